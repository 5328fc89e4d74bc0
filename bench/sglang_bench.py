"""SGLang HiCache storage through radixd: instance A stores a prefix, instance B finds and fetches
it; GB/s for set and get against memcpy of the same bytes and against SGLang's own HiCacheFile on
/dev/shm, all in the same run, with the ratios.

Usage (in .venv-sglang, built by scripts/_env.sh radixd_sglang_venv; from the repository root)::

    .venv-sglang/bin/python bench/sglang_bench.py [--tokens 32768] [--reps 3] [--copy-threads N]

Geometry: 36 layers, 8 KV heads, head dim 128, bf16, page 64 (9 MiB a page, K and V), SGLang's
real ``MHATokenToKVPoolHost`` (page_first) on the CPU and a real radixd. 32768 tokens is 4.8 GB a
copy. The run is phased so that at most three copies are resident at once: A's and B's SGLang
host pools throughout; radixd's host pool during the radixd phase (the daemon is stopped and its
memory given back before the next phase); HiCacheFile's files on /dev/shm during the last phase.
memcpy copies between the same two pools (no extra buffers). It refuses to start when the machine
has too little memory available for that.

The radixd backend copies on 1 thread and then on ``--copy-threads`` threads (its
``copy_threads`` setting): each row is compared with memcpy on as many threads, so a threaded
figure is never flattered by a single-threaded baseline. HiCacheFile is SGLang's own (one thread).
Every rep of every operation is timed right after a memcpy (see ``Timings``): GB/s are the best
of ``--reps``, ratios the median of the paired ratios (keys are cleared before each set, so every
set writes). Goals (issue 12): >= 0.8 of memcpy, >= 2x HiCacheFile.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (_ROOT, *(os.path.join(_ROOT, "clients", c) for c in ("python", "sglang"))):
    if p not in sys.path:
        sys.path.insert(0, p)

import argparse  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from radixd_sglang.copier import DEFAULT_MAX_THREADS, usable_cpus  # noqa: E402
from radixd_sglang.testing import host_pool, storage_config  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from bench._common import DaemonProcess, write_json  # noqa: E402

GEO = {"layers": 36, "heads": 8, "head_dim": 128, "page_size": 64}
HEADROOM = 1.5e9  # the interpreters, torch, the daemon's own memory

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


def mem_available() -> float:
    """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024.0
    return float("inf")


class Timings:
    """Each operation's times, each beside the memcpy times taken right before it.

    The speed of the shared development machine changes by 2x from one second to the next
    (other work on the two cores and on the memory bus), so comparing best-of figures taken
    seconds or phases apart compares the machine's moods. Each rep of an operation is timed right
    after a 1-thread memcpy and a memcpy on the operation's thread count, and a ratio is the
    median over reps of the paired ratios; the GB/s are the best reps."""

    def __init__(self, nbytes: int, span: Span, tp: ThreadPoolExecutor) -> None:
        self.nbytes, self.span, self.tp = nbytes, span, tp
        self.t: dict[str, list[float]] = {}

    def _time(self, name: str, fn: Callable[[], Any]) -> None:
        t = time.perf_counter()
        fn()
        self.t.setdefault(name, []).append(time.perf_counter() - t)

    def paired(self, name: str, threads: int, fn: Callable[[], Any]) -> None:
        for n in sorted({1, threads}):
            self._time(f"{name}@memcpy_{n}", lambda n=n: self.span.memcpy(n, self.tp))
            self.t.setdefault(f"memcpy_{n}", []).append(self.t[f"{name}@memcpy_{n}"][-1])
        self._time(name, fn)

    def gbps(self, name: str) -> float:
        return self.nbytes / min(self.t[name]) / 1e9

    def x_memcpy(self, name: str, threads: int) -> float:
        """Median over reps of (memcpy time on ``threads`` threads / this operation's time)."""
        return statistics.median(
            m / t for m, t in zip(self.t[f"{name}@memcpy_{threads}"], self.t[name], strict=True))


class Span:
    """A run of pages at the same token offset in two SGLang host pools (page_first): the K
    block and the V block of the run are each one contiguous range of bytes in each pool."""

    def __init__(self, pool_a: Any, pool_b: Any, tokens: int) -> None:
        self.src = pool_a.alloc(tokens)
        self.dst = pool_b.alloc(tokens)
        for idx in (self.src, self.dst):
            first = int(idx[0])
            if not torch.equal(idx, torch.arange(first, first + tokens, dtype=idx.dtype)):
                raise RuntimeError("SGLang's allocator gave non-contiguous pages")
        s, d = int(self.src[0]), int(self.dst[0])
        self.a = [pool_a.kv_buffer[kv, s:s + tokens].view(torch.int16) for kv in (0, 1)]
        self.b = [pool_b.kv_buffer[kv, d:d + tokens].view(torch.int16) for kv in (0, 1)]
        self.page = pool_a.page_size
        self.page_nbytes = 2 * self.a[0][:self.page].numel() * 2

    def memcpy(self, threads: int, pool: ThreadPoolExecutor | None) -> None:
        """B's bytes <- A's bytes: the K block and the V block, each cut into ``threads`` runs of
        whole pages (the same cut the backend makes), each run one contiguous copy."""
        runs = []
        for a, b in zip(self.a, self.b, strict=True):
            pages = a.shape[0] // self.page
            for i in range(threads):
                lo = pages * i // threads * self.page
                hi = pages * (i + 1) // threads * self.page
                runs.append((a[lo:hi], b[lo:hi]))
        if threads == 1 or pool is None:
            for a, b in runs:
                b.copy_(a)
            return
        list(pool.map(lambda ab: ab[1].copy_(ab[0]), runs))

    def zero_b(self) -> None:
        for b in self.b:
            b.zero_()

    def check(self, what: str) -> None:
        """B holds A's bytes, page by page (no big temporaries: the machine is full)."""
        for a, b in zip(self.a, self.b, strict=True):
            for lo in range(0, a.shape[0], self.page):
                if not torch.equal(a[lo:lo + self.page], b[lo:lo + self.page]):
                    raise AssertionError(f"{what}: not byte-exact at token {lo}")


def radixd_phase(span: Span, pool_a: Any, pool_b: Any, keys: list[str], tm: Timings,
                 threads: list[int], reps: int) -> None:
    """Set from A, exists and get into B, on each number of copy threads, each rep beside a
    memcpy on as many threads; radixd's host pool is resident only during this phase."""
    daemon = DaemonProcess(CONFIG.format(host_pages=len(keys) + 8, **GEO))
    insts = []
    try:
        for n in threads:
            extra = {"backend_name": "radixd", "module_path": "radixd_sglang",
                     "class_name": "RadixdHiCacheStorage", "interface_v1": 1,
                     "socket": daemon.socket, "model": "m", "timeout_s": 120,
                     "copy_threads": n}
            a = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool_a)
            a.register_mem_pool_host(pool_a)
            b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool_b)
            b.register_mem_pool_host(pool_b)
            insts += [a, b]
            for _ in range(reps):
                a.clear()
                tm.paired(f"radixd_set_{n}", n, lambda a=a: a.batch_set_v1(keys, span.src))
                t = time.perf_counter()
                if b.batch_exists(keys) != len(keys):
                    raise AssertionError("B does not find the prefix A stored")
                tm.t.setdefault("exists", []).append(time.perf_counter() - t)
                span.zero_b()
                tm.paired(f"radixd_get_{n}", n, lambda b=b: b.batch_get_v1(keys, span.dst))
                span.check(f"radixd get, {n} copy thread(s)")
    finally:
        for inst in insts:
            inst.close()
        daemon.stop()


def file_phase(span: Span, pool_a: Any, pool_b: Any, keys: list[str], tm: Timings,
               reps: int) -> None:
    """SGLang's HiCacheFile on /dev/shm: A's instance writes the files, B's reads them."""
    shm = Path(tempfile.mkdtemp(prefix="radixd-sglang-bench-", dir="/dev/shm"))
    try:
        need = len(keys) * span.page_nbytes * 1.05
        if shutil.disk_usage(shm).free < need:
            raise SystemExit(f"/dev/shm has {shutil.disk_usage(shm).free / 1e9:.1f} GB free, "
                             f"HiCacheFile needs {need / 1e9:.1f} GB")
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

        for _ in range(reps):
            clear_shm()
            tm.paired("file_set", 1, lambda: files[0].batch_set_v2(
                [PoolTransfer(PoolName.KV, host_indices=span.src, keys=keys)]))
            span.zero_b()
            tm.paired("file_get", 1, lambda: files[1].batch_get_v2(
                [PoolTransfer(PoolName.KV, host_indices=span.dst, keys=keys)]))
            span.check("HiCacheFile get")
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copy-threads", type=int,
                    default=max(2, min(DEFAULT_MAX_THREADS, usable_cpus())),
                    help="the backend's copy_threads for the threaded rows, and the threads of "
                         "the threaded memcpy (default: min(4, CPUs), at least 2)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads inside each copy, the baselines' included (on "
                         "the 2 shared cores here, torch's threaded copy is several times slower)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    # a SIGTERM unwinds like an error: the daemon stops and /dev/shm is cleaned up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(args.threads)
    threads = sorted({1, args.copy_threads})
    page_tokens = GEO["page_size"]
    pages = args.tokens // page_tokens
    page_nbytes = 2 * page_tokens * GEO["layers"] * GEO["heads"] * GEO["head_dim"] * 2
    nbytes = pages * page_nbytes
    need = 3 * (nbytes + page_nbytes) + HEADROOM
    avail = {"start": mem_available()}
    if avail["start"] < need:
        raise SystemExit(f"{avail['start'] / 1e9:.1f} GB available, this run needs "
                         f"{need / 1e9:.1f} GB (three {nbytes / 1e9:.2f} GB copies at its peak): "
                         f"try later or with fewer --tokens")

    # A's and B's host pools: two copies, resident to the end; memcpy copies between them.
    pool_a = host_pool(pages=pages + 1, dtype=torch.bfloat16, **GEO)
    pool_b = host_pool(pages=pages + 1, dtype=torch.bfloat16, **GEO)
    span = Span(pool_a, pool_b, pages * page_tokens)
    pool_a.kv_buffer.view(torch.int16).random_()
    pool_b.kv_buffer.view(torch.int16).zero_()  # faulted in before anything is timed
    keys = [f"{i:064x}" for i in range(pages)]
    with ThreadPoolExecutor(max_workers=max(threads)) as tp:
        tm = Timings(nbytes, span, tp)
        span.memcpy(1, None)
        span.check("memcpy")
        # radixd's host pool: the third copy, given back when the daemon stops.
        avail["radixd"] = mem_available()
        radixd_phase(span, pool_a, pool_b, keys, tm, threads, args.reps)
        gc.collect()
        # HiCacheFile's files on /dev/shm: the third copy, removed at the end.
        avail["hicachefile"] = mem_available()
        if avail["hicachefile"] < nbytes + HEADROOM:
            raise SystemExit(f"radixd's memory did not come back: "
                             f"{avail['hicachefile'] / 1e9:.1f} GB available")
        file_phase(span, pool_a, pool_b, keys, tm, args.reps)
    load = os.getloadavg()[1]

    print(f"tokens {pages * page_tokens} ({pages} pages of {page_nbytes} B, "
          f"{nbytes / 1e6:.0f} MB a copy), {args.reps} reps, torch intra-op threads "
          f"{args.threads}, {usable_cpus()} CPUs, load average {load:.1f} (5 min); GB available "
          f"at the start of each phase: "
          + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in avail.items()))
    print("GB/s: the best rep. Ratios: the median over reps of each rep against the memcpy timed "
          "right before it;\nx HiCacheFile = (x 1-thread memcpy) / (HiCacheFile's x 1-thread "
          "memcpy).")
    print(f"{'':36}{'GB/s':>7}  {'x memcpy, same threads':>22}  {'x HiCacheFile':>13}")
    figures: dict[str, float] = {"tokens": pages * page_tokens, "bytes": nbytes,
                                 "radixd_exists_ms": min(tm.t["exists"]) * 1e3}
    for n in threads:
        figures[f"memcpy_{n}t_gbps"] = tm.gbps(f"memcpy_{n}")
        print(f"{f'memcpy, {n} thread(s)':36}{tm.gbps(f'memcpy_{n}'):7.2f}")
    for op in ("set", "get"):
        figures[f"hicachefile_{op}_gbps"] = tm.gbps(f"file_{op}")
        figures[f"hicachefile_{op}_x_memcpy"] = tm.x_memcpy(f"file_{op}", 1)
        print(f"{f'HiCacheFile {op} (/dev/shm)':36}{tm.gbps(f'file_{op}'):7.2f}  "
              f"{tm.x_memcpy(f'file_{op}', 1):21.2f}x")
    for op, who in (("set", "A"), ("get", "B")):
        for n in threads:
            name = f"radixd_{op}_{n}"
            x_file = tm.x_memcpy(name, 1) / tm.x_memcpy(f"file_{op}", 1)
            figures.update({f"{name}t_gbps": tm.gbps(name),
                            f"{name}t_x_memcpy": tm.x_memcpy(name, n),
                            f"{name}t_x_hicachefile": x_file})
            print(f"{f'radixd {op} ({who}), {n} copy thread(s)':36}{tm.gbps(name):7.2f}  "
                  f"{tm.x_memcpy(name, n):21.2f}x  {x_file:12.2f}x")
    for n in threads[1:]:
        pairs = [(m1, mn) for name in tm.t if name.endswith(f"_{n}@memcpy_1")
                 for m1, mn in zip(tm.t[name], tm.t[name.replace("@memcpy_1", f"@memcpy_{n}")],
                                   strict=True)]
        speedup = statistics.median(m1 / mn for m1, mn in pairs)
        figures[f"memcpy_{n}t_x_1t"] = speedup
        print(f"memcpy on {n} threads against 1 thread (paired): {speedup:.2f}x")
    print(f"radixd exists (B, one lookup of {pages} keys): {figures['radixd_exists_ms']:.1f} ms; "
          f"each get and set is two such requests and the copies")
    if args.json:
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
