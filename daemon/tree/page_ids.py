"""A node's device page ids: an ``array('i')``, or a compact form of a list of ascending runs.

At a page of one token a node holds thousands of page ids, and the allocators hand a request's
pages out as ascending runs (daemon/gpu/allocator.py). A run kept as a ``range`` takes 48 bytes
where an array takes 4 per page; a few runs kept as their bounds take a few bytes a run. Page ids
are most of the tree's metadata at small pages otherwise.

Telling runs apart and listing them back as ids are vector work, which this pure package does
not import; a :class:`PageIdCodec` given to the tree does both. What the codec keeps must behave
as a read-only sequence of ints whose slices are again such sequences (the tree splits nodes and
takes windows by slicing), as ``array`` and ``range`` do. The default, :class:`PlainPageIds`,
keeps every list as given.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, repeat
from typing import Protocol, overload

#: what ``Node.full``, ``Node.swa`` and ``Node.host`` hold (besides None): an ``array('i')``, a
#: ``range``, or another sequence a codec made
PageIds = Sequence[int]


class PageIdCodec(Protocol):
    """How the tree stores the page ids of cold nodes, the long runs of nodes in use and the host
    slot ids of every node, and how it lists them for its callers."""

    #: lists shorter than this are always kept as arrays (the tree does not offer them), and
    #: checked by the tree itself (it asks :meth:`id_verdict` about longer ones only)
    min_ids: int
    #: bytes of listings the codec keeps for the next matches (join_matched); 0 if none
    listed_bytes: int

    def compact(self, ids: array) -> PageIds:
        """``ids`` (distinct page ids, owned by the tree from now on) as the tree keeps them."""
        ...

    def in_use(self, ids: PageIds) -> PageIds:
        """What a node in use keeps for ``ids`` (owned by the tree from now on): ``ids`` when
        a match lists them cheaply (an array; in the codec's forms, one run or a few), else
        their array. For an array it looks for those runs: cheap enough for an operation's
        path (a comparison, at most one vector pass), and at a page of one token an array
        costs 4 bytes a token where a node's runs cost a few bytes in all."""
        ...

    def join(self, parts: Sequence[PageIds]) -> array:
        """One new int32 array of the ids of ``parts`` in order (never one of the parts)."""
        ...

    def join_matched(self, parts: Sequence[PageIds]) -> array:
        """:meth:`join` for what a match gives out: the same lists come back match after match
        (hot prefixes), and the codec may keep their listings to serve the next one."""
        ...

    def id_verdict(self, ids: Sequence[int]) -> tuple[bool, bool]:
        """``(every id > 0, no id twice)`` of a list of ``min_ids`` ids or more that a caller
        hands the tree (the second False whenever the first is): at a page of one token an
        insert brings thousands of ids, and the codec may read an ``array('i')`` of them with
        vector code."""
        ...


#: a run of zero bytes: the regular expression engine counts them in a tight C loop, several
#: times faster than ``bytes.lstrip`` (which looks each byte up in its set of bytes to strip)
_ZERO_BYTES = re.compile(rb"\x00*")


def leading_zeros(raw: bytes) -> int:
    """How many int32 words at the start of ``raw`` are 0, in C: the zero bytes are counted,
    and the first byte that is not lies in the first word that is not."""
    return _ZERO_BYTES.match(raw).end() // 4  # type: ignore[union-attr]


def concat_pages(parts: Iterable[PageIds]) -> array:
    """One page array from several, without the quadratic cost of repeated ``+``. A part that
    is not an array is listed one id at a time: correct, but a codec with vector code joins
    its own forms faster."""
    out = array("i")
    for p in parts:
        if isinstance(p, array):
            out += p
        else:
            out.extend(p)
    return out


class LeadingZeros:
    """``lead`` zeros, then the ids of ``tail``: a node's host SWA slot ids (0 for a page
    without an SWA copy) when they start with many zeros. A backup copies the SWA of a node's
    trailing window only, so at a page of one token an array of them is mostly zeros: 4 bytes
    a page of the node for the few pages of a window.

    Read-only, like the forms of :class:`PageIdCodec`: a change makes a new list
    (:func:`host_swa_ids`). Slices are again of this class."""

    __slots__ = ("lead", "tail")

    def __init__(self, lead: int, tail: array) -> None:
        self.lead = lead
        self.tail = tail

    def __len__(self) -> int:
        return self.lead + len(self.tail)

    def __iter__(self) -> Iterator[int]:
        return chain(repeat(0, self.lead), self.tail)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> LeadingZeros: ...

    def __getitem__(self, i: int | slice) -> int | LeadingZeros:
        lead = self.lead
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("host SWA ids are sliced with step 1 only")
            stop = max(start, stop)
            return LeadingZeros(max(0, min(stop, lead) - start),
                                self.tail[max(0, start - lead):max(0, stop - lead)])
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("host SWA id index out of range")
        return 0 if i < lead else self.tail[i - lead]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LeadingZeros | array) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LeadingZeros({self.lead}, {self.tail!r})"

    def tobytes(self) -> bytes:
        return bytes(4 * self.lead) + self.tail.tobytes()

    def count(self, value: int) -> int:
        return self.tail.count(value) + (self.lead if value == 0 else 0)


#: host SWA id lists with fewer leading zeros stay arrays (what a :class:`LeadingZeros` costs
#: beyond its tail, in ids)
LEAD_MIN = 32

#: what ``Node.host_swa`` holds besides None
HostSwaIds = array | LeadingZeros


def host_swa_ids(ids: HostSwaIds, lead_min: int = LEAD_MIN) -> HostSwaIds | None:
    """How a node keeps the host SWA ids ``ids`` (the node owns them from now on): ``None``
    when none is set, their tail after the leading zeros when those are ``lead_min`` or more,
    else the array."""
    if type(ids) is LeadingZeros:
        lead, tail = ids.lead, ids.tail
    else:
        lead, tail = 0, ids
    z = leading_zeros(tail.tobytes())
    if z == len(tail):
        return None
    if lead + z < lead_min:
        return ids if type(ids) is array else array("i", ids)
    return LeadingZeros(lead + z, tail[z:])


def nonzero_count(ids: HostSwaIds) -> int:
    """Ids that are not 0 (in C)."""
    return len(ids) - ids.count(0)


def nonzero(ids: HostSwaIds) -> array:
    """The ids that are not 0, in order, as a new array."""
    tail = ids.tail if type(ids) is LeadingZeros else ids
    return array("i", (p for p in tail if p))
