"""Locks and pins (daemon/tree/locks.py): receipts stay exact across splits; a lost or repeated
release is refused. Tests named after SGLang bug classes (reference/sglang.md section 10) replay
the shape of that failure and assert what radixd does instead.
"""

from __future__ import annotations

import pytest

from daemon.tree import ReceiptError

from .helpers import (
    NS,
    PAGE_SIZES,
    Ids,
    counters,
    lock_counts,
    make_cache,
    make_tree,
    ok,
    recount,
    seq,
    snapshot,
)


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
