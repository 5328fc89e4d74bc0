"""Every pipelined result is its own: batches and single requests from many tasks on one
AsyncClient, a sync Client beside it, and threads sharing one sync Client, against a real
daemon.

A batch response used to be decoded lazily, after the reader had read the next response into the
same buffer: a task then got another request's payload, or page ids it did not hold (and an
engine wrote KV into them). Each check here asks the daemon itself: echoed ping payloads are the
task's own, every allocated page is freed by the session that got it (``page_not_held``
otherwise), and at the end the tenant holds nothing.
"""

from __future__ import annotations

import asyncio
import random
import threading
from array import array
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radixd_client import AsyncClient, Client, pages

from tests.harness import loop_factories

MODEL = "m"
LOOPS = loop_factories()


def run(loop_factory: Any, coro: Any) -> Any:
    with asyncio.Runner(loop_factory=loop_factory) as r:
        return r.run(asyncio.wait_for(coro, 60))


# A step is one request or one batch, as a list of items: ("ping", n) or ("alloc", n).
Step = list[tuple[str, int]]


async def run_steps(c: AsyncClient, who: int, steps: list[tuple[bool, Step]],
                    held: list[int]) -> None:
    """Run one task's steps; every echoed payload must be this task's, and the pages every
    alloc returned are collected in ``held`` (checked against the daemon afterwards)."""
    for k, (batched, items) in enumerate(steps):
        tags = [f"{who}/{k}/{i}".encode() * (1 + n % 7) for i, (_op, n) in enumerate(items)]
        if batched:
            async with c.batch() as b:
                futs = [b.ping(tag) if op == "ping" else b.alloc(MODEL, n)
                        for (op, n), tag in zip(items, tags, strict=True)]
            results = [f.result() for f in futs]
        else:
            results = [await (c.ping(tag) if op == "ping" else c.alloc(MODEL, n))
                       for (op, n), tag in zip(items, tags, strict=True)]
        for (op, n), tag, res in zip(items, tags, results, strict=True):
            if op == "ping":
                assert res.payload == tag, f"task {who} got another request's ping payload"
            else:
                full, swa = pages(res.full_pages), pages(res.swa_pages)
                assert len(full) == n and len(swa) == n, res
                held.extend(zip(full, swa, strict=True))
        await asyncio.sleep(0)


def assert_unique(held: list[tuple[int, int]]) -> None:
    assert len({f for f, _ in held}) == len(held), "a full page was handed out twice"
    assert len({s for _, s in held}) == len(held), "an SWA page was handed out twice"


async def free_and_verify(c: AsyncClient, held: list[tuple[int, int]]) -> None:
    """Every (full, SWA) page pair a task was given is held by this session, once: the daemon
    frees each (``page_not_held`` would raise)."""
    assert_unique(held)
    for full, swa in held:
        await c.free(MODEL, full_pages=[full], swa_pages=[swa])


async def assert_nothing_held(c: AsyncClient) -> None:
    """Nothing stranded: with every page freed, the tenant's open sessions hold none."""
    models = (await c.stats(MODEL)).models[MODEL]
    assert (models["held_full_pages"], models["held_swa_pages"]) == (0, 0), models


@pytest.fixture
def daemon(make_daemon: Any) -> Any:
    """Pools big enough that no alloc of these workloads runs out of pages."""
    model = {"name": MODEL, "page_size": 4, "sliding_window": 8, "num_full_layers": 1,
             "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "float32",
             "device": "cpu", "full_pages": 4096, "swa_pages": 4096}
    return make_daemon({"models": [model]})


def steps_of(rng: random.Random, n: int, alloc_pages: int) -> list[tuple[bool, Step]]:
    out = []
    for _ in range(n):
        items = [("alloc", rng.randint(1, alloc_pages)) if rng.random() < 0.3
                 else ("ping", rng.randint(0, 50)) for _ in range(rng.randint(1, 3))]
        out.append((rng.random() < 0.6, items))
    return out


def sync_steps(c: Client, steps: list[tuple[bool, Step]], who: str) -> list[tuple[int, int]]:
    """Run the steps on a blocking client; every echoed payload must be this caller's, every
    alloc as many pages as it asked for. Returns the (full, SWA) pages the allocs gave."""
    held: list[tuple[int, int]] = []
    for k, (batched, items) in enumerate(steps):
        tags = [f"{who}/{k}/{i}".encode() for i in range(len(items))]
        if batched:
            with c.batch() as b:
                futs = [b.ping(t) if op == "ping" else b.alloc(MODEL, n)
                        for (op, n), t in zip(items, tags, strict=True)]
            results = [f.result() for f in futs]
        else:
            results = [c.ping(t) if op == "ping" else c.alloc(MODEL, n)
                       for (op, n), t in zip(items, tags, strict=True)]
        for (op, n), t, res in zip(items, tags, results, strict=True):
            if op == "ping":
                assert res.payload == t, (t, res.payload)
            else:
                got = list(zip(pages(res.full_pages), pages(res.swa_pages), strict=True))
                assert len(got) == n
                held.extend(got)
    return held


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_many_tasks_pipelining_batches_get_their_own_results(daemon: Any,
                                                             loop_factory: Any) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket) as c:
            rng = random.Random(7)
            # pings only, many tasks: every batch response is followed at once by others
            tasks = [run_steps(c, who, [(True, [("ping", who % 50)])] * 10, [])
                     for who in range(200)]
            await asyncio.gather(*tasks)
            # pings and allocs, single and batched, with the pages checked by the daemon
            helds: list[list[tuple[int, int]]] = [[] for _ in range(40)]
            await asyncio.gather(*(run_steps(c, who, steps_of(rng, 25, 1), helds[who])
                                   for who in range(40)))
            await free_and_verify(c, [p for h in helds for p in h])
            await assert_nothing_held(c)

    run(loop_factory, main())
    daemon.check()


def sync_worker(path: str, seed: int, steps: int, errors: list[BaseException],
                freed: threading.Event, close: threading.Event) -> None:
    """A sync Client beside the async tasks: its batches and single calls, checked likewise;
    its session stays open (``freed`` set) until ``close`` is set."""
    try:
        rng = random.Random(seed)
        with Client(path) as c:
            held = sync_steps(c, steps_of(rng, steps, 2), "sync")
            assert_unique(held)
            for full, swa in held:
                c.free(MODEL, full_pages=array("i", [full]), swa_pages=array("i", [swa]))
            freed.set()
            close.wait(60)
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)
    finally:
        freed.set()


step_st = st.tuples(st.booleans(), st.lists(
    st.tuples(st.sampled_from(["ping", "alloc"]), st.integers(1, 2)), min_size=1, max_size=4))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tasks=st.lists(st.lists(step_st, min_size=1, max_size=12), min_size=2, max_size=24),
       sync_steps=st.integers(0, 30), seed=st.integers(0, 1 << 16))
def test_random_interleavings_of_sync_and_async_clients(daemon: Any, tasks: list[Any],
                                                        sync_steps: int, seed: int) -> None:
    """Any mix of tasks, batches and single calls on one AsyncClient, with a sync client
    working at the same time: every result is the caller's own."""
    errors: list[BaseException] = []
    freed, close = threading.Event(), threading.Event()
    worker = threading.Thread(target=sync_worker,
                              args=(daemon.socket, seed, sync_steps, errors, freed, close))

    async def main() -> None:
        async with await AsyncClient.connect(daemon.socket) as c:
            helds: list[list[tuple[int, int]]] = [[] for _ in tasks]
            await asyncio.gather(*(run_steps(c, who, steps, helds[who])
                                   for who, steps in enumerate(tasks)))
            await free_and_verify(c, [p for h in helds for p in h])
            await asyncio.to_thread(freed.wait, 60)
            await assert_nothing_held(c)  # both sessions still open

    worker.start()
    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        close.set()
        worker.join(60)
    assert not errors, errors


def test_threads_sharing_one_sync_client_each_get_their_own_replies(daemon: Any) -> None:
    """Threads that share one blocking Client take turns on its connection. Before, each
    read whatever reply was oldest: calls got another thread's payload or pages, mismatched
    request ids, or a short batch, and an alloc could hand a thread pages it did not ask for."""
    errors: list[BaseException] = []
    helds: list[list[tuple[int, int]]] = [[] for _ in range(4)]
    with Client(daemon.socket) as c:
        def worker(who: int) -> None:
            try:
                helds[who] = sync_steps(c, steps_of(random.Random(who), 150, 2), str(who))
            except BaseException as exc:  # surfaced by the test
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors[:3]
        held = [p for h in helds for p in h]
        assert_unique(held)
        for full, swa in held:  # page_not_held if a thread was given pages of no alloc of its
            c.free(MODEL, full_pages=array("i", [full]), swa_pages=array("i", [swa]))
        models = c.stats(MODEL).models[MODEL]
        assert (models["held_full_pages"], models["held_swa_pages"]) == (0, 0), models


def test_threads_attaching_one_client_at_once_share_its_pools(daemon: Any) -> None:
    """Two threads attach the same model through one client at the same moment: both get the
    one pools object the client keeps (and updates as segments come and go). Before, each could
    build its own, and the orphan was never updated."""
    def attach(c: Client, start: threading.Barrier, got: list[Any]) -> None:
        start.wait(10)
        got.append(c.attach(MODEL))

    for _ in range(20):
        with Client(daemon.socket) as c:
            start, got = threading.Barrier(2), []
            threads = [threading.Thread(target=attach, args=(c, start, got)) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert len(got) == 2 and got[0] is got[1]


@pytest.fixture
def small_window_daemon(make_daemon: Any) -> Any:
    """max_inflight 2: the AsyncClient keeps at most two requests in flight."""
    return make_daemon({"server": {"max_inflight": 2}})


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_attach_runs_while_callers_hold_every_slot(small_window_daemon: Any,
                                                   loop_factory: Any) -> None:
    """Callers that got their in-flight slot just as an attach closed the gate wait for the
    attach holding that slot: the attach, which has the connection alone, needs none (it
    waited for one of theirs forever)."""
    async def main() -> None:
        async with await AsyncClient.connect(small_window_daemon.socket) as c:
            pings = [asyncio.ensure_future(c.ping(b"%d" % i)) for i in range(6)]
            await asyncio.sleep(0)  # two are sent, four wait for a slot
            pools = await asyncio.wait_for(c.attach(MODEL), 10)
            pools.close()
            results = await asyncio.wait_for(asyncio.gather(*pings), 10)
            assert [r.payload for r in results] == [b"%d" % i for i in range(6)]

    run(loop_factory, main())


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_a_call_cancelled_at_the_attach_gate_gives_its_slot_back(small_window_daemon: Any,
                                                                 loop_factory: Any) -> None:
    """Calls cancelled while they wait at a closed attach gate holding a slot give the slot
    back: afterwards the client still runs max_inflight calls at once (it hung instead). The
    gate is held closed by hand, as an attach holds it, so that the callers are cancelled
    exactly there."""
    async def main() -> None:
        async with await AsyncClient.connect(small_window_daemon.socket) as c:
            pings = [asyncio.ensure_future(c.ping(b"x")) for _ in range(6)]
            await asyncio.sleep(0)  # two are sent, four wait for a slot
            c._gate_open = False  # an attach starts: the gate closes
            c._gate.clear()
            await asyncio.sleep(0.3)  # the two answers free two slots: two callers take them
            for p in pings:
                p.cancel()
            done = await asyncio.gather(*pings, return_exceptions=True)
            assert sum(isinstance(r, asyncio.CancelledError) for r in done) >= 4
            c._gate_open = True  # the attach is over
            c._gate.set()
            both = await asyncio.wait_for(asyncio.gather(c.ping(b"a"), c.ping(b"b")), 5)
            assert [r.payload for r in both] == [b"a", b"b"]

    run(loop_factory, main())
