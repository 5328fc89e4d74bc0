"""bench/alloc_bench.py: the baseline's modules are really the baseline's (a ref before the run
order fix shows its short copy blocks), this checkout's modules stay the ones the process uses,
and the same code on both sides gives the same deterministic churn figures."""

from __future__ import annotations

import sys

import pytest

import daemon.gpu.segments as segments
from bench import alloc_bench


def test_the_same_code_on_both_sides_gives_the_same_churn_figures() -> None:
    f = alloc_bench.run("HEAD", quick=True)
    for label, _, _ in alloc_bench.CHURN_POOLS:
        assert f[f"pages_per_block_{label}_ratio"] == 1.0
    assert all(v > 0 for v in f.values())
    assert sys.modules["daemon.gpu.segments"] is segments


def test_a_baseline_before_the_run_order_fix_is_measured_as_that_code() -> None:
    # aa8562f: frees pushed as given, so recycled runs came back reversed (a page or two a block)
    f = alloc_bench.run("aa8562f", quick=True)
    for label, _, _ in alloc_bench.CHURN_POOLS:
        assert f[f"pages_per_block_{label}_base"] < 3
        assert f[f"pages_per_block_{label}_this"] > 8
    assert sys.modules["daemon.gpu.segments"] is segments


def test_a_baseline_git_does_not_know_is_a_usage_error(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    with pytest.raises(SystemExit) as stopped:
        alloc_bench.main(["--baseline", "no-such-ref-anywhere", "--quick"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "cannot export the baseline 'no-such-ref-anywhere'" in err and "Traceback" not in err
