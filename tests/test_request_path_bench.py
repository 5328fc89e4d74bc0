"""bench/request_path_bench.py: the daemon's request path fed frames without a socket, this
checkout against a baseline ref. Bad counts are a usage error before anything is exported; a
short run against HEAD answers every operation of the workload (a refusal would stop it) and
prints each figure of both sides with their ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import request_path_bench as rpb


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--requests-rounds", "0"],
                                  ["--rounds", "x"], ["--cpu", "9999"]])
def test_counts_below_one_are_a_usage_error(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        rpb.main(["--baseline", "HEAD", *argv])
    assert exc.value.code == 2
    assert "--" in capsys.readouterr().err


def test_a_run_against_head_gives_every_operation_on_both_sides(tmp_path: Path, capsys) -> None:
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
