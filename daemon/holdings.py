"""What each session holds in one model: pages it allocated and has not yet handed on, and its
lock receipts.

Per pool, one table over all its pages says which session holds each page (a session number, 0
for none); each session's holding keeps its count and the namespaces it allocated for (whose
segments its pages lie in: in practice one, its tenant's). Handing out, checking and giving back
the pages of a request are then a few numpy operations over its page ids. At page size 1 a
request names thousands of pages, and a Python step per page (a dict or set entry each) was most
of what an insert cost the daemon. A page can have one holder only, by construction; the page
conservation check reads the tables in chunks.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np

from .gpu.allocator import VECTOR_MIN, as_page_array, nonzero_ids, page_ids
from .tree import chunked


def is_load_owner(owner: object) -> bool:
    """Whether ``owner`` is a load's copy (daemon/tier_jobs.py ``begin_load``), not a session:
    the device pages it holds are on their way into the tree."""
    return isinstance(owner, tuple) and owner[:1] == ("load",)


class PageTable:
    """The holder of every page of one pool (0: not held): an int32 array, read one id at a
    time from Python (``holder``, a memoryview) for a short list of pages and in numpy
    (``holder_np``) for a long one.

    The array is zeroed lazily (numpy's zeros take fresh pages from the kernel), so its memory
    becomes resident as pages get held, not at start: 4 bytes per page of every pool, 200 MB
    for a pool of 50M pages."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.holder_np = np.zeros(capacity, dtype=np.int32)
        self.holder = memoryview(self.holder_np).cast("B").cast("i")

    def held_in(self, number: int, start: int, stop: int) -> np.ndarray:
        """The page ids in [start, stop) that session ``number`` holds."""
        return np.flatnonzero(self.holder_np[start:stop] == number) + start


class HeldPages:
    """One session's pages of one pool: a view of the pool's table, plus its count."""

    __slots__ = ("table", "number", "count", "spaces")

    def __init__(self, table: PageTable, number: int) -> None:
        self.table = table
        self.number = number
        self.count = 0
        self.spaces: dict[str, None] = {}  # the namespaces it allocated for, in order

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[int]:
        """Its pages in id order (a scan of the whole table: for a session's end, not a
        request)."""
        return iter(self.table.held_in(self.number, 0, self.table.capacity).tolist())

    def __contains__(self, page: object) -> bool:
        return (isinstance(page, int) and 0 < page < self.table.capacity
                and self.table.holder[page] == self.number)

    def add(self, namespace: str, pages: Iterable[int]) -> None:
        """Pages newly allocated for ``namespace``, none held by anyone."""
        pages = as_page_array(pages)
        if not len(pages):
            return
        self.spaces[namespace] = None
        if len(pages) < VECTOR_MIN // 4:  # one numpy call beats this loop sooner than a check
            holder, n = self.table.holder, self.number
            for p in pages:
                holder[p] = n
        else:
            self.table.holder_np[page_ids(pages)] = self.number
        self.count += len(pages)

    def covers(self, pages: array) -> bool:
        """Whether every page of ``pages`` (distinct ids, any int32) is held here."""
        t = self.table
        n = self.number
        if len(pages) < VECTOR_MIN:
            if not pages:
                return True
            if not (0 < min(pages) and max(pages) < t.capacity):
                return False
            got = itemgetter(*pages)(t.holder)
            return got == n if len(pages) == 1 else set(got) == {n}
        ids = page_ids(pages)
        return (0 < int(ids.min()) and int(ids.max()) < t.capacity
                and bool((t.holder_np[ids] == n).all()))

    def remove(self, pages: Iterable[int]) -> None:
        """Pages that left the session (to the tree or the free list): distinct pages it holds
        (:meth:`covers`), 0 (no SWA page) skipped."""
        pages = nonzero_ids(as_page_array(pages))
        if len(pages) < VECTOR_MIN:
            holder = self.table.holder
            for p in pages:
                holder[p] = 0
        else:
            self.table.holder_np[page_ids(pages)] = 0
        self.count -= len(pages)

@dataclass
class Holding:
    """One session's share of one model."""

    full: HeldPages
    swa: HeldPages
    receipts: set[int] = field(default_factory=set)


class Holders:
    """The holdings of one model's sessions, by owner, and the numbers they go by in the
    tables (reused once a holding is gone, so the numbers stay small)."""

    def __init__(self, full_capacity: int, swa_capacity: int) -> None:
        self.full = PageTable(full_capacity)
        self.swa = PageTable(swa_capacity)
        self.by_owner: dict[object, Holding] = {}
        self._spare: list[int] = []
        self._next = 1

    def holding(self, owner: object) -> Holding:
        h = self.by_owner.get(owner)
        if h is None:
            n = self._spare.pop() if self._spare else self._next
            self._next = max(self._next, n + 1)
            h = self.by_owner[owner] = Holding(HeldPages(self.full, n), HeldPages(self.swa, n))
        return h

    def drop(self, owner: object) -> Holding | None:
        """The owner's holding, gone: its pages are held by no one (the caller hands them on,
        read first with ``array("i", h.full)``)."""
        h = self.by_owner.pop(owner, None)
        if h is not None:
            for pages in (h.full, h.swa):
                if pages.count:
                    t = pages.table
                    t.holder_np[t.holder_np == pages.number] = 0
            self._spare.append(h.full.number)
        return h

    def audit_counts_steps(self, pool: str, v: list[str], counts: np.ndarray
                           ) -> Iterator[None]:
        """Each holding's count of ``pool`` against ``counts`` (pages per holder number, from a
        scan of the table), and no page held by a number no holding has; STEP_ITEMS holdings
        a step (a daemon may serve a thousand sessions)."""
        numbers: dict[int, tuple[Hashable, int]] = {}
        for chunk in chunked(self.by_owner.items()):
            for o, h in chunk:
                numbers[getattr(h, pool).number] = (o, getattr(h, pool).count)
            yield
        for chunk in chunked(np.flatnonzero(counts).tolist()):
            for n in chunk:
                if n and n not in numbers:
                    v.append(f"{pool} pool: {int(counts[n])} pages held by session number "
                             f"{n}, which no holding has")
            yield
        for chunk in chunked(numbers.items()):
            for n, (owner, count) in chunk:
                have = int(counts[n]) if n < len(counts) else 0
                if have != count:
                    v.append(f"owner {owner!r}: its {pool} holding counts {count} pages, the "
                             f"page table gives it {have}")
            yield
