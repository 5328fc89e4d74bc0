"""The key-addressed store's invariants about the host pools it shares with the tree (the
bookkeeping's own are ``KeyedPages.audit_steps``): what ``KeyedTier.check_steps`` runs for each
pool kind, in bounded steps."""

from __future__ import annotations

from collections.abc import Iterator

from daemon.gpu.allocator import AUDIT_STEP_SLOTS
from daemon.tree import chunked

from .host_tier import HostTier
from .keyed_pages import KeyedPage, KeyedPages

__all__ = ["keyed_pool_audit_steps", "keyed_slots"]


def keyed_slots(pages: KeyedPages, kind: str
                ) -> Iterator[tuple[str, int, KeyedPage | None] | None]:
    """(namespace, slot, page) of every stored page of ``kind``, then (namespace, slot,
    None) of every reserved key of ``kind``, read lazily; None for each page or pin of the
    other kind, so that a chunk of this is a bounded piece of work whatever the kind."""
    for page in pages.pages.values():
        yield (page.ns, page.slot, page) if page.kind == kind else None
    for pin in pages.pins.values():
        if pin.kind != kind or pin.reserved is None:
            yield None
            continue
        for slot, _ in pin.reserved.values():
            yield pin.ns, slot, None

def keyed_pool_audit_steps(pages: KeyedPages, host: HostTier, kind: str, v: list[str]
                           ) -> Iterator[None]:
    """The key-addressed store's invariants about the host pool of ``kind`` into ``v``: free +
    tree host + keyed + reserved (+ copies in flight) = capacity, no slot in two places, every
    keyed slot holding the page's own hash and, isolated, lying in its namespace's segments.
    Yields after each bounded piece of work (the background checker's steps); the slots'
    marks are a bytearray, not a set, so that no step rehashes a table the pool's size."""
    pool = host.full if kind == "full" else host.swa
    keyed = host.keyed[kind]
    if pool is None:
        for chunk in chunked(keyed_slots(pages, kind), AUDIT_STEP_SLOTS):
            if any(x is not None for x in chunk):
                v.append(f"keyed {kind} pages but no {kind} host pool")
                return
            yield
        return
    cap = pool.capacity
    hashes = pool.slot_hashes()
    refs = pool.reference_counts()
    marks = bytearray(cap)  # 1: a keyed page's or a reservation's slot
    odd: set[int] = set()  # ... such slots outside the pool
    stored = reserved = 0
    twice = False
    free: list[int] = []  # keyed slots the pool does not hold
    distinct_held = 0
    wrong_hash: KeyedPage | None = None
    misplaced: dict[str, set[int]] = {}  # isolation: namespace -> segments it does not hold
    alloc = pool.allocator if host.isolated else None
    for chunk in chunked(keyed_slots(pages, kind), AUDIT_STEP_SLOTS):
        by_ns: dict[str, list[int]] = {}
        for item in chunk:
            if item is None:
                continue
            ns, slot, page = item
            if page is None:
                reserved += 1
            else:
                stored += 1
                if wrong_hash is None and hashes.get(slot) != page.hash:
                    wrong_hash = page
            if alloc is not None:
                by_ns.setdefault(ns, []).append(slot)
            if 0 <= slot < cap:
                if marks[slot]:
                    twice = True
                    continue
                marks[slot] = 1
            elif slot in odd:
                twice = True
                continue
            else:
                odd.add(slot)
            if slot in refs:
                distinct_held += 1
            else:
                free.append(slot)
        if alloc is not None:
            for ns, slots in by_ns.items():
                alloc.misplaced(slots, ns, misplaced.setdefault(ns, set()))
        yield
    if twice:
        v.append(f"keyed {kind}: a host slot is held by two keyed pages or reservations")
    n_mine = len(free) + distinct_held
    agree = n_mine == len(keyed)
    for chunk in chunked(keyed, AUDIT_STEP_SLOTS):
        agree = agree and all(0 <= s < cap and marks[s] or s in odd for s in chunk)
        yield
    if not agree:  # the report: a rare path, in one step
        mine = {x[1] for x in keyed_slots(pages, kind) if x is not None}
        v.append(f"keyed {kind}: slots {sorted(mine ^ keyed)[:10]} disagree with the host "
                 "tier's keyed set")
    if free:
        v.append(f"keyed {kind}: slots {sorted(free)[:10]} are free in the pool")
    others = pool.used - distinct_held  # the tree's host pages, copies in flight, readers
    if pool.available + others + stored + reserved != pool.usable:
        v.append(f"keyed {kind}: free {pool.available} + tree and copies {others} + keyed "
                 f"{stored} + reserved {reserved} != capacity {pool.usable}")
    if wrong_hash is not None:
        v.append(f"keyed page {wrong_hash.key!r}: slot {wrong_hash.slot} holds another hash")
    for ns, segs in misplaced.items():
        v += pool.allocator.audit_owners(ns, f"keyed {kind} slots", segs)
