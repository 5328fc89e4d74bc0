"""Tree rules of the memory tiers: pins, host copies with SWA windows, loads and fetches."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.tree import CollectingSink, RadixTree, check_tree
from daemon.tree.node import Node

from .helpers import NS, Ids, seq

PAGE_SIZES = [1, 4, 16]


def make(P: int) -> tuple[RadixTree, CollectingSink, Ids]:
    sink = CollectingSink()
    return RadixTree(P, 2 * P, sink, host_sink=sink, policy="lru"), sink, Ids()


def node_at(tree: RadixTree, tokens: bytes):
    return tree.get_node(tree.match(NS, tokens).node_id)


def ok(tree: RadixTree) -> None:
    assert check_tree(tree) == []


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_unpin_cleans_an_ancestor_left_without_device_children(P):
    """A tombstone whose only remaining child is host-only loses its last device child while a
    load pins it: when the pin ends it must go (demoted), not stay a tombstone leaf."""
    tree, sink, ids = make(P)
    x, y = seq(P, [1, 2, 5, 6]), seq(P, [1, 2, 3, 4])
    tree.insert(NS, x, ids.full(4), ids.swa(4, zeros=2), swa_evicted_len=2 * P)  # T tombstone
    tree.insert(NS, y, ids.full(2), ids.swa(2), prev_prefix_len=2 * P)
    t = tree.get_node(tree.match(NS, x).node_id).parent
    yn = tree.get_node(tree.match(NS, y).node_id)
    assert t.swa is None and t.full is not None
    tree.set_host(t.id, array("i", [900, 901]))
    tree.set_host(yn.id, array("i", [902, 903]), array("i", [904, 905]))
    tree.evict(full_pages=2)  # the coldest leaf: x's branch or y's; y must be host-only after
    while yn.full is not None:
        tree.evict(full_pages=2)
    ok(tree)
    if t.dev_children == 0:  # x went first and took T down already: rebuild x
        tree.insert(NS, x, ids.full(4), ids.swa(4, zeros=2), swa_evicted_len=2 * P)
    pin = tree.pin(yn)  # a load of y in flight
    assert t.pin == 1 and tree.full_protected >= 2
    ok(tree)
    tree.evict(full_pages=100)  # x goes; T is pinned and stays, though now a dead leaf
    assert t.full is not None and t.dev_children == 0
    ok(tree)
    tree.unpin(pin)
    ok(tree)  # T was demoted (it has a host copy): no tombstone leaf is left
    assert t.full is None and t.host is not None


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_pinned_pages_are_protected_not_evictable(P):
    tree, _, ids = make(P)
    s = seq(P, [1, 2, 3])
    tree.insert(NS, s, ids.full(3), ids.swa(3))
    assert (tree.full_evictable, tree.full_protected) == (3, 0)
    n = node_at(tree, s)
    pin = tree.pin(n)
    assert (tree.full_evictable, tree.full_protected) == (0, 3)
    assert (tree.swa_evictable, tree.swa_protected) == (0, 3)
    assert tree.evict(full_pages=10, swa_pages=10).full_pages == 0
    r = tree.match(NS, s, lock=True)  # a lock on a pinned path moves nothing twice
    ok(tree)
    tree.unpin(pin)
    assert (tree.full_evictable, tree.full_protected) == (0, 3)  # still locked
    tree.unlock(r.receipt)
    assert (tree.full_evictable, tree.full_protected) == (3, 0)
    ok(tree)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_host_pin_keeps_host_copies_but_not_device_pages(P):
    tree, _, ids = make(P)
    s = seq(P, [1, 2, 3, 4])
    tree.insert(NS, s, ids.full(4), ids.swa(4))
    n = node_at(tree, s)
    tree.set_host(n.id, array("i", [1, 2, 3, 4]), array("i", [0, 0, 5, 6]))
    pin = tree.pin(n, host_only=True)
    assert tree.full_evictable == 4  # a fetch must never make an alloc fail
    tree.evict(full_pages=4)
    assert n.full is None and n.host is not None  # demoted
    assert tree.evict_host(10).host_slots == 0  # but its host copy stays
    ok(tree)
    tree.unpin(pin)
    assert tree.evict_host(10).host_slots == 4
    ok(tree)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_load_plan_needs_the_window_and_commit_takes_fresh_pages(P):
    tree, sink, ids = make(P)
    s = seq(P, [1, 2, 3, 4, 5])
    tree.insert(NS, s, ids.full(5), ids.swa(5))
    n = node_at(tree, s)
    tree.set_host(n.id, array("i", [11, 12, 13, 14, 15]), array("i", [0, 0, 0, 21, 22]))
    tree.evict(full_pages=5)
    assert tree.match(NS, s).host_hit_len == 5 * P
    # a prompt that ends inside the node has no SWA copy for its window there
    assert tree.plan_load(NS, seq(P, [1, 2, 3]), 0) is None
    plan = tree.plan_load(NS, s, 0)
    assert plan is not None and plan.end == 5
    assert [slot for _, slot in plan.full] == [11, 12, 13, 14, 15]
    assert plan.swa == [(3, 21), (4, 22)]
    pin = tree.pin(plan.anchor)
    fresh = ids.full(5)
    fswa = ids.swa(2)
    fd = dict(zip(range(5), fresh, strict=True))
    sd = {3: fswa[0], 4: fswa[1]}
    assert tree.commit_load(NS, s, plan, fd, sd) == 5
    tree.unpin(pin)
    assert fd == {} and sd == {}
    m = tree.match(NS, s)
    assert m.prefix_len == 5 * P and list(m.full_pages) == list(fresh)
    assert list(m.swa_pages) == list(fswa)
    ok(tree)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_adopt_fetched_pages_under_the_host_prefix(P):
    tree, _, ids = make(P)
    head, s = seq(P, [1, 2]), seq(P, [1, 2, 3, 4])
    tree.insert(NS, head, ids.full(2), ids.swa(2))
    h = node_at(tree, head)
    tree.set_host(h.id, array("i", [1, 2]), array("i", [3, 4]))
    start, last = tree.host_prefix(NS, s)
    assert (start, last) == (2, h)
    slots = {2: 10, 3: 11}
    swa = {2: 12, 3: 13}
    got = tree.adopt_host(NS, s, start, 4, slots, swa)
    assert got == (2, 2) and slots == {} and swa == {}
    m = tree.match(NS, s)
    assert (m.prefix_len, m.host_hit_len) == (2 * P, 2 * P)
    ok(tree)
    # a hole in the host prefix: nothing attaches below it
    tree2, _, ids2 = make(P)
    tree2.insert(NS, head, ids2.full(2), ids2.swa(2))
    slots = {2: 10, 3: 11}
    assert tree2.adopt_host(NS, s, 2, 4, slots, {}) == (0, 0) and len(slots) == 2
    ok(tree2)


def _usable_end_page_by_page(tree: RadixTree, path: list) -> int:
    """usable_end as it was written before it scanned host SWA ids by runs: a step a page."""
    wp = tree.window_pages
    best = i = run = 0
    tomb = False
    for node, m in path:
        for j in range(m):
            i += 1
            if node.swa is not None or (node.host_swa is not None and node.host_swa[j]):
                run += 1
                if not tomb or run >= wp:
                    best = i
            else:
                tomb, run = True, 0
    return best


# a node of a path: SWA on device, a tombstone without host SWA copies, or host SWA copies (0
# where a page has none), and how many of its pages the path matched
_PATH_NODE = st.integers(1, 12).flatmap(lambda k: st.tuples(
    st.one_of(st.just("live"), st.just("tomb"),
              st.lists(st.sampled_from([0, 0, 5, 7, 2**24]), min_size=k, max_size=k)),
    st.integers(1, k)))


@settings(max_examples=300)
@given(st.lists(_PATH_NODE, max_size=6), st.integers(1, 5))
def test_usable_end_by_runs_is_the_page_by_page_rule(nodes: list, window_pages: int) -> None:
    tree = RadixTree(1, window_pages, CollectingSink(), policy="lru")
    path = []
    for kind, m in nodes:
        n = Node(len(path) + 1, None, None, b"", b"")
        if kind == "live":
            n.swa = array("i", [1])
        elif kind != "tomb":
            n.host_swa = array("i", kind)
        path.append((n, m))
    assert tree.usable_end(path) == _usable_end_page_by_page(tree, path)
