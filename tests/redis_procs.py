"""Redis servers a test starts itself: a standalone one it can kill, or a three-node Cluster.

The shared Redis on 127.0.0.1:6379 is started by .ci/run; these are for what a shared server
cannot do on demand (die mid-run, come back empty, shard keys over nodes).
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import redis as redis_sync

SHARED_URL = "redis://127.0.0.1:6379/0"


def free_port(also_bus: bool = False) -> int:
    """A free loopback port; with ``also_bus``, port + 10000 (the Cluster bus) is free too."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port > 55000 and also_bus:
            continue
        if also_bus:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
        return port
    raise RuntimeError("no free port")


class Server:
    """One redis-server process (no persistence) on a port of the test's."""

    def __init__(self, port: int, workdir: Path, *extra: str) -> None:
        self.port = port
        self.workdir = workdir
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.workdir), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis_sync.Redis(port=self.port, socket_timeout=0.5).ping():
                    return
            except redis_sync.RedisError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


def start_cluster(tmp_path: Path, nodes: int = 3) -> tuple[list[Server], list[int]]:
    """A Redis Cluster of ``nodes`` masters on loopback ports, in state ok. The caller kills
    the servers (also when this raises: the list is filled as they start)."""
    servers: list[Server] = []
    ports: list[int] = []
    try:
        while len(ports) < nodes:
            p = free_port(also_bus=True)
            if p not in ports:
                ports.append(p)
        for i, p in enumerate(ports):
            d = tmp_path / f"n{i}"
            d.mkdir()
            srv = Server(p, d, "--cluster-enabled", "yes", "--cluster-config-file",
                         str(d / "nodes.conf"), "--cluster-node-timeout", "2000")
            servers.append(srv)
            srv.start()
        subprocess.run(["redis-cli", "--cluster", "create",
                        *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            infos = [redis_sync.Redis(port=p).execute_command("CLUSTER", "INFO") for p in ports]
            if all(b"cluster_state:ok" in (i if isinstance(i, bytes) else str(i).encode())
                   for i in infos):
                return servers, ports
            time.sleep(0.1)
        raise RuntimeError("cluster did not reach cluster_state:ok")
    except BaseException:
        for s in servers:
            s.kill()
        raise
