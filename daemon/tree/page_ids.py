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

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Protocol

#: what ``Node.full``, ``Node.swa`` and ``Node.host`` hold (besides None): an ``array('i')``, a
#: ``range``, or another sequence a codec made
PageIds = Sequence[int]


class PageIdCodec(Protocol):
    """How the tree stores the page ids of cold nodes and the host slot ids of every node, and
    how it lists them for its callers."""

    #: lists shorter than this are always kept as arrays (the tree does not offer them)
    min_ids: int

    def compact(self, ids: array) -> PageIds:
        """``ids`` (distinct page ids, owned by the tree from now on) as the tree keeps them."""
        ...

    def join(self, parts: Sequence[PageIds]) -> array:
        """One new int32 array of the ids of ``parts`` in order (never one of the parts)."""
        ...


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


class PlainPageIds:
    """The tree's default codec: ids kept as the caller gave them."""

    min_ids = sys.maxsize

    def compact(self, ids: array) -> PageIds:
        return ids

    def join(self, parts: Sequence[PageIds]) -> array:
        return concat_pages(parts)
