"""The eviction queue's lazy refresh (daemon/tree/lru.py): a use raises a node's key, its entry
stays, and the queue still gives the node of the least key now, as an eagerly re-sorted queue
would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.tree import check_tree
from daemon.tree.lru import EvictionQueue

from .helpers import NS, Ids, make_tree, ok, seq


class Item:
    """What the queue needs of a node: the slot for its entry (the tree's Node has one per
    queue) and a key the test sets."""

    __slots__ = ("entry", "key", "name")

    def __init__(self, name: int) -> None:
        self.entry: tuple | None = None
        self.key = 0
        self.name = name


OPS = st.lists(st.tuples(st.sampled_from(["push", "raise", "remove", "pop", "peek"]),
                         st.integers(0, 7), st.integers(0, 50)), max_size=120)


@given(OPS)
@settings(max_examples=300, deadline=None)
def test_a_raised_key_is_seen_when_the_node_would_be_taken(ops):
    items = [Item(i) for i in range(8)]
    q = EvictionQueue("entry", lambda it: it.key)
    queued: set[int] = set()  # the reference: which items are in the queue
    for op, i, k in ops:
        it = items[i]
        if op == "push":  # a requeue: any key, the item's own
            it.key = k
            q.push(it, k)
            queued.add(i)
        elif op == "raise":  # a use: the key only rises, the entry is not touched
            it.key += k
        elif op == "remove":
            q.remove(it)
            queued.discard(i)
        else:
            got = q.peek() if op == "peek" else q.pop()
            if not queued:
                assert got is None
                continue
            least = min(items[j].key for j in queued)
            assert got is not None and got.name in queued and got.key == least
            if op == "pop":
                queued.discard(got.name)
                assert got.entry is None
        assert len(q) == len(queued)
        live = [(e, q.node_of[e[1]]) for e in q.heap if e[1] in q.node_of]
        assert len(live) == len(q.node_of)  # every live entry is in the heap, once
        for e, it in live:  # a live entry's key is never above its node's
            assert e[0] <= it.key and it.entry is e
        # an entry is a tuple of numbers: nothing the garbage collector need walk
        assert all(type(e) is tuple and len(e) == 2 for e in q.heap)


def test_a_match_moves_a_leaf_behind_the_others_without_touching_its_entry():
    P = 4
    tree, sink = make_tree(P)
    ids = Ids()
    a, b, c = (seq(P, [x, x + 1]) for x in (10, 20, 30))
    for s in (a, b, c):
        tree.insert(NS, s, ids.full(2), ids.swa(2))
    leaf = tree.match(NS, a).node_id
    entry = tree.get_node(leaf).full_entry
    key_before = entry[0]
    tree.insert(NS, seq(P, [40, 41]), ids.full(2), ids.swa(2))  # the churn clock moves
    tree.match(NS, a)
    node = tree.get_node(leaf)
    assert node.full_entry is entry and entry[0] == key_before < tree.policy.full_key(node)
    ok(tree)
    first = tree.evict(full_pages=2)
    assert first.full_pages == 2 and tree.match(NS, a).prefix_len == len(a) // 4
    assert tree.match(NS, b).prefix_len == 0  # b, the least recently used, went first
    ok(tree)


def test_the_checker_reports_an_entry_keyed_above_its_node():
    P = 4
    tree, _ = make_tree(P)
    ids = Ids()
    tree.insert(NS, seq(P, [1, 2]), ids.full(2), ids.swa(2))
    node = tree.get_node(tree.match(NS, seq(P, [1, 2])).node_id)
    ok(tree)
    q = node.ns.full_q
    entry = node.full_entry
    bad = (tree.policy.full_key(node) + 1, entry[1])  # would be evicted too late
    q.heap[q.heap.index(entry)] = bad
    node.full_entry = bad
    assert any("above its own" in v for v in check_tree(tree))
