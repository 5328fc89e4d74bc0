"""Locks (engine readers) and pins (tier copies): what keeps pages from being evicted."""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Iterator
from typing import Any

from .errors import NodeNotUsable, ReceiptError
from .node import Node, Pin, Receipt


class Locking:
    """Locks and pins of :class:`~daemon.tree.radix.RadixTree` (a mixin: it
    shares the tree's state)."""

    # ------------------------------------------------------------------ locks

    def lock(self, node_id: int, namespace: str | None = None, tag: Any = None) -> Receipt:
        """Protect the path ending at a node; the node must be a usable match end."""
        node = self.get_node(node_id, namespace)
        if not self.is_usable_end(node):
            raise NodeNotUsable(
                f"node {node_id} cannot be locked: its sliding window (or device copy) was "
                "evicted; match again")
        return self._lock(node, tag)

    def _lock(self, node: Node, tag: Any = None) -> Receipt:
        n = node
        while n.parent is not None:
            if n.full_lock == 0 and not n.pin:
                np_ = len(n.tokens) // self.page_bytes
                self.full_evictable -= np_
                self.full_protected += np_
                if n.full_entry is not None:
                    n.ns.full_q.remove(n)
            n.full_lock += 1
            n = n.parent
        covered = 0
        if self.swa_enabled:
            need = self.window_pages
            n = node
            pb = self.page_bytes
            while n.parent is not None and covered < need and n.swa is not None:
                np_ = len(n.tokens) // pb
                if covered + np_ > need:
                    self._split(n, np_ - (need - covered))
                    np_ = need - covered
                if n.swa_lock == 0 and not n.pin:
                    self.swa_evictable -= np_
                    self.swa_protected += np_
                    if n.swa_entry is not None:
                        n.ns.swa_q.remove(n)
                n.swa_lock += 1
                covered += np_
                n = n.parent
        r = Receipt(node, covered, tag)
        self.receipts.add(r)
        return r

    def release_swa(self, receipt: Receipt) -> None:
        """Early SWA-only release (decode past the window); the full lock stays."""
        if not receipt.active or receipt.swa_released:
            raise ReceiptError("the SWA part of this lock was already released")
        self._release_swa(receipt)
        receipt.swa_released = True

    def _release_swa(self, r: Receipt, times: int = 1) -> None:
        """Release ``r``'s SWA locks ``times`` times over (receipts alike in anchor and SWA
        pages, released together)."""
        left = r.swa_pages
        n = r.anchor
        pb = self.page_bytes
        while left > 0:
            np_ = len(n.tokens) // pb
            if n.swa_lock < times or n.swa is None or n.parent is None:
                raise AssertionError(f"SWA release walked onto an unlocked node {n!r} for {r!r}")
            n.swa_lock -= times
            if n.swa_lock == 0 and not n.pin:
                self.swa_protected -= np_
                self.swa_evictable += np_
                self._requeue(n)
            left -= np_
            n = n.parent
        if left != 0:
            raise AssertionError(f"SWA release of {r!r} ended off a node boundary")
        r.swa_pages = 0

    def unlock(self, receipt: Receipt) -> None:
        """Release exactly what the receipt took; a second release is refused."""
        if not receipt.active:
            raise ReceiptError("this lock was already released")
        if not receipt.swa_released:
            self._release_swa(receipt)
        anchor = receipt.anchor
        n = anchor
        while n.parent is not None:
            if n.full_lock <= 0:
                raise AssertionError(f"full release walked onto an unlocked node {n!r}")
            n.full_lock -= 1
            if n.full_lock == 0 and not n.pin:
                self._full_unguarded(n)
            n = n.parent
        receipt.active = False
        self.receipts.discard(receipt)
        if anchor.full_lock == 0:  # (only an unlocked node can be a dead leaf)
            self._drop_dead_leaf(anchor)

    def unlock_all(self, receipts: Collection[Receipt]) -> None:
        """Release every one of ``receipts`` (a session that ended): what one :meth:`unlock`
        each would leave, but each node of their paths is visited once, not once per receipt
        through it. A session's thousands of locks on one deep path (pages of one token) cost
        seconds of the event loop one at a time. All of them are checked before anything moves."""
        rs = list({id(r): r for r in receipts}.values())
        if any(not r.active for r in rs):
            raise ReceiptError("one of these locks was already released")
        alike: dict[tuple[int, int], list[Receipt]] = {}
        for r in rs:
            if not r.swa_released:
                alike.setdefault((r.anchor.id, r.swa_pages), []).append(r)
        for group in alike.values():
            self._release_swa(group[0], len(group))
            for r in group:
                r.swa_pages = 0
        for n, k in _path_totals((r.anchor, 1) for r in rs):
            if n.full_lock < k:
                raise AssertionError(f"full release walked onto an unlocked node {n!r}")
            n.full_lock -= k
            if n.full_lock == 0 and not n.pin:
                self._full_unguarded(n)
        for r in rs:
            r.active = False
            self.receipts.discard(r)
        anchors = {r.anchor.id: r.anchor for r in rs}
        for a in sorted(anchors.values(), key=lambda n: -n.depth):  # a leaf's cleanup climbs
            if a.full_lock == 0 and self.nodes.get(a.id) is a:
                self._drop_dead_leaf(a)

    def _full_unguarded(self, n: Node) -> None:
        """``n``'s last lock went and no pin guards it: its pages are evictable again."""
        np_ = len(n.tokens) // self.page_bytes
        self.full_protected -= np_
        self.full_evictable += np_
        self._requeue(n)

    # ------------------------------------------------------------------ pins (tier copies)

    def pin(self, anchor: Node, host_only: bool = False) -> Pin:
        """Keep every page of the path root..anchor where it is while a tier copy runs
        (``host_only``: only the host copies, for a fetch that attaches below them)."""
        n = anchor
        pb = self.page_bytes
        while n.parent is not None:
            if host_only:
                n.host_pin += 1
                if n.host_pin == 1:
                    self._requeue(n)
            else:
                n.pin += 1
                if n.pin == 1:
                    self._guard(n, len(n.tokens) // pb)
                    self._unqueue(n)
            n = n.parent
        p = Pin(anchor, host_only)
        self.pins.add(p)
        return p

    def _guard(self, n: Node, np_: int) -> None:
        """A pin starts (``np_`` > 0) or ends (< 0) on ``n``: its pages no lock guards move
        between evictable and protected."""
        if n.full is not None and not n.full_lock:
            self.full_evictable -= np_
            self.full_protected += np_
        if n.swa is not None and not n.swa_lock:
            self.swa_evictable -= np_
            self.swa_protected += np_

    def unpin(self, p: Pin) -> None:
        if not p.active:
            raise ReceiptError("this pin was already released")
        n = p.anchor
        pb = self.page_bytes
        freed: list[Node] = []  # nodes no pin guards now, lowest first
        while n.parent is not None:
            if (n.host_pin if p.host_only else n.pin) <= 0:
                raise AssertionError(f"unpin walked onto an unpinned node {n!r} for {p!r}")
            if p.host_only:
                n.host_pin -= 1
                if n.host_pin == 0:
                    self._requeue(n)
            else:
                n.pin -= 1
                if n.pin == 0:
                    self._guard(n, -(len(n.tokens) // pb))
                    self._requeue(n)
                    freed.append(n)
            n = n.parent
        p.active = False
        self.pins.discard(p)
        # an ancestor may have lost its last device child while pinned (its pinned child can be
        # host-only): every node the pin guarded is checked, not only the anchor
        for n in freed:
            if self.nodes.get(n.id) is n:
                self._drop_dead_leaf(n)


def _path_totals(counted: Iterable[tuple[Node, int]]) -> Iterator[tuple[Node, int]]:
    """Every node on the paths from the ``counted`` nodes up to their root (the root left out),
    once, deepest first, with the sum of the counts of the nodes at or below it: what one walk
    to the root per count would add to each node, in one visit per node of the paths' union
    (thousands of locks on a path thousands of nodes deep cost seconds walked one by one). A
    node is given only once every node below it was; the paths must not change meanwhile."""
    owed: dict[int, int] = {}
    heap: list[tuple[int, int, Node]] = []
    for n, k in counted:
        if n.parent is None:
            continue
        if n.id not in owed:
            owed[n.id] = 0
            heapq.heappush(heap, (-n.depth, n.id, n))  # a child is deeper than its parent
        owed[n.id] += k
    while heap:
        _, _, n = heapq.heappop(heap)
        k = owed.pop(n.id)
        yield n, k
        p = n.parent
        if p.parent is not None:
            if p.id not in owed:
                owed[p.id] = 0
                heapq.heappush(heap, (-p.depth, p.id, p))
            owed[p.id] += k
