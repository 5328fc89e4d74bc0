"""A keyed fetch (``kv_lookup`` with ``fetch``) while Redis writes hold host slots, in process over
a real host tier and the shared Redis server: the writer's reads are taken with
``HostTier.hold``, as daemon/keyed_tier.py's writer takes them, so the test decides when each
write has read its page. The fetch waits for them within its timeout, then reads the store
again: what other sessions did meanwhile is never overwritten and never an error."""

from __future__ import annotations

import asyncio

import pytest

from daemon.keyed_tier import KeyedTier
from daemon.model_cache import ModelCache
from daemon.storage.codec import encode_page
from daemon.storage.host_tier import HostTier
from daemon.storage.keyed_pages import keyed_hash
from daemon.storage.redis_tier import RedisTier
from tests.redis_procs import SHARED_URL
from tests.test_keyed_store_model import (
    PROFILE,
    host_only_node,
    no_fresh_memory_the_second_time,
    store_of_freed_segments,
)


def store_held(host_pages: int, quotas: dict[str, int]) -> tuple[KeyedTier, HostTier, list[int]]:
    """A keyed store with pages h0, h1 and h2 of namespace "a" committed, each slot held by a
    Redis write that has not read it yet."""
    cache = ModelCache(PROFILE)
    host = HostTier(PROFILE, host_pages, 4, pin_memory=False)
    cache.host = host
    kv = KeyedTier(cache, host, quotas, "tiny")
    r = kv.reserve("s1", "a", "full", [b"h0", b"h1", b"h2"], 64)
    kv.commit("s1", r.pin)
    held = host.hold("full", list(r.slots))
    assert len(held) == 3
    return kv, host, held


async def only_in_redis(kv: KeyedTier, prefix: str, keys: list[bytes], ns: str = "a"
                        ) -> dict[bytes, bytes]:
    """Put a value for each key in Redis, as the keyed writer names and encodes it (under the
    namespace's generation as the store knows it); attach the tier to the store first if it has
    none (it writes nothing itself here: no writer runs)."""
    if kv.l3 is None:
        kv.l3 = RedisTier(SHARED_URL, key_prefix=prefix, ttl_seconds=0, op_timeout=2.0)
    gen = kv.names.known(ns) or 0
    pages = {}
    values = []
    for i, k in enumerate(keys):
        payload = bytes([i + 1]) * kv.host.full.page_nbytes
        h = keyed_hash(ns, kv.fingerprint, "full", k)
        values.append(encode_page(pool="full", page_hash=kv.names.page_id(h, gen),
                                  fingerprint=kv.fingerprint, key=k, payload=payload))
        pages[k] = payload
    assert await kv.l3.set_pages(values) == len(keys)
    return pages


def test_a_fetch_held_back_by_the_quota_waits_for_the_writes(prefix: str) -> None:
    """Namespace "a" may hold 3 host pages and holds 3 whose writes are queued: the quota's own
    oldest pages can go only once written. The fetch waits for that, then takes two of them."""
    async def run() -> None:
        kv, host, held = store_held(9, {"a": 3})
        try:
            pages = await only_in_redis(kv, prefix, [b"x", b"y"])
            asyncio.get_running_loop().call_later(0.05, host.unhold, "full", held)
            assert await kv.fetch("a", "full", [b"x", b"y"], 5.0) == 2
            got = kv.lookup("s2", "a", "full", [b"h0", b"h1", b"h2", b"x", b"y"], False, 64)
            assert got.present == b"\x00\x00\x01\x01\x01"
            for k, s in zip((b"x", b"y"), got.slots[3:], strict=True):
                assert bytes(host.full.page_bytes(s)) == pages[k]
            assert kv.check({"s1", "s2"}) == [] and host.audit({"full": set()}) == []
        finally:
            await kv.l3.aclose()  # type: ignore[union-attr]
            host.close()

    asyncio.run(run())


def test_what_other_sessions_did_during_the_wait_is_read_again(prefix: str) -> None:
    """Four usable slots: h0-h2 held, one free. While the fetch of x and y waits, another session
    stores x in the free slot. The writes never read their slots within the fetch's timeout:
    the fetch gives up, reads the store again, and places nothing (x is stored, y has no room);
    it used to place x over the other session's page or take a slot that was gone, and fail."""
    async def run() -> None:
        kv, host, held = store_held(5, {})
        try:
            await only_in_redis(kv, prefix, [b"x", b"y"])
            fetch = asyncio.create_task(kv.fetch("a", "full", [b"x", b"y"], 1.0))
            await asyncio.sleep(0.2)  # the fetch is waiting for the writes
            r = kv.reserve("s2", "a", "full", [b"x"], 64)
            assert r.slots[0]
            mine = bytes([9]) * host.full.page_nbytes
            host.full.write_page_bytes(r.slots[0], mine)
            kv.commit("s2", r.pin)
            assert await fetch == 0
            got = kv.lookup("s2", "a", "full", [b"x", b"y"], False, 64)
            assert got.present == b"\x01\x00"
            assert bytes(host.full.page_bytes(got.slots[0])) == mine
            assert kv.check({"s1", "s2"}) == []
            host.unhold("full", held)
            assert host.audit({"full": set()}) == []
        finally:
            await kv.l3.aclose()  # type: ignore[union-attr]
            host.close()

    asyncio.run(run())


def tree_copies_held(host: HostTier, cache: ModelCache, ns: str, n: int) -> list[int]:
    """``n`` one-page tree nodes of namespace ``ns``, host-only, each slot held by a write to
    Redis that has not read it yet; returns the held slots."""
    return [s for i in range(n)
            for s in host.hold("full", host_only_node(cache, host, ns, 1000 * i, 1).host)]


def host_copies(cache: ModelCache) -> int:
    return sum(1 for n in cache.tree.iter_nodes() if n.parent is not None and n.host is not None)


@pytest.mark.parametrize("segment_pages", [None, 2])
def test_a_fetch_evicts_one_queued_tree_copy_and_waits_for_its_write(
        prefix: str, segment_pages: int | None) -> None:
    """Host is full of the tree's copies of namespace "b", each queued for Redis. A fetch for
    namespace "a" evicts one: its slot (isolated: its whole segment) is room to come. Wake-ups
    by writes that free nothing evict no more; once the evicted copy's write has read it, the
    fetch takes the slot. Each copy evicted used to free nothing and make room go on until none
    was left."""
    async def run() -> None:
        cache = ModelCache(PROFILE)
        host = HostTier(PROFILE, 5, 4, pin_memory=False, segment_pages=segment_pages)
        cache.host = host
        cache.tree.host_sink = host
        kv = KeyedTier(cache, host, {}, "tiny")
        try:
            held = tree_copies_held(host, cache, "b", 4)
            pages = await only_in_redis(kv, prefix, [b"x"], ns="a")
            fetch = asyncio.create_task(kv.fetch("a", "full", [b"x"], 10.0))
            await asyncio.sleep(0.2)
            assert host_copies(cache) == 3 and not fetch.done()
            for s in held:  # writes of copies still in the tree: nothing comes free
                if host.full.refcount(s) == 2:
                    host.hold("full", (s,))
                    host.unhold("full", (s,))
                    await asyncio.sleep(0.01)
            assert host_copies(cache) == 3 and not fetch.done()
            host.unhold("full", held)
            assert await fetch == 1
            got = kv.lookup("s", "a", "full", [b"x"], False, 64)
            assert bytes(host.full.page_bytes(got.slots[0])) == pages[b"x"]
            assert host_copies(cache) == 3
            assert kv.check({"s"}) == [] and cache.check() == []
        finally:
            await kv.l3.aclose()  # type: ignore[union-attr]
            host.close()

    asyncio.run(run())


def test_a_key_whose_cleared_page_a_write_still_reads_is_a_miss_until_it_ends(
        prefix: str) -> None:
    """k0 is cleared while its Redis write still reads the slot, which stays indexed under the
    key's hash until then: a fetch of k0 meanwhile is a miss (it used to fail with an internal
    error, the hash being held), and brings it once the write is done."""
    async def run() -> None:
        kv, host, held = store_held(9, {})
        try:
            await only_in_redis(kv, prefix, [])  # (Redis attached: the clear is recorded there)
            kv.clear("a")
            assert await kv.names.wait_raised("a", 2.0)
            pages = await only_in_redis(kv, prefix, [b"h0"])  # a value written since the clear
            assert await kv.fetch("a", "full", [b"h0"], 1.0) == 0
            host.unhold("full", held)
            assert await kv.fetch("a", "full", [b"h0"], 1.0) == 1
            got = kv.lookup("s1", "a", "full", [b"h0"], False, 64)
            assert bytes(host.full.page_bytes(got.slots[0])) == pages[b"h0"]
            assert kv.check({"s1"}) == [] and host.audit({"full": set()}) == []
        finally:
            await kv.l3.aclose()  # type: ignore[union-attr]
            host.close()

    asyncio.run(run())


def test_a_fetch_whose_segment_gets_no_fresh_memory_stores_what_it_could(prefix: str) -> None:
    """Isolated host pools: a fetch's second segment cannot get a fresh memfd (EMFILE, faked
    through the allocator's ``on_assign``). The first key arrives, the rest are misses, no
    internal error, and the store stays consistent."""
    async def run() -> None:
        kv, host = store_of_freed_segments()
        try:
            pages = await only_in_redis(kv, prefix, [b"x", b"y", b"z"], ns="b")
            renew = no_fresh_memory_the_second_time(host)
            assert await kv.fetch("b", "full", [b"x", b"y", b"z"], 2.0) == 1
            renew()
            got = kv.lookup("s2", "b", "full", [b"x", b"y", b"z"], False, 64)
            assert got.present == b"\x01\x00\x00"
            assert bytes(host.full.page_bytes(got.slots[0])) == pages[b"x"]
            assert kv.stats("b")["kv_l3_fetched"] == 1
            assert kv.check({"s1", "s2"}) == [] and host.audit({"full": set(), "swa": set()}) == []
        finally:
            if kv.l3 is not None:
                await kv.l3.aclose()
            host.close()

    asyncio.run(run())
