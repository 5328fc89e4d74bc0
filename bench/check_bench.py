"""Requests while the full invariant check runs: ``match`` latency on a large tree with the
background full check running back to back, against the same daemon set-up without it.

Usage (from the repository root)::

    python bench/check_bench.py [--tokens 1e7] [--samples 20000] [--rounds 3] [--json out.json]

Two real daemons (page 64, bookkeeping only: ``export_pools = false``, so no host tier), run one
after the other in this invocation, each filled over the socket with the same ``--tokens`` cached
tokens (64 shared 1024-token documents, each sequence one of them plus 3072 fresh tokens):

- ``off``: ``checker.interval_s = 3600``: no background check runs during the measurement;
- ``on``: ``checker.interval_s = 0.001``: stepped full passes (deep: every page re-hashed) run
  back to back, between requests (daemon/checker.py).

One client matches every cached sequence once (the cache's steady state: a match that moves
nothing, so a pass is not given up because of it), then matches random cached 4k sequences back
to back (closed loop) over the Unix socket. The script prints ``match`` p50/p99/max in
microseconds for both, the ratios on/off (goal: p99 at most 1.5x), and, for ``on``, the stepped
passes done and given up during the measurement and the longest the check held the event loop at
once, by wall clock and in CPU time (from the daemon's metrics). ``--rounds N`` runs both sides N
times, alternating which goes first, and reports the median of each figure.
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
import statistics  # noqa: E402
import time  # noqa: E402
from array import array  # noqa: E402

from radixd_client import Client  # noqa: E402

from bench._common import DaemonProcess, write_json  # noqa: E402

MODEL = "bench"
PAGE = 64
SEQ = 4096
DOC = 1024
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


def _measure(d: DaemonProcess, seqs: list[bytes], samples: int
             ) -> tuple[list[float], dict[str, float], dict[str, float]]:
    """Match latencies, and the daemon's checker figures just before and after them."""
    rng = random.Random(3)
    order = [rng.choice(seqs) for _ in range(samples)]
    out = [0.0] * samples
    clock = time.perf_counter_ns
    with Client(d.socket, client_name="check-bench") as c:
        for s in seqs:  # warm: every node touched once since the last insert
            c.match(MODEL, s)
        time.sleep(0.5)  # a pass given up by the warm-up starts again
        before = _metrics(d)
        gc.disable()
        try:
            for i, s in enumerate(order):
                t = clock()
                m = c.match(MODEL, s)
                out[i] = (clock() - t) / 1000
                if m.prefix_len != SEQ:
                    raise RuntimeError(f"a cached sequence matched {m.prefix_len} tokens")
        finally:
            gc.enable()
        after = _metrics(d)
    return out, before, after


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_side(label: str, interval: float, seqs: list[bytes], samples: int) -> dict[str, float]:
    pages = len(seqs) * SEQ // PAGE + 1024
    d = DaemonProcess(CONFIG.format(interval=interval, pages=pages), admin=True)
    try:
        t0 = time.perf_counter()
        with Client(d.socket, client_name="check-bench-fill") as c:
            _fill(c, seqs)
        fill_s = time.perf_counter() - t0
        lat, before, after = _measure(d, seqs, samples)
        fig = {f"{label}_fill_s": round(fill_s, 2),
               f"{label}_match_p50_us": round(_pct(lat, 0.5), 1),
               f"{label}_match_p99_us": round(_pct(lat, 0.99), 1),
               f"{label}_match_max_us": round(max(lat), 1),
               f"{label}_rss_mib": round(d.rss_mb(), 1)}
        key = "radixd_invariant_stepped_passes_total{{outcome=\"{}\"}}"
        for outcome in ("done", "given_up"):
            fig[f"{label}_passes_{outcome}"] = (after.get(key.format(outcome), 0)
                                                - before.get(key.format(outcome), 0))
        for clock in ("wall", "cpu"):
            fig[f"{label}_longest_slice_{clock}_us"] = round(after.get(
                f"radixd_invariant_longest_slice_seconds{{clock=\"{clock}\"}}", 0) * 1e6, 1)
        return fig
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=1e7)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    seqs = _sequences(int(args.tokens))
    print(f"{len(seqs)} sequences of {SEQ} tokens, about {len(seqs) * (SEQ - DOC) + 64 * DOC:,} "
          f"cached tokens at page {PAGE}")
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        sides = [("off", 3600.0), ("on", 0.001)]
        fig = {}
        for label, interval in (sides if r % 2 == 0 else sides[::-1]):
            fig.update(run_side(label, interval, seqs, args.samples))
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
