"""Memory isolation's price on the host tier (L2): segmented host pools against one shared pool.

The host-tier addition to bench/segments_bench.py: two daemon processes in one run, identical but
for ``memory_isolation`` ("segments" at the default host segment size, and "none"), each with a
CPU model of 8 layers (4 full, 4 SWA), 8 KV heads, head dim 128, float16, page 16 (256 KiB a host
page) and a host tier of 2048 full and 512 SWA slots (640 MiB), serving two tenants in two
namespaces through the key-addressed store (what the SGLang HiCache backend uses). Alice first
stores half the full host pool, so that her namespace holds many segments. For each it prints:

- ``kv_attach`` in a new client of alice (one descriptor and one mapping per segment of her
  namespace, against one of each per pool), the segments mapped and the mappings it added;
- the keyed hot path of one tenant in steady state (the host pool full of her pages, so each
  new page evicts her oldest): ``kv_reserve`` + write + ``kv_commit`` of 8 pages, ``kv_lookup``
  of 8 stored keys (p50);
- the cross-namespace churn: the tenants take turns at storing 60 % of the full host pool and
  clearing it, so that host segments change namespace (each a fresh zeroed memfd whose pages the
  kernel zero-fills as the engine writes them, and the client maps them: ``kv_attach`` again),
  per turn: about 300 MiB of host segments change namespace each turn;
- the daemon's mappings and descriptors;

and the ratio segments / none for each. Usage::

    python bench/host_segments_bench.py [--quick] [--json PATH]
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "clients", "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import argparse  # noqa: E402
import time  # noqa: E402

from radixd_client import Client  # noqa: E402

from bench._common import DaemonProcess, write_json  # noqa: E402
from bench.segments_bench import TENANTS, isolation_config, p50, timed_us  # noqa: E402

HOST = 2048
BATCH = 8


def _config(isolation: str) -> str:
    return isolation_config(isolation, f"full_pages = 64\nswa_pages = 64\nhost_pages = {HOST}\n"
                                       "host_swa_pages = 512\nl3 = false")


def _maps() -> int:
    with open("/proc/self/maps", encoding="ascii") as f:
        return sum(1 for _ in f)


class Side:
    def __init__(self, isolation: str) -> None:
        self.d = DaemonProcess(_config(isolation), admin=True)
        self.alice, self.bob = (Client(self.d.socket, token=t) for _, t, _ in TENANTS)
        self.pools = {c: c.kv_attach("m") for c in (self.alice, self.bob)}
        self.figures: dict[str, list[float]] = {}
        self.n = 0

    def add(self, key: str, value: float) -> None:
        self.figures.setdefault(key, []).append(value)

    def keys(self, k: int) -> list[bytes]:
        self.n += k
        return [b"key-%d" % i for i in range(self.n - k, self.n)]

    def store(self, c: Client, keys: list[bytes]) -> None:
        """Reserve, write every reserved slot, commit (as the SGLang backend's set)."""
        r = c.kv_reserve("m", keys, "full")
        t = self.pools[c].full
        for s in r.slots:
            if s:
                t[s] = 1
        if r.pin:
            c.kv_commit("m", r.pin)

    def close(self) -> None:
        self.alice.close()
        self.bob.close()
        self.d.stop()


def setup(side: Side) -> None:
    for _ in range(HOST // 2 // 64):  # alice holds half the full host pool
        side.store(side.alice, side.keys(64))
    attach, segs, maps = [], 0, 0
    for _ in range(5):
        with Client(side.d.socket, token="alice-token") as c:
            before = _maps()
            t = time.perf_counter()
            pools = c.kv_attach("m")
            attach.append((time.perf_counter() - t) * 1000)
            segs, maps = len(pools.segments) or len(pools.infos), _maps() - before
            del pools
    side.add("kv_attach_ms", p50(attach))
    side.add("kv_attach_segments", float(segs))
    side.add("kv_attach_mappings", float(maps))
    side.add("daemon_mappings", float(side.d.mappings()))
    side.add("daemon_fds", float(side.d.fds()))


def hot_path(side: Side, reps: int) -> None:
    """Alice alone, in steady state: the full host pool holds her pages (filled first, not
    timed), so each new page evicts her oldest, in her own segments."""
    alice = side.alice
    for _ in range(HOST // 64 + 1):
        side.store(alice, side.keys(64))
    side.add("reserve_commit_8_p50_us",
             p50(timed_us(lambda: side.store(alice, side.keys(BATCH)), reps)))
    stored = side.keys(BATCH)
    side.store(alice, stored)
    side.add("lookup_8_p50_us",
             p50(timed_us(lambda: alice.kv_lookup("m", stored, "full", pin=False), reps)))


def churn(side: Side, turns: int) -> None:
    """The tenants take turns at 60 % of the full host pool, clearing it after (alice's own
    pages cleared first: what is measured is segments changing namespace, not eviction)."""
    side.alice.kv_clear("m")
    n = int(HOST * 0.6)
    times = []
    for i in range(turns):
        c = (side.alice, side.bob)[i % 2]
        t = time.perf_counter()
        for _ in range(n // 64):
            side.store(c, side.keys(64))
        times.append(time.perf_counter() - t)
        c.kv_clear("m")
    side.add("churn_turn_ms", p50(times) * 1000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds; the two daemons take turns within each (default 5)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args()
    reps = 100 if args.quick else 500
    sides = {"segments": Side("segments"), "none": Side("none")}
    try:
        for side in sides.values():
            setup(side)
        for r in range(args.rounds):  # alternate which goes first: a busy machine hits both
            order = list(sides.values()) if r % 2 == 0 else list(sides.values())[::-1]
            for side in order:
                side.alice.kv_clear("m")
                hot_path(side, reps)
                churn(side, turns=4)
    finally:
        for side in sides.values():
            side.close()
    seg = {k: p50(v) for k, v in sides["segments"].figures.items()}
    none = {k: p50(v) for k, v in sides["none"].figures.items()}
    print(f"host tier: medians of {args.rounds} rounds ({reps} repetitions each for latencies)")
    print(f"{'figure':<26}{'segments':>12}{'none':>12}{'ratio':>8}")
    figures: dict[str, float] = {}
    for key in seg:
        ratio = seg[key] / none[key] if none[key] else float("nan")
        print(f"{key:<26}{seg[key]:>12.1f}{none[key]:>12.1f}{ratio:>8.2f}")
        figures[f"segments_{key}"], figures[f"none_{key}"] = seg[key], none[key]
        figures[f"ratio_{key}"] = ratio
    if args.json:
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
