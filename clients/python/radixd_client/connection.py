"""The radixd connection rules without any I/O (the h11 pattern): bytes in, events out.

:class:`ClientConnection` is what both clients are built on: requests in, frame bytes out;
received bytes in, decoded replies out. It owns request ids, the in-order matching of responses
to requests (docs/protocol.md 3.3), the hello gate, the response size limit and the complete
decoding of each response while its bytes are still in the read buffer. :class:`FrameSplitter`
is the daemon's side: received bytes in, request bodies out, under ``max_frame_bytes``.

Neither reads nor writes a socket, so the rules are written once and tested byte by byte; the
I/O layers (``client.py``, ``aio.py``, ``daemon/server.py``) only move bytes and descriptors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from .errors import AuthError, ProtocolError, RadixdError, UndecodableResult, error_from_wire
from .protocol import (
    HEADER,
    HEADER_SIZE,
    Batch,
    Code,
    HelloResult,
    Request,
    decode_response,
    decode_result,
    error_frame,
)

__all__ = [
    "MIN_RESPONSE_CAP",
    "BrokenStream",
    "ClientConnection",
    "FrameSplitter",
    "FrameTooLarge",
    "Reply",
    "apply_hello",
    "decode_batch",
    "decode_ok",
]

#: Largest response body accepted, whatever the daemon's request limit is: a length prefix beyond
#: this means the stream is out of step, not a big answer.
MIN_RESPONSE_CAP = 1 << 30
INITIAL_BUFFER = 64 * 1024

_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)


class BrokenStream(Exception):
    """The stream cannot be trusted any more (garbage, an id out of order, a length beyond any
    limit): the I/O layer closes the connection, ending the session. ``__cause__`` says why
    when there is more to say (the daemon's own error, for an id-0 refusal)."""


def decode_ok(op: str, raw: msgspec.Raw) -> Any:
    """The caller's value of a success response of ``op``; undecodable bytes are a
    :class:`ProtocolError` (the stream is fine, this one result is not)."""
    try:
        return decode_result(op, raw)
    except _DECODE_ERRORS as exc:
        raise UndecodableResult(f"undecodable {op} result: {exc}", code=Code.BAD_FRAME) from exc


def decode_batch(ops: list[str], raw: msgspec.Raw) -> list[tuple[bool, Any]]:
    """Every item of a batch response, decoded now: ``(ran_ok, value)`` with the typed result,
    or the error the daemon reported, or the :class:`ProtocolError` of an item that does not
    decode. ``ops`` are the batch's operations, in order; the daemon may answer fewer.

    Items are ``msgspec.Raw`` views into the read buffer, which the next response overwrites:
    decoding them later once handed a task another request's results (fixed in 7392921).
    """
    try:
        items = decode_result("batch", raw).results  # type: ignore[attr-defined]
    except _DECODE_ERRORS as exc:
        raise UndecodableResult(f"undecodable batch result: {exc}",
                                code=Code.BAD_FRAME) from exc
    outcomes: list[tuple[bool, Any]] = []
    for op, item in zip(ops, items, strict=False):
        if not item.ok:
            outcomes.append((False, error_from_wire(item.error)))
            continue
        try:
            outcomes.append((True, decode_result(op, item.result)))
        except _DECODE_ERRORS as exc:
            outcomes.append((True, UndecodableResult(
                f"undecodable {op} result in a batch: {exc}", code=Code.BAD_FRAME)))
    return outcomes


def apply_hello(target: Any, hello: HelloResult) -> None:
    """What a session learns from its hello, as attributes of the client object (both clients
    expose the same ones)."""
    target.hello_result = hello
    target.session = hello.session
    target.instance = hello.instance
    target.version = hello.version
    target.tenant = hello.tenant
    target.namespace = hello.namespace
    target.models = {m.name: m for m in hello.models}
    target.limits = hello.limits


class Reply(msgspec.Struct):
    """One response, matched to its request and decoded. ``value`` is the result (for a batch,
    :func:`decode_batch`'s outcomes) when ``ok``, else the :class:`RadixdError` to raise.
    ``context`` is what the I/O layer registered with the request (a future, say).

    A msgspec struct rather than a plain class: one is made per response, on the hot path, and
    this is a third of the cost."""

    id: int
    op: str
    ok: bool
    value: Any
    context: Any


class ClientConnection:
    """The client side of one connection: requests in, frame bytes out; bytes in, replies out.

    Responses come back in request order (docs/protocol.md 3.3), so each one answers the oldest
    unanswered request: its id must be that request's, or 0 with an error (the daemon could not
    read the id). Anything else is a :class:`BrokenStream`. With ``in_order=False`` a response
    may answer any pending request by its id (the asyncio client has always accepted that, and
    its tests pin it); an id-0 error still answers the oldest, and an id that is not pending is
    still a broken stream.

    Reading is zero-copy: the I/O layer reads into :meth:`recv_buffer` and reports the count to
    :meth:`received`. Each reply is decoded completely (batch items included) before
    :meth:`next_event` returns it, so no view of the buffer outlives the frame's bytes; a buffer
    still viewed anyway is never written again.
    """

    def __init__(self, *, in_order: bool = True, initial_buffer: int = INITIAL_BUFFER) -> None:
        self.in_order = in_order
        self._next_id = 1
        # id -> (op, batch ops or None, context), oldest first
        self._pending: dict[int, tuple[str, list[str] | None, Any]] = {}
        self._buf = bytearray(initial_buffer)
        self._view = memoryview(self._buf)
        self._start = 0  # first unconsumed byte
        self._end = 0  # end of the bytes received
        self.max_request = 1 << 62  # until the hello tells the daemon's limit
        self.max_response = MIN_RESPONSE_CAP
        self.hello: HelloResult | None = None
        self._hello_pending = False

    # -- requests -------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Requests sent and not answered yet (cancelled callers' included: the daemon still
        answers them)."""
        return len(self._pending)

    def send(self, op: str, req: Request, context: Any = None) -> bytes:
        """The frame to write for ``req`` (its id assigned here); the request is pending from now
        on. Refused locally, with nothing pending, when it is over the daemon's limit or comes
        before the hello (the daemon would refuse it and, for size, drop the connection)."""
        if self.hello is None:
            # (the errors the daemon would answer with, raised before anything is sent)
            if op != "hello":
                raise AuthError(f"{op} before hello: the session is not open yet",
                                code=Code.NOT_AUTHENTICATED)
            if self._hello_pending:
                raise AuthError("a hello is already in flight", code=Code.NOT_AUTHENTICATED)
        elif op == "hello":
            raise AuthError(f"this connection is already session {self.hello.session}",
                            code=Code.ALREADY_AUTHENTICATED)
        rid = self._next_id
        self._next_id = rid + 1
        req.id = rid
        body = _encode_body(req)
        size = len(body)
        if size > self.max_request:
            raise ProtocolError(
                f"request of {size} bytes; the daemon's limit is {self.max_request} "
                "(max_frame_bytes): split it", code=Code.FRAME_TOO_LARGE,
                details={"limit": self.max_request, "size": size})
        ops = [o.__struct_config__.tag for o in req.ops] if type(req) is Batch else None
        self._pending[rid] = (op, ops, context)
        if op == "hello":
            self._hello_pending = True
        return HEADER.pack(size) + body

    def abandon(self) -> list[Any]:
        """Forget every pending request (the connection is gone); their contexts, oldest first."""
        out = [p[2] for p in self._pending.values()]
        self._pending.clear()
        self._hello_pending = False
        return out

    # -- bytes in -------------------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes received and not yet part of a returned reply."""
        return self._end - self._start

    def recv_buffer(self) -> memoryview:
        """Where to read the next bytes into (then call :meth:`received`)."""
        if self._end == len(self._buf):
            self._make_room(len(self._buf) - self._start + 1)
        return self._view[self._end:]

    def received(self, n: int) -> None:
        """``n`` bytes were read into :meth:`recv_buffer`."""
        self._end += n

    def read_reply(self, recv_into: Callable[[memoryview], int]) -> Reply | None:
        """The next reply, reading with ``recv_into`` (a blocking socket's) as often as it takes;
        None if the stream ends first. The blocking client's hot path in one call instead of a
        :meth:`next_event` / :meth:`recv_buffer` / :meth:`received` round per read."""
        reply = self.next_event() if self._end != self._start else None
        while reply is None:
            if self._end == len(self._buf):
                self._make_room(len(self._buf) - self._start + 1)
            k = recv_into(self._view[self._end :])
            if not k:
                return None
            self._end += k
            reply = self.next_event()
        return reply

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes read elsewhere, copied in."""
        n = len(data)
        if self._end + n > len(self._buf):
            self._make_room(self._end - self._start + n)
        self._view[self._end : self._end + n] = data
        self._end += n

    def _make_room(self, need: int) -> None:
        """Room for ``need`` bytes from the first unconsumed one: moved to the front, or into a
        new buffer (never a resize: an escaped view would make it fail)."""
        have = self._end - self._start
        if need <= len(self._buf) and self._start:
            self._buf[:have] = self._buf[self._start : self._end]
        else:
            buf = bytearray(max(need, 2 * len(self._buf)))
            buf[:have] = self._view[self._start : self._end]
            self._buf, self._view = buf, memoryview(buf)
        self._start, self._end = 0, have

    def next_event(self) -> Reply | None:
        """The next reply, or None until more bytes arrive. Raises :class:`BrokenStream`."""
        start, end = self._start, self._end
        if end - start < HEADER_SIZE:
            return None
        n = HEADER.unpack_from(self._buf, start)[0]
        if n > self.max_response:
            raise BrokenStream(f"a response of {n} bytes announced, beyond any limit; the "
                               "stream is out of step")
        stop = start + HEADER_SIZE + n
        if stop > end:
            if stop > len(self._buf):
                self._make_room(HEADER_SIZE + n)
            return None
        body = self._view[start + HEADER_SIZE : stop]
        if stop == end:
            self._start = self._end = 0
        else:
            self._start = stop
        # One function for the whole reply (it is every call's path); ``resp`` views the buffer
        # and is dropped before the view is released.
        resp = None
        try:
            try:
                resp = decode_response(body)
            except _DECODE_ERRORS as exc:
                raise BrokenStream(f"undecodable response: {exc}") from exc
            rid = resp.id
            ok = resp.ok
            pending = self._pending
            if not pending:
                if rid == 0 and not ok:
                    err = error_from_wire(resp.error)
                    raise BrokenStream(f"the daemon refused a request it could not identify "
                                       f"({err.code}: {err.message})") from err
                raise BrokenStream(f"a response for unknown request id {rid}")
            oldest = next(iter(pending))
            if rid == oldest or (rid == 0 and not ok):
                rid = oldest
            elif self.in_order:
                raise BrokenStream(f"response id {rid} does not match request id {oldest} "
                                   "(responses come in request order)")
            elif rid not in pending:
                raise BrokenStream(f"a response for unknown request id {rid}")
            op, ops, context = pending.pop(rid)
            if not ok:
                value: Any = error_from_wire(resp.error)
            else:
                try:
                    value = (decode_ok(op, resp.result) if ops is None
                             else decode_batch(ops, resp.result))
                except RadixdError as exc:
                    value, ok = exc, False
            if op == "hello":
                self._hello_done(value if ok else None)
            return Reply(rid, op, ok, value, context)
        finally:
            resp = None
            try:
                body.release()
            except BufferError:
                self._abandon_buffer()

    def _hello_done(self, hello: HelloResult | None) -> None:
        """The session is open (or the hello was refused, and may be sent again)."""
        self._hello_pending = False
        if hello is not None:
            self.hello = hello
            self.max_request = hello.limits.max_frame_bytes
            self.max_response = max(MIN_RESPONSE_CAP, 4 * hello.limits.max_frame_bytes)

    def _abandon_buffer(self) -> None:
        """Something still views the buffer (a ``msgspec.Raw`` kept by a traceback): it keeps
        that one, and what was read past the frame moves to a new one."""
        have = self._end - self._start
        buf = bytearray(max(len(self._buf), have))
        buf[:have] = self._buf[self._start : self._end]
        self._buf, self._view = buf, memoryview(buf)
        self._start, self._end = 0, have


_encode_body = msgspec.msgpack.Encoder().encode


# ---------------------------------------------------------------------------- daemon side

class FrameTooLarge(Exception):
    """A length prefix over the limit: answer :meth:`frame` and close, as the frame boundary is
    lost and the stream cannot be resynchronised (docs/protocol.md 3.1)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes; the limit is {limit}")
        self.size = size
        self.limit = limit

    def frame(self) -> bytes:
        """The error frame to send before closing (id 0: the request's id was never read)."""
        return error_frame(0, Code.FRAME_TOO_LARGE,
                           f"frame of {self.size} bytes; the limit is {self.limit} "
                           "(the connection is closed: its framing is lost)",
                           {"limit": self.limit, "size": self.size})


class FrameSplitter:
    """The daemon side of one connection: received bytes in, request bodies out.

    :meth:`next_frame` hands out a view of each complete body; :meth:`done` releases it once
    handled and :meth:`compact` drops what was consumed, after the frames of a read are handled
    (deleting per frame would move the rest of the buffer each time).
    """

    __slots__ = ("_buf", "_off", "max_frame")

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf: bytes | bytearray = b""
        self._off = 0

    def feed(self, data: bytes) -> None:
        """Nothing pending (the usual case: a read ends at a frame's end): the bytes are read
        where they are, not copied; otherwise they join what is pending."""
        buf = self._buf
        if self._off == len(buf):
            self._buf = bytes(data)  # (a no-op for bytes: the daemon's reads hand bytes)
            self._off = 0
        elif isinstance(buf, bytearray):
            buf += data
        else:
            self._buf = bytearray(memoryview(buf)[self._off :])
            self._buf += data
            self._off = 0

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._off

    def next_frame(self) -> memoryview | None:
        """The next complete body, or None until more bytes arrive. Raises
        :class:`FrameTooLarge` as soon as a length over the limit is read (not the body)."""
        buf = self._buf
        off = self._off
        if len(buf) - off < HEADER_SIZE:
            return None
        size = int.from_bytes(buf[off : off + HEADER_SIZE], "little")
        if size > self.max_frame:
            raise FrameTooLarge(size, self.max_frame)
        end = off + HEADER_SIZE + size
        if end > len(buf):
            return None
        self._off = end
        return memoryview(buf)[off + HEADER_SIZE : end]

    @staticmethod
    def done(body: memoryview) -> None:
        """The body is handled: no view of the buffer may outlive it (compacting resizes)."""
        body.release()

    def compact(self) -> None:
        off = self._off
        if off:
            buf = self._buf
            if off == len(buf):
                self._buf = b""
            elif isinstance(buf, bytearray):
                del buf[:off]
            else:
                self._buf = bytearray(memoryview(buf)[off:])
            self._off = 0
