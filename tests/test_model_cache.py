"""ModelCache: per-owner accounting on top of the tree and the allocators, and its conservation
check (free + tree + held = capacity, no page in two places)."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.gpu.allocator import OutOfPages
from daemon.gpu.profile import ModelProfile
from daemon.model_cache import ModelCache, PageNotHeld
from daemon.tree import BadArgument, ReceiptError, as_token_bytes, check_tree

P = 4
NS = "ns"


def seq(labels: list[int], tail: int = 0) -> bytes:
    toks: list[int] = []
    for lab in labels:
        toks += [lab * 1000 + j for j in range(P)]
    toks += [999_000 + j for j in range(tail)]
    return as_token_bytes(toks)


def make_cache(full: int = 32, swa: int = 32, window_pages: int | None = 2) -> ModelCache:
    profile = ModelProfile(
        name="m", page_size=P, num_full_layers=1, num_kv_heads=1, head_dim=1, full_pages=full,
        sliding_window=window_pages * P if window_pages else None,
        num_swa_layers=1 if window_pages else 0, swa_pages=swa if window_pages else 0,
        dtype="float32", device="cpu")
    return ModelCache(profile)


def snapshot(cache: ModelCache):
    t = cache.tree
    nodes = sorted((n.id, bytes(n.tokens), tuple(n.full or ()),
                    None if n.swa is None else tuple(n.swa), n.full_lock, n.swa_lock)
                   for n in t.iter_nodes())
    holdings = {o: (sorted(h.full), sorted(h.swa), sorted(h.receipts))
                for o, h in cache.holdings.items()}
    a = cache.alloc_state
    swa_free = sorted(a.swa.free_set()) if a.swa is not None else []
    return nodes, holdings, sorted(a.full.free_set()), swa_free, len(t.receipts)


def all_free(cache: ModelCache) -> bool:
    a = cache.alloc_state
    return a.full.available == a.full.usable and (
        a.swa is None or a.swa.available == a.swa.usable)


# ---------------------------------------------------------------------- ownership


def test_pages_of_another_owner_are_refused():
    cache = make_cache()
    f1, w1 = cache.alloc(1, 3)
    f2, w2 = cache.alloc(2, 3)
    s = seq([1, 2, 3])
    state = snapshot(cache)
    with pytest.raises(PageNotHeld):
        cache.free(2, [f1[0]])
    with pytest.raises(PageNotHeld):
        cache.free(2, swa=[w1[1]])
    with pytest.raises(PageNotHeld):
        cache.free(2, [f2[0], f1[0]])  # one of them is fine: still nothing is freed
    with pytest.raises(PageNotHeld):
        cache.insert(2, NS, s, f1, w2)
    with pytest.raises(PageNotHeld):
        cache.insert(2, NS, s, f2, w1)
    with pytest.raises(PageNotHeld):
        cache.cache_finished(2, NS, s, f1, w1, 0, 0, None)
    with pytest.raises(PageNotHeld):
        cache.insert(3, NS, s, f2, w2)  # an owner that holds nothing
    assert snapshot(cache) == state and cache.check() == []
    # the rightful owner can
    res, _ = cache.insert(1, NS, s, f1, w1)
    assert res.inserted_len == 3 * P and cache.check() == []
    # once in the tree, the pages are nobody's: freeing them again is refused
    with pytest.raises(PageNotHeld):
        cache.free(1, [f1[0]])
    assert cache.check() == []


def test_receipts_of_another_owner_are_refused():
    cache = make_cache()
    f, w = cache.alloc(1, 3)
    s = seq([1, 2, 3])
    cache.insert(1, NS, s, f, w)
    _, rid = cache.match(1, NS, s, lock=True)
    f2, w2 = cache.alloc(2, 1)
    state = snapshot(cache)
    with pytest.raises(ReceiptError):
        cache.unlock(2, rid)
    with pytest.raises(ReceiptError):
        cache.release_swa(2, rid)
    with pytest.raises(ReceiptError):
        cache.cache_finished(2, NS, seq([1, 2, 3, 4]), f2, w2, 3 * P, 0, rid)
    with pytest.raises(ReceiptError):
        cache.cache_unfinished(2, NS, seq([1, 2, 3, 4]), f2, w2, 3 * P, 0, rid)
    for bogus in (rid + 100, -1, "1", None):
        with pytest.raises(ReceiptError):
            cache.unlock(1, bogus)
    assert snapshot(cache) == state and cache.check() == []
    assert cache.release_owner(2) == (0, 1, 1)
    assert cache.tree.full_protected == 3  # owner 1's lock survived owner 2 going away
    cache.unlock(1, rid)
    assert cache.tree.full_protected == 0 and cache.check() == []


def test_release_owner_frees_everything():
    cache = make_cache()
    f, w = cache.alloc(1, 2)
    cache.insert(1, NS, seq([1, 2]), f, w)
    tokens = seq([1, 2, 3, 4, 5], tail=1)
    _, rid = cache.match(7, NS, tokens, lock=True)
    full, swa = cache.alloc(7, 4)
    cache.free(7, swa=[swa[0]])  # decode freed one SWA page
    swa = array("i", [0]) + swa[1:]
    res, rid2 = cache.cache_unfinished(7, NS, tokens, full, swa, 2 * P, 3 * P, rid)
    assert res.inserted_len == 5 * P
    _, rid3 = cache.match(7, NS, seq([1]), lock=True)
    extra_f, extra_w = cache.alloc(7, 2)
    assert cache.check() == []
    receipts, held_full, held_swa = cache.release_owner(7)
    assert (receipts, held_full, held_swa) == (2, 3, 3)  # 2 locks; tail page + 2 extra
    assert 7 not in cache.holdings and not cache.tree.receipts
    assert cache.tree.full_protected == 0 and cache.tree.swa_protected == 0
    assert cache.check() == []
    assert cache.release_owner(7) == (0, 0, 0)
    with pytest.raises(ReceiptError):
        cache.unlock(7, rid3)
    cache.release_owner(1)
    cache.evict(1000, 1000)
    assert cache.check() == [] and all_free(cache)


def test_alloc_evicts_cached_unlocked_pages_when_short():
    cache = make_cache(full=9, swa=9)  # 8 usable pages per pool
    f, w = cache.alloc(1, 6)
    cache.insert(1, NS, seq([1, 2, 3, 4, 5, 6]), f, w)
    assert cache.alloc_state.full.available == 2
    full, swa = cache.alloc(2, 5)
    assert len(full) == len(swa) == 5
    assert cache.counters["evicted_for_alloc_full"] == 3
    assert cache.alloc_state.full.available == 0
    assert cache.tree.device_pages() == (3, 3)
    assert cache.check() == []
    assert cache.match(3, NS, seq([1, 2, 3, 4, 5, 6]))[0].prefix_len == 3 * P


def test_alloc_never_evicts_locked_pages():
    cache = make_cache(full=9, swa=9)
    f, w = cache.alloc(1, 6)
    s = seq([1, 2, 3, 4, 5, 6])
    cache.insert(1, NS, s, f, w)
    m, rid = cache.match(1, NS, s, lock=True)
    state = snapshot(cache)
    with pytest.raises(OutOfPages):
        cache.alloc(2, 3)  # hopeless: refused before anything is evicted
    assert snapshot(cache) == state and cache.check() == []
    assert cache.tree.full_protected == 6 and cache.tree.swa_protected == 2
    m2, _ = cache.match(2, NS, s)
    assert m2.prefix_len == 6 * P and list(m2.full_pages) == list(m.full_pages)
    assert list(m2.swa_pages) == list(m.swa_pages)
    assert 2 not in cache.holdings or not cache.holdings[2].full


def test_alloc_failure_lists_the_counts():
    cache = make_cache(full=11, swa=11)  # 10 usable pages per pool
    f, w = cache.alloc(1, 4)
    s = seq([1, 2, 3, 4])
    cache.insert(1, NS, s, f, w)
    _, rid = cache.match(1, NS, s, lock=True)  # 4 full locked, 2 SWA locked, 2 SWA evictable
    held_f, held_w = cache.alloc(2, 3)  # 3 held by a session
    with pytest.raises(OutOfPages) as ei:
        cache.alloc(3, 8)
    e = ei.value
    msg = str(e)
    for word in ("free", "evictable", "locked", "held"):
        assert word in msg
    assert e.counts["requested"] == 8
    assert e.counts["full_available"] == 3 and e.counts["full_locked"] == 4
    assert e.counts["full_evictable"] == 0 and e.counts["full_held"] == 3
    assert e.counts["swa_locked"] == 2 and e.counts["swa_held"] == 3
    assert e.counts["swa_available"] == 3 and e.counts["swa_evictable"] == 2
    assert cache.counters["alloc_failures"] == 1
    assert 3 not in cache.holdings or not cache.holdings[3].full
    assert cache.tree.device_pages() == (4, 4)  # nothing evicted for a hopeless request
    assert cache.check() == []


# ---------------------------------------------------------------------- the conservation check


def test_check_catches_a_page_leaked_from_the_free_list():
    cache = make_cache()
    f, w = cache.alloc(1, 2)
    cache.insert(1, NS, seq([1, 2]), f, w)
    assert cache.check() == []
    a = cache.alloc_state
    (leaked,) = a.full._seg_free[0].take(1)  # gone from the free list, behind the allocator's back
    v = cache.check()
    assert v and any("full pool" in x for x in v)
    assert any(str(leaked) in x and "unaccounted" in x for x in v)
    a.full._seg_free[0].put(array("i", [leaked]))
    assert cache.check() == []
    leaked = a.swa._seg_free[0].take(1)
    v = cache.check()
    assert any("swa pool" in x for x in v)


def test_check_catches_a_page_owned_twice():
    cache = make_cache()
    f, w = cache.alloc(1, 2)
    cache.insert(1, NS, seq([1, 2]), f, w)
    g, x = cache.alloc(2, 1)
    assert cache.check() == []
    # a page in the tree also planted in a session's holding
    p = f[0]
    cache.holdings[2].full.add(NS, [p])
    v = cache.check()
    assert any("in the tree and held by a session" in s and str(p) in s for s in v)
    cache.holdings[2].full.remove([p])
    assert cache.check() == []
    # a free page also held by a session
    q = next(iter(cache.alloc_state.swa._seg_free[0]))
    cache.holdings[2].swa.add(NS, [q])
    v = cache.check()
    assert any("free and held by a session" in s for s in v)
    cache.holdings[2].swa.remove([q])
    assert cache.check() == []
    # a page held under a session number no holding has (a holding dropped without its pages)
    cache.holders.full.holder[g[0]] = 9
    v = cache.check()
    assert any("held by session number 9, which no holding has" in s for s in v)
    assert any("its full holding counts 1 pages, the page table gives it 0" in s for s in v)


def test_check_catches_a_holding_miscounted():
    cache = make_cache()
    cache.alloc(1, 2)
    assert cache.check() == []
    cache.holdings[1].full.count += 1
    assert any("its full holding counts 3 pages, the page table gives it 2" in s
               for s in cache.check())
    cache.holdings[1].full.count -= 1
    cache.holders.full.holder[0] = 1
    assert any("padding page 0 is held" in s for s in cache.check())
    cache.holders.full.holder[0] = 0
    cache.holders.full.holder[5] = -3
    assert any("negative session numbers in the page table" in s for s in cache.check())


def test_model_without_swa():
    cache = make_cache(window_pages=None)
    assert not cache.swa_enabled
    tokens = seq([1, 2, 3], tail=2)
    _, rid = cache.match(1, NS, tokens, lock=True)
    full, swa = cache.alloc(1, 4)
    assert len(swa) == 0
    res = cache.cache_finished(1, NS, tokens, full, swa, 0, 0, rid)
    assert res.inserted_len == 3 * P and cache.check() == []
    assert cache.match(2, NS, tokens)[0].prefix_len == 3 * P
    cache.evict(100, 100)
    assert cache.check() == [] and all_free(cache)


# ---------------------------------------------------------------------- found while testing
# Bugs found while writing the rule and regression tests (each test failed on the code it was
# written against, commit dcf9c7f; fixed in d71648b):
# 1. ``ModelCache._release_pages`` read ``self.holdings[owner]``, raising KeyError for an owner
#    that never allocated or locked anything, after the tree call: an insert / cache_unfinished
#    that locked in the tree lost that receipt (the SGLang lost-receipt class).
# 2. ``ModelCache.alloc`` evicted before finding out that the allocation could not succeed, so a
#    request that failed anyway flushed every other session's cached (unlocked) pages.
# (3., a tree bug, is tested in tests/tree/test_insertion.py.)


def cached(cache: ModelCache, labels: list[int]) -> None:
    f, w = cache.alloc(1, len(labels))
    cache.insert(1, NS, seq(labels), f, w)


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


# ---------------------------------------------------------------------- two-phase eviction


def test_alloc_offers_victims_to_the_tiers_between_tree_operations():
    """An alloc that evicts hands each node the tree names to ``copy_to_host`` with the node
    untouched, then commits: a copied node is demoted, and the alloc gets its pages."""
    cache = make_cache(full=9, swa=9)
    cached(cache, [1, 2, 3, 4])
    tree = cache.tree
    tree.host_copy_hits = 0
    seen = []

    def copy(n) -> None:
        assert n in tree.awaiting_copy and n.full is not None
        seen.append(n)
        tree.set_host(n.id, array("i", range(100 + 10 * n.id, 100 + 10 * n.id + tree.npages(n))))

    cache.copy_to_host = copy
    full, _ = cache.alloc(2, 8)
    assert len(full) == 8 and seen and not tree.awaiting_copy
    assert all(n.full is None and n.host is not None for n in seen)
    assert tree.host_pages == 4
    assert cache.match(3, NS, seq([1, 2, 3, 4]))[0].full_hit_len == 0
    assert check_tree(tree) == []  # (cache.check would ask for the host tier these slots lack)


def test_held_pages_count_what_sessions_hold():
    cache = make_cache()
    cache.alloc(1, 3)
    cache.alloc(2, 2)
    assert (cache.held_full_pages, cache.held_swa_pages) == (5, 5)
    cache.release_owner(1)
    assert (cache.held_full_pages, cache.held_swa_pages) == (2, 2)


# ---------------------------------------------------------------------- id lists, checked in C


def reference_verdict(cache: ModelCache, owner: int, n: int, total: int, prev: int,
                      frontier_len: int, full: list[int], swa: list[int]) -> str:
    """What the per-id loops ModelCache used to run say of these lists: "bad_argument",
    "page_not_held" or "ok" (written apart from the code under test, id by id)."""
    frontier = min(frontier_len // P, n)
    for j, sp in enumerate(swa):
        if prev + j < frontier and sp != 0:
            return "bad_argument"
        if sp == 0 and frontier <= prev + j < n:
            return "bad_argument"
    live = [p for p in swa if p]
    if len(set(live)) != len(live) or len(set(full)) != len(full):
        return "bad_argument"
    h = cache.holdings.get(owner)
    if h is None or any(p not in h.full for p in full) or any(p not in h.swa for p in live):
        return "page_not_held"
    return "ok"


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_id_list_checks_agree_with_the_per_id_reference(data):
    """cache_finished's checks of the id lists (min, max, count and sets, in C) give the
    verdict of a loop over every id, on lists mixing held ids, zeros, negatives, duplicates
    and ids of another owner; a refused call changes nothing."""
    cache = make_cache(full=64, swa=64)
    pages = data.draw(st.integers(2, 12))
    tail = data.draw(st.integers(0, P - 1))
    tokens = seq(list(range(1, pages + 1)), tail)
    n = pages
    total = pages + (1 if tail else 0)
    prev = 0
    frontier_len = data.draw(st.integers(0, pages + 1)) * P
    f, w = cache.alloc(1, total)
    of, ow = cache.alloc(2, 2)  # another owner's
    full, swa = list(f), list(w)
    frontier = min(frontier_len // P, n)
    for j in range(min(frontier, total)):
        swa[j] = 0  # the decode freed these
    for _ in range(data.draw(st.integers(0, 3))):  # faults, each kind at any page
        kind = data.draw(st.sampled_from(["zero", "id", "dup", "other", "negative"]))
        pool = data.draw(st.sampled_from(["full", "swa"]))
        lst, own, other = (full, f, of) if pool == "full" else (swa, w, ow)
        edges = sorted({0, max(0, frontier - 1), min(frontier, total - 1), n - 1, total - 1})
        j = data.draw(st.one_of(st.sampled_from(edges), st.integers(0, total - 1)))
        dup = lst[data.draw(st.integers(0, total - 1))]
        lst[j] = {"zero": 0, "id": own[j] or own[-1], "dup": dup, "other": other[0],
                  "negative": -3}[kind]
    want = reference_verdict(cache, 1, n, total, prev, frontier_len, full, swa)
    before = snapshot(cache)
    try:
        cache.cache_finished(1, NS, tokens, array("i", full), array("i", swa), prev,
                             frontier_len, None)
        got = "ok"
    except PageNotHeld:
        got = "page_not_held"
    except BadArgument:
        got = "bad_argument"
    assert got == want, (full, swa, frontier_len)
    if got != "ok":
        assert snapshot(cache) == before
    assert check_tree(cache.tree) == []


def test_check_finds_a_held_page_in_another_namespaces_segment():
    """Isolated pools: a session's pages lie in the segments of the namespace it allocated for.
    A page moved (by a bookkeeping bug) from one session to another of another namespace keeps
    every count right; only the segment check sees it."""
    profile = ModelProfile(
        name="m", page_size=P, num_full_layers=1, num_kv_heads=1, head_dim=1, full_pages=64,
        sliding_window=2 * P, num_swa_layers=1, swa_pages=64, dtype="float32", device="cpu")
    cache = ModelCache(profile, segment_pages=8)
    cache.alloc(1, 3, "a")
    f2, _ = cache.alloc(2, 3, "b")
    assert cache.check() == []
    h1, h2 = cache.holdings[1], cache.holdings[2]
    cache.holders.full.holder[f2[0]] = h1.full.number
    h1.full.count += 1
    h2.full.count -= 1
    v = cache.check()
    seg = f2[0] // 8
    assert any("full pages of namespace 'a' lie in segments" in s and f"[{seg}]" in s
               for s in v), v


def test_disown_of_a_known_list_with_a_page_twice_scans_and_leaves_nothing_behind():
    """disown(known=...) skips the table scan only for a list that is exactly what the owner
    holds: a list with a page twice is as long as the holding yet misses a page."""
    cache = make_cache()
    f, w = cache.alloc(1, 2)
    full, swa = cache.disown(1, (array("i", [f[0], f[0]]), array("i", [w[0], w[0]])))
    assert sorted(full) == sorted(f) and sorted(swa) == sorted(w)
    assert 1 not in cache.holdings and not cache.holders.full.holder_np.any()
    cache.alloc_state.free_full(full)
    cache.alloc_state.free_swa(swa)
    cache.alloc(7, 1)  # takes the number the dropped holding had
    assert cache.check() == [] and len(cache.holdings[7].full) == 1


def test_page_ids_of_another_int_type_are_read_as_int32():
    """In process a caller may pass array('q') or lists: the checks read int32 ids."""
    cache = make_cache(full=400, swa=400, window_pages=None)
    f, _ = cache.alloc(1, 200)
    tokens = as_token_bytes(list(range(1, 200 * P + 1)))
    res, _ = cache.insert(1, NS, tokens, array("q", f), array("q"))
    assert res.inserted_len == 200 * P and cache.check() == []
    g, _ = cache.alloc(1, 1)
    with pytest.raises(BadArgument, match="32-bit"):
        cache.free(1, array("q", [2**40]))
    cache.free(1, list(g))
    assert cache.check() == []


# ---------------------------------------------------------------------- page runs


def test_page_one_nodes_in_use_keep_long_runs_unless_configured_not_to():
    """``server.long_runs_in_use``: on (the default), a node that takes 1,024 page ids or more
    in one run keeps a range from its insert on, and a match lists it back exactly; off, it
    keeps the array until it is cold."""
    profile = ModelProfile(
        name="m", page_size=1, num_full_layers=1, num_kv_heads=1, head_dim=1, full_pages=6000,
        sliding_window=128, num_swa_layers=1, swa_pages=6000, dtype="float32", device="cpu")
    toks = as_token_bytes(range(1, 2001))
    for on, form in ((True, range), (False, array)):
        cache = ModelCache(profile, long_runs_in_use=on)
        f, w = cache.alloc(1, 2000)
        cache.cache_finished(1, NS, toks, f, w, 0, 0, None)
        node = next(n for n in cache.tree.iter_nodes() if n.parent is not None)
        assert type(node.full) is form and type(node.swa) is form
        m, _ = cache.match(1, NS, toks)
        assert m.full_pages.tolist() == f.tolist() and m.swa_pages.tolist() == w.tolist()[-128:]
        assert cache.check() == []


def test_page_one_cold_nodes_are_kept_as_runs_and_listed_back_exactly():
    """At a page of one token the tree keeps a cold node's pages by their runs (the daemon's
    codec, daemon/gpu/page_runs.py, run while it is idle); matches list them back in order,
    a node of one run used again stays one, evictions give back exactly those pages, and the
    conservation check stays clean throughout."""
    profile = ModelProfile(
        name="m", page_size=1, num_full_layers=1, num_kv_heads=1, head_dim=1, full_pages=6000,
        sliding_window=128, num_swa_layers=1, swa_pages=6000, dtype="float32", device="cpu")
    cache = ModelCache(profile, long_runs_in_use=False)  # (the runs of nodes in use: below)
    tree = cache.tree
    assert tree.compact_after == 6000 // 2

    def idle() -> None:
        while tree.compact_cold(64, 64):
            pass

    def forms() -> dict[int, str]:
        return {n.id: type(n.full).__name__ for n in tree.iter_nodes() if n.parent is not None}

    a_toks = as_token_bytes(range(1, 2001))
    f, w = cache.alloc(1, 2000)
    cache.cache_finished(1, NS, a_toks, f, w, 0, 0, None)
    idle()
    assert set(forms().values()) == {"array"}  # nothing arrived since: nothing is cold
    # a second request shares 1500 tokens: the node splits, 3500 tokens arrive
    b_toks = as_token_bytes([*range(1, 1501), *range(9000, 12_500)])
    m, rid = cache.match(2, NS, b_toks, lock=True)
    assert m.prefix_len == 1500 and m.full_pages.tolist() == f.tolist()[:1500]
    f2, w2 = cache.alloc(2, 3500)
    cache.cache_finished(2, NS, b_toks, f2, w2, 1500, 0, rid)
    idle()
    # the shared prefix was used by that insert: only the first request's own tail is cold
    tail = next(n for n in tree.iter_nodes() if n.tokens[:4] == as_token_bytes([1501]))
    by_form = forms()
    assert by_form.pop(tail.id) == "range" and set(by_form.values()) == {"array"}, by_form
    assert cache.check() == []
    assert tree.stats["compacted_nodes"] == 1 and tree.stats["expanded_nodes"] == 0
    # the first request again: the same pages, and its nodes are in use again
    m1, _ = cache.match(1, NS, a_toks)
    assert m1.prefix_len == 2000 and m1.full_pages.tolist() == f.tolist()
    assert m1.swa_pages.tolist() == w.tolist()[-128:]
    # (one run stays a range when used again: listed with one numpy call, never expanded)
    assert forms()[tail.id] == "range" and tree.stats["expanded_nodes"] == 0
    assert cache.check() == []
    # compacted again (the threshold at 0: everything is cold); evictions give the runs back
    tree.compact_after = 0
    idle()
    assert set(forms().values()) == {"range"}
    cache.evict(full_pages=6000, swa_pages=6000)
    assert all_free(cache) and cache.check() == []


def test_a_session_end_refused_whole_leaves_every_lock_registered_for_the_next_try():
    """release_owner hands the tree all the owner's receipts at once; when the tree refuses
    them (a registered receipt already released: a bug elsewhere, injected here), nothing is
    forgotten, and once the fault is gone the owner's end releases everything."""
    cache = make_cache()
    f, w = cache.alloc(1, 3)
    cache.insert(1, NS, seq([1, 2, 3]), f, w)
    _, a = cache.match(1, NS, seq([1, 2, 3]), lock=True)
    _, b = cache.match(1, NS, seq([1, 2]), lock=True)
    r = cache._receipts[b][1]
    r.active = False  # the fault
    with pytest.raises(ReceiptError):
        cache.release_owner(1)
    assert sorted(cache.holdings[1].receipts) == sorted([a, b])
    assert a in cache._receipts and b in cache._receipts
    r.active = True
    assert cache.release_owner(1) == (2, 0, 0)
    assert cache.check() == [] and 1 not in cache.holdings
