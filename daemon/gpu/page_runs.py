"""The tree's page-id codec with vector code: lists of ascending runs kept by their bounds.

The allocators hand a request's pages out as ascending runs (daemon/gpu/allocator.py): one run
from a fresh pool, a few once freed runs are handed out again. At a page of one token a node
holds thousands of ids. One run is kept as a ``range`` (48 bytes), a few as a
:class:`PageRunList` (two int32 bounds a run), where an array takes 4 bytes per id (the codec
protocol is daemon/tree/page_ids.py; the two layers import nothing of each other). Telling the
runs apart and listing them back as ids for a match or an insert take a few numpy calls, where a
Python step per id would take hundreds of microseconds.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

#: ids from which a list is looked at for runs: a shorter list costs little as an array (at page
#: 64 a 4096-token sequence is 64 ids), and a look costs a few numpy calls
RUN_MIN = 128
#: the fewest ids per run, on average, for a list to be kept as runs: 8 bytes a run against 4 a
#: page, and a list of many short runs is no allocator's
IDS_PER_RUN = 16

#: the most runs a node in use keeps by their bounds (PageRuns.in_use): a match lists them with
#: one numpy call each (about a microsecond, several times the copy of their array), at a few
#: bytes a run against 4 a page. At a page of one token an allocation is one run from a fresh
#: pool and usually two once freed runs are handed out again (those of the SWA pages a decode
#: gave back, say)
IN_USE_RUNS = 4

#: ids from which a node in use keeps its runs (PageRuns.in_use): the look and each listing cost
#: about a microsecond whatever the length, and what they save is 4 bytes a page. At a page of
#: 16 tokens a 4k sequence is 256 ids (1 KB): kept from 128, its insert took 1.3x and its match
#: 1.25x the time for 4% less metadata (tree_bench); at a page of one token a node is thousands
IN_USE_MIN = 1024
#: ``in_use_min`` of a codec that leaves every list of a node in use as it is
#: (``server.long_runs_in_use = false``)
NEVER_IN_USE = 2**62

#: a node is cold, and its ids kept as runs, once new content of 1 / COLD_SHARE of the full pool
#: has arrived since it was last used (RadixTree.compact_after): a node in use keeps a list of
#: more than IN_USE_RUNS runs as an array, which a match lists with one copy instead of a vector
#: call per run. An eighth compacted more, but a
#: working set that cycles through the pool then had its nodes compacted and expanded again
#: round after round (bench/daemon_cpu_bench.py at page 1, one client: 1.08-1.10x the CPU per
#: operation; at a half: 0.98x)
COLD_SHARE = 2

#: ids up to which a join appends each part to an empty array (numpy lists a run into a
#: temporary): for a short list that is about half the time of filling an array made whole in
#: place, and for a long one several times it (the temporaries are large allocations: 158
#: against 6 microseconds for 32k ids); the two took the same at about 6k ids
APPEND_MAX = 6144

#: bytes of listed runs a codec keeps for the next matches (PageRuns.join_matched), the oldest
#: dropped first: listing a run costs an ``arange`` (about a microsecond whatever its length,
#: several times the copy of an array), and the runs a match lists again and again are those of
#: hot prefixes (system prompts, the turns of a conversation in progress). 512 KB is 128k ids,
#: 32 sequences of 4k tokens at a page of one token: at a million cached tokens it adds at most
#: half a byte per token to what the runs save (4 bytes a page)
LISTED_BYTES = 512 * 1024
#: once LISTED_BYTES are kept, one new listing in this many replaces the oldest (PageRuns._listing)
LISTED_ADMIT = 8
#: what a kept listing costs besides its ids (its bytes object, key and dict slot), counted
#: against LISTED_BYTES so that many short runs cannot hold more than the budget says
LISTED_ENTRY_BYTES = 160

#: ids from which PageRuns.id_verdict tells a few runs apart by their bounds (a few numpy calls,
#: whatever their length) rather than sorting the ids (which costs more as they grow)
VERDICT_RUNS_MIN = 512
#: the most runs PageRuns.id_verdict tells apart by their bounds; a list of more is sorted
VERDICT_RUNS = 64

#: grown by repetition, a new array is filled in place (see APPEND_MAX)
_ZERO = array("i", [0])


def cold_after_tokens(pool_pages: int, page_size: int) -> int:
    """``RadixTree.compact_after`` for a full pool of ``pool_pages`` pages."""
    return pool_pages * page_size // COLD_SHARE


class PageRunList:
    """Ascending runs of page ids, by their bounds: run ``k`` is ``range(starts[k], starts[k] +
    ends[k] - ends[k - 1])`` (``ends``: ids up to the end of each run). A read-only sequence of
    ints, as the tree needs: its slices are runs again (a ``range`` when one run is left)."""

    __slots__ = ("starts", "ends")

    def __init__(self, starts: array, ends: array) -> None:
        self.starts = starts
        self.ends = ends

    def __len__(self) -> int:
        return self.ends[-1]

    def runs(self) -> Iterator[range]:
        before = 0
        for s, e in zip(self.starts, self.ends, strict=True):
            yield range(s, s + e - before)
            before = e

    def __iter__(self) -> Iterator[int]:
        for r in self.runs():
            yield from r

    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if isinstance(i, slice):
            return self._slice(i)
        n = self.ends[-1]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("page run list index out of range")
        k = bisect_right(self.ends, i)
        return self.starts[k] + i - (self.ends[k - 1] if k else 0)

    def _slice(self, sl: slice) -> Sequence[int]:
        a, b, step = sl.indices(self.ends[-1])
        if step != 1:
            return array("i", self)[sl]
        if a >= b:
            return range(0)
        ends = self.ends
        k0 = bisect_right(ends, a)  # the run holding id a, and the one holding id b - 1
        k1 = bisect_left(ends, b)
        first = self.starts[k0] + a - (ends[k0 - 1] if k0 else 0)
        if k0 == k1:
            return range(first, first + b - a)
        starts = self.starts[k0 : k1 + 1]
        starts[0] = first
        new_ends = array("i", [e - a for e in ends[k0:k1]])
        new_ends.append(b - a)
        return PageRunList(starts, new_ends)

    def __repr__(self) -> str:
        return f"PageRunList({', '.join(f'{r.start}..{r.stop - 1}' for r in self.runs())})"


class PageRuns:
    """Keeps a list of ``min_ids`` or more ids that is one run as a ``range``, and one of a few
    runs (``IDS_PER_RUN`` ids or more each, on average) as a :class:`PageRunList`; a node in use
    keeps them so from ``in_use_min`` ids (:data:`IN_USE_MIN`)."""

    def __init__(self, min_ids: int = RUN_MIN, ids_per_run: int = IDS_PER_RUN,
                 in_use_min: int = IN_USE_MIN, listed_bytes: int = LISTED_BYTES) -> None:
        if min_ids < 2 or ids_per_run < 2:
            raise ValueError(f"min_ids and ids_per_run must be at least 2, got {min_ids} and "
                             f"{ids_per_run}")
        if listed_bytes < 0:
            raise ValueError(f"listed_bytes must be at least 0, got {listed_bytes}")
        self.min_ids = min_ids
        self.ids_per_run = ids_per_run
        self.in_use_min = max(min_ids, in_use_min)
        self._iota_ids = np.zeros(0, np.int32)
        self.listed_max = listed_bytes
        self.listed_bytes = 0
        #: a run -> its ids as int32 bytes, the oldest first. Keyed by value (a
        #: ``range`` hashes and compares by its bounds): a run's listing never changes, whichever
        #: node holds it, and a node split or evicted leaves nothing stale behind
        self._listed: OrderedDict[range, bytes] = OrderedDict()
        self._refused = 0  # listings not kept since the budget was full (see _listing)

    @property
    def kept_listings(self) -> tuple[range, ...]:
        """The runs whose listings are kept for the next matches (join_matched), oldest
        first."""
        return tuple(self._listed)

    def compact(self, ids: array) -> array | range | PageRunList:
        n = len(ids)
        if n < self.min_ids:
            return ids
        x = np.frombuffer(ids, dtype=np.int32)
        breaks = x[1:] - x[:-1] != 1
        n_breaks = int(np.count_nonzero(breaks))
        if (n_breaks + 1) * self.ids_per_run > n:
            return ids  # (counted first: listing the breaks of a list of no runs costs more)
        return _runs(ids, np.flatnonzero(breaks) + 1)

    def in_use(self, ids: Sequence[int]) -> Sequence[int]:
        if _few(ids):
            return ids
        if type(ids) is not array:
            return self.join([ids])
        n = len(ids)
        if n < self.in_use_min:
            return ids
        if _one_run(ids):  # (the usual case)
            return range(ids[0], ids[0] + n)
        x = np.frombuffer(ids, dtype=np.int32)
        cuts = np.flatnonzero(x[1:] - x[:-1] != 1) + 1  # where a run begins, but the first
        if len(cuts) >= IN_USE_RUNS or (len(cuts) + 1) * self.ids_per_run > n:
            return ids
        return _runs(ids, cuts)

    def join(self, parts: Sequence[Sequence[int]]) -> array:
        total = 0
        plain = True  # all arrays (short nodes, as at page 64): plain copies
        for p in parts:
            total += len(p)
            plain = plain and type(p) is array
        if plain or total <= APPEND_MAX:
            return _appended(parts)
        return _filled(parts, total, self._iota(total))

    def join_matched(self, parts: Sequence[Sequence[int]]) -> array:
        """Runs are copied from the listings kept of earlier matches (see :meth:`_listing`),
        one run at a time; a list of more than APPEND_MAX ids, or with a part of more than
        IN_USE_RUNS runs, is joined as :meth:`join` joins it. (Not the oldest listing moved
        to the back on a hit: that costs a match more than the listings it would keep.)"""
        out = array("i")
        total = 0
        for p in parts:
            total += len(p)
            if total > APPEND_MAX:
                return self.join(parts)
            if type(p) is array:
                out += p  # type: ignore[operator]
                continue
            runs = _few_runs(p)
            if runs is None:
                return self.join(parts)
            for r in runs:
                out.frombytes(self._listing(r))
        return out

    def id_verdict(self, ids: Sequence[int]) -> tuple[bool, bool]:
        """An allocator's list is one run or a few (see the module's docstring): one run is
        proved by comparing bytes with its listing, a few by their bounds, which overlap
        nowhere when no id is there twice; any other ``array('i')`` is sorted, and what is not
        one (or is shorter than ``min_ids``: the tree scans those itself) takes min() and a
        set. At a page of one token (3k ids) this made tree_bench's public insert 0.73x; at a
        page of 64 tokens (48 ids) numpy's calls cost more than the tree's byte scan."""
        n = len(ids)
        if type(ids) is not array or ids.typecode != "i" or n < self.min_ids:
            if min(ids) <= 0:
                return False, False
            return True, len(set(ids)) == n
        if ids[0] > 0 and _one_run(ids):
            return True, True
        x = np.frombuffer(ids, dtype=np.int32)
        if n >= VERDICT_RUNS_MIN:
            if int(x.min()) <= 0:
                return False, False
            cuts = np.flatnonzero(x[1:] - x[:-1] != 1)  # (ids > 0: no difference overflows)
            if len(cuts) < VERDICT_RUNS:
                return True, _runs_disjoint(ids, cuts.tolist())
        x = np.sort(x)
        positive = bool(x[0] > 0)
        return positive, positive and bool((x[1:] != x[:-1]).all())

    def _listing(self, run: range) -> bytes:
        """The ids of ``run`` as int32 bytes, kept while LISTED_BYTES allows. Once the budget
        is full, one new listing in LISTED_ADMIT is kept, in place of the oldest: runs matched
        in turn that need more than the budget (many conversations at page 1) would otherwise
        each push out the one matched next and never be found, at a dictionary's work per miss;
        so they turn over slowly and some of them are found."""
        listed = self._listed
        got = listed.get(run)
        if got is not None:
            return got
        got = _run_bytes(run.start, run.stop)
        cost = len(got) + LISTED_ENTRY_BYTES
        if cost > self.listed_max:
            return got
        if self.listed_bytes + cost > self.listed_max:
            self._refused += 1
            if self._refused % LISTED_ADMIT:
                return got
            while self.listed_bytes + cost > self.listed_max:
                self.listed_bytes -= len(listed.popitem(last=False)[1]) + LISTED_ENTRY_BYTES
        self.listed_bytes += cost
        listed[run] = got
        return got

    def _iota(self, k: int) -> np.ndarray:
        """0..k-1 as int32, kept (4 bytes per id of the longest list joined) so that listing a
        run is one addition instead of an arange and a copy."""
        if len(self._iota_ids) < k:
            self._iota_ids = np.arange(max(k, 2 * len(self._iota_ids)), dtype=np.int32)
        return self._iota_ids[:k]


def _runs(ids: array, cuts: np.ndarray) -> range | PageRunList:
    """``ids`` (distinct, ascending between ``cuts``, the positions where a run begins but
    the first) kept as one run or by its runs' bounds."""
    first = ids[0]
    if not len(cuts):
        return range(first, first + len(ids))
    if len(cuts) < IN_USE_RUNS:  # (a few: Python beats numpy's cost per call)
        at = cuts.tolist()
        return PageRunList(array("i", [first, *(ids[c] for c in at)]),
                           array("i", [*at, len(ids)]))
    starts = array("i", [first])
    starts.frombytes(np.frombuffer(ids, dtype=np.int32)[cuts].tobytes())
    ends = array("i")
    ends.frombytes(cuts.astype(np.int32).tobytes())
    ends.append(len(ids))
    return PageRunList(starts, ends)


def _one_run(ids: array) -> bool:
    """Whether ``ids`` (an int32 array, not empty) is one run ``a, a + 1, ...``: its ends, then
    its bytes against the run's listing."""
    first, n = ids[0], len(ids)
    return ids[-1] - first == n - 1 and ids.tobytes() == _run_bytes(first, first + n)


def _runs_disjoint(ids: array, cuts: list[int]) -> bool:
    """Whether the ascending runs of ``ids`` that end at ``cuts`` (and at its end) overlap
    nowhere: their bounds, sorted (a few: Python beats numpy's cost per call)."""
    spans = sorted(zip([ids[0], *(ids[c + 1] for c in cuts)], [*(ids[c] for c in cuts), ids[-1]],
                       strict=True))
    return all(a[1] < b[0] for a, b in zip(spans, spans[1:], strict=False))


def _offsets(runs: range | PageRunList) -> int | np.ndarray:
    """What an id's position in ``runs`` is added to for its value: one number for a run, one
    per id for several."""
    if type(runs) is range:
        return runs.start
    ends = np.frombuffer(runs.ends, dtype=np.int32)
    lengths = ends.copy()
    lengths[1:] -= ends[:-1]
    return np.repeat(np.frombuffer(runs.starts, dtype=np.int32) - (ends - lengths), lengths)


def _runs_of(pages: Sequence[int]) -> bool:
    """Whether ``pages`` is one of this codec's forms: a run (a ``range`` rising by one) or a
    :class:`PageRunList` (any other sequence is listed as it is)."""
    return (type(pages) is range and pages.step == 1) or type(pages) is PageRunList


def _few_runs(pages: Sequence[int]) -> Iterable[range] | None:
    """The runs of ``pages`` when it is one run or a few (:data:`IN_USE_RUNS`), which are
    listed an ``arange`` each; None for any other list."""
    kind = type(pages)
    if kind is range:
        return (pages,) if pages.step == 1 else None  # type: ignore[attr-defined]
    if kind is PageRunList and len(pages.starts) <= IN_USE_RUNS:  # type: ignore[attr-defined]
        return pages.runs()  # type: ignore[attr-defined]
    return None


def _few(pages: Sequence[int]) -> bool:
    """Whether ``pages`` is one run or a few (:data:`IN_USE_RUNS`): listed an ``arange`` each."""
    return _few_runs(pages) is not None


def _run_bytes(lo: int, hi: int) -> bytes:
    """The ids ``lo .. hi - 1`` as int32 bytes."""
    return np.arange(lo, hi, dtype=np.int32).tobytes()


def _appended(parts: Sequence[Sequence[int]]) -> array:
    """The ids of ``parts`` appended to an empty array in order: a run or a few with one
    ``arange`` each, runs that follow on from one another across parts (the nodes a match
    lists are often pieces of one allocation) as one in all."""
    out = array("i")
    lo = hi = 0  # a run not listed yet
    for p in parts:
        runs = None if type(p) is array else _few_runs(p)
        if runs is None:
            if hi > lo:
                out.frombytes(_run_bytes(lo, hi))
                lo = hi = 0
            if type(p) is array:
                out += p  # type: ignore[operator]
            elif type(p) is PageRunList:
                out += page_run_array(p)  # type: ignore[arg-type]
            else:
                out.extend(p)
            continue
        for r in runs:
            if r.start == hi and hi > lo:
                hi = r.stop
                continue
            if hi > lo:
                out.frombytes(_run_bytes(lo, hi))
            lo, hi = r.start, r.stop
    if hi > lo:
        out.frombytes(_run_bytes(lo, hi))
    return out


def page_run_array(pages: range | PageRunList) -> array:
    """The ids of a run or of runs as a new int32 array (what the allocators' frees take)."""
    n = len(pages)
    if n <= APPEND_MAX and _few(pages):
        return _appended((pages,))
    return _filled((pages,), n, np.arange(n, dtype=np.int32))


def _filled(parts: Sequence[Sequence[int]], total: int, iota: np.ndarray) -> array:
    """A long list: one array of ``total`` ids, each part written into it in place (a run or
    runs as one addition to ``iota``, ``0 .. total - 1`` or longer)."""
    out = _ZERO * total
    ids = np.frombuffer(out, dtype=np.int32)
    pos = 0
    for p in parts:
        k = len(p)
        if k and _runs_of(p):
            np.add(iota[:k], _offsets(p), out=ids[pos : pos + k])  # type: ignore[arg-type]
        elif k:
            ids[pos : pos + k] = p
        pos += k
    return out
