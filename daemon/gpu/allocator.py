"""Page allocators for the device pools.

Pure bookkeeping (no torch): a free stack plus one state byte per page, so a double free or a free
of a page that was never handed out is caught instead of corrupting the free list. A request's
pages are checked and marked in C (numpy over the state bytes), not a Python step per page: at
page size 1 one request names thousands of pages. Page 0 is the padding page of every pool and is
never handed out.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from .page_runs import PageRunList, page_run_array


class AllocatorError(ValueError):
    """A free that does not match an allocation (double free, unknown page)."""

    code = "bad_page"


class OutOfPages(Exception):
    """Not enough free pages; carries the counts the caller needs to explain the failure."""

    code = "out_of_memory"

    def __init__(self, message: str, **counts: int) -> None:
        super().__init__(message)
        self.counts = counts


_FREE = 0
_USED = 1


#: pages one audit step looks at one by one (about ten microseconds)
AUDIT_STEP_PAGES = 256
#: host slots or keyed pages one audit step looks at one by one (a few dict look-ups each: p99
#: about 0.2 ms a step on the 2-core development machine; bench/host_audit_bench.py measures it)
AUDIT_STEP_SLOTS = 256


#: page state byte -> 1 where free
_FREE_MARK = bytes([1, 0] + [0] * 254)


def mark_free(marks: bytearray, pages: Iterable[int]) -> bool:
    """Mark ``pages`` (from a free list) in ``marks``; whether one was marked already (or is out
    of range: then it is not marked, and the state comparison reports it)."""
    twice = False
    n = len(marks)
    for p in pages:
        if 0 <= p < n:
            twice |= marks[p] == 1
            marks[p] = 1
    return twice


def marked_free(name: str, state: bytearray, marks: bytearray, v: list[str]
                ) -> Iterator[None]:
    """The pages ``state`` marks free are those the free lists hold (``marks``), compared a
    chunk of bytes at a time."""
    step = 64 * AUDIT_STEP_PAGES  # compared as bytes, not one by one
    for start in range(0, len(state), step):
        want = state[start:start + step].translate(_FREE_MARK)
        if want != marks[start:start + step]:
            off = [start + i for i, (x, y) in enumerate(zip(want, marks[start:start + step],
                                                            strict=True)) if x != y]
            v.append(f"{name}: free list and page states disagree on {off[:10]}")
            return
        yield


#: entries of a page table (one int per page of a pool) a checker step reads at once with numpy
#: (tens of microseconds)
TABLE_SCAN_STEP = 1 << 16

#: page ids from which one numpy call beats a Python step per id (numpy costs a few
#: microseconds a call whatever the length; a Python step about 50 ns)
VECTOR_MIN = 128


def as_page_array(pages: Iterable[int]) -> array:
    """``pages`` as an int32 array (itself when it is one). A node's runs (the tree keeps them as
    a ``range`` or a ``PageRunList``: daemon/gpu/page_runs.py) are listed in numpy."""
    if isinstance(pages, array) and pages.typecode == "i":
        return pages
    if (type(pages) is range and pages.step == 1) or type(pages) is PageRunList:
        return page_run_array(pages)
    return array("i", pages)


def page_ids(pages: array) -> np.ndarray:
    """An int32 array of page ids as a numpy array over the same memory (no copy). Drop it
    before the array is resized: an exported array refuses to grow."""
    return np.frombuffer(pages, dtype=np.int32) if len(pages) else np.zeros(0, np.int32)


def nonzero_ids(pages: array) -> array:
    """``pages`` without its zeros (no SWA page, in a request's SWA ids)."""
    out = array("i")
    if len(pages) < VECTOR_MIN:
        if 0 not in pages:
            return pages
        out.extend(p for p in pages if p)
    else:
        ids = page_ids(pages)
        if ids.all():
            return pages
        out.frombytes(ids[ids != 0].tobytes())
    return out


def ascending(pages: array) -> array:
    """``pages`` sorted, as a new int32 array. A stable sort (timsort) merges the ascending runs
    an allocation is made of in one pass: about a tenth of the default quicksort's time for a
    few runs."""
    out = array("i")
    out.frombytes(np.sort(page_ids(pages), kind="stable").tobytes())
    return out


def ascends(ids: np.ndarray) -> bool:
    """Whether the ids rise strictly: then none occurs twice, the first is the least and the
    last the greatest. An allocation of ``VECTOR_MIN`` pages or more hands them out so (and
    nodes keep its runs), so one comparison pass saves the sort that finding duplicates
    otherwise takes."""
    return len(ids) < 2 or bool((ids[1:] > ids[:-1]).all())


def has_duplicates(pages: array) -> bool:
    """Whether an id occurs twice."""
    if len(pages) < VECTOR_MIN:
        return len(set(pages)) != len(pages)
    ids = page_ids(pages)
    return not ascends(ids) and _repeats(ids)


def _repeats(ids: np.ndarray) -> bool:
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


def set_states(state: bytearray, pages: array, value: int) -> None:
    """``state[p] = value`` for every page of ``pages`` (valid ids)."""
    if len(pages) < VECTOR_MIN:
        for p in pages:
            state[p] = value
    else:
        np.frombuffer(state, dtype=np.uint8)[page_ids(pages)] = value


def check_allocated(name: str, state: bytearray, pages: array) -> bool:
    """Raise unless every page is a page of the pool marked used in ``state`` (one byte a page,
    page 0 the padding page) and listed once: the validation of a free, before any change. A
    long list is checked in numpy first; only one that fails is walked page by page, for the
    message about its first bad page. Returns whether the list is one of ``VECTOR_MIN`` ids or
    more that rises strictly (:func:`ascends`), which the free goes on to use."""
    cap = len(state)
    if len(pages) >= VECTOR_MIN:
        ids = page_ids(pages)
        once = ascends(ids)
        lo, hi = (ids[0], ids[-1]) if once else (ids.min(), ids.max())
        if (0 < int(lo) and int(hi) < cap
                and (np.frombuffer(state, dtype=np.uint8)[ids] == _USED).all()
                and (once or not _repeats(ids))):
            return once
    seen: set[int] = set()
    for p in pages:
        if not 0 < p < cap:
            raise AllocatorError(f"{name}: page {p} is not a page of this pool (1..{cap - 1})")
        if state[p] != _USED:
            raise AllocatorError(f"{name}: page {p} is not allocated (double free?)")
        if p in seen:
            raise AllocatorError(f"{name}: page {p} listed twice in one free")
        seen.add(p)
    return False


class PageAllocator:
    """Hands out page ids 1..capacity-1 of one pool."""

    def __init__(self, capacity: int, name: str = "pool") -> None:
        if capacity < 1:
            raise ValueError(f"{name}: capacity must be >= 1 page (page 0 is reserved), "
                             f"got {capacity}")
        self.name = name
        self.capacity = capacity
        self._state = bytearray(capacity)
        self._state[0] = _USED  # the padding page is permanently taken
        # pop() hands out low ids first, which keeps early allocations compact
        self._free = array("i", range(capacity - 1, 0, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def usable(self) -> int:
        """Pages that can ever be handed out (capacity minus the padding page)."""
        return self.capacity - 1

    def alloc(self, n: int) -> array:
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} pages")
        free = self._free
        if n > len(free):
            raise OutOfPages(f"{self.name}: {n} pages requested, {len(free)} free",
                             requested=n, available=len(free))
        out = free[len(free) - n :]
        del free[len(free) - n :]
        out.reverse()  # as n single pops give: ascending runs, as SegmentedAllocator hands out
        set_states(self._state, out, _USED)
        return out

    def check_free(self, pages: Iterable[int]) -> None:
        """Raise unless every page is allocated and listed once (validation before any change)."""
        check_allocated(self.name, self._state, as_page_array(pages))

    def free(self, pages: Iterable[int]) -> None:
        pages = as_page_array(pages)
        check_allocated(self.name, self._state, pages)
        set_states(self._state, pages, _FREE)
        self._free.extend(pages[::-1])  # a run freed ascending is handed out ascending again

    def free_set(self) -> set[int]:
        return set(self._free)

    def audit(self) -> list[str]:
        """Free list and state bytes agree, with no duplicate in the free list."""
        v: list[str] = []
        for _ in self.audit_steps(v):
            pass
        return v

    def audit_steps(self, v: list[str], marks: bytearray | None = None) -> Iterator[None]:
        """:meth:`audit` into ``v`` in steps of :data:`AUDIT_STEP_PAGES` pages (the daemon runs
        them between requests: daemon/checker.py); ``marks`` (``capacity`` zero bytes) is left
        with a 1 for every page on the free list."""
        marks = bytearray(self.capacity) if marks is None else marks  # 1: on a free list
        twice = False
        free = self._free
        for start in range(0, len(free), AUDIT_STEP_PAGES):
            twice |= mark_free(marks, free[start:start + AUDIT_STEP_PAGES])
            yield
        if twice:
            v.append(f"{self.name}: the free list holds a page twice")
        if self._state[0] != _USED or marks[0]:
            v.append(f"{self.name}: the padding page 0 is free")
        yield from marked_free(self.name, self._state, marks, v)


class PairedAllocator:
    """Full and SWA pages taken together: an allocation never gets one without the other.

    It is also the tree's page sink, so everything the tree lets go of returns here.
    """

    def __init__(self, full_capacity: int, swa_capacity: int) -> None:
        self.full = PageAllocator(full_capacity, "full pool")
        self.swa = PageAllocator(swa_capacity, "swa pool") if swa_capacity else None

    def alloc(self, n: int) -> tuple[array, array]:
        swa_avail = self.swa.available if self.swa is not None else n
        if n > self.full.available or n > swa_avail:
            raise OutOfPages(
                f"{n} pages requested; free: full {self.full.available}, swa {swa_avail}",
                requested=n, full_available=self.full.available, swa_available=swa_avail)
        full = self.full.alloc(n)
        swa = self.swa.alloc(n) if self.swa is not None else array("i")
        return full, swa

    def free_full(self, pages: Sequence[int]) -> None:
        self.full.free(pages)

    def free_swa(self, pages: Sequence[int]) -> None:
        if self.swa is None:
            if len(pages):
                raise AllocatorError("this model has no SWA pool")
            return
        self.swa.free(pages)
