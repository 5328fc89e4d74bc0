"""Listening sockets the daemon binds itself: the engines' Unix socket and the admin endpoint.

Both the server and the admin endpoint bind sockets; the rules (never replace a file that is not
a socket, take over a stale socket, refuse one another daemon still serves) live here once.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path


def bind_unix_socket(path: str, mode: int) -> socket.socket:
    """A listening, non-blocking Unix stream socket at ``path``, created with ``mode``.

    A stale socket (its daemon died) is replaced; a live one, or a file that is not a socket,
    is an error rather than something to take over silently."""
    p = Path(path)
    if not p.parent.exists():
        p.parent.mkdir(parents=True, mode=0o750)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise OSError(errno.EEXIST,
                          f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            p.unlink()  # a stale socket from a daemon that died
        else:
            raise OSError(errno.EADDRINUSE, f"another radixd is serving on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)  # no window in which the socket has looser permissions
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, mode)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening, non-blocking TCP socket; port 0 picks a free one (tests, several daemons)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if host == "localhost":
        host = "127.0.0.1"
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
