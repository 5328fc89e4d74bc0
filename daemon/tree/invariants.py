"""The tree's invariant checker: recompute everything from scratch and compare.

Every violation is collected before reporting (one report shows the whole damage, not the first
symptom). The page sets it gathers feed the pool-conservation check one layer up.

The check is written as steps (:func:`audit_steps`, a generator that yields after every bounded
piece of work: one node, a few pages re-hashed, a chunk of a queue or of a page set) so that the
daemon can run it between requests without holding a request back for more than one step
(daemon/checker.py). The steps read the tree as it is when each one runs: the caller must not
let the tree change between two steps of one pass (the checker abandons a pass when it did).
:func:`audit_tree` runs every step at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from .hashing import HASH_BYTES, block_hashes
from .lru import EvictionQueue
from .node import Node
from .page_ids import nonzero, nonzero_count
from .radix import RadixTree

#: bytes mapping a count to 1 where it is above 1 (a page seen twice), else to 0
_TWICE = bytes([0, 0] + [1] * 254)


class PageMarks:
    """How many times the walk met each page id (saturating at 255), in a bytearray indexed by
    page id: unlike a set or a Counter it never rehashes a large table in one go, so no step of
    the stepped check is long, and the pool check one layer up compares it with the free lists'
    marks a chunk of bytes at a time."""

    __slots__ = ("counts", "bad")

    def __init__(self) -> None:
        self.counts = bytearray()
        self.bad: list[int] = []  # ids <= 0

    def add(self, pages: Iterable[int]) -> None:
        c = self.counts
        for p in pages:
            if p <= 0:
                self.bad.append(p)
                continue
            if p >= len(c):
                c.extend(bytes(max(p + 1 - len(c), len(c))))
            if c[p] < 255:
                c[p] += 1

    def __contains__(self, page: int) -> bool:
        return 0 < page < len(self.counts) and self.counts[page] > 0

    def __len__(self) -> int:
        """Distinct pages met."""
        return len(self.counts) - self.counts.count(0)

    def __iter__(self) -> Iterator[int]:
        """The pages met, in order."""
        return (p for p, n in enumerate(self.counts) if n)

    def twice(self, limit: int = 10) -> list[int]:
        """Up to ``limit`` pages met more than once."""
        dup = self.counts.translate(_TWICE)
        out: list[int] = []
        i = dup.find(1)
        while i >= 0 and len(out) < limit:
            out.append(i)
            i = dup.find(1, i + 1)
        return out


@dataclass
class TreeAudit:
    violations: list[str] = field(default_factory=list)
    full_pages: PageMarks = field(default_factory=PageMarks)
    swa_pages: PageMarks = field(default_factory=PageMarks)
    host_slots: PageMarks = field(default_factory=PageMarks)
    host_swa_slots: PageMarks = field(default_factory=PageMarks)
    nodes: int = 0


#: items (pages, nodes, queue entries) one step handles at most: about ten microseconds
STEP_ITEMS = 64
#: hash blocks one step re-hashes at most (SHA-256 of 64 tokens: about 1 microsecond)
HASH_STEP_BLOCKS = 8


def check_tree(tree: RadixTree, *, deep: bool = True) -> list[str]:
    """All violated invariants of ``tree`` (empty when healthy). ``deep`` re-hashes every page."""
    return audit_tree(tree, deep=deep).violations


def audit_tree(tree: RadixTree, *, deep: bool = True) -> TreeAudit:
    """The whole audit at once (tests, SIGUSR1, ``POST /v1/check``, shutdown)."""
    a = TreeAudit()
    for _ in audit_steps(tree, a, deep=deep):
        pass
    return a


def chunked(items: Iterable[Any], n: int = STEP_ITEMS) -> Iterator[list[Any]]:
    """``items`` in lists of at most ``n``, read lazily: a step's worth of a long loop, taken
    from a live container (a dict, a set) one list a step instead of copying all of it in one
    go. The container must not change between two steps; the checker's state version gives a
    pass up when it does (daemon/checker.py), and a change it missed raises, which a complete
    check then judges."""
    it = iter(items)
    while chunk := list(islice(it, n)):
        yield chunk


def audit_steps(tree: RadixTree, a: TreeAudit, *, deep: bool = True) -> Iterator[None]:
    """The audit of :func:`audit_tree` into ``a``, yielding between bounded steps."""
    v = a.violations
    pb = tree.page_bytes
    reachable: dict[int, Node] = {}
    full_owner = a.full_pages
    swa_owner = a.swa_pages
    host_owner = a.host_slots
    host_swa_owner = a.host_swa_slots

    for name, ns in tree.namespaces.items():
        root = ns.root
        if root.parent is not None or root.tokens or root.full is None or len(root.full):
            v.append(f"namespace {name!r}: malformed root {root!r}")
        if root.full_lock or root.swa_lock:
            v.append(f"namespace {name!r}: root carries locks {root.full_lock}/{root.swa_lock}")
        stack = [root]
        while stack:
            yield
            n = stack.pop()
            if n.id in reachable:
                v.append(f"node {n.id} reached twice (cycle or shared child)")
                continue
            reachable[n.id] = n
            if n.ns is not ns:
                v.append(f"node {n.id} belongs to namespace {getattr(n.ns, 'name', None)!r}, "
                         f"found under {name!r}")
            dev_children = 0
            for chunk in chunked((n.children or {}).items()):  # a root may have thousands
                for key, c in chunk:
                    if c.parent is not n:
                        v.append(f"node {c.id}: parent pointer does not point at {n.id}")
                    if key != c.tokens[:pb]:
                        v.append(f"node {c.id}: registered under a key that is not its first "
                                 "page")
                    if c.full is not None:
                        dev_children += 1
                    stack.append(c)
                yield
            if n.children is not None and not n.children:
                v.append(f"node {n.id}: empty children dict (must be None)")
            if n.dev_children != dev_children:
                v.append(f"node {n.id}: dev_children={n.dev_children}, recount {dev_children}")
            if n.parent is not None:
                yield from _check_node(tree, n, v, deep)
                for owner, pages in ((full_owner, n.full), (swa_owner, n.swa),
                                     (host_owner, n.host)):
                    for chunk in chunked(pages or ()):
                        owner.add(chunk)
                        yield
                if n.host_swa is not None:  # 0: a page of the host copy without an SWA copy
                    host_swa_owner.add(nonzero(n.host_swa))

    a.nodes = len(reachable)
    yield
    ghosts: list[int] = []  # registered, not reachable
    for chunk in chunked(tree.nodes.items()):
        for k, i in chunk:
            if i.id != k:
                v.append(f"node registry maps {k} to node {i.id}")
            n = reachable.get(k)
            if n is None:
                ghosts.append(k)
            elif n is not i:
                v.append(f"node registry maps {k} to another object than the tree's node {k}")
        yield
    if ghosts or len(tree.nodes) != len(reachable):
        lost: list[int] = []  # reachable, not registered
        for chunk in chunked(reachable):
            lost += [k for k in chunk if k not in tree.nodes]
            yield
        v.append(f"node registry disagrees with the tree: unreachable {sorted(ghosts)[:10]}, "
                 f"unregistered {sorted(lost)[:10]}")
    if tree.awaiting_copy:  # a two-phase eviction must be committed before anything else runs
        v.append(f"eviction left half-done: nodes {[n.id for n in tree.awaiting_copy][:10]} "
                 "await a host copy")

    for pool, owners in (("full", full_owner), ("swa", swa_owner), ("host", host_owner),
                         ("host swa", host_swa_owner)):
        dup = owners.twice()
        if dup:
            v.append(f"{pool} pages owned by more than one node: {dup}")
        if owners.bad:
            v.append(f"{pool} page ids <= 0 in the tree: {sorted(owners.bad)[:10]}")
        yield

    yield from _check_locks(tree, reachable, v)
    yield from _check_queues(tree, reachable, v)
    yield from _check_counters(tree, reachable, v)


def _check_node(tree: RadixTree, n: Node, v: list[str], deep: bool) -> Iterator[None]:
    pb = tree.page_bytes
    if not n.tokens or len(n.tokens) % pb:
        v.append(f"node {n.id}: {len(n.tokens)} token bytes is not a positive number of pages")
        return
    np_ = len(n.tokens) // pb
    if n.depth != n.parent.depth + len(n.tokens) // 4:
        v.append(f"node {n.id}: depth {n.depth} is not its parent's plus its own length")
    nh = tree.hash_count(n)
    if len(n.hashes) != nh * HASH_BYTES:
        v.append(f"node {n.id}: {len(n.hashes)} hash bytes for {nh} blocks ending in it")
    elif deep and nh:
        prev, carry = tree.chain_state(n.parent)
        bb = tree.block_bytes
        first = bb - len(carry)  # bytes of this node's tokens that complete its first block
        pos = 0
        for j in range(0, nh, HASH_STEP_BLOCKS):  # each block chains from the stored one before
            k = min(HASH_STEP_BLOCKS, nh - j)
            end = first + (j + k - 1) * bb
            got = block_hashes(prev, carry if j == 0 else b"", n.tokens[pos:end], bb)
            if got != n.hashes[j * HASH_BYTES:(j + k) * HASH_BYTES]:
                v.append(f"node {n.id}: block hashes do not chain from its ancestors")
                break
            prev = got[-HASH_BYTES:]
            pos = end
            yield
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
        if type(arr) is range and (arr.step != 1 or (arr and arr.start < 1)):
            v.append(f"node {n.id}: {label} ids kept as {arr!r}, not a run of page ids")
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


def _check_locks(tree: RadixTree, reachable: dict[int, Node], v: list[str]) -> Iterator[None]:
    pb = tree.page_bytes
    # receipts and pins per anchor; then each node's count is its own anchors' plus its
    # children's, added up in one pass over the nodes children first (``reachable`` is in walk
    # order, every node after its parent), where each node is compared as soon as its count is
    # complete: bounded steps however many anchors, no reliance on ``depth``
    full: Counter[int] = Counter()
    swa: Counter[int] = Counter()
    pins: Counter[int] = Counter()
    host_pins: Counter[int] = Counter()
    # SWA windows by (anchor, SWA pages) as one int, so that no GC-tracked object is made per
    # receipt (20,000 of them set off a collection of as many, milliseconds in one step)
    spans: Counter[int] = Counter()
    for chunk in chunked(tree.receipts):
        for r in chunk:
            if not r.active:
                v.append(f"inactive receipt still registered: {r!r}")
                continue
            a = r.anchor
            if reachable.get(a.id) is not a:
                v.append(f"receipt anchored at node {a.id}, which is not in the tree")
                continue
            full[a.id] += 1
            if type(r.swa_pages) is not int or not 0 <= r.swa_pages < 1 << 32:
                v.append(f"receipt {r!r}: {r.swa_pages!r} SWA pages")
            elif r.swa_pages:
                spans[a.id << 32 | r.swa_pages] += 1
        yield
    walked = 0
    while spans:  # emptied as it goes: freeing 10,000s of entries at once is a long step too
        key, k = spans.popitem()
        aid, pages = key >> 32, key & 0xFFFFFFFF
        left = pages
        n = reachable[aid]
        while left > 0 and n.parent is not None:
            swa[n.id] += k
            left -= len(n.tokens) // pb
            n = n.parent
            walked += 1
            if walked >= STEP_ITEMS:
                walked = 0
                yield
        if left != 0:
            v.append(f"{k} receipts on node {aid} with {pages} SWA pages: the SWA segment does "
                     "not end on a node boundary")
    yield
    for chunk in chunked(tree.pins):
        for p in chunk:
            a = p.anchor
            if not p.active or reachable.get(a.id) is not a:
                v.append(f"pin {p!r}: inactive, or anchored at a node not in the tree")
                continue
            (host_pins if p.host_only else pins)[a.id] += 1
        yield
    for chunk in chunked(reversed(reachable.values())):
        for n in chunk:
            if n.full_lock < 0 or n.swa_lock < 0:
                v.append(f"node {n.id}: negative lock count {n.full_lock}/{n.swa_lock}")
            if n.full_lock < n.swa_lock:
                v.append(f"node {n.id}: full lock {n.full_lock} < SWA lock {n.swa_lock}")
            p = n.parent
            if p is None:
                continue
            i = n.id  # (popped, as the SWA spans above)
            f, s, pn, hp = full.pop(i, 0), swa.pop(i, 0), pins.pop(i, 0), host_pins.pop(i, 0)
            if n.full_lock != f or n.swa_lock != s:
                v.append(f"node {i}: locks {n.full_lock}/{n.swa_lock}, receipts account "
                         f"for {f}/{s} (a lost or doubled receipt)")
            if n.swa_lock and n.swa is None:
                v.append(f"node {i}: SWA-locked tombstone")
            if (n.pin, n.host_pin) != (pn, hp):
                v.append(f"node {i}: pin counts {n.pin}/{n.host_pin}, pins in flight "
                         f"account for {pn}/{hp}")
            if p.parent is not None:  # what passes through this node passes through its parent
                j = p.id
                if f:
                    full[j] += f
                if pn:
                    pins[j] += pn
                if hp:
                    host_pins[j] += hp
        yield


def _check_queues(tree: RadixTree, reachable: dict[int, Node], v: list[str]) -> Iterator[None]:
    pol = tree.policy
    keys = {"full": pol.full_key, "swa": pol.swa_key, "host": pol.host_key,
            "host_swa": pol.host_key}
    by_ns: dict[int, list[Node]] = {id(ns): [] for ns in tree.namespaces.values()}
    for chunk in chunked(reachable.values()):
        for n in chunk:
            if n.parent is not None and id(n.ns) in by_ns:
                by_ns[id(n.ns)].append(n)
        yield
    for name, ns in tree.namespaces.items():
        want: dict[str, set[int]] = {"full": set(), "swa": set(), "host": set(),
                                     "host_swa": set()}
        full = swa = host = 0
        for chunk in chunked(by_ns[id(ns)]):
            for n in chunk:
                if n.full is not None:
                    full += len(n.full)
                if n.swa is not None:
                    swa += len(n.swa)
                if n.host is not None:
                    host += len(n.host)
                if n.pin:  # a pinned node is in no queue
                    continue
                if n.full is not None and n.full_lock == 0 and n.dev_children == 0:
                    want["full"].add(n.id)
                if tree.swa_enabled and n.swa is not None and n.swa_lock == 0:
                    want["swa"].add(n.id)
                if (n.full is None and n.host is not None and not n.children
                        and not n.host_pin):
                    want["host"].add(n.id)
                    if n.host_swa is not None and nonzero_count(n.host_swa):
                        want["host_swa"].add(n.id)
            yield
        for label, q in (("full", ns.full_q), ("swa", ns.swa_q), ("host", ns.host_q),
                         ("host_swa", ns.host_swa_q)):
            yield from _check_queue(f"{name}/{label}", q, want[label], keys[label], reachable,
                                    v)
        counted = (ns.full_pages, ns.swa_pages, ns.host_pages)
        if counted != (full, swa, host):
            v.append(f"namespace {name!r}: page counts {counted}, recomputed {(full, swa, host)}")


def _check_queue(label: str, q: EvictionQueue, want: set[int], key: Callable[[Node], Any],
                 reachable: dict[int, Node], v: list[str]) -> Iterator[None]:
    heap = q.heap
    node_of = q.node_of
    in_heap = 0  # live entries the heap holds (each seq is unique)
    got: set[int] = set()
    twice = False
    for chunk in chunked(heap):
        for e in chunk:
            n = node_of.get(e[1])
            if n is None:  # dead
                continue
            in_heap += 1
            if n.id in got:
                twice = True
            got.add(n.id)
            if reachable.get(n.id) is not n:
                v.append(f"{label} queue holds node {n.id}, which is not in the tree")
            elif getattr(n, q.attr) != e:
                v.append(f"{label} queue entry of node {n.id} is not the node's live entry")
            elif e[0] > key(n):  # (a use raises a node's key, not its entry's: tree/lru.py)
                v.append(f"{label} queue orders node {n.id} by a key {e[0]} above its own "
                         f"({key(n)}): it would be evicted too late")
        yield
    if twice:
        v.append(f"{label} queue holds a node twice")
    if len(node_of) != in_heap:
        v.append(f"{label} queue counts {len(node_of)} live entries, its heap holds {in_heap}")
    missing: list[int] = []
    for chunk in chunked(want):  # (a set compare of 10,000s of nodes is a long step)
        missing += [i for i in chunk if i not in got]
        yield
    if missing or len(got) != len(want):
        v.append(f"{label} queue holds {sorted(got - want)[:10]} that are not eligible and misses "
                 f"{sorted(missing)[:10]}")
    for start in range(1, len(heap), STEP_ITEMS):
        if any(heap[(i - 1) // 2][:2] > heap[i][:2]
               for i in range(start, min(len(heap), start + STEP_ITEMS))):
            v.append(f"{label} queue lost its heap order")
            break
        yield


def _check_counters(tree: RadixTree, reachable: dict[int, Node], v: list[str]
                    ) -> Iterator[None]:
    fe = fp = se = sp = hp = hs = 0
    pb = tree.page_bytes
    for chunk in chunked(reachable.values()):
        for n in chunk:
            if n.parent is None:
                continue
            np_ = len(n.tokens) // pb
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
                hs += nonzero_count(n.host_swa)
        yield
    got = (tree.full_evictable, tree.full_protected, tree.swa_evictable, tree.swa_protected,
           tree.host_pages, tree.host_swa_pages)
    if got != (fe, fp, se, sp, hp, hs):
        v.append(f"page counters (full evictable/protected, swa evictable/protected, host, "
                 f"host swa) are {got}, recomputed {(fe, fp, se, sp, hp, hs)}")
