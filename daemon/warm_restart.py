"""Warm restart of the host tier (L2): save it at a graceful stop, rebuild it at the next start.

At stop (:func:`save_host_state`, after the tiers drained): per model, every tree node with a
host copy that hangs from its namespace root through nodes with host copies (the part of the tree
that can exist without device pages), and every stored keyed page, with their pages and
checksums (format: :mod:`daemon.storage.host_snapshot`). Device pages are not saved: on a GPU they
cannot outlive the process, and on the CPU device they are not kept either (the engines that
wrote them are gone); what they computed survives through the host copies, which the drain
before the save makes for every device-only node (``TierManager.drain(back_up_device=True)``).

At start (:func:`restore_host_state`, before serving): a model whose layout fingerprint or page
size changed restores nothing (one log line says why); each page is verified against its
checksum and a page that fails is dropped with everything below it in the tree, never served.
Kept pages get new slots in the fresh pools (allocator, reference counts, the keyed pages'
content index and the tree's host-page counts, the per-namespace quotas included, all follow from
the ordinary operations: ``HostPool.store_unnamed`` and ``RadixTree.adopt_host_under`` (each
node under the one made for its parent) for the tree's pages, ``HostPool.store`` and
``KeyedPages.add_stored`` for keyed pages).

Two places keep the state between the stop and the start, with one restore for both
(:func:`_restore`): ``[server] state_dir`` (the held pages copied into files) and, under systemd
with ``FileDescriptorStoreMax=``, systemd's fd store (:func:`save_host_fdstore`: the pools'
memfds themselves (isolated pools: the memfd of each host segment that holds a saved page) and a
memfd with the index, so a stop writes no page; at start
:func:`restore_host_fdstore` reads each page in place from the old memfd, checks it and copies it
into the new pool, then closes the old memfds and removes them from the store). The fd store
wins when both are configured.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .entities import ModelEntry
from .storage.host_snapshot import (
    FDSTORE_PREFIX,
    SECTIONS,
    HostSnapshot,
    KeyedRecord,
    L3LedgerRecord,
    ModelImage,
    PageSource,
    PoolImage,
    SnapshotError,
    TreeNodeRecord,
    as_slots,
    decode_index,
    encode_index,
    memfd_pool,
    memfd_segments_pool,
    open_pool,
    pool_file,
    read_fd,
    remove_pages,
    take_snapshot,
    write_index,
    write_pool,
)
from .storage.keyed_pages import keyed_hash
from .tier_jobs import fit_host_quota, host_quota_held
from .tree import Node

log = logging.getLogger("radixd.warm_restart")

#: The fd-store name of the memfd holding the index.
INDEX_FD = f"{FDSTORE_PREFIX}host-index"
#: why pools passed back without the index are refused: what a stop whose fd-store save failed
#: half way leaves with systemd (it saved to ``state_dir`` instead)
NO_INDEX = "the fd store holds host pools but no index"


@dataclass
class RestartReport:
    """What the last start restored: status, the admin endpoint and /metrics show it."""

    source: str = "none"  # "none" (nothing to restore), "state_dir", "fdstore"
    kept_pages: int = 0
    dropped_pages: int = 0
    restore_seconds: float = 0.0
    reason: str = ""  # why nothing was restored, when a snapshot was refused whole
    models: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "kept_pages": self.kept_pages,
                "dropped_pages": self.dropped_pages,
                "restore_seconds": round(self.restore_seconds, 6), "reason": self.reason,
                "models": self.models}


# ---------------------------------------------------------------------------------------- save

def _host_nodes(root: Node) -> Iterator[Node]:
    """Nodes with a host copy reachable from ``root`` through nodes with one, parents first."""
    stack = [c for c in (root.children or {}).values() if c.host is not None]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(c for c in (n.children or {}).values() if c.host is not None)


def _image(entry: ModelEntry, index: int, state_dir: str | None) -> ModelImage:
    """One model's index entry; its held pages are written to ``state_dir``, or, with none (the
    fd store), only checksummed: the pool's memfd is what survives, named after the model."""
    tree = entry.cache.tree
    host = entry.tiers.host  # type: ignore[union-attr]
    img = ModelImage(fingerprint=tree.layout_fingerprint)
    used: dict[str, list[int]] = {"full": [], "swa": []}
    for ns_name, ns in sorted(tree.namespaces.items()):
        pos: dict[int, int] = {ns.root.id: -1}
        for n in _host_nodes(ns.root):
            pos[n.id] = len(img.tree)
            hs = n.host_swa.tobytes() if n.host_swa is not None else b""
            slots = tree.page_ids.join([n.host])  # type: ignore[list-item] # (or its runs)
            img.tree.append(TreeNodeRecord(pos[n.parent.id], ns_name, n.tokens,  # type: ignore
                                           slots.tobytes(), hs, max(0, tree.clock - n.ts)))
            used["full"].extend(slots)
            if n.host_swa is not None:
                used["swa"].extend(s for s in n.host_swa if s)
    if entry.keyed is not None:
        for order in entry.keyed.pages.order.values():  # least recently used first
            for page in order.values():
                img.keyed.append(KeyedRecord(
                    page.ns, page.kind, page.key, page.slot, page.in_l3,
                    max(0, tree.clock - page.stamp), -1 if page.gen is None else page.gen))
                used[page.kind].append(page.slot)
        img.kv_gens, img.kv_clearing = entry.keyed.names.state()
    img.l3_ledger = [L3LedgerRecord(ns, h, pool, n)
                     for ns, values in entry.tiers.l3_ledger.entries().items()  # type: ignore
                     for h, pool, n in values]
    for kind, slots in used.items():
        if not slots:
            continue
        pool = host.pool(kind)
        name = pool_file(index, kind) if state_dir is not None else fd_name(index, kind)
        img.pools[kind] = write_pool(state_dir, name,
                                     ((s, pool.page_bytes(s)) for s in slots), pool.page_nbytes)
        if state_dir is None and pool.num_segments:  # the fd store keeps segment memfds
            img.pools[kind].segment_pages = pool.segment_pages or 0
    return img


def fd_name(index: int, kind: str) -> str:
    """The fd-store name of model ``index``'s ``kind`` host pool."""
    return f"{FDSTORE_PREFIX}host-{index}-{kind}"


def _snapshot(models: dict[str, ModelEntry], state_dir: str | None) -> HostSnapshot:
    """Every model's host tier (called after the tiers drained: no copy in flight, nothing
    pending). A model whose copies outlived the drain is left out (its pages may be half
    written)."""
    snap = HostSnapshot(sections=dict(SECTIONS), models={})
    for i, (name, entry) in enumerate(models.items()):
        if entry.tiers is None:
            continue
        if entry.tiers.copying or any(entry.tiers.host.pending.values()):
            log.warning("warm restart: %s has copies in flight; its host tier is not saved", name)
            continue
        snap.models[name] = _image(entry, i, state_dir)
    return snap


def _snapshot_pages(snap: HostSnapshot) -> int:
    return sum(len(p.slots) // 4 for m in snap.models.values() for p in m.pools.values())


def save_host_fdstore(models: dict[str, ModelEntry], store_fd: Callable[[str, int], bool],
                      limit: int = 0) -> int:
    """Hand every model's host pools (their memfds: no page is copied; an isolated pool, the
    memfd of each segment holding a saved page) and a memfd holding the index to systemd's fd
    store through ``store_fd(name, fd)`` (``Notifier.store_fd``); returns the pages kept, 0 when
    nothing could be stored, or when more fds are needed than the store keeps (``limit``,
    ``$FDSTORE``; 0: unchecked): the caller then falls back to ``state_dir``. The index goes
    last: a next start without it uses none of the pools."""
    t0 = time.perf_counter()
    snap = _snapshot(models, None)
    fds: list[tuple[str, int | None]] = []
    for name, entry in models.items():
        img = snap.models.get(name)
        for kind, image in img.pools.items() if img is not None else ():
            pool = entry.tiers.host.pool(kind)  # type: ignore[union-attr]
            if image.segment_pages:  # isolated: each segment holding a saved page, its memfd
                fds += [(f"{image.file}-seg{seg}", pool.segment_fds[seg]) for seg in
                        sorted({s // image.segment_pages for s in as_slots(image.slots)})]
            else:
                fds.append((image.file, pool.fd))
    if limit and len(fds) + 1 > limit:
        log.warning("warm restart: the host pools need %d fds in systemd's fd store (one per "
                    "host segment holding pages under memory isolation) plus the index, it "
                    "keeps %d: raise FileDescriptorStoreMax= (and FDSTORE=)", len(fds), limit)
        return 0
    sent = all(fd is not None and store_fd(name, fd) for name, fd in fds)
    if not sent:
        log.warning("warm restart: the host pools could not be stored in systemd's fd store")
        return 0
    raw = encode_index(snap)
    fd = os.memfd_create(INDEX_FD, os.MFD_CLOEXEC)
    try:
        os.write(fd, raw)
        if not store_fd(INDEX_FD, fd):
            return 0
    finally:
        os.close(fd)
    pages = _snapshot_pages(snap)
    log.info("warm restart: stored %d host pages of %d model(s) in systemd's fd store (index %d "
             "bytes) in %.3f s", pages, len(snap.models), len(raw), time.perf_counter() - t0)
    return pages


def save_host_state(models: dict[str, ModelEntry], state_dir: str) -> int:
    """Write every model's host tier to ``state_dir``; returns the pages saved."""
    t0 = time.perf_counter()
    remove_pages(state_dir)
    snap = _snapshot(models, state_dir)
    pages = _snapshot_pages(snap)
    size = write_index(state_dir, snap)
    log.info("warm restart: saved %d host pages of %d model(s) to %s (index %d bytes) in %.3f s",
             pages, len(snap.models), state_dir, size, time.perf_counter() - t0)
    return pages


# ---------------------------------------------------------------------------------------- restore

class _Restorer:
    """Rebuilds one model's host tier from its image."""

    def __init__(self, entry: ModelEntry, img: ModelImage, sources: dict[str, PageSource],
                 sections: dict[str, int]) -> None:
        self.entry = entry
        self.tree = entry.cache.tree
        self.host = entry.tiers.host  # type: ignore[union-attr]
        self.img = img
        self.sources = sources
        self.sections = sections
        self.kept = 0
        self.dropped = 0

    def _copy(self, kind: str, old: int, h: bytes | None, ns: str) -> int | None:
        """The verified page saved in ``old`` in a new slot of namespace ``ns``'s segments,
        indexed under hash ``h`` (a keyed page; None: a tree page, which the tree indexes), or
        None."""
        if not old:
            return None
        src = self.sources.get(kind)
        data = src.page(old) if src is not None else None
        if data is None:
            return None
        pool = self.host.pool(kind)
        key = self.host.space(ns)
        if pool.available_to(key) == 0 or (h is not None and pool.lookup(h) is not None):
            return None
        slot = pool.store(h, key) if h is not None else pool.store_unnamed(1, key)[0]
        pool.write_page_bytes(slot, data)
        return slot

    def _give_back(self, kind: str, slots: Any) -> None:
        for s in slots:
            if s:
                self.host.pool(kind).release(s)

    def tree_nodes(self) -> None:
        """Each saved node under the node made for its parent (a record comes after its
        parent's), so that no node is found again from the root."""
        tree = self.tree
        pb = tree.page_bytes
        swa_pool = self.host.swa is not None
        made: list[Node | None] = []  # per record index: its node when restored, else None
        for rec in self.img.tree:
            host = as_slots(rec.host)
            hswa = as_slots(rec.host_swa) if rec.host_swa else array("i", bytes(4 * len(host)))
            npages = len(rec.tokens) // pb
            parent = made[rec.parent] if 0 <= rec.parent < len(made) else None
            if (rec.parent >= 0 and (parent is None or parent.ns.name != rec.ns)) or npages == 0 \
                    or len(rec.tokens) != npages * pb or len(host) != npages \
                    or len(hswa) != npages:
                made.append(None)
                self.dropped += len(host) + sum(1 for s in hswa if s)
                continue
            full = [self._copy("full", host[j], None, rec.ns) for j in range(npages)]
            if any(s is None for s in full):
                self._give_back("full", full)
                made.append(None)
                self.dropped += npages + sum(1 for s in hswa if s)
                continue
            swa = [self._copy("swa", hswa[j], None, rec.ns) if swa_pool else None
                   for j in range(npages)]
            self.dropped += sum(1 for j in range(npages) if hswa[j] and swa[j] is None)
            node = tree.adopt_host_under(
                parent if parent is not None else tree.namespace(rec.ns).root, rec.tokens,
                array("i", full), array("i", (s or 0 for s in swa)),  # type: ignore[arg-type]
                used=tree.clock - max(0, rec.age))
            if node is None:  # pragma: no cover - a saved tree is a tree
                self._give_back("full", full)
                self._give_back("swa", swa)
                made.append(None)
                self.dropped += npages
                continue
            self.kept += npages + sum(1 for s in swa if s)
            made.append(node)

    def keyed_pages(self) -> None:
        keyed = self.entry.keyed
        fp = self.tree.layout_fingerprint
        for rec in self.img.keyed:
            h = keyed_hash(rec.ns, fp, rec.kind, rec.key) if rec.kind in ("full", "swa") \
                else b""
            slot = self._copy(rec.kind, rec.slot, h, rec.ns) if h and keyed is not None and \
                (rec.kind == "full" or self.host.swa is not None) and \
                keyed.pages.get(rec.ns, rec.kind, rec.key) is None else None
            if slot is None:
                self.dropped += 1
                continue
            self.host.keyed[rec.kind].add(slot)
            keyed.pages.add_stored(rec.ns, rec.kind, rec.key, slot, h,  # type: ignore[union-attr]
                                   self.tree.clock - max(0, rec.age), in_l3=rec.in_l3,
                                   gen=self._stored_as(rec))
            self.kept += 1

    def _stored_as(self, rec: KeyedRecord) -> int | None:
        """A restored keyed page's clear generation (KeyedPage.gen): as saved, or when none was
        (a snapshot from before the field, or a page kept by a clear of this daemon's that had
        not reached Redis), None while that clear is still to be made, else 0 (older than any
        clear: a miss where it was not, never a page of before one)."""
        if rec.gen >= 0:
            return rec.gen
        return None if rec.ns in self.img.kv_clearing else 0

    def run(self) -> None:
        if "tree" in self.sections:
            self.tree_nodes()
        else:
            self.dropped += sum(len(r.host) // 4 for r in self.img.tree)
        if "l3_ledger" in self.sections:  # the quota keeps counting what Redis still holds
            by_ns: dict[str, list[tuple[bytes, str, int]]] = {}
            for rec in self.img.l3_ledger:
                by_ns.setdefault(rec.ns, []).append((rec.page_id, rec.pool, rec.nbytes))
            for ns, values in by_ns.items():
                self.entry.tiers.l3_ledger.adopt(ns, values)  # type: ignore[union-attr]
        if "keyed" in self.sections:
            self.keyed_pages()
        else:
            self.dropped += len(self.img.keyed)
        if self.entry.keyed is not None:  # a clear not yet in Redis is raised there at start
            self.entry.keyed.names.restore(self.img.kv_gens, self.img.kv_clearing)
        self.fit_quotas()

    def fit_quotas(self) -> None:
        """A quota_host_pages the new configuration lowered: the namespace's host pages over it
        go now, as its next copy would make them go (the coldest first: tree and keyed pages keep
        their order across a restart), and not only once it copies again (a tenant that only
        reads would stay over its quota)."""
        cache = self.entry.cache
        for ns, quota in self.entry.tiers.host_quotas.items():  # type: ignore[union-attr]
            held = host_quota_held(cache, ns)
            if not quota or held <= quota:
                continue
            used = sum(p.used for p in self.host.pools())  # (SWA slots go with their nodes)
            fit_host_quota(cache, ns, 0, quota)
            gone = used - sum(p.used for p in self.host.pools())
            self.dropped += gone
            self.kept -= gone
            log.warning("warm restart: model %r: namespace %r held %d saved full host pages, "
                        "over its quota_host_pages of %d: %d of them went (%d host pages with "
                        "their SWA ones)", self.entry.name, ns, held, quota,
                        held - host_quota_held(cache, ns), gone)


def _image_pages(img: ModelImage) -> int:
    return sum(len(p.slots) // 4 for p in img.pools.values())


def _restore(models: dict[str, ModelEntry], snap: HostSnapshot, report: RestartReport,
             open_source: Callable[[PoolImage], PageSource]) -> None:
    """Rebuild every model's host tier from ``snap``, the pages read through ``open_source``
    (the state_dir's files, or the stored memfds): the one restore both sources share."""
    for name, img in snap.models.items():
        entry = models.get(name)
        pages = _image_pages(img)
        why = ""
        if entry is None or entry.tiers is None:
            why = "the model has no host tier in this configuration"
        elif img.fingerprint != entry.cache.tree.layout_fingerprint:
            why = (f"its layout changed (fingerprint {img.fingerprint.hex()[:16]} saved, "
                   f"{entry.cache.tree.layout_fingerprint.hex()[:16]} now)")
        elif any(kind == "swa" and entry.tiers.host.swa is None or
                 p.page_nbytes != entry.tiers.host.pool(kind).page_nbytes
                 for kind, p in img.pools.items() if kind in ("full", "swa")):
            why = "its host pools changed shape"
        if why:
            if entry is not None and entry.keyed is not None:  # (names, not pages: kept)
                entry.keyed.names.restore(img.kv_gens, img.kv_clearing)
            log.warning("warm restart: dropping the %d saved host pages of model %r: %s",
                        pages, name, why)
            report.dropped_pages += pages
            report.models[name] = {"kept_pages": 0, "dropped_pages": pages}
            continue
        sources = {kind: open_source(p) for kind, p in img.pools.items()}
        r = _Restorer(entry, img, sources, snap.sections)  # type: ignore[arg-type]
        r.run()
        report.kept_pages += r.kept
        report.dropped_pages += r.dropped
        report.models[name] = {"kept_pages": r.kept, "dropped_pages": r.dropped}
        if r.dropped:
            log.warning("warm restart: model %r: %d saved host pages were dropped (failed "
                        "verification, did not fit, or were over a lowered quota)", name,
                        r.dropped)


def _finish(report: RestartReport, t0: float) -> RestartReport:
    report.restore_seconds = time.perf_counter() - t0
    log.info("warm restart: kept %d host pages, dropped %d, from %s in %.3f s",
             report.kept_pages, report.dropped_pages, report.source, report.restore_seconds)
    return report


def restore_host_state(models: dict[str, ModelEntry], state_dir: str) -> RestartReport:
    """Rebuild the host tiers from ``state_dir`` (before anything is served)."""
    t0 = time.perf_counter()
    report = RestartReport()
    try:
        snap = take_snapshot(state_dir)
    except SnapshotError as exc:
        log.warning("warm restart: the saved host state is not used: %s", exc)
        report.reason = str(exc)
        remove_pages(state_dir)
        return report
    if snap is None:
        remove_pages(state_dir)
        return report
    report.source = "state_dir"
    _restore(models, snap, report, lambda image: open_pool(state_dir, image))
    remove_pages(state_dir)
    return _finish(report, t0)


def discard_host_state(state_dir: str) -> None:
    """Drop what ``state_dir`` holds, unread: a start that restored from the fd store must not
    leave an older snapshot there for a later start to restore."""
    with contextlib.suppress(SnapshotError):
        if take_snapshot(state_dir) is not None:
            log.info("warm restart: an older host snapshot in %s is discarded", state_dir)
    remove_pages(state_dir)


def restore_host_fdstore(models: dict[str, ModelEntry], stored: dict[str, int],
                         remove_fds: Callable[[str], bool]) -> RestartReport | None:
    """Rebuild the host tiers from the fds systemd's fd store passed back (``stored``: name ->
    fd, as :func:`daemon.sdnotify.passed_fds` returns them); None when none were passed. Every
    passed fd is closed here and removed from the store (``FDSTOREREMOVE``), used or refused,
    so a later start never sees pages this daemon may overwrite (``remove_fds(name)``:
    ``Notifier.remove_fds``)."""
    if not stored:
        return None
    t0 = time.perf_counter()
    report = RestartReport(source="fdstore")
    maps: list[PageSource] = []
    try:
        index = stored.get(INDEX_FD)
        if index is None:
            raise SnapshotError(NO_INDEX)
        snap = decode_index(read_fd(index))

        def source(image: PoolImage) -> PageSource:
            src = (memfd_segments_pool(stored, image) if image.segment_pages
                   else memfd_pool(stored.get(image.file), image))
            maps.append(src)
            return src

        _restore(models, snap, report, source)
    except SnapshotError as exc:
        log.warning("warm restart: the host pools in the fd store are not used: %s", exc)
        report.reason = str(exc)
    finally:
        for src in maps:
            for data in ([src.data] if src.data is not None else []) + list(
                    src.segments.values()):
                mapping = data.obj
                data.release()
                with contextlib.suppress(BufferError):  # a page view still alive: GC closes it
                    mapping.close()  # type: ignore[union-attr]
        for name, fd in stored.items():
            os.close(fd)
            remove_fds(name)
        stored.clear()
    return _finish(report, t0)
