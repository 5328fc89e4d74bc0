"""The AsyncClient against a scripted daemon, on asyncio and on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from typing import Any

import pytest
from radixd_client import (
    AsyncClient,
    BatchSkipped,
    ConnectFailed,
    ConnectionLost,
    OutOfMemory,
    ProtocolError,
    ReceiptError,
)
from radixd_client import protocol as P

TOK = [1, 2, 3, 4, 5, 6, 7, 8]
TOKB = struct.pack("<8i", *TOK)
PG = struct.pack("<2i", 3, 4)
MATCH = P.MatchResult(prefix_len=8, full_pages=PG, swa_pages=b"", node=5, full_hit_len=8,
                      host_hit_len=0, receipt=11)


async def aconnect(d: Any) -> AsyncClient:
    return await AsyncClient.from_socket(d.client_sock, "tok", client_name="async-engine")


def echo(req: Any) -> bytes:
    if isinstance(req, P.Ping):
        return P.ok_frame(req.id, P.PingResult(payload=req.payload))
    if isinstance(req, P.Match):
        return P.ok_frame(req.id, MATCH)
    return P.ok_frame(req.id, P.Empty())


def test_hello_and_calls(fake_daemon: Any, kit: Any, run: Any) -> None:
    d = fake_daemon(echo)

    async def main() -> None:
        async with await aconnect(d) as c:
            assert (c.session, c.tenant, c.namespace) == (7, "acme", "ns-acme")
            assert c.models == {"tiny": kit.MODEL} and c.limits.max_inflight == 64
            assert (await c.ping(b"a")).payload == b"a"
            assert await c.match("tiny", TOK, lock=True) == MATCH
            assert await c.unlock("tiny", 11) == P.Empty()
        assert c.closed

    run(main())
    assert d.requests[0] == P.Hello(id=1, token="tok", client="async-engine")
    assert d.requests[2] == P.Match(id=3, model="tiny", tokens=TOKB, lock=True)
    assert d.ops() == ["hello", "ping", "match", "unlock"]


def test_every_operation_sends_its_request(fake_daemon: Any, run: Any) -> None:
    insert = P.InsertResult(prefix_len=0, inserted_len=8, full_pages=PG, swa_pages=b"", node=1)
    results = {"lock": P.LockResult(receipt=1), "alloc": P.AllocResult(full_pages=PG,
                                                                       swa_pages=b""),
               "insert": insert, "cache_unfinished": insert, "cache_finished": insert,
               "evict": P.EvictResult(full_pages=1, swa_pages=0),
               "stats": P.StatsResult(tenant="a", namespace="n", models={})}
    d = fake_daemon(lambda req: P.ok_frame(req.id, results.get(req.__struct_config__.tag,
                                                               P.Empty())))

    async def main() -> None:
        c = await aconnect(d)
        assert await c.lock("tiny", 5) == results["lock"]
        assert await c.release_swa("tiny", 1) == P.Empty()
        assert await c.alloc("tiny", 2) == results["alloc"]
        assert await c.free("tiny", [3, 4], [4]) == P.Empty()
        assert await c.insert("tiny", TOK, PG, lock=True) == insert
        assert await c.cache_unfinished("tiny", TOK, PG, receipt=1) == insert
        assert await c.cache_finished("tiny", TOK, PG, prev_prefix_len=4) == insert
        assert await c.evict("tiny", 1, 2) == results["evict"]
        assert await c.stats() == results["stats"]
        await c.close()

    run(main())
    sent = {r.__struct_config__.tag: r for r in d.requests}
    assert sent["free"] == P.Free(id=sent["free"].id, model="tiny", full_pages=PG,
                                  swa_pages=PG[4:])
    assert sent["insert"].lock is True and sent["cache_unfinished"].receipt == 1
    assert sent["evict"].swa_pages == 2 and sent["stats"].model is None


def test_concurrent_requests_are_pipelined_and_matched_by_id(fake_daemon: Any, run: Any) -> None:
    """The daemon holds 10 requests and answers them in reverse order."""
    held: list[Any] = []
    n = 10

    def handler(req: Any) -> Any:
        held.append(req)
        if len(held) < n:
            return None
        return b"".join(P.ok_frame(r.id, P.PingResult(payload=r.payload))
                        for r in reversed(held))

    d = fake_daemon(handler)

    async def main() -> list[bytes]:
        c = await aconnect(d)
        out = await asyncio.gather(*(c.ping(str(i).encode()) for i in range(n)))
        await c.close()
        return [r.payload for r in out]

    assert run(main()) == [str(i).encode() for i in range(n)]
    assert len({r.id for r in held}) == n


def test_in_flight_requests_stay_within_max_inflight(fake_daemon: Any, kit: Any,
                                                     run: Any) -> None:
    state = {"outstanding": 0, "max": 0}
    lock = threading.Lock()
    pending: list[Any] = []

    def handler(req: Any) -> Any:
        with lock:
            pending.append(req)
            state["max"] = max(state["max"], len(pending))
            if len(pending) < 3:
                return None
            batch, pending[:] = list(pending), []
        return b"".join(P.ok_frame(r.id, P.PingResult(payload=r.payload)) for r in batch)

    d = fake_daemon(handler, hello=kit.hello_result(max_inflight=3))

    async def main() -> int:
        c = await aconnect(d)
        out = await asyncio.gather(*(c.ping(bytes([i])) for i in range(12)))
        await c.close()
        return len(out)

    assert run(main()) == 12
    assert state["max"] == 3


def test_errors_are_mapped_and_the_connection_survives(fake_daemon: Any, run: Any) -> None:
    def handler(req: Any) -> bytes:
        if isinstance(req, P.Alloc):
            return P.error_frame(req.id, P.Code.OUT_OF_MEMORY, "full", {"full": {"locked": 3}})
        return echo(req)

    d = fake_daemon(handler)

    async def main() -> None:
        c = await aconnect(d)
        with pytest.raises(OutOfMemory) as e:
            await c.alloc("tiny", 10)
        assert e.value.details == {"full": {"locked": 3}}
        assert (await c.ping(b"still")).payload == b"still"
        await c.close()

    run(main())


def test_error_with_id_zero_answers_the_only_request_in_flight(fake_daemon: Any,
                                                               run: Any) -> None:
    d = fake_daemon(lambda req: P.error_frame(0, P.Code.BAD_FRAME, "malformed")
                    if isinstance(req, P.Match) else echo(req))

    async def main() -> None:
        c = await aconnect(d)
        with pytest.raises(ProtocolError, match="malformed"):
            await c.match("tiny", TOK)
        assert (await c.ping(b"x")).payload == b"x"
        await c.close()

    run(main())


def test_eof_fails_every_pending_call(fake_daemon: Any, kit: Any, run: Any) -> None:
    count = {"n": 0}

    def handler(req: Any) -> Any:
        count["n"] += 1
        return kit.CLOSE if count["n"] == 3 else None

    d = fake_daemon(handler)

    async def main() -> None:
        c = await aconnect(d)
        results = await asyncio.gather(*(c.ping() for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, ConnectionLost) for r in results), results
        assert "reconnect" in str(results[0])
        assert c.closed
        with pytest.raises(ConnectionLost):
            await c.ping()
        await c.close()

    run(main())


def test_partial_frames(fake_daemon: Any, run: Any) -> None:
    def handler(req: Any) -> list[bytes]:
        frame = echo(req)
        return [frame[:1], frame[1:3], frame[3:5], frame[5:]]

    d = fake_daemon(handler, chunk_delay=0.005)

    async def main() -> None:
        c = await aconnect(d)
        assert await c.match("tiny", TOK) == MATCH
        big = await c.ping(b"z" * 200_000)
        assert big.payload == b"z" * 200_000
        await c.close()

    run(main())


def test_close_fails_pending_calls(fake_daemon: Any, run: Any) -> None:
    d = fake_daemon(lambda req: None)  # never answers

    async def main() -> None:
        c = await aconnect(d)
        task = asyncio.ensure_future(c.ping())
        await asyncio.sleep(0.05)
        await c.close()
        with pytest.raises(ConnectionLost, match="closed by the client"):
            await task

    run(main())


def test_cancelled_call_does_not_break_the_stream(fake_daemon: Any, run: Any) -> None:
    def handler(req: Any) -> Any:
        if isinstance(req, P.Ping) and req.payload == b"slow":
            def later(sock: socket.socket) -> None:
                time.sleep(0.1)
                sock.sendall(echo(req))
            return later
        return echo(req)

    d = fake_daemon(handler)

    async def main() -> None:
        c = await aconnect(d)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(c.ping(b"slow"), 0.02)
        # the late answer is read and dropped; the next call gets its own answer
        assert (await c.ping(b"next")).payload == b"next"
        await c.close()

    run(main())


def test_batch(fake_daemon: Any, run: Any) -> None:
    def handler(req: Any) -> bytes:
        items = [P.BatchItem(ok=True, result=P.msgspec.Raw(P.encode_body(MATCH))),
                 P.BatchItem(ok=False, error=P.Error(code=P.Code.BAD_RECEIPT, message="no"))]
        return P.ok_frame(req.id, P.BatchResult(results=items))

    d = fake_daemon(handler)

    async def main() -> None:
        c = await aconnect(d)
        async with c.batch() as b:
            f1 = b.match("tiny", TOK)
            f2 = b.unlock("tiny", 1)
            f3 = b.ping()
        assert f1.result() == MATCH
        with pytest.raises(ReceiptError):
            f2.result()
        with pytest.raises(BatchSkipped):
            f3.result()
        await c.close()

    run(main())
    assert d.ops() == ["hello", "batch"] and len(d.requests[1].ops) == 3


def test_locked(fake_daemon: Any, run: Any) -> None:
    d = fake_daemon(echo)

    async def main() -> None:
        c = await aconnect(d)
        async with c.locked("tiny", TOK) as m:
            assert m.receipt == 11
        with pytest.raises(KeyError):
            async with c.locked("tiny", TOK):
                raise KeyError
        await c.close()

    run(main())
    assert d.ops() == ["hello", "match", "unlock", "match", "unlock"]
    assert all(r.receipt == 11 for r in d.requests if isinstance(r, P.Unlock))


def test_connect_by_path_and_failures(tmp_path: Any, kit: Any, run: Any) -> None:
    path = str(tmp_path / "radixd.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            hdr = kit.recv_exact(conn, 4)
            req = P.decode_request(kit.recv_exact(conn, P.HEADER.unpack(hdr)[0]))
            conn.sendall(P.ok_frame(req.id, kit.hello_result()))
            kit.recv_exact(conn, 1)

    t = threading.Thread(target=serve, daemon=True)
    t.start()

    async def main() -> None:
        c = await AsyncClient.connect(path, "tok", client_name="x", timeout=5)
        assert c.session == 7 and c.path == path
        await c.close()
        with pytest.raises(ConnectFailed):
            await AsyncClient.connect(str(tmp_path / "missing.sock"))

    run(main())
    t.join(5)
    listener.close()


def test_write_larger_than_the_socket_buffer(fake_daemon: Any, run: Any) -> None:
    """A frame the socket cannot take at once is finished by the writer task, not interleaved."""
    d = fake_daemon(echo)
    d.client_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    async def main() -> None:
        c = await aconnect(d)
        payloads = [bytes([i]) * 300_000 for i in range(4)]
        out = await asyncio.gather(*(c.ping(p) for p in payloads))
        assert [o.payload for o in out] == payloads
        await c.close()

    run(main())


class ListeningDaemon:
    """A scripted daemon on a listening socket, for reconnects: ``handler(i, req)`` answers
    connection ``i``'s requests other than hello (a frame, None for no answer, or ``"close"``);
    ``hello_delay[i]`` holds connection ``i``'s hello answer back. ``seen``: (connection, op)."""

    def __init__(self, path: str, kit: Any, handler: Any, hello_delay: dict[int, float]
                 | None = None) -> None:
        self.path, self.kit, self.handler = path, kit, handler
        self.hello_delay = hello_delay or {}
        self.seen: list[tuple[int, str]] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        for i in range(16):
            try:
                s, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(i, s), daemon=True).start()

    def _serve(self, i: int, s: socket.socket) -> None:
        with s:
            while (head := self.kit.recv_exact(s, 4)) is not None:
                req = P.decode_request(self.kit.recv_exact(s, P.HEADER.unpack(head)[0]))
                self.seen.append((i, req.__struct_config__.tag))
                if isinstance(req, P.Hello):
                    time.sleep(self.hello_delay.get(i, 0.0))
                    out = P.ok_frame(req.id, self.kit.hello_result())
                else:
                    out = self.handler(i, req)
                if out in ("close", "close soon"):
                    threading.Timer(0.0 if out == "close" else 0.2, self._hang_up, (s,)).start()
                    continue
                if out is not None:
                    s.sendall(out)

    @staticmethod
    def _hang_up(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)

    def run(self, run: Any, main: Any) -> None:
        """``run(main())`` (the ``run`` fixture) while this daemon listens; closed after."""
        try:
            run(main())
        finally:
            self.listener.close()


def _first_goes_away(i: int, req: Any) -> Any:
    """Connection 0 hangs up a moment after a request (calls made meanwhile queue behind it);
    later connections answer pings and refuse every other request."""
    if i == 0:
        return "close soon"
    if isinstance(req, P.Ping):
        return P.ok_frame(req.id, P.PingResult(payload=req.payload))
    return P.error_frame(req.id, "bad_argument", f"no model {getattr(req, 'model', '')}")


def _fast_reconnect() -> Any:
    from radixd_client import Reconnect

    return Reconnect(max_wait_s=10, initial_backoff_s=0.02, max_backoff_s=0.05)


def test_attaches_queued_behind_a_cut_one_are_not_sent_on_the_new_session(
        tmp_path: Any, kit: Any, run: Any) -> None:
    """Attaches wait for each other (each has the connection to itself): those queued behind
    the one the restart cut were made for the old session and raise SessionRestarted with it,
    instead of running on the new session (before its hello, even)."""
    from radixd_client import SessionRestarted

    d = ListeningDaemon(str(tmp_path / "d.sock"), kit, _first_goes_away, {1: 0.3})

    async def main() -> None:
        c = await AsyncClient.connect(d.path, reconnect=_fast_reconnect(), timeout=5)
        got = await asyncio.gather(*(c.attach(f"m{k}") for k in range(10)),
                                   return_exceptions=True)
        assert [type(g) for g in got] == [SessionRestarted] * 10, got
        assert (await c.ping(b"y")).payload == b"y"
        await c.close()

    d.run(run, main)
    assert [op for i, op in d.seen if i == 1] == ["hello", "ping"], d.seen


def test_every_call_made_while_the_new_session_opens_raises_session_restarted(
        tmp_path: Any, kit: Any, run: Any) -> None:
    """ping, attach and kv_attach made while the new daemon has not answered the hello yet."""
    from radixd_client import SessionRestarted

    d = ListeningDaemon(str(tmp_path / "d.sock"), kit, _first_goes_away, {1: 0.5})

    async def main() -> None:
        c = await AsyncClient.connect(d.path, reconnect=_fast_reconnect())
        cut = asyncio.create_task(c.ping(b"cut"))
        await asyncio.sleep(0.35)  # the daemon went away; the new hello is not answered yet
        got = await asyncio.gather(cut, c.ping(b"x"), c.attach("m"), c.kv_attach("m"),
                                   return_exceptions=True)
        assert [type(g) for g in got] == [SessionRestarted] * 4, got
        await c.close()

    d.run(run, main)
    assert [op for i, op in d.seen if i == 1] == ["hello"], d.seen


def test_a_reconnect_whose_callers_were_all_cancelled_does_not_answer_the_next_restart(
        tmp_path: Any, kit: Any, run: Any) -> None:
    """The reconnect goes on when the calls waiting for it are cancelled; the next restart
    opens a new session again instead of handing out the first one's outcome."""
    from radixd_client import SessionRestarted

    def handler(i: int, req: Any) -> Any:
        if i < 2 and req.payload == b"cut":  # the first two connections go away on a cut
            return "close"
        return P.ok_frame(req.id, P.PingResult(payload=req.payload))

    d = ListeningDaemon(str(tmp_path / "d.sock"), kit, handler, {1: 0.3})

    async def main() -> None:
        c = await AsyncClient.connect(d.path, reconnect=_fast_reconnect())
        first = asyncio.create_task(c.ping(b"cut"))
        await asyncio.sleep(0.1)
        first.cancel()  # its reconnect (hello held back) goes on without it
        await asyncio.sleep(0.5)
        assert c.restarts == 1 and (await c.ping(b"a")).payload == b"a"
        with pytest.raises(SessionRestarted):
            await c.ping(b"cut")  # the second restart
        assert c.restarts == 2 and (await c.ping(b"b")).payload == b"b"
        await c.close()

    d.run(run, main)
    assert sorted({i for i, op in d.seen if op == "hello"}) == [0, 1, 2], d.seen


def test_a_reconnect_after_shutting_down_opens_one_connection(tmp_path: Any, kit: Any,
                                                             run: Any) -> None:
    """The daemon answers ``shutting_down`` and keeps the connection open a moment (a real one
    closes it right after: this scripted one holds that moment open). The old connection's
    reader, cancelled by the reconnect, must not fail the connection the reconnect has bound
    meanwhile: one new connection and one hello serve the client (a second attempt, a backoff
    later, before this was fixed)."""
    from radixd_client import Reconnect, SessionRestarted

    def handler(i: int, req: Any) -> Any:
        if i == 0:
            return P.error_frame(req.id, "shutting_down", "stopping")
        return P.ok_frame(req.id, P.PingResult(payload=req.payload))

    d = ListeningDaemon(str(tmp_path / "d.sock"), kit, handler)

    async def main() -> None:
        c = await AsyncClient.connect(d.path, reconnect=Reconnect(
            max_wait_s=10, initial_backoff_s=1.0, max_backoff_s=1.0))
        with pytest.raises(SessionRestarted):
            await c.ping(b"x")
        assert (await c.ping(b"y")).payload == b"y"
        await c.close()

    d.run(run, main)
    assert [i for i, op in d.seen if op == "hello"] == [0, 1], d.seen


def test_a_cancelled_batch_says_whether_it_may_have_run(fake_daemon: Any, kit: Any,
                                                        run: Any) -> None:
    """A batch cancelled once sent may have run (the daemon got it); one cancelled while it
    waited for a slot was never sent: its operations did not run."""
    d = fake_daemon(lambda req: None, hello=kit.hello_result(max_inflight=1))  # no answers

    async def cancelled_batch(c: AsyncClient) -> Any:
        b = c.batch()
        f = b.unlock("tiny", 1)

        async def send() -> None:
            async with b:
                pass
        task = asyncio.ensure_future(send())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return f

    async def main() -> None:
        c = await aconnect(d)
        sent = await cancelled_batch(c)  # it takes the only slot, and keeps it: no answer
        with pytest.raises(BatchSkipped, match="unlock: no result, it may have run"):
            sent.result()
        waiting = await cancelled_batch(c)
        with pytest.raises(BatchSkipped, match="unlock not run: the batch was interrupted"):
            waiting.result()
        assert [type(r) for r in d.requests] == [P.Hello, P.Batch]
        await c.close()

    run(main())
