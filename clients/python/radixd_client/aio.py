"""The asyncio client: one connection shared by many tasks, requests pipelined.

``client = await AsyncClient.connect(path, token=...)``; then the same operations as
:class:`~radixd_client.client.Client`, as coroutines. Any number of tasks may call concurrently:
each request is written at once (frames never interleave) and a background reader task matches
responses to requests by id. The number of requests in flight is kept within the daemon's
``max_inflight`` (further calls wait for a slot instead of being refused).

Works on the default asyncio loop and on uvloop. If the connection ends (daemon gone, socket
error, or :meth:`AsyncClient.close`), every pending and later call raises
:class:`~radixd_client.errors.ConnectionLost`: the session and everything it held are gone.

A cancelled call is cancelled only on this side: the daemon still runs it, so what it acquired
(a lock, allocated pages) stays held by the session until released or until the session ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import msgspec

from .client import (
    _MIN_RESPONSE_CAP,
    MAX_FDS,
    Decode,
    _apply_hello,
    _BatchBuilder,
    _take_fds,
    decode_ok,
    release_view,
)
from .errors import (
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
    Stats,
    StatsResult,
    Unlock,
    decode_response,
    encode,
    int32_bytes,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .pools import AttachedPools

__all__ = ["AsyncClient", "AsyncClientBatch"]

log = logging.getLogger("radixd_client")

_INITIAL_BUFFER = 64 * 1024


class _Broken(Exception):
    """Internal: the reader found the connection unusable; the argument says why."""


class AsyncClientBatch(_BatchBuilder):
    """``async with client.batch() as b:``: like :class:`~radixd_client.client.ClientBatch`,
    sent (and awaited) at the end of the ``async with`` block."""

    def __init__(self, client: AsyncClient, stop_on_error: bool) -> None:
        super().__init__(stop_on_error)
        self._client = client

    async def __aenter__(self) -> AsyncClientBatch:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if exc is not None:
            self._abandon("the batch was not sent: its `async with` block raised", exc)
            return
        if not self._ops:
            self._sent = True
            return
        try:
            outcomes = await self._client._call("batch", self._request(), decode=self._decode)
        except RadixdError as err:
            self._abandon(f"the batch failed as a whole ({err.code})", err)
            raise
        except BaseException as err:
            self._abandon("the batch was interrupted (it may still have run)", err)
            raise
        self._distribute(outcomes)


class AsyncClient:
    """An asyncio connection (and session) to radixd; create it with :meth:`connect`."""

    session: int
    version: int
    tenant: str
    namespace: str
    models: dict[str, ModelInfo]
    limits: Limits
    hello_result: HelloResult

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        """Internal: use :meth:`connect` or :meth:`from_socket`."""
        sock.setblocking(False)
        self.path: str | None = None
        self._sock: socket.socket | None = sock
        self._loop = loop
        self._next_id = 1
        # id -> (op, future, decoder); an entry stays until its response arrives, even if its
        # caller was cancelled, because the daemon counts it as in flight until then.
        self._pending: dict[int, tuple[str, asyncio.Future[Any], Decode | None]] = {}
        self._closed_error: ConnectionLost | None = None
        self._wake = asyncio.Event()  # set when a request is registered
        self._drained = asyncio.Event()  # set by the reader when nothing is pending
        self._gate_open = True  # False while an attach needs the connection alone
        self._gate = asyncio.Event()
        self._gate.set()
        self._attach_lock = asyncio.Lock()
        self._attach_id: int | None = None
        self._slots: asyncio.Semaphore | None = None  # max_inflight, once known
        self._wbuf: list[memoryview] = []
        self._writer: asyncio.Task[None] | None = None
        self._buf = bytearray(_INITIAL_BUFFER)
        self._hdr = bytearray(HEADER_SIZE)
        self._max_request = 1 << 62
        self._max_response = _MIN_RESPONSE_CAP
        self._reader = loop.create_task(self._read_loop(), name="radixd-client-reader")

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    async def connect(cls, path: str, token: str | None = None, *, client_name: str = "",
                      timeout: float | None = None) -> AsyncClient:
        """Connect to the daemon's socket at ``path`` and authenticate.

        ``timeout`` bounds the connect and the hello only; bound later calls with
        ``asyncio.timeout`` (knowing the daemon may still run a call whose wait was cut).
        """
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, path), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            why = getattr(exc, "strerror", None) or type(exc).__name__
            raise ConnectFailed(f"cannot connect to radixd at {path!r}: {why}") from exc
        self = await cls.from_socket(sock, token, client_name=client_name, timeout=timeout)
        self.path = path
        return self

    @classmethod
    async def from_socket(cls, sock: socket.socket, token: str | None = None, *,
                          client_name: str = "", timeout: float | None = None) -> AsyncClient:
        """Use an already connected stream socket; the client owns it from now on."""
        self = cls(sock, asyncio.get_running_loop())
        try:
            hello: HelloResult = await asyncio.wait_for(
                self._call("hello", Hello(version=PROTOCOL_VERSION, token=token,
                                          client=client_name)), timeout)
        except asyncio.TimeoutError as exc:
            await self.close()
            raise TimedOut("no hello answer from radixd in time") from exc
        except BaseException:
            await self.close()
            raise
        _apply_hello(self, hello)
        if hello.limits.max_inflight > 0:
            self._slots = asyncio.Semaphore(hello.limits.max_inflight)
        return self

    # -- writing --------------------------------------------------------------------------------

    def _write(self, frame: bytes) -> None:
        """Queue one whole frame; never interleaves with another and never waits.

        The common case writes it at once. What the socket does not take goes to a writer task
        (so a caller's cancellation can never cut a frame in half).
        """
        sock = self._sock
        if sock is None:
            raise self._lost()
        if self._wbuf:
            self._wbuf.append(memoryview(frame))
            return
        try:
            sent = sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            err = self._fail(f"{type(exc).__name__}: {exc}", exc)
            raise err from exc
        if sent < len(frame):
            self._wbuf.append(memoryview(frame)[sent:])
            self._writer = self._loop.create_task(self._drain_writes())

    async def _drain_writes(self) -> None:
        try:
            while self._wbuf and self._sock is not None:
                await self._loop.sock_sendall(self._sock, self._wbuf[0])
                self._wbuf.pop(0)
        except asyncio.CancelledError:
            raise
        except OSError as exc:
            self._fail(f"{type(exc).__name__}: {exc}", exc)
        finally:
            self._writer = None

    # -- reading --------------------------------------------------------------------------------

    async def _recv_exact(self, view: memoryview, n: int) -> None:
        got = 0
        sock = self._sock
        while got < n:
            if sock is None:
                raise _Broken("closed")
            k = await self._loop.sock_recv_into(sock, view[got:n])
            if not k:
                raise _Broken("the daemon closed the connection" if got == 0 and n == HEADER_SIZE
                              else "the daemon closed the connection in the middle of a "
                              "response")
            got += k

    async def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            raise _Broken("closed")
        fut = self._loop.create_future()
        fd = sock.fileno()
        self._loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            self._loop.remove_reader(fd)

    async def _recvmsg_exact(self, n: int, fds: list[int]) -> bytearray:
        """Read ``n`` bytes with recvmsg, collecting any descriptors that come with them."""
        out = bytearray()
        space = socket.CMSG_SPACE(MAX_FDS * 4)
        flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
        while len(out) < n:
            sock = self._sock
            if sock is None:
                raise _Broken("closed")
            try:
                data, ancdata, msg_flags, _addr = sock.recvmsg(n - len(out), space, flags)
            except (BlockingIOError, InterruptedError):
                await self._readable()
                continue
            if not _take_fds(ancdata, msg_flags, fds):
                raise _Broken(f"an attach response carried more than {MAX_FDS} descriptors")
            if not data:
                raise _Broken("the daemon closed the connection during attach")
            out += data
        return out

    async def _read_frame(self) -> memoryview:
        await self._recv_exact(memoryview(self._hdr), HEADER_SIZE)
        n = HEADER.unpack(self._hdr)[0]
        if n > self._max_response:
            raise _Broken(f"a response of {n} bytes announced: the stream is out of step")
        if n > len(self._buf):
            self._buf = bytearray(max(n, 2 * len(self._buf)))  # new, never resized (see Client)
        view = memoryview(self._buf)[:n]
        await self._recv_exact(view, n)
        return view

    async def _read_loop(self) -> None:
        try:
            while True:
                if not self._pending:
                    # Idle: read nothing, so that a later attach response is read (with its
                    # descriptors) by recvmsg and not by a plain read already waiting.
                    self._drained.set()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                fds: list[int] = []
                if self._attach_id is not None:
                    try:
                        hdr = await self._recvmsg_exact(HEADER_SIZE, fds)
                        n = HEADER.unpack(hdr)[0]
                        if n > self._max_response:
                            raise _Broken(f"an attach response of {n} bytes announced")
                        body: memoryview = memoryview(await self._recvmsg_exact(n, fds))
                    except BaseException:
                        _close_fds(fds)
                        raise
                    self._dispatch(body, fds)
                else:
                    body = await self._read_frame()
                    self._dispatch(body, fds)
                    if not release_view(body):
                        # Something still views the buffer (a traceback holding a response):
                        # it keeps that buffer; the next frame is read into a new one.
                        self._buf = bytearray(len(self._buf))
        except asyncio.CancelledError:
            self._fail("closed by the client")
            raise
        except _Broken as exc:
            self._fail(str(exc), exc.__cause__)
        except OSError as exc:
            self._fail(f"{type(exc).__name__}: {exc}", exc)
        except Exception as exc:  # a bug here must not leave callers waiting forever
            log.exception("radixd client reader failed")
            self._fail(f"client reader failed: {type(exc).__name__}: {exc}", exc)

    def _dispatch(self, body: memoryview, fds: list[int]) -> None:
        try:
            resp = decode_response(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            _close_fds(fds)
            raise _Broken(f"undecodable response: {exc}") from exc
        entry = self._pending.pop(resp.id, None)
        if entry is None and resp.id == 0 and not resp.ok and len(self._pending) == 1:
            # The daemon could not read the request's id; with one request in flight it is
            # that request's answer.
            entry = self._pending.pop(next(iter(self._pending)))
        if entry is None:
            _close_fds(fds)
            if resp.id == 0 and not resp.ok:
                err = error_from_wire(resp.error)
                self._fail(f"the daemon refused a request it could not identify "
                           f"({err.code}: {err.message})", err)
                return
            raise _Broken(f"a response for unknown request id {resp.id}")
        op, fut, decode = entry
        if self._slots is not None:
            self._slots.release()
        if resp.id == self._attach_id:
            self._attach_id = None
        if fut.done():  # the caller was cancelled
            _close_fds(fds)
            return
        if not resp.ok:
            _close_fds(fds)
            fut.set_exception(error_from_wire(resp.error))
            return
        # Decoded here, completely: ``body`` is the reader's buffer, overwritten by the next
        # response, and ``resp.result`` (and a batch's items) are views into it.
        try:
            result = decode_ok(op, resp.result, decode)
        except RadixdError as exc:
            _close_fds(fds)
            fut.set_exception(exc)
            return
        fut.set_result((result, fds) if op == "attach" else result)

    # -- failure and closing --------------------------------------------------------------------

    def _lost(self) -> ConnectionLost:
        if self._closed_error is not None:
            err = ConnectionLost(self._closed_error.message)
            err.__cause__ = self._closed_error.__cause__
            return err
        return ConnectionLost("connection to radixd lost")

    def _fail(self, why: str, cause: BaseException | None = None) -> ConnectionLost:
        """Mark the connection dead, close it, fail everything pending; idempotent."""
        if self._closed_error is None:
            err = ConnectionLost(f"connection to radixd lost ({why})")
            err.__cause__ = cause
            self._closed_error = err
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        pending, self._pending = self._pending, {}
        for _op, fut, _decode in pending.values():
            if not fut.done():
                e = ConnectionLost(self._closed_error.message)
                e.__cause__ = self._closed_error.__cause__
                fut.set_exception(e)
        self._wbuf.clear()
        if self._writer is not None and self._writer is not asyncio.current_task():
            self._writer.cancel()
        if self._reader is not asyncio.current_task() and not self._reader.done():
            self._reader.cancel()
        self._drained.set()
        self._gate.set()
        self._wake.set()
        return self._lost()

    @property
    def closed(self) -> bool:
        return self._closed_error is not None

    async def close(self) -> None:
        """Close the connection; the daemon then releases everything this session held."""
        self._fail("closed by the client")
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"session {getattr(self, 'session', '?')}"
        return f"<radixd AsyncClient {self.path or 'socket'} {state}>"

    # -- calls ----------------------------------------------------------------------------------

    async def _call(self, op: str, req: Request, exclusive: bool = False,
                    decode: Decode | None = None) -> Any:
        # While an attach has the connection to itself, others wait (also for a slot, then
        # again for the gate, as another attach may have started meanwhile).
        while not (self._gate_open or exclusive or self._closed_error is not None):
            await self._gate.wait()
        if self._slots is not None:
            await self._slots.acquire()
            while not (self._gate_open or exclusive or self._closed_error is not None):
                await self._gate.wait()
        if self._closed_error is not None:
            if self._slots is not None:
                self._slots.release()
            raise self._lost()
        rid = self._next_id
        self._next_id = rid + 1
        req.id = rid
        frame = encode(req)
        if len(frame) - HEADER_SIZE > self._max_request:
            if self._slots is not None:
                self._slots.release()
            raise ProtocolError(
                f"request of {len(frame) - HEADER_SIZE} bytes; the daemon's limit is "
                f"{self._max_request} (max_frame_bytes): split it", code=Code.FRAME_TOO_LARGE,
                details={"limit": self._max_request, "size": len(frame) - HEADER_SIZE})
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._pending[rid] = (op, fut, decode)
        if op == "attach":
            self._attach_id = rid
        try:
            self._write(frame)
        except BaseException:
            self._pending.pop(rid, None)
            raise
        self._wake.set()
        return await fut

    async def ping(self, payload: bytes = b"") -> PingResult:
        return await self._call("ping", Ping(payload=payload))  # type: ignore[no-any-return]

    async def match(self, model: str, tokens: Any, lock: bool = False) -> MatchResult:
        return await self._call(  # type: ignore[no-any-return]
            "match", Match(model=model, tokens=int32_bytes(tokens), lock=lock))

    async def lock(self, model: str, node: int) -> LockResult:
        return await self._call(  # type: ignore[no-any-return]
            "lock", Lock(model=model, node=node))

    async def unlock(self, model: str, receipt: int) -> Empty:
        return await self._call(  # type: ignore[no-any-return]
            "unlock", Unlock(model=model, receipt=receipt))

    async def release_swa(self, model: str, receipt: int) -> Empty:
        return await self._call(  # type: ignore[no-any-return]
            "release_swa", ReleaseSwa(model=model, receipt=receipt))

    async def alloc(self, model: str, n: int) -> AllocResult:
        return await self._call("alloc", Alloc(model=model, n=n))  # type: ignore[no-any-return]

    async def free(self, model: str, full_pages: Any = (), swa_pages: Any = ()) -> Empty:
        return await self._call("free", Free(  # type: ignore[no-any-return]
            model=model, full_pages=int32_bytes(full_pages), swa_pages=int32_bytes(swa_pages)))

    async def insert(self, model: str, tokens: Any, full_pages: Any, swa_pages: Any = (),
                     prev_prefix_len: int = 0, swa_evicted_len: int = 0, lock: bool = False
                     ) -> InsertResult:
        return await self._call("insert", Insert(  # type: ignore[no-any-return]
            model=model, tokens=int32_bytes(tokens), full_pages=int32_bytes(full_pages),
            swa_pages=int32_bytes(swa_pages), prev_prefix_len=prev_prefix_len,
            swa_evicted_len=swa_evicted_len, lock=lock))

    async def cache_unfinished(self, model: str, tokens: Any, full_pages: Any,
                               swa_pages: Any = (), prev_prefix_len: int = 0,
                               swa_evicted_len: int = 0, receipt: int | None = None
                               ) -> InsertResult:
        return await self._call("cache_unfinished", CacheUnfinished(  # type: ignore
            model=model, tokens=int32_bytes(tokens), full_pages=int32_bytes(full_pages),
            swa_pages=int32_bytes(swa_pages), prev_prefix_len=prev_prefix_len,
            swa_evicted_len=swa_evicted_len, receipt=receipt))

    async def cache_finished(self, model: str, tokens: Any, full_pages: Any,
                             swa_pages: Any = (), prev_prefix_len: int = 0,
                             swa_evicted_len: int = 0, receipt: int | None = None
                             ) -> InsertResult:
        return await self._call("cache_finished", CacheFinished(  # type: ignore
            model=model, tokens=int32_bytes(tokens), full_pages=int32_bytes(full_pages),
            swa_pages=int32_bytes(swa_pages), prev_prefix_len=prev_prefix_len,
            swa_evicted_len=swa_evicted_len, receipt=receipt))

    async def evict(self, model: str, full_pages: int = 0, swa_pages: int = 0,
                    host_pages: int = 0) -> EvictResult:
        return await self._call("evict", Evict(  # type: ignore[no-any-return]
            model=model, full_pages=full_pages, swa_pages=swa_pages, host_pages=host_pages))

    async def stats(self, model: str | None = None) -> StatsResult:
        return await self._call("stats", Stats(model=model))  # type: ignore[no-any-return]

    async def load(self, model: str, tokens: Any, lock: bool = False) -> LoadResult:
        """Copy the host (L2) part of the match of ``tokens`` back to device, then match.

        Answered only once the data is on device; the result is a match (``lock`` as in
        :meth:`match`) plus ``loaded_len``. Not allowed in a batch.
        """
        return await self._call(  # type: ignore[no-any-return]
            "load", Load(model=model, tokens=int32_bytes(tokens), lock=lock))

    async def prefetch(self, model: str, tokens: Any, policy: str = "best_effort",
                 timeout_ms: int = 0) -> PrefetchResult:
        """Fetch the pages of ``tokens`` that only L3 (Redis) holds into L2 (host).

        ``policy``: ``best_effort`` answers once L3 was asked what it holds and fetches in the
        background; ``wait_complete`` answers when the fetch is done; ``timeout`` answers when it
        is done or after ``timeout_ms``. Not allowed in a batch.
        """
        return await self._call(  # type: ignore[no-any-return]
            "prefetch", Prefetch(model=model, tokens=int32_bytes(tokens), policy=policy,
                                 timeout_ms=timeout_ms))

    # -- batches, receipts, pools ---------------------------------------------------------------

    def batch(self, *, stop_on_error: bool = True) -> AsyncClientBatch:
        """``async with client.batch() as b:`` (see :class:`AsyncClientBatch`)."""
        return AsyncClientBatch(self, stop_on_error)

    @contextlib.asynccontextmanager
    async def locked(self, model: str, tokens: Any) -> AsyncIterator[MatchResult]:
        """``match(lock=True)``, then ``unlock`` of its receipt (if any) when the block ends
        (set ``m.receipt = None`` inside the block if the receipt was handed on)."""
        m = await self.match(model, tokens, lock=True)
        try:
            yield m
        except BaseException:
            if m.receipt is not None and not self.closed:
                with contextlib.suppress(RadixdError):
                    await self.unlock(model, m.receipt)
            raise
        if m.receipt is not None:
            await self.unlock(model, m.receipt)

    async def attach(self, model: str) -> AttachedPools:
        """Map the KV pools of ``model`` into this process (needs torch); see
        :meth:`radixd_client.client.Client.attach`. Other calls wait while it runs: the
        response, which carries descriptors, must be the only one in flight."""
        from .pools import attach_pools

        async with self._attach_lock:
            self._gate_open = False
            self._gate.clear()
            try:
                while self._pending and self._closed_error is None:
                    self._drained.clear()
                    await self._drained.wait()
                result, fds = await self._call("attach", Attach(model=model), exclusive=True)
            finally:
                self._gate_open = True
                self._gate.set()
        try:
            return attach_pools(model, result, fds)
        finally:
            _close_fds(fds)


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
