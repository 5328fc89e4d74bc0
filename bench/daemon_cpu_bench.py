"""Daemon CPU per operation: this checkout's daemon against a baseline git ref's, in the same run.

The workload is rpc_bench's mixed engine request (match+lock, alloc, cache_finished) from 1 and 8
client processes. For each side the figures are ops/s and the daemon's own CPU time per operation:
utime+stime of the daemon process from /proc/<pid>/stat, read just before the clients start their
timed loop and just after the last one finishes, divided by the operations the clients completed
in that window (each one is exactly one request the daemon handled). ``loop_cpu_us_per_op`` is
the part of it spent on the daemon's main thread, where its event loop runs (from
/proc/<pid>/task/<pid>/stat): the difference is its other threads' (tier copies, torch's worker
pools), which on a many-core host can grow without the loop doing more. The baseline ref is exported
with ``git archive`` into a temporary directory and its daemon runs from there.

The floor, measured in the same run on this checkout's daemon with the same client counts, is
an 8-byte ``ping`` instead of the mixed operations: what one request costs the daemon in socket
reads and writes, the event loop and the kernel's wake-ups, before any operation's own work. On
a small, shared machine that part is most of the total (``--no-floor`` leaves it out).

``--page-size P`` (default 64) runs both daemons at page size P, a divisor of 64, with the
request keeping its shape in tokens: a cached shared prefix of 256 tokens plus 128 fresh ones, as
at 64 (4 and 2 pages). ``--request-tokens N`` (a multiple of 4 * P, at most 8192) makes it a
request of N tokens instead, 3/4 of them a cached shared prefix and 1/4 fresh. The pools (device
and host, full and SWA) hold the same tokens at every page size (64/P times the pages), and each
client has 512 * 128 / fresh distinct requests, so the tree holds about as many tokens whatever
the shape. Those requests are cycled: once a client has sent each one, its fresh tokens are
cached and every later request is a full hit (match, an empty alloc, cache_finished inserting
nothing); each client sends every one of them once before the timed window (before 2026-11-26 a
0.2 s warm-up did not, so a window began with some inserts and their host-tier copies).
``--fresh`` makes every request's fresh part new to the tree (its first token a number the
client never sent before), so that each one allocates and inserts its fresh pages; before
the timed window the clients send such requests until the tree holds 95% of a pool (the SWA
pool, the smaller), so that every page size is measured in the same regime, the steady state of
a full cache where allocations evict about what they take.

``--batch K`` sends the requests as a scheduler step of K engine requests would: K match+lock
operations in one ``batch`` frame, then their K allocs in one, then their K cache_finished in one
(the floor: K pings a frame). Each item counts as one operation: what is left per operation once
a frame's read, write and wake-up are shared by K of them. Both daemons take the same frames.

``--device cuda`` (or ``cuda:N``) puts both daemons' pools on that GPU: the host pool is
page-locked and the tier copies are issued from the event loop onto a CUDA stream, so their
launches count in the loop's CPU.

    python bench/daemon_cpu_bench.py [--baseline main] [--seconds 5] [--rounds 2] [--host-off]
        [--no-floor] [--page-size P] [--request-tokens N] [--fresh] [--batch K]
        [--device cpu|cuda[:N]] [--json PATH]
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "clients", "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import argparse  # noqa: E402
import multiprocessing as mp  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402
from array import array  # noqa: E402

from radixd_client import Client  # noqa: E402

from bench._common import DaemonProcess, export_ref, write_json  # noqa: E402
from bench.rpc_bench import (  # noqa: E402
    FRESH_TOKENS,
    MODEL,
    PAGE,
    PREFIX_TOKENS,
    _cache_prompt,
    _mixed_loop,
    _mixed_ops,
    _prefixes,
    _requests,
    config,
    pool_pages,
)

#: appended to rpc_bench's model section for --host-off: no host (L2) tier
HOST_OFF = "host_pages = 0\nhost_swa_pages = 0\n"
#: appended last: no fixed admin port, so the two daemons (and other benches) never collide
ADMIN_ANY_PORT = "[admin]\nport = 0\n"
#: the model's default host (L2) pool sizes in pages (daemon.config.ModelConfig), which
#: --page-size scales like the device pools
HOST_PAGES, HOST_SWA_PAGES = 4096, 1024
#: --page-size: the divisors of PAGE (the pools scale by PAGE / P, the default shape is whole pages)
PAGE_SIZES = tuple(p for p in range(1, PAGE + 1) if PAGE % p == 0)
#: --fresh: the share of a pool the tree holds before the timed window
FILL = 0.95
#: --batch: the most requests per step (a frame of 64 items is within the daemon's default
#: max_inflight, 256)
MAX_BATCH = 64
#: --request-tokens: the most, so that 8 clients' prefixes and requests fit the SWA pool (the
#: smaller one: 1,280,000 tokens) at every page size, 8 * (8 * 6144 + 65536) = 917,504 tokens
MAX_REQUEST_TOKENS = 8192


def request_shape(page_size: int = PAGE, request_tokens: int | None = None) -> tuple[int, int]:
    """(prefix tokens, fresh tokens) of one request: rpc_bench's 256 + 128 by default, else 3/4
    and 1/4 of ``request_tokens``. Raises ValueError, naming the option, for a shape that is not
    whole pages of ``page_size`` or does not fit the pools."""
    if page_size not in PAGE_SIZES:
        raise ValueError(f"--page-size: one of {', '.join(map(str, PAGE_SIZES))} (a divisor of "
                         f"{PAGE}), got {page_size}")
    if request_tokens is None:
        return PREFIX_TOKENS, FRESH_TOKENS
    if (request_tokens <= 0 or request_tokens % (4 * page_size)
            or request_tokens > MAX_REQUEST_TOKENS):
        raise ValueError(f"--request-tokens: a multiple of 4 * page size ({4 * page_size}) up "
                         f"to {MAX_REQUEST_TOKENS}, got {request_tokens}")
    return request_tokens * 3 // 4, request_tokens // 4


def model_keys(page_size: int = PAGE, host_off: bool = False) -> str:
    """More keys for rpc_bench's model table: no host tier (``host_off``), or at another page size
    than PAGE the host pools scaled to hold the same tokens as the defaults at PAGE."""
    if host_off:
        return HOST_OFF
    if page_size == PAGE:
        return ""
    k = PAGE // page_size
    return f"host_pages = {HOST_PAGES * k}\nhost_swa_pages = {HOST_SWA_PAGES * k}\n"


class FreshRequests:
    """``reqs`` (prefix + fresh tokens each), every one handed out with the first of its fresh
    tokens replaced by a number this client never sent before (above the ids rpc_bench draws,
    distinct per ``seed``), so its fresh pages are never cached. Indexed as rpc_bench's
    _mixed_loop does (``reqs[i % len(reqs)]``)."""

    def __init__(self, reqs: list[bytes], prefix_tokens: int, seed: int) -> None:
        self.reqs, self.at = reqs, prefix_tokens * 4
        self.next = 100_000 + seed * 10**8  # int32 for seeds below 21

    def __len__(self) -> int:
        return len(self.reqs)

    def __getitem__(self, i: int) -> bytes:
        r = self.reqs[i]
        self.next += 1
        return r[:self.at] + struct.pack("=i", self.next) + r[self.at + 4:]


def _filled(c: Client, page: int) -> bool:
    """Whether the tree holds FILL of either pool (page 0 is never handed out): the SWA pool is
    the smaller, and once it is full an allocation evicts whole paths, full pages included."""
    st = c.stats(MODEL).models[MODEL]
    return any(st[k] >= FILL * (cap - 1)
               for k, cap in zip(("tree_full_pages", "tree_swa_pages"), pool_pages(page),
                                 strict=True))


def _ping_loop(c: Client, seconds: float, batch: int = 1) -> tuple[int, float]:
    """8-byte pings for ``seconds``, ``batch`` to a frame when more than one: (operations done,
    seconds taken)."""
    ops = 0
    payload = b"x" * 8
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        if batch == 1:
            c.ping(payload)
        else:
            with c.batch() as b:
                for _ in range(batch):
                    b.ping(payload)
        ops += batch
    return ops, time.perf_counter() - t0


def _step_ops(c: Client, reqs: list[bytes], page: int) -> int:
    """``reqs`` as one scheduler step sends them: a batch of their match+lock operations, one of
    their allocs, one of their cache_finished (3 operations each, in 3 frames)."""
    with c.batch() as b:
        matching = [b.match(MODEL, t, lock=True) for t in reqs]
    ms = [f.result() for f in matching]
    with c.batch() as b:
        allocs = [b.alloc(MODEL, len(t) // 4 // page - m.prefix_len // page)
                  for t, m in zip(reqs, ms, strict=True)]
    with c.batch() as b:
        for t, m, f in zip(reqs, ms, allocs, strict=True):
            a = f.result()
            b.cache_finished(MODEL, t, a.full_pages, a.swa_pages, m.prefix_len, 0, m.receipt)
    return 3 * len(reqs)


def _loop(c: Client, reqs: list[bytes], seconds: float, page: int, batch: int
          ) -> tuple[int, float]:
    """rpc_bench's mixed loop, or with ``batch`` > 1 its steps of ``batch`` requests
    (:func:`_step_ops`): (operations done, seconds taken)."""
    if batch == 1:
        return _mixed_loop(c, reqs, seconds, page)
    ops = i = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        ops += _step_ops(c, [reqs[(i + j) % len(reqs)] for j in range(batch)], page)
        i += batch
    return ops, time.perf_counter() - t0


def _worker(path: str, seconds: float, seed: int, ready: mp.Queue, go: mp.Event,
            done: mp.Queue, ping: bool = False, page: int = PAGE,
            shape: tuple[int, int] = (PREFIX_TOKENS, FRESH_TOKENS), fresh: bool = False,
            batch: int = 1) -> None:
    """Caches its prefixes (untimed), says so, waits for ``go``, then runs the timed loop
    (``ping``: the floor's loop instead). ``page``: the model's page size; ``shape``: (prefix
    tokens, fresh tokens) of a request; ``fresh``: every request's fresh part new
    (:class:`FreshRequests`), sent until the tree holds FILL of a pool before saying ready);
    ``batch``: requests per scheduler step (:func:`_loop`)."""
    rng = random.Random(seed)
    with Client(path, client_name=f"cpu-bench-{seed}") as c:
        if ping:
            _ping_loop(c, 0.2, batch)
            ready.put(seed)
            go.wait()
            done.put(_ping_loop(c, seconds, batch))
            return
        prefixes = _prefixes(rng, shape[0])
        for p in prefixes:
            _cache_prompt(c, array("i", p).tobytes(), page)
        reqs = _requests(rng, prefixes, fresh=shape[1])
        if fresh:
            reqs = FreshRequests(reqs, shape[0], seed)  # type: ignore[assignment]
        if not fresh:  # each request once, so that the window is all full hits
            for r in reqs:
                _mixed_ops(c, r, page)
        _loop(c, reqs, 0.2, page, batch)  # warm: first allocations, code paths
        while fresh and not _filled(c, page):
            _loop(c, reqs, 0.2, page, batch)
        ready.put(seed)
        go.wait()
        done.put(_loop(c, reqs, seconds, page, batch))


def measure(d: DaemonProcess, clients: int, seconds: float, ping: bool = False,
            page: int = PAGE, shape: tuple[int, int] = (PREFIX_TOKENS, FRESH_TOKENS),
            fresh: bool = False, batch: int = 1) -> dict[str, float]:
    """ops/s and daemon CPU us per operation for ``clients`` client processes on daemon ``d``
    (``ping``: 8-byte pings instead of the mixed operations; ``page``, ``shape``, ``fresh``,
    ``batch``: as :func:`_worker`)."""
    ctx = mp.get_context("spawn")
    ready: mp.Queue = ctx.Queue()
    done: mp.Queue = ctx.Queue()
    go = ctx.Event()
    procs = [ctx.Process(target=_worker, args=(d.socket, seconds, i, ready, go, done, ping,
                                               page, shape, fresh, batch))
             for i in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=180)
    cpu0, loop0, t0 = d.cpu_s(), d.loop_cpu_s(), time.perf_counter()
    go.set()
    results = [done.get(timeout=seconds + 180) for _ in procs]
    cpu1, loop1, wall = d.cpu_s(), d.loop_cpu_s(), time.perf_counter() - t0
    for p in procs:
        p.join()
    ops = sum(r[0] for r in results)
    return {"ops_per_s": ops / max(r[1] for r in results),
            "cpu_us_per_op": (cpu1 - cpu0) * 1e6 / ops,
            "loop_cpu_us_per_op": (loop1 - loop0) * 1e6 / ops,
            "daemon_cpu_share": (cpu1 - cpu0) / wall}


def run(baseline: str, seconds: float, host_off: bool, rounds: int = 2,
        client_counts: tuple[int, ...] = (1, 8), floor: bool = True, page_size: int = PAGE,
        request_tokens: int | None = None, fresh: bool = False, device: str = "cpu",
        batch: int = 1) -> dict[str, float]:
    """Each side ``rounds`` times per client count, the order flipping every round (base, this,
    this, base, ...) so that a machine getting busier or quieter does not favour one side; each
    figure is the mean over the rounds. ``floor``: also the ping floor (``*_floor`` keys), once
    per round on this checkout's daemon, between the two sides. ``page_size``,
    ``request_tokens``: the model's page size and the request's shape (:func:`request_shape`),
    given back as the ``page_size``, ``prefix_tokens`` and ``fresh_tokens`` keys; ``fresh``:
    every request's fresh part new (:class:`FreshRequests`), the ``fresh`` key 1; ``device``:
    the model's device (``cuda``: pools on the GPU, the host pool pinned, copies on a CUDA
    stream enqueued from the event loop); ``batch``: requests per scheduler step, the ``batch``
    key (:func:`_loop`)."""
    shape = request_shape(page_size, request_tokens)
    conf = config(model_keys(page_size, host_off), page_size, device) + ADMIN_ANY_PORT
    base_root = export_ref(baseline)
    out: dict[str, float] = {"page_size": page_size, "prefix_tokens": shape[0],
                             "fresh_tokens": shape[1], "fresh": int(fresh), "batch": batch}
    sides = (("base", base_root), ("this", _ROOT))
    try:
        for n in client_counts:
            for r in range(rounds):
                order = sides if r % 2 == 0 else sides[::-1]
                runs = [(order[0][0], order[0][1], False)]
                if floor:
                    runs.append(("floor", _ROOT, True))
                runs.append((order[1][0], order[1][1], False))
                for side, root, ping in runs:
                    d = DaemonProcess(conf, root=root)
                    try:
                        for k, v in measure(d, n, seconds, ping, page_size, shape,
                                                fresh, batch).items():
                            key = f"{k}_{n}c_{side}"
                            out[key] = out.get(key, 0.0) + v / rounds
                    finally:
                        d.stop()
            out[f"ops_per_s_{n}c_ratio"] = out[f"ops_per_s_{n}c_this"] / \
                out[f"ops_per_s_{n}c_base"]
            for k in ("cpu_us_per_op", "loop_cpu_us_per_op"):
                out[f"{k}_{n}c_ratio"] = out[f"{k}_{n}c_this"] / out[f"{k}_{n}c_base"]
    finally:
        shutil.rmtree(base_root, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main", help="git ref to compare with (default main)")
    ap.add_argument("--seconds", type=float, default=5.0, help="timed window per measurement")
    ap.add_argument("--host-off", action="store_true", help="models without a host (L2) tier")
    ap.add_argument("--rounds", type=int, default=2,
                    help="measurements per side and client count, order alternating (default 2)")
    ap.add_argument("--no-floor", action="store_true",
                    help="leave out the ping floor (this daemon answering 8-byte pings)")
    ap.add_argument("--page-size", type=int, default=PAGE, metavar="P",
                    help=f"the model's page size, a divisor of {PAGE} (default {PAGE}); the "
                         "request keeps its shape in tokens")
    ap.add_argument("--request-tokens", type=int, metavar="N",
                    help=f"requests of N tokens, 3/4 a cached prefix and 1/4 fresh (a multiple "
                         f"of 4 * P, at most {MAX_REQUEST_TOKENS}; default "
                         f"{PREFIX_TOKENS} + {FRESH_TOKENS})")
    ap.add_argument("--fresh", action="store_true",
                    help="every request's fresh tokens new to the tree (each one inserts; the "
                         "pools fill and allocations evict) instead of cycling 512 * 128 / "
                         "fresh requests that are cached after their first use")
    ap.add_argument("--batch", type=int, default=1, metavar="K",
                    help="send K requests per scheduler step: their matches in one batch frame, "
                         f"then their allocs, then their cache_finished (1 to {MAX_BATCH}; "
                         "default 1: every operation a frame of its own)")
    ap.add_argument("--device", default="cpu",
                    help="the model's device: cpu (default) or cuda[:N] (pools on the GPU, "
                         "the host pool pinned; both daemons)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as a flat JSON object")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        ap.error(f"--device: cpu or cuda[:N], got {args.device!r}")
    if not 1 <= args.batch <= MAX_BATCH:
        ap.error(f"--batch: 1 to {MAX_BATCH} requests per step, got {args.batch}")
    try:
        prefix, fresh = request_shape(args.page_size, args.request_tokens)
    except ValueError as e:
        ap.error(str(e))
    f = run(args.baseline, args.seconds, args.host_off, args.rounds, floor=not args.no_floor,
            page_size=args.page_size, request_tokens=args.request_tokens, fresh=args.fresh,
            device=args.device, batch=args.batch)
    print(f"baseline {args.baseline}, device {args.device}, "
          f"host tier {'off' if args.host_off else 'on'}, "
          f"{args.seconds:g} s per window, mean of {args.rounds} rounds (order alternating)")
    print(f"page size {args.page_size}, requests of {prefix + fresh} tokens: a cached prefix of "
          f"{prefix} + {fresh} fresh"
          + (", every one new (--fresh)" if args.fresh else ", cycled (cached after first use)")
          + (f"; {args.batch} per scheduler step, each operation's {args.batch} in one batch "
             "frame" if args.batch > 1 else ""))
    floor = not args.no_floor
    print(f"{'clients':>7} {'metric':>18} {args.baseline:>12} {'this':>12} {'this/base':>10}"
          + (f" {'ping floor':>12}" if floor else ""))
    for n in (1, 8):
        for k, fmt in (("ops_per_s", "{:12.0f}"), ("cpu_us_per_op", "{:12.2f}"),
                       ("loop_cpu_us_per_op", "{:12.2f}")):
            base, this = f[f"{k}_{n}c_base"], f[f"{k}_{n}c_this"]
            line = (f"{n:>7} {k:>18} {fmt.format(base)} {fmt.format(this)} "
                    f"{f[f'{k}_{n}c_ratio']:>10.3f}")
            if floor:
                line += f" {fmt.format(f[f'{k}_{n}c_floor'])}"
            print(line)
    if args.json:
        write_json(args.json, {k: round(v, 3) for k, v in f.items()})
    return f


if __name__ == "__main__":
    main()
