"""bench/gc_pause_bench.py: the garbage collector's pauses under tree churn. Bad values are a
usage error naming the option; a short run with other thresholds gives every figure of both
sides and their ratios, the cache consistent after the churn (the worker checks it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gc_pause_bench as gpb


@pytest.mark.parametrize(("argv", "option"), [
    (["--pages", "10"], "--pages"), (["--ops", "0"], "--ops"), (["--rounds", "0"], "--rounds"),
    (["--thresholds", "1,2"], "--thresholds"), (["--thresholds", "0,1,1"], "--thresholds"),
    (["--thresholds", "a,b,c"], "--thresholds"), (["--cpu", "9999"], "--cpu")])
def test_bad_values_are_a_usage_error_naming_the_option(
        argv: list[str], option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gpb.main(argv)
    assert exc.value.code == 2
    assert option in capsys.readouterr().err.splitlines()[-1]


def test_a_short_run_gives_every_figure_of_both_sides(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figures.json"
    # thresholds of 1: a collection after every new container, so both sides see collections
    gpb.main(["--pages", "400", "--ops", "400", "--rounds", "1", "--thresholds", "1,1,1",
              "--json", str(out)])
    figures = json.loads(out.read_text())
    for side in ("daemon", "other"):
        assert figures[f"requests_per_s_{side}"] > 0
        assert figures[f"nodes_{side}"] > 0
        assert 0 < figures[f"insert_p50_us_{side}"] <= figures[f"insert_max_ms_{side}"] * 1e3
    assert figures["gen0_collections_other"] > figures["gen0_collections_daemon"]
    assert figures["gen0_longest_ms_other"] > 0
    assert figures["requests_per_s_other_ratio"] == pytest.approx(
        figures["requests_per_s_other"] / figures["requests_per_s_daemon"])
    assert "gen2_longest_ms" in capsys.readouterr().out
