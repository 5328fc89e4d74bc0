"""The v2 path against SGLang's own HiCacheFile (same operations, same exists/hit answers, SWA
trailing pages included), tenants and quota, and the failure model: radixd killed, then back."""

from __future__ import annotations

import signal

import torch
from conftest import GEOMETRY, MODEL, conf, extra
from radixd_sglang.testing import host_pool, storage_config
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from test_backend import backend, fill, pages_of


def hybrid(b, pages: int = 16):
    kv, swa = host_pool(pages=pages, **GEOMETRY), host_pool(pages=pages, **GEOMETRY)
    b.register_mem_pool_host(kv)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    b.register_mem_host_pool_v2(swa, PoolName.SWA)
    return kv, swa


def test_v2_answers_equal_hicachefile_swa_trailing_pages_included(make_daemon, tmp_path) -> None:
    d = make_daemon()
    ours = StorageBackendFactory.create_backend("dynamic", storage_config(extra(d)), None)
    theirs = HiCacheFile(storage_config({"file_storage_path": str(tmp_path / "f")}))
    for b in (ours, theirs):
        kv, swa = hybrid(b)
        idx, keys = fill(kv, 7, 3)
        sidx, _ = fill(swa, 7, 4)
        page = kv.page_size
        w = b.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=idx[:6 * page],
                                         keys=keys[:6])])
        assert w == {PoolName.KV: [True] * 6}
        # SWA state only for pages 0, 1, 3, 4 (as SGLang keeps only trailing windows)
        sel = [0, 1, 3, 4]
        hi = torch.cat([sidx[i * page:(i + 1) * page] for i in sel])
        w = b.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=hi,
                                         keys=[keys[i] for i in sel])])
        assert w == {PoolName.SWA: [True] * 4}
        answers = []
        for trailing in (1, 2, 3):
            t = PoolTransfer(PoolName.SWA, keys=keys[:trailing],
                             hit_policy=PoolHitPolicy.TRAILING_PAGES)
            r = b.batch_exists_v2(keys, [t])
            answers.append((r.kv_hit_pages, dict(r.extra_pool_hit_pages),
                            r.restorable_prefix_pages))
        r = b.batch_exists_v2(keys, [PoolTransfer(PoolName.SWA, keys=keys,
                                                  hit_policy=PoolHitPolicy.ALL_PAGES)])
        answers.append((r.kv_hit_pages, dict(r.extra_pool_hit_pages), r.restorable_prefix_pages))
        answers.append(b.batch_exists(keys))
        dst = swa.alloc(2 * page)
        got = b.batch_get_v2([PoolTransfer(PoolName.SWA, host_indices=dst,
                                           keys=[keys[3], keys[2]])])
        answers.append(got)
        if got[PoolName.SWA][0]:
            assert torch.equal(pages_of(swa, dst)[0], pages_of(swa, sidx)[3])
        b.answers = answers
    assert ours.answers == theirs.answers
    assert ours.answers[1] == (5, {"kv": 6, "swa": 5}, [1, 2, 5])  # trailing 2: 5 restorable
    ours.close()


def test_tenants_do_not_see_each_others_pages_and_a_quota_holds(make_daemon) -> None:
    d = make_daemon({"models": [MODEL], "tenants": [
        {"name": "a", "token": "ta", "quota_host_pages": 4}, {"name": "b", "token": "tb"}]})
    a, pa = backend(d, token="ta")
    b, pb = backend(d, token="tb")
    idx, keys = fill(pa, 6, 5)
    ok = a.batch_set_v1(keys, idx)
    assert sum(ok) == 4 and ok[:4] == [True] * 4  # the quota declines the rest: not an error
    assert a.batch_exists(keys) == 4 and b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, pb.alloc(6 * pb.page_size)) == [False] * 6
    a.close()
    b.close()


def test_radixd_killed_is_a_miss_and_it_works_again_after_restart(make_daemon) -> None:
    d = make_daemon()
    b, pool = backend(d, backoff_max_s=0.05)
    idx, keys = fill(pool, 3, 6)
    assert all(b.batch_set_v1(keys, idx))
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    d.killed = True
    dst = pool.alloc(3 * pool.page_size)
    assert b.batch_get_v1(keys, dst) == [False] * 3  # no exception into SGLang
    assert b.batch_exists(keys) == 0 and b.batch_set_v1(keys, idx) == [False] * 3
    assert b.get_stats() is not None
    d2 = conf.Daemon(d.tmp, d.config)  # the same socket path
    try:
        import time

        deadline = time.monotonic() + 10
        while not all(b.batch_set_v1(keys, idx)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.batch_get_v1(keys, dst) == [True] * 3
        assert all(torch.equal(x, y) for x, y in zip(pages_of(pool, dst), pages_of(pool, idx),
                                                     strict=True))
        b.close()
    finally:
        conf.check_and_stop([d2])


def test_radixd_killed_in_the_middle_of_a_get_is_a_miss_never_half_a_hit(make_daemon) -> None:
    """The daemon dies while the backend copies pinned pages out of its mapped host pool (the
    kill is injected between two page copies; the copy itself is the real one). The get answers
    all misses (the pin's release failed, so nothing is vouched for), raises nothing into
    SGLang, and once radixd is back the same get is a byte-exact hit."""
    d = make_daemon()
    b, pool = backend(d, backoff_max_s=0.05)
    idx, keys = fill(pool, 4, 8)
    assert all(b.batch_set_v1(keys, idx))
    view = b._views["full"]  # noqa: SLF001 - the fault goes between two real page copies
    real_load, copied = view.load, []

    def load_then_kill(page: int, slot: torch.Tensor) -> None:
        if len(copied) == 2:
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
            d.killed = True
        real_load(page, slot)
        copied.append(page)

    view.load = load_then_kill
    dst = pool.alloc(4 * pool.page_size)
    assert b.batch_get_v1(keys, dst) == [False] * 4
    assert len(copied) == 4  # the copy ran on after the kill: the mapping outlives the daemon
    view.load = real_load
    d2 = conf.Daemon(d.tmp, d.config)  # the same socket path
    try:
        import time

        deadline = time.monotonic() + 10
        while not all(b.batch_set_v1(keys, idx)) and time.monotonic() < deadline:
            time.sleep(0.05)
        dst2 = pool.alloc(4 * pool.page_size)
        assert b.batch_get_v1(keys, dst2) == [True] * 4
        assert all(torch.equal(x, y) for x, y in zip(pages_of(pool, dst2), pages_of(pool, idx),
                                                     strict=True))
        b.close()
    finally:
        conf.check_and_stop([d2])


def test_page_size_mismatch_is_refused_at_registration_naming_the_fix(make_daemon) -> None:
    import pytest

    d = make_daemon()
    pool = host_pool(pages=8, **{**GEOMETRY, "head_dim": 16})
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra(d)), pool)
    with pytest.raises(ValueError, match="head_dim = 16"):
        b.register_mem_pool_host(pool)
    with pytest.raises(ValueError, match="page_first"):
        b.register_mem_pool_host(host_pool(pages=8, layout="layer_first", **GEOMETRY))


def test_the_torchvision_stand_in_is_never_called() -> None:
    """The cache path ran in this process (the other tests): the stand-in kernels never did."""
    import pytest
    import sglang_cpu_shim
    import torchvision

    assert torchvision.__version__
    with pytest.raises(RuntimeError, match="CPU stand-in"):
        torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
    assert sglang_cpu_shim.CALLS == ["nms"]


# 64 device pages: each (layer, kv) strip of a segment whole OS pages; host pages of 512 B make
# host segments of 8 slots
ISOLATED = {**MODEL, "full_pages": 64, "swa_pages": 64, "memory_isolation": "segments"}


def test_isolated_host_pools_each_tenant_maps_only_its_segments_as_they_grow(make_daemon) -> None:
    """With memory isolation the backend's kv_attach maps only its tenant's host segments (none
    at first); storing 30 pages takes new segments, and the client maps each before the slots
    are written (host_segments_gen): another session of the tenant reads the bytes in radixd's
    memory, and the other tenant's mapping of those slots reads zeros."""
    from radixd_client import Client

    d = make_daemon({"models": [ISOLATED], "tenants": [
        {"name": "a", "token": "ta"}, {"name": "b", "token": "tb"}]})
    a, pa = backend(d, pages=64, token="ta")
    b, pb = backend(d, pages=64, token="tb")
    ia, ka = fill(pa, 30, 7)
    ib, kb = fill(pb, 30, 8)
    assert all(a.batch_set_v1(ka, ia)) and all(b.batch_set_v1(kb, ib))
    for tenant, keys, pool, idx in (("ta", ka, pa, ia), ("tb", kb, pb, ib)):
        with Client(d.socket, token=tenant) as c:  # a fresh session: radixd's own memory
            got = c.kv_lookup("m", [k.encode() + b.suffix.encode() for k in keys], pin=False)
            assert list(got.present) == [1] * 30
            mine = c.kv_attach("m")
            assert mine.generation >= 4 and len(mine.segments) >= 4
            for s, want in zip(got.slots, pages_of(pool, idx), strict=True):
                assert bytes(mine.full[s].numpy()) == bytes(want.view(torch.uint8).numpy())
            other = "tb" if tenant == "ta" else "ta"
            with Client(d.socket, token=other) as o:  # the other tenant: zeros there
                theirs = o.kv_attach("m")
                assert all(int(theirs.full[s].max()) == 0 for s in got.slots)
    dst = pa.alloc(30 * pa.page_size)
    assert a.batch_get_v1(ka, dst) == [True] * 30
    assert all(torch.equal(x, y) for x, y in zip(pages_of(pa, dst), pages_of(pa, ia),
                                                 strict=True))
    assert b.batch_exists(ka) == 0
    a.close()
    b.close()
