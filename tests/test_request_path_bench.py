"""bench/request_path_bench.py: the daemon's request path fed frames without a socket, this
checkout against a baseline ref. Bad counts are a usage error before anything is exported; a
short run against HEAD answers every operation of the workload (a refusal would stop it) and
prints each figure of both sides with their ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import request_path_bench as rpb


@pytest.mark.parametrize(("argv", "option"), [
    (["--rounds", "0"], "--rounds"), (["--requests-rounds", "0"], "--requests-rounds"),
    (["--rounds", "x"], "--rounds"), (["--cpu", "9999"], "--cpu")])
def test_bad_counts_and_cpus_are_a_usage_error_naming_the_option(
        argv: list[str], option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        rpb.main(["--baseline", "HEAD", *argv])
    assert exc.value.code == 2
    assert option in capsys.readouterr().err.splitlines()[-1]  # the error line, not the usage


def test_a_worker_that_runs_another_trees_daemon_is_refused(tmp_path: Path) -> None:
    """The baseline's figures must be the baseline's: a worker asked for one tree whose daemon
    came from another (here: a tree without the daemon, so this checkout's is imported) is an
    error, not a figure."""
    (tmp_path / "clients" / "python").mkdir(parents=True)
    with pytest.raises(RuntimeError, match="ran the daemon of"):
        rpb.run_side(str(tmp_path), 1, None)


def test_a_run_against_head_gives_every_operation_on_both_sides(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figures.json"
    assert rpb.main(["--baseline", "HEAD", "--rounds", "1", "--requests-rounds", "1",
                     "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    for op in (*rpb.OPS, "mixed"):
        base, this = figures[f"{op}_p50_us_base"], figures[f"{op}_p50_us_this"]
        assert base > 0 and this > 0
        assert figures[f"{op}_p50_ratio"] == pytest.approx(this / base, rel=0.02)
        assert figures[f"{op}_mean_us_this"] > 0
    # the mixed operation is one engine request's three operations, averaged
    assert figures["mixed_p50_us_this"] == pytest.approx(
        sum(figures[f"{op}_p50_us_this"] for op in rpb.MIXED) / 3, rel=0.01)
    # a full hit matches a cached prefix: the match costs more than the bare path (ping)
    assert figures["match_p50_us_this"] > figures["ping_p50_us_this"]
    assert "cache_finished" in capsys.readouterr().out
