"""Which pages one Redis value holds: full-pool runs and SWA windows (pure planning, no I/O).

A full-pool L3 value is a **run**: the whole pages of one hash block from the block's first page
to one of its pages, named by that last page's key (protocol.md 9.3). A run ends at a block's last
page (a whole block, at least 64 tokens) or at the last page of a tree node that ends inside a
block (so a prefix that stops there can be found). With pages of 64 tokens or more a block is one
page and every run is one page, the format before runs existed. Why runs: at small pages, one
value per page meant one Redis key, one round trip slot and one header per token or four.

A node's runs may start in its ancestors (its first block began above it): their pages come from
the ancestors' host copies, which exist whenever the node has one (a host copy hangs from the root
through host copies).

An SWA value is a node's **window**: the pages of the node's trailing window that have an SWA host
copy, up to its last page, named by that last page's key (``:swa``). Only a node's end can end a
usable hit (the SWA window rule), so that is the one place a window is looked up; a node shorter
than the window continues in its parent's window value, ending where the node begins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .tree import Node, RadixTree

__all__ = ["L3Run", "block_ends", "node_runs", "node_window", "run_pages", "tail_candidates",
           "window_pages"]


@dataclass(frozen=True, slots=True)
class L3Run:
    """One value to write (a full-pool run, or an SWA window): host ``slots`` of its pages in
    order, their ``tokens``, and ``last``, the index in the node of its last page (whose page
    key names the value)."""

    last: int
    slots: tuple[int, ...]
    tokens: bytes


def _ancestor_pages(node: Node, pages: int, page_bytes: int
                    ) -> tuple[tuple[int, ...], bytes] | None:
    """The host slots and tokens of the ``pages`` pages just above ``node``; None when one of
    them has no host copy."""
    slots: list[Sequence[int]] = []
    toks: list[bytes] = []
    need = pages
    a = node.parent
    while need:
        if a is None or a.parent is None or a.host is None:
            return None
        take = min(need, len(a.host))
        slots.append(a.host[len(a.host) - take :])
        toks.append(a.tokens[len(a.tokens) - take * page_bytes :])
        need -= take
        a = a.parent
    return tuple(s for part in reversed(slots) for s in part), b"".join(reversed(toks))


def node_runs(tree: RadixTree, node: Node, slots: Sequence[int]) -> tuple[list[L3Run], int]:
    """The runs that end in ``node``, whose pages are on host in ``slots``; and how many runs
    could not be made because a page above the node has no host copy."""
    pb = tree.page_bytes
    B = tree.block_pages
    n = len(slots)
    toks = node.tokens
    if B == 1:
        # (listed, not indexed: a compact list finds a position by bisection)
        return [L3Run(i, (s,), toks[i * pb : (i + 1) * pb]) for i, s in enumerate(slots)], 0
    first = (node.depth * 4 - len(toks)) // pb  # the node's first page, counted from the root
    lasts = list(range((B - 1 - first % B) % B, n, B))
    if not lasts or lasts[-1] != n - 1:
        lasts.append(n - 1)
    runs: list[L3Run] = []
    missed = 0
    for last in lasts:
        lo = last - (first + last) % B  # the run's first page, relative to the node
        own = tuple(slots[max(lo, 0) : last + 1])
        own_toks = toks[max(lo, 0) * pb : (last + 1) * pb]
        if lo >= 0:
            runs.append(L3Run(last, own, own_toks))
            continue
        above = _ancestor_pages(node, -lo, pb)
        if above is None:
            missed += 1
            continue
        runs.append(L3Run(last, above[0] + own, above[1] + own_toks))
    return runs, missed


def node_window(node: Node, swa_slots: Sequence[int] | None, page_bytes: int) -> L3Run | None:
    """The SWA value of ``node``: its last pages that have an SWA host copy (``swa_slots``, 0
    for none), up to its last page; None when its last page has none (no hit can use it)."""
    slots = swa_slots or ()
    n = len(slots)
    if not n or not slots[n - 1]:
        return None
    lo = n - 1
    while lo and slots[lo - 1]:
        lo -= 1
    return L3Run(n - 1, tuple(slots[lo:]), node.tokens[lo * page_bytes : n * page_bytes])


def block_ends(start: int, pages: int, block_pages: int) -> list[int]:
    """The last page of every whole block that ends in [start, pages): the runs to look up
    first when fetching pages from ``start`` of a sequence of ``pages`` pages."""
    return list(range(start // block_pages * block_pages + block_pages - 1, pages, block_pages))


def tail_candidates(covered: int, start: int, pages: int, block_pages: int) -> list[int]:
    """Where a shorter run of the block that starts at page ``covered`` (the first block no
    whole run was found for) may end, below the block's last page and from ``start`` on."""
    return list(range(max(start, covered), min(pages, covered + block_pages - 1)))


def run_pages(tokens: bytes, payload: memoryview, run_tokens: bytes, first: int, last: int,
              page_bytes: int, page_nbytes: int) -> list[memoryview] | None:
    """The pages of a verified run value covering pages [first, last] of ``tokens``, each a
    view into ``payload``; None when the value does not hold exactly those tokens and pages
    (written for another page size, or by a daemon that stored one page a value)."""
    count = last + 1 - first
    if run_tokens != tokens[first * page_bytes : (last + 1) * page_bytes] or \
            payload.nbytes != count * page_nbytes:
        return None
    return [payload[i * page_nbytes : (i + 1) * page_nbytes] for i in range(count)]


def window_pages(tokens: bytes, payload: memoryview, value_tokens: bytes, end: int,
                 page_bytes: int, page_nbytes: int) -> tuple[int, list[memoryview]] | None:
    """An SWA window value read under the key of page ``end - 1`` of ``tokens``: its first page
    and its pages; None when it does not hold whole pages of ``tokens`` that end there."""
    count = len(value_tokens) // page_bytes
    first = end - count
    if not count or first < 0:
        return None
    pages = run_pages(tokens, payload, value_tokens, first, end - 1, page_bytes, page_nbytes)
    return None if pages is None else (first, pages)
