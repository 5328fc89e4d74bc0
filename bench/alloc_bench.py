"""The page allocator and the host pool's slot bookkeeping: this checkout's against a baseline
git ref's, in one process.

    python bench/alloc_bench.py [--baseline main] [--quick] [--json PATH]

Both sides' ``daemon.gpu.segments`` and ``daemon.storage.host_pool`` are imported in this process
(the baseline's from its ``git archive``, under its own modules) and timed in turns, so that a
machine getting busier or quieter weighs on both alike. Figures, each side and the ratio:

- ``pages_per_block_*``: how long the runs of consecutive ascending slots are that a host copy
  is cut into (one block each: on CUDA one DMA call from the event loop), over a tree-like churn
  of a 20,000-slot pool: 400 conversations whose turns each take one node's run of 1 to 1,200
  slots, leaf-first LRU eviction (one free per node) when the pool is short, the mean over the
  takes after the first quarter and over 3 seeds; the pool shared (one segment, CUDA's default)
  or in segments of 160 slots over three namespaces. Deterministic: the same code gives the same
  figure.
- ``alloc_free_us_<n>_<pool>``: one ``alloc`` of ``n`` pages and its ``free``, on a pool whose
  free lists a scattered half-free has scrambled (the median of repeated batches).
- ``store_us_<n>``, ``release_us_<n>``: ``HostPool.store_unnamed`` of ``n`` slots (a host copy
  taking its slots), and ``release_many`` of them (an int32 array, as the tree hands them back),
  in a pool of a million slots, 800,000 of them held (``--quick``: 100,000 slots, 80,000 held).
- ``pool_build_ms``: building one pool's allocator (one segment) of 50M pages (``--quick``: 2M),
  what a daemon does at start for every device and host pool; ``pool_bytes_per_page``: what a
  fresh pool of a million pages takes, by ``tracemalloc`` (its state bytes and free list).
- ``audit_ms``: a whole ``audit`` (what the background check and the check at stop run, in
  steps) of a pool of 10M pages (``--quick``: 1M) in 16 segments, 60% of it handed out and a
  third of that freed again in runs of 100 pages.
- ``host_bytes_per_held_slot``: what that pool's bookkeeping took, by ``tracemalloc`` from its
  creation to the end of the fill (arrays of one entry per slot, held or not, included; the
  pages' own memory, a memfd mapping, not), over the slots held then (80% of them).
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "clients", "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import argparse  # noqa: E402
import importlib  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from array import array  # noqa: E402
from collections import OrderedDict  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

from bench._common import export_ref, write_json  # noqa: E402

MODULES = ("daemon.gpu.segments", "daemon.gpu.profile", "daemon.storage.host_pool")
CHURN_SLOTS = 20_001
CHURN_POOLS = (("shared", CHURN_SLOTS, 1), ("segments_3ns", 160, 3))


def _is_daemon(name: str) -> bool:
    return name == "daemon" or name.startswith("daemon.")


def modules_at(root: str) -> dict[str, ModuleType]:
    """:data:`MODULES` of the checkout at ``root``, imported under their own names and then put
    aside, so that the modules already imported (this checkout's) are the ones the rest of the
    process keeps seeing; the classes taken from them keep their own module's globals."""
    saved = {k: m for k, m in sys.modules.items() if _is_daemon(k)}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, root)
    try:
        return {name: importlib.import_module(name) for name in MODULES}
    finally:
        sys.path.remove(root)
        for k in [k for k in sys.modules if _is_daemon(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


def _blocks(pages: array) -> int:
    return sum(1 for i, p in enumerate(pages) if i == 0 or p != pages[i - 1] + 1)


def churn(segments: ModuleType, segment_slots: int, namespaces: int, seed: int,
          steps: int) -> float:
    """Mean pages per copy block over a tree-like churn (the module's docstring)."""
    a = segments.SegmentedAllocator(CHURN_SLOTS, segment_slots)
    rnd = random.Random(seed)
    chains: dict[int, list[array]] = {}  # conversation -> its nodes' slots, root first
    lru: OrderedDict[int, None] = OrderedDict()
    pages = blocks = 0
    for step in range(steps):
        conv = rnd.randrange(400)
        ns = f"t{conv % namespaces}"
        k = rnd.choice((rnd.randint(1, 16), rnd.randint(16, 256), rnd.randint(256, 1200)))
        while a.available_to(ns) < k:
            victim = next((v for v in lru if v % namespaces == conv % namespaces),
                          next(iter(lru)))
            nodes = chains[victim]
            a.free(nodes.pop())  # the deepest node: a leaf
            if not nodes:
                del chains[victim], lru[victim]
        got = a.alloc(k, ns)
        if step > steps // 4:
            pages += len(got)
            blocks += _blocks(got)
        chains.setdefault(conv, []).append(got)
        lru.pop(conv, None)
        lru[conv] = None
    assert a.audit() == []
    return pages / blocks


def _scrambled(segments: ModuleType, segment_pages: int, capacity: int) -> Any:
    a = segments.SegmentedAllocator(capacity, segment_pages)
    held = list(a.alloc(capacity - 1, "a"))
    random.Random(1).shuffle(held)
    half = held[: len(held) // 2]
    for i in range(0, len(half), 50):
        a.free(array("i", half[i:i + 50]))
    return a


def _in_turns(fns: dict[str, Any], rounds: int) -> dict[str, float]:
    """Median seconds of each side's ``fns[side]()`` (which times itself), sides alternating."""
    samples: dict[str, list[float]] = {side: [] for side in fns}
    order = list(fns)
    for r in range(rounds):
        for side in (order if r % 2 == 0 else order[::-1]):
            samples[side].append(fns[side]())
    return {side: statistics.median(v) for side, v in samples.items()}


def run(baseline: str, quick: bool = False) -> dict[str, float]:
    base_root = export_ref(baseline)
    try:
        sides = {"base": modules_at(base_root),
                 "this": {name: importlib.import_module(name) for name in MODULES}}
    finally:
        shutil.rmtree(base_root, ignore_errors=True)
    out: dict[str, float] = {}

    def put(name: str, values: dict[str, float]) -> None:
        out[f"{name}_base"], out[f"{name}_this"] = values["base"], values["this"]
        out[f"{name}_ratio"] = values["this"] / values["base"]

    steps = 1000 if quick else 4000
    for label, seg, nsc in CHURN_POOLS:
        put(f"pages_per_block_{label}",
            {side: statistics.mean(churn(m["daemon.gpu.segments"], seg, nsc, s, steps)
                                   for s in range(3)) for side, m in sides.items()})

    cap = 128 * 512 + 1
    for label, seg in (("1seg", cap), ("128seg", 512)):
        pools = {side: _scrambled(m["daemon.gpu.segments"], seg, cap)
                 for side, m in sides.items()}
        for n in (2, 64, 1024, 4096):
            def cycle(a: Any, n: int = n) -> float:
                batch = max(5, 2000 // n)
                t = time.perf_counter()
                for _ in range(batch):
                    a.free(a.alloc(n, "a"))
                return (time.perf_counter() - t) / batch

            put(f"alloc_free_us_{n}_{label}",
                {k: v * 1e6 for k, v in _in_turns(
                    {side: (lambda a=a: cycle(a)) for side, a in pools.items()},
                    8 if quick else 20).items()})

    def build(m: dict[str, ModuleType], pages: int) -> float:
        t = time.perf_counter()
        m["daemon.gpu.segments"].SegmentedAllocator(pages, pages, "bench")
        return time.perf_counter() - t

    big = 2_000_001 if quick else 50_000_001
    put("pool_build_ms", {k: v * 1e3 for k, v in _in_turns(
        {side: (lambda m=m: build(m, big)) for side, m in sides.items()}, 2 if quick else 3
    ).items()})
    fresh = {}
    for side, m in sides.items():
        tracemalloc.start()
        pool = m["daemon.gpu.segments"].SegmentedAllocator(1_000_001, 1_000_001, "bench")
        fresh[side] = tracemalloc.get_traced_memory()[0] / pool.usable
        tracemalloc.stop()
        del pool
    put("pool_bytes_per_page", fresh)

    def audited(m: dict[str, ModuleType], pages: int) -> float:
        a = m["daemon.gpu.segments"].SegmentedAllocator(pages, -(-pages // 16), "bench")
        got = a.alloc(pages * 6 // 10, "a")
        for i in range(0, len(got), 300):
            a.free(got[i:i + 100])
        t = time.perf_counter()
        assert a.audit() == []
        return time.perf_counter() - t

    audit_pages = 1_000_001 if quick else 10_000_001
    put("audit_ms", {side: audited(m, audit_pages) * 1e3 for side, m in sides.items()})

    slots = 100_001 if quick else 1_000_001
    host = {}
    meta = {}
    for side, m in sides.items():
        profile = m["daemon.gpu.profile"].ModelProfile(
            name="bench", device="cpu", full_pages=8, page_size=1, num_full_layers=1,
            num_kv_heads=1, head_dim=8, dtype="float16")
        tracemalloc.start()
        p = m["daemon.storage.host_pool"].HostPool(profile, slots, "full", pin_memory=False)
        for _ in range(slots * 8 // 10 // 1000):
            p.store_unnamed(1000)
        meta[side] = tracemalloc.get_traced_memory()[0] / p.used
        tracemalloc.stop()
        host[side] = p
    put("host_bytes_per_held_slot", meta)
    for n in (2, 64, 1024, 4096):
        def store(p: Any, n: int = n) -> float:
            t = time.perf_counter()
            taken = p.store_unnamed(n)
            took = time.perf_counter() - t
            p.release_many(taken)
            return took

        def release(p: Any, n: int = n) -> float:
            taken = p.store_unnamed(n)
            t = time.perf_counter()
            p.release_many(taken)
            return time.perf_counter() - t

        for name, fn in (("store", store), ("release", release)):
            put(f"{name}_us_{n}", {k: v * 1e6 for k, v in _in_turns(
                {side: (lambda p=p, fn=fn: fn(p)) for side, p in host.items()},
                20 if quick else 60).items()})
    for p in host.values():
        p.close()
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main", help="git ref to compare with (default main)")
    ap.add_argument("--quick", action="store_true", help="shorter churn, smaller host pool")
    ap.add_argument("--json", metavar="PATH", help="write the figures as a flat JSON object")
    args = ap.parse_args(argv)
    f = run(args.baseline, args.quick)
    print(f"baseline {args.baseline}{' (quick)' if args.quick else ''}: medians, both sides in "
          "this process, timed in turns")
    names = sorted({k.rsplit("_", 1)[0] for k in f})
    width = max(map(len, names))
    print(f"{'figure':<{width}} {args.baseline:>12} {'this':>12} {'this/base':>10}")
    for name in names:
        print(f"{name:<{width}} {f[name + '_base']:12.2f} {f[name + '_this']:12.2f} "
              f"{f[name + '_ratio']:10.3f}")
    if args.json:
        write_json(args.json, {k: round(v, 4) for k, v in f.items()})
    return f


if __name__ == "__main__":
    main()
