"""Benchmark of page copies between a device pool (L1) and the host pool (L2).

Usage (from the repository root)::

    python bench/host_copy_bench.py [--quick] [--json out.json]

Profile: 32 layers, 8 KV heads, head_dim 128, bfloat16, page size 16 (``--page-size``), so one page
of all layers is 2 MiB (64 KiB per layer, K and V). A batch of 1,024 tokens (4,096 without
``--quick``) at random device page ids (as a tree's pages are scattered over the pool) is copied
into consecutive host slots (as a fresh batch gets them from the slot allocator) and back; with
``--scattered`` into host slots in random order, every slot a block of its own: the worst case,
which a churned host pool came close to at page 1 while the allocator handed recycled runs back
reversed (docs/operations.md, runs that survive churn). ``memcpy_gbps`` is a plain
``dst.copy_(src)`` of the same number of bytes between two contiguous tensors of the same memory
kind, in the same run; the ratios are the tier copy over that. ``*_call_ms`` is the time the copy
call itself takes on the calling thread (on CUDA it only enqueues the copy: that is the event loop's
share of a background copy; on CPU it is the whole copy). Each figure is the median of several
repetitions after a warm-up (which also faults every page in). On a CUDA machine the device pool is
on the GPU, the host pool pinned, and ``memcpy_gbps`` the pinned<->device copy of the same bytes
(the mean of both directions is not taken: each ratio uses its own direction).
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import hashlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench._common import write_json  # noqa: E402
from daemon.gpu.pools import KVPools  # noqa: E402
from daemon.gpu.profile import ModelProfile  # noqa: E402
from daemon.storage.copies import device_to_host, host_to_device  # noqa: E402
from daemon.storage.host_pool import HostPool  # noqa: E402

LAYOUT: dict[str, Any] = dict(page_size=16, num_full_layers=32, num_kv_heads=8, head_dim=128,
                              dtype="bfloat16")


def _time(fn: Callable[[], None], reps: int, sync: Callable[[], None]) -> tuple[float, float]:
    """Median seconds of ``fn`` until ``sync`` returns, and of the call alone."""
    fn()  # warm-up
    sync()
    times, calls = [], []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        called = time.perf_counter()
        sync()
        times.append(time.perf_counter() - start)
        calls.append(called - start)
    return statistics.median(times), statistics.median(calls)


def run(quick: bool, page_size: int = 16, scattered: bool = False) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = (1024 if quick else 4096) // page_size  # pages per copy: 128 MiB / 512 MiB
    device_pages = 2 * batch + 1
    reps = 5 if quick else 10
    profile = ModelProfile(name="bench", device=device, full_pages=device_pages,
                           **{**LAYOUT, "page_size": page_size})
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    with KVPools(profile) as kv, HostPool(profile, batch + 1, "full") as host:
        pool = kv.full
        pool.buffer.view(torch.uint8).view(-1)[:] = 1  # fault in every page
        pages = (torch.randperm(device_pages - 1, generator=gen)[:batch] + 1).tolist()
        slots = [host.store(hashlib.sha256(str(i).encode()).digest()) for i in range(batch)]
        if scattered:
            slots = [slots[i] for i in torch.randperm(batch, generator=gen).tolist()]
        nbytes = batch * host.page_nbytes
        d2h, d2h_call = _time(lambda: device_to_host(pool, pages, host, slots), reps, sync)
        h2d, h2d_call = _time(lambda: host_to_device(host, slots, pool, pages), reps, sync)
        ok = all(torch.equal(host.page(s).view(torch.uint8).cpu(),
                             pool.page(p).view(torch.uint8).cpu())
                 for s, p in zip(slots[:4], pages[:4], strict=True))
        if device == "cuda":
            src_host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
            dst_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
            memcpy_h2d = _time(lambda: dst_dev.copy_(src_host, non_blocking=True), reps, sync)[0]
            memcpy_d2h = _time(lambda: src_host.copy_(dst_dev, non_blocking=True), reps, sync)[0]
        else:
            src = torch.ones(nbytes, dtype=torch.uint8)
            dst = torch.zeros(nbytes, dtype=torch.uint8)
            memcpy_h2d = memcpy_d2h = _time(lambda: dst.copy_(src), reps, sync)[0]
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    out: dict[str, Any] = {
        "device": device,
        "host_memory": "pinned" if device == "cuda" else "memfd",
        "page_size": page_size,
        "host_slots": "scattered" if scattered else "consecutive",
        "page_bytes": host.page_nbytes,
        "batch_pages": batch,
        "batch_bytes": nbytes,
        "torch_threads": torch.get_num_threads(),
        "l1_to_l2_gbps": gbps(d2h),
        "l2_to_l1_gbps": gbps(h2d),
        "memcpy_gbps": gbps(memcpy_d2h) if device == "cpu" else gbps(min(memcpy_d2h, memcpy_h2d)),
        "memcpy_d2h_gbps": gbps(memcpy_d2h),
        "memcpy_h2d_gbps": gbps(memcpy_h2d),
        "l1_to_l2_ratio": memcpy_d2h / d2h,
        "l2_to_l1_ratio": memcpy_h2d / h2d,
        "l1_to_l2_call_ms": d2h_call * 1e3,
        "l2_to_l1_call_ms": h2d_call * 1e3,
        "verified": ok,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller batch, fewer repetitions")
    parser.add_argument("--page-size", type=int, default=16, metavar="P",
                        help="tokens per page, a divisor of 1024 (default 16)")
    parser.add_argument("--scattered", action="store_true",
                        help="host slots in random order (a churned host pool)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.page_size < 1 or 1024 % args.page_size:
        parser.error(f"--page-size must divide 1024, got {args.page_size}")
    figures = run(args.quick, args.page_size, args.scattered)
    width = max(map(len, figures))
    for key, value in figures.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    if args.json:
        write_json(args.json, figures)
    return 0 if figures["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
