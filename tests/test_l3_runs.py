"""The L3 runs (daemon.l3_runs): which pages each full-pool Redis value holds, against a reference
that walks the pages one by one; and what a fetch looks up."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.l3_runs import (
    block_ends,
    node_runs,
    node_window,
    run_pages,
    tail_candidates,
    window_pages,
)
from daemon.tree import CollectingSink, Node, RadixTree, as_token_bytes

NS = "ns"


def chain(P: int, cuts: list[int]) -> tuple[RadixTree, list[Node], bytes]:
    """A tree holding one sequence split into nodes at the page counts ``cuts`` (ascending),
    every node on host with slot 1000 + its page index from the root."""
    sink = CollectingSink()
    tree = RadixTree(P, 2 * P, sink, host_sink=sink, policy="lru")
    pages = cuts[-1]
    toks = as_token_bytes(list(range(7, 7 + pages * P)))
    for c in cuts:  # inserting each prefix splits the nodes at the cut
        full = array("i", range(1, c + 1))
        tree.insert(NS, toks[: c * 4 * P], full, array("i", range(500, 500 + c)), 0, 0)
    nodes, n = [], tree.nodes[tree.match(NS, toks).node_id]
    while n.parent is not None:
        nodes.append(n)
        n = n.parent
    nodes.reverse()
    start = 0
    for n in nodes:
        count = len(n.tokens) // (4 * P)
        tree.set_host(n.id, array("i", range(1000 + start, 1000 + start + count)))
        start += count
    return tree, nodes, toks


def reference_runs(B: int, first: int, count: int) -> list[tuple[int, list[int]]]:
    """(last page, its run's pages) for the runs a node of pages [first, first + count) ends:
    each block end inside it, and its own last page."""
    out = []
    for p in range(first, first + count):
        if p % B == B - 1 or p == first + count - 1:
            out.append((p, list(range(p // B * B, p + 1))))
    return out


@settings(max_examples=60, deadline=None)
@given(P=st.sampled_from([1, 4, 16, 64]),
       cuts=st.lists(st.integers(1, 150), min_size=1, max_size=4, unique=True))
def test_runs_are_the_block_prefixes_ending_in_the_node(P: int, cuts: list[int]) -> None:
    tree, nodes, toks = chain(P, sorted(cuts))
    B = tree.block_pages
    pb = 4 * P
    start = 0
    for n in nodes:
        count = len(n.tokens) // pb
        runs, missed = node_runs(tree, n, n.host)
        assert missed == 0
        want = reference_runs(B, start, count)
        assert [(start + r.last, [s - 1000 for s in r.slots]) for r in runs] == want
        for r in runs:
            lo = (start + r.last) // B * B
            assert r.tokens == toks[lo * pb : (start + r.last + 1) * pb]
        start += count


def test_a_run_without_its_ancestors_pages_on_host_is_missed() -> None:
    tree, nodes, _ = chain(4, [10, 20])  # blocks of 16 pages: pages 10-15 need 0-9
    parent, child = nodes
    saved, parent.host = parent.host, None  # as if the parent's host copy were gone
    try:
        runs, missed = node_runs(tree, child, child.host)
    finally:
        parent.host = saved
    assert missed == 1
    assert [r.last for r in runs] == [9]  # only the run that starts inside the child: 16-19


def test_block_ends_and_tail_candidates() -> None:
    assert block_ends(0, 40, 16) == [15, 31]
    assert block_ends(5, 40, 16) == [15, 31]  # a run of the block that starts before page 5
    assert block_ends(16, 32, 16) == [31]
    assert block_ends(3, 6, 1) == [3, 4, 5]  # one page a block: every page is a run
    assert tail_candidates(32, 0, 40, 16) == list(range(32, 40))
    assert tail_candidates(32, 0, 60, 16) == list(range(32, 47))  # 47 ends the block: not here
    assert tail_candidates(16, 20, 40, 16) == list(range(20, 31))  # from the fetch's start
    assert tail_candidates(3, 3, 6, 1) == []


@pytest.mark.parametrize(("run_toks", "payload_len", "ok"), [
    ("same", 3 * 8, True), ("other", 3 * 8, False), ("short", 2 * 8, False),
    ("same", 3 * 8 + 1, False)])
def test_run_pages_checks_tokens_and_length(run_toks: str, payload_len: int, ok: bool) -> None:
    P, page_nbytes = 2, 8
    tokens = as_token_bytes(list(range(100, 110)))  # five pages
    want = tokens[1 * 4 * P : 4 * 4 * P]  # pages 1-3
    stored = {"same": want, "other": as_token_bytes(list(range(6))),
              "short": want[: 2 * 4 * P]}[run_toks]
    payload = memoryview(bytes(range(payload_len)))
    got = run_pages(tokens, payload, stored, 1, 3, 4 * P, page_nbytes)
    if not ok:
        assert got is None
        return
    assert got is not None and [bytes(p) for p in got] == [bytes(range(i * 8, i * 8 + 8))
                                                             for i in range(3)]


@settings(max_examples=80, deadline=None)
@given(slots=st.lists(st.integers(0, 3), min_size=0, max_size=12))
def test_a_nodes_window_is_its_last_pages_with_an_swa_copy(slots: list[int]) -> None:
    """The SWA value of a node: the longest stretch of pages with an SWA host slot (non-zero)
    that ends at the node's last page, with their tokens; none when the last page has none."""
    P = 2
    tree, (node,), toks = chain(P, [max(1, len(slots))])
    got = node_window(node, array("i", slots), 4 * P)
    if not slots or not slots[-1]:
        assert got is None
        return
    lo = len(slots)
    while lo and slots[lo - 1]:
        lo -= 1
    assert got is not None
    assert (got.last, got.slots) == (len(slots) - 1, tuple(slots[lo:]))
    assert got.tokens == toks[lo * 4 * P : len(slots) * 4 * P]
    assert node_window(node, None, 4 * P) is None


def test_window_pages_reads_a_window_ending_at_its_key() -> None:
    P, page_nbytes = 2, 8
    tokens = as_token_bytes(list(range(100, 110)))  # five pages
    payload = memoryview(bytes(range(16)))
    first, pages = window_pages(tokens, payload, tokens[3 * 4 * P : 5 * 4 * P], 5, 4 * P,
                                page_nbytes)
    assert first == 3 and [bytes(p) for p in pages] == [bytes(range(8)), bytes(range(8, 16))]
    # another window's tokens, more pages than lie below its end, none, or too few bytes
    assert window_pages(tokens, payload, tokens[2 * 4 * P : 4 * 4 * P], 5, 4 * P, 8) is None
    assert window_pages(tokens, payload, tokens, 4, 4 * P, 8) is None
    assert window_pages(tokens, payload, b"", 5, 4 * P, 8) is None
    assert window_pages(tokens, payload[:8], tokens[3 * 4 * P : 5 * 4 * P], 5, 4 * P, 8) is None
