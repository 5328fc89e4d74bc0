"""Bugs found while writing the rule and regression tests (each test failed on the code it
was written against, commit dcf9c7f; all three were fixed in d71648b and stay here as
regression tests).

1. ``ModelCache._release_pages`` (daemon/model_cache.py) reads ``self.holdings[owner]``, which
   raises ``KeyError`` for an owner that has never allocated or locked anything (or was released).
   It runs *after* the tree call, so an insert / cache_unfinished that locked in the tree loses
   that receipt: the tree keeps a lock nobody can release (the SGLang lost-receipt class).
2. ``ModelCache.alloc`` evicts before finding out that the allocation cannot succeed, so a
   request that fails anyway flushes every other session's cached (unlocked) pages.
3. ``RadixTree.cache_finished`` checks that ``full_pages`` / ``swa_pages`` are distinct only over
   the inserted range, not across the unaligned tail page, so a page listed twice is both adopted
   by the tree and handed to the sink (one page in two places).
"""

from __future__ import annotations

from array import array

import pytest

from daemon.gpu.allocator import OutOfPages
from daemon.gpu.profile import ModelProfile
from daemon.model_cache import ModelCache
from daemon.tree import BadArgument, CollectingSink, RadixTree, as_token_bytes, check_tree

P = 4
NS = "ns"


def seq(labels: list[int], tail: int = 0) -> bytes:
    toks: list[int] = []
    for lab in labels:
        toks += [lab * 1000 + j for j in range(P)]
    toks += [999_000 + j for j in range(tail)]
    return as_token_bytes(toks)


def make_cache(full: int = 32, swa: int = 32) -> ModelCache:
    profile = ModelProfile(
        name="m", page_size=P, num_full_layers=1, num_kv_heads=1, head_dim=1, full_pages=full,
        sliding_window=2 * P, num_swa_layers=1, swa_pages=swa, dtype="float32", device="cpu")
    return ModelCache(profile)


def cached(cache: ModelCache, labels: list[int]) -> None:
    f, w = cache.alloc(1, len(labels))
    cache.insert(1, NS, seq(labels), f, w)


# ---------------------------------------------------------------------- bug 1


def test_locking_insert_by_an_owner_holding_nothing_keeps_its_receipt():
    """daemon/model_cache.py ModelCache.insert -> _release_pages (``h = self.holdings[owner]``).

    Owner 2 has only matched (no lock, no alloc), so it has no Holding. Its request is exactly
    the cached prefix, so it inserts no new pages: ``insert(..., prev_prefix_len=len, lock=True)``.
    Expected: a receipt id comes back and the cache is consistent. Actual: KeyError(2) after the
    tree took the lock; the receipt is registered nowhere and can never be released.
    """
    cache = make_cache()
    cached(cache, [1, 2])
    s = seq([1, 2])
    m, rid = cache.match(2, NS, s)  # no lock: no Holding for owner 2
    assert m.prefix_len == 2 * P and rid is None
    res, rid = cache.insert(2, NS, s, array("i"), array("i"), 2 * P, 0, lock=True)
    assert rid is not None and res.inserted_len == 2 * P
    assert cache.check() == []
    cache.unlock(2, rid)
    assert cache.tree.full_protected == 0 and cache.check() == []


def test_cache_unfinished_by_an_owner_holding_nothing_keeps_its_receipt():
    """Same line, through cache_unfinished (which always locks): a chunk that ends exactly on the
    cached prefix, from an owner that never locked. Actual: KeyError and a lost tree lock."""
    cache = make_cache()
    cached(cache, [1, 2])
    s = seq([1, 2])
    res, rid = cache.cache_unfinished(3, NS, s, array("i"), array("i"), 2 * P, 0, None)
    assert res.inserted_len == 2 * P and cache.check() == []
    cache.unlock(3, rid)
    assert cache.tree.full_protected == 0 and cache.check() == []


def test_empty_key_insert_by_an_owner_holding_nothing_is_a_no_op():
    """Same line: a key shorter than one page (empty after page alignment, PR #10637 class) from
    a fresh owner. Expected: nothing inserted, no error. Actual: KeyError."""
    cache = make_cache()
    short = seq([1])[: 4 * (P - 1)]
    res, rid = cache.insert(4, NS, short, array("i"), array("i"))
    assert res.inserted_len == 0 and rid is None and cache.check() == []
    # and a finished request that is exactly a cached prefix (no pages left to hand back)
    cached(cache, [1, 2])
    res = cache.cache_finished(6, NS, seq([1, 2]), array("i"), array("i"), 2 * P, 0, None)
    assert res.inserted_len == 2 * P and cache.check() == []


def test_free_of_nothing_by_an_owner_holding_nothing_is_a_no_op():
    """Same line via ModelCache.free: freeing an empty list from an owner without a Holding
    raises KeyError (expected: nothing to do)."""
    cache = make_cache()
    cache.free(5, [], [])
    assert cache.check() == []


# ---------------------------------------------------------------------- bug 2


def test_alloc_that_cannot_succeed_does_not_flush_the_cache():
    """daemon/model_cache.py ModelCache.alloc: ``self.tree.evict(need_full, need_swa)`` runs
    before ``a.alloc(n)`` without checking that available + evictable can cover ``n``.

    Owner 1 caches 6 unlocked pages in a pool of 8 usable pages. Owner 2 asks for 20 pages, which
    can never be satisfied. Expected: OutOfPages, the cache untouched (and the error reports the
    6 evictable pages). Actual: all 6 cached pages are evicted first, then OutOfPages reports
    ``0 evictable``: any session can wipe every other session's cache with one oversized alloc.
    """
    cache = make_cache(full=9, swa=9)
    cached(cache, [1, 2, 3, 4, 5, 6])
    with pytest.raises(OutOfPages) as ei:
        cache.alloc(2, 20)
    assert cache.tree.device_pages() == (6, 6)
    assert ei.value.counts["full_evictable"] == 6
    assert cache.match(3, NS, seq([1, 2, 3, 4, 5, 6]))[0].prefix_len == 6 * P


# ---------------------------------------------------------------------- bug 3


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
    sink = CollectingSink()
    tree = RadixTree(P, 2 * P, sink)
    tokens = seq([1, 2], tail=2)
    full = array("i", [1, 2, 1] if pool == "full" else [1, 2, 3])
    swa = array("i", [5, 6, 5] if pool == "swa" else [5, 6, 7])
    with pytest.raises(BadArgument):
        tree.cache_finished(NS, tokens, full, swa, 0, 0, None)
    assert tree.device_pages() == (0, 0) and not sink.full and not sink.swa
    assert check_tree(tree) == []
