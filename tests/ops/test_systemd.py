"""systemd integration, tested without systemd as PID 1.

- sd_notify: a real AF_UNIX datagram socket stands in for systemd's; a real daemon process must
  send READY=1 once its socket accepts connections, WATCHDOG=1 at half of $WATCHDOG_USEC, and
  STOPPING=1 on SIGTERM, then exit 0.
- Socket activation: ``systemd-socket-activate`` (from the systemd package), and the protocol by
  hand (fd 3, LISTEN_FDS, LISTEN_PID); the daemon serves on the passed socket and leaves it alone.
- The unit files: ``systemd-analyze verify`` and ``security --offline``, the sysusers and tmpfiles
  snippets applied to a scratch root, and the settings they must keep, checked by parsing them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from radixd_client import Client
from radixd_client.errors import TimedOut

from daemon.config import load_config
from daemon.sdnotify import Notifier

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "systemd"
EXAMPLE = REPO / "daemon" / "data" / "radixd.example.toml"

CONFIG = """\
log_level = "info"
[server]
socket = "{socket}"
[admin]
enabled = false
[checker]
interval_s = 0.2
strict = true
[[models]]
name = "m"
page_size = 4
sliding_window = 8
num_full_layers = 1
num_swa_layers = 1
num_kv_heads = 1
head_dim = 64
dtype = "float32"
device = "cpu"
full_pages = 64
swa_pages = 32
"""

# Passes fd argv[1] as fd 3 the way systemd does (LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID: "self"
# for this very process, which exec keeps; "" to leave it unset; or another pid), then execs
# `python -m daemon.cli argv[3:]`.
ACTIVATE = """\
import os, sys
fd, listen_pid = int(sys.argv[1]), sys.argv[2]
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_FDNAMES"] = "rpc"
if listen_pid == "self":
    os.environ["LISTEN_PID"] = str(os.getpid())
elif listen_pid:
    os.environ["LISTEN_PID"] = listen_pid
os.execv(sys.executable, [sys.executable, "-m", "daemon.cli", *sys.argv[3:]])
"""


# ---------------------------------------------------------------------------------------- helpers


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory for sockets: sun_path holds 107 bytes, pytest's tmp_path can be long."""
    path = Path(tempfile.mkdtemp(prefix="rxd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without anything systemd or radixd-specific it may have inherited (the
    suite itself may run under systemd), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG_", "LISTEN_", "RADIXD_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def write_config(directory: Path, socket_path: Path) -> Path:
    path = directory / "radixd.toml"
    path.write_text(CONFIG.format(socket=socket_path))
    return path


def serve(config: Path) -> list[str]:
    return [sys.executable, "-m", "daemon.cli", "serve", "--config", str(config)]


class Process:
    """A process whose output goes to a log file; ``stop()`` sends SIGTERM and returns the code."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path,
                 pass_fds: tuple[int, ...] = ()):
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=self._log,
                                     stderr=subprocess.STDOUT, pass_fds=pass_fds)
        self.pid = self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text()

    def alive(self) -> None:
        assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.log()}"

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 20.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.terminate()
        return self.wait()

    def assert_clean(self) -> None:
        text = self.log()
        for bad in ("Traceback", "internal error", "invariant violations"):
            assert bad not in text, text[-4000:]


class NotifySocket:
    """What systemd listens on: an AF_UNIX datagram socket, at a path or in the abstract
    namespace (``@name``)."""

    def __init__(self, directory: Path | None = None, *, abstract: bool = False):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"radixd-test-{os.getpid()}-{uuid.uuid4().hex}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            assert directory is not None
            path = directory / "notify.sock"
            self.sock.bind(str(path))
            self.address = str(path)

    def recv(self, timeout: float) -> tuple[float, dict[str, str]] | None:
        """The next message as {KEY: VALUE} with its arrival time, or None after ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return None
        at = time.monotonic()
        fields = {}
        for line in data.decode().split("\n"):
            key, sep, value = line.partition("=")
            assert sep and key and key == key.upper(), f"not KEY=VALUE: {data!r}"
            fields[key] = value
        return at, fields

    def wait_for(self, key: str, timeout: float, proc: Process | None = None
                 ) -> tuple[float, dict[str, str], list[dict[str, str]]]:
        """Messages until one carries ``key``: (its time, it, the ones before it)."""
        before: list[dict[str, str]] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            got = self.recv(max(left, 0.01)) if left > 0 else None
            if got is None:
                log = f"\n{proc.log()}" if proc else ""
                raise AssertionError(f"no {key} within {timeout}s; got {before}{log}")
            at, msg = got
            if key in msg:
                return at, msg, before
            before.append(msg)

    def drain(self, seconds: float) -> list[tuple[float, dict[str, str]]]:
        out = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            got = self.recv(left)
            if got is None:
                break
            out.append(got)
        return out

    def close(self) -> None:
        self.sock.close()


def wait_for_path(path: Path, proc: Process, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        proc.alive()
        assert time.monotonic() < deadline, f"{path} did not appear:\n{proc.log()}"
        time.sleep(0.02)


def connect_once(path: Path) -> None:
    """One connection attempt, no retry: fails unless the socket is listening right now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))


# ------------------------------------------------------------------------------------ sd_notify


def test_notify_ready_watchdog_stopping(short_tmp: Path) -> None:
    """READY=1 (with STATUS and MAINPID) once the socket accepts, WATCHDOG=1 every half interval
    from the running loop, STOPPING=1 on SIGTERM, exit 0, socket removed."""
    notify = NotifySocket(short_tmp)
    sock_path = short_tmp / "radixd.sock"
    config = write_config(short_tmp, sock_path)
    interval = 1.0
    # WATCHDOG_PID stays unset: if set it must be the daemon's own pid, which is not known
    # before the process exists (sd_watchdog_enabled(3)).
    env = clean_env(NOTIFY_SOCKET=notify.address, WATCHDOG_USEC=str(int(interval * 1e6)))
    daemon = Process(serve(config), env, short_tmp / "radixd.log")
    try:
        _, ready, before = notify.wait_for("READY", 60, daemon)
        # The first and only connection attempt, made the moment READY arrives, must succeed:
        # READY was sent after the socket was listening, not before.
        connect_once(sock_path)
        assert ready["READY"] == "1"
        assert ready["MAINPID"] == str(daemon.pid)
        assert ready.get("STATUS"), ready
        assert stat.S_IMODE(sock_path.stat().st_mode) == 0o660
        assert all("STOPPING" not in m and "READY" not in m for m in before), before

        # Watchdog pings for a while, with clients using the daemon meanwhile.
        pings = []
        deadline = time.monotonic() + 3.2
        with Client(str(sock_path), timeout=10) as client:
            while time.monotonic() < deadline:
                client.ping()
                for at, msg in notify.drain(0.05):
                    assert "STOPPING" not in msg
                    if msg.get("WATCHDOG") == "1":
                        pings.append(at)
        assert len(pings) >= 5, pings
        gaps = [b - a for a, b in pairwise(pings)]
        # sd_watchdog_enabled(3) advises pinging at half the interval; a gap of a whole
        # interval would get the daemon killed.
        assert max(gaps) < interval, gaps
        assert 0.35 * interval <= statistics.median(gaps) <= 0.75 * interval, gaps

        daemon.terminate()
        _, stopping, _ = notify.wait_for("STOPPING", 15, daemon)
        assert stopping["STOPPING"] == "1"
        assert daemon.wait() == 0, daemon.log()
        assert not sock_path.exists(), "the daemon owns (and removes) a socket it bound itself"
        daemon.assert_clean()
    finally:
        daemon.stop()
        notify.close()


def test_notify_abstract_socket_and_foreign_watchdog_pid(short_tmp: Path) -> None:
    """NOTIFY_SOCKET=@name is the abstract namespace. WATCHDOG_PID naming another process means
    the watchdog is not ours: no WATCHDOG=1, but READY and STOPPING as usual."""
    notify = NotifySocket(abstract=True)
    sock_path = short_tmp / "radixd.sock"
    config = write_config(short_tmp, sock_path)
    env = clean_env(NOTIFY_SOCKET=notify.address, WATCHDOG_USEC="200000",
                    WATCHDOG_PID=str(os.getpid()))
    daemon = Process(serve(config), env, short_tmp / "radixd.log")
    try:
        _, ready, _ = notify.wait_for("READY", 60, daemon)
        connect_once(sock_path)
        assert ready["MAINPID"] == str(daemon.pid)
        later = notify.drain(1.0)  # five watchdog intervals
        assert not [m for _, m in later if "WATCHDOG" in m], later
        daemon.terminate()
        notify.wait_for("STOPPING", 15, daemon)
        assert daemon.wait() == 0, daemon.log()
        daemon.assert_clean()
    finally:
        daemon.stop()
        notify.close()


def test_extending_timeout(short_tmp: Path) -> None:
    """While a slow start-up step runs, EXTEND_TIMEOUT_USEC=<step> arrives more often than
    every step; none after the step ends, and none past the limit."""
    notify = NotifySocket(short_tmp)
    notifier = Notifier(notify.address)
    try:
        with notifier.extending_timeout(step=0.3):
            time.sleep(0.5)
        sent = notify.drain(0.1)
        assert all(m == {"EXTEND_TIMEOUT_USEC": "300000"} for _, m in sent), sent
        assert len(sent) >= 3, sent
        times = [at for at, _ in sent]
        assert max(b - a for a, b in pairwise(times)) < 0.3
        assert notify.drain(0.4) == []

        with notifier.extending_timeout(step=0.3, limit=0.15):
            time.sleep(0.6)
        sent = notify.drain(0.1)
        assert 1 <= len(sent) <= 3, sent  # at 0 and 0.1 s, then the limit is reached

        with Notifier(None).extending_timeout():  # outside systemd: nothing, no thread
            pass
    finally:
        notifier.close()
        notify.close()


# -------------------------------------------------------------------------- socket activation


@pytest.mark.systemd_tools
def test_systemd_socket_activate(short_tmp: Path) -> None:
    """systemd-socket-activate listens, execs the daemon on the first connection, and that first
    connection is served; the daemon binds nothing itself and leaves the socket file alone."""
    sock_path = short_tmp / "activated.sock"
    own_path = short_tmp / "configured.sock"  # [server] socket: must stay unused
    config = write_config(short_tmp, own_path)
    notify = NotifySocket(short_tmp)
    # It gives the child a fresh environment (PATH, HOME, ... and LISTEN_*): anything else must
    # be passed with --setenv.
    argv = ["systemd-socket-activate", "--listen", str(sock_path), "--fdname=rpc",
            f"--setenv=NOTIFY_SOCKET={notify.address}", "--setenv=PYTHONUNBUFFERED=1",
            *serve(config)]
    proc = Process(argv, clean_env(), short_tmp / "radixd.log")
    try:
        wait_for_path(sock_path, proc)
        # The daemon starts only now; the connection waits in the listen queue meanwhile.
        with Client(str(sock_path), timeout=60) as client:
            assert client.ping(b"activated").payload == b"activated"
            assert "m" in client.models
        _, ready, _ = notify.wait_for("READY", 10, proc)
        assert ready["MAINPID"] == str(proc.pid)  # systemd-socket-activate exec'd the daemon
        assert not own_path.exists()
        proc.terminate()
        assert proc.wait() == 0, proc.log()
        assert stat.S_ISSOCK(sock_path.lstat().st_mode), "a passed socket is systemd's to remove"
        proc.assert_clean()
    finally:
        proc.stop()
        notify.close()


def test_passed_socket_served_and_kept_across_restart(short_tmp: Path) -> None:
    """The activation protocol by hand: our listening socket as fd 3. The daemon serves on it,
    does not touch the file, and a connection made while no daemon runs (as during a restart
    with radixd.socket) is served by the next daemon."""
    sock_path = short_tmp / "activated.sock"
    own_path = short_tmp / "configured.sock"
    config = write_config(short_tmp, own_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    os.chmod(sock_path, 0o600)  # something the daemon's socket_mode (0660) would change
    listener.listen(64)
    fd = listener.fileno()

    def start(n: int) -> Process:
        argv = [sys.executable, "-c", ACTIVATE, str(fd), "self", "serve", "--config", str(config)]
        return Process(argv, clean_env(), short_tmp / f"radixd{n}.log", pass_fds=(fd,))

    first = start(1)
    try:
        with Client(str(sock_path), timeout=60) as client:
            client.ping()
            client.stats("m")
        assert not own_path.exists()
        assert first.stop() == 0, first.log()
        first.assert_clean()
        assert stat.S_ISSOCK(sock_path.lstat().st_mode)
        assert stat.S_IMODE(sock_path.lstat().st_mode) == 0o600

        pending = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        pending.settimeout(60)
        pending.connect(str(sock_path))  # queued: nobody is accepting now
        second = start(2)
        try:
            with Client.from_socket(pending) as client:
                assert client.ping(b"again").payload == b"again"
            assert second.stop() == 0, second.log()
            second.assert_clean()
        finally:
            second.stop()
        assert stat.S_ISSOCK(sock_path.lstat().st_mode)
    finally:
        first.stop()
        listener.close()


@pytest.mark.parametrize("listen_pid", ["", "1"], ids=["LISTEN_PID-unset", "LISTEN_PID-other"])
def test_inherited_listen_fds_are_ignored(short_tmp: Path, listen_pid: str) -> None:
    """LISTEN_FDS without LISTEN_PID naming this very process was meant for someone else
    (sd_listen_fds(3)): the daemon binds its configured socket and never accepts on fd 3."""
    passed_path = short_tmp / "passed.sock"
    own_path = short_tmp / "configured.sock"
    config = write_config(short_tmp, own_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(passed_path))
    listener.listen(8)
    fd = listener.fileno()
    argv = [sys.executable, "-c", ACTIVATE, str(fd), listen_pid, "serve", "--config", str(config)]
    daemon = Process(argv, clean_env(), short_tmp / "radixd.log", pass_fds=(fd,))
    try:
        wait_for_path(own_path, daemon, timeout=60)
        with Client(str(own_path), timeout=10) as client:
            client.ping()
        with pytest.raises(TimedOut):
            Client(str(passed_path), timeout=1.0)  # queued, never accepted
        assert daemon.stop() == 0, daemon.log()
        assert not own_path.exists()
        daemon.assert_clean()
    finally:
        daemon.stop()
        listener.close()


# ----------------------------------------------------------------------------------- unit files


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd's unit syntax: [Section], Key=Value (repeatable), # and ; comments."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}: cannot parse {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section].get(key)
    assert values and len(values) == 1, f"[{section}] {key}: {values}"
    return values[0]


def test_units_settings() -> None:
    """The settings the design depends on, parsed from the files (runs without systemd too)."""
    from daemon.cli import EXIT_INVARIANT, EXIT_USAGE

    service = parse_unit(UNITS / "radixd.service")
    sock = parse_unit(UNITS / "radixd.socket")
    s = service["Service"]
    want = {
        "Type": "notify", "NotifyAccess": "main", "User": "radixd", "Group": "radixd",
        "RuntimeDirectory": "radixd", "RuntimeDirectoryMode": "0750",
        "RuntimeDirectoryPreserve": "yes", "WatchdogSec": "30s", "Restart": "on-failure",
        "LimitMEMLOCK": "infinity", "LimitNOFILE": "65536", "NoNewPrivileges": "yes",
        "ProtectSystem": "strict", "ReadWritePaths": "/run/radixd", "ProtectHome": "yes",
        "PrivateTmp": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
        "ProtectKernelLogs": "yes", "ProtectControlGroups": "yes", "RestrictNamespaces": "yes",
        "LockPersonality": "yes", "RestrictRealtime": "yes", "SystemCallArchitectures": "native",
        "CapabilityBoundingSet": "",
    }
    for key, value in want.items():
        assert one(service, "Service", key) == value, key
    assert one(service, "Service", "ExecStart").endswith(
        "radixd serve --config /etc/radixd/radixd.toml")
    assert set(one(service, "Service", "RestrictAddressFamilies").split()) == {
        "AF_UNIX", "AF_INET", "AF_INET6"}
    assert set(one(service, "Service", "RestartPreventExitStatus").split()) == {
        str(EXIT_USAGE), str(EXIT_INVARIANT)}
    for key in ("TimeoutStartSec", "TimeoutStopSec"):
        one(service, "Service", key)
    # CUDA needs /dev/nvidia* and writable+executable memory for its JIT: none of these may be on
    # (ProtectClock= implies a DeviceAllow= rule, which closes the device policy).
    for key in ("MemoryDenyWriteExecute", "PrivateDevices", "ProtectClock", "DevicePolicy",
                "DeviceAllow", "ProcSubset", "PrivateUsers"):
        assert key not in s, key
    assert one(service, "Install", "WantedBy") == "multi-user.target"
    # warm restart through the fd store (tests/daemon/test_fdstore.py): systemd keeps the pools'
    # memfds and the index, and $FDSTORE (set by systemd >= 254 itself) turns it on
    store_max = one(service, "Service", "FileDescriptorStoreMax")
    assert int(store_max) >= 3
    assert f"FDSTORE={store_max}" in s["Environment"]

    # The socket unit, the service and the example configuration agree with each other.
    example = load_config(EXAMPLE, env={})
    assert one(sock, "Socket", "ListenStream") == example.server.socket == (
        f"/run/{one(service, 'Service', 'RuntimeDirectory')}/radixd.sock")
    assert one(sock, "Socket", "SocketMode") == example.server.socket_mode
    assert one(sock, "Socket", "SocketUser") == one(service, "Service", "User")
    assert one(sock, "Socket", "SocketGroup") == one(service, "Service", "Group")
    assert one(sock, "Socket", "DirectoryMode") == one(service, "Service", "RuntimeDirectoryMode")
    assert one(sock, "Socket", "Service") == "radixd.service"
    assert one(sock, "Install", "WantedBy") == "sockets.target"


SYSTEMD_README = UNITS / "README.md"
UNIT_DIRS = (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))


def documented_venv() -> str:
    """The virtual environment systemd/README.md's install commands create."""
    found = re.findall(r"^sudo python3 -m venv (/\S+)$", SYSTEMD_README.read_text(), re.M)
    assert len(found) == 1, "systemd/README.md must create exactly one venv"
    return found[0]


def installed_root(directory: Path, *, with_radixd: bool = True) -> Path:
    """A scratch root installed the way systemd/README.md says: the shipped units, unedited, in
    /etc/systemd/system; the documented venv's radixd (a stand-in script: verify checks that
    ExecStart= names an executable, not what it does) unless ``with_radixd`` is False; and this
    machine's own system units (verify resolves sysinit.target and the like in the root)."""
    root = directory / "root"
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    readme = SYSTEMD_README.read_text()
    for name in ("radixd.service", "radixd.socket"):
        assert f"systemd/{name}" in readme and "/etc/systemd/system/" in readme, name
        shutil.copy(UNITS / name, units / name)
    system = next((d for d in UNIT_DIRS if (d / "sysinit.target").exists()), None)
    assert system is not None, f"no systemd unit directory among {UNIT_DIRS}"
    shutil.copytree(system, root / "usr/lib/systemd/system", symlinks=True)
    if with_radixd:
        radixd = root / documented_venv().lstrip("/") / "bin/radixd"
        radixd.parent.mkdir(parents=True)
        radixd.write_text(f"#!/bin/sh\nexec {sys.executable} -m daemon.cli \"$@\"\n")
        radixd.chmod(0o755)
    return root


def _analyzable_units(directory: Path) -> list[str]:
    """The shipped units copied unedited into ``directory`` (for `security --offline`, which
    reads the file only)."""
    for name in ("radixd.service", "radixd.socket"):
        shutil.copy(UNITS / name, directory / name)
    return ["radixd.service", "radixd.socket"]


# Lines of `systemd-analyze verify` output that describe the machine rather than our files. None
# is known: on this machine (systemd 252, PID 1 not systemd, as root and as nobody) verify prints
# nothing at all for these units. A line would only belong here if it also appears for a unit
# file known to be correct, and only with a comment saying where and why it appears.
VERIFY_NOISE: tuple[re.Pattern[str], ...] = ()


INSTALLED_UNITS = ["/etc/systemd/system/radixd.service", "/etc/systemd/system/radixd.socket"]


def _verify(root: Path, files: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}", *files],
                          cwd=root, capture_output=True, text=True, timeout=120,
                          env={**clean_env(), "SYSTEMD_LOG_COLOR": "0"})


def test_documented_install_path_is_execstart() -> None:
    """The unit runs radixd from the venv systemd/README.md tells the operator to create, and
    operations.md names the same path."""
    venv = documented_venv()
    service = parse_unit(UNITS / "radixd.service")
    assert one(service, "Service", "ExecStart") == (
        f"{venv}/bin/radixd serve --config /etc/radixd/radixd.toml")
    assert not venv.startswith(("/home", "/root"))  # ProtectHome=yes would hide it
    assert f"{venv}/bin/radixd" in (REPO / "docs/operations.md").read_text()


@pytest.mark.systemd_tools
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """The shipped units, unedited, installed as documented, pass verify. verify exits 0 on
    unknown keys and bad values, printing only warnings: so its output must be empty, not just
    its exit code 0. Without the venv's radixd it must complain (as it did about the
    /usr/bin/radixd the unit used to name), and a broken copy shows that warnings reach us."""
    result = _verify(installed_root(tmp_path), INSTALLED_UNITS)
    lines = [line for line in (result.stdout + result.stderr).splitlines()
             if line.strip() and not any(p.search(line) for p in VERIFY_NOISE)]
    print(f"systemd-analyze verify: rc={result.returncode}\n{result.stdout}{result.stderr}")
    assert result.returncode == 0 and not lines, "\n".join(lines)

    missing = _verify(installed_root(tmp_path / "missing", with_radixd=False), INSTALLED_UNITS)
    assert f"Command {documented_venv()}/bin/radixd is not executable" in missing.stderr, missing

    broken = installed_root(tmp_path / "broken")
    service = broken / INSTALLED_UNITS[0].lstrip("/")
    text = service.read_text()
    service.write_text(
        text.replace("NoNewPrivileges=", "NoNewPrivilegs=").replace("Type=notify", "Type=notifyy"))
    bad = _verify(broken, INSTALLED_UNITS)
    assert "NoNewPrivilegs" in bad.stderr and "notifyy" in bad.stderr, bad


@pytest.mark.systemd_tools
def test_systemd_analyze_security_ratchet(tmp_path: Path) -> None:
    """The offline exposure score (0 best, 10 worst) must not rise: 3.5 when written."""
    _analyzable_units(tmp_path)
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", "./radixd.service"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=clean_env())
    match = re.search(r"Overall exposure level for radixd\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= 4.0, result.stdout


@pytest.mark.systemd_tools
def test_sysusers_and_tmpfiles(tmp_path: Path) -> None:
    """The snippets applied to a scratch root: user and group radixd, and the directories with
    the owner and mode the units expect."""
    # applying them to a scratch root chowns files: root, or passwordless sudo (as the setup uses)
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    subprocess.run([*sudo, "systemd-sysusers", f"--root={root}", str(UNITS / "radixd.sysusers")],
                   check=True, capture_output=True, text=True, timeout=60)
    passwd = {line.split(":")[0]: line.split(":")
              for line in (root / "etc/passwd").read_text().splitlines()}
    group = {line.split(":")[0]: line.split(":")
             for line in (root / "etc/group").read_text().splitlines()}
    user = passwd["radixd"]
    uid, gid, home = int(user[2]), int(user[3]), user[5]
    assert gid == int(group["radixd"][2]) and home == "/var/lib/radixd"
    assert user[6].endswith("nologin")

    subprocess.run([*sudo, "systemd-tmpfiles", f"--root={root}", "--create",
                    str(UNITS / "radixd.tmpfiles")],
                   check=True, capture_output=True, text=True, timeout=60)
    expect = {"etc/radixd": (0, gid, 0o750), "var/lib/radixd": (uid, gid, 0o750),
              "run/radixd": (uid, gid, 0o750)}
    for rel, (owner, grp, mode) in expect.items():
        st = (root / rel).stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (owner, grp, mode), rel


def test_missing_systemd_tools_fail_with_the_way_out(tmp_path: Path) -> None:
    """Without systemd's tools on PATH a ``systemd_tools`` test fails (it is not skipped) with a
    message that says how to install them and how to deselect it; deselected, nothing fails."""
    test = "tests/ops/test_systemd.py::test_systemd_analyze_security_ratchet"
    env = {**clean_env(), "PATH": str(tmp_path)}  # no systemd-analyze there
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", test]
    run = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 error" in run.stdout and "skipped" not in run.stdout, run.stdout
    assert "systemd-analyze" in run.stdout and "not found" in run.stdout, run.stdout
    assert "apt-get install --no-install-recommends systemd" in run.stdout, run.stdout
    assert '-m "not systemd_tools"' in run.stdout, run.stdout

    run = subprocess.run([*argv, "-m", "not systemd_tools"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 5 and "1 deselected" in run.stdout, run.stdout  # 5: none ran
