"""Engines ride through a daemon restart (issue 15): a client with a reconnect policy, a real
daemon stopped with SIGTERM and a new one started on the same socket and state directory.

The cut call raises ``SessionRestarted`` once; the client is on a new session; the tensors it
attached before are the new daemon's pools (same objects, same addresses); the warm-restarted
host tier serves the prefix cached before, byte-exact; a request in flight starts over through
``RequestLifecycle.restart`` and never writes into pages it does not own. Without a policy a
restart is ``ConnectionLost``, as before; a daemon that never comes back is ``ConnectFailed``
once the policy's time is up.
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from pathlib import Path
from typing import Any

import pytest
from radixd_client import (
    Client,
    ConnectFailed,
    ConnectionLost,
    NotWritable,
    Reconnect,
    RequestLifecycle,
    SessionRestarted,
)

from .conftest import SMALL_MODEL, Daemon
from .test_checker_daemon import LAUNCHER
from .test_tiers import P, seq, tier_stats, wait_for

FAST = Reconnect(max_wait_s=60, initial_backoff_s=0.02, max_backoff_s=0.5)


def _config(tmp: Path) -> dict[str, Any]:
    return {"server": {"socket": str(tmp / "shared.sock"), "state_dir": str(tmp / "state")},
            "models": [SMALL_MODEL]}


def _value(tok: int) -> float:
    return float(tok % 997) + 0.5


def _cache(c: Client, pools: Any, tokens: list[int]) -> list[int]:
    """Allocate, write a value each token decides into every slot of its page, insert."""
    n = len(tokens) // P
    a = c.alloc("m", n)
    full = list(array("i", a.full_pages))
    for j, page in enumerate(full):
        pools.full[:, :, page] = _value(tokens[(j + 1) * P - 1])
    c.insert("m", array("i", tokens).tobytes(), a.full_pages, a.swa_pages)
    return full


def _restart(make_daemon: Any, d: Any, tmp: Path) -> Any:
    d.check()
    assert d.stop() == 0, d.log()[-2000:]
    return make_daemon(_config(tmp), name="after")


def test_a_client_rides_through_a_restart_with_its_pools_and_cache(make_daemon,
                                                                  tmp_path: Path) -> None:
    d1 = make_daemon(_config(tmp_path), name="before")
    toks = seq(8)
    with Client(d1.socket, reconnect=FAST, client_name="engine") as c:
        pools = c.attach("m")
        full_tensor, address = pools.full, pools.full.data_ptr()
        _cache(c, pools, toks)
        wait_for(lambda: tier_stats(d1)["tree_host_pages"] >= 8, "the host copies")
        old_instance = c.instance
        d2 = _restart(make_daemon, d1, tmp_path)
        with pytest.raises(SessionRestarted) as cut:
            c.match("m", toks)
        assert isinstance(cut.value, ConnectionLost) and c.restarts == 1
        assert c.instance != old_instance and not c.closed  # a new daemon's session
        # the same tensor object, at the same address, is the new daemon's pool
        assert c.attach("m") is pools and pools.full is full_tensor
        assert full_tensor.data_ptr() == address
        m = c.match("m", toks)  # no second SessionRestarted: the new session serves
        assert (m.prefix_len, m.host_hit_len) == (0, 8 * P)  # host tier kept, device empty
        r = c.load("m", toks, lock=True)
        assert r.prefix_len == 8 * P
        got = [float(full_tensor[0, 0, p, 0, 0, 0]) for p in array("i", r.full_pages)]
        assert got == [_value(toks[(j + 1) * P - 1]) for j in range(8)]
        # what this process writes through the old tensor reaches the new daemon's memory
        page = array("i", c.alloc("m", 1).full_pages)[0]
        full_tensor[:, :, page] = 4321.0
        with Client(d2.socket) as other:
            assert float(other.attach("m").full[0, 1, page, 0, 0, 0]) == 4321.0
        c.unlock("m", r.receipt)
    d2.check()


def test_a_request_in_flight_starts_over_and_never_writes_old_pages(make_daemon,
                                                                    tmp_path: Path) -> None:
    d1 = make_daemon(_config(tmp_path), name="before")
    prompt = seq(6, base=300)
    with Client(d1.socket, reconnect=FAST) as c:
        pools = c.attach("m")
        lc = RequestLifecycle(c, "m", prompt)
        lc.admit()
        lc.reserve(4 * P)
        lc.check_writable(0, 4 * P)
        old_pages = list(lc.full_table)
        d2 = _restart(make_daemon, d1, tmp_path)
        with pytest.raises(SessionRestarted):
            lc.commit(4 * P)
        lc.restart()
        assert (lc.computed_len, lc.full_table, lc.receipt) == (0, [], None)
        with pytest.raises(NotWritable):
            lc.check_writable(0, P)  # the old session's pages are not this request's any more
        assert lc.admit().prefix_len == 0
        while lc.computed_len < len(prompt):
            end = min(len(prompt), lc.computed_len + 2 * P)
            lc.reserve(end)
            lc.check_writable(lc.computed_len, end)
            for j in range(lc.computed_len // P, end // P):
                pools.full[:, :, lc.full_table[j]] = _value(prompt[(j + 1) * P - 1])
            lc.computed_len = end
            lc.commit(end)
        lc.finish()
        assert lc.finished_inserted_len == len(prompt)
        m = c.match("m", prompt)
        assert m.prefix_len == len(prompt)
        assert [float(pools.full[0, 0, p, 0, 0, 0]) for p in array("i", m.full_pages)] == [
            _value(prompt[(j + 1) * P - 1]) for j in range(6)]
        assert old_pages  # (they were handed out before the restart, and are gone with it)
    d2.check()


def test_a_request_the_restart_did_not_reach_never_uses_the_new_sessions_ids(
        make_daemon, tmp_path: Path) -> None:
    """Two requests on one client; the restart cuts request B's call only. Request A, never
    told, kept ids the new session numbers afresh: its check_writable passed on B's new pages,
    its commit was accepted, and its abort freed B's pages and receipt (as a review found). A
    now raises SessionRestarted before sending anything, and its abort sends nothing."""
    d1 = make_daemon(_config(tmp_path), name="before")
    with Client(d1.socket, reconnect=FAST) as c:
        c.attach("m")
        a = RequestLifecycle(c, "m", seq(3, base=100), label="A")
        b = RequestLifecycle(c, "m", seq(3, base=200), label="B")
        for lc in (a, b):
            lc.admit()
            lc.reserve(3 * P)
        d2 = _restart(make_daemon, d1, tmp_path)
        with pytest.raises(SessionRestarted):
            b.commit(3 * P)
        b.restart()
        b.admit()
        b.reserve(3 * P)
        assert set(a.full_table) & set(b.full_table)  # the new session reused the ids
        for step in (lambda: a.check_writable(0, 3 * P), lambda: a.commit(3 * P),
                     lambda: a.reserve(4 * P), lambda: a.decode_step(3 * P, 4 * P),
                     lambda: a.finish(3 * P)):
            with pytest.raises(SessionRestarted, match="call restart"):
                step()
        a.abort()  # nothing to give back: it all went with the old session
        held = c.stats("m").models["m"]
        assert held["held_full_pages"] == 3 and held["tree_full_pages"] == 0  # B's, intact
        b.check_writable(0, 3 * P)
        b.computed_len = 3 * P
        assert b.finish().inserted_len == 3 * P
        a.restart()
        assert a.admit().prefix_len == 0  # A starts over in the new session
        a.abort()
    d2.check()


def test_a_restart_during_many_calls_raises_once_then_serves(make_daemon, tmp_path: Path) -> None:
    """Calls in a loop while the daemon restarts: exactly one SessionRestarted, then every call
    works; the policy's waiting covers the time the successor takes to start."""
    d1 = make_daemon(_config(tmp_path), name="before")
    toks = array("i", seq(2, base=900)).tobytes()
    errors: list[BaseException] = []
    done = threading.Event()
    served_after = [0]
    with Client(d1.socket, reconnect=FAST) as c:
        def loop() -> None:
            while not done.is_set():
                try:
                    c.match("m", toks)
                    if errors:
                        served_after[0] += 1
                except BaseException as exc:  # noqa: BLE001 - recorded and asserted on
                    errors.append(exc)
        t = threading.Thread(target=loop)
        t.start()
        time.sleep(0.3)
        d2 = _restart(make_daemon, d1, tmp_path)
        wait_for(lambda: served_after[0] >= 20, "calls on the new session", timeout=60)
        done.set()
        t.join(30)
    assert [type(e) for e in errors] == [SessionRestarted]
    d2.check()


def test_threads_sharing_a_client_ride_through_a_restart_once(make_daemon,
                                                              tmp_path: Path) -> None:
    """Four threads ping through one reconnecting Client while the daemon restarts: one
    reconnect, one SessionRestarted (the cut call's), every payload the caller's own. Before a
    call held the client for its reconnect too, each thread that saw the loss reconnected
    again (4 restarts), and calls went out on a connection that had not said hello."""
    d1 = make_daemon(_config(tmp_path), name="before")
    errors: list[BaseException] = []
    done = threading.Event()
    with Client(d1.socket, reconnect=FAST) as c:
        def loop(who: int) -> None:
            k = 0
            while not done.is_set():
                tag = f"{who}/{k}".encode()
                k += 1
                try:
                    got = c.ping(tag)
                    assert got.payload == tag, (tag, got.payload)
                except BaseException as exc:  # noqa: BLE001 - recorded and asserted on
                    errors.append(exc)
        threads = [threading.Thread(target=loop, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        d2 = _restart(make_daemon, d1, tmp_path)
        wait_for(lambda: c.restarts >= 1 and c.ping(b"x").payload == b"x", "the new session")
        time.sleep(0.3)
        done.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert [type(e) for e in errors] == [SessionRestarted], errors[:4]
        assert c.restarts == 1
    d2.check()


def test_a_client_closed_while_another_thread_reconnects_stays_closed(
        make_daemon, tmp_path: Path) -> None:
    """close() from another thread while a call waits for the daemon to come back: the call
    raises ConnectionLost and opens no session, although the daemon returns. Before, the
    reconnect went on and the closed client held a live session again."""
    d1 = make_daemon(_config(tmp_path), name="before")
    c = Client(d1.socket, reconnect=FAST)
    d1.check()
    assert d1.stop() == 0
    raised: list[BaseException] = []

    def call() -> None:
        try:
            c.ping(b"x")
        except BaseException as exc:  # noqa: BLE001 - asserted on below
            raised.append(exc)
    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.3)  # the call lost its connection and retries
    c.close()
    d2 = make_daemon(_config(tmp_path), name="after")
    t.join(30)
    assert not t.is_alive() and len(raised) == 1
    assert type(raised[0]) is ConnectionLost and "closed by the client" in str(raised[0])
    assert c.closed and c.restarts == 0
    time.sleep(0.5)  # (a reconnect still under way would have opened its session by now)
    with Client(d2.socket) as probe:
        assert probe.session == 1  # the first session the new daemon opened
    d2.check()


def test_without_a_policy_a_restart_is_connection_lost(make_daemon, tmp_path: Path) -> None:
    d1 = make_daemon(_config(tmp_path), name="before")
    with Client(d1.socket) as c:
        d2 = _restart(make_daemon, d1, tmp_path)
        with pytest.raises(ConnectionLost) as lost:
            c.match("m", array("i", seq(1)).tobytes())
        assert not isinstance(lost.value, SessionRestarted) and c.closed
        with pytest.raises(ConnectionLost):
            c.match("m", array("i", seq(1)).tobytes())
    d2.check()


def test_a_daemon_that_never_returns_is_connect_failed_in_time(make_daemon,
                                                              tmp_path: Path) -> None:
    d1 = make_daemon(_config(tmp_path), name="before")
    c = Client(d1.socket, reconnect=Reconnect(max_wait_s=1.0, initial_backoff_s=0.05,
                                              max_backoff_s=0.2))
    d1.check()
    assert d1.stop() == 0
    t0 = time.monotonic()
    with pytest.raises(ConnectFailed, match="did not come back within 1 s"):
        c.match("m", array("i", seq(1)).tobytes())
    assert time.monotonic() - t0 < 10


def test_closing_the_client_is_not_a_reason_to_reconnect(make_daemon, tmp_path: Path) -> None:
    d = make_daemon(_config(tmp_path))
    c = Client(d.socket, reconnect=FAST)
    c.close()
    with pytest.raises(ConnectionLost) as lost:
        c.match("m", array("i", seq(1)).tobytes())
    assert not isinstance(lost.value, SessionRestarted) and c.restarts == 0


def test_closing_the_client_wakes_another_threads_call_waiting_for_its_answer(
        tmp_path: Path) -> None:
    """A thread's load never gets its answer (planted: the load hangs in the daemon); another
    thread closes the shared client. The waiting call raises ConnectionLost saying the client
    closed it, at once, not when the read times out, and nothing reconnects."""
    d = _hung_load_daemon(tmp_path)
    try:
        c = Client(d.socket, reconnect=FAST, timeout=60)
        waiting, raised = _hang_a_load(d, c)
        t0 = time.monotonic()
        c.close()
        waiting.join(20)
        assert not waiting.is_alive() and time.monotonic() - t0 < 10
        assert len(raised) == 1 and type(raised[0]) is ConnectionLost, raised
        assert "closed by the client" in str(raised[0])
        assert c.closed and c.restarts == 0
    finally:
        d.stop()


def _hung_load_daemon(tmp_path: Path) -> Daemon:
    """A daemon whose loads of model m never end (planted), its checks off: the hang pins a
    node no job accounts for, which they would report."""
    return Daemon(tmp_path, {"l3": {"drain_timeout_s": 0.5},
                             "checker": {"interval_s": 3600.0, "strict": False}},
                  launcher=LAUNCHER, env={"FAULT_LOAD": "hang"})


def _hang_a_load(d: Daemon, c: Client) -> tuple[threading.Thread, list[BaseException]]:
    """A thread waiting in ``c``'s load that never ends, and what it will raise."""
    tokens = array("i", seq(1)).tobytes()
    a = c.alloc("m", 1)
    c.insert("m", tokens, a.full_pages, a.swa_pages)
    raised: list[BaseException] = []

    def load() -> None:
        try:
            c.load("m", tokens)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            raised.append(exc)

    waiting = threading.Thread(target=load)
    waiting.start()
    wait_for(lambda: "a load of model m that never ends" in d.log(), "the hung load", 20)
    return waiting, raised


def test_a_forked_child_closing_its_copy_leaves_the_parents_session(make_daemon,
                                                                    tmp_path: Path) -> None:
    """A child forked after the client connected closes its copy (a with-block, or garbage
    collection): its descriptor goes, the connection stays the parent's, locks and all."""
    d = make_daemon(_config(tmp_path))
    with Client(d.socket) as c:
        tokens = array("i", seq(1)).tobytes()
        a = c.alloc("m", 1)
        c.insert("m", tokens, a.full_pages, a.swa_pages)
        locked = c.match("m", tokens, lock=True)
        pid = os.fork()
        if pid == 0:  # the child: close, and leave without running the parent's cleanup
            c.close()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert c.ping(b"still mine").payload == b"still mine"
        c.unlock("m", locked.receipt)  # the receipt is the parent session's still


def test_a_child_forked_during_another_threads_call_closes_only_its_copy(
        tmp_path: Path) -> None:
    """A thread waits in a load that never ends (planted) when the process forks: the child's
    copy of the client's lock is held for good, by a thread the child lacks. Its close must
    still let go of its descriptor only: a shutdown would cut the parent's waiting call."""
    d = _hung_load_daemon(tmp_path)
    try:
        c = Client(d.socket, timeout=60)
        waiting, raised = _hang_a_load(d, c)
        pid = os.fork()
        if pid == 0:
            c.close()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        waiting.join(1.0)
        assert waiting.is_alive() and not raised, raised  # still waiting on its connection
        c.close()
        waiting.join(20)
        assert not waiting.is_alive() and type(raised[0]) is ConnectionLost
    finally:
        d.stop()


def test_closing_an_async_client_while_it_reconnects_fails_its_calls_as_connection_lost(
        make_daemon, tmp_path: Path) -> None:
    """A call waiting for the reconnect when the client is closed was not cancelled: it raises
    ConnectionLost (the session it was made for is gone), not the CancelledError of the
    reconnect that close() stopped."""
    import asyncio

    from radixd_client import AsyncClient

    d = make_daemon(_config(tmp_path))

    async def main() -> None:
        c = await AsyncClient.connect(d.socket, reconnect=FAST)
        d.check()
        assert d.stop() == 0  # gone, and not coming back
        call = asyncio.create_task(c.ping(b"cut"))
        await asyncio.sleep(0.3)
        assert c._reconnecting is not None and not c._reconnecting.done()
        await c.close()
        with pytest.raises(ConnectionLost) as lost:
            await asyncio.wait_for(call, 10)
        assert not isinstance(lost.value, SessionRestarted) and c.closed
        with pytest.raises(ConnectionLost):
            await c.ping(b"later")

    asyncio.run(main())


def test_the_backoff_doubles_with_jitter_up_to_its_cap() -> None:
    import random

    got = list(zip(range(8), Reconnect(max_wait_s=5, initial_backoff_s=0.1,
                                       max_backoff_s=0.5).delays(random.Random(1)),
                   strict=False))
    caps = [0.1, 0.2, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert all(cap / 2 <= d <= cap for (_, d), cap in zip(got, caps, strict=True))
    with pytest.raises(ValueError):
        Reconnect(initial_backoff_s=1.0, max_backoff_s=0.5)


def test_an_async_client_rides_through_with_all_its_calls(make_daemon, tmp_path: Path) -> None:
    """Several tasks in flight when the daemon restarts: each cut call raises SessionRestarted,
    one reconnect serves them all, the attached tensors are the new pools, and the client then
    works (host hits from the warm restart included)."""
    import asyncio

    from radixd_client import AsyncClient

    d1 = make_daemon(_config(tmp_path), name="before")
    toks = seq(4, base=700)
    holder: dict[str, Any] = {}

    async def before() -> None:
        c = await AsyncClient.connect(d1.socket, reconnect=FAST)
        pools = await c.attach("m")
        a = await c.alloc("m", 4)
        for j, page in enumerate(array("i", a.full_pages)):
            pools.full[:, :, page] = _value(toks[(j + 1) * P - 1])
        await c.insert("m", array("i", toks).tobytes(), a.full_pages, a.swa_pages)
        holder.update(c=c, pools=pools, tensor=pools.full, instance=c.instance)

    async def after() -> None:
        c, pools = holder["c"], holder["pools"]
        probe = array("i", seq(1, base=5)).tobytes()
        got = await asyncio.gather(*(c.match("m", probe) for _ in range(5)),
                                   return_exceptions=True)
        assert got and all(isinstance(g, SessionRestarted) for g in got), got
        assert c.restarts == 1 and c.instance != holder["instance"] and not c.closed
        assert (await c.attach("m")) is pools and pools.full is holder["tensor"]
        m = await c.match("m", toks)
        assert m.host_hit_len == 4 * P
        r = await c.load("m", toks)
        assert [float(pools.full[0, 0, p, 0, 0, 0]) for p in array("i", r.full_pages)] == [
            _value(toks[(j + 1) * P - 1]) for j in range(4)]
        await c.close()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(before())
        wait_for(lambda: tier_stats(d1)["tree_host_pages"] >= 4, "the host copies")
        d2 = _restart(make_daemon, d1, tmp_path)
        loop.run_until_complete(after())
    finally:
        loop.close()
    d2.check()


def test_async_calls_waiting_for_a_slot_fail_when_the_daemon_dies(tmp_path: Path) -> None:
    """The requests in flight when the daemon dies never give their slots back: the calls
    waiting for one, and calls made later, raise ConnectionLost instead of waiting forever."""
    import asyncio
    import signal

    from radixd_client import AsyncClient

    d = Daemon(tmp_path, {"server": {"max_inflight": 2}})  # killed below: not make_daemon's

    async def main() -> None:
        c = await AsyncClient.connect(d.socket)
        assert c.limits.max_inflight == 2
        d.proc.send_signal(signal.SIGSTOP)  # two pings in flight, the third waits for a slot
        tasks = [asyncio.create_task(c.ping(b"%d" % i)) for i in range(3)]
        await asyncio.sleep(0.3)
        d.proc.kill()
        d.proc.wait()
        got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert [type(g) for g in got] == [ConnectionLost] * 3, got
        with pytest.raises(ConnectionLost):
            await asyncio.wait_for(c.ping(b"later"), 10)
        await c.close()

    try:
        asyncio.run(main())
    finally:
        d.stop()  # (closes its log; a daemon main() did not reach is stopped)


def test_async_calls_made_while_the_new_session_opens_raise_session_restarted(
        make_daemon, tmp_path: Path) -> None:
    """A call made while the reconnect waits for the new daemon's hello is not sent before it
    (the daemon would refuse it as not authenticated): it raises SessionRestarted with the cut
    call, saying it was not sent (``details["sent"]`` False, on its own error: the cut call's
    says nothing of the kind), and one new connection serves the client."""
    import asyncio
    import signal

    from radixd_client import AsyncClient

    d1 = make_daemon(_config(tmp_path), name="before")
    holder: dict[str, Any] = {}

    async def before() -> None:
        holder["c"] = await AsyncClient.connect(d1.socket, reconnect=FAST)

    async def after(d2: Any) -> None:
        c = holder["c"]
        d2.proc.send_signal(signal.SIGSTOP)  # it accepts, but answers the hello only later
        cut = asyncio.create_task(c.ping(b"cut"))
        await asyncio.sleep(0.3)
        assert c._reconnecting is not None and not c._reconnecting.done()
        other = asyncio.create_task(c.ping(b"other"))
        attach = asyncio.create_task(c.attach("m"))  # (an exclusive call: its own path)
        await asyncio.sleep(0.2)
        d2.proc.send_signal(signal.SIGCONT)
        got = await asyncio.wait_for(asyncio.gather(cut, other, attach, return_exceptions=True),
                                     20)
        assert [type(g) for g in got] == [SessionRestarted] * 3, got
        # the calls made meanwhile were refused unsent; the cut one may have been sent
        assert got[1].details["sent"] is False and got[2].details["sent"] is False
        assert "sent" not in got[0].details
        assert got[1].details["attach_again"] == got[0].details["attach_again"] == {}
        assert c.restarts == 1 and (await c.ping(b"after")).payload == b"after"
        assert c.session == 1  # the new daemon's first: no connection opened and dropped
        await c.close()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(before())
        d2 = _restart(make_daemon, d1, tmp_path)
        loop.run_until_complete(after(d2))
    finally:
        loop.close()
    d2.check()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_pools_that_cannot_be_mapped_again_are_closed_not_kept(make_daemon, tmp_path: Path,
                                                                asynchronous: bool) -> None:
    """A restarted daemon with another pool layout: the cut call raises SessionRestarted naming
    the model, the old AttachedPools is closed (no write through it can miss the new pools),
    and attach() maps the new pools afresh."""
    import asyncio

    from radixd_client import AsyncClient, PoolError

    def config(full_pages: int) -> dict[str, Any]:
        return {"server": {"socket": str(tmp_path / "shared.sock")},
                "models": [dict(SMALL_MODEL, full_pages=full_pages, memory_isolation="none")]}

    d1 = make_daemon(config(64), name="before")

    async def run_async(d_restart: Any) -> tuple[Any, Any, Any]:
        c = await AsyncClient.connect(d1.socket, reconnect=FAST)
        old = await c.attach("m")
        d_restart()
        with pytest.raises(SessionRestarted) as cut:
            await c.ping()
        new = await c.attach("m")
        page = array("i", (await c.alloc("m", 1)).full_pages)[0]
        await c.close()
        return cut.value, old, (new, page)

    holder: dict[str, Any] = {}

    def restart() -> None:
        assert d1.stop() == 0
        holder["d2"] = make_daemon(config(128), name="after")

    if asynchronous:
        err, old, (new, page) = asyncio.run(run_async(restart))
    else:
        with Client(d1.socket, reconnect=FAST) as c:
            old = c.attach("m")
            restart()
            with pytest.raises(SessionRestarted) as cut:
                c.ping()
            err = cut.value
            new = c.attach("m")
            page = array("i", c.alloc("m", 1).full_pages)[0]
            new.full[:, :, page] = 1234.0
            with Client(holder["d2"].socket) as other, other.attach("m") as seen:
                assert float(seen.full[0, 0, page, 0, 0, 0]) == 1234.0
    assert "m" in err.details["attach_again"] and "attach again" in str(err)
    assert old.closed and new is not old and tuple(new.full.shape)[2] == 128
    with pytest.raises(PoolError):
        old.pool("full")
    new.close()  # (its mappings' descriptors go now, not at some later test's collection)
    holder["d2"].check()


def test_a_restart_that_cuts_the_pools_into_other_segments_closes_them(make_daemon,
                                                                       tmp_path: Path) -> None:
    """Same shape and dtype, another segment_pages: the rebind mapped the new daemon's segment
    memfds at the old offsets (12 of 12 pages read back wrong through a fresh mapping, as a
    review found). The pools are closed and named in attach_again."""
    def config(segment_pages: int) -> dict[str, Any]:
        return {"server": {"socket": str(tmp_path / "shared.sock")},
                "models": [dict(SMALL_MODEL, segment_pages=segment_pages)]}

    d1 = make_daemon(config(4), name="before")
    c = Client(d1.socket, reconnect=FAST)
    try:
        pools = c.attach("m")
        d1.check()
        assert d1.stop() == 0
        d2 = make_daemon(config(8), name="after")
        with pytest.raises(SessionRestarted) as cut:
            c.ping()
        assert "segments of 8 pages, not 4" in cut.value.details["attach_again"]["m"]
        assert pools.closed
        fresh = c.attach("m")
        ids = list(array("i", c.alloc("m", 12).full_pages))
        for p in ids:
            fresh.full[0, 0, p] = float(p)
        with Client(d2.socket) as other:
            theirs = other.attach("m")
            assert [float(theirs.full[0, 0, p, 0, 0, 0]) for p in ids] == [float(p) for p in ids]
    finally:
        c.close()
    d2.check()


def test_a_timeout_reconnects_to_the_same_daemon_without_remapping(make_daemon,
                                                                    tmp_path: Path) -> None:
    """No answer in time closes the connection (the stream is out of step) and a reconnect
    policy opens a new session; when it is the same daemon instance, the pools mapped here are
    still its memory: nothing is closed or mapped again, host pools included."""
    import signal

    d = make_daemon(_config(tmp_path))
    c = Client(d.socket, reconnect=FAST, timeout=0.5)
    try:
        pools, host = c.attach("m"), c.kv_attach("m")
        instance = c.instance
        d.proc.send_signal(signal.SIGSTOP)  # for 1.5 s: the call times out, the reconnect
        resume = threading.Timer(1.5, d.proc.send_signal, (signal.SIGCONT,))  # waits it out
        resume.start()
        try:
            with pytest.raises(SessionRestarted) as cut:
                c.ping()
        finally:
            resume.join()
        assert c.instance == instance and c.restarts == 1
        assert cut.value.details["attach_again"] == {}
        assert not pools.closed and not host.closed and c.attach("m") is pools
        r = c.kv_reserve("m", [b"still-mapped"])
        host.pool("full")[r.slots[0]] = 7
        c.kv_commit("m", r.pin)
        with Client(d.socket) as other:
            got = other.kv_lookup("m", [b"still-mapped"])
            assert int(other.kv_attach("m").full[got.slots[0]][0]) == 7
            other.kv_release("m", got.pin)
    finally:
        c.close()


def test_an_async_attach_cancelled_as_its_answer_arrives_closes_the_descriptors(
        make_daemon) -> None:
    """The cancel lands in the loop iteration that delivered the answer and its memfds (faked
    by cancelling from the client's dispatch): the task ends cancelled, and the descriptors it
    was handed are closed, not leaked (16 per attach before)."""
    import asyncio
    import os

    from radixd_client import AsyncClient

    d = make_daemon({})
    holder = Client(d.socket)  # the namespace holds segments: attach sends their memfds
    holder.alloc("m", 30)

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def run() -> None:
        c = await AsyncClient.connect(d.socket)
        task: dict[str, asyncio.Future[Any]] = {}
        dispatch = c._dispatch

        def cancel_on_answer(reply: Any) -> None:
            dispatch(reply)
            if reply.op == "attach" and "t" in task:
                task["t"].cancel()

        c._dispatch = cancel_on_answer  # type: ignore[method-assign]
        before = open_fds()
        for _ in range(3):
            task["t"] = asyncio.ensure_future(c.attach("m"))
            with pytest.raises(asyncio.CancelledError):
                await task["t"]
        assert open_fds() == before
        del task["t"]
        assert (await c.attach("m")).full is not None  # the client serves on
        await c.close()

    try:
        asyncio.run(run())
    finally:
        holder.close()
