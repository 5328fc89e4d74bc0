"""One focused test (or a few) per rule of the radix tree (docs/design.md, radix.py docstring).

Every test drives a :class:`RadixTree` with a :class:`CollectingSink` directly and runs the checker
after every mutating step. Page ids are handed out by a tiny counter so each test knows exactly
which pages the caller owns and which the tree let go of.
"""

from __future__ import annotations

import hashlib
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.tree import (
    BadArgument,
    CollectingSink,
    NodeNotUsable,
    RadixTree,
    ReceiptError,
    UnknownNode,
    as_token_bytes,
    block_pages,
    check_tree,
    namespace_seed,
)
from daemon.tree.hashing import HASH_BYTES, page_keys

PAGE_SIZES = [1, 16, 64]
NS = "ns"


def page(label: int, P: int) -> list[int]:
    """The P tokens of page ``label``: distinct labels never share a token."""
    return [label * 1000 + j for j in range(P)]


def seq(P: int, labels: list[int], tail: int = 0) -> bytes:
    """Tokens of whole pages ``labels`` followed by ``tail`` tokens of an unaligned last page."""
    toks: list[int] = []
    for lab in labels:
        toks += page(lab, P)
    toks += [999_000 + j for j in range(tail)]
    return as_token_bytes(toks)


class Harness:
    """A tree, its sink and a page-id dispenser; ``ok()`` runs the checker."""

    def __init__(self, P: int, window: int | None = -1, *, host: bool = False,
                 fingerprint: bytes = b"", policy: str = "lru"):
        self.P = P
        if window == -1:
            window = 2 * P  # two pages by default
        self.sink = CollectingSink()
        self.tree = RadixTree(P, window, self.sink, host_sink=self.sink if host else None,
                              layout_fingerprint=fingerprint, policy=policy)
        self._full = 0
        self._swa = 100_000
        self._host = 500_000

    def ok(self) -> None:
        assert check_tree(self.tree) == []

    def full(self, n: int) -> array:
        out = array("i", range(self._full + 1, self._full + 1 + n))
        self._full += n
        return out

    def swa(self, n: int, zeros: int = 0) -> array:
        """``n`` SWA ids, the first ``zeros`` of them 0 (already freed by the caller)."""
        live = n - zeros
        out = array("i", [0] * zeros) + array("i", range(self._swa + 1, self._swa + 1 + live))
        self._swa += live
        return out

    def host(self, n: int) -> array:
        out = array("i", range(self._host + 1, self._host + 1 + n))
        self._host += n
        return out

    def insert(self, tokens: bytes, prev: int = 0, frontier: int = 0, *, ns: str = NS,
               lock: bool = False):
        """Insert with fresh caller pages for [prev, aligned end); returns (result, full, swa)."""
        P = self.P
        n = len(tokens) // (4 * P) - prev // P
        zeros = min(n, max(0, frontier // P - prev // P))
        full = self.full(n)
        swa = self.swa(n, zeros) if self.tree.swa_enabled else array("i")
        res = self.tree.insert(ns, tokens, full, swa if self.tree.swa_enabled else None, prev,
                               frontier, lock=lock)
        self.ok()
        return res, full, swa

    def match(self, tokens: bytes, *, ns: str = NS, lock: bool = False):
        res = self.tree.match(ns, tokens, lock=lock)
        self.ok()
        return res

    def evict(self, full: int = 0, swa: int = 0):
        res = self.tree.evict(full, swa)
        self.ok()
        return res

    def unlock(self, r) -> None:
        self.tree.unlock(r)
        self.ok()

    def counters(self) -> tuple[int, int, int, int]:
        t = self.tree
        return (t.full_evictable, t.full_protected, t.swa_evictable, t.swa_protected)

    def root(self, ns: str = NS):
        return self.tree.namespace(ns).root

    def path(self, tokens: bytes, ns: str = NS) -> list:
        """The nodes whose tokens are consecutive whole-node prefixes of ``tokens``."""
        pb = 4 * self.P
        out = []
        node = self.root(ns)
        off = 0
        while node.children:
            child = node.children.get(tokens[off : off + pb])
            if child is None or not tokens.startswith(child.tokens, off):
                break
            out.append(child)
            off += len(child.tokens)
            node = child
        return out


def dead_leaves(tree: RadixTree) -> list:
    """Unlocked device leaves without SWA (must never exist)."""
    return [n for n in tree.iter_nodes()
            if n.parent is not None and n.full is not None and n.swa is None
            and n.dev_children == 0 and n.full_lock == 0]


# ---------------------------------------------------------------------- pages and splits


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_unaligned_tail_is_ignored(P):
    h = Harness(P)
    tail = P - 1  # nothing for P == 1: then the sequence is exactly aligned
    tokens = seq(P, [1, 2, 3], tail=tail)
    res, full, swa = h.insert(tokens)
    assert res.inserted_len == 3 * P
    assert list(res.full_pages) == list(full) and len(full) == 3
    (node,) = h.path(tokens)
    assert len(node.tokens) == 3 * P * 4
    m = h.match(tokens)
    assert m.prefix_len == 3 * P and m.full_hit_len == 3 * P
    assert list(m.full_pages) == list(full)
    # a different unaligned tail is still the same key: all three pages are duplicates
    res2, full2, _ = h.insert(seq(P, [1, 2, 3]) + as_token_bytes([-7] * tail))
    assert res2.prefix_len == 3 * P and list(h.sink.full) == list(full2)
    assert len(h.tree.nodes) == 2


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_query_shorter_than_one_page_matches_nothing(P):
    h = Harness(P)
    h.insert(seq(P, [1, 2]))
    short = seq(P, [1])[: (P - 1) * 4]
    m = h.match(short)
    assert m.prefix_len == 0 and m.full_hit_len == 0 and m.host_hit_len == 0
    assert len(m.full_pages) == 0 and len(m.swa_pages) == 0
    assert m.node_id == h.root().id
    # the same for an insert: nothing to insert, nothing consumed
    res = h.tree.insert(NS, short, array("i"), array("i"))
    h.ok()
    assert res.inserted_len == 0 and res.node_id == h.root().id and not h.sink.full


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_match_diverging_mid_page_splits_at_the_page_boundary(P):
    h = Harness(P)
    _, full, _ = h.insert(seq(P, [1, 2, 3, 4]))
    # same first two pages, then a third page that differs only in its last token
    third = page(3, P)
    third[-1] = -5
    query = seq(P, [1, 2]) + as_token_bytes(third)
    m = h.match(query)
    assert m.prefix_len == 2 * P
    assert list(m.full_pages) == list(full[:2])
    node = h.tree.get_node(m.node_id)
    assert len(node.tokens) == 2 * P * 4  # the node that ends exactly at the match end
    for n in h.tree.iter_nodes():
        assert len(n.tokens) % (4 * P) == 0


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_insert_diverging_mid_page_splits_at_the_page_boundary(P):
    h = Harness(P)
    h.insert(seq(P, [1, 2, 3, 4]))
    third = page(3, P)
    third[0 if P == 1 else P // 2] = -5
    other = seq(P, [1, 2]) + as_token_bytes(third) + seq(P, [9])
    res, full, _ = h.insert(other)
    assert res.prefix_len == 2 * P and res.inserted_len == 4 * P
    assert list(h.sink.full) == list(full[:2])  # the two shared pages were duplicates
    upper = h.path(other)[0]
    assert len(upper.tokens) == 2 * P * 4 and len(upper.children) == 2
    assert all(len(n.tokens) % (4 * P) == 0 for n in h.tree.iter_nodes())


# ---------------------------------------------------------------------- node ids


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_node_ids_are_never_reused(P):
    h = Harness(P)
    tokens = seq(P, [1, 2, 3, 4])
    h.insert(tokens)
    h.match(seq(P, [1, 2]))  # a split: one more id
    seen = set(h.tree.nodes)
    top = max(seen)
    r = h.evict(full=100, swa=100)
    assert r.full_pages == 4
    assert set(h.tree.nodes) == {h.root().id}
    res, _, _ = h.insert(tokens)
    h.match(seq(P, [1]))
    new = set(h.tree.nodes) - {h.root().id}
    assert new and min(new) > top
    assert res.node_id > top
    with pytest.raises(UnknownNode):
        h.tree.lock(max(seen - {h.root().id}))  # an evicted id stays unknown


# ---------------------------------------------------------------------- hashes and namespaces


def reference_page_keys(seed: bytes, tokens: bytes, P: int) -> list[bytes]:
    """protocol.md 9.3's page keys, written from the formula: the key of page j is SHA-256 of
    the previous block's hash and the tokens from its block's start to its own end."""
    K = max(1, -(-64 // P))
    keys: list[bytes] = []
    prev = seed
    for j in range(len(tokens) // (4 * P)):
        start = (j // K) * K * P * 4
        keys.append(hashlib.sha256(prev + tokens[start : (j + 1) * P * 4]).digest())
        if j % K == K - 1:
            prev = keys[-1]
    return keys


@pytest.mark.parametrize("P", PAGE_SIZES + [48])
def test_hashes_chain_over_blocks_from_the_namespace_seed(P):
    """Nodes hold the hash of each block that ends inside them, whatever the splits; the page
    keys the tiers use follow the documented formula, and equal the block hashes at page 64."""
    fp = b"layout-1"
    h = Harness(P, fingerprint=fp)
    K = block_pages(P)
    assert K == max(1, -(-64 // P))
    n = 3 * K + 2  # three whole blocks and part of a fourth
    a = seq(P, list(range(1, n + 1)))
    # b leaves a mid-block (a split that does not fall on a block edge, unless K is 1)
    b = seq(P, list(range(1, K + 2)) + [900, 901, 902] + list(range(1000, 1000 + 2 * K)))
    c = seq(P, [1, 2, 903])  # and c leaves both inside the first block
    for t in (a, b, c):
        h.insert(t)
    h.ok()
    seed = namespace_seed(NS, fp)
    for tokens in (a, b, c):
        nodes = h.path(tokens)
        assert b"".join(n.tokens for n in nodes) == tokens
        keys = reference_page_keys(seed, tokens, P)
        assert h.tree.page_keys(nodes) == keys
        blocks = [k for j, k in enumerate(keys) if j % K == K - 1]
        assert b"".join(n.hashes for n in nodes) == b"".join(blocks)
        for i, nd in enumerate(nodes):  # and each node's own keys, asked for alone
            off = sum(len(x.tokens) for x in nodes[:i]) // (4 * P)
            assert h.tree.page_keys([nd]) == keys[off : off + len(nd.tokens) // (4 * P)]
        if K == 1:
            assert b"".join(keys) == b"".join(n.hashes for n in nodes)
    if K > 1:  # a node inside one block holds no hash
        assert any(not nd.hashes for nd in h.tree.iter_nodes() if nd.parent is not None)
    nd = h.path(a)[-1]  # and the checker finds a block hash tampered with
    nd.hashes = bytes(HASH_BYTES) + nd.hashes[HASH_BYTES:]
    assert any("do not chain" in x for x in check_tree(h.tree))


@settings(max_examples=60, deadline=None)
@given(P=st.sampled_from([1, 2, 3, 16, 48, 64, 128]), n=st.integers(1, 200),
       data=st.data())
def test_page_keys_asked_for_some_pages_are_those_of_the_formula(P, n, data):
    """A tier asks only for the keys it publishes (a run's end, a window's pages): those are
    the formula's keys of exactly those pages, from the root or from a chain state inside a
    block, through the tree's path or the plain function."""
    tokens = array("i", range(7, 7 + n * P)).tobytes()
    seed = namespace_seed(NS, b"fp")
    keys = reference_page_keys(seed, tokens, P)
    want = sorted(data.draw(st.sets(st.integers(0, n - 1))))
    assert page_keys(seed, b"", tokens, 4 * P, 4 * P * block_pages(P), want) == \
        [keys[j] for j in want]
    h = Harness(P, fingerprint=b"fp")
    h.insert(tokens)
    cut = data.draw(st.integers(1, n))  # a node that ends anywhere, inside a block or not
    h.insert(tokens[: cut * 4 * P])
    h.ok()
    nodes = h.path(tokens)
    assert h.tree.page_keys(nodes, want) == [keys[j] for j in want]
    low = nodes[-1]
    first = (n * 4 * P - len(low.tokens)) // (4 * P)
    mine = [j - first for j in want if j >= first]
    assert h.tree.page_keys([low], mine) == [keys[j + first] for j in mine]


def test_page_keys_refuse_pages_out_of_order_or_range():
    tokens = array("i", range(1, 9)).tobytes()
    for bad, block, exc in (([2, 1], 256, ValueError), ([1, 1], 256, ValueError),
                            ([3, 3], 16, ValueError), ([8], 256, IndexError),
                            ([-1], 256, IndexError)):  # [3, 3]: a page that ends its block
        with pytest.raises(exc):
            page_keys(bytes(32), b"", tokens, 4, block, bad)
    h = Harness(64)  # one page a block: the tree's stored hashes, checked the same way
    h.insert(seq(64, [1, 2, 3]))
    nodes = h.path(seq(64, [1, 2, 3]))
    assert len(h.tree.page_keys(nodes, [0, 2])) == 2
    with pytest.raises(IndexError):
        h.tree.page_keys(nodes, [3])


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_namespaces_are_isolated(P):
    h = Harness(P)
    tokens = seq(P, [1, 2, 3])
    res_a, full_a, _ = h.insert(tokens, ns="a")
    m = h.match(tokens, ns="b")
    assert m.prefix_len == 0 and m.full_hit_len == 0 and m.node_id == h.root("b").id
    res_b, full_b, _ = h.insert(tokens, ns="b")
    assert res_b.prefix_len == 0 and not h.sink.full  # nothing deduplicated across namespaces
    (na,) = h.path(tokens, "a")
    (nb,) = h.path(tokens, "b")
    assert na is not nb and list(na.full) == list(full_a) and list(nb.full) == list(full_b)
    ka, kb = h.tree.page_keys([na]), h.tree.page_keys([nb])
    assert len(ka) == len(kb) == 3 and not set(ka) & set(kb)
    # node ids are scoped to their namespace
    with pytest.raises(UnknownNode):
        h.tree.lock(na.id, namespace="b")
    # a different layout fingerprint gives different hashes for the same namespace
    other = Harness(P, fingerprint=b"layout-2")
    other.insert(tokens, ns="a")
    assert not set(other.tree.page_keys(other.path(tokens, "a"))) & set(ka)


# ---------------------------------------------------------------------- the SWA rule of a match


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_tombstone_in_the_window_makes_the_end_unusable(P):
    h = Harness(P, window=2 * P)
    a = seq(P, [1, 2])
    _, full_a, swa_a = h.insert(a)
    s = seq(P, [1, 2, 3, 4, 5])
    # pages [2, 3) come in as a tombstone, [3, 5) live: path A(live 2) - T(tomb 1) - L(live 2)
    res, full_s, swa_s = h.insert(s, prev=2 * P, frontier=3 * P)
    assert list(res.swa_pages) == [0, swa_s[1], swa_s[2]]
    t, leaf = h.path(s)[1:]
    assert t.swa is None and leaf.swa is not None

    m = h.match(s)  # window = pages 3, 4: live
    assert m.prefix_len == 5 * P and m.full_hit_len == 5 * P
    assert list(m.swa_pages) == list(swa_s[1:])

    m = h.match(seq(P, [1, 2, 3, 4]))  # window = pages 2, 3: page 2 is a tombstone
    assert m.prefix_len == 2 * P and m.full_hit_len == 4 * P
    assert list(m.full_pages) == list(full_a) and list(m.swa_pages) == list(swa_a)
    assert m.node_id == h.path(a)[0].id

    m = h.match(seq(P, [1, 2, 3]))  # ends on the tombstone itself
    assert m.prefix_len == 2 * P and m.full_hit_len == 3 * P

    wide = Harness(P, window=3 * P)  # the same shape with a window that reaches the tombstone
    wide.insert(a)
    wide.insert(s, prev=2 * P, frontier=3 * P)
    m = wide.match(s)
    assert m.prefix_len == 2 * P and m.full_hit_len == 5 * P


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_all_tombstone_prefix_matches_nothing_usable(P):
    h = Harness(P, window=2 * P)
    s = seq(P, [1, 2, 3, 4, 5])
    h.insert(s, frontier=3 * P)
    m = h.match(seq(P, [1, 2, 3, 4]))
    assert m.prefix_len == 0 and m.full_hit_len == 4 * P and m.node_id == h.root().id
    assert len(m.full_pages) == 0 and len(m.swa_pages) == 0
    assert h.match(s).prefix_len == 5 * P


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_live_path_shorter_than_the_window_is_usable(P):
    h = Harness(P, window=5 * P)
    s = seq(P, [1, 2])
    _, full, swa = h.insert(s)
    m = h.match(s + seq(P, [3]))
    assert m.prefix_len == 2 * P and list(m.full_pages) == list(full)
    assert list(m.swa_pages) == list(swa)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_swa_pages_are_the_last_window_pages(P):
    window = 2 * P - 1 if P > 1 else 2  # not a multiple of the page for P > 1: ceil -> 2 pages
    h = Harness(P, window=window)
    assert h.tree.window_pages == 2
    s = seq(P, [1, 2, 3, 4, 5])
    _, full, swa = h.insert(s)
    m = h.match(s)
    assert list(m.full_pages) == list(full)
    assert list(m.swa_pages) == list(swa[-2:])
    m = h.match(seq(P, [1, 2, 3]))  # split inside the node: still the window before the end
    assert list(m.swa_pages) == list(swa[1:3])
    r = h.match(s, lock=True).receipt
    assert r.swa_pages == 2


# ---------------------------------------------------------------------- locks and receipts


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_lock_protects_the_full_path_and_only_the_window_swa(P):
    h = Harness(P, window=2 * P)
    s = seq(P, [1, 2, 3, 4, 5, 6])
    _, full, swa = h.insert(s)
    _, full_b, swa_b = h.insert(seq(P, [7, 8]))  # an unlocked branch
    r = h.match(s, lock=True).receipt
    assert r.swa_pages == 2
    assert h.counters() == (2, 6, 6, 2)
    ev = h.evict(full=100, swa=100)
    assert ev.full_pages == 2 and ev.swa_pages == 2 + 4
    assert sorted(h.sink.full) == sorted(full_b)
    assert sorted(h.sink.swa) == sorted(list(swa_b) + list(swa[:4]))
    assert h.counters() == (0, 6, 0, 2)
    m = h.match(s)  # the path and its window survived
    assert m.prefix_len == 6 * P and list(m.full_pages) == list(full)
    assert list(m.swa_pages) == list(swa[4:])
    h.unlock(r)
    assert h.counters() == (6, 0, 2, 0)
    ev = h.evict(full=100, swa=100)
    assert ev.full_pages == 6 and ev.swa_pages == 2
    assert sorted(h.sink.full) == sorted(list(full_b) + list(full))
    assert sorted(h.sink.swa) == sorted(list(swa_b) + list(swa))
    assert h.counters() == (0, 0, 0, 0) and set(h.tree.nodes) == {h.root().id}


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_release_swa_early_then_unlock(P):
    h = Harness(P, window=2 * P)
    s = seq(P, [1, 2, 3, 4])
    _, full, swa = h.insert(s)
    r = h.match(s, lock=True).receipt
    assert h.counters() == (0, 4, 2, 2)
    h.tree.release_swa(r)
    h.ok()
    assert h.counters() == (0, 4, 4, 0)
    ev = h.evict(full=100, swa=100)  # every SWA page goes; the full path stays (locked)
    assert ev.full_pages == 0 and ev.swa_pages == 4
    assert sorted(h.sink.swa) == sorted(swa) and not h.sink.full
    assert h.counters() == (0, 4, 0, 0)
    m = h.match(s)
    assert m.prefix_len == 0 and m.full_hit_len == 4 * P
    h.unlock(r)  # the tombstoned leaf is removed, and the cleanup walks upward
    assert set(h.tree.nodes) == {h.root().id}
    assert sorted(h.sink.full) == sorted(full)
    assert h.counters() == (0, 0, 0, 0)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_double_unlock_and_double_release_swa_are_refused(P):
    h = Harness(P)
    s = seq(P, [1, 2, 3])
    h.insert(s)
    r = h.match(s, lock=True).receipt
    h.tree.release_swa(r)
    before = h.counters()
    with pytest.raises(ReceiptError):
        h.tree.release_swa(r)
    assert h.counters() == before
    h.ok()
    h.unlock(r)
    after = h.counters()
    with pytest.raises(ReceiptError):
        h.tree.unlock(r)
    with pytest.raises(ReceiptError):
        h.tree.release_swa(r)
    assert h.counters() == after == (3, 0, 3, 0)
    assert all(n.full_lock == 0 and n.swa_lock == 0 for n in h.tree.iter_nodes())
    h.ok()


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_lock_of_a_node_whose_window_was_tombstoned_is_refused(P):
    h = Harness(P, window=2 * P)
    s = seq(P, [1, 2, 3, 4])
    h.insert(s, frontier=2 * P)  # T(tomb 2) - L(live 2)
    t, leaf = h.path(s)
    with pytest.raises(NodeNotUsable):
        h.tree.lock(t.id)
    h.ok()
    r = h.tree.lock(leaf.id)
    h.ok()
    assert r.swa_pages == 2
    h.unlock(r)
    wide = Harness(P, window=3 * P)
    wide.insert(s, frontier=2 * P)
    with pytest.raises(NodeNotUsable):
        wide.tree.lock(wide.path(s)[1].id)
    assert all(n.full_lock == 0 for n in wide.tree.iter_nodes())
    wide.ok()


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_lock_of_a_node_tombstoned_by_eviction_is_refused(P):
    h = Harness(P, window=2 * P)
    a = seq(P, [1, 2, 3, 4])
    s = seq(P, [1, 2, 3, 4, 5, 6])
    h.insert(a)
    h.insert(s, prev=4 * P)
    na, nb = h.path(s)
    ev = h.evict(swa=4)  # the internal node (nearer the root) is tombstoned, not removed
    assert ev.swa_pages == 4 and ev.full_pages == 0
    assert na.id in h.tree.nodes and na.swa is None
    with pytest.raises(NodeNotUsable):
        h.tree.lock(na.id)
    r = h.tree.lock(nb.id)
    h.ok()
    h.unlock(r)


def test_unknown_node_ids_are_refused():
    h = Harness(16)
    h.insert(seq(16, [1]))
    for bad in (10_000, -1, "1", None):
        with pytest.raises(UnknownNode):
            h.tree.lock(bad)
    with pytest.raises(UnknownNode):
        h.tree.set_host(10_000, array("i", [1]))
    h.ok()


# ---------------------------------------------------------------------- insert


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_insert_dedup_frees_duplicates_and_returns_canonical_ids(P):
    h = Harness(P)
    s = seq(P, [1, 2, 3])
    _, full1, swa1 = h.insert(s)
    longer = seq(P, [1, 2, 3, 4, 5])
    res, full2, swa2 = h.insert(longer)
    assert res.prefix_len == 3 * P and res.inserted_len == 5 * P
    assert list(res.full_pages) == list(full1) + list(full2[3:])
    assert list(res.swa_pages) == list(swa1) + list(swa2[3:])
    assert sorted(h.sink.full) == sorted(full2[:3])
    assert sorted(h.sink.swa) == sorted(swa2[:3])
    res3, full3, swa3 = h.insert(longer)  # all duplicates
    assert res3.prefix_len == 5 * P
    assert list(res3.full_pages) == list(full1) + list(full2[3:])
    assert set(full3) <= set(h.sink.full) and set(swa3) <= set(h.sink.swa)
    assert h.tree.device_pages() == (5, 5)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_prev_prefix_len_pages_cover_prev_to_end(P):
    h = Harness(P)
    a = seq(P, [1, 2])
    _, full_a, _ = h.insert(a)
    s = seq(P, [1, 2, 3, 4])
    res, full, swa = h.insert(s, prev=2 * P)
    assert len(full) == 2
    assert res.prefix_len == 2 * P and res.inserted_len == 4 * P
    assert list(res.full_pages) == list(full) and list(res.swa_pages) == list(swa)
    assert not h.sink.full
    assert list(h.match(s).full_pages) == list(full_a) + list(full)
    # the arrays must cover exactly [prev, end)
    for bad_full in (array("i", [50]), array("i", [50, 51, 52])):
        with pytest.raises(BadArgument):
            h.tree.insert(NS, seq(P, [1, 2, 3, 9]), bad_full, array("i", [60] * len(bad_full)),
                          2 * P)
    with pytest.raises(BadArgument):  # not page-aligned
        h.tree.insert(NS, s, array("i", [50, 51]), array("i", [60, 61]), 2 * P + 1 if P > 1
                      else -1)
    with pytest.raises(BadArgument):  # the tree does not hold [0, prev)
        h.tree.insert(NS, seq(P, [1, 7, 8]), array("i", [50]), array("i", [60]), 2 * P)
    h.ok()
    assert h.tree.device_pages() == (4, 4)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_swa_evicted_len_makes_earlier_pages_tombstones(P):
    h = Harness(P)
    s = seq(P, [1, 2, 3, 4, 5])
    res, full, swa = h.insert(s, frontier=3 * P)
    assert list(swa[:3]) == [0, 0, 0]
    assert list(res.swa_pages) == list(swa)
    t, leaf = h.path(s)
    assert len(t.tokens) == 3 * P * 4 and t.swa is None and list(t.full) == list(full[:3])
    assert list(leaf.swa) == list(swa[3:])
    with pytest.raises(BadArgument):  # a live id below the frontier
        h.tree.insert(NS, seq(P, [7, 8]), array("i", [50, 51]), array("i", [60, 61]), 0, P)
    with pytest.raises(BadArgument):  # a 0 at or after the frontier
        h.tree.insert(NS, seq(P, [7, 8]), array("i", [50, 51]), array("i", [0, 0]), 0, P)
    h.ok()


# ---------------------------------------------------------------------- tombstone revival


def _tomb_then_live(h: Harness):
    """Path T(tomb, pages 0..4) - L(live, pages 5..6) for sequence labels 1..7."""
    s = seq(h.P, [1, 2, 3, 4, 5, 6, 7])
    res, full, swa = h.insert(s, frontier=5 * h.P)
    t, leaf = h.path(s)
    assert t.swa is None and len(t.tokens) == 5 * h.P * 4
    return s, t, leaf, full


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_revival_frontier_before_the_node(P):
    h = Harness(P)
    s, t, leaf, full = _tomb_then_live(h)
    other = seq(P, [1, 2, 3, 4, 5, 20])
    res, cfull, cswa = h.insert(other)  # fresh SWA for every page
    assert t.swa is not None and list(t.swa) == list(cswa[:5])  # the whole node revived
    assert list(t.full) == list(full[:5]) and t.id in h.tree.nodes
    assert sorted(h.sink.full) == sorted(cfull[:5]) and not h.sink.swa
    assert list(res.swa_pages) == list(cswa)
    assert h.match(seq(P, [1, 2, 3, 4, 5])).prefix_len == 5 * P


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_revival_frontier_inside_the_node(P):
    h = Harness(P)
    s, t, leaf, full = _tomb_then_live(h)
    other = seq(P, [1, 2, 3, 4, 5, 20])
    res, cfull, cswa = h.insert(other, frontier=2 * P)
    up = t.parent
    assert up.parent is h.root() and up.swa is None and len(up.tokens) == 2 * P * 4
    assert list(t.swa) == list(cswa[2:5])  # the suffix [2, 5) revived, the prefix stays a tomb
    assert list(up.full) + list(t.full) == list(full[:5])
    assert list(res.swa_pages) == [0, 0] + list(cswa[2:])
    assert sorted(h.sink.full) == sorted(cfull[:5]) and not h.sink.swa
    m = h.match(seq(P, [1, 2, 3, 4, 5]))
    assert m.prefix_len == 5 * P and list(m.swa_pages) == list(cswa[3:5])
    assert h.match(seq(P, [1, 2, 3])).prefix_len == 0  # window [1, 3) reaches the tombstone


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_revival_frontier_after_the_node(P):
    h = Harness(P)
    s, t, leaf, full = _tomb_then_live(h)
    splits = h.tree.stats["splits"]
    other = seq(P, [1, 2, 3, 4, 5, 20, 21])
    res, cfull, cswa = h.insert(other, frontier=6 * P)
    assert t.swa is None and len(t.tokens) == 5 * P * 4  # untouched, not split
    assert h.tree.stats["splits"] == splits
    assert sorted(h.sink.full) == sorted(cfull[:5]) and not h.sink.swa
    assert list(res.swa_pages) == [0] * 6 + [cswa[6]]
    m = h.match(other)  # window = pages 5 (tomb), 6
    assert m.prefix_len == 0 and m.full_hit_len == 7 * P


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_revival_while_the_full_kv_is_locked_keeps_the_locked_pages(P):
    h = Harness(P)
    s, t, leaf, full = _tomb_then_live(h)
    r = h.tree.lock(leaf.id)  # full lock on T and L, SWA lock on L
    h.ok()
    assert t.full_lock == 1 and t.swa_lock == 0
    other = seq(P, [1, 2, 3, 4, 5, 20])
    res, cfull, cswa = h.insert(other)
    assert list(t.full) == list(full[:5]) and list(t.swa) == list(cswa[:5])
    assert not set(full) & set(h.sink.full)  # no locked full page was freed
    assert sorted(h.sink.full) == sorted(cfull[:5])
    assert t.full_lock == 1
    h.unlock(r)
    assert all(n.full_lock == 0 and n.swa_lock == 0 for n in h.tree.iter_nodes())
    assert h.tree.device_pages() == (8, 8)


# ---------------------------------------------------------------------- composite engine steps


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_cache_unfinished_moves_the_lock_and_keeps_the_tail(P):
    h = Harness(P)
    tail = max(P // 2, 1) if P > 1 else 0
    tokens = seq(P, [1, 2], tail=tail)
    r0 = h.match(tokens, lock=True).receipt
    total = 2 + (1 if tail else 0)
    full, swa = h.full(total), h.swa(total)
    res = h.tree.cache_unfinished(NS, tokens, full, swa, 0, 0, r0)
    h.ok()
    assert res.inserted_len == 2 * P and res.receipt is not None and res.receipt is not r0
    assert not r0.active and res.receipt.active
    assert not h.sink.full and not h.sink.swa  # the tail page stays with the caller
    node = h.tree.get_node(res.node_id)
    assert node.full_lock == 1 and res.receipt.anchor is node
    with pytest.raises(ReceiptError):
        h.tree.unlock(r0)
    # the next chunk: prev = inserted_len, pages from there (the old tail page included)
    tokens2 = seq(P, [1, 2, 3], tail=tail)
    more = h.full(1)
    more_swa = h.swa(1)
    full2 = array("i", full[2:]) + more
    swa2 = array("i", swa[2:]) + more_swa
    res2 = h.tree.cache_unfinished(NS, tokens2, full2, swa2, 2 * P, 0, res.receipt)
    h.ok()
    assert res2.inserted_len == 3 * P and not res.receipt.active
    assert list(res2.full_pages) == [full2[0]]
    assert not h.sink.full
    h.tree.cache_finished(NS, tokens2, full2[1:], swa2[1:], 3 * P, 0, res2.receipt)
    h.ok()
    assert not res2.receipt.active
    assert sorted(h.sink.full) == sorted(full2[1:]) and sorted(h.sink.swa) == sorted(swa2[1:])
    assert h.counters() == (3, 0, 3, 0)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_cache_finished_frees_the_tail_and_what_is_not_inserted(P):
    h = Harness(P)
    tail = P - 1 if P > 1 else 0
    tokens = seq(P, [1, 2, 3], tail=tail)
    r = h.match(tokens, lock=True).receipt
    total = 3 + (1 if tail else 0)
    full = h.full(total)
    swa = h.swa(total)
    res = h.tree.cache_finished(NS, tokens, full, swa, 0, 0, r)
    h.ok()
    assert res.inserted_len == 3 * P and not r.active and not h.tree.receipts
    assert sorted(h.sink.full) == sorted(full[3:]) and sorted(h.sink.swa) == sorted(swa[3:])
    # every SWA page freed during decode: nothing new goes in, every caller page comes back
    h.sink.full.clear()
    h.sink.swa.clear()
    longer = seq(P, [1, 2, 3, 4, 5], tail=tail)
    r = h.match(longer, lock=True).receipt
    n_new = 2 + (1 if tail else 0)
    full2 = h.full(n_new)
    swa2 = array("i", [0] * n_new)
    res = h.tree.cache_finished(NS, longer, full2, swa2, 3 * P, 6 * P, r)
    h.ok()
    assert res.inserted_len == 3 * P and not r.active
    assert sorted(h.sink.full) == sorted(full2) and not h.sink.swa
    assert h.tree.device_pages() == (3, 3)


# ---------------------------------------------------------------------- eviction


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_full_eviction_is_lru_over_unlocked_leaves(P):
    h = Harness(P)
    a, b, c, d = seq(P, [1, 2]), seq(P, [3, 4]), seq(P, [5, 6]), seq(P, [7, 8])
    _, fa, _ = h.insert(a)
    _, fb, _ = h.insert(b)
    _, fc, _ = h.insert(c)
    _, fd, _ = h.insert(d)
    h.match(a)  # a is as recent as the newest now: b and c are the least recently used
    ev = h.evict(full=2)
    assert ev.full_pages == 2 and sorted(h.sink.full) == sorted(fb)
    r = h.match(c, lock=True).receipt
    ev = h.evict(full=4)  # c is locked: d and a go
    assert ev.full_pages == 4
    assert sorted(h.sink.full) == sorted(list(fb) + list(fd) + list(fa))
    ev = h.evict(full=2)
    assert ev.full_pages == 0
    h.unlock(r)
    ev = h.evict(full=2)
    assert ev.full_pages == 2 and set(h.tree.nodes) == {h.root().id}


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_depth_credit_policy_trims_the_deepest_path_first(P):
    """lru-depth (the default): a long path inserted after a short one still loses its tail
    first; plain LRU takes the older, short path."""
    for policy, victim in (("lru", "short"), ("lru-depth", "long")):
        h = Harness(P, policy=policy)
        _, f_short, _ = h.insert(seq(P, [1]))
        _, f_long, _ = h.insert(seq(P, [2, 3, 4, 5]))
        ev = h.evict(full=1)
        assert ev.full_pages == 1
        want = f_short[0] if victim == "short" else f_long[-1]
        assert h.sink.full == [want]


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_full_eviction_of_a_bigger_leaf_frees_exactly_n(P):
    h = Harness(P)
    s = seq(P, [1, 2, 3, 4, 5])
    _, full, swa = h.insert(s)
    ev = h.evict(full=2)
    assert ev.full_pages == 2 and ev.swa_pages == 2
    assert sorted(h.sink.full) == sorted(full[3:]) and sorted(h.sink.swa) == sorted(swa[3:])
    m = h.match(s)
    assert m.prefix_len == 3 * P and list(m.full_pages) == list(full[:3])
    assert h.counters() == (3, 0, 3, 0)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_swa_eviction_tombstones_internal_nodes_and_removes_leaves(P):
    h = Harness(P, window=2 * P)
    a = seq(P, [1, 2])
    s = seq(P, [1, 2, 3, 4])
    _, fa, sa = h.insert(a)
    _, fs, ss = h.insert(s, prev=2 * P)
    na, nb = h.path(s)
    ev = h.evict(swa=2)  # the older node is internal: tombstoned, its full KV stays
    assert ev.swa_pages == 2 and ev.full_pages == 0
    assert na.swa is None and list(na.full) == list(fa) and sorted(h.sink.swa) == sorted(sa)
    assert h.match(s).prefix_len == 4 * P
    ev = h.evict(swa=2)  # the leaf goes, and its now-dead tombstone parent with it
    assert ev.swa_pages == 2 and ev.full_pages == 4
    assert set(h.tree.nodes) == {h.root().id}
    assert sorted(h.sink.full) == sorted(list(fa) + list(fs))
    assert not dead_leaves(h.tree)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_swa_eviction_of_a_bigger_node_keeps_the_tail_live(P):
    h = Harness(P, window=2 * P)
    s = seq(P, [1, 2, 3, 4, 5])
    _, full, swa = h.insert(s)
    ev = h.evict(swa=3)
    assert ev.swa_pages == 3 and ev.full_pages == 0
    assert sorted(h.sink.swa) == sorted(swa[:3])
    assert not dead_leaves(h.tree)
    m = h.match(s)
    assert m.prefix_len == 5 * P and list(m.swa_pages) == list(swa[3:])


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_swa_eviction_of_a_locked_leaf_after_release_swa(P):
    h = Harness(P, window=2 * P)
    s = seq(P, [1, 2])
    _, full, swa = h.insert(s)
    r = h.match(s, lock=True).receipt
    assert h.evict(swa=10).swa_pages == 0  # SWA-locked: nothing to take
    h.tree.release_swa(r)
    h.ok()
    ev = h.evict(swa=10)
    assert ev.swa_pages == 2 and ev.full_pages == 0
    (leaf,) = h.path(s)
    assert leaf.swa is None and leaf.full_lock == 1 and leaf.children is None
    assert h.evict(full=10).full_pages == 0  # still full-locked
    h.unlock(r)  # the tombstoned leaf goes at its last unlock
    assert leaf.id not in h.tree.nodes and sorted(h.sink.full) == sorted(full)
    assert h.counters() == (0, 0, 0, 0)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_no_unlocked_tombstone_leaf_after_cascades(P):
    h = Harness(P, window=P)
    # a chain of single-page nodes, each inserted as an extension of the previous one
    labels = list(range(1, 7))
    for k in range(1, len(labels) + 1):
        h.insert(seq(P, labels[:k]), prev=(k - 1) * P)
    assert len(h.path(seq(P, labels))) == 6
    for _ in range(6):
        h.evict(swa=1)
        assert not dead_leaves(h.tree)
    assert set(h.tree.nodes) == {h.root().id}
    assert h.counters() == (0, 0, 0, 0)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_eviction_across_and_within_namespaces(P):
    h = Harness(P)
    _, fa1, sa1 = h.insert(seq(P, [1, 2]), ns="a")
    _, fb1, _ = h.insert(seq(P, [3, 4]), ns="b")
    _, fa2, _ = h.insert(seq(P, [5, 6]), ns="a")
    na, nb = h.tree.namespace("a"), h.tree.namespace("b")
    assert (na.full_pages, na.swa_pages, nb.full_pages, nb.swa_pages) == (4, 4, 2, 2)
    ev = h.tree.evict(2, 0, namespace="b")  # only b's pages, though a holds older ones
    h.ok()
    assert ev.full_pages == 2 and sorted(h.sink.full) == sorted(fb1)
    assert (na.full_pages, nb.full_pages, nb.swa_pages) == (4, 0, 0)
    assert h.tree.evict(2, 2, namespace="b").full_pages == 0
    assert h.tree.evict(2, 2, namespace="nobody").full_pages == 0
    h.ok()
    h.ok()
    ev = h.evict(full=2)  # across namespaces: the least recently used leaf
    assert ev.full_pages == 2 and sorted(h.sink.full) == sorted(list(fb1) + list(fa1))
    assert na.full_pages == 2 and h.match(seq(P, [5, 6]), ns="a").prefix_len == 2 * P


# ---------------------------------------------------------------------- host tier


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_set_host_needs_the_parent_first(P):
    h = Harness(P, host=True)
    a = seq(P, [1, 2])
    s = seq(P, [1, 2, 3])
    h.insert(a)
    h.insert(s, prev=2 * P)
    na, nb = h.path(s)
    with pytest.raises(BadArgument):
        h.tree.set_host(nb.id, h.host(1))
    with pytest.raises(BadArgument):
        h.tree.set_host(h.root().id, array("i"))
    with pytest.raises(BadArgument):
        h.tree.set_host(na.id, h.host(3))  # wrong slot count
    h.ok()
    assert na.host is None and nb.host is None and h.tree.host_pages == 0
    h.tree.set_host(na.id, h.host(2))
    h.ok()
    with pytest.raises(BadArgument):
        h.tree.set_host(na.id, h.host(2))  # already has one
    h.tree.set_host(nb.id, h.host(1))
    h.ok()
    h.ok()
    assert h.tree.host_pages == 3


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_eviction_demotes_host_backed_nodes(P):
    h = Harness(P, host=True)
    a = seq(P, [1, 2])
    s = seq(P, [1, 2, 3, 4])
    _, fa, _ = h.insert(a)
    _, fs, _ = h.insert(s, prev=2 * P)
    na, nb = h.path(s)
    ha = h.host(2)
    h.tree.set_host(na.id, ha)
    h.ok()
    ev = h.evict(full=100)  # nb has no host copy: deleted; na is demoted
    assert ev.full_pages == 4
    assert nb.id not in h.tree.nodes
    assert na.id in h.tree.nodes and na.full is None and na.swa is None
    assert list(na.host) == list(ha)
    m = h.match(s)
    # a host copy without the window's SWA could not be used after a load: no host hit
    assert m.prefix_len == 0 and m.full_hit_len == 0 and m.host_hit_len == 0
    # the window (two pages) gets SWA copies on host, as from Redis
    assert h.tree.adopt_host(NS, a, 0, 2, {}, dict(enumerate(h.host(2)))) == (0, 2)
    h.ok()
    m = h.match(s)
    assert m.prefix_len == 0 and m.full_hit_len == 0 and m.host_hit_len == 2 * P
    # a fresh device copy brings the host-only node back to the device, same node
    res, cfull, cswa = h.insert(a)
    assert na.full is not None and list(na.full) == list(cfull) and list(na.host) == list(ha)
    assert h.match(a).prefix_len == 2 * P
    h.evict(full=100)
    assert na.full is None
    ev = h.tree.evict_host(100)
    h.ok()
    assert ev.host_slots == 2 and sorted(h.sink.host) == sorted(ha)
    assert len(h.sink.host_swa) == 2 and h.tree.host_swa_pages == 0
    assert set(h.tree.nodes) == {h.root().id} and h.tree.host_pages == 0


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_host_only_chain_and_evict_host_drops_leaves_first(P):
    h = Harness(P, host=True)
    a = seq(P, [1, 2])
    s = seq(P, [1, 2, 3, 4])
    h.insert(a)
    h.insert(s, prev=2 * P)
    na, nb = h.path(s)
    ha, hb = h.host(2), h.host(2)
    h.tree.set_host(na.id, ha, h.host(2))  # each node keeps SWA copies of its window
    h.tree.set_host(nb.id, hb, h.host(2))
    h.ok()
    h.evict(full=100)
    assert na.full is None and nb.full is None and set(h.tree.nodes) == {
        h.root().id, na.id, nb.id}
    m = h.match(s)
    assert m.prefix_len == 0 and m.host_hit_len == 4 * P
    ev = h.tree.evict_host(1)  # the leaf goes first (whole node)
    h.ok()
    assert ev.host_slots == 2 and sorted(h.sink.host) == sorted(hb)
    assert nb.id not in h.tree.nodes and na.id in h.tree.nodes
    assert h.match(s).host_hit_len == 2 * P
    h.tree.evict_host(1)
    h.ok()
    assert set(h.tree.nodes) == {h.root().id}


# ---------------------------------------------------------------------- models without SWA


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_model_without_swa(P):
    h = Harness(P, window=None)
    assert not h.tree.swa_enabled and h.tree.window_pages == 0
    s = seq(P, [1, 2, 3])
    res, full, swa = h.insert(s)
    assert len(swa) == 0 and len(res.swa_pages) == 0 and res.inserted_len == 3 * P
    m = h.match(s + seq(P, [4]), lock=True)
    assert m.prefix_len == 3 * P and list(m.full_pages) == list(full) and len(m.swa_pages) == 0
    assert m.receipt.swa_pages == 0
    assert h.evict(full=10, swa=10).full_pages == 0
    h.unlock(m.receipt)
    with pytest.raises(BadArgument):
        h.tree.insert(NS, seq(P, [7]), array("i", [50]), array("i", [60]))
    res, full2, _ = h.insert(seq(P, [1, 2, 3, 4]))
    assert res.prefix_len == 3 * P and sorted(h.sink.full) == sorted(full2[:3])
    tail = P - 1 if P > 1 else 0
    tokens = seq(P, [1, 2, 3, 4, 5], tail=tail)
    r = h.match(tokens, lock=True).receipt
    extra = h.full(1 + (1 if tail else 0))
    h.tree.cache_finished(NS, tokens, extra, None, 4 * P, 0, r)
    h.ok()
    assert h.match(tokens).prefix_len == 5 * P
    ev = h.evict(full=100)
    assert ev.full_pages == 5 and ev.swa_pages == 0 and not h.sink.swa
    assert set(h.tree.nodes) == {h.root().id}
