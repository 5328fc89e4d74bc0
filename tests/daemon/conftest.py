"""A real radixd process on a real Unix socket, per test.

The daemon runs strict (it stops on the first invariant violation) and every test ends with a
requested full check (SIGUSR1) that must report ok, then a SIGTERM that must exit 0: so every
test that mutates state is also a test that the checker stays clean.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from radixd_client import protocol

REPO = Path(__file__).resolve().parents[2]


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


def write_config(path: Path, config: dict[str, Any]) -> None:
    lines: list[str] = []
    for key, value in config.items():
        if not isinstance(value, (dict, list)) or (isinstance(value, list) and value
                                                    and not isinstance(value[0], dict)):
            lines.append(f"{key} = {_toml(value)}")
    for key, value in config.items():
        if isinstance(value, dict):
            lines.append(f"[{key}]")
            lines += [f"{k} = {_toml(v)}" for k, v in value.items()]
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for item in value:
                lines.append(f"[[{key}]]")
                lines += [f"{k} = {_toml(v)}" for k, v in item.items() if v is not None]
    path.write_text("\n".join(lines) + "\n")


SMALL_MODEL = {
    "name": "m", "page_size": 4, "sliding_window": 8, "num_full_layers": 1,
    "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "float32",
    "device": "cpu", "full_pages": 64, "swa_pages": 32,
}


class Daemon:
    """One radixd process; ``check()`` asks it for a full invariant check and waits for it."""

    def __init__(self, tmp: Path, config: dict[str, Any], *, launcher: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()):
        """``launcher``: argv put before ``daemon.cli serve`` (a wrapper that sets up fds the
        way systemd does); ``env``: added to this environment; ``pass_fds``: as Popen's."""
        self.tmp = tmp
        self.socket = str(tmp / "radixd.sock")
        config = dict(config)
        config.setdefault("server", {})
        config["server"] = {"socket": self.socket, **config["server"]}
        self.socket = config["server"]["socket"]  # a test may name its own (a restart on it)
        config.setdefault("checker", {"interval_s": 0.2, "strict": True})
        config.setdefault("admin", {"port": 0})  # several daemons run at once
        config.setdefault("models", [SMALL_MODEL])
        config.setdefault("log_level", "info")
        self.config = config
        self.config_path = tmp / "radixd.toml"
        write_config(self.config_path, config)
        self.log_path = tmp / "radixd.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*launcher, sys.executable, "-m", "daemon.cli", "serve", "--config",
             str(self.config_path)],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, pass_fds=pass_fds,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.checks = 0
        try:
            self._wait_ready()
        except BaseException:  # a daemon that did not come up must not outlive the test
            self.proc.kill()
            self.proc.wait()
            self._log.close()
            raise

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"radixd exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(self.socket)
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"radixd did not come up:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def check(self, timeout: float = 20.0) -> None:
        """A full invariant check in the daemon; fails the test unless it reports ok."""
        assert self.proc.poll() is None, f"radixd died ({self.proc.returncode}):\n{self.log()}"
        self.checks += 1
        want = f"invariant check #{self.checks} (requested): "
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()
            if want + "ok" in text:
                return
            if want in text or self.proc.poll() is not None:
                raise AssertionError(f"invariant check failed:\n{text[-4000:]}")
            time.sleep(0.02)
        raise AssertionError(f"no check verdict within {timeout}s:\n{self.log()[-4000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


FORBIDDEN_IN_LOG = ("invariant violations", "internal error", "Traceback",
                    "Error handling request")


def check_and_stop(daemons: list[Daemon]) -> None:
    """Teardown of every daemon fixture: a clean full check, a clean exit, a clean log."""
    for daemon in daemons:
        if daemon.proc.poll() is None:
            daemon.check()
        code = daemon.stop()
        log = daemon.log()
        assert code == 0, f"radixd exited with {code}:\n{log[-4000:]}"
        for bad in FORBIDDEN_IN_LOG:
            assert bad not in log, log[-4000:]


class Raw:
    """A hand-driven session: frames exactly as the test writes them."""

    def __init__(self, path: str, hello: bool = True):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.settimeout(10)
        self.s.connect(path)
        if hello:
            assert self.call(protocol.Hello(id=0)).ok

    def send(self, body: bytes) -> None:
        self.s.sendall(struct.pack("<I", len(body)) + body)

    def recv(self) -> protocol.Response:
        (n,) = struct.unpack("<I", self._exactly(4))
        return protocol.decode_response(self._exactly(n))

    def _exactly(self, n: int) -> bytes:
        """(MSG_WAITALL does not wait on a socket with a timeout: Python polls it instead.)"""
        out = bytearray()
        while len(out) < n:
            chunk = self.s.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return bytes(out)

    def call(self, req: Any) -> protocol.Response:
        self.send(protocol.encode_body(req))
        return self.recv()

    def close(self) -> None:
        self.s.close()


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator:
    """``make_daemon(config_dict)`` starts a daemon; each is checked and stopped at teardown."""
    daemons: list[Daemon] = []

    def factory(config: dict[str, Any] | None = None, name: str = "d", **launch: Any) -> Daemon:
        d = tmp_path / f"{name}{len(daemons)}"
        d.mkdir(exist_ok=True)  # a test may have put a passed socket there first
        daemon = Daemon(d, config or {}, **launch)
        daemons.append(daemon)
        return daemon

    yield factory
    check_and_stop(daemons)


@pytest.fixture
def daemon(make_daemon) -> Daemon:
    return make_daemon()
