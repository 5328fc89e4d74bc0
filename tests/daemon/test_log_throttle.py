"""LogThrottle: the one rate limit of the daemon's flood-prone warnings (failed hellos,
connections past the open-files threshold, refused admin connections)."""

from __future__ import annotations

from daemon.log_throttle import LogThrottle


def test_one_line_per_interval_and_the_count_of_those_held_back() -> None:
    now = [100.0]
    t = LogThrottle(5.0, clock=lambda: now[0])
    assert t.due()  # the first event always goes out
    assert [t.due() for _ in range(3)] == [False] * 3
    now[0] = 104.9
    assert not t.due() and t.held_back == 4
    now[0] = 105.0
    assert t.due()
    assert t.take_held_back() == 4 and t.held_back == 0
    assert not t.due() and t.take_held_back() == 1


def test_the_interval_runs_from_the_last_line_that_went_out() -> None:
    now = [0.0]
    t = LogThrottle(60, clock=lambda: now[0])
    assert t.due()
    now[0] = 59.0
    assert not t.due()  # held back: does not restart the interval
    now[0] = 60.0
    assert t.due()
    now[0] = 119.0
    assert not t.due()
