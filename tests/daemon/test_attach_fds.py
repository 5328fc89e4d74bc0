"""The descriptors an ``attach`` sends (SCM_RIGHTS) cost the daemon none of its own: an attach
answered at once needs no copy of them, and one that waits behind responses the client has not
read holds none while it waits. Before, each attach duplicated every memfd it listed: a daemon
near its descriptor limit answered ``internal`` and leaked the copies made before the one that
failed, and a client that never read pinned one descriptor per segment for 30 s."""

from __future__ import annotations

import array
import contextlib
import os
import resource
import socket
import time
from typing import Any

from radixd_client import Client
from radixd_client import protocol as P

from .conftest import Raw


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_an_attach_at_the_descriptor_limit_is_answered_and_leaks_nothing(make_daemon) -> None:
    d = make_daemon({"checker": {"interval_s": 3600.0}})
    pid = d.proc.pid
    with Client(d.socket) as c:
        c.alloc("m", 24)  # pages from several segments of the namespace
        time.sleep(0.2)
        n = _open_fds(pid)
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (n + 1, hard))  # one descriptor free
        try:
            pools = c.attach("m")
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        assert len(pools.segments) >= 3, pools.segments  # more than the daemon had free
        assert _open_fds(pid) == n
    d.check()


def _recv_with_fds(sock: socket.socket) -> tuple[P.Response, list[int]]:
    buf, fds = b"", []
    while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "little"):
        data, anc, _flags, _addr = sock.recvmsg(1 << 20, socket.CMSG_SPACE(64 * 4))
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += array.array("i", raw[: len(raw) - len(raw) % 4]).tolist()
        assert data, "closed"
        buf += data
    return P.decode_response(buf[4:]), fds


def test_an_attach_behind_an_unread_response_holds_no_descriptors_meanwhile(make_daemon
                                                                             ) -> None:
    d = make_daemon({"checker": {"interval_s": 3600.0}})
    pid = d.proc.pid
    c = Raw(d.socket)
    try:
        assert c.call(P.Alloc(id=1, model="m", n=24)).ok
        before = _open_fds(pid)
        # one response of 4 MiB the client does not read yet: the attach waits behind it
        c.send(P.encode_body(P.Ping(id=2, payload=b"\0" * (4 << 20))))
        c.send(P.encode_body(P.Attach(id=3, model="m")))
        time.sleep(0.5)
        assert _open_fds(pid) == before
        ping = c.recv()
        assert ping.ok and ping.id == 2
        reply, fds = _recv_with_fds(c.s)
        try:
            assert reply.ok and reply.id == 3, reply
            result: Any = P.decode_result("attach", reply.result)
            assert len(fds) == len(result.segments) >= 3
            for seg in result.segments:  # each descriptor is the segment it is listed as
                assert os.fstat(fds[seg.fd_index]).st_size == seg.nbytes
        finally:
            for fd in fds:
                os.close(fd)
        assert c.call(P.Ping(id=4, payload=b"after")).ok  # the frames behind it went on
    finally:
        c.close()
    d.check()


def test_an_attach_the_socket_never_takes_ends_at_its_deadline(monkeypatch) -> None:
    """The transport has sent everything, but the kernel's buffer toward the client is full
    (the client reads nothing): the attach waits without making its answer again and again,
    and the connection is closed once ATTACH_SEND_TIMEOUT_S has passed. Before, that state
    had no deadline (only a transport buffer that was not empty had one), and the answer was
    made 200 times a second. In process: the kernel buffer is filled through a copy of the
    daemon's end of a socket pair, as a client that stops reading leaves it."""
    import asyncio

    from daemon import server as server_module
    from daemon.app import build_service
    from daemon.config import Config
    from daemon.server import Connection, Server
    from daemon.service import Service

    from .conftest import SMALL_MODEL

    monkeypatch.setattr(server_module, "ATTACH_SEND_TIMEOUT_S", 0.2)
    made = []
    attach = Service.FD_HANDLERS["attach"]
    monkeypatch.setitem(Service.FD_HANDLERS, "attach", lambda *a: made.append(1) or attach(*a))
    config = Config(models=[SMALL_MODEL])
    service = build_service(config)

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        server = Server(config, service)
        server.loop = loop
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        fill = theirs.dup()
        fill.setblocking(False)
        await loop.connect_accepted_socket(lambda: Connection(server), theirs)
        for req in (P.Hello(id=1), P.Alloc(id=2, model="m", n=24)):
            await loop.sock_sendall(ours, P.encode(req))
            await asyncio.sleep(0.05)
        assert len(ours.recv(1 << 16)) > 0  # (both answers)
        conn = next(iter(server.connections))
        with contextlib.suppress(BlockingIOError):
            while True:
                fill.send(b"\0" * 4096)
        await loop.sock_sendall(ours, P.encode(P.Attach(id=3, model="m")))
        await asyncio.sleep(1.0)
        closed = conn.closed  # (by the daemon: the client has not closed its end yet)
        for s in (ours, fill):
            s.close()
        return closed

    closed = asyncio.run(main())
    assert closed and len(made) == 1, (closed, len(made))
    service.close()
