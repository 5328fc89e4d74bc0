"""SegmentedAllocator against a reference model: pages of a namespace come only from its
segments, empty segments go back to the free list, and a segment changes namespace only from
there, renewed (zeroed) on the way."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from daemon.gpu.allocator import AllocatorError, OutOfPages
from daemon.gpu.segments import PairedSegmentAllocator, SegmentedAllocator

NAMESPACES = ("a", "b", "c")


class SegmentMachine(RuleBasedStateMachine):
    """The reference: which pages each namespace holds; the rest follows from it."""

    def __init__(self) -> None:
        super().__init__()
        self.renewed: list[int] = []
        self.cap, self.seg = 23, 4  # a short last segment, and page 0 in segment 0
        self.a = SegmentedAllocator(self.cap, self.seg, "full pool", self.renewed.append)
        self.held: dict[str, set[int]] = {ns: set() for ns in NAMESPACES}
        self.last: dict[int, str] = {}  # segment -> the namespace it served last

    def _owner_ref(self) -> dict[int, str]:
        return {p // self.seg: ns for ns, ps in self.held.items() for p in ps}

    @rule(ns=st.sampled_from(NAMESPACES), n=st.integers(0, 9))
    def alloc(self, ns: str, n: int) -> None:
        owners = self._owner_ref()
        room = sum(1 for p in range(1, self.cap)
                   if owners.get(p // self.seg, ns) == ns and all(
                       p not in h for h in self.held.values()))
        if n > room:
            with pytest.raises(OutOfPages):
                self.a.alloc(n, ns)
            return
        before = list(self.renewed)
        got = self.a.alloc(n, ns)
        assert len(got) == n and len(set(got)) == n
        for p in got:
            assert owners.get(p // self.seg, ns) == ns, "a page of another namespace's segment"
            assert all(p not in h for h in self.held.values())
        taken = {p // self.seg for p in got} - set(owners)
        # a segment is renewed exactly when it goes to a namespace other than its last one
        assert sorted(self.renewed[len(before):]) == sorted(
            s for s in taken if self.last.get(s, ns) != ns)
        for s in taken:
            self.last[s] = ns
        self.held[ns].update(got)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ns = data.draw(st.sampled_from([n for n in NAMESPACES if self.held[n]]))
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held[ns])), unique=True,
                                   min_size=1))
        self.a.free(array("i", pages))
        self.held[ns].difference_update(pages)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def free_run(self, data: st.DataObject) -> None:
        """A node's run comes back as a ``range`` (checked and marked a slice at a time, split
        by segment arithmetic), maybe across segments."""
        ns = data.draw(st.sampled_from([n for n in NAMESPACES if self.held[n]]))
        start = data.draw(st.sampled_from(sorted(self.held[ns])))
        stop = start + 1
        while stop in self.held[ns] and data.draw(st.booleans()):
            stop += 1
        self.a.free(range(start, stop))
        self.held[ns].difference_update(range(start, stop))

    @rule(start=st.integers(-2, 25), stop=st.integers(-3, 27))
    def bad_run_free_changes_nothing(self, start: int, stop: int) -> None:
        run = range(start, stop)  # (empty ones too, whose stop is negative)
        held = set().union(*self.held.values())
        if run and all(p in held for p in run):
            return
        before = self.a.free_set()
        if not run:
            self.a.free(run)  # nothing to free: nothing changes
        else:
            with pytest.raises(AllocatorError):
                self.a.free(run)
        assert self.a.free_set() == before

    @rule(p=st.integers(-2, 25))
    def bad_free_changes_nothing(self, p: int) -> None:
        if any(p in h for h in self.held.values()):
            return
        before = self.a.free_set()
        with pytest.raises(AllocatorError):
            self.a.free([p])
        assert self.a.free_set() == before

    @invariant()
    def agrees(self) -> None:
        assert self.a.audit() == []
        owners = self._owner_ref()
        for s in range(self.a.num_segments):
            assert self.a.owner[s] == owners.get(s), f"segment {s}"
        for ns, ps in self.held.items():
            bad: set[int] = set()
            self.a.misplaced(ps, ns, bad)
            assert self.a.audit_owners(ns, "pages", bad) == []
            assert set(self.a.segments_of(ns)) == {p // self.seg for p in ps}
        assert self.a.available == self.cap - 1 - sum(len(h) for h in self.held.values())


TestSegments = SegmentMachine.TestCase
TestSegments.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_one_segment_is_the_single_shared_pool() -> None:
    a = SegmentedAllocator(8, 100)
    assert a.num_segments == 1
    got = a.alloc(7, "")
    assert sorted(got) == list(range(1, 8))
    with pytest.raises(OutOfPages):
        a.alloc(1, "")
    a.free(got)
    assert a.audit() == [] and a.available == 7


def test_memory_isolation_auto_means_segments_on_the_cpu_and_none_on_cuda() -> None:
    from daemon.gpu.segments import effective_isolation

    assert effective_isolation("auto", "cpu") == "segments"
    assert effective_isolation("auto", "cuda:0") == "none"
    assert effective_isolation("none", "cpu") == "none"
    assert effective_isolation("segments", "cpu") == "segments"
    with pytest.raises(ValueError, match='"segments" is built for CPU pools only'):
        effective_isolation("segments", "cuda")
    with pytest.raises(ValueError, match="is not one of"):
        effective_isolation("isolated", "cpu")


class _NoFreshMemory:
    """An ``on_assign`` that fails on its ``fail_at``-th call, as a memfd_create (EMFILE, ENOMEM)
    or a cudaHostRegister can: a fault no real part produces on demand."""

    def __init__(self, fail_at: int) -> None:
        self.calls = 0
        self.fail_at = fail_at

    def __call__(self, seg: int) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError(24, "Too many open files")


def test_a_segment_that_cannot_get_fresh_memory_stays_free_and_nothing_leaks() -> None:
    fault = _NoFreshMemory(fail_at=2)
    a = SegmentedAllocator(9, 2, "full pool", fault)
    pages = a.alloc(8, "a")  # every segment, then all back: free, last served by "a"
    a.free(pages)
    assert a.free_segment_count == 5 and a.audit() == []
    with pytest.raises(OSError):
        a.alloc(6, "b")  # the second segment it moves fails: the first one's pages go back
    assert a.audit() == []
    assert a.free_segment_count == 5 and a.available_to("b") == 8 and a.segments_of("b") == []
    got = a.alloc(8, "b")  # the pool is whole: the next alloc gets all of it
    assert sorted(got) == list(range(1, 9)) and a.audit() == []


def test_a_paired_allocation_whose_swa_segment_cannot_get_fresh_memory_takes_nothing() -> None:
    """Full and SWA pages are taken together or not at all: when the SWA pool's segment cannot
    get fresh memory, the full pages already taken go back (they were lost before)."""
    failing = _NoFreshMemory(fail_at=1)
    a = PairedSegmentAllocator(65, 65, 16, lambda kind, seg: failing(seg) if kind == "swa"
                               else None)
    full, swa = a.alloc(60, "x")  # every segment of both pools served "x" last
    a.free_full(full)
    a.free_swa(swa)
    failing.calls = 0  # the next segment the SWA pool moves to another namespace fails
    with pytest.raises(OSError):
        a.alloc(20, "y")
    assert a.full.available == a.full.usable and a.swa.available == a.swa.usable
    assert a.full.audit() == [] and a.swa.audit() == []
    assert a.full.segments_of("y") == [] and a.swa.segments_of("y") == []
    full, swa = a.alloc(20, "y")  # and the pool is whole for the next try
    assert len(full) == len(swa) == 20


def _runs(pages: array) -> int:
    """Runs of consecutive ascending ids in ``pages``."""
    return sum(1 for i, p in enumerate(pages) if i == 0 or p != pages[i - 1] + 1)


def test_a_run_freed_in_order_comes_back_in_order() -> None:
    """Copies move a run of consecutive slots as one block: a run that came back reversed after
    churn (as it did when a free pushed it as given) made every page of a copy its own block."""
    a = SegmentedAllocator(1000, 1000)
    first = a.alloc(150, "ns")
    assert list(first) == list(range(1, 151))
    a.free(first[:70])
    a.free(first[70:])
    # last freed, first handed out again: two ascending runs, not 150 descending steps
    assert list(a.alloc(80, "ns")) == list(range(71, 151))
    assert list(a.alloc(70, "ns")) == list(range(1, 71))
    assert a.audit() == []


def test_runs_survive_churn_over_segments() -> None:
    """The same over segments of 64 pages: whatever order the segments come back in, each
    one's pages come back as one ascending run."""
    a = SegmentedAllocator(1000, 64)
    held = [a.alloc(100, "ns") for _ in range(6)]
    for pages in held[::2]:
        a.free(pages)
    again = a.alloc(300, "ns")
    assert len(set(again)) == 300
    # a run per freed block (and the open segment's rest), split at segment edges
    assert _runs(again) <= 4 + 300 // 64 + 1
    assert a.audit() == []


def test_runs_freed_apart_but_adjacent_come_back_as_one() -> None:
    """Two nodes' runs, freed by two calls, are next to each other in the pool: an allocation
    that takes both hands them out as one ascending run (one copy block, not two)."""
    a = SegmentedAllocator(1000, 1000)
    first = a.alloc(300, "ns")
    a.free(first[:150])
    a.free(first[150:])
    assert list(a.alloc(300, "ns")) == list(range(1, 301))
    assert a.audit() == []
