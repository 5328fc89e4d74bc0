"""bench/deep_locks_bench.py: both ways of ending a session leave a clean cache and the check
finds nothing wrong (the bench checks each round), and its options refuse nonsense before
building anything."""

from __future__ import annotations

import pytest

from bench import deep_locks_bench


def test_both_ways_release_every_lock_and_the_figures_come_out() -> None:
    f = deep_locks_bench.main(["--depth", "40", "--locks", "60", "--anchors", "7", "--rounds", "2"])
    assert set(f) == {"one_at_a_time_ms", "in_one_pass_ms", "check_step_locked_ms",
                      "check_step_unlocked_ms", "check_locked_ms", "check_unlocked_ms",
                      "session_end_ratio", "check_step_ratio", "check_ratio"}
    assert all(v > 0 for v in f.values())


@pytest.mark.parametrize("opt", ["--depth", "--locks", "--anchors", "--rounds"])
def test_a_count_below_one_is_a_usage_error(opt, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        deep_locks_bench.main([opt, "0"])
    assert exc.value.code == 2
    assert opt in capsys.readouterr().err


def test_more_anchors_than_the_path_has_nodes_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        deep_locks_bench.main(["--depth", "10", "--locks", "100", "--anchors", "11"])
    assert exc.value.code == 2
    assert "--anchors" in capsys.readouterr().err
