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

#: the listen backlog of the engines' socket (also applied to a socket systemd passes): a burst
#: of connects, e.g. every worker of an engine starting at once, must not see EAGAIN
LISTEN_BACKLOG = 1024


class ConfiguredAddressError(OSError):
    """A configured address cannot be bound, and binding again would fail the same way: the
    configuration is at fault, not the run, so ``radixd serve`` exits 2 (which the systemd unit
    does not restart) with this message; ``key`` is the configuration key to change."""

    key = "server.socket"


class SocketPathError(ConfiguredAddressError):
    """The socket's path cannot be used (its directory cannot be made, a file that is not a
    socket is in the way, the name is too long, permission); the message names the path, and
    ``key`` the configuration key that set it (who binds an admin socket says so)."""


def _path_error(exc: OSError, path: str, what: str) -> SocketPathError:
    why = exc.strerror or str(exc)
    return SocketPathError(exc.errno, f"{path}: {what}: {why}")


#: the longest path a Unix socket's address holds (sun_path is 108 bytes, one a terminator)
MAX_SOCKET_PATH = 107


def check_socket_path(path: str) -> None:
    """Raise SocketPathError when ``path`` cannot be a socket: too long for a socket address,
    a file that is not a socket already there, or a file, not a directory, on its way
    (``radixd config check`` asks too, binding nothing; a live socket there is the bind's
    business)."""
    p = Path(path)
    if not p.is_absolute():
        raise SocketPathError(errno.EINVAL, f"{path}: not an absolute path (engines and radixd "
                                            "status would look for it from their own working "
                                            "directories): give the whole path")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise SocketPathError(errno.ENAMETOOLONG,
                              f"{path}: {len(os.fsencode(path))} bytes, longer than the "
                              f"{MAX_SOCKET_PATH} a Unix socket path may have (choose a "
                              "shorter one)")
    if (p.exists() or p.is_symlink()) and not stat.S_ISSOCK(p.lstat().st_mode):
        raise SocketPathError(errno.EEXIST, f"{path}: exists and is not a socket; refusing to "
                                            "replace it (choose another socket path)")
    for parent in (p.parent, *p.parent.parents):  # the nearest existing ancestor: a directory?
        if parent.exists():
            if not parent.is_dir():
                raise SocketPathError(errno.ENOTDIR, f"{path}: {parent} is a file, not a "
                                                     "directory (choose another socket path)")
            return


def check_socket_owner(path: str) -> None:
    """SocketPathError when someone else could have made a directory on the socket's way, and
    so could replace the socket with their own and read the tenant tokens engines send in
    hello: up to the highest directory where anyone may make names (world-writable and sticky,
    as /tmp, where the ``/tmp/radixd-$UID`` fallback lives), that one included, every existing
    directory, and every symbolic link on the way, must be this user's or root's (a sticky
    directory's owner may rename what it holds). Asked by ``serve`` as the daemon's own user
    (``radixd config check`` may run as another), and again at the bind, after the missing
    directories were made. A world-writable directory without the sticky bit (a volume shared
    on purpose) is the operator's choice."""
    chain = [d for d in (Path(path).parent, *Path(path).parent.parents) if d.exists()]
    sticky = [i for i, d in enumerate(chain)
              if (m := d.stat().st_mode) & stat.S_IWOTH and m & stat.S_ISVTX]
    if not sticky:
        return
    for d in chain[: sticky[-1] + 1]:
        for st in {os.lstat(d), d.stat()}:  # the link, and what it leads to
            if st.st_uid not in (0, os.geteuid()):
                raise SocketPathError(
                    errno.EPERM, f"{path}: {d} belongs to uid {st.st_uid}, not to this user "
                                 f"({os.geteuid()}), in a directory where anyone may make "
                                 "names: its owner could replace the socket; remove it, or "
                                 "choose a socket path in a directory of this user's")


def replaceable_by_others(path: str) -> str:
    """Why users other than this one could replace the socket at ``path`` (empty: no reason
    found): a directory on its way, symbolic links resolved, that its group or others may
    write and that is not sticky lets them rename the socket, or the directory holding it, and
    bind their own in its place, which clients would then send their tokens to. Only a
    warning: such a directory (a volume shared on purpose) is the operator's choice, and the
    shipped layout (/run/radixd, 0750) is not one."""
    real = Path(path).resolve()
    for d in real.parents:
        try:
            mode = d.stat().st_mode
        except OSError:
            continue
        if mode & 0o022 and not mode & stat.S_ISVTX:
            who = "anyone" if mode & 0o002 else "its group"
            return (f"{path}: {d} is writable by {who} (mode {mode & 0o7777:04o}) and not "
                    "sticky: they could put their own socket in place of this one and read "
                    f"what clients send it, tokens included; chmod go-w {d}, or set its sticky "
                    "bit")
    return ""


def refuse_served_socket(path: str) -> None:
    """OSError (EADDRINUSE) when a process accepts connections on the socket at ``path``:
    another daemon serves there, and taking its socket over would cut its engines off. The
    bind asks, and ``serve`` before it allocates anything."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # nothing there, or a stale socket from a daemon that died
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another radixd is serving on {path}")


def bind_unix_socket(path: str, mode: int) -> socket.socket:
    """A listening, non-blocking Unix stream socket at ``path``, created with ``mode``.

    A stale socket (its daemon died) is replaced; a live one, or a file that is not a socket,
    is an error rather than something to take over silently. A path that cannot hold a socket
    is a SocketPathError naming the path and what is wrong with it."""
    p = Path(path)
    check_socket_path(path)
    check_socket_owner(path)
    if not p.parent.exists():
        try:
            p.parent.mkdir(parents=True, mode=0o750)
        except OSError as exc:
            raise _path_error(exc, path, f"cannot create its directory {p.parent}") from None
        check_socket_owner(path)  # (a directory someone else made meanwhile)
    if p.exists() or p.is_symlink():  # a socket (check_socket_path refused anything else)
        refuse_served_socket(path)
        p.unlink()  # a stale socket from a daemon that died
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)  # no window in which the socket has looser permissions
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EROFS,
                         errno.ENAMETOOLONG, errno.EINVAL) or "too long" in str(exc):
            raise _path_error(exc, path, "cannot bind") from None
        raise
    finally:
        os.umask(old)
    os.chmod(path, mode)
    sock.listen(LISTEN_BACKLOG)
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
