"""KVPools: layout, shared memory a second process can map, lifetime, size checks, CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from daemon.gpu.pools import POOL_LAYOUT, KVPools, Pool, PoolError, map_pool_fd
from daemon.gpu.profile import DTYPE_ITEMSIZE, ModelProfile

REPO_ROOT = Path(__file__).resolve().parents[2]


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
        full_pages=6,
        swa_pages=4,
    )
    fields.update(overrides)
    return ModelProfile(**fields)


@pytest.fixture
def pools() -> Any:
    with KVPools(make_profile()) as kv:
        yield kv


def _maps_mention(name: str) -> bool:
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        return any(f"/memfd:{name}" in line for line in f)


# -- layout ------------------------------------------------------------------------------------


def test_shapes_dtype_and_size(pools: KVPools) -> None:
    p = pools.profile
    assert pools.full.buffer.shape == (3, 2, 6, 4, 2, 8)
    assert pools.swa is not None
    assert pools.swa.buffer.shape == (2, 2, 4, 4, 2, 8)
    for pool, size in ((pools.full, p.full_pool_bytes), (pools.swa, p.swa_pool_bytes)):
        assert pool.buffer.dtype == torch.bfloat16
        assert pool.buffer.device.type == "cpu"
        assert pool.buffer.is_contiguous()
        assert pool.nbytes == size == pool.buffer.numel() * 2


def test_per_layer_views_are_contiguous_page_major_and_disjoint(pools: KVPools) -> None:
    pool = pools.full
    base = pool.buffer.data_ptr()
    per_kv = 6 * 4 * 2 * 8 * 2  # pages * page_size * heads * head_dim * itemsize
    for layer in range(3):
        k, v = pool.k(layer), pool.v(layer)
        assert k.shape == v.shape == (6, 4, 2, 8)
        assert k.is_contiguous() and v.is_contiguous()
        assert k.data_ptr() == base + (2 * layer) * per_kv
        assert v.data_ptr() == base + (2 * layer + 1) * per_kv
    # A write through a view lands at exactly one place of the whole buffer.
    pool.v(2)[5, 3, 1, 7] = 3.0
    assert pool.buffer[2, 1, 5, 3, 1, 7].item() == 3.0
    assert int((pool.buffer != 0).sum()) == 1


def test_layer_and_page_bounds(pools: KVPools) -> None:
    with pytest.raises(PoolError, match=r"^layer: 3 out of range .*3 layers"):
        pools.full.k(3)
    with pytest.raises(PoolError, match=r"^layer: -1 out of range"):
        pools.full.v(-1)
    with pytest.raises(PoolError, match=r"^page_id: 4 out of range for the swa pool \(4 pages\)"):
        pools.page_view("swa", 4)


def test_page_view_matches_layer_views(pools: KVPools) -> None:
    views = pools.page_view("full", 3)
    assert len(views) == 3
    for layer, (k, v) in enumerate(views):
        k.fill_(layer + 1)
        v.fill_(-(layer + 1))
        assert torch.equal(pools.full.k(layer)[3], k)
        assert bool((pools.full.k(layer)[3] == layer + 1).all())
        assert bool((pools.full.v(layer)[3] == -(layer + 1)).all())
    # Other pages are untouched.
    assert int(pools.full.buffer[:, :, [0, 1, 2, 4, 5]].count_nonzero()) == 0
    assert len(pools.page_view("swa", 1)) == 2


def test_unknown_pool_kind(pools: KVPools) -> None:
    with pytest.raises(PoolError, match=r"^pool: tiny has no 'bogus' pool"):
        pools.pool("bogus")


def test_no_swa_pool_without_swa_layers() -> None:
    profile = make_profile(sliding_window=None, num_swa_layers=0, swa_pages=0)
    with KVPools(profile) as kv:
        assert kv.swa is None
        assert kv.pools() == (kv.full,)
        assert kv.describe()["swa"] is None
        with pytest.raises(PoolError, match=r"has no 'swa' pool"):
            kv.pool("swa")


def test_padding_page_is_zero(pools: KVPools) -> None:
    for pool in pools.pools():
        assert int(pool.buffer[:, :, 0].count_nonzero()) == 0


@pytest.mark.parametrize("dtype", sorted(DTYPE_ITEMSIZE))
def test_every_dtype_stores_values(dtype: str) -> None:
    with KVPools(make_profile(dtype=dtype)) as kv:
        assert kv.full.buffer.dtype == getattr(torch, dtype)
        assert kv.full.nbytes == kv.full.buffer.numel() * DTYPE_ITEMSIZE[dtype]
        kv.full.k(1)[2, 3, 1, 4] = 1.5  # exactly representable in every supported dtype
        mapped = map_pool_fd(kv.full.fd, kv.full.describe())  # type: ignore[arg-type]
        assert mapped.dtype == kv.full.buffer.dtype
        assert mapped[1, 0, 2, 3, 1, 4].float().item() == 1.5


# -- shared memory -----------------------------------------------------------------------------


def test_cpu_pool_lives_in_a_sealed_cloexec_memfd(pools: KVPools) -> None:
    fd = pools.full.fd
    assert fd is not None
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:radixd-tiny-full")
    assert pools.swa is not None and pools.swa.fd is not None
    assert os.readlink(f"/proc/self/fd/{pools.swa.fd}").startswith("/memfd:radixd-tiny-swa")
    assert os.fstat(fd).st_size == pools.full.nbytes
    assert not os.get_inheritable(fd)
    # Sealed: a client holding the fd cannot shrink it under the daemon's mapping (SIGBUS).
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, pools.full.nbytes * 2)


def test_tensor_memory_is_the_memfd(pools: KVPools) -> None:
    pool = pools.full
    pool.k(1)[4] = torch.arange(4 * 2 * 8, dtype=torch.bfloat16).view(4, 2, 8)
    page_bytes = 4 * 2 * 8 * 2
    offset = (2 * 1 * 6 + 4) * page_bytes  # layer 1, K, page 4
    assert pool.fd is not None
    on_disk = os.pread(pool.fd, page_bytes, offset)
    assert on_disk == pool.k(1)[4].contiguous().view(torch.uint8).numpy().tobytes()
    assert on_disk != bytes(page_bytes)


def test_describe_is_json_and_complete(pools: KVPools) -> None:
    d = json.loads(json.dumps(pools.describe()))
    assert d["model"] == "tiny"
    full = d["full"]
    assert full["kind"] == "full" and full["storage"] == "memfd" and full["device"] == "cpu"
    assert full["dtype"] == "bfloat16"
    assert full["shape"] == [3, 2, 6, 4, 2, 8]
    assert full["strides"] == list(pools.full.buffer.stride())
    assert full["nbytes"] == pools.full.nbytes
    assert full["num_layers"] == 3 and full["num_pages"] == 6 and full["page_size"] == 4
    assert full["layout"] == list(POOL_LAYOUT)
    assert full["layout_fingerprint"] == pools.profile.layout_fingerprint().hex()
    assert d["swa"]["shape"] == [2, 2, 4, 4, 2, 8] and d["swa"]["num_layers"] == 2


def test_map_pool_fd_in_process_shares_memory(pools: KVPools) -> None:
    assert pools.swa is not None and pools.swa.fd is not None
    mapped = map_pool_fd(pools.swa.fd, pools.swa.describe())
    assert mapped.shape == pools.swa.buffer.shape
    assert mapped.data_ptr() != pools.swa.buffer.data_ptr()  # a second mapping...
    mapped[1, 1, 3].fill_(7)
    assert bool((pools.swa.v(1)[3] == 7).all())  # ...of the same memory
    pools.swa.k(0)[2].fill_(-2)
    assert bool((mapped[0, 0, 2] == -2).all())


_CHILD = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from daemon.gpu.pools import map_pool_fd

    fd, desc = int(sys.argv[1]), json.loads(sys.argv[2])
    pool = map_pool_fd(fd, desc)
    os.close(fd)  # the mapping outlives the fd
    seen = pool[2, 0, 3].float().sum().item()          # what the parent wrote
    pool[1, 1, 5] = torch.full(pool.shape[3:], 0.25, dtype=pool.dtype)  # layer 1, V, page 5
    print(json.dumps({"seen": seen, "shape": list(pool.shape)}))
    """
)


def test_another_process_maps_the_pool() -> None:
    with KVPools(make_profile(dtype="float16")) as kv:
        pool = kv.full
        assert pool.fd is not None
        pool.k(2)[3] = 2.0
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get(
            "PYTHONPATH", "")])}
        result = subprocess.run(
            [sys.executable, "-c", _CHILD, str(pool.fd), json.dumps(pool.describe())],
            pass_fds=(pool.fd,),
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["seen"] == 2.0 * 4 * 2 * 8
        assert report["shape"] == [3, 2, 6, 4, 2, 8]
        assert bool((pool.v(1)[5] == 0.25).all())
        # Nothing else changed: the child wrote exactly one page.
        assert int(pool.buffer.count_nonzero()) == 2 * (4 * 2 * 8)


def test_map_pool_fd_validates_description(pools: KVPools) -> None:
    fd = pools.full.fd
    assert fd is not None
    good = pools.full.describe()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"version": 99}, r"^description\.version: "),
        ({"storage": "cuda"}, r"^description\.storage: "),
        ({"dtype": "int8"}, r"^description\.dtype: unsupported 'int8'"),
        ({"shape": [3, 2, 6, 4, 2]}, r"^description\.shape: "),
        ({"shape": [3, 2, 6, 4, 2, 0]}, r"^description\.shape: "),
        ({"strides": [1, 1, 1, 1, 1, 1]}, r"^description\.strides: "),
        ({"nbytes": good["nbytes"] - 2}, r"^description\.nbytes: .*does not match"),
        # Claims more memory than the fd holds: refused instead of SIGBUS on first access.
        ({"shape": [3, 2, 12, 4, 2, 8], "strides": [1536, 768, 64, 16, 8, 1],
          "nbytes": good["nbytes"] * 2}, r"^description\.nbytes: .*fd only holds"),
    ]
    for change, pattern in cases:
        with pytest.raises(PoolError, match=pattern):
            map_pool_fd(fd, {**good, **change})
    with pytest.raises(PoolError, match=r"^description: expected a mapping"):
        map_pool_fd(fd, [1, 2])  # type: ignore[arg-type]


# -- lifetime ----------------------------------------------------------------------------------


def test_close_releases_fd_and_mapping() -> None:
    kv = KVPools(make_profile(name="closeme"))
    fds = [pool.fd for pool in kv.pools()]
    assert _maps_mention("radixd-closeme-full")
    kv.close()
    assert kv.closed and kv.full.closed and kv.full.fd is None
    for fd in fds:
        assert fd is not None
        with pytest.raises(OSError):
            os.fstat(fd)
    assert not _maps_mention("radixd-closeme-full")
    assert not _maps_mention("radixd-closeme-swa")
    with pytest.raises(PoolError, match=r"closeme full pool is closed"):
        kv.full.k(0)
    kv.close()  # idempotent


def test_view_held_past_close_stays_valid() -> None:
    kv = KVPools(make_profile(name="heldview"))
    view = kv.full.k(1)
    view[2].fill_(5)
    kv.close()
    # The mapping is not pulled out from under a live view (that would crash on access).
    assert bool((view[2] == 5).all())
    assert _maps_mention("radixd-heldview-full")
    del view
    assert not _maps_mention("radixd-heldview-full")


def test_context_manager_closes() -> None:
    with KVPools(make_profile()) as kv:
        fd = kv.full.fd
        assert fd is not None
    assert kv.closed
    with pytest.raises(OSError):
        os.fstat(fd)


def test_unclosed_pool_does_not_leak_its_fd() -> None:
    pool = Pool(make_profile(name="leaky"), "full", torch.device("cpu"))
    fd = pool.fd
    assert fd is not None
    del pool
    with pytest.raises(OSError):
        os.fstat(fd)


def test_too_large_is_refused_before_allocating() -> None:
    probe = make_profile(head_dim=128, num_full_layers=64)
    pages = (1 << 50) // probe.full_page_bytes  # a petabyte: more than any host has
    profile = make_profile(head_dim=128, num_full_layers=64, full_pages=pages)
    with pytest.raises(PoolError, match=r"^tiny: pools need \d+ bytes \(full: \d+ pages x") as e:
        KVPools(profile)
    assert "full_pages" in str(e.value)


def test_pool_kind_is_validated() -> None:
    with pytest.raises(ValueError, match=r"^kind: expected one of"):
        Pool(make_profile(), "l2", torch.device("cpu"))
    no_swa = make_profile(sliding_window=None, num_swa_layers=0, swa_pages=0)
    with pytest.raises(PoolError, match=r"^tiny: the model has no swa pool"):
        Pool(no_swa, "swa", torch.device("cpu"))


# -- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_pools() -> None:
    profile = make_profile(device="cuda:0", full_pages=64, swa_pages=32)
    # Dirty the caching allocator first, so an unzeroed padding page would show.
    junk = torch.full((profile.full_pool_bytes,), 0x7F, dtype=torch.uint8, device="cuda:0")
    del junk
    with KVPools(profile) as kv:
        for pool in kv.pools():
            assert pool.fd is None
            assert pool.buffer.device == torch.device("cuda", 0)
            assert pool.buffer.is_contiguous()
            assert int(pool.buffer[:, :, 0].count_nonzero()) == 0
            assert pool.k(1).is_contiguous() and pool.k(1).shape == pool.buffer.shape[2:]
            d = json.loads(json.dumps(pool.describe()))
            assert d["storage"] == "cuda" and d["device"] == "cuda:0"
            pool.v(1)[3] = 1.0
            assert bool((pool.buffer[1, 1, 3] == 1).all())
        with pytest.raises(PoolError, match=r"description\.storage"):
            map_pool_fd(0, kv.full.describe())
