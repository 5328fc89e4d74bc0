"""FreePages (a pool's or a segment's free pages: those that came back, listed, and those never
handed out, one range) against the free stack it replaced, built whole: the same pages go out in
the same order, and its audit finds a page listed twice or handed out twice."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.gpu.allocator import FRESH_CHUNK, VECTOR_MIN, FreePages, PageAllocator, mark_free
from daemon.gpu.segments import SegmentedAllocator


class WholeStack:
    """The free list before FreePages: every free page listed from the start, popped from the
    end (low ids first), pages that came back pushed last first."""

    def __init__(self, start: int, stop: int) -> None:
        self.free = array("i", range(stop - 1, start - 1, -1))

    def take(self, k: int) -> array:
        got = self.free[len(self.free) - k:]
        del self.free[len(self.free) - k:]
        got.reverse()
        return got

    def put(self, pages: array) -> None:
        self.free.extend(pages[::-1])


@settings(max_examples=300, deadline=None)
@given(start=st.integers(1, 5),
       size=st.one_of(st.integers(0, 2 * VECTOR_MIN + 40), st.integers(0, 3 * FRESH_CHUNK)),
       steps=st.lists(st.tuples(st.booleans(),
                                st.one_of(st.integers(0, 2 * VECTOR_MIN),
                                          st.integers(FRESH_CHUNK - 8, FRESH_CHUNK + 8)),
                                st.randoms()),
                      max_size=40))
def test_pages_go_out_as_from_the_whole_stack(start: int, size: int, steps: list) -> None:
    stop = start + size
    fp, ref = FreePages(start, stop), WholeStack(start, stop)
    held: list[int] = []
    for take, k, rnd in steps:
        if take:
            k = min(k, len(fp))
            got = fp.take(k)
            assert got.typecode == "i" and got == ref.take(k)
            held += got
        elif held:
            rnd.shuffle(held)
            back = array("i", held[:k])
            if k >= 8:  # a node's run: what the tree gives back most
                back = array("i", sorted(back))
            del held[:k]
            fp.put(back)
            ref.put(back)
        assert len(fp) == len(ref.free)
        assert sorted(fp) == sorted(ref.free)
        assert sorted(set(fp) | set(held)) == list(range(start, stop))
        marks = bytearray(stop)
        assert not any(fp.mark_steps(marks))
        assert [p for p in range(stop) if marks[p]] == sorted(ref.free)


def test_a_fresh_pool_lists_nothing_and_a_free_lists_what_came_back() -> None:
    a = PageAllocator(1_000_000)
    assert a.available == 999_999 and a.free_list_bytes == 0
    got = a.alloc(5000)
    assert list(got) == list(range(1, 5001))
    a.free(got[:1000])
    assert a.available == 995_999 and a.free_list_bytes == 4 * 1000
    assert list(a.alloc(1001)) == [*range(1, 1001), 5001]
    s = SegmentedAllocator(1_000_000, 1000, "full pool")
    assert sum(f.listed_bytes for f in s._seg_free) == 0
    assert s.audit() == []


def test_the_audit_finds_a_page_that_came_back_listed_among_the_never_used() -> None:
    a = PageAllocator(FRESH_CHUNK + 16, "full pool")
    (p,) = a.alloc(1)  # a chunk of never-used pages moves onto the list
    a.free([p])
    assert a.audit() == [] and a._free.fresh == FRESH_CHUNK + 1
    a._free.back.append(a._free.fresh)  # would be handed out twice
    assert any("twice" in x for x in a.audit())
    b = PageAllocator(16, "full pool")
    b._free.fresh = 17  # past the pool
    assert any("never-used pages 17..16" in x for x in b.audit())
    s = SegmentedAllocator(16, 4, "swa pool")
    s._seg_free[1].fresh = 3  # into segment 0
    assert any("segment 1's never-used pages 3..8" in x for x in s.audit())


def _mark_free_page_by_page(marks: bytearray, pages: array) -> bool:
    twice = False
    for p in pages:
        if 0 <= p < len(marks):
            twice |= marks[p] == 1
            marks[p] = 1
    return twice


@settings(max_examples=200, deadline=None)
@given(n=st.integers(VECTOR_MIN, 3 * VECTOR_MIN), data=st.data())
def test_a_long_list_is_marked_as_page_by_page(n: int, data: st.DataObject) -> None:
    cap = 4 * VECTOR_MIN
    shape = data.draw(st.sampled_from(["rising", "falling", "scattered"]))
    ids = data.draw(st.lists(st.integers(-3, cap + 3), min_size=n, max_size=n,
                             unique=data.draw(st.booleans())))
    if shape != "scattered":
        ids.sort(reverse=shape == "falling")
    pre = data.draw(st.lists(st.integers(0, cap - 1), max_size=3))
    got, want = bytearray(cap), bytearray(cap)
    for p in pre:
        got[p] = want[p] = 1
    assert mark_free(got, array("i", ids)) == _mark_free_page_by_page(want, array("i", ids))
    assert got == want


def test_the_segment_audit_reads_long_lists_and_counts_in_bytes() -> None:
    s = SegmentedAllocator(3 * 5000, 5000, "full pool")
    got = s.alloc(9000, "a")
    s.free(got[:7000])
    assert s.audit() == []
    s._seg_free[0].back.append(5003)  # a page of segment 1 on segment 0's list, far down a list
    s._seg_free[0].back.reverse()  # of thousands
    assert any("segment 0's free list holds a page outside it (0..5000)" in x
               for x in s.audit())
    u = SegmentedAllocator(10, 4, "swa pool")  # a short last segment: pages 8 and 9
    u.alloc(9, "a")
    u._seg_free[2].back.append(10)  # past the pool's end (the old per-page test let it pass)
    assert any("segment 2's free list holds a page outside it (8..10)" in x for x in u.audit())
    t = SegmentedAllocator(3 * 5000, 5000, "full pool")
    t.alloc(6000, "a")
    t._state[12_000] = 1  # in use behind the allocator's back (segment 2, never used)
    v = t.audit()
    assert any("segment 2 counts 0 pages in use, 1 are" in x for x in v)
