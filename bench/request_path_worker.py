"""One side of bench/request_path_bench.py, in a process of its own: the daemon of the source
tree that PYTHONPATH starts with, fed one session's requests without a socket. The job comes
pickled on stdin and the figures go out as one line of JSON, so that this process imports nothing
of the tree that runs the benchmark (its bench package included) before that tree's daemon; that
daemon is imported only once the process is on its CPU, so that the threads its imports start
(torch's) are there too."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
from typing import Any

#: how long the host tier may take to copy what the warm-up inserted
SETTLE_S = 60.0


class KeptWrites:
    """The side of a transport the connection uses: writes are kept, nothing else happens."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # no socket: no peer credentials, no fd to watch

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:  # (a connection's turn ends: frames wait in its buffer)
        pass

    def resume_reading(self) -> None:
        pass


async def _settled(service: Any) -> None:
    """Wait until the host tier has copied what was inserted (no backup queued or landing, twice
    in a row), as a serving daemon's would have before the timed requests."""
    deadline = time.monotonic() + SETTLE_S
    quiet = 0
    while quiet < 2:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the host tier did not settle in {SETTLE_S:.0f} s")
        await asyncio.sleep(0.05)
        tiers = [e.tiers.stats() for e in service.models.values() if e.tiers is not None]
        busy = any(t["backup_queue"] or t["host_pages_pending"] for t in tiers)
        quiet = 0 if busy else quiet + 1


async def _run(job: dict[str, Any], scratch: str) -> dict[str, float]:
    from radixd_client import protocol as P
    from radixd_client.connection import ClientConnection

    from daemon.app import build
    from daemon.config import load_config
    from daemon.server import Connection

    try:
        from daemon.process_memory import tune_gc
    except ImportError:  # a baseline from before 2026-11-30 keeps it in daemon.server
        from daemon.server import tune_gc  # type: ignore[attr-defined,no-redef]

    model, page = job["model"], job["page"]
    path = os.path.join(scratch, "radixd.toml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(job["config"].format(socket=os.path.join(scratch, "radixd.sock"), admin=None))
    server = build(load_config(path)).server
    server.loop = asyncio.get_running_loop()
    server.service.start_tiers()  # as serve() does: the host tier copies what is inserted
    tune_gc()
    conn, transport, client = Connection(server), KeptWrites(), ClientConnection()
    conn.connection_made(transport)  # type: ignore[arg-type]
    times: dict[str, list[int]] = {}

    def call(op: str, req: Any, timed: bool = False) -> Any:
        frame = client.send(op, req)
        t0 = time.perf_counter_ns()
        conn.data_received(frame)
        dt = time.perf_counter_ns() - t0
        client.receive_data(transport.out.pop())
        reply = client.next_event()
        if reply is None or not reply.ok:
            raise RuntimeError(f"{op} failed: {reply.value if reply else 'no reply'}")
        if timed:
            times.setdefault(op, []).append(dt)
        return reply.value

    def request(tokens: bytes, timed: bool) -> None:
        call("ping", P.Ping(payload=b"12345678"), timed)
        m = call("match", P.Match(model=model, tokens=tokens, lock=True), timed)
        a = call("alloc", P.Alloc(model=model, n=len(tokens) // 4 // page
                                  - m.prefix_len // page), timed)
        call("cache_finished", P.CacheFinished(
            model=model, tokens=tokens, full_pages=a.full_pages, swa_pages=a.swa_pages,
            prev_prefix_len=m.prefix_len, swa_evicted_len=0, receipt=m.receipt), timed)

    call("hello", P.Hello(token=None))
    for p in job["prefixes"]:
        a = call("alloc", P.Alloc(model=model, n=len(p) // 4 // page))
        call("insert", P.Insert(model=model, tokens=p, full_pages=a.full_pages,
                                swa_pages=a.swa_pages))
    for tokens in job["requests"]:  # each one cached: the timed rounds are full hits
        request(tokens, False)
    await _settled(server.service)
    for _ in range(job["rounds"]):
        for tokens in job["requests"]:
            request(tokens, True)
    out: dict[str, float] = {}
    for op, ts in times.items():
        ts.sort()
        out[f"{op}_p50_us"] = ts[len(ts) // 2] / 1000
        out[f"{op}_mean_us"] = sum(ts) / len(ts) / 1000
    return out


def measure(job: dict[str, Any]) -> dict[str, Any]:
    """``job``: ``config`` (rpc_bench's, ``{socket}`` to fill), ``model``, ``page``,
    ``prefixes`` and ``requests`` (int32 token bytes), ``rounds``, ``cpu`` (None: any). The
    figures, and under ``source`` the tree whose daemon gave them. On uvloop, as the daemon."""
    if job["cpu"] is not None:
        os.sched_setaffinity(0, {job["cpu"]})
    import daemon

    try:
        import uvloop
    except ImportError:  # (a daemon dependency; asyncio's own loop would do)
        uvloop = None
    scratch = tempfile.mkdtemp(prefix="radixd-request-path-")
    try:
        run = uvloop.run if uvloop is not None else asyncio.run
        figures = run(_run(job, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {**figures,
            "source": os.path.dirname(os.path.dirname(os.path.abspath(daemon.__file__)))}


if __name__ == "__main__":
    print(json.dumps(measure(pickle.load(sys.stdin.buffer))))
