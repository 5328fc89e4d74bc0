"""``radixd bench soak`` for two minutes: clients, Redis and the daemon itself killed or restarted
under load, every hit verified (tree pages, and keyed pages also against the clients' clears),
and nothing mismatched, stale, violated or leaked at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from radixd_bench.soak_keyed import SHARED_EPOCH, KeyedOptions, KeyedSoak, keyed_page
from radixd_bench.soak_worker import PageVerifier, expected_values

REPO = Path(__file__).resolve().parents[2]


def test_the_page_check_catches_one_wrong_value() -> None:
    """The soak's verdict is only as good as its comparison: one value off in one page of a
    pool is one mismatched page."""
    P, tokens = 4, [5, 9, 2, 7, 1, 3, 8, 6]

    class Pools:
        t = torch.zeros(2, 2, 4, P, 1, 8)

        def pool(self, kind: str) -> torch.Tensor:
            return self.t

    pages = PageVerifier(Pools(), P)
    table = [2, 3]
    pages.write("full", table, tokens, 0, 8)
    assert Pools.t[0, 1, 3, 1, 0, 5].item() == expected_values(tokens, 0, 8)[5]
    assert pages.verify("full", table, tokens, 0, 8) == (2, 0)
    Pools.t[1, 0, 3, 2, 0, 7] += 1
    assert pages.verify("full", table, tokens, 0, 8) == (2, 1)
    Pools.t[1, 0, 3, 2, 0, 7] -= 1
    # another last token: the values of its page (not of the page before) change
    assert pages.verify("full", table, [*tokens[:7], 4], 0, 8) == (2, 1)


class _Cleared:
    """What a ``kv_clear`` answers, as far as the keyed check reads it."""

    def __init__(self, l3_cleared: bool | None) -> None:
        self.removed = 0
        self.l3_cleared = l3_cleared


class _Clears:
    """A session whose next ``kv_clear`` answers ``l3_cleared`` as told, or is cut (None)."""

    def __init__(self) -> None:
        self.answer: _Cleared | None = None

    def kv_clear(self, model: str) -> _Cleared:
        if self.answer is None:
            raise ConnectionError("cut")
        return self.answer


def test_the_keyed_check_tells_verified_mismatched_and_stale_pages_apart() -> None:
    """A keyed page says which epoch it claims; the check accepts only this key's page of an
    epoch it was written at, and calls an intact page of before an answered clear stale (Redis
    told or not), of before one whose answer never came tolerated, until a later clear is
    answered."""
    import random

    nbytes = 256
    kv = KeyedSoak("m", "a", "t", KeyedOptions(), random.Random(0))
    k, other = kv.key("full", 1), kv.key("full", 2)
    kv.written[("full", k)] = {0: None}
    kv.written[("full", other)] = {0: None}
    page = keyed_page("a", "full", k, 0, nbytes)
    assert kv.classify("full", k, page.clone()) == "verified"
    # any byte off, another key's page, another namespace's or kind's, a slot never written
    for i in (0, 4, 12, nbytes - 1):
        bad = page.clone()
        bad[i] ^= 1
        assert kv.classify("full", k, bad) == "mismatch", i
    assert kv.classify("full", k, keyed_page("a", "full", other, 0, nbytes)) == "mismatch"
    assert kv.classify("full", k, keyed_page("b", "full", k, 0, nbytes)) == "mismatch"
    kv.written[("swa", k)] = {0: None}
    assert kv.classify("swa", k, page.clone()) == "mismatch"
    assert kv.classify("full", k, torch.zeros(nbytes, dtype=torch.uint8)) == "mismatch"
    # an intact page of an epoch the key was never written at is not this key's page either
    assert kv.classify("full", k, keyed_page("a", "full", k, 1, nbytes)) == "mismatch"

    session = _Clears()
    counts = {"keyed_clears": 0, "keyed_clears_confirmed": 0}
    with pytest.raises(ConnectionError):  # no answer: it may not have reached the daemon, so
        kv.clear(session, counts)  # the old page may come back; the epoch moves on
    assert (kv.epoch, kv.floor) == (1, 0)
    assert kv.classify("full", k, page.clone()) == "unconfirmed"
    session.answer = _Cleared(False)  # answered, Redis not told yet: nothing of before is
    kv.clear(session, counts)  # served again all the same (protocol.md 9.4)
    assert (kv.epoch, kv.floor) == (2, 2)
    assert kv.classify("full", k, page.clone()) == "stale"
    kv.written[("full", k)][2] = None
    newer = keyed_page("a", "full", k, 2, nbytes)
    assert kv.classify("full", k, newer.clone()) == "verified"
    session.answer = _Cleared(True)
    kv.clear(session, counts)
    assert (kv.epoch, kv.floor) == (3, 3) and counts == {"keyed_clears": 3,
                                                         "keyed_clears_confirmed": 1}
    assert kv.classify("full", k, page.clone()) == "stale"
    assert kv.classify("full", k, newer.clone()) == "stale"
    bad = newer.clone()
    bad[100] ^= 1
    assert kv.classify("full", k, bad) == "mismatch"  # wrong bytes are a mismatch, never stale
    # a shared key's page is the namespace's, whatever the epoch: another tenant's is a mismatch
    shared = kv.shared_key("full", 0)
    mine = keyed_page("a", "full", shared, SHARED_EPOCH, nbytes)
    assert kv.classify_shared("full", shared, mine.clone()) == "shared"
    assert kv.classify_shared("full", shared,
                              keyed_page("b", "full", shared, SHARED_EPOCH, nbytes)) == "mismatch"
    mine[7] ^= 1
    assert kv.classify_shared("full", shared, mine) == "mismatch"


@pytest.mark.soak
def test_a_two_minute_soak_has_no_mismatch_violation_or_leak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "bench", "soak", "--duration", "120",
         "--kill-every", "15", "--redis-kill-every", "30", "--restart-at", "60",
         "--workdir", str(tmp_path / "work"), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=500)
    assert out.exists(), proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    summary = proc.stdout + proc.stderr
    assert r["mismatches"] == 0, summary
    assert r["keyed_mismatches"] == 0 and r["keyed_stale"] == 0, summary
    assert r["violations"] == [], summary
    assert r["leaked_pages"] == 0 and r["leaked_keyed_pins"] == 0, summary
    assert r["client_crashes"] == 0 and r["final_exit_code"] == 0, summary
    assert proc.returncode == 0, summary
    assert r["verified_pages"] > 100, summary  # hits happened and were read back
    assert r["client_kills"] >= 4 and r["redis_kills"] >= 2 and r["daemon_restarts"] == 1
    assert r["restart"]["old_exit_code"] == 0, summary
    assert r["restart"]["host_pages_kept"] > 0, summary  # the warm restart kept the host tier
    assert r["requests"] > 100, summary
    # keyed pages were stored, served and read back, some of them from Redis and some written
    # before the daemon restart; clears were answered (each raises the floor the stale check
    # reads), and Redis confirmed some
    assert r["keyed_stored"] > 500 and r["keyed_verified"] > 500, summary
    assert r["keyed_fetched"] > 0 and r["keyed_verified_after_restart"] > 0, summary
    assert r["keyed_clears_confirmed"] >= 3 and r["keyed_stale_checks"] > 100, summary
    assert r["keyed_shared_verified"] > 100, summary  # both tenants' pages of the same keys


def _session_members(sid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    fields = fh.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # session id; zombies are gone
                out.append(int(name))
    return out


@pytest.mark.soak
def test_a_soak_stopped_by_sigterm_leaves_no_process_behind(tmp_path: Path) -> None:
    """An operator's kill (or a CI timeout) ends the soak's clients, Redis and daemon too."""
    work = tmp_path / "work"
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli", "bench", "soak", "--duration", "600",
         "--clients", "2", "--restart-at", "-1", "--workdir", str(work)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (work / "radixd.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # clients started and running requests
        assert (work / "radixd.sock").exists() and len(_session_members(proc.pid)) >= 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while _session_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _session_members(proc.pid) == []
    finally:
        for pid in _session_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
