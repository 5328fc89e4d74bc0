"""Page allocators over segments: the pages a namespace gets come only from its own segments.

A pool of ``capacity`` pages is cut into segments of ``segment_pages`` consecutive page ids
(segment = page // segment_pages; the last one may be shorter). A segment is either free (on the
free list) or assigned to one namespace, and every page of an assigned segment is handed out to
that namespace only, so what an engine of another tenant maps (the segments of its own
namespaces, docs/protocol.md) never holds another namespace's KV. A segment whose last page
comes back returns to the free list at once, and any namespace can take it from there: memory
still flows between tenants. When a segment is assigned to a namespace other than the one it
last served, ``on_assign(segment)`` runs first: the pool gives it fresh, zeroed memory there
(daemon.gpu.pools), so no byte crosses namespaces and a mapping of the old memory shows nothing
new.

Pure bookkeeping (no torch), like :class:`daemon.gpu.allocator.PageAllocator`: one state byte per
page catches a double free in O(1). Page 0 (padding) is never handed out and not counted in
segment 0's pages in use; it is zero in every fresh memory a segment gets.

With ``segment_pages >= capacity`` there is one segment and every namespace shares it: that is
the single shared pool (``memory_isolation = "none"``); callers then pass one namespace key.
"""

from __future__ import annotations

import math
import mmap
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np
from radixd_client.errors import PoolError
from radixd_client.segments import check_segment_alignment

from daemon.gpu.allocator import (
    AUDIT_STEP_PAGES,
    LIST_STEP,
    TABLE_SCAN_STEP,
    VECTOR_MIN,
    AllocatorError,
    FreePages,
    OutOfPages,
    as_page_array,
    ascending,
    check_allocated,
    freed_pages,
    marked_free,
    outside,
    page_ids,
    set_states,
)
from daemon.gpu.profile import cuda_available

if TYPE_CHECKING:
    from daemon.gpu.profile import ModelProfile

#: Segments per model (both pools) at most: an ``attach`` passes one descriptor per segment, and
#: one message carries at most 253 (SCM_MAX_FD).
MAX_SEGMENTS = 240
#: How many segments (both pools together) the automatic segment size aims at.
AUTO_SEGMENTS = 128
ISOLATION_MODES = ("auto", "segments", "none")


def effective_isolation(isolation: str, device: str) -> str:
    """What ``memory_isolation`` means on ``device``: ``auto`` is ``segments`` on the CPU and
    ``none`` on CUDA, where segmented pools are not built yet (a default config must start on a
    GPU; the daemon logs a warning then). An explicit ``segments`` on CUDA is a config error."""
    if isolation not in ISOLATION_MODES:
        raise ValueError(f"memory_isolation: {isolation!r} is not one of {list(ISOLATION_MODES)}")
    on_cuda = device.startswith("cuda") or (device == "auto" and cuda_available())
    if isolation == "auto":
        return "none" if on_cuda else "segments"
    if isolation == "segments" and on_cuda:
        raise ValueError('memory_isolation: "segments" is built for CPU pools only in this '
                         'version; on a CUDA device use "auto" or "none" (no memory isolation '
                         "between tenants)")
    return isolation


def _os_page_unit(profile: ModelProfile) -> int:
    """The fewest pages whose (layer, K or V) strip, what a segment's mapping cuts at, ends on
    an OS page."""
    strip = profile.full_page_bytes // (2 * profile.num_full_layers)
    return mmap.PAGESIZE // math.gcd(mmap.PAGESIZE, strip)


def pool_page_multiple(profile: ModelProfile, isolation: str, mapped: bool = True) -> int:
    """The page count every pool of the model must be a multiple of: 1, unless its pools are
    cut into segments mapped apart on the host, whose strips must end on OS pages (a pool sized
    in bytes is rounded down to it)."""
    if effective_isolation(isolation, profile.device) == "none" or not mapped \
            or profile.device.startswith("cuda"):
        return 1
    return _os_page_unit(profile)


def resolve_segment_pages(profile: ModelProfile, isolation: str, segment_pages: int,
                          mapped: bool = True) -> int | None:
    """The segment size of a model in pages, or None for the single shared pool.

    ``segment_pages`` 0 is automatic: about :data:`AUTO_SEGMENTS` segments per model, rounded up
    to whole OS pages per (layer, kv) strip. ``mapped``: the pools exist and are mapped (else
    only the bookkeeping, which needs no alignment). Raises ValueError with the reason and a
    remedy."""
    isolation = effective_isolation(isolation, profile.device)
    if isolation == "none":
        return None
    if not isinstance(segment_pages, int) or isinstance(segment_pages, bool) or segment_pages < 0:
        raise ValueError(f"segment_pages: a number of pages >= 1, or 0 for automatic; got "
                         f"{segment_pages!r}")
    strip = profile.full_page_bytes // (2 * profile.num_full_layers)
    unit = _os_page_unit(profile)
    multiple = pool_page_multiple(profile, isolation, mapped)
    pools = [profile.full_pages] + ([profile.swa_pages] if profile.has_swa else [])
    for pages, kind in zip(pools, ("full", "swa"), strict=False):
        if pages % multiple:
            raise ValueError(
                f"{kind}_pages: the {kind} pool's {pages} pages x {strip} bytes per page and "
                f"layer are not a multiple of the {mmap.PAGESIZE}-byte OS page, so its segments "
                f"cannot be mapped apart: use a multiple of {multiple} pages (or "
                f"memory_isolation = \"none\"; {kind}_bytes is rounded down to such a multiple)")
    if segment_pages == 0:
        want = max(1, -(-sum(pools) // AUTO_SEGMENTS))
        segment_pages = -(-want // unit) * unit
    count = sum(-(-p // segment_pages) for p in pools)
    if count > MAX_SEGMENTS:
        raise ValueError(f"segment_pages: {segment_pages} pages make {count} segments; at most "
                         f"{MAX_SEGMENTS} per model (each is a descriptor in attach): use "
                         f"segment_pages >= {-(-sum(pools) // (MAX_SEGMENTS - len(pools)))}")
    if mapped and not profile.device.startswith("cuda"):
        for pages, kind in zip(pools, ("full", "swa"), strict=False):
            try:
                check_segment_alignment(strip, segment_pages, pages, f"{kind} pool")
            except PoolError as exc:
                raise ValueError(f"segment_pages: {exc}") from None
    return segment_pages


def resolve_host_segment_pages(profile: ModelProfile, isolation: str, segment_pages: int,
                               host_pages: int, host_swa_pages: int) -> int | None:
    """Slots per host (L2) segment, or None for shared host pools: the host tier follows the
    model's ``memory_isolation`` (isolated exactly when its device pools are). ``segment_pages``
    (``host_segment_pages``) 0 is automatic: about :data:`AUTO_SEGMENTS` segments over the host
    pools, rounded up so that every segment starts on an OS page (a host page is one block of
    all layers). At most :data:`MAX_SEGMENTS` (one descriptor each in ``kv_attach``). Raises
    ValueError with the reason and a remedy."""
    if effective_isolation(isolation, profile.device) == "none" or not host_pages:
        return None
    if not isinstance(segment_pages, int) or isinstance(segment_pages, bool) or segment_pages < 0:
        raise ValueError(f"host_segment_pages: a number of slots >= 1, or 0 for automatic; got "
                         f"{segment_pages!r}")
    pools = [(host_pages, profile.full_page_bytes)]
    if profile.has_swa and profile.num_swa_layers and host_swa_pages:
        pools.append((host_swa_pages, profile.swa_page_bytes))
    unit = math.lcm(*(mmap.PAGESIZE // math.gcd(mmap.PAGESIZE, b) for _, b in pools))
    if segment_pages == 0:
        want = max(1, -(-sum(p for p, _ in pools) // AUTO_SEGMENTS))
        segment_pages = -(-want // unit) * unit
    elif segment_pages % unit:
        raise ValueError(f"host_segment_pages: {segment_pages} slots do not start every segment "
                         f"on a {mmap.PAGESIZE}-byte OS page; use a multiple of {unit} (or 0)")
    count = sum(-(-p // segment_pages) for p, _ in pools)
    if count > MAX_SEGMENTS:
        raise ValueError(f"host_segment_pages: {segment_pages} slots make {count} host segments;"
                         f" at most {MAX_SEGMENTS} per model (each is a descriptor in kv_attach):"
                         f" use host_segment_pages >= "
                         f"{-(-sum(p for p, _ in pools) // (MAX_SEGMENTS - len(pools)))}")
    return segment_pages


_FREE = 0
_USED = 1


class SegmentedAllocator:
    """Hands out page ids 1..capacity-1 of one pool, per namespace, from whole segments."""

    def __init__(self, capacity: int, segment_pages: int, name: str = "pool",
                 on_assign: Callable[[int], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"{name}: capacity must be >= 1 page (page 0 is reserved), "
                             f"got {capacity}")
        if segment_pages < 1:
            raise ValueError(f"{name}: segment_pages must be >= 1, got {segment_pages}")
        self.name = name
        self.capacity = capacity
        self.segment_pages = segment_pages = min(segment_pages, capacity)
        self.num_segments = -(-capacity // segment_pages)
        self.on_assign = on_assign
        self._state = bytearray(capacity)
        self._state[0] = _USED  # the padding page is permanently taken
        nseg = self.num_segments
        # per segment: its free pages (low ids handed out first) and its pages in use
        self._seg_free = [FreePages(max(1, s * segment_pages),
                                    min(capacity, (s + 1) * segment_pages))
                          for s in range(nseg)]
        self._seg_used = [0] * nseg
        self.owner: list[str | None] = [None] * nseg  # the namespace a segment serves now
        self.last_owner: list[str | None] = [None] * nseg  # ... or served last (None: never)
        self._free_segments: list[int] = list(range(nseg - 1, -1, -1))  # low ids popped first
        self._free_segment_pages = capacity - 1  # free pages inside free-listed segments
        self._ns_segments: dict[str, list[int]] = {}
        self._ns_free: dict[str, int] = {}  # free pages inside each namespace's segments
        # per namespace, its segments that have a free page (an ordered set): alloc visits only
        # these, not every segment the namespace holds
        self._ns_open: dict[str, dict[int, None]] = {}
        self._free_pages = capacity - 1
        self.segments_assigned = 0  # counters: assignments, and those that changed namespace
        self.segments_moved = 0
        #: per namespace, how often it was given a segment it did not serve last: its segment
        #: generation (a segment it emptied and takes back keeps its memfd and its mappings)
        self.generations: dict[str, int] = {}

    # -- counts -------------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Free pages in the whole pool (in free segments and inside assigned ones)."""
        return self._free_pages

    @property
    def usable(self) -> int:
        """Pages that can ever be handed out (capacity minus the padding page)."""
        return self.capacity - 1

    def available_to(self, namespace: str) -> int:
        """Pages ``namespace`` can take now: free inside its segments plus free segments."""
        return self._ns_free.get(namespace, 0) + self.free_segment_pages

    @property
    def free_segment_count(self) -> int:
        """Segments on the free list, serving no namespace."""
        return len(self._free_segments)

    @property
    def free_segment_pages(self) -> int:
        return self._free_segment_pages

    def segment_of(self, page: int) -> int:
        return page // self.segment_pages

    def segments_of(self, namespace: str) -> list[int]:
        """The segments ``namespace`` holds now, in id order."""
        return sorted(self._ns_segments.get(namespace, ()))

    def mappable_by(self, namespace: str) -> list[int]:
        """The segments ``namespace``'s sessions may map: those it holds, and free ones it
        served last (their memfd holds only its own bytes, and it takes them back first). Keeping
        those mapped is what lets a namespace that empties and refills a segment go on without
        attaching again."""
        return [s for s, owner in enumerate(self.last_owner) if owner == namespace]

    def used_in(self, segment: int) -> int:
        """Pages of ``segment`` handed out and not freed."""
        return self._seg_used[segment]

    def segment_range(self, segment: int) -> range:
        """The page ids of ``segment``."""
        s = self.segment_pages
        return range(segment * s, min(self.capacity, (segment + 1) * s))

    # -- alloc / free -------------------------------------------------------------------------

    def alloc(self, n: int, namespace: str) -> array:
        """``n`` pages of ``namespace``'s segments, taking free segments when they are short."""
        if n <= 0:
            if n < 0:
                raise ValueError(f"{self.name}: cannot allocate {n} pages")
            return array("i")
        have = self._ns_free.get(namespace, 0) + self._free_segment_pages
        if n > have:
            raise OutOfPages(f"{self.name}: {n} pages requested, {have} free to namespace "
                             f"{namespace!r}", requested=n, available=have)
        open_ = self._ns_open.get(namespace)
        if open_ is None:
            self._ns_segments[namespace] = []
            self._ns_free[namespace] = 0
            open_ = self._ns_open[namespace] = {}
        out = array("i")
        seg_free = self._seg_free
        for seg in list(open_):  # oldest first: fullest first would pack tighter
            if len(out) == n:
                break
            out += self._take(seg, n - len(out))
            f = seg_free[seg]
            if not f.back and f.fresh == f.stop:  # empty (``len`` without its call)
                del open_[seg]
        try:
            while len(out) < n:
                seg = self._assign(namespace)
                out += self._take(seg, n - len(out))
                f = self._seg_free[seg]
                if f.back or f.fresh < f.stop:
                    open_[seg] = None
        except BaseException:  # a segment could not get fresh memory: give back what we took
            self._handed_out(out, namespace)
            self.free(out)
            raise
        if len(out) >= VECTOR_MIN:
            # sorted, so that pages freed apart but next to each other in the pool (two nodes'
            # runs, two segments) come back as one run: a copy moves a run as one block
            out = ascending(out)
        self._handed_out(out, namespace)
        return out

    def _handed_out(self, pages: array, namespace: str) -> None:
        self._ns_free[namespace] -= len(pages)
        self._free_pages -= len(pages)
        set_states(self._state, pages, _USED)

    def _take(self, seg: int, k: int) -> array:
        got = self._seg_free[seg].take(k)
        self._seg_used[seg] += len(got)
        return got

    def _assign(self, namespace: str) -> int:
        """A free segment for ``namespace``: one it served last if any (no zeroing needed)."""
        free = self._free_segments
        pick = len(free) - 1
        for i in range(len(free) - 1, -1, -1):
            if self.last_owner[free[i]] == namespace:
                pick = i
                break
        seg = free.pop(pick)
        if self.last_owner[seg] != namespace:
            if self.last_owner[seg] is not None and self.on_assign is not None:
                try:
                    self.on_assign(seg)
                except BaseException:  # no fresh memory: it stays free, as it was
                    free.insert(pick, seg)
                    raise
                self.segments_moved += 1
            self.generations[namespace] = self.generations.get(namespace, 0) + 1
        self.segments_assigned += 1
        self.owner[seg] = self.last_owner[seg] = namespace
        self._ns_segments[namespace].append(seg)
        k = len(self._seg_free[seg])
        self._ns_free[namespace] += k
        self._free_segment_pages -= k
        return seg

    def check_free(self, pages: Iterable[int]) -> None:
        """Raise unless every page is allocated and listed once (validation before any change)."""
        check_allocated(self.name, self._state, as_page_array(pages))

    def free(self, pages: Iterable[int]) -> None:
        """Pages back to their segments; a segment left empty goes back to the free list."""
        pages = freed_pages(pages)
        rising = check_allocated(self.name, self._state, pages)
        set_states(self._state, pages, _FREE)
        emptied: set[int] = set()
        for seg, back in self._by_segment(pages, rising):
            free = self._seg_free[seg]
            owner = self.owner[seg]
            if not free.back and free.fresh == free.stop:  # it was full: open it again
                self._ns_open[owner][seg] = None  # type: ignore[index]
            free.put(back)
            self._seg_used[seg] -= len(back)
            self._ns_free[owner] += len(back)  # type: ignore[index]
            if not self._seg_used[seg]:
                emptied.add(seg)
        self._free_pages += len(pages)
        for seg in sorted(emptied, reverse=True):
            ns = self.owner[seg]
            assert ns is not None
            self._ns_segments[ns].remove(seg)
            k = len(self._seg_free[seg])
            self._ns_free[ns] -= k
            del self._ns_open[ns][seg]
            if not self._ns_segments[ns]:
                del self._ns_segments[ns], self._ns_free[ns], self._ns_open[ns]
            self.owner[seg] = None
            self._free_segments.append(seg)
            self._free_segment_pages += k

    def _by_segment(self, pages: array | range, rising: bool
                    ) -> list[tuple[int, array | range]]:
        """``pages`` split by segment, each part in its pages' order, the parts in the order of
        their first page (the order in which a page-by-page loop opens segments). ``rising``:
        the pages rise strictly (as ``check_allocated`` found), so the parts are slices."""
        if self.num_segments == 1:
            return [(0, pages)] if len(pages) else []
        sp = self.segment_pages
        if type(pages) is range:  # a run: its parts are runs
            cuts = range(pages.start - pages.start % sp + sp, pages.stop, sp)
            bounds = [pages.start, *cuts, pages.stop]
            return [(a // sp, range(a, b)) for a, b in pairwise(bounds) if b > a]
        if len(pages) < VECTOR_MIN:
            parts: dict[int, array] = {}
            for p in pages:
                part = parts.get(p // sp)
                if part is None:
                    part = parts[p // sp] = array("i")
                part.append(p)
            return list(parts.items())
        ids = page_ids(pages)
        first, last = int(ids[0]) // sp, int(ids[-1]) // sp
        if rising and last - first <= len(ids):
            if first == last:
                return [(first, pages)]
            out: list[tuple[int, array]] = []
            a = 0
            ends = np.searchsorted(ids, np.arange(first + 1, last + 1) * sp).tolist()
            for seg, b in zip(range(first, last + 1), [*ends, len(ids)], strict=True):
                if b > a:
                    out.append((seg, pages[a:b]))
                    a = b
            return out
        segs = ids // sp
        if segs.min() == segs.max():
            return [(int(segs[0]), pages)]
        order = np.argsort(segs, kind="stable")
        ranked = segs[order]
        starts = np.flatnonzero(np.diff(ranked)) + 1
        bounds = np.concatenate(([0], starts, [len(ranked)]))
        picked = page_ids(pages)[order]
        out = []
        for g in np.argsort(order[bounds[:-1]]):
            part = array("i")
            part.frombytes(picked[bounds[g]:bounds[g + 1]].tobytes())
            out.append((int(ranked[bounds[g]]), part))
        return out

    def free_set(self) -> set[int]:
        return {p for f in self._seg_free for p in f}

    def audit(self) -> list[str]:
        """Free lists, state bytes and segment bookkeeping agree."""
        v: list[str] = []
        for _ in self.audit_steps(v):
            pass
        return v

    def audit_steps(self, v: list[str], marks: bytearray | None = None) -> Iterator[None]:
        """:meth:`audit` into ``v`` in steps of about
        :data:`~daemon.gpu.allocator.AUDIT_STEP_PAGES` pages (the daemon runs them between
        requests: daemon/checker.py); ``marks`` (``capacity`` zero bytes) is left with a 1 for
        every page on a free list."""
        marks = bytearray(self.capacity) if marks is None else marks  # 1: on a free list
        twice = False
        off: list[int] = []
        for seg, f in enumerate(self._seg_free):
            r = self.segment_range(seg)
            if f.off_bounds(max(1, r.start), r.stop):
                off.append(seg)
                continue
            for found in f.mark_steps(marks):
                twice |= found
                yield
            if seg % AUDIT_STEP_PAGES == AUDIT_STEP_PAGES - 1:  # (many segments with no free page)
                yield
        for seg in off[:10]:
            f = self._seg_free[seg]
            r = self.segment_range(seg)
            v.append(f"{self.name}: segment {seg}'s never-used pages {f.fresh}..{f.stop} lie "
                     f"outside it ({r.start}..{r.stop})")
        if off:  # the marks are not the lists' pages: what follows would only add noise
            return
        if twice:
            v.append(f"{self.name}: a free list holds a page twice")
        if self._state[0] != _USED or marks[0]:
            v.append(f"{self.name}: the padding page 0 is free")
        yield from marked_free(self.name, self._state, marks, v)
        listed = sum(len(f) for f in self._seg_free)
        if listed != self._free_pages:
            v.append(f"{self.name}: free page count {self._free_pages} != {listed}")
        for seg in range(self.num_segments):
            yield
            r = self.segment_range(seg)
            back = self._seg_free[seg].back
            for start in range(0, len(back), LIST_STEP):
                if outside(back[start:start + LIST_STEP], r.start, r.stop):
                    v.append(f"{self.name}: segment {seg}'s free list holds a page outside it "
                             f"({r.start}..{r.stop})")
                    break
                yield
            used = 0
            st = self._state
            step = 64 * AUDIT_STEP_PAGES  # bytes counted in C, not page by page
            for start in range(max(1, r.start), r.stop, step):  # (page 0: the padding page)
                used += st.count(_USED, start, min(r.stop, start + step))
                yield
            if used != self._seg_used[seg]:
                v.append(f"{self.name}: segment {seg} counts {self._seg_used[seg]} pages in "
                         f"use, {used} are")
            free_listed = seg in self._free_segments
            if free_listed != (self.owner[seg] is None):
                v.append(f"{self.name}: segment {seg} is {'free' if free_listed else 'not free'}"
                         f" but has owner {self.owner[seg]!r}")
            if self.owner[seg] is None and used:
                v.append(f"{self.name}: free segment {seg} holds {used} pages in use")
        if self._free_segment_pages != sum(len(self._seg_free[s]) for s in self._free_segments):
            v.append(f"{self.name}: free-segment page count {self._free_segment_pages} is off")
        listed = sorted(s for segs in self._ns_segments.values() for s in segs)
        if listed != sorted(s for s in range(self.num_segments) if self.owner[s] is not None):
            v.append(f"{self.name}: namespace segment lists disagree with segment owners")
        for ns, segs in self._ns_segments.items():
            yield
            if any(self.owner[s] != ns for s in segs):
                v.append(f"{self.name}: namespace {ns!r} lists a segment it does not own")
            if self._ns_free.get(ns) != sum(len(self._seg_free[s]) for s in segs):
                v.append(f"{self.name}: namespace {ns!r} free count is off")
            if set(self._ns_open.get(ns, ())) != {s for s in segs if self._seg_free[s]}:
                v.append(f"{self.name}: namespace {ns!r}'s segments with free pages are off")

    def misplaced(self, pages: Iterable[int], namespace: str, bad: set[int]) -> None:
        """Add to ``bad`` the segments of ``pages`` that ``namespace`` does not hold (the
        isolation rule)."""
        sp = self.segment_pages
        owner = self.owner
        pages = as_page_array(pages)  # (a node's runs listed as ids)
        if len(pages) >= VECTOR_MIN:  # a node's pages, at page
            # size 1 thousands of them in a few segments
            segs: Iterable[int] = np.unique(page_ids(pages) // sp).tolist()
        else:
            segs = {p // sp for p in pages}
        bad.update(s for s in segs if owner[s] != namespace)

    def audit_owners(self, namespace: str, what: str, bad: set[int]) -> list[str]:
        """The report of :meth:`misplaced`'s findings."""
        if not bad:
            return []
        segs = sorted(bad)[:10]
        return [f"{self.name}: {what} of namespace {namespace!r} lie in segments {segs} owned "
                f"by {[self.owner[s] for s in segs]}"]


class PairedSegmentAllocator:
    """Full and SWA pages taken together, each pool over its own segments (see the module).

    It is also the tree's page sink, so everything the tree lets go of returns here.
    """

    def __init__(self, full_capacity: int, swa_capacity: int, segment_pages: int,
                 on_assign: Callable[[str, int], None] | None = None) -> None:
        def hook(kind: str) -> Callable[[int], None] | None:
            return None if on_assign is None else (lambda seg: on_assign(kind, seg))

        self.full = SegmentedAllocator(full_capacity, segment_pages, "full pool", hook("full"))
        self.swa = (SegmentedAllocator(swa_capacity, segment_pages, "swa pool", hook("swa"))
                    if swa_capacity else None)

    def allocators(self) -> tuple[tuple[str, SegmentedAllocator], ...]:
        if self.swa is None:
            return (("full", self.full),)
        return (("full", self.full), ("swa", self.swa))

    def alloc(self, n: int, namespace: str) -> tuple[array, array]:
        if n == 0:
            return array("i"), array("i")
        full_avail = self.full.available_to(namespace)
        swa_avail = self.swa.available_to(namespace) if self.swa is not None else n
        if n > full_avail or n > swa_avail:
            raise OutOfPages(
                f"{n} pages requested; free to namespace {namespace!r}: full {full_avail}, "
                f"swa {swa_avail}", requested=n, full_available=full_avail,
                swa_available=swa_avail)
        full = self.full.alloc(n, namespace)
        if self.swa is None:
            return full, array("i")
        try:
            swa = self.swa.alloc(n, namespace)
        except BaseException:  # a segment could not get fresh memory: all or none
            self.full.free(full)
            raise
        return full, swa

    def free_full(self, pages: Sequence[int]) -> None:
        self.full.free(pages)

    def free_swa(self, pages: Sequence[int]) -> None:
        if self.swa is None:
            if len(pages):
                raise AllocatorError("this model has no SWA pool")
            return
        self.swa.free(pages)


def audit_model_segments_steps(cache: Any, v: list[str]) -> Iterator[None]:
    """Segment ownership of one model cache (``daemon.model_cache.ModelCache``, duck-typed: this
    package sits below it): every device page of a namespace's tree lies in a segment of that
    namespace, every page a session holds in a segment of a namespace it allocated for (in
    practice one: its tenant's). That a free segment holds no live page is the allocators' own
    audit (:meth:`SegmentedAllocator.audit`, run with the page conservation check). Pages in
    flight (a load's) count with their holder's namespace."""
    alloc = cache.alloc_state
    pools = dict(alloc.allocators())
    bad: dict[tuple[str, str], set[int]] = {}
    for i, node in enumerate(list(cache.tree.iter_nodes())):
        if not i % 16:
            yield
        key = cache.space(node.ns.name) if node.ns is not None else None
        if key is None:
            continue
        for kind, pages in (("full", node.full), ("swa", node.swa)):
            a = pools.get(kind)
            if pages and a is not None:
                a.misplaced(pages, key, bad.setdefault((kind, key), set()))
    for kind, table in (("full", cache.holders.full), ("swa", cache.holders.swa)):
        a = pools.get(kind)
        if a is None:
            continue
        keys: dict[int, set[str]] = {}
        for i, h in enumerate(list(cache.holdings.values())):
            keys[getattr(h, kind).number] = {cache.space(ns) for ns in getattr(h, kind).spaces}
            if not i % 16:  # (a daemon may serve a thousand sessions)
                yield
        yield from _held_misplaced_steps(a, table.holder_np, keys, kind, bad)
    for (kind, key), segs in bad.items():
        v += pools[kind].audit_owners(key, f"{kind} pages", segs)


def _held_misplaced_steps(a: SegmentedAllocator, holder: Any, keys: dict[int, set[str]],
                          kind: str, bad: dict[tuple[str, str], set[int]]) -> Iterator[None]:
    """Held pages outside the segments of the namespaces their holder allocated for, into
    ``bad``: one pass over the pool's page table (``holder``: session number per page), each
    chunk reduced in numpy to its distinct (holder, segment) pairs, so the cost is the table's
    size whatever the number of sessions. A number no holding has is the conservation check's
    to report."""
    sp = a.segment_pages
    for start in range(0, len(holder), TABLE_SCAN_STEP):
        chunk = holder[start:start + TABLE_SCAN_STEP]
        idx = np.flatnonzero(chunk)
        if len(idx):
            pairs = np.unique(chunk[idx].astype(np.int64) * a.num_segments + (idx + start) // sp)
            for i, pair in enumerate(pairs.tolist()):
                n, seg = divmod(pair, a.num_segments)
                spaces = keys.get(n)
                if spaces and a.owner[seg] not in spaces:
                    bad.setdefault((kind, min(spaces)), set()).add(seg)
                if i % 64 == 63:  # (as many pairs as sessions holding pages in the chunk)
                    yield
        yield
