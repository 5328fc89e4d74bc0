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

from .connection import BrokenStream, ClientConnection, Reply, apply_hello
from .errors import (
    ConnectFailed,
    ConnectionLost,
    RadixdError,
    SegmentsNotMapped,
    SessionRestarted,
    ShuttingDown,
    TimedOut,
)
from .fds import MAX_FDS, RECVMSG_FLAGS, ancillary_space, close_fds, take_fds
from .operations import BatchBuilder, Operations
from .protocol import (
    PROTOCOL_VERSION,
    Attach,
    Hello,
    HelloResult,
    KvAttach,
    Limits,
    MatchResult,
    ModelInfo,
    Request,
)
from .reconnect import Reconnect, drop_unmappable, models_to_remap, restarted

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .pools import AttachedPools, KvHostPools

__all__ = ["AsyncClient", "AsyncClientBatch"]

#: operations whose responses carry descriptors (SCM_RIGHTS): read with recvmsg, run alone
_FD_OPS = ("attach", "kv_attach")

log = logging.getLogger("radixd_client")


class AsyncClientBatch(BatchBuilder):
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
            outcomes = await self._client._call("batch", self._request())
        except SegmentsNotMapped as err:
            self._distribute(err.result)  # it ran: the futures hold its results
            raise
        except RadixdError as err:
            self._abandon(f"the batch failed as a whole ({err.code})", err)
            raise
        except BaseException as err:
            self._abandon("the batch was interrupted", err)
            raise
        self._distribute(outcomes)


class AsyncClient(Operations):
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
        self.path: str | None = None
        self._loop = loop
        self._attached: dict[str, AttachedPools] = {}  # to map segments as they come
        self._kv_attached: dict[str, KvHostPools] = {}  # the same for host pools
        self._reconnect: Reconnect | None = None
        self._token: str | None = None
        self._client_name = ""
        self._closed_by_user = False
        self._timeout: float | None = None
        self._generation = 0  # sessions opened by this client, minus one
        self._reconnecting: asyncio.Task[SessionRestarted] | None = None
        # models whose pools the last reconnect closed (reported by every call it cut), and
        # those a reconnect closed before it was cut itself (reported by the next)
        self._unmapped: dict[str, str] = {}
        self._dropped: dict[str, str] = {}
        self.restarts = 0
        self._bind(sock)

    def _bind(self, sock: socket.socket) -> None:
        """The per-connection state, fresh: at construction and after a reconnect."""
        sock.setblocking(False)
        self._sock: socket.socket | None = sock
        self._pid = os.getpid()  # the process the connection is this client's in
        # Each request's future is its context in the connection; an entry stays until its
        # response arrives, even if its caller was cancelled, because the daemon counts it as in
        # flight until then.
        self._conn = ClientConnection(in_order=False)
        self._closed_error: ConnectionLost | None = None
        self._wake = asyncio.Event()  # set when a request is registered
        self._drained = asyncio.Event()  # set by the reader when nothing is pending
        self._gate_open = True  # False while an attach needs the connection alone
        self._gate = asyncio.Event()
        self._gate.set()
        self._attach_lock = asyncio.Lock()
        self._attach_id: int | None = None
        self._attach_fds: list[int] = []  # received with the attach response, not yet handed
        self._slots: asyncio.Semaphore | None = None  # max_inflight, once known
        self._wbuf: list[memoryview] = []
        self._writer: asyncio.Task[None] | None = None
        self._reader = self._loop.create_task(self._read_loop(), name="radixd-client-reader")

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    async def connect(cls, path: str, token: str | None = None, *, client_name: str = "",
                      timeout: float | None = None,
                      reconnect: Reconnect | None = None) -> AsyncClient:
        """Connect to the daemon's socket at ``path`` and authenticate.

        ``timeout`` bounds the connect and the hello only; bound later calls with
        ``asyncio.timeout`` (knowing the daemon may still run a call whose wait was cut).
        ``reconnect``: ride through a daemon restart, as :class:`radixd_client.Client` does
        (every call that was in flight or waiting raises ``SessionRestarted``; one reconnect
        serves them all).
        """
        self = await cls.from_socket(await _connect(path, timeout), token,
                                     client_name=client_name, timeout=timeout)
        self.path = path
        self._reconnect = reconnect
        self._timeout = timeout
        return self

    @classmethod
    async def from_socket(cls, sock: socket.socket, token: str | None = None, *,
                          client_name: str = "", timeout: float | None = None) -> AsyncClient:
        """Use an already connected stream socket; the client owns it from now on."""
        self = cls(sock, asyncio.get_running_loop())
        self._token, self._client_name = token, client_name
        await self._handshake(timeout)
        return self

    async def _handshake(self, timeout: float | None) -> None:
        try:
            hello: HelloResult = await asyncio.wait_for(
                self._call_once("hello", Hello(version=PROTOCOL_VERSION, token=self._token,
                                               client=self._client_name)), timeout)
        except asyncio.TimeoutError as exc:
            await self._close_connection()
            raise TimedOut("no hello answer from radixd in time") from exc
        except BaseException:
            await self._close_connection()
            raise
        apply_hello(self, hello)
        if hello.limits.max_inflight > 0:
            self._slots = asyncio.Semaphore(hello.limits.max_inflight)

    # -- riding through a restart ---------------------------------------------------------------

    async def _ride_through(self, cause: RadixdError, generation: int) -> SessionRestarted:
        """One reconnect for every call the lost session cut (see radixd_client.reconnect)."""
        if self._generation != generation:  # another call already reconnected
            return restarted(cause, None, self, self._unmapped)
        if self._reconnecting is None or self._reconnecting.done():
            # (a done task here is one whose callers were all cancelled, or one that failed)
            self._reconnecting = self._loop.create_task(self._reconnect_now(cause))
        task = self._reconnecting
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # close() stopped the reconnect: this call was not cancelled, its session is gone
            cancelling = getattr(asyncio.current_task(), "cancelling", None)  # (3.11+)
            if task.cancelled() and not (cancelling is not None and cancelling()):
                raise self._lost() from None
            raise
        finally:
            if task.done() and self._reconnecting is task:
                self._reconnecting = None

    async def _reconnect_now(self, cause: RadixdError) -> SessionRestarted:
        policy, path = self._reconnect, self.path
        assert policy is not None and path is not None
        self._fail("the daemon went away")
        old = getattr(self, "session", None)
        old_instance = getattr(self, "instance", None)
        attempts = policy.attempts(path, self._loop.time)
        while True:
            try:
                self._bind(await _connect(path, self._timeout))
                await self._handshake(self._timeout)
                break
            except (ConnectFailed, ConnectionLost, ShuttingDown) as exc:
                await asyncio.sleep(attempts.wait_after(exc))
        self._generation += 1
        self.restarts += 1
        unmapped = self._dropped  # (kept if this reconnect is cut too: reported by the next)
        for model in models_to_remap(self._attached, self._kv_attached, old_instance,
                                     self.instance):
            try:
                self._attached[model].rebind(*await self._attach_exclusive(model))
            except (ConnectionLost, ShuttingDown):
                raise
            except (RadixdError, OSError) as err:  # (a PoolError too)
                drop_unmappable(self._attached, model, err, unmapped)
        self._unmapped, self._dropped = unmapped, {}
        return restarted(cause, old, self, unmapped)

    # -- writing --------------------------------------------------------------------------------

    def _write(self, frame: bytes) -> None:
        """Queue one whole frame; never interleaves with another and never waits.

        The common case writes it at once. What the socket does not take goes to a writer task
        (so a caller's cancellation can never cut a frame in half).
        """
        sock = self._sock
        if sock is None:
            raise self._unsent()
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
        conn = self._conn  # (a reconnect binds another: this task then only ends)
        try:
            while self._wbuf and self._sock is not None:
                await self._loop.sock_sendall(self._sock, self._wbuf[0])
                self._wbuf.pop(0)
        except asyncio.CancelledError:
            raise
        except OSError as exc:
            if self._conn is conn:
                self._fail(f"{type(exc).__name__}: {exc}", exc)
        finally:
            if self._writer is asyncio.current_task():
                self._writer = None

    # -- reading --------------------------------------------------------------------------------

    async def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            raise BrokenStream("closed")
        fut = self._loop.create_future()
        fd = sock.fileno()
        self._loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            self._loop.remove_reader(fd)

    async def _recv_attach(self, sock: socket.socket) -> int:
        """Read with recvmsg, keeping the descriptors that come with the bytes."""
        space = ancillary_space()
        while True:
            try:
                k, ancdata, msg_flags, _addr = sock.recvmsg_into(
                    [self._conn.recv_buffer()], space, RECVMSG_FLAGS)
            except (BlockingIOError, InterruptedError):
                await self._readable()
                continue
            if not take_fds(ancdata, msg_flags, self._attach_fds):
                raise BrokenStream(f"an attach response carried more than {MAX_FDS} descriptors")
            if not k:
                raise BrokenStream("the daemon closed the connection during attach")
            return k  # type: ignore[no-any-return]

    async def _read_loop(self) -> None:
        conn = self._conn
        loop = self._loop

        def fail(why: str, cause: BaseException | None = None) -> None:
            # A reconnect can bind the next connection before this task, cancelled with its
            # own, runs again: that end is its connection's, already failed, not the new one's.
            if self._conn is conn:
                self._fail(why, cause)

        try:
            while True:
                reply = conn.next_event()
                if reply is not None:
                    self._dispatch(reply)
                    continue
                if not conn.pending:
                    # Idle: read nothing, so that a later attach response is read (with its
                    # descriptors) by recvmsg and not by a plain read already waiting.
                    self._drained.set()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                sock = self._sock
                if sock is None:
                    raise BrokenStream("closed")
                if self._attach_id is not None:
                    k = await self._recv_attach(sock)
                else:
                    k = await loop.sock_recv_into(sock, conn.recv_buffer())
                    if not k:
                        raise BrokenStream(
                            "the daemon closed the connection in the middle of a response"
                            if conn.buffered else "the daemon closed the connection")
                conn.received(k)
        except asyncio.CancelledError:
            fail("closed by the client")
            raise
        except BrokenStream as exc:
            fail(str(exc), exc.__cause__)
        except OSError as exc:
            fail(f"{type(exc).__name__}: {exc}", exc)
        except Exception as exc:  # a bug here must not leave callers waiting forever
            log.exception("radixd client reader failed")
            fail(f"client reader failed: {type(exc).__name__}: {exc}", exc)

    def _dispatch(self, reply: Reply) -> None:
        """Settle the caller's future with a reply the connection already decoded."""
        fut: asyncio.Future[Any] = reply.context
        fds: list[int] = []
        if reply.id == self._attach_id:  # the exclusive call: it took no slot
            self._attach_id = None
            fds, self._attach_fds = self._attach_fds, []
        elif self._slots is not None:
            self._slots.release()
        if fut.done():  # the caller was cancelled
            close_fds(fds)
            return
        if not reply.ok:
            close_fds(fds)
            fut.set_exception(reply.value)
            return
        fut.set_result((reply.value, fds) if reply.op in _FD_OPS else reply.value)

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
            # shut down first, as the blocking client does: a child forked meanwhile holds a
            # copy that would keep the session, and what it holds, open until the child exits
            with contextlib.suppress(OSError):
                if os.getpid() == self._pid:
                    sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        close_fds(self._attach_fds)
        for fut in self._conn.abandon():
            if not fut.done():
                e = ConnectionLost(self._closed_error.message)
                e.__cause__ = self._closed_error.__cause__
                fut.set_exception(e)
        self._wbuf.clear()
        if self._slots is not None:
            # The requests in flight took slots that no response gives back: a caller waiting
            # for one gets it, finds the connection gone and passes it on (so does a later call)
            self._slots.release()
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
        """Close the connection; the daemon then releases everything this session held. A
        closed client does not reconnect."""
        self._closed_by_user = True
        if self._reconnecting is not None:
            self._reconnecting.cancel()
        await self._close_connection()

    async def _close_connection(self) -> None:
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

    async def _call(self, op: str, req: Request, exclusive: bool = False) -> Any:
        generation = self._generation
        try:
            self._refuse_while_reconnecting()
            return await self._call_once(op, req, exclusive)
        except (ConnectionLost, ShuttingDown) as exc:
            raise await self._cut(exc, generation) from exc

    async def _cut(self, exc: RadixdError, generation: int) -> RadixdError:
        """What a call the lost connection cut raises: ``exc`` itself without a reconnect
        policy, else the :class:`SessionRestarted` of the reconnect it waits for (for a call
        refused unsent, a copy saying so: the reconnect's own is every cut call's)."""
        if (self._reconnect is None or self.path is None or self._closed_by_user
                or isinstance(exc, SessionRestarted)):
            return exc
        err = await self._ride_through(exc, generation)
        if exc.details.get("sent") is False:
            return SessionRestarted(err.message, details={**err.details, "sent": False})
        return err

    def _unsent(self) -> ConnectionLost:
        """The connection-lost error of a call refused before anything of it was sent."""
        err = self._lost()
        err.details["sent"] = False
        return err

    def _refuse_while_reconnecting(self) -> None:
        """While a new session is being opened, a new call waits for it (through the ride
        through) and hears that the session it was made for ended, like every call that was
        waiting: sent now, it would reach the new connection before its hello. (The reconnect's
        own calls, its hello and attaches, go on.)"""
        task = self._reconnecting
        if task is not None and not task.done() and task is not asyncio.current_task():
            raise self._unsent()

    async def _call_once(self, op: str, req: Request, exclusive: bool = False) -> Any:
        # While an attach has the connection to itself, others wait (also for a slot, then
        # again for the gate, as another attach may have started meanwhile). The exclusive
        # call (attach) takes no slot: it runs alone, and callers waiting at the gate with a
        # slot must not keep it from running.
        conn = self._conn
        while not (self._gate_open or exclusive or self._closed_error is not None):
            await self._gate.wait()
        slots = None if exclusive or self._closed_error is not None else self._slots
        if slots is not None:
            await slots.acquire()
            try:
                while not (self._gate_open or self._closed_error is not None):
                    await self._gate.wait()
            except BaseException:  # cancelled while waiting: the slot goes back
                slots.release()
                raise
        if self._closed_error is not None or self._conn is not conn:
            # (gone while this call waited, even if a reconnect has bound another connection
            # since: the session it was made for ended)
            if slots is not None:
                slots.release()
            raise self._unsent()
        fut: asyncio.Future[Any] = self._loop.create_future()
        try:
            frame = self._conn.send(op, req, fut)
        except BaseException:
            if slots is not None:
                slots.release()
            raise
        if op in _FD_OPS:
            self._attach_id = req.id
        try:
            self._write(frame)
        except BaseException:
            if fut.done() and not fut.cancelled():
                fut.exception()  # failed with the connection: this raise reports it
            raise
        self._wake.set()
        try:
            value = await fut
        except asyncio.CancelledError:  # the answer may have come, with descriptors: close them
            if op in _FD_OPS and fut.done() and not fut.cancelled() and fut.exception() is None:
                close_fds(fut.result()[1])
            raise
        if (self._attached or self._kv_attached) and op not in _FD_OPS:
            await self._follow_segments(op, req, value)
        return value

    async def _follow_segments(self, op: str, req: Request, value: Any) -> None:
        """Map the segments a result names that this process has not mapped (protocol.md
        4.3); if that fails, ``SegmentsNotMapped`` carries the result (see the sync client)."""
        from .pools import SESSION_GONE, segments_not_mapped, segments_to_follow

        for attach_op, model in segments_to_follow(req, value, self._attached,
                                                   self._kv_attached):
            try:
                await (self.attach if attach_op == "attach" else self.kv_attach)(model)
            except SESSION_GONE:
                raise  # the session, and what the call took with it, is gone
            except (RadixdError, OSError, MemoryError) as err:
                raise segments_not_mapped(op, attach_op, model, value, err) from err

    # -- batches, receipts, pools ---------------------------------------------------------------

    def batch(self, *, stop_on_error: bool = True) -> AsyncClientBatch:
        """``async with client.batch() as b:`` (see :class:`AsyncClientBatch`)."""
        return AsyncClientBatch(self, stop_on_error)

    @contextlib.asynccontextmanager
    async def locked(self, model: str, tokens: Any) -> AsyncIterator[MatchResult]:
        """``match(lock=True)``, then ``unlock`` of its receipt (if any) when the block ends
        (set ``m.receipt = None`` inside the block if the receipt was handed on). A lock whose
        session the client lost meanwhile went with it: nothing is unlocked (see the sync
        client)."""
        try:
            m = await self.match(model, tokens, lock=True)
        except SegmentsNotMapped as err:  # (its receipt is released: see the sync client)
            await self._unlock_quietly(model, getattr(err.result, "receipt", None), self.restarts)
            raise
        # the session the match answered on: a reconnect cannot end between its answer and
        # this line (a call on a lost connection raises, it does not answer)
        restarts = self.restarts
        try:
            yield m
        except BaseException:
            await self._unlock_quietly(model, m.receipt, restarts)
            raise
        if m.receipt is not None and self.restarts == restarts:
            await self.unlock(model, m.receipt)

    async def _unlock_quietly(self, model: str, receipt: int | None, restarts: int) -> None:
        """A call made now is sent on this session or raises: checking ``restarts`` just before
        it, with no await between, is enough here (one loop, one task at a time)."""
        if receipt is not None and not self.closed and self.restarts == restarts:
            with contextlib.suppress(RadixdError):
                await self.unlock(model, receipt)

    async def attach(self, model: str) -> AttachedPools:
        """Map the KV pools of ``model`` into this process (needs torch); see
        :meth:`radixd_client.client.Client.attach`. Other calls wait while it runs: the
        response, which carries descriptors, must be the only one in flight."""
        from .pools import attach_or_update

        result, fds = await self._exclusive_call("attach", Attach(model=model))
        try:
            return attach_or_update(self._attached, model, result, fds)
        finally:
            close_fds(fds)

    async def kv_attach(self, model: str) -> KvHostPools:
        """Map the host (L2) pools of ``model`` (see :meth:`radixd_client.Client.kv_attach`);
        other calls wait while it runs, as for :meth:`attach`."""
        from .pools import attach_host_pools

        result, fds = await self._exclusive_call("kv_attach", KvAttach(model=model))
        try:
            return attach_host_pools(model, result, fds, self._kv_attached)
        finally:
            close_fds(fds)

    async def _exclusive_call(self, op: str, req: Request) -> tuple[Any, list[int]]:
        """:meth:`_exclusive`, riding through a restart as :meth:`_call` does."""
        generation = self._generation
        try:
            self._refuse_while_reconnecting()
            return await self._exclusive(op, req)
        except (ConnectionLost, ShuttingDown) as exc:
            raise await self._cut(exc, generation) from exc

    async def _attach_exclusive(self, model: str) -> tuple[Any, list[int]]:
        return await self._exclusive("attach", Attach(model=model))

    async def _exclusive(self, op: str, req: Request) -> tuple[Any, list[int]]:
        """A call whose response carries descriptors: it has the connection to itself."""
        conn = self._conn
        async with self._attach_lock:
            # Queued behind an exclusive call of a connection that has since been lost: the
            # session this call was made for ended (a reconnect may have bound another, whose
            # hello may not even be answered yet).
            if self._conn is not conn or self._closed_error is not None:
                raise self._unsent()
            self._refuse_while_reconnecting()
            self._gate_open = False
            self._gate.clear()
            try:
                while self._conn.pending and self._closed_error is None:
                    self._drained.clear()
                    await self._drained.wait()
                return await self._call_once(op, req, exclusive=True)  # type: ignore[no-any-return]
            finally:
                self._gate_open = True
                self._gate.set()


async def _connect(path: str, timeout: float | None) -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, path), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        sock.close()
        why = getattr(exc, "strerror", None) or type(exc).__name__
        raise ConnectFailed(f"cannot connect to radixd at {path!r}: {why}") from exc
    return sock
