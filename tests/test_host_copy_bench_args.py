"""bench/host_copy_bench.py's --page-size: a size it has no batch shape for is a usage error
naming the option, before any pool is made."""

from __future__ import annotations

import pytest

from bench import host_copy_bench


@pytest.mark.parametrize("size", ["0", "-16", "3", "2048", "x"])
def test_a_page_size_that_does_not_divide_the_batch_is_a_usage_error(size, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        host_copy_bench.main(["--quick", "--page-size", size])
    assert exc.value.code == 2
    assert "--page-size" in capsys.readouterr().err
