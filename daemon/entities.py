"""What the service keeps per model, tenant and session: plain records, shared by the service,
its query API (daemon/queries.py) and the composition root (daemon/app.py), which builds them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixd_client import protocol as P

from .config import Config
from .model_cache import ModelCache

DEFAULT_TENANT = "default"


@dataclass
class Tenant:
    name: str
    digest: bytes | None  # sha256 of the token; None only for the built-in default tenant
    namespace: str
    models: frozenset[str] | None  # None: every model
    quota_full: int = 0
    quota_swa: int = 0
    quota_host: int = 0
    quota_l3: int = 0
    counters: dict[str, int] = field(default_factory=lambda: {
        "sessions": 0, "matches": 0, "match_tokens": 0, "hit_tokens": 0, "host_hit_tokens": 0,
        "inserted_tokens": 0,
        "allocated_pages": 0, "quota_evicted_pages": 0, "quota_refusals": 0})


@dataclass
class Peer:
    pid: int = 0
    uid: int = -1
    gid: int = -1


@dataclass
class Session:
    id: int
    tenant: Tenant
    peer: Peer
    client: str
    started: float = field(default_factory=time.time)
    ops: int = 0
    #: its last match, when no load has followed it yet: (model, tokens' fingerprint, the
    #: device hits it counted). A load of the same tokens continues that request (protocol
    #: 9.2's probe), which the match has counted already
    probed: tuple[str, tuple[int, bytes, bytes], int] | None = None


@dataclass
class ModelEntry:
    name: str
    cache: ModelCache
    info: P.ModelInfo
    pools: Any = None  # daemon.gpu.pools.KVPools when exported
    tiers: Any = None  # daemon.tiers.TierManager when the host tier is on
    keyed: Any = None  # daemon.keyed_tier.KeyedTier when the host tier is on


def build_tenants(config: Config) -> list[Tenant]:
    """The configured tenants; without any, the daemon is open: one built-in tenant, no token."""
    tenants = [
        Tenant(t.name, t.token_digest(), t.namespace or t.name,
               None if "*" in t.models else frozenset(t.models),
               t.quota_full_pages, t.quota_swa_pages, t.quota_host_pages, t.quota_l3_bytes)
        for t in config.tenants
    ]
    return tenants or [Tenant(DEFAULT_TENANT, None, DEFAULT_TENANT, None)]


def namespace_quotas(tenants: list[Tenant], attr: str) -> dict[str, int]:
    """Per namespace, the smallest non-zero quota of the tenants sharing it (the tiers enforce
    host and L3 quotas per namespace, since pages belong to namespaces, not tenants)."""
    out: dict[str, int] = {}
    for t in tenants:
        q = getattr(t, attr)
        if q:
            out[t.namespace] = min(q, out.get(t.namespace, q))
    return out


def fingerprint(tokens: bytes) -> tuple[int, bytes, bytes]:
    """Tells a request's tokens from another's at no cost per token (a hash of a long prompt
    costs microseconds on every match): their length and their two ends."""
    return len(tokens), tokens[:64], tokens[-64:]


def count_load(tenant: dict[str, int], model: dict[str, int], tokens: int, prefix: int,
               loaded: int, probed: int | None) -> None:
    """A load's match counted a lookup of ``tokens`` whose ``prefix`` usable tokens were all
    device hits: ``loaded`` of them came from host. ``probed``: the device hits the session's
    match of the same tokens counted just before, when it did; that match counted the request,
    and the load adds only the hits past those, from host as far as it loaded them (counting
    the request again made one that loaded count twice, and its hit rate half of what it was;
    counting every loaded token made it pass 100% when the probe's device pages were evicted
    before the load brought them back)."""
    if probed is None:
        undo = {"hit_tokens": loaded}
        host = loaded
    else:
        host = min(loaded, max(0, prefix - probed))
        undo = {"matches": 1, "match_tokens": tokens,
                "hit_tokens": prefix - max(0, prefix - probed - host)}
    for counters in (tenant, model):
        for key, n in undo.items():
            counters[key] -= n
        counters["host_hit_tokens"] += host
