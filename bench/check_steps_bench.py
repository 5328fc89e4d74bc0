"""The background full check's steps on a wide tree with many locks: how long its longest step
holds the event loop (a request that arrives meanwhile waits for it), this checkout against a
baseline git ref, in the same run.

The tree, built in process by both sides alike: page 16, ``--roots`` children of the root (a
cache of that many different prompts), each one page with a page under it, and ``--locks``
locks of two sessions spread over those leaves in turn, each with an SWA window reaching into
its parent. On it the stepped full check (``ModelCache.check_steps``: the steps the background
checker runs between requests, deep: every page re-hashed) runs ``--passes`` times, each step
timed alone in CPU time (``time.thread_time``: the check's own work, not the moments a shared
machine did not run the process), the step that ends a pass included; before the passes the
collector is run and the heap frozen, so that a collection during a pass is one the check's own
allocations set off. Figures per side, the medians over ``--rounds`` worker processes (the sides
in turns, each first every other round): the longest step, the 99.9th percentile step (CPU
milliseconds) and a whole pass (wall clock milliseconds), and their ratios this/base.

Each side runs in a process of its own, on its tree's daemon (the baseline from ``git archive``
of ``--baseline``), on one CPU (``--cpu``, by default the first this process may use).

    python bench/check_steps_bench.py [--baseline main] [--roots 20000] [--locks 20000]
        [--passes 3] [--rounds 3] [--cpu N] [--json PATH]
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
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from array import array  # noqa: E402
from typing import Any  # noqa: E402

PAGE = 16
FIGURES = ("longest_step_ms", "p999_step_ms", "pass_ms")
#: one worker's whole run (its build and its passes)
WORKER_TIMEOUT_S = 600


def wide_cache(roots: int, locks: int, page: int = PAGE, spare: int = 16
               ) -> tuple[Any, list[tuple[int, int]]]:
    """The tree of the module docstring (at ``page`` tokens a page, with ``spare`` pages more
    in each pool), in the daemon this process imported: its ModelCache, and each lock's (owner,
    receipt id)."""
    from daemon.gpu.profile import ModelProfile
    from daemon.model_cache import ModelCache
    from daemon.tree import as_token_bytes

    profile = ModelProfile(
        name="m", page_size=page, num_full_layers=1, num_kv_heads=1, head_dim=1,
        full_pages=2 * roots + spare, sliding_window=2 * page, num_swa_layers=1,
        swa_pages=2 * roots + spare, dtype="float32", device="cpu")
    cache = ModelCache(profile)
    seqs = [as_token_bytes([i + 1] * page + [10**6 + i] * page) for i in range(roots)]
    for s in seqs:
        f, w = cache.alloc(1, 2)
        cache.insert(1, "bench", s, f, w)
    held = []
    for i in range(locks):
        owner = 2 + i % 2
        m = cache.match(owner, "bench", seqs[i % roots])[0]
        held.append((owner, cache.lock(owner, "bench", m.node_id)))
    return cache, held


def measure(roots: int, locks: int, passes: int) -> dict[str, Any]:
    """This process's side: the check's step times over ``passes`` passes."""
    import gc

    import daemon

    cache, _ = wide_cache(roots, locks)
    gc.collect()
    gc.freeze()
    steps = array("d")  # no object per step: the timing sets off no collection
    whole = array("d")
    clock = time.perf_counter
    step_clock = time.thread_time  # the check's own work, not the moments it was not running
    for _ in range(passes):
        v: list[str] = []
        gen = cache.check_steps(v)
        t_all = clock()
        while True:
            t = step_clock()
            try:
                next(gen)
            except StopIteration:
                break
            finally:  # the step that ends the pass is a step too
                steps.append(step_clock() - t)
        whole.append(clock() - t_all)
        if v:
            raise RuntimeError(f"the check found violations: {v[:3]}")
    ordered = sorted(steps)
    return {"source": os.path.dirname(os.path.dirname(os.path.abspath(daemon.__file__))),
            "longest_step_ms": ordered[-1] * 1e3,
            "p999_step_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.999))] * 1e3,
            "pass_ms": statistics.median(whole) * 1e3, "steps": len(steps) // passes}


def run_side(root: str, roots: int, locks: int, passes: int, cpu: int | None
             ) -> dict[str, Any]:
    """A worker process on ``root``'s daemon; its figures."""
    from bench._common import run_worker

    argv = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, str(roots), str(locks),
            str(passes)]
    return run_worker(argv, root, WORKER_TIMEOUT_S, cpu=cpu)


def main(argv: list[str] | None = None) -> dict[str, float]:
    from bench._common import export_ref, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main", help="git ref of the daemon to compare with")
    ap.add_argument("--roots", type=int, default=20000, help="children of the root")
    ap.add_argument("--locks", type=int, default=20000, help="locks over their children")
    ap.add_argument("--passes", type=int, default=3, help="check passes per worker")
    ap.add_argument("--rounds", type=int, default=3, help="worker processes per side")
    ap.add_argument("--cpu", type=int, default=min(os.sched_getaffinity(0)),
                    help="the CPU every worker runs on (default: the first this process may use)")
    ap.add_argument("--json", help="write the figures as JSON")
    args = ap.parse_args(argv)
    for name in ("roots", "passes", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: at least 1, got {getattr(args, name)}")
    if args.locks < 0:
        ap.error(f"--locks: at least 0, got {args.locks}")
    if args.cpu not in os.sched_getaffinity(0):
        ap.error(f"--cpu: one of the CPUs this process may use, "
                 f"{sorted(os.sched_getaffinity(0))}, got {args.cpu}")
    base_root = export_ref(args.baseline)
    got: dict[str, list[dict[str, Any]]] = {"base": [], "this": []}
    try:
        sides = [("base", base_root), ("this", _ROOT)]
        for i in range(args.rounds):
            for side, root in sides[::-1] if i % 2 else sides:
                got[side].append(run_side(root, args.roots, args.locks, args.passes, args.cpu))
    finally:
        shutil.rmtree(base_root, ignore_errors=True)
    out: dict[str, float] = {}
    print(f"stepped full check, page {PAGE}, {args.roots} children of the root, {args.locks} "
          f"locks; medians of {args.rounds} processes on CPU {args.cpu}; baseline "
          f"{args.baseline}")
    print(f"{'figure':<18}{'base':>10}{'this':>10}{'ratio':>8}")
    for name in (*FIGURES, "steps"):
        row = {side: statistics.median(f[name] for f in got[side]) for side in got}
        out[f"{name}_base"], out[f"{name}_this"] = row["base"], row["this"]
        out[f"{name}_ratio"] = row["this"] / row["base"]
        print(f"{name:<18}{row['base']:>10.3f}{row['this']:>10.3f}{out[f'{name}_ratio']:>7.2f}x")
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == [WORKER_FLAG]:
        print(json.dumps(measure(*map(int, sys.argv[2:5]))))
    else:
        main()
