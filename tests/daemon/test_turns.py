"""One connection's pipelined frames do not hold the others back: after its turn (TURN_S) a
connection with frames left gives way, and the other connections' requests are handled
before the rest of its frames. Before, every complete frame of a read (up to 256 KiB of them:
thousands of small requests) ran before anyone else's: one engine stalled the others for
0.2-5 s.

In process, over real Unix sockets on a real event loop: the server's own Connection objects
serve two socket pairs, and the service records the order in which it answers."""

from __future__ import annotations

import asyncio
import socket

import pytest
from radixd_client import protocol as P

from daemon import server as server_module
from daemon.app import build_service
from daemon.config import Config
from daemon.server import Connection, Server

from .conftest import SMALL_MODEL

FRAMES = 200


async def _read_replies(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int
                        ) -> list[P.Response]:
    buf, out = b"", []
    while len(out) < n:
        buf += await loop.sock_recv(sock, 1 << 16)
        while len(buf) >= 4 and len(buf) >= 4 + (size := int.from_bytes(buf[:4], "little")):
            out.append(P.decode_response(buf[4 : 4 + size]))
            buf = buf[4 + size :]
    return out


@pytest.mark.parametrize("turn_s", [0.0, 3600.0])
def test_a_pipelining_connection_gives_way_after_its_turn(monkeypatch, turn_s: float) -> None:
    """A sends FRAMES pings in one write, then B one ping. With a turn that ends after every
    frame, B's ping is answered while most of A's still wait (the server's count of operations
    handled, read as B's answer arrives); with one that never ends (what the daemon did
    before), only after all of A's."""
    monkeypatch.setattr(server_module, "TURN_S", turn_s, raising=False)
    config = Config(models=[{**SMALL_MODEL, "export_pools": False}])
    service = build_service(config, create_pools=False)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        server = Server(config, service)
        server.loop = loop
        clients = []
        for _ in range(2):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            ours.setblocking(False)
            await loop.connect_accepted_socket(lambda: Connection(server), theirs)
            await loop.sock_sendall(ours, P.encode(P.Hello(id=1)))
            assert (await _read_replies(loop, ours, 1))[0].ok
            clients.append(ours)
        a, b = clients
        await loop.sock_sendall(a, b"".join(P.encode(P.Ping(id=2 + i, payload=b"a%d" % i))
                                            for i in range(FRAMES)))
        await loop.sock_sendall(b, P.encode(P.Ping(id=2, payload=b"b")))
        assert (await _read_replies(loop, b, 1))[0].ok
        handled = server.ops - 2  # (the hellos)
        assert len(await _read_replies(loop, a, FRAMES)) == FRAMES
        assert server.ops == 2 + FRAMES + 1
        for sock in clients:
            sock.close()
        return handled

    handled = asyncio.run(main())
    if turn_s == 0.0:
        assert handled < FRAMES // 2, handled  # B's, and a few of A's
    else:
        assert handled == FRAMES + 1  # all of A's first
