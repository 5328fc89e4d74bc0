"""The tree's page sink: where every page the tree lets go of returns (the allocators), and the
watches that tell a background copy which of the device pages it reads were freed under it."""

from __future__ import annotations

from collections.abc import Iterable

from .gpu.allocator import freed_pages
from .gpu.segments import PairedSegmentAllocator
from .tree import PageIds


class Watch:
    """Device pages a background copy reads; those the tree frees meanwhile are tainted."""

    __slots__ = ("full", "swa", "tainted_full", "tainted_swa")

    def __init__(self, full: Iterable[int], swa: Iterable[int]) -> None:
        self.full = set(full)
        self.swa = set(swa)
        self.tainted_full: set[int] = set()
        self.tainted_swa: set[int] = set()


class TreeSink:
    """The tree's page sink: the allocators, plus the watches of copies in flight."""

    def __init__(self, alloc: PairedSegmentAllocator) -> None:
        self.alloc = alloc
        self.watches: list[Watch] = []

    def free_full(self, pages: PageIds) -> None:
        if self.watches:  # a node's runs listed once, for every watch and for the free
            pages = freed_pages(pages)
            for w in self.watches:
                w.tainted_full.update(w.full.intersection(pages))
        self.alloc.free_full(pages)

    def free_swa(self, pages: PageIds) -> None:
        if self.watches:  # a node's runs listed once, for every watch and for the free
            pages = freed_pages(pages)
            for w in self.watches:
                w.tainted_swa.update(w.swa.intersection(pages))
        self.alloc.free_swa(pages)

    def watch(self, full: Iterable[int], swa: Iterable[int]) -> Watch:
        w = Watch(full, swa)
        self.watches.append(w)
        return w

    def unwatch(self, w: Watch) -> tuple[set[int], set[int]]:
        self.watches.remove(w)
        return w.tainted_full, w.tainted_swa
