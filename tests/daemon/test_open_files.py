"""The open-file limit (daemon/open_files.py): a daemon raises its soft limit to the hard one at
start, and warns (with a metric) when accepted connections come near it; past it, it keeps
serving once descriptors are free again. Real daemons under ``prlimit``."""

from __future__ import annotations

import re
import resource
import socket
import subprocess
import sys
import time
from typing import Any

from radixd_client import Client

from daemon.open_files import NearLimit, raise_soft_limit

from .conftest import REPO, SMALL_MODEL
from .test_tiers import admin_get

#: the test model without segments or a host tier: about 22 descriptors open once it serves,
#: whatever the pools' sizes (one memfd per pool)
FEW_FDS = {"models": [{**SMALL_MODEL, "memory_isolation": "none", "host_pages": 0,
                       "host_swa_pages": 0}]}
#: a hard limit this process may give its children (CI runs as root; a user's may be lower)
HARD = min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])


def _metric(d: Any, name: str) -> float:
    text = admin_get(d, "/metrics").decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


def _limit(soft: int, hard: int) -> tuple[str, ...]:
    return ("prlimit", f"--nofile={soft}:{hard}", "--")


def test_the_soft_limit_is_raised_to_the_hard_one_at_start(make_daemon) -> None:
    d = make_daemon(FEW_FDS, launcher=_limit(64, HARD))
    assert f"open files limit raised from 64 to {HARD}" in d.log()
    assert _metric(d, "radixd_max_fds") == HARD
    assert 0 < _metric(d, "radixd_open_fds") < 64


def test_connections_near_the_limit_warn_once_and_the_daemon_serves_after(make_daemon) -> None:
    """With 64 descriptors allowed (the model takes about 22), 160 raw connections: those
    accepted past descriptor 56 count, and one warning says what to raise; libuv resets the ones
    past the limit. Once they close, a client is served and the tree is intact (the fixture's
    check)."""
    d = make_daemon(FEW_FDS, launcher=_limit(64, 64))
    assert "open files limit raised" not in d.log()
    held = []
    for _ in range(160):
        s = socket.socket(socket.AF_UNIX)
        s.connect(d.socket)  # (the listen backlog takes it even when accept cannot)
        held.append(s)
    deadline = time.monotonic() + 10
    while "files this process may open are open" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    for s in held:
        s.close()
    log = d.log()
    warnings = re.findall(r"at least (\d+) of the 64 files this process may open are open", log)
    assert len(warnings) == 1, log[-3000:]
    assert 57 < int(warnings[0]) <= 64
    assert "LimitNOFILE=" in log
    seen = wait_for_metric(d, "radixd_connections_near_fd_limit_total")
    assert seen >= 1
    with Client(d.socket) as c:
        assert c.ping(b"after").payload == b"after"


def wait_for_metric(d: Any, name: str) -> float:
    deadline = time.monotonic() + 10
    while True:
        try:
            return _metric(d, name)
        except OSError:  # the admin endpoint may still be out of descriptors
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_raise_soft_limit_stops_at_the_hard_limit_or_the_cap() -> None:
    code = ("import sys; from daemon.open_files import raise_soft_limit; "
            "print(*raise_soft_limit(int(sys.argv[1])))")
    for soft, hard, most, want in ((100, 200, 1 << 20, "100 200"), (100, 200, 150, "100 150"),
                                   (200, 200, 1 << 20, "200 200"), (300, 400, 250, "300 300")):
        got = subprocess.run([*_limit(soft, hard), sys.executable, "-c", code, str(most)],
                             capture_output=True, text=True, cwd=REPO, check=True)
        assert got.stdout.split() == want.split(), (soft, hard, most, got.stderr)


def test_raise_soft_limit_when_the_hard_limit_is_unlimited_or_refused(monkeypatch) -> None:
    """The two cases a Linux runner cannot set up: an unlimited hard limit (the cap is asked
    for) and a setrlimit the kernel refuses (the limit stays)."""
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, resource.RLIM_INFINITY))
    monkeypatch.setattr(resource, "setrlimit", lambda _, lim: asked.append(lim))
    assert raise_soft_limit(most=5000) == (1024, 5000)
    assert asked == [(5000, resource.RLIM_INFINITY)]

    def refuse(_: int, __: tuple[int, int]) -> None:
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    assert raise_soft_limit(most=5000) == (1024, 1024)


def test_near_limit_counts_every_connection_past_the_threshold_and_warns_once_a_minute(
        caplog) -> None:
    now = [0.0]
    limit = [100]
    near = NearLimit(lambda: limit[0], clock=lambda: now[0])
    for fd in (5, 89):
        near.accepted(fd)
    assert near.seen == 0 and not caplog.records
    for fd, t in ((90, 0.0), (95, 30.0), (99, 59.9), (91, 60.0)):
        now[0] = t
        near.accepted(fd)
    assert near.seen == 4
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "at least 91 of the 100 files this process may open are open",
        "at least 92 of the 100 files this process may open are open"]
    limit[0] = 1000  # raised live: the next connection past the old threshold reads it again
    now[0] = 200.0
    near.accepted(95)
    assert (near.seen, near.threshold, len(caplog.records)) == (4, 900, 2)
