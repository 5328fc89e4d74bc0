"""The daemon's request path without the socket: what each operation costs in Python, this
checkout against a baseline git ref, in the same run.

daemon_cpu_bench reads the daemon's CPU per operation over a real socket, where each request
also pays the event loop's wake-up and two syscalls (its ``ping`` floor). This benchmark takes
that part away, to show what is left: one process builds the daemon as ``radixd serve`` does
(rpc_bench's configuration, host tier on, its background copies started, on uvloop), opens a
session on a server connection
(``daemon.server.Connection``, the asyncio Protocol the socket feeds) and hands it each request's
frame with ``data_received``, as the event loop would after a read, collecting the response from
a transport that only keeps what is written. Each call is timed alone (``perf_counter_ns``); the
figures are p50 and mean microseconds per operation.

The workload is daemon_cpu_bench's default one (rpc_bench's mixed engine request: match+lock,
alloc, cache_finished), from one session: eight cached prefixes of 256 tokens, 512 requests of
256 + 128 tokens, each sent once before the timed rounds, so that every timed request is a full
hit (a match of 6 pages, an empty alloc, a cache_finished inserting nothing); the timed rounds
start once the host tier has copied what those first requests inserted. A ``ping`` of 8
bytes before each request measures the path without any operation's own work: frame split,
decode, dispatch, metrics, encode, the write.

Each side runs in a process of its own (bench/request_path_worker.py, which imports that side's
tree first and says which tree it ran), ``--rounds`` times, the sides in turns and each one first
every other round; for each operation the best p50 and the best mean of the rounds are kept. The
baseline runs from ``git archive`` of ``--baseline``. Every worker runs on one CPU (``--cpu``, by
default the first this process may use; ``--no-pin`` lets them run anywhere): on the 2-vCPU
development VM a process on one of the vCPUs ran now and then 1.4x slower than the same code on
the other. Run it on a quiet machine, and compare a ref with itself to see the noise.

    python bench/request_path_bench.py [--baseline main] [--rounds 3] [--requests-rounds 20]
        [--cpu N | --no-pin] [--json PATH]
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import functools  # noqa: E402
import pickle  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
from array import array  # noqa: E402

from bench._common import export_ref, run_worker, write_json  # noqa: E402
from bench.rpc_bench import MODEL, PAGE, _prefixes, _requests, config  # noqa: E402

#: the operations timed, in the order a request sends them (request_path_worker.py)
OPS = ("ping", "match", "alloc", "cache_finished")
#: the mixed operation's figures are the mean of these three (one engine request)
MIXED = ("match", "alloc", "cache_finished")
#: run as a script: its folder, not this tree, first on its path (see its docstring)
WORKER = os.path.join(_ROOT, "bench", "request_path_worker.py")
#: one worker's whole run (a daemon's build, the warm-up, the host tier settling, the rounds)
WORKER_TIMEOUT_S = 600


@functools.cache  # the same for every worker of the run
def workload(seed: int = 1) -> tuple[list[bytes], list[bytes]]:
    """(prefixes to cache, requests) as int32 token bytes: daemon_cpu_bench's client 0's."""
    rng = random.Random(seed)
    prefixes = _prefixes(rng)
    return [array("i", p).tobytes() for p in prefixes], _requests(rng, prefixes)


def run_side(root: str, rounds: int, cpu: int | None) -> dict[str, float]:
    """One worker process on ``root``'s daemon (bench/request_path_worker.py); its figures."""
    prefixes, requests = workload()
    job = {"config": config(), "model": MODEL, "page": PAGE, "prefixes": prefixes,
           "requests": requests, "rounds": rounds, "cpu": cpu}
    return run_worker([sys.executable, WORKER], root, WORKER_TIMEOUT_S, stdin=pickle.dumps(job))


def _mixed(figures: dict[str, float], stat: str) -> float:
    return sum(figures[f"{op}_{stat}_us"] for op in MIXED) / len(MIXED)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main", help="git ref of the daemon to compare with")
    ap.add_argument("--rounds", type=int, default=3,
                    help="worker processes per side, in turns (the best p50 is kept)")
    ap.add_argument("--requests-rounds", type=int, default=20,
                    help="timed passes over the 512 requests in each worker")
    ap.add_argument("--cpu", type=int, default=min(os.sched_getaffinity(0)),
                    help="the CPU every worker runs on (default: the first this process may use)")
    ap.add_argument("--no-pin", action="store_true", help="let the workers run on any CPU")
    ap.add_argument("--json", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.requests_rounds < 1:
        ap.error("--rounds and --requests-rounds must be at least 1")
    if args.cpu not in os.sched_getaffinity(0):
        ap.error(f"--cpu: one of the CPUs this process may use, "
                 f"{sorted(os.sched_getaffinity(0))}, got {args.cpu}")
    cpu = None if args.no_pin else args.cpu
    base_root = export_ref(args.baseline)
    best: dict[str, dict[str, float]] = {"this": {}, "base": {}}
    try:
        sides = [("base", base_root), ("this", _ROOT)]
        for i in range(args.rounds):  # in turns, each side first every other round
            for side, root in sides[::-1] if i % 2 else sides:
                for k, v in run_side(root, args.requests_rounds, cpu).items():
                    best[side][k] = min(v, best[side].get(k, v))
    finally:
        shutil.rmtree(base_root, ignore_errors=True)
    out: dict[str, float] = {}
    print(f"request path without the socket, µs per operation (best of {args.rounds} "
          f"processes{'' if cpu is None else f' on CPU {cpu}'}); baseline {args.baseline}")
    print(f"{'operation':<16}{'base p50':>10}{'this p50':>10}{'ratio':>8}"
          f"{'base mean':>11}{'this mean':>11}")
    for op in (*OPS, "mixed"):
        row = {}
        for side in ("base", "this"):
            f = best[side]
            for stat in ("p50", "mean"):
                row[f"{side}_{stat}"] = _mixed(f, stat) if op == "mixed" else f[f"{op}_{stat}_us"]
                out[f"{op}_{stat}_us_{side}"] = round(row[f"{side}_{stat}"], 2)
        out[f"{op}_p50_ratio"] = round(row["this_p50"] / row["base_p50"], 3)
        print(f"{op:<16}{row['base_p50']:>10.2f}{row['this_p50']:>10.2f}"
              f"{out[f'{op}_p50_ratio']:>7.2f}x{row['base_mean']:>11.2f}{row['this_mean']:>11.2f}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
