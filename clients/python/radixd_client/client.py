"""The blocking client, for engine scheduler loops.

One :class:`Client` is one connection and one daemon session. Calls are synchronous: each writes
one frame and reads exactly one response frame, so per-call overhead is one ``sendall``, two
``recv_into`` into a reused buffer, and two msgspec decodes. A client is not thread-safe; give
each thread its own (or use :class:`radixd_client.aio.AsyncClient` to share one connection among
tasks).

Everything a session holds (receipts, allocated pages) is released by the daemon when the
connection ends, however it ends. When that happens mid-call the client raises
:class:`~radixd_client.errors.ConnectionLost`: reconnect with a new ``Client`` and start over.
"""

from __future__ import annotations

import contextlib
import os
import socket
from array import array
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec

from .errors import (
    BatchSkipped,
    ConnectFailed,
    ConnectionLost,
    ProtocolError,
    RadixdError,
    TimedOut,
    error_from_wire,
)
from .protocol import (
    HEADER,
    HEADER_SIZE,
    PROTOCOL_VERSION,
    Alloc,
    AllocResult,
    Attach,
    AttachResult,
    Batch,
    CacheFinished,
    CacheUnfinished,
    Code,
    Empty,
    Evict,
    EvictResult,
    Free,
    Hello,
    HelloResult,
    Insert,
    InsertResult,
    Limits,
    Load,
    LoadResult,
    Lock,
    LockResult,
    Match,
    MatchResult,
    ModelInfo,
    Ping,
    PingResult,
    Prefetch,
    PrefetchResult,
    ReleaseSwa,
    Request,
    Response,
    Stats,
    StatsResult,
    Unlock,
    decode_response,
    decode_result,
    encode,
    int32_array,
    int32_bytes,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .pools import AttachedPools

__all__ = ["BatchFuture", "Client", "ClientBatch", "pages"]

T = TypeVar("T")

#: How many descriptors an ``attach`` response may carry (one per memfd pool; 2 today).
MAX_FDS = 16
_INITIAL_BUFFER = 64 * 1024
#: Largest response body accepted, whatever the daemon's request limit is: a length prefix beyond
#: this means the stream is out of step, not a big answer.
_MIN_RESPONSE_CAP = 1 << 30


def _apply_hello(client: Any, hello: HelloResult) -> None:
    """What a session learns from its hello, as attributes (shared by both clients)."""
    client.hello_result = hello
    client.session = hello.session
    client.instance = hello.instance
    client.version = hello.version
    client.tenant = hello.tenant
    client.namespace = hello.namespace
    client.models = {m.name: m for m in hello.models}
    client.limits = hello.limits
    client._max_request = hello.limits.max_frame_bytes
    client._max_response = max(_MIN_RESPONSE_CAP, 4 * hello.limits.max_frame_bytes)


def _take_fds(ancdata: list[tuple[int, int, bytes]], msg_flags: int, fds: list[int]) -> bool:
    """Append the SCM_RIGHTS descriptors of one recvmsg to ``fds``; False if some were cut off
    (the caller treats that as a broken stream)."""
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(cdata) - len(cdata) % 4
            fds.extend(array("i", cdata[:usable]))
    return not msg_flags & getattr(socket, "MSG_CTRUNC", 0)


#: Turns a success response's ``result`` into what the caller gets; runs while the frame's bytes
#: are still in the read buffer.
Decode = Callable[[msgspec.Raw], Any]


def decode_ok(op: str, raw: msgspec.Raw, decode: Decode | None = None) -> Any:
    """The caller's value of a success response of ``op``: ``decode(raw)`` when given, else the
    operation's result type. Undecodable bytes are a :class:`ProtocolError`."""
    if decode is not None:
        return decode(raw)
    try:
        return decode_result(op, raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable {op} result: {exc}", code=Code.BAD_FRAME) from exc


def release_view(view: memoryview) -> bool:
    """Release a view of a client's read buffer once its frame is decoded; False if something
    still exports it (a ``msgspec.Raw`` kept alive), and then the buffer must not be reused."""
    try:
        view.release()
    except BufferError:
        return False
    return True


def pages(data: bytes | bytearray | memoryview) -> array:
    """Page ids (or tokens) as returned by the daemon, as an ``array('i')``.

    ``array`` supports indexing, slicing and ``len`` like a list, converts to numpy with
    ``numpy.frombuffer(a, dtype=numpy.int32)`` and to torch with ``torch.frombuffer(a,
    dtype=torch.int32)``, both without copying.
    """
    return int32_array(data)


def _lost(why: str) -> ConnectionLost:
    return ConnectionLost(f"connection to radixd lost ({why})")


# ---------------------------------------------------------------------------- batch handles

class BatchFuture(Generic[T]):
    """The outcome of one operation queued in a batch; :meth:`result` after the ``with`` block."""

    __slots__ = ("_done", "_error", "_result", "op")

    def __init__(self, op: str) -> None:
        self.op = op
        self._done = False
        self._result: Any = None
        self._error: RadixdError | None = None

    def _set(self, result: Any) -> None:
        self._done, self._result = True, result

    def _fail(self, error: RadixdError) -> None:
        self._done, self._error = True, error

    def done(self) -> bool:
        return self._done

    def result(self) -> T:
        """The typed result; raises the operation's error if it failed (or did not run)."""
        if not self._done:
            raise RuntimeError(f"the batch holding this {self.op} has not been sent yet: read "
                               "results after its `with` block")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[no-any-return]

    def exception(self) -> RadixdError | None:
        """The operation's error, or None if it succeeded."""
        if not self._done:
            raise RuntimeError(f"the batch holding this {self.op} has not been sent yet")
        return self._error

    def __repr__(self) -> str:
        state = ("pending" if not self._done else
                 f"failed {self._error.code}" if self._error is not None else "ok")
        return f"<BatchFuture {self.op} {state}>"


class _BatchBuilder:
    """Queues operations for one ``batch`` frame. Shared by the sync and the async batch."""

    def __init__(self, stop_on_error: bool) -> None:
        self.stop_on_error = stop_on_error
        self._ops: list[Any] = []
        self._futures: list[BatchFuture[Any]] = []
        self._sent = False

    def __len__(self) -> int:
        return len(self._ops)

    def _add(self, op: str, req: Request) -> BatchFuture[Any]:
        if self._sent:
            raise RuntimeError("this batch was already sent; start a new one")
        fut: BatchFuture[Any] = BatchFuture(op)
        self._ops.append(req)
        self._futures.append(fut)
        return fut

    def _request(self) -> Batch:
        self._sent = True
        return Batch(ops=self._ops, stop_on_error=self.stop_on_error)

    def _abandon(self, why: str, cause: BaseException | None = None) -> None:
        self._sent = True
        for fut in self._futures:
            if not fut.done():
                err = BatchSkipped(f"{fut.op} not run: {why}")
                err.__cause__ = cause
                fut._fail(err)

    def _decode(self, raw: msgspec.Raw | bytes) -> list[tuple[bool, Any]]:
        """Every item of the batch's response, decoded now: ``(ran_ok, value)`` with the typed
        result, or the error the daemon reported, or the :class:`ProtocolError` of an item that
        does not decode.

        The response's items are ``msgspec.Raw`` views into the buffer the response was read
        into, and a client reuses that buffer for the next response. Called by the code that
        read the frame, before it reads again, so no view outlives its bytes (decoding later
        once handed a task another request's results).
        """
        try:
            items = decode_result("batch", raw).results  # type: ignore[attr-defined]
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"undecodable batch result: {exc}", code=Code.BAD_FRAME) from exc
        outcomes: list[tuple[bool, Any]] = []
        for fut, item in zip(self._futures, items, strict=False):  # fewer: see _distribute
            if not item.ok:
                outcomes.append((False, error_from_wire(item.error)))
                continue
            try:
                outcomes.append((True, decode_result(fut.op, item.result)))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                outcomes.append((True, ProtocolError(
                    f"undecodable {fut.op} result in a batch: {exc}", code=Code.BAD_FRAME)))
        return outcomes

    def _distribute(self, outcomes: list[tuple[bool, Any]]) -> None:
        """Settle every future from :meth:`_decode`'s outcomes, in order."""
        first_failure: RadixdError | None = None
        for i, fut in enumerate(self._futures):
            if first_failure is not None and self.stop_on_error:
                # Whatever the daemon reports for the rest (a placeholder error, or nothing),
                # these did not run.
                err = BatchSkipped(f"{fut.op} not run: an earlier operation of the batch "
                                   f"failed ({first_failure.code}) and stop_on_error is set")
                err.__cause__ = first_failure
                fut._fail(err)
                continue
            if i >= len(outcomes):
                fut._fail(ProtocolError(f"the daemon answered {len(outcomes)} of "
                                        f"{len(self._futures)} batch operations",
                                        code=Code.BAD_FRAME))
                continue
            ran_ok, value = outcomes[i]
            if isinstance(value, RadixdError):
                fut._fail(value)
                if not ran_ok and first_failure is None:
                    first_failure = value
            else:
                fut._set(value)

    # -- the operations (same arguments as the client's methods) --------------------------------

    def ping(self, payload: bytes = b"") -> BatchFuture[PingResult]:
        return self._add("ping", Ping(payload=payload))

    def match(self, model: str, tokens: Any, lock: bool = False) -> BatchFuture[MatchResult]:
        return self._add("match", Match(model=model, tokens=int32_bytes(tokens), lock=lock))

    def lock(self, model: str, node: int) -> BatchFuture[LockResult]:
        return self._add("lock", Lock(model=model, node=node))

    def unlock(self, model: str, receipt: int) -> BatchFuture[Empty]:
        return self._add("unlock", Unlock(model=model, receipt=receipt))

    def release_swa(self, model: str, receipt: int) -> BatchFuture[Empty]:
        return self._add("release_swa", ReleaseSwa(model=model, receipt=receipt))

    def alloc(self, model: str, n: int) -> BatchFuture[AllocResult]:
        return self._add("alloc", Alloc(model=model, n=n))

    def free(self, model: str, full_pages: Any = (), swa_pages: Any = ()) -> BatchFuture[Empty]:
        return self._add("free", Free(model=model, full_pages=int32_bytes(full_pages),
                                      swa_pages=int32_bytes(swa_pages)))

    def insert(self, model: str, tokens: Any, full_pages: Any, swa_pages: Any = (),
               prev_prefix_len: int = 0, swa_evicted_len: int = 0, lock: bool = False
               ) -> BatchFuture[InsertResult]:
        return self._add("insert", Insert(
            model=model, tokens=int32_bytes(tokens), full_pages=int32_bytes(full_pages),
            swa_pages=int32_bytes(swa_pages), prev_prefix_len=prev_prefix_len,
            swa_evicted_len=swa_evicted_len, lock=lock))

    def cache_unfinished(self, model: str, tokens: Any, full_pages: Any, swa_pages: Any = (),
                         prev_prefix_len: int = 0, swa_evicted_len: int = 0,
                         receipt: int | None = None) -> BatchFuture[InsertResult]:
        return self._add("cache_unfinished", CacheUnfinished(
            model=model, tokens=int32_bytes(tokens), full_pages=int32_bytes(full_pages),
            swa_pages=int32_bytes(swa_pages), prev_prefix_len=prev_prefix_len,
            swa_evicted_len=swa_evicted_len, receipt=receipt))

    def cache_finished(self, model: str, tokens: Any, full_pages: Any, swa_pages: Any = (),
                       prev_prefix_len: int = 0, swa_evicted_len: int = 0,
                       receipt: int | None = None) -> BatchFuture[InsertResult]:
        return self._add("cache_finished", CacheFinished(
            model=model, tokens=int32_bytes(tokens), full_pages=int32_bytes(full_pages),
            swa_pages=int32_bytes(swa_pages), prev_prefix_len=prev_prefix_len,
            swa_evicted_len=swa_evicted_len, receipt=receipt))

    def evict(self, model: str, full_pages: int = 0, swa_pages: int = 0, host_pages: int = 0
              ) -> BatchFuture[EvictResult]:
        return self._add("evict", Evict(model=model, full_pages=full_pages, swa_pages=swa_pages,
                                        host_pages=host_pages))

    def stats(self, model: str | None = None) -> BatchFuture[StatsResult]:
        return self._add("stats", Stats(model=model))


class ClientBatch(_BatchBuilder):
    """``with client.batch() as b:`` queues operations; the block's end sends them as one frame.

    The daemon runs them in order, atomically with respect to every other client, in one round
    trip. Each queued call returns a :class:`BatchFuture`; after the block, ``.result()`` gives
    the typed result or raises that operation's error. A failed operation does not raise at the
    end of the block: it is reported by its own future, and with ``stop_on_error`` (the default)
    the operations after it do not run and raise :class:`~radixd_client.errors.BatchSkipped`.
    The end of the block raises only when the batch as a whole could not run (connection lost,
    batch refused); then every future raises too. If the block itself raises, nothing is sent.
    """

    def __init__(self, client: Client, stop_on_error: bool) -> None:
        super().__init__(stop_on_error)
        self._client = client

    def __enter__(self) -> ClientBatch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            self._abandon("the batch was not sent: its `with` block raised", exc)
            return
        if not self._ops:
            self._sent = True
            return
        try:
            outcomes = self._client._call("batch", self._request(), self._decode)
        except RadixdError as err:
            self._abandon(f"the batch failed as a whole ({err.code})", err)
            raise
        except BaseException as err:
            self._abandon("the batch was interrupted", err)
            raise
        self._distribute(outcomes)


# ---------------------------------------------------------------------------- client

class Client:
    """A blocking connection (and session) to radixd over its Unix socket.

    ``Client(path, token, client_name=..., timeout=...)`` connects and authenticates (``hello``);
    the hello result is kept: :attr:`session`, :attr:`tenant`, :attr:`namespace`,
    :attr:`models` (name -> :class:`~radixd_client.protocol.ModelInfo`), :attr:`limits`.
    ``timeout`` (seconds, None for none) bounds each socket operation; a timeout closes the
    connection and raises :class:`~radixd_client.errors.TimedOut`.

    Token and page arguments accept ``bytes`` (already int32 little-endian), ``array('i')``,
    numpy integer arrays, torch integer tensors, or lists of ints. Page ids in results are
    ``bytes``; :func:`pages` turns them into an ``array('i')``.
    """

    session: int
    version: int
    tenant: str
    namespace: str
    models: dict[str, ModelInfo]
    limits: Limits
    hello_result: HelloResult

    def __init__(self, path: str, token: str | None = None, *, client_name: str = "",
                 timeout: float | None = None) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
        except OSError as exc:
            sock.close()
            why = exc.strerror or type(exc).__name__
            raise ConnectFailed(f"cannot connect to radixd at {path!r}: {why}") from exc
        self.path: str | None = path
        self._start(sock, token, client_name)

    @classmethod
    def from_socket(cls, sock: socket.socket, token: str | None = None, *,
                    client_name: str = "") -> Client:
        """Use an already connected stream socket (for example one end of ``socketpair()``),
        keeping its timeout; the client owns it from now on."""
        self = cls.__new__(cls)
        self.path = None
        self._start(sock, token, client_name)
        return self

    def _start(self, sock: socket.socket, token: str | None, client_name: str) -> None:
        self._sock: socket.socket | None = sock
        self._next_id = 1
        self._buf = bytearray(_INITIAL_BUFFER)
        self._view = memoryview(self._buf)
        self._pending = b""  # bytes read past the last response
        self._max_request = 1 << 62  # until hello tells the limit
        self._max_response = _MIN_RESPONSE_CAP
        self._close_reason = "closed by the client"
        try:
            hello: HelloResult = self._call(
                "hello", Hello(version=PROTOCOL_VERSION, token=token, client=client_name))
        except BaseException:
            self.close()
            raise
        _apply_hello(self, hello)

    # -- frame I/O ------------------------------------------------------------------------------

    def _broken(self, why: str, cause: BaseException | None = None) -> ConnectionLost:
        """Close the connection and return the error to raise."""
        self._close_reason = why
        self.close()
        if isinstance(cause, TimeoutError):
            err: ConnectionLost = TimedOut(f"no answer from radixd in time ({why})")
        else:
            err = _lost(why)
        err.__cause__ = cause
        return err

    def _recv_exact(self, view: memoryview, n: int, header: bool) -> None:
        sock = self._sock
        assert sock is not None
        got = 0
        while got < n:
            k = sock.recv_into(view[got:n])
            if not k:
                raise self._broken("the daemon closed the connection" if header and got == 0
                                   else "the daemon closed the connection in the middle of a "
                                   "response")
            got += k

    def _read_body_size(self, n: int) -> memoryview:
        if n > self._max_response:
            raise self._broken(f"a response of {n} bytes announced, beyond any limit; the "
                               "stream is out of step")
        if n + HEADER_SIZE > len(self._buf):
            # A new buffer rather than a resize: a msgspec.Raw from an earlier frame may still
            # reference the old one (a traceback can keep it alive), and resizing would fail.
            self._buf = bytearray(max(n, 2 * len(self._buf)))
            self._view = memoryview(self._buf)
        return self._view

    def _exchange(self, frame: bytes) -> memoryview:
        """Send one frame, read one response; the body as a view of the reused buffer."""
        sock = self._sock
        if sock is None:
            raise _lost(self._close_reason)
        try:
            sock.sendall(frame)
            # One read usually brings the whole response. Anything read past it (a daemon never
            # sends it, but a stream must not lose bytes) is kept for the next call.
            view = self._view
            got = len(self._pending)
            if got:
                view[:got] = self._pending
                self._pending = b""
            if got < HEADER_SIZE:
                k = sock.recv_into(view[got:])
                if not k and not got:
                    raise self._broken("the daemon closed the connection")
                got += k
                if got < HEADER_SIZE:
                    self._recv_exact(view[got:], HEADER_SIZE - got, False)
                    got = HEADER_SIZE
            n = HEADER.unpack_from(view)[0]
            end = HEADER_SIZE + n
            if got < end:
                body = self._read_body_size(n)
                if body is not view:  # grown: move what was read of the body
                    have = got - HEADER_SIZE
                    body[:have] = view[HEADER_SIZE:got]
                    self._recv_exact(body[have:], n - have, False)
                    return body[:n]
                self._recv_exact(view[got:], end - got, False)
            elif got > end:
                self._pending = bytes(view[end:got])
        except ConnectionLost:
            raise
        except OSError as exc:  # reset, broken pipe, timeout
            raise self._broken(f"{type(exc).__name__}: {exc}", exc) from exc
        except BaseException as exc:
            # KeyboardInterrupt (or similar) mid-frame: the stream is out of step for good.
            self._broken(f"interrupted by {type(exc).__name__} in the middle of a call", exc)
            raise
        return view[HEADER_SIZE : HEADER_SIZE + n]

    def _check_size(self, frame: bytes) -> None:
        if len(frame) - HEADER_SIZE > self._max_request:
            raise ProtocolError(
                f"request of {len(frame) - HEADER_SIZE} bytes; the daemon's limit is "
                f"{self._max_request} (max_frame_bytes): split it", code=Code.FRAME_TOO_LARGE,
                details={"limit": self._max_request, "size": len(frame) - HEADER_SIZE})

    def _response(self, rid: int, body: memoryview) -> Response:
        try:
            resp = decode_response(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise self._broken(f"undecodable response: {exc}", exc) from exc
        if resp.id != rid and not (resp.id == 0 and not resp.ok):
            # (id 0 with an error: the daemon could not read our request's id; it is still the
            # answer to the one request in flight.)
            raise self._broken(f"response id {resp.id} does not match request id {rid}")
        if not resp.ok:
            raise error_from_wire(resp.error)
        return resp

    def _call(self, op: str, req: Request, decode: Decode | None = None) -> Any:
        """One request, one response; the result decoded before the buffer is read into again
        (``decode`` for a batch, whose items must be decoded too)."""
        rid = self._next_id
        self._next_id = rid + 1
        req.id = rid
        frame = encode(req)
        self._check_size(frame)
        body = self._exchange(frame)
        try:
            return decode_ok(op, self._response(rid, body).result, decode)
        finally:
            if not release_view(body):
                # Something still views the buffer (a traceback holding the response): it
                # keeps that buffer; the next response is read into a new one.
                self._buf = bytearray(len(self._buf))
                self._view = memoryview(self._buf)

    # -- operations -----------------------------------------------------------------------------

    def ping(self, payload: bytes = b"") -> PingResult:
        return self._call("ping", Ping(payload=payload))  # type: ignore[no-any-return]

    def match(self, model: str, tokens: Any, lock: bool = False) -> MatchResult:
        """Longest usable cached prefix of ``tokens``; with ``lock``, also a receipt for it."""
        return self._call(  # type: ignore[no-any-return]
            "match", Match(model=model, tokens=int32_bytes(tokens), lock=lock))

    def lock(self, model: str, node: int) -> LockResult:
        return self._call("lock", Lock(model=model, node=node))  # type: ignore[no-any-return]

    def unlock(self, model: str, receipt: int) -> Empty:
        return self._call(  # type: ignore[no-any-return]
            "unlock", Unlock(model=model, receipt=receipt))

    def release_swa(self, model: str, receipt: int) -> Empty:
        """Release only the SWA part of a receipt (a decoding request past the window)."""
        return self._call(  # type: ignore[no-any-return]
            "release_swa", ReleaseSwa(model=model, receipt=receipt))

    def alloc(self, model: str, n: int) -> AllocResult:
        """``n`` full pages and, for SWA models, ``n`` SWA pages, held by this session."""
        return self._call("alloc", Alloc(model=model, n=n))  # type: ignore[no-any-return]

    def free(self, model: str, full_pages: Any = (), swa_pages: Any = ()) -> Empty:
        return self._call("free", Free(  # type: ignore[no-any-return]
            model=model, full_pages=int32_bytes(full_pages), swa_pages=int32_bytes(swa_pages)))

    def insert(self, model: str, tokens: Any, full_pages: Any, swa_pages: Any = (),
               prev_prefix_len: int = 0, swa_evicted_len: int = 0, lock: bool = False
               ) -> InsertResult:
        return self._call("insert", Insert(  # type: ignore[no-any-return]
            model=model, tokens=int32_bytes(tokens), full_pages=int32_bytes(full_pages),
            swa_pages=int32_bytes(swa_pages), prev_prefix_len=prev_prefix_len,
            swa_evicted_len=swa_evicted_len, lock=lock))

    def cache_unfinished(self, model: str, tokens: Any, full_pages: Any, swa_pages: Any = (),
                         prev_prefix_len: int = 0, swa_evicted_len: int = 0,
                         receipt: int | None = None) -> InsertResult:
        return self._call("cache_unfinished", CacheUnfinished(  # type: ignore[no-any-return]
            model=model, tokens=int32_bytes(tokens), full_pages=int32_bytes(full_pages),
            swa_pages=int32_bytes(swa_pages), prev_prefix_len=prev_prefix_len,
            swa_evicted_len=swa_evicted_len, receipt=receipt))

    def cache_finished(self, model: str, tokens: Any, full_pages: Any, swa_pages: Any = (),
                       prev_prefix_len: int = 0, swa_evicted_len: int = 0,
                       receipt: int | None = None) -> InsertResult:
        return self._call("cache_finished", CacheFinished(  # type: ignore[no-any-return]
            model=model, tokens=int32_bytes(tokens), full_pages=int32_bytes(full_pages),
            swa_pages=int32_bytes(swa_pages), prev_prefix_len=prev_prefix_len,
            swa_evicted_len=swa_evicted_len, receipt=receipt))

    def evict(self, model: str, full_pages: int = 0, swa_pages: int = 0,
              host_pages: int = 0) -> EvictResult:
        """Free up to these pages of this session's namespace (unlocked, coldest first)."""
        return self._call("evict", Evict(  # type: ignore[no-any-return]
            model=model, full_pages=full_pages, swa_pages=swa_pages, host_pages=host_pages))

    def stats(self, model: str | None = None) -> StatsResult:
        return self._call("stats", Stats(model=model))  # type: ignore[no-any-return]

    def load(self, model: str, tokens: Any, lock: bool = False) -> LoadResult:
        """Copy the host (L2) part of the match of ``tokens`` back to device, then match.

        Answered only once the data is on device; the result is a match (``lock`` as in
        :meth:`match`) plus ``loaded_len``. Not allowed in a batch.
        """
        return self._call(  # type: ignore[no-any-return]
            "load", Load(model=model, tokens=int32_bytes(tokens), lock=lock))

    def prefetch(self, model: str, tokens: Any, policy: str = "best_effort",
                 timeout_ms: int = 0) -> PrefetchResult:
        """Fetch the pages of ``tokens`` that only L3 (Redis) holds into L2 (host).

        ``policy``: ``best_effort`` answers once L3 was asked what it holds and fetches in the
        background; ``wait_complete`` answers when the fetch is done; ``timeout`` answers when it
        is done or after ``timeout_ms``. Not allowed in a batch.
        """
        return self._call(  # type: ignore[no-any-return]
            "prefetch", Prefetch(model=model, tokens=int32_bytes(tokens), policy=policy,
                                 timeout_ms=timeout_ms))

    # -- batches and receipts -------------------------------------------------------------------

    def batch(self, *, stop_on_error: bool = True) -> ClientBatch:
        """Queue operations and send them as one ``batch`` frame at the end of a ``with``."""
        return ClientBatch(self, stop_on_error)

    @contextlib.contextmanager
    def locked(self, model: str, tokens: Any) -> Iterator[MatchResult]:
        """``match(lock=True)``, then ``unlock`` of its receipt (if any) when the block ends.

        If the block hands the receipt on (for example as ``cache_unfinished(receipt=...)``,
        which moves or drops the lock), set ``m.receipt = None`` so that it is not released twice.
        If the block raises, an error from the unlock is suppressed in favour of the block's.
        """
        m = self.match(model, tokens, lock=True)
        try:
            yield m
        except BaseException:
            if m.receipt is not None and self._sock is not None:
                with contextlib.suppress(RadixdError):
                    self.unlock(model, m.receipt)
            raise
        if m.receipt is not None:
            self.unlock(model, m.receipt)

    # -- pools ----------------------------------------------------------------------------------

    def attach(self, model: str) -> AttachedPools:
        """Map the KV pools of ``model`` into this process (needs torch).

        CPU pools arrive as memfd descriptors with the response (SCM_RIGHTS) and are mapped
        shared; GPU pools are opened from their CUDA IPC handles. See
        :class:`~radixd_client.pools.AttachedPools`.
        """
        from .pools import attach_pools

        sock = self._sock
        if sock is None:
            raise _lost(self._close_reason)
        if self._pending:  # bytes no request asked for: the stream is out of step
            raise self._broken("unexpected bytes from the daemon before attach")
        rid = self._next_id
        self._next_id = rid + 1
        frame = encode(Attach(id=rid, model=model))
        fds: list[int] = []
        try:
            try:
                sock.sendall(frame)
                # Every byte of this frame is read with recvmsg, so the descriptors are received
                # whichever segment carries them. Nothing was read ahead of it: no bytes are
                # pending (checked above), and no other request is in flight.
                hdr = self._recvmsg_exact(HEADER_SIZE, fds)
                n = HEADER.unpack(hdr)[0]
                if n > self._max_response:
                    raise self._broken(f"an attach response of {n} bytes announced")
                body = self._recvmsg_exact(n, fds)
            except RadixdError:
                raise
            except OSError as exc:
                raise self._broken(f"{type(exc).__name__}: {exc}", exc) from exc
            except BaseException as exc:
                self._broken(f"interrupted by {type(exc).__name__} during attach", exc)
                raise
            resp = self._response(rid, memoryview(body))
            try:
                result: AttachResult = decode_result("attach", resp.result)  # type: ignore
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise ProtocolError(f"undecodable attach result: {exc}",
                                    code=Code.BAD_FRAME) from exc
            return attach_pools(model, result, fds)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _recvmsg_exact(self, n: int, fds: list[int]) -> bytearray:
        sock = self._sock
        assert sock is not None
        out = bytearray()
        space = socket.CMSG_SPACE(MAX_FDS * 4)
        flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
        while len(out) < n:
            data, ancdata, msg_flags, _addr = sock.recvmsg(n - len(out), space, flags)
            if not _take_fds(ancdata, msg_flags, fds):
                raise self._broken(f"the attach response carried more than {MAX_FDS} "
                                   "descriptors")
            if not data:
                raise self._broken("the daemon closed the connection during attach")
            out += data
        return out

    # -- lifetime -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Close the connection; the daemon then releases everything this session held."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._sock is None else f"session {getattr(self, 'session', '?')}"
        where = self.path or "socket"
        return f"<radixd Client {where} {state}>"
