"""Regression tests named after the SGLang bug classes (reference/sglang.md section 10).

Each test replays the shape of a known SGLang failure against radixd and asserts what radixd does
instead: refuse with an error and change nothing, or stay consistent (checker clean, counters
exact, every page in exactly one place).
"""

from __future__ import annotations

import random
from array import array

import pytest

from daemon.gpu.allocator import AllocatorError
from daemon.gpu.profile import ModelProfile
from daemon.model_cache import ModelCache, PageNotHeld
from daemon.tree import (
    BadArgument,
    CollectingSink,
    NodeNotUsable,
    RadixTree,
    ReceiptError,
    as_token_bytes,
    check_tree,
)

PAGE_SIZES = [1, 16, 64]
NS = "ns"


def seq(P: int, labels: list[int], tail: int = 0) -> bytes:
    toks: list[int] = []
    for lab in labels:
        toks += [lab * 1000 + j for j in range(P)]
    toks += [999_000 + j for j in range(tail)]
    return as_token_bytes(toks)


class Ids:
    """Fresh full / SWA page ids for tree-level tests."""

    def __init__(self) -> None:
        self.f = 0
        self.s = 100_000

    def full(self, n: int) -> array:
        out = array("i", range(self.f + 1, self.f + 1 + n))
        self.f += n
        return out

    def swa(self, n: int, zeros: int = 0) -> array:
        out = array("i", [0] * zeros) + array("i", range(self.s + 1, self.s + 1 + n - zeros))
        self.s += n - zeros
        return out


def make_tree(P: int, window_pages: int = 2) -> tuple[RadixTree, CollectingSink]:
    sink = CollectingSink()
    return RadixTree(P, window_pages * P, sink, policy="lru"), sink


def make_cache(P: int = 4, window_pages: int = 2, full: int = 64, swa: int = 64) -> ModelCache:
    profile = ModelProfile(
        name="m", page_size=P, num_full_layers=1, num_kv_heads=1, head_dim=1, full_pages=full,
        sliding_window=window_pages * P, num_swa_layers=1, swa_pages=swa, dtype="float32",
        device="cpu")
    return ModelCache(profile)


def ok(tree: RadixTree) -> None:
    assert check_tree(tree) == []


def lock_counts(tree: RadixTree) -> dict[int, tuple[int, int]]:
    return {n.id: (n.full_lock, n.swa_lock) for n in tree.iter_nodes()}


def counters(tree: RadixTree) -> tuple[int, int, int, int, int]:
    return (tree.full_evictable, tree.full_protected, tree.swa_evictable, tree.swa_protected,
            tree.host_pages)


def recount(tree: RadixTree) -> tuple[int, int, int, int, int]:
    """The page counters recomputed from the nodes, independently of the checker."""
    fe = fp = se = sp = hp = 0
    for n in tree.iter_nodes():
        if n.parent is None:
            continue
        np_ = len(n.tokens) // tree.page_bytes
        if n.full is not None:
            if n.full_lock:
                fp += np_
            else:
                fe += np_
        if n.swa is not None:
            if n.swa_lock:
                sp += np_
            else:
                se += np_
        if n.host is not None:
            hp += np_
    return fe, fp, se, sp, hp


def dead_leaves(tree: RadixTree) -> list:
    return [n for n in tree.iter_nodes()
            if n.parent is not None and n.full is not None and n.swa is None
            and n.dev_children == 0 and n.full_lock == 0]


def snapshot(cache: ModelCache):
    """Everything a refused call must leave untouched."""
    t = cache.tree
    nodes = sorted((n.id, bytes(n.tokens), tuple(n.full or ()), tuple(n.swa or ()) if n.swa
                    is not None else None, n.full_lock, n.swa_lock) for n in t.iter_nodes())
    holdings = {o: (sorted(h.full), sorted(h.swa), sorted(h.receipts))
                for o, h in cache.holdings.items()}
    a = cache.alloc_state
    return (nodes, holdings, sorted(a.full.free_set()), sorted(a.swa.free_set()),
            counters(t), len(t.receipts))


# ---------------------------------------------------------------------- (a) lost receipts


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_lost_receipt_double_release_refused(P):
    """#24153 / PR #26218 / PR #28161: a release that does not match an acquire underflowed
    ``swa_lock_ref``. Here every second release is refused and no count moves."""
    tree, sink = make_tree(P)
    ids = Ids()
    s = seq(P, [1, 2, 3, 4])
    tree.insert(NS, s, ids.full(4), ids.swa(4))
    r1 = tree.match(NS, s, lock=True).receipt
    r2 = tree.match(NS, seq(P, [1, 2, 3]), lock=True).receipt  # overlapping windows
    ok(tree)
    tree.release_swa(r1)
    before = lock_counts(tree)
    with pytest.raises(ReceiptError):
        tree.release_swa(r1)  # PR #28161: SWA released twice
    assert lock_counts(tree) == before
    tree.unlock(r1)
    ok(tree)
    before = lock_counts(tree)
    for again in (tree.unlock, tree.release_swa):
        with pytest.raises(ReceiptError):
            again(r1)
    assert lock_counts(tree) == before
    # a finished request handing back an already-released receipt changes nothing at all
    more = ids.full(1)
    with pytest.raises(ReceiptError):
        tree.cache_finished(NS, seq(P, [1, 2, 3, 4, 5]), more, ids.swa(1), 4 * P, 0, r1)
    with pytest.raises(ReceiptError):
        tree.cache_unfinished(NS, seq(P, [1, 2, 3, 4, 5]), more, ids.swa(1), 4 * P, 0, r1)
    assert lock_counts(tree) == before and not sink.full and not sink.swa
    assert tree.match(NS, seq(P, [1, 2, 3, 4, 5])).prefix_len == 4 * P
    tree.unlock(r2)
    ok(tree)
    assert all(v == (0, 0) for v in lock_counts(tree).values())
    assert counters(tree) == (4, 0, 4, 0, 0)

    # the same through the owner layer: a receipt is one owner's, and released once
    cache = make_cache(P)
    f, w = cache.alloc(1, 3)
    cache.insert(1, NS, seq(P, [1, 2, 3]), f, w)
    _, rid = cache.match(1, NS, seq(P, [1, 2, 3]), lock=True)
    with pytest.raises(ReceiptError):
        cache.unlock(2, rid)
    with pytest.raises(ReceiptError):
        cache.release_swa(2, rid)
    cache.unlock(1, rid)
    state = snapshot(cache)
    for call in (cache.unlock, cache.release_swa):
        with pytest.raises(ReceiptError):
            call(1, rid)
    assert cache.release_owner(1) == (0, 0, 0)
    assert snapshot(cache)[0] == state[0] and cache.check() == []


# ---------------------------------------------------------------------- (b) cursors and splits


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_window_edge_moved_by_split_keeps_receipt_valid(P):
    """PR #36848 / PR #38138 / #8931: splits under a live lock moved the recorded window edge or
    dropped locks. Here the receipt records a page count, so splits inside the locked window and
    above it leave the release exact."""
    tree, sink = make_tree(P, window_pages=3)
    ids = Ids()
    a = seq(P, [1, 2, 3, 4])
    s = seq(P, [1, 2, 3, 4, 5])
    tree.insert(NS, a, ids.full(4), ids.swa(4))
    tree.insert(NS, s, ids.full(1), ids.swa(1), 4 * P)
    m = tree.match(NS, s, lock=True)
    r = m.receipt
    assert r.swa_pages == 3
    ok(tree)
    # the window edge falls inside A: A was split so the lock pins exactly 3 pages
    assert tree.swa_protected == 3 and tree.full_protected == 5
    splits = tree.stats["splits"]
    assert tree.match(NS, seq(P, [1])).prefix_len == P  # split above the window
    ok(tree)
    assert tree.match(NS, seq(P, [1, 2, 3])).prefix_len == 3 * P  # split inside the window
    ok(tree)
    assert tree.stats["splits"] == splits + 2
    res = tree.insert(NS, seq(P, [1, 2, 3, 9]), ids.full(4), ids.swa(4))  # branch in the window
    ok(tree)
    assert res.prefix_len == 3 * P
    # a second lock whose window overlaps the first one and ends inside it (more splits)
    r2 = tree.match(NS, seq(P, [1, 2, 3, 4]), lock=True).receipt
    ok(tree)
    assert r2.swa_pages == 3
    assert tree.match(NS, seq(P, [1, 2])).prefix_len == 2 * P
    ok(tree)
    # SWA eviction may take everything above the windows and the unlocked branch, nothing else
    tree.evict(0, 100)
    ok(tree)
    assert tree.match(NS, s).prefix_len == 5 * P
    assert tree.match(NS, seq(P, [1, 2, 3, 4])).prefix_len == 4 * P
    tree.unlock(r)
    ok(tree)
    tree.unlock(r2)
    ok(tree)
    assert all(v == (0, 0) for v in lock_counts(tree).values())
    assert tree.full_protected == 0 and tree.swa_protected == 0
    assert counters(tree) == recount(tree)
    tree.evict(100, 100)
    ok(tree)
    assert set(tree.nodes) == {tree.namespace(NS).root.id}


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


# ---------------------------------------------------------------------- (c) two owners for one slot


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


@pytest.mark.parametrize("P", PAGE_SIZES)
@pytest.mark.parametrize("window_pages", [1, 2, 3])
def test_tombstone_never_left_as_leaf(P, window_pages):
    """#24153 / PR #23882 / PR #23391: SWA-only eviction crashed on leaves with a full lock and
    no SWA lock, and cascade eviction met locked or tombstoned nodes. Here: SWA eviction under a
    released SWA lock, then unlock and cache_finished with the frontier at the very end, in both
    orders; no unlocked tombstone leaf ever exists and everything is freed exactly once."""
    for order in ("finish_first", "evict_between"):
        tree, sink = make_tree(P, window_pages)
        ids = Ids()
        base = seq(P, [1, 2, 3])
        base_full = ids.full(3)
        tree.insert(NS, base, base_full, ids.swa(3))
        tokens = seq(P, [1, 2, 3, 4, 5, 6])
        m = tree.match(NS, tokens, lock=True)
        assert m.prefix_len == 3 * P
        other = tree.match(NS, seq(P, [1, 2]), lock=True).receipt  # a second reader
        new_full = ids.full(3)
        tree.release_swa(m.receipt)
        tree.release_swa(other)
        ok(tree)
        tree.evict(0, 100)  # every SWA page goes; full stays (locked)
        ok(tree)
        assert tree.swa_evictable == 0 and tree.swa_protected == 0
        if order == "evict_between":
            tree.unlock(other)
            ok(tree)
            assert not dead_leaves(tree)
        res = tree.cache_finished(NS, tokens, new_full, array("i", [0, 0, 0]), 3 * P, 6 * P,
                                  m.receipt)
        ok(tree)
        assert res.inserted_len == 3 * P
        assert not dead_leaves(tree)
        if order == "finish_first":
            tree.unlock(other)
            ok(tree)
        assert not dead_leaves(tree)
        assert set(tree.nodes) == {tree.namespace(NS).root.id}
        assert sorted(sink.full) == sorted(list(base_full) + list(new_full))
        assert len(set(sink.swa)) == len(sink.swa) == 3
        assert counters(tree) == (0, 0, 0, 0, 0)


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
def test_evictable_counters_match_after_everything(P):
    """PR #10637 / #35270: evictable sizes drifted from the pages really in the tree. Here a long
    seeded mix of every operation keeps the incremental counters equal to a recount from the
    nodes, and to free + tree + held = capacity, after every step."""
    rnd = random.Random(1234 + P)
    cache = make_cache(P, window_pages=2, full=48, swa=40)
    tree = cache.tree
    owners = (1, 2, 3)
    docs = [[d * 20 + i for i in range(10)] for d in range(3)]
    live: list[dict] = []
    receipts: list[tuple[int, int]] = []

    def check() -> None:
        assert counters(tree) == recount(tree)
        assert cache.check() == []
        a = cache.alloc_state
        held_full = sum(len(h.full) for h in cache.holdings.values())
        held_swa = sum(len(h.swa) for h in cache.holdings.values())
        full_tree, swa_tree = tree.device_pages()
        assert a.full.available + full_tree + held_full == a.full.usable
        assert a.swa.available + swa_tree + held_swa == a.swa.usable

    for _ in range(250):
        op = rnd.choice(["start", "start", "decode", "finish", "unfinished", "abort", "lock",
                         "unlock", "evict", "kill"])
        if op == "start":
            owner = rnd.choice(owners)
            doc = rnd.choice(docs)
            labels = doc[: rnd.randint(1, len(doc))] + [rnd.randint(500, 502)] * rnd.randint(0, 2)
            tail = rnd.randint(0, P - 1) if P > 1 else 0
            tokens = seq(P, labels, tail=tail)
            m, rid = cache.match(owner, NS, tokens, lock=True)
            total = len(labels) + (1 if tail else 0)
            try:
                full, swa = cache.alloc(owner, total - m.prefix_len // P)
            except Exception:  # out of pages: give the lock back
                cache.unlock(owner, rid)
            else:
                live.append(dict(owner=owner, tokens=tokens, prev=m.prefix_len, rid=rid,
                                 full=list(full), swa=list(swa), frontier=m.prefix_len))
        elif op == "decode" and live:
            rq = rnd.choice(live)
            n = len(rq["tokens"]) // (4 * P)
            p = rq["prev"] // P
            upto = rnd.randint(rq["frontier"] // P, n)
            freed = [rq["swa"][i - p] for i in range(rq["frontier"] // P, upto)
                     if rq["swa"][i - p]]
            cache.free(rq["owner"], swa=freed)
            for i in range(rq["frontier"] // P, upto):
                rq["swa"][i - p] = 0
            rq["frontier"] = max(rq["frontier"], upto * P)
            if rnd.random() < 0.5 and rq["frontier"] > rq["prev"]:
                try:
                    cache.release_swa(rq["owner"], rq["rid"])
                except ReceiptError:
                    pass
        elif op == "finish" and live:
            rq = live.pop(rnd.randrange(len(live)))
            cache.cache_finished(rq["owner"], NS, rq["tokens"], rq["full"], rq["swa"],
                                 rq["prev"], rq["frontier"], rq["rid"])
        elif op == "unfinished" and live:
            rq = rnd.choice(live)
            res, rid = cache.cache_unfinished(rq["owner"], NS, rq["tokens"], rq["full"],
                                              rq["swa"], rq["prev"], rq["frontier"], rq["rid"])
            k = res.inserted_len // P - rq["prev"] // P
            rq.update(full=rq["full"][k:], swa=rq["swa"][k:], prev=res.inserted_len, rid=rid,
                      frontier=max(rq["frontier"], res.inserted_len))
        elif op == "abort" and live:
            rq = live.pop(rnd.randrange(len(live)))
            cache.free(rq["owner"], rq["full"], [p for p in rq["swa"] if p])
            cache.unlock(rq["owner"], rq["rid"])
        elif op == "lock":
            owner = rnd.choice(owners)
            m, _ = cache.match(owner, NS, seq(P, rnd.choice(docs)[: rnd.randint(1, 10)]))
            try:
                receipts.append((owner, cache.lock(owner, NS, m.node_id)))
            except NodeNotUsable:
                pass
        elif op == "unlock" and receipts:
            owner, rid = receipts.pop(rnd.randrange(len(receipts)))
            if rid in cache._receipts:
                cache.unlock(owner, rid)
        elif op == "evict":
            cache.evict(rnd.randint(0, 6), rnd.randint(0, 6))
        elif op == "kill":
            owner = rnd.choice(owners)
            cache.release_owner(owner)
            live[:] = [rq for rq in live if rq["owner"] != owner]
            receipts[:] = [r for r in receipts if r[0] != owner]
        check()
    # the mix really exercised splits, both kinds of eviction and reuse
    assert tree.stats["splits"] > 10 and cache.counters["allocs"] > 20
    assert tree.stats["evicted_full_pages"] > 0 and tree.stats["evicted_swa_pages"] > 0
    assert cache.counters["hit_tokens"] > 0
    for owner in owners:
        cache.release_owner(owner)
    check()
    cache.evict(10_000, 10_000)
    check()
    assert counters(tree) == (0, 0, 0, 0, 0)
    a = cache.alloc_state
    assert a.full.available == a.full.usable and a.swa.available == a.swa.usable
