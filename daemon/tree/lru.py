"""Eviction queues: a min-heap of eligible nodes with lazy invalidation and lazy refresh.

Eligibility changes (lock, unlock, a child evicted) insert nodes with old timestamps in the middle
of the order, which an intrusive LRU list can only do in O(n). A heap does it in O(log n); an entry
is invalidated in O(1) by clearing its node slot, and the heap is compacted when dead entries
outnumber live ones.

A use of a node (a match or an insert through it) only raises its key: the node's timestamp
moves, its entry stays where it was. An entry's key is therefore at most its node's key, and
:meth:`EvictionQueue.pop` takes the least entry whose key is still its node's, queueing the
others again by their keys now: a victim of the same least key as an eager queue's (between
equal keys the order may differ), for one heap operation per refreshed node that reaches the
top instead of one per use (a match touches every node on its path; few are ever evicted).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any

from .node import Node


class EvictionQueue:
    """Nodes eligible for one kind of eviction, ordered by (priority, insertion order)."""

    __slots__ = ("attr", "key", "heap", "live", "_seq")

    def __init__(self, attr: str, key: Callable[[Node], Any]) -> None:
        self.attr = attr  # the Node slot that holds this queue's live entry
        #: a node's priority now (the policy's); never less than its entry's, see the module
        self.key = key
        self.heap: list[list] = []
        self.live = 0
        self._seq = 0  # tie-break: unique per entry, so entries never compare their nodes

    def __len__(self) -> int:
        return self.live

    def push(self, node: Node, key: Any) -> None:
        """``key``: the policy's key for this queue, compared as it is (the SWA queue's is a
        tuple)."""
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
        entry = self.top()
        if entry is None:
            return None
        heapq.heappop(self.heap)
        node = entry[2]
        setattr(node, self.attr, None)
        self.live -= 1
        return node

    def peek(self) -> Node | None:
        entry = self.top()
        return entry[2] if entry is not None else None

    def top(self) -> list | None:
        """The entry :meth:`pop` would take, ``[key, seq, node]`` (None when empty): dead entries
        above it dropped, refreshed ones queued again by their keys now."""
        heap = self.heap
        key = self.key
        while heap:
            entry = heap[0]
            node = entry[2]
            if node is None:
                heapq.heappop(heap)
                continue
            k = key(node)
            if k == entry[0]:
                return entry
            self._seq += 1  # the node was used since it was queued: in line after those
            entry[0] = k  # queued before that use
            entry[1] = self._seq
            heapq.heapreplace(heap, entry)
        return None

    def nodes(self) -> Iterator[Node]:
        """Live nodes in no particular order (for the checker and for scans)."""
        return (e[2] for e in self.heap if e[2] is not None)

    def _compact(self) -> None:
        self.heap = [e for e in self.heap if e[2] is not None]
        heapq.heapify(self.heap)
