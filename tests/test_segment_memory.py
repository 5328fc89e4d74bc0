"""A device segment handed to a namespace gets fresh memory (a new memfd); when that fails
(EMFILE, ENOMEM: a fault no real part produces on demand, injected at the pool's renewal), the
allocation that needed it is refused as out of memory, nothing it took stays taken, and a load
that needed it is a counted failure (the engine recomputes), never an internal error or a leak.
In process, over a real service with real CPU pools."""

from __future__ import annotations

import asyncio
import errno
import os
from array import array
from collections.abc import Iterator
from typing import Any

import pytest
from radixd_client import protocol as P

from daemon.app import build_service
from daemon.config import Config
from daemon.entities import Peer, Session
from daemon.service import Service, error_of

PAGE = 4
MODEL = {"name": "m", "page_size": PAGE, "sliding_window": 8, "num_full_layers": 1,
         "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "float32",
         "device": "cpu", "full_pages": 32, "swa_pages": 32, "host_pages": 32,
         "host_swa_pages": 16, "write_policy": "write_back", "memory_isolation": "segments",
         "segment_pages": 4, "host_segment_pages": 4}
TENANTS = [{"name": "a", "token": "ta", "namespace": "ns-a"},
           {"name": "b", "token": "tb", "namespace": "ns-b"}]
TOKENS = array("i", range(1, 8 * PAGE + 1)).tobytes()


@pytest.fixture
def svc() -> Iterator[Service]:
    service = build_service(Config(models=[MODEL], tenants=TENANTS), create_pools=True)
    try:
        yield service
    finally:
        service.close()


def session(svc: Service, token: str) -> Session:
    return svc.open_session(svc.authenticate(token, Peer(0, os.getuid(), os.getgid())), Peer())


def every_segment_last_served_b(svc: Service, sb: Session) -> None:
    """Tenant b takes every device segment and gives them back: the next namespace to take
    one needs fresh memory for it."""
    b = svc.alloc(sb, P.Alloc(model="m", n=31))
    svc.free(sb, P.Free(model="m", full_pages=b.full_pages, swa_pages=b.swa_pages))


def no_fresh_memory(monkeypatch: pytest.MonkeyPatch, pool: Any) -> None:
    def fail(seg: int) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(pool, "renew_segment", fail)


def free_to(svc: Service, ns: str) -> tuple[int, int]:
    a = svc.models["m"].cache.alloc_state
    return a.full.available_to(ns), a.swa.available_to(ns)


def test_an_alloc_whose_segment_gets_no_memory_is_out_of_memory_and_takes_nothing(
        svc: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    sa, sb = session(svc, "ta"), session(svc, "tb")
    every_segment_last_served_b(svc, sb)
    before = free_to(svc, "ns-a")
    no_fresh_memory(monkeypatch, svc.models["m"].pools.swa)  # the full segment is renewed
    with pytest.raises(Exception) as refused:
        svc.alloc(sa, P.Alloc(model="m", n=2))
    code, message, details = error_of(refused.value)
    assert code == P.Code.OUT_OF_MEMORY and "could not get fresh memory" in message
    assert details["segment_memory"] == 1 and details["requested"] == 2
    assert free_to(svc, "ns-a") == before and svc.check() == []
    monkeypatch.undo()
    got = svc.alloc(sa, P.Alloc(model="m", n=2))
    assert len(got.full_pages) == 2 * 4
    svc.close_session(sa)
    svc.close_session(sb)
    assert svc.check() == []


def test_a_load_whose_swa_segment_gets_no_memory_is_a_counted_failure_and_leaks_nothing(
        svc: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load took its full pages, then its SWA segment got no memory: the full pages were
    left held by nobody, for the daemon's life (a review reproduced 8 pages lost)."""
    entry = svc.models["m"]

    async def run() -> None:
        svc.start_tiers()
        sa, sb = session(svc, "ta"), session(svc, "tb")
        a = svc.alloc(sa, P.Alloc(model="m", n=8))
        svc.insert(sa, P.Insert(model="m", tokens=TOKENS, full_pages=a.full_pages,
                                swa_pages=a.swa_pages))
        svc.evict(sa, P.Evict(model="m", full_pages=8, swa_pages=8))  # write_back: demoted
        assert svc.match(sa, P.Match(model="m", tokens=TOKENS)).host_hit_len == 8 * PAGE
        every_segment_last_served_b(svc, sb)
        before = free_to(svc, "ns-a")
        failures = entry.tiers.counters["load_failures"]
        no_fresh_memory(monkeypatch, entry.pools.swa)
        res = await svc.load(sa, P.Load(model="m", tokens=TOKENS, lock=True))
        assert res.loaded_len == 0 and res.prefix_len == 0 and res.host_hit_len == 8 * PAGE
        assert entry.tiers.counters["load_failures"] == failures + 1
        assert free_to(svc, "ns-a") == before and svc.check() == []
        monkeypatch.undo()
        res = await svc.load(sa, P.Load(model="m", tokens=TOKENS, lock=True))
        assert res.loaded_len == 8 * PAGE  # the same load, once memory is there
        svc.close_session(sa)
        svc.close_session(sb)
        assert svc.check() == []
        await svc.stop_tiers(asyncio.get_running_loop().time() + 5)

    asyncio.run(run())
