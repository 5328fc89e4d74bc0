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
import os
import secrets
from array import array
from collections.abc import Callable
from typing import Any, TypeVar

from radixd_client import protocol as P

from .config import Config
from .entities import ModelEntry, Peer, Session, Tenant, build_tenants, count_load, fingerprint
from .gpu.allocator import OutOfPages
from .queries import ServiceQueries
from .service_checks import ServiceChecks, mutating, mutating_async
from .warm_restart import RestartReport, save_host_fdstore, save_host_state

log = logging.getLogger("radixd.service")
T = TypeVar("T")
#: the longest a kv_clear waits for Redis to record it: below the clients' request timeouts (the
#: SGLang backend's is 5 s), whatever l3.op_timeout_ms is
CLEAR_WAIT_S = 2.0


class ServiceError(Exception):
    """A refused request: a stable code, a message, and details for the client."""

    def __init__(self, code: str, message: str, **details: Any):
        super().__init__(message)
        self.code = code
        self.details = details



class Service(ServiceQueries, ServiceChecks):
    """The operations, over collaborators built elsewhere (daemon/app.py: the composition root):
    the model entries with their caches, pools and tier managers, the tenants, the L3 client.
    It only uses them, so a test can hand it pool-less models and no L3."""

    def __init__(self, config: Config, models: dict[str, ModelEntry],
                 tenants: list[Tenant] | None = None, l3: Any = None):
        self.config = config
        self.models = models
        self.tenants: list[Tenant] = tenants if tenants is not None else build_tenants(config)
        self.open_mode = not config.tenants
        self.l3 = l3
        self.sessions: dict[int, Session] = {}
        self._next_session = 1
        #: operations that changed what the invariant check reads (service_checks.mutating)
        self.mutations = 0
        self.instance = secrets.token_hex(8)
        #: what the last start restored of the host tier (daemon/warm_restart.py)
        self.restart = RestartReport()
        #: where a stop hands the host pools to systemd's fd store (``Notifier.store_fd``, set by
        #: daemon/app.py under systemd with ``$FDSTORE``); None: ``state_dir``, if set, instead
        self.fd_store: Callable[[str, int], bool] | None = None
        #: how many fds that store keeps (``$FDSTORE``); 0: not known, no limit checked
        self.fd_store_max = 0
        self.limits = P.Limits(max_frame_bytes=config.server.max_frame_bytes,
                               max_tokens=config.server.max_tokens,
                               max_inflight=config.server.max_inflight,
                               max_locks_per_session=config.server.max_locks_per_session)

    def start_tiers(self) -> None:
        """Start the tiers' background workers (needs the running event loop)."""
        for entry in self.models.values():
            if entry.tiers is not None:
                entry.tiers.start()
            if entry.keyed is not None:
                entry.keyed.start()

    async def stop_tiers(self, deadline: float) -> set[str]:
        """Finish what the write policies owe to host and L3 by ``deadline`` (monotonic). When a
        warm restart follows (a state directory or systemd's fd store), the tree's device-only
        pages are copied to host first, so the next run finds them there. Returns the models
        whose drain failed: their tier jobs may still hold what they took, so the stop's check at
        rest leaves them out. One model's failure does not keep the others from draining, and its
        tasks are stopped all the same; the host state is then not saved (a warm restart would
        adopt slots a job may still fill)."""
        warm = self.fd_store is not None or bool(self.config.server.state_dir)
        failed: set[str] = set()
        for name, entry in self.models.items():
            try:
                await self._drain_model(name, entry, deadline, warm)
            except Exception:  # noqa: BLE001 - logged; the other models still drain
                log.exception("stopping the memory tiers of model %r", name)
                failed.add(name)
        if self.l3 is not None:
            await self.l3.aclose()
        if not warm:
            return failed
        if failed:
            log.warning("host state not saved for a warm restart: the drain of %s failed",
                        ", ".join(map(repr, sorted(failed))))
            return failed
        try:
            if self.fd_store is None or not save_host_fdstore(self.models, self.fd_store,
                                                              self.fd_store_max):
                if self.config.server.state_dir:
                    save_host_state(self.models, self.config.server.state_dir)
        except Exception:  # noqa: BLE001 - the next start is cold; the stop goes on
            log.exception("saving the host state for a warm restart")
        return failed

    @staticmethod
    async def _drain_model(name: str, entry: ModelEntry, deadline: float, warm: bool) -> None:
        # the tree's copies first: making host room for them may evict keyed pages that L3
        # write-back still owes Redis, which the keyed store's drain then writes
        try:
            if entry.tiers is not None:
                gained = await entry.tiers.drain(deadline, back_up_device=warm)
                if warm:
                    log.info("warm restart: model %r: the tree's host pages grew by %d in the "
                             "stop's drain (device-only nodes copied)", name, gained)
            if entry.keyed is not None:
                await entry.keyed.drain(deadline)
        finally:  # a failed drain's tasks stop too (a task that will not is marked stuck)
            if entry.keyed is not None:
                await entry.keyed.aclose()
            if entry.tiers is not None:
                await entry.tiers.aclose()

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
        self.mutations += 1
        for entry in self.models.values():
            if entry.keyed is not None:
                entry.keyed.release_owner(session.id)
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

    def _enforce_quota(self, s: Session, entry: ModelEntry, n: int, n_swa: int | None = None,
                       evict: bool = True) -> None:
        """Over quota, the tenant's own cold pages go first; then the request is refused.

        ``n`` full pages (and ``n_swa`` SWA pages, default ``n``) are about to be taken. A
        request that no eviction could bring under quota (what its sessions hold and its loads
        copy, plus ``n``, is over it) is refused first, nothing evicted; ``evict=False``: only."""
        n_swa = n if n_swa is None else n_swa
        t = s.tenant
        if not t.quota_full and not t.quota_swa:
            return
        cache = entry.cache
        swa_enabled = cache.swa_enabled

        def overage(tree: bool) -> tuple[int, int]:
            ns = cache.tree.namespaces.get(t.namespace)
            tree_full, tree_swa = ((ns.full_pages, ns.swa_pages) if ns is not None and tree
                                   else (0, 0))
            held_full, held_swa = self._held(s, entry)
            load_full, load_swa = cache.loading_pages.get(t.namespace, (0, 0))
            of = (tree_full + held_full + load_full + n - t.quota_full if t.quota_full else 0)
            osw = (tree_swa + held_swa + load_swa + n_swa - t.quota_swa
                   if t.quota_swa and swa_enabled else 0)
            return max(0, of), max(0, osw)

        over_full, over_swa = overage(False)
        hopeless = bool(over_full or over_swa)
        if evict and not hopeless and any(over := overage(True)):
            ev = cache.evict(*over, namespace=t.namespace, reason="quota")
            t.counters["quota_evicted_pages"] += ev.full_pages
            over_full, over_swa = overage(True)
        if over_full or over_swa:
            t.counters["quota_refusals"] += 1
            pool = "full" if over_full else "swa"
            limit = t.quota_full if over_full else t.quota_swa
            why = ("with what its sessions hold, even without any of its cached pages" if hopeless
                   else "and its unlocked cached pages are already evicted")
            raise ServiceError(
                P.Code.QUOTA_EXCEEDED,
                f"tenant {t.name!r} is over its {pool} page quota for model {entry.name!r}: "
                f"{n} pages requested, limit {limit}, {why} (release locks or pages first)",
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
            self.mutations += 1  # a receipt: see service_checks.mutating
        res, rid = entry.cache.match(s.id, s.tenant.namespace, tokens, lock=r.lock)
        s.probed = (r.model, fingerprint(tokens), res.prefix_len)
        c = s.tenant.counters
        c["matches"] += 1
        c["match_tokens"] += len(tokens) // 4
        c["hit_tokens"] += res.prefix_len
        if entry.tiers is not None:
            entry.tiers.used(res.node_id, inserted=False)
        return P.MatchResult(prefix_len=res.prefix_len, full_pages=res.full_pages.tobytes(),
                             swa_pages=res.swa_pages.tobytes(), node=res.node_id,
                             full_hit_len=res.full_hit_len, host_hit_len=res.host_hit_len,
                             receipt=rid,
                             segments_gen=entry.cache.segment_generation(s.tenant.namespace))

    @mutating
    def lock(self, s: Session, r: P.Lock) -> P.LockResult:
        entry = self._model(s, r.model)
        self._lock_budget(s, entry)
        return P.LockResult(receipt=entry.cache.lock(s.id, s.tenant.namespace, r.node))

    @mutating
    def unlock(self, s: Session, r: P.Unlock) -> P.Empty:
        self._model(s, r.model).cache.unlock(s.id, r.receipt)
        return P.Empty()

    @mutating
    def release_swa(self, s: Session, r: P.ReleaseSwa) -> P.Empty:
        self._model(s, r.model).cache.release_swa(s.id, r.receipt)
        return P.Empty()

    @mutating
    def alloc(self, s: Session, r: P.Alloc) -> P.AllocResult:
        entry = self._model(s, r.model)
        a = entry.cache.alloc_state
        cap = min(a.full.usable, a.swa.usable) if a.swa is not None else a.full.usable
        if r.n < 0 or r.n > cap:
            raise ServiceError(P.Code.BAD_ARGUMENT,
                               f"n must be between 0 and the pools' {cap} pages, got {r.n}")
        t = s.tenant
        ns = t.namespace
        cache = entry.cache
        if t.quota_full or t.quota_swa:
            self._enforce_quota(s, entry, r.n, evict=False)  # no eviction could help
            if not cache.can_alloc(r.n, ns):  # refuse before any quota eviction, for nothing
                cache.counters["alloc_failures"] += 1
                raise cache.oom_error(r.n, ns)
            self._enforce_quota(s, entry, r.n)
        full, swa = cache.alloc(s.id, r.n, ns)
        t.counters["allocated_pages"] += r.n
        return P.AllocResult(full_pages=full.tobytes(), swa_pages=swa.tobytes(),
                             segments_gen=cache.segment_generation(ns))

    @mutating
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
                              swa_pages=res.swa_pages.tobytes(), node=res.node_id, receipt=rid,
                              segments_gen=entry.cache.segment_generation(s.tenant.namespace))

    @mutating
    def insert(self, s: Session, r: P.Insert) -> P.InsertResult:
        entry = self._model(s, r.model)
        tokens = self._tokens(r.tokens)
        full, swa = self._pages(r.full_pages, "full_pages"), self._pages(r.swa_pages, "swa_pages")
        if r.lock:
            self._lock_budget(s, entry)
        res, rid = entry.cache.insert(s.id, s.tenant.namespace, tokens, full, swa,
                                      r.prev_prefix_len, r.swa_evicted_len, lock=r.lock)
        return self._insert_result(s, entry, res, rid)

    @mutating
    def cache_unfinished(self, s: Session, r: P.CacheUnfinished) -> P.InsertResult:
        entry = self._model(s, r.model)
        tokens = self._tokens(r.tokens)
        full, swa = self._pages(r.full_pages, "full_pages"), self._pages(r.swa_pages, "swa_pages")
        if r.receipt is None:  # with a receipt, the new lock replaces it
            self._lock_budget(s, entry)
        res, rid = entry.cache.cache_unfinished(s.id, s.tenant.namespace, tokens, full, swa,
                                                r.prev_prefix_len, r.swa_evicted_len, r.receipt)
        return self._insert_result(s, entry, res, rid)

    @mutating
    def cache_finished(self, s: Session, r: P.CacheFinished) -> P.InsertResult:
        entry = self._model(s, r.model)
        res = entry.cache.cache_finished(
            s.id, s.tenant.namespace, self._tokens(r.tokens),
            self._pages(r.full_pages, "full_pages"), self._pages(r.swa_pages, "swa_pages"),
            r.prev_prefix_len, r.swa_evicted_len, r.receipt)
        return self._insert_result(s, entry, res, None)

    @mutating
    def evict(self, s: Session, r: P.Evict) -> P.EvictResult:
        """An engine may make room only from its own namespace."""
        entry = self._model(s, r.model)
        if not isinstance(r.host_pages, int) or r.host_pages < 0:
            raise ServiceError(P.Code.BAD_ARGUMENT,
                               f"host_pages must be a non-negative int, got {r.host_pages!r}")
        return self._evict(entry, r.full_pages, r.swa_pages, r.host_pages, s.tenant.namespace,
                           "explicit")

    def admin_evict(self, model: str, full_pages: int, swa_pages: int, host_pages: int,
                    namespace: str | None) -> P.EvictResult:
        """An operator's eviction (POST /v1/evict): any namespace, or one; counted as admin."""
        return self._evict(self._entry(model), full_pages, swa_pages, host_pages, namespace,
                           "admin")

    @staticmethod
    def _evict(entry: ModelEntry, full_pages: int, swa_pages: int, host_pages: int,
               namespace: str | None, reason: str) -> P.EvictResult:
        res = entry.cache.evict(full_pages, swa_pages, namespace=namespace, reason=reason)
        host = (entry.cache.evict_host(host_pages, namespace=namespace).host_slots
                if host_pages else 0)
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
            if entry.keyed is not None:
                out[name].update(entry.keyed.stats(t.namespace))
        return P.StatsResult(tenant=t.name, namespace=t.namespace, models=out)

    def attach(self, s: Session, r: P.Attach) -> tuple[P.AttachResult, list[int]]:
        """Pool descriptions plus the fds to pass with them (CPU pools are memfds). A segmented
        pool passes only the segments of the session's namespace: never another's memory."""
        entry = self._model(s, r.model)
        if entry.pools is None:
            raise ServiceError(P.Code.BAD_ARGUMENT,
                               f"model {r.model!r} does not export its pools (export_pools off)")
        infos: list[P.PoolInfo] = []
        segments: list[P.SegmentInfo] = []
        fds: list[int] = []
        alloc = dict(entry.cache.alloc_state.allocators())
        key = entry.cache.space(s.tenant.namespace)
        for pool in entry.pools.pools():
            desc = pool.describe()
            if pool.num_segments:
                kind, index, handle = "memfd_segments", -1, b""
                for seg in alloc[pool.kind].mappable_by(key):
                    fds.append(pool.segment_fds[seg])
                    segments.append(P.SegmentInfo(
                        pool=pool.kind, index=seg, epoch=pool.segment_epochs[seg],
                        fd_index=len(fds) - 1, nbytes=os.fstat(fds[-1]).st_size))
            elif pool.fd is not None:
                fds.append(pool.fd)
                kind, index, handle = "memfd", len(fds) - 1, b""
            else:
                kind, index, handle = "cuda_ipc", -1, _cuda_ipc_handle(pool)
            infos.append(P.PoolInfo(pool=pool.kind, kind=kind, fd_index=index,
                                    dtype=desc["dtype"], shape=desc["shape"],
                                    nbytes=desc["nbytes"], device=desc["device"],
                                    description=desc, handle=handle))
        return P.AttachResult(
            pools=infos, segment_pages=entry.pools.segment_pages or 0, segments=segments,
            generation=entry.cache.segment_generation(s.tenant.namespace)), fds

    @mutating_async
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
        last = s.probed
        probed = last[2] if last and last[:2] == (r.model, fingerprint(tokens)) else None
        m = self.match(s, P.Match(model=r.model, tokens=tokens, lock=r.lock))
        loaded = max(0, m.prefix_len - before) if before is not None else 0
        count_load(s.tenant.counters, entry.cache.counters, len(tokens) // 4, m.prefix_len,
                   loaded, probed)
        s.probed = None  # (the request ends here: a load that follows is another)
        if entry.tiers is not None:
            entry.tiers.counters["loaded_tokens"] += loaded
        return P.LoadResult(prefix_len=m.prefix_len, full_pages=m.full_pages,
                            swa_pages=m.swa_pages, node=m.node, full_hit_len=m.full_hit_len,
                            host_hit_len=m.host_hit_len, receipt=m.receipt, loaded_len=loaded,
                            segments_gen=m.segments_gen)

    @mutating_async
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

    # ------------------------------------------------------------------ keyed pages

    def _keyed(self, s: Session, name: str) -> tuple[ModelEntry, Any]:
        entry = self._model(s, name)
        if entry.keyed is None:
            raise ServiceError(P.Code.BAD_ARGUMENT,
                               f"model {name!r} has no host tier (host_pages = 0 or pools not "
                               "exported): it has no key-addressed store")
        return entry, entry.keyed

    def kv_attach(self, s: Session, r: P.KvAttach) -> tuple[P.KvAttachResult, list[int]]:
        """The host pools' descriptions plus their memfds, for the engine to map. Segmented
        pools (memory isolation) pass only the host segments of the session's namespace: never
        another's memory; ``generation`` tells the engine when to ask again."""
        _, keyed = self._keyed(s, r.model)
        host = keyed.host
        ns = s.tenant.namespace
        infos: list[P.KvPoolInfo] = []
        segments: list[P.SegmentInfo] = []
        fds: list[int] = []
        for pool in host.pools():
            if pool.closed:
                raise ServiceError(P.Code.SHUTTING_DOWN,
                                   f"model {r.model!r}: its {pool.kind} host pool is closed")
            if pool.num_segments:
                kind, index = "memfd_segments", -1
                for seg in pool.allocator.mappable_by(host.space(ns)):
                    fds.append(pool.segment_fds[seg])
                    segments.append(P.SegmentInfo(
                        pool=pool.kind, index=seg, epoch=pool.segment_epochs[seg],
                        fd_index=len(fds) - 1, nbytes=os.fstat(fds[-1]).st_size))
            else:
                fds.append(pool.fd)  # type: ignore[arg-type]
                kind, index = "memfd", len(fds) - 1
            # without the pool's occupancy: that is every namespace's, not the session's
            description = {k: v for k, v in pool.describe().items()
                           if k not in ("used", "available")}
            infos.append(P.KvPoolInfo(pool=pool.kind, fd_index=index, slots=pool.capacity,
                                      page_nbytes=pool.page_nbytes, nbytes=pool.nbytes,
                                      description=description, kind=kind))
        return P.KvAttachResult(pools=infos, segment_pages=host.segment_pages or 0,
                                segments=segments, generation=host.generation(ns)), fds

    def kv_lookup(self, s: Session, r: P.KvLookup) -> P.KvLookupResult:
        _, keyed = self._keyed(s, r.model)
        if r.fetch:
            raise ServiceError(P.Code.BAD_ARGUMENT,
                               "kv_lookup with fetch waits for Redis: not allowed in a batch")
        if r.pin:
            self.mutations += 1  # a pin: see service_checks.mutating
        return keyed.lookup(s.id, s.tenant.namespace, r.pool, r.keys, r.pin,
                            self.config.server.max_locks_per_session)

    @mutating
    def kv_reserve(self, s: Session, r: P.KvReserve) -> P.KvReserveResult:
        _, keyed = self._keyed(s, r.model)
        return keyed.reserve(s.id, s.tenant.namespace, r.pool, r.keys,
                             self.config.server.max_locks_per_session)

    @mutating
    def kv_commit(self, s: Session, r: P.KvCommit) -> P.Empty:
        _, keyed = self._keyed(s, r.model)
        keyed.commit(s.id, r.pin)
        return P.Empty()

    @mutating
    def kv_release(self, s: Session, r: P.KvRelease) -> P.Empty:
        _, keyed = self._keyed(s, r.model)
        keyed.release(s.id, r.pin)
        return P.Empty()

    @mutating
    def kv_clear(self, s: Session, r: P.KvClear) -> P.KvClearResult:
        """In a batch: the answer does not wait for Redis to record the clear."""
        _, keyed = self._keyed(s, r.model)
        ns = s.tenant.namespace
        removed = len(keyed.clear(ns))
        return P.KvClearResult(removed=removed,
                               l3_cleared=keyed.l3 is None or keyed.names.raised(ns))

    @mutating_async
    async def kv_clear_wait(self, s: Session, r: P.KvClear) -> P.KvClearResult:
        """``kv_clear`` on its own: the answer waits (twice ``l3.op_timeout_ms``, CLEAR_WAIT_S
        at most) for Redis to record it and says whether it did: an engine that clears stale
        KV (new weights) must know when Redis may still hold it readable."""
        res = self.kv_clear(s, r)
        if not res.l3_cleared:
            res.l3_cleared = await self._keyed(s, r.model)[1].names.wait_raised(
                s.tenant.namespace, min(2 * self.config.l3.op_timeout_ms / 1000, CLEAR_WAIT_S))
        return res

    @mutating_async
    async def kv_lookup_fetch(self, s: Session, r: P.KvLookup) -> P.KvLookupResult:
        """``kv_lookup`` with ``fetch``: keys only Redis holds come to host first (a miss when
        Redis is down, slow or holds a bad value), then the lookup."""
        _, keyed = self._keyed(s, r.model)
        if not isinstance(r.timeout_ms, int) or not 0 <= r.timeout_ms <= 600_000:
            raise ServiceError(P.Code.BAD_ARGUMENT,
                               f"timeout_ms must be between 0 and 600000, got {r.timeout_ms!r}")
        timeout = (r.timeout_ms or self.config.l3.prefetch_timeout_ms) / 1000
        keyed.check_lookup(r.pool, r.keys)
        if r.pin:  # refused before Redis is asked: the distinct keys named, at most, are pinned
            keyed.check_pins(s.id, len(set(r.keys)), self.config.server.max_locks_per_session)
        fetched = await keyed.fetch(s.tenant.namespace, r.pool, r.keys, timeout)
        if s.id not in self.sessions:  # the session ended meanwhile: nothing to pin for
            raise ServiceError(P.Code.SHUTTING_DOWN, "the session ended during the fetch")
        res = keyed.lookup(s.id, s.tenant.namespace, r.pool, r.keys, r.pin,
                           self.config.server.max_locks_per_session)
        res.fetched = fetched
        return res

    @staticmethod
    def waits(op: str, req: Any) -> bool:
        """Whether a (top-level) request runs as a task that may wait (a copy, Redis)."""
        return op in Service.ASYNC_HANDLERS and (op != "kv_lookup" or req.fetch)

    ASYNC_HANDLERS = {"load": load, "prefetch": prefetch, "kv_lookup": kv_lookup_fetch,
                      "kv_clear": kv_clear_wait}
    #: operations whose response carries file descriptors (SCM_RIGHTS)
    FD_HANDLERS = {"attach": attach, "kv_attach": kv_attach}

    HANDLERS = {
        "ping": ping, "match": match, "lock": lock, "unlock": unlock, "release_swa": release_swa,
        "alloc": alloc, "free": free, "insert": insert, "cache_unfinished": cache_unfinished,
        "cache_finished": cache_finished, "evict": evict, "stats": stats,
        "kv_lookup": kv_lookup, "kv_reserve": kv_reserve, "kv_commit": kv_commit,
        "kv_release": kv_release, "kv_clear": kv_clear,
    }

    def compact_cold(self) -> int:
        """One step of idle work: the page ids of at most one cold node per model go to their
        compact form (design.md, the tree's page ids). Returns the nodes compacted."""
        return sum(entry.cache.tree.compact_cold() for entry in self.models.values())

    def close(self) -> None:
        for s in list(self.sessions.values()):
            self.close_session(s)
        for entry in self.models.values():
            if entry.tiers is not None and (entry.tiers.copying or entry.tiers.stuck):
                # a copy outlived the drain: leave the memory mapped, the process is ending
                log.warning("%s: %d copies still running at shutdown; pools left mapped",
                            entry.name, max(entry.tiers.copying, entry.tiers.stuck))
                continue
            if entry.tiers is not None:
                entry.tiers.host.close()
            if entry.pools is not None:
                entry.pools.close()


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
        return code, str(exc), dict(getattr(exc, "details", None) or {})
    return P.Code.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", {}
