"""The tree's page sink: where every page the tree lets go of returns (the allocators), and the
watches that tell a background copy which of the device pages it reads were freed under it.

A freed page goes back to the allocator at once, and from there to any namespace's next
``alloc`` (its segment, once empty, to another tenant, who writes into it). So when the tree
frees a page that a copy running off the loop still reads, the sink first waits for that copy
(a bounded job, waited for on the event loop): otherwise the copy would read the next owner's
KV into the copying tenant's host slots, which that tenant maps. The copies of the nodes whose
pages were freed (and of those below them in the job) are then dropped as tainted."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from .gpu.allocator import freed_pages
from .gpu.segments import PairedSegmentAllocator
from .tree import PageIds


class Watch:
    """Device pages a background copy reads; those the tree frees meanwhile are tainted."""

    __slots__ = ("full", "swa", "tainted_full", "tainted_swa", "reader", "waits")

    def __init__(self, full: Iterable[int], swa: Iterable[int]) -> None:
        self.full = set(full)
        self.swa = set(swa)
        self.tainted_full: set[int] = set()
        self.tainted_swa: set[int] = set()
        #: the copy in flight that reads the pages (``wait()`` blocks until it is done)
        self.reader: Any = None
        self.waits = 0  # frees that waited for the reader

    def settle(self) -> None:
        """Wait for the reader before a page it reads goes back to the allocator. What the
        copy raised is its owner's to see (it awaits the same copy)."""
        reader, self.reader = self.reader, None
        if reader is None:
            return
        with contextlib.suppress(Exception):  # (a CUDA error raises from query() too)
            if not reader.finished():
                self.waits += 1
                reader.wait()


class TreeSink:
    """The tree's page sink: the allocators, plus the watches of copies in flight."""

    def __init__(self, alloc: PairedSegmentAllocator) -> None:
        self.alloc = alloc
        self.watches: list[Watch] = []

    def free_full(self, pages: PageIds) -> None:
        if self.watches:  # a node's runs listed once, for every watch and for the free
            pages = freed_pages(pages)
            for w in self.watches:
                hit = w.full.intersection(pages)
                if hit:
                    w.tainted_full.update(hit)
                    w.settle()
        self.alloc.free_full(pages)

    def free_swa(self, pages: PageIds) -> None:
        if self.watches:  # a node's runs listed once, for every watch and for the free
            pages = freed_pages(pages)
            for w in self.watches:
                hit = w.swa.intersection(pages)
                if hit:
                    w.tainted_swa.update(hit)
                    w.settle()
        self.alloc.free_swa(pages)

    def watch(self, full: Iterable[int], swa: Iterable[int]) -> Watch:
        w = Watch(full, swa)
        self.watches.append(w)
        return w

    def unwatch(self, w: Watch) -> tuple[set[int], set[int]]:
        self.watches.remove(w)
        return w.tainted_full, w.tainted_swa
