"""The open-file limit (daemon/open_files.py): a daemon raises its soft limit to the hard one at
start, and warns (with a metric) when accepted connections come near it; past it, it keeps
serving once descriptors are free again. Real daemons under ``prlimit``."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from typing import Any

from radixd_client import Client

from daemon.open_files import NearLimit

from .conftest import REPO
from .test_tiers import admin_get


def _metric(d: Any, name: str) -> float:
    text = admin_get(d, "/metrics").decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


def _limit(soft: int, hard: int) -> tuple[str, ...]:
    return ("prlimit", f"--nofile={soft}:{hard}", "--")


def test_the_soft_limit_is_raised_to_the_hard_one_at_start(make_daemon) -> None:
    d = make_daemon(launcher=_limit(256, 4096))
    assert "open files limit raised from 256 to 4096" in d.log()
    assert _metric(d, "radixd_max_fds") == 4096
    assert 0 < _metric(d, "radixd_open_fds") < 4096


def test_connections_near_the_limit_warn_once_and_the_daemon_serves_after(make_daemon) -> None:
    """With 256 descriptors allowed (the small test model's segments take about 170), 160 raw
    connections: those accepted past descriptor 229 count, and one warning says what to raise;
    libuv resets the ones past the limit. Once they close, a client is served and the tree is
    intact (the fixture's check)."""
    d = make_daemon(launcher=_limit(256, 256))
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
    warnings = re.findall(r"at least (\d+) of the 256 files this process may open are open", log)
    assert len(warnings) == 1, log[-3000:]
    assert 230 < int(warnings[0]) <= 256
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


def test_near_limit_counts_every_connection_past_the_threshold_and_warns_once_a_minute(
        caplog) -> None:
    now = [0.0]
    near = NearLimit(100, clock=lambda: now[0])
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
