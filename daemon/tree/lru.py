"""Eviction queues: a min-heap of eligible nodes with lazy invalidation and lazy refresh.

Eligibility changes (lock, unlock, a child evicted) insert nodes with old timestamps in the middle
of the order, which an intrusive LRU list can only do in O(n). A heap does it in O(log n); an entry
is invalidated in O(1) by dropping its number from the live entries, and the heap is compacted
when dead entries outnumber live ones.

An entry is a tuple ``(key, seq)``, and the node it stands for is found by ``seq`` in the
queue's dict of live entries: no entry refers to its node, so an entry is no object the cyclic
garbage collector traverses (tuples of numbers are untracked after its first look), where a
``[key, seq, node]`` list was two per node for every collection to walk (docs/operations.md,
"Garbage collector pauses").

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

    __slots__ = ("attr", "key", "heap", "node_of", "_seq")

    def __init__(self, attr: str, key: Callable[[Node], Any]) -> None:
        self.attr = attr  # the Node slot that holds this queue's live entry
        #: a node's priority now (the policy's); never less than its entry's, see the module
        self.key = key
        self.heap: list[tuple[Any, int]] = []
        #: the live entries: seq -> node (an entry whose seq is not here is dead)
        self.node_of: dict[int, Node] = {}
        self._seq = 0  # tie-break: unique per entry, so entries never compare their nodes

    def __len__(self) -> int:
        return len(self.node_of)

    def push(self, node: Node, key: Any) -> None:
        """``key``: the policy's key for this queue, compared as it is (the SWA queue's is a
        tuple)."""
        old = getattr(node, self.attr)
        if old is not None:
            if old[0] == key:
                return
            del self.node_of[old[1]]
        self._seq += 1
        entry = (key, self._seq)
        setattr(node, self.attr, entry)
        heapq.heappush(self.heap, entry)
        self.node_of[self._seq] = node
        if len(self.heap) > 2 * len(self.node_of) + 64:
            self._compact()

    def remove(self, node: Node) -> None:
        entry = getattr(node, self.attr)
        if entry is not None:
            del self.node_of[entry[1]]
            setattr(node, self.attr, None)

    def pop(self) -> Node | None:
        entry = self.top()
        if entry is None:
            return None
        heapq.heappop(self.heap)
        node = self.node_of.pop(entry[1])
        setattr(node, self.attr, None)
        return node

    def peek(self) -> Node | None:
        entry = self.top()
        return self.node_of[entry[1]] if entry is not None else None

    def top(self) -> tuple[Any, int] | None:
        """The entry :meth:`pop` would take, ``(key, seq)`` (None when empty): dead entries
        above it dropped, refreshed ones queued again by their keys now."""
        heap = self.heap
        key = self.key
        node_of = self.node_of
        while heap:
            entry = heap[0]
            node = node_of.get(entry[1])
            if node is None:
                heapq.heappop(heap)
                continue
            k = key(node)
            if k == entry[0]:
                return entry
            del node_of[entry[1]]
            self._seq += 1  # the node was used since it was queued: in line after those
            entry = (k, self._seq)  # queued before that use
            node_of[self._seq] = node
            setattr(node, self.attr, entry)
            heapq.heapreplace(heap, entry)
        return None

    def nodes(self) -> Iterator[Node]:
        """Live nodes in no particular order (for the checker and for scans)."""
        return iter(self.node_of.values())

    def _compact(self) -> None:
        node_of = self.node_of
        self.heap = [e for e in self.heap if e[1] in node_of]
        heapq.heapify(self.heap)
