"""The longest step of the background invariant check on a large host tier: the host-tier audit
and the keyed store's check run as steps of bounded work (``HostTier.audit_steps``,
``KeyedTier.check_steps``), where each used to be one step of the whole pool.

In process, a real service (CPU pools, no daemon) whose full host pool of ``--slots`` slots is
filled with keyed pages (one ``kv_reserve`` + ``kv_commit`` per 50,000 keys), the last
``--reserved`` of them left reserved. It times, in the thread's CPU time (no preemption) with the
garbage collector frozen:

- ``stepped``: every step of ``Service.check_steps`` (the pass the background checker runs
  between requests; docs/design.md section 5), its p99 and longest step, over ``--rounds``
  passes;
- ``unstepped``: the host audit and the keyed check each drained in one go (what one step of the
  pass was before they were stepped: a request that arrived meanwhile waited for all of it),

and prints the ratio of the unstepped longest step to the stepped one. Usage::

    python bench/host_audit_bench.py [--slots 100000] [--reserved 1000] [--rounds 3]
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
import gc  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402

from radixd_client import protocol as P  # noqa: E402

from bench._common import write_json  # noqa: E402
from daemon.app import build_service  # noqa: E402
from daemon.config import Config  # noqa: E402
from daemon.entities import Peer  # noqa: E402
from daemon.service import Service  # noqa: E402

BATCH = 50_000


def _service(slots: int, reserved: int) -> Service:
    """A service whose full host pool holds ``slots`` keyed pages, ``reserved`` of them
    reserved (a pin still writing them), the rest stored."""
    model = {"name": "m", "page_size": 4, "sliding_window": 8, "num_full_layers": 1,
             "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32",
             "device": "cpu", "full_pages": 64, "swa_pages": 64, "host_pages": slots + 1,
             "host_swa_pages": 16, "memory_isolation": "none"}
    svc = build_service(Config(models=[model]), create_pools=True)
    s = svc.open_session(svc.authenticate(None, Peer(0, os.getuid(), os.getgid())), Peer())
    stored = slots - reserved
    for start in range(0, slots, BATCH):
        keys = [b"k%d" % i for i in range(start, min(slots, start + BATCH))]
        if start + len(keys) > stored:  # this batch ends in the reserved ones
            cut = max(0, stored - start)
            if cut:
                r = svc.kv_reserve(s, P.KvReserve(model="m", keys=keys[:cut]))
                svc.kv_commit(s, P.KvCommit(model="m", pin=r.pin))
            svc.kv_reserve(s, P.KvReserve(model="m", keys=keys[cut:]))
        else:
            r = svc.kv_reserve(s, P.KvReserve(model="m", keys=keys))
            svc.kv_commit(s, P.KvCommit(model="m", pin=r.pin))
    return svc


def _steps(gen: Iterator[None]) -> list[float]:
    """The CPU seconds of each step of ``gen``."""
    out: list[float] = []
    clock = time.thread_time
    while True:
        t = clock()
        try:
            next(gen)
        except StopIteration:
            out.append(clock() - t)
            return out
        out.append(clock() - t)


def _once(fn: Callable[[], object]) -> float:
    t = time.thread_time()
    fn()
    return time.thread_time() - t


def measure(slots: int, reserved: int, rounds: int) -> dict[str, float]:
    svc = _service(slots, reserved)
    entry = svc.models["m"]
    host, keyed = entry.cache.host, entry.keyed
    assert host is not None and keyed is not None
    owners = set(svc.sessions)
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        steps: list[float] = []
        for _ in range(rounds):
            v: list[str] = []
            steps += _steps(svc.check_steps(v))
            assert v == [], v
        tree = {"full": set(), "swa": set()}  # no tree host pages here
        host_s = [_once(lambda: host.audit(tree)) for _ in range(rounds)]
        keyed_s = [_once(lambda: keyed.check(owners)) for _ in range(rounds)]
        complete_s = [_once(svc.check) for _ in range(rounds)]
    finally:
        gc.enable()
        gc.unfreeze()
        svc.close()
    steps.sort()
    fig = {
        "slots": slots,
        "keyed_pages": slots - reserved,
        "reserved": reserved,
        "complete_check_ms": round(min(complete_s) * 1e3, 2),
        "stepped_steps_per_pass": len(steps) // rounds,
        "stepped_step_p99_ms": round(steps[int(0.99 * len(steps))] * 1e3, 3),
        "stepped_step_max_ms": round(steps[-1] * 1e3, 3),
        "unstepped_host_audit_ms": round(min(host_s) * 1e3, 2),
        "unstepped_keyed_check_ms": round(min(keyed_s) * 1e3, 2),
    }
    fig["unstepped_step_max_ms"] = max(fig["unstepped_host_audit_ms"],
                                       fig["unstepped_keyed_check_ms"])
    fig["max_step_ratio"] = round(fig["unstepped_step_max_ms"] / fig["stepped_step_max_ms"], 1)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=100_000, help="full host pool slots, all used")
    ap.add_argument("--reserved", type=int, default=1000, help="of them reserved, not stored")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    fig = measure(args.slots, args.reserved, args.rounds)
    for k, x in fig.items():
        print(f"{k:28} {x}")
    print(f"the longest step: {fig['unstepped_step_max_ms']} ms as one step, "
          f"{fig['stepped_step_max_ms']} ms stepped ({fig['max_step_ratio']}x shorter)")
    if args.json:
        write_json(args.json, fig)


if __name__ == "__main__":
    main()
