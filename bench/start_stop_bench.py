"""Start and stop of a daemon with a large pool: this checkout's against a baseline git ref's, in
one run.

    python bench/start_stop_bench.py [--baseline main] [--pages 5e7] [--rounds 2] [--quick]
                                     [--json PATH]

One model at page 1 on the CPU device (one full and one SWA layer, one KV head of 8, float16: 32
bytes a page, so that the pools' memory stays small while their page count is large), ``--pages``
full pages and a tenth of that SWA, no host tier. Per side and round (the sides alternating):

- ``ready_s``: from starting the process to its socket accepting a connection (config, torch's
  import, the pools and their allocators, the tree);
- ``rss_mib``: the daemon's resident memory then;
- ``stop_s``: from SIGTERM to its exit (the stop drains, runs the full check and the check at
  rest, then closes the pools); a daemon that exits with an error or has not stopped after
  ``STOP_WAIT_S`` ends the run with an error (it is killed).

Printed: the medians of each side and the ratio. ``--quick``: 5M pages, one start per side.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "clients", "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import argparse  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from bench import rpc_bench  # noqa: E402
from bench._common import DaemonProcess, export_ref, write_json  # noqa: E402

#: seconds a daemon has to stop before it is killed (and the run ends with an error)
STOP_WAIT_S = 300

#: pool page counts are rounded up to this, so that segments of the pool map apart (a multiple
#: of the 4096-byte OS page at 16 bytes per page and layer)
ALIGN = 256


def config(pages: int) -> str:
    """rpc_bench's daemon config (one small model on the CPU) at page 1, with a full pool of
    about ``pages`` pages, an SWA pool a tenth of it and no host tier."""
    def up(n: int) -> int:
        return max(ALIGN, -(-n // ALIGN) * ALIGN)
    return (rpc_bench.CONFIG.replace("{page_size}", "1").replace("{device}", "cpu")
            .replace("{full_pages}", str(up(pages))).replace("{swa_pages}", str(up(pages // 10)))
            .replace("{extra}", "host_pages = 0\nhost_swa_pages = 0\n"))


def measure(root: str, pages: int) -> dict[str, float]:
    t = time.perf_counter()
    d = DaemonProcess(config(pages), root=root)
    try:
        ready = time.perf_counter() - t
        rss = d.rss_mb()
        t = time.perf_counter()
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(STOP_WAIT_S)
        stop = time.perf_counter() - t
    finally:  # a daemon that did not stop in time is killed; its directory goes either way
        d.close()
    if code != 0:
        raise RuntimeError(f"radixd from {root} exited with {code} at its stop")
    return {"ready_s": ready, "rss_mib": rss, "stop_s": stop}


def run(baseline: str, pages: int, rounds: int) -> dict[str, float]:
    roots = {"base": export_ref(baseline), "this": _ROOT}
    got: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    try:
        for r in range(rounds):
            for side in (("base", "this") if r % 2 == 0 else ("this", "base")):
                got[side].append(measure(roots[side], pages))
    finally:
        shutil.rmtree(roots["base"], ignore_errors=True)
    out: dict[str, float] = {}
    for name in ("ready_s", "rss_mib", "stop_s"):
        for side in ("base", "this"):
            out[f"{name}_{side}"] = statistics.median(m[name] for m in got[side])
        out[f"{name}_ratio"] = out[f"{name}_this"] / out[f"{name}_base"]
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main", help="git ref to compare with (default main)")
    ap.add_argument("--pages", type=float, default=5e7, help="full pool pages (default 5e7)")
    ap.add_argument("--rounds", type=int, default=2, help="starts per side (default 2)")
    ap.add_argument("--quick", action="store_true", help="5M pages, one start per side")
    ap.add_argument("--json", metavar="PATH", help="write the figures as a flat JSON object")
    args = ap.parse_args(argv)
    if args.pages < 1 or args.rounds < 1:
        ap.error("--pages and --rounds must be at least 1")
    if args.quick:
        args.pages, args.rounds = 5e6, 1
    f = run(args.baseline, int(args.pages), args.rounds)
    print(f"baseline {args.baseline}: page 1, {int(args.pages):,} full pages, medians of "
          f"{args.rounds} starts per side, alternating")
    print(f"{'figure':<10} {args.baseline[:12]:>12} {'this':>12} {'this/base':>10}", flush=True)
    for name in ("ready_s", "rss_mib", "stop_s"):
        print(f"{name:<10} {f[name + '_base']:>12.2f} {f[name + '_this']:>12.2f} "
              f"{f[name + '_ratio']:>10.3f}", flush=True)
    if args.json:
        write_json(args.json, f)
    return f


if __name__ == "__main__":
    main()
