"""The service: every operation an engine can ask for, on state only it mutates.

It composes one :class:`ModelCache` per model profile with tenants (namespaces, allowed models,
quotas) and sessions (the owners of pages and receipts). It runs on the event loop thread only and
every call runs to completion before the next starts, so each operation is atomic with respect to
every other. It speaks protocol structs in and out but knows nothing of sockets or framing.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from radixd_client import protocol as P

from .config import Config
from .gpu.allocator import OutOfPages
from .model_cache import ModelCache

log = logging.getLogger("radixd.service")

DEFAULT_TENANT = "default"


class ServiceError(Exception):
    """A refused request: a stable code, a message, and details for the client."""

    def __init__(self, code: str, message: str, **details: Any):
        super().__init__(message)
        self.code = code
        self.details = details


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


@dataclass
class ModelEntry:
    name: str
    cache: ModelCache
    info: P.ModelInfo
    pools: Any = None  # daemon.gpu.pools.KVPools when exported
    tiers: Any = None  # daemon.tiers.TierManager when the host tier is on


class Service:
    def __init__(self, config: Config, *, create_pools: bool = True):
        self.config = config
        self.models: dict[str, ModelEntry] = {}
        for mc in config.models:
            profile = mc.profile()
            pools = None
            if create_pools and mc.export_pools:
                from .gpu.pools import KVPools  # torch only when pools are wanted

                pools = KVPools(profile)
            device = str(pools.device) if pools is not None else profile.device
            info = P.ModelInfo(
                name=profile.name, page_size=profile.page_size,
                sliding_window=profile.sliding_window, num_full_layers=profile.num_full_layers,
                num_swa_layers=profile.num_swa_layers, num_kv_heads=profile.num_kv_heads,
                head_dim=profile.head_dim, dtype=profile.dtype, device=device,
                full_pages=profile.full_pages, swa_pages=profile.swa_pages,
                host_pages=mc.host_pages if pools is not None else 0,
                l3=bool(pools is not None and mc.host_pages and mc.l3 and config.l3.url))
            cache = ModelCache(profile, pools=pools, policy=mc.eviction_policy)
            self.models[mc.name] = ModelEntry(mc.name, cache, info, pools)
        self.tenants: list[Tenant] = [
            Tenant(t.name, t.token_digest(), t.namespace or t.name,
                   None if "*" in t.models else frozenset(t.models),
                   t.quota_full_pages, t.quota_swa_pages, t.quota_host_pages, t.quota_l3_bytes)
            for t in config.tenants
        ]
        self.open_mode = not self.tenants
        if self.open_mode:
            self.tenants = [Tenant(DEFAULT_TENANT, None, DEFAULT_TENANT, None)]
        self.l3 = None
        if config.l3.url and any(m.l3 and m.host_pages for m in config.models):
            from .storage.redis_tier import RedisTier

            c = config.l3
            self.l3 = RedisTier(c.url, key_prefix=c.key_prefix + ":", ttl_seconds=c.ttl_s,
                                op_timeout=c.op_timeout_ms / 1000,
                                breaker_threshold=c.breaker_threshold,
                                breaker_open_seconds=c.breaker_open_s,
                                max_connections=c.max_connections)
        for mc in config.models:
            entry = self.models[mc.name]
            if entry.pools is not None and mc.host_pages:
                from .tiers import TierManager

                entry.tiers = TierManager(entry.cache, entry.pools, mc,
                                          self.l3 if mc.l3 else None, config.l3,
                                          self._quotas("quota_host"), self._quotas("quota_l3"))
        self.sessions: dict[int, Session] = {}
        self._next_session = 1
        self.instance = secrets.token_hex(8)
        self.ops_total = 0
        self.limits = P.Limits(max_frame_bytes=config.server.max_frame_bytes,
                               max_tokens=config.server.max_tokens,
                               max_inflight=config.server.max_inflight)

    def _quotas(self, attr: str) -> dict[str, int]:
        """Per namespace, the smallest non-zero quota of the tenants sharing it."""
        out: dict[str, int] = {}
        for t in self.tenants:
            q = getattr(t, attr)
            if q:
                out[t.namespace] = min(q, out.get(t.namespace, q))
        return out

    def start_tiers(self) -> None:
        """Start the tiers' background workers (needs the running event loop)."""
        for entry in self.models.values():
            if entry.tiers is not None:
                entry.tiers.start()

    async def stop_tiers(self, deadline: float) -> None:
        """Finish what the write policies owe to host and L3 by ``deadline`` (monotonic)."""
        for entry in self.models.values():
            if entry.tiers is not None:
                await entry.tiers.drain(deadline)
                await entry.tiers.aclose()
        if self.l3 is not None:
            await self.l3.aclose()

    # ------------------------------------------------------------------ sessions

    def authenticate(self, token: str | None, peer: Peer) -> Tenant:
        srv = self.config.server
        if srv.allowed_uids and peer.uid not in srv.allowed_uids and (
                not srv.allowed_gids or peer.gid not in srv.allowed_gids):
            raise ServiceError(P.Code.AUTH_FAILED, f"peer uid {peer.uid} is not allowed")
        if srv.allowed_gids and not srv.allowed_uids and peer.gid not in srv.allowed_gids:
            raise ServiceError(P.Code.AUTH_FAILED, f"peer gid {peer.gid} is not allowed")
        if self.open_mode:
            if token:
                raise ServiceError(P.Code.AUTH_FAILED,
                                   "this daemon has no tenants configured: connect without a token")
            return self.tenants[0]
        if not token:
            raise ServiceError(P.Code.AUTH_FAILED, "a tenant token is required")
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for t in self.tenants:  # compare with every tenant: timing does not tell which matched
            if hmac.compare_digest(digest, t.digest or b"") and found is None:
                found = t
        if found is None:
            raise ServiceError(P.Code.AUTH_FAILED, "unknown tenant token")
        return found

    def open_session(self, tenant: Tenant, peer: Peer, client: str = "") -> Session:
        if len(self.sessions) >= self.config.server.max_sessions:
            raise ServiceError(P.Code.TOO_MANY_SESSIONS,
                               f"the daemon serves its maximum of "
                               f"{self.config.server.max_sessions} sessions")
        s = Session(self._next_session, tenant, peer, client)
        self._next_session += 1
        self.sessions[s.id] = s
        tenant.counters["sessions"] += 1
        return s

    def close_session(self, session: Session) -> None:
        """Everything the session held goes back, whatever way its connection ended."""
        if self.sessions.pop(session.id, None) is None:
            return
        for entry in self.models.values():
            locks, full, swa = entry.cache.release_owner(session.id)
            if locks or full or swa:
                log.info("session %d closed: released %d locks, %d full and %d swa pages of %s",
                         session.id, locks, full, swa, entry.name)

    def hello_result(self, session: Session) -> P.HelloResult:
        t = session.tenant
        return P.HelloResult(
            session=session.id, version=P.PROTOCOL_VERSION, instance=self.instance,
            tenant=t.name, namespace=t.namespace,
            models=[e.info for e in self.models.values()
                    if t.models is None or e.name in t.models],
            limits=self.limits)

    # ------------------------------------------------------------------ helpers

    def _model(self, s: Session, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            raise ServiceError(P.Code.UNKNOWN_MODEL, f"no model named {name!r}",
                               models=sorted(self.models))
        if s.tenant.models is not None and name not in s.tenant.models:
            raise ServiceError(P.Code.MODEL_NOT_ALLOWED,
                               f"tenant {s.tenant.name!r} may not use model {name!r}")
        return entry

    def _tokens(self, data: bytes) -> bytes:
        if len(data) % 4:
            raise ServiceError(P.Code.BAD_ARGUMENT,
                               f"tokens must be int32 little-endian: {len(data)} bytes is not a "
                               "multiple of 4")
        if len(data) // 4 > self.limits.max_tokens:
            raise ServiceError(P.Code.TOO_MANY_TOKENS,
                               f"{len(data) // 4} tokens; the limit is {self.limits.max_tokens}",
                               limit=self.limits.max_tokens)
        return data

    @staticmethod
    def _pages(data: bytes, name: str) -> array:
        if len(data) % 4:
            raise ServiceError(P.Code.BAD_ARGUMENT,
                               f"{name} must be int32 little-endian: {len(data)} bytes is not a "
                               "multiple of 4")
        a = array("i")
        a.frombytes(data)
        return a

    def _held(self, s: Session, entry: ModelEntry) -> tuple[int, int]:
        """Pages held by every session of the caller's tenant, in one model."""
        full = swa = 0
        hold = entry.cache.holdings
        for sid, other in self.sessions.items():
            if other.tenant is s.tenant:
                h = hold.get(sid)
                if h is not None:
                    full += len(h.full)
                    swa += len(h.swa)
        return full, swa

    def _enforce_quota(self, s: Session, entry: ModelEntry, n: int, n_swa: int | None = None
                       ) -> None:
        """Over quota, the tenant's own cold pages go first; then the request is refused.

        ``n`` full pages (and ``n_swa`` SWA pages, default ``n``) are about to be taken."""
        n_swa = n if n_swa is None else n_swa
        t = s.tenant
        if not t.quota_full and not t.quota_swa:
            return
        cache = entry.cache
        swa_enabled = cache.swa_enabled

        def overage() -> tuple[int, int]:
            ns = cache.tree.namespaces.get(t.namespace)
            tree_full, tree_swa = (ns.full_pages, ns.swa_pages) if ns is not None else (0, 0)
            held_full, held_swa = self._held(s, entry)
            of = tree_full + held_full + n - t.quota_full if t.quota_full else 0
            osw = (tree_swa + held_swa + n_swa - t.quota_swa
                   if t.quota_swa and swa_enabled else 0)
            return max(0, of), max(0, osw)

        over_full, over_swa = overage()
        if over_full or over_swa:
            ev = cache.evict(over_full, over_swa, namespace=t.namespace, reason="quota")
            t.counters["quota_evicted_pages"] += ev.full_pages
            over_full, over_swa = overage()
        if over_full or over_swa:
            t.counters["quota_refusals"] += 1
            pool = "full" if over_full else "swa"
            limit = t.quota_full if over_full else t.quota_swa
            raise ServiceError(
                P.Code.QUOTA_EXCEEDED,
                f"tenant {t.name!r} is over its {pool} page quota for model {entry.name!r}: "
                f"{n} pages requested, limit {limit}, and its unlocked cached pages are already "
                "evicted (release locks or pages first)",
                pool=pool, limit=limit, requested=n, over=over_full or over_swa)

    # ------------------------------------------------------------------ operations

    def ping(self, s: Session, r: P.Ping) -> P.PingResult:
        return P.PingResult(payload=r.payload)

    def _lock_budget(self, s: Session, entry: ModelEntry) -> None:
        """A session may hold at most max_locks_per_session receipts (memory, and the time its
        end takes to release them all)."""
        h = entry.cache.holdings.get(s.id)
        limit = self.config.server.max_locks_per_session
        if h is not None and len(h.receipts) >= limit:
            raise ServiceError(P.Code.TOO_MANY_LOCKS,
                               f"this session holds {len(h.receipts)} lock receipts on model "
                               f"{entry.name!r}; the limit is {limit}: unlock some first",
                               limit=limit)

    def match(self, s: Session, r: P.Match) -> P.MatchResult:
        entry = self._model(s, r.model)
        tokens = self._tokens(r.tokens)
        if r.lock:
            self._lock_budget(s, entry)
        res, rid = entry.cache.match(s.id, s.tenant.namespace, tokens, lock=r.lock)
        c = s.tenant.counters
        c["matches"] += 1
        c["match_tokens"] += len(tokens) // 4
        c["hit_tokens"] += res.prefix_len
        if entry.tiers is not None:
            entry.tiers.used(res.node_id, inserted=False)
        return P.MatchResult(prefix_len=res.prefix_len, full_pages=res.full_pages.tobytes(),
                             swa_pages=res.swa_pages.tobytes(), node=res.node_id,
                             full_hit_len=res.full_hit_len, host_hit_len=res.host_hit_len,
                             receipt=rid)

    def lock(self, s: Session, r: P.Lock) -> P.LockResult:
        entry = self._model(s, r.model)
        self._lock_budget(s, entry)
        return P.LockResult(receipt=entry.cache.lock(s.id, s.tenant.namespace, r.node))

    def unlock(self, s: Session, r: P.Unlock) -> P.Empty:
        self._model(s, r.model).cache.unlock(s.id, r.receipt)
        return P.Empty()

    def release_swa(self, s: Session, r: P.ReleaseSwa) -> P.Empty:
        self._model(s, r.model).cache.release_swa(s.id, r.receipt)
        return P.Empty()

    def alloc(self, s: Session, r: P.Alloc) -> P.AllocResult:
        entry = self._model(s, r.model)
        a = entry.cache.alloc_state
        cap = min(a.full.usable, a.swa.usable) if a.swa is not None else a.full.usable
        if r.n < 0 or r.n > cap:
            raise ServiceError(P.Code.BAD_ARGUMENT,
                               f"n must be between 0 and the pools' {cap} pages, got {r.n}")
        if not entry.cache.can_alloc(r.n):  # refuse before any quota eviction, for nothing
            entry.cache.counters["alloc_failures"] += 1
            raise entry.cache.oom_error(r.n)
        self._enforce_quota(s, entry, r.n)
        full, swa = entry.cache.alloc(s.id, r.n)
        s.tenant.counters["allocated_pages"] += r.n
        return P.AllocResult(full_pages=full.tobytes(), swa_pages=swa.tobytes())

    def free(self, s: Session, r: P.Free) -> P.Empty:
        entry = self._model(s, r.model)
        entry.cache.free(s.id, self._pages(r.full_pages, "full_pages"),
                         self._pages(r.swa_pages, "swa_pages"))
        return P.Empty()

    def _insert_result(self, s: Session, entry: ModelEntry, res: Any, rid: int | None
                       ) -> P.InsertResult:
        s.tenant.counters["inserted_tokens"] += max(0, res.inserted_len - res.prefix_len)
        if entry.tiers is not None:
            entry.tiers.used(res.node_id, inserted=True)
        return P.InsertResult(prefix_len=res.prefix_len, inserted_len=res.inserted_len,
                              full_pages=res.full_pages.tobytes(),
                              swa_pages=res.swa_pages.tobytes(), node=res.node_id, receipt=rid)

    def insert(self, s: Session, r: P.Insert) -> P.InsertResult:
        entry = self._model(s, r.model)
        if r.lock:
            self._lock_budget(s, entry)
        res, rid = entry.cache.insert(
            s.id, s.tenant.namespace, self._tokens(r.tokens),
            self._pages(r.full_pages, "full_pages"), self._pages(r.swa_pages, "swa_pages"),
            r.prev_prefix_len, r.swa_evicted_len, lock=r.lock)
        return self._insert_result(s, entry, res, rid)

    def cache_unfinished(self, s: Session, r: P.CacheUnfinished) -> P.InsertResult:
        entry = self._model(s, r.model)
        if r.receipt is None:  # with a receipt, the new lock replaces it
            self._lock_budget(s, entry)
        res, rid = entry.cache.cache_unfinished(
            s.id, s.tenant.namespace, self._tokens(r.tokens),
            self._pages(r.full_pages, "full_pages"), self._pages(r.swa_pages, "swa_pages"),
            r.prev_prefix_len, r.swa_evicted_len, r.receipt)
        return self._insert_result(s, entry, res, rid)

    def cache_finished(self, s: Session, r: P.CacheFinished) -> P.InsertResult:
        entry = self._model(s, r.model)
        res = entry.cache.cache_finished(
            s.id, s.tenant.namespace, self._tokens(r.tokens),
            self._pages(r.full_pages, "full_pages"), self._pages(r.swa_pages, "swa_pages"),
            r.prev_prefix_len, r.swa_evicted_len, r.receipt)
        return self._insert_result(s, entry, res, None)

    def evict(self, s: Session, r: P.Evict) -> P.EvictResult:
        """An engine may make room only from its own namespace."""
        entry = self._model(s, r.model)
        if not isinstance(r.host_pages, int) or r.host_pages < 0:
            raise ServiceError(P.Code.BAD_ARGUMENT,
                               f"host_pages must be a non-negative int, got {r.host_pages!r}")
        res = entry.cache.evict(r.full_pages, r.swa_pages, namespace=s.tenant.namespace)
        host = 0
        if r.host_pages:
            host = entry.cache.tree.evict_host(r.host_pages, namespace=s.tenant.namespace
                                               ).host_slots
        return P.EvictResult(full_pages=res.full_pages, swa_pages=res.swa_pages, host_pages=host)

    def stats(self, s: Session, r: P.Stats) -> P.StatsResult:
        t = s.tenant
        names = [r.model] if r.model is not None else [
            n for n in self.models if t.models is None or n in t.models]
        out: dict[str, dict[str, int]] = {}
        for name in names:
            entry = self._model(s, name)
            ns = entry.cache.tree.namespaces.get(t.namespace)
            held_full, held_swa = self._held(s, entry)
            out[name] = {
                "tree_full_pages": ns.full_pages if ns else 0,
                "tree_swa_pages": ns.swa_pages if ns else 0,
                "held_full_pages": held_full,
                "held_swa_pages": held_swa,
                "quota_full_pages": t.quota_full,
                "quota_swa_pages": t.quota_swa,
                "tree_host_pages": ns.host_pages if ns else 0,
                "quota_host_pages": t.quota_host,
                "quota_l3_bytes": t.quota_l3,
                **t.counters,
            }
        return P.StatsResult(tenant=t.name, namespace=t.namespace, models=out)

    def attach(self, s: Session, r: P.Attach) -> tuple[P.AttachResult, list[int]]:
        """Pool descriptions plus the fds to pass with them (CPU pools are memfds)."""
        entry = self._model(s, r.model)
        if entry.pools is None:
            raise ServiceError(P.Code.BAD_ARGUMENT,
                               f"model {r.model!r} does not export its pools (export_pools off)")
        infos: list[P.PoolInfo] = []
        fds: list[int] = []
        for pool in entry.pools.pools():
            desc = pool.describe()
            if pool.fd is not None:
                fds.append(pool.fd)
                kind, index, handle = "memfd", len(fds) - 1, b""
            else:
                kind, index, handle = "cuda_ipc", -1, _cuda_ipc_handle(pool)
            infos.append(P.PoolInfo(pool=pool.kind, kind=kind, fd_index=index,
                                    dtype=desc["dtype"], shape=desc["shape"],
                                    nbytes=desc["nbytes"], device=desc["device"],
                                    description=desc, handle=handle))
        return P.AttachResult(pools=infos), fds

    async def load(self, s: Session, r: P.Load) -> P.LoadResult:
        """Host copies of the path back to device, then a match: answered once the data is
        there. Other sessions are served meanwhile (this session's later frames wait)."""
        entry = self._model(s, r.model)
        tokens = self._tokens(r.tokens)
        if r.lock:
            self._lock_budget(s, entry)
        before = None
        if entry.tiers is not None:
            before = await entry.tiers.load(
                s.tenant.namespace, tokens,
                lambda full, swa: self._enforce_quota(s, entry, full, swa))
        if s.id not in self.sessions:  # the session ended during the copy: nothing to lock for
            raise ServiceError(P.Code.SHUTTING_DOWN, "the session ended during the load")
        m = self.match(s, P.Match(model=r.model, tokens=tokens, lock=r.lock))
        loaded = max(0, m.prefix_len - before) if before is not None else 0
        # the match counted every usable token as a device hit; the loaded ones came from host
        entry.cache.counters["hit_tokens"] -= loaded
        s.tenant.counters["hit_tokens"] -= loaded
        s.tenant.counters["host_hit_tokens"] += loaded
        if entry.tiers is not None:
            entry.tiers.counters["loaded_tokens"] += loaded
        return P.LoadResult(prefix_len=m.prefix_len, full_pages=m.full_pages,
                            swa_pages=m.swa_pages, node=m.node, full_hit_len=m.full_hit_len,
                            host_hit_len=m.host_hit_len, receipt=m.receipt, loaded_len=loaded)

    async def prefetch(self, s: Session, r: P.Prefetch) -> P.PrefetchResult:
        """Pages only L3 holds, to host. Never an error caused by L3: a miss instead."""
        entry = self._model(s, r.model)
        tokens = self._tokens(r.tokens)
        if r.policy not in P.PREFETCH_POLICIES:
            raise ServiceError(P.Code.BAD_ARGUMENT,
                               f"policy must be one of {list(P.PREFETCH_POLICIES)}, "
                               f"got {r.policy!r}")
        if not isinstance(r.timeout_ms, int) or r.timeout_ms < 0 or r.timeout_ms > 600_000:
            raise ServiceError(P.Code.BAD_ARGUMENT,
                               f"timeout_ms must be between 0 and 600000, got {r.timeout_ms!r}")
        if entry.tiers is None:
            return P.PrefetchResult(status="unavailable", l3_hit_len=0, fetched_len=0)
        timeout = (r.timeout_ms or self.config.l3.prefetch_timeout_ms) / 1000
        return await entry.tiers.prefetch(s.tenant.namespace, tokens, r.policy, timeout)

    ASYNC_HANDLERS = {"load": load, "prefetch": prefetch}

    HANDLERS = {
        "ping": ping, "match": match, "lock": lock, "unlock": unlock, "release_swa": release_swa,
        "alloc": alloc, "free": free, "insert": insert, "cache_unfinished": cache_unfinished,
        "cache_finished": cache_finished, "evict": evict, "stats": stats,
    }

    # ------------------------------------------------------------------ checking

    def check(self, *, deep: bool = True) -> list[str]:
        """Every invariant of every model, plus sessions: each owner must be a live session."""
        v: list[str] = []
        for name, entry in self.models.items():
            v += [f"{name}: {x}" for x in entry.cache.check(deep=deep)]
            ghosts = [o for o in entry.cache.holdings
                      if o not in self.sessions and not _is_job(o)]
            if ghosts:
                v.append(f"{name}: pages or receipts held by sessions that are gone: {ghosts[:10]}")
        return v

    def quick_check(self) -> list[str]:
        """O(1) counter check for busy periods: free + tree + held = capacity, per pool."""
        v: list[str] = []
        for name, entry in self.models.items():
            c = entry.cache
            a = c.alloc_state
            tree_full, tree_swa = c.tree.device_pages()
            held_full = len(c._full_owner)
            held_swa = len(c._swa_owner)
            if a.full.available + tree_full + held_full != a.full.usable:
                v.append(f"{name}: full pool free {a.full.available} + tree {tree_full} + held "
                         f"{held_full} != {a.full.usable}")
            if a.swa is not None and a.swa.available + tree_swa + held_swa != a.swa.usable:
                v.append(f"{name}: swa pool free {a.swa.available} + tree {tree_swa} + held "
                         f"{held_swa} != {a.swa.usable}")
        return v

    def close(self) -> None:
        for s in list(self.sessions.values()):
            self.close_session(s)
        for entry in self.models.values():
            if entry.tiers is not None and entry.tiers.copying:
                # a copy outlived the drain: leave the memory mapped, the process is ending
                log.warning("%s: %d copies still running at shutdown; pools left mapped",
                            entry.name, entry.tiers.copying)
                continue
            if entry.tiers is not None:
                entry.tiers.host.close()
            if entry.pools is not None:
                entry.pools.close()

    # ------------------------------------------------------------------ snapshots (read-only)
    # For the admin endpoint and the metrics: they read state, never change it, and run on the
    # event loop like every operation, so each snapshot is consistent.

    def pool_usage(self, model: str) -> dict[str, dict[str, int]]:
        """Per pool ("full", and "swa" when the model has SWA): capacity (usable pages, page 0
        excluded), free, tree (evictable + locked), evictable, locked, held (by sessions)."""
        c = self.models[model].cache
        a = c.alloc_state
        t = c.tree
        out = {"full": {"capacity": a.full.usable, "free": a.full.available,
                        "tree": t.full_evictable + t.full_protected,
                        "evictable": t.full_evictable, "locked": t.full_protected,
                        "held": len(c._full_owner)}}
        if a.swa is not None:
            out["swa"] = {"capacity": a.swa.usable, "free": a.swa.available,
                          "tree": t.swa_evictable + t.swa_protected,
                          "evictable": t.swa_evictable, "locked": t.swa_protected,
                          "held": len(c._swa_owner)}
        return out

    def tree_nodes(self, model: str) -> int:
        """Nodes holding tokens (namespace roots not counted)."""
        t = self.models[model].cache.tree
        return len(t.nodes) - len(t.namespaces)

    def live_sessions(self) -> dict[str, int]:
        """Open sessions per tenant name (every tenant listed, 0 when none)."""
        out = {t.name: 0 for t in self.tenants}
        for s in self.sessions.values():
            out[s.tenant.name] = out.get(s.tenant.name, 0) + 1
        return out

    def tenant_models(self, tenant: Tenant) -> list[str]:
        """The models a tenant may use, in configuration order."""
        return [n for n in self.models if tenant.models is None or n in tenant.models]

    def tenant_usage(self, model: str) -> dict[str, dict[str, int]]:
        """Per tenant name, in one model: tree_full_pages and tree_swa_pages (pages of the
        tenant's namespace; tenants sharing a namespace report the same pages) and
        held_full_pages and held_swa_pages (pages its open sessions hold)."""
        c = self.models[model].cache
        out: dict[str, dict[str, int]] = {}
        for t in self.tenants:
            ns = c.tree.namespaces.get(t.namespace)
            out[t.name] = {"tree_full_pages": ns.full_pages if ns is not None else 0,
                           "tree_swa_pages": ns.swa_pages if ns is not None else 0,
                           "held_full_pages": 0, "held_swa_pages": 0}
        for owner, h in c.holdings.items():
            s = self.sessions.get(owner)
            if s is not None and s.tenant.name in out:
                u = out[s.tenant.name]
                u["held_full_pages"] += len(h.full)
                u["held_swa_pages"] += len(h.swa)
        return out

    def session_holdings(self, session: Session) -> dict[str, dict[str, int]]:
        """Per model the session may use: full_pages, swa_pages and receipts it holds."""
        out: dict[str, dict[str, int]] = {}
        for name in self.tenant_models(session.tenant):
            h = self.models[name].cache.holdings.get(session.id)
            out[name] = {"full_pages": len(h.full) if h else 0,
                         "swa_pages": len(h.swa) if h else 0,
                         "receipts": len(h.receipts) if h else 0}
        return out


def _is_job(owner: Any) -> bool:
    """Owners of pages a tier copy holds while it runs (not sessions)."""
    return isinstance(owner, tuple) and owner[:1] == ("load",)


def _cuda_ipc_handle(pool: Any) -> bytes:
    """The CUDA IPC handle of a device pool, in the client library's documented format."""
    from radixd_client.pools import export_cuda_ipc_handle

    return export_cuda_ipc_handle(pool.buffer)


def error_of(exc: BaseException) -> tuple[str, str, dict[str, Any]]:
    """(code, message, details) of a refused operation."""
    if isinstance(exc, ServiceError):
        return exc.code, str(exc), exc.details
    if isinstance(exc, OutOfPages):
        return P.Code.OUT_OF_MEMORY, str(exc), dict(exc.counts)
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code in P.ALL_CODES:
        return code, str(exc), {}
    return P.Code.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", {}
