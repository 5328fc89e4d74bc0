"""Eviction (daemon/tree/eviction.py): no tombstone leaf left behind, page counters exact after
any sequence (tests named after SGLang bug classes, reference/sglang.md section 10), and the
two-phase eviction the memory tiers drive (name, copy, commit).
"""

from __future__ import annotations

import random
from array import array

import pytest

from daemon.tree import CollectingSink, Node, NodeNotUsable, RadixTree, ReceiptError, check_tree

from .helpers import (
    NS,
    PAGE_SIZES,
    Ids,
    counters,
    dead_leaves,
    make_cache,
    make_tree,
    ok,
    recount,
    seq,
)


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


# ---------------------------------------------------------------------- two-phase eviction


def two_phase_tree(P: int) -> tuple[RadixTree, CollectingSink, Ids]:
    sink = CollectingSink()
    tree = RadixTree(P, 2 * P, sink, host_sink=sink, policy="lru")
    tree.host_copy_hits = 0
    return tree, sink, Ids()


def copy_chain(tree: RadixTree, n: Node) -> None:
    """What the tiers do in phase 2: host copies for ``n`` and the ancestors it needs."""
    chain = []
    while n.host is None:
        chain.append(n)
        n = n.parent
    for a in reversed(chain):
        tree.set_host(a.id, array("i", range(900 + 10 * a.id, 900 + 10 * a.id + tree.npages(a))))


@pytest.mark.parametrize("P", [1, 4])
def test_eviction_names_a_victim_without_a_host_copy_and_stops(P):
    """Phase 1: the tree takes nothing from a node the tiers want on host; it names it and
    returns, so that no copy runs inside the eviction."""
    tree, sink, ids = two_phase_tree(P)
    s = seq(P, [1, 2, 3])
    tree.insert(NS, s, ids.full(3), ids.swa(3))
    res = tree.evict(full_pages=3)
    assert res.full_pages == 0 and not sink.full
    assert [n.tokens for n in tree.awaiting_copy] == [s]
    n = tree.awaiting_copy[0]
    assert n.full is not None and tree.nodes[n.id] is n
    assert any("half-done" in x for x in check_tree(tree))  # the caller must commit
    tree.commit_evictions()
    ok(tree)


@pytest.mark.parametrize("P", [1, 4])
@pytest.mark.parametrize("copied", [True, False])
def test_commit_demotes_a_copied_victim_and_deletes_a_declined_one(P, copied):
    tree, sink, ids = two_phase_tree(P)
    s = seq(P, [1, 2, 3])
    tree.insert(NS, s, ids.full(3), ids.swa(3))
    tree.evict(full_pages=3)
    (n,) = tree.awaiting_copy
    if copied:
        tree.set_host(n.id, array("i", [900, 901, 902]))
    res = tree.commit_evictions("alloc")
    assert res.full_pages == 3 and not tree.awaiting_copy
    assert tree.evictions_by_reason["alloc"][0] == 3
    assert (tree.nodes.get(n.id) is n) == copied
    assert n.full is None and (n.host is not None) == copied
    ok(tree)


@pytest.mark.parametrize("P", [1, 4])
def test_resumed_eviction_takes_what_a_one_shot_eviction_takes(P):
    """Naming, copying, committing and resuming frees the same pages, in the same order, as an
    eviction that never stops (a tree without tiers)."""

    def build(tree: RadixTree) -> None:
        ids = Ids()
        for lab in range(1, 6):
            tree.insert(NS, seq(P, [lab, lab + 10, lab + 20]), ids.full(3), ids.swa(3))

    ref_sink = CollectingSink()
    ref = RadixTree(P, 2 * P, ref_sink, policy="lru")
    build(ref)
    ref.evict(full_pages=7)
    tree, sink, _ = two_phase_tree(P)
    build(tree)
    slot = 1000
    res = tree.evict(full_pages=7)
    while tree.awaiting_copy:
        for n in list(tree.awaiting_copy):
            k = tree.npages(n)
            if n.parent.host is not None and k % 2:  # copy some, decline the others
                tree.set_host(n.id, array("i", range(slot, slot + k)))
                slot += k
        res.add(tree.commit_evictions("alloc"))
        res.add(tree.evict(full_pages=max(0, 7 - res.full_pages)))
    assert res.full_pages == 7
    assert sorted(sink.full) == sorted(ref_sink.full)
    ok(tree)


@pytest.mark.parametrize("P", [1, 4])
def test_unlock_cleanup_names_a_dead_leaf_instead_of_deleting_it(P):
    """The cleanup of an unlock (a full-locked leaf that lost its SWA) is an eviction too: the
    tree names the leaf; the commit demotes it once the tiers copied it."""
    tree, sink, ids = two_phase_tree(P)
    s = seq(P, [1, 2, 3, 4])
    r = tree.insert(NS, s, ids.full(4), ids.swa(4), lock=True)
    tree.release_swa(r.receipt)
    tree.evict(swa_pages=4)  # the leaf loses its SWA while its full KV is locked
    tree.unlock(r.receipt)
    (n,) = tree.awaiting_copy
    assert n.swa is None and n.full is not None
    copy_chain(tree, n)
    tree.commit_evictions()
    assert n.full is None and n.host is not None and not tree.awaiting_copy
    ok(tree)


def test_an_swa_host_eviction_takes_leaves_that_hold_swa_host_slots():
    """Four host-only leaves, oldest first: A and B without SWA host copies, C and D with them.
    Freeing one SWA host slot takes C, the coldest that holds one (before 2026-11-29 it took A
    and B first, their full host pages for nothing); with none left that holds any, it stops
    short rather than drop the others; freeing full slots takes the coldest leaf, as ever."""
    P = 4
    tree, sink, ids = two_phase_tree(P)
    tree.host_copy_hits = None
    leaves = []
    for label, with_swa in ((1, False), (2, False), (3, True), (4, True)):
        s = seq(P, [label])
        tree.insert(NS, s, ids.full(1), ids.swa(1))
        n = tree.get_node(tree.match(NS, s).node_id)
        tree.set_host(n.id, array("i", [900 + label]),
                      array("i", [950 + label]) if with_swa else None)
        leaves.append(n)
    tree.evict(full_pages=4)
    a, b, c, d = leaves
    assert all(n.full is None and n.host is not None for n in leaves)
    res = tree.evict_host(0, swa_slots=1)
    assert (res.host_slots, res.host_swa_slots) == (1, 1)
    assert sink.host == [903] and sink.host_swa == [953]
    assert [tree.nodes.get(n.id) for n in (a, b, d)] == [a, b, d]
    ok(tree)
    res = tree.evict_host(0, swa_slots=2)  # D, then none holds any: A and B stay
    assert (res.host_slots, res.host_swa_slots) == (1, 1)
    assert sorted(sink.host) == [903, 904] and tree.nodes.get(a.id) is a
    ok(tree)
    res = tree.evict_host(1)
    assert res.host_slots == 1 and tree.nodes.get(a.id) is None and tree.nodes.get(b.id) is b
    ok(tree)


def test_an_swa_host_eviction_reaches_a_window_under_a_leaf_without_one():
    """A holds SWA host slots (its window), its only child B none (B's copy found no SWA slot):
    no leaf holds any, and B is what stands over A's window. Freeing an SWA host slot takes B
    then A, instead of stopping short with A's slots out of reach; a leaf over no such
    ancestor (C) stays."""
    P = 4
    tree, sink, ids = two_phase_tree(P)
    tree.host_copy_hits = None
    c_seq, a_seq, ab_seq = seq(P, [9]), seq(P, [1, 2]), seq(P, [1, 2, 3])
    tree.insert(NS, c_seq, ids.full(1), ids.swa(1))
    tree.insert(NS, a_seq, ids.full(2), ids.swa(2))
    tree.insert(NS, ab_seq, ids.full(1), ids.swa(1), prev_prefix_len=2 * P)
    c = tree.get_node(tree.match(NS, c_seq).node_id)
    a = tree.get_node(tree.match(NS, a_seq).node_id)
    b = tree.get_node(tree.match(NS, ab_seq).node_id)
    assert b.parent is a
    tree.set_host(c.id, array("i", [909]))
    tree.set_host(a.id, array("i", [901, 902]), array("i", [951, 952]))
    tree.set_host(b.id, array("i", [903]))
    tree.evict(full_pages=4)
    assert all(n.full is None for n in (a, b, c))
    res = tree.evict_host(0, swa_slots=1)
    assert (res.host_slots, res.host_swa_slots) == (3, 2)
    assert sorted(sink.host) == [901, 902, 903] and sorted(sink.host_swa) == [951, 952]
    assert tree.nodes.get(c.id) is c
    ok(tree)


def test_dropped_host_pages_stay_held_until_released():
    """L3 write-back is the two-phase eviction of the host tier: a dropped host-only leaf keeps
    its slots (bytes readable) until the tiers release it."""
    P = 4
    tree, sink, ids = two_phase_tree(P)
    tree.host_copy_hits = None
    tree.report_host_drops = True
    s = seq(P, [1, 2])
    tree.insert(NS, s, ids.full(2), ids.swa(2))
    n = tree.get_node(tree.match(NS, s).node_id)
    tree.set_host(n.id, array("i", [900, 901]))
    tree.evict(full_pages=2)
    assert tree.evict_host(2).host_slots == 2
    assert tree.host_drops == [n] and not sink.host and tree.host_pages == 0
    tree.release_host_drops()
    assert sorted(sink.host) == [900, 901] and not tree.host_drops
    ok(tree)


def test_tree_package_stays_pure():
    """No torch, no asyncio and no callback attributes on the tree: the tiers act between tree
    operations, never from inside one."""
    import ast
    import pathlib

    import daemon.tree as pkg

    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(m.split(".")[0] in {"torch", "asyncio", "socket"} for m in names), \
                    path
    tree, _, _ = two_phase_tree(1)
    assert not any(callable(v) for v in vars(tree).values())


@pytest.mark.parametrize("P", [1, 4])
def test_an_unpin_names_a_victim_once_when_only_the_parent_wants_a_copy(P):
    """An unpin checks every node its pin guarded, child first: the child's cleanup climbs to a
    parent the policy wants on host (more hits than the child) and names it, then the loop
    reaches that parent itself. It must be named once, copied once, committed once (it was
    named twice, and the commit failed the load that unpinned with an internal error)."""
    from daemon.tree import EvictResult

    mc = make_cache(P, window_pages=1, full=16, swa=16)
    owner = 1
    f, s = mc.alloc(owner, 2)
    mc.insert(owner, NS, seq(P, [1, 2]), f, s)
    f, s = mc.alloc(owner, 4)
    mc.insert(owner, NS, seq(P, [1, 2, 3, 4]), f, s)  # parent B [1, 2], child A [3, 4]
    tree = mc.tree
    _res, rid = mc.match(owner, NS, seq(P, [1, 2, 3, 4]), lock=True)  # splits at the window
    mc.release_swa(owner, rid)  # decoding past the window
    mc.evict(0, 4)  # the path loses its SWA while its full KV is locked
    (b,) = [n for n in tree.iter_nodes() if n.parent is not None and n.parent.parent is None]
    leaf = max(tree.iter_nodes(), key=lambda n: n.depth)
    assert leaf.parent is not b and leaf is not b  # at least one node between them
    pin = tree.pin(leaf)  # a copy (a load) holds the path
    mc.unlock(owner, rid)  # pinned: nothing is dropped yet
    for n in tree.iter_nodes():
        n.hits = 3 if n is b else 0
    tree.host_copy_hits = 1  # write_through_selective: the parent qualifies, the rest not
    offered: list[int] = []
    mc.copy_to_host = lambda n: offered.append(n.id)  # the tiers decline (no host room)
    mc.unpin(pin)
    assert offered == [b.id]
    assert not tree.awaiting_copy and b.id not in tree.nodes  # declined: deleted
    assert mc.check() == []
    assert isinstance(tree.commit_evictions(), EvictResult)  # nothing left to commit
