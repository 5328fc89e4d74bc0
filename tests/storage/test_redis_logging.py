"""What the log says about the Redis tier, through a real daemon and a real redis-server.

docs/operations.md sends operators to the log when L3 misses: these tests hold it to that. Redis
unreachable at start is logged once; a breaker that opens is logged once with its cause, however
many half-open probes fail while Redis stays down; the recovery is logged once; the password in
the configured URL never reaches the log.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
from radixd_client import Client

from daemon.storage.redis_tier import CircuitBreaker
from daemon.storage.redis_urls import has_password, redact_url
from tests.harness import daemon_conftest
from tests.redis_procs import Server, free_port

_dc = daemon_conftest()
SMALL_MODEL = _dc.SMALL_MODEL
P = SMALL_MODEL["page_size"]
PASSWORD = "s3cret-pw-not-for-logs"
OPEN_LINE = "circuit breaker open"
CLOSED_LINE = "circuit breaker closed"
START_LINE = "unreachable at start"


class PasswordServer(Server):
    """A redis-server that wants a password (so that the daemon's URL carries one)."""

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--requirepass", PASSWORD],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis_sync.Redis(port=self.port, password=PASSWORD, socket_timeout=0.5).ping():
                    return
            except redis_sync.RedisError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start")


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Any]:
    """Real daemons (tests/daemon/conftest.py's), each checked clean and stopped at teardown."""
    daemons: list[Any] = []

    def factory(config: dict[str, Any]) -> Any:
        d = tmp_path / f"d{len(daemons)}"
        d.mkdir()
        daemons.append(_dc.Daemon(d, config))
        return daemons[-1]

    yield factory
    _dc.check_and_stop(daemons)


def lines_with(daemon: Any, text: str) -> list[str]:
    return [line for line in daemon.log().splitlines() if text in line]


def wait_line(daemon: Any, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = lines_with(daemon, text)
        if found:
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no log line with {text!r}:\n{daemon.log()[-4000:]}")


def prefetch_misses(c: Client, base: int, n: int = 1) -> None:
    """Prefetches of prefixes nobody cached: each asks Redis (EXISTS), and finds nothing."""
    for i in range(n):
        toks = list(range(base + 100 * i, base + 100 * i + 4 * P))
        pr = c.prefetch("m", toks, policy="wait_complete")
        assert pr.fetched_len == 0


def test_redact_url() -> None:
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("rediss://user:pw@h:1/2?password=pw&x=1") == \
        "rediss://user:***@h:1/2?password=***&x=1"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redact_url("unix:///run/redis.sock?password=pw") == "unix:///run/redis.sock?password=***"
    # has_password: a password exactly where redact_url hides one
    for url in ("redis://:pw@h:1/0", "rediss://user:pw@h:1/2", "redis://h:1/0?PASSWORD=pw",
                "unix:///run/redis.sock?password=pw"):
        assert has_password(url) and redact_url(url) != url, url
    for url in ("redis://h:6379/0", "redis://user@h:1/0", "redis://h:1/0?x=1", "redis://[::1"):
        assert not has_password(url), url


def test_breaker_logs_an_outage_in_two_lines(caplog: pytest.LogCaptureFixture) -> None:
    """Through a long outage (many failed probes) the breaker logs one warning when it opens,
    with the cause, and one info line when a probe succeeds; the failed probes only at debug."""
    now = [0.0]
    b = CircuitBreaker(2, 5.0, clock=lambda: now[0], name="redis://:***@h:1/0")
    caplog.set_level(logging.DEBUG, logger="radixd.storage.redis")
    for _ in range(2):
        b.record(b.admit() or "", False, "ConnectionError: refused")
    for _ in range(10):  # ten periods of Redis still down
        assert b.admit() is None
        now[0] += 5.0
        b.record(b.admit() or "", False, "ConnectionError: refused")
    now[0] += 5.0
    b.record(b.admit() or "", True)
    loud = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]
    assert loud == [
        ("WARNING", "L3 Redis redis://:***@h:1/0: circuit breaker open after 2 consecutive failed "
                    "calls (last: ConnectionError: refused); L3 reads miss and writes are "
                    "dropped, next probe in 5.0s"),
        ("INFO", "L3 Redis redis://:***@h:1/0: circuit breaker closed, the probe succeeded after "
                 "55.0s open; L3 is used again")]
    # open -> half-open -> open ten times, then open -> half-open before the successful probe
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 21
    assert b.state == "closed" and b.opens == 11


def test_redis_down_at_start_outage_and_recovery_logged_once_each(make_daemon,
                                                                  tmp_path: Path) -> None:
    port = free_port()
    srv = PasswordServer(port, tmp_path)
    redacted = f"redis://:***@127.0.0.1:{port}/0"
    try:
        d = make_daemon({"models": [SMALL_MODEL],
                         "l3": {"url": f"redis://:{PASSWORD}@127.0.0.1:{port}/0",
                                "key_prefix": "logtest", "op_timeout_ms": 300,
                                "breaker_open_s": 0.5, "breaker_threshold": 2}})
        # nothing listens on the port yet: the start-up ping says so, with the URL redacted
        line = wait_line(d, START_LINE)
        assert redacted in line and "WARNING" in line, line

        srv.start()
        with Client(d.socket, timeout=20) as c:
            prefetch_misses(c, 1000, 3)  # Redis answers: calls succeed, no transition
            assert not lines_with(d, OPEN_LINE)

            srv.kill()
            prefetch_misses(c, 2000, 3)  # threshold 2: the breaker opens
            line = wait_line(d, OPEN_LINE)
            assert redacted in line and "WARNING" in line, line
            assert "Connection" in line, line  # the cause: connection refused / reset
            # while Redis stays down, half-open probes fail and the breaker opens again: quietly
            for i in range(3):
                time.sleep(0.6)
                prefetch_misses(c, 3000 + 1000 * i)
            assert len(lines_with(d, OPEN_LINE)) == 1, d.log()[-4000:]
            assert not lines_with(d, CLOSED_LINE)

            srv.start()
            time.sleep(0.6)  # breaker_open_s: the next call is the probe, and it succeeds
            prefetch_misses(c, 9000)
            line = wait_line(d, CLOSED_LINE)
            assert redacted in line and "INFO" in line, line
            prefetch_misses(c, 10000, 3)
        log = d.log()
        assert len(lines_with(d, START_LINE)) == 1, log
        assert len(lines_with(d, OPEN_LINE)) == 1, log
        assert len(lines_with(d, CLOSED_LINE)) == 1, log
        assert PASSWORD not in log
    finally:
        srv.kill()


def test_a_plain_url_to_a_cluster_node_is_named_at_the_start(make_daemon,
                                                             tmp_path: Path) -> None:
    """redis:// to a node of a Redis Cluster answered the start ping ("answers"), then about
    half the writes failed with MOVED, seen only in the counters."""
    from tests.redis_procs import start_cluster

    (tmp_path / "cluster").mkdir()
    servers, ports = start_cluster(tmp_path / "cluster", nodes=3)
    try:
        d = make_daemon({"models": [SMALL_MODEL],
                         "l3": {"url": f"redis://127.0.0.1:{ports[0]}/0",
                                "key_prefix": "nodetest"}})
        line = wait_line(d, "is a node of a Redis Cluster")
        assert "WARNING" in line and "redis+cluster://" in line, line
        assert not lines_with(d, " answers")
    finally:
        for srv in servers:
            srv.kill()


def test_a_tls_url_to_a_port_without_tls_says_so_at_the_start(make_daemon,
                                                              tmp_path: Path) -> None:
    """rediss:// to a plain port: the TLS handshake waits for an answer that never comes, and
    the log said only "timeout"."""
    srv = Server(free_port(), tmp_path)
    srv.start()
    try:
        d = make_daemon({"models": [SMALL_MODEL],
                         "l3": {"url": f"rediss://127.0.0.1:{srv.port}/0",
                                "key_prefix": "tlstest", "op_timeout_ms": 300}})
        line = wait_line(d, START_LINE)
        assert "does not speak TLS" in line, line
    finally:
        srv.kill()


def test_a_redis_that_refuses_info_still_answers_at_the_start(make_daemon,
                                                              tmp_path: Path) -> None:
    """The cluster check asks INFO, which an ACL or a proxy may refuse: the start was logged
    as "unreachable", though L3 worked (a review found it)."""
    srv = Server(free_port(), tmp_path, "--rename-command", "INFO", "")
    srv.start()
    try:
        d = make_daemon({"models": [SMALL_MODEL],
                         "l3": {"url": srv.url, "key_prefix": "infotest"}})
        line = wait_line(d, " answers")
        assert "INFO" in line, line
        assert not lines_with(d, START_LINE)
    finally:
        srv.kill()
