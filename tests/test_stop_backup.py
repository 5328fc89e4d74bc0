"""The stop before a warm restart, in process against the real service and the real Redis: the
tree's device-only nodes are copied to host (``TierManager.drain(back_up_device=True)``), and
the keyed pages that making room for them evicts still reach Redis under L3 write-back (the keyed
store drains after the tree's back-up), so the next start finds both."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from array import array
from pathlib import Path

import redis as redis_sync
from radixd_client import protocol as P

from daemon.app import build_service
from daemon.config import Config
from daemon.entities import Peer
from daemon.service import Service

PAGE = 4
REDIS_URL = "redis://127.0.0.1:6379/0"


def _service(state_dir: Path, prefix: str) -> Service:
    model = {"name": "m", "page_size": PAGE, "sliding_window": 8, "num_full_layers": 1,
             "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "float32",
             "device": "cpu", "full_pages": 64, "swa_pages": 32, "host_pages": 9,
             "host_swa_pages": 4, "host_segment_pages": 4, "write_policy": "write_back"}
    tenants = [{"name": "a", "token": "ta", "namespace": "ns-a"},
               {"name": "b", "token": "tb", "namespace": "ns-b"}]
    return build_service(Config(models=[model], tenants=tenants,
                                server={"state_dir": str(state_dir)},
                                l3={"url": REDIS_URL, "write_policy": "write_back",
                                    "key_prefix": prefix}), create_pools=True)


def _session(svc: Service, token: str) -> object:
    return svc.open_session(svc.authenticate(token, Peer(0, os.getuid(), os.getgid())), Peer())


def _checks_at_rest(svc: Service) -> list[str]:
    """The full check, then, with every session closed, the stop's check at rest (nothing
    pinned, held, reserved or read any more)."""
    violations = svc.check()
    for s in list(svc.sessions.values()):
        svc.close_session(s)
    return violations + svc.check_at_rest()


def _delete_keys(prefix: str) -> None:
    raw = redis_sync.Redis.from_url(REDIS_URL)
    found = list(raw.scan_iter(match=prefix + ":*", count=1000))
    if found:
        raw.delete(*found)
    raw.close()


def test_the_stops_back_up_keeps_tree_pages_and_the_keyed_pages_it_evicts(tmp_path: Path) -> None:
    prefix = f"radixd-test-{uuid.uuid4().hex[:12]}"
    keys = [b"b%d" % i for i in range(4)]

    async def run() -> tuple[int, list[int], list[str]]:
        svc = _service(tmp_path, prefix)
        svc.start_tiers()
        sa, sb = _session(svc, "ta"), _session(svc, "tb")
        r = svc.kv_reserve(sb, P.KvReserve(model="m", keys=keys))
        svc.kv_commit(sb, P.KvCommit(model="m", pin=r.pin))
        a = svc.alloc(sa, P.Alloc(model="m", n=8))  # write_back: device only while serving
        svc.insert(sa, P.Insert(model="m", tokens=array("i", range(1, 8 * PAGE + 1)).tobytes(),
                                full_pages=a.full_pages, swa_pages=a.swa_pages))
        await svc.stop_tiers(time.monotonic() + 5)
        host_pages = svc.models["m"].cache.tree.host_pages
        violations = svc.check()
        svc.close()
        again = _service(tmp_path, prefix)
        sb2 = _session(again, "tb")
        again.start_tiers()
        got = await again.kv_lookup_fetch(sb2, P.KvLookup(model="m", keys=keys, pin=False,
                                                           fetch=True, timeout_ms=5000))
        await again.stop_tiers(time.monotonic() + 2)
        violations += again.check()
        again.close()
        return host_pages, list(got.present), violations

    try:
        host_pages, present, violations = asyncio.run(run())
    finally:
        _delete_keys(prefix)
    assert host_pages == 8  # every device-only page of the tree went to host at the stop
    assert present == [1, 1, 1, 1]  # the keyed pages it displaced came back through Redis
    assert violations == []


def _l3_service(prefix: str) -> Service:
    """A model whose tree is written through to host and Redis (the state saved nowhere)."""
    model = {"name": "m", "page_size": PAGE, "sliding_window": 8, "num_full_layers": 1,
             "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "float32",
             "device": "cpu", "full_pages": 64, "swa_pages": 32, "host_pages": 32,
             "host_swa_pages": 16, "host_segment_pages": 4, "write_policy": "write_through"}
    return build_service(Config(models=[model], tenants=[{"name": "a", "token": "ta",
                                                          "namespace": "ns-a"}],
                                l3={"url": REDIS_URL, "write_policy": "write_through",
                                    "key_prefix": prefix}), create_pools=True)


async def _written_through(prefix: str, tokens: bytes) -> int:
    """``tokens`` inserted by a first daemon, which stops once they are in Redis; returns the
    pages it wrote."""
    first = _l3_service(prefix)
    first.start_tiers()
    sa = _session(first, "ta")
    a = first.alloc(sa, P.Alloc(model="m", n=len(tokens) // 4 // PAGE))
    first.insert(sa, P.Insert(model="m", tokens=tokens, full_pages=a.full_pages,
                              swa_pages=a.swa_pages))
    await first.stop_tiers(time.monotonic() + 5)  # host, then Redis
    written = first.models["m"].tiers.counters["l3_write_pages"]
    first.close()
    return written


def test_a_prefetch_cut_off_by_the_stop_gives_its_pins_and_slots_back(tmp_path: Path) -> None:
    """A prefetch whose Redis reads never answer outlives the stop's drain: the stop cancels it,
    and it hands back the host slots it reserved and the path it pinned before the pools close
    (and before a warm restart would save the host state)."""
    prefix = f"radixd-test-{uuid.uuid4().hex[:12]}"
    tokens = array("i", range(1, 8 * PAGE + 1)).tobytes()

    async def run() -> tuple[int, list[str], int, int, int, bool]:
        written = await _written_through(prefix, tokens)
        svc = _l3_service(prefix)
        svc.start_tiers()
        reading = asyncio.Event()
        get_pages = svc.l3.get_pages

        async def full_reads_hang(hashes, pool, *args, **kwargs):  # a Redis that stops answering
            if pool == "swa":  # (the window is read before the full pages' slots are taken)
                return await get_pages(hashes, pool, *args, **kwargs)
            reading.set()
            await asyncio.Event().wait()

        svc.l3.get_pages = full_reads_hang
        host = svc.models["m"].tiers.host
        prefetch = asyncio.create_task(svc.prefetch(_session(svc, "ta"), P.Prefetch(
            model="m", tokens=tokens, policy="wait_complete")))
        await asyncio.wait_for(reading.wait(), 5)
        taken = host.full.used
        await svc.stop_tiers(time.monotonic() + 0.2)
        await asyncio.wait((prefetch,), timeout=1)
        tree = svc.models["m"].cache.tree
        out = (written, _checks_at_rest(svc), taken, host.full.used + host.swa.used,
               len(tree.pins), prefetch.done())
        svc.close()
        return out

    try:
        written, violations, taken, used_after, pins_after, ended = asyncio.run(run())
    finally:
        _delete_keys(prefix)
    assert written == 8 + 2  # the full pages, and the SWA window (8 tokens: 2 pages)
    assert taken == 8  # the fetch had reserved a slot per page when Redis stopped answering
    assert ended and used_after == 0 and pins_after == 0
    assert violations == []


def test_a_fetch_cancelled_before_its_first_step_unpins_and_answers(tmp_path: Path) -> None:
    """The stop cancels a fetch task created in the same turn of the loop, before it ran a line:
    the host prefix its prefetch pinned is unpinned, and a best_effort prefetch answers (no pages
    started) instead of waiting forever."""
    prefix = f"radixd-test-{uuid.uuid4().hex[:12]}"
    tokens = array("i", range(1, 8 * PAGE + 1)).tobytes()

    async def run() -> tuple[int, str, int, list[str]]:
        await _written_through(prefix, tokens)
        svc = _l3_service(prefix)
        svc.start_tiers()
        s = _session(svc, "ta")
        half = tokens[: len(tokens) // 2]  # a host prefix for the fetch to pin
        b = svc.alloc(s, P.Alloc(model="m", n=4))
        svc.insert(s, P.Insert(model="m", tokens=half, full_pages=b.full_pages,
                               swa_pages=b.swa_pages))
        tree = svc.models["m"].cache.tree
        deadline = time.monotonic() + 5
        while tree.host_pages < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        prefetch = asyncio.create_task(svc.prefetch(s, P.Prefetch(
            model="m", tokens=tokens, policy="best_effort")))
        # the stop's cancel reaches the fetch task right after the prefetch created it
        stop = asyncio.create_task(svc.models["m"].tiers.aclose())
        await stop
        got = await asyncio.wait_for(prefetch, 5)
        out = (tree.host_pages, got.status, len(tree.pins), _checks_at_rest(svc))
        svc.close()
        return out

    try:
        host_pages, status, pins, violations = asyncio.run(run())
    finally:
        _delete_keys(prefix)
    assert host_pages == 4  # the prefix was on host, so the fetch had pinned it
    assert status == "none" and pins == 0 and violations == []
