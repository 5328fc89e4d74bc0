"""Locks and pins (daemon/tree/locks.py): receipts stay exact across splits; a lost or repeated
release is refused. Tests named after SGLang bug classes (reference/sglang.md section 10) replay
the shape of that failure and assert what radixd does instead.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.tree import CollectingSink, RadixTree, ReceiptError, as_token_bytes, check_tree

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


# ---------------------------------------------------------------------- many locks at once

NAMESPACES = ("alpha", "beta")
#: a tree, its locks and pins, step by step: sequences inserted (namespace, page labels; a few
#: first, so that the steps have paths to work on); locks,
#: each a match of a prefix of a sequence inserted before (its index and page count; 0: a lock
#: of nothing), some with their SWA released early; evictions between them (tombstones, splits
#: under locks); host copies along a sequence's path, top down; pins (device or host only)
#: taken and given back
lock_steps = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.sampled_from(NAMESPACES),
              st.lists(st.integers(1, 4), min_size=1, max_size=8)),
    st.tuples(st.just("lock"), st.integers(0, 20), st.integers(0, 8), st.booleans()),
    # (every unlocked SWA page at once: the released windows of locked paths become tombstones)
    st.tuples(st.just("evict"), st.integers(0, 4), st.sampled_from([0, 1, 3, 6, 10**6])),
    st.tuples(st.just("host"), st.integers(0, 20), st.integers(1, 8)),
    st.tuples(st.just("pin"), st.integers(0, 20), st.integers(1, 8), st.booleans()),
    st.tuples(st.just("unpin"), st.integers(0, 20)),
), min_size=1, max_size=30)
lock_scripts = st.fixed_dictionaries({
    "P": st.sampled_from(PAGE_SIZES),
    "first": st.lists(st.tuples(st.just("insert"), st.sampled_from(NAMESPACES),
                                st.lists(st.integers(1, 4), min_size=1, max_size=8)),
                      min_size=1, max_size=4),
    "steps": lock_steps,
    "copy_hits": st.sampled_from([None, 0]),  # 0: a cleaned-up node is named for a host copy
    "release": st.lists(st.integers(0, 29), max_size=16),
})


def _locked_tree(script: dict):
    """The script's tree with its locks and pins: (tree, sink, receipts still held)."""
    P = script["P"]
    sink = CollectingSink()
    tree = RadixTree(P, 2 * P, sink, host_sink=sink, policy="lru")
    ids = Ids()
    slots = Ids()
    seqs: list[tuple[str, bytes]] = []
    receipts, pins = [], []
    for step in script["first"] + script["steps"]:
        if step[0] == "insert":
            ns, s = step[1], seq(P, step[2])
            m = tree.match(ns, s)
            new = len(s) // 4 // P - m.prefix_len // P
            if new:
                tree.insert(ns, s, ids.full(new), ids.swa(new), m.prefix_len)
            seqs.append((ns, s))
            continue
        if not seqs:
            continue
        if step[0] == "evict":
            tree.evict(step[1], step[2])
            continue
        if step[0] == "unpin":
            if pins:
                tree.unpin(pins.pop(step[1] % len(pins)))
            continue
        ns, s = seqs[step[1] % len(seqs)]
        s = s[: min(step[2] * P, len(s) // 4) * 4]
        if step[0] == "lock":
            r = tree.match(ns, s, lock=True).receipt
            if r is not None:
                if step[3]:
                    tree.release_swa(r)
                receipts.append(r)
            continue
        n = tree.nodes.get(tree.match(ns, s).node_id)
        path = []
        while n is not None and n.parent is not None:
            path.append(n)
            n = n.parent
        if step[0] == "host":
            for n in reversed(path):  # prefix closed: stop at the first that cannot have one
                if n.host is None and (n.full is None or n.parent.host is None
                                       and n.parent.parent is not None):
                    break
                if n.host is None:
                    k = len(n.tokens) // tree.page_bytes
                    tree.set_host(n.id, slots.full(k))
        elif path and (not step[3] or path[0].host is not None):
            pins.append(tree.pin(path[0], host_only=step[3]))
    tree.host_copy_hits = script["copy_hits"]
    return tree, sink, [r for r in receipts if r.active]


def _whole_state(tree, sink):
    """Nodes with their ids, locks, pins and eviction-queue keys, the counters, the nodes named
    for a host copy, and what was freed."""
    def key(entry):
        return None if entry is None else entry[0]
    nodes = sorted((n.id, bytes(n.tokens), tuple(n.full or ()),
                    None if n.swa is None else tuple(n.swa), tuple(n.host or ()),
                    n.full_lock, n.swa_lock, n.pin, n.host_pin, n.dev_children,
                    key(n.full_entry), key(n.swa_entry), key(n.host_entry),
                    key(n.host_swa_entry)) for n in tree.iter_nodes())
    return (nodes, counters(tree), tree.full_protected, tree.swa_protected,
            len(tree.receipts), len(tree.pins), sorted(n.id for n in tree.awaiting_copy),
            [n.id for n in tree.host_drops], sorted(sink.full), sorted(sink.swa),
            sorted(sink.host), dict(tree.stats))


def _same_as_one_at_a_time(script: dict) -> None:
    one, one_sink, one_rs = _locked_tree(script)
    every, every_sink, every_rs = _locked_tree(script)
    ok(one)
    assert _whole_state(every, every_sink) == _whole_state(one, one_sink)
    picked = sorted({i % len(one_rs) for i in script["release"]}) if one_rs else []
    for i in picked:
        one.unlock(one_rs[i])
    every.unlock_all([every_rs[i] for i in picked] + [every_rs[i] for i in picked[:1]])
    assert _whole_state(every, every_sink) == _whole_state(one, one_sink)
    assert all(not every_rs[i].active for i in picked)
    for tree in (one, every):
        while tree.awaiting_copy:
            tree.commit_evictions()
        ok(tree)
    assert _whole_state(every, every_sink) == _whole_state(one, one_sink)
    for tree in (one, every):  # all that can go, whichever of equal keys goes first
        for _ in range(100):
            before = len(tree.nodes), tree.device_pages()
            tree.evict(10**6, 10**6)
            while tree.awaiting_copy:
                tree.commit_evictions()
            if (len(tree.nodes), tree.device_pages()) == before:
                break
        ok(tree)
    assert _whole_state(every, every_sink)[:2] == _whole_state(one, one_sink)[:2]


@settings(max_examples=300, deadline=None)
@given(script=lock_scripts)
def test_unlock_all_leaves_what_unlocking_one_at_a_time_leaves(script):
    """A session's end releases its locks in one pass (``unlock_all``): the tree, its counters,
    its eviction queues, the nodes its cleanup names for a host copy and the pages freed must
    be what one ``unlock`` per receipt gives (between nodes of equal keys the queues' order
    may differ: lru.py), and so must the state once the named nodes' evictions commit."""
    _same_as_one_at_a_time(script)


@pytest.mark.parametrize("copy_hits", [None, 0])
@pytest.mark.parametrize("P", PAGE_SIZES)
def test_unlock_all_cleans_up_every_anchor_left_a_tombstone(P, copy_hits):
    """Locks whose windows were released early, on two sibling leaves (one with a host copy)
    and on their parent, with every unlocked SWA page evicted meanwhile: each anchor is a
    tombstone once unlocked, and each must be cleaned up (deleted, demoted to its host copy,
    or named for one) as one unlock at a time would."""
    _same_as_one_at_a_time({
        "P": P, "copy_hits": copy_hits,
        "first": [("insert", "alpha", [1, 2, 3, 4]), ("insert", "alpha", [1, 2, 5, 6])],
        "steps": [("host", 0, 4), ("lock", 0, 4, True), ("lock", 1, 4, True),
                  ("lock", 0, 2, True), ("evict", 0, 10**6)],
        "release": [0, 1, 2],
    })


def test_unlock_all_refuses_a_released_receipt_and_moves_nothing():
    tree, _ = make_tree(4)
    ids = Ids()
    s = seq(4, [1, 2, 3])
    tree.insert(NS, s, ids.full(3), ids.swa(3))
    r1 = tree.match(NS, s, lock=True).receipt
    r2 = tree.match(NS, s, lock=True).receipt
    tree.unlock(r1)
    before = (lock_counts(tree), counters(tree))
    with pytest.raises(ReceiptError):
        tree.unlock_all([r2, r1])
    assert (lock_counts(tree), counters(tree)) == before and r2.active
    tree.unlock_all([r2])
    ok(tree)
    assert all(v == (0, 0) for v in lock_counts(tree).values())


def test_a_session_of_many_locks_on_one_deep_path_ends_in_one_pass():
    """Pages of one token, a path of 300 nodes (a branch at every token), 400 locks of one
    owner on its end and 50 on a middle node: the owner's end releases all of them, the
    counters and the checker agree, and the other owner's lock still holds its path."""
    cache = make_cache(P=1, window_pages=8, full=1024, swa=1024)
    path = list(range(1, 301))
    f, w = cache.alloc(1, 300)
    cache.insert(1, NS, as_token_bytes(path), f, w)
    for i in range(1, 300):
        f, w = cache.alloc(1, 1)
        cache.insert(1, NS, as_token_bytes(path[:i] + [10_000 + i]), f, w, i)
    assert sum(1 for _ in cache.tree.iter_nodes()) >= 600
    end = cache.match(2, NS, as_token_bytes(path), lock=True)[0]
    middle = cache.match(2, NS, as_token_bytes(path[:150]), lock=True)[0]
    for _ in range(399):
        cache.lock(2, NS, end.node_id)
    for _ in range(49):
        cache.lock(2, NS, middle.node_id)
    kept = cache.match(3, NS, as_token_bytes(path[:100]), lock=True)[1]
    assert cache.release_owner(2) == (450, 0, 0)
    assert cache.check() == []
    assert counters(cache.tree) == recount(cache.tree)
    locked = [n for n in cache.tree.iter_nodes() if n.full_lock]
    assert locked and max(n.depth for n in locked) == 100
    assert all(n.full_lock == 1 for n in locked)
    cache.unlock(3, kept)
    assert cache.check() == [] and not any(n.full_lock for n in cache.tree.iter_nodes())


def test_the_checker_counts_every_lock_and_pin_of_a_deep_path_once_and_finds_one_lost():
    """The checker adds up the receipts and pins of each node in one pass over their paths
    (not one walk to the root each): on a path of 200 one-token nodes with 300 locks at three
    depths and pins at two, a lock or pin count one off anywhere is still reported, at that
    node only."""
    tree, _ = make_tree(1, window_pages=8)
    ids = Ids()
    path = list(range(1, 201))
    tree.insert(NS, as_token_bytes(path), ids.full(200), ids.swa(200))
    for i in range(1, 200):
        tree.insert(NS, as_token_bytes(path[:i] + [10_000 + i]), ids.full(1), ids.swa(1), i)
    ends = [tree.match(NS, as_token_bytes(path[:d])).node_id for d in (200, 120, 40)]
    receipts = [tree.lock(ends[i % 3], NS) for i in range(300)]
    pin = tree.pin(tree.get_node(ends[1], NS))
    host_pin = tree.pin(tree.get_node(ends[2], NS), host_only=True)
    ok(tree)
    for n in [tree.get_node(e, NS) for e in ends] + [tree.get_node(ends[2], NS).parent]:
        for attr, words in (("full_lock", "receipts account for"),
                            ("swa_lock", "receipts account for"),
                            ("pin", "pins in flight account for"),
                            ("host_pin", "pins in flight account for")):
            setattr(n, attr, getattr(n, attr) + 1)
            found = check_tree(tree)
            setattr(n, attr, getattr(n, attr) - 1)
            assert [p for p in found if words in p] and all(
                p.startswith(f"node {n.id}:") for p in found if words in p), (attr, found)
    ok(tree)
    tree.unpin(pin)
    tree.unpin(host_pin)
    tree.unlock_all(receipts)
    ok(tree)
