"""PageAllocator / PairedAllocator: page 0 reserved, refused frees change nothing, audits."""

from __future__ import annotations

from array import array

import pytest

from daemon.gpu.allocator import AllocatorError, OutOfPages, PageAllocator, PairedAllocator


def state(a: PageAllocator) -> tuple[list[int], bytes]:
    return sorted(a._free), bytes(a._state)


def test_page_zero_is_never_handed_out():
    a = PageAllocator(8, "full pool")
    assert a.available == a.usable == 7
    got = list(a.alloc(3)) + list(a.alloc(4))
    assert sorted(got) == list(range(1, 8)) and 0 not in got
    assert a.available == 0
    a.free(got)
    again = list(a.alloc(7))
    assert 0 not in again and sorted(again) == list(range(1, 8))
    with pytest.raises(AllocatorError):
        a.free([0])
    assert a.audit() == []


def test_alloc_zero_and_negative():
    a = PageAllocator(4)
    assert len(a.alloc(0)) == 0 and a.available == 3
    with pytest.raises(ValueError):
        a.alloc(-1)
    assert a.available == 3 and a.audit() == []


def test_capacity_must_leave_room_for_the_padding_page():
    with pytest.raises(ValueError):
        PageAllocator(0)
    a = PageAllocator(1)
    assert a.usable == 0 and a.available == 0
    with pytest.raises(OutOfPages):
        a.alloc(1)


def test_double_free_is_refused():
    a = PageAllocator(8)
    p, q = a.alloc(2)
    a.free([p])
    before = state(a)
    with pytest.raises(AllocatorError, match="not allocated"):
        a.free([p])
    assert state(a) == before and a.audit() == []


def test_a_run_frees_as_a_range_and_a_bad_run_frees_nothing():
    """A node's run comes back as a ``range``: checked by counting its state bytes, marked as a
    slice, listed onto the free list in order; a run with a page not allocated (double free,
    the padding page, past the pool) is refused naming that page, and nothing changes."""
    a = PageAllocator(300)
    got = a.alloc(200)
    assert got.tolist() == list(range(1, 201))
    a.free(range(51, 151))
    assert a.available == 199 and a.audit() == []
    assert a.alloc(100).tolist() == list(range(51, 151))  # back in the order they went out
    a.free(range(120, 151))
    before = state(a)
    for bad, page in ((range(100, 130), 120), (range(0, 5), 0), (range(190, 310), 201)):
        with pytest.raises(AllocatorError, match=f"page {page} "):
            a.free(bad)
        assert state(a) == before and a.audit() == []
    a.free(range(0))  # nothing
    assert state(a) == before


def test_failed_free_of_a_page_listed_twice_frees_nothing():
    a = PageAllocator(8)
    p, q = a.alloc(2)
    before = state(a)
    with pytest.raises(AllocatorError, match="twice"):
        a.free([p, p])
    assert state(a) == before and a.available == 5
    with pytest.raises(AllocatorError):
        a.free(array("i", [q, p, q]))
    assert state(a) == before
    a.free([p, q])
    assert a.available == 7 and a.audit() == []


@pytest.mark.parametrize("bad", [0, -1, 8, 100])
def test_failed_free_of_valid_and_foreign_pages_frees_nothing(bad):
    a = PageAllocator(8)
    p, q = a.alloc(2)
    before = state(a)
    with pytest.raises(AllocatorError):
        a.free([p, bad])
    with pytest.raises(AllocatorError):
        a.free([bad, q])
    assert state(a) == before
    never = next(x for x in range(1, 8) if x not in (p, q))  # in range but never handed out
    with pytest.raises(AllocatorError):
        a.free([p, never])
    assert state(a) == before and a.audit() == []


def test_out_of_pages_carries_the_counts_and_changes_nothing():
    a = PageAllocator(6, "swa pool")
    a.alloc(3)
    before = state(a)
    with pytest.raises(OutOfPages) as ei:
        a.alloc(3)
    assert ei.value.counts == {"requested": 3, "available": 2}
    assert "swa pool" in str(ei.value) and "3" in str(ei.value)
    assert ei.value.code == "out_of_memory"
    assert state(a) == before


def test_audit_finds_a_planted_duplicate_in_the_free_list():
    a = PageAllocator(8)
    a.alloc(2)
    assert a.audit() == []
    a._free.back.append(next(iter(a._free)))  # a page free twice over
    v = a.audit()
    assert len(v) == 2 and "twice" in v[0] and "free page count 5 != 6" in v[1]


def test_audit_finds_free_list_and_states_disagreeing():
    a = PageAllocator(8, "full pool")
    (p,) = a.alloc(1)
    a._free.back.append(p)  # freed behind the state bytes' back
    v = a.audit()
    assert any("disagree" in x and str(p) in x for x in v)
    b = PageAllocator(8)
    b._state[0] = 0  # the padding page marked free
    assert any("padding page 0" in x for x in b.audit())


def test_paired_alloc_takes_both_or_neither():
    pa = PairedAllocator(10, 4)
    full, swa = pa.alloc(2)
    assert len(full) == len(swa) == 2 and 0 not in full and 0 not in swa
    before = (state(pa.full), state(pa.swa))
    with pytest.raises(OutOfPages) as ei:
        pa.alloc(2)  # full has 7 free, swa only 1
    assert ei.value.counts == {"requested": 2, "full_available": 7, "swa_available": 1}
    assert (state(pa.full), state(pa.swa)) == before  # no full page was taken alone
    pa.free_full(full)
    pa.free_swa(swa)
    assert pa.full.available == 9 and pa.swa.available == 3


def test_paired_free_checks_each_pool():
    pa = PairedAllocator(10, 10)
    full, swa = pa.alloc(2)
    before = (state(pa.full), state(pa.swa))
    with pytest.raises(AllocatorError):
        pa.free_swa(array("i", [swa[0], swa[0]]))
    with pytest.raises(AllocatorError):
        pa.free_full(array("i", [full[0], 9]))
    assert (state(pa.full), state(pa.swa)) == before


def test_paired_without_swa_pool():
    pa = PairedAllocator(5, 0)
    assert pa.swa is None
    full, swa = pa.alloc(4)
    assert len(full) == 4 and len(swa) == 0
    with pytest.raises(OutOfPages):
        pa.alloc(1)
    pa.free_swa(array("i"))
    with pytest.raises(AllocatorError):
        pa.free_swa(array("i", [1]))
    pa.free_full(full)
    assert pa.full.available == 4
