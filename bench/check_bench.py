"""Requests while the full invariant check runs: ``match`` latency on a large tree with the
background full check running back to back, against the same daemon set-up without it.

Usage (from the repository root)::

    python bench/check_bench.py [--tokens 1e7] [--samples 20000] [--block 200] [--rounds 3]
                                [--aa] [--no-stop] [--pin] [--quick] [--json out.json]

Two real daemons of this checkout (page 64, bookkeeping only: ``export_pools = false``, so no
host tier), each filled over the socket with the same ``--tokens`` cached tokens (64 shared
1024-token documents, each sequence one of them plus 3072 fresh tokens):

- ``off``: ``checker.interval_s = 3600``: no background check runs during the measurement;
- ``on``: ``checker.interval_s = 0.001``: stepped full passes (deep: every page re-hashed) run
  back to back, between requests (daemon/checker.py); with ``--aa`` it is a second ``off`` (the
  noise floor of the measurement: its ratios should be 1).

One client matches every cached sequence once on each (the cache's steady state: a match that
moves nothing, so a pass is not given up because of it), then matches random cached 4k sequences
back to back (closed loop) over the Unix socket, in blocks of ``--block`` requests that alternate
between the two daemons. The daemon not being measured is stopped (SIGSTOP) meanwhile, so that
its checker takes no CPU from the other (``--no-stop``: left running), and both sides see the
same moments of a shared machine's noise; the first ``SKIP`` requests of each block (the process
just continued, perhaps in the middle of a slice) are not counted, on either side. ``--pin`` puts
this client on CPU 0 and both daemons on CPU 1.

The script prints ``match`` p50/p90/p99/p99.9/max in microseconds for both, the ratios on/off
(goal: p99 at most 1.5x), and, for ``on``, the stepped passes done and given up during the
measurement, the slices ended by a waiting request or by the budget, and the longest step and
slice (wall clock and CPU time), from the daemon's metrics. ``--rounds N`` repeats the whole
(fresh daemons, alternating which side goes first) and reports the median of each figure.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "clients", "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import argparse  # noqa: E402
import gc  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from array import array  # noqa: E402

from radixd_client import Client  # noqa: E402

from bench._common import DaemonProcess, write_json  # noqa: E402

MODEL = "bench"
PAGE = 64
SEQ = 4096
DOC = 1024
#: requests not counted at the start of each block (both sides): the first after a SIGCONT
SKIP = 5
CONFIG = """
log_level = "warning"
[server]
socket = "{{socket}}"
[admin]
unix_socket = "{{admin}}"
token = "bench"
[checker]
interval_s = {interval}
[[models]]
name = "bench"
page_size = 64
sliding_window = 128
num_full_layers = 1
num_swa_layers = 1
num_kv_heads = 1
head_dim = 8
dtype = "float16"
device = "cpu"
export_pools = false
full_pages = {pages}
swa_pages = {pages}
"""


def _metrics(d: DaemonProcess) -> dict[str, float]:
    """The daemon's checker figures from its Prometheus text."""
    text = d.admin_text("/metrics")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("radixd_invariant_stepped_passes_total",
                            "radixd_invariant_slices_total",
                            "radixd_invariant_longest_step_seconds",
                            "radixd_invariant_longest_slice_seconds",
                            "radixd_invariant_checks_total")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _sequences(tokens: int) -> list[bytes]:
    rng = random.Random(7)
    docs = [[rng.randrange(1, 100_000) for _ in range(DOC)] for _ in range(64)]
    return [array("i", docs[i % 64] + [rng.randrange(1, 100_000) for _ in range(SEQ - DOC)]
                  ).tobytes() for i in range(max(1, tokens // (SEQ - DOC)))]


def _fill(c: Client, seqs: list[bytes]) -> None:
    for s in seqs:
        a = c.alloc(MODEL, SEQ // PAGE)
        c.insert(MODEL, s, a.full_pages, a.swa_pages)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _start(interval: float, seqs: list[bytes]) -> tuple[DaemonProcess, float]:
    """A filled and warmed daemon, and the seconds its fill took."""
    d = DaemonProcess(CONFIG.format(interval=interval, pages=len(seqs) * SEQ // PAGE + 1024),
                      admin=True)
    t0 = time.perf_counter()
    with Client(d.socket, client_name="check-bench-fill") as c:
        _fill(c, seqs)
    fill_s = time.perf_counter() - t0
    return d, fill_s


def _pin(pid: int, cpu: int) -> None:
    """Every thread of process ``pid`` onto ``cpu``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})


def one_round(seqs: list[bytes], samples: int, block: int, seed: int, stop: bool, pin: bool,
              aa: bool) -> dict[str, float]:
    """Both daemons, measured in alternating blocks; their figures."""
    sides = {"off": _start(3600.0, seqs), "on": _start(3600.0 if aa else 0.001, seqs)}
    if pin:  # the client on one CPU, both daemons on another
        os.sched_setaffinity(0, {0})
        for d, _ in sides.values():
            _pin(d.proc.pid, 1)
    clients: dict[str, Client] = {}
    try:
        for label, (d, _) in sides.items():
            clients[label] = Client(d.socket, client_name="check-bench")
            for s in seqs:  # warm: every node touched once since the last insert
                clients[label].match(MODEL, s)
        time.sleep(0.5)  # a pass given up by the warm-up starts again
        before = _metrics(sides["on"][0])
        rng = random.Random(seed)
        lat: dict[str, list[float]] = {"off": [], "on": []}
        clock = time.perf_counter_ns
        order = ["off", "on"] if seed % 2 == 0 else ["on", "off"]
        gc.disable()
        try:
            for b in range(2 * -(-samples // block)):
                label = order[b % 2]
                other = order[1 - b % 2]
                if stop:
                    sides[other][0].proc.send_signal(signal.SIGSTOP)
                    sides[label][0].proc.send_signal(signal.SIGCONT)
                c, out = clients[label], lat[label]
                for i in range(block + SKIP):
                    s = rng.choice(seqs)
                    t = clock()
                    m = c.match(MODEL, s)
                    if i >= SKIP:
                        out.append((clock() - t) / 1000)
                    if m.prefix_len != SEQ:
                        raise RuntimeError(f"a cached sequence matched {m.prefix_len} tokens")
        finally:
            gc.enable()
            for d, _ in sides.values():
                d.proc.send_signal(signal.SIGCONT)
        after = _metrics(sides["on"][0])
        fig: dict[str, float] = {}
        for label, (d, fill_s) in sides.items():
            xs = lat[label]
            fig.update({f"{label}_fill_s": round(fill_s, 2),
                        f"{label}_match_p50_us": round(_pct(xs, 0.5), 1),
                        f"{label}_match_p90_us": round(_pct(xs, 0.90), 1),
                        f"{label}_match_p99_us": round(_pct(xs, 0.99), 1),
                        f"{label}_match_p999_us": round(_pct(xs, 0.999), 1),
                        f"{label}_match_over_1ms": sum(1 for x in xs if x > 1000),
                        f"{label}_match_max_us": round(max(xs), 1),
                        f"{label}_rss_mib": round(d.rss_mb(), 1)})
        key = "radixd_invariant_stepped_passes_total{{outcome=\"{}\"}}"
        for outcome in ("done", "given_up"):
            fig[f"on_passes_{outcome}"] = (after.get(key.format(outcome), 0)
                                           - before.get(key.format(outcome), 0))
        for ended in ("request", "budget"):
            k = f"radixd_invariant_slices_total{{ended=\"{ended}\"}}"
            fig[f"on_slices_ended_by_{ended}"] = after.get(k, 0) - before.get(k, 0)
        fig["on_longest_step_us"] = round(
            after.get("radixd_invariant_longest_step_seconds", 0) * 1e6, 1)
        for clk in ("wall", "cpu"):
            fig[f"on_longest_slice_{clk}_us"] = round(after.get(
                f"radixd_invariant_longest_slice_seconds{{clock=\"{clk}\"}}", 0) * 1e6, 1)
        return fig
    finally:
        for c in clients.values():
            c.close()
        for d, _ in sides.values():
            d.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=1e7)
    ap.add_argument("--samples", type=int, default=20_000, help="match requests per side")
    ap.add_argument("--block", type=int, default=200, help="requests per block")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--aa", action="store_true", help="both daemons without background checks")
    ap.add_argument("--pin", action="store_true",
                    help="this client on CPU 0 and both daemons on CPU 1: the daemon's check then "
                         "takes no CPU from the client (on a machine with few cores)")
    ap.add_argument("--no-stop", action="store_true",
                    help="leave the daemon not being measured running (its checker then takes "
                         "CPU from the other side too: the ratio errs in the daemon's disfavour)")
    ap.add_argument("--quick", action="store_true", help="1M tokens, 5000 samples, 1 round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.samples, args.rounds = 1e6, 5000, 1
    seqs = _sequences(int(args.tokens))
    print(f"{len(seqs)} sequences of {SEQ} tokens, about {len(seqs) * (SEQ - DOC) + 64 * DOC:,} "
          f"cached tokens at page {PAGE}")
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        fig = one_round(seqs, args.samples, args.block, r, not args.no_stop, args.pin, args.aa)
        for q in ("p50", "p99", "max"):
            fig[f"match_{q}_ratio"] = round(fig[f"on_match_{q}_us"] / fig[f"off_match_{q}_us"], 2)
        print(f"round {r + 1}: " + ", ".join(f"{k} {fig[k]}" for k in sorted(fig)
                                             if k.startswith("match_")))
        rounds.append(fig)
    fig = {k: statistics.median(f[k] for f in rounds) for k in rounds[0]}
    for k in sorted(fig):
        print(f"{k:28} {fig[k]}")
    print(f"goal: match_p99_ratio <= 1.5: {'met' if fig['match_p99_ratio'] <= 1.5 else 'NOT met'}")
    if args.json:
        write_json(args.json, fig)


if __name__ == "__main__":
    main()
