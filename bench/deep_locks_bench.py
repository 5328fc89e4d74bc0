"""Many locks on a deep path (pages of one token), what they cost the event loop: a session's
end, and the background check's steps.

The tree: pages of one token and a branch at every token of one ``--depth`` token path (a node
per token), ``--locks`` locks of one owner on the path's end (a session whose requests all
share it), or spread in turn over ``--anchors`` nodes evenly down to it. One lock or unlock
walks the whole path. Both parts run in this process, on fresh identical caches, ``--rounds``
times (medians):

- **session end**: the model cache's ``release_owner`` (every lock in one pass of the tree,
  ``RadixTree.unlock_all``) against releasing the same locks one ``unlock`` at a time (what a
  session's end did before, and what ``ModelCache.unlock`` does per request): milliseconds and
  their ratio;
- **check**: the stepped full check (``ModelCache.check_steps``, the background checker's
  steps, between which requests are served) on the tree with the locks against the same tree
  without them: its longest step and its whole time in milliseconds, and their ratios. The
  check counts each node's locks from the receipts; a request waits at most one step.

    python bench/deep_locks_bench.py [--depth 2000] [--locks 4000] [--anchors 1] [--rounds 3]
        [--json PATH]
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from bench._common import write_json  # noqa: E402
from daemon.gpu.profile import ModelProfile  # noqa: E402
from daemon.model_cache import ModelCache  # noqa: E402
from daemon.process_memory import tune_gc  # noqa: E402
from daemon.tree import as_token_bytes  # noqa: E402

NS = "bench"
OWNER, BUILDER = 2, 1


def deep_cache(depth: int, locks: int, anchors: int = 1) -> tuple[ModelCache, list[int]]:
    """A page-1 cache whose path of ``depth`` tokens has a branch at every token, and
    ``locks`` locks of OWNER on ``anchors`` nodes of it spread evenly down to its end, in turn:
    (cache, receipt ids)."""
    profile = ModelProfile(
        name="m", page_size=1, num_full_layers=1, num_kv_heads=1, head_dim=1,
        full_pages=2 * depth + 16, sliding_window=128, num_swa_layers=1,
        swa_pages=2 * depth + 16, dtype="float32", device="cpu")
    cache = ModelCache(profile)
    path = list(range(1, depth + 1))
    f, w = cache.alloc(BUILDER, depth)
    cache.insert(BUILDER, NS, as_token_bytes(path), f, w)
    for i in range(1, depth):
        f, w = cache.alloc(BUILDER, 1)
        cache.insert(BUILDER, NS, as_token_bytes(path[:i] + [10**6 + i]), f, w, i)
    ends = [cache.match(OWNER, NS, as_token_bytes(path[:depth * (i + 1) // anchors]))[0]
            for i in range(anchors)]
    rids = [cache.lock(OWNER, NS, ends[i % anchors].node_id) for i in range(locks)]
    return cache, rids


def one_at_a_time(cache: ModelCache, rids: list[int]) -> None:
    for rid in rids:
        cache.unlock(OWNER, rid)


def in_one_pass(cache: ModelCache, rids: list[int]) -> None:
    cache.release_owner(OWNER)


def stepped_check(cache: ModelCache) -> tuple[float, float]:
    """The stepped full check's (longest step, whole) in milliseconds; raises on a violation."""
    problems: list[str] = []
    steps = cache.check_steps(problems)
    longest, t_all = 0.0, time.perf_counter()
    while True:
        t0 = time.perf_counter()
        if next(steps, StopIteration) is StopIteration:
            break
        longest = max(longest, time.perf_counter() - t0)
    whole = time.perf_counter() - t_all
    if problems:
        raise RuntimeError(f"the check found problems: {problems[:3]}")
    return longest * 1e3, whole * 1e3


def measure(depth: int, locks: int, rounds: int, anchors: int = 1) -> dict[str, float]:
    """Median milliseconds of each over ``rounds`` fresh caches, and the ratios."""
    times: dict[str, list[float]] = {}

    def add(name: str, ms: float) -> None:
        times.setdefault(name, []).append(ms)

    for r in range(rounds):
        ways = [one_at_a_time, in_one_pass]
        for way in ways if r % 2 == 0 else ways[::-1]:
            cache, rids = deep_cache(depth, locks, anchors)
            t0 = time.perf_counter()
            way(cache, rids)
            add(way.__name__, (time.perf_counter() - t0) * 1e3)
            problems = cache.check()
            if problems or any(n.full_lock for n in cache.tree.iter_nodes()):
                raise RuntimeError(f"{way.__name__} left the cache wrong: {problems[:3]}")
        cache, rids = deep_cache(depth, locks, anchors)  # the check, with the locks, then without
        for side in ("locked", "unlocked"):
            step, whole = stepped_check(cache)
            add(f"check_step_{side}", step)
            add(f"check_{side}", whole)
            if side == "locked":
                in_one_pass(cache, rids)
    out = {f"{k}_ms": statistics.median(v) for k, v in times.items()}
    out["session_end_ratio"] = out["one_at_a_time_ms"] / out["in_one_pass_ms"]
    out["check_step_ratio"] = out["check_step_locked_ms"] / out["check_step_unlocked_ms"]
    out["check_ratio"] = out["check_locked_ms"] / out["check_unlocked_ms"]
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depth", type=int, default=2000, help="tokens (nodes) of the deep path")
    ap.add_argument("--locks", type=int, default=4000, help="locks the session holds on it")
    ap.add_argument("--anchors", type=int, default=1,
                    help="nodes the locks are spread over, evenly down the path (default 1: "
                         "all on its end)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh caches per way (median)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as a JSON object")
    args = ap.parse_args(argv)
    for name in ("depth", "locks", "anchors", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: at least 1, got {getattr(args, name)}")
    tune_gc()  # as radixd serve does: the collector's pauses are not what is measured
    if args.anchors > min(args.depth, args.locks):
        ap.error(f"--anchors: at most --depth and --locks, got {args.anchors}")
    f = measure(args.depth, args.locks, args.rounds, args.anchors)
    print(f"page 1, a path of {args.depth} nodes, {args.locks} locks on "
          + ("its end" if args.anchors == 1 else f"{args.anchors} nodes down to its end") + ", "
          f"median of {args.rounds} rounds, milliseconds")
    print("session end: one unlock at a time {:10.2f}   in one pass {:10.2f}   ratio {:8.1f}x"
          .format(f["one_at_a_time_ms"], f["in_one_pass_ms"], f["session_end_ratio"]))
    print("check, longest step: with the locks {:8.3f}   without {:8.3f}   ratio {:8.2f}"
          .format(f["check_step_locked_ms"], f["check_step_unlocked_ms"],
                  f["check_step_ratio"]))
    print("check, whole:        with the locks {:8.1f}   without {:8.1f}   ratio {:8.2f}"
          .format(f["check_locked_ms"], f["check_unlocked_ms"], f["check_ratio"]))
    if args.json:
        write_json(args.json, {k: round(v, 3) for k, v in f.items()})
    return f


if __name__ == "__main__":
    main()
