"""What every benchmark script shares: a daemon process of its own, and the flat JSON file of
figures (`--json PATH`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from radixd_bench.unix_http import UnixHTTPConnection

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_json(path: str, figures: dict[str, Any]) -> None:
    """A flat JSON object of named figures, sorted, creating the folder if needed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(figures, fh, indent=1, sort_keys=True)
        fh.write("\n")


def run_worker(argv: list[str], root: str, timeout_s: float, *, cpu: int | None = None,
               stdin: bytes | None = None) -> dict[str, Any]:
    """A benchmark's worker process on source tree ``root`` (a side measured in a fresh process
    of its own, run from ``root`` with it first on PYTHONPATH, on CPU ``cpu`` if given): the
    JSON object of the last line it printed, less its ``"source"``, the tree its daemon came
    from. A worker that fails, prints nothing, outlives ``timeout_s`` or ran another tree's
    daemon (a baseline measuring this tree) is a ``RuntimeError``, never a figure."""
    if cpu is not None:
        argv = ["taskset", "-c", str(cpu), *argv]
    try:
        got = subprocess.run(argv, input=stdin, capture_output=True, cwd=root,
                             env=tree_env(root), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the worker on {root} took more than {timeout_s} s") from None
    lines = got.stdout.decode(errors="replace").strip().splitlines()
    if got.returncode or not lines:
        raise RuntimeError(f"the worker on {root} failed (exit {got.returncode}):\n"
                           f"{got.stderr.decode(errors='replace')[-4000:]}")
    figures: dict[str, Any] = json.loads(lines[-1])
    source = figures.pop("source")
    if os.path.realpath(source) != os.path.realpath(root):
        raise RuntimeError(f"the worker for {root} ran the daemon of {source}, another tree's "
                           "daemon")
    return figures


_TICK = os.sysconf("SC_CLK_TCK")


def tree_env(root: str) -> dict[str, str]:
    """This process's environment for a Python process that runs source tree ``root``: the tree
    and its client library first on PYTHONPATH, what the caller's PYTHONPATH held (packages
    installed there) after them."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, os.path.join(root, "clients", "python"),
         *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}


class DaemonProcess:
    """A radixd in a scratch directory, serving ``config`` (TOML, where ``{socket}`` and
    ``{admin}`` stand for the engines' and the admin endpoint's socket paths; an admin endpoint
    needs ``token = "bench"``). ``root``: the source tree it runs from (this checkout, or a
    baseline exported by :func:`export_ref`)."""

    def __init__(self, config: str, admin: bool = False, root: str = _ROOT) -> None:
        self.dir = tempfile.mkdtemp(prefix="radixd-bench-")
        self.socket = os.path.join(self.dir, "radixd.sock")
        self.admin = os.path.join(self.dir, "admin.sock") if admin else None
        cfg = os.path.join(self.dir, "radixd.toml")
        with open(cfg, "w") as fh:
            fh.write(config.format(socket=self.socket, admin=self.admin))
        self.proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--config", cfg],
                                     cwd=root, env=tree_env(root))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                for path in filter(None, (self.socket, self.admin)):
                    with socket.socket(socket.AF_UNIX) as s:
                        s.connect(path)
                return
            except OSError:
                if self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError(f"radixd from {root} exited during start") from None
                time.sleep(0.05)
        self.close()
        raise RuntimeError(f"radixd from {root} did not start")

    def cpu_s(self) -> float:
        """The daemon's user+system CPU seconds so far (all its threads)."""
        return _stat_cpu_s(f"/proc/{self.proc.pid}/stat")

    def loop_cpu_s(self) -> float:
        """The CPU seconds of the daemon's main thread, the one its event loop runs on: the
        rest of :meth:`cpu_s` is its other threads' (copies, Redis, torch's worker pools)."""
        return _stat_cpu_s(f"/proc/{self.proc.pid}/task/{self.proc.pid}/stat")

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def mappings(self) -> int:
        with open(f"/proc/{self.proc.pid}/maps") as fh:
            return sum(1 for _ in fh)

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def admin_json(self, path: str) -> Any:
        return json.loads(self.admin_text(path))

    def admin_text(self, path: str) -> str:
        """The body of a GET on the admin endpoint (``token = "bench"``)."""
        if self.admin is None:
            raise RuntimeError("this daemon has no admin endpoint")
        conn = UnixHTTPConnection(self.admin)
        try:
            conn.request("GET", path, headers={"Authorization": "Bearer bench"})
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise RuntimeError(f"admin GET {path}: HTTP {resp.status}: {body[:300]!r}")
        return body.decode()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        self.close()

    def close(self) -> None:
        """Kill the daemon if it still runs, and remove its directory."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _stat_cpu_s(path: str) -> float:
    """utime + stime of a /proc stat file (a process's or one thread's), in seconds."""
    with open(path) as fh:
        fields = fh.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


def export_ref(ref: str) -> str:
    """The tree of git ``ref`` of this repository, unpacked into a new temporary directory: a
    baseline daemon to run beside this checkout's in the same run. A ref git does not know is
    a usage error (exit status 2, git's own words), not a traceback."""
    got = subprocess.run(["git", "-C", _ROOT, "archive", ref], capture_output=True)
    if got.returncode:
        why = got.stderr.decode(errors="replace").strip().splitlines()
        sys.stderr.write(f"error: cannot export the baseline {ref!r}: "
                         f"{why[-1] if why else 'git archive failed'}\n")
        raise SystemExit(2)
    out = tempfile.mkdtemp(prefix="radixd-baseline-")
    subprocess.run(["tar", "-x", "-C", out], input=got.stdout, check=True)
    return out
