"""Eviction queues: a min-heap of eligible nodes with lazy invalidation.

Eligibility changes (lock, unlock, a child evicted) insert nodes with old timestamps in the middle
of the order, which an intrusive LRU list can only do in O(n). A heap does it in O(log n); an entry
is invalidated in O(1) by clearing its node slot, and the heap is compacted when dead entries
outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from .node import Node


class EvictionQueue:
    """Nodes eligible for one kind of eviction, ordered by (priority, insertion order)."""

    __slots__ = ("attr", "heap", "live", "_seq")

    def __init__(self, attr: str) -> None:
        self.attr = attr  # the Node slot that holds this queue's live entry
        self.heap: list[list] = []
        self.live = 0
        self._seq = 0  # tie-break: unique per entry, so entries never compare their nodes

    def __len__(self) -> int:
        return self.live

    def push(self, node: Node, key: float) -> None:
        old = getattr(node, self.attr)
        if old is not None:
            if old[0] == key:
                return
            old[2] = None
            self.live -= 1
        self._seq += 1
        entry = [key, self._seq, node]
        setattr(node, self.attr, entry)
        heapq.heappush(self.heap, entry)
        self.live += 1
        if len(self.heap) > 2 * self.live + 64:
            self._compact()

    def remove(self, node: Node) -> None:
        entry = getattr(node, self.attr)
        if entry is not None:
            entry[2] = None
            setattr(node, self.attr, None)
            self.live -= 1

    def pop(self) -> Node | None:
        heap = self.heap
        while heap:
            entry = heapq.heappop(heap)
            node = entry[2]
            if node is not None:
                setattr(node, self.attr, None)
                self.live -= 1
                return node
        return None

    def peek(self) -> Node | None:
        heap = self.heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def nodes(self) -> Iterator[Node]:
        """Live nodes in no particular order (for the checker and for scans)."""
        return (e[2] for e in self.heap if e[2] is not None)

    def ordered(self) -> list[Node]:
        """Live nodes in eviction order (cost O(n log n); for the checker and debugging)."""
        return [e[2] for e in sorted(e for e in self.heap if e[2] is not None)]

    def _compact(self) -> None:
        self.heap = [e for e in self.heap if e[2] is not None]
        heapq.heapify(self.heap)
