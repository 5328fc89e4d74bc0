"""bench/cli_bench.py: both sides answer, the figures are measured (not zero) and their ratio is
the one printed; a bad argument is a usage error."""

from __future__ import annotations

import pytest

from bench import cli_bench


def test_both_sides_answer_and_the_ratio_is_theirs(capsys: pytest.CaptureFixture[str]) -> None:
    f = cli_bench.main(["--baseline", "HEAD", "--runs", "1"])
    assert f["status_s_base"] > 0 and f["status_s_this"] > 0
    assert f["status_s_ratio"] == f["status_s_this"] / f["status_s_base"]
    assert f"this/base: {f['status_s_ratio']:.3f}" in capsys.readouterr().out


def test_zero_runs_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as stopped:
        cli_bench.main(["--runs", "0"])
    assert stopped.value.code == 2
