"""SGLang HiCache storage through radixd: instance A stores a prefix, instance B finds and fetches
it; GB/s for set and get against memcpy of the same bytes and against SGLang's own HiCacheFile on
/dev/shm, all in the same run, with the ratios.

Usage (in .venv-sglang, built by scripts/_env.sh radixd_sglang_venv; from the repository root)::

    .venv-sglang/bin/python bench/sglang_bench.py [--tokens 4096] [--reps 3]

Geometry: 36 layers, 8 KV heads, head dim 128, bf16, page 64 (9 MiB a page, K and V), SGLang's
real ``MHATokenToKVPoolHost`` (page_first) on the CPU and a real radixd. 32k tokens is ~4.7 GB a
copy; the default 4096 tokens (~604 MB) fits a shared 24 GB machine. Each figure is the best of
``--reps`` runs (the keys are cleared between runs so every set really writes). Goals (issue 12):
>= 0.8 of memcpy, >= 2x HiCacheFile.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (_ROOT, *(os.path.join(_ROOT, "clients", c) for c in ("python", "sglang"))):
    if p not in sys.path:
        sys.path.insert(0, p)

import argparse  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from radixd_sglang.testing import host_pool, storage_config  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from bench._common import DaemonProcess  # noqa: E402

GEO = {"layers": 36, "heads": 8, "head_dim": 128, "page_size": 64}

# One model of GEO's geometry: the backend uses its host pool only (``host_pages``, one a page).
CONFIG = """\
log_level = "warning"
[server]
socket = "{{socket}}"
[admin]
enabled = false
[checker]
interval_s = 60.0
[[models]]
name = "m"
page_size = {page_size}
sliding_window = 0
num_full_layers = {layers}
num_kv_heads = {heads}
head_dim = {head_dim}
dtype = "bfloat16"
device = "cpu"
full_pages = 2
swa_pages = 0
host_pages = {host_pages}
host_swa_pages = 0
"""


def best(fn, reps: int, before=None) -> float:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def memcpy_gbps(nbytes: int, reps: int) -> float:
    """The baseline: one contiguous copy of the same bytes (both buffers faulted in first)."""
    a = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    b = a.clone()
    return nbytes / best(lambda: b.copy_(a), reps) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for every copy, the baseline's included (on the "
                         "2 shared cores here, torch's threaded copy is several times slower)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pages = args.tokens // GEO["page_size"]
    pool_a = host_pool(pages=pages + 1, dtype=torch.bfloat16, **GEO)
    pool_b = host_pool(pages=pages + 1, dtype=torch.bfloat16, **GEO)
    src = pool_a.alloc(pages * GEO["page_size"])
    dst = pool_b.alloc(pages * GEO["page_size"])
    pool_a.kv_buffer.view(torch.int16).random_()
    keys = [f"{i:064x}" for i in range(pages)]
    page_nbytes = 2 * GEO["page_size"] * GEO["layers"] * GEO["heads"] * GEO["head_dim"] * 2
    nbytes = pages * page_nbytes

    memcpy = memcpy_gbps(nbytes, args.reps)

    daemon = DaemonProcess(CONFIG.format(host_pages=pages + 8, **GEO))
    try:
        extra = {"backend_name": "radixd", "module_path": "radixd_sglang",
                 "class_name": "RadixdHiCacheStorage", "interface_v1": 1,
                 "socket": daemon.socket, "model": "m", "timeout_s": 60}
        inst_a = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool_a)
        inst_a.register_mem_pool_host(pool_a)
        inst_b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool_b)
        inst_b.register_mem_pool_host(pool_b)
        r_set = nbytes / best(lambda: inst_a.batch_set_v1(keys, src), args.reps,
                              before=inst_a.clear) / 1e9
        assert inst_b.batch_exists(keys) == pages
        r_get = nbytes / best(lambda: inst_b.batch_get_v1(keys, dst), args.reps) / 1e9
        assert torch.equal(pool_b.kv_buffer.view(torch.int16)[:, dst],
                           pool_a.kv_buffer.view(torch.int16)[:, src]), "not byte-exact"
        inst_a.close()
        inst_b.close()
    finally:
        daemon.stop()

    shm = Path(tempfile.mkdtemp(prefix="radixd-sglang-bench-", dir="/dev/shm"))
    try:
        files = []
        for pool in (pool_a, pool_b):
            f = HiCacheFile(storage_config({"file_storage_path": str(shm)}))
            f.register_mem_pool_host(pool)
            f.register_mem_host_pool_v2(pool, PoolName.KV)
            files.append(f)

        def clear_shm() -> None:
            for p in shm.iterdir():
                p.unlink()
            files[0]._evictor.clear()  # noqa: SLF001 - SGLang's own bookkeeping of the files

        f_set = nbytes / best(lambda: files[0].batch_set_v2(
            [PoolTransfer(PoolName.KV, host_indices=src, keys=keys)]), args.reps,
            before=clear_shm) / 1e9
        f_get = nbytes / best(lambda: files[1].batch_get_v2(
            [PoolTransfer(PoolName.KV, host_indices=dst, keys=keys)]), args.reps) / 1e9
    finally:
        shutil.rmtree(shm, ignore_errors=True)

    print(f"tokens {pages * GEO['page_size']} ({pages} pages of {page_nbytes} B, "
          f"{nbytes / 1e6:.0f} MB a copy), best of {args.reps}, {args.threads} torch thread(s)")
    print(f"memcpy               {memcpy:7.2f} GB/s")
    print(f"radixd set (A)       {r_set:7.2f} GB/s  {r_set / memcpy:5.2f}x memcpy  "
          f"{r_set / f_set:5.2f}x HiCacheFile")
    print(f"radixd get (B)       {r_get:7.2f} GB/s  {r_get / memcpy:5.2f}x memcpy  "
          f"{r_get / f_get:5.2f}x HiCacheFile")
    print(f"HiCacheFile set/get  {f_set:7.2f} / {f_get:.2f} GB/s (/dev/shm)")


if __name__ == "__main__":
    main()
