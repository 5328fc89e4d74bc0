"""Benchmark of the warm restart: the host hit rate before and after a restart, warm and cold.

Usage (from the repository root)::

    python bench/restart_bench.py [--docs 48] [--doc-pages 16] [--window 200] [--json out.json]

A real ``radixd serve`` runs under a stand-in for systemd (:class:`FdStore`: a real AF_UNIX
datagram ``NOTIFY_SOCKET`` that keeps the fds sent with ``FDSTORE=1`` and passes them to the next
start as ``LISTEN_FDS``/``LISTEN_FDNAMES``, as systemd's fd store does). One client replays a
workload of requests over ``--docs`` shared prefixes of ``--doc-pages`` pages each (the device
pool holds a quarter of them, the host tier all): per request ``load`` with lock (device and host
hits), ``alloc`` + ``insert`` of the missed pages, ``unlock``. After a warm-up, the hit rate
(tokens found on device or host / tokens asked) is measured over a window of requests; then the
daemon gets SIGTERM and a new one starts, and the very same window is replayed:

* **warm**: the new daemon gets the host pools back from the fd store;
* **cold** (the baseline, same run): the new daemon starts with nothing.

Printed per restart: ``hit_after / hit_before``, SIGTERM-to-serving seconds (old daemon's exit,
new daemon's start and restore, until its socket accepts) and the host pages kept. Goal (issue
15): warm ``hit_after / hit_before`` >= 0.9.
"""

from __future__ import annotations

import argparse
import array
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "clients", "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from radixd_client import Client  # noqa: E402

from bench._common import write_json  # noqa: E402

# Moves the fds named in argv[1] to 3.. in that order, names them argv[2] (":"-separated), sets
# LISTEN_PID to this process (exec keeps it), then execs argv[3:]: what systemd does after fork.
LAUNCH = """\
import fcntl, os, sys
fds = [int(x) for x in sys.argv[1].split(",") if x]
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i)
    os.close(fd)
if fds:
    os.environ["LISTEN_FDS"] = str(len(fds))
    os.environ["LISTEN_FDNAMES"] = sys.argv[2]
    os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.argv[3], sys.argv[3:])
"""


class FdStore:
    """systemd's side of the notify protocol and its fd store (name -> fd), for a daemon this
    process starts (:meth:`launch`). Used by this bench and by tests/daemon/test_fdstore.py."""

    def __init__(self, directory: str, limit: int = 1024):
        """``limit``: FileDescriptorStoreMax= (passed to the daemon as ``$FDSTORE``)."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.address = os.path.join(directory, "notify.sock")
        self.sock.bind(self.address)
        self.limit = limit
        self.fds: dict[str, int] = {}
        self.removed: list[str] = []
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = False
        # systemd reads the notify socket all the time: a daemon storing more fds than the
        # socket queues (net.unix.max_dgram_qlen, 10 by default) must not block on it
        self._reader = threading.Thread(target=self._read, daemon=True, name="fdstore")
        self._reader.start()

    def pump(self, timeout: float = 0.5) -> None:
        """Wait until systemd's side took every message sent so far: none came for ``timeout``
        (at most a few times that, should the daemon keep talking)."""
        deadline = time.monotonic() + 4 * timeout
        while time.monotonic() - self._last < timeout and time.monotonic() < deadline:
            time.sleep(0.05)

    def _read(self) -> None:
        self.sock.settimeout(0.1)
        while not self._closed:
            try:
                data, anc, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(4 * 16))
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._last = time.monotonic()
                self._take(data, anc)

    def _take(self, data: bytes, anc: list[tuple[int, int, bytes]]) -> None:
        """One message, as systemd takes it: store an fd (dropped past ``limit``, as systemd
        drops what goes past FileDescriptorStoreMax=) or remove one."""
        fds = array.array("i")
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(raw[: len(raw) - len(raw) % 4])
        fields = dict(line.partition("=")[::2] for line in data.decode().split("\n"))
        name = fields.get("FDNAME", "")
        if fields.get("FDSTORE") == "1" and len(fds) == 1 and (
                name in self.fds or len(self.fds) < self.limit):
            if name in self.fds:
                os.close(self.fds[name])
            self.fds[name] = fds[0]
            return
        for fd in fds:
            os.close(fd)
        if fields.get("FDSTOREREMOVE") == "1" and name in self.fds:
            os.close(self.fds.pop(name))
            self.removed.append(name)

    def launch(self, sockets: dict[str, int] | None = None) -> dict[str, Any]:
        """How to start a daemon under this "systemd": ``launcher`` (argv to put before the
        daemon's), ``env`` (to add) and ``pass_fds`` (for Popen), carrying the stored fds after
        the listening ``sockets`` (name -> fd) of socket activation, as systemd orders them."""
        both = {**(sockets or {}), **self.fds}
        names = list(both)
        fds = tuple(both[n] for n in names)
        return {"launcher": (sys.executable, "-c", LAUNCH, ",".join(map(str, fds)),
                             ":".join(names)),
                "env": {"NOTIFY_SOCKET": self.address, "FDSTORE": str(self.limit)},
                "pass_fds": fds}

    def drop(self) -> None:
        """Forget every stored fd (what a stop for good does)."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def close(self) -> None:
        self._closed = True
        self._reader.join()
        self.drop()
        self.sock.close()


CONFIG = """\
log_level = "warning"
[server]
socket = "{socket}"
[admin]
enabled = false
[[models]]
name = "m"
page_size = 16
sliding_window = 0
num_full_layers = 4
num_kv_heads = 8
head_dim = 128
dtype = "bfloat16"
device = "cpu"
full_pages = {device_pages}
host_pages = {host_pages}
"""


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="rxrb-", dir="/tmp")
        self.socket = os.path.join(self.dir, "radixd.sock")
        self.config = os.path.join(self.dir, "radixd.toml")
        pages = args.docs * args.doc_pages
        with open(self.config, "w") as fh:
            fh.write(CONFIG.format(socket=self.socket, device_pages=pages // 4 + 2,
                                   host_pages=pages + pages // 4 + 2))
        self.store = FdStore(self.dir)
        self.proc: subprocess.Popen | None = None
        self.docs = [[d * 1_000_000 + i for i in range(args.doc_pages * 16)]
                     for d in range(args.docs)]

    def start(self) -> None:
        launch = self.store.launch()
        env = {**os.environ, **launch["env"], "PYTHONPATH": os.pathsep.join(
            [_ROOT, os.path.join(_ROOT, "clients", "python")])}
        self.proc = subprocess.Popen(
            [*launch["launcher"], sys.executable, "-m", "daemon.cli", "serve", "--config",
             self.config], cwd=_ROOT, env=env, pass_fds=launch["pass_fds"])
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.socket)
                self.store.pump(0.2)  # READY, and FDSTOREREMOVE of what it took back
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("radixd exited during start") from None
                time.sleep(0.02)
        raise RuntimeError("radixd did not start")

    def restart(self, warm: bool) -> float:
        """SIGTERM, then the next daemon (with the stored fds, or none); seconds to serving."""
        assert self.proc is not None
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        self.store.pump(0.05)
        if not warm:
            self.store.drop()
        self.start()
        return time.perf_counter() - t0

    def requests(self, seed: int, n: int) -> list[int]:
        """A window: documents drawn uniformly (every one is reused, none is hot)."""
        rng = random.Random(seed)
        return [rng.randrange(self.args.docs) for _ in range(n)]

    def replay(self, window: list[int]) -> float:
        """Hit rate of ``window``: tokens found on device or host / tokens asked."""
        hit = asked = 0
        with Client(self.socket, timeout=60) as c:
            for d in window:
                toks = self.docs[d]
                r = c.load("m", toks, lock=True)
                hit += r.prefix_len
                asked += len(toks)
                miss = (len(toks) - r.prefix_len) // 16
                if miss:
                    a = c.alloc("m", miss)
                    c.insert("m", toks, a.full_pages, prev_prefix_len=r.prefix_len)
                if r.receipt is not None:
                    c.unlock("m", r.receipt)
        return hit / asked

    def host_pages(self) -> int:
        with Client(self.socket) as c:
            return int(c.stats("m").models["m"]["tree_host_pages"])

    def run(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self.start()
        self.replay(self.requests(1, self.args.docs * 3))  # warm-up: every document cached
        for kind, warm in (("warm", True), ("cold", False)):
            time.sleep(1.0)  # let the host copies land
            window = self.requests(2, self.args.window)
            before = self.replay(window)
            pages = self.host_pages()
            secs = self.restart(warm)
            kept = self.host_pages()
            after = self.replay(window)
            out.update({f"{kind}_hit_before": before, f"{kind}_hit_after": after,
                        f"{kind}_ratio": after / before if before else 0.0,
                        f"{kind}_sigterm_to_serving_s": secs, f"{kind}_host_pages_before": pages,
                        f"{kind}_host_pages_kept": kept})
            print(f"{kind}: hit rate after/before {after:.3f}/{before:.3f} = "
                  f"{out[f'{kind}_ratio']:.3f}  SIGTERM-to-serving {secs:.2f} s  host pages "
                  f"kept {kept} of {pages}", flush=True)
        return out

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=48, help="shared prefixes in the workload")
    ap.add_argument("--doc-pages", type=int, default=16, help="pages (of 16 tokens) per prefix")
    ap.add_argument("--window", type=int, default=200, help="requests per measured window")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    bench = Bench(args)
    try:
        figures = bench.run()
    finally:
        bench.close()
    page_mib = 4 * 2 * 16 * 8 * 128 * 2 / 2**20
    print(f"pages of {page_mib:.2f} MiB; {args.docs} prefixes x {args.doc_pages} pages; "
          f"warm/cold hit-after ratio {figures['warm_ratio']:.3f} / {figures['cold_ratio']:.3f} "
          f"(goal: warm >= 0.9)")
    if args.json:
        write_json(args.json, figures)
    return 0 if figures["warm_ratio"] >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
