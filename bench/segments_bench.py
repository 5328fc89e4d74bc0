"""Memory isolation's price: the same daemon with segmented pools and with one shared pool.

Two daemon processes in one run, identical but for ``memory_isolation`` ("segments" at the
default segment size, and "none"), each serving a CPU model of 8 layers (4 full, 4 SWA), 8 KV
heads, head dim 128, float16, page 16 (256 KiB a page, 512 MiB in each of the full and SWA
pools) to two tenants in two namespaces. For each it prints what an operator pays:

- start-up to serving (the pools are built: one memfd per segment against one per pool),
  mappings and descriptors in the daemon, RSS;
- ``attach`` in a new client (one mapping per segment and layer strip);
- the hot path in one namespace: match of a cached 4k-token prompt, alloc + free of 16 pages,
  a whole request (match+lock, alloc, cache_finished) with its evictions;
- the cross-namespace churn: two tenants taking turns at filling 60 % of the pool and freeing
  it, so that segments change namespace (each move gives the segment fresh zeroed memory), with
  the number of moves the daemon counted and the cost per moved MiB.

and the ratio segments / none for each figure. Usage::

    python bench/segments_bench.py [--quick] [--json PATH]
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "clients", "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from array import array  # noqa: E402
from typing import Any  # noqa: E402

from radixd_client import Client  # noqa: E402

from bench._common import DaemonProcess, write_json  # noqa: E402

PAGE = 16
FULL_PAGES = 2048
TENANTS = (("alice", "alice-token", "ns-a"), ("bob", "bob-token", "ns-b"))
PAGE_MIB = 2 * 8 * 128 * 2 * PAGE * 4 / 2**20  # K and V, 8 heads, dim 128, fp16, 4 layers


def isolation_config(isolation: str, pools: str) -> str:
    """The daemon of this bench and of ``host_segments_bench``: one CPU model (page 16, 4 full and
    4 SWA layers, 8 KV heads, head dim 128, fp16) with the pool sizes ``pools`` (TOML lines of
    the model's table) and two tenants in two namespaces."""
    tenants = "".join(f'[[tenants]]\nname = "{n}"\ntoken = "{t}"\nnamespace = "{ns}"\n'
                      for n, t, ns in TENANTS)
    return f"""log_level = "warning"
[server]
socket = "{{socket}}"
malloc_trim_interval_s = 0
[admin]
unix_socket = "{{admin}}"
token = "bench"
[checker]
interval_s = 3600.0
[[models]]
name = "m"
page_size = {PAGE}
sliding_window = 128
num_full_layers = 4
num_swa_layers = 4
num_kv_heads = 8
head_dim = 128
dtype = "float16"
device = "cpu"
{pools}
memory_isolation = "{isolation}"
{tenants}"""


def _config(isolation: str) -> str:
    return isolation_config(isolation, f"full_pages = {FULL_PAGES}\nswa_pages = {FULL_PAGES}\n"
                                       "host_pages = 0")


def p50(xs: list[float]) -> float:
    return statistics.median(xs)


def timed_us(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t) / 1000)
    return out


def _tokens(rng: random.Random, n: int, prefix: list[int] | None = None) -> bytes:
    return array("i", (prefix or []) + [rng.randrange(1, 100_000) for _ in
                                        range(n - len(prefix or []))]).tobytes()


class Side:
    """One daemon (one layout) and its two tenants' clients."""

    def __init__(self, isolation: str) -> None:
        t0 = time.perf_counter()
        self.d = DaemonProcess(_config(isolation), admin=True)
        self.start_s = time.perf_counter() - t0
        self.alice, self.bob = (Client(self.d.socket, token=t) for _, t, _ in TENANTS)
        self.figures: dict[str, list[float]] = {}

    def add(self, key: str, value: float) -> None:
        self.figures.setdefault(key, []).append(value)

    def close(self) -> None:
        self.alice.close()
        self.bob.close()
        self.d.stop()


def setup(side: Side) -> None:
    """What is measured once: start-up, attach, the daemon's mappings, descriptors and RSS."""
    side.add("start_s", side.start_s)
    attach = []
    for _ in range(5):
        with Client(side.d.socket, token="alice-token") as c:
            t = time.perf_counter()
            c.attach("m")
            attach.append((time.perf_counter() - t) * 1000)
    side.add("attach_ms", p50(attach))
    side.alice.attach("m")
    side.add("daemon_mappings", float(side.d.mappings()))
    side.add("daemon_fds", float(side.d.fds()))
    side.add("daemon_rss_mib", side.d.rss_mb())


def hot_path(side: Side, reps: int, seed: int) -> None:
    """One round of the single-namespace figures (p50 of ``reps`` each)."""
    rng = random.Random(seed)
    alice = side.alice
    alice.evict("m", full_pages=FULL_PAGES, swa_pages=FULL_PAGES)
    prompt = _tokens(rng, 4096)
    a = alice.alloc("m", 4096 // PAGE)
    alice.insert("m", prompt, a.full_pages, a.swa_pages)
    side.add("match_4k_p50_us", p50(timed_us(lambda: alice.match("m", prompt), reps)))

    def alloc_free() -> None:
        got = alice.alloc("m", 16)
        alice.free("m", got.full_pages, got.swa_pages)
    side.add("alloc_free_16_p50_us", p50(timed_us(alloc_free, reps)))

    prefixes = [list(array("i", _tokens(rng, 1024))) for _ in range(8)]
    it = iter([_tokens(rng, 1024 + 2 * PAGE, rng.choice(prefixes)) for _ in range(reps)])

    def request() -> None:
        toks = next(it)
        m = alice.match("m", toks, lock=True)
        got = alice.alloc("m", len(toks) // 4 // PAGE - m.prefix_len // PAGE)
        alice.cache_finished("m", toks, got.full_pages, got.swa_pages, m.prefix_len, 0,
                             m.receipt)
    side.add("request_p50_us", p50(timed_us(request, reps)))


def churn(side: Side, turns: int) -> None:
    """The tenants take turns at 60 % of the pool (alice's cache emptied first, so that what
    is measured is segments changing namespace, not eviction)."""
    side.alice.evict("m", full_pages=FULL_PAGES, swa_pages=FULL_PAGES)
    before = _moved_mib(side.d)
    n = int(FULL_PAGES * 0.6)
    times = []
    for i in range(turns):
        c = (side.alice, side.bob)[i % 2]
        t = time.perf_counter()
        got = c.alloc("m", n)
        times.append(time.perf_counter() - t)
        c.free("m", got.full_pages, got.swa_pages)
    side.add("churn_alloc_p50_ms", p50(times) * 1000)
    side.add("churn_moved_mib", _moved_mib(side.d) - before)
    side.add("churn_s_total", sum(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds; the two daemons take turns within each (default 5)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args()
    reps = 200 if args.quick else 1000
    sides = {"segments": Side("segments"), "none": Side("none")}
    try:
        for side in sides.values():
            setup(side)
        for r in range(args.rounds):  # alternate which goes first: a busy machine hits both
            order = list(sides.values()) if r % 2 == 0 else list(sides.values())[::-1]
            for side in order:
                hot_path(side, reps, seed=r)
                churn(side, turns=4)
    finally:
        for side in sides.values():
            side.close()
    seg = {k: p50(v) for k, v in sides["segments"].figures.items()}
    none = {k: p50(v) for k, v in sides["none"].figures.items()}
    print(f"medians of {args.rounds} rounds ({reps} repetitions each for the latencies)")
    print(f"{'figure':<24}{'segments':>12}{'none':>12}{'ratio':>8}")
    figures: dict[str, float] = {}
    for key in seg:
        ratio = seg[key] / none[key] if none[key] else float("nan")
        print(f"{key:<24}{seg[key]:>12.1f}{none[key]:>12.1f}{ratio:>8.2f}")
        figures[f"segments_{key}"], figures[f"none_{key}"] = seg[key], none[key]
        figures[f"ratio_{key}"] = ratio
    if seg["churn_moved_mib"]:
        per_mib = (seg["churn_s_total"] - none["churn_s_total"]) * 1000 / seg["churn_moved_mib"]
        print(f"churn: {seg['churn_moved_mib']:.0f} MiB of segments changed namespace a round; "
              f"extra time per moved MiB (segments - none): {per_mib:.3f} ms")
        figures["move_ms_per_mib"] = per_mib
    if args.json:
        write_json(args.json, figures)


def _moved_mib(d: DaemonProcess) -> float:
    """MiB of segments the daemon gave fresh zeroed memory because they changed namespace."""
    segs = d.admin_json("/v1/stats")["models"]["m"]["segments"] or {}
    return sum(s["moved"] * s["segment_pages"] for s in segs.values()) * PAGE_MIB


if __name__ == "__main__":
    main()
