"""The service (daemon/service.py) in process, without pools: what a refused request may and
may not change."""

from __future__ import annotations

import os
from array import array

import pytest

P = 4


SMALL = {"name": "m", "page_size": P, "sliding_window": 2 * P, "num_full_layers": 1,
         "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "float32",
         "device": "cpu", "full_pages": 21, "swa_pages": 21, "export_pools": False}


def _service(tenants, model=SMALL):
    from daemon.app import build_service
    from daemon.config import Config

    return build_service(Config(models=[model], tenants=tenants), create_pools=False)


def _session(svc, token):
    from daemon.entities import Peer

    return svc.open_session(svc.authenticate(token, Peer(0, os.getuid(), os.getgid())), Peer())


def _toks(n_pages: int, base: int) -> bytes:
    return array("i", range(base, base + n_pages * P)).tobytes()


def test_quota_eviction_happens_even_when_the_alloc_then_fails() -> None:
    """service.py:215-236 + 285-286: _enforce_quota evicts the tenant's cached pages before
    cache.alloc decides whether the allocation can succeed at all. When the pool cannot satisfy
    it (another tenant holds the rest), the request fails with out_of_memory but the tenant's
    cache is gone: a refused request that changed state (ModelCache.alloc itself takes care to
    'refuse before evicting anyone's cache for nothing')."""
    from daemon.gpu.allocator import OutOfPages

    # One shared pool: the setup needs the pool exactly full, which with segments depends on how
    # the namespaces' pages fall into segments (bob's alloc would evict alice's pages to empty one)
    svc = _service([{"name": "a", "token": "ta", "namespace": "na", "quota_full_pages": 10},
                    {"name": "b", "token": "tb", "namespace": "nb"}],
                   model={**SMALL, "memory_isolation": "none"})
    sa, sb = _session(svc, "ta"), _session(svc, "tb")
    cache = svc.models["m"].cache
    from radixd_client import protocol as Pr

    # alice caches 8 pages; bob holds 12 of the remaining 12: the pool (20 usable) is full
    a = svc.alloc(sa, Pr.Alloc(model="m", n=8))
    svc.insert(sa, Pr.Insert(model="m", tokens=_toks(8, 1), full_pages=a.full_pages,
                             swa_pages=a.swa_pages))
    svc.alloc(sb, Pr.Alloc(model="m", n=12))
    assert cache.tree.namespaces["na"].full_pages == 8
    # alice asks for 10: within quota only if her 8 cached pages go, and even then the pool has
    # only 8 free pages: the request must fail, and should leave her cache alone
    with pytest.raises(OutOfPages):
        svc.alloc(sa, Pr.Alloc(model="m", n=10))
    assert cache.check() == []
    assert cache.tree.namespaces["na"].full_pages == 8, (
        f"the refused alloc evicted {8 - cache.tree.namespaces['na'].full_pages} of alice's "
        "cached pages")
