"""The socket server: frames in, service calls, frames out. It knows sessions and limits, not trees.

One asyncio loop (uvloop when installed) runs everything. A connection is an asyncio Protocol:
complete frames are decoded and handled as they arrive, in order, so the service is never
re-entered; the responses to the frames handled in one turn go out in one write (a pipelining
client costs one send per read, not one per response). A connection's turn ends after TURN_S
when frames remain: the others' requests go first, then its next turn. A malformed body gets
an error response and the session goes on; a length prefix over the limit closes only that
connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import select
import signal
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import Any

import msgspec
from radixd_client import protocol as P
from radixd_client.connection import FrameSplitter, FrameTooLarge

from .checker import Checker
from .config import Config
from .entities import Peer, Session
from .log_throttle import LogThrottle
from .metrics import GcPauses, OpStats
from .open_files import NearLimit
from .process_memory import HeapTrimmer
from .sdnotify import Notifier, listen_fds, watchdog_interval
from .service import Service, ServiceError, error_of
from .sockets import LISTEN_BACKLOG, bind_unix_socket, replaceable_by_others

log = logging.getLogger("radixd.server")

_PEEK = msgspec.msgpack.Decoder(dict)
ATTACH_SEND_TIMEOUT_S = 30.0
#: the largest frame a connection may send before its hello succeeds (a hello is well under
#: 1 KiB): a connection that never says hello must not make the daemon hold max_frame_bytes
#: (16 MiB) of it until hello_timeout_s, times every such connection
MAX_FRAME_BEFORE_HELLO = 64 * 1024
#: how long one connection's frames may run before the others' turn: a client that pipelines
#: thousands of small requests in one write would otherwise hold every other engine back for as
#: long as they all take (one stalled the others 0.2-5 s)
TURN_S = 0.002
#: failed hellos are logged at most once per this many seconds per daemon; the next line says
#: how many were left out meanwhile, so a token-guessing client cannot flood the log
AUTH_LOG_INTERVAL_S = 5.0
#: idle compaction of cold nodes' page ids (Server._compact_idle): about the longest it holds the
#: loop at once, the most steps it takes then, and how soon it looks again after a slice that
#: compacted something, or not
COMPACT_SLICE_S = 0.001
COMPACT_STEPS = 64
COMPACT_BUSY_S = 0.005
COMPACT_IDLE_S = 0.2
#: operations answered synchronously with no special case in _handle: one dict lookup decides
_PLAIN_HANDLERS = {op: h for op, h in Service.HANDLERS.items()
                   if op not in Service.ASYNC_HANDLERS and op not in Service.FD_HANDLERS}


class Connection(asyncio.Protocol):
    def __init__(self, server: Server):
        self.server = server
        self.service = server.service
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None
        self.peer = Peer()
        self.auth_failures = 0
        self._hello_timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.closed = False
        # later frames wait, in order: an operation that waits (load, an attach's send) or the
        # connection's next turn
        self.holding = False
        self.fd: int | None = None  # the socket's, watched for waiting requests
        limits = server.config.server
        self.max_frame = limits.max_frame_bytes
        self.max_inflight = limits.max_inflight
        # the framing rules, shared with the tests; max_frame once the hello has succeeded
        self.frames = FrameSplitter(min(self.max_frame, MAX_FRAME_BEFORE_HELLO))
        self._out: list[bytes] | None = None  # responses held while _process runs, then flushed

    # ------------------------------------------------------------------ transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.fd = sock.fileno()
            self.server.near_limit.accepted(self.fd)
            self.server.watch_readable(self.fd)
            with contextlib.suppress(OSError):
                creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
                pid, uid, gid = struct.unpack("3i", creds)
                self.peer = Peer(pid, uid, gid)
        # backpressure: a client that does not read its responses stops being read from
        transport.set_write_buffer_limits(high=self.max_inflight * 64 * 1024)  # type: ignore
        self._hello_timer = self.server.loop.call_later(
            self.server.config.server.hello_timeout_s, self._hello_expired)

    def _hello_expired(self) -> None:
        """A connection that never authenticates does not hold buffers and a slot forever."""
        if self.session is None and not self.closed and self.transport is not None:
            self._write(P.error_frame(0, P.Code.NOT_AUTHENTICATED,
                                      "no successful hello in time; closing the connection"))
            self.transport.close()
            self.closed = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.server.connections.discard(self)
        if self.fd is not None:
            self.server.unwatch_readable(self.fd)
            self.fd = None
        if self.session is not None:
            self.service.close_session(self.session)
            log.debug("session %d ended (%s)", self.session.id, exc or "closed")
            self.session = None

    def pause_writing(self) -> None:
        if self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and self.paused:
            self.paused = False
            if not self.holding:
                self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.frames.feed(data)
        self._process()

    def _process(self) -> None:
        """Handle every complete frame received, in order, until the connection closes, an
        operation holds it (an attach sending fds, a load: later frames wait for it), or its
        turn (TURN_S) is over while frames remain: then the others' go first."""
        frames = self.frames
        self._out = []
        start, handled = perf_counter(), 0
        try:
            while not self.closed and not self.holding:
                if handled and frames.buffered and perf_counter() - start > TURN_S:
                    self._next_turn()
                    return
                handled += 1
                try:
                    body = frames.next_frame()
                except FrameTooLarge as exc:
                    self._write(exc.frame())
                    self._flush()
                    self.transport.close()  # type: ignore[union-attr]
                    self.closed = True
                    return
                if body is None:
                    return
                try:
                    self._handle(body)
                except Exception:  # a daemon bug: answer it, keep the session and the loop alive
                    log.exception("internal error handling a frame")
                    self._write(P.error_frame(0, P.Code.INTERNAL,
                                              "internal error handling a frame"))
                finally:  # the buffer is compacted below: no view of it may outlive this frame
                    frames.done(body)
        finally:
            frames.compact()
            self._flush()

    # ------------------------------------------------------------------ frames

    def _write(self, frame: bytes) -> None:
        """Inside _process the frame joins the responses flushed when it returns (or before the
        connection closes); anywhere else it is written now."""
        out = self._out
        if out is not None:
            out.append(frame)
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame)

    def _flush(self) -> None:
        """Write the held responses, in order, with one write; later writes go straight out."""
        out, self._out = self._out, None
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _handle(self, body: memoryview) -> None:
        try:
            req = P.decode_request(body)
        except Exception as exc:  # malformed, wrong types, or nested past the decoder's limit
            self._bad_frame(body, exc)
            return
        rid = req.id
        op = req.__struct_config__.tag
        server = self.server
        t0 = perf_counter()
        try:
            server.ops += 1
            if server.stopping:
                raise ServiceError(P.Code.SHUTTING_DOWN,
                                   "the daemon is stopping; reconnect to its successor")
            if self.session is None:
                if isinstance(req, P.Hello):
                    self._hello(req)
                    server.op_stats.observe(op, perf_counter() - t0)
                    return
                raise ServiceError(P.Code.NOT_AUTHENTICATED,
                                   "send hello (with the tenant token) before anything else")
            session = self.session
            session.ops += 1
            handler = _PLAIN_HANDLERS.get(op)
            if handler is not None:  # the common case first: no special handling
                self._write(P.ok_frame(rid, handler(self.service, session, req)))
            elif isinstance(req, P.Batch):
                self._write(P.ok_frame(rid, self._batch(req)))
            elif op in Service.FD_HANDLERS:
                self._attach(req)
            elif isinstance(req, P.Hello):
                raise ServiceError(P.Code.ALREADY_AUTHENTICATED,
                                   f"this connection is already session {self.session.id}")
            elif Service.waits(op, req):
                self._run_async(rid, op, req.model, Service.ASYNC_HANDLERS[op](
                    self.service, self.session, req), t0)
                return
            else:
                handler = Service.HANDLERS[op]
                self._write(P.ok_frame(rid, handler(self.service, self.session, req)))
            server.op_stats.observe(op, perf_counter() - t0)
        except Exception as exc:  # every refusal becomes a response; the session survives
            code, message, details = error_of(exc)
            if code == P.Code.INTERNAL:
                log.exception("internal error handling %s", type(req).__name__)
            self._write(P.error_frame(rid, code, message, details))
            self.server.op_stats.observe(op, perf_counter() - t0, code)
            if code == P.Code.AUTH_FAILED and self.auth_failures >= \
                    self.server.config.server.max_auth_failures:
                self._flush()
                self.transport.close()  # type: ignore[union-attr]
                self.closed = True  # frames already received are not processed

    def _bad_frame(self, body: memoryview, exc: Exception) -> None:
        rid, op = 0, None
        with contextlib.suppress(Exception):
            peek = _PEEK.decode(body)
            raw_id = peek.get("id", 0)
            # bool is an int subclass: a `true` id is not an integer id (protocol.md 3.1)
            rid = raw_id if type(raw_id) is int else 0
            op = peek.get("op")
        if isinstance(op, str) and op not in P.OPS:
            self._write(P.error_frame(rid, P.Code.UNKNOWN_OP,
                                      f"unknown operation {op!r}; known: {sorted(P.OPS)}"))
        else:
            self._write(P.error_frame(rid, P.Code.BAD_FRAME, f"malformed request: {exc}"))

    def _hello(self, req: P.Hello) -> None:
        if req.version != P.PROTOCOL_VERSION:
            raise ServiceError(P.Code.VERSION_UNSUPPORTED,
                               f"protocol version {req.version} is not supported; this daemon "
                               f"speaks {P.PROTOCOL_VERSION}", supported=[P.PROTOCOL_VERSION])
        try:
            tenant = self.service.authenticate(req.token, self.peer)
        except ServiceError as exc:
            self.auth_failures += 1
            self.server.auth_failed(self.peer, str(exc))
            raise
        self.session = self.service.open_session(tenant, self.peer, req.client)
        self.frames.max_frame = self.max_frame
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        log.debug("session %d opened: tenant %s, peer %s, client %r", self.session.id,
                  tenant.name, self.peer, req.client)
        self._write(P.ok_frame(req.id, self.service.hello_result(self.session)))

    def _batch(self, req: P.Batch) -> P.BatchResult:
        if len(req.ops) > self.max_inflight:
            raise ServiceError(P.Code.TOO_MANY_INFLIGHT,
                               f"a batch of {len(req.ops)} operations; the limit is "
                               f"{self.max_inflight}", limit=self.max_inflight)
        items: list[P.BatchItem] = []
        failed = False
        enc = P.encode_body
        stats = self.server.op_stats
        for op in req.ops:
            if failed and req.stop_on_error:
                items.append(P.BatchItem(ok=False, error=P.Error(
                    code=P.Code.NOT_EXECUTED,
                    message="not executed: an earlier operation of the batch failed")))
                continue
            tag = op.__struct_config__.tag
            t0 = perf_counter()
            try:
                handler = Service.HANDLERS[tag]
                result = handler(self.service, self.session, op)
                items.append(P.BatchItem(ok=True, result=msgspec.Raw(enc(result))))
                stats.observe(tag, perf_counter() - t0)
            except Exception as exc:
                code, message, details = error_of(exc)
                stats.observe(tag, perf_counter() - t0, code)
                if code == P.Code.INTERNAL:
                    log.exception("internal error in a batch")
                items.append(P.BatchItem(ok=False, error=P.Error(code=code, message=message,
                                                                 details=details)))
                failed = True
        return P.BatchResult(results=items)

    def _run_async(self, rid: int, op: str, model: str, coro: Any, t0: float) -> None:
        """An operation that waits (a copy, Redis): other sessions are served meanwhile; this
        session's later frames wait, so its responses stay in request order."""
        self.holding = True
        self.transport.pause_reading()  # type: ignore[union-attr]
        task = self.server.loop.create_task(self._finish_async(rid, op, coro, t0))
        self.server.async_ops[task] = model
        task.add_done_callback(self.server.async_op_done)

    async def _finish_async(self, rid: int, op: str, coro: Any, t0: float) -> None:
        try:
            result = await coro
            frame = P.ok_frame(rid, result)
            self.server.op_stats.observe(op, perf_counter() - t0)
        except Exception as exc:
            code, message, details = error_of(exc)
            if code == P.Code.INTERNAL:
                log.exception("internal error handling %s", op)
            frame = P.error_frame(rid, code, message, details)
            self.server.op_stats.observe(op, perf_counter() - t0, code)
        finally:
            self.holding = False
        if self.closed or self.transport is None:
            return
        self._write(frame)
        if not self.paused:
            self.transport.resume_reading()
        self._process_soon()

    def _process_soon(self) -> None:
        """Go on with the frames that waited behind an operation that waits (a load, prefetch,
        fetching kv_lookup or kv_clear) or an attach, from the event
        loop rather than from inside the finished task, through one more frame (_resume), as
        data_received does: every frame is then decoded at the same stack depth, so the
        decoder's nesting limit (protocol.md 3.2) is the same for all."""
        self.server.loop.call_soon(self._resume)

    def _resume(self) -> None:
        self._process()

    def _next_turn(self) -> None:
        """Give way: nothing more is read meanwhile, and the frames already read are handled
        from the event loop's queue, after what the other connections sent (I/O first)."""
        self.holding = True
        self.server.turns_waiting += 1  # (read already: the background work gives way to them)
        self.transport.pause_reading()  # type: ignore[union-attr]
        self.server.loop.call_soon(self._turn)

    def _turn(self) -> None:
        self.holding = False
        self.server.turns_waiting -= 1
        if self.closed or self.transport is None:
            return
        if not self.paused:
            self.transport.resume_reading()
        self._process()

    def _attach(self, req: Any) -> None:
        """An ``attach`` or ``kv_attach``: the response carries descriptors (SCM_RIGHTS), so it
        goes out with sendmsg on the socket itself, after every byte written before it."""
        handler = Service.FD_HANDLERS[req.__struct_config__.tag]
        result, fds = handler(self.service, self.session, req)  # type: ignore[arg-type]
        if not fds:
            self._write(P.ok_frame(req.id, result))
            return
        self._flush()  # the responses before it go first
        self._out = []
        if self._send_fds_now(P.ok_frame(req.id, result), fds):
            return
        # The client has not read what was written before: until it does, later frames wait
        # (responses stay in request order) and nothing more is read. No descriptor is kept
        # meanwhile: a client that never reads would pin one per segment, and other sessions
        # may renew a listed segment, closing its memfd (a number soon another namespace's).
        # The answer is made again when it can be sent, from the pools as they are then.
        self.holding = True
        self.transport.pause_reading()  # type: ignore[union-attr]
        self.server.loop.create_task(self._send_with_fds(req, handler))

    def _send_fds_now(self, frame: bytes, fds: list[int]) -> bool:
        """Send ``frame`` with ``fds`` if nothing written before it still waits and the socket
        takes it now; False: nothing was sent. A socket error closes the connection (True)."""
        transport = self.transport
        assert transport is not None
        if transport.is_closing():
            return True
        if not fds:  # (a namespace that no segment serves yet)
            transport.write(frame)
            return True
        if transport.get_write_buffer_size():
            return False
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
        # the loop's own socket, borrowed (detached, never closed, here): a dup of it would
        # take a descriptor, which a daemon at its limit does not have
        sock = socket.socket(fileno=transport.get_extra_info("socket").fileno())
        try:
            sent = sock.sendmsg([frame], rights)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            log.warning("could not send pool fds to session %s: %s",
                        self.session.id if self.session else "?", exc)
            transport.close()
            self.closed = True
            return True
        finally:
            sock.detach()
        if sent < len(frame):  # the fds went with the first bytes; the rest is plain data
            transport.write(frame[sent:])
        return True

    async def _send_with_fds(self, req: Any, handler: Any) -> None:
        transport = self.transport
        assert transport is not None
        loop = self.server.loop
        deadline = loop.time() + ATTACH_SEND_TIMEOUT_S
        writable = select.poll()  # (poll(2): no descriptor taken, unlike epoll)
        writable.register(transport.get_extra_info("socket").fileno(), select.POLLOUT)
        try:
            while True:
                await asyncio.sleep(0.005)
                if self.closed or transport.is_closing():
                    break
                if loop.time() > deadline:
                    log.warning("could not send pool fds to session %s: the client read "
                                "nothing for %ss", self.session.id if self.session else "?",
                                ATTACH_SEND_TIMEOUT_S)
                    transport.close()
                    self.closed = True
                    break
                if transport.get_write_buffer_size() or not writable.poll(0):
                    continue  # (the answer is made only when it can go: no fds are held)
                try:
                    result, fds = handler(self.service, self.session, req)
                except Exception as exc:  # (a pool closed meanwhile: the daemon is stopping)
                    code, message, details = error_of(exc)
                    if code == P.Code.INTERNAL:
                        log.exception("internal error handling %s", type(req).__name__)
                    transport.write(P.error_frame(req.id, code, message, details))
                    break
                if self._send_fds_now(P.ok_frame(req.id, result), fds):
                    break
        finally:
            self.holding = False
            if not self.closed:
                if not self.paused:
                    transport.resume_reading()
                self._process_soon()


class Server:
    """The engines' socket and the daemon's lifecycle (start, READY, signals, shutdown).

    Its collaborators come from the composition root (daemon/app.py): the service, the checker,
    the systemd notifier, and ``start_admin``, which starts the admin endpoint before READY (the
    server does not know what that endpoint is). It also keeps the counters only it can see:
    operations handled and their latencies, which the metrics read through ``ServerState``."""

    def __init__(self, config: Config, service: Service, notifier: Notifier | None = None,
                 checker: Checker | None = None,
                 start_admin: Callable[[], Awaitable[Any]] | None = None):
        self.config = config
        self.service = service
        self.notifier = notifier or Notifier(None)
        self.checker = checker or Checker(service, config.checker)
        # the checker goes cheap while operations flow, gives way to a waiting request, and
        # strict mode stops this server
        self.checker.bind(ops=lambda: self.ops, stop=self.stop, pending=self.request_pending)
        # the listening socket and every connection, level-triggered: a request that waits to be
        # read (the loop's own selector is not asked: it is the loop's)
        self._readable = select.epoll()
        self.start_admin = start_admin
        self.ready = False  # pools and socket exist and the daemon is not shutting down
        self._owns_socket = True
        self.connections: set[Connection] = set()
        self.ops = 0
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._server: asyncio.AbstractServer | None = None
        self._stopping: asyncio.Event | None = None
        self.exit_code = 0
        self.stopping = False
        self.started = time.time()
        self.op_stats = OpStats()
        self.heap_trimmer = HeapTrimmer(config.server.malloc_trim_interval_s)
        self.gc_pauses = GcPauses()
        self.near_limit = NearLimit()
        self.compact_seconds = 0.0  # in _compact_idle
        self.socket_path = config.server.socket
        self.admin: Any = None  # what start_admin returned (it has an async stop())
        #: operations that wait (load, prefetch, a fetching kv_lookup, kv_clear) in flight, by
        #: task: the model each one uses
        self.async_ops: dict[asyncio.Task, str] = {}
        self.turns_waiting = 0  # connections with frames read, waiting for their next turn
        self._auth_log = LogThrottle(AUTH_LOG_INTERVAL_S)

    def async_op_done(self, task: asyncio.Task) -> None:
        self.async_ops.pop(task, None)

    def auth_failed(self, peer: Peer, reason: str) -> None:
        """Log a failed hello, rate-limited (at most one line per AUTH_LOG_INTERVAL_S, with the
        count of those left out): operators see guessing or misconfigured engines, and a client
        cannot flood the log. ``reason`` is the refusal's message, which never holds the token."""
        if self._auth_log.due():
            log.warning("failed hello (auth_failed) from pid %d uid %d gid %d: %s "
                        "(%d earlier failures not logged)", peer.pid, peer.uid, peer.gid, reason,
                        self._auth_log.take_held_back())

    async def start(self) -> None:
        """Bind (or take systemd's) socket and serve on it: after :meth:`_serve` set the
        signal handlers and the stop event, which a signal during start-up may already set."""
        path = self.config.server.socket
        passed = listen_fds()
        if passed:  # socket activation: systemd owns the socket file
            sock = passed[0]
            if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                raise OSError(errno.EINVAL, "the socket systemd passed is not a Unix stream "
                                            "socket (radixd.socket needs ListenStream=/path)")
            sock.setblocking(False)
            self._owns_socket = False
            path = sock.getsockname() or path
            for extra in passed[1:]:
                log.warning("ignoring extra socket passed by systemd: fd %d", extra.fileno())
                extra.close()
        else:
            sock = bind_unix_socket(path, self.config.server.socket_mode_int)
            if problem := replaceable_by_others(path):
                log.warning("server.socket: %s", problem)
        # create_unix_server listens again with its own default backlog (100) unless told
        self._server = await self.loop.create_unix_server(lambda: Connection(self), sock=sock,
                                                          backlog=LISTEN_BACKLOG)
        self.watch_readable(sock.fileno())
        self.service.start_tiers()
        self.socket_path = path
        log.info("serving on %s (models: %s)%s", path, ", ".join(self.service.models),
                 " (socket passed by systemd)" if passed else "")

    async def serve(self) -> int:
        with self.gc_pauses.installed():
            return await self._serve()

    async def _serve(self) -> int:
        # the handlers before the socket: a client that can connect may signal at once
        self.loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.stop)
        self.loop.add_signal_handler(signal.SIGUSR1, self.checker.on_request)
        # by default SIGHUP would end the process at once (no drain, the socket left behind,
        # and under systemd a clean exit that Restart=on-failure does not restart)
        self.loop.add_signal_handler(signal.SIGHUP, _no_reload)
        await self.start()
        try:
            if self.start_admin is not None:
                self.admin = await self.start_admin()
        except BaseException:
            await self.shutdown()
            raise
        tasks = [self.loop.create_task(self.checker.loop()),
                 self.loop.create_task(self.heap_trimmer.loop())]
        if self.config.server.idle_compaction:
            tasks.append(self.loop.create_task(self._compact_idle()))
        interval = watchdog_interval()
        if interval is not None:
            tasks.append(self.loop.create_task(self._watchdog(interval)))
        if not self.stopping:  # (a SIGTERM during start-up: straight to shutdown)
            self.ready = True
            self.notifier.ready(self._status_line())
        try:
            await self._stopping.wait()  # type: ignore[union-attr]
        finally:
            for t in tasks:
                t.cancel()
            await self.shutdown()
        return self.exit_code

    def watch_readable(self, fd: int) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._readable.register(fd, select.EPOLLIN)

    def unwatch_readable(self, fd: int) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._readable.unregister(fd)

    def request_pending(self) -> bool:
        """Whether a connection or a new client waits to be read (one epoll_wait, no wait): the
        background check gives way to it (about a microsecond, asked after every step)."""
        if self.turns_waiting:  # frames read already, waiting for their connection's turn
            return True
        try:
            return bool(self._readable.poll(0))
        except (OSError, ValueError):
            return False

    async def _compact_idle(self) -> None:
        """Cold nodes' page ids to their compact form while no request waits: steps of at most
        one node per model, for about ``COMPACT_SLICE_S`` at a time, so a request that arrives
        waits for one step at most (tens of microseconds at a page of one token; a node of 100k
        ids takes about a millisecond)."""
        while True:
            done = 0
            start = time.perf_counter()
            end = start + COMPACT_SLICE_S
            for _ in range(COMPACT_STEPS):  # a step looks at a few nodes, maybe all in use
                if self.request_pending() or time.perf_counter() >= end:
                    break
                try:
                    done += self.service.compact_cold()
                except Exception:  # a bug: every node keeps a valid form; the checker judges
                    log.exception("idle compaction of page ids failed; it stays off")
                    return
            self.compact_seconds += time.perf_counter() - start
            await asyncio.sleep(COMPACT_BUSY_S if done else COMPACT_IDLE_S)

    def _status_line(self) -> str:
        return (f"serving {len(self.service.models)} model(s) to {len(self.service.sessions)} "
                f"session(s) on {self.socket_path}")

    async def _watchdog(self, interval: float) -> None:
        """WATCHDOG=1 from the event loop itself: a stuck loop stops the pings and systemd
        restarts the daemon."""
        while True:
            self.notifier.notify(watchdog=1, status=self._status_line())
            await asyncio.sleep(interval)

    def stop(self, exit_code: int | None = None) -> None:
        if exit_code is not None:
            self.exit_code = exit_code
        if not self.stopping:
            self.notifier.stopping("stopping: ending sessions")
        self.stopping = True
        self.ready = False
        if self._stopping is not None:
            self._stopping.set()

    async def shutdown(self) -> None:
        """Stop accepting, end every session (releasing what it held), remove the socket."""
        if self.admin is not None:
            admin, self.admin = self.admin, None
            with contextlib.suppress(Exception):
                await admin.stop()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        await asyncio.sleep(0)
        for conn in list(self.connections):
            conn.connection_lost(None)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        if self._owns_socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.server.socket)
        deadline = time.monotonic() + self.config.l3.drain_timeout_s  # one budget for it all
        if self.async_ops:  # copies in flight write into the pools: let them land first
            await asyncio.wait(list(self.async_ops), timeout=self.config.l3.drain_timeout_s)
        try:
            busy = await self.service.stop_tiers(deadline)
        except Exception:  # noqa: BLE001 - a failing drain must not keep the daemon up
            log.exception("stopping the memory tiers")
            busy = set(self.service.models)  # tier jobs may still run and hold what they took
        if left_out := self._auth_log.take_held_back():
            log.warning("%d failed hellos not logged before the stop", left_out)
        try:
            violations = self.service.check(deep=False)
            # a load still running, or a drain that failed, still holds its pages and pins
            busy |= {model for op, model in self.async_ops.items() if not op.done()}
            violations += self.service.check_at_rest(busy)
        except Exception:  # noqa: BLE001 - a checker bug must not keep the pools mapped
            log.exception("checking the cache at shutdown")
            violations = []
        if violations:
            log.error("invariant violations at shutdown: %s", violations)
        self.service.close()
        self._readable.close()
        log.info("stopped")


def _no_reload() -> None:
    log.warning("SIGHUP ignored: radixd has no reload; restart it to apply a new configuration")
