"""Pauses of Python's cyclic garbage collector under tree churn, with the daemon's collector
settings and, side by side in the same run, with other thresholds or another ref's daemon.

A collection holds the event loop for its whole length (every request waits), and the objects
it traverses are mostly the tree's: a node is three container objects (the node and its page
id arrays). This benchmark runs the daemon's model cache in process
the way a busy engine drives it: page 16, ``--pages`` pages in each pool, requests of a shared
document prefix (1 to 8 pages of one of 500 documents) and 1 to 4 fresh pages, each one a
``match`` then an ``alloc`` and an ``insert`` of its fresh pages, evicting the least recently
used when the pool is full. The first ``--pages`` / 4 requests fill the pool and are not timed;
then ``--ops`` requests are, each alloc+insert alone (``perf_counter``), and every collection
(``gc.callbacks``).

A side runs in a process of its own (a fresh heap: the collector's state is the process's):
``daemon``, this checkout with what ``radixd serve`` sets (the start-up heap frozen, thresholds
``daemon.process_memory.tune_gc``'s); with ``--thresholds T0,T1,T2``, ``other``: the same, then
those thresholds; with ``--baseline REF``, ``baseline``: the daemon of git ``REF`` (exported with
``git archive``) with its own settings. ``--rounds`` processes per side, in turns; the figures
are their medians: per generation the collections, the longest and the total pause in
milliseconds (wall clock: on a shared machine the longest also holds the moments the process
was not running; the totals divided by the counts are the steadier figure); the alloc+insert
p50 (µs), p99.9 and max (ms); requests per second; the time of one full collection
(``gc.collect()``) of the heap at the end, which every full collection of that tree costs; and
the ratios of each side to ``daemon``.

    python bench/gc_pause_bench.py [--pages 100000] [--ops 100000] [--rounds 3]
        [--thresholds 5000,4,20] [--baseline REF] [--cpu N] [--json PATH]
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_FLAG = "--worker"
if WORKER_FLAG not in sys.argv and _ROOT not in sys.path:  # a worker imports its own tree
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from array import array  # noqa: E402
from typing import Any  # noqa: E402

PAGE = 16
DOCS = 500
#: one worker's whole run
WORKER_TIMEOUT_S = 900


def churn(pages: int, ops: int, thresholds: tuple[int, int, int] | None) -> dict[str, Any]:
    """One side, in this process: the figures of the module docstring."""
    import gc

    import daemon.app  # noqa: F401  (the daemon's imports: the heap tune_gc freezes)
    from daemon.gpu.profile import ModelProfile
    from daemon.model_cache import ModelCache
    from daemon.process_memory import tune_gc
    from daemon.tree import as_token_bytes

    profile = ModelProfile(
        name="m", page_size=PAGE, num_full_layers=1, num_kv_heads=1, head_dim=1,
        full_pages=pages, sliding_window=2 * PAGE, num_swa_layers=1, swa_pages=pages,
        dtype="float32", device="cpu")
    cache = ModelCache(profile)
    rng = random.Random(1)
    docs = [[rng.randrange(1 << 30) for _ in range(8 * PAGE)] for _ in range(DOCS)]
    tune_gc()
    if thresholds is not None:
        gc.set_threshold(*thresholds)
    pauses: dict[int, array] = {g: array("d") for g in (0, 1, 2)}
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif timing:
            pauses[info["generation"]].append(time.perf_counter() - started[0])

    gc.callbacks.append(on_gc)
    lat = array("d")
    timing = False
    warm = pages // 4
    t_run = 0.0
    for i in range(warm + ops):
        if i == warm:
            timing, t_run = True, time.perf_counter()
        fresh = rng.randint(1, 4)
        toks = as_token_bytes(rng.choice(docs)[:PAGE * rng.randint(1, 8)]
                              + [rng.randrange(1 << 30) for _ in range(PAGE * fresh)])
        cache.match(1, "bench", toks)
        t = time.perf_counter()
        f, w = cache.alloc(1, len(toks) // 4 // PAGE)
        cache.insert(1, "bench", toks, f, w)
        if timing:
            lat.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - t_run
    gc.callbacks.remove(on_gc)
    t = time.perf_counter()
    gc.collect()  # what a full collection of this heap costs (the start-up heap is frozen)
    full_ms = (time.perf_counter() - t) * 1e3
    if problems := cache.check(deep=False):
        raise RuntimeError(f"the cache is inconsistent: {problems[:3]}")
    import daemon

    out: dict[str, Any] = {
        "source": os.path.dirname(os.path.dirname(os.path.abspath(daemon.__file__))),
        "requests_per_s": ops / elapsed, "nodes": float(len(cache.tree.nodes)),
        "full_collection_ms": full_ms}
    ordered = sorted(lat)
    out["insert_p50_us"] = ordered[len(ordered) // 2] * 1e6
    out["insert_p999_ms"] = ordered[min(len(ordered) - 1, int(len(ordered) * 0.999))] * 1e3
    out["insert_max_ms"] = ordered[-1] * 1e3
    for g, p in pauses.items():
        out[f"gen{g}_collections"] = float(len(p))
        out[f"gen{g}_longest_ms"] = max(p, default=0.0) * 1e3
        out[f"gen{g}_total_ms"] = sum(p) * 1e3
    return out


def run_side(pages: int, ops: int, thresholds: tuple[int, int, int] | None, cpu: int | None,
             root: str = _ROOT) -> dict[str, float]:
    """One side's worker process, on ``root``'s daemon."""
    from bench._common import run_worker

    argv = [sys.executable, os.path.abspath(__file__), WORKER_FLAG,
            json.dumps([pages, ops, thresholds])]
    return run_worker(argv, root, WORKER_TIMEOUT_S, cpu=cpu)


def _thresholds(text: str) -> tuple[int, int, int]:
    try:
        t = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"three integers T0,T1,T2, got {text!r}") from None
    if len(t) != 3 or t[0] < 1 or min(t) < 0:
        raise argparse.ArgumentTypeError(f"three integers T0,T1,T2 (T0 at least 1), got {text!r}")
    return t  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from bench._common import export_ref, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=100_000, help="pages in each pool")
    ap.add_argument("--ops", type=int, default=100_000, help="timed requests per process")
    ap.add_argument("--rounds", type=int, default=3, help="processes per side")
    ap.add_argument("--thresholds", type=_thresholds,
                    help="the other side's gc thresholds, T0,T1,T2")
    ap.add_argument("--baseline", metavar="REF", help="also run the daemon of this git ref")
    ap.add_argument("--cpu", type=int, default=min(os.sched_getaffinity(0)),
                    help="the CPU every worker runs on (default: the first this process may use)")
    ap.add_argument("--json", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if args.pages < 64:
        ap.error(f"--pages: at least 64, got {args.pages}")
    for name in ("ops", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: at least 1, got {getattr(args, name)}")
    if args.cpu not in os.sched_getaffinity(0):
        ap.error(f"--cpu: one of the CPUs this process may use, "
                 f"{sorted(os.sched_getaffinity(0))}, got {args.cpu}")
    sides: list[tuple[str, tuple[int, int, int] | None, str]] = [("daemon", None, _ROOT)]
    if args.thresholds is not None:
        sides.append(("other", args.thresholds, _ROOT))
    base_root = export_ref(args.baseline) if args.baseline else None
    if base_root is not None:
        sides.append(("baseline", None, base_root))
    got: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in sides}
    try:
        for i in range(args.rounds):
            for name, t, root in sides[::-1] if i % 2 else sides:
                got[name].append(run_side(args.pages, args.ops, t, args.cpu, root))
    finally:
        if base_root is not None:
            shutil.rmtree(base_root, ignore_errors=True)
    med = {name: {k: statistics.median(f[k] for f in runs) for k in runs[0]}
           for name, runs in got.items()}
    named = [name for name, _, _ in sides]
    what = "".join([f"; other: thresholds {','.join(map(str, args.thresholds))}"
                    if args.thresholds else "", f"; baseline {args.baseline}" if base_root else ""])
    print(f"gc pauses under tree churn, page {PAGE}, {args.pages} pages, {args.ops} requests; "
          f"medians of {args.rounds} processes on CPU {args.cpu}{what}")
    print(f"{'figure':<22}" + "".join(f"{name:>12}" for name in named)
          + "".join(f"{name + '/daemon':>17}" for name in named[1:]))
    out: dict[str, Any] = {}
    for k in med["daemon"]:
        row = [med[name][k] for name in named]
        line = f"{k:<22}" + "".join(f"{v:>12.3f}" for v in row)
        for name, v in zip(named, row, strict=True):
            out[f"{k}_{name}"] = v
        for name, v in zip(named[1:], row[1:], strict=True):
            out[f"{k}_{name}_ratio"] = v / row[0] if row[0] else None
            line += f"{v / row[0]:>16.2f}x" if row[0] else f"{'-':>17}"
        print(line)
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == [WORKER_FLAG]:
        pages, ops, t = json.loads(sys.argv[2])
        print(json.dumps(churn(pages, ops, tuple(t) if t else None)))
    else:
        main()
