"""Every operation and every kind of bad input, over a real socket to a real daemon."""

from __future__ import annotations

import socket
import struct
from array import array

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radixd_client import Client, errors, pages, protocol

from .conftest import Raw

P = 4
MODEL = "m"


def toks(n: int, base: int = 1) -> bytes:
    return array("i", range(base, base + n)).tobytes()




def test_every_operation_round_trip(daemon) -> None:
    with Client(daemon.socket) as c:
        assert c.ping(b"abc").payload == b"abc"
        t = toks(6 * P)
        m = c.match(MODEL, t)
        assert (m.prefix_len, m.full_hit_len, m.receipt) == (0, 0, None)
        a = c.alloc(MODEL, 6)
        assert len(pages(a.full_pages)) == 6 and len(pages(a.swa_pages)) == 6
        r = c.insert(MODEL, t, a.full_pages, a.swa_pages, lock=True)
        assert (r.prefix_len, r.inserted_len) == (0, 6 * P) and r.receipt is not None
        c.unlock(MODEL, r.receipt)
        m = c.match(MODEL, t, lock=True)
        assert m.prefix_len == 6 * P and pages(m.full_pages) == pages(a.full_pages)
        assert pages(m.swa_pages) == pages(a.swa_pages)[-2:]  # window 8 = 2 pages
        c.release_swa(MODEL, m.receipt)
        with pytest.raises(errors.ReceiptError):
            c.release_swa(MODEL, m.receipt)
        rid = c.lock(MODEL, m.node).receipt
        c.unlock(MODEL, rid)
        c.unlock(MODEL, m.receipt)
        with pytest.raises(errors.ReceiptError):
            c.unlock(MODEL, m.receipt)
        # a longer request: prefill chunk, decode frees SWA, finish
        t2 = t + toks(3 * P + 2, 500)  # 9 pages + 2 tokens
        m = c.match(MODEL, t2, lock=True)
        assert m.prefix_len == 6 * P
        b = c.alloc(MODEL, 4)  # pages 6..9 (the last is the unaligned tail)
        u = c.cache_unfinished(MODEL, t2[: 8 * P * 4], pages(b.full_pages)[:2],
                               pages(b.swa_pages)[:2], 6 * P, 0, m.receipt)
        assert u.inserted_len == 8 * P and u.receipt is not None
        sw = pages(b.swa_pages)
        c.free(MODEL, swa_pages=sw[2:3])  # decode freed the SWA of page 8
        f = c.cache_finished(MODEL, t2, pages(b.full_pages)[2:], array("i", [0, sw[3]]),
                             8 * P, 9 * P, u.receipt)
        assert f.inserted_len == 8 * P  # page 8 alone would end as a tombstone: not cached
        st = c.stats(MODEL).models[MODEL]
        assert st["held_full_pages"] == 0 and st["held_swa_pages"] == 0
        ev = c.evict(MODEL, full_pages=2, swa_pages=0)
        assert ev.full_pages == 2
    daemon.check()


def test_batch_runs_in_order_and_reports_each_item(daemon) -> None:
    with Client(daemon.socket) as c:
        with c.batch() as b:
            p = b.ping(b"x")
            a = b.alloc(MODEL, 2)
            m = b.match(MODEL, toks(8))
        assert p.result().payload == b"x" and len(pages(a.result().full_pages)) == 2
        assert m.result().prefix_len == 0
        with c.batch() as b:
            ok = b.free(MODEL, a.result().full_pages, a.result().swa_pages)
            bad = b.unlock(MODEL, 12345)
            skipped = b.ping(b"y")
        ok.result()
        with pytest.raises(errors.ReceiptError):
            bad.result()
        with pytest.raises(errors.BatchSkipped, match="not run|not executed"):
            skipped.result()
        with c.batch(stop_on_error=False) as b:
            bad = b.unlock(MODEL, 999)
            fine = b.ping(b"z")
        assert fine.result().payload == b"z"
    daemon.check()


def test_batch_larger_than_max_inflight_is_refused(make_daemon) -> None:
    d = make_daemon({"server": {"max_inflight": 4}})
    with Client(d.socket) as c:
        with pytest.raises(errors.LimitExceeded):
            with c.batch() as b:
                for _ in range(5):
                    b.ping(b"")
        assert c.ping(b"ok").payload == b"ok"


BAD_CALLS = [
    (protocol.Match(id=1, model="nope", tokens=b""), "unknown_model"),
    (protocol.Match(id=1, model=MODEL, tokens=b"\x01\x02\x03"), "bad_argument"),
    (protocol.Lock(id=1, model=MODEL, node=10**9), "unknown_node"),
    (protocol.Unlock(id=1, model=MODEL, receipt=7), "bad_receipt"),
    (protocol.ReleaseSwa(id=1, model=MODEL, receipt=7), "bad_receipt"),
    (protocol.Alloc(id=1, model=MODEL, n=-1), "bad_argument"),
    (protocol.Alloc(id=1, model=MODEL, n=10**6), "bad_argument"),
    (protocol.Free(id=1, model=MODEL, full_pages=toks(1, 5)), "page_not_held"),
    (protocol.Free(id=1, model=MODEL, full_pages=b"\x00\x00"), "bad_argument"),
    (protocol.Insert(id=1, model=MODEL, tokens=toks(8), full_pages=toks(2, 3),
                     swa_pages=toks(2, 3)), "page_not_held"),
    (protocol.Insert(id=1, model=MODEL, tokens=toks(8), full_pages=b"",
                     prev_prefix_len=8), "bad_argument"),
    (protocol.CacheFinished(id=1, model=MODEL, tokens=b"", full_pages=b"",
                            receipt=99), "bad_receipt"),
    (protocol.Evict(id=1, model=MODEL, full_pages=-3), "bad_argument"),
    (protocol.Stats(id=1, model="nope"), "unknown_model"),
]


@pytest.mark.parametrize(("req", "code"), BAD_CALLS, ids=[f"{r.__class__.__name__}-{c}"
                                                         for r, c in BAD_CALLS])
def test_bad_input_gets_a_clear_error_and_the_session_survives(daemon, req, code) -> None:
    raw = Raw(daemon.socket)
    r = raw.call(req)
    assert not r.ok and r.error.code == code and r.error.message
    assert r.id == 1
    assert raw.call(protocol.Ping(id=2, payload=b"alive")).ok
    raw.close()


def test_malformed_frames(daemon) -> None:
    raw = Raw(daemon.socket)
    raw.send(b"\xc1\xc1")  # not msgpack
    r = raw.recv()
    assert r.error.code == "bad_frame" and r.id == 0
    raw.send(msgspec.msgpack.encode({"op": "match", "id": 9, "model": 5, "tokens": b""}))
    r = raw.recv()
    assert (r.error.code, r.id) == ("bad_frame", 9) and "model" in r.error.message
    raw.send(msgspec.msgpack.encode({"op": "teleport", "id": 4}))
    r = raw.recv()
    assert (r.error.code, r.id) == ("unknown_op", 4)
    raw.send(msgspec.msgpack.encode([1, 2, 3]))
    assert raw.recv().error.code == "bad_frame"
    assert raw.call(protocol.Ping(id=5)).ok  # the session survived all of it
    # a length prefix over the limit: error, then only this connection closes
    other = Raw(daemon.socket)
    raw.s.sendall(struct.pack("<I", 1 << 30))
    r = raw.recv()
    assert r.error.code == "frame_too_large"
    with pytest.raises(ConnectionError):
        raw.recv()
    assert other.call(protocol.Ping(id=1)).ok
    other.close()
    daemon.check()


def test_before_hello_a_frame_over_64_kib_is_refused_and_after_it_the_limit_is_max_frame(
        daemon) -> None:
    """A connection that has not said hello may not make the daemon hold max_frame_bytes (16
    MiB) of it until hello_timeout_s: its length prefix over 64 KiB is frame_too_large, and the
    connection closes. Once the hello succeeds, max_frame_bytes is the limit."""
    stranger = Raw(daemon.socket, hello=False)
    stranger.s.sendall(struct.pack("<I", (64 << 10) + 1))  # the body never follows
    r = stranger.recv()
    assert r.error.code == "frame_too_large" and r.error.details["limit"] == 64 << 10
    with pytest.raises(ConnectionError):
        stranger.recv()
    engine = Raw(daemon.socket)
    payload = b"x" * (1 << 20)
    assert engine.call(protocol.Ping(id=1, payload=payload)).ok
    # a hello and a large request in one write: the request is read under the session's limit
    both = Raw(daemon.socket, hello=False)
    both.send(protocol.encode_body(protocol.Hello(id=1)))
    both.send(protocol.encode_body(protocol.Ping(id=2, payload=payload)))
    assert both.recv().ok
    assert both.recv().ok
    for c in (engine, both):
        c.close()
    daemon.check()


def test_too_many_tokens(make_daemon) -> None:
    d = make_daemon({"server": {"max_tokens": 16}})
    with Client(d.socket) as c:
        with pytest.raises(errors.LimitExceeded):
            c.match(MODEL, toks(17))
        assert c.match(MODEL, toks(16)).prefix_len == 0


def test_out_of_memory_reports_counts(daemon) -> None:
    with Client(daemon.socket) as c:
        a = c.alloc(MODEL, 30)  # the SWA pool has 31 usable pages
        with pytest.raises(errors.OutOfMemory) as ei:
            c.alloc(MODEL, 5)
        d = ei.value.details
        assert d["swa_available"] == 1 and d["swa_held"] == 30 and d["requested"] == 5
        c.free(MODEL, a.full_pages, a.swa_pages)
        assert len(pages(c.alloc(MODEL, 5).full_pages)) == 5
    daemon.check()


# ------------------------------------------------------------------------------ fuzzing

_json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.binary(max_size=40)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
_ops = st.sampled_from(sorted(protocol.OPS) + ["nope", ""])
_fields = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from([MODEL, "x", 3]), "tokens": st.binary(max_size=64),
    "full_pages": st.binary(max_size=24), "swa_pages": st.binary(max_size=24),
    "n": st.integers(-5, 70), "node": st.integers(-1, 50), "receipt": st.integers(-1, 20),
    "lock": st.booleans(), "prev_prefix_len": st.integers(-4, 40),
    "swa_evicted_len": st.integers(-4, 40), "payload": st.binary(max_size=8),
    "ops": st.lists(st.fixed_dictionaries({"op": _ops}), max_size=3),
    "extra": _json_like})
requests = st.builds(lambda op, f, i: {"op": op, "id": i, **f}, _ops, _fields,
                     st.integers(0, 2**31))
frames = st.one_of(
    requests.map(msgspec.msgpack.encode),
    _json_like.map(msgspec.msgpack.encode),
    st.binary(max_size=64),
)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), frames), min_size=1, max_size=25))
def test_random_and_malformed_frames_from_several_clients(daemon, script) -> None:
    """Random valid, invalid and garbage frames from three sessions: every frame gets exactly
    one response, the daemon keeps answering, and its checker stays clean."""
    sessions = [Raw(daemon.socket) for _ in range(3)]
    try:
        for who, body in script:
            sessions[who].send(body)
            r = sessions[who].recv()
            assert r.ok or r.error.code in protocol.ALL_CODES
            assert r.ok or r.error.code != "internal", r.error.message
        for s in sessions:
            assert s.call(protocol.Ping(id=1, payload=b"still here")).ok
    finally:
        for s in sessions:
            s.close()
    daemon.check()


def test_attach_response_keeps_request_order(daemon) -> None:
    """attach sends fds (SCM_RIGHTS) out of band: frames pipelined behind it must wait."""
    raw = Raw(daemon.socket)
    # a page gives the namespace a segment of each pool (attach sends only those)
    assert raw.call(protocol.Alloc(id=11, model=MODEL, n=1)).ok
    raw.s.sendall(b"".join(protocol.encode(r) for r in (
        protocol.Attach(id=12, model=MODEL), protocol.Ping(id=13),
        protocol.Attach(id=14, model=MODEL), protocol.Ping(id=15))))
    ids = []
    fds_seen = 0
    buf = b""
    while len(ids) < 4:
        data, fds, _flags, _addr = socket.recv_fds(raw.s, 1 << 16, 8)
        assert data, "connection closed"
        fds_seen += len(fds)
        for fd in fds:
            import os

            os.close(fd)
        buf += data
        while len(buf) >= 4 and len(buf) >= 4 + struct.unpack("<I", buf[:4])[0]:
            (n,) = struct.unpack("<I", buf[:4])
            ids.append(protocol.decode_response(buf[4 : 4 + n]).id)
            buf = buf[4 + n :]
    assert ids == [12, 13, 14, 15]
    assert fds_seen == 4  # one segment of each of two pools, twice
    raw.close()


def test_auth_failures_in_one_write_stop_at_the_limit(make_daemon) -> None:
    d = make_daemon({"tenants": [{"name": "t", "token": "right"}]})
    raw = Raw(d.socket, hello=False)
    raw.s.sendall(b"".join(protocol.encode(r) for r in (
        protocol.Hello(id=1, token="a"), protocol.Hello(id=2, token="b"),
        protocol.Hello(id=3, token="c"), protocol.Hello(id=4, token="right"),
        protocol.Alloc(id=5, model=MODEL, n=5))))
    codes = [raw.recv().error.code for _ in range(3)]
    assert codes == ["auth_failed"] * 3
    with pytest.raises(ConnectionError):
        raw.recv()  # closed: the good hello and the alloc behind the third failure never ran
    raw.close()
    with Client(d.socket, token="right") as c:
        assert c.stats(MODEL).models[MODEL]["allocated_pages"] == 0


def test_session_limit_and_restart_detection(make_daemon) -> None:
    d = make_daemon({"server": {"max_sessions": 2}})
    with Client(d.socket) as a, Client(d.socket) as b:
        assert a.instance == b.instance and len(a.instance) == 16
        with pytest.raises(errors.LimitExceeded) as ei:
            Client(d.socket)
        assert ei.value.code == "too_many_sessions"
    with Client(d.socket) as c:  # sessions that ended free their slots
        assert c.ping(b"x").payload == b"x"


def test_a_model_without_sliding_window_layers(make_daemon) -> None:
    """num_swa_layers = 0 (TOML cannot say null): no SWA pool, plain prefix caching."""
    model = {"name": "dense", "page_size": 4, "num_full_layers": 1, "num_swa_layers": 0,
             "num_kv_heads": 1, "head_dim": 64, "dtype": "float32", "device": "cpu",
             "full_pages": 32}
    d = make_daemon({"models": [model]})
    with Client(d.socket) as c:
        assert c.models["dense"].sliding_window is None and c.models["dense"].swa_pages == 0
        a = c.alloc("dense", 3)
        assert a.swa_pages == b"" and len(pages(a.full_pages)) == 3
        t = toks(3 * P)
        c.insert("dense", t, a.full_pages)
        m = c.match("dense", t + toks(2, 900), lock=True)
        assert m.prefix_len == 3 * P and m.swa_pages == b""
        c.unlock("dense", m.receipt)
        pools = c.attach("dense")
        assert pools.swa is None
    d.check()


def test_lock_receipts_per_session_are_capped(make_daemon) -> None:
    d = make_daemon({"server": {"max_locks_per_session": 3}})
    with Client(d.socket) as c:
        a = c.alloc(MODEL, 2)
        t = toks(2 * P)
        c.insert(MODEL, t, a.full_pages, a.swa_pages)
        receipts = [c.match(MODEL, t, lock=True).receipt for _ in range(3)]
        with pytest.raises(errors.LimitExceeded) as ei:
            c.match(MODEL, t, lock=True)
        assert ei.value.code == "too_many_locks" and ei.value.details["limit"] == 3
        with pytest.raises(errors.LimitExceeded):
            c.lock(MODEL, c.match(MODEL, t).node)
        assert c.match(MODEL, t).prefix_len == 2 * P  # unlocked matches still work
        c.unlock(MODEL, receipts[0])
        c.unlock(MODEL, c.match(MODEL, t, lock=True).receipt)  # a slot is free again
    d.check()


def test_a_connection_without_hello_is_closed_after_the_timeout(make_daemon) -> None:
    d = make_daemon({"server": {"hello_timeout_s": 0.3}})
    raw = Raw(d.socket, hello=False)
    r = raw.recv()  # nothing sent: the daemon gives up on it
    assert (r.id, r.error.code) == (0, "not_authenticated")
    with pytest.raises(ConnectionError):
        raw.recv()
    raw.close()
    with Client(d.socket) as c:  # an authenticated session is not affected by the timer
        import time as _t

        _t.sleep(0.5)
        assert c.ping(b"x").payload == b"x"


def test_token_errors_come_before_the_lock_cap(make_daemon) -> None:
    """docs/protocol.md, order of checks: a malformed request from a session at its lock cap
    is told what is wrong with it (bad_argument, too_many_tokens: its tokens or page lists),
    not too_many_locks; the same for match, insert with a lock and cache_unfinished without a
    receipt (raw frames: the client library refuses tokens that are not whole int32 before
    sending them)."""
    d = make_daemon({"server": {"max_locks_per_session": 1}})
    raw = Raw(d.socket, hello=False)
    hello = protocol.decode_result("hello", raw.call(protocol.Hello(id=9)).result)
    t = toks(2 * P)
    a = protocol.decode_result("alloc", raw.call(protocol.Alloc(id=1, model=MODEL, n=2)).result)
    assert raw.call(protocol.Insert(id=2, model=MODEL, tokens=t, full_pages=a.full_pages,
                                    swa_pages=a.swa_pages)).ok
    assert raw.call(protocol.Match(id=3, model=MODEL, tokens=t, lock=True)).ok  # its one lock
    b = protocol.decode_result("alloc", raw.call(protocol.Alloc(id=4, model=MODEL, n=2)).result)
    huge = bytes(4 * (hello.limits.max_tokens + 1))
    for tokens, code in ((t[:-1], "bad_argument"), (huge, "too_many_tokens"),
                         (t, "too_many_locks")):
        for req in (protocol.Match(id=5, model=MODEL, tokens=tokens, lock=True),
                    protocol.Insert(id=6, model=MODEL, tokens=tokens, full_pages=b.full_pages,
                                    swa_pages=b.swa_pages, lock=True),
                    protocol.CacheUnfinished(id=7, model=MODEL, tokens=tokens,
                                             full_pages=b.full_pages, swa_pages=b.swa_pages)):
            r = raw.call(req)
            assert not r.ok and r.error.code == code, (type(req).__name__, code, r.error)
    odd = b.full_pages[:-1]  # a page list that is not whole int32: also before the cap
    for req in (protocol.Insert(id=8, model=MODEL, tokens=t, full_pages=odd,
                                swa_pages=b.swa_pages, lock=True),
                protocol.CacheUnfinished(id=9, model=MODEL, tokens=t, full_pages=b.full_pages,
                                         swa_pages=odd)):
        r = raw.call(req)
        assert not r.ok and r.error.code == "bad_argument", (type(req).__name__, r.error)
    raw.close()
    d.check()
