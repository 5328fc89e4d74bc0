"""Insertion (daemon/tree/insertion.py): overlaps, revivals, page alignment and repeated
chunks. Tests named after SGLang bug classes (reference/sglang.md section 10) replay the shape of
that failure and assert what radixd does instead: refuse with nothing changed, or stay
consistent.
"""

from __future__ import annotations

from array import array

import pytest

from daemon.gpu.allocator import AllocatorError
from daemon.model_cache import PageNotHeld
from daemon.tree import (
    BadArgument,
    CollectingSink,
    NodeNotUsable,
    RadixTree,
    ReceiptError,
    check_tree,
)

from .helpers import (
    NS,
    PAGE_SIZES,
    Ids,
    counters,
    dead_leaves,
    make_cache,
    make_tree,
    ok,
    seq,
    snapshot,
)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_revival_over_locked_full_kv(P):
    """PR #29352 (and PR #27586): reviving a tombstone must not free the locked full KV, and
    must not free or reuse a live SWA slot. The node keeps its full pages; only the caller's
    duplicate pages are freed, each exactly once."""
    tree, sink = make_tree(P)
    ids = Ids()
    s = seq(P, [1, 2, 3])
    full = ids.full(3)
    tree.insert(NS, s, full, ids.swa(3))
    r = tree.match(NS, s, lock=True).receipt
    tree.release_swa(r)  # decode went past the window
    assert tree.evict(0, 10).swa_pages == 3
    ok(tree)
    leaf = r.anchor  # the window split the node: the anchor is the lower, 2-page part
    assert leaf.swa is None and leaf.full_lock == 1 and leaf.children is None
    assert leaf.parent.swa is None and leaf.parent.full_lock == 1
    with pytest.raises(NodeNotUsable):
        tree.lock(leaf.id)
    cfull, cswa = ids.full(3), ids.swa(3)
    res = tree.insert(NS, s, cfull, cswa)  # another request recomputed the same prefix
    ok(tree)
    assert list(leaf.parent.full) + list(leaf.full) == list(full)
    assert list(leaf.parent.swa) + list(leaf.swa) == list(cswa)
    assert list(res.full_pages) == list(full) and list(res.swa_pages) == list(cswa)
    assert sorted(sink.full) == sorted(cfull)  # the caller's duplicates, never the locked pages
    assert not set(sink.swa) & set(cswa)
    assert leaf.full_lock == 1
    tree.unlock(r)
    ok(tree)
    assert leaf.id in tree.nodes and tree.match(NS, s).prefix_len == 3 * P
    tree.evict(100, 100)
    ok(tree)
    assert sorted(sink.full) == sorted(list(cfull) + list(full))
    assert len(set(sink.swa)) == len(sink.swa)

    # the same with the owner layer: conservation holds at every step
    cache = make_cache(P)
    f, w = cache.alloc(1, 3)
    _, rid = cache.insert(1, NS, s, f, w, lock=True)
    cache.release_swa(1, rid)
    cache.evict(0, 100)
    assert cache.check() == []
    f2, w2 = cache.alloc(2, 3)
    cache.insert(2, NS, s, f2, w2)
    assert cache.check() == []
    cache.unlock(1, rid)
    cache.evict(1000, 1000)
    assert cache.check() == []
    a = cache.alloc_state
    assert a.full.available == a.full.usable and a.swa.available == a.swa.usable


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_swa_evicted_len_past_the_end(P):
    """PR #22900 / PR #31486: an uncapped ``swa_evicted_seqlen`` leaked SWA slots or put KV
    already evicted from the window back into the tree. Here the frontier is capped: nothing
    goes in beyond the cached path, no tombstone leaf is created, the caller keeps its pages and
    cache_finished frees them."""
    cache = make_cache(P)
    base = seq(P, [1, 2])
    f, w = cache.alloc(1, 2)
    cache.insert(1, NS, base, f, w)
    tail = P - 1 if P > 1 else 0
    tokens = seq(P, [1, 2, 3, 4, 5], tail=tail)
    m, rid = cache.match(2, NS, tokens, lock=True)
    assert m.prefix_len == 2 * P
    total = 5 + (1 if tail else 0)
    full, swa = cache.alloc(2, total - 2)
    cache.free(2, swa=swa)  # decode freed every SWA page of the request
    zeros = array("i", [0] * 3)
    nodes_before = set(cache.tree.nodes)
    res, lrid = cache.insert(2, NS, tokens, full[:3], zeros, 2 * P, 100 * P)
    assert lrid is None
    assert res.inserted_len == 2 * P and len(res.full_pages) == 0
    assert set(cache.tree.nodes) == nodes_before
    assert set(cache.holdings[2].full) == set(full) and not cache.holdings[2].swa
    assert not dead_leaves(cache.tree)
    assert cache.check() == []
    cache.cache_finished(2, NS, tokens, full, array("i", [0] * (total - 2)), 2 * P, 100 * P,
                         rid)
    assert cache.check() == []
    assert not cache.holdings[2].full and not cache.holdings[2].receipts
    a = cache.alloc_state
    assert a.full.available == a.full.usable - 2 and a.swa.available == a.swa.usable - 2
    # a live SWA id below the (capped) frontier is still refused
    f3, w3 = cache.alloc(3, 3)
    state = snapshot(cache)
    with pytest.raises(BadArgument):
        cache.insert(3, NS, seq(P, [1, 2, 7, 8, 9]), f3, w3, 2 * P, 100 * P)
    assert snapshot(cache) == state and cache.check() == []


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_empty_key_after_page_alignment(P):
    """PR #10637: a key shorter than a page becomes empty after truncation. Here it matches
    nothing, inserts nothing, and a finished request of less than a page just frees its one
    (tail) page."""
    tree, sink = make_tree(P)
    ids = Ids()
    tree.insert(NS, seq(P, [1, 2]), ids.full(2), ids.swa(2))
    before = counters(tree)
    short = seq(P, [1])[: 4 * (P - 1)]
    m = tree.match(NS, short, lock=True)
    assert m.prefix_len == 0 and m.full_hit_len == 0 and len(m.full_pages) == 0
    assert m.node_id == tree.namespace(NS).root.id
    res = tree.insert(NS, short, array("i"), array("i"))
    assert res.inserted_len == 0 and res.prefix_len == 0 and len(res.full_pages) == 0
    ok(tree)
    if P > 1:
        tail_full, tail_swa = ids.full(1), ids.swa(1)
        res = tree.cache_finished(NS, short, tail_full, tail_swa, 0, 0, m.receipt)
        assert res.inserted_len == 0
        assert list(sink.full) == list(tail_full) and list(sink.swa) == list(tail_swa)
    else:
        tree.unlock(m.receipt)
    ok(tree)
    assert counters(tree) == before and not tree.receipts
    with pytest.raises(BadArgument):  # an empty key still needs consistent arrays
        tree.insert(NS, short, array("i", [77]), array("i", [78]))
    ok(tree)

    # through the owner layer (an owner that already holds something)
    cache = make_cache(P)
    m, rid = cache.match(1, NS, short, lock=True)
    assert m.prefix_len == 0
    if P > 1:
        f, w = cache.alloc(1, 1)
        res = cache.cache_finished(1, NS, short, f, w, 0, 0, rid)
        assert res.inserted_len == 0
    else:
        cache.unlock(1, rid)
    res, _ = cache.insert(1, NS, short, array("i"), array("i"))
    assert res.inserted_len == 0
    assert cache.check() == []
    a = cache.alloc_state
    assert a.full.available == a.full.usable and a.swa.available == a.swa.usable


@pytest.mark.parametrize("P", [1, 16])
def test_cache_unfinished_twice_same_prefix(P):
    """PR #25091: mixed chunked prefill ran cache_unfinished twice for one chunk, and
    ``old_prefix_len > len(radix_key)`` tripped an assert. Here a repeat with the advanced prefix
    is a no-op that moves the lock again; a stale repeat is refused with nothing changed."""
    tail = P // 2 if P > 1 else 0
    tokens = seq(P, [1, 2], tail=tail)
    total = 2 + (1 if tail else 0)

    tree, sink = make_tree(P)
    ids = Ids()
    r0 = tree.match(NS, tokens, lock=True).receipt
    full, swa = ids.full(total), ids.swa(total)
    res1 = tree.cache_unfinished(NS, tokens, full, swa, 0, 0, r0)
    ok(tree)
    shape = sorted((n.id, bytes(n.tokens)) for n in tree.iter_nodes())
    c1 = counters(tree)
    res2 = tree.cache_unfinished(NS, tokens, full[2:], swa[2:], res1.inserted_len, 0,
                                 res1.receipt)
    ok(tree)
    assert res2.inserted_len == res1.inserted_len == 2 * P and res2.node_id == res1.node_id
    assert len(res2.full_pages) == 0
    assert not res1.receipt.active and res2.receipt.active
    assert sorted((n.id, bytes(n.tokens)) for n in tree.iter_nodes()) == shape
    assert counters(tree) == c1 and not sink.full and not sink.swa
    # the stale receipt of the first call is refused
    with pytest.raises(ReceiptError):
        tree.cache_unfinished(NS, tokens, full[2:], swa[2:], 2 * P, 0, res1.receipt)
    # prev past the (truncated) key: an error, not an assert, and nothing changes
    with pytest.raises(BadArgument):
        tree.cache_unfinished(NS, seq(P, [1]), array("i"), array("i"), 2 * P, 0, res2.receipt)
    assert res2.receipt.active and counters(tree) == c1
    ok(tree)
    tree.cache_finished(NS, tokens, full[2:], swa[2:], 2 * P, 0, res2.receipt)
    ok(tree)
    assert counters(tree) == (2, 0, 2, 0, 0)

    # the owner layer: the stale second call (same prev, same pages) is refused
    cache = make_cache(P)
    _, rid0 = cache.match(1, NS, tokens, lock=True)
    f, w = cache.alloc(1, total)
    res1, rid1 = cache.cache_unfinished(1, NS, tokens, f, w, 0, 0, rid0)
    state = snapshot(cache)
    with pytest.raises(ReceiptError):
        cache.cache_unfinished(1, NS, tokens, f, w, 0, 0, rid0)
    with pytest.raises(PageNotHeld):
        cache.cache_unfinished(1, NS, tokens, f, w, 0, 0, None)
    assert snapshot(cache) == state and cache.check() == []
    res2, rid2 = cache.cache_unfinished(1, NS, tokens, f[2:], w[2:], 2 * P, 0, rid1)
    assert res2.inserted_len == 2 * P and cache.check() == []
    cache.cache_finished(1, NS, tokens, f[2:], w[2:], 2 * P, 0, rid2)
    assert cache.check() == [] and not cache.tree.receipts


@pytest.mark.parametrize("P", [1, 16])
def test_one_page_owned_twice_is_refused(P):
    """#35270 / PR #35470 / PR #38355: the same pages counted under two nodes or freed while the
    tree held them. Here a page listed twice, or one the caller does not hold, is refused before
    anything changes."""
    cache = make_cache(P)
    f1, w1 = cache.alloc(1, 3)
    cache.insert(1, NS, seq(P, [1, 2, 3]), f1, w1)
    f, w = cache.alloc(2, 3)
    g, x = cache.alloc(3, 1)
    s = seq(P, [4, 5, 6])
    state = snapshot(cache)
    bad_calls = [
        (AllocatorError, dict(full=array("i", [f[0], f[0], f[1]]), swa=w)),  # listed twice
        (AllocatorError, dict(full=f, swa=array("i", [w[0], w[1], w[1]]))),
        (PageNotHeld, dict(full=array("i", [f[0], f[1], g[0]]), swa=w)),  # another owner's
        (PageNotHeld, dict(full=array("i", [f[0], f[1], f1[0]]), swa=w)),  # the tree's
        (PageNotHeld, dict(full=f, swa=array("i", [w[0], w[1], w1[2]]))),
        (PageNotHeld, dict(full=array("i", [f[0], f[1], 0]), swa=w)),
    ]
    for exc, kw in bad_calls:
        with pytest.raises((exc, BadArgument)):
            cache.insert(2, NS, s, kw["full"], kw["swa"])
        assert snapshot(cache) == state and cache.check() == []
        with pytest.raises((exc, BadArgument)):
            cache.cache_finished(2, NS, s, kw["full"], kw["swa"], 0, 0, None)
        assert snapshot(cache) == state and cache.check() == []
    with pytest.raises((AllocatorError, BadArgument)):
        cache.free(2, [f[0], f[0]])
    with pytest.raises(PageNotHeld):
        cache.free(2, [f1[0]])  # a page the tree holds
    assert snapshot(cache) == state and cache.check() == []

    # the tree alone refuses a page listed twice in one insert, with nothing changed
    tree, sink = make_tree(P)
    tree.namespace(NS)
    before = set(tree.nodes)
    with pytest.raises(BadArgument):
        tree.insert(NS, s, array("i", [5, 5, 6]), array("i", [7, 8, 9]))
    with pytest.raises(BadArgument):
        tree.insert(NS, s, array("i", [5, 6, 7]), array("i", [8, 8, 9]))
    assert set(tree.nodes) == before and not sink.full and not sink.swa
    ok(tree)
    # the checker notices a page planted under two nodes
    ids = Ids()
    tree.insert(NS, seq(P, [1]), ids.full(1), ids.swa(1))
    tree.insert(NS, seq(P, [2]), ids.full(1), ids.swa(1))
    n1, n2 = tree.namespace(NS).root.children.values()
    n2.full = array("i", n1.full)
    assert any("more than one node" in v for v in check_tree(tree))


@pytest.mark.parametrize("pool", ["full", "swa"])
def test_cache_finished_refuses_a_page_listed_in_both_the_prefix_and_the_tail(pool):
    """daemon/tree/radix.py RadixTree.cache_finished / _split_tail: distinctness is checked by
    insert() over [prev, aligned end) only; the unaligned tail page is split off first and never
    compared with the rest.

    ``cache_finished(tokens of 2.5 pages, full=[1, 2, 1], ...)``: expected BadArgument (as
    ``insert`` gives for ``[1, 1]``) with nothing changed. Actual: page 1 is adopted by the tree
    and also handed to the sink as free: one page in the tree and in the free list. (ModelCache
    rejects such a list before reaching the tree, so this needs a direct tree caller.)
    """
    P = 4
    sink = CollectingSink()
    tree = RadixTree(P, 2 * P, sink)
    tokens = seq(P, [1, 2], tail=2)
    full = array("i", [1, 2, 1] if pool == "full" else [1, 2, 3])
    swa = array("i", [5, 6, 5] if pool == "swa" else [5, 6, 7])
    with pytest.raises(BadArgument):
        tree.cache_finished(NS, tokens, full, swa, 0, 0, None)
    assert tree.device_pages() == (0, 0) and not sink.full and not sink.swa
    assert check_tree(tree) == []
