"""Host pool (L2): page-first layout, content-addressed slots, copies to and from device pools."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import time
from array import array
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings

import daemon.storage.host_pool as host_pool_module
from daemon.gpu.allocator import AllocatorError, OutOfPages
from daemon.gpu.pools import KVPools, Pool
from daemon.gpu.profile import ModelProfile
from daemon.storage.copies import (
    CopyError,
    CopyInFlight,
    device_to_host,
    host_to_device,
    in_thread,
    plan_device_to_host,
    run_copy,
    run_plans,
)
from daemon.storage.host_pool import HOST_POOL_LAYOUT, MAX_REFERENCES, HostPool


@contextlib.contextmanager
def release_path(vector: bool) -> Iterator[None]:
    """``HostPool.release_many`` on its numpy path (``vector``) whatever the list's length, or a
    slot at a time."""
    was = host_pool_module.FEW_SLOTS
    host_pool_module.FEW_SLOTS = 1 if vector else 2**40
    try:
        yield
    finally:
        host_pool_module.FEW_SLOTS = was


def make_profile(**overrides: Any) -> ModelProfile:
    fields: dict[str, Any] = dict(
        name="tiny",
        page_size=4,
        sliding_window=6,
        num_full_layers=3,
        num_swa_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype="bfloat16",
        device="cpu",
        full_pages=12,
        swa_pages=9,
    )
    fields.update(overrides)
    return ModelProfile(**fields)


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def fill_random(pool: Pool, seed: int) -> None:
    """Random bytes in every page but the padding page (NaN patterns included for floats)."""
    g = torch.Generator().manual_seed(seed)
    raw = pool.buffer.view(torch.uint8)
    raw[:, :, 1:].copy_(torch.randint(0, 256, raw[:, :, 1:].shape, generator=g,
                                      dtype=torch.uint8))


# -- layout and memory -----------------------------------------------------------------------


def test_page_first_layout_and_reserved_slot() -> None:
    p = make_profile()
    with HostPool(p, 5, "full", pin_memory=False) as host:
        assert host.buffer.shape == (5, 3, 2, 4, 2, 8)
        assert host.buffer.is_contiguous() and host.buffer.dtype == torch.bfloat16
        assert host.page_nbytes == p.full_page_bytes
        assert host.nbytes == 5 * p.full_page_bytes
        assert host.fd is not None and not host.pinned
        assert host.describe()["layout"] == list(HOST_POOL_LAYOUT)
        assert as_bytes(host.page(0)) == bytes(host.page_nbytes)
        assert host.usable == 4 and host.available == 4
        base = host.buffer.data_ptr()
        for slot in range(5):
            assert host.page(slot).data_ptr() == base + slot * host.page_nbytes
    with HostPool(p, 3, "swa", pin_memory=False) as host:
        assert host.buffer.shape == (3, 2, 2, 4, 2, 8)
        assert host.page_nbytes == p.swa_page_bytes


def test_rejects_bad_arguments() -> None:
    p = make_profile()
    with pytest.raises(ValueError, match="kind"):
        HostPool(p, 4, "mamba")
    with pytest.raises(ValueError, match="capacity_pages"):
        HostPool(p, 1, "full")
    with pytest.raises(ValueError, match="capacity_pages"):
        HostPool(p, True, "full")  # type: ignore[arg-type]
    no_swa = make_profile(sliding_window=None, num_swa_layers=0, swa_pages=0)
    with pytest.raises(Exception, match="no swa pool"):
        HostPool(no_swa, 4, "swa")


def test_close_is_idempotent_and_blocks_access() -> None:
    host = HostPool(make_profile(), 3, "full", pin_memory=False)
    slot = host.store(h(1))
    host.close()
    host.close()
    assert host.closed and host.fd is None
    with pytest.raises(Exception, match="closed"):
        host.page_bytes(slot)


# -- slots: keyed by hash, or unnamed ------------------------------------------------------------


def test_slots_by_hash_with_refcounts() -> None:
    with HostPool(make_profile(), 4, "full", pin_memory=False) as host:
        assert host.lookup(h(1)) is None
        a = host.store(h(1))  # a keyed page is stored
        host.hold(a)  # a reader holds it too
        assert host.lookup(h(1)) == a
        assert host.refcount(a) == 2 and host.used == 1 and host.available == 2
        with pytest.raises(ValueError, match="already held"):
            host.store(h(1))
        b = host.store(h(2))
        assert b != a and host.lookup(h(2)) == b and host.hash_of(b) == h(2)
        host.release(a)
        assert host.refcount(a) == 1 and host.lookup(h(1)) == a
        host.release(a)
        assert host.refcount(a) == 0 and host.lookup(h(1)) is None and host.hash_of(a) is None
        assert host.available == 2 and host.used == 1
        with pytest.raises(AllocatorError, match="not held"):
            host.release(a)
        with pytest.raises(AllocatorError, match="not held"):
            host.hold(a)
        with pytest.raises(AllocatorError):
            host.release(0)
        with pytest.raises(ValueError, match="32 bytes"):
            host.store(b"short")
        assert host.audit() == []
        host.release(b)
        assert host.used == 0 and host.available == 3 and host.audit() == []


def test_unnamed_slots_are_counted_but_never_indexed() -> None:
    """The tree's host copies: slots with references and no hash, freed at their last
    release, all or none when the pool is short."""
    with HostPool(make_profile(), 6, "full", pin_memory=False) as host:
        keyed = host.store(h(1))
        slots = host.store_unnamed(3)
        assert len(set(slots)) == 3 and keyed not in slots
        assert [host.hash_of(s) for s in slots] == [None] * 3
        assert dict(host.slot_hashes()) == {keyed: h(1)}
        assert host.used == 4 and host.audit() == []
        with pytest.raises(OutOfPages):
            host.store_unnamed(2)  # one slot is left: nothing is taken
        assert host.used == 4 and host.available == 1
        host.hold(slots[0])
        host.release_many(slots)
        assert host.refcount(slots[0]) == 1 and host.used == 2 and host.audit() == []
        host.release(slots[0])
        assert host.used == 1 and host.lookup(h(1)) == keyed and host.audit() == []


def test_out_of_slots() -> None:
    with HostPool(make_profile(), 3, "full", pin_memory=False) as host:
        host.store(h(1))
        host.store(h(2))
        with pytest.raises(OutOfPages):
            host.store(h(3))
        assert host.lookup(h(3)) is None and host.audit() == []
        host.hold(host.lookup(h(1)))  # holding needs no slot


def _pool_state(host: HostPool) -> tuple:
    return (dict(host.slot_hashes()), dict(host.reference_counts()), host.available,
            host.allocator.free_set())


@pytest.mark.parametrize("fault", ["held already", "listed twice", "short hash", "not a hash",
                                   "too many"])
def test_store_many_takes_all_or_nothing(fault: str) -> None:
    """A batch that fails leaves the pool as it was: no slot taken, no hash indexed."""
    with HostPool(make_profile(), 12, "full", pin_memory=False) as host:
        host.store(h(0))
        before = _pool_state(host)
        batch: list[Any] = [h(i) for i in range(1, 6)]
        batch[3] = {"held already": h(0), "listed twice": h(1), "short hash": b"short",
                    "not a hash": "a string", "too many": h(4)}[fault]
        if fault == "too many":
            batch += [h(i) for i in range(100, 110)]
        with pytest.raises(OutOfPages if fault == "too many" else ValueError):
            host.store_many(batch)
        assert _pool_state(host) == before and host.audit() == []
        slots = host.store_many([h(i) for i in range(1, 6)])
        assert [host.lookup(h(i)) for i in range(1, 6)] == list(slots)
        assert all(host.refcount(s) == 1 for s in slots) and host.audit() == []


def test_release_many_checks_every_slot_before_it_changes_one() -> None:
    with HostPool(make_profile(), 12, "full", pin_memory=False) as host:
        a, b, c = host.store_many([h(1), h(2), h(3)])
        host.hold(b)  # b holds two references
        assert a == 1  # so that True stands for a held slot below
        before = _pool_state(host)
        # (a float or a bool equal to a held slot is no slot, wherever it stands in the list)
        for bad in ([a, c, 0], [a, 11], [a, a], [b, b, b], [b, float(b)], [a, True],
                    [True, a]):
            with pytest.raises(AllocatorError):
                host.release_many(bad)
            assert _pool_state(host) == before
        host.release_many([b, a, b])  # b's two references, a's one
        assert host.lookup(h(1)) is None and host.lookup(h(2)) is None
        assert host.lookup(h(3)) == c and host.used == 1 and host.audit() == []


def test_release_many_refuses_bytes_before_it_changes_a_slot() -> None:
    """Bytes iterate as ints, so each would pass for a slot, but the fast path's array() reads
    them as int32 values: a bytes or bytearray list is refused whole, nothing released."""
    with HostPool(make_profile(), 16, "full", pin_memory=False) as host:
        slots = host.store_unnamed(4)
        before = _pool_state(host)
        for bad in (bytes(slots), bytearray(slots), bytearray(slots[:1])):
            with pytest.raises(AllocatorError, match="sequence of ints"):
                host.release_many(bad)
            assert _pool_state(host) == before and host.audit() == []
        host.release_many(list(slots))
        assert host.used == 0 and host.audit() == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "unnamed", "hold", "hold", "release",
                                           "release"]),
                          st.lists(st.integers(0, 15), max_size=6), st.booleans()),
                max_size=25), st.booleans())
@example([("store", [], False), ("hold", [0], False), ("release", [1, 1], True)], False)
@example([("store", [], False), ("hold", [0], False), ("release", [1, 1], True)], True)
def test_release_many_agrees_with_a_reference_count_model(steps: list, vector: bool) -> None:
    """Any mix of keyed and unnamed slots, extra references, repeated and foreign slots, and a
    bool among the slots: release_many frees exactly the slots whose last reference it drops,
    forgets their hashes, and refuses a bad list whole; on either path (``vector``: numpy's,
    which lists of ``FEW_SLOTS`` slots or more take)."""
    with release_path(vector), HostPool(make_profile(), 16, "full", pin_memory=False) as host:
        refs: dict[int, int] = {}
        hashes: dict[int, bytes] = {}
        n = 0
        for op, picks, flag in steps:
            held = sorted(refs)
            if op == "store":
                n += 1
                if host.available:
                    hashes[host.store(h(n))] = h(n)
                    refs[host.lookup(h(n))] = 1
            elif op == "unnamed":
                if host.available >= len(picks):
                    refs.update(dict.fromkeys(host.store_unnamed(len(picks)), 1))
            elif op == "hold" and held:
                s = held[picks[0] % len(held)] if picks else held[0]
                host.hold(s)
                refs[s] += 1
            elif op == "release":
                slots: list[Any] = [held[i % len(held)] if held and not flag else i
                                    for i in picks]
                if flag and slots and refs.get(1):
                    slots[picks[-1] % len(slots)] = True  # no slot, even where 1 is held
                counts = {s: slots.count(s) for s in slots}
                ok = (all(type(s) is int for s in slots)
                      and all(refs.get(s, 0) >= k for s, k in counts.items()))
                before = _pool_state(host)
                # an int32 array (what the tree hands back) takes the typed path: as a list
                arg = (array("i", slots) if len(slots) % 2 and all(type(s) is int for s in slots)
                       else slots)
                if not ok:
                    with pytest.raises(AllocatorError):
                        host.release_many(arg)
                    assert _pool_state(host) == before
                    continue
                host.release_many(arg)
                for s in slots:
                    refs[s] -= 1
                    if not refs[s]:
                        del refs[s]
                        hashes.pop(s, None)
            assert dict(host.reference_counts()) == refs
            assert dict(host.slot_hashes()) == hashes
            assert host.used == len(refs) and host.audit() == []


@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(0, 11), min_size=1, max_size=30),
       st.lists(st.integers(0, 11), max_size=12), st.booleans(), st.booleans())
def test_release_many_frees_slots_in_the_order_their_last_references_go(
        release: list[int], holds: list[int], typed: bool, vector: bool) -> None:
    """Slots listed twice included: the slots freed go back to the allocator in the order in
    which their last references go, as one batch of distinct slots would, so the allocations
    that follow hand out the same slots in the same order (runs freed in order come back in
    order). The reference drops the references that free nothing one at a time, then releases
    the freed slots as one distinct list."""
    one = HostPool(make_profile(), 13, "full", pin_memory=False)
    many = HostPool(make_profile(), 13, "full", pin_memory=False)
    try:
        for pool in (one, many):
            slots = pool.store_unnamed(12)
            for i in holds:
                pool.hold(slots[i])
        left = {s: 1 + holds.count(i) for i, s in enumerate(slots)}
        listed = []
        for i in release:
            if left[slots[i]]:
                left[slots[i]] -= 1
                listed.append(slots[i])
        freed = []
        refs = {s: one.refcount(s) for s in set(listed)}
        for s in listed:
            refs[s] -= 1
            if refs[s]:
                one.release(s)
            else:
                freed.append(s)
        one.release_many(freed)
        with release_path(vector):
            many.release_many(array("i", listed) if typed else listed)
        assert dict(many.reference_counts()) == dict(one.reference_counts())
        assert many.store_unnamed(many.available) == one.store_unnamed(one.available)
        assert many.audit() == [] and one.audit() == []
    finally:
        one.close()
        many.close()


@pytest.mark.parametrize("vector", [False, True])
def test_an_over_release_names_the_first_such_slot_in_the_list(vector: bool) -> None:
    with release_path(vector), HostPool(make_profile(), 8, "full", pin_memory=False) as host:
        a, b = host.store_unnamed(2)
        with pytest.raises(AllocatorError) as refused:
            host.release_many([b, b, a, a])
        assert str(refused.value).endswith(f"slot {b} released 2 times, holds 1 references")
        assert host.used == 2 and host.audit() == []


def test_release_many_takes_int_subclasses_as_the_ints_they_are() -> None:
    class Slot(int):
        pass

    with HostPool(make_profile(), 8, "full", pin_memory=False) as host:
        a = host.store_unnamed(3)
        host.release_many([Slot(a[0]), Slot(a[2])])
        assert host.used == 1 and host.refcount(a[1]) == 1 and host.audit() == []


def test_a_refused_release_leaves_the_callers_array_free_to_grow() -> None:
    with HostPool(make_profile(), 8, "full", pin_memory=False) as host:
        a = host.store_unnamed(2)
        bad = array("i", [a[0], 7])  # 7 is not held
        with pytest.raises(AllocatorError, match="slot 7 is not held") as refused:
            host.release_many(bad)
        bad.append(1)  # a BufferError if the pool's view of it lived on in the traceback
        assert refused.value is not None and host.refcount(a[0]) == 1 and host.audit() == []


def test_a_slot_at_its_reference_limit_refuses_one_more_hold() -> None:
    with HostPool(make_profile(), 4, "full", pin_memory=False) as host:
        s = host.store_unnamed(1)[0]
        host._refs[s] = MAX_REFERENCES  # the fault: a count no test could reach by holding
        with pytest.raises(AllocatorError, match="the most a slot can"):
            host.hold(s)
        assert host.refcount(s) == MAX_REFERENCES


@pytest.mark.parametrize("plant", ["refs_zero", "index_points_elsewhere", "free_and_held",
                                   "leak", "double_index"])
def test_audit_finds_planted_corruption(plant: str) -> None:
    with HostPool(make_profile(), 6, "full", pin_memory=False) as host:
        a, b = host.store(h(1)), host.store(h(2))
        assert host.audit() == []
        if plant == "refs_zero":
            host._refs[a] = 0
        elif plant == "index_points_elsewhere":
            host._slot_of[h(1)] = b
        elif plant == "free_and_held":
            host._alloc.free([a])
        elif plant == "leak":
            host._alloc.alloc(1, "")
        elif plant == "double_index":
            host._slot_of[h(3)] = a
        assert host.audit(), plant


# -- page bytes ---------------------------------------------------------------------------------


def test_page_bytes_zero_copy_and_write() -> None:
    with HostPool(make_profile(), 4, "full", pin_memory=False) as host:
        slot = host.store(h(1))
        data = bytes(range(256)) * (host.page_nbytes // 256) + bytes(host.page_nbytes % 256)
        host.write_page_bytes(slot, data)
        view = host.page_bytes(slot)
        assert isinstance(view, memoryview) and view.nbytes == host.page_nbytes
        assert bytes(view) == data == as_bytes(host.page(slot))
        host.page(slot).view(torch.uint8).view(-1)[0] = 77  # zero-copy: the view sees it
        assert view[0] == 77
        with pytest.raises(ValueError, match="bytes"):
            host.write_page_bytes(slot, data[:-1])
        with pytest.raises(AllocatorError, match="not held"):
            host.page_bytes(slot + 1)
        with pytest.raises(AllocatorError):
            host.write_page_bytes(0, data)


# -- copies -------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [8, 512])
@pytest.mark.parametrize("runs", [3, 40])
def test_a_copy_into_scattered_slots_lands_each_page_in_its_slot(runs: int, head_dim: int
                                                                  ) -> None:
    """Up to a few runs of slots a CPU copy goes run by run; past them (a host pool that has
    seen churn) it gathers and scatters all rows at once. A small copy (head_dim 8: a few KiB)
    does either with numpy alone, opening no OpenMP region; a larger one (head_dim 512: 49 KiB a
    page, over 256 KiB in all) with torch. Each way, each slot gets its page."""
    p = make_profile(full_pages=128, head_dim=head_dim)
    with KVPools(p) as kv:
        pool = kv.pool("full")
        fill_random(pool, 3)
        with HostPool(p, 200, "full", pin_memory=False) as host:
            taken = list(host.store_many([h(i) for i in range(160)]))
            slots = taken[::4][:runs] if runs > 16 else taken[:runs * 2]  # 40 runs, or 1
            pages = list(range(1, len(slots) + 1))[::-1]
            device_to_host(pool, pages, host, slots)
            for pg, slot in zip(pages, slots, strict=True):
                whole = b"".join(as_bytes(pool.buffer[layer, kv_, pg])
                                 for layer in range(pool.num_layers) for kv_ in range(2))
                assert bytes(host.page_bytes(slot)) == whole
            untouched = set(taken) - set(slots)
            assert all(not any(host.page_bytes(s)) for s in untouched)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_round_trip_device_host_device_byte_exact(dtype: str, page_size: int) -> None:
    p = make_profile(dtype=dtype, page_size=page_size, sliding_window=2 * page_size)
    with KVPools(p) as kv:
        for kind, seed in (("full", 1), ("swa", 2)):
            pool = kv.pool(kind)
            fill_random(pool, seed)
            before = as_bytes(pool.buffer)
            with HostPool(p, 8, kind, pin_memory=False) as host:
                pages = [7, 2, 5, 3, 1]
                slots = [host.store(h(i)) for i in range(len(pages))]
                device_to_host(pool, pages, host, slots)
                for pg, slot in zip(pages, slots, strict=True):
                    # one slot is that page across all layers, layer by layer, K then V
                    whole = b"".join(as_bytes(pool.buffer[layer, kv_, pg])
                                     for layer in range(pool.num_layers) for kv_ in range(2))
                    assert bytes(host.page_bytes(slot)) == whole
                # wipe the device pages, bring them back into other pages too
                pool.buffer.view(torch.uint8)[:, :, 1:].zero_()
                host_to_device(host, slots, pool, pages)
                for pg in pages:
                    assert as_bytes(pool.page(pg)) == as_bytes(
                        torch.frombuffer(bytearray(before), dtype=torch.uint8)
                        .view(pool.buffer.view(torch.uint8).shape)[:, :, pg]
                    )
                target = [x for x in range(1, pool.num_pages) if x not in pages][: len(pages)]
                host_to_device(host, slots[: len(target)], pool, target)
                for pg, slot in zip(target, slots, strict=False):
                    assert as_bytes(pool.page(pg)) == bytes(host.page_bytes(slot))
                assert host.audit() == []


def test_copies_with_scattered_slots_and_empty_batches() -> None:
    p = make_profile()
    with KVPools(p) as kv, HostPool(p, 10, "full", pin_memory=False) as host:
        pool = kv.full
        fill_random(pool, 3)
        slots = [host.store(h(i)) for i in range(9)]
        for s in (2, 3, 6):  # free a few so that the next batch gets non-consecutive slots
            host.release(s)
        scattered = [9, 2, 3, 6, 1]
        pages = [11, 4, 8, 1, 6]
        for s in (2, 3, 6):
            host.store(h(100 + s))
        device_to_host(pool, pages, host, scattered)
        for pg, slot in zip(pages, scattered, strict=True):
            assert as_bytes(host.page(slot)) == as_bytes(pool.page(pg))
        pool.buffer.view(torch.uint8)[:, :, 1:].zero_()
        host_to_device(host, scattered, pool, pages)
        for pg, slot in zip(pages, scattered, strict=True):
            assert as_bytes(pool.page(pg)) == as_bytes(host.page(slot))
        device_to_host(pool, [], host, [])
        host_to_device(host, [], pool, [])
        assert len(slots) == 9


@pytest.mark.parametrize("ids", [list, lambda v: array("i", v)], ids=["list", "array"])
def test_a_copy_plan_checks_now_and_copies_when_run(ids: Any) -> None:
    """A plan (made on the loop, run on the copy thread) raises a bad request at once, and moves
    the bytes the device pages hold when it runs, not when it was made. Ids come as lists or
    as the int32 arrays the tiers hand it (read as bytes)."""
    p = make_profile()
    with KVPools(p) as kv, HostPool(p, 10, "full", pin_memory=False) as host:
        pool = kv.full
        slots = ids([host.store(h(i)) for i in range(3)])
        with pytest.raises(CopyError, match="out of range"):
            plan_device_to_host(pool, ids([1, 2, pool.num_pages]), host, slots)
        with pytest.raises(CopyError, match="out of range"):
            plan_device_to_host(pool, ids([1, -2, 3]), host, slots)
        with pytest.raises(CopyError, match="twice"):
            plan_device_to_host(pool, ids([1, 1, 2]), host, slots)
        with pytest.raises(CopyError, match="twice"):
            plan_device_to_host(pool, ids([1, 2, 3]), host, ids([slots[0], slots[1], slots[0]]))
        plan = plan_device_to_host(pool, ids([5, 6, 7]), host, slots)
        fill_random(pool, 4)  # after the plan was made
        run_plans(plan)
        for pg, slot in zip([5, 6, 7], slots, strict=True):
            assert as_bytes(host.page(slot)) == as_bytes(pool.page(pg))
        run_plans(plan_device_to_host(pool, ids([]), host, ids([])))  # nothing to copy: a no-op


def test_copy_rejects_mismatches() -> None:
    p = make_profile()
    with KVPools(p) as kv, HostPool(p, 4, "full", pin_memory=False) as host:
        with pytest.raises(CopyError, match="kinds"):
            device_to_host(kv.pool("swa"), [1], host, [1])
        with pytest.raises(CopyError, match="out of range"):
            device_to_host(kv.full, [0], host, [1])
        with pytest.raises(CopyError, match="out of range"):
            host_to_device(host, [4], kv.full, [1])
        with pytest.raises(CopyError, match="twice"):
            host_to_device(host, [1, 2], kv.full, [3, 3])
        with pytest.raises(CopyError, match="slots"):
            device_to_host(kv.full, [1, 2], host, [1])
        for bad in (["3"], [1.5], [2**70]):  # not ids: refused, not converted
            with pytest.raises(CopyError, match="integers"):
                device_to_host(kv.full, bad, host, [1])
        other = make_profile(head_dim=16)
        with HostPool(other, 3, "full", pin_memory=False) as wrong:
            with pytest.raises(CopyError, match="page shapes"):
                device_to_host(kv.full, [1], wrong, [1])
        with HostPool(make_profile(dtype="float32"), 3, "full", pin_memory=False) as wrong:
            with pytest.raises(CopyError, match="dtypes"):
                device_to_host(kv.full, [1], wrong, [1])


@pytest.mark.asyncio
async def test_copies_run_off_the_event_loop() -> None:
    """A ticking task keeps being served while large copies run."""
    p = make_profile(name="big", page_size=16, num_full_layers=8, num_kv_heads=8, head_dim=128,
                     sliding_window=None, num_swa_layers=0, swa_pages=0, full_pages=257)
    # 256 pages x 512 KiB = 128 MiB each way
    with KVPools(p) as kv, HostPool(p, 257, "full", pin_memory=False) as host:
        pool = kv.full
        pages = list(range(1, 257))
        slots = [host.store(h(i)) for i in range(256)]
        loop_thread = threading.get_ident()
        copy_threads: set[int] = set()

        def copies_for(seconds: float) -> int:
            copy_threads.add(threading.get_ident())
            end, n = time.monotonic() + seconds, 0
            while time.monotonic() < end or n < 2:
                device_to_host(pool, pages, host, slots)
                host_to_device(host, slots, pool, pages)
                n += 2
            return n

        ticks: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.002)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        start = time.monotonic()
        n = await run_copy(copies_for, 0.5)
        elapsed = time.monotonic() - start
        stop.set()
        await task
        during = [t for t in ticks if start <= t <= start + elapsed]
        assert n >= 2 and elapsed >= 0.5
        assert copy_threads and loop_thread not in copy_threads
        # served about every 2 ms; demand a tenth of that rate to stay robust on a busy machine
        assert len(during) >= 25, (len(during), elapsed)
        gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
        assert max(gaps) < 0.2

        # and run_copy of the module's own copies returns their result
        assert await run_copy(device_to_host, pool, pages[:4], host, slots[:4]) is None
        assert as_bytes(host.page(slots[0])) == as_bytes(pool.page(1))


@pytest.mark.asyncio
async def test_a_cancelled_wait_for_thread_work_ends_only_after_the_work() -> None:
    """A stop cancels tier tasks that wait for an encode or a slot write on a thread; the slots
    they hold go back when the wait ends, so it must not end before the thread is done with
    them, however many times it is cancelled."""
    started, release = threading.Event(), threading.Event()
    done: list[int] = []

    def work() -> int:
        started.set()
        release.wait(10)
        done.append(1)
        return 7

    task = asyncio.create_task(in_thread(work))
    assert await asyncio.to_thread(started.wait, 10)
    for _ in range(2):
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done() and done == []  # still waiting for the thread
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done == [1]
    assert await in_thread(lambda: 8) == 8  # uncancelled: the result


# -- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("segment", [None, 8])
async def test_cuda_round_trip_on_copy_stream(dtype: str, segment: int | None) -> None:
    """Segmented (memory isolation): each segment is page-locked on its own, and a segment that
    changes namespace is unregistered, replaced and registered again before the copies use it."""
    p = make_profile(device="cuda", dtype=dtype, page_size=16, sliding_window=32,
                     full_pages=64, swa_pages=40)
    with KVPools(p) as kv:
        for kind in ("full", "swa"):
            pool = kv.pool(kind)
            assert pool.device.type == "cuda"
            raw = pool.buffer.view(torch.uint8)
            raw[:, :, 1:].copy_(torch.randint(0, 256, raw[:, :, 1:].shape, dtype=torch.uint8,
                                              device=pool.device))
            torch.cuda.synchronize()
            with HostPool(p, 32, kind, segment_pages=segment) as host:
                assert host.pinned and host.buffer.is_pinned()
                assert (host.fd is not None) == (segment is None)
                ns = "a" if segment else ""
                if segment:  # "b" serves segments 0 and 1 first: "a" takes them renewed
                    for s in [host.store(h(500 + i), "b") for i in range(9)]:
                        host.release(s)
                pages = list(range(pool.num_pages - 1, pool.num_pages - 21, -1))
                slots = [host.store(h(i), ns) for i in range(20)]
                for s in slots[5:8]:  # make the slots non-consecutive
                    host.release(s)
                slots = slots[:5] + slots[8:] + [host.store(h(100 + i), ns) for i in range(3)]
                if segment:
                    assert host.segment_epochs[0] == host.segment_epochs[1] == 1
                    assert host.buffer.is_pinned()
                ticks = 0

                async def tick() -> None:
                    nonlocal ticks
                    while True:
                        ticks += 1
                        await asyncio.sleep(0)

                task = asyncio.create_task(tick())
                # The first copy of a process, and of a size, loads kernels and page-locks a
                # staging block (cudaHostAlloc), each of which may synchronize the device once;
                # the rule is for the copies after them.
                await run_copy(device_to_host, pool, pages, host, slots)
                # Keep the stream the copy waits behind busy: starting the copy must not make
                # the loop wait for it (the event is still pending once the copy is enqueued),
                # and awaiting it lets other tasks run.
                torch.cuda._sleep(200_000_000)
                copy = CopyInFlight(device_to_host, pool, pages, host, slots)
                assert not copy.finished()
                await copy
                assert copy.finished()
                for pg, slot in zip(pages, slots, strict=True):
                    assert bytes(host.page_bytes(slot)) == as_bytes(pool.page(pg).cpu())
                saved = as_bytes(pool.buffer.cpu())
                raw[:, :, 1:].zero_()
                await run_copy(host_to_device, host, slots, pool, pages)
                task.cancel()
                after = pool.buffer.cpu()
                before = torch.frombuffer(bytearray(saved), dtype=torch.uint8).view(raw.shape)
                for pg in pages:
                    assert as_bytes(after[:, :, pg]) == as_bytes(before[:, :, pg])
                assert ticks >= 1
                assert host.audit() == []


# -- segments (memory isolation) -------------------------------------------------------------

SEG_PROFILE = dict(head_dim=128)  # a host page of 12 KiB: whole OS pages, a segment may be 1 slot


@settings(max_examples=40, deadline=None)
@given(segment=st.integers(1, 3), capacity=st.integers(2, 9),
       ops=st.lists(st.tuples(st.sampled_from("ab"), st.booleans(), st.integers(0, 30)),
                    max_size=40))
def test_segmented_slots_stay_in_their_namespace_against_a_model(
        segment: int, capacity: int, ops: list[tuple[str, bool, int]]) -> None:
    """Random stores and releases by two namespaces over a pool of drawn segment size: every
    held slot lies in a segment of its namespace and keeps its bytes, a free segment holds no
    held slot, and a slot whose segment last served the other namespace reads zeros (a fresh
    memfd, its epoch grown)."""
    with HostPool(make_profile(**SEG_PROFILE), capacity, "full", pin_memory=False,
                  segment_pages=segment) as host:
        a = host.allocator
        model: dict[int, tuple[str, bytes]] = {}  # slot -> (namespace, content)
        last: dict[int, str] = {}  # segment -> the namespace it served last
        for n, (ns, store, x) in enumerate(ops):
            if store and host.available_to(ns):
                seg_before = dict(last)
                epochs = list(host.segment_epochs)
                slot = host.store(h(1000 * n + x), ns)
                seg = slot // segment
                if seg_before.get(seg, ns) != ns:  # moved: fresh zeroed memory
                    assert host.segment_epochs[seg] == epochs[seg] + 1
                    assert bytes(host.page_bytes(slot)) == bytes(host.page_nbytes)
                last[seg] = ns
                data = bytes([n % 251 + 1]) * host.page_nbytes
                host.write_page_bytes(slot, data)
                model[slot] = (ns, data)
            elif not store and model:
                slot = sorted(model)[x % len(model)]
                del model[slot]
                host.release(slot)
            assert host.audit() == []
            for slot, (owner, data) in model.items():
                assert a.owner[slot // segment] == owner
                assert bytes(host.page_bytes(slot)) == data
            for seg in range(host.num_segments):
                if a.owner[seg] is None:
                    assert not set(host.segment_range(seg)) & set(model)
        for ns in "ab":
            assert host.audit_owners([s for s, (o, _) in model.items() if o == ns], ns, "x") == []
        if model:  # a slot claimed for the wrong namespace is reported
            slot, (owner, _) = next(iter(model.items()))
            assert host.audit_owners([slot], "b" if owner == "a" else "a", "slots")


def test_a_moved_segment_leaves_old_mappings_on_the_old_memory() -> None:
    """What another process mapped of a segment (its memfd) stays the old memory once the
    segment changes namespace: it neither sees the new namespace's bytes nor writes them."""
    import mmap

    with HostPool(make_profile(**SEG_PROFILE), 5, "full", pin_memory=False,
                  segment_pages=2) as host:
        s = host.store(h(1), "a")
        host.write_page_bytes(s, b"\x07" * host.page_nbytes)
        seg = s // 2
        fd = os.dup(host.segment_fds[seg])  # what tenant a's engine received
        old = mmap.mmap(fd, os.fstat(fd).st_size)
        host.release(s)  # empty: back on the free list
        s2 = host.store(h(2), "b")  # b takes it: a new memfd
        assert s2 // 2 == seg and host.segment_epochs[seg] == 1
        assert bytes(host.page_bytes(s2)) == bytes(host.page_nbytes)
        host.write_page_bytes(s2, b"\x09" * host.page_nbytes)
        at = (s2 % 2) * host.page_nbytes
        assert old[at : at + 4] != b"\x09" * 4  # a's mapping does not see b's bytes
        old[at : at + host.page_nbytes] = b"\x01" * host.page_nbytes  # nor reaches them
        assert bytes(host.page_bytes(s2)) == b"\x09" * host.page_nbytes
        assert os.fstat(fd).st_ino != os.fstat(host.segment_fds[seg]).st_ino
        old.close()
        os.close(fd)
        assert host.describe()["num_segments"] == 3 and host.fd is None


def test_the_host_tier_reports_a_tree_slot_in_another_namespaces_segment() -> None:
    """The checker's host ownership audit: a node's host copy in a segment of its own namespace
    passes, one in another namespace's segment is reported (nodes are duck-typed: storage sits
    below the tree)."""
    from types import SimpleNamespace

    from daemon.storage.host_tier import HostTier

    host = HostTier(make_profile(**SEG_PROFILE), 9, 0, pin_memory=False, segment_pages=2)
    try:
        mine, theirs = host.take("full", 1, "a"), host.take("full", 1, "b")
        host.filled("full", mine, "a")
        host.filled("full", theirs, "b")

        def audit(slot: int) -> list[str]:
            node = SimpleNamespace(ns=SimpleNamespace(name="a"), host=array("i", [slot]),
                                   host_swa=None)
            v: list[str] = []
            for _ in host.audit_tree_owners_steps([node], v):
                pass
            return v

        assert audit(mine[0]) == []
        assert "tree full host slots of namespace 'a'" in audit(theirs[0])[0]
    finally:
        host.close()


def test_the_host_tier_drops_nothing_when_one_slot_of_a_drop_is_bad() -> None:
    from daemon.storage.host_tier import HostTier

    tier = HostTier(make_profile(), 8, 4, pin_memory=False)
    try:
        slots = tier.take("full", 2, "ns")
        with pytest.raises(AllocatorError):
            tier.drop("full", [slots[0], 7], "ns")  # 7: a slot nobody holds
        assert tier.pending["full"] == set(slots)
        assert [tier.full.refcount(s) for s in slots] == [1, 1]
        tier.drop("full", slots, "ns")
        assert not tier.pending["full"] and not tier.pending_full
        assert tier.full.used == 0 and tier.full.audit() == []
    finally:
        tier.close()
