"""The admin HTTP endpoint: health, readiness, Prometheus metrics, JSON views, checks, eviction.

It runs inside the daemon's own event loop (aiohttp ``AppRunner`` on a socket it binds itself), so
every handler sees the service between two operations, never in the middle of one, and a handler
that changes state (``POST /v1/evict``) is as atomic as an engine's operation. It reads the daemon
only through the service's query API (daemon/queries.py), the checker and ``ServerState``.

Security (docs/design.md section 7): it binds loopback (``admin.host``) or a Unix socket, every
route but ``GET /healthz`` and ``GET /`` (a static page with no data in it) needs
``Authorization: Bearer <token>``, the token is kept only as its SHA-256 digest and compared in
constant time, and no response ever contains a token or a digest. With no token configured, a
random one is generated at start and written (mode 0600) to ``admin.token_file``, by default
``admin.token`` beside the engines' socket, where ``radixd status`` finds it; beside the socket
too, ``<socket>.admin`` says which endpoint (and which daemon instance) answers for that socket.
A clean stop removes both, if they still hold what this daemon wrote.

Every route's query, body and response is a type in daemon/admin_types.py; the OpenAPI document
at ``/v1/openapi.json`` is generated from them, and tests/ops/test_admin.py runs schemathesis
against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import hmac
import importlib.resources
import json
import logging
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Any, cast

import msgspec
from aiohttp import web

from . import __version__, exposition
from .admin_requests import BadRequest, decode_body, decode_query
from .admin_types import (
    MAX_VIOLATIONS_SHOWN,
    ROUTES,
    Alive,
    CheckResult,
    Error,
    ErrorDetail,
    EvictRequest,
    EvictResult,
    Model,
    ModelStats,
    NoQuery,
    Ready,
    Stats,
    TenantStats,
    Tree,
    TreeQuery,
    openapi_document,
)
from .admin_types import Checker as CheckerOut
from .checker import Checker
from .config import Config, admin_endpoint_file, admin_token_file, redacted
from .log_throttle import LogThrottle
from .queries import NotFound, ServerState
from .service import Service
from .sockets import bind_tcp, bind_unix_socket, replaceable_by_others

__all__ = ["AdminHandle", "BadRequest", "TokenFileError", "openapi_document", "start_admin"]


log = logging.getLogger("radixd.admin")

# routes that need no token (GET routes answer HEAD too)
_PUBLIC = {(m, r.path) for r in ROUTES if r.public for m in (r.method, "HEAD")}

#: how long a connection may stay open without a request (aiohttp's own default is an hour: the
#: endpoint is open to every local user, whose idle connections would use up the daemon's fds)
IDLE_TIMEOUT_S = 10.0
#: the longest a refused connection stays open, reading what its client still sends
REFUSED_LINGER_S = 1.0
#: the answer to a connection past admin.max_connections, before it is closed
_TOO_MANY = json.dumps({"error": {"code": "too_many_connections", "message": (
    "the admin endpoint has admin.max_connections open; close idle ones")}}).encode()


class _Refused(asyncio.Protocol):
    """A connection past the limit: one 503, then a close once the client has sent what it had
    (its request is read and dropped, as asyncio.Protocol does) or after REFUSED_LINGER_S:
    closed with a request body still unread, the kernel would reset the connection, and the
    client never see the 503.
    ``lingering`` counts those still open: past the limit again, one is closed at once (a flood
    of them must not hold the descriptors the limit keeps for the engines)."""

    def __init__(self, lingering: set[_Refused], limit: int) -> None:
        self._close: asyncio.TimerHandle | None = None
        self._lingering = lingering
        self._limit = limit

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr = cast(asyncio.Transport, transport)
        tr.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json"
                 b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(_TOO_MANY), _TOO_MANY))
        if len(self._lingering) >= self._limit:  # (counted here: a burst is exact on any loop)
            tr.close()
            return
        if tr.can_write_eof():
            tr.write_eof()
        self._lingering.add(self)
        self._close = asyncio.get_running_loop().call_later(REFUSED_LINGER_S, tr.close)

    def eof_received(self) -> bool:
        return False  # the client is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        self._lingering.discard(self)
        if self._close is not None:
            self._close.cancel()


class _Capped:
    """The listening socket's protocol factory: aiohttp's request handler while fewer than
    ``limit`` connections are open (aiohttp has no limit of its own)."""

    def __init__(self, server: web.Server, limit: int) -> None:
        self.server, self.limit = server, limit
        self.refused = 0
        self._throttle = LogThrottle(60)
        self._lingering: set[_Refused] = set()

    def __call__(self) -> asyncio.Protocol:
        open_ = self.open()
        if open_ < self.limit:
            return self.server()
        self.refused += 1
        if self._throttle.due():
            log.warning("admin endpoint: %d connections open (admin.max_connections); refused "
                        "%d so far", open_, self.refused)
        return _Refused(self._lingering, self.limit)

    def open(self) -> int:
        """Connections open and staying so: one being closed (its idle time up) is on its way
        out, though aiohttp forgets it only a loop turn later, when a client that saw it close
        may already be connecting again."""
        return sum(1 for h in self.server.connections
                   if h.transport is not None and not h.transport.is_closing())


class AdminHandle:
    """A running admin endpoint: where it listens, and how to stop it."""

    def __init__(self, url: str, port: int | None, runner: web.AppRunner,
                 listener: asyncio.Server, unix_path: str | None, token_file: str | None, *,
                 written: dict[str, str] | None = None, lock: int | None = None):
        self.url = url
        self.port = port
        self.token_file = token_file  # where a generated token was written (None: configured)
        self._runner = runner
        self._listener = listener
        self._unix_path = unix_path
        self._written = dict(written or {})  # path -> what this daemon wrote there
        self._lock = lock  # the claim on the token file (closed last: see stop)

    async def stop(self) -> None:
        """Stop serving, and remove the files this daemon wrote (the generated token, the
        endpoint file) if they still hold what it wrote: left behind, the next daemon's
        ``radixd status`` would read a token no daemon accepts. A file another daemon has
        rewritten since is that daemon's, and stays."""
        self._listener.close()  # no new connections; the runner closes the open ones
        await self._runner.cleanup()
        if self._unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._unix_path)
        for path, text in self._written.items():
            remove_if_unchanged(path, text)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        log.info("admin endpoint stopped")


def remove_if_unchanged(path: str, text: str) -> bool:
    """Unlink ``path`` if it holds exactly ``text``; True when it was removed."""
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() != text:
                return False
        os.unlink(path)
    except OSError:
        return False
    return True


class TokenFileError(OSError):
    """The generated admin token could not be written (always fatal: nobody could use it)."""


# ---------------------------------------------------------------------------- start and stop

async def start_admin(config: Config, service: Service, state: ServerState, checker: Checker,
                      socket_path: str) -> AdminHandle:
    """Bind the admin endpoint per ``config.admin`` and serve it in the running loop.

    ``socket_path``: the engines' socket, beside which a generated token is written."""
    cfg = config.admin
    digest, token_file, token_text, lock = _token_digest(config, socket_path)
    app = web.Application(middlewares=[_middleware], client_max_size=64 * 1024)
    admin = _Admin(config, service, state, checker, digest)
    app[_ADMIN] = admin
    admin.routes(app)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0,
                           keepalive_timeout=IDLE_TIMEOUT_S)
    listener: asyncio.Server | None = None
    sock = None
    try:
        await runner.setup()
        if cfg.unix_socket is not None:
            sock = bind_unix_socket(cfg.unix_socket, 0o660)
            if problem := replaceable_by_others(cfg.unix_socket):
                log.warning("admin.unix_socket: %s", problem)
            url, port, unix_path = f"unix:{cfg.unix_socket}", None, cfg.unix_socket
        else:
            sock = bind_tcp(cfg.host, cfg.port)
            port = sock.getsockname()[1]
            host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
            url, unix_path = f"http://{host}:{port}", None
        assert runner.server is not None  # (set up above)
        # not serving until it is ours: a start cancelled meanwhile leaves nothing accepting
        listener = await asyncio.get_running_loop().create_server(
            _Capped(runner.server, cfg.max_connections), sock=sock, start_serving=False)
        await listener.start_serving()
    except BaseException:
        if listener is not None:
            listener.close()
        elif sock is not None:
            sock.close()
        if sock is not None and cfg.unix_socket is not None:  # bound by this start
            with contextlib.suppress(OSError):
                os.unlink(cfg.unix_socket)
        await runner.cleanup()
        if token_file is not None:
            remove_if_unchanged(token_file, token_text)
        if lock is not None:
            os.close(lock)
        raise
    written = {token_file: token_text} if token_file is not None else {}
    endpoint = admin_endpoint_file(socket_path)
    text = json.dumps({"url": url, "instance": service.instance, "pid": os.getpid(),
                       "started": state.started, "token_file": token_file}) + "\n"
    try:
        _write_secret(endpoint, text, mode=0o644)  # no secret: where to ask, and who answers
        written[endpoint] = text
    except OSError as exc:  # only a convenience for radixd status --socket
        log.warning("cannot write the admin endpoint file %s: %s", endpoint, exc.strerror or exc)
    if token_file is not None:  # (not before: a failed bind removed the file again)
        log.info("admin token generated and written to %s (mode 0600)", token_file)
    log.info("admin endpoint on %s", url)  # (after its endpoint file: the line says it is all up)
    return AdminHandle(url, port, runner, listener, unix_path, token_file, written=written,
                       lock=lock)


def _token_digest(config: Config, socket_path: str
                  ) -> tuple[bytes, str | None, str, int | None]:
    """The SHA-256 digest of the bearer token, generating (and writing) one if none is set;
    then also where it was written, the file's text (removed at a clean stop) and the lock
    that claims the file while this daemon runs (:func:`_claim`)."""
    cfg = config.admin
    if cfg.token is not None:
        return hashlib.sha256(cfg.token.encode()).digest(), None, "", None
    if cfg.token_sha256 is not None:
        return bytes.fromhex(cfg.token_sha256), None, "", None
    # hex: a generated token never starts with '-', which a command line would read as a flag
    token = secrets.token_hex(32)
    path = admin_token_file(config, socket_path)
    try:
        lock = _claim(path)
        if lock is None and cfg.token_file is not None:
            raise TokenFileError(errno.EEXIST, f"admin.token_file {path} is the token of "
                                               "another running daemon: give this one another "
                                               "admin.token_file")
        if lock is None:  # another daemon's socket shares the directory: its token stays,
            # this one's goes beside this socket (the endpoint file names it, for radixd status)
            log.info("%s is the admin token of another running daemon", path)
            path = f"{socket_path}.token"
            lock = _claim(path)
            if lock is None:
                raise TokenFileError(errno.EEXIST, f"{path} is the admin token of another "
                                                   "running daemon: set admin.token_file")
    except TokenFileError:
        raise
    except OSError as exc:
        raise TokenFileError(exc.errno, f"cannot write the admin token to {path} (its "
                                        f"lock file): {exc.strerror or exc} (set "
                                        "admin.token_file, or admin.token_sha256)") from None
    try:
        if not _a_token_or_nothing(path):
            raise TokenFileError(errno.EEXIST, f"{path} exists and is not an admin token a "
                                               "daemon wrote (a regular file of 64 hex digits): "
                                               "give another path, or remove it")
        _write_secret(path, token + "\n")
    except TokenFileError:
        os.close(lock)
        raise
    except OSError as exc:
        os.close(lock)
        raise TokenFileError(exc.errno, f"cannot write the admin token to {path}: "
                                        f"{exc.strerror or exc} (set admin.token_file, or "
                                        "admin.token_sha256)") from None
    return hashlib.sha256(token.encode()).digest(), path, token + "\n", lock


def _a_token_or_nothing(path: str) -> bool:
    """Whether ``path`` is free for a generated token: absent, or a regular file holding a
    token a daemon wrote there before (one that stopped without removing it: 64 hex digits, or
    the 43 URL-safe characters of versions before 2026-11). Anything else is someone's:
    writing over it, and removing it at the stop, lost it (and a FIFO would block the open)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        text = f.read(66)
    return re.fullmatch(rb"[0-9a-f]{64}\n|[A-Za-z0-9_-]{43}\n", text) is not None


def _claim(path: str) -> int | None:
    """An exclusive lock on ``<path>.lock``, held while this daemon runs (the fd; closing it
    lets go): None when another running daemon holds it. The kernel drops it with the process,
    so a daemon that died leaves no claim behind."""
    Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_secret(path: str, text: str, mode: int = 0o600) -> None:
    """Write atomically, never through a symlink, readable by the owner only (by default)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.fchmod(fd, mode)
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        os.replace(tmp, p)
    except BaseException:  # (the secret must not stay behind under another name)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


# ---------------------------------------------------------------------------- errors and auth

def _error(status: int, code: str, message: str, parameter: str | None = None,
           headers: dict[str, str] | None = None) -> web.Response:
    detail = ErrorDetail(code, message, msgspec.UNSET if parameter is None else parameter)
    return _respond(Error(detail), status, headers)


def _respond(value: Any, status: int = 200, headers: dict[str, str] | None = None
             ) -> web.Response:
    return web.Response(body=msgspec.json.encode(value), status=status, headers=headers,
                        content_type="application/json")


_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found",
               405: "method_not_allowed", 413: "payload_too_large",
               415: "unsupported_media_type"}


@web.middleware
async def _middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    admin: _Admin = request.app[_ADMIN]
    if (request.method, request.path) not in _PUBLIC:
        denied = admin.authenticate(request)
        if denied is not None:
            return denied
    try:
        if request.body_exists:  # all of it in time: a body that never ends held a slot forever
            try:
                await asyncio.wait_for(request.read(), IDLE_TIMEOUT_S)
            except asyncio.TimeoutError:  # (not the builtin before Python 3.11)
                late = _error(408, "request_timeout",
                              f"the request body did not arrive within {IDLE_TIMEOUT_S:g} s")
                late.force_close()
                return late
        return await handler(request)
    except BadRequest as exc:
        return _error(400, "bad_request", str(exc), exc.parameter)
    except NotFound as exc:
        return _error(404, "not_found", str(exc))
    except web.HTTPException as exc:  # no such route (404), wrong method (405), too large (413)
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        message = {404: f"no route {request.path}; see /v1/openapi.json",
                   405: f"{request.method} is not allowed on {request.path} "
                        f"(allowed: {exc.headers.get('Allow', 'none')})"}.get(
            exc.status, exc.reason)
        return _error(exc.status, _HTTP_CODES.get(exc.status, "http_error"), message,
                      headers=headers)
    except Exception:
        log.exception("admin endpoint: internal error handling %s %s", request.method,
                      request.path)
        return _error(500, "internal", "internal error in the admin endpoint (see the log)")


# ---------------------------------------------------------------------------- the routes

class _Admin:
    def __init__(self, config: Config, service: Service, state: ServerState, checker: Checker,
                 digest: bytes):
        self.config = config
        self.service = service
        self.state = state
        self.checker = checker
        self._digest = digest
        self._collector = exposition.Collector(service, state, checker,
                                               config.admin.tenant_label_limit)
        self._handlers = {
            "/": self.status_page, "/healthz": self.healthz, "/readyz": self.readyz,
            "/metrics": self.metrics, "/v1/stats": self.stats, "/v1/tenants": self.tenants,
            "/v1/sessions": self.sessions, "/v1/models": self.models, "/v1/tree": self.tree,
            "/v1/check": self.check, "/v1/evict": self.evict, "/v1/config": self.config_view,
            "/v1/openapi.json": self.openapi,
        }

    def routes(self, app: web.Application) -> None:
        for route in ROUTES:
            add = app.router.add_get if route.method == "GET" else app.router.add_post
            add(route.path, self._validated(route.query, self._handlers[route.path]))

    @staticmethod
    def _validated(query: Any, handler: Any) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await handler(request, None if query is None else decode_query(request, query))

        return handle

    def authenticate(self, request: web.Request) -> web.Response | None:
        """None when the bearer token is right, else the 401 response."""
        header = request.headers.get("Authorization")
        scheme, _, credential = (header or "").strip().partition(" ")
        credential = credential.strip()
        if scheme.lower() == "bearer" and credential:
            try:
                digest = hashlib.sha256(credential.encode("utf-8", "surrogateescape")).digest()
            except UnicodeError:
                digest = b""
            if hmac.compare_digest(digest, self._digest):
                return None
            return _error(401, "unauthorized", "the bearer token is not valid",
                          headers={"WWW-Authenticate":
                                   'Bearer realm="radixd", error="invalid_token"'})
        why = ("missing Authorization header" if header is None
               else "the Authorization header must be 'Bearer <token>'")
        return _error(401, "unauthorized",
                      f"{why}: every admin route but GET /healthz and GET / needs the admin "
                      "token (admin.token_file, by default admin.token beside the socket)",
                      headers={"WWW-Authenticate": 'Bearer realm="radixd"'})

    def _model_name(self, name: str | msgspec.UnsetType, parameter: str = "model") -> str:
        models = self.service.model_names()
        if name is msgspec.UNSET:
            if len(models) == 1:
                return models[0]
            raise BadRequest(f"{parameter} is required: this daemon serves {len(models)} models "
                             f"({', '.join(models)})", parameter)
        if name not in models:
            raise NotFound(f"no model named {name!r} (models: {', '.join(models)})")
        return name  # type: ignore[return-value]

    # -- health

    async def healthz(self, request: web.Request, _: None) -> web.Response:
        return _respond(Alive())

    async def readyz(self, request: web.Request, _: None) -> web.Response:
        if self.state.ready:
            return _respond(Ready(True))
        return _respond(Ready(False, "stopping" if self.state.stopping else "starting"), 503)

    async def metrics(self, request: web.Request, _: None) -> web.Response:
        body, content_type = exposition.render(self._collector,
                                               request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": content_type})

    # -- views

    async def stats(self, request: web.Request, _: NoQuery) -> web.Response:
        svc = self.service
        models = {v.name: ModelStats(
            page_size=v.info.page_size, sliding_window=v.info.sliding_window, policy=v.policy,
            pools=v.pools, nodes=v.nodes, matches=v.matches, match_tokens=v.match_tokens,
            hit_tokens=v.hit_tokens, hit_rate=_rate(v.hit_tokens + v.host_hits, v.match_tokens),
            evictions=v.evictions, tiers=v.tiers.stats if v.tiers is not None else None,
            segments=v.segments, keyed=v.keyed, host_hit_tokens=v.host_hits)
            for v in svc.model_views()}
        tenants = [TenantStats(
            name=t.name, namespace=t.namespace, sessions=t.sessions,
            hit_tokens=(c := t.counters)["hit_tokens"], match_tokens=c["match_tokens"],
            hit_rate=_rate(c["hit_tokens"] + c["host_hit_tokens"], c["match_tokens"]),
            quota_refusals=c["quota_refusals"], host_hit_tokens=c["host_hit_tokens"])
            for t in svc.tenant_views()]
        last = self.checker.last
        checker = CheckerOut(last.ok, last.kind, last.at, last.violations[:MAX_VIOLATIONS_SHOWN],
                             len(last.violations))
        return _respond(Stats(
            instance=svc.instance, version=__version__,
            uptime_s=round(max(0.0, time.time() - self.state.started), 3),
            ready=bool(self.state.ready), sessions=svc.session_count(),
            ops_total=self.state.ops, checker=checker, models=models, tenants=tenants,
            l3=svc.l3_stats(), warm_restart=svc.restart.as_dict()))

    async def tenants(self, request: web.Request, _: NoQuery) -> web.Response:
        return _respond(self.service.tenant_views())

    async def sessions(self, request: web.Request, _: NoQuery) -> web.Response:
        return _respond(self.service.session_views())

    async def models(self, request: web.Request, _: NoQuery) -> web.Response:
        return _respond([Model(**msgspec.structs.asdict(v.info), policy=v.policy, pools=v.pools)
                         for v in self.service.model_views()])

    async def config_view(self, request: web.Request, _: NoQuery) -> web.Response:
        return _respond(redacted(self.config))

    async def openapi(self, request: web.Request, _: NoQuery) -> web.Response:
        return _respond(openapi_document())

    async def status_page(self, request: web.Request, _: None) -> web.Response:
        page = importlib.resources.files("daemon").joinpath("static").joinpath("status.html")
        try:
            body = page.read_bytes()
        except OSError:
            raise NotFound("the status page (daemon/static/status.html) is not installed; the "
                           "JSON API is at /v1/stats") from None
        return web.Response(body=body, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def tree(self, request: web.Request, q: TreeQuery) -> web.Response:
        model = self._model_name(q.model)
        names = self.service.namespaces(model)
        ns_name = q.namespace
        if ns_name is msgspec.UNSET:
            if len(names) == 1:
                ns_name = names[0]
            elif not names:
                raise NotFound(f"model {model!r} has nothing cached yet (no namespace)")
            else:
                raise BadRequest(f"namespace is required: model {model!r} has {len(names)} "
                                 f"namespaces ({', '.join(names[:20])})", "namespace")
        if ns_name not in names:
            raise NotFound(f"model {model!r} has nothing cached in namespace {ns_name!r} "
                           f"(namespaces: {', '.join(names[:20]) or 'none'})")
        limit = self.config.admin.tree_dump_max_nodes
        view = self.service.tree_view(model, ns_name, q.depth, limit)  # type: ignore[arg-type]
        return _respond(Tree(model, ns_name, q.depth, limit, view.nodes,  # type: ignore[arg-type]
                             view.truncated, view.root))

    # -- actions

    async def check(self, request: web.Request, _: NoQuery) -> web.Response:
        violations = self.checker.run(deep=True)
        seconds = self.checker.last.seconds
        # strict mode stops the daemon after this response is on its way
        self.checker.verdict(violations, "(admin)", delay=0.1)
        return _respond(CheckResult(not violations, violations, seconds))

    async def evict(self, request: web.Request, _: NoQuery) -> web.Response:
        body = await decode_body(request, EvictRequest)
        model = self._model_name(body.model)
        if body.swa_pages and not self.service.has_swa(model):
            raise BadRequest(f"model {model!r} has no SWA pool: swa_pages must be 0",
                             "swa_pages")
        namespace = None if body.namespace is msgspec.UNSET else body.namespace
        if namespace is not None and namespace not in self.service.namespaces(model):
            raise NotFound(f"model {model!r} has nothing cached in namespace {namespace!r}")
        res = self.service.admin_evict(model, body.full_pages, body.swa_pages, body.host_pages,
                                       namespace)
        log.info("admin eviction in %s%s: %d full, %d swa and %d host pages freed (asked %d, %d "
                 "and %d)", model, f" (namespace {namespace})" if namespace else "",
                 res.full_pages, res.swa_pages, res.host_pages, body.full_pages, body.swa_pages,
                 body.host_pages)
        return _respond(EvictResult(res.full_pages, res.swa_pages, res.host_pages))


_ADMIN = web.AppKey("radixd_admin", _Admin)


def _rate(hits: int, total: int) -> float:
    return hits / total if total else 0.0
