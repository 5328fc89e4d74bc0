"""What SGLang 0.5.23's cache controller and scheduler rely on beyond the copies: pools whose
pages are not all in kv_buffer are refused, the scheduler's metrics call never waits behind a
radixd call and nothing is kept when SGLang does not ask for metrics, requests longer than
radixd's key limit work, and keys are SGLang's own (HiCacheFile's) under DP attention."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
from conftest import GEOMETRY, extra
from radixd_client import protocol as P
from radixd_sglang.backend import key_suffix
from radixd_sglang.testing import host_pool, storage_config
from sglang.srt.mem_cache.hicache_storage import HiCacheFile
from sglang.srt.mem_cache.pool_host.mha_mxfp8 import MHATokenToKVPoolMXFP8Host
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from test_backend import backend, fill, pages_of


def test_a_pool_keeping_page_scales_outside_kv_buffer_is_refused(make_daemon) -> None:
    """SGLang's MXFP8 host pool keeps each page's scales beside kv_buffer; storing kv_buffer
    alone would restore pages with another page's scales. The real class needs CUDA to be
    built, so a CPU pool is given its class and scale sizes: its own get_size_per_token then
    reports the scales, as on a GPU."""
    d = make_daemon()
    pool = host_pool(pages=8, **GEOMETRY)
    pool.__class__ = MHATokenToKVPoolMXFP8Host
    pool.k_sf_page_bytes = pool.v_sf_page_bytes = 16
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra(d)), pool)
    with pytest.raises(ValueError, match="MHATokenToKVPoolMXFP8Host keeps 144 B per token"):
        b.register_mem_pool_host(pool)
    b.close()


def test_get_stats_does_not_wait_for_a_radixd_call_in_flight(make_daemon) -> None:
    """SGLang's scheduler calls get_stats every step; a call stuck on radixd (here: the daemon
    stopped, the call waiting for its timeout) must not stall it."""
    d = make_daemon()
    b, pool = backend(d, timeout_s=3, backoff_max_s=0.05)
    idx, keys = fill(pool, 2, 3)
    assert all(b.batch_set_v1(keys, idx))
    d.proc.send_signal(signal.SIGSTOP)
    try:
        stuck = threading.Thread(target=b.batch_exists, args=(keys,))
        stuck.start()
        time.sleep(0.3)  # the call is on the wire
        stats = b.get_stats()
        assert stuck.is_alive()  # get_stats came back while the call still waited
        assert stats.backup_pgs == [2]
    finally:
        d.proc.send_signal(signal.SIGCONT)
    stuck.join()
    deadline = time.monotonic() + 10
    while b.batch_exists(keys) != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.batch_exists(keys) == 2
    b.close()


def test_metrics_are_kept_only_when_sglang_asks_for_them(make_daemon) -> None:
    d = make_daemon()
    pool = host_pool(pages=16, **GEOMETRY)
    quiet = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra(d), metrics=False), pool)
    quiet.register_mem_pool_host(pool)
    idx, keys = fill(pool, 3, 4)
    dst = pool.alloc(3 * pool.page_size)
    for _ in range(5):
        assert quiet.batch_set_v1(keys, idx) == [True] * 3
        assert quiet.batch_get_v1(keys, dst) == [True] * 3
    stats = quiet.get_stats()
    assert stats.backup_pgs == [] and stats.prefetch_pgs == [] and stats.prefetch_bandwidth == []
    quiet.close()


def test_a_request_longer_than_radixds_key_limit_is_split(make_daemon) -> None:
    """SGLang asks about every page of a request at once (HybridCacheController's hit query):
    at page size 1 a 70k-token prompt is more keys than one radixd request takes."""
    d = make_daemon()
    n = P.KV_MAX_KEYS + 4
    b, pool = backend(d, pages=n + 8)
    idx, keys = fill(pool, 3, 5)
    assert all(b.batch_set_v1(keys, idx))
    more = keys + [f"{i:064x}" for i in range(n - 3)]
    assert b.batch_exists(more) == 3
    dst = pool.alloc(n * pool.page_size)
    got = b.batch_get_v1(more, dst)
    assert got[:3] == [True] * 3 and not any(got[3:])
    assert all(x.equal(y) for x, y in zip(pages_of(pool, dst[:3 * pool.page_size]),
                                          pages_of(pool, idx), strict=True))
    # a set as long, over two radixd requests: radixd's host pool holds 63 pages, so most of
    # it is declined (a miss), never an error that would drop the session
    ok = b.batch_set_v1(more, dst)
    assert len(ok) == n and ok[:3] == [True] * 3 and 0 < sum(ok) < n
    b.close()


@pytest.mark.parametrize("dp_rank", [0, 1, 3])
def test_keys_are_hicachefiles_under_dp_attention(tmp_path, dp_rank: int) -> None:
    """DP attention groups hold the same KV for the same prefix: SGLang's own file backend
    names a page alike in every group, and so does this one (they share it)."""
    config = storage_config({"file_storage_path": str(tmp_path)}, tp_rank=1, tp_size=2,
                            dp_rank=dp_rank)
    assert key_suffix(config) == HiCacheFile(config).config_suffix == "_org-model_1_2"


def test_gets_and_sets_fit_a_low_lock_limit(make_daemon) -> None:
    """An operator's max_locks_per_session below a request's pages: every pinned lookup and
    reservation was refused (too_many_locks: all misses); they go in runs the limit admits,
    which hello's limits tell."""
    d = make_daemon({"server": {"max_locks_per_session": 4}})
    b, pool = backend(d, pages=24)
    idx, keys = fill(pool, 10, 11)
    assert b.batch_set_v1(keys, idx) == [True] * 10
    dst = pool.alloc(10 * pool.page_size)
    assert b.batch_get_v1(keys, dst) == [True] * 10
    assert all(x.equal(y) for x, y in zip(pages_of(pool, dst), pages_of(pool, idx), strict=True))
    b.close()


def test_requests_fit_a_low_frame_limit(make_daemon, caplog) -> None:
    """An operator's server.max_frame_bytes of 64 KiB takes about 500 keys a request: a batch
    of 1,200 went as one request, which the client refused before sending it; every call was a
    miss, and each one dropped a healthy session. They go in runs the limit admits, which hello
    tells."""
    from conftest import MODEL

    d = make_daemon({"server": {"max_frame_bytes": 64 * 1024},
                     "models": [{**MODEL, "host_pages": 1300}]})
    b, pool = backend(d, pages=2 * 1200 + 8)
    idx, keys = fill(pool, 1200, 12)
    assert b.batch_set_v1(keys, idx) == [True] * 1200
    assert b.batch_exists(keys) == 1200
    assert b.batch_exists_v2(keys, []).kv_hit_pages == 1200
    dst = pool.alloc(1200 * pool.page_size)
    assert b.batch_get_v1(keys, dst) == [True] * 1200
    assert all(x.equal(y) for x, y in zip(pages_of(pool, dst), pages_of(pool, idx), strict=True))
    b.close()
    assert "failed" not in caplog.text and "refused" not in caplog.text, caplog.text[-2000:]


def test_an_mla_pool_is_refused_as_mla_not_as_a_layout(make_daemon) -> None:
    """An MLA host pool already in page_first was refused with 'launch SGLang with
    --hicache-mem-layout page_first', the flag the operator had used; the error now says the
    backend copies MHA pools only."""
    from radixd_sglang.pages import page_view
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    layers, page, dim = 2, 4, 24
    bufs = tuple(torch.zeros(page * 2, 1, dim) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page,
        kv_lora_rank=16, qk_rope_head_dim=8, kv_cache_dim=dim, dtype=torch.float32,
        device=torch.device("cpu"))
    pool = MLATokenToKVPoolHost(
        info, host_to_device_ratio=2.0, host_size=0, page_size=page, layout="page_first",
        pin_memory=False, device="cpu", host_token_capacity=8 * page,
        device_capacity_tokens=2 * page, start_layer=0, end_layer=layers - 1,
        target_layer_num=layers)
    with pytest.raises(ValueError, match="copies only MHA host pools") as refused:
        page_view(pool)
    assert "MLA" in str(refused.value) and "--hicache-mem-layout" not in str(refused.value)


def test_a_pool_of_equal_page_bytes_but_another_layout_is_refused(make_daemon) -> None:
    """radixd's entry: float16, page 4, 2 layers, 1 head, head_dim 8 (256 B a page). A bfloat16
    pool of that geometry, or a float16 one of page 8 and 1 layer, has pages of the same bytes:
    both are refused at registration, naming the fix. They used to be accepted, and a second
    instance read the first's float16 pages as bfloat16: hits of wrong KV."""
    from conftest import MODEL

    d = make_daemon({"models": [{**MODEL, "dtype": "float16"}]})
    ok = host_pool(pages=8, dtype=torch.float16, **GEOMETRY)
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra(d)), ok)
    b.register_mem_pool_host(ok)  # the entry's own layout: accepted
    b.close()
    for pool, fix in ((host_pool(pages=8, dtype=torch.bfloat16, **GEOMETRY), "dtype = bfloat16"),
                      (host_pool(pages=8, dtype=torch.float16,
                                 **{**GEOMETRY, "layers": 1, "page_size": 8}), "page_size = 8")):
        b = StorageBackendFactory.create_backend("dynamic", storage_config(extra(d)), pool)
        with pytest.raises(ValueError, match=fix):
            b.register_mem_pool_host(pool)
        b.close()


def test_an_fp8_kv_cache_stored_as_uint8_is_an_fp8_entrys(make_daemon) -> None:
    """SGLang keeps an FP8 KV cache as uint8: such a host pool is accepted on a float8 entry
    and round-trips byte-exact; on a float16 entry the refusal names the float8 dtypes."""
    from conftest import MODEL

    d = make_daemon({"models": [{**MODEL, "dtype": "float8_e4m3fn"}]})
    pool = host_pool(pages=8, dtype=torch.uint8, **GEOMETRY)
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra(d)), pool)
    b.register_mem_pool_host(pool)
    idx = pool.alloc(3 * pool.page_size)
    pool.kv_buffer[:, idx] = torch.randint(0, 256, pool.kv_buffer[:, idx].shape,
                                           dtype=torch.uint8)
    keys = [f"{i:064x}" for i in range(3)]
    assert b.batch_set_v1(keys, idx) == [True] * 3
    dst = pool.alloc(3 * pool.page_size)
    assert b.batch_get_v1(keys, dst) == [True] * 3
    assert torch.equal(pool.kv_buffer[:, dst], pool.kv_buffer[:, idx])
    b.close()
    d16 = make_daemon({"models": [{**MODEL, "dtype": "float16", "head_dim": 4}]})
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra(d16)), pool)
    with pytest.raises(ValueError, match="dtype = float8_e4m3fn or float8_e5m2"):
        b.register_mem_pool_host(pool)
    b.close()


def test_swa_trailing_pages_past_radixds_key_limit_are_seen(make_daemon) -> None:
    """batch_exists_v2 over more keys than one radixd request takes (SGLang's hybrid hit query
    sends every page of a request at once), with SWA state kept for the last window only: the
    SWA pages are asked for in every span, not up to the first absent one as the KV prefix is.
    The whole prefix was reported unrestorable (0 KV pages)."""
    from conftest import MODEL
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    n = P.KV_MAX_KEYS + 4
    geo = {"layers": 1, "heads": 1, "head_dim": 4, "page_size": 1}
    d = make_daemon({"models": [{**MODEL, "page_size": 1, "num_full_layers": 1,
                                 "num_swa_layers": 1, "head_dim": 4, "host_pages": n + 16,
                                 "host_swa_pages": 64}]})
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra(d)), None)
    kv, swa = host_pool(pages=n + 8, **geo), host_pool(pages=16, **geo)
    b.register_mem_pool_host(kv)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    b.register_mem_host_pool_v2(swa, PoolName.SWA)
    keys = [f"{i:064x}" for i in range(n)]
    assert all(b.batch_set_v1(keys, kv.alloc(n)))
    assert b.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=swa.alloc(2),
                                        keys=keys[-2:])]) == {PoolName.SWA: [True, True]}
    r = b.batch_exists_v2(keys, [PoolTransfer(PoolName.SWA, keys=keys[-2:],
                                              hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert (r.kv_hit_pages, r.restorable_prefix_pages[-1]) == (n, n)  # as HiCacheFile answers
    b.close()
