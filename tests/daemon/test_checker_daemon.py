"""The background check of a real daemon runs in steps between requests and still stops a strict
daemon on a real violation, confirmed by a complete check (daemon/checker.py)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from array import array
from pathlib import Path

import pytest
from radixd_client import Client

from . import conftest as conf

LAUNCHER = (sys.executable, str(Path(__file__).with_name("fault_launcher.py")))
TOKENS = array("i", range(1, 3 * 4 + 1)).tobytes()  # three pages of the small model


def _cache(d: conf.Daemon, models: tuple[str, ...] = ("m",)) -> None:
    """TOKENS cached in each of ``models``, as an engine after a prefill."""
    with Client(d.socket, client_name="t") as c:
        for model in models:
            a = c.alloc(model, 3)
            c.insert(model, TOKENS, a.full_pages, a.swa_pages)


def _plant(d: conf.Daemon) -> None:
    """SIGUSR2 (tests/daemon/fault_launcher.py), once the fault is planted."""
    d.proc.send_signal(signal.SIGUSR2)
    _wait_for_log(d, "fault planted")


def _serve_plant_and_stop(d: conf.Daemon, models: tuple[str, ...] = ("m",)) -> str:
    """TOKENS cached in ``models`` (clean by a complete check), a fault planted, a complete check
    (a pin is no violation while serving), then the stop; returns the log of a daemon that exited
    0."""
    try:
        _cache(d, models)
        d.check()
        _plant(d)
        d.check()
    finally:
        code = d.stop()
    log = d.log()
    assert code == 0, log[-3000:]
    return log


def _wait_for_log(d: conf.Daemon, text: str) -> None:
    deadline = time.monotonic() + 10
    while text not in d.log():
        assert time.monotonic() < deadline, d.log()[-3000:]
        time.sleep(0.02)


def test_a_violation_planted_in_a_serving_daemon_is_found_in_steps_and_stops_it(
        tmp_path: Path) -> None:
    """A strict daemon serving requests: a lock no receipt accounts for is planted (SIGUSR2,
    tests/daemon/fault_launcher.py). A stepped background pass finds it, the complete check
    confirms it, and the daemon logs it and stops with exit code 3."""
    d = conf.Daemon(tmp_path, {"checker": {"interval_s": 0.05, "strict": True}},
                    launcher=LAUNCHER)
    try:
        with Client(d.socket, client_name="t") as c:
            for i in range(6):
                t = array("i", range(i * 100, i * 100 + 3 * 4)).tobytes()
                a = c.alloc("m", 3)
                c.insert("m", t, a.full_pages, a.swa_pages)
            c.match("m", t)
        d.check()  # clean so far: a complete check says so
        d.proc.send_signal(signal.SIGUSR2)
        code = d.proc.wait(30)
        log = d.log()
        assert code == 3, log[-3000:]
        assert "fault planted" in log
        assert "the stepped check found" in log, log[-3000:]
        assert "receipts account for" in log and "strict mode: stopping" in log, log[-3000:]
    finally:
        d.stop()


def test_a_pin_left_by_no_job_is_reported_by_the_stops_check_at_rest(tmp_path: Path) -> None:
    """A pin that no tier job will ever take back (planted: tests/daemon/fault_launcher.py) keeps
    its pages from eviction for good, and no check while serving can tell it from a fetch's:
    the stop, once every session and job has ended, reports it."""
    d = conf.Daemon(tmp_path, {}, launcher=LAUNCHER, env={"FAULT_KIND": "pin"})
    log = _serve_plant_and_stop(d)
    assert "pinned by no job" in log
    assert "invariant violations at shutdown" in log, log[-3000:]
    assert "m: 1 tree pins left with no session or job" in log, log[-3000:]


@pytest.mark.parametrize("fault", ["drain", "check"])
def test_a_stop_that_fails_to_drain_or_check_still_closes_and_blames_no_leak(
        tmp_path: Path, fault: str) -> None:
    """The stop's drain of the tiers raises (a tier job may then still hold its pin: planted
    here), or the check at rest raises: either is logged, the check at rest reports no leak it
    cannot tell from a job still running, and the daemon still closes its pools and exits 0."""
    d = conf.Daemon(tmp_path, {}, launcher=LAUNCHER, env={"FAULT_KIND": "pin",
                                                          "FAULT_STOP": fault})
    try:
        with Client(d.socket, client_name="t") as c:
            t = array("i", range(1, 3 * 4 + 1)).tobytes()
            a = c.alloc("m", 3)
            c.insert("m", t, a.full_pages, a.swa_pages)
        d.check()
    finally:
        code = d.stop()
    log = d.log()
    assert code == 0, log[-3000:]
    assert f"fault planted: the {'drain' if fault == 'drain' else 'check at rest'} failed" in log
    assert ("stopping the memory tiers" if fault == "drain"
            else "checking the cache at shutdown") in log, log[-3000:]
    assert "left with no session or job" not in log, log[-3000:]
    assert "invariant violations at shutdown" not in log, log[-3000:]
    assert log.rstrip().endswith("stopped"), log[-3000:]


def test_a_model_whose_drain_failed_is_left_out_of_the_check_at_rest_and_no_other(
        tmp_path: Path) -> None:
    """Two models; at the stop, model m's drain raises after pinning a node of m (a job the
    failed drain may have left running), while a pin that no job will take back was planted in
    model m2 as it served. The stop still drains m2 (with a state directory, its device-only
    pages are copied to host), leaves m out of the check at rest with a line that says so,
    reports m2's pin, and saves no host state: one model's failed drain does not hide
    another's leak, nor does a warm restart adopt slots a job may still fill."""
    m2 = {**conf.SMALL_MODEL, "name": "m2", "write_policy": "write_back"}
    d = conf.Daemon(tmp_path, {"models": [conf.SMALL_MODEL, m2],
                               "server": {"state_dir": str(tmp_path / "state")}},
                    launcher=LAUNCHER,
                    env={"FAULT_KIND": "pin", "FAULT_MODEL": "m2", "FAULT_STOP": "drain_of_m"})
    log = _serve_plant_and_stop(d, ("m", "m2"))
    assert "fault planted: the drain of model m failed" in log, log[-3000:]
    assert "stopping the memory tiers of model 'm'" in log, log[-3000:]
    assert "the check at rest leaves out 'm':" in log, log[-3000:]
    assert "m2: 1 tree pins left with no session or job" in log, log[-3000:]
    assert "m: 1 tree pins left" not in log, log[-3000:]
    assert "model 'm2': the tree's host pages grew by 3 in the stop's drain" in log, log[-3000:]
    assert "warm restart: model 'm':" not in log, log[-3000:]
    assert "host state not saved for a warm restart: the drain of 'm' failed" in log
    assert not (tmp_path / "state" / "host-index.bin").exists()
    assert log.rstrip().endswith("stopped"), log[-3000:]


def test_a_failed_save_of_the_host_state_is_logged_and_the_stop_still_checks_at_rest(
        tmp_path: Path) -> None:
    """The save of the host state for a warm restart fails (a full disk, planted): the stop logs
    it, still runs the check at rest for every model, since the drains succeeded (it reports a
    pin planted while serving that no job will take back), closes the pools and exits 0; no
    index is left for the next start, which is cold."""
    state = tmp_path / "state"
    d = conf.Daemon(tmp_path, {"server": {"state_dir": str(state)}}, launcher=LAUNCHER,
                    env={"FAULT_KIND": "pin", "FAULT_STOP": "save"})
    log = _serve_plant_and_stop(d)
    assert "saving the host state for a warm restart" in log, log[-3000:]
    assert "fault planted: the save failed" in log, log[-3000:]
    assert "stopping the memory tiers" not in log and "leaves out" not in log, log[-3000:]
    assert "m: 1 tree pins left with no session or job" in log, log[-3000:]
    assert not (state / "host-index.bin").exists()
    assert log.rstrip().endswith("stopped"), log[-3000:]


def test_a_load_that_never_ends_leaves_its_model_alone_out_of_the_check_at_rest(
        tmp_path: Path) -> None:
    """A load of model m hangs at the stop after pinning a node of m (planted), and a pin that
    no job will take back was planted in model m2. The stop waits for the load up to its drain
    budget, then leaves m alone out of the check at rest, and reports m2's pin."""
    m2 = {**conf.SMALL_MODEL, "name": "m2"}
    d = conf.Daemon(tmp_path, {"models": [conf.SMALL_MODEL, m2], "l3": {"drain_timeout_s": 0.5}},
                    launcher=LAUNCHER,
                    env={"FAULT_KIND": "pin", "FAULT_MODEL": "m2", "FAULT_LOAD": "hang"})
    hung = Client(d.socket, client_name="hung", timeout=30)
    try:
        _cache(d, ("m", "m2"))
        _plant(d)  # in m2
        threading.Thread(target=_load_ignoring_the_stop, args=(hung,), daemon=True).start()
        _wait_for_log(d, "a load of model m that never ends")
    finally:
        code = d.stop()
        hung.close()
    log = d.log()
    assert code == 0, log[-3000:]
    assert "the check at rest leaves out 'm':" in log, log[-3000:]
    assert "m2: 1 tree pins left with no session or job" in log, log[-3000:]
    assert "m: 1 tree pins left" not in log, log[-3000:]


def _load_ignoring_the_stop(c: Client) -> None:
    with contextlib.suppress(Exception):  # the stop ends the connection: no answer comes
        c.load("m", TOKENS)


def test_requests_flow_while_stepped_passes_run(make_daemon) -> None:
    """Passes back to back (interval 1 ms) while a client inserts and matches: every request is
    answered, no pass reports anything, and the teardown's complete check is clean."""
    d = make_daemon({"checker": {"interval_s": 0.001, "strict": True}})
    with Client(d.socket, client_name="t") as c:
        deadline = time.monotonic() + 1.0
        i = 0
        while time.monotonic() < deadline:
            t = array("i", range(i % 7 * 50, i % 7 * 50 + 8)).tobytes()
            m = c.match("m", t, lock=True)
            if m.prefix_len < 8:
                a = c.alloc("m", 2 - m.prefix_len // 4)
                c.cache_finished("m", t, a.full_pages, a.swa_pages, m.prefix_len, 0,
                                 m.receipt)
            elif m.receipt is not None:
                c.unlock("m", m.receipt)
            i += 1
    assert "the stepped check found" not in d.log()
