"""The tree at scale: latencies and memory at 1M, 10M and 50M cached tokens.

Usage (from the repository root)::

    python bench/scale_bench.py [--page-sizes 64,16,1] [--tokens 1e6,1e7,5e7]
                                [--max-tokens-p1 1e7] [--json out.json]

For each page size one tree (with its allocators, as in ``bench/tree_bench.py``: 1k system
prompts, 4k sequences of which a quarter are second turns, a third with their SWA below the
window freed) grows through the checkpoints; at each it first does what the daemon does while
idle (cold nodes' page ids kept as runs: ``tree_bench.idle``), then measures, on the tree as it
is:

- ``match_4k``, ``lock_unlock``, ``insert_4k`` (a fresh 4k sequence behind a cached system
  prompt) p50 and p99, in microseconds;
- ``evict_page``: ``evict`` of 1024 tokens' worth of pages from the LRU end, per page freed;
- ``full_check_s``: the invariant checker's full walk (``check_tree(deep=True)``);
- ``bytes_per_token``: growth of the process's RSS since the empty tree, per cached token
  (allocator arrays sized for the last checkpoint are in the baseline), and ``rss_mib``.

and prints each figure's ratio between the last and the first checkpoint of its page size: the
goals are flat latency (at most 1.5x from 1M to 50M) and linear memory (bytes per token about
constant). Pages of 1 token stop at ``--max-tokens-p1`` (default 10M: about 0.5 GB of tree).
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

from bench._common import write_json  # noqa: E402
from bench.tree_bench import (  # noqa: E402
    NS,
    SEQ_LEN,
    SYS_LEN,
    Workload,
    cached_tokens,
    engine_insert,
    idle,
    new_tree,
)
from daemon.gpu.allocator import PairedAllocator  # noqa: E402
from daemon.tree import RadixTree  # noqa: E402
from daemon.tree.invariants import check_tree  # noqa: E402

WINDOW = 128
SAMPLES = 2000
INSERTS = 200
EVICT_BATCHES = 50
FIGURES = ("match_4k_p50_us", "match_4k_p99_us", "lock_unlock_p50_us", "insert_4k_p50_us",
           "insert_4k_p99_us", "evict_page_p50_us", "full_check_s", "bytes_per_token",
           "rss_mib")


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pct(samples: list[int], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000.0


def _timed(fn: Callable[[int], None], n: int) -> list[int]:
    clock = time.perf_counter_ns
    out = [0] * n
    gc.disable()
    try:
        for i in range(n):
            t0 = clock()
            fn(i)
            out[i] = clock() - t0
    finally:
        gc.enable()
    return out


class Grower:
    """One tree growing through the checkpoints (with the prompts known to be cached)."""

    def __init__(self, page_size: int, max_tokens: int) -> None:
        self.P = page_size
        cap = int(max_tokens * 1.1) // page_size + 4 * SEQ_LEN // page_size + 2
        self.alloc = PairedAllocator(cap, cap)
        self.tree = new_tree(RadixTree, page_size, self.alloc)
        self.wl = Workload(page_size, seed=7)
        self.recent: list[bytes] = []  # the latest cached 4k sequences (match/lock targets)
        gc.collect()
        self.rss0 = _rss()
        self.fresh = 0

    def grow_to(self, tokens: int) -> None:
        while cached_tokens(self.tree) < tokens:
            toks, f = self.wl.next_seq()
            engine_insert(self.tree, self.alloc, toks, f)
            self.recent.append(toks)
            if len(self.recent) > 256:
                self.recent.pop(0)
            self.wl.firsts[:] = self.wl.firsts[-16:]

    def measure(self) -> dict[str, float]:
        tree = self.tree
        out: dict[str, float] = {}
        idle(tree)  # cold nodes' page ids as runs, as the daemon keeps them while idle
        gc.collect()
        out["rss_mib"] = _rss() / 2**20
        n_tok = cached_tokens(tree)
        out["bytes_per_token"] = (_rss() - self.rss0) / n_tok
        hot = [t for t in self.recent[-64:] if tree.match(NS, t).prefix_len == SEQ_LEN]
        if not hot:
            raise RuntimeError("no recent sequence is cached whole")
        match = tree.match
        s = _timed(lambda i: match(NS, hot[i % len(hot)]), SAMPLES)
        out["match_4k_p50_us"], out["match_4k_p99_us"] = _pct(s, 0.5), _pct(s, 0.99)
        ids = [match(NS, t).node_id for t in hot]
        lock, unlock = tree.lock, tree.unlock
        s = _timed(lambda i: unlock(lock(ids[i % len(ids)])), SAMPLES)
        out["lock_unlock_p50_us"] = _pct(s, 0.5)
        out.update(self._insert())
        out["evict_page_p50_us"] = self._evict()
        t = time.perf_counter()
        violations = check_tree(tree, deep=True)
        out["full_check_s"] = time.perf_counter() - t
        if violations:
            raise RuntimeError(f"invariant violations: {violations[:5]}")
        out["cached_tokens"] = float(n_tok)
        return out

    def _insert(self) -> dict[str, float]:
        """A fresh 4k sequence behind a cached system prompt, timed around ``insert`` only."""
        tree, P = self.tree, self.P
        n = SEQ_LEN // P
        samples = []
        for _ in range(INSERTS):
            toks = self.wl.fresh_4k(self.fresh)
            self.fresh += 1
            m = tree.match(NS, toks, lock=True)
            prev = m.prefix_len // P
            if self.alloc.full.available < n - prev:
                tree.evict(n - prev, n - prev, reason="alloc")
            full, swa = self.alloc.alloc(n - prev)
            gc.disable()
            t0 = time.perf_counter_ns()
            res = tree.insert(NS, toks, full, swa, prev * P, 0)
            samples.append(time.perf_counter_ns() - t0)
            gc.enable()
            tree.unlock(m.receipt)
            assert res.inserted_len == SEQ_LEN and m.prefix_len >= SYS_LEN
        return {"insert_4k_p50_us": _pct(samples, 0.5), "insert_4k_p99_us": _pct(samples, 0.99)}

    def _evict(self) -> float:
        """Per page freed, batches of 1024 tokens from the LRU end (the growth loop refills)."""
        batch = max(1, 1024 // self.P)
        per_page = []
        for _ in range(EVICT_BATCHES):
            t0 = time.perf_counter_ns()
            res = self.tree.evict(full_pages=batch)
            dt = time.perf_counter_ns() - t0
            if res.full_pages:
                per_page.append(dt // res.full_pages)
        return _pct(per_page, 0.5)


def _numbers(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page-sizes", default="64,16,1")
    ap.add_argument("--tokens", default="1e6,1e7,5e7", help="checkpoints (cached tokens)")
    ap.add_argument("--max-tokens-p1", default="1e7",
                    help="last checkpoint for pages of 1 token (memory)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    sizes = _numbers(args.page_sizes)
    if len(sizes) > 1:  # one process per page size: RSS a tree freed is not given back to the OS
        figures: dict[str, float] = {}
        for P in sizes:
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                subprocess.run([sys.executable, __file__, "--page-sizes", str(P), "--tokens",
                                args.tokens, "--max-tokens-p1", args.max_tokens_p1,
                                "--json", tmp.name], check=True)
                with open(tmp.name) as fh:
                    figures.update(json.load(fh))
        if args.json:
            write_json(args.json, figures)
        return figures
    figures = {}
    for P in sizes:
        marks = [t for t in _numbers(args.tokens)
                 if P != 1 or t <= int(float(args.max_tokens_p1))]
        g = Grower(P, marks[-1])
        rows = []
        for mark in marks:
            t = time.perf_counter()
            g.grow_to(mark)
            grow_s = time.perf_counter() - t
            row = g.measure()
            rows.append(row)
            print(f"p{P} {row['cached_tokens'] / 1e6:.1f}M tokens (grown in {grow_s:.0f} s): "
                  + ", ".join(f"{k} {row[k]:.3g}" for k in FIGURES), flush=True)
            for k in FIGURES:
                figures[f"p{P}_{int(mark)}_{k}"] = row[k]
        first, last = rows[0], rows[-1]
        print(f"p{P} ratio {last['cached_tokens'] / 1e6:.1f}M / "
              f"{first['cached_tokens'] / 1e6:.1f}M: "
              + ", ".join(f"{k} {last[k] / first[k]:.2f}" for k in FIGURES if first[k]),
              flush=True)
        del g
        gc.collect()
    if args.json:
        write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
