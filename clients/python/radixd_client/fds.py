"""Descriptor passing (SCM_RIGHTS) for ``attach``, shared by the blocking and asyncio clients.

The pools' memfds arrive with the attach response, so that response is read with ``recvmsg``;
this is socket work, kept out of the sans-IO :mod:`radixd_client.connection`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from array import array

__all__ = ["MAX_FDS", "RECVMSG_FLAGS", "ancillary_space", "close_fds", "take_fds"]

#: How many descriptors an ``attach`` response may carry (a memfd per pool or segment; the
#: kernel passes at most 253 in one message, SCM_MAX_FD).
MAX_FDS = 253
#: Received descriptors are close-on-exec from the start: no fork/exec between can leak them.
RECVMSG_FLAGS = getattr(socket, "MSG_CMSG_CLOEXEC", 0)


def ancillary_space() -> int:
    """The ancillary buffer size for ``recvmsg``: room for :data:`MAX_FDS` descriptors."""
    return socket.CMSG_SPACE(MAX_FDS * 4)


def take_fds(ancdata: list[tuple[int, int, bytes]], msg_flags: int, fds: list[int]) -> bool:
    """Append the SCM_RIGHTS descriptors of one recvmsg to ``fds``; False if some were cut off
    (the caller treats that as a broken stream)."""
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(cdata) - len(cdata) % 4
            fds.extend(array("i", cdata[:usable]))
    return not msg_flags & getattr(socket, "MSG_CTRUNC", 0)


def close_fds(fds: list[int]) -> None:
    """Close received descriptors that nothing took over, and forget them."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
