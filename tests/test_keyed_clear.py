"""kv_clear against the keyed store's Redis writer, in process over a real host tier and the shared
Redis server, at the moments a daemon cannot be made to hit on demand: a write-back queued, or in
the writer's batch, when the clear comes; a clear that arrives while a batch is on its way to
Redis. Nothing written before a clear may be read after it (docs/protocol.md 9.4)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
import redis as redis_sync

from daemon.keyed_tier import L3_WRITE_BATCH, KeyedTier
from daemon.model_cache import ModelCache
from daemon.storage.host_tier import HostTier
from daemon.storage.redis_tier import RedisTier
from tests.redis_procs import SHARED_URL
from tests.test_keyed_store_model import PROFILE


def run_store(prefix: str, host_pages: int, policy: str,
              body: Callable[[KeyedTier, HostTier], Awaitable[None]],
              charge: Callable[[list], Awaitable[int]] | None = None) -> None:
    async def run() -> None:
        cache = ModelCache(PROFILE)
        host = HostTier(PROFILE, host_pages, 4, pin_memory=False)
        cache.host = host
        kv = KeyedTier(cache, host, {}, "tiny", l3_policy=policy, l3_charge=charge,
                       l3=RedisTier(SHARED_URL, key_prefix=prefix + ":", op_timeout=2.0))
        kv.start()
        try:
            await body(kv, host)
            assert kv.check({"s1", "s2", "s3"}) == []
        finally:
            await kv.aclose()
            await kv.l3.aclose()  # type: ignore[union-attr]
            host.close()

    asyncio.run(run())


def commit(kv: KeyedTier, host: HostTier, owner: str, ns: str, keys: list[bytes], fill: int
           ) -> None:
    r = kv.reserve(owner, ns, "full", keys, 1000)
    for s in r.slots:
        host.full.write_page_bytes(s, bytes([fill]) * host.full.page_nbytes)
    kv.commit(owner, r.pin)


async def fetched(kv: KeyedTier, keys: list[bytes]) -> int:
    """How many of ``keys`` a fetch in namespace "a" brings from Redis (the lookup agrees)."""
    n = await kv.fetch("a", "full", keys, 2.0)
    got = kv.lookup("s3", "a", "full", keys, False, 1000)
    assert got.present.count(1) == n
    return n


@pytest.mark.parametrize("where", ["queued", "in the writer's batch"])
def test_write_backs_of_before_a_clear_are_never_read_after_it(prefix: str, where: str) -> None:
    """Under write-back an evicted page's bytes wait for the writer. Evicted before the clear,
    such a page is no longer on host, so the clear did not mark it; it was written after the
    clear under the new generation, and a fetch served its old bytes (a review found it)."""
    n = 1 if where == "queued" else L3_WRITE_BATCH + 1
    keys = [b"old%03d" % i for i in range(n)]

    async def body(kv: KeyedTier, host: HostTier) -> None:
        commit(kv, host, "s1", "a", keys, 7)
        # namespace "b" takes the whole pool: every page of "a" is evicted, its write queued
        commit(kv, host, "s2", "b", [b"new%03d" % i for i in range(n)], 9)
        if where != "queued":
            await asyncio.sleep(0)  # the writer takes a batch and waits for Redis
            assert kv.l3_queued == 1
        kv.clear("a")
        await kv.drain(time.monotonic() + 5)
        assert await fetched(kv, keys) == 0

    run_store(prefix, n + 1, "write_back", body)


def test_a_page_kept_by_a_clear_during_its_write_is_not_taken_as_in_redis(prefix: str) -> None:
    """A pinned page survives a clear. When the clear comes while its write is on the way, the
    value lands under the generation of before, where no one reads it: the page is not taken as
    in Redis (under write-back its eviction writes it again), and the quota is not charged for
    the dead value, which is deleted from Redis (it used to stay there, counted by no quota)."""
    charged: list = []

    async def charge(items: list) -> int:
        charged.extend(items)
        return 0

    async def body(kv: KeyedTier, host: HostTier) -> None:
        real = kv.l3.set_pages_each  # type: ignore[union-attr]

        async def clear_on_the_way(values: list[bytes]) -> list[bool]:
            kv.clear("a")
            return await real(values)

        kv.l3.set_pages_each = clear_on_the_way  # type: ignore[union-attr,method-assign]
        commit(kv, host, "s1", "a", [b"p"], 5)
        pin = kv.lookup("s1", "a", "full", [b"p"], True, 64).pin
        await kv.drain(time.monotonic() + 5)
        page = kv.pages.get("a", "full", b"p")
        assert page is not None and not page.in_l3 and charged == []
        raw = redis_sync.Redis.from_url(SHARED_URL)
        try:
            assert [k for k in raw.scan_iter(match=f"{prefix}:*") if b":kvgen:" not in k] == []
        finally:
            raw.close()
        kv.l3.set_pages_each = real  # type: ignore[union-attr,method-assign]
        kv.release("s1", pin)
        kv.clear("a")
        await kv.drain(time.monotonic() + 5)
        assert await fetched(kv, [b"p"]) == 0

    run_store(prefix, 4, "write_through", body, charge)


def test_a_batch_that_fails_after_its_pages_were_counted_counts_each_page_once(
        prefix: str) -> None:
    """The L3 ledger's charge runs after a batch's pages are counted as written. A failure there
    (injected: the ledger's own Redis calls fail only with Redis gone, which would fail the write
    first) is logged and counts the pages that were not counted yet, none here: before, each
    page counted as written and as failed."""
    async def charge(items: list) -> int:
        raise RuntimeError("injected: the L3 ledger failed")

    async def body(kv: KeyedTier, host: HostTier) -> None:
        commit(kv, host, "s1", "a", [b"p", b"q"], 5)
        await kv.drain(time.monotonic() + 5)
        assert kv.counters["kv_l3_write_pages"] == 2
        assert kv.counters["kv_l3_write_failures"] == 0
        assert kv.ns_counters["a"]["kv_l3_write_failures"] == 0
        assert all(page.in_l3 for page in (kv.pages.get("a", "full", k) for k in (b"p", b"q")))

    run_store(prefix, 4, "write_through", body, charge)


def two_namespaces(kv: KeyedTier, host: HostTier) -> None:
    """Two pages of namespace "a" and two of "b", queued for the writer's next batch."""
    commit(kv, host, "s1", "a", [b"a1", b"a2"], 5)
    commit(kv, host, "s2", "b", [b"b1", b"b2"], 6)


def failures(kv: KeyedTier) -> tuple[int, int, int]:
    return (kv.ns_counters["a"]["kv_l3_write_failures"],
            kv.ns_counters["b"]["kv_l3_write_failures"], kv.counters["kv_l3_write_failures"])


def test_a_write_that_fails_counts_a_page_without_a_generation_once(prefix: str) -> None:
    """Namespace "a" has no generation to write under (Redis did not answer for it: injected),
    so its pages count as failures before the write; then the write itself fails (injected).
    Before, "a"'s pages counted twice."""
    async def body(kv: KeyedTier, host: HostTier) -> None:
        real = kv.names.to_write

        async def none_for_a(l3: RedisTier, ns: str) -> int | None:
            return None if ns == "a" else await real(l3, ns)

        async def fail(values: list[bytes]) -> list[bool]:
            raise ConnectionError("injected: the write failed")

        kv.names.to_write = none_for_a  # type: ignore[method-assign]
        kv.l3.set_pages_each = fail  # type: ignore[union-attr,method-assign]
        two_namespaces(kv, host)
        await kv.drain(time.monotonic() + 5)
        assert failures(kv) == (2, 2, 4)

    run_store(prefix, 6, "write_through", body)


def test_a_batch_that_fails_before_naming_does_not_count_what_a_clear_overtook(
        prefix: str) -> None:
    """A clear of "a" lands while the writer asks Redis for the generations, and then that
    fails (both injected): "a"'s pages were dropped by the clear, not failed, as on the path
    where nothing fails; "b"'s failed."""
    async def body(kv: KeyedTier, host: HostTier) -> None:
        async def clear_a_then_fail(l3: RedisTier, ns: str) -> int | None:
            kv.clear("a")
            raise ConnectionError("injected: Redis went away")

        kv.names.to_write = clear_a_then_fail  # type: ignore[method-assign]
        two_namespaces(kv, host)
        await kv.drain(time.monotonic() + 5)
        assert failures(kv) == (0, 2, 2)

    run_store(prefix, 6, "write_through", body)


def test_a_page_committed_while_its_own_clear_is_recorded_is_written(prefix: str) -> None:
    """Until this daemon's clear of "a" has reached Redis it knows the generation of before the
    clear. A page committed meanwhile, stored as of that generation, would be taken for older
    than the clear when written under the new one, and dropped: it is written."""
    async def body(kv: KeyedTier, host: HostTier) -> None:
        commit(kv, host, "s1", "a", [b"p"], 5)
        await kv.drain(time.monotonic() + 5)  # the write read the generation
        before = kv.names.known("a")
        assert before is not None
        kv.clear("a")
        assert not kv.names.raised("a")
        commit(kv, host, "s1", "a", [b"q"], 6)
        await kv.drain(time.monotonic() + 5)
        assert kv.names.known("a") == before + 1
        assert kv.counters["kv_l3_write_outdated"] == 0
        assert kv.ns_counters["a"]["kv_l3_write_pages"] == 2
        assert kv.pages.get("a", "full", b"q").in_l3  # type: ignore[union-attr]

    run_store(prefix, 4, "write_through", body)


def test_a_page_pinned_at_its_own_clear_is_still_written_back(prefix: str) -> None:
    """A page pinned at a clear keeps its content, on host and, under write-back, in Redis once
    evicted (docs/protocol.md 9.4). Stored as of the generation of before the clear, it would
    be taken for older than it and dropped: the clear lets it be written under the new one."""
    async def body(kv: KeyedTier, host: HostTier) -> None:
        await kv.fetch("a", "full", [b"none"], 2.0)  # the generation is known
        commit(kv, host, "s1", "a", [b"p"], 5)
        pin = kv.lookup("s1", "a", "full", [b"p"], True, 64).pin
        kv.clear("a")
        await kv.drain(time.monotonic() + 5)
        kv.release("s1", pin)
        # namespace "b" takes the whole pool: p is evicted and its write queued
        commit(kv, host, "s2", "b", [b"b1", b"b2", b"b3"], 9)
        await kv.drain(time.monotonic() + 5)
        assert kv.pages.get("a", "full", b"p") is None
        assert kv.counters["kv_l3_write_outdated"] == 0
        assert kv.ns_counters["a"]["kv_l3_write_pages"] == 1

    run_store(prefix, 4, "write_back", body)


def another_daemons_clear(kv: KeyedTier, prefix: str) -> None:
    """What another daemon's kv_clear of "a" leaves in the shared Redis: its generation raised."""
    raw = redis_sync.Redis.from_url(SHARED_URL)
    try:
        raw.incrby(f"{prefix}:{kv.names.gen_key('a')}", 1)
    finally:
        raw.close()


def test_a_page_stored_before_the_generation_was_read_counts_as_older_than_any_clear(
        prefix: str) -> None:
    """A page committed before this daemon has read its namespace's generation (here in the
    step of its reservation, whose read has not answered yet) is of generation 0. Another
    daemon clears since, and the page's write-back is dropped: written under the generation
    that clear raised, it would be read as newer than the clear."""
    async def body(kv: KeyedTier, host: HostTier) -> None:
        commit(kv, host, "s1", "a", [b"p"], 5)
        assert kv.pages.get("a", "full", b"p").gen == 0  # type: ignore[union-attr]
        await asyncio.sleep(0.2)
        assert kv.names.known("a") == 0  # the reservation's read
        another_daemons_clear(kv, prefix)
        commit(kv, host, "s2", "b", [b"b1", b"b2", b"b3"], 9)  # p is evicted: its write queued
        await kv.drain(time.monotonic() + 5)
        assert kv.ns_counters["a"]["kv_l3_write_outdated"] == 1
        assert kv.ns_counters["a"]["kv_l3_write_pages"] == 0
        assert await fetched(kv, [b"p"]) == 0

    run_store(prefix, 4, "write_back", body)


def test_a_lookup_reads_the_generation_for_the_pages_stored_after_it(prefix: str) -> None:
    """Redis holds generation 1, from a clear made before this daemon started. An engine looks
    its keys up before it computes and stores what is missing; the lookup reads the
    generation, so the page reserved once that read has answered is of generation 1 and
    written back (of generation 0 it would be taken for older than that clear, and dropped)."""
    async def body(kv: KeyedTier, host: HostTier) -> None:
        another_daemons_clear(kv, prefix)
        assert kv.lookup("s1", "a", "full", [b"p"], False, 1000).present == b"\x00"
        await asyncio.sleep(0.2)
        commit(kv, host, "s1", "a", [b"p"], 5)
        assert kv.pages.get("a", "full", b"p").gen == 1  # type: ignore[union-attr]
        commit(kv, host, "s2", "b", [b"b1", b"b2", b"b3"], 9)  # p is evicted: its write queued
        await kv.drain(time.monotonic() + 5)
        assert kv.ns_counters["a"]["kv_l3_write_outdated"] == 0
        assert await fetched(kv, [b"p"]) == 1

    run_store(prefix, 4, "write_back", body)


async def written_back_after_another_daemons_clear(kv: KeyedTier, host: HostTier, prefix: str,
                                                   key: bytes) -> int:
    """Another daemon clears "a"; then ``key`` is evicted here, its write queued: how many of
    it a fetch brings back (0 when its write was dropped as older than that clear)."""
    another_daemons_clear(kv, prefix)
    commit(kv, host, "s2", "b", [b"b1", b"b2", b"b3"], 9)
    await kv.drain(time.monotonic() + 5)
    return await fetched(kv, [key])


def test_what_its_own_clear_kept_is_older_than_another_daemons_clear_after_it(
        prefix: str) -> None:
    """p is pinned at this daemon's clear and q reserved while that clear is on its way to
    Redis: both are of the generation the clear raises, once it has. Another daemon clears
    after that: written under its generation, they would be read as newer than its clear (a
    review found both written, and fetched back)."""
    async def body(kv: KeyedTier, host: HostTier) -> None:
        await kv.fetch("a", "full", [b"none"], 2.0)  # the generation is known: 0
        commit(kv, host, "s1", "a", [b"p"], 5)
        pin = kv.lookup("s1", "a", "full", [b"p"], True, 64).pin
        kv.clear("a")
        r = kv.reserve("s1", "a", "full", [b"q"], 1000)
        await kv.drain(time.monotonic() + 5)
        kv.release("s1", pin)
        host.full.write_page_bytes(r.slots[0], bytes([6]) * host.full.page_nbytes)
        kv.commit("s1", r.pin)
        assert [kv.pages.get("a", "full", k).gen for k in (b"p", b"q")] == [1, 1]  # type: ignore
        assert await written_back_after_another_daemons_clear(kv, host, prefix, b"p") == 0
        assert kv.ns_counters["a"]["kv_l3_write_outdated"] == 2

    run_store(prefix, 4, "write_back", body)


def test_a_page_is_of_the_generation_known_at_its_reservation(prefix: str) -> None:
    """p is reserved (its KV computed before) while this daemon knows generation 0; another
    daemon clears; this daemon reads the new generation (a fetch) before p is committed. Of the
    generation known at its commit, p was written under the new one and fetched as newer than
    that clear (a review found it)."""
    async def body(kv: KeyedTier, host: HostTier) -> None:
        await kv.fetch("a", "full", [b"none"], 2.0)
        r = kv.reserve("s1", "a", "full", [b"p"], 1000)
        host.full.write_page_bytes(r.slots[0], bytes([5]) * host.full.page_nbytes)
        another_daemons_clear(kv, prefix)
        await kv.fetch("a", "full", [b"other"], 2.0)
        assert kv.names.known("a") == 1
        kv.commit("s1", r.pin)
        assert kv.pages.get("a", "full", b"p").gen == 0  # type: ignore[union-attr]
        commit(kv, host, "s2", "b", [b"b1", b"b2", b"b3"], 9)  # p is evicted: its write queued
        await kv.drain(time.monotonic() + 5)
        assert await fetched(kv, [b"p"]) == 0

    run_store(prefix, 4, "write_back", body)


def test_a_write_queued_while_its_own_clear_is_on_its_way_gets_that_clears_generation(
        prefix: str) -> None:
    """q is reserved while this daemon's clear is on its way to Redis, then evicted before the
    clear lands: its write waits in the queue (the writer is held up by a slow batch:
    injected). The generation the clear raised reached the pages still stored, not q's queued
    write, which another daemon's later clear then did not stop (a review found it)."""
    async def body(kv: KeyedTier, host: HostTier) -> None:
        await kv.fetch("a", "full", [b"none"], 2.0)  # the generation is known: 0
        real = kv.l3.set_pages_each  # type: ignore[union-attr]
        gate = asyncio.Event()

        async def slow(values: list[bytes]) -> list[bool | None]:
            await gate.wait()
            return await real(values)

        kv.l3.set_pages_each = slow  # type: ignore[union-attr,method-assign]
        commit(kv, host, "s2", "c", [b"c1", b"c2", b"c3", b"c4", b"c5"], 3)
        commit(kv, host, "s2", "b", [b"b0"], 4)  # c1 is evicted: the writer takes it, and waits
        await asyncio.sleep(0.05)
        assert kv.l3_queued == 0
        kv.clear("a")
        commit(kv, host, "s1", "a", [b"q"], 6)
        commit(kv, host, "s2", "b", [b"b1", b"b2", b"b3", b"b4", b"b5"], 9)  # q is evicted
        assert kv.pages.get("a", "full", b"q") is None and kv.l3_queued >= 1
        await asyncio.sleep(0.3)  # the clear lands
        assert kv.names.raised("a")
        assert [i[-1].gen for i in kv._l3_queue if i[-1].ns == "a"] == [1]
        another_daemons_clear(kv, prefix)
        gate.set()
        await kv.drain(time.monotonic() + 5)
        assert kv.ns_counters["a"]["kv_l3_write_outdated"] == 1
        assert await fetched(kv, [b"q"]) == 0

    run_store(prefix, 6, "write_back", body)
