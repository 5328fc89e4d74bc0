"""Whole-list checks of the page ids a caller hands the tree: every id > 0, no id twice.

At a page of one token an insert carries thousands of ids, and the plain checks (``min()``,
``len(set(ids))``) make a Python int of every id and hash it into a set: for a 4k-token insert
that was more than the rest of the insert. On an ``array('i')`` these checks read the ids as
bytes instead, in C (byte scans, strided slices, comparisons of byte strings), with a few Python
steps per *run* of ids rather than one per id.

Why runs: allocators hand out pages in runs of consecutive ids (a free stack pops neighbours, and
pages freed together go back together), so a request's ids are, in practice, a few runs of
ascending or descending ids. Those are recognised and proved exactly (each run's bytes equal
those of ``range(lo, lo + n)``); the values are then known as a few intervals, whose minimum,
maximum and overlaps give both verdicts. Any list that is not a few such runs is checked the
plain way, so the verdict never depends on which path gave it.

The same byte reading finds the next 0 and the next id that is not 0 (``next_zero``,
``next_nonzero``): the match's SWA rule reads a node's host SWA ids, 0 where a page has no copy,
by those runs (daemon/tree/tiering.py ``usable_end``).
"""

from __future__ import annotations

from array import array
from typing import Any

from .page_ids import HostSwaIds, LeadingZeros, leading_zeros

_ZERO_ID = bytes(4)
_U32 = 0xFFFFFFFF
_INT32_MAX = 0x7FFFFFFF

#: lists shorter than this are checked the plain way: below a few hundred ids a set costs no more
#: than the run scan's fixed cost (reading the ids' bytes as planes, a few Python steps a run)
RUNS_MIN = 512
# a shorter run gives the scan up: runs that short are not an allocator's, and would cost more
# than the set they replace
_RUN_MIN_IDS = 16
#: ids compared with one slice of the patterns below
_CHUNK = 4096
# byte 0 of consecutive ids from any start, ascending (entry j: j & 255) and descending
# (entry j: 255 - (j & 255))
_LOW_UP = bytes(range(256)) * (_CHUNK // 256 + 1)
_LOW_DOWN = _LOW_UP[::-1]
# byte 1 of consecutive ids from any start in a 64k block, ascending (entry j: (j >> 8) & 255)
# and descending (its complement)
_MID_UP = b"".join(bytes((v,)) * 256 for v in range(256))
_MID_UP += _MID_UP[:_CHUNK]
_MID_DOWN = _MID_UP.translate(bytes(range(255, -1, -1)))


def int32_bytes(ids: Any) -> bytes | None:
    """The raw int32 words of ``ids`` when it is an ``array('i')``, else None."""
    if isinstance(ids, array) and ids.typecode == "i" and ids.itemsize == 4:
        return ids.tobytes()
    return None


def all_page_ids(ids: Any) -> bool:
    """Whether every id is > 0 (``min(ids) > 0``): on an ``array('i')`` a scan of its bytes in
    C, since min() makes a Python int of each of the thousands of ids of a page-1 request."""
    raw = int32_bytes(ids)
    if raw is None:
        return min(ids) > 0
    if not raw[3::4].isascii():  # a sign bit is set: a negative id
        return False
    i = raw.find(_ZERO_ID)
    while i >= 0:  # a zero id is four zero bytes at a word boundary
        if not i % 4:
            return False
        i = raw.find(_ZERO_ID, i + 1)
    return True


def all_zero(ids: Any) -> bool:
    """Whether every id is 0 (``min(ids) == max(ids) == 0``), in C on an ``array('i')``."""
    raw = int32_bytes(ids)
    if raw is None:
        return min(ids) == 0 == max(ids)
    return raw.count(0) == len(raw)


def page_id_verdict(ids: Any) -> tuple[bool, bool]:
    """``(every id > 0, no id twice)`` of a non-empty list; the second is only computed (and
    only meaningful) when the first holds: callers refuse non-positive ids first."""
    spans = id_spans(ids)
    if spans is None:
        if not all_page_ids(ids):
            return False, False
        return True, len(set(ids)) == len(ids)
    if spans[0][0] < 1 or max(hi for _, hi in spans) > _INT32_MAX:
        return False, False
    return True, disjoint(spans)


def distinct_ids(ids: Any) -> bool:
    """Whether no id occurs twice (``len(set(ids)) == len(ids)``), whatever the ids' signs."""
    spans = id_spans(ids)
    return len(set(ids)) == len(ids) if spans is None else disjoint(spans)


def next_zero(ids: HostSwaIds, start: int, stop: int) -> int:
    """The first position in [start, stop) of ``ids`` (an ``array('i')`` or its leading zeros
    and the rest, ``stop <= len(ids)``) that holds 0, else ``stop``: a scan in C up to the
    position found."""
    if type(ids) is LeadingZeros:
        if start < ids.lead:
            return start
        return ids.lead + next_zero(ids.tail, start - ids.lead, stop - ids.lead)
    try:
        return ids.index(0, start, stop)
    except ValueError:
        return stop


def next_nonzero(ids: HostSwaIds, start: int, stop: int) -> int:
    """The first position in [start, stop) of ``ids`` (as for :func:`next_zero`) that is not
    0, else ``stop``: its leading zero bytes stripped in C, in pieces that double (a scan as
    long as the zeros, not as the rest of the list, which a list of many runs would copy again
    for each)."""
    if type(ids) is LeadingZeros:
        lead = ids.lead
        if stop <= lead:
            return stop
        return lead + next_nonzero(ids.tail, max(0, start - lead), stop - lead)
    step = 64
    while start < stop:
        end = min(stop, start + step)
        lead = leading_zeros(ids[start:end].tobytes())
        if start + lead < end:
            return start + lead
        start, step = end, 2 * step
    return stop


def distinct_nonzero(ids: Any) -> bool:
    """Whether no id but 0 occurs twice: SWA ids, 0 for a page whose SWA KV is gone (in
    practice the leading ones, below the caller's SWA frontier)."""
    raw = int32_bytes(ids)
    if raw is not None:
        rest = ids[leading_zeros(raw) :]
        if all_page_ids(rest):  # no zero (nor negative) id past the leading zeros
            return distinct_ids(rest)
    live = [p for p in ids if p]
    return len(set(live)) == len(live)


def disjoint(spans: list[tuple[int, int]]) -> bool:
    """Whether closed intervals sorted by their start overlap nowhere."""
    return all(a[1] < b[0] for a, b in zip(spans, spans[1:], strict=False))


def id_spans(ids: Any) -> list[tuple[int, int]] | None:
    """The values of ``ids`` as closed intervals ``(lo, hi)`` of their unsigned 32-bit words,
    one per run of consecutive ids (ascending or descending), sorted by ``lo``; None when
    ``ids`` is not an ``array('i')`` of at least :data:`RUNS_MIN` ids in at most
    ``2 + len(ids) // 1024`` runs (single ids count as runs) of at least 16 ids each (a run
    costs a few microseconds of Python steps: past that, the plain checks are the cheaper
    ones, and a list that gives up has cost them little more).

    Each byte of the ids is read as one byte string (a *plane*). A run is the longest stretch
    whose bytes 0 and 1 follow ``a, a + 1, ...`` (or ``a, a - 1, ...``), found by comparing
    those planes with slices of patterns; bytes 2 and 3 are then proved to be the run's
    (they change at most once in 65,536 ids). A stretch that is not a run in its upper bytes
    (its low 16 bits happen to continue the run before it) gives None, never a wrong
    interval."""
    n = len(ids)
    raw = int32_bytes(ids) if n >= RUNS_MIN else None
    if raw is None:
        return None
    p0 = raw[0::4]
    upper: tuple[bytes, bytes, bytes] | None = None  # planes 1 to 3, read at the first run
    limit = 2 + n // 1024
    spans: list[tuple[int, int]] = []
    pos = 0
    while pos < n:
        if len(spans) == limit:
            return None
        a = ids[pos] & _U32
        b = ids[pos + 1] & _U32 if pos + 1 < n else a
        if b != a + 1 and b != a - 1:
            spans.append((a, a))
            pos += 1
            continue
        up = b > a
        end = _stretch_end(p0, pos, n, _LOW_UP if up else _LOW_DOWN,
                           a & 0xFF if up else 0xFF - (a & 0xFF), 0xFF)
        if end - pos < _RUN_MIN_IDS:
            return None
        if upper is None:
            upper = raw[1::4], raw[2::4], raw[3::4]
        end = _stretch_end(upper[0], pos, end, _MID_UP if up else _MID_DOWN,
                           a & 0xFFFF if up else 0xFFFF - (a & 0xFFFF), 0xFFFF)
        lo, hi = (a, a + end - pos - 1) if up else (a - (end - pos - 1), a)
        if lo < 0 or hi > _U32 or not _upper_bytes_run(upper, pos, end, a, up):
            return None
        spans.append((lo, hi))
        pos = end
    spans.sort()
    return spans


def _stretch_end(plane: bytes, pos: int, stop: int, pattern: bytes, phase: int, period: int
                 ) -> int:
    """The end (at most ``stop``) of the longest stretch from ``pos`` whose bytes in ``plane``
    follow ``pattern`` from ``phase`` on (``pattern`` repeats every ``period + 1`` bytes): one
    comparison per chunk while the run goes on (a list is usually one run or a few long
    ones), then a bisection inside the chunk where it ends."""
    good = pos + 1  # [pos, good) follows the pattern (pos itself: it gave the phase)
    while good < stop:
        m = min(stop - good, _CHUNK)
        ph = (phase + good - pos) & period
        want = pattern[ph : ph + m]
        if plane.startswith(want, good):
            good += m
            continue
        lo, hi = 0, m - 1  # the first offset that differs is in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if plane.startswith(want[lo : mid + 1], good + lo):
                lo = mid + 1
            else:
                hi = mid
        return good + lo
    return stop


def _upper_bytes_run(upper: tuple[bytes, bytes, bytes], pos: int, end: int, a: int, up: bool
                     ) -> bool:
    """Whether bytes 2 and 3 of ids [pos, end) are those of ``a, a + 1, ...`` (``up``) or of
    ``a, a - 1, ...`` (the caller keeps the values inside 32 bits): in a chunk of ids they
    change at most once, so each plane is compared with at most two repeated bytes."""
    _, p2, p3 = upper
    for c in range(pos, end, _CHUNK):
        m = min(_CHUNK, end - c)
        s = a + (c - pos) if up else a - (c - pos)  # the value at c
        o1 = s & 0xFFFF
        h = s >> 16
        if up:  # ids before bytes 2 and 3 move on, and what they move on to
            k, h2 = min(m, 0x10000 - o1), h + 1
        else:
            k, h2 = min(m, o1 + 1), h - 1
        if (p2[c : c + m] != bytes((h & 0xFF,)) * k + bytes((h2 & 0xFF,)) * (m - k)
                or p3[c : c + m] != bytes((h >> 8,)) * k + bytes((h2 >> 8 & 0xFF,)) * (m - k)):
            return False
    return True
