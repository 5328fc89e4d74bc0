"""Page allocators for the device pools.

Pure bookkeeping (no torch): free pages (:class:`FreePages`) plus one state byte per page, so a
double free or a free of a page that was never handed out is caught instead of corrupting the free
list. A request's pages are checked and marked in C (numpy over the state bytes), not a Python
step per page: at page size 1 one request names thousands of pages. Page 0 is the padding page of
every pool and is never handed out.
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


def mark_free(marks: bytearray, pages: array) -> bool:
    """Mark ``pages`` (from a free list) in ``marks``; whether one was marked already or is
    listed twice. A page out of range is not marked (the state comparison then reports it)."""
    n = len(marks)
    if len(pages) < VECTOR_MIN:
        twice = False
        for p in pages:
            if 0 <= p < n:
                twice |= marks[p] == 1
                marks[p] = 1
        return twice
    ids = page_ids(pages)
    ids = ids[(ids >= 0) & (ids < n)]
    m = np.frombuffer(marks, dtype=np.uint8)
    twice = bool((m[ids] == 1).any())
    m[ids] = 1
    # a list is mostly runs, rising or falling (each push is a run reversed): then no id repeats
    return twice or not (ascends(ids) or ascends(ids[::-1])) and _repeats(ids)


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

#: free-list entries one audit step reads at once with numpy (tens of microseconds, a few
#: hundred where the marks' pages are touched for the first time; a list that is neither
#: rising nor falling is sorted to find an id listed twice)
LIST_STEP = 4 * AUDIT_STEP_PAGES


def as_page_array(pages: Iterable[int]) -> array:
    """``pages`` as an int32 array (itself when it is one). A node's runs (the tree keeps them as
    a ``range`` or a ``PageRunList``: daemon/gpu/page_runs.py) are listed in numpy."""
    if isinstance(pages, array) and pages.typecode == "i":
        return pages
    if (type(pages) is range and pages.step == 1) or type(pages) is PageRunList:
        return page_run_array(pages)
    return array("i", pages)


def freed_pages(pages: Iterable[int]) -> array | range:
    """What a free works on: a run (a node's ``range``) as it is, which it checks and marks a
    slice at a time, else an int32 array (:func:`as_page_array`)."""
    if type(pages) is range and pages.step == 1 and len(pages):
        return pages
    return as_page_array(pages)


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


def outside(pages: array, lo: int, hi: int) -> bool:
    """Whether an id of ``pages`` is not in ``lo .. hi - 1``."""
    if not len(pages):
        return False
    if len(pages) < VECTOR_MIN:
        return min(pages) < lo or max(pages) >= hi
    ids = page_ids(pages)
    return int(ids.min()) < lo or int(ids.max()) >= hi


def has_duplicates(pages: array) -> bool:
    """Whether an id occurs twice."""
    if len(pages) < VECTOR_MIN:
        return len(set(pages)) != len(pages)
    ids = page_ids(pages)
    return not ascends(ids) and _repeats(ids)


def _repeats(ids: np.ndarray) -> bool:
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


#: never-used pages moved onto a free list at a time: slicing a list is what hands pages out
#: fast, and a chunk keeps the list short (16 KB) where the whole range would cost 4 B a page
FRESH_CHUNK = 4096


def descending_ids(start: int, n: int) -> array:
    """``start + n - 1`` down to ``start``, as an int32 array."""
    out = array("i")
    out.frombytes(np.arange(start + n - 1, start - 1, -1, dtype=np.int32).tobytes())
    return out


class FreePages:
    """The free pages of one pool or segment: those that came back, as a stack, and those never
    handed out, as one range (``fresh`` up to ``stop``).

    A free stack built whole costs 4 bytes per page of the pool from the start (200 MB and
    seconds to build at 50M pages), although a full pool's stack is short. Here only pages that
    came back are listed, and under them at most a chunk of never-used ones. Pages go out in the
    order single pops of a stack built whole would give: the last to come back first, then
    never-used pages ascending (a fresh pool hands out ascending runs, which copies move as one
    block each)."""

    __slots__ = ("back", "fresh", "stop")

    def __init__(self, start: int, stop: int) -> None:
        self.back = array("i")  # popped from the end
        self.fresh = start
        self.stop = stop

    def __len__(self) -> int:
        return len(self.back) + self.stop - self.fresh

    def __iter__(self) -> Iterator[int]:
        yield from self.back
        yield from range(self.fresh, self.stop)

    def take(self, k: int) -> array:
        """``k`` pages off the list, or all it has if fewer."""
        back = self.back
        n = len(back)
        if k > n and self.fresh < self.stop:
            # the next never-used pages go under those that came back (where a stack built
            # whole holds them), a chunk at a time
            m = min(max(k - n, FRESH_CHUNK), self.stop - self.fresh)
            back[:0] = descending_ids(self.fresh, m)
            self.fresh += m
            n += m
        k = min(k, n)
        got = back[n - k:]
        del back[n - k:]
        got.reverse()
        return got

    def off_bounds(self, start: int, stop: int) -> bool:
        """Whether the never-used range is not within ``start .. stop`` ending at ``stop`` (a
        corruption the audit reports before it reads the list)."""
        return not start <= self.fresh <= self.stop == stop

    def put(self, pages: array | range) -> None:
        """``pages`` back on the list, last first: a run freed ascending goes out ascending
        again (copies move a run of consecutive pages as one block; one that came back reversed
        would be a block per page)."""
        if type(pages) is range:  # (listed in numpy, not a Python step per id)
            self.back += descending_ids(pages.start, len(pages))
        else:
            self.back.extend(pages[::-1])

    @property
    def listed_bytes(self) -> int:
        """What the list takes (pages that came back, and at most a chunk of never-used ones)."""
        return self.back.itemsize * len(self.back)

    def mark_steps(self, marks: bytearray) -> Iterator[bool]:
        """Set ``marks[p] = 1`` for every free page, in bounded steps; each step yields whether
        it found a page marked already (listed twice, or a page that came back listed among the
        never-used ones: it would be handed out twice)."""
        back = self.back
        for start in range(0, len(back), LIST_STEP):
            yield mark_free(marks, back[start:start + LIST_STEP])
        step = 64 * AUDIT_STEP_PAGES  # a slice of bytes at a time, not page by page
        for a in range(max(self.fresh, 0), min(self.stop, len(marks)), step):
            b = min(self.stop, len(marks), a + step)
            twice = marks.count(1, a, b) > 0
            marks[a:b] = _ONES[:b - a]
            yield twice


#: one audit step's slice of fresh pages, marked free
_ONES = b"\x01" * (64 * AUDIT_STEP_PAGES)


def set_states(state: bytearray, pages: array | range, value: int) -> None:
    """``state[p] = value`` for every page of ``pages`` (valid ids; a run as one slice)."""
    if type(pages) is range:  # (a run of valid ids: start >= 0, step 1)
        state[pages.start:pages.start + len(pages)] = bytes((value,)) * len(pages)
    elif len(pages) < VECTOR_MIN:
        for p in pages:
            state[p] = value
    else:
        np.frombuffer(state, dtype=np.uint8)[page_ids(pages)] = value


def check_allocated(name: str, state: bytearray, pages: array | range) -> bool:
    """Raise unless every page is a page of the pool marked used in ``state`` (one byte a page,
    page 0 the padding page) and listed once: the validation of a free, before any change. A
    long list is checked in numpy first, a run (a node's ``range``) by counting its state bytes
    in C; only one that fails is walked page by page, for the message about its first bad page.
    Returns whether the list is a run or one of ``VECTOR_MIN`` ids or more that rises strictly
    (:func:`ascends`), which the free goes on to use."""
    cap = len(state)
    if type(pages) is range:
        if 0 < pages.start and pages.stop <= cap and state.count(
                _USED, pages.start, pages.stop) == len(pages):
            return True
        pages = page_run_array(pages)
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
        self._free = FreePages(1, capacity)  # low ids first: early allocations stay compact
        self._available = capacity - 1  # (len of the free pages, without a Python call)

    @property
    def available(self) -> int:
        return self._available

    @property
    def usable(self) -> int:
        """Pages that can ever be handed out (capacity minus the padding page)."""
        return self.capacity - 1

    def alloc(self, n: int) -> array:
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} pages")
        if n > self._available:
            raise OutOfPages(f"{self.name}: {n} pages requested, {self._available} free",
                             requested=n, available=self._available)
        out = self._free.take(n)
        self._available -= n
        set_states(self._state, out, _USED)
        return out

    def check_free(self, pages: Iterable[int]) -> None:
        """Raise unless every page is allocated and listed once (validation before any change)."""
        check_allocated(self.name, self._state, as_page_array(pages))

    def free(self, pages: Iterable[int]) -> None:
        pages = freed_pages(pages)
        check_allocated(self.name, self._state, pages)
        set_states(self._state, pages, _FREE)
        self._free.put(pages)
        self._available += len(pages)

    def free_set(self) -> set[int]:
        return set(self._free)

    @property
    def free_list_bytes(self) -> int:
        """What the free list takes (pages that came back; never-used ones are one range)."""
        return self._free.listed_bytes

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
        free = self._free
        if free.off_bounds(1, self.capacity):
            v.append(f"{self.name}: never-used pages {free.fresh}..{free.stop} lie outside the "
                     f"pool (1..{self.capacity})")
            return
        twice = False
        for found in free.mark_steps(marks):
            twice |= found
            yield
        if twice:
            v.append(f"{self.name}: the free list holds a page twice")
        if self._available != len(free):
            v.append(f"{self.name}: free page count {self._available} != {len(free)}")
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
