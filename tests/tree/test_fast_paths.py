"""The insert path's fast paths agree with the plain code they replace: the byte scans of page ids
with min()/max() and with a loop (the next 0, the next id that is not), the run scan of long id
lists with min() and a set, block_hashes with the per-block chain written out, a trusted insert
with a checked one, and no insert result shares an array with the tree."""

from __future__ import annotations

import hashlib
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.gpu.page_runs import RUN_MIN, VERDICT_RUNS, VERDICT_RUNS_MIN, PageRuns
from daemon.tree import (
    BadArgument,
    CollectingSink,
    PlainPageIds,
    RadixTree,
    block_hashes,
    check_tree,
)
from daemon.tree.id_checks import (
    RUNS_MIN,
    all_page_ids,
    all_zero,
    distinct_ids,
    distinct_nonzero,
    id_spans,
    next_nonzero,
    next_zero,
    page_id_verdict,
)
from daemon.tree.page_ids import LeadingZeros, host_swa_ids, nonzero, nonzero_count

from .helpers import NS, Ids, make_tree, seq

INT32 = st.integers(-(2**31), 2**31 - 1)
# ids whose bytes make zero runs across word boundaries (0x100, 0x10000, 0x1000000 multiples)
EDGY = st.sampled_from([0, 1, -1, 255, 256, 65535, 65536, 2**24, 2**24 - 1, 2**31 - 1, -(2**31),
                        0x01000000, 0x00010000, 0x00000100, 0x7F000000, 0x80])
IDS = st.lists(st.one_of(INT32, EDGY), min_size=1, max_size=64)


@given(IDS)
def test_all_page_ids_is_min_above_zero(ids: list[int]) -> None:
    assert all_page_ids(array("i", ids)) == (min(ids) > 0)
    assert all_page_ids(ids) == (min(ids) > 0)  # not an array('i'): the plain path


@given(st.lists(st.one_of(st.just(0), INT32, EDGY), min_size=1, max_size=64))
def test_all_zero_is_min_and_max_zero(ids: list[int]) -> None:
    assert all_zero(array("i", ids)) == (min(ids) == 0 == max(ids))
    assert all_zero(ids) == (min(ids) == 0 == max(ids))


def _int32(v: int) -> int:
    return (v + 2**31) % 2**32 - 2**31


# starts of runs next to where a byte of the ids carries into the next (and around 0 and the
# sign bit), where a run's upper bytes change
EDGES = st.sampled_from([1, 256, 512, 65536, 131072, 2**24, 2**24 + 65536, 2**31 - 1, 2**32 - 1])


@st.composite
def id_lists(draw: st.DrawFn) -> list[int]:
    """Long lists of ids made the way allocators hand them out (runs, ascending or descending,
    some single ids), then maybe spoiled: an id repeated, moved on by one byte's carry, or made
    0 or negative."""
    ids: list[int] = []
    for _ in range(draw(st.integers(1, 4))):
        start = draw(st.one_of(EDGES.flatmap(lambda e: st.integers(e - 300, e + 300)),
                               st.integers(1, 2**31 - 1), INT32))
        length = draw(st.sampled_from([1000, 3000, 600, 300, 17, 16, 15, 2, 1]))
        step = draw(st.sampled_from([1, -1]))
        ids += [_int32(start + step * t) for t in range(length)]
    for _ in range(draw(st.sampled_from([0, 1, 2]))):
        i = draw(st.integers(0, len(ids) - 1))
        how = draw(st.sampled_from(["repeat", "carry", "zero", "negative"]))
        if how == "repeat":
            ids[i] = ids[draw(st.integers(0, len(ids) - 1))]
        elif how == "carry":
            ids[i] = _int32(ids[i] + draw(st.sampled_from([256, -256, 65536, 2**24])))
        else:
            ids[i] = 0 if how == "zero" else -draw(st.integers(1, 2**31))
    return ids


def _plain_verdict(ids: list[int]) -> tuple[bool, bool]:
    positive = min(ids) > 0
    return positive, positive and len(set(ids)) == len(ids)


@settings(max_examples=500, deadline=None)
@given(id_lists())
def test_run_scan_gives_the_plain_verdicts(ids: list[int]) -> None:
    arr = array("i", ids)
    assert page_id_verdict(arr) == _plain_verdict(ids) == page_id_verdict(ids)
    for codec in (PlainPageIds(), PageRuns()):  # what the tree asks (its insert's checks)
        assert codec.id_verdict(arr) == _plain_verdict(ids) == codec.id_verdict(ids)
    assert distinct_ids(arr) == (len(set(ids)) == len(ids)) == distinct_ids(ids)
    live = [p for p in ids if p]
    assert distinct_nonzero(arr) == (len(set(live)) == len(live)) == distinct_nonzero(ids)
    spans = id_spans(arr)
    if spans is not None:  # the intervals hold exactly the ids (as unsigned 32-bit words)
        assert len(ids) >= RUNS_MIN
        assert sorted(v for lo, hi in spans for v in range(lo, hi + 1)) == sorted(
            p % 2**32 for p in ids)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 700), id_lists())
def test_distinct_nonzero_with_leading_zeros(zeros: int, ids: list[int]) -> None:
    arr = array("i", [0] * zeros + ids)
    live = [p for p in ids if p]
    assert distinct_nonzero(arr) == (len(set(live)) == len(live))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2**31 - 5000), st.integers(1, 1200)), min_size=1,
                max_size=VERDICT_RUNS + 4),
       st.sampled_from(["as is", "repeat", "overlap", "zero", "negative", "shuffle"]),
       st.data())
def test_the_vector_verdict_of_ascending_runs(runs: list[tuple[int, int]], how: str,
                                              data: st.DataObject) -> None:
    """PageRuns' verdict over the lists allocators hand out (ascending runs, around the number
    of runs where it sorts instead), spoiled in the ways that must be refused."""
    ids = [p for lo, n in runs for p in range(lo, lo + n)]
    i = data.draw(st.integers(0, len(ids) - 1))
    if how == "repeat":
        ids[i] = ids[data.draw(st.integers(0, len(ids) - 1))]
    elif how == "overlap":  # a run that starts inside another
        ids += range(ids[i], ids[i] + data.draw(st.integers(1, 40)))
    elif how in ("zero", "negative"):
        ids[i] = 0 if how == "zero" else -data.draw(st.integers(1, 2**31))
    elif how == "shuffle":
        ids = data.draw(st.permutations(ids))
    assert PageRuns().id_verdict(array("i", ids)) == _plain_verdict(ids)


def test_the_vector_verdict_takes_each_way() -> None:
    """One run (long, short), a few, many and shorter lists (sorted), and short lists (min and a
    set), each right and wrong."""
    codec = PageRuns()
    one = list(range(9, 9 + VERDICT_RUNS_MIN + 5))
    short_run = list(range(70_000, 70_000 + RUN_MIN))
    few = list(range(5_000, 5_300)) + list(range(100, 400)) + list(range(9_000, 9_300))
    many = [p for k in range(VERDICT_RUNS + 1) for p in range(1000 * k + 1, 1000 * k + 9)]
    sorted_ = list(range(VERDICT_RUNS_MIN - 1, 0, -1))
    short = list(range(RUN_MIN - 1, 0, -1))
    for ids in (one, short_run, few, many, sorted_, short):
        assert codec.id_verdict(array("i", ids)) == (True, True)
        assert codec.id_verdict(array("i", ids + ids[-1:])) == (True, False)
        assert codec.id_verdict(array("i", [*ids, 0])) == (False, False)
        assert codec.id_verdict(array("i", [-5, *ids])) == (False, False)
    assert codec.id_verdict(array("i", few[:-1] + [150])) == (True, False)  # inside a run
    assert codec.id_verdict(array("q", one)) == (True, True)  # not int32: the plain way


def test_run_scan_reads_allocator_runs() -> None:
    """The lists allocators hand out take the run scan, not the plain checks."""
    runs = [range(70_000, 71_500), range(5_000, 3_000, -1), range(2**31 - 600, 2**31)]
    ids = array("i", [p for r in runs for p in r])
    assert id_spans(ids) == sorted((min(r), max(r)) for r in runs)
    assert page_id_verdict(ids) == (True, True)
    ids[2000] = ids[10]
    assert page_id_verdict(ids) == (True, False)
    ids[2000] = 0
    assert page_id_verdict(ids) == (False, False)


def _chain(prev: bytes, carry: bytes, tokens: bytes, block_bytes: int) -> bytes:
    data = carry + tokens
    out = b""
    for off in range(0, len(data) - block_bytes + 1, block_bytes):
        prev = hashlib.sha256(prev + data[off : off + block_bytes]).digest()
        out += prev
    return out


@given(st.binary(min_size=32, max_size=32), st.integers(1, 8), st.integers(0, 7),
       st.binary(max_size=200))
def test_block_hashes_is_the_chain(prev: bytes, block_words: int, carry_words: int,
                                   raw: bytes) -> None:
    bb = 4 * block_words
    carry = bytes(range(4 * (carry_words % block_words)))
    tokens = raw[: len(raw) - len(raw) % 4]
    assert block_hashes(prev, carry, tokens, bb) == _chain(prev, carry, tokens, bb)


def _state(tree) -> list:
    return sorted((n.id, n.tokens, n.hashes, None if n.full is None else n.full.tolist(),
                   None if n.swa is None else n.swa.tolist(), n.ts, n.swa_ts, n.hits)
                  for n in tree.iter_nodes())


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 4]), st.data())
def test_trusted_insert_equals_checked_insert(P: int, data: st.DataObject) -> None:
    """The same valid inserts into two trees, one trusted and one checked: the same results,
    trees and freed pages; scribbling over a result changes neither tree."""
    trees = [make_tree(P, window_pages=3) for _ in range(2)]
    ids = [Ids(), Ids()]
    for _ in range(data.draw(st.integers(1, 6))):
        labels = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=40))
        toks = seq(P, labels)
        n = len(labels)
        frontier = data.draw(st.integers(0, n + 1)) * P
        results = []
        for (tree, sink), own, trusted in zip(trees, ids, (True, False), strict=True):
            m = tree.match(NS, toks, lock=True)
            prev = m.prefix_len // P
            f = min(frontier // P, n)
            zeros = max(0, f - prev)
            res = tree.insert(NS, toks, own.full(n - prev), own.swa(n - prev, zeros),
                              prev * P, frontier, trusted=trusted)
            tree.unlock(m.receipt)
            results.append((res.prefix_len, res.inserted_len, res.full_pages.tolist(),
                            res.swa_pages.tolist(), res.node_id, list(sink.full),
                            list(sink.swa)))
            before = _state(tree)
            for a in (res.full_pages, res.swa_pages):
                for j in range(len(a)):
                    a[j] = -7
            assert _state(tree) == before
            assert check_tree(tree) == []
        assert results[0] == results[1]
        assert _state(trees[0][0]) == _state(trees[1][0])


@pytest.mark.parametrize("P", [1, 4])
@pytest.mark.parametrize("bad", [0, -3, 0x01000000 * -1])
def test_checked_insert_still_refuses_bad_ids(P: int, bad: int) -> None:
    tree, _ = make_tree(P)
    toks = seq(P, [1, 2, 3, 4])
    full = array("i", [5, 6, bad, 8])
    with pytest.raises(BadArgument, match="full_pages must be distinct page ids > 0"):
        tree.insert(NS, toks, full, array("i", [1, 2, 3, 4]))
    with pytest.raises(BadArgument, match=r"swa_pages\[2\] must be a page id"):
        tree.insert(NS, toks, array("i", [1, 2, 3, 4]), full)
    with pytest.raises(BadArgument, match=r"swa_pages\[1\] must be 0"):
        tree.insert(NS, toks, array("i", [1, 2, 3, 4]), array("i", [0, 5, 6, 7]),
                    swa_evicted_len=2 * P)
    assert check_tree(tree) == []


@pytest.mark.parametrize("codec", [PlainPageIds, PageRuns])
@pytest.mark.parametrize("P", [1, 4])
def test_long_id_lists_are_refused_with_the_same_messages(P: int, codec: type) -> None:
    """Lists long enough for the run scan (or the daemon's codec's numpy): a repeated or a bad
    id is refused as before."""
    tree = RadixTree(P, 2 * P, CollectingSink(), policy="lru", page_ids=codec())
    n = 2 * RUNS_MIN
    toks = seq(P, list(range(1, n + 1)))
    good = array("i", range(n, 0, -1))
    dup = array("i", good)
    dup[n - 1] = dup[0]
    bad = array("i", good)
    bad[7] = -bad[7]
    with pytest.raises(BadArgument, match="full_pages must be distinct page ids > 0"):
        tree.insert(NS, toks, dup, good)
    with pytest.raises(BadArgument, match="full_pages must be distinct page ids > 0"):
        tree.insert(NS, toks, bad, good)
    with pytest.raises(BadArgument, match="swa_pages must be distinct page ids"):
        tree.insert(NS, toks, good, dup)
    with pytest.raises(BadArgument, match=r"swa_pages\[7\] must be a page id"):
        tree.insert(NS, toks, good, bad)
    with pytest.raises(BadArgument, match="^full_pages must be distinct page ids$"):
        tree.cache_finished(NS, toks, dup, good, 0, 0, None)
    with pytest.raises(BadArgument, match="swa_pages must be distinct page ids"):
        tree.cache_finished(NS, toks, good, dup, 0, 0, None)
    assert check_tree(tree) == []
    res = tree.insert(NS, toks, good, array("i", good))
    assert res.inserted_len == n * P
    assert check_tree(tree) == []


@given(st.integers(0, 400), st.lists(st.one_of(st.just(0), st.one_of(INT32, EDGY)), max_size=48),
       st.integers(0, 450), st.integers(0, 450))
def test_next_zero_and_next_nonzero_are_the_plain_scans(zeros: int, tail: list[int], a: int,
                                                        b: int) -> None:
    """(Leading zeros long enough for next_nonzero's doubling pieces.)"""
    ids = [0] * zeros + tail
    a, b = min(a, len(ids)), min(max(a, b), len(ids))
    arr = array("i", ids)
    want = (next((i for i in range(a, b) if ids[i] == 0), b),
            next((i for i in range(a, b) if ids[i] != 0), b))
    assert (next_zero(arr, a, b), next_nonzero(arr, a, b)) == want
    kept = host_swa_ids(array("i", ids), 1)  # the same list without its leading zeros
    if kept is not None:
        assert (next_zero(kept, a, b), next_nonzero(kept, a, b)) == want


@settings(max_examples=300)
@given(st.integers(0, 300), st.lists(st.one_of(st.just(0), INT32), max_size=40),
       st.sampled_from([1, 2, 32, 10**9]), st.integers(-350, 350), st.integers(-350, 350))
def test_host_swa_ids_are_the_list_without_leading_zeros(zeros: int, tail: list[int],
                                                         lead_min: int, a: int, b: int) -> None:
    """What a node keeps reads back as the list it was given: items, slices (again kept so),
    bytes, counts, the ids that are not 0; an all-zero list is None."""
    ids = [0] * zeros + tail
    kept = host_swa_ids(array("i", ids), lead_min)
    if not any(ids):
        assert kept is None
        return
    assert kept is not None and len(kept) == len(ids) and list(kept) == ids
    assert type(kept) is (LeadingZeros if ids.index(next(p for p in ids if p)) >= lead_min
                          else array)
    assert kept.tobytes() == array("i", ids).tobytes()
    assert kept.count(0) == ids.count(0) and nonzero_count(kept) == len(ids) - ids.count(0)
    assert list(nonzero(kept)) == [p for p in ids if p]
    assert list(kept[a:b]) == ids[a:b] and list(kept[a:]) == ids[a:]
    assert type(kept[a:b]) is type(kept)
    for i in (a, b, 0, len(ids) - 1):
        if -len(ids) <= i < len(ids):
            assert kept[i] == ids[i]
        else:
            with pytest.raises(IndexError):
                kept[i]
    again = host_swa_ids(kept[a:b], lead_min)
    assert (None if again is None else list(again)) == (ids[a:b] if any(ids[a:b]) else None)


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("gap", [1, 63, 64, 65, 191, 192, 193, 447, 448, 449])
def test_next_nonzero_finds_an_id_at_the_edges_of_its_pieces(start: int, gap: int) -> None:
    """next_nonzero reads zeros in pieces of 64, 128, 256... ids from ``start``: an id just
    before, at and after the end of each is found."""
    ids = array("i", bytes(4 * (start + gap))) + array("i", [2**24, 0, 7])
    assert next_nonzero(ids, start, len(ids)) == start + gap
    assert next_nonzero(ids, start, start + gap) == start + gap  # none before stop
