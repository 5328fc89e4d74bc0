"""A scripted stand-in for the daemon, for client tests that need no real daemon.

``FakeDaemon`` owns one end of a ``socketpair()`` (a real Unix stream socket) and serves it from a
thread: it reads whole frames, decodes them with the protocol, records them, and answers with
whatever the test's handler returns: a whole frame, a list of byte chunks written one by one
(to exercise partial reads), ``None`` for no answer, or ``CLOSE`` to hang up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from radixd_client import protocol as P

from tests.harness import loop_factories

CLOSE = object()

MODEL = P.ModelInfo(
    name="tiny", page_size=4, sliding_window=8, num_full_layers=2, num_swa_layers=1,
    num_kv_heads=2, head_dim=8, dtype="bfloat16", device="cpu", full_pages=64, swa_pages=32,
)


def hello_result(max_frame: int = 1 << 20, max_inflight: int = 64) -> P.HelloResult:
    return P.HelloResult(
        session=7, version=P.PROTOCOL_VERSION, instance="0123abcd", tenant="acme",
        namespace="ns-acme",
        models=[MODEL], limits=P.Limits(max_frame_bytes=max_frame, max_tokens=1 << 16,
                                        max_inflight=max_inflight),
    )


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


Handler = Callable[[Any], Any]


class FakeDaemon:
    def __init__(self, handler: Handler | None = None, *, hello: P.HelloResult | None = None,
                 hello_error: tuple[str, str] | None = None, chunk_delay: float = 0.002) -> None:
        self.handler = handler or (lambda req: P.ok_frame(req.id, P.Empty()))
        self.hello = hello or hello_result()
        self.hello_error = hello_error
        self.chunk_delay = chunk_delay
        self.client_sock, self.sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.requests: list[Any] = []
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    # what the test inspects
    def ops(self) -> list[str]:
        return [r.__struct_config__.tag for r in self.requests]

    def send(self, out: Any) -> None:
        if out is None:
            return
        if out is CLOSE:
            self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
            raise EOFError
        if isinstance(out, (bytes, bytearray)):
            self.sock.sendall(out)
            return
        if callable(out):
            out(self.sock)
            return
        for piece in out:
            if piece is CLOSE:
                self.send(CLOSE)
            self.sock.sendall(piece)
            time.sleep(self.chunk_delay)

    def _serve(self) -> None:
        try:
            while True:
                hdr = recv_exact(self.sock, 4)
                if hdr is None:
                    return
                body = recv_exact(self.sock, P.HEADER.unpack(hdr)[0])
                if body is None:
                    return
                req = P.decode_request(body)
                self.requests.append(req)
                if isinstance(req, P.Hello) and self.hello_error is not None:
                    self.send(P.error_frame(req.id, *self.hello_error))
                elif isinstance(req, P.Hello):
                    self.send(P.ok_frame(req.id, self.hello))
                else:
                    self.send(self.handler(req))
        except EOFError:
            return
        except OSError:
            return
        except BaseException as exc:  # surfaced by close()
            self.errors.append(exc)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
        self._thread.join(5)
        with contextlib.suppress(OSError):
            self.client_sock.close()
        assert not self.errors, self.errors


@pytest.fixture
def fake_daemon() -> Iterator[Callable[..., FakeDaemon]]:
    made: list[FakeDaemon] = []

    def make(handler: Handler | None = None, **kw: Any) -> FakeDaemon:
        d = FakeDaemon(handler, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def open_fds() -> set[int]:
    return {int(x) for x in os.listdir("/proc/self/fd")}


@pytest.fixture(params=loop_factories())
def run(request: pytest.FixtureRequest) -> Callable[[Any], Any]:
    """Run a coroutine to completion on a fresh loop of the parametrized kind."""

    def runner(coro: Any) -> Any:
        with asyncio.Runner(loop_factory=request.param) as r:
            return r.run(asyncio.wait_for(coro, 30))

    return runner


@pytest.fixture
def kit() -> Any:
    """The helpers above, for test modules (conftest modules cannot be imported by name)."""
    import types

    return types.SimpleNamespace(CLOSE=CLOSE, MODEL=MODEL, hello_result=hello_result,
                                 open_fds=open_fds, recv_exact=recv_exact, FakeDaemon=FakeDaemon)
