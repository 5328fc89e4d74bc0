"""The synchronous halves of the tier copies: what a copy moves, the slots and pages it needs, and
how its result lands in the tree.

A copy runs off the event loop between a ``begin_*`` and its ``finish_*``; everything here runs
on the loop, so each half is atomic with respect to every other operation. Between the two, the
path is pinned (the tree keeps its pages where the copy expects them) and the destination pages or
slots are held by the job (a synthetic owner for device pages, the host tier's pending set for
host slots), so the conservation checks account for them and a session that dies meanwhile
cannot free them under the copy.
"""

from __future__ import annotations

import itertools
import logging
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from .gpu.allocator import OutOfPages, nonzero_ids, page_ids
from .model_cache import ModelCache
from .page_sink import Watch
from .tree import LoadPlan, Namespace, Node, Pin, page_keys

log = logging.getLogger("radixd.tiers")

_load_ids = itertools.count(1)


# ------------------------------------------------------------------------------- device -> host

@dataclass
class BackupRecord:
    """One chain of nodes copied to host: ``pages`` pages walked up from ``anchor``."""

    anchor: Node
    pages: int
    full_slots: array  # root-first, one per page
    swa_slots: array  # per page, 0 where the page gets no SWA copy
    dev_full: array  # the device pages read, root-first
    dev_swa: array  # per page, the SWA page read (0: none)


@dataclass
class BackupJob:
    records: list[BackupRecord] = field(default_factory=list)
    dev_full: array = field(default_factory=lambda: array("i"))
    host_full: array = field(default_factory=lambda: array("i"))
    dev_swa: array = field(default_factory=lambda: array("i"))
    host_swa: array = field(default_factory=lambda: array("i"))
    watch: Watch | None = None  # None: a synchronous copy (nothing can free pages under it)
    finished: bool = False  # finish_backup ran (an eviction may finish a running job early)


def host_quota_held(mc: ModelCache, ns: str) -> int:
    """The full host pages namespace ``ns``'s quota_host_pages counts: the tree's, those its
    copies are filling, and its keyed pages."""
    if mc.keyed is not None:
        return mc.keyed.host_used(ns)
    space = mc.tree.namespaces.get(ns)
    return (space.host_pages if space is not None else 0) + \
        mc.host.pending_full.get(ns, 0)  # type: ignore[union-attr]


def fit_host_quota(mc: ModelCache, ns: str, want: int, quota: int) -> bool:
    """Whether ``want`` more full host pages fit namespace ``ns``'s ``quota`` (0: none), once
    its own coldest host pages went (they go now, as many as it takes)."""
    if not quota:
        return True
    if mc.keyed is not None:  # keyed pages share the pool, its eviction order and the quota
        return mc.keyed.fit_quota(ns, want) >= want
    over = host_quota_held(mc, ns) + want - quota
    if over > 0:
        mc.evict_host(over, namespace=ns)
    return host_quota_held(mc, ns) + want <= quota


def reserve_host(mc: ModelCache, ns: Namespace, kind: str, want: int,
                 quota: int = 0) -> array | None:
    """``want`` pending host slots in namespace ``ns``: first within the tenant's host quota
    (its own cold host pages go first), then within the pool (the coldest host-only pages go).
    None when they cannot be had: the copy is skipped, never forced."""
    host = mc.host
    if host is None or not want or (kind == "swa" and host.swa is None):
        return None
    mc.flush_host_drops()  # dropped by a caller outside the tiers: their slots are held
    keyed = mc.keyed  # keyed pages share the pool, its eviction order and the quota
    if kind == "full" and not fit_host_quota(mc, ns.name, want, quota):
        return None
    short = want - host.available_to(kind, ns.name)
    if short > 0:
        if keyed is not None:
            keyed.make_room(kind, want, ns.name)
        else:  # no keyed store (tests): the tree's own coldest, this namespace's first if isolated
            for victims in ((ns.name, None) if host.isolated else (None,)):
                short = want - host.available_to(kind, ns.name)
                if short > 0:
                    mc.evict_host(short if kind == "full" else 0, namespace=victims,
                                  swa_slots=short if kind == "swa" else 0)
    try:
        return host.take(kind, want, ns.name)
    except (OutOfPages, ValueError):
        return None
    except OSError as exc:  # a host segment got no fresh memory (EMFILE, ENOMEM): no room
        log.warning("%s host slots for namespace %r: a segment got no memory (%s); the copy "
                    "is skipped", kind, ns.name, exc.strerror or exc)
        return None


def _chain(node: Node, exclude: set[int]) -> list[Node]:
    """The device nodes from the highest ancestor without a host copy down to ``node``."""
    chain: list[Node] = []
    n = node
    while n.parent is not None and n.host is None and id(n) not in exclude:
        chain.append(n)
        n = n.parent
    chain.reverse()
    return chain


def plan_backup(mc: ModelCache, node: Node, exclude: set[int], quota: int = 0,
                job: BackupJob | None = None) -> BackupRecord | None:
    """Slots for ``node`` and the ancestors it needs (host copies are prefix-closed), added to
    ``job``'s copy lists. Only the trailing window of each node gets SWA copies."""
    tree = mc.tree
    chain = _chain(node, exclude)
    if not chain or any(n.full is None for n in chain):
        return None
    pb = tree.page_bytes
    full_slots = reserve_host(mc, node.ns, "full", sum(len(n.tokens) for n in chain) // pb,
                              quota)
    if full_slots is None:
        return None
    wp = tree.window_pages
    swa_pos: list[int] = []  # page positions in the chain that get an SWA copy
    dev_swa = array("i")
    off = 0
    for n in chain:
        k = len(n.tokens) // pb
        if n.swa is not None and mc.host is not None and mc.host.swa is not None:
            lo = max(0, k - wp)
            swa_pos.extend(range(off + lo, off + k))
            dev_swa += tree.page_ids.join([n.swa[lo:k]])
        off += k
    swa_slots = array("i", bytes(4 * off))
    swa_read = array("i", bytes(4 * off))
    got_swa = reserve_host(mc, node.ns, "swa", len(swa_pos)) if swa_pos else None
    if got_swa is not None:  # (placed in numpy: a window is a hundred pages at page 1)
        at = np.array(swa_pos, dtype=np.intp)
        np.frombuffer(swa_slots, dtype=np.int32)[at] = page_ids(got_swa)
        np.frombuffer(swa_read, dtype=np.int32)[at] = page_ids(dev_swa)
    dev_full = tree.page_ids.join([n.full for n in chain])  # type: ignore[misc]
    if job is not None:
        job.dev_full += dev_full
        job.host_full += full_slots
        if got_swa is not None:
            job.dev_swa += dev_swa
            job.host_swa += got_swa
    exclude.update(id(n) for n in chain)
    return BackupRecord(node, off, full_slots, swa_slots, dev_full, swa_read)


def begin_backup(mc: ModelCache, nodes: Iterable[Node], quotas: dict[str, int]) -> BackupJob:
    """One copy job for every node still on device without a host copy.

    The nodes are not pinned: a background backup must never make pages unevictable (an
    ``alloc`` would fail for a copy that is only an optimisation). Instead, a job copied off the
    loop watches the device pages it reads (:func:`watch_backup`), and a page the tree frees
    meanwhile taints its copy, which is dropped. A job copied at once needs no watch."""
    tree = mc.tree
    job = BackupJob()
    seen: set[int] = set()
    try:
        for node in nodes:
            if tree.nodes.get(node.id) is not node or node.full is None or node.host is not None:
                continue
            rec = plan_backup(mc, node, seen, quotas.get(node.ns.name, 0), job)
            if rec is not None:
                job.records.append(rec)
    except BaseException:  # the slots of the records planned so far go back
        finish_backup(mc, job, False)
        raise
    return job


def watch_backup(mc: ModelCache, job: BackupJob) -> None:
    """Watch the device pages ``job`` reads: call before its copy leaves the loop (between
    :func:`begin_backup` and the first ``await``), so no free can slip in unseen."""
    if job.records and job.watch is None:
        job.watch = mc.sink.watch(job.dev_full, job.dev_swa)


def finish_backup(mc: ModelCache, job: BackupJob, ok: bool) -> list[tuple[Node, array, array]]:
    """Give the copied nodes their host slots (or drop the slots when the copy failed or a page
    it read was freed meanwhile).

    Returns (node, full slots, SWA slots) of every node that got a host copy, for L3."""
    tree = mc.tree
    host = mc.host
    assert host is not None
    tainted_full: set[int] = set()
    tainted_swa: set[int] = set()
    if job.watch is not None:
        tainted_full, tainted_swa = mc.sink.unwatch(job.watch)
    done: list[tuple[Node, array, array]] = []
    for rec in job.records:
        nodes: list[Node] = []
        n, left = rec.anchor, rec.pages
        while left > 0 and n.parent is not None:
            nodes.append(n)
            left -= len(n.tokens) // tree.page_bytes
            n = n.parent
        nodes.reverse()
        off = 0
        for n in nodes:
            k = len(n.tokens) // tree.page_bytes
            fs = rec.full_slots[off : off + k]
            ss = rec.swa_slots[off : off + k]
            read = rec.dev_full[off : off + k]
            clean = (n.full is not None and tree.page_ids.join([n.full]) == read
                     and (not tainted_full or tainted_full.isdisjoint(read))
                     and (not tainted_swa
                          or tainted_swa.isdisjoint(rec.dev_swa[off : off + k])))
            off += k
            if (ok and clean and left == 0 and n.host is None and n.full is not None
                    and n.parent.host is not None and tree.nodes.get(n.id) is n):
                host.filled("full", fs, n.ns.name)
                host.filled("swa", nonzero_ids(ss))
                tree.set_host(n.id, fs, ss if any(ss) else None)
                done.append((n, fs, ss))
            else:
                host.drop("full", fs, n.ns.name)
                host.drop("swa", ss)
    return done


# ------------------------------------------------------------------------------- host -> device

@dataclass
class LoadJob:
    plan: LoadPlan
    pin: Pin
    owner: tuple[str, int]
    full_pages: array  # device pages, positionally for plan.full
    swa_pages: array  # device pages, positionally for plan.swa

    @property
    def host_full(self) -> list[int]:
        return [s for _, s in self.plan.full]

    @property
    def host_swa(self) -> list[int]:
        return [s for _, s in self.plan.swa]


def begin_load(mc: ModelCache, namespace: str, tokens: bytes, device_len: int,
               admit: Callable[[int, int], None] | None = None) -> LoadJob | None:
    """Pin the path and take device pages for what host holds past ``device_len`` tokens; None
    when there is nothing to load. ``admit(full, swa)`` may refuse the pages (a tenant quota)
    by raising. Raises OutOfPages (with nothing changed) when the pools cannot make room."""
    plan = mc.tree.plan_load(namespace, tokens, device_len)
    if plan is None:
        return None
    pin = mc.tree.pin(plan.anchor)
    owner = ("load", next(_load_ids))
    try:
        if admit is not None:
            admit(len(plan.full), len(plan.swa))
        full, swa = mc.alloc_unpaired(owner, len(plan.full), len(plan.swa), namespace)
    except BaseException:
        mc.unpin(pin)
        raise
    loading = mc.loading_pages.setdefault(namespace, [0, 0])
    loading[0] += len(full)
    loading[1] += len(swa)
    return LoadJob(plan, pin, owner, full, swa)


def finish_load(mc: ModelCache, namespace: str, tokens: bytes, job: LoadJob, ok: bool) -> int:
    """Hand the copied pages to the tree (or free them when the copy failed); returns the pages
    that became resident."""
    mc.disown(job.owner, (job.full_pages, job.swa_pages))
    loading = mc.loading_pages[namespace]
    loading[0] -= len(job.full_pages)
    loading[1] -= len(job.swa_pages)
    if loading == [0, 0]:
        del mc.loading_pages[namespace]
    fd = {i: p for (i, _), p in zip(job.plan.full, job.full_pages, strict=True)}
    sd = {i: p for (i, _), p in zip(job.plan.swa, job.swa_pages, strict=True)}
    try:
        loaded = mc.tree.commit_load(namespace, tokens, job.plan, fd, sd) if ok else 0
    finally:
        if fd:
            mc.alloc_state.free_full(array("i", fd.values()))
        if sd:
            mc.alloc_state.free_swa(array("i", sd.values()))
        mc.unpin(job.pin)
    return loaded


# ------------------------------------------------------------------------------- L3 -> host

@dataclass
class FetchJob:
    """Pages [start, ...) of ``tokens`` that L3 may hold, under a pinned host prefix."""

    start: int
    pages: int  # whole pages of tokens
    pin: Pin | None
    seed: bytes  # the namespace's chain seed
    tokens: bytes
    page_bytes: int
    block_bytes: int
    full_slots: dict[int, int] = field(default_factory=dict)  # page index -> pending slot
    swa_slots: dict[int, int] = field(default_factory=dict)

    def page_keys(self, pages: list[int]) -> list[bytes]:
        """The page keys of these pages of ``tokens`` (ascending), derived only when asked: a
        fetch names runs' ends and a window's pages, not every page."""
        return page_keys(self.seed, b"", self.tokens, self.page_bytes, self.block_bytes, pages)


def begin_fetch(mc: ModelCache, namespace: str, tokens: bytes) -> FetchJob:
    tree = mc.tree
    start, last = tree.host_prefix(namespace, tokens)
    pb = tree.page_bytes
    n = len(tokens) // pb
    # host_only: the prefix keeps its host copies; its device pages stay evictable (a node with
    # a host copy is demoted, not deleted), so a Redis round trip never makes an alloc fail
    return FetchJob(start, n, tree.pin(last, host_only=True) if last is not None else None,
                    tree.namespace(namespace).seed, tokens[: n * pb], pb, tree.block_bytes)


def finish_fetch(mc: ModelCache, namespace: str, tokens: bytes, job: FetchJob, end: int
                 ) -> int:
    """Attach the fetched pages [start, end) under the host prefix; returns pages attached."""
    host = mc.host
    assert host is not None
    fs, ss = dict(job.full_slots), dict(job.swa_slots)
    got = 0
    try:
        if end > job.start:
            got, _ = mc.tree.adopt_host(namespace, tokens, job.start, end, fs, ss)
    finally:
        host.drop("full", fs.values(), namespace)
        host.drop("swa", ss.values())
        host.filled("full", (s for i, s in job.full_slots.items() if i not in fs), namespace)
        host.filled("swa", (s for i, s in job.swa_slots.items() if i not in ss))
        if job.pin is not None:
            mc.unpin(job.pin)
    return got
