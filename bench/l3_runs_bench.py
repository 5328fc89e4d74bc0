"""What L3 runs and windows buy: Redis keys, bytes and daemon CPU of this checkout's daemon
against a baseline git ref's (default c249a41, one Redis value per page), in the same run.

Since 34c4f43 a full-pool Redis value is a *run*: the pages of one hash block (``ceil(64/P)``
pages, at least 64 tokens) from the block's start to its end or to a node's end (protocol.md 9.3).
Since 7c7dce1 a node's SWA pages are one value too, its *window* (before, one value per page of
the window; ``--baseline 7cccc2d`` compares with that). For each page size P of ``--page-sizes``,
each side (the baseline ref, exported with ``git archive``, and this checkout) and each of
``--rounds`` rounds (the order flipping every round: base, this, this, base, ...) a daemon of its
own is started (CPU device; one full and one SWA layer, 1 KV head of 128 dims in float16, i.e.
512 bytes per token per layer; a window of 128 tokens; device and host pools that hold every
request; ``[l3]`` write_through under a key prefix unique to the side and page size). Then:

* **write**: one client caches ``--requests`` distinct random sequences of ``--request-tokens``
  tokens, each as one alloc + insert, with random KV written into its pages of the mapped pools;
  the first half share a prefix of ``--shared-tokens`` tokens (1000 by default: not a multiple of
  64, so a node ends inside a hash block and runs span nodes). Both daemons drop the oldest
  queued L3 writes past 16384 pages, so an insert waits (polling the daemon's stats, about
  0.6 ms of its CPU each, counted in the write CPU; ``pace_polls`` in the JSON) while more than
  12288 pages are owed to Redis: only at small pages. The write is done when the
  daemon's host copy and L3 queues are empty and its ``l3_write_pages`` counter has not moved
  for 0.5 s. Measured: Redis keys under the prefix (full and ``:swa``), their bytes (sum of
  STRLEN) and Redis' own MEMORY USAGE, the daemon's CPU (utime+stime from /proc) from the first
  insert until the write is done, per request, and the wall time.
* **read**: ``evict`` empties the tree (device and host); then for each request, in order, a
  ``prefetch(policy="wait_complete")``, timed; the daemon's CPU over all prefetches, per
  request. Each request must then be usable whole (``match``: ``prefix_len + host_hit_len`` is
  its whole pages); a request that is not is a shortfall, reported (and the exit status is 1).

Figures are means over the rounds. CPU is read in clock ticks (10 ms): where a side spends
only a few ticks (prefetch at P >= 16) the ratio moves by 20% between runs. Keys are deleted
and daemons stopped after each side, also on errors.

    python bench/l3_runs_bench.py [--baseline c249a41] [--page-sizes 1,4,16,64] [--requests 16]
        [--request-tokens 4096] [--shared-tokens 1000] [--rounds 2] [--redis URL] [--quick]
        [--json PATH]
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
import secrets  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from array import array  # noqa: E402
from typing import Any  # noqa: E402

import redis  # noqa: E402
import torch  # noqa: E402
from radixd_client import Client  # noqa: E402

from bench._common import DaemonProcess, export_ref, write_json  # noqa: E402

MODEL = "l3b"
WINDOW = 128
#: the model's KV shape: one full and one SWA layer of 1 head x 128 dims, float16
LAYERS, HEADS, DIM = 1, 1, 128
REDIS_URL = "redis://127.0.0.1:6379"
#: both daemons' cap on pages queued for Redis (daemon/tiers.py, daemon/l3_tier.py MAX_L3_QUEUE)
MAX_L3_QUEUE = 16384
#: the inserts wait while more pages than this are owed to Redis (a margin under the cap)
PACE_PAGES = MAX_L3_QUEUE * 3 // 4
CONFIG = """log_level = "warning"
[server]
socket = "{socket}"
[admin]
unix_socket = "{admin}"
token = "bench"
[checker]
interval_s = 3600.0
[l3]
url = "%(url)s"
key_prefix = "%(prefix)s"
write_policy = "write_through"
[[models]]
name = "%(model)s"
page_size = %(page)d
sliding_window = %(window)d
num_full_layers = %(layers)d
num_swa_layers = %(layers)d
num_kv_heads = %(heads)d
head_dim = %(dim)d
dtype = "float16"
device = "cpu"
memory_isolation = "none"
full_pages = %(pages)d
swa_pages = %(pages)d
host_pages = %(pages)d
host_swa_pages = %(pages)d
"""
#: (figure key, table label, format) of the table's rows
ROWS = (("keys", "keys", "{:12.0f}"), ("full_keys", "  full keys", "{:12.0f}"),
        ("swa_keys", "  swa keys", "{:12.0f}"), ("bytes", "bytes in Redis", "{:12.0f}"),
        ("redis_memory", "Redis MEMORY USAGE", "{:12.0f}"),
        ("write_cpu_ms_per_req", "write CPU ms/req", "{:12.2f}"),
        ("write_wall_s", "write wall s", "{:12.2f}"),
        ("prefetch_p50_ms", "prefetch p50 ms", "{:12.2f}"),
        ("prefetch_cpu_ms_per_req", "prefetch CPU ms/req", "{:12.2f}"),
        ("fetched_tokens", "fetched tokens", "{:12.0f}"),
        ("write_failures", "L3 write failures", "{:12.0f}"),
        ("shortfall_requests", "shortfall requests", "{:12.0f}"))
#: figures that must be 0 on both sides
FAILURES = ("write_failures", "shortfall_requests")


def parse_page_sizes(text: str) -> list[int]:
    """``--page-sizes``: comma-separated page sizes from 1 to 1024. Raises ValueError."""
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--page-sizes: comma-separated integers, got {text!r}") from None
    if not sizes or any(not 1 <= p <= 1024 for p in sizes):
        raise ValueError(f"--page-sizes: each from 1 to 1024, got {text!r}")
    return sizes


def check_shape(requests: int, request_tokens: int, shared_tokens: int, sizes: list[int]) -> None:
    """Raises ValueError, naming the option, for a workload it cannot build."""
    if requests < 1:
        raise ValueError(f"--requests: at least 1, got {requests}")
    if request_tokens < max(sizes) or request_tokens > 1 << 16:
        raise ValueError(f"--request-tokens: from the largest page size ({max(sizes)}) to 65536,"
                         f" got {request_tokens}")
    if not 0 <= shared_tokens < request_tokens:
        raise ValueError(f"--shared-tokens: from 0 to below --request-tokens, got {shared_tokens}")


def workload(seed: int, requests: int, tokens: int, shared: int) -> list[list[int]]:
    """``requests`` random token sequences; the first half start with the same ``shared``."""
    rng = random.Random(seed)
    common = [rng.randrange(1, 100_000) for _ in range(shared)]
    out = []
    for i in range(requests):
        head = common if i < requests // 2 else []
        out.append(head + [rng.randrange(1, 100_000) for _ in range(tokens - len(head))])
    return out


def config(url: str, prefix: str, page: int, requests: int, tokens: int) -> str:
    """The daemon's TOML: pools that hold every request's pages, plus slack."""
    pages = requests * (tokens // page) + 64
    return CONFIG % dict(url=url, prefix=prefix, model=MODEL, page=page, window=WINDOW,
                         layers=LAYERS, heads=HEADS, dim=DIM, pages=pages)


def model_stats(c: Client) -> dict[str, int]:
    return c.stats(MODEL).models[MODEL]


def tier_counters(d: DaemonProcess) -> dict[str, int]:
    """The model's tier counters (admin ``/v1/stats``)."""
    return d.admin_json("/v1/stats")["models"][MODEL]["tiers"]


def wait_written(d: DaemonProcess, timeout: float = 300.0) -> tuple[float, int]:
    """Waits until the host copies and L3 writes are done: both queues empty and
    ``l3_write_pages`` unmoved for 0.5 s. Returns the perf_counter when the final count was
    first seen, and the L3 write failures (dropped or failed values)."""
    last, since, deadline = None, time.perf_counter(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = tier_counters(d)
        now = (st["l3_write_pages"], st["l3_write_failures"], st["backups"])
        busy = st["backup_queue"] or st["l3_write_queue"]
        if busy or now != last:
            last, since = (None if busy else now), time.perf_counter()
        elif time.perf_counter() - since >= 0.5:
            return since, st["l3_write_failures"]
        time.sleep(0.2)
    raise RuntimeError("the L3 writes did not finish")


def redis_figures(r: redis.Redis, prefix: str) -> dict[str, float]:
    """Keys under ``prefix`` (all, full, swa), sum of STRLEN and of MEMORY USAGE."""
    keys = list(r.scan_iter(match=prefix + ":*", count=1000))
    sizes, mem = [], []
    for i in range(0, len(keys), 1000):
        p = r.pipeline(transaction=False)
        for k in keys[i:i + 1000]:
            p.strlen(k)
            p.memory_usage(k, samples=0)
        got = p.execute()
        sizes += got[0::2]
        mem += got[1::2]
    swa = sum(1 for k in keys if k.endswith(b":swa"))
    return {"keys": len(keys), "full_keys": len(keys) - swa, "swa_keys": swa,
            "bytes": sum(sizes), "redis_memory": sum(m or 0 for m in mem)}


def delete_prefix(r: redis.Redis, prefix: str) -> int:
    keys = list(r.scan_iter(match=prefix + ":*", count=1000))
    for i in range(0, len(keys), 1000):
        r.delete(*keys[i:i + 1000])
    return len(keys)


def pending_pages(d: DaemonProcess, c: Client) -> int:
    """Pages inserted but not yet written to Redis: device pages without a host copy yet, plus
    the L3 write queue."""
    return model_stats(c)["tree_full_pages"] - (t := tier_counters(d))["host_pages_in_tree"] \
        + t["l3_write_queue"]


def cache_requests(d: DaemonProcess, c: Client, page: int, reqs: list[list[int]],
                   seed: int) -> int:
    """Each request as one alloc + insert, random KV written into its full and SWA pages.
    Paced so that the pages owed to Redis stay under PACE_PAGES (both daemons drop the
    oldest queued L3 writes past MAX_L3_QUEUE pages): returns the polls that took."""
    pools = c.attach(MODEL)
    gen = torch.Generator().manual_seed(seed)
    kv = [torch.randn((LAYERS, 2, len(t) // page, page, HEADS, DIM), generator=gen)
          .to(torch.float16) for t in reqs]
    toks = [array("i", t[:len(t) // page * page]).tobytes() for t in reqs]
    owed, polls = 0, 0  # an upper bound of pending_pages, known at the last poll + inserted since
    for data, t in zip(kv, toks, strict=True):
        need = data.shape[2] + -(-WINDOW // page)
        while owed + need > PACE_PAGES:
            if polls:
                time.sleep(0.05)
            owed, polls = pending_pages(d, c), polls + 1
        a = c.alloc(MODEL, data.shape[2])
        for pool, ids in ((pools.full, a.full_pages), (pools.swa, a.swa_pages)):
            pool[:, :, torch.frombuffer(bytearray(ids), dtype=torch.int32).long()] = data
        c.insert(MODEL, t, a.full_pages, a.swa_pages)
        owed += need
    return polls


def empty_tree(c: Client) -> None:
    """Evicts everything, device and host, until the tree holds no page."""
    big = 1 << 30
    for _ in range(20):
        c.evict(MODEL, full_pages=big, swa_pages=big, host_pages=big)
        st = model_stats(c)
        if not (st["tree_full_pages"] or st["tree_swa_pages"] or st["tree_host_pages"]):
            return
        time.sleep(0.1)
    raise RuntimeError(f"evict left pages in the tree: {st}")


def measure_side(root: str, url: str, prefix: str, page: int, reqs: list[list[int]],
                 seed: int) -> dict[str, float]:
    """One daemon from ``root`` at page size ``page``: the write and read figures."""
    r = redis.Redis.from_url(url)
    d = None
    try:
        d = DaemonProcess(config(url, prefix, page, len(reqs), len(reqs[0])), admin=True,
                          root=root)
        with Client(d.socket, client_name="l3-runs-bench", timeout=120) as c:
            cpu0, t0 = d.cpu_s(), time.perf_counter()
            polls = cache_requests(d, c, page, reqs, seed)
            t1, failures = wait_written(d)
            out: dict[str, float] = {"write_cpu_ms_per_req": (d.cpu_s() - cpu0) * 1e3 / len(reqs),
                                     "write_wall_s": t1 - t0, "pace_polls": polls,
                                     "write_failures": failures}
            out.update(redis_figures(r, prefix))
            empty_tree(c)
            lat, fetched = [], 0
            cpu0 = d.cpu_s()
            for t in reqs:
                t0 = time.perf_counter()
                res = c.prefetch(MODEL, array("i", t).tobytes(), policy="wait_complete")
                lat.append(time.perf_counter() - t0)
                fetched += res.fetched_len
            out["prefetch_cpu_ms_per_req"] = (d.cpu_s() - cpu0) * 1e3 / len(reqs)
            out["prefetch_p50_ms"] = statistics.median(lat) * 1e3
            out["fetched_tokens"] = fetched
            short = []
            for i, t in enumerate(reqs):
                m = c.match(MODEL, array("i", t).tobytes())
                got, want = m.prefix_len + m.host_hit_len, len(t) // page * page
                if got < want:
                    short.append(f"request {i}: {got} of {want} tokens usable")
            out["shortfall_requests"] = len(short)
            for s in short:
                print(f"  SHORTFALL page {page} {root}: {s}", file=sys.stderr)
            st = tier_counters(d)
            out["prefetch_no_room"] = st["prefetch_no_room"]
            out["l3_write_runs_skipped"] = st.get("l3_write_runs_skipped", 0)
        return out
    finally:
        if d is not None:
            d.stop()
        delete_prefix(r, prefix)
        r.close()


def run(baseline: str, sizes: list[int], requests: int, tokens: int, shared: int,
        url: str = REDIS_URL, rounds: int = 2, seed: int = 1) -> dict[str, float]:
    """Every figure, flat: ``<figure>_p<P>_<base|this|ratio>``, the mean over ``rounds`` (a
    fresh daemon each, the order flipping every round: base, this, this, base, ...); failures
    (FAILURES) are summed instead."""
    base_root = export_ref(baseline)
    tag = secrets.token_hex(4)
    out: dict[str, float] = {"requests": requests, "request_tokens": tokens,
                             "shared_tokens": shared, "rounds": rounds}
    sides = (("base", base_root), ("this", _ROOT))
    try:
        for page in sizes:
            reqs = workload(seed + page, requests, tokens, shared)
            for r in range(rounds):
                for side, root in (sides if r % 2 == 0 else sides[::-1]):
                    t = time.perf_counter()
                    got = measure_side(root, url, f"radixd-l3bench-{tag}-{side}-p{page}-r{r}",
                                       page, reqs, seed)
                    for k, v in got.items():
                        key = f"{k}_p{page}_{side}"
                        out[key] = out.get(key, 0.0) + (v if k in FAILURES else v / rounds)
                    print(f"  page {page} {side} round {r + 1}: "
                          f"{time.perf_counter() - t:.1f} s", file=sys.stderr)
            for k, *_ in ROWS:
                b = out[f"{k}_p{page}_base"]
                out[f"{k}_p{page}_ratio"] = out[f"{k}_p{page}_this"] / b if b else float("nan")
    finally:
        shutil.rmtree(base_root, ignore_errors=True)
    return out


def print_table(f: dict[str, Any], sizes: list[int], baseline: str) -> None:
    print(f"{'page':>4} {'metric':<20} {baseline:>12} {'this':>12} {'this/base':>10}")
    for page in sizes:
        for k, label, fmt in ROWS:
            ratio = f[f"{k}_p{page}_ratio"]
            print(f"{page:>4} {label:<20} {fmt.format(f[f'{k}_p{page}_base'])} "
                  f"{fmt.format(f[f'{k}_p{page}_this'])} "
                  + (f"{ratio:>10.3f}" if ratio == ratio else f"{'-':>10}"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="c249a41", help="git ref to compare with")
    ap.add_argument("--page-sizes", default="1,4,16,64", help="comma-separated (1,4,16,64)")
    ap.add_argument("--requests", type=int, default=16, help="sequences cached (16)")
    ap.add_argument("--request-tokens", type=int, default=4096, help="tokens each (4096)")
    ap.add_argument("--shared-tokens", type=int, default=1000,
                    help="a prefix the first half of the requests share (1000; 0: none)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="daemons per side and page size, order alternating; figures are means")
    ap.add_argument("--redis", default=REDIS_URL, help=f"Redis URL ({REDIS_URL})")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4 requests of 1024 tokens sharing 250, 1 round")
    ap.add_argument("--json", metavar="PATH", help="write the figures as a flat JSON object")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.request_tokens, args.shared_tokens, args.rounds = 4, 1024, 250, 1
    try:
        sizes = parse_page_sizes(args.page_sizes)
        check_shape(args.requests, args.request_tokens, args.shared_tokens, sizes)
        if args.rounds < 1:
            raise ValueError(f"--rounds: at least 1, got {args.rounds}")
    except ValueError as e:
        ap.error(str(e))
    f = run(args.baseline, sizes, args.requests, args.request_tokens, args.shared_tokens,
            args.redis, args.rounds)
    print(f"baseline {args.baseline}; {args.requests} requests of {args.request_tokens} tokens, "
          f"the first {args.requests // 2} sharing {args.shared_tokens}; window {WINDOW}; "
          f"{2 * LAYERS * HEADS * DIM * 2} bytes per token per layer; mean of {args.rounds} "
          "round(s), order alternating")
    print_table(f, sizes, args.baseline)
    if args.json:
        write_json(args.json, {k: round(v, 4) for k, v in f.items()})
    if any(f[f"{k}_p{p}_{s}"] for k in FAILURES for p in sizes for s in ("base", "this")):
        print("FAILED: L3 write failures, or requests not fetched whole (SHORTFALL lines)")
        sys.exit(1)
    return f


if __name__ == "__main__":
    main()
