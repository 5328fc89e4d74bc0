"""bench/session_end_bench.py: both ways of ending a session leave a clean cache (the bench
checks each round), and its options refuse nonsense before building anything."""

from __future__ import annotations

import pytest

from bench import session_end_bench


def test_both_ways_release_every_lock_and_the_figures_come_out() -> None:
    f = session_end_bench.main(["--depth", "40", "--locks", "60", "--rounds", "2"])
    assert set(f) == {"one_at_a_time_ms", "in_one_pass_ms", "ratio"}
    assert f["one_at_a_time_ms"] > 0 and f["in_one_pass_ms"] > 0


@pytest.mark.parametrize("opt", ["--depth", "--locks", "--rounds"])
def test_a_count_below_one_is_a_usage_error(opt, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        session_end_bench.main([opt, "0"])
    assert exc.value.code == 2
    assert opt in capsys.readouterr().err
