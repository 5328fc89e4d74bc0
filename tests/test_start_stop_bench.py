"""bench/start_stop_bench.py: both daemons start and stop, the figures are measured (not zero),
the pool sizes are rounded to what segments need, and bad arguments are usage errors."""

from __future__ import annotations

import os
import subprocess

import pytest

from bench import start_stop_bench
from tests.harness import REPO


def test_small_pools_start_and_stop_on_both_sides() -> None:
    f = start_stop_bench.main(["--baseline", "HEAD", "--pages", "3000", "--rounds", "1"])
    for name in ("ready_s", "rss_mib", "stop_s"):
        assert f[f"{name}_base"] > 0 and f[f"{name}_this"] > 0
        assert f[f"{name}_ratio"] == f[f"{name}_this"] / f[f"{name}_base"]


def test_pool_sizes_are_rounded_up_to_whole_segments() -> None:
    text = start_stop_bench.config(3000)
    assert "full_pages = 3072" in text and "swa_pages = 512" in text


@pytest.mark.parametrize("argv", [["--pages", "0"], ["--rounds", "0"]])
def test_bad_arguments_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        start_stop_bench.main(argv)
    assert stopped.value.code == 2


def test_a_daemon_that_does_not_stop_in_time_is_killed_and_its_directory_removed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    started = []
    real = start_stop_bench.DaemonProcess

    def keep(*args: object, **kw: object) -> object:
        d = real(*args, **kw)
        started.append(d)
        return d

    monkeypatch.setattr(start_stop_bench, "DaemonProcess", keep)
    monkeypatch.setattr(start_stop_bench, "STOP_WAIT_S", 0)  # no daemon stops in no time
    with pytest.raises(subprocess.TimeoutExpired):
        start_stop_bench.measure(str(REPO), 3000)
    (d,) = started
    assert d.proc.poll() is not None and not os.path.exists(d.dir)
