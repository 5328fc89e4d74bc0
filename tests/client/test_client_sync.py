"""The blocking Client against a scripted daemon on a real Unix socket (socketpair)."""

from __future__ import annotations

import socket
import struct
import threading
from array import array
from typing import Any

import pytest
from radixd_client import (
    AuthError,
    BadArgument,
    BatchSkipped,
    Client,
    ConnectFailed,
    ConnectionLost,
    LimitExceeded,
    OutOfMemory,
    ProtocolError,
    RadixdError,
    ReceiptError,
    SessionRestarted,
    TimedOut,
    UndecodableResult,
)
from radixd_client import protocol as P

TOK = [1, 2, 3, 4, 5, 6, 7, 8]
TOKB = struct.pack("<8i", *TOK)
PG = struct.pack("<2i", 3, 4)
MATCH = P.MatchResult(prefix_len=8, full_pages=PG, swa_pages=PG[4:], node=5, full_hit_len=8,
                      host_hit_len=0, receipt=11)
INSERT = P.InsertResult(prefix_len=4, inserted_len=4, full_pages=PG, swa_pages=b"", node=6,
                        receipt=None)


def connect(d: Any, **kw: Any) -> Client:
    return Client.from_socket(d.client_sock, "tok", client_name="test-engine", **kw)


# ---------------------------------------------------------------------------- hello, calls

def test_hello_is_sent_and_its_result_kept(fake_daemon: Any, kit: Any) -> None:
    d = fake_daemon()
    c = connect(d)
    assert d.requests[0] == P.Hello(id=1, version=P.PROTOCOL_VERSION, token="tok",
                                    client="test-engine")
    assert (c.session, c.tenant, c.namespace, c.version) == (7, "acme", "ns-acme", 1)
    assert c.models == {"tiny": kit.MODEL}
    assert c.limits.max_inflight == 64 and c.hello_result.session == 7
    assert "session 7" in repr(c)


# op name, client call, the request the daemon must see (id aside), the daemon's result
CALLS: list[tuple[str, Any, P.Request, P.Result]] = [
    ("ping", lambda c: c.ping(b"hi"), P.Ping(payload=b"hi"), P.PingResult(payload=b"hi")),
    ("match", lambda c: c.match("tiny", TOK, lock=True),
     P.Match(model="tiny", tokens=TOKB, lock=True), MATCH),
    ("lock", lambda c: c.lock("tiny", 5), P.Lock(model="tiny", node=5), P.LockResult(receipt=2)),
    ("unlock", lambda c: c.unlock("tiny", 2), P.Unlock(model="tiny", receipt=2), P.Empty()),
    ("release_swa", lambda c: c.release_swa("tiny", 2), P.ReleaseSwa(model="tiny", receipt=2),
     P.Empty()),
    ("alloc", lambda c: c.alloc("tiny", 2), P.Alloc(model="tiny", n=2),
     P.AllocResult(full_pages=PG, swa_pages=PG)),
    ("free", lambda c: c.free("tiny", array("i", [3, 4]), swa_pages=[4]),
     P.Free(model="tiny", full_pages=PG, swa_pages=PG[4:]), P.Empty()),
    ("insert", lambda c: c.insert("tiny", TOKB, PG, PG, 4, 2, lock=True),
     P.Insert(model="tiny", tokens=TOKB, full_pages=PG, swa_pages=PG, prev_prefix_len=4,
              swa_evicted_len=2, lock=True), INSERT),
    ("cache_unfinished", lambda c: c.cache_unfinished("tiny", TOK, [3, 4], [], 4, 0, receipt=11),
     P.CacheUnfinished(model="tiny", tokens=TOKB, full_pages=PG, prev_prefix_len=4,
                       receipt=11), INSERT),
    ("cache_finished", lambda c: c.cache_finished("tiny", TOK, [3, 4], prev_prefix_len=4),
     P.CacheFinished(model="tiny", tokens=TOKB, full_pages=PG, prev_prefix_len=4), INSERT),
    ("evict", lambda c: c.evict("tiny", full_pages=3), P.Evict(model="tiny", full_pages=3),
     P.EvictResult(full_pages=3, swa_pages=0)),
    ("stats", lambda c: c.stats("tiny"), P.Stats(model="tiny"),
     P.StatsResult(tenant="acme", namespace="ns-acme", models={"tiny": {"full_pages": 3}})),
    ("stats-all", lambda c: c.stats(), P.Stats(), P.StatsResult(tenant="acme",
                                                                namespace="ns-acme", models={})),
]


@pytest.mark.parametrize("name, call, expected, result", CALLS, ids=[c[0] for c in CALLS])
def test_each_operation(fake_daemon: Any, name: str, call: Any, expected: P.Request,
                        result: P.Result) -> None:
    d = fake_daemon(lambda req: P.ok_frame(req.id, result))
    c = connect(d)
    got = call(c)
    assert got == result and type(got) is type(result)
    sent = d.requests[-1]
    assert sent.id == 2
    expected.id = 2
    assert sent == expected


def test_request_ids_increment(fake_daemon: Any) -> None:
    d = fake_daemon(lambda req: P.ok_frame(req.id, P.PingResult(payload=req.payload)))
    c = connect(d)
    for i in range(5):
        assert c.ping(bytes([i])).payload == bytes([i])
    assert [r.id for r in d.requests] == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------------------- errors

@pytest.mark.parametrize("code", P.ALL_CODES)
def test_error_responses_raise_the_mapped_error_and_the_session_survives(
        fake_daemon: Any, code: str) -> None:
    from radixd_client.errors import CODE_TO_ERROR

    def handler(req: Any) -> bytes:
        if isinstance(req, P.Alloc):
            return P.error_frame(req.id, code, "refused", {"full": {"available": 0}})
        return P.ok_frame(req.id, P.PingResult(payload=b"ok"))

    d = fake_daemon(handler)
    c = connect(d)
    with pytest.raises(CODE_TO_ERROR[code]) as e:
        c.alloc("tiny", 1000)
    assert e.value.code == code and e.value.details == {"full": {"available": 0}}
    assert c.ping().payload == b"ok"


def test_error_with_id_zero_answers_the_request_in_flight(fake_daemon: Any) -> None:
    d = fake_daemon(lambda req: P.error_frame(0, P.Code.BAD_FRAME, "malformed request")
                    if isinstance(req, P.Match) else P.ok_frame(req.id, P.PingResult(payload=b"")))
    c = connect(d)
    with pytest.raises(ProtocolError, match="malformed"):
        c.match("tiny", TOK)
    assert c.ping().payload == b""


def test_auth_failure_raises_from_the_constructor(fake_daemon: Any) -> None:
    d = fake_daemon(hello_error=(P.Code.AUTH_FAILED, "wrong token"))
    with pytest.raises(AuthError, match="wrong token") as e:
        connect(d)
    assert e.value.code == "auth_failed"
    assert d.client_sock.fileno() == -1  # the client closed its socket


def test_out_of_memory_details(fake_daemon: Any) -> None:
    counts = {"full": {"available": 1, "evictable": 0, "locked": 9, "held": 2}}
    d = fake_daemon(lambda req: P.error_frame(req.id, P.Code.OUT_OF_MEMORY, "no room", counts))
    c = connect(d)
    with pytest.raises(OutOfMemory) as e:
        c.alloc("tiny", 50)
    assert e.value.details == counts


def test_too_large_request_is_refused_locally(fake_daemon: Any, kit: Any) -> None:
    d = fake_daemon(hello=kit.hello_result(max_frame=256))
    c = connect(d)
    with pytest.raises(ProtocolError) as e:
        c.match("tiny", list(range(100)))
    assert e.value.code == P.Code.FRAME_TOO_LARGE and e.value.details["limit"] == 256
    assert len(d.requests) == 1  # only the hello went out
    assert c.unlock("tiny", 1) == P.Empty()  # the session is fine


# ---------------------------------------------------------------------------- framing

def test_response_dribbled_byte_by_byte(fake_daemon: Any) -> None:
    def handler(req: Any) -> list[bytes]:
        frame = P.ok_frame(req.id, MATCH)
        return [frame[i:i + 1] for i in range(len(frame))]

    d = fake_daemon(handler, chunk_delay=0.0005)
    c = connect(d)
    assert c.match("tiny", TOK) == MATCH
    assert c.match("tiny", TOK) == MATCH


def test_header_split_across_reads(fake_daemon: Any) -> None:
    def handler(req: Any) -> list[bytes]:
        frame = P.ok_frame(req.id, MATCH)
        return [frame[:1], frame[1:3], frame[3:6], frame[6:]]

    c = connect(fake_daemon(handler, chunk_delay=0.01))
    assert c.match("tiny", TOK) == MATCH


def test_two_responses_in_one_write_are_read_exactly(fake_daemon: Any) -> None:
    """Two responses in one write: the second is kept (not lost) and answers the next call."""
    def handler(req: Any) -> Any:
        if isinstance(req, P.Ping) and req.payload == b"first":
            # answer this request and, in the same write, the next one (id + 1)
            return P.ok_frame(req.id, P.PingResult(payload=b"1")) + \
                P.ok_frame(req.id + 1, P.PingResult(payload=b"2"))
        return None  # already answered

    c = connect(fake_daemon(handler))
    assert c.ping(b"first").payload == b"1"
    assert c.ping(b"second").payload == b"2"


def test_large_response_grows_the_buffer(fake_daemon: Any) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB, beyond the initial 64 KiB buffer
    d = fake_daemon(lambda req: P.ok_frame(req.id, P.PingResult(
        payload=big if req.payload == b"big" else b"small")))
    c = connect(d)
    first = c.ping(b"big")
    assert first.payload == big
    assert c.ping(b"x").payload == b"small"
    assert c.ping(b"big").payload == big
    assert first.payload == big  # results own their bytes: reusing the buffer changed nothing


@pytest.mark.parametrize("cut", ["before", "mid-header", "mid-body"])
def test_daemon_gone_mid_call_raises_connection_lost(fake_daemon: Any, kit: Any,
                                                     cut: str) -> None:
    def handler(req: Any) -> Any:
        frame = P.ok_frame(req.id, MATCH)
        return {"before": [kit.CLOSE], "mid-header": [frame[:2], kit.CLOSE],
                "mid-body": [frame[:9], kit.CLOSE]}[cut]

    c = connect(fake_daemon(handler))
    with pytest.raises(ConnectionLost) as e:
        c.match("tiny", TOK)
    assert "reconnect" in e.value.message and e.value.code == "connection_lost"
    assert c.closed
    with pytest.raises(ConnectionLost):
        c.ping()


def test_broken_pipe_on_send_raises_connection_lost(fake_daemon: Any) -> None:
    d = fake_daemon()
    c = connect(d)
    d.sock.close()
    with pytest.raises(ConnectionLost):
        for _ in range(100):  # the first sends may still land in the buffer
            c.insert("tiny", list(range(4096)), list(range(1024)))
    assert c.closed


def test_mismatched_response_id_drops_the_connection(fake_daemon: Any) -> None:
    c = connect(fake_daemon(lambda req: P.ok_frame(req.id + 5, P.Empty())))
    with pytest.raises(ConnectionLost, match="does not match"):
        c.unlock("tiny", 1)
    assert c.closed


def test_garbage_response_drops_the_connection(fake_daemon: Any) -> None:
    c = connect(fake_daemon(lambda req: P.HEADER.pack(3) + b"\xc1\xc1\xc1"))
    with pytest.raises(ConnectionLost, match="undecodable"):
        c.ping()


def test_undecodable_result_is_a_protocol_error(fake_daemon: Any) -> None:
    d = fake_daemon(lambda req: P.ok_frame(req.id, {"receipt": "not an int"}))
    c = connect(d)
    with pytest.raises(ProtocolError, match="undecodable lock result"):
        c.lock("tiny", 1)
    assert not c.closed


def test_timeout_closes_and_raises_timed_out(fake_daemon: Any) -> None:
    d = fake_daemon(lambda req: None if isinstance(req, P.Match) else P.ok_frame(req.id, P.Empty()))
    d.client_sock.settimeout(0.2)
    c = connect(d)
    with pytest.raises(TimedOut) as e:
        c.match("tiny", TOK)
    assert isinstance(e.value, ConnectionLost) and e.value.code == "timeout"
    assert c.closed


# ---------------------------------------------------------------------------- batch

def _batch_handler(items: list[P.BatchItem] | None = None) -> Any:
    def handler(req: Any) -> bytes:
        assert isinstance(req, P.Batch)
        if items is not None:
            return P.ok_frame(req.id, P.BatchResult(results=items))
        out = []
        for op in req.ops:
            if isinstance(op, P.Match):
                out.append(P.BatchItem(ok=True, result=P.msgspec.Raw(P.encode_body(MATCH))))
            elif isinstance(op, P.Alloc):
                out.append(P.BatchItem(ok=False, error=P.Error(
                    code=P.Code.OUT_OF_MEMORY, message="full", details={"n": op.n})))
                if req.stop_on_error:
                    break
            else:
                out.append(P.BatchItem(ok=True, result=P.msgspec.Raw(
                    P.encode_body(P.LockResult(receipt=1)))))
        return P.ok_frame(req.id, P.BatchResult(results=out))
    return handler


def test_batch_sends_one_frame_and_reports_per_item(fake_daemon: Any) -> None:
    d = fake_daemon(_batch_handler())
    c = connect(d)
    with c.batch() as b:
        f1 = b.match("tiny", TOK)
        f2 = b.alloc("tiny", 99)
        f3 = b.lock("tiny", 5)
        with pytest.raises(RuntimeError, match="not been sent"):
            f1.result()
    assert d.ops() == ["hello", "batch"]
    sent = d.requests[1]
    assert sent.stop_on_error is True
    assert sent.ops == [P.Match(model="tiny", tokens=TOKB), P.Alloc(model="tiny", n=99),
                        P.Lock(model="tiny", node=5)]
    assert all(op.id == 0 for op in sent.ops)
    assert f1.result() == MATCH and f1.exception() is None
    with pytest.raises(OutOfMemory) as e:
        f2.result()
    assert e.value.details == {"n": 99} and f2.exception() is e.value
    with pytest.raises(BatchSkipped, match="earlier operation .* failed .*out_of_memory") as s:
        f3.result()
    assert s.value.__cause__ is e.value
    assert "ok" in repr(f1) and "failed" in repr(f2)


def test_batch_without_stop_on_error_runs_everything(fake_daemon: Any) -> None:
    c = connect(fake_daemon(_batch_handler()))
    with c.batch(stop_on_error=False) as b:
        f1, f2, f3 = b.alloc("tiny", 1), b.match("tiny", TOK), b.lock("tiny", 5)
    with pytest.raises(OutOfMemory):
        f1.result()
    assert f2.result() == MATCH and f3.result() == P.LockResult(receipt=1)


def test_batch_placeholder_errors_after_a_failure_are_skips(fake_daemon: Any) -> None:
    """A daemon may answer the ops after a failure with placeholder errors: still skips."""
    items = [P.BatchItem(ok=False, error=P.Error(code=P.Code.BAD_RECEIPT, message="no")),
             P.BatchItem(ok=False, error=P.Error(code=P.Code.NOT_EXECUTED,
                                                 message="not executed: an earlier operation "
                                                         "of the batch failed"))]
    c = connect(fake_daemon(_batch_handler(items)))
    with c.batch() as b:
        f1, f2 = b.unlock("tiny", 1), b.unlock("tiny", 2)
    with pytest.raises(ReceiptError):
        f1.result()
    with pytest.raises(BatchSkipped):
        f2.result()


def test_batch_of_every_op_decodes_each_result(fake_daemon: Any) -> None:
    results = [P.PingResult(payload=b"p"), MATCH, P.LockResult(receipt=3), P.Empty(), P.Empty(),
               P.AllocResult(full_pages=PG, swa_pages=b""), P.Empty(), INSERT, INSERT, INSERT,
               P.EvictResult(full_pages=1, swa_pages=0),
               P.StatsResult(tenant="a", namespace="n", models={})]
    items = [P.BatchItem(ok=True, result=P.msgspec.Raw(P.encode_body(r))) for r in results]
    d = fake_daemon(_batch_handler(items))
    c = connect(d)
    with c.batch() as b:
        futures = [b.ping(b"p"), b.match("tiny", TOK), b.lock("tiny", 1), b.unlock("tiny", 3),
                   b.release_swa("tiny", 3), b.alloc("tiny", 1), b.free("tiny", [3]),
                   b.insert("tiny", TOK, PG), b.cache_unfinished("tiny", TOK, PG),
                   b.cache_finished("tiny", TOK, PG, receipt=3), b.evict("tiny", 1), b.stats()]
    assert len(b) == len(results)
    assert [f.result() for f in futures] == results
    assert [type(f.result()) for f in futures] == [type(r) for r in results]


def test_batch_refused_as_a_whole_raises_at_the_end_of_the_block(fake_daemon: Any) -> None:
    c = connect(fake_daemon(lambda req: P.error_frame(req.id, P.Code.TOO_MANY_INFLIGHT, "many")))
    with pytest.raises(LimitExceeded), c.batch() as b:
        f = b.ping()
    with pytest.raises(BatchSkipped, match="not run: the batch failed as a whole") as e:
        f.result()
    assert isinstance(e.value.__cause__, LimitExceeded)


def test_batch_cut_after_it_was_sent_may_have_run(fake_daemon: Any, kit: Any) -> None:
    """The daemon may have carried the batch out before the connection went: its operations
    are not said to have not run (a free or an unlock that did run, retried, would be refused
    or, after a reconnect, hit another request's ids)."""
    c = connect(fake_daemon(lambda req: kit.CLOSE if isinstance(req, P.Batch) else None))
    with pytest.raises(ConnectionLost), c.batch() as b:
        f = b.unlock("tiny", 1)
    with pytest.raises(BatchSkipped, match="no result, it may have run") as e:
        f.result()
    assert isinstance(e.value.__cause__, ConnectionLost)


def test_a_batch_whose_answer_cannot_be_decoded_may_have_run(fake_daemon: Any) -> None:
    """The daemon ran it and answered; only this client cannot read the answer."""
    c = connect(fake_daemon(lambda req: P.ok_frame(req.id, {"results": "not a list"})))
    with pytest.raises(UndecodableResult), c.batch() as b:
        f = b.unlock("tiny", 1)
    with pytest.raises(BatchSkipped, match="no result, it may have run"):
        f.result()
    assert not c.closed


def test_calls_bound_to_two_sessions_at_once_are_refused(fake_daemon: Any) -> None:
    """Nested on_session blocks naming different sessions: no call could go to both."""
    d = fake_daemon()
    c = connect(d)
    with c.on_session(c.restarts):
        assert c.unlock("tiny", 1) is not None
        with pytest.raises(SessionRestarted, match="not sent"), c.on_session(c.restarts + 1):
            c.unlock("tiny", 2)
        c.unlock("tiny", 3)  # the outer binding holds again
    assert [getattr(r, "receipt", None) for r in d.requests] == [None, 1, 3]


def test_batch_not_sent_when_the_block_raises(fake_daemon: Any) -> None:
    d = fake_daemon(_batch_handler())
    c = connect(d)
    with pytest.raises(KeyError), c.batch() as b:
        f = b.match("tiny", TOK)
        raise KeyError("engine bug")
    assert d.ops() == ["hello"]
    with pytest.raises(BatchSkipped, match="not run: the batch was not sent"):
        f.result()
    with pytest.raises(RuntimeError, match="already sent"):
        b.ping()


def test_empty_batch_sends_nothing(fake_daemon: Any) -> None:
    d = fake_daemon()
    c = connect(d)
    with c.batch():
        pass
    assert d.ops() == ["hello"]


def test_batch_with_too_few_results(fake_daemon: Any) -> None:
    c = connect(fake_daemon(_batch_handler([])))
    with c.batch() as b:
        f = b.ping()
    with pytest.raises(ProtocolError, match="answered 0 of 1"):
        f.result()


# ---------------------------------------------------------------------------- locked()

def _lock_handler(receipt: int | None) -> Any:
    def handler(req: Any) -> bytes:
        if isinstance(req, P.Match):
            m = P.MatchResult(prefix_len=8, full_pages=PG, swa_pages=b"", node=5,
                              full_hit_len=8, host_hit_len=0,
                              receipt=receipt if req.lock else None)
            return P.ok_frame(req.id, m)
        if isinstance(req, P.Unlock) and req.receipt == 404:
            return P.error_frame(req.id, P.Code.BAD_RECEIPT, "gone")
        if isinstance(req, P.CacheUnfinished):
            return P.ok_frame(req.id, INSERT)
        return P.ok_frame(req.id, P.Empty())
    return handler


def test_locked_unlocks_on_exit(fake_daemon: Any) -> None:
    d = fake_daemon(_lock_handler(31))
    c = connect(d)
    with c.locked("tiny", TOK) as m:
        assert m.receipt == 31
        assert d.ops() == ["hello", "match"] and d.requests[1].lock is True
    assert d.ops() == ["hello", "match", "unlock"]
    assert d.requests[2].receipt == 31 and d.requests[2].model == "tiny"


def test_locked_unlocks_when_the_block_raises(fake_daemon: Any) -> None:
    d = fake_daemon(_lock_handler(31))
    c = connect(d)
    with pytest.raises(ValueError, match="engine"), c.locked("tiny", TOK):
        raise ValueError("engine")
    assert d.ops()[-1] == "unlock"


def test_locked_does_not_mask_the_block_error_with_the_unlock_error(fake_daemon: Any) -> None:
    c = connect(fake_daemon(_lock_handler(404)))
    with pytest.raises(ValueError), c.locked("tiny", TOK):
        raise ValueError("engine")
    # without a block error, the unlock error surfaces
    with pytest.raises(ReceiptError), c.locked("tiny", TOK):
        pass


def test_locked_skips_the_unlock_when_the_receipt_was_handed_on(fake_daemon: Any) -> None:
    d = fake_daemon(_lock_handler(31))
    c = connect(d)
    with c.locked("tiny", TOK) as m:
        c.cache_unfinished("tiny", TOK, PG, receipt=m.receipt)
        m.receipt = None
    assert d.ops() == ["hello", "match", "cache_unfinished"]


def test_locked_without_receipt(fake_daemon: Any) -> None:
    d = fake_daemon(_lock_handler(None))
    c = connect(d)
    with c.locked("tiny", TOK) as m:
        assert m.receipt is None
    assert d.ops() == ["hello", "match"]


# ---------------------------------------------------------------------------- connecting

def test_connect_by_path(tmp_path: Any, kit: Any) -> None:
    path = str(tmp_path / "radixd.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    seen: list[Any] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            for _ in range(2):
                hdr = kit.recv_exact(conn, 4)
                req = P.decode_request(kit.recv_exact(conn, P.HEADER.unpack(hdr)[0]))
                seen.append(req)
                result = kit.hello_result() if isinstance(req, P.Hello) else \
                    P.PingResult(payload=req.payload)
                conn.sendall(P.ok_frame(req.id, result))
            kit.recv_exact(conn, 1)  # until the client closes

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with Client(path, "tok", client_name="by-path", timeout=5) as c:
        assert c.path == path and c.session == 7
        assert c.ping(b"x").payload == b"x"
    assert c.closed
    t.join(5)
    listener.close()
    assert seen[0].client == "by-path" and seen[0].token == "tok"


def test_connect_failures(tmp_path: Any) -> None:
    with pytest.raises(ConnectFailed, match="cannot connect to radixd at") as e:
        Client(str(tmp_path / "missing.sock"))
    assert e.value.code == "connect_failed" and isinstance(e.value, RadixdError)
    assert not isinstance(e.value, ConnectionLost)


def test_close_is_idempotent_and_calls_after_close_raise(fake_daemon: Any) -> None:
    d = fake_daemon()
    with connect(d) as c:
        pass
    c.close()
    assert c.closed and "closed" in repr(c)
    with pytest.raises(ConnectionLost, match="closed by the client"):
        c.ping()
    with pytest.raises(ConnectionLost):
        c.attach("tiny")


def test_bad_argument_from_a_daemon_is_not_fatal(fake_daemon: Any) -> None:
    n = {"calls": 0}

    def handler(req: Any) -> bytes:
        n["calls"] += 1
        if n["calls"] == 1:
            return P.error_frame(req.id, P.Code.BAD_ARGUMENT, "tokens not page aligned")
        return P.ok_frame(req.id, INSERT)

    c = connect(fake_daemon(handler))
    with pytest.raises(BadArgument):
        c.insert("tiny", TOK[:3], PG)
    assert c.insert("tiny", TOK, PG) == INSERT
