"""bench/check_steps_bench.py: the background check's steps on a wide tree, this checkout
against a baseline ref. Bad values are a usage error naming the option before anything is
exported; a short run against HEAD gives every figure of both sides with their ratio; a worker
that imported another tree's daemon is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import check_steps_bench as csb


@pytest.mark.parametrize(("argv", "option"), [
    (["--roots", "0"], "--roots"), (["--locks", "-1"], "--locks"), (["--passes", "0"], "--passes"),
    (["--rounds", "0"], "--rounds"), (["--rounds", "x"], "--rounds"), (["--cpu", "9999"], "--cpu")])
def test_bad_values_are_a_usage_error_naming_the_option(
        argv: list[str], option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        csb.main(["--baseline", "HEAD", *argv])
    assert exc.value.code == 2
    assert option in capsys.readouterr().err.splitlines()[-1]


def test_a_worker_that_runs_another_trees_daemon_is_refused(tmp_path: Path) -> None:
    (tmp_path / "clients" / "python").mkdir(parents=True)
    with pytest.raises(RuntimeError, match="another tree's daemon"):
        csb.run_side(str(tmp_path), 4, 2, 1, None)


def test_a_run_against_head_gives_every_figure_of_both_sides(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figures.json"
    csb.main(["--baseline", "HEAD", "--roots", "60", "--locks", "30", "--passes", "2",
              "--rounds", "1", "--json", str(out)])
    figures = json.loads(out.read_text())
    for name in (*csb.FIGURES, "steps"):
        base, this = figures[f"{name}_base"], figures[f"{name}_this"]
        assert base > 0 and this > 0
        assert figures[f"{name}_ratio"] == pytest.approx(this / base)
    # a step is a small part of a pass over 121 nodes and 30 locks
    assert figures["steps_this"] > 121
    assert figures["longest_step_ms_this"] <= figures["pass_ms_this"]
    assert "longest_step_ms" in capsys.readouterr().out
