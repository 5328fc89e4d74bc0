"""Protocol edge cases (issue 13), each against a real daemon over its socket: ids that are not
integers, the decoder's nesting limit, the order of argument and ownership checks, the listen
backlog, a session refused for the session limit, what a client may conclude at shutdown, and
the log of failed logins."""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import threading
import time
from array import array
from typing import Any

import msgspec
import pytest
from radixd_client import Client, protocol

from .conftest import SMALL_MODEL, Raw
from .test_tiers import wait_for

P = 4
MODEL = "m"
AUTH_LOG_INTERVAL_S = 5.0  # operations.md: at most one line about failed hellos per 5 s
DENSE = {"name": "dense", "page_size": 4, "num_full_layers": 1, "num_swa_layers": 0,
         "num_kv_heads": 1, "head_dim": 64, "dtype": "float32", "device": "cpu",
         "full_pages": 32}


def ids(*pages: int) -> bytes:
    return array("i", pages).tobytes()


def toks(n: int, base: int = 1) -> bytes:
    return array("i", range(base, base + n)).tobytes()


def recv_map(raw: Raw) -> dict[str, Any]:
    """The next response as a plain map: types exactly as sent (a bool stays a bool)."""
    head = raw.s.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        raise ConnectionError("closed")
    (n,) = struct.unpack("<I", head)
    return msgspec.msgpack.decode(raw.s.recv(n, socket.MSG_WAITALL))


def code_of(raw: Raw, req: Any) -> str | None:
    r = raw.call(req)
    return None if r.ok else r.error.code


# ------------------------------------------------------------------ 1. ids that are not integers


@pytest.mark.parametrize("bad_id", [True, False, 1.0, "7", [7]])
def test_an_id_that_is_not_an_integer_is_answered_with_id_0(daemon, bad_id) -> None:
    """protocol.md 3.1: the error echoes the id only when it is an integer; msgpack true is not
    (bool is an int subclass in Python: the daemon used to echo ``true``)."""
    raw = Raw(daemon.socket)
    raw.send(msgspec.msgpack.encode({"op": "ping", "id": bad_id}))
    r = recv_map(raw)
    assert r["ok"] is False and r["error"]["code"] == "bad_frame"
    assert type(r["id"]) is int and r["id"] == 0
    # an integer id of a request that fails to decode is echoed
    raw.send(msgspec.msgpack.encode({"op": "ping", "id": 7, "payload": "not bytes"}))
    r = recv_map(raw)
    assert (r["id"], r["error"]["code"]) == (7, "bad_frame")
    assert raw.call(protocol.Ping(id=8, payload=b"alive")).ok
    raw.close()


# ------------------------------------------------------------------ 2. nesting limit

#: protocol.md 3.2: with CPython 3.11 and uvloop a request nesting 986 containers (the request
#: map included) is always accepted, one nesting 988 never; 987 depends on how warm CPython's
#: specialised call sites are. Every supported build accepts at least 500.
ALWAYS_ACCEPTED = 986
ALWAYS_REFUSED = 988
NESTING_GUARANTEED = 500
REFERENCE_BUILD = sys.version_info[:2] == (3, 11) and sys.implementation.name == "cpython"


def nested_ping(levels: int, container: bytes) -> bytes:
    """A ping (id 9) whose unknown key ``x`` holds containers such that the body nests
    ``levels`` containers in all (the request map is the first)."""
    return (b"\x83\xa2op\xa4ping\xa2id\x09\xa1x" + container * (levels - 1) + b"\xc0")


@pytest.mark.parametrize("container", [b"\x91", b"\x81\xa1k"], ids=["array", "map"])
def test_the_documented_nesting_limit_for_values_of_unknown_keys(daemon, container) -> None:
    raw = Raw(daemon.socket)

    def boundary(behind_load: bool) -> None:
        """The same bounds for a frame read at once and for one that waited behind a load
        (processed later, from the event loop)."""
        for levels, accepted in ((ALWAYS_ACCEPTED, True), (ALWAYS_REFUSED, False)):
            if behind_load:
                assert raw.call(protocol.Load(id=3, model=MODEL, tokens=b"")).ok
            raw.send(nested_ping(levels, container))
            r = raw.recv()
            if accepted:
                assert r.ok and r.id == 9, (levels, r)
            else:
                assert (r.ok, r.id, r.error.code) == (False, 0, "bad_frame")
                assert "recursion" in r.error.message

    raw.send(nested_ping(NESTING_GUARANTEED, container))
    assert raw.recv().ok
    raw.send(nested_ping(5000, container))
    r = raw.recv()
    assert (r.ok, r.id, r.error.code) == (False, 0, "bad_frame")
    if REFERENCE_BUILD:
        boundary(behind_load=False)  # a fresh daemon: its call sites are cold
        boundary(behind_load=True)
        for _ in range(200):  # warm
            assert raw.call(protocol.Load(id=3, model=MODEL, tokens=b"")).ok
            raw.send(nested_ping(NESTING_GUARANTEED, container))
            assert raw.recv().ok
        boundary(behind_load=False)
        boundary(behind_load=True)
    assert raw.call(protocol.Ping(id=10, payload=b"alive")).ok
    raw.close()


# ------------------------------------------------------------------ 3. order of checks


def test_free_reports_a_malformed_list_before_ownership(daemon) -> None:
    """bad_argument (the request's own fault) before page_not_held (the daemon's state)."""
    raw = Raw(daemon.socket)
    assert code_of(raw, protocol.Free(id=1, model=MODEL, full_pages=ids(5, 5))) == \
        "bad_argument"  # was page_not_held: page 5 is not held
    assert code_of(raw, protocol.Free(id=1, model=MODEL, swa_pages=ids(7, 7))) == "bad_argument"
    assert code_of(raw, protocol.Free(id=1, model=MODEL, full_pages=ids(5))) == "page_not_held"
    assert code_of(raw, protocol.Free(id=1, model=MODEL, full_pages=ids(0))) == "page_not_held"
    a = msgspec.msgpack.decode(raw.call(protocol.Alloc(id=2, model=MODEL, n=1)).result)
    full = array("i", a["full_pages"])[0]
    assert code_of(raw, protocol.Free(id=3, model=MODEL, full_pages=ids(full, full))) == \
        "bad_argument"
    assert code_of(raw, protocol.Free(id=4, model=MODEL, full_pages=ids(full),
                                      swa_pages=a["swa_pages"])) is None  # still held: freed
    raw.close()


def test_insert_without_swa_layers_refuses_swa_pages_before_ownership(make_daemon) -> None:
    d = make_daemon({"models": [DENSE]})
    raw = Raw(d.socket)
    for swa in (ids(1), ids(0)):  # [1] was page_not_held, [0] bad_argument
        assert code_of(raw, protocol.Insert(id=1, model="dense", tokens=toks(P),
                                            full_pages=ids(1), swa_pages=swa)) == "bad_argument"
    assert code_of(raw, protocol.Insert(id=1, model="dense", tokens=toks(P),
                                        full_pages=ids(1))) == "page_not_held"
    for op in (protocol.CacheUnfinished, protocol.CacheFinished):
        assert code_of(raw, op(id=1, model="dense", tokens=toks(P), full_pages=ids(1),
                               swa_pages=ids(3))) == "bad_argument"
    raw.close()


@pytest.mark.parametrize("op", ["insert", "cache_unfinished", "cache_finished"])
def test_insert_and_cache_check_arguments_then_receipt_then_pages(daemon, op) -> None:
    """Every request below names pages this session does not hold (5, 6): a malformed one is
    bad_argument all the same; a well-formed one with a bad receipt is bad_receipt; then
    page_not_held. Checks against the tree's content come last."""
    raw = Raw(daemon.socket)
    make = {"insert": protocol.Insert, "cache_unfinished": protocol.CacheUnfinished,
            "cache_finished": protocol.CacheFinished}[op]
    extra = {} if op == "insert" else {"receipt": None}
    malformed = [
        dict(tokens=toks(2 * P), full_pages=ids(5), swa_pages=ids(6)),  # one page short
        dict(tokens=toks(2 * P), full_pages=ids(5, 5), swa_pages=ids(6, 7)),  # a duplicate
        dict(tokens=toks(2 * P), full_pages=ids(5, 6), swa_pages=ids(7, 8),
             prev_prefix_len=3),  # not a multiple of P
        dict(tokens=toks(2 * P), full_pages=ids(5, 6), swa_pages=ids(7, 8),
             swa_evicted_len=P),  # a live id below the frontier
        dict(tokens=toks(2 * P), full_pages=ids(5, 6), swa_pages=ids(7, 0)),  # 0 above it
        dict(tokens=toks(P), full_pages=b"", swa_pages=b"", prev_prefix_len=2 * P),  # too long
    ]
    for fields in malformed:
        assert code_of(raw, make(id=1, model=MODEL, **extra, **fields)) == "bad_argument", fields
    good_shape = dict(tokens=toks(2 * P), full_pages=ids(5, 6), swa_pages=ids(7, 8))
    if op != "insert":
        assert code_of(raw, make(id=1, model=MODEL, receipt=99, **good_shape)) == "bad_receipt"
    assert code_of(raw, make(id=1, model=MODEL, **extra, **good_shape)) == "page_not_held"
    # prev_prefix_len longer than what the tree has: known only from the tree, after ownership
    claim = dict(tokens=toks(2 * P), full_pages=ids(6), swa_pages=ids(8), prev_prefix_len=P)
    assert code_of(raw, make(id=1, model=MODEL, **extra, **claim)) == "page_not_held"
    a = msgspec.msgpack.decode(raw.call(protocol.Alloc(id=2, model=MODEL, n=1)).result)
    held = dict(claim, full_pages=a["full_pages"], swa_pages=a["swa_pages"])
    assert code_of(raw, make(id=1, model=MODEL, **extra, **held)) == "bad_argument"
    # nothing moved: the pages are still held and can be freed
    assert code_of(raw, protocol.Free(id=3, model=MODEL, full_pages=a["full_pages"],
                                      swa_pages=a["swa_pages"])) is None
    raw.close()


# ------------------------------------------------------------------ 4. listen backlog


def test_a_burst_of_connects_is_queued_not_refused(daemon) -> None:
    """The socket listens with a backlog of 1024 (asyncio's default is 100). The daemon is
    stopped (SIGSTOP) so that it accepts nothing while the burst queues up."""
    with open("/proc/sys/net/core/somaxconn") as f:
        somaxconn = int(f.read())
    burst = min(1000, somaxconn)
    # (a requirement of this machine, not a skip: below 200 the burst cannot tell 1024 from 100)
    assert burst >= 200, (f"net.core.somaxconn is {somaxconn}: raise it to at least 200 "
                          "(sysctl -w net.core.somaxconn=4096) to run this test")
    socks: list[socket.socket] = []
    refused = 0
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        for _ in range(burst):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            socks.append(s)
            try:
                s.connect(daemon.socket)
            except BlockingIOError:
                refused += 1
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        for s in socks:
            s.close()
    assert refused == 0, f"{refused} of {burst} connects got EAGAIN"
    raw = Raw(daemon.socket)  # and the daemon went on accepting
    assert raw.call(protocol.Ping(id=1, payload=b"x")).ok
    raw.close()


# ------------------------------------------------------------------ 5. too_many_sessions


def test_a_refused_session_may_retry_hello_until_the_hello_timeout(make_daemon) -> None:
    timeout = 1.0
    d = make_daemon({"server": {"max_sessions": 1, "hello_timeout_s": timeout}})
    first = Raw(d.socket)
    second = Raw(d.socket, hello=False)
    assert code_of(second, protocol.Hello(id=1)) == "too_many_sessions"
    assert code_of(second, protocol.Ping(id=2)) == "not_authenticated"  # still open
    first.close()
    time.sleep(0.1)  # the daemon sees the first session end
    assert code_of(second, protocol.Hello(id=3)) is None  # the same connection, now admitted
    # a refused connection is closed hello_timeout_s after it connected, not after the refusal
    t0 = time.monotonic()
    third = Raw(d.socket, hello=False)
    time.sleep(0.6 * timeout)
    assert code_of(third, protocol.Hello(id=1)) == "too_many_sessions"
    r = third.recv()
    assert (r.id, r.error.code) == (0, "not_authenticated")
    assert 0.9 * timeout <= time.monotonic() - t0 < 1.5 * timeout
    with pytest.raises(ConnectionError):
        third.recv()
    assert second.call(protocol.Ping(id=4, payload=b"x")).ok
    second.close()
    third.close()


# ------------------------------------------------------------------ 6. shutdown


def test_requests_without_a_response_at_shutdown_were_not_executed(make_daemon) -> None:
    """protocol.md 3.3: a client pipelines allocs across a SIGTERM. Those answered ok are
    exactly those that ran: the daemon's log of the session's end counts the pages it held."""
    d = make_daemon({"models": [{**SMALL_MODEL, "full_pages": 20000, "swa_pages": 20000}]})
    raw = Raw(d.socket)
    body = protocol.encode_body(protocol.Alloc(id=5, model=MODEL, n=1))
    frame = struct.pack("<I", len(body)) + body
    sent = 0
    responses: list[protocol.Response] = []

    def read() -> None:
        with pytest.raises(ConnectionError):
            while True:
                responses.append(raw.recv())

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 10
    try:
        while sent < 15000 and time.monotonic() < deadline:
            raw.s.sendall(frame * 50)
            sent += 50
            if sent == 2000:
                d.proc.send_signal(signal.SIGTERM)
            time.sleep(0.0005)
    except OSError:  # the daemon closed the connection: the rest could not be sent
        pass
    reader.join(20)
    assert d.proc.wait(20) == 0
    executed = sum(r.ok for r in responses)
    refused = [r.error.code for r in responses if not r.ok]
    assert set(refused) <= {"shutting_down"}
    oks = [r.ok for r in responses]
    assert oks == sorted(oks, reverse=True)  # results first, then shutting_down, then nothing
    assert 0 < executed and len(responses) <= sent
    released = [line for line in d.log().splitlines() if "released" in line]
    assert len(released) == 1, d.log()[-3000:]
    assert f"released 0 locks, {executed} full and {executed} swa pages" in released[0]


# ------------------------------------------------------------------ 7. failed logins logged


def test_failed_hellos_are_logged_at_a_bounded_rate(make_daemon) -> None:
    d = make_daemon({"tenants": [{"name": "t", "token": "right-token"}]})
    secret = "guess-0f3a9c"

    def fail() -> None:
        raw = Raw(d.socket, hello=False)
        assert code_of(raw, protocol.Hello(id=1, token=secret)) == "auth_failed"
        raw.close()

    for _ in range(6):
        fail()
    time.sleep(0.3)
    lines = [x for x in d.log().splitlines() if "failed hello" in x]
    assert len(lines) == 1, lines
    assert f"pid {os.getpid()} uid {os.getuid()}" in lines[0]
    assert "unknown tenant token" in lines[0] and "(0 earlier" in lines[0]
    time.sleep(AUTH_LOG_INTERVAL_S)
    fail()
    time.sleep(0.3)
    lines = [x for x in d.log().splitlines() if "failed hello" in x]
    assert len(lines) == 2 and "(5 earlier failures not logged)" in lines[1], lines
    assert secret not in d.log()


def test_sighup_is_logged_and_ignored(make_daemon) -> None:
    """There is no reload. SIGHUP's default would end the daemon at once, with no drain and
    the socket left behind, and systemd would not restart it (a clean signal)."""
    d = make_daemon()
    with Client(d.socket) as c:
        c.attach("m")
        a = c.alloc("m", 2)
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "SIGHUP ignored" in d.log(), "the warning")
        assert d.proc.poll() is None
        c.free("m", a.full_pages, a.swa_pages)
        assert c.ping(b"still here").payload == b"still here"


def test_signal_handlers_are_in_place_before_the_socket_exists(tmp_path) -> None:
    """A client may signal the daemon as soon as it can connect (the test harness's check
    sends SIGUSR1 then), and a signal that comes before its handler ends the process (SIGUSR1's
    default): the handlers are installed before the socket is bound. In process, the server's
    start (which binds the socket) is replaced by one that reads the handlers and stops."""
    import asyncio

    from daemon.app import build
    from daemon.config import load_config

    config = load_config(None, env={}, overrides={
        "server": {"socket": str(tmp_path / "s.sock")},
        "models": [{**SMALL_MODEL, "export_pools": False}]})
    server = build(config, create_pools=False).server
    seen: dict[int, Any] = {}

    class Stop(Exception):
        pass

    async def start() -> None:
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            seen[sig] = signal.getsignal(sig)
        raise Stop

    server.start = start  # type: ignore[method-assign]
    with pytest.raises(Stop):
        asyncio.run(server.serve())
    assert not (tmp_path / "s.sock").exists()
    for sig, handler in seen.items():
        assert handler not in (signal.SIG_DFL, signal.SIG_IGN, None), (sig, handler)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the loop's, gone with it
