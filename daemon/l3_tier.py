"""L3 (Redis) of one model at run time: the writer that sends host pages to Redis and the
prefetch that brings pages only Redis holds back into host.

:class:`daemon.tiers.TierManager` composes one (``TierManager.l3tier``) beside its host copies:
it queues a node here once the node's pages are on host (``write_through``) or as host drops them
(``write_back``). Full-pool pages travel as runs of a hash block (:mod:`daemon.l3_runs`), SWA
pages one value each. Everything that touches Redis is fail-soft: a miss, never an error to the
engine (the :class:`RedisTier` bounds every call and trips a breaker).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from radixd_client import protocol as P

from .l3_runs import (
    block_ends,
    node_runs,
    node_window,
    run_pages,
    tail_candidates,
    window_pages,
)
from .model_cache import ModelCache
from .storage.codec import encode_page
from .storage.copies import in_thread
from .storage.host_tier import HostTier
from .storage.l3_ledger import L3Ledger
from .storage.redis_tier import RedisTier
from .tier_jobs import FetchJob, begin_fetch, finish_fetch, reserve_host
from .tree import Node

log = logging.getLogger("radixd.tiers")

#: (pool kind, namespace, held host slots (none once encoded), L3 id, tokens, encoded value)
L3Write = tuple[str, str, tuple[int, ...], bytes, bytes, "bytes | None"]

#: Most pages one L3 write batch carries (bounds the bytes encoded at once); a run of a block's
#: pages is never split, so a batch holds at least one value.
L3_WRITE_BATCH = 256
#: How often the L3 writer looks for host pages the tree dropped without the tiers being told
#: (an evict of host pages from outside the tiers); every reuse of a host slot looks first anyway.
HOST_DROPS_POLL_S = 0.05
#: Most pages waiting for Redis, at least: each holds its host slot, so a slow Redis must not pin
#: the whole host pool; past the bound the values farthest from the root are lost (counted as L3
#: write failures: L3Tier.queue). The bound is this or a quarter of the host pool, whichever is
#: more: at small pages a burst of inserts is many pages, and the host pool holds many more.
MAX_L3_QUEUE = 16384


class L3Tier:
    """The Redis side of one model's tiers. ``counters`` and ``inflight`` are the
    TierManager's: one set of figures per model, and one set of tasks its drain waits for."""

    def __init__(self, cache: ModelCache, host: HostTier, model_name: str, l3: RedisTier | None,
                 host_quotas: dict[str, int], quotas: dict[str, int],
                 counters: dict[str, int], inflight: set[asyncio.Task]) -> None:
        self.cache = cache
        self.host = host
        self.l3 = l3
        self.fingerprint = cache.profile.layout_fingerprint()
        # The tree's page hashes name a page by namespace, layout and tokens, not by the weights
        # that computed it: two models of one layout (a base model and its fine-tune) would share
        # Redis keys. Keys and stored headers use the hash salted with the model's name, which
        # operators keep equal across daemons for the same weights only.
        self.salt = hashlib.sha256(b"radixd-l3-model\x00" + model_name.encode()).digest()
        self.host_quotas = host_quotas
        self.quotas = quotas
        # L3 byte quota: per namespace, the values this daemon wrote (oldest first) and their sum
        self.ledger = L3Ledger()
        self.counters = counters
        self._inflight = inflight
        self.pending: list[L3Write] = []
        self.queued_pages = 0  # the pages of the values in pending
        # fetches in flight by (namespace, tokens up to the end of the first page they bring)
        self.fetching: dict[tuple[str, bytes], asyncio.Task] = {}
        self.max_queued_pages = max(MAX_L3_QUEUE, host.full.usable // 4)
        self.wake: asyncio.Event | None = None

    def start(self) -> asyncio.Task:
        """Start the writer (on the running loop); the caller owns the task."""
        assert self.l3 is not None
        self.wake = asyncio.Event()
        self.l3.start_probe()  # logs whether Redis answers at start (once per daemon)
        return asyncio.create_task(self.writer(), name="radixd-l3-writer")

    def id_of(self, page_hash: bytes) -> bytes:
        """The page's name in L3: its page key salted with the model's identity."""
        return hashlib.sha256(self.salt + page_hash).digest()

    def queue(self, node: Node, full_slots: Sequence[int], swa_slots: Sequence[int] | None,
              snapshot: bool = False) -> None:
        """Queue a node's host pages for Redis: its full pages as runs and its SWA window
        (``swa_slots``, 0 or None for none) as one value (l3_runs), holding the slots until they
        are encoded (or, with ``snapshot``, encoding them now: slots about to be freed must free at
        once, or the eviction that freed them would not make room)."""
        ns = node.ns.name
        pb = self.cache.tree.page_bytes
        runs, missed = node_runs(self.cache.tree, node, full_slots)
        self.counters["l3_write_skipped"] += missed
        items = [("full", r) for r in runs]
        window = node_window(node, swa_slots, pb)
        if window is not None:
            items.append(("swa", window))
        named = sorted({r.last for _, r in items})
        # from the node's tokens: a digest for each value's key, not one for every page
        key = dict(zip(named, self.cache.tree.page_keys([node], named), strict=True))
        for i, (kind, run) in enumerate(items):
            slots, toks = run.slots, run.tokens
            if not snapshot and self.pending \
                    and self.queued_pages + len(toks) // pb > self.max_queued_pages:
                # full, under write-through, which queues a path root first: this value and the
                # node's rest are refused, the path's beginning kept (see below)
                self.counters["l3_write_failures"] += len(items) - i
                break
            l3_id = self.id_of(key[run.last])
            if snapshot:  # the slots are being freed: take their bytes now
                pool = self.host.pool(kind)
                value = encode_page(pool=kind, page_hash=l3_id, fingerprint=self.fingerprint,
                                    tokens=toks, payload=[pool.page_bytes(s) for s in slots])
                self.pending.append((kind, ns, (), l3_id, toks, value))
                self.queued_pages += len(toks) // pb
                continue
            held = self.host.hold(kind, slots)
            if len(held) < len(slots):  # a slot not readable (being filled): not written
                if held:
                    self.host.unhold(kind, held)
                self.counters["l3_write_skipped"] += 1
                continue
            self.pending.append((kind, ns, slots, l3_id, toks, None))
            self.queued_pages += len(toks) // pb
        # A value is read only after every value before it on its path (a prefetch stops at the
        # first miss), so a full queue loses a path's deepest values, never its beginning: under
        # write-through the newest (refused above); under write_back the oldest, since a host
        # eviction drops a parent only after its children, which were queued first
        while snapshot and self.queued_pages > self.max_queued_pages and len(self.pending) > 1:
            kind, _, slots, _, toks, _ = self.pending.pop(0)
            if slots:
                self.host.unhold(kind, slots)
            self.queued_pages -= len(toks) // pb
            self.counters["l3_write_failures"] += 1
        if self.wake is not None:
            self.wake.set()

    def host_dropped(self, nodes: list[Node]) -> None:
        """L3 write_back: host-only pages left host (their slots are free, not yet reused); send
        them to Redis first."""
        for node in nodes:
            self.queue(node, node.host, node.host_swa, snapshot=True)  # type: ignore[arg-type]

    async def writer(self) -> None:
        assert self.wake is not None and self.l3 is not None
        while True:
            # host pages dropped outside the tiers (an admin evict) are noticed here too
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), HOST_DROPS_POLL_S)
            self.wake.clear()
            self.cache.flush_host_drops()
            while self.pending:
                batch = self.take_batch()
                task = asyncio.current_task()
                if task is not None:
                    self._inflight.add(task)
                try:
                    values = await in_thread(self._encode, batch)
                finally:
                    for kind, _, slots, _, _, _ in batch:
                        if slots:
                            self.host.unhold(kind, slots)
                try:
                    await self._store(batch, values)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("L3 write failed")
                finally:
                    if task is not None:
                        self._inflight.discard(task)

    def drop_pending(self) -> None:
        """Give back the slots of the values still queued, unwritten (a stop, once the writer
        has ended)."""
        for kind, _, slots, *_ in self.pending:
            if slots:
                self.host.unhold(kind, slots)
        self.pending.clear()
        self.queued_pages = 0

    def take_batch(self) -> list[L3Write]:
        """The oldest queued values, up to L3_WRITE_BATCH pages (at least one value)."""
        pb = self.cache.tree.page_bytes
        pages = 0
        n = 0
        for *_, toks, _ in self.pending:
            if n and pages + len(toks) // pb > L3_WRITE_BATCH:
                break
            pages += len(toks) // pb
            n += 1
        batch = self.pending[:n]
        del self.pending[:n]
        self.queued_pages -= pages
        return batch

    def _encode(self, batch: list[L3Write]) -> list[bytes]:
        """Runs in a worker thread: the slots are held, so their bytes cannot change."""
        return [value if value is not None else
                encode_page(pool=kind, page_hash=h, fingerprint=self.fingerprint, tokens=toks,
                            payload=[self.host.pool(kind).page_bytes(s) for s in slots])
                for kind, _, slots, h, toks, value in batch]

    async def _store(self, batch: list[L3Write], values: list[bytes]) -> None:
        assert self.l3 is not None
        stored = await self.l3.set_pages_each(values)
        self.counters["l3_write_values"] += stored.count(True)
        self.counters["l3_write_failures"] += len(values) - stored.count(True)
        done = [w for w, ok in zip(batch, stored, strict=True) if ok]
        self.counters["l3_write_pages"] += sum(len(t) for *_, t, _ in done) \
            // self.cache.tree.page_bytes
        await self.charge([(ns, h, kind, len(v)) for (kind, ns, _, h, _, _), v, ok
                           in zip(batch, values, stored, strict=True) if ok is not False])

    async def charge(self, values: list[tuple[str, bytes, str, int]]) -> int:
        """Count values just written to Redis (or that it may hold: a write failed once sent),
        ``(namespace, Redis page id, pool, bytes)``, against their namespace's
        ``quota_l3_bytes``; over it, delete the namespace's least recently written values and
        count them. One ledger per namespace for the tree's pages and the keyed store's (which
        calls this too), so a tenant's quota bounds both together. Values whose delete Redis
        does not answer stay counted, the oldest, and go at the next charge. Returns how many
        values were deleted."""
        assert self.l3 is not None
        over: dict[tuple[str, str], list[tuple[bytes, int]]] = {}
        for ns, h, kind, nbytes in values:
            for old, old_kind, old_bytes in self.ledger.charge(ns, h, kind, nbytes,
                                                                  self.quotas.get(ns, 0)):
                over.setdefault((ns, old_kind), []).append((old, old_bytes))
        deleted = 0
        for (ns, kind), gone in over.items():
            if await self.l3.unlink([h for h, _ in gone], kind) is None:
                self.ledger.give_back(ns, [(h, kind, n) for h, n in gone])
            else:
                deleted += len(gone)
        self.counters["l3_quota_deleted_pages"] += deleted
        return deleted

    # ------------------------------------------------------------------ prefetch (L3 -> L2)

    async def prefetch(self, namespace: str, tokens: bytes, policy: str, timeout_s: float
                       ) -> P.PrefetchResult:
        if self.l3 is None:
            return P.PrefetchResult(status="unavailable", l3_hit_len=0, fetched_len=0)
        self.counters["prefetches"] += 1
        job = begin_fetch(self.cache, namespace, tokens)
        if job.start >= job.pages:
            finish_fetch(self.cache, namespace, tokens, job, job.start)
            return P.PrefetchResult(status="none", l3_hit_len=0, fetched_len=0)
        known: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._fetch(namespace, tokens, job, known))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        task.add_done_callback(functools.partial(self._unstarted, namespace, tokens, job, known))
        P_ = self.cache.profile.page_size
        if policy == "best_effort":
            hit = await asyncio.shield(known)
            return P.PrefetchResult(status="started" if hit else "none", l3_hit_len=hit * P_,
                                    fetched_len=0)
        try:
            if policy == "wait_complete":
                got = await asyncio.shield(task)
            else:
                got = await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except asyncio.TimeoutError:
            self.counters["prefetch_timeouts"] += 1
            hit = known.result() if known.done() else 0
            return P.PrefetchResult(status="timeout", l3_hit_len=hit * P_, fetched_len=0)
        hit = known.result() if known.done() else 0
        return P.PrefetchResult(status="complete" if hit else "none", l3_hit_len=hit * P_,
                                fetched_len=got * P_)

    def _unstarted(self, namespace: str, tokens: bytes, job: FetchJob,
                   known: asyncio.Future[int], task: asyncio.Task) -> None:
        """A fetch cancelled (by a stop) before its first step never ran a line of its own, so
        neither its cleanup: unpin here, and answer the prefetch waiting on ``known``. (Once
        started, a fetch sets ``known`` whatever way it ends.)"""
        if task.cancelled() and not known.done():
            finish_fetch(self.cache, namespace, tokens, job, job.start)
            known.set_result(0)

    async def _fetch(self, namespace: str, tokens: bytes, job: FetchJob,
                     known: asyncio.Future[int]) -> int:
        """The whole fetch; sets ``known`` to the pages L3 holds once that is known. Returns
        pages attached to the tree. Every path ends in finish_fetch (unpin, slots back; for a
        fetch cancelled before it started, :meth:`_unstarted` does it).

        A fetch whose first page another fetch in flight brings too (engines asking for one
        shared prefix at once) waits for that one, then fetches what is still missing past the
        longer host prefix: the pages are read from Redis, and room made for them, once. The
        pages the one ahead attached count as this fetch's, in ``known`` and in what it
        returns."""
        me = asyncio.current_task()
        pb = self.cache.tree.page_bytes
        key = (namespace, tokens[: (job.start + 1) * pb])
        brought = 0  # pages the fetches this one waited for attached, from its start
        try:
            while (ahead := self.fetching.get(key)) not in (None, me):
                finish_fetch(self.cache, namespace, tokens, job, job.start)  # unpinned
                await asyncio.wait((ahead,))
                if not ahead.cancelled() and ahead.exception() is None:
                    brought += ahead.result()
                job = begin_fetch(self.cache, namespace, tokens)
                if job.start >= job.pages:
                    finish_fetch(self.cache, namespace, tokens, job, job.start)
                    return brought
                key = (namespace, tokens[: (job.start + 1) * pb])
            if me is not None:
                self.fetching[key] = me
            end = job.start
            try:
                end = await self._fetch_pages(namespace, tokens, job, known, brought)
            except asyncio.CancelledError:  # shutdown: unpin, and the slots go back
                finish_fetch(self.cache, namespace, tokens, job, job.start)
                raise
            except Exception:
                log.exception("L3 fetch failed")
                for kind, slots in (("full", job.full_slots), ("swa", job.swa_slots)):
                    self.host.drop(kind, slots.values(), namespace)
                    slots.clear()
                end = job.start
            finally:
                if self.fetching.get(key) is me:
                    del self.fetching[key]
        finally:
            if not known.done():
                known.set_result(brought)
        got = finish_fetch(self.cache, namespace, tokens, job, end)
        self.counters["prefetch_pages"] += got
        return brought + got

    async def _runs_present(self, ids: Callable[[Iterable[int]], list[bytes]], pages: int,
                            start: int) -> list[int]:
        """The last pages of the runs L3 holds from page ``start`` on (of ``pages``, named by
        ``ids``), in order and contiguous: whole blocks by one EXISTS each, then the longest
        shorter run of the next block."""
        l3 = self.l3
        assert l3 is not None
        B = self.cache.tree.block_pages
        ends = block_ends(start, pages, B)
        have = await l3.exists_prefix(ids(ends), "full")
        lasts = ends[:have]
        tail = tail_candidates(lasts[-1] + 1 if lasts else start // B * B, start, pages, B)
        if tail:
            there = await l3.exists_each(ids(tail), "full")
            lasts += [j for j, ok in zip(tail, there, strict=True) if ok][-1:]
        return lasts

    async def _read_window(self, ids: Callable[[Iterable[int]], list[bytes]], tokens: bytes,
                           lo: int, end: int) -> list[memoryview] | None:
        """The SWA pages [lo, end) from the window values that end at ``end`` and, where a node
        was shorter than the window, at its parent's end below; None when one is missing or is
        not the window its key names (that one is deleted as stale)."""
        l3 = self.l3
        assert l3 is not None and self.host.swa is not None
        pb = self.cache.tree.page_bytes
        out: list[memoryview] = []
        at = end
        while at > lo:
            (v,) = await l3.get_pages(ids((at - 1,)), "swa", self.fingerprint)
            got = None if v is None else window_pages(tokens, v.payload, v.tokens, at, pb,
                                                      self.host.swa.page_nbytes)
            if got is None:
                if v is not None:
                    await l3.delete_stale(ids((at - 1,)), "swa")
                return None
            first, pages = got
            out[:0] = pages[max(lo, first) - first :]
            at = first
        return out

    async def _fetch_pages(self, namespace: str, tokens: bytes, job: FetchJob,
                           known: asyncio.Future[int], brought: int = 0) -> int:
        """Fetch from page ``job.start`` on; sets ``known`` to ``brought`` (the pages fetches
        this one waited for attached) plus what L3 holds past it, once that is known. Returns
        the end of what was written to host slots."""
        l3 = self.l3
        assert l3 is not None
        tree = self.cache.tree
        start = job.start
        named: dict[int, bytes] = {}  # page index -> its L3 id (full and SWA keys share it)

        def ids(which: Iterable[int]) -> list[bytes]:
            which = list(which)
            new = sorted({j for j in which if j not in named})
            if new:
                named.update(zip(new, map(self.id_of, job.page_keys(new)), strict=True))
            return [named[j] for j in which]

        lasts = await self._runs_present(ids, job.pages, start)
        end = lasts[-1] + 1 if lasts else start
        swa = tree.swa_enabled
        wp = tree.window_pages
        # With SWA a prefix may end only where a window value ends (a cached node's end). The
        # last run's end is asked first, and every page only when it has none (a node may have
        # ended anywhere, also inside a block L3 holds whole), or when a window read fails.
        rings = iter(([lasts[-1]] if lasts else [], range(start, end)))
        probed: dict[int, bool] = {}  # page -> whether a window value ends with it

        async def window_below(limit: int) -> tuple[int, list[memoryview]]:
            """The largest end <= limit whose window L3 holds whole, and the window's pages
            (from ``start`` at the lowest); (start, []) when there is none."""
            while True:
                ends = [j + 1 for j in sorted(probed, reverse=True) if probed[j] and j < limit]
                for e in ends:
                    got = await self._read_window(ids, tokens, max(start, e - wp), e)
                    if got is not None:
                        return e, got
                    limit = e - 1
                ring = next(rings, None)
                if ring is None:
                    return start, []
                ask = [j for j in ring if j < limit and j not in probed]
                if ask:
                    probed.update(zip(ask, await l3.exists_each(ids(ask), "swa"), strict=True))

        window: list[memoryview] = []
        if swa:
            end, window = await window_below(end) if self.host.swa is not None else (start, [])
        known.set_result(brought + end - start)
        if end <= start:
            return start
        ns = tree.namespace(namespace)
        quota = self.host_quotas.get(namespace, 0)
        full_slots = reserve_host(self.cache, ns, "full", end - start, quota)
        if full_slots is None:  # what the host pool can take, if it still ends on a window
            room = min(end - 1, start + self.host.available_to("full", namespace))
            end, window = await window_below(room) if swa else (room, [])
            full_slots = (reserve_host(self.cache, ns, "full", end - start, quota)
                          if end > start else None)
            if full_slots is None:
                self.counters["prefetch_no_room"] += 1
                return start
        job.full_slots = {start + i: s for i, s in enumerate(full_slots)}
        pb = tree.page_bytes
        B = tree.block_pages
        lasts = [j for j in lasts if j // B * B < end]  # the runs that reach below end
        full_vals = await l3.get_pages(ids(lasts), "full", self.fingerprint)
        pages: dict[int, memoryview] = {}  # page index -> its bytes in a verified run
        for last, v in zip(lasts, full_vals, strict=True):
            first = last // B * B
            got = None if v is None else run_pages(tokens, v.payload, v.tokens, first, last, pb,
                                                   self.host.full.page_nbytes)
            if got is None:
                if v is not None:  # verified, named right, yet not this run: never usable
                    await l3.delete_stale(ids((last,)), "full")
                break
            pages.update((first + i, page) for i, page in enumerate(got) if first + i >= start)
        good = start
        while good < end and good in pages:
            good += 1
        if swa and good < end:  # a run failed: the largest end below it with a whole window
            good, window = await window_below(good)
        swa_lo = good - len(window)
        if window:
            swa_slots = reserve_host(self.cache, ns, "swa", len(window))
            if swa_slots is None:
                return start
            job.swa_slots = {swa_lo + i: s for i, s in enumerate(swa_slots)}
        writes: list[tuple[Any, int, memoryview]] = []
        for i in range(start, end):
            if i < good:
                writes.append((self.host.full, job.full_slots[i], pages[i]))
            else:
                self.host.drop("full", (job.full_slots.pop(i),), namespace)
        writes += ((self.host.swa, job.swa_slots[swa_lo + i], page)
                   for i, page in enumerate(window))
        if writes:
            await in_thread(_write_slots, writes)
        self.counters["l3_hit_pages"] += good - start
        return good


def _write_slots(writes: list[tuple[Any, int, memoryview]]) -> None:
    for pool, slot, payload in writes:
        pool.write_page_bytes(slot, payload)
