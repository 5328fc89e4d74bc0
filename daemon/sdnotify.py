"""systemd integration without libsystemd: the notify protocol and socket activation.

The notify protocol is one datagram of ``KEY=VALUE`` lines to the AF_UNIX socket named by
``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace). Socket activation passes
listening sockets as fds 3.. with ``LISTEN_FDS``/``LISTEN_PID`` set. Outside systemd every call
here is a no-op, so the daemon runs the same way by hand.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

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


def listen_fds(env: dict[str, str] | None = None, *, unset: bool = True) -> list[socket.socket]:
    """Listening sockets passed by systemd socket activation (none when not activated).

    As sd_listen_fds(3): the fds are ours only when ``LISTEN_PID`` is set and names this process
    (a missing ``LISTEN_PID`` means the variables were inherited, not meant for us). The
    variables are removed afterwards so child processes do not think the sockets are theirs.
    """
    env = os.environ if env is None else env
    pid = env.get("LISTEN_PID")
    count = env.get("LISTEN_FDS")
    if not count or pid != str(os.getpid()):
        return []
    try:
        n = int(count)
    except ValueError:
        return []
    if unset:
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            env.pop(key, None)
    socks = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + n):
        os.set_inheritable(fd, False)
        socks.append(socket.socket(fileno=fd))
    return socks
