"""How long ``radixd status`` takes to answer: this checkout's command line against a baseline
git ref's, in one run.

    python bench/cli_bench.py [--baseline main] [--runs 7] [--json PATH]

Each run is a fresh ``python -m daemon.cli status --socket PATH`` process with the default
configuration, PATH a socket where no daemon listens: the time is everything before the answer
("no daemon at PATH"): the interpreter, the imports, the configuration's validation (which, for
device "auto", asked torch whether there is a GPU before 2026-11-29). The sides alternate; the
medians of each side and their ratio are printed.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from bench._common import export_ref, tree_env, write_json  # noqa: E402


def answer_s(root: str, socket_path: str) -> float:
    """Seconds for one ``radixd status`` of source tree ``root`` to say no daemon answers."""
    env = tree_env(root)
    env.pop("RADIXD_CONFIG", None)  # the default configuration, whatever this shell sets
    t0 = time.perf_counter()
    got = subprocess.run([sys.executable, "-m", "daemon.cli", "status", "--socket", socket_path],
                         capture_output=True, text=True, env=env, cwd=root, timeout=120)
    elapsed = time.perf_counter() - t0
    if "no daemon at" not in got.stderr:
        raise RuntimeError(f"status of {root} did not answer as expected:\n{got.stderr[-2000:]}")
    return elapsed


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="main")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    base = export_ref(args.baseline)
    scratch = tempfile.mkdtemp(prefix="radixd-cli-bench-")
    times: dict[str, list[float]] = {"base": [], "this": []}
    try:
        sock = os.path.join(scratch, "none.sock")
        for i in range(args.runs):
            for side in (("base", "this") if i % 2 == 0 else ("this", "base")):
                times[side].append(answer_s(base if side == "base" else _ROOT, sock))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    out = {f"status_s_{side}": statistics.median(ts) for side, ts in times.items()}
    out["status_s_ratio"] = out["status_s_this"] / out["status_s_base"]
    print(f"radixd status with no daemon, median of {args.runs} runs each; baseline "
          f"{args.baseline}")
    print(f"  {args.baseline}: {out['status_s_base']:.3f} s   this: {out['status_s_this']:.3f} s"
          f"   this/base: {out['status_s_ratio']:.3f}")
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
