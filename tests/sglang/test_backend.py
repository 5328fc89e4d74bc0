"""radixd_sglang's backend, built by SGLang's own StorageBackendFactory over SGLang's own host pool,
against a real radixd: zero-copy v1 get/set byte-exact, shared between two instances (two
processes), tenants, the v2 SWA policy against SGLang's HiCacheFile, and the failure model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from conftest import GEOMETRY, extra
from radixd_sglang.testing import host_pool, storage_config
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

HERE = Path(__file__).resolve().parent


def backend(daemon, pages: int = 16, **kw):
    pool = host_pool(pages=pages, **GEOMETRY)
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra(daemon, **kw)), pool)
    b.register_mem_pool_host(pool)
    return b, pool


def fill(pool, n: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """n random pages in fresh host slots; returns their token indices and their keys."""
    idx = pool.alloc(n * pool.page_size)
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        t = int(idx[i * pool.page_size])
        pool.kv_buffer[:, t:t + pool.page_size] = torch.randn(
            pool.kv_buffer[:, t:t + pool.page_size].shape, generator=g)
    return idx, [f"{seed:04x}{i:060x}" for i in range(n)]


def pages_of(pool, idx) -> list[torch.Tensor]:
    return [pool.get_data_page(int(idx[i]), flat=True).clone()
            for i in range(0, idx.numel(), pool.page_size)]


def test_factory_builds_it_and_v1_round_trip_is_byte_exact(make_daemon) -> None:
    d = make_daemon()
    b, pool = backend(d)
    assert type(b).__name__ == "RadixdHiCacheStorage"
    idx, keys = fill(pool, 5, 1)
    assert b.batch_exists(keys) == 0 and not b.exists(keys[0])
    assert b.batch_set_v1(keys[:3], idx[:3 * pool.page_size]) == [True] * 3
    assert b.batch_exists(keys) == 3 and b.exists(keys[2]) and not b.exists(keys[3])
    dst = pool.alloc(5 * pool.page_size)
    assert b.batch_get_v1(keys, dst) == [True, True, True, False, False]
    for got, want in zip(pages_of(pool, dst)[:3], pages_of(pool, idx)[:3], strict=True):
        assert torch.equal(got, want)
    # storing again is a success with nothing to write
    assert b.batch_set_v1(keys[:3], idx[:3 * pool.page_size]) == [True] * 3
    stats = b.get_stats()
    assert stats.backup_pgs == [3, 3] and stats.prefetch_pgs == [3]
    assert b.get_stats().backup_pgs == []
    assert b.clear() is True and b.batch_exists(keys) == 0
    b.close()


def test_two_processes_share_a_prefix_byte_exact(make_daemon, tmp_path: Path) -> None:
    d = make_daemon()
    a, pool = backend(d)
    idx, keys = fill(pool, 6, 7)
    assert all(a.batch_set_v1(keys, idx))
    want = torch.stack(pages_of(pool, idx))
    torch.save({"keys": keys, "want": want}, tmp_path / "want.pt")
    out = subprocess.run(
        [sys.executable, str(HERE / "instance_b.py"), d.socket, str(tmp_path / "want.pt")],
        capture_output=True, text=True, timeout=120, cwd=HERE.parents[1])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "B: 6 pages found, 6 fetched, byte-exact" in out.stdout
