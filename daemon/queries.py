"""The service's read-only query API: what the admin endpoint and the metrics may know.

Every answer is a plain msgspec Struct built at call time from the service's live state, so its
readers (admin routes, the Prometheus collector, the status page through ``/v1/stats``) need no
knowledge of the model cache, the radix tree, the tier managers or the allocators, and a change
in those stays behind this module. The queries run on the event loop like every operation, so
each answer is consistent; none of them changes state.
"""

from __future__ import annotations

import heapq
from typing import Annotated, Any, Literal, Protocol

import msgspec
from radixd_client import protocol as P

from .entities import ModelEntry, Session, Tenant
from .metrics import GcPauses, OpStats
from .model_cache import ModelCache
from .open_files import NearLimit
from .process_memory import HeapTrimmer

#: eviction triggers every model reports, 0 until they happen
EVICTION_REASONS = ("alloc", "quota", "explicit", "admin")


class PoolUsage(msgspec.Struct):
    """One device pool: capacity (usable pages, page 0 excluded) = free + tree + held."""

    capacity: int
    free: int
    tree: int  # evictable + locked
    evictable: int
    locked: int
    held: int  # allocated to sessions, not yet given to the tree or freed


class SegmentUsage(msgspec.Struct):
    """One pool's segments under memory isolation (docs/operations.md "Memory isolation")."""

    segments: int
    segment_pages: int
    free: int  # segments on the free list (serving no namespace)
    assigned: int  # segments handed to a namespace since the start
    moved: int  # ... of them to another namespace than they last served: zeroed first


class EvictionCount(msgspec.Struct):
    full: int
    swa: int


class HostPool(msgspec.Struct):
    capacity: int
    used: int


class TierView(msgspec.Struct):
    """A model's host (L2) tier and what it moved; ``stats`` is the tier manager's summary."""

    host: dict[str, HostPool]
    counters: dict[str, int]
    copy_seconds: dict[str, float]
    copy_bytes: dict[str, int]
    stats: dict[str, Any]


class KeyedView(msgspec.Struct):
    """A model's key-addressed store, all namespaces (a tenant's ``stats`` shows its own)."""

    pages: dict[str, int]  # stored pages by pool kind
    pins: int  # lookup pins and reservations held now
    counters: dict[str, int]


class ModelView(msgspec.Struct):
    name: str
    info: P.ModelInfo
    policy: str
    pools: dict[str, PoolUsage]  # "full", and "swa" when the model has SWA
    nodes: int  # nodes holding tokens (namespace roots not counted)
    matches: int
    match_tokens: int
    hit_tokens: int  # device hits (loaded tokens are counted in tiers)
    evictions: dict[str, EvictionCount]  # by trigger, every known trigger listed
    tiers: TierView | None
    segments: dict[str, SegmentUsage] | None = None  # by pool; None: no memory isolation
    # nodes whose page ids went to their compact form while cold, and back when used again
    compacted_nodes: int = 0
    expanded_nodes: int = 0
    # bytes of the page-id listings the codec keeps for the next matches (0: a codec that keeps
    # none)
    listing_bytes: int = 0
    keyed: KeyedView | None = None  # None: no key-addressed store (no host tier)

    @property
    def swa(self) -> bool:
        return "swa" in self.pools

    host_hits: int = 0  # usable tokens loads brought back from host, each request's once


class TenantUsage(msgspec.Struct):
    """A tenant's pages in one model (tenants sharing a namespace report the same tree pages)."""

    tree_full_pages: int
    tree_swa_pages: int
    held_full_pages: int
    held_swa_pages: int


class TenantView(msgspec.Struct):
    name: str
    namespace: str
    models: Annotated[list[str], msgspec.Meta(description="['*']: every model")]
    quota_full_pages: int
    quota_swa_pages: int
    quota_host_pages: int
    quota_l3_bytes: int
    sessions: int
    counters: dict[str, int]
    usage: dict[str, TenantUsage]  # the models it may use, in configuration order


class SessionHeld(msgspec.Struct):
    full_pages: int
    swa_pages: int
    receipts: int


class SessionView(msgspec.Struct):
    id: int
    tenant: str
    client: str
    pid: int
    uid: int
    gid: int
    started: float
    ops: int
    held: dict[str, SessionHeld]


class TreeNode(msgspec.Struct):
    id: int
    pages: int
    depth: Annotated[int, msgspec.Meta(description="tokens from the root")]
    state: Literal["live", "tombstone", "host"]
    host: Annotated[bool, msgspec.Meta(description="has a host (L2) copy")]
    locks: Annotated[list[int], msgspec.Meta(description="[full locks, swa locks]")]
    hits: int
    children: list[TreeNode] = msgspec.field(default_factory=list)
    children_omitted: Annotated[int, msgspec.Meta(
        description="children left out by depth or the node cap")] | msgspec.UnsetType = \
        msgspec.UNSET


class TreeView(msgspec.Struct):
    """A bounded breadth-first dump of one namespace."""

    root: TreeNode
    nodes: int
    truncated: bool


class ServerState(Protocol):
    """What the server reports about itself (daemon.server.Server has these attributes): the
    admin endpoint and the metrics read it without depending on the server module."""

    ready: bool
    stopping: bool
    started: float  # Unix time
    ops: int  # frames handled
    op_stats: OpStats
    heap_trimmer: HeapTrimmer
    gc_pauses: GcPauses
    near_limit: NearLimit


class NotFound(LookupError):
    """No such model or namespace."""


class ServiceQueries:
    """Mixed into :class:`daemon.service.Service`: its read-only view."""

    models: dict[str, ModelEntry]
    tenants: list[Tenant]
    sessions: dict[int, Session]
    l3: Any
    instance: str

    # -- models and pools

    def model_names(self) -> list[str]:
        return list(self.models)

    def _entry(self, model: str) -> ModelEntry:
        entry = self.models.get(model)
        if entry is None:
            raise NotFound(f"no model named {model!r} (models: {', '.join(self.models)})")
        return entry

    def pool_usage(self, model: str) -> dict[str, PoolUsage]:
        c = self._entry(model).cache
        a = c.alloc_state
        t = c.tree
        held_full, held_swa = held_pages(c)
        out = {"full": PoolUsage(a.full.usable, a.full.available,
                                 t.full_evictable + t.full_protected, t.full_evictable,
                                 t.full_protected, held_full)}
        if a.swa is not None:
            out["swa"] = PoolUsage(a.swa.usable, a.swa.available,
                                   t.swa_evictable + t.swa_protected, t.swa_evictable,
                                   t.swa_protected, held_swa)
        return out

    def model_view(self, model: str) -> ModelView:
        entry = self._entry(model)
        cache = entry.cache
        tree = cache.tree
        c = cache.counters
        by = tree.evictions_by_reason
        reasons = list(EVICTION_REASONS) + sorted(set(by) - set(EVICTION_REASONS))
        evictions = {r: EvictionCount(*by.get(r, (0, 0))) for r in reasons}
        return ModelView(
            name=model, info=entry.info, policy=tree.policy.name, pools=self.pool_usage(model),
            nodes=len(tree.nodes) - len(tree.namespaces), matches=c["matches"],
            match_tokens=c["match_tokens"], hit_tokens=c["hit_tokens"],
            host_hits=c["host_hit_tokens"], evictions=evictions,
            tiers=_tier_view(entry), segments=_segment_view(cache),
            compacted_nodes=tree.stats["compacted_nodes"],
            expanded_nodes=tree.stats["expanded_nodes"],
            listing_bytes=tree.page_ids.listed_bytes, keyed=_keyed_view(entry))

    def model_views(self) -> list[ModelView]:
        return [self.model_view(m) for m in self.models]

    def l3_stats(self) -> dict[str, Any] | None:
        """The Redis client's counters and breaker_state; None without L3."""
        return dict(self.l3.stats) if self.l3 is not None else None

    # -- tenants and sessions

    def live_sessions(self) -> dict[str, int]:
        """Open sessions per tenant name (every tenant listed, 0 when none)."""
        out = {t.name: 0 for t in self.tenants}
        for s in self.sessions.values():
            out[s.tenant.name] = out.get(s.tenant.name, 0) + 1
        return out

    def session_count(self) -> int:
        return len(self.sessions)

    def tenant_models(self, tenant: Tenant) -> list[str]:
        """The models a tenant may use, in configuration order."""
        return [n for n in self.models if tenant.models is None or n in tenant.models]

    def tenant_usage(self, model: str) -> dict[str, TenantUsage]:
        """Per tenant name, its pages in one model."""
        c = self._entry(model).cache
        out: dict[str, TenantUsage] = {}
        for t in self.tenants:
            ns = c.tree.namespaces.get(t.namespace)
            out[t.name] = TenantUsage(ns.full_pages if ns is not None else 0,
                                      ns.swa_pages if ns is not None else 0, 0, 0)
        for owner, h in c.holdings.items():
            s = self.sessions.get(owner)
            if s is not None and s.tenant.name in out:
                u = out[s.tenant.name]
                u.held_full_pages += len(h.full)
                u.held_swa_pages += len(h.swa)
        return out

    def tenant_views(self) -> list[TenantView]:
        """Every tenant in configuration order (never a token or its digest)."""
        live = self.live_sessions()
        usage = {m: self.tenant_usage(m) for m in self.models}
        return [TenantView(
            name=t.name, namespace=t.namespace,
            models=["*"] if t.models is None else sorted(t.models),
            quota_full_pages=t.quota_full, quota_swa_pages=t.quota_swa,
            quota_host_pages=t.quota_host, quota_l3_bytes=t.quota_l3,
            sessions=live.get(t.name, 0), counters=dict(t.counters),
            usage={m: usage[m][t.name] for m in self.tenant_models(t)}) for t in self.tenants]

    def session_holdings(self, session: Session) -> dict[str, SessionHeld]:
        out: dict[str, SessionHeld] = {}
        for name in self.tenant_models(session.tenant):
            h = self.models[name].cache.holdings.get(session.id)
            out[name] = SessionHeld(len(h.full), len(h.swa), len(h.receipts)) if h else \
                SessionHeld(0, 0, 0)
        return out

    def session_views(self) -> list[SessionView]:
        return [SessionView(s.id, s.tenant.name, s.client, s.peer.pid, s.peer.uid, s.peer.gid,
                            s.started, s.ops, self.session_holdings(s))
                for s in sorted(self.sessions.values(), key=lambda s: s.id)]

    # -- the tree

    def namespaces(self, model: str) -> list[str]:
        """Namespaces with something cached in ``model``, sorted."""
        return sorted(self._entry(model).cache.tree.namespaces)

    def has_swa(self, model: str) -> bool:
        return bool(self._entry(model).cache.swa_enabled)

    def tree_view(self, model: str, namespace: str, depth: int, limit: int) -> TreeView:
        tree = self._entry(model).cache.tree
        ns = tree.namespaces.get(namespace)
        if ns is None:
            raise NotFound(f"model {model!r} has nothing cached in namespace {namespace!r}")
        root, count, truncated = dump_tree(tree, ns.root, depth, limit)
        return TreeView(root, count, truncated)


def held_pages(cache: ModelCache) -> tuple[int, int]:
    """Pages the sessions hold in a model (full, SWA)."""
    return cache.held_full_pages, cache.held_swa_pages


def _tier_view(entry: ModelEntry) -> TierView | None:
    t = entry.tiers
    if t is None:
        return None
    host = {p.kind: HostPool(p.usable, p.used) for p in t.host.pools()}
    return TierView(host=host, counters=dict(t.counters), copy_seconds=dict(t.copy_seconds),
                    copy_bytes=dict(t.copy_bytes), stats=t.stats())


def _keyed_view(entry: ModelEntry) -> KeyedView | None:
    k = entry.keyed
    if k is None:
        return None
    return KeyedView(pages={kind: len(order) for kind, order in k.pages.order.items()},
                     pins=len(k.pages.pins), counters=dict(k.counters))


def dump_tree(tree: Any, root: Any, depth: int, limit: int) -> tuple[TreeNode, int, bool]:
    """A namespace's tree breadth first: levels below the root up to ``depth``, at most
    ``limit`` nodes in all, so a huge tree cannot stall the loop or the response. A node some of
    whose children are left out says how many in ``children_omitted``. Returns (root, nodes
    shown, whether ``limit`` cut it short)."""
    page_bytes = tree.page_bytes
    swa = tree.swa_enabled

    def view(n: Any) -> TreeNode:
        if n.full is None:
            state = "host"
        elif swa and n.swa is None:
            state = "tombstone"
        else:
            state = "live"
        return TreeNode(n.id, len(n.tokens) // page_bytes, n.depth, state,  # type: ignore[arg-type]
                        n.host is not None and len(n.host) > 0, [n.full_lock, n.swa_lock], n.hits)

    out = view(root)
    count = 1
    truncated = False
    queue = [(root, out, 0)]
    i = 0
    while i < len(queue):
        node, js, level = queue[i]
        i += 1
        n = len(node.children) if node.children else 0
        if not n:
            continue
        if level >= depth or count >= limit:  # counted, never sorted: a node may have 100k
            js.children_omitted = n
            truncated = truncated or level < depth
            continue
        # the lowest ids of those that fit: a heap's work, not a sort of every child
        children = heapq.nsmallest(limit - count, node.children.values(), key=_node_id)
        for child in children:
            cjs = view(child)
            js.children.append(cjs)
            count += 1
            queue.append((child, cjs, level + 1))
        if len(children) < n:
            truncated = True
            js.children_omitted = n - len(children)
    return out, count, truncated


def _node_id(node: Any) -> int:
    return node.id  # type: ignore[no-any-return]


def _segment_view(cache: ModelCache) -> dict[str, SegmentUsage] | None:
    if not cache.isolated:
        return None
    out = {kind: _segments(a) for kind, a in cache.alloc_state.allocators()}
    if cache.host is not None and cache.host.isolated:  # host pools: "host_full", "host_swa"
        out.update({f"host_{p.kind}": _segments(p.allocator) for p in cache.host.pools()})
    return out


def _segments(a: Any) -> SegmentUsage:
    """A ``SegmentedAllocator``'s counts (device pools and host pools alike)."""
    return SegmentUsage(a.num_segments, a.segment_pages, a.free_segment_count,
                        a.segments_assigned, a.segments_moved)
