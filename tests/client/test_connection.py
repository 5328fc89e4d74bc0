"""The connection rules byte by byte, against the sans-IO connection: no socket, no daemon.

Each test feeds the exact bytes a daemon (or a client) would send and checks what comes out:
framing across reads, several frames in one read, length limits, request ids and the order of
responses (docs/protocol.md 3.1 and 3.3), the hello gate, and batch items decoded before the
buffer holding them is written again.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from radixd_client import protocol as P
from radixd_client.connection import (
    MIN_RESPONSE_CAP,
    BrokenStream,
    ClientConnection,
    FrameSplitter,
    FrameTooLarge,
    Reply,
)
from radixd_client.errors import AuthError, OutOfMemory, ProtocolError

LIMITS = P.Limits(max_frame_bytes=4096, max_tokens=1 << 16, max_inflight=8)
HELLO = P.HelloResult(session=3, version=P.PROTOCOL_VERSION, instance="i", tenant="t",
                      namespace="ns", models=[], limits=LIMITS)


def body_of(frame: bytes) -> bytes:
    assert P.HEADER.unpack_from(frame)[0] == len(frame) - P.HEADER_SIZE
    return frame[P.HEADER_SIZE:]


def opened(**kw: Any) -> ClientConnection:
    """A connection whose hello succeeded."""
    conn = ClientConnection(**kw)
    frame = conn.send("hello", P.Hello(token="x"))
    assert P.decode_request(body_of(frame)).id == 1
    conn.receive_data(P.ok_frame(1, HELLO))
    reply = conn.next_event()
    assert reply is not None and reply.ok and reply.value == HELLO
    return conn


def ping_reply(rid: int, payload: bytes) -> bytes:
    return P.ok_frame(rid, P.PingResult(payload=payload))


def events(conn: ClientConnection) -> list[Reply]:
    out = []
    while (r := conn.next_event()) is not None:
        out.append(r)
    return out


# ---------------------------------------------------------------------------- requests out

def test_requests_get_increasing_ids_and_whole_frames() -> None:
    conn = opened()
    frames = [conn.send("ping", P.Ping(payload=bytes([i])), context=i) for i in range(3)]
    reqs = [P.decode_request(body_of(f)) for f in frames]
    assert [r.id for r in reqs] == [2, 3, 4]
    assert reqs[1] == P.Ping(id=3, payload=b"\x01")
    assert conn.pending == 3


def test_hello_gate() -> None:
    conn = ClientConnection()
    with pytest.raises(AuthError) as e:
        conn.send("ping", P.Ping())
    assert e.value.code == P.Code.NOT_AUTHENTICATED and conn.pending == 0
    conn.send("hello", P.Hello())
    with pytest.raises(AuthError):
        conn.send("hello", P.Hello())  # one in flight already
    with pytest.raises(AuthError):
        conn.send("ping", P.Ping())  # not open until the answer
    conn.receive_data(P.error_frame(1, P.Code.AUTH_FAILED, "wrong token"))
    reply = conn.next_event()
    assert reply is not None and not reply.ok and isinstance(reply.value, AuthError)
    assert conn.hello is None
    conn.send("hello", P.Hello())  # a refused hello may be retried
    conn.receive_data(P.ok_frame(2, HELLO))
    assert conn.next_event().ok  # type: ignore[union-attr]
    assert conn.hello == HELLO and conn.max_request == 4096
    conn.send("ping", P.Ping())
    with pytest.raises(AuthError) as e:
        conn.send("hello", P.Hello())
    assert e.value.code == P.Code.ALREADY_AUTHENTICATED
    assert conn.pending == 1  # only the ping


def test_request_over_the_daemons_limit_is_refused_before_sending() -> None:
    conn = opened()
    with pytest.raises(ProtocolError) as e:
        conn.send("ping", P.Ping(payload=b"x" * 5000))
    assert e.value.code == P.Code.FRAME_TOO_LARGE and e.value.details["limit"] == 4096
    assert conn.pending == 0
    near = conn.send("ping", P.Ping(payload=b"x" * 4000))
    assert len(near) - P.HEADER_SIZE <= 4096


# ---------------------------------------------------------------------------- bytes in

def test_partial_frames_wait_for_the_rest() -> None:
    conn = opened()
    conn.send("ping", P.Ping(payload=b"abc"))
    frame = ping_reply(2, b"abc")
    for i in range(len(frame) - 1):
        conn.receive_data(frame[i : i + 1])
        assert conn.next_event() is None
    conn.receive_data(frame[-1:])
    reply = conn.next_event()
    assert reply is not None and reply.value == P.PingResult(payload=b"abc")
    assert conn.buffered == 0 and conn.pending == 0


def test_several_frames_in_one_chunk_and_a_partial_one_after() -> None:
    conn = opened()
    for i in range(4):
        conn.send("ping", P.Ping(payload=bytes([i])), context=f"c{i}")
    chunk = b"".join(ping_reply(2 + i, bytes([i])) for i in range(3))
    last = ping_reply(5, b"\x03")
    conn.receive_data(chunk + last[:5])
    got = events(conn)
    assert [(r.id, r.context, r.value.payload) for r in got] == [
        (2, "c0", b"\x00"), (3, "c1", b"\x01"), (4, "c2", b"\x02")]
    assert conn.buffered == 5
    conn.receive_data(last[5:])
    assert [r.id for r in events(conn)] == [5]


def test_zero_copy_reads_grow_the_buffer_for_a_large_response() -> None:
    conn = ClientConnection(initial_buffer=64)
    conn.send("hello", P.Hello())
    conn.receive_data(P.ok_frame(1, HELLO))
    conn.next_event()
    big = bytes(range(256)) * 64
    conn.send("ping", P.Ping())
    frame = ping_reply(2, big)
    pos = 0
    reply = None
    while reply is None:
        buf = conn.recv_buffer()
        k = min(len(buf), 100, len(frame) - pos)
        buf[:k] = frame[pos : pos + k]
        pos += k
        conn.received(k)
        reply = conn.next_event()
    assert pos == len(frame) and reply.value.payload == big


def test_read_reply_reads_until_a_reply_or_the_end() -> None:
    """The blocking client's one-call path: reads as often as needed, keeps what it read past
    the reply, and says None when the stream ends first."""
    conn = opened()
    conn.send("ping", P.Ping())
    conn.send("ping", P.Ping())
    data = ping_reply(2, b"a") + ping_reply(3, b"b")[:7]
    chunks = [data[i : i + 3] for i in range(0, len(data), 3)]

    def recv_into(view: memoryview) -> int:
        if not chunks:
            return 0
        chunk = chunks.pop(0)
        view[: len(chunk)] = chunk
        return len(chunk)

    assert conn.read_reply(recv_into).value.payload == b"a"  # type: ignore[union-attr]
    assert conn.read_reply(recv_into) is None  # the stream ended inside the second reply
    assert conn.buffered == 7


def test_oversize_response_length_breaks_the_stream() -> None:
    conn = ClientConnection()
    assert conn.max_response == MIN_RESPONSE_CAP
    conn = opened()
    assert conn.max_response == MIN_RESPONSE_CAP  # 4 x 4096 is less: the floor holds
    conn.send("ping", P.Ping())
    conn.receive_data(P.HEADER.pack(MIN_RESPONSE_CAP + 1))
    with pytest.raises(BrokenStream, match="beyond any limit"):
        conn.next_event()


def test_garbage_body_breaks_the_stream() -> None:
    conn = opened()
    conn.send("ping", P.Ping())
    conn.receive_data(P.HEADER.pack(3) + b"\xc1\xc1\xc1")
    with pytest.raises(BrokenStream, match="undecodable"):
        conn.next_event()


# ---------------------------------------------------------------------------- ids and order

def test_error_with_id_zero_answers_the_oldest_pending_request() -> None:
    conn = opened()
    for ctx in ("first", "second"):
        conn.send("alloc", P.Alloc(model="m", n=1), context=ctx)
    conn.receive_data(P.error_frame(0, P.Code.BAD_FRAME, "malformed request")
                      + P.error_frame(3, P.Code.OUT_OF_MEMORY, "full", {"n": 1}))
    first, second = events(conn)
    assert (first.id, first.context, first.ok) == (2, "first", False)
    assert isinstance(first.value, ProtocolError) and first.value.code == P.Code.BAD_FRAME
    assert isinstance(second.value, OutOfMemory) and second.value.details == {"n": 1}


def test_error_with_id_zero_and_nothing_pending_breaks_the_stream() -> None:
    conn = opened()
    conn.receive_data(P.error_frame(0, P.Code.NOT_AUTHENTICATED, "too slow"))
    with pytest.raises(BrokenStream, match="could not identify") as e:
        conn.next_event()
    assert e.value.__cause__.code == P.Code.NOT_AUTHENTICATED  # type: ignore[union-attr]


def test_success_with_id_zero_is_not_an_answer() -> None:
    conn = opened()
    conn.send("ping", P.Ping())
    conn.receive_data(ping_reply(0, b""))
    with pytest.raises(BrokenStream, match="does not match"):
        conn.next_event()


def test_out_of_order_ids_break_the_stream() -> None:
    conn = opened()
    conn.send("ping", P.Ping())
    conn.send("ping", P.Ping())
    conn.receive_data(ping_reply(3, b""))
    with pytest.raises(BrokenStream, match="response id 3 does not match request id 2"):
        conn.next_event()


def test_unordered_connection_matches_by_id_but_not_unknown_ids() -> None:
    conn = opened(in_order=False)
    for i in range(3):
        conn.send("ping", P.Ping(), context=i)
    conn.receive_data(ping_reply(4, b"c") + ping_reply(2, b"a") + ping_reply(4, b"again"))
    a, b = conn.next_event(), conn.next_event()
    assert (a.context, b.context) == (2, 0)  # type: ignore[union-attr]
    with pytest.raises(BrokenStream, match="unknown request id 4"):
        conn.next_event()


def test_abandon_hands_back_every_pending_context_in_order() -> None:
    conn = opened()
    for ctx in "abc":
        conn.send("ping", P.Ping(), context=ctx)
    assert conn.abandon() == ["a", "b", "c"] and conn.pending == 0


# ---------------------------------------------------------------------------- decoding

def test_undecodable_result_is_an_error_reply_and_the_stream_goes_on() -> None:
    conn = opened()
    conn.send("lock", P.Lock(model="m", node=1))
    conn.send("ping", P.Ping())
    conn.receive_data(P.ok_frame(2, {"receipt": "not an int"}) + ping_reply(3, b"ok"))
    bad, good = events(conn)
    assert not bad.ok and isinstance(bad.value, ProtocolError)
    assert "undecodable lock result" in bad.value.message
    # the error's traceback may keep a view of the old buffer alive: reading goes on anyway
    conn.send("ping", P.Ping())
    conn.receive_data(ping_reply(4, b"z" * 100_000))
    assert good.value.payload == b"ok" and conn.next_event().value.payload == b"z" * 100_000


def _batch_frame(rid: int, items: list[P.BatchItem]) -> bytes:
    return P.ok_frame(rid, P.BatchResult(results=items))


def test_batch_items_are_decoded_before_the_buffer_is_reused() -> None:
    conn = opened()
    ops = [P.Ping(payload=b"p"), P.Lock(model="m", node=1), P.Alloc(model="m", n=2),
           P.Lock(model="m", node=2)]
    conn.send("batch", P.Batch(ops=ops))
    conn.send("ping", P.Ping())
    items = [
        P.BatchItem(ok=True, result=msgspec.Raw(P.encode_body(P.PingResult(payload=b"p")))),
        P.BatchItem(ok=True, result=msgspec.Raw(P.encode_body(P.LockResult(receipt=9)))),
        P.BatchItem(ok=False, error=P.Error(code=P.Code.OUT_OF_MEMORY, message="full")),
        P.BatchItem(ok=True, result=msgspec.Raw(P.encode_body({"receipt": "bad"}))),
    ]
    # the batch answer and the next one arrive in one read, into the same buffer
    conn.receive_data(_batch_frame(2, items) + ping_reply(3, b"\xff" * 300))
    batch = conn.next_event()
    assert batch is not None and batch.ok
    outcomes = batch.value
    # overwrite everything the buffer held: the outcomes must not change
    rest = conn.next_event()
    conn.send("ping", P.Ping())
    conn.receive_data(ping_reply(4, b"\x00" * 5000))
    conn.next_event()
    assert rest.value.payload == b"\xff" * 300  # type: ignore[union-attr]
    assert outcomes[0] == (True, P.PingResult(payload=b"p"))
    assert outcomes[1] == (True, P.LockResult(receipt=9))
    assert outcomes[2][0] is False and isinstance(outcomes[2][1], OutOfMemory)
    assert outcomes[3][0] is True and isinstance(outcomes[3][1], ProtocolError)
    assert not any(isinstance(v, (msgspec.Raw, memoryview)) for _, v in outcomes)


def test_batch_answered_short_and_batch_undecodable() -> None:
    conn = opened()
    conn.send("batch", P.Batch(ops=[P.Ping(), P.Ping()]))
    conn.send("batch", P.Batch(ops=[P.Ping()]))
    one = P.BatchItem(ok=True, result=msgspec.Raw(P.encode_body(P.PingResult(payload=b""))))
    conn.receive_data(_batch_frame(2, [one]) + P.ok_frame(3, {"results": 5}))
    short, bad = events(conn)
    assert short.value == [(True, P.PingResult(payload=b""))]
    assert not bad.ok and "undecodable batch result" in bad.value.message


# ---------------------------------------------------------------------------- daemon side

def test_splitter_partial_and_several_frames() -> None:
    split = FrameSplitter(max_frame=1024)
    frames = [P.encode(P.Ping(id=i, payload=bytes(i))) for i in range(1, 4)]
    data = b"".join(frames)
    split.feed(data[:3])
    assert split.next_frame() is None
    split.feed(data[3:-2])
    got = []
    while (body := split.next_frame()) is not None:
        got.append(P.decode_request(body).id)
        split.done(body)
    assert got == [1, 2]
    split.compact()
    assert split.buffered == len(frames[2]) - 2
    split.feed(data[-2:])
    body = split.next_frame()
    assert body is not None and P.decode_request(body).id == 3
    split.done(body)
    split.compact()
    assert split.buffered == 0


def test_splitter_limit_is_inclusive_and_oversize_is_refused_from_the_header() -> None:
    split = FrameSplitter(max_frame=16)
    split.feed(P.HEADER.pack(16) + bytes(16))
    body = split.next_frame()
    assert body is not None and len(body) == 16
    split.done(body)
    split.feed(P.HEADER.pack(17))  # the body is not even needed
    with pytest.raises(FrameTooLarge) as e:
        split.next_frame()
    resp = P.decode_response(body_of(e.value.frame()))
    assert (resp.id, resp.ok) == (0, False)
    assert resp.error.code == P.Code.FRAME_TOO_LARGE  # type: ignore[union-attr]
    assert resp.error.details == {"limit": 16, "size": 17}  # type: ignore[union-attr]


def test_splitter_empty_frame_is_an_empty_body() -> None:
    split = FrameSplitter(max_frame=16)
    split.feed(P.HEADER.pack(0))
    body = split.next_frame()
    assert body is not None and len(body) == 0
    split.done(body)
    split.compact()
    assert split.buffered == 0


def test_client_and_splitter_speak_the_same_framing() -> None:
    """What the client writes, the daemon side splits back into the same requests."""
    conn = opened()
    split = FrameSplitter(max_frame=LIMITS.max_frame_bytes)
    reqs = [P.Match(model="m", tokens=P.int32_bytes(range(8))), P.Stats(),
            P.Batch(ops=[P.Ping(payload=b"q")])]
    split.feed(b"".join(conn.send(r.__struct_config__.tag, r) for r in reqs))
    out = []
    while (body := split.next_frame()) is not None:
        out.append(P.decode_request(body))
        split.done(body)
    assert out == reqs


def test_the_rules_do_no_io() -> None:
    """The connection and the operations import no I/O module: every client can use them."""
    import ast
    from pathlib import Path

    import radixd_client

    pkg = Path(radixd_client.__file__).parent
    for name in ("connection.py", "operations.py"):
        tree = ast.parse((pkg / name).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""])
                assert not {m.split(".")[0] for m in mods} & {
                    "socket", "asyncio", "selectors", "select"}, (name, mods)
