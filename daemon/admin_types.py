"""The admin endpoint's request and response types, and the OpenAPI document made from them.

Each route's query, body and response is a msgspec Struct (the read models come from the
service's query API, daemon/queries.py). The same types validate what comes in (``decode_query``
and ``decode_body`` in daemon/admin_requests.py), encode what goes out, and produce the schemas of
``/v1/openapi.json``, so the document cannot drift from what the endpoint does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType
from radixd_client import protocol as P

from . import __version__
from .queries import (
    EvictionCount,
    KeyedView,
    PoolUsage,
    SegmentUsage,
    SessionView,
    TenantView,
    TreeNode,
)

MAX_TREE_DEPTH = 64
DEFAULT_TREE_DEPTH = 3
MAX_EVICT_PAGES = (1 << 31) - 1
MAX_VIOLATIONS_SHOWN = 50

Pages = Annotated[int, Meta(ge=0, le=MAX_EVICT_PAGES)]
Rate = Annotated[float, Meta(ge=0, le=1)]


# ---------------------------------------------------------------------------- requests

class NoQuery(msgspec.Struct, forbid_unknown_fields=True):
    """Routes that take no query parameter."""


class TreeQuery(msgspec.Struct, forbid_unknown_fields=True):
    model: Annotated[str, Meta(description="required when the daemon serves more than one "
                                           "model")] | UnsetType = UNSET
    namespace: Annotated[str, Meta(description="required when the model has more than one "
                                               "namespace")] | UnsetType = UNSET
    depth: Annotated[int, Meta(ge=0, le=MAX_TREE_DEPTH,
                               description="node levels below the namespace root")
                     ] = DEFAULT_TREE_DEPTH


class EvictRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: Annotated[str, Meta(description="default: the only model, if there is one")
                     ] | UnsetType = UNSET
    namespace: Annotated[str, Meta(description="evict only this namespace's pages (default: "
                                               "any, coldest first)")] | UnsetType = UNSET
    full_pages: Pages = 0
    swa_pages: Annotated[Pages, Meta(description="must be 0 for a model without SWA")] = 0
    host_pages: Annotated[Pages, Meta(
        description="host (L2) copies of host-only pages to drop, coldest first (with L3 "
                    "write_back they go to Redis first)")] = 0


# ---------------------------------------------------------------------------- responses

class ErrorDetail(msgspec.Struct, omit_defaults=True):
    code: str
    message: str
    parameter: Annotated[str, Meta(description="the query parameter or body field at fault")
                         ] | UnsetType = UNSET


class Error(msgspec.Struct):
    error: ErrorDetail


class Alive(msgspec.Struct):
    status: Literal["alive"] = "alive"


class Ready(msgspec.Struct):
    ready: bool
    reason: Literal["starting", "stopping"] | UnsetType = UNSET


class Checker(msgspec.Struct):
    ok: Annotated[bool | None, Meta(description="null until a check has run")]
    kind: Annotated[str | None, Meta(description="full or counters")]
    at: Annotated[float | None, Meta(description="Unix time of the last check")]
    violations: Annotated[list[str], Meta(max_length=MAX_VIOLATIONS_SHOWN)]
    violation_count: int


class ModelStats(msgspec.Struct):
    page_size: int
    sliding_window: int | None
    policy: str
    pools: dict[str, PoolUsage]
    nodes: int
    matches: int
    match_tokens: int
    hit_tokens: Annotated[int, Meta(description="usable tokens already on device")]
    hit_rate: Annotated[Rate, Meta(description="(hit_tokens + host_hit_tokens) / match_tokens")]
    evictions: Annotated[dict[str, EvictionCount], Meta(description="pages evicted per "
                                                                    "trigger")]
    tiers: Annotated[dict[str, Any] | None, Meta(
        description="host (L2) and L3 counters; null without a host tier")]
    segments: Annotated[dict[str, SegmentUsage] | None, Meta(
        description="per pool (full, swa, and the host pools host_full, host_swa), its "
                    "segments under memory isolation; null without isolation")
    ] = None
    keyed: Annotated[KeyedView | None, Meta(
        description="the key-addressed store, all namespaces: stored pages by pool, pins and "
                    "reservations held, the store's counters; null without a host tier")
    ] = None
    host_hit_tokens: Annotated[int, Meta(
        description="usable tokens loaded back from host (tiers.loaded_tokens)")] = 0


class TenantStats(msgspec.Struct):
    name: str
    namespace: str
    sessions: int
    hit_tokens: int
    match_tokens: int
    hit_rate: Annotated[Rate, Meta(description="(hit_tokens + host_hit_tokens) / match_tokens")]
    quota_refusals: int
    host_hit_tokens: int = 0


class Stats(msgspec.Struct):
    instance: str
    version: str
    uptime_s: float
    ready: bool
    sessions: int
    ops_total: int
    checker: Checker
    models: dict[str, ModelStats]
    tenants: list[TenantStats]
    l3: Annotated[dict[str, Any] | None, Meta(
        description="the Redis client's counters and breaker_state; null without L3")]
    warm_restart: Annotated[dict[str, Any], Meta(
        description="what the last start restored of the host tier from server.state_dir or "
                    "systemd's fd store: source (none, state_dir or fdstore), kept_pages, "
                    "dropped_pages, restore_seconds, "
                    "reason (why a saved state was refused whole) and per model figures")]


class Model(P.ModelInfo, kw_only=True):
    """A model's profile (as engines get it in hello), its eviction policy and pool usage."""

    policy: str
    pools: dict[str, PoolUsage]


class Tree(msgspec.Struct):
    model: str
    namespace: str
    depth: int
    max_nodes: int
    nodes: int
    truncated: bool
    root: TreeNode


class CheckResult(msgspec.Struct):
    ok: bool
    violations: list[str]
    seconds: float


class EvictResult(msgspec.Struct):
    full_pages: int
    swa_pages: int
    host_pages: int


# ---------------------------------------------------------------------------- the routes

class Route(msgspec.Struct):
    """One documented operation: what it takes and what it answers (by status code)."""

    method: str
    path: str
    summary: str
    query: Any = NoQuery  # None: not checked (probes and scrapers may add their own)
    body: type | None = None
    ok: Any = None  # the 200 body's type; None: not JSON (see ``content``)
    content: str = "application/json"
    public: bool = False
    errors: tuple[int, ...] = (400,)
    extra: dict[str, Any] = msgspec.field(default_factory=dict)  # e.g. 503 for /readyz


ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", "Liveness: the event loop answers (no token needed).", ok=Alive,
          public=True, errors=(), query=None),
    Route("GET", "/readyz", "Readiness: pools and socket exist and no shutdown is in progress.",
          ok=Ready, errors=(), query=None,
          extra={"503": (Ready, "not ready (starting or stopping)")}),
    Route("GET", "/metrics", "Prometheus metrics (text format 0.0.4, or OpenMetrics 1.0.0 "
                             "when the Accept header asks for application/openmetrics-text).",
          content="text/plain", errors=(), query=None),
    Route("GET", "/v1/stats", "Summary of models, pools, hit rates, sessions, tenants and the "
                              "checker (what the status page shows).", ok=Stats),
    Route("GET", "/v1/tenants", "Tenants: quotas, counters and usage per model (no tokens).",
          ok=list[TenantView]),
    Route("GET", "/v1/sessions", "Open sessions and what each holds.", ok=list[SessionView]),
    Route("GET", "/v1/models", "Model profiles, eviction policy and pool usage.",
          ok=list[Model]),
    Route("GET", "/v1/tree", "A bounded dump of one namespace's radix tree (debugging).",
          query=TreeQuery, ok=Tree, errors=(400, 404)),
    Route("POST", "/v1/check", "Run the full invariant check now.", ok=CheckResult),
    Route("POST", "/v1/evict", "Evict unlocked cached pages of one model (locked pages are "
                               "never evicted).", body=EvictRequest, ok=EvictResult,
          errors=(400, 404, 413)),
    Route("GET", "/v1/config", "The effective configuration, secrets redacted.",
          ok=dict[str, Any]),
    Route("GET", "/v1/openapi.json", "This document.", ok=dict[str, Any]),
    Route("GET", "/", "The status page (static HTML; its script calls /v1/stats with the "
                      "token; no token needed to load it).", content="text/html", public=True,
          errors=(404,), query=None),
)

_ERRORS = {400: ("BadRequest", "invalid query parameter or body"),
           401: ("Unauthorized", "missing or wrong bearer token"),
           404: ("NotFound", "no such model, namespace or page"),
           413: ("TooLarge", "body over 64 KiB")}


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 description of every admin route, generated from ``ROUTES``' types."""
    types: list[Any] = [Error]
    for r in ROUTES:
        types += [t for t in (r.ok, r.body, *(t for t, _ in r.extra.values())) if t is not None]
        if r.query not in (NoQuery, None):
            types.append(r.query)
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}")
    of = dict(zip(map(_key, types), schemas, strict=True))
    paths: dict[str, Any] = {}
    for r in ROUTES:
        op: dict[str, Any] = {"summary": r.summary, "responses": {"200": _ok(r, of)}}
        if r.public:
            op["security"] = []
        else:
            op["responses"]["401"] = {"$ref": "#/components/responses/Unauthorized"}
        for status, (t, description) in r.extra.items():
            op["responses"][status] = _json(of[_key(t)], description)
        for status in r.errors:
            op["responses"][str(status)] = {"$ref": f"#/components/responses/"
                                                    f"{_ERRORS[status][0]}"}
        if r.query not in (NoQuery, None):
            op["parameters"] = _parameters(components[r.query.__name__])
        if r.body is not None:
            op["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": of[_key(r.body)]}}}
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "radixd admin API", "version": __version__,
                 "description": "The admin endpoint of radixd. Every route but GET /healthz and "
                                "GET / needs `Authorization: Bearer <admin token>`. Errors are "
                                "JSON: {\"error\": {\"code\", \"message\", \"parameter\"?}}."},
        "paths": paths,
        "security": [{"bearerAuth": []}],
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
            "schemas": components,
            "responses": {
                name: {**_json(of[_key(Error)], description),
                       **({"headers": {"WWW-Authenticate": {"schema": {"type": "string"}}}}
                          if status == 401 else {})}
                for status, (name, description) in _ERRORS.items()},
        },
    }


def _key(t: Any) -> str:
    return repr(t)


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _ok(r: Route, of: dict[str, Any]) -> dict[str, Any]:
    if r.ok is None:
        return {"description": "OK", "content": {r.content: {"schema": {"type": "string"}}}}
    return _json(of[_key(r.ok)], "OK")


def _parameters(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """Query parameters from a query Struct's schema: one per field."""
    required = set(schema.get("required", ()))
    out = []
    for name, prop in schema["properties"].items():
        prop = dict(prop)
        description = prop.pop("description", None)
        p: dict[str, Any] = {"name": name, "in": "query", "required": name in required,
                             "schema": prop}
        if description:
            p["description"] = description
        out.append(p)
    return out
