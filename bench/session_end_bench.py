"""What a session's end costs the event loop when it held many locks on a deep path: the model
cache's ``release_owner`` (every lock in one pass of the tree, ``RadixTree.unlock_all``) against
releasing the same locks one ``unlock`` at a time (what a session's end did before, and what
``ModelCache.unlock`` still does per request), in the same process, on identical caches.

The tree is the deep case: pages of one token and a branch at every token of one ``--depth``
token path (a node per token), ``--locks`` locks of one owner, all on the path's end (a session
whose requests all share it). One unlock walks the whole path, so one at a time costs locks x
depth node visits; one pass visits each node once. Both run ``--rounds`` times on fresh caches;
the figures are the medians, in milliseconds, and their ratio.

    python bench/session_end_bench.py [--depth 2000] [--locks 4000] [--rounds 3] [--json PATH]
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
from daemon.tree import as_token_bytes  # noqa: E402

NS = "bench"
OWNER, BUILDER = 2, 1


def deep_cache(depth: int, locks: int) -> tuple[ModelCache, list[int]]:
    """A page-1 cache whose path of ``depth`` tokens has a branch at every token, and
    ``locks`` locks of OWNER on its end: (cache, receipt ids)."""
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
    end, rid = cache.match(OWNER, NS, as_token_bytes(path), lock=True)
    rids = [rid] + [cache.lock(OWNER, NS, end.node_id) for _ in range(locks - 1)]
    return cache, rids  # type: ignore[return-value]


def one_at_a_time(cache: ModelCache, rids: list[int]) -> None:
    for rid in rids:
        cache.unlock(OWNER, rid)


def in_one_pass(cache: ModelCache, rids: list[int]) -> None:
    cache.release_owner(OWNER)


def measure(depth: int, locks: int, rounds: int) -> dict[str, float]:
    """Median milliseconds of each way over ``rounds`` fresh caches, and their ratio."""
    times: dict[str, list[float]] = {"one_at_a_time": [], "in_one_pass": []}
    for r in range(rounds):
        ways = [one_at_a_time, in_one_pass]
        for way in ways if r % 2 == 0 else ways[::-1]:
            cache, rids = deep_cache(depth, locks)
            t0 = time.perf_counter()
            way(cache, rids)
            times[way.__name__].append((time.perf_counter() - t0) * 1e3)
            problems = cache.check()
            if problems or any(n.full_lock for n in cache.tree.iter_nodes()):
                raise RuntimeError(f"{way.__name__} left the cache wrong: {problems[:3]}")
    out = {f"{k}_ms": statistics.median(v) for k, v in times.items()}
    out["ratio"] = out["one_at_a_time_ms"] / out["in_one_pass_ms"]
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depth", type=int, default=2000, help="tokens (nodes) of the deep path")
    ap.add_argument("--locks", type=int, default=4000, help="locks the session holds on it")
    ap.add_argument("--rounds", type=int, default=3, help="fresh caches per way (median)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as a JSON object")
    args = ap.parse_args(argv)
    for name in ("depth", "locks", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: at least 1, got {getattr(args, name)}")
    f = measure(args.depth, args.locks, args.rounds)
    print(f"page 1, a path of {args.depth} nodes, {args.locks} locks on its end, "
          f"median of {args.rounds} rounds")
    print(f"one unlock at a time: {f['one_at_a_time_ms']:10.2f} ms")
    print(f"in one pass:          {f['in_one_pass_ms']:10.2f} ms")
    print(f"ratio:                {f['ratio']:10.1f}x")
    if args.json:
        write_json(args.json, {k: round(v, 3) for k, v in f.items()})
    return f


if __name__ == "__main__":
    main()
