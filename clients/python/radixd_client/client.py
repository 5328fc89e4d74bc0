"""The blocking client, for engine scheduler loops.

One :class:`Client` is one connection and one daemon session. Calls are synchronous: each writes
one frame and reads its response, so per-call overhead is one ``sendall``, usually one
``recv_into`` into a reused buffer, and two msgspec decodes. The protocol rules are
:class:`~radixd_client.connection.ClientConnection`'s; this module only moves the bytes.
Threads that share a client take turns, a whole call each (its reconnect and the mapping of new
segments included), so that none reads another's reply; for calls that overlap, give each
thread its own client or use :class:`radixd_client.aio.AsyncClient` to share one connection
among tasks. With a reconnect policy, only the call a restart cut raises ``SessionRestarted``:
the other threads' next calls run in the new session, where what the old one held (receipts,
pages) is gone; calls that carry that session's ids belong inside :meth:`Client.on_session`.

Everything a session holds (receipts, allocated pages) is released by the daemon when the
connection ends, however it ends. When that happens mid-call the client raises
:class:`~radixd_client.errors.ConnectionLost`: reconnect with a new ``Client`` and start over.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from .connection import BrokenStream, ClientConnection, apply_hello
from .errors import (
    ConnectFailed,
    ConnectionLost,
    RadixdError,
    SegmentsNotMapped,
    SessionRestarted,
    ShuttingDown,
    TimedOut,
)
from .fds import RECVMSG_FLAGS, ancillary_space, close_fds, take_fds
from .operations import BatchBuilder, BatchFuture, Operations
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
    int32_array,
)
from .reconnect import Reconnect, drop_unmappable, models_to_remap, restarted

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .pools import AttachedPools, KvHostPools

__all__ = ["BatchFuture", "Client", "ClientBatch", "pages"]


def pages(data: bytes | bytearray | memoryview) -> array:
    """Page ids (or tokens) as returned by the daemon, as an ``array('i')``.

    ``array`` supports indexing, slicing and ``len`` like a list, converts to numpy with
    ``numpy.frombuffer(a, dtype=numpy.int32)`` and to torch with ``torch.frombuffer(a,
    dtype=torch.int32)``, both without copying.
    """
    return int32_array(data)


T = TypeVar("T")


def _lost(why: str) -> ConnectionLost:
    return ConnectionLost(f"connection to radixd lost ({why})")


def _connect(path: str, timeout: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except OSError as exc:
        sock.close()
        why = exc.strerror or type(exc).__name__
        raise ConnectFailed(f"cannot connect to radixd at {path!r}: {why}") from exc
    return sock


class ClientBatch(BatchBuilder):
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
            outcomes = self._client._call("batch", self._request())
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


# ---------------------------------------------------------------------------- client

class Client(Operations):
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
                 timeout: float | None = None, reconnect: Reconnect | None = None) -> None:
        """``reconnect``: ride through a daemon restart (:mod:`radixd_client.reconnect`); off
        by default, when a lost connection raises ``ConnectionLost`` and the client stays
        closed."""
        self.path: str | None = path
        self._timeout = timeout
        self._reconnect = reconnect
        self.restarts = 0  # sessions this client has opened again after losing one
        self._start(_connect(path, timeout), token, client_name)

    @classmethod
    def from_socket(cls, sock: socket.socket, token: str | None = None, *,
                    client_name: str = "") -> Client:
        """Use an already connected stream socket (for example one end of ``socketpair()``),
        keeping its timeout; the client owns it from now on (and cannot reconnect)."""
        self = cls.__new__(cls)
        self.path = None
        self._timeout = None
        self._reconnect = None
        self.restarts = 0
        self._start(sock, token, client_name)
        return self

    def _start(self, sock: socket.socket, token: str | None, client_name: str) -> None:
        self._io = threading.RLock()  # one call at a time (reentrant: a call may attach)
        self._bound = threading.local()  # this thread's on_session() count, if any
        self._token, self._client_name = token, client_name
        self._attached: dict[str, AttachedPools] = {}  # to map segments as they come
        self._dropped: dict[str, str] = {}  # pools a reconnect closed before it was cut too
        self._unmapped: dict[str, str] = {}  # those the last reconnect closed
        self._kv_attached: dict[str, KvHostPools] = {}  # the same for host pools
        self._closed_by_user = False
        self._open_session(sock)

    def _open_session(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock
        self._pid = os.getpid()  # the process the connection is this client's in
        self._conn = ClientConnection()
        self._close_reason = "closed by the client"
        try:
            hello: HelloResult = self._call_once(
                "hello", Hello(version=PROTOCOL_VERSION, token=self._token,
                               client=self._client_name))
        except BaseException:
            self._drop()
            raise
        apply_hello(self, hello)

    # -- riding through a restart ---------------------------------------------------------------

    def _may_reconnect(self) -> bool:
        return self._reconnect is not None and self.path is not None and not self._closed_by_user

    def _ride_through(self, cause: RadixdError) -> SessionRestarted:
        """Connect again until the daemon answers a hello (or the policy's time is up), map the
        attached pools again in place, and return the error for the cut call to raise."""
        policy, path = self._reconnect, self.path
        assert policy is not None and path is not None
        self._drop()
        old = getattr(self, "session", None)
        old_instance = getattr(self, "instance", None)
        attempts = policy.attempts(path)
        while True:
            if self._closed_by_user:  # closed from another thread meanwhile: stays closed
                raise _lost("closed by the client")
            try:
                self._open_session(_connect(path, self._timeout))
            except (ConnectFailed, ConnectionLost, ShuttingDown) as exc:
                time.sleep(attempts.wait_after(exc))
                continue
            if self._closed_by_user:
                self._drop()
                raise _lost("closed by the client")
            break
        self.restarts += 1
        unmapped = self._dropped  # (kept if this reconnect is cut too: reported by the next)
        for model in models_to_remap(self._attached, self._kv_attached, old_instance,
                                     self.instance):
            try:
                self._attached[model].rebind(
                    *self._call_with_fds_once("attach", Attach(model=model)))
            except (ConnectionLost, ShuttingDown):
                raise
            except (RadixdError, OSError) as err:  # (a PoolError too)
                drop_unmappable(self._attached, model, err, unmapped)
        self._dropped = {}
        self._unmapped = dict(unmapped)
        return restarted(cause, old, self, unmapped)

    # -- calls ----------------------------------------------------------------------------------

    def _broken(self, why: str, cause: BaseException | None = None) -> ConnectionLost:
        """Close the connection and return the error to raise."""
        if self._closed_by_user:  # close() from another thread cut this call: say so
            why, cause = "closed by the client", None
        self._close_reason = why
        self._drop()
        if isinstance(cause, TimeoutError):
            err: ConnectionLost = TimedOut(f"no answer from radixd in time ({why})")
        else:
            err = _lost(why)
        err.__cause__ = cause
        return err

    def _eof(self, during: str = "") -> ConnectionLost:
        if during:
            return self._broken(f"the daemon closed the connection during {during}")
        if self._conn.buffered:
            return self._broken("the daemon closed the connection in the middle of a response")
        return self._broken("the daemon closed the connection")

    def _call(self, op: str, req: Request) -> Any:
        """One request, one reply."""
        return self._in_turn(self._call_once, op, req)

    def _in_turn(self, once: Callable[[str, Request], T], op: str, req: Request) -> T:
        """``once(op, req)`` while holding the client (threads take turns, a whole call each);
        with a reconnect policy, a lost session is opened again before the call raises
        ``SessionRestarted``. Inside :meth:`on_session`, a call made for a session the client
        has since left raises it before sending anything."""
        with self._io:
            bound = getattr(self._bound, "restarts", None)
            if bound is not None and bound != self.restarts:
                raise self._unsent(op, bound)
            try:
                return once(op, req)
            except (ConnectionLost, ShuttingDown) as exc:
                if not self._may_reconnect() or isinstance(exc, SessionRestarted):
                    raise
                raise self._ride_through(exc) from exc

    def _unsent(self, op: str, bound: int) -> SessionRestarted:
        """The error of a call made for a session this client has left (:meth:`on_session`);
        ``details["attach_again"]``: what the last reconnect could not map again (the call that
        met the restart raised it first); ``details["sent"]``: False, as only here."""
        return SessionRestarted(
            f"{op} was not sent: it was made for another session of this client than its "
            f"current one (a call met a daemon restart meanwhile: restarts was {bound}, is "
            f"{self.restarts}); the client is now session {self.session} of daemon instance "
            f"{self.instance}, which numbers pages and receipts afresh",
            details={"attach_again": dict(self._unmapped), "sent": False})

    def _call_once(self, op: str, req: Request) -> Any:
        """One request, one reply, decoded completely by the connection before the buffer is
        read into again."""
        sock = self._sock
        if sock is None:
            raise _lost(self._close_reason)
        conn = self._conn
        frame = conn.send(op, req)
        try:
            sock.sendall(frame)
            reply = conn.read_reply(sock.recv_into)
            if reply is None:
                raise self._eof()
        except ConnectionLost:
            raise
        except BrokenStream as exc:
            raise self._broken(str(exc), exc.__cause__) from exc.__cause__
        except OSError as exc:  # reset, broken pipe, timeout
            raise self._broken(f"{type(exc).__name__}: {exc}", exc) from exc
        except BaseException as exc:
            # KeyboardInterrupt (or similar) mid-frame: the stream is out of step for good.
            self._broken(f"interrupted by {type(exc).__name__} in the middle of a call", exc)
            raise
        if reply.ok:
            self._follow_segments(op, req, reply.value)
            return reply.value
        raise reply.value

    def _follow_segments(self, op: str, req: Request, value: Any) -> None:
        """A result naming a segment generation this process has not mapped: attach again
        first, so that its pages are mapped when the caller reads them (protocol.md 4.3). If
        that fails, ``SegmentsNotMapped`` carries the result, which the daemon has applied."""
        if not (self._attached or self._kv_attached):
            return
        from .pools import SESSION_GONE, segments_not_mapped, segments_to_follow

        for attach_op, model in segments_to_follow(req, value, self._attached,
                                                   self._kv_attached):
            try:
                (self.attach if attach_op == "attach" else self.kv_attach)(model)
            except SESSION_GONE:
                raise  # the session, and what the call took with it, is gone
            except (RadixdError, OSError, MemoryError) as err:
                raise segments_not_mapped(op, attach_op, model, value, err) from err

    # -- batches and receipts -------------------------------------------------------------------

    def batch(self, *, stop_on_error: bool = True) -> ClientBatch:
        """Queue operations and send them as one ``batch`` frame at the end of a ``with``."""
        return ClientBatch(self, stop_on_error)

    @contextlib.contextmanager
    def on_session(self, restarts: int) -> Iterator[None]:
        """Calls this thread makes inside the block go only to the session the client had when
        :attr:`restarts` was ``restarts``: once another thread's call has met a daemon restart
        and the client has connected again, each raises ``SessionRestarted`` without sending
        anything. For calls that carry ids of that session (receipts, page ids, node ids): the
        new session numbers them afresh, so the same ids may be another request's there.
        Checking ``restarts`` before the call is not enough where threads share the client:
        another thread may reconnect between the check and the send."""
        outer = getattr(self._bound, "restarts", None)
        if outer is not None and outer != restarts:  # no session could be both
            raise self._unsent("on_session", outer)
        self._bound.restarts = restarts
        try:
            yield
        finally:
            self._bound.restarts = outer

    @contextlib.contextmanager
    def locked(self, model: str, tokens: Any) -> Iterator[MatchResult]:
        """``match(lock=True)``, then ``unlock`` of its receipt (if any) when the block ends.

        If the block hands the receipt on (for example as ``cache_unfinished(receipt=...)``,
        which moves or drops the lock), set ``m.receipt = None`` so that it is not released twice.
        If the block raises, an error from the unlock is suppressed in favour of the block's.
        A match whose segments cannot be mapped here (``SegmentsNotMapped``) never reaches the
        block: its receipt is released before the error goes on. A lock whose session the
        client lost (a restart, met by this or another thread's call) went with that session:
        nothing is unlocked, since its receipt's number may be another request's lock now.
        """
        with self._io:  # (no other thread reconnects between the count and the match)
            restarts = self.restarts
            try:
                m = self.match(model, tokens, lock=True)
            except SegmentsNotMapped as err:
                with contextlib.suppress(RadixdError):
                    self._unlock_on(restarts, model, getattr(err.result, "receipt", None))
                raise
        try:
            yield m
        except BaseException:
            with contextlib.suppress(RadixdError):
                self._unlock_on(restarts, model, m.receipt)
            raise
        self._unlock_on(restarts, model, m.receipt)

    def _unlock_on(self, restarts: int, model: str, receipt: int | None) -> None:
        """Unlock ``receipt`` unless its session is gone (and its lock with it)."""
        with self._io:
            if receipt is not None and self._sock is not None and self.restarts == restarts:
                self.unlock(model, receipt)

    # -- pools ----------------------------------------------------------------------------------

    def attach(self, model: str) -> AttachedPools:
        """Map the KV pools of ``model`` into this process (needs torch).

        CPU pools arrive as memfd descriptors with the response (SCM_RIGHTS) and are mapped
        shared; GPU pools are opened from their CUDA IPC handles. See
        :class:`~radixd_client.pools.AttachedPools`.
        """
        from .pools import attach_or_update

        with self._io:  # the mapping too: two threads attaching share one pools object
            result, fds = self._call_with_fds("attach", Attach(model=model))
            try:
                return attach_or_update(self._attached, model, result, fds)
            finally:
                close_fds(fds)

    def kv_attach(self, model: str) -> KvHostPools:
        """Map the host (L2) pools of ``model`` into this process (needs torch): the memory the
        key-addressed store's slots index (``kv_lookup``, ``kv_reserve``). See
        :class:`~radixd_client.pools.KvHostPools`."""
        from .pools import attach_host_pools

        with self._io:
            result, fds = self._call_with_fds("kv_attach", KvAttach(model=model))
            try:
                return attach_host_pools(model, result, fds, self._kv_attached)
            finally:
                close_fds(fds)

    def _call_with_fds(self, op: str, req: Request) -> tuple[Any, list[int]]:
        return self._in_turn(self._call_with_fds_once, op, req)

    def _call_with_fds_once(self, op: str, req: Request) -> tuple[Any, list[int]]:
        """One call whose response carries descriptors (SCM_RIGHTS): the result and the fds,
        which the caller closes."""
        sock = self._sock
        if sock is None:
            raise _lost(self._close_reason)
        conn = self._conn
        if conn.buffered:  # bytes no request asked for: the stream is out of step
            raise self._broken(f"unexpected bytes from the daemon before {op}")
        frame = conn.send(op, req)
        fds: list[int] = []
        try:
            try:
                sock.sendall(frame)
                # Every byte of the response is read with recvmsg, so the descriptors are
                # received whichever segment carries them. Nothing was read ahead of it (checked
                # above), no other request is in flight, and the daemon sends nothing unasked.
                space = ancillary_space()
                reply = None
                while reply is None:
                    k, ancdata, msg_flags, _addr = sock.recvmsg_into(
                        [conn.recv_buffer()], space, RECVMSG_FLAGS)
                    if not take_fds(ancdata, msg_flags, fds):
                        raise self._broken(f"the {op} response carried too many descriptors")
                    if not k:
                        raise self._eof(op)
                    conn.received(k)
                    reply = conn.next_event()
            except RadixdError:
                raise
            except BrokenStream as exc:
                raise self._broken(str(exc), exc.__cause__) from exc.__cause__
            except OSError as exc:
                raise self._broken(f"{type(exc).__name__}: {exc}", exc) from exc
            except BaseException as exc:
                self._broken(f"interrupted by {type(exc).__name__} during {op}", exc)
                raise
            if not reply.ok:
                raise reply.value
        except BaseException:
            close_fds(fds)
            raise
        return reply.value, fds

    # -- lifetime -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Close the connection; the daemon then releases everything this session held. A
        closed client does not reconnect.

        With another thread's call in flight, the connection is shut down instead, which wakes
        that call (a close alone would not), and the call closes it. Only then: a shutdown acts
        on the connection everywhere, a forked child's copy included, where a close lets go of
        this process's descriptor only."""
        self._closed_by_user = True
        if os.getpid() != self._pid:  # a forked child's copy: its lock may be held for good
            self._drop()  # (by a thread only the parent has), and the connection is the parent's
            return
        if self._drop_if_idle():
            return
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._drop_if_idle()  # the call ended meanwhile: nobody else would close it

    def _drop_if_idle(self) -> bool:
        """Close the connection unless another thread's call holds the client."""
        if not self._io.acquire(blocking=False):
            return False
        try:
            self._drop()
        finally:
            self._io.release()
        return True

    def _drop(self) -> None:
        """Close the connection. In the process that opened it, shut it down first: a child
        forked meanwhile (multiprocessing, data loader workers) holds a copy of the socket, and
        a close alone would keep the connection, and the session with every page and lock it
        holds, open until that child exits. A forked child's copy is only closed."""
        sock, self._sock = self._sock, None
        if sock is not None:
            self._conn.abandon()
            with contextlib.suppress(OSError):
                if os.getpid() == self._pid:
                    sock.shutdown(socket.SHUT_RDWR)
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
