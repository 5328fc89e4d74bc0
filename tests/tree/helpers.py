"""Helpers shared by the tree tests: token sequences, page ids, small trees and caches, and
views of their state to compare before and after an operation."""

from __future__ import annotations

from array import array

from daemon.gpu.profile import ModelProfile
from daemon.model_cache import ModelCache
from daemon.tree import (
    CollectingSink,
    RadixTree,
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
