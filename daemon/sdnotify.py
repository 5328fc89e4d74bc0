"""systemd integration without libsystemd: the notify protocol and socket activation.

The notify protocol is one datagram of ``KEY=VALUE`` lines to the AF_UNIX socket named by
``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace). Socket activation passes
listening sockets as fds 3.. with ``LISTEN_FDS``/``LISTEN_PID`` set. The file-descriptor store
(``FDSTORE=1`` with the fds attached as SCM_RIGHTS) hands fds to systemd at stop; the next start
gets them back through the same ``LISTEN_FDS``, told apart from the sockets by their
``LISTEN_FDNAMES`` (:data:`FDSTORE_PREFIX`). Outside systemd every call here is a no-op, so the
daemon runs the same way by hand.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

from .storage.host_snapshot import FDSTORE_PREFIX

log = logging.getLogger("radixd.systemd")

SD_LISTEN_FDS_START = 3


class Notifier:
    """Sends READY/STATUS/WATCHDOG/STOPPING to systemd when run as a Type=notify service."""

    def __init__(self, address: str | None):
        self.address = address
        self._sock: socket.socket | None = None
        if address:
            if address.startswith("@"):
                address = "\0" + address[1:]
            self._target = address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Notifier:
        env = os.environ if env is None else env
        return cls(env.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, **fields: str | int) -> bool:
        """Send one message; False (logged once per failure) if systemd could not be told."""
        if self._sock is None:
            return False
        msg = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        try:
            self._sock.sendto(msg, self._target)
            return True
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self.address, exc)
            return False

    def ready(self, status: str) -> bool:
        return self.notify(ready=1, status=status, mainpid=os.getpid())

    def status(self, status: str) -> bool:
        return self.notify(status=status)

    def store_fd(self, name: str, fd: int) -> bool:
        """Put ``fd`` in systemd's fd store under ``name`` (``FDSTORE=1``, SCM_RIGHTS): systemd
        keeps it open across the restart and passes it to the next start. False when it could not
        be sent (not under systemd, or the send failed)."""
        if self._sock is None:
            return False
        msg = f"FDSTORE=1\nFDNAME={name}".encode()
        try:
            self._sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        array.array("i", [fd]).tobytes())], 0, self._target)
            return True
        except OSError as exc:
            log.warning("sd_notify FDSTORE of %s to %s failed: %s", name, self.address, exc)
            return False

    def remove_fds(self, name: str) -> bool:
        """Ask systemd to close the stored fds named ``name`` (consumed or refused)."""
        return self.notify(fdstoreremove=1, fdname=name)

    def stopping(self, status: str = "stopping") -> bool:
        return self.notify(stopping=1, status=status)

    def watchdog(self) -> bool:
        return self.notify(watchdog=1)

    def extend_timeout(self, seconds: float) -> bool:
        """Start-up work that may outlast TimeoutStartSec (allocating large pools)."""
        return self.notify(extend_timeout_usec=int(seconds * 1e6))

    @contextlib.contextmanager
    def extending_timeout(self, step: float = 30.0, limit: float = 1800.0) -> Iterator[None]:
        """Keep the start (or stop) timeout from firing while a slow, blocking block runs.

        For as long as the block runs, a thread sends ``EXTEND_TIMEOUT_USEC=<step>`` every
        ``step / 3`` seconds, so systemd waits ``step`` seconds past the latest message instead of
        killing a daemon that is still allocating pools. It gives up after ``limit`` seconds, so
        an allocation stuck in the driver still ends in a timeout. A no-op outside systemd::

            with notifier.extending_timeout():
                daemon = build(config)   # allocates the KV pools (daemon/app.py)
        """
        if self._sock is None:
            yield
            return
        done = threading.Event()

        def extend() -> None:
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline:
                self.extend_timeout(step)
                if done.wait(step / 3):
                    return
            log.warning("still starting after %.0f s; no longer extending the systemd timeout",
                        limit)

        thread = threading.Thread(target=extend, name="sd-extend-timeout", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(env: dict[str, str] | None = None) -> float | None:
    """Seconds between pings: half of WatchdogSec (as sd_watchdog_enabled() advises), or None."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None


_passed: tuple[list[int], dict[str, int]] | None = None


def passed_fds(env: dict[str, str] | None = None) -> tuple[list[int], dict[str, int]]:
    """The fds systemd passed this process: (listening sockets, {name: fd} of stored fds).

    As sd_listen_fds_with_names(3): the fds are ours only when ``LISTEN_PID`` is set and names
    this process (a missing ``LISTEN_PID`` means the variables were inherited, not meant for us).
    A fd whose name starts with :data:`FDSTORE_PREFIX` came back from the fd store; every other
    one is a socket. Read once per process (the restore runs before the server binds) and the
    variables removed, so child processes do not think the fds are theirs.
    """
    global _passed
    if env is None and _passed is not None:
        return _passed
    src = os.environ if env is None else env
    pid = src.get("LISTEN_PID")
    count = src.get("LISTEN_FDS")
    result: tuple[list[int], dict[str, int]] = ([], {})
    if count and pid == str(os.getpid()):
        try:
            n = int(count)
        except ValueError:
            n = 0
        names = src.get("LISTEN_FDNAMES", "").split(":")
        for i, fd in enumerate(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + n)):
            os.set_inheritable(fd, False)
            name = names[i] if i < len(names) else ""
            if name.startswith(FDSTORE_PREFIX) and name not in result[1]:
                result[1][name] = fd
            else:
                result[0].append(fd)
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            src.pop(key, None)
    if env is None:
        _passed = result
    return result


def fdstore_enabled(env: dict[str, str] | None = None) -> bool:
    """Whether a stop should put the host pools in systemd's fd store: under systemd
    (``NOTIFY_SOCKET``) with ``$FDSTORE`` > 0. systemd >= 254 sets ``$FDSTORE`` from
    ``FileDescriptorStoreMax=``; radixd.service also sets it, for older versions."""
    env = os.environ if env is None else env
    try:
        return bool(env.get("NOTIFY_SOCKET")) and int(env.get("FDSTORE", "0")) > 0
    except ValueError:
        return False


def fdstore_max(env: dict[str, str] | None = None) -> int:
    """How many fds systemd's store keeps for the unit (``$FDSTORE``, from
    ``FileDescriptorStoreMax=``); 0 when unknown or off. systemd drops what goes past it."""
    env = os.environ if env is None else env
    try:
        return max(0, int(env.get("FDSTORE", "0")))
    except ValueError:
        return 0


def listen_fds(env: dict[str, str] | None = None, *, unset: bool = True) -> list[socket.socket]:
    """Listening sockets passed by systemd socket activation (none when not activated); the
    fd-store fds passed with them are left to :func:`passed_fds` (whose caller takes them)."""
    if env is not None and not unset:
        env = dict(env)
    fds = passed_fds(env)[0]
    socks = [socket.socket(fileno=fd) for fd in fds]
    fds.clear()  # taken: a second server in this process must not wrap them again
    return socks
