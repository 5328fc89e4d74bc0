"""``AsyncClient.kv_attach`` against a real daemon: the host pools it maps are the daemon's own
memory (what a synchronous client stores there, it reads), and calls other tasks make meanwhile
wait for it and then succeed (the response carries descriptors, so it runs alone)."""

from __future__ import annotations

import asyncio
from array import array

import torch
from radixd_client import AsyncClient, Client

from .test_keyed_store import HOST, keys


def test_async_kv_attach_maps_the_daemons_host_memory(make_daemon) -> None:
    d = make_daemon({"models": [HOST]})
    with Client(d.socket) as sync:
        pools = sync.kv_attach("m")
        r = sync.kv_reserve("m", keys("k"))
        page = torch.arange(pools.page_nbytes["full"], dtype=torch.int64).remainder(251).to(
            torch.uint8)
        pools.full[r.slots[0]].copy_(page)
        sync.kv_commit("m", r.pin)

        async def run() -> None:
            c = await AsyncClient.connect(d.socket)
            probe = array("i", range(1, 9)).tobytes()
            mapped, *matches = await asyncio.gather(
                c.kv_attach("m"), *(c.match("m", probe) for _ in range(4)))
            assert all(m.prefix_len == 0 for m in matches)
            found = await c.kv_lookup("m", keys("k"))
            assert found.prefix == 1 and found.present == b"\x01"
            assert torch.equal(mapped.full[found.slots[0]], page)
            await c.kv_release("m", found.pin)
            await c.close()

        asyncio.run(run())
    d.check()


def test_async_client_maps_host_segments_its_namespace_gains(make_daemon) -> None:
    """Memory isolation: an AsyncClient's host mapping starts with no segment of the namespace;
    a lookup naming slots in segments another session filled meanwhile maps them (in place,
    before the call returns)."""
    d = make_daemon({"models": [{**HOST, "host_segment_pages": 4}]})

    async def run() -> None:
        c = await AsyncClient.connect(d.socket)
        mapped = await c.kv_attach("m")
        assert mapped.segments == {} and mapped.generation == 0
        with Client(d.socket) as sync:
            pools = sync.kv_attach("m")
            r = sync.kv_reserve("m", [b"k%d" % i for i in range(10)])
            for s in r.slots:
                pools.full[s] = s
            sync.kv_commit("m", r.pin)
        found = await c.kv_lookup("m", [b"k%d" % i for i in range(10)], pin=False)
        assert found.host_segments_gen > 0 and mapped.generation == found.host_segments_gen
        assert [int(mapped.full[s].max()) for s in found.slots] == list(found.slots)
        await c.close()

    asyncio.run(run())
    d.check()
