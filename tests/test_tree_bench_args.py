"""bench/tree_bench.py's comparison options refuse what they cannot run, naming the option,
before anything is exported or measured."""

from __future__ import annotations

import pytest

from bench import tree_bench


@pytest.mark.parametrize("sizes", ["7", "1,32", "x"])
def test_page_sizes_it_has_no_workload_for_are_a_usage_error(sizes, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        tree_bench.main(["--baseline", "HEAD", "--page-sizes", sizes])
    assert exc.value.code == 2
    assert "--page-sizes" in capsys.readouterr().err
