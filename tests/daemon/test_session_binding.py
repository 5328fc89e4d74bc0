"""Ids of one session never reach the next, and a closed client's session ends at once.

A daemon restart gives a reconnecting client a new session that numbers receipts and pages
afresh, so an old id sent on the new session names another request's lock or pages there.
``locked()`` used to release the old receipt's number at the end of its block, and a
``RequestLifecycle`` step that waited for the client while another thread reconnected was sent
on the new session. And a client's close left the connection open while a forked child held a
copy of its socket, with every page and lock of the session. Real daemons, restarted for real.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from array import array
from pathlib import Path
from typing import Any

import pytest
from radixd_client import (
    AsyncClient,
    Client,
    ReceiptError,
    RequestLifecycle,
    SessionRestarted,
    TimedOut,
)

from .conftest import SMALL_MODEL
from .test_ride_through import FAST, _config, _restart
from .test_tiers import P, seq


def _held(c: Client) -> int:
    return int(c.stats("m").models["m"]["held_full_pages"])


def _cache(c: Client, tokens: bytes) -> None:
    a = c.alloc("m", len(tokens) // 4 // P)
    c.insert("m", tokens, a.full_pages, a.swa_pages)


def test_locked_does_not_release_the_new_sessions_lock_of_the_same_number(
        make_daemon, tmp_path: Path) -> None:
    d1 = make_daemon(_config(tmp_path), name="before")
    mine, other = (array("i", seq(2, base=b)).tobytes() for b in (100, 200))
    with Client(d1.socket, reconnect=FAST) as c:
        _cache(c, mine)
        with c.locked("m", mine) as m:
            d2 = _restart(make_daemon, d1, tmp_path)
            with pytest.raises(SessionRestarted):
                c.ping(b"cut")
            _cache(c, other)
            theirs = c.match("m", other, lock=True)  # another request's lock, same number
            assert theirs.receipt == m.receipt
        c.unlock("m", theirs.receipt)  # still held: the block's end released nothing
    d2.check()


def test_an_async_locked_does_not_release_the_new_sessions_lock_of_the_same_number(
        make_daemon, tmp_path: Path) -> None:
    d1 = make_daemon(_config(tmp_path), name="before")
    mine, other = (array("i", seq(2, base=b)).tobytes() for b in (300, 400))

    async def main() -> Any:
        c = await AsyncClient.connect(d1.socket, reconnect=FAST)
        try:
            a = await c.alloc("m", 2)
            await c.insert("m", mine, a.full_pages, a.swa_pages)
            async with c.locked("m", mine) as m:
                d2 = await asyncio.to_thread(_restart, make_daemon, d1, tmp_path)
                with pytest.raises(SessionRestarted):
                    await c.ping(b"cut")
                a = await c.alloc("m", 2)
                await c.insert("m", other, a.full_pages, a.swa_pages)
                theirs = await c.match("m", other, lock=True)
                assert theirs.receipt == m.receipt
            await c.unlock("m", theirs.receipt)
            return d2
        finally:
            await c.close()

    asyncio.run(main()).check()


def _thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """``fn`` running in a thread, and what it returned or raised once it ends."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            out["error"] = exc
    t = threading.Thread(target=run)
    t.start()
    return t, out


def _in(t: threading.Thread, function: str) -> bool:
    """Whether ``t`` is running ``function`` (a frame of it is on its stack)."""
    frame = sys._current_frames().get(t.ident)  # noqa: SLF001 - where a thread waits
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def _while_another_thread_reconnects(make_daemon: Any, d1: Any, tmp_path: Path, c: Client,
                                     step: Any, waits_in: str = "_in_turn") -> tuple[Any, Any]:
    """Stop ``d1``; thread B's ping meets it and reconnects, holding the client, while
    ``step`` runs in thread A and waits for the client (in ``waits_in``); then a new daemon
    starts. (the new daemon, what A returned or raised)"""
    d1.check()
    assert d1.stop() == 0
    b, b_out = _thread(lambda: c.ping(b"cut"))
    deadline = time.monotonic() + 30
    while not _in(b, "_ride_through"):
        assert time.monotonic() < deadline, "B never reconnected"
        time.sleep(0.01)
    a, a_out = _thread(step)
    while not (_in(a, waits_in) and _in(b, "_ride_through")):
        assert time.monotonic() < deadline and a.is_alive(), a_out
        time.sleep(0.01)
    d2 = make_daemon(_config(tmp_path), name="after")
    for t in (a, b):
        t.join(60)
    assert type(b_out.get("error")) is SessionRestarted and c.restarts == 1
    return d2, a_out


STEPS = {  # a step of a request holding two pages and a receipt, made for the old session
    "reserve": lambda lc: lc.reserve(3 * P),
    "commit": lambda lc: lc.commit(2 * P),
    "decode_step": lambda lc: lc.decode_step(2 * P, 3 * P),
    "finish": lambda lc: lc.finish(2 * P),
    "abort": lambda lc: lc.abort(),
}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_a_lifecycle_step_that_waited_out_another_threads_reconnect_is_not_sent(
        make_daemon, tmp_path: Path, name: str) -> None:
    """Before, such a step was sent on the new session once B let go of the client: an alloc
    took pages there that the request then forgot (held until the client closed), a commit or
    finish put the old page ids (another request's there) in the tree, an abort freed them.
    Now each raises SessionRestarted unsent, and abort returns quietly: all of it went with
    the old session."""
    d1 = make_daemon(_config(tmp_path), name="before")
    with Client(d1.socket, reconnect=FAST) as c:
        lc = RequestLifecycle(c, "m", seq(3, base=500), label="A")
        lc.admit()
        lc.reserve(2 * P)
        lc.computed_len = 2 * P
        d2, out = _while_another_thread_reconnects(make_daemon, d1, tmp_path, c,
                                                   lambda: STEPS[name](lc))
        if name == "abort":
            assert out == {"value": None} and lc.done
        else:
            assert type(out["error"]) is SessionRestarted, out
            assert "was not sent" in str(out["error"])
        assert _held(c) == 0 and c.stats("m").models["m"]["tree_full_pages"] == 0
        lc.restart()
        lc.admit()
        lc.reserve(3 * P)
        assert _held(c) == 3  # the request starts over on the new session
        lc.abort()
    d2.check()


def test_an_admit_that_waited_out_another_threads_reconnect_admits_on_the_new_session(
        make_daemon, tmp_path: Path) -> None:
    """A request that holds nothing is bound to the session the client had when admit() began;
    another thread reconnected before admit() could send, so its match was refused unsent
    (SessionRestarted) although nothing of the request belonged to the old session. Now it
    admits on the new session, and its lock and pages are that session's."""
    d1 = make_daemon(_config(tmp_path), name="before")
    with Client(d1.socket, reconnect=FAST) as c:
        lc = RequestLifecycle(c, "m", seq(3, base=800), label="A")
        d2, out = _while_another_thread_reconnects(make_daemon, d1, tmp_path, c, lc.admit)
        assert "error" not in out, out
        assert out["value"].prefix_len == 0 and lc.receipt is not None
        rid = lc.receipt
        lc.reserve(3 * P)
        assert _held(c) == 3
        lc.abort()
        assert _held(c) == 0
        with pytest.raises(ReceiptError):  # abort released the new session's lock
            c.unlock("m", rid)
    d2.check()


def test_an_admit_whose_own_call_a_restart_cut_raises_with_the_pools_to_attach_again(
        make_daemon, tmp_path: Path) -> None:
    """The retry above is for a call refused unsent only. When the restart cuts admit()'s own
    match, that SessionRestarted is the one that names the pools the reconnect closed (here a
    new layout): admit() raises it, so the engine rebuilds its views before writing KV."""
    def config(full_pages: int) -> dict[str, Any]:
        return {"server": {"socket": str(tmp_path / "shared.sock")},
                "models": [dict(SMALL_MODEL, full_pages=full_pages, memory_isolation="none")]}

    d1 = make_daemon(config(64), name="before")
    with Client(d1.socket, reconnect=FAST) as c:
        old = c.attach("m")
        lc = RequestLifecycle(c, "m", seq(3, base=900), label="fresh")
        assert d1.stop() == 0
        d2 = make_daemon(config(128), name="after")  # another layout: not mapped again
        with pytest.raises(SessionRestarted) as exc:
            lc.admit()
        assert "m" in exc.value.details["attach_again"] and old.closed
        assert exc.value.details.get("sent", True) is not False
    d2.check()


def test_locked_that_waited_out_another_threads_reconnect_locks_on_the_new_session(
        make_daemon, tmp_path: Path) -> None:
    """locked() entered while another thread reconnects: its match runs on the new session,
    no error (it holds nothing of the old one), and the block's end releases that lock."""
    d1 = make_daemon(_config(tmp_path), name="before")
    tokens = array("i", seq(2, base=700)).tobytes()
    with Client(d1.socket, reconnect=FAST) as c:
        def block() -> int:
            with c.locked("m", tokens) as m:
                return m.receipt
        d2, out = _while_another_thread_reconnects(make_daemon, d1, tmp_path, c, block,
                                                   waits_in="locked")
        assert isinstance(out.get("value"), int), out
        with pytest.raises(ReceiptError):  # the block's end released it, on the new session
            c.unlock("m", out["value"])
    d2.check()


def _child_holding_a_copy() -> tuple[int, int]:
    """A forked child that keeps its copies of this process's descriptors until the returned
    pipe end is closed; (pid, that end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: wait, and leave without running the parent's cleanup
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    return pid, w


def _ended_while_child_lives(d: Any, pid: int, w: int) -> bool:
    """Whether the daemon released the closed session's pages while the child still holds a
    copy of its socket; then lets the child go."""
    try:
        with Client(d.socket) as probe:
            deadline = time.monotonic() + 5
            while _held(probe) and time.monotonic() < deadline:
                time.sleep(0.05)
            return _held(probe) == 0
    finally:
        os.close(w)
        assert os.waitpid(pid, 0)[1] == 0


def test_closing_a_client_ends_its_session_while_a_forked_child_lives(make_daemon,
                                                                    tmp_path: Path) -> None:
    d = make_daemon(_config(tmp_path))
    c = Client(d.socket)
    c.alloc("m", 2)
    pid, w = _child_holding_a_copy()
    c.close()
    assert _ended_while_child_lives(d, pid, w)


def test_closing_an_async_client_ends_its_session_while_a_forked_child_lives(
        make_daemon, tmp_path: Path) -> None:
    d = make_daemon(_config(tmp_path))

    async def main() -> tuple[int, int]:
        c = await AsyncClient.connect(d.socket)
        await c.alloc("m", 2)
        child = _child_holding_a_copy()
        await c.close()
        return child

    assert _ended_while_child_lives(d, *asyncio.run(main()))


def test_a_timed_out_call_ends_its_session_while_a_forked_child_lives(make_daemon,
                                                                     tmp_path: Path) -> None:
    """A timeout closes the connection (the stream is out of step); the session must end with
    it, not live on with a child's copy, beside the one the client reconnects to."""
    d = make_daemon(_config(tmp_path))
    c = Client(d.socket, timeout=2.0)
    c.alloc("m", 2)
    pid, w = _child_holding_a_copy()
    d.proc.send_signal(signal.SIGSTOP)  # no answer comes
    try:
        with pytest.raises(TimedOut):
            c.ping(b"late")
    finally:
        d.proc.send_signal(signal.SIGCONT)
    assert c.closed
    assert _ended_while_child_lives(d, pid, w)
