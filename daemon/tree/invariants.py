"""The tree's invariant checker: recompute everything from scratch and compare.

Every violation is collected before reporting (one report shows the whole damage, not the first
symptom). The page sets it gathers feed the pool-conservation check one layer up.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .hashing import HASH_BYTES, chain_hashes
from .lru import EvictionQueue
from .node import Node
from .radix import RadixTree


@dataclass
class TreeAudit:
    violations: list[str] = field(default_factory=list)
    full_pages: set[int] = field(default_factory=set)
    swa_pages: set[int] = field(default_factory=set)
    host_slots: set[int] = field(default_factory=set)
    host_swa_slots: set[int] = field(default_factory=set)
    nodes: int = 0


def check_tree(tree: RadixTree, *, deep: bool = True) -> list[str]:
    """All violated invariants of ``tree`` (empty when healthy). ``deep`` re-hashes every page."""
    return audit_tree(tree, deep=deep).violations


def audit_tree(tree: RadixTree, *, deep: bool = True) -> TreeAudit:
    a = TreeAudit()
    v = a.violations
    pb = tree.page_bytes
    reachable: dict[int, Node] = {}
    full_owner: Counter[int] = Counter()
    swa_owner: Counter[int] = Counter()
    host_owner: Counter[int] = Counter()
    host_swa_owner: Counter[int] = Counter()

    for name, ns in tree.namespaces.items():
        root = ns.root
        if root.parent is not None or root.tokens or root.full is None or len(root.full):
            v.append(f"namespace {name!r}: malformed root {root!r}")
        if root.full_lock or root.swa_lock:
            v.append(f"namespace {name!r}: root carries locks {root.full_lock}/{root.swa_lock}")
        stack = [root]
        while stack:
            n = stack.pop()
            if n.id in reachable:
                v.append(f"node {n.id} reached twice (cycle or shared child)")
                continue
            reachable[n.id] = n
            if n.ns is not ns:
                v.append(f"node {n.id} belongs to namespace {getattr(n.ns, 'name', None)!r}, "
                         f"found under {name!r}")
            dev_children = 0
            for key, c in (n.children or {}).items():
                if c.parent is not n:
                    v.append(f"node {c.id}: parent pointer does not point at {n.id}")
                if key != c.tokens[:pb]:
                    v.append(f"node {c.id}: registered under a key that is not its first page")
                if c.full is not None:
                    dev_children += 1
                stack.append(c)
            if n.children is not None and not n.children:
                v.append(f"node {n.id}: empty children dict (must be None)")
            if n.dev_children != dev_children:
                v.append(f"node {n.id}: dev_children={n.dev_children}, recount {dev_children}")
            if n.parent is not None:
                _check_node(tree, n, v, deep)
                for p in n.full or ():
                    full_owner[p] += 1
                for p in n.swa or ():
                    swa_owner[p] += 1
                for p in n.host or ():
                    host_owner[p] += 1
                for p in n.host_swa or ():
                    if p:
                        host_swa_owner[p] += 1

    a.nodes = len(reachable)
    if set(reachable) != set(tree.nodes):
        ghosts = sorted(set(tree.nodes) - set(reachable))[:10]
        lost = sorted(set(reachable) - set(tree.nodes))[:10]
        v.append(f"node registry disagrees with the tree: unreachable {ghosts}, "
                 f"unregistered {lost}")
    for k, i in tree.nodes.items():
        if i.id != k:
            v.append(f"node registry maps {k} to node {i.id}")
    if tree.awaiting_copy:  # a two-phase eviction must be committed before anything else runs
        v.append(f"eviction left half-done: nodes {[n.id for n in tree.awaiting_copy][:10]} "
                 "await a host copy")

    for pool, owners in (("full", full_owner), ("swa", swa_owner), ("host", host_owner),
                         ("host swa", host_swa_owner)):
        dup = [p for p, c in owners.items() if c > 1]
        if dup:
            v.append(f"{pool} pages owned by more than one node: {sorted(dup)[:10]}")
        bad = [p for p in owners if p <= 0]
        if bad:
            v.append(f"{pool} page ids <= 0 in the tree: {sorted(bad)[:10]}")
    a.full_pages = set(full_owner)
    a.swa_pages = set(swa_owner)
    a.host_slots = set(host_owner)
    a.host_swa_slots = set(host_swa_owner)

    _check_locks(tree, reachable, v)
    _check_queues(tree, reachable, v)
    _check_counters(tree, reachable, v)
    return a


def _check_node(tree: RadixTree, n: Node, v: list[str], deep: bool) -> None:
    pb = tree.page_bytes
    if not n.tokens or len(n.tokens) % pb:
        v.append(f"node {n.id}: {len(n.tokens)} token bytes is not a positive number of pages")
        return
    np_ = len(n.tokens) // pb
    if n.depth != n.parent.depth + len(n.tokens) // 4:
        v.append(f"node {n.id}: depth {n.depth} is not its parent's plus its own length")
    if len(n.hashes) != np_ * HASH_BYTES:
        v.append(f"node {n.id}: {len(n.hashes)} hash bytes for {np_} pages")
    elif deep:
        parent = n.parent
        prev = parent.hashes[-HASH_BYTES:] if parent.parent is not None else n.ns.seed
        if chain_hashes(prev, n.tokens, pb) != n.hashes:
            v.append(f"node {n.id}: page hashes do not chain from its parent")
    if n.full is None and n.host is None:
        v.append(f"node {n.id}: dead (no full KV on device or host)")
    if n.swa is not None and n.full is None:
        v.append(f"node {n.id}: SWA KV without full KV on device")
    if n.swa is not None and not tree.swa_enabled:
        v.append(f"node {n.id}: SWA pages in a model without SWA layers")
    for label, arr in (("full", n.full), ("swa", n.swa), ("host", n.host),
                       ("host swa", n.host_swa)):
        if arr is not None and len(arr) != np_:
            v.append(f"node {n.id}: {len(arr)} {label} ids for {np_} pages")
    parent = n.parent
    if n.full is not None and parent.full is None:
        v.append(f"node {n.id}: on device under a parent that is not (prefix closure)")
    if n.host_swa is not None and (n.host is None or not any(n.host_swa)):
        v.append(f"node {n.id}: host SWA copies without a host copy, or an all-zero list")
    if n.host is not None and parent.host is None:
        v.append(f"node {n.id}: host copy under a parent without one (prefix closure)")
    if (tree.swa_enabled and n.full is not None and n.swa is None and n.dev_children == 0
            and n.full_lock == 0 and n.pin == 0):
        v.append(f"node {n.id}: unlocked tombstone left as a device leaf")
    if n.full is None and n.full_lock:
        v.append(f"node {n.id}: locked but not on device")


def _check_locks(tree: RadixTree, reachable: dict[int, Node], v: list[str]) -> None:
    full: Counter[int] = Counter()
    swa: Counter[int] = Counter()
    pb = tree.page_bytes
    for r in tree.receipts:
        if not r.active:
            v.append(f"inactive receipt still registered: {r!r}")
            continue
        a = r.anchor
        if reachable.get(a.id) is not a:
            v.append(f"receipt anchored at node {a.id}, which is not in the tree")
            continue
        n = a
        while n.parent is not None:
            full[n.id] += 1
            n = n.parent
        left = r.swa_pages
        n = a
        while left > 0 and n.parent is not None:
            swa[n.id] += 1
            left -= len(n.tokens) // pb
            n = n.parent
        if left != 0:
            v.append(f"receipt {r!r}: SWA segment does not end on a node boundary")
    for n in reachable.values():
        if n.full_lock < 0 or n.swa_lock < 0:
            v.append(f"node {n.id}: negative lock count {n.full_lock}/{n.swa_lock}")
        if n.full_lock < n.swa_lock:
            v.append(f"node {n.id}: full lock {n.full_lock} < SWA lock {n.swa_lock}")
        if n.parent is None:
            continue
        if n.full_lock != full[n.id] or n.swa_lock != swa[n.id]:
            v.append(f"node {n.id}: locks {n.full_lock}/{n.swa_lock}, receipts account for "
                     f"{full[n.id]}/{swa[n.id]} (a lost or doubled receipt)")
        if n.swa_lock and n.swa is None:
            v.append(f"node {n.id}: SWA-locked tombstone")
    pins: Counter[int] = Counter()
    host_pins: Counter[int] = Counter()
    for p in tree.pins:
        a = p.anchor
        if not p.active or reachable.get(a.id) is not a:
            v.append(f"pin {p!r}: inactive, or anchored at a node not in the tree")
            continue
        count = host_pins if p.host_only else pins
        while a.parent is not None:
            count[a.id] += 1
            a = a.parent
    for n in reachable.values():
        if n.parent is not None and (n.pin, n.host_pin) != (pins[n.id], host_pins[n.id]):
            v.append(f"node {n.id}: pin counts {n.pin}/{n.host_pin}, pins in flight account "
                     f"for {pins[n.id]}/{host_pins[n.id]}")


def _check_queues(tree: RadixTree, reachable: dict[int, Node], v: list[str]) -> None:
    pol = tree.policy
    keys = {"full": pol.full_key, "swa": pol.swa_key, "host": pol.host_key}
    for name, ns in tree.namespaces.items():
        every = [n for n in reachable.values() if n.parent is not None and n.ns is ns]
        nodes = [n for n in every if not n.pin]  # a pinned node is in no queue
        want = {
            "full": {n.id for n in nodes
                     if n.full is not None and n.full_lock == 0 and n.dev_children == 0},
            "swa": {n.id for n in nodes
                    if tree.swa_enabled and n.swa is not None and n.swa_lock == 0},
            "host": {n.id for n in nodes
                     if n.full is None and n.host is not None and not n.children
                     and not n.host_pin},
        }
        for label, q in (("full", ns.full_q), ("swa", ns.swa_q), ("host", ns.host_q)):
            _check_queue(f"{name}/{label}", q, want[label], keys[label], reachable, v)
        nodes = every
        counted = (ns.full_pages, ns.swa_pages, ns.host_pages)
        full = sum(len(n.full) for n in nodes if n.full is not None)
        swa = sum(len(n.swa) for n in nodes if n.swa is not None)
        host = sum(len(n.host) for n in nodes if n.host is not None)
        if counted != (full, swa, host):
            v.append(f"namespace {name!r}: page counts {counted}, recomputed {(full, swa, host)}")


def _check_queue(label: str, q: EvictionQueue, want: set[int], key: Callable[[Node], Any],
                 reachable: dict[int, Node], v: list[str]) -> None:
    live = [e for e in q.heap if e[2] is not None]
    ids = [e[2].id for e in live]
    if len(ids) != len(set(ids)):
        v.append(f"{label} queue holds a node twice")
    if q.live != len(live):
        v.append(f"{label} queue counts {q.live} live entries, holds {len(live)}")
    got = set(ids)
    if got != want:
        v.append(f"{label} queue holds {sorted(got - want)[:10]} that are not eligible and misses "
                 f"{sorted(want - got)[:10]}")
    for e in live:
        n = e[2]
        if reachable.get(n.id) is not n:
            v.append(f"{label} queue holds node {n.id}, which is not in the tree")
        elif getattr(n, q.attr) is not e:
            v.append(f"{label} queue entry of node {n.id} is not the node's live entry")
        elif e[0] != key(n):
            v.append(f"{label} queue orders node {n.id} by a stale key {e[0]} (now {key(n)})")
    heap = q.heap
    for i in range(1, len(heap)):
        if heap[(i - 1) // 2][:2] > heap[i][:2]:
            v.append(f"{label} queue lost its heap order at {i}")
            break


def _check_counters(tree: RadixTree, reachable: dict[int, Node], v: list[str]) -> None:
    fe = fp = se = sp = hp = hs = 0
    for n in reachable.values():
        if n.parent is None:
            continue
        np_ = len(n.tokens) // tree.page_bytes
        if n.full is not None:  # a pin guards pages like a lock
            if n.full_lock or n.pin:
                fp += np_
            else:
                fe += np_
        if n.swa is not None:
            if n.swa_lock or n.pin:
                sp += np_
            else:
                se += np_
        if n.host is not None:
            hp += np_
        if n.host_swa is not None:
            hs += sum(1 for p in n.host_swa if p)
    got = (tree.full_evictable, tree.full_protected, tree.swa_evictable, tree.swa_protected,
           tree.host_pages, tree.host_swa_pages)
    if got != (fe, fp, se, sp, hp, hs):
        v.append(f"page counters (full evictable/protected, swa evictable/protected, host, "
                 f"host swa) are {got}, recomputed {(fe, fp, se, sp, hp, hs)}")
