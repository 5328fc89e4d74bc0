"""The memory tiers of one model at run time: host (L2) backups, loads back to device, and the L3
(Redis) writer and fetcher.

It composes the model's :class:`ModelCache` with its :class:`HostTier` and the daemon's shared
:class:`RedisTier`, and runs the copies off the event loop (a copy thread on CPU, a copy stream on
CUDA, :func:`daemon.storage.copies.run_copy`). The synchronous halves of each copy (which pages,
which slots, how the result lands in the tree) are in :mod:`daemon.tier_jobs`.

Write policies (``[[models]] write_policy``):

* ``write_through``: every node handed to the tree is copied to host in the background;
* ``write_through_selective``: a node is copied once a match or insert has used it
  ``write_through_threshold`` times;
* ``write_back``: a node is copied when eviction takes its device copy (the only way to demote
  instead of delete without holding device pages longer). Eviction is two-phase
  (:mod:`daemon.tree.eviction`): the tree names the node and stops, this layer copies it (on the
  caller's thread: an ``alloc`` cannot wait for the loop), the tree commits. The tree never calls
  back into this layer.

L3 (``[l3] write_policy``): pages reach Redis when they reach host (``write_through``) or when the
host tier drops them (``write_back``). Everything that touches Redis is fail-soft: a miss, never an
error to the engine (the :class:`RedisTier` bounds every call and trips a breaker).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from radixd_client import protocol as P

from .config import L3Config, ModelConfig
from .gpu.allocator import OutOfPages
from .model_cache import ModelCache
from .storage.codec import encode_page
from .storage.copies import CopyInFlight, CopyPlan, host_to_device, plan_device_to_host, run_plans
from .storage.host_tier import HostTier
from .storage.l3_ledger import L3Ledger
from .storage.redis_tier import RedisTier
from .tier_jobs import (
    BackupJob,
    FetchJob,
    begin_backup,
    begin_fetch,
    begin_load,
    finish_backup,
    finish_fetch,
    finish_load,
    plan_backup,
    reserve_host,
    watch_backup,
)
from .tree import Node

log = logging.getLogger("radixd.tiers")

L3Write = tuple[str, str, int, bytes, bytes, "bytes | None"]

#: Most pages one L3 write batch carries (bounds the bytes encoded at once).
L3_WRITE_BATCH = 256
#: Nodes one background copy job takes: bounds what an eviction reaching one of them waits for.
BACKUP_BATCH_NODES = 64
#: How long the backup worker lets inserts accumulate before it plans a copy job (unless a
#: whole batch is already waiting): one job, one thread hand-off and one completion wake-up per
#: interval instead of per insert. Write-through needs no promptness (eviction of a node not
#: copied yet copies it itself), while per-insert jobs cost the loop more than the copies.
BACKUP_COALESCE_S = 0.005
#: On CPU, a job of at most this many bytes is copied on the loop at once: a copy this small
#: takes less time than handing it to the copy thread and back (two wake-ups and GIL hand-offs
#: that the requests in flight pay for), and needs no device-page watch.
INLINE_COPY_BYTES = 256 << 10
#: Most nodes waiting for a host copy: past it the oldest requests are dropped (counted as
#: skipped); a backlog that long means the copies cannot keep up and older ones matter least.
MAX_BACKUP_BACKLOG = 65536
#: How often the L3 writer looks for host pages the tree dropped without the tiers being told
#: (an evict of host pages from outside the tiers); every reuse of a host slot looks first anyway.
HOST_DROPS_POLL_S = 0.05
#: Most pages waiting for Redis. Each holds its host slot, so a slow Redis must not pin the
#: whole host pool: past it the oldest writes are dropped (counted as L3 write failures).
MAX_L3_QUEUE = 16384


async def _copy(copy: CopyInFlight) -> None:
    """Await a copy so that a cancellation cannot abandon it halfway: the pages it writes must
    not be reused (or the pools closed) while a thread or a stream still writes them."""
    fut = asyncio.ensure_future(copy.done())
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        raise


def _plan_out(dev_full: Any, dev_swa: Any, host: HostTier, job: BackupJob) -> list[CopyPlan]:
    """The copies of a backup job, validated and laid out on the calling thread (the loop)."""
    plans = []
    if job.dev_full:
        plans.append(plan_device_to_host(dev_full, job.dev_full, host.full, job.host_full))
    if job.dev_swa:
        plans.append(plan_device_to_host(dev_swa, job.dev_swa, host.swa,  # type: ignore[arg-type]
                                         job.host_swa))
    return plans


def _copy_in(dev_full: Any, dev_swa: Any, host: HostTier, slots_full: list[int],
             pages_full: array, slots_swa: list[int], pages_swa: array) -> None:
    if pages_full:
        host_to_device(host.full, slots_full, dev_full, pages_full)
    if pages_swa:
        host_to_device(host.swa, slots_swa, dev_swa, pages_swa)  # type: ignore[arg-type]


class TierManager:
    """L2 (and L3 when configured) of one model."""

    def __init__(self, cache: ModelCache, pools: Any, host: HostTier, mc: ModelConfig,
                 l3: RedisTier | None, l3cfg: L3Config, host_quotas: dict[str, int],
                 l3_quotas: dict[str, int]) -> None:
        self.cache = cache
        self.pools = pools
        self.profile = cache.profile
        self.fingerprint = self.profile.layout_fingerprint()
        # The tree's page hashes name a page by namespace, layout and tokens, not by the weights
        # that computed it: two models of one layout (a base model and its fine-tune) would share
        # Redis keys. Keys and stored headers use the hash salted with the model's name, which
        # operators keep equal across daemons for the same weights only.
        self._l3_salt = hashlib.sha256(b"radixd-l3-model\x00" + mc.name.encode()).digest()
        self.host = host
        cache.host = self.host
        cache.tree.host_sink = self.host
        self.write_policy = mc.write_policy
        self.threshold = mc.write_through_threshold
        self.l3 = l3
        self.l3cfg = l3cfg
        self.host_quotas = host_quotas
        self.l3_quotas = l3_quotas
        # L3 byte quota: per namespace, the pages this daemon wrote (oldest first) and their sum
        self.l3_ledger = L3Ledger()
        # phase 1 of two-phase eviction: which nodes the tree names for a copy before they go
        cache.tree.host_copy_hits = self.threshold if \
            self.write_policy == "write_through_selective" else 0
        cache.copy_to_host = self._demote
        if l3 is not None and l3cfg.write_policy == "write_back":
            cache.tree.report_host_drops = True
            cache.read_host_drops = self._host_dropped
        self._backlog: list[Node] = []
        self._owed: set[int] = set()  # ids of the nodes in _backlog: their copy is still owed
        # (pool kind, namespace, held host slot or 0, L3 page id, tokens, encoded value or None)
        self._l3_queue: list[L3Write] = []
        self._tasks: list[asyncio.Task] = []
        self._wake_backup: asyncio.Event | None = None
        self._wake_l3: asyncio.Event | None = None
        self._inflight: set[asyncio.Task] = set()
        self.copying = 0  # copies running in a thread or on a stream (the pools must stay open)
        self._running: tuple[BackupJob, CopyInFlight] | None = None  # the background copy
        self.counters = dict.fromkeys((
            "backups", "backup_pages", "backup_skipped", "demoted_sync_pages", "evictions_waited",
            "loads", "loaded_tokens", "load_pages", "load_failures",
            "prefetches", "prefetch_pages", "prefetch_timeouts", "prefetch_no_room",
            "l3_hit_pages", "l3_write_pages", "l3_write_failures", "l3_quota_deleted_pages",
            "copy_errors"), 0)
        self.copy_seconds = {"to_host": 0.0, "to_device": 0.0}
        self.copy_bytes = {"to_host": 0, "to_device": 0}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the background workers (on the running loop)."""
        self._wake_backup = asyncio.Event()
        self._wake_l3 = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._backup_worker(), name="radixd-backup"))
        if self.l3 is not None:
            self.l3.start_probe()  # logs whether Redis answers at start (once per daemon)
            self._tasks.append(asyncio.create_task(self._l3_writer(), name="radixd-l3-writer"))

    async def drain(self, deadline: float, back_up_device: bool = False) -> int:
        """Finish queued backups and L3 writes by ``deadline`` (time.monotonic(); shutdown).
        Under L3 write_back, host pages not yet in Redis are written first: they would be lost
        with the process. With ``back_up_device`` (a warm restart follows: only host outlives the
        process), device-only tree nodes are copied to host as room and quotas allow, whatever
        the write policy. Returns the host pages the tree gained while draining."""
        owed: Iterator[Node] = iter(())
        if self.l3 is not None and self.l3cfg.write_policy == "write_back":
            owed = (n for n in list(self.cache.tree.iter_nodes())
                    if n.parent is not None and n.host is not None)
        device_only: Iterator[Node] = iter(())
        if back_up_device:
            device_only = (n for n in list(self.cache.tree.iter_nodes())
                           if n.parent is not None and n.full is not None and n.host is None)
        host_before = self.cache.tree.host_pages
        self.cache.flush_host_drops()
        pending = backing = True
        while (pending or backing or self._backlog or self._l3_queue or self._inflight) and \
                time.monotonic() < deadline:
            while backing and len(self._backlog) < 4 * BACKUP_BATCH_NODES:
                node = next(device_only, None)
                if node is None:
                    backing = False
                elif node.id not in self._owed:
                    self._backlog.append(node)
                    self._owed.add(node.id)
            while pending and len(self._l3_queue) < 4 * L3_WRITE_BATCH:  # a bounded queue
                node = next(owed, None)
                if node is None:
                    pending = False
                elif node.host is not None and self.cache.tree.nodes.get(node.id) is node:
                    swa = node.host_swa if node.host_swa is not None else \
                        array("i", bytes(4 * len(node.host)))
                    self._queue_l3(node, node.host, swa)
            for ev in (self._wake_backup, self._wake_l3):
                if ev is not None:
                    ev.set()
            await asyncio.sleep(0.01)
        return self.cache.tree.host_pages - host_before

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()

    # ------------------------------------------------------------------ write policies

    def used(self, node_id: int, inserted: bool) -> None:
        """A match or insert ended at ``node_id``: schedule its host copy if the policy says."""
        if self.write_policy == "write_back":
            return
        node = self.cache.tree.nodes.get(node_id)
        if node is None or node.parent is None or node.full is None or node.host is not None:
            return
        if self.write_policy == "write_through" and not inserted:
            return
        if self.write_policy == "write_through_selective" and node.hits < self.threshold:
            return
        if node.id in self._owed:  # queued already (its copy takes its ancestors along)
            return
        self._backlog.append(node)
        self._owed.add(node.id)
        if len(self._backlog) > MAX_BACKUP_BACKLOG:
            drop = len(self._backlog) - MAX_BACKUP_BACKLOG
            self._owed.difference_update(n.id for n in self._backlog[:drop])
            del self._backlog[:drop]
            self.counters["backup_skipped"] += drop
        if self._wake_backup is not None:
            self._wake_backup.set()

    async def _backup_worker(self) -> None:
        assert self._wake_backup is not None
        while True:
            await self._wake_backup.wait()
            if len(self._backlog) < BACKUP_BATCH_NODES:
                await asyncio.sleep(BACKUP_COALESCE_S)  # let the next inserts join this job
            self._wake_backup.clear()
            while self._backlog:
                # bounded jobs: an eviction may have to wait for the running one
                nodes = self._backlog[:BACKUP_BATCH_NODES]
                del self._backlog[:BACKUP_BATCH_NODES]
                self._owed.difference_update(n.id for n in nodes)
                try:
                    await self._backup(nodes)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a daemon bug: the job already cleaned up after itself
                    log.exception("host backup failed")

    def _job_bytes(self, job: BackupJob) -> int:
        swa = self.host.swa.page_nbytes if self.host.swa is not None else 0
        return len(job.host_full) * self.host.full.page_nbytes + len(job.host_swa) * swa

    async def _backup(self, nodes: list[Node]) -> None:
        job = begin_backup(self.cache, nodes, self.host_quotas)
        self.counters["backup_skipped"] += len(nodes) - len(job.records)
        if not job.records:
            return
        t0 = time.perf_counter()
        if self.pools.device.type == "cpu" and self._job_bytes(job) <= INLINE_COPY_BYTES:
            # begin, copy and finish in one step of the loop: nothing can free a page under it
            ok = self._copy_now(job, "device-to-host copy failed")
        else:
            ok = await self._copy_off_loop(job)
        self.copy_seconds["to_host"] += time.perf_counter() - t0
        self.copy_bytes["to_host"] += len(job.host_full) * self.host.full.page_nbytes
        if not job.finished:  # (an eviction may have finished it already: _finish_running)
            self._finish_backup(job, ok)

    async def _copy_off_loop(self, job: BackupJob) -> bool:
        """Copy ``job`` on the copy thread (or stream), its device pages watched meanwhile;
        False when the copy raised."""
        watch_backup(self.cache, job)
        ok = True
        task = asyncio.current_task()
        if task is not None:
            self._inflight.add(task)
        self.copying += 1
        try:
            copy = CopyInFlight(run_plans, *_plan_out(self.pools.full, self.pools.swa,
                                                      self.host, job))
            self._running = (job, copy)
            await _copy(copy)
        except Exception:
            ok = False
            self.counters["copy_errors"] += 1
            log.exception("device-to-host copy failed")
        finally:
            self._running = None
            self.copying -= 1
            if task is not None:
                self._inflight.discard(task)
        return ok

    def _finish_backup(self, job: BackupJob, ok: bool) -> None:
        job.finished = True
        done = finish_backup(self.cache, job, ok)
        self.counters["backups"] += len(job.records)
        self.counters["backup_pages"] += sum(len(fs) for _, fs, _ in done)
        if self.l3 is not None and self.l3cfg.write_policy == "write_through":
            for node, fs, ss in done:
                self._queue_l3(node, fs, ss)

    def _finish_running(self, node: Node) -> None:
        """Eviction reached a node the running background copy is copying: wait for that copy
        (a bounded job) and give its nodes their host copies now, so this one is demoted."""
        running = self._running
        if running is None or node.full is None:
            return
        job, copy = running
        if job.finished or job.watch is None or not any(p in job.watch.full for p in node.full):
            return
        ok = True
        try:
            copy.wait()
        except Exception:
            ok = False
            self.counters["copy_errors"] += 1
            log.exception("device-to-host copy failed")
        self.counters["evictions_waited"] += 1
        self._finish_backup(job, ok)

    def _demote(self, node: Node) -> None:
        """Phase 2 of an eviction: the tree named a node that is losing its device copy without
        a host copy; copy it (and the ancestors it needs) to host now, so the commit demotes it
        instead of deleting it.

        Which nodes the tree names is ``host_copy_hits``: every node without a host copy under
        write_back and write_through (0: the background copier's job, overtaken by eviction),
        only those hit often enough under write_through_selective. A node the running
        background copy is copying is waited for rather than copied twice.

        Under ``write_through`` a node without a host copy is still owed one (in the backlog:
        copied here) or its copy was skipped (no room, quota, overflow): not retried here, inside
        the evicting request, at other host pages' cost; it is deleted as without a host tier.
        (Under write_through_selective, a node past its threshold may never have been queued.)"""
        self._finish_running(node)
        if node.host is not None:
            return
        if self.write_policy == "write_through" and node.id not in self._owed:
            return  # its background copy was skipped: deleted, as without a host tier
        job = BackupJob()
        rec = plan_backup(self.cache, node, set(), self.host_quotas.get(node.ns.name, 0), job)
        if rec is None:
            self.counters["backup_skipped"] += 1
            return
        job.records.append(rec)
        ok = self._copy_now(job, "device-to-host copy failed (write_back)")
        done = finish_backup(self.cache, job, ok)
        self.counters["demoted_sync_pages"] += sum(len(fs) for _, fs, _ in done)
        if self.l3 is not None and self.l3cfg.write_policy == "write_through":
            for n, fs, ss in done:
                self._queue_l3(n, fs, ss)

    def _copy_now(self, job: BackupJob, failure: str) -> bool:
        """Copy ``job`` to host on the calling thread, done when this returns; False (counted
        and logged as ``failure``) when the copy raised."""
        try:
            run_plans(*_plan_out(self.pools.full, self.pools.swa, self.host, job))
            if self.pools.device.type == "cuda":
                import torch

                torch.cuda.synchronize(self.pools.device)
        except Exception:
            self.counters["copy_errors"] += 1
            log.exception(failure)
            return False
        return True

    # ------------------------------------------------------------------ load (L2 -> L1)

    async def load(self, namespace: str, tokens: bytes,
                   admit: Callable[[int, int], None] | None = None) -> int:
        """Copy what host holds of ``tokens``' path back to device; returns the usable device
        prefix (tokens) before the load, so the caller's match tells what the load added.

        The caller matches afterwards: the response is built only once the data is on device."""
        cache = self.cache
        probe = cache.tree.match(namespace, tokens)
        try:
            job = begin_load(cache, namespace, tokens, probe.prefix_len, admit)
        except OutOfPages:  # no room on device for the copy: nothing loaded, recompute instead
            self.counters["load_failures"] += 1
            return probe.prefix_len
        if job is None:
            return probe.prefix_len
        self.counters["loads"] += 1
        ok = True
        t0 = time.perf_counter()
        self.copying += 1
        try:
            await _copy(CopyInFlight(_copy_in, self.pools.full, self.pools.swa, self.host,
                                     job.host_full, job.full_pages, job.host_swa, job.swa_pages))
        except Exception:
            ok = False
            self.counters["load_failures"] += 1
            self.counters["copy_errors"] += 1
            log.exception("host-to-device copy failed")
        finally:
            self.copying -= 1
        self.copy_seconds["to_device"] += time.perf_counter() - t0
        self.copy_bytes["to_device"] += len(job.full_pages) * self.host.full.page_nbytes
        loaded = finish_load(cache, namespace, tokens, job, ok)
        self.counters["load_pages"] += loaded
        return probe.prefix_len

    # ------------------------------------------------------------------ L3 write

    def _l3_id(self, page_hash: bytes) -> bytes:
        """The page's name in L3: its page key salted with the model's identity."""
        return hashlib.sha256(self._l3_salt + page_hash).digest()

    def _queue_l3(self, node: Node, full_slots: array, swa_slots: Iterable[int],
                  snapshot: bool = False) -> None:
        """Queue a node's host pages for Redis, holding the slots until they are encoded (or,
        with ``snapshot``, encoding them now: slots about to be freed must free at once, or the
        eviction that freed them would not make room)."""
        ns = node.ns.name
        pb = self.cache.tree.page_bytes
        hashes = [self.host.full.hash_of(s) for s in full_slots]  # indexed by page key already
        if None in hashes:  # pragma: no cover - a tree host copy is always indexed
            hashes = self.cache.tree.page_keys([node])
        for j, (fs, ss) in enumerate(zip(full_slots, swa_slots, strict=True)):
            toks = node.tokens[j * pb : (j + 1) * pb]
            for kind, slot in (("full", fs), ("swa", ss)):
                if not slot:
                    continue
                if snapshot:  # the slot is being freed: take its bytes now
                    value = encode_page(pool=kind, page_hash=self._l3_id(hashes[j]),
                                        fingerprint=self.fingerprint, tokens=toks,
                                        payload=self.host.pool(kind).page_bytes(slot))
                    self._l3_queue.append((kind, ns, 0, self._l3_id(hashes[j]), toks, value))
                elif self.host.hold(kind, (slot,)):
                    self._l3_queue.append((kind, ns, slot, self._l3_id(hashes[j]), toks, None))
        if len(self._l3_queue) > MAX_L3_QUEUE:
            drop = len(self._l3_queue) - MAX_L3_QUEUE
            for kind, _, slot, _, _, _ in self._l3_queue[:drop]:
                if slot:
                    self.host.unhold(kind, (slot,))
            del self._l3_queue[:drop]
            self.counters["l3_write_failures"] += drop
        if self._wake_l3 is not None:
            self._wake_l3.set()

    def _host_dropped(self, nodes: list[Node]) -> None:
        """L3 write_back: host-only pages left host (their slots are free, not yet reused); send
        them to Redis first."""
        for node in nodes:
            swa = node.host_swa if node.host_swa is not None else \
                array("i", bytes(4 * len(node.host)))  # type: ignore[arg-type]
            self._queue_l3(node, node.host, swa, snapshot=True)  # type: ignore[arg-type]

    async def _l3_writer(self) -> None:
        assert self._wake_l3 is not None and self.l3 is not None
        loop = asyncio.get_running_loop()
        while True:
            # host pages dropped outside the tiers (an admin evict) are noticed here too
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake_l3.wait(), HOST_DROPS_POLL_S)
            self._wake_l3.clear()
            self.cache.flush_host_drops()
            while self._l3_queue:
                batch = self._l3_queue[:L3_WRITE_BATCH]
                del self._l3_queue[:L3_WRITE_BATCH]
                task = asyncio.current_task()
                if task is not None:
                    self._inflight.add(task)
                try:
                    values = await loop.run_in_executor(None, self._encode, batch)
                finally:
                    for kind, _, slot, _, _, _ in batch:
                        if slot:
                            self.host.unhold(kind, (slot,))
                try:
                    await self._l3_store(batch, values)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("L3 write failed")
                finally:
                    if task is not None:
                        self._inflight.discard(task)

    def _encode(self, batch: list[L3Write]) -> list[bytes]:
        """Runs in a worker thread: the slots are held, so their bytes cannot change."""
        return [value if value is not None else
                encode_page(pool=kind, page_hash=h, fingerprint=self.fingerprint, tokens=toks,
                            payload=self.host.pool(kind).page_bytes(slot))
                for kind, _, slot, h, toks, value in batch]

    async def _l3_store(self, batch: list[L3Write], values: list[bytes]) -> None:
        assert self.l3 is not None
        before = self.l3.stats["set_failures"]
        written = await self.l3.set_pages(values)
        self.counters["l3_write_pages"] += written
        self.counters["l3_write_failures"] += self.l3.stats["set_failures"] - before
        if written < len(values):
            return  # which ones failed is unknown: count none rather than delete early
        await self.charge_l3([(ns, h, kind, len(v)) for (kind, ns, _, h, _, _), v
                              in zip(batch, values, strict=True)])

    async def charge_l3(self, values: list[tuple[str, bytes, str, int]]) -> int:
        """Count values just written to Redis, ``(namespace, Redis page id, pool, bytes)``,
        against their namespace's ``quota_l3_bytes``; over it, delete the namespace's least
        recently written values and count them. One ledger per namespace for the tree's pages
        and the keyed store's (which calls this too), so a tenant's quota bounds both together.
        Returns how many values were deleted."""
        assert self.l3 is not None
        over: dict[str, list[bytes]] = {"full": [], "swa": []}
        for ns, h, kind, nbytes in values:
            for old, old_kind in self.l3_ledger.charge(ns, h, kind, nbytes,
                                                       self.l3_quotas.get(ns, 0)):
                over[old_kind].append(old)
        for kind, hashes in over.items():
            self.counters["l3_quota_deleted_pages"] += len(hashes)
            if hashes:
                await self.l3.delete(hashes, kind)
        return sum(map(len, over.values()))

    # ------------------------------------------------------------------ prefetch (L3 -> L2)

    async def prefetch(self, namespace: str, tokens: bytes, policy: str, timeout_s: float
                       ) -> P.PrefetchResult:
        if self.l3 is None:
            return P.PrefetchResult(status="unavailable", l3_hit_len=0, fetched_len=0)
        self.counters["prefetches"] += 1
        job = begin_fetch(self.cache, namespace, tokens)
        if job.start >= len(job.hashes):
            finish_fetch(self.cache, namespace, tokens, job, job.start)
            return P.PrefetchResult(status="none", l3_hit_len=0, fetched_len=0)
        known: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._fetch(namespace, tokens, job, known))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        P_ = self.profile.page_size
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

    async def _fetch(self, namespace: str, tokens: bytes, job: FetchJob,
                     known: asyncio.Future[int]) -> int:
        """The whole fetch; sets ``known`` to the pages L3 holds once that is known. Returns
        pages attached to the tree. Every path ends in finish_fetch (unpin, slots back)."""
        end = job.start
        try:
            end = await self._fetch_pages(namespace, tokens, job, known)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("L3 fetch failed")
            for kind, slots in (("full", job.full_slots), ("swa", job.swa_slots)):
                self.host.drop(kind, slots.values())
                slots.clear()
            end = job.start
        finally:
            if not known.done():
                known.set_result(0)
        got = finish_fetch(self.cache, namespace, tokens, job, end)
        self.counters["prefetch_pages"] += got
        return got

    def _window_end(self, start: int, end: int, swa_present: list[bool]) -> int:
        """The largest end <= ``end`` whose SWA window (within [start, end)) L3 holds whole."""
        if not self.cache.tree.swa_enabled:
            return end
        wp = self.cache.tree.window_pages
        for e in range(end, start, -1):
            lo = max(start, e - wp)
            if all(swa_present[i - start] for i in range(lo, e)):
                return e
        return start

    async def _fetch_pages(self, namespace: str, tokens: bytes, job: FetchJob,
                           known: asyncio.Future[int]) -> int:
        l3 = self.l3
        assert l3 is not None
        start = job.start
        hashes = job.hashes
        ids = [self._l3_id(h) for h in hashes]
        end = start + await l3.exists_prefix(ids[start:], "full")
        present: list[bool] = []
        if end > start and self.cache.tree.swa_enabled:
            present = await l3.exists_each(ids[start:end], "swa")
            end = self._window_end(start, end, present)
        known.set_result(end - start)
        if end <= start:
            return start
        ns = self.cache.tree.namespace(namespace)
        wp = self.cache.tree.window_pages
        swa_lo = max(start, end - wp) if self.cache.tree.swa_enabled else end
        quota = self.host_quotas.get(namespace, 0)
        full_slots = reserve_host(self.cache, ns, "full", hashes[start:end], quota)
        if full_slots is None:  # what the host pool can take, if it still ends on a window
            room = min(end - 1, start + self.host.available_to("full", namespace))
            fit = self._window_end(start, room, present) if self.cache.tree.swa_enabled \
                else room
            if fit <= start:
                self.counters["prefetch_no_room"] += 1
                return start
            end = fit
            swa_lo = max(start, end - wp) if self.cache.tree.swa_enabled else end
            full_slots = reserve_host(self.cache, ns, "full", hashes[start:end], quota)
            if full_slots is None:
                self.counters["prefetch_no_room"] += 1
                return start
        job.full_slots = {start + i: s for i, s in enumerate(full_slots)}
        if swa_lo < end:
            swa_slots = reserve_host(self.cache, ns, "swa", hashes[swa_lo:end])
            if swa_slots is None:
                return start
            job.swa_slots = {swa_lo + i: s for i, s in enumerate(swa_slots)}
        pb = self.cache.tree.page_bytes
        full_vals = await l3.get_pages(ids[start:end], "full", self.fingerprint)
        swa_vals = (await l3.get_pages(ids[swa_lo:end], "swa", self.fingerprint)
                    if swa_lo < end else [])
        good = start
        for i, v in enumerate(full_vals):
            if v is None or v.tokens != tokens[(start + i) * pb : (start + i + 1) * pb]:
                break
            good = start + i + 1
        swa_ok = [v is not None and v.tokens == tokens[(swa_lo + i) * pb : (swa_lo + i + 1) * pb]
                  for i, v in enumerate(swa_vals)]
        present = [False] * (swa_lo - start) + swa_ok  # below swa_lo: not fetched
        good = self._window_end(start, good, present[: good - start])
        writes: list[tuple[Any, int, memoryview]] = []
        for i in range(start, end):
            if i < good:
                writes.append((self.host.full, job.full_slots[i], full_vals[i - start].payload))
            else:
                self.host.drop("full", (job.full_slots.pop(i),))
        for i in range(swa_lo, end):
            if i < good and swa_ok[i - swa_lo]:
                writes.append((self.host.swa, job.swa_slots[i], swa_vals[i - swa_lo].payload))
            elif i in job.swa_slots:
                self.host.drop("swa", (job.swa_slots.pop(i),))
        if writes:
            await asyncio.get_running_loop().run_in_executor(None, _write_slots, writes)
        self.counters["l3_hit_pages"] += good - start
        return good

    # ------------------------------------------------------------------ reporting

    def stats(self) -> dict[str, int]:
        h = self.host
        out = dict(self.counters)
        out["host_pages_used"] = h.full.used
        out["host_pages_capacity"] = h.full.usable
        out["host_swa_pages_used"] = h.swa.used if h.swa is not None else 0
        out["host_swa_pages_capacity"] = h.swa.usable if h.swa is not None else 0
        out["host_pages_in_tree"] = self.cache.tree.host_pages
        out["backup_queue"] = len(self._backlog)
        out["l3_write_queue"] = len(self._l3_queue)
        return out


def _write_slots(writes: list[tuple[Any, int, memoryview]]) -> None:
    for pool, slot, payload in writes:
        pool.write_page_bytes(slot, payload)
