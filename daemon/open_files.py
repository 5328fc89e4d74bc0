"""How many files the daemon may have open, and how near it is to that limit.

Every engine connection is a descriptor, and so is every memory-isolation segment (a memfd
each), every host segment and every Redis connection. A daemon started outside systemd inherits
its shell's soft limit, often 1,024, far below the hard one. Running out is silent and
surprising: uvloop (libuv) accepts and closes the connections it has no descriptor for without a
word, so an engine sees its connection reset, and a segment that gets no memfd makes an ``alloc``
fail as ``out_of_memory`` with the pool half empty. So at start the soft limit is raised to the
hard one (as Go's runtime does for its programs), and an accepted connection whose descriptor
number lies in the last tenth of the limit logs a warning: the kernel hands out the lowest free
number, so descriptor ``k`` means at least ``k + 1`` are open.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable

from .log_throttle import LogThrottle

log = logging.getLogger("radixd.server")

#: the soft limit asked for when the hard one is unlimited or larger (the kernel charges a
#: descriptor only when it is used; the daemon calls no select() that would need fewer)
MOST = 1 << 20
#: the share of the limit past which an accepted connection warns
WARN_SHARE = 0.9
#: at most one warning per this many seconds
WARN_EVERY_S = 60.0


def raise_soft_limit(most: int = MOST) -> tuple[int, int]:
    """(soft limit before, soft limit now): raised to the hard limit (at most ``most``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = most if hard == resource.RLIM_INFINITY else min(hard, most)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):  # a sandbox that refuses it: the limit stays what it was
        return soft, soft
    return soft, want


def soft_limit() -> int:
    """The soft limit now (RLIM_INFINITY, -1, as the largest int a descriptor can be)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 2**31 - 1


def open_count() -> int | None:
    """Descriptors open now (None where /proc is not mounted): for /metrics, not a hot path
    (one directory listing)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own descriptor
    except OSError:
        return None


class NearLimit:
    """Warns, at most once every WARN_EVERY_S, when an accepted connection's descriptor number
    shows the daemon past WARN_SHARE of its limit; counts every such connection. The limit is
    read again past the threshold: an operator may have raised it live (``prlimit --pid``)."""

    def __init__(self, read_limit: Callable[[], int] = soft_limit,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.read_limit = read_limit
        self.seen = 0  # connections accepted past the threshold
        self._throttle = LogThrottle(WARN_EVERY_S, clock)
        self._set(read_limit())

    def _set(self, limit: int) -> None:
        self.limit = limit
        self.threshold = int(limit * WARN_SHARE)

    def accepted(self, fd: int) -> None:
        if fd < self.threshold:
            return
        self._set(self.read_limit())
        if fd < self.threshold:
            return
        self.seen += 1
        if not self._throttle.due():
            return
        log.warning("at least %d of the %d files this process may open are open (a connection "
                    "got descriptor %d): past the limit, new engine connections are reset and "
                    "memory-isolation segments cannot be made; raise it (LimitNOFILE= in the "
                    "systemd unit, ulimit -n in a shell)", fd + 1, self.limit, fd)
