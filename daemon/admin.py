"""The admin HTTP endpoint: health, readiness, Prometheus metrics, JSON views, checks, eviction.

It runs inside the daemon's own event loop (aiohttp ``AppRunner`` on a socket it binds itself), so
every handler sees the service between two operations, never in the middle of one, and a handler
that changes state (``POST /v1/evict``) is as atomic as an engine's operation.

Security (DESIGN.md section 7): it binds loopback (``admin.host``) or a Unix socket, every route
but ``GET /healthz`` and ``GET /`` (a static page with no data in it) needs
``Authorization: Bearer <token>``, the token is kept only as its SHA-256 digest and compared in
constant time, and no response ever contains a token or a digest. With no token configured, a
random one is generated at start and written (mode 0600) to ``admin.token_file``, by default
``admin.token`` beside the engines' socket, where ``radixd status`` finds it.

The routes and their JSON shapes are described by the OpenAPI document at ``/v1/openapi.json``
(``openapi_document`` below); tests/ops/test_admin.py runs schemathesis against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import importlib.resources
import json
import logging
import os
import re
import secrets
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from . import __version__, exposition
from .config import redacted
from .exposition import EVICTION_REASONS

if TYPE_CHECKING:
    from .server import Server

log = logging.getLogger("radixd.admin")

MAX_TREE_DEPTH = 64
DEFAULT_TREE_DEPTH = 3
MAX_EVICT_PAGES = (1 << 31) - 1
MAX_VIOLATIONS_SHOWN = 50
_PUBLIC = {("GET", "/healthz"), ("HEAD", "/healthz"), ("GET", "/"), ("HEAD", "/")}
_UINT = re.compile(r"[0-9]{1,6}")


class AdminHandle:
    """A running admin endpoint: where it listens, and how to stop it."""

    def __init__(self, url: str, port: int | None, runner: web.AppRunner,
                 unix_path: str | None, token_file: str | None):
        self.url = url
        self.port = port
        self.token_file = token_file  # where a generated token was written (None: configured)
        self._runner = runner
        self._unix_path = unix_path

    async def stop(self) -> None:
        await self._runner.cleanup()
        if self._unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._unix_path)
        log.info("admin endpoint stopped")


class BadRequest(Exception):
    """A query parameter or body field is invalid: 400, naming it."""

    def __init__(self, message: str, parameter: str | None = None):
        super().__init__(message)
        self.parameter = parameter


class NotFound(Exception):
    """A model or namespace that does not exist: 404."""


class TokenFileError(OSError):
    """The generated admin token could not be written (always fatal: nobody could use it)."""


# ---------------------------------------------------------------------------- start and stop

async def start_admin(server: Server) -> AdminHandle:
    """Bind the admin endpoint per ``config.admin`` and serve it in the running loop."""
    cfg = server.config.admin
    digest, token_file = _token_digest(server)
    app = web.Application(middlewares=[_middleware], client_max_size=64 * 1024)
    admin = _Admin(server, digest)
    app[_ADMIN] = admin
    admin.routes(app)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        if cfg.unix_socket is not None:
            from .server import _bind_socket

            sock = _bind_socket(cfg.unix_socket, 0o660)
            url, port, unix_path = f"unix:{cfg.unix_socket}", None, cfg.unix_socket
        else:
            sock = _bind_tcp(cfg.host, cfg.port)
            port = sock.getsockname()[1]
            host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
            url, unix_path = f"http://{host}:{port}", None
        site = web.SockSite(runner, sock)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    log.info("admin endpoint on %s", url)
    return AdminHandle(url, port, runner, unix_path, token_file)


def _bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if host == "localhost":
        host = "127.0.0.1"
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def default_token_file(socket_path: str) -> str:
    """Where a generated admin token goes without ``admin.token_file``: beside the socket."""
    return str(Path(socket_path).parent / "admin.token")


def _token_digest(server: Server) -> tuple[bytes, str | None]:
    """The SHA-256 digest of the bearer token, generating (and writing) one if none is set."""
    cfg = server.config.admin
    if cfg.token is not None:
        return hashlib.sha256(cfg.token.encode()).digest(), None
    if cfg.token_sha256 is not None:
        return bytes.fromhex(cfg.token_sha256), None
    # hex: a generated token never starts with '-', which a command line would read as a flag
    token = secrets.token_hex(32)
    path = cfg.token_file or default_token_file(str(server.socket_path))
    try:
        _write_secret(path, token + "\n")
    except OSError as exc:
        raise TokenFileError(exc.errno, f"cannot write the admin token to {path}: "
                                        f"{exc.strerror or exc} (set admin.token_file, or "
                                        "admin.token_sha256)") from None
    log.info("admin token generated and written to %s (mode 0600)", path)
    return hashlib.sha256(token.encode()).digest(), path


def _write_secret(path: str, text: str) -> None:
    """Write atomically, never through a symlink, readable by the owner only."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, p)


# ---------------------------------------------------------------------------- errors and auth

def _error(status: int, code: str, message: str, parameter: str | None = None,
           headers: dict[str, str] | None = None) -> web.Response:
    err: dict[str, Any] = {"code": code, "message": message}
    if parameter is not None:
        err["parameter"] = parameter
    return web.json_response({"error": err}, status=status, headers=headers)


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
    def __init__(self, server: Server, digest: bytes):
        self.server = server
        self.service = server.service
        self.config = server.config
        self._digest = digest

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/", self.status_page)
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/metrics", self.metrics)
        r.add_get("/v1/stats", self.stats)
        r.add_get("/v1/tenants", self.tenants)
        r.add_get("/v1/sessions", self.sessions)
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/tree", self.tree)
        r.add_post("/v1/check", self.check)
        r.add_post("/v1/evict", self.evict)
        r.add_get("/v1/config", self.config_view)
        r.add_get("/v1/openapi.json", self.openapi)

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

    # -- helpers

    @staticmethod
    def _query(request: web.Request, allowed: tuple[str, ...]) -> dict[str, str]:
        out: dict[str, str] = {}
        for key in request.query:
            if key not in allowed:
                raise BadRequest(f"unknown query parameter {key!r}"
                                 + (f"; this route takes {', '.join(allowed)}" if allowed
                                    else "; this route takes none"), key)
            values = request.query.getall(key)
            if len(values) > 1:
                raise BadRequest(f"query parameter {key!r} is given {len(values)} times; give it "
                                 "once", key)
            out[key] = values[0]
        return out

    def _model_name(self, name: str | None, parameter: str = "model") -> str:
        models = self.service.models
        if name is None:
            if len(models) == 1:
                return next(iter(models))
            raise BadRequest(f"{parameter} is required: this daemon serves {len(models)} models "
                             f"({', '.join(models)})", parameter)
        if name not in models:
            raise NotFound(f"no model named {name!r} (models: {', '.join(models)})")
        return name

    def _checker(self) -> dict[str, Any]:
        last = self.server.last_check
        violations = list(last.get("violations") or [])
        return {"ok": last.get("ok"), "kind": last.get("kind"), "at": last.get("at"),
                "violations": violations[:MAX_VIOLATIONS_SHOWN],
                "violation_count": len(violations)}

    def _policy(self, model: str) -> str:
        return self.service.models[model].cache.tree.policy.name

    def _evictions(self, model: str) -> dict[str, dict[str, int]]:
        by = self.service.models[model].cache.tree.evictions_by_reason
        reasons = list(EVICTION_REASONS) + sorted(set(by) - set(EVICTION_REASONS))
        return {r: {"full": by.get(r, (0, 0))[0], "swa": by.get(r, (0, 0))[1]} for r in reasons}

    # -- health

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def readyz(self, request: web.Request) -> web.Response:
        if self.server.ready:
            return web.json_response({"ready": True})
        reason = "stopping" if self.server.stopping else "starting"
        return web.json_response({"ready": False, "reason": reason}, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        text = exposition.render(self.server)
        return web.Response(body=text.encode(),
                            headers={"Content-Type": exposition.CONTENT_TYPE})

    # -- views

    async def stats(self, request: web.Request) -> web.Response:
        self._query(request, ())
        svc = self.service
        models: dict[str, Any] = {}
        for name, entry in svc.models.items():
            c = entry.cache.counters
            models[name] = {
                "page_size": entry.info.page_size,
                "sliding_window": entry.info.sliding_window,
                "policy": self._policy(name),
                "pools": svc.pool_usage(name),
                "nodes": svc.tree_nodes(name),
                "matches": c["matches"],
                "match_tokens": c["match_tokens"],
                "hit_tokens": c["hit_tokens"],
                "hit_rate": _rate(c["hit_tokens"], c["match_tokens"]),
                "evictions": self._evictions(name),
                "tiers": entry.tiers.stats() if entry.tiers is not None else None,
            }
        live = svc.live_sessions()
        tenants = [{"name": t.name, "namespace": t.namespace, "sessions": live.get(t.name, 0),
                    "hit_tokens": t.counters["hit_tokens"],
                    "match_tokens": t.counters["match_tokens"],
                    "hit_rate": _rate(t.counters["hit_tokens"], t.counters["match_tokens"]),
                    "quota_refusals": t.counters["quota_refusals"]} for t in svc.tenants]
        return web.json_response({
            "instance": svc.instance,
            "version": __version__,
            "uptime_s": round(max(0.0, time.time() - self.server.started), 3),
            "ready": bool(self.server.ready),
            "sessions": len(svc.sessions),
            "ops_total": self.server.ops,
            "checker": self._checker(),
            "models": models,
            "tenants": tenants,
            "l3": svc.l3.stats if svc.l3 is not None else None,
        })

    async def tenants(self, request: web.Request) -> web.Response:
        self._query(request, ())
        svc = self.service
        live = svc.live_sessions()
        usage = {m: svc.tenant_usage(m) for m in svc.models}
        out = []
        for t in svc.tenants:
            out.append({
                "name": t.name, "namespace": t.namespace,
                "models": ["*"] if t.models is None else sorted(t.models),
                "quota_full_pages": t.quota_full, "quota_swa_pages": t.quota_swa,
                "quota_host_pages": t.quota_host, "quota_l3_bytes": t.quota_l3,
                "sessions": live.get(t.name, 0),
                "counters": dict(t.counters),
                "usage": {m: usage[m][t.name] for m in svc.tenant_models(t)},
            })
        return web.json_response(out)

    async def sessions(self, request: web.Request) -> web.Response:
        self._query(request, ())
        svc = self.service
        out = [{"id": s.id, "tenant": s.tenant.name, "client": s.client, "pid": s.peer.pid,
                "uid": s.peer.uid, "gid": s.peer.gid, "started": s.started, "ops": s.ops,
                "held": svc.session_holdings(s)}
               for s in sorted(svc.sessions.values(), key=lambda s: s.id)]
        return web.json_response(out)

    async def models(self, request: web.Request) -> web.Response:
        self._query(request, ())
        out = []
        for name, entry in self.service.models.items():
            info = msgspec.structs.asdict(entry.info)
            out.append({**info, "policy": self._policy(name),
                        "pools": self.service.pool_usage(name)})
        return web.json_response(out)

    async def config_view(self, request: web.Request) -> web.Response:
        self._query(request, ())
        return web.json_response(redacted(self.config))

    async def openapi(self, request: web.Request) -> web.Response:
        self._query(request, ())
        return web.json_response(openapi_document())

    async def status_page(self, request: web.Request) -> web.Response:
        page = importlib.resources.files("daemon").joinpath("static").joinpath("status.html")
        try:
            body = page.read_bytes()
        except OSError:
            raise NotFound("the status page (daemon/static/status.html) is not installed; the "
                           "JSON API is at /v1/stats") from None
        return web.Response(body=body, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    # -- the tree

    async def tree(self, request: web.Request) -> web.Response:
        q = self._query(request, ("model", "namespace", "depth"))
        model = self._model_name(q.get("model"))
        depth = DEFAULT_TREE_DEPTH
        if "depth" in q:
            raw = q["depth"]
            if not _UINT.fullmatch(raw) or int(raw) > MAX_TREE_DEPTH:
                raise BadRequest(f"depth must be an integer from 0 to {MAX_TREE_DEPTH}, got "
                                 f"{raw!r}", "depth")
            depth = int(raw)
        tree = self.service.models[model].cache.tree
        names = sorted(tree.namespaces)
        ns_name = q.get("namespace")
        if ns_name is None:
            if len(names) == 1:
                ns_name = names[0]
            elif not names:
                raise NotFound(f"model {model!r} has nothing cached yet (no namespace)")
            else:
                raise BadRequest(f"namespace is required: model {model!r} has {len(names)} "
                                 f"namespaces ({', '.join(names[:20])})", "namespace")
        ns = tree.namespaces.get(ns_name)
        if ns is None:
            raise NotFound(f"model {model!r} has nothing cached in namespace {ns_name!r} "
                           f"(namespaces: {', '.join(names[:20]) or 'none'})")
        limit = self.config.admin.tree_dump_max_nodes
        root, count, truncated = dump_tree(tree, ns.root, depth, limit)
        return web.json_response({"model": model, "namespace": ns_name, "depth": depth,
                                  "max_nodes": limit, "nodes": count, "truncated": truncated,
                                  "root": root})

    # -- actions

    async def check(self, request: web.Request) -> web.Response:
        self._query(request, ())
        violations = self.server.run_check(deep=True)
        seconds = self.server.last_check.get("seconds", 0.0)
        if violations:
            log.error("invariant check (admin): %d violations: %s", len(violations),
                      "; ".join(violations[:20]))
            if self.config.checker.strict:
                log.critical("strict mode: stopping on an invariant violation")
                # after this response is on its way
                asyncio.get_running_loop().call_later(0.1, self.server.stop, 3)
        else:
            log.info("invariant check (admin): ok in %.3fs", seconds)
        return web.json_response({"ok": not violations, "violations": violations,
                                  "seconds": seconds})

    async def evict(self, request: web.Request) -> web.Response:
        self._query(request, ())
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
        known = ("model", "namespace", "full_pages", "swa_pages", "host_pages")
        for key in body:
            if key not in known:
                raise BadRequest(f"unknown field {key!r}; fields: {', '.join(known)}", key)
        for key in ("model", "namespace"):
            if key in body and not isinstance(body[key], str):
                raise BadRequest(f"{key} must be a string, got {_json_type(body[key])}", key)
        counts = {}
        for key in ("full_pages", "swa_pages", "host_pages"):
            v = body.get(key, 0)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_EVICT_PAGES:
                raise BadRequest(f"{key} must be an integer from 0 to {MAX_EVICT_PAGES}, got "
                                 f"{v!r}"[:200], key)
            counts[key] = v
        model = self._model_name(body.get("model"))
        cache = self.service.models[model].cache
        if counts["swa_pages"] and not cache.swa_enabled:
            raise BadRequest(f"model {model!r} has no SWA pool: swa_pages must be 0",
                             "swa_pages")
        namespace = body.get("namespace")
        if namespace is not None and namespace not in cache.tree.namespaces:
            raise NotFound(f"model {model!r} has nothing cached in namespace {namespace!r}")
        res = cache.evict(counts["full_pages"], counts["swa_pages"], namespace=namespace,
                          reason="admin")
        host = (cache.tree.evict_host(counts["host_pages"], namespace=namespace).host_slots
                if counts["host_pages"] else 0)
        log.info("admin eviction in %s%s: %d full, %d swa and %d host pages freed (asked %d, %d "
                 "and %d)", model, f" (namespace {namespace})" if namespace else "",
                 res.full_pages, res.swa_pages, host, counts["full_pages"], counts["swa_pages"],
                 counts["host_pages"])
        return web.json_response({"full_pages": res.full_pages, "swa_pages": res.swa_pages,
                                  "host_pages": host})


_ADMIN = web.AppKey("radixd_admin", _Admin)


def _rate(hits: int, total: int) -> float:
    return hits / total if total else 0.0


def _json_type(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw.strip():
        raise BadRequest("a JSON body is required (Content-Type: application/json)")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}"[:300]) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def dump_tree(tree: Any, root: Any, depth: int, limit: int) -> tuple[dict[str, Any], int, bool]:
    """A namespace's tree breadth first: levels below the root up to ``depth``, at most
    ``limit`` nodes in all. A node some of whose children are left out says how many in
    ``children_omitted``. Returns (root, nodes shown, whether ``limit`` cut it short)."""
    page_bytes = tree.page_bytes
    swa = tree.swa_enabled

    def view(n: Any) -> dict[str, Any]:
        if n.full is None:
            state = "host"
        elif swa and n.swa is None:
            state = "tombstone"
        else:
            state = "live"
        return {"id": n.id, "pages": len(n.tokens) // page_bytes, "depth": n.depth,
                "state": state, "host": n.host is not None and len(n.host) > 0,
                "locks": [n.full_lock, n.swa_lock], "hits": n.hits, "children": []}

    out = view(root)
    count = 1
    truncated = False
    queue = [(root, out, 0)]
    i = 0
    while i < len(queue):
        node, js, level = queue[i]
        i += 1
        children = sorted(node.children.values(), key=lambda c: c.id) if node.children else []
        if not children:
            continue
        if level >= depth:
            js["children_omitted"] = len(children)
            continue
        for k, child in enumerate(children):
            if count >= limit:
                truncated = True
                js["children_omitted"] = len(children) - k
                break
            cjs = view(child)
            js["children"].append(cjs)
            count += 1
            queue.append((child, cjs, level + 1))
    return out, count, truncated


# ---------------------------------------------------------------------------- OpenAPI

def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _obj(props: dict[str, Any], required: list[str] | None = None,
         extra: bool = False) -> dict[str, Any]:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": extra}


_INT = {"type": "integer"}
_UINT_S = {"type": "integer", "minimum": 0}
_NUM = {"type": "number"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.0 description of every admin route (kept in step with ``_Admin.routes``)."""
    pool = _obj({k: _UINT_S for k in ("capacity", "free", "tree", "evictable", "locked", "held")})
    pools = _obj({"full": _ref("Pool"), "swa": _ref("Pool")}, ["full"])
    err = {
        "type": "object", "required": ["error"], "additionalProperties": False,
        "properties": {"error": {
            "type": "object", "required": ["code", "message"], "additionalProperties": True,
            "properties": {"code": _STR, "message": _STR,
                           "parameter": {**_STR, "description": "the query parameter or body "
                                                                "field at fault"}}}},
    }
    checker = _obj({
        "ok": {**_BOOL, "nullable": True, "description": "null until a check has run"},
        "kind": {**_STR, "nullable": True, "description": "full or counters"},
        "at": {**_NUM, "nullable": True, "description": "Unix time of the last check"},
        "violations": {"type": "array", "items": _STR, "maxItems": MAX_VIOLATIONS_SHOWN},
        "violation_count": _UINT_S,
    })
    model_stats = _obj({
        "page_size": _INT, "sliding_window": {**_INT, "nullable": True}, "policy": _STR,
        "pools": _ref("Pools"), "nodes": _UINT_S, "matches": _UINT_S, "match_tokens": _UINT_S,
        "hit_tokens": _UINT_S, "hit_rate": {**_NUM, "minimum": 0, "maximum": 1},
        "evictions": {"type": "object", "description": "pages evicted per trigger",
                      "additionalProperties": _obj({"full": _UINT_S, "swa": _UINT_S})},
        "tiers": {"type": "object", "nullable": True, "additionalProperties": _INT,
                  "description": "host (L2) and L3 counters; null without a host tier"},
    })
    tenant_stats = _obj({
        "name": _STR, "namespace": _STR, "sessions": _UINT_S, "hit_tokens": _UINT_S,
        "match_tokens": _UINT_S, "hit_rate": {**_NUM, "minimum": 0, "maximum": 1},
        "quota_refusals": _UINT_S,
    })
    stats = _obj({
        "instance": _STR, "version": _STR, "uptime_s": _NUM, "ready": _BOOL,
        "sessions": _UINT_S, "ops_total": _UINT_S, "checker": _ref("Checker"),
        "models": {"type": "object", "additionalProperties": _ref("ModelStats")},
        "tenants": {"type": "array", "items": _ref("TenantStats")},
        "l3": {"type": "object", "nullable": True, "additionalProperties": True,
               "description": "the Redis client's counters and breaker_state; null without L3"},
    })
    usage = _obj({k: _UINT_S for k in ("tree_full_pages", "tree_swa_pages", "held_full_pages",
                                       "held_swa_pages")})
    tenant = _obj({
        "name": _STR, "namespace": _STR,
        "models": {"type": "array", "items": _STR, "description": "['*']: every model"},
        "quota_full_pages": _UINT_S, "quota_swa_pages": _UINT_S, "quota_host_pages": _UINT_S,
        "quota_l3_bytes": _UINT_S, "sessions": _UINT_S,
        "counters": {"type": "object", "additionalProperties": _INT},
        "usage": {"type": "object", "additionalProperties": _ref("TenantUsage")},
    })
    session = _obj({
        "id": _INT, "tenant": _STR, "client": _STR, "pid": _INT, "uid": _INT, "gid": _INT,
        "started": _NUM, "ops": _UINT_S,
        "held": {"type": "object", "additionalProperties": _obj(
            {"full_pages": _UINT_S, "swa_pages": _UINT_S, "receipts": _UINT_S})},
    })
    model = _obj({
        "name": _STR, "page_size": _INT, "sliding_window": {**_INT, "nullable": True},
        "num_full_layers": _INT, "num_swa_layers": _INT, "num_kv_heads": _INT,
        "head_dim": _INT, "dtype": _STR, "device": _STR, "full_pages": _INT,
        "swa_pages": _INT, "host_pages": {**_INT, "description": "host (L2) slots; 0: none"},
        "l3": {**_BOOL, "description": "prefetch can reach Redis"},
        "policy": _STR, "pools": _ref("Pools"),
    })
    node = {
        **_obj({
            "id": _INT, "pages": _UINT_S, "depth": {**_UINT_S, "description": "tokens from the "
                                                                                "root"},
            "state": {"type": "string", "enum": ["live", "tombstone", "host"]},
            "host": {**_BOOL, "description": "has a host (L2) copy"},
            "locks": {"type": "array", "items": _UINT_S, "minItems": 2, "maxItems": 2,
                      "description": "[full locks, swa locks]"},
            "hits": _UINT_S,
            "children": {"type": "array", "items": _ref("TreeNode")},
            "children_omitted": {**_UINT_S, "description": "children left out by depth or "
                                                           "the node cap"},
        }, ["id", "pages", "depth", "state", "host", "locks", "hits", "children"]),
    }
    tree = _obj({
        "model": _STR, "namespace": _STR, "depth": _UINT_S, "max_nodes": _UINT_S,
        "nodes": _UINT_S, "truncated": _BOOL, "root": _ref("TreeNode"),
    })
    check = _obj({"ok": _BOOL, "violations": {"type": "array", "items": _STR},
                  "seconds": _NUM})
    evict_req = _obj({
        "model": {**_STR, "description": "default: the only model, if there is one"},
        "namespace": {**_STR, "description": "evict only this namespace's pages (default: "
                                             "any, coldest first)"},
        "full_pages": {**_INT, "minimum": 0, "maximum": MAX_EVICT_PAGES, "default": 0},
        "swa_pages": {**_INT, "minimum": 0, "maximum": MAX_EVICT_PAGES, "default": 0,
                      "description": "must be 0 for a model without SWA"},
        "host_pages": {**_INT, "minimum": 0, "maximum": MAX_EVICT_PAGES, "default": 0,
                       "description": "host (L2) copies of host-only pages to drop, coldest "
                                      "first (with L3 write_back they go to Redis first)"},
    }, [])
    evict_res = _obj({"full_pages": _UINT_S, "swa_pages": _UINT_S, "host_pages": _UINT_S})
    ready = _obj({"ready": _BOOL, "reason": {"type": "string",
                                             "enum": ["starting", "stopping"]}}, ["ready"])

    e400 = {"$ref": "#/components/responses/BadRequest"}
    e401 = {"$ref": "#/components/responses/Unauthorized"}
    e404 = {"$ref": "#/components/responses/NotFound"}

    def get(summary: str, schema: dict[str, Any], *extra: tuple[str, Any],
            params: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        op: dict[str, Any] = {"summary": summary,
                              "responses": {"200": _json(schema, "OK"), "401": e401,
                                            **dict(extra)}}
        if params:
            op["parameters"] = params
        return {"get": op}

    paths: dict[str, Any] = {
        "/healthz": {"get": {
            "summary": "Liveness: the event loop answers (no token needed).",
            "security": [],
            "responses": {"200": _json(_obj({"status": {"type": "string",
                                                         "enum": ["alive"]}}), "alive")}}},
        "/readyz": {"get": {
            "summary": "Readiness: pools and socket exist and no shutdown is in progress.",
            "responses": {"200": _json(ready, "ready"), "401": e401,
                          "503": _json(ready, "not ready (starting or stopping)")}}},
        "/metrics": {"get": {
            "summary": "Prometheus metrics (text format 0.0.4).",
            "responses": {"200": {"description": "the exposition",
                                  "content": {"text/plain": {"schema": _STR}}},
                          "401": e401}}},
        "/v1/stats": get("Summary of models, pools, hit rates, sessions, tenants and the "
                         "checker (what the status page shows).", _ref("Stats"), ("400", e400)),
        "/v1/tenants": get("Tenants: quotas, counters and usage per model (no tokens).",
                           {"type": "array", "items": _ref("Tenant")}, ("400", e400)),
        "/v1/sessions": get("Open sessions and what each holds.",
                            {"type": "array", "items": _ref("Session")}, ("400", e400)),
        "/v1/models": get("Model profiles, eviction policy and pool usage.",
                          {"type": "array", "items": _ref("Model")}, ("400", e400)),
        "/v1/tree": get(
            "A bounded dump of one namespace's radix tree (debugging).", _ref("Tree"),
            ("400", e400), ("404", e404),
            params=[
                {"name": "model", "in": "query", "required": False, "schema": _STR,
                 "description": "required when the daemon serves more than one model"},
                {"name": "namespace", "in": "query", "required": False, "schema": _STR,
                 "description": "required when the model has more than one namespace"},
                {"name": "depth", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 0, "maximum": MAX_TREE_DEPTH,
                            "default": DEFAULT_TREE_DEPTH},
                 "description": "node levels below the namespace root"},
            ]),
        "/v1/check": {"post": {
            "summary": "Run the full invariant check now.",
            "responses": {"200": _json(_ref("CheckResult"), "the check's report"),
                          "400": e400, "401": e401}}},
        "/v1/evict": {"post": {
            "summary": "Evict unlocked cached pages of one model (locked pages are never "
                       "evicted).",
            "requestBody": {"required": True, "content": {
                "application/json": {"schema": _ref("EvictRequest")}}},
            "responses": {"200": _json(_ref("EvictResult"), "pages freed"), "400": e400,
                          "401": e401, "404": e404,
                          "413": {"$ref": "#/components/responses/TooLarge"}}}},
        "/v1/config": get("The effective configuration, secrets redacted.",
                          {"type": "object", "additionalProperties": True}, ("400", e400)),
        "/v1/openapi.json": get("This document.", {"type": "object",
                                                   "additionalProperties": True},
                                ("400", e400)),
        "/": {"get": {
            "summary": "The status page (static HTML; its script calls /v1/stats with the "
                       "token; no token needed to load it).",
            "security": [],
            "responses": {"200": {"description": "the page",
                                  "content": {"text/html": {"schema": _STR}}},
                          "404": e404}}},
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "radixd admin API", "version": __version__,
                 "description": "The admin endpoint of radixd. Every route but GET /healthz and "
                                "GET / needs `Authorization: Bearer <admin token>`. Errors are "
                                "JSON: {\"error\": {\"code\", \"message\", \"parameter\"?}}."},
        "paths": paths,
        "security": [{"bearerAuth": []}],
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": err, "Pool": pool, "Pools": pools, "Checker": checker,
                "ModelStats": model_stats, "TenantStats": tenant_stats, "Stats": stats,
                "TenantUsage": usage, "Tenant": tenant, "Session": session, "Model": model,
                "TreeNode": node, "Tree": tree, "CheckResult": check,
                "EvictRequest": evict_req, "EvictResult": evict_res, "Ready": ready,
            },
            "responses": {
                "BadRequest": _json(_ref("Error"), "invalid query parameter or body"),
                "Unauthorized": {**_json(_ref("Error"), "missing or wrong bearer token"),
                                 "headers": {"WWW-Authenticate": {"schema": _STR}}},
                "NotFound": _json(_ref("Error"), "no such model, namespace or page"),
                "TooLarge": _json(_ref("Error"), "body over 64 KiB"),
            },
        },
    }
