"""The page tables of daemon/holdings.py and the allocators' numpy paths (daemon/gpu) against
simple references: a dict page -> (holder, namespace), and the page-by-page loops they replaced.
List lengths are drawn on both sides of VECTOR_MIN, so the Python and the numpy paths both run."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.gpu.allocator import VECTOR_MIN, AllocatorError, check_allocated
from daemon.gpu.segments import SegmentedAllocator
from daemon.holdings import HeldPages, Holders, PageTable

CAP = 600
SPACES = ("a", "b", "c")
LENGTHS = st.sampled_from([0, 1, 2, VECTOR_MIN - 1, VECTOR_MIN, VECTOR_MIN + 1, 200])


def _ids(draw: st.DrawFn, pool: list[int], n: int) -> list[int]:
    """``n`` distinct ids of ``pool`` (all of them if it has fewer) in a random order. Drawn as
    a seeded shuffle, not a permutation of the whole pool: a permutation of hundreds of ids made
    the smallest example so large that newer Hypothesis releases fail the health check."""
    if not pool or not n:
        return []
    return draw(st.randoms(use_true_random=False)).sample(pool, min(n, len(pool)))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_holdings_agree_with_a_dict_of_page_holders(data: st.DataObject) -> None:
    holders = Holders(CAP, CAP)
    ref: dict[int, tuple[int, str]] = {}  # full page -> (owner, namespace)
    for _ in range(data.draw(st.integers(5, 25), label="steps")):
        op = data.draw(st.sampled_from(["add", "remove", "covers", "drop"]))
        owner = data.draw(st.integers(1, 3), label="owner")
        h = holders.holding(owner)
        mine = sorted(p for p, (o, _) in ref.items() if o == owner)
        if op == "add":
            free = [p for p in range(1, CAP) if p not in ref]
            pages = _ids(data.draw, free, data.draw(LENGTHS))
            ns = data.draw(st.sampled_from(SPACES))
            h.full.add(ns, array("i", pages))
            ref.update(dict.fromkeys(pages, (owner, ns)))
        elif op == "remove":
            pages = _ids(data.draw, mine, data.draw(LENGTHS))
            zeros = data.draw(st.integers(0, 3))  # SWA lists carry 0 for "no page"
            h.full.remove(array("i", pages + [0] * zeros))
            for p in pages:
                del ref[p]
        elif op == "covers":
            others = [p for p in ref if ref[p][0] != owner]
            pick = data.draw(st.sampled_from(["mine", "one other", "odd id"]))
            pages = _ids(data.draw, mine, data.draw(LENGTHS))
            if pick == "one other" and others:
                pages.append(data.draw(st.sampled_from(others)))
            elif pick == "odd id":
                pages.append(data.draw(st.sampled_from([0, -1, -CAP, CAP, CAP + 5, 2**31 - 1])))
            want = all(ref.get(p, (None,))[0] == owner for p in pages)
            assert h.full.covers(array("i", pages)) == want
        else:
            got = holders.drop(owner)
            assert got is not None and sorted(got.full) == [] and got.full.count == len(mine)
            for p in mine:
                del ref[p]
        for o in (1, 2, 3):
            held = holders.by_owner.get(o)
            want = sorted(p for p, (oo, _) in ref.items() if oo == o)
            assert (sorted(held.full) if held else []) == want
            assert (len(held.full) if held else 0) == len(want)
            if held:
                assert {ref[p][1] for p in want} <= set(held.full.spaces)
                assert all((p in held.full) == (p in want) for p in (0, -1, CAP, *want[:3]))


def _reference_free(a: SegmentedAllocator, pages: array) -> None:
    """SegmentedAllocator.free as a page-by-page loop (the code the grouped free replaced):
    segments reopen in the order of their first page, and each segment's pages are pushed last
    first (so that a run freed in order is handed out in order again)."""
    st_ = a._state
    sp = a.segment_pages
    emptied: set[int] = set()
    for p in pages:
        seg = p // sp
        if not a._seg_free[seg]:
            a._ns_open[a.owner[seg]][seg] = None
    for p in reversed(pages):
        st_[p] = 0
        seg = p // sp
        a._seg_free[seg].back.append(p)
        a._seg_used[seg] -= 1
        a._ns_free[a.owner[seg]] += 1
        if not a._seg_used[seg]:
            emptied.add(seg)
    a._free_pages += len(pages)
    for seg in sorted(emptied, reverse=True):
        ns = a.owner[seg]
        a._ns_segments[ns].remove(seg)
        a._ns_free[ns] -= len(a._seg_free[seg])
        del a._ns_open[ns][seg]
        if not a._ns_segments[ns]:
            del a._ns_segments[ns], a._ns_free[ns], a._ns_open[ns]
        a.owner[seg] = None
        a._free_segments.append(seg)
        a._free_segment_pages += len(a._seg_free[seg])


def _state(a: SegmentedAllocator) -> tuple:
    return (bytes(a._state), [list(f) for f in a._seg_free], list(a._seg_used), list(a.owner),
            list(a._free_segments), a._free_segment_pages, a._free_pages,
            {ns: list(segs) for ns, segs in a._ns_segments.items()}, dict(a._ns_free),
            {ns: list(o) for ns, o in a._ns_open.items()})


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([7, 64, 1000]))
def test_grouped_free_leaves_the_state_a_page_by_page_free_leaves(data: st.DataObject,
                                                                 segment_pages: int) -> None:
    """Free lists in the same order, segments opened in the same order: the next allocations
    hand out the same ids as before the change."""
    fast = SegmentedAllocator(CAP, segment_pages)
    ref = SegmentedAllocator(CAP, segment_pages)
    held: list[int] = []
    for _ in range(data.draw(st.integers(3, 15), label="steps")):
        if held and data.draw(st.booleans(), label="free"):
            pages = array("i", _ids(data.draw, held, data.draw(LENGTHS)))
            if data.draw(st.booleans(), label="ascending"):  # as allocations hand them out:
                pages = array("i", sorted(pages))  # the parts are slices, no sort
            fast.free(pages)
            _reference_free(ref, pages)
            held = [p for p in held if p not in set(pages)]
        else:
            n = min(data.draw(LENGTHS), fast.available_to("a"))
            ns = data.draw(st.sampled_from(SPACES[:2]))
            n = min(n, fast.available_to(ns))
            got = fast.alloc(n, ns)
            assert got == ref.alloc(n, ns)
            held += list(got)
        assert _state(fast) == _state(ref)
        assert fast.audit() == []


def _reference_check(name: str, state: bytearray, pages: array) -> str | None:
    seen: set[int] = set()
    for p in pages:
        if not 0 < p < len(state):
            return f"{name}: page {p} is not a page of this pool (1..{len(state) - 1})"
        if state[p] != 1:
            return f"{name}: page {p} is not allocated (double free?)"
        if p in seen:
            return f"{name}: page {p} listed twice in one free"
        seen.add(p)
    return None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, CAP - 1), unique=True, min_size=VECTOR_MIN + 5),
       st.sampled_from(["ok", "dup", "zero", "negative", "beyond", "free page"]),
       st.integers(0, 10_000), st.booleans())
def test_long_free_lists_get_the_errors_of_the_page_by_page_check(used: list[int], fault: str,
                                                                 at: int, ascending: bool
                                                                 ) -> None:
    """``ascending``: the list sorted first, as allocations hand them out (a rising list needs
    no sort to rule out duplicates; a fault at either end can leave it rising)."""
    state = bytearray(CAP)
    state[0] = 1
    for p in used[1:]:
        state[p] = 1
    pages = sorted(used[1:]) if ascending else used[1:]
    i = at % len(pages)
    if fault == "dup":
        pages.insert(i, pages[(i + 1) % len(pages)])
    elif fault != "ok":
        pages[i] = {"zero": 0, "negative": -3, "beyond": CAP, "free page": used[0]}[fault]
    want = _reference_check("pool", state, array("i", pages))
    if want is None:
        check_allocated("pool", state, array("i", pages))
    else:
        with pytest.raises(AllocatorError) as e:
            check_allocated("pool", state, array("i", pages))
        assert str(e.value) == want


@pytest.mark.parametrize("n", [3, VECTOR_MIN + 20])
def test_misplaced_names_the_segments_of_another_namespace_in_short_and_long_lists(n: int
                                                                                    ) -> None:
    a = SegmentedAllocator(CAP, 50)
    mine = a.alloc(n, "a")
    theirs = a.alloc(5, "b")
    bad: set[int] = set()
    a.misplaced(mine, "a", bad)
    assert bad == set()
    mixed = array("i", list(mine[:-1]) + [theirs[2]])
    a.misplaced(mixed, "a", bad)
    assert bad == {theirs[2] // 50}
    bad.clear()
    a.misplaced(list(mixed), "a", bad)  # a list takes the other path
    assert bad == {theirs[2] // 50}


def _resident_mib() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


def test_a_page_table_is_resident_only_where_pages_are_held() -> None:
    before = _resident_mib()
    table = PageTable(50_000_000)  # 200 MB of holders
    assert _resident_mib() - before < 20
    held = HeldPages(table, 7)
    held.add("ns", array("i", [3, 49_999_999]))
    assert 3 in held and 49_999_999 in held and 4 not in held and len(held) == 2
    assert list(held) == [3, 49_999_999] and table.holder[3] == 7
    held.remove(array("i", [3]))
    assert 3 not in held and list(held) == [49_999_999]
