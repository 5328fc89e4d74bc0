"""The memory tiers of one model at run time: host (L2) backups and loads back to device; the L3
(Redis) writer and fetcher are its :class:`daemon.l3_tier.L3Tier` (``TierManager.l3tier``).

It composes the model's :class:`ModelCache` with its :class:`HostTier` and the daemon's shared
:class:`RedisTier`, and runs the copies off the event loop (a copy thread on CPU, a copy stream on
CUDA: :class:`daemon.storage.copies.CopyInFlight`, awaited with
:func:`~daemon.storage.copies.to_the_end`). The synchronous halves of each copy (which pages,
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
host tier drops them (``write_back``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Callable, Iterator
from typing import Any

from .config import L3Config, ModelConfig
from .gpu.allocator import OutOfPages
from .l3_tier import L3_WRITE_BATCH, L3Tier
from .model_cache import ModelCache
from .storage.copies import (
    SERIAL_COPY_BYTES,
    CopyInFlight,
    CopyPlan,
    host_to_device,
    plan_device_to_host,
    run_plans,
    to_the_end,
)
from .storage.host_tier import HostTier
from .storage.redis_tier import RedisTier
from .tier_jobs import (
    BackupJob,
    begin_backup,
    begin_load,
    finish_backup,
    finish_load,
    plan_backup,
    watch_backup,
)
from .tree import Node

log = logging.getLogger("radixd.tiers")

#: Nodes one background copy job takes: bounds what an eviction reaching one of them waits for.
BACKUP_BATCH_NODES = 64
#: How long the backup worker lets inserts accumulate before it plans a copy job (unless a
#: whole batch is already waiting): one job, one thread hand-off and one completion wake-up per
#: interval instead of per insert. Write-through needs no promptness (eviction of a node not
#: copied yet copies it itself), while per-insert jobs cost the loop more than the copies.
BACKUP_COALESCE_S = 0.005
#: On CPU, a job of at most this many bytes is copied on the loop at once: a copy this small
#: takes less time than handing it to the copy thread and back (two wake-ups and GIL hand-offs
#: that the requests in flight pay for), and needs no device-page watch. The same bound keeps
#: such a copy serial (no OpenMP region opened on the loop).
INLINE_COPY_BYTES = SERIAL_COPY_BYTES
#: Most nodes waiting for a host copy: past it the oldest requests are dropped (counted as
#: skipped); a backlog that long means the copies cannot keep up and older ones matter least.
MAX_BACKUP_BACKLOG = 65536
#: How long a stop waits for the copies and fetches it cancelled to let go of the memory their
#: threads or streams write: one that is hung past it (a stuck device) is left running, and
#: the pools stay mapped until the process ends (Service.close)
CANCEL_WAIT_S = 5.0

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
        self.host = host
        cache.host = self.host
        cache.tree.host_sink = self.host
        self.write_policy = mc.write_policy
        self.threshold = mc.write_through_threshold
        self.l3 = l3
        self.l3cfg = l3cfg
        self.host_quotas = host_quotas
        # phase 1 of two-phase eviction: which nodes the tree names for a copy before they go
        cache.tree.host_copy_hits = self.threshold if \
            self.write_policy == "write_through_selective" else 0
        cache.copy_to_host = self._demote
        self._backlog: list[Node] = []
        self._owed: set[int] = set()  # ids of the nodes in _backlog: their copy is still owed
        self._tasks: list[asyncio.Task] = []
        self._wake_backup: asyncio.Event | None = None
        self._inflight: set[asyncio.Task] = set()
        self.copying = 0  # copies running in a thread or on a stream (the pools must stay open)
        self.stuck = 0  # tasks a stop cancelled that had not ended CANCEL_WAIT_S later
        self._running: tuple[BackupJob, CopyInFlight] | None = None  # the background copy
        self.counters = dict.fromkeys((
            "backups", "backup_pages", "backup_skipped", "demoted_sync_pages", "evictions_waited",
            "frees_waited",
            "loads", "loaded_tokens", "load_pages", "load_failures",
            "prefetches", "prefetch_pages", "prefetch_timeouts", "prefetch_no_room",
            "l3_hit_pages", "l3_write_pages", "l3_write_values", "l3_write_failures",
            "l3_write_skipped", "l3_quota_deleted_pages",
            "copy_errors"), 0)
        self.copy_seconds = {"to_host": 0.0, "to_device": 0.0}
        self.copy_bytes = {"to_host": 0, "to_device": 0}
        self.l3tier = L3Tier(cache, host, mc.name, l3, host_quotas, l3_quotas,
                             self.counters, self._inflight)
        self.l3_ledger = self.l3tier.ledger
        self.charge_l3 = self.l3tier.charge
        self.prefetch = self.l3tier.prefetch
        if l3 is not None and l3cfg.write_policy == "write_back":
            cache.tree.report_host_drops = True
            cache.read_host_drops = self.l3tier.host_dropped

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the background workers (on the running loop)."""
        self._wake_backup = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._backup_worker(), name="radixd-backup"))
        if self.l3 is not None:
            self._tasks.append(self.l3tier.start())

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
        l3 = self.l3tier
        while (pending or backing or self._backlog or l3.pending or self._inflight) and \
                time.monotonic() < deadline:
            while backing and len(self._backlog) < 4 * BACKUP_BATCH_NODES:
                node = next(device_only, None)
                if node is None:
                    backing = False
                elif node.id not in self._owed:
                    self._backlog.append(node)
                    self._owed.add(node.id)
            while pending and l3.queued_pages < 4 * L3_WRITE_BATCH:  # a bounded queue
                node = next(owed, None)
                if node is None:
                    pending = False
                elif node.host is not None and self.cache.tree.nodes.get(node.id) is node:
                    l3.queue(node, node.host, node.host_swa)
            for ev in (self._wake_backup, l3.wake):
                if ev is not None:
                    ev.set()
            await asyncio.sleep(0.01)
        return self.cache.tree.host_pages - host_before

    async def aclose(self) -> None:
        """Stop the workers and the copies and fetches still in flight (shutdown, after the
        drain): each waits for the thread work it started, then gives its pins and slots back,
        before the pools are closed and the host state is saved."""
        tasks = list(dict.fromkeys([*self._tasks, *self._inflight]))
        for t in tasks:
            t.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
            self.stuck = len(stuck)
            if stuck:
                log.warning("%d tier tasks still running %.0f s after the stop cancelled them",
                            len(stuck), CANCEL_WAIT_S)
        for t in tasks:
            if t.done() and not t.cancelled():
                t.exception()  # retrieved: the drain logged what mattered
        self._tasks.clear()
        self.l3tier.drop_pending()

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
            if job.watch is not None:  # a free of a page it reads waits for it (page_sink)
                job.watch.reader = copy
            self._running = (job, copy)
            await to_the_end(copy.done())
        except asyncio.CancelledError:  # shutdown: the copy has ended, its slots go back
            if not job.finished:
                self._finish_backup(job, False)
            raise
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
        if job.watch is not None:
            self.counters["frees_waited"] += job.watch.waits
        done = finish_backup(self.cache, job, ok)
        self.counters["backups"] += len(job.records)
        self.counters["backup_pages"] += sum(len(fs) for _, fs, _ in done)
        if self.l3 is not None and self.l3cfg.write_policy == "write_through":
            for node, fs, ss in done:
                self.l3tier.queue(node, fs, ss)

    def _finish_running(self, node: Node) -> None:
        """Eviction reached a node the running background copy is copying: wait for that copy
        (a bounded job) and give its nodes their host copies now, so this one is demoted."""
        running = self._running
        if running is None or node.full is None:
            return
        job, copy = running
        if job.finished or job.watch is None or job.watch.full.isdisjoint(node.full):
            return
        ok = True
        try:
            copy.wait()
        except Exception:  # counted and logged by _copy_off_loop, which awaits the same copy
            ok = False
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
                self.l3tier.queue(n, fs, ss)

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
            self.counters["loads"] += 1  # (a failed one: counted in both, as a failed copy is)
            self.counters["load_failures"] += 1
            return probe.prefix_len
        if job is None:
            return probe.prefix_len
        self.counters["loads"] += 1
        ok = True
        t0 = time.perf_counter()
        self.copying += 1
        try:
            await to_the_end(CopyInFlight(_copy_in, self.pools.full, self.pools.swa, self.host,
                                          job.host_full, job.full_pages, job.host_swa,
                                          job.swa_pages).done())
        except asyncio.CancelledError:  # shutdown: the copy has ended, its pages go back
            finish_load(cache, namespace, tokens, job, False)
            raise
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

    # ------------------------------------------------------------------ reporting

    def stats(self) -> dict[str, int]:
        h = self.host
        out = dict(self.counters)
        out["host_pages_used"] = h.full.used
        out["host_pages_capacity"] = h.full.usable
        out["host_swa_pages_used"] = h.swa.used if h.swa is not None else 0
        out["host_swa_pages_capacity"] = h.swa.usable if h.swa is not None else 0
        out["host_pages_in_tree"] = self.cache.tree.host_pages
        out["host_pages_pending"] = len(h.pending["full"])
        out["backup_queue"] = len(self._backlog)
        out["l3_write_queue"] = self.l3tier.queued_pages
        return out
