"""The page-run codec (daemon/gpu/page_runs.py) against plain lists: what it keeps as runs, that
the runs read, slice and index as the list they stand for, and that joining gives back exactly
the ids, in order, as a new array."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from daemon.gpu.allocator import PageAllocator, as_page_array
from daemon.gpu.page_runs import (
    APPEND_MAX,
    IN_USE_MIN,
    IN_USE_RUNS,
    LISTED_ADMIT,
    LISTED_ENTRY_BYTES,
    RUN_MIN,
    PageRunList,
    PageRuns,
)
from daemon.gpu.segments import SegmentedAllocator
from daemon.tree import (
    CollectingSink,
    PlainPageIds,
    RadixTree,
    as_token_bytes,
    check_tree,
    concat_pages,
)


def test_one_rising_run_is_kept_as_a_range_and_lists_of_no_runs_as_given():
    c = PageRuns(4, 2)
    assert c.compact(array("i", [5, 6, 7, 8])) == range(5, 9)
    for ids in ([5, 6, 7], [8, 7, 6, 5], [5, 7, 6, 8], [5, 9, 6, 10]):
        a = array("i", ids)
        assert c.compact(a) is a, ids


def test_a_few_runs_are_kept_by_their_bounds():
    ids = [*range(10, 30), *range(50, 70), *range(31, 51)]
    kept = PageRuns(4, 16).compact(array("i", ids))
    assert type(kept) is PageRunList
    assert kept.starts.tolist() == [10, 50, 31] and kept.ends.tolist() == [20, 40, 60]
    assert list(kept) == ids and len(kept) == 60
    # runs shorter than ids_per_run on average: kept as the array
    a = array("i", ids)
    assert PageRuns(4, 21).compact(a) is a


def test_the_daemon_default_leaves_short_lists_alone():
    short = array("i", range(1, RUN_MIN))
    assert PageRuns().compact(short) is short
    assert PageRuns().compact(array("i", range(1, RUN_MIN + 1))) == range(1, RUN_MIN + 1)
    in_use = array("i", range(1, IN_USE_MIN))  # a node in use: arrays up to IN_USE_MIN ids
    assert PageRuns().in_use(in_use) is in_use
    assert PageRuns().in_use(array("i", range(1, IN_USE_MIN + 1))) == range(1, IN_USE_MIN + 1)


def test_bad_minimums_are_refused():
    with pytest.raises(ValueError, match="min_ids"):
        PageRuns(1)
    with pytest.raises(ValueError, match="ids_per_run"):
        PageRuns(4, 1)


runs_st = st.lists(st.tuples(st.integers(1, 2**31 - 300), st.integers(1, 40)), min_size=1,
                   max_size=6)


def _ids(runs: list[tuple[int, int]]) -> list[int]:
    return [p for s, n in runs for p in range(s, s + n)]


@given(runs_st, st.data())
def test_kept_runs_read_slice_and_index_as_their_list(runs, data):
    ids = _ids(runs)
    kept = PageRuns(2, 2).compact(array("i", ids))
    assert list(kept) == ids and len(kept) == len(ids)
    i = data.draw(st.integers(-len(ids), len(ids) - 1))
    assert kept[i] == ids[i]
    a = data.draw(st.integers(-len(ids) - 2, len(ids) + 2))
    b = data.draw(st.integers(-len(ids) - 2, len(ids) + 2))
    part = kept[a:b]
    assert list(part) == ids[a:b]
    if len(part) > 1:  # slices of slices, as splits of split nodes are
        assert list(part[1:-1]) == ids[a:b][1:-1]
        assert list(part[::2]) == ids[a:b][::2]
    for bad in (len(ids), -len(ids) - 1):
        with pytest.raises(IndexError):
            kept[bad]


@given(runs_st)
@example([(1, 1), (5, 1), (9, 1)])  # runs shorter than ids_per_run: kept as the array
@example([(1, 3), (7, 3), (20, 3), (30, 3), (40, 3)])  # more runs than IN_USE_RUNS
def test_a_node_in_use_keeps_a_run_or_a_few_and_they_list_back_exactly(runs):
    ids = _ids(runs)
    codec = PageRuns(2, 2, 2)
    kept = codec.in_use(array("i", ids))
    breaks = sum(b != a + 1 for a, b in zip(ids, ids[1:], strict=False))
    if len(ids) < 2 or breaks >= IN_USE_RUNS or 2 * (breaks + 1) > len(ids):  # 2: ids_per_run
        assert type(kept) is array
    else:
        assert type(kept) is (range if not breaks else PageRunList)
        assert codec.in_use(kept) is kept  # used again: kept as it is
    assert list(kept) == ids and codec.join([kept]).tolist() == ids
    many = codec.compact(array("i", ids))
    if type(many) is PageRunList and len(many.starts) > IN_USE_RUNS:
        back = codec.in_use(many)  # a cold list of many runs, used again
        assert type(back) is array and back.tolist() == ids


parts_st = st.lists(
    st.one_of(
        st.lists(st.integers(1, 2**31 - 1), max_size=20).map(lambda x: array("i", x)),
        st.tuples(st.integers(1, 2**31 - 200), st.integers(0, 150)).map(
            lambda t: range(t[0], t[0] + t[1])),
        runs_st.map(lambda r: PageRuns(2, 2).compact(array("i", _ids(r)))),
        # any other int sequence the codec protocol admits: listed as it is
        st.lists(st.integers(1, 2**31 - 1), max_size=20),
        st.tuples(st.integers(1, 10**6), st.integers(0, 40), st.integers(2, 5)).map(
            lambda t: range(t[0], t[0] + t[1] * t[2], t[2])),
    ),
    max_size=6,
)


def test_runs_that_follow_on_across_parts_are_listed_exactly():
    """A join lists runs that continue one another (pieces of one allocation, split into
    nodes) as one; arrays, empty runs and breaks in between end such a run."""
    codec = PageRuns(2, 2)
    few = codec.compact(array("i", [*range(9, 20), *range(40, 60)]))
    assert type(few) is PageRunList
    parts = [range(1, 5), range(5, 9), few, range(60, 70), array("i", [3]), range(70, 71),
             range(0), range(71, 80), range(200, 210), [5, 6], range(210, 211)]
    assert codec.join(parts).tolist() == [p for part in parts for p in part]


def test_a_long_join_lists_every_form_in_order():
    """Past APPEND_MAX ids a join fills one array in place: every form, in order."""
    codec = PageRuns(2, 2)
    many = codec.compact(array("i", [p for k in range(IN_USE_RUNS + 3)
                                     for p in range(100 * k + 1, 100 * k + 51)]))
    few = codec.compact(array("i", [*range(9001, 9101), *range(8001, 8101)]))
    assert type(many) is PageRunList and len(many.starts) > IN_USE_RUNS
    assert type(few) is PageRunList and len(few.starts) <= IN_USE_RUNS
    parts = [array("i", range(20001, 20101)), range(30001, 30001 + APPEND_MAX), few, many,
             range(0), array("i"), [7, 5, 3], range(60001, 60101, 3)]
    for join in (codec.join, codec.join_matched):
        got = join(parts)
        assert type(got) is array and got.tolist() == [p for part in parts for p in part]
        assert all(got is not part for part in parts)
    assert not codec.kept_listings  # a long list is filled in place: no listing is kept


def test_a_match_keeps_the_listings_of_its_runs_within_the_budget():
    """join_matched keeps each run's listing for the next match, by the run's bounds (whatever
    object holds them), up to LISTED_BYTES; once that is full, one new listing in LISTED_ADMIT
    replaces the oldest."""
    n = 1000
    cost = 4 * n + LISTED_ENTRY_BYTES
    codec = PageRuns(listed_bytes=2 * cost)
    runs = [range(1 + k * n, 1 + (k + 1) * n) for k in range(LISTED_ADMIT + 3)]
    assert codec.join_matched(runs[:1]).tolist() == list(runs[0])
    assert (len(codec.kept_listings), codec.listed_bytes) == (1, cost)
    again = range(runs[0].start, runs[0].stop)  # another object with the same bounds
    assert codec.join_matched([again, runs[1]]).tolist() == [*runs[0], *runs[1]]
    assert (len(codec.kept_listings), codec.listed_bytes) == (2, 2 * cost)
    for k in range(2, LISTED_ADMIT + 2):  # the budget is full: the 8th new run is kept
        assert codec.join_matched([runs[k]]).tolist() == list(runs[k])
        assert codec.listed_bytes == 2 * cost
        want = (runs[0], runs[1]) if k < LISTED_ADMIT + 1 else (runs[1], runs[k])
        assert codec.kept_listings == want  # (the 8th in place of the oldest)
    two = codec.compact(array("i", [*runs[-1], *range(90_001, 90_001 + n)]))
    assert type(two) is PageRunList  # a part of a few runs: each run listed alike
    assert codec.join_matched([two]).tolist() == list(two)
    assert codec.listed_bytes <= 2 * cost
    assert codec.join([runs[-1]]).tolist() == list(runs[-1])
    none = PageRuns(listed_bytes=0)
    assert none.join_matched(runs[:2]).tolist() == [*runs[0], *runs[1]]
    assert (len(none.kept_listings), none.listed_bytes) == (0, 0)
    with pytest.raises(ValueError, match="listed_bytes"):
        PageRuns(listed_bytes=-1)


@given(parts_st)
def test_join_lists_every_id_in_order_in_a_new_array(parts):
    want = [p for part in parts for p in part]
    # (a budget of a few hundred bytes keeps a listing or two and drops them again)
    for codec in (PageRuns(2), PageRuns(2, listed_bytes=600), PlainPageIds()):
        for join in (codec.join, codec.join_matched, codec.join_matched):
            got = join(parts)
            assert isinstance(got, array) and got.typecode == "i"
            assert got.tolist() == want
            assert all(got is not p for p in parts)
    assert concat_pages(parts).tolist() == want
    for p in parts:
        assert as_page_array(p).tolist() == list(p)


@given(st.lists(st.integers(1, 10_000), min_size=2, max_size=300, unique=True))
def test_compact_never_changes_the_ids(ids):
    kept = PageRuns(2, 2).compact(array("i", ids))
    assert list(kept) == ids
    assert (type(kept) is range) == (ids == list(range(ids[0], ids[0] + len(ids))))


def test_runs_freed_to_an_allocator_free_exactly_their_pages():
    alloc = PageAllocator(600)
    got = alloc.alloc(500)
    run = PageRuns().compact(got)
    assert type(run) is range  # a fresh allocator hands out one ascending run
    alloc.free(run[:300])
    assert alloc.available == 99 + 300
    alloc.free(run[300:])
    assert alloc.available == 599 and alloc.audit() == []
    # the last run freed is handed out first, ascending again
    assert alloc.alloc(200).tolist() == list(run[300:])
    runs = PageRuns(2, 2).compact(array("i", [*range(401, 501), *range(301, 401)]))
    assert type(runs) is PageRunList
    alloc.free(runs)
    assert alloc.available == 599 and alloc.audit() == []
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(runs[50:150])  # a double free of runs is refused as any other


def test_a_segment_check_of_runs_names_the_segments_they_touch():
    a = SegmentedAllocator(64, 8, "full pool")
    got = a.alloc(20, "t1")
    bad: set[int] = set()
    a.misplaced(PageRuns(2, 2).compact(got), "t2", bad)
    assert bad == {p // 8 for p in got}
    a.misplaced(range(0), "t2", bad)  # nothing named, nothing added
    assert bad == {p // 8 for p in got}


def _tree(min_ids: int = 2) -> RadixTree:
    tree = RadixTree(1, 2, CollectingSink(), policy="lru",
                     page_ids=PageRuns(min_ids, 2, min_ids))
    tree.compact_after = 0
    return tree


def test_a_node_keeps_a_run_or_a_few_from_its_insert_and_many_runs_go_back_to_an_array():
    """A node in use keeps what a match lists cheaply: one run as a range and up to
    IN_USE_RUNS runs by their bounds from the insert on; a list of more runs stays an array,
    goes to runs once cold, and back to an array when the node is used again."""
    tree = _tree()
    runs = IN_USE_RUNS + 1
    toks = as_token_bytes(range(1, 2 * runs + 1))
    full = array("i", [p for k in range(runs) for p in (4 * k + 1, 4 * k + 2)])  # runs of two
    swa = array("i", range(101, 101 + 2 * runs))  # one run
    tree.insert("ns", toks, full, swa)
    node = next(n for n in tree.iter_nodes() if n.parent is not None)
    assert type(node.full) is array and node.swa == range(101, 101 + 2 * runs)
    assert tree.compact_cold(8, 8) == 1
    assert type(node.full) is PageRunList and len(node.full.starts) == runs
    assert tree.stats["expanded_nodes"] == 0
    few = array("i", [40, 41, 42, 60, 61, 62])  # two runs
    few_toks = as_token_bytes(range(50, 56))
    tree.insert("ns", few_toks, few, array("i", range(140, 146)))  # the clock moves
    other = tree.match("ns", few_toks)
    assert other.full_pages.tolist() == few.tolist()
    assert type(tree.nodes[other.node_id].full) is PageRunList
    m = tree.match("ns", toks)  # touches the first node: its five runs go back to an array
    assert m.full_pages.tolist() == full.tolist() and m.swa_pages.tolist() == swa[-2:].tolist()
    assert type(node.full) is array and type(node.swa) is range
    assert tree.stats["expanded_nodes"] == 1 and check_tree(tree) == []


def test_host_slot_ids_are_kept_as_runs_and_read_back_exactly():
    """A node's host slot ids go to the codec when they are set, hot or cold, and stay compact
    when the node is used (only a load and the tiers read them); a split cuts them, a load plan
    lists them in order once the device copy is evicted, and a host eviction gives back exactly
    those slots."""
    sink = CollectingSink()
    tree = RadixTree(1, None, sink, host_sink=sink, policy="lru",
                     page_ids=PageRuns(2, 2, 2))
    tree.compact_after = 0
    toks = as_token_bytes(range(1, 9))
    tree.insert("ns", toks, array("i", range(1, 9)), array("i"))
    node = next(n for n in tree.iter_nodes() if n.parent is not None)
    tree.set_host(node.id, array("i", [*range(201, 205), *range(301, 305)]))  # two runs
    assert type(node.full) is range and type(node.host) is PageRunList
    tree.insert("ns", as_token_bytes(range(50, 54)), array("i", [40, 41, 42, 43]),
                array("i"))  # the clock moves: the next match touches
    assert tree.match("ns", toks).full_pages.tolist() == list(range(1, 9))
    assert type(node.full) is range and type(node.host) is PageRunList
    assert check_tree(tree) == []
    # a sequence that leaves the first after 6 tokens splits it inside the second run
    tree.insert("ns", toks[: 6 * 4] + as_token_bytes([77, 78]), array("i", [9, 10]),
                array("i"), prev_prefix_len=6)
    up = node.parent
    assert list(up.host) == [201, 202, 203, 204, 301, 302] and list(node.host) == [303, 304]
    assert type(up.host) is PageRunList and type(node.host) is range
    assert check_tree(tree) == []
    # every device copy goes: the two nodes with host copies stay, on host only
    tree.evict(full_pages=tree.full_evictable)
    assert node.full is None and up.full is None
    assert type(up.host) is PageRunList and type(node.host) is range
    plan = tree.plan_load("ns", toks, 0)
    assert plan is not None
    assert [slot for _, slot in plan.full] == [201, 202, 203, 204, 301, 302, 303, 304]
    assert [i for i, _ in plan.full] == list(range(8))
    assert check_tree(tree) == []
    res = tree.evict_host(8)
    assert res.host_slots == 8
    assert sorted(sink.host) == [201, 202, 203, 204, 301, 302, 303, 304]
    assert tree.host_pages == 0 and check_tree(tree) == []
