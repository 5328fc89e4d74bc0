"""The stepped background check (daemon/checker.py) in process, against the real service and
tree: random operations interleaved with its steps never make it report anything on a consistent
state, and it still finds a real violation.

The operations run as a task beside ``Checker.run_stepped`` on one event loop, as requests do in
the daemon: between the check's slices (here one step each), never inside one.
"""

from __future__ import annotations

import asyncio
import os
import random
from array import array
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from radixd_client import protocol as P

from daemon.app import build_service
from daemon.checker import Checker
from daemon.config import CheckerConfig, Config
from daemon.entities import Peer
from daemon.service import Service

PAGE = 4
MODEL = {"name": "m", "page_size": PAGE, "sliding_window": 2 * PAGE, "num_full_layers": 1,
         "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32",
         "device": "cpu", "full_pages": 48, "swa_pages": 48, "export_pools": False}
# sequences over a few shared prefixes, so that inserts split and share nodes
PREFIXES = [[b * 100 + j for j in range(3 * PAGE)] for b in range(3)]


def _service() -> Service:
    return build_service(Config(models=[MODEL]), create_pools=False)


def _tokens(rng: random.Random) -> bytes:
    base = rng.choice(PREFIXES)[: PAGE * rng.randint(1, 3)]
    tail = [rng.randrange(1000, 1010) for _ in range(PAGE * rng.randint(0, 3))]
    return array("i", base + tail).tobytes()


class Engine:
    """Random engine operations through the service, as the server would call it."""

    def __init__(self, svc: Service, seed: int) -> None:
        self.svc = svc
        self.rng = random.Random(seed)
        self.sessions = [self._open() for _ in range(2)]
        self.receipts: list[tuple[object, int]] = []
        self.held: list[tuple[object, bytes, bytes]] = []

    def _open(self) -> object:
        svc = self.svc
        return svc.open_session(svc.authenticate(None, Peer(0, os.getuid(), os.getgid())),
                                Peer())

    def step(self) -> None:
        rng, svc = self.rng, self.svc
        s = rng.choice(self.sessions)
        op = rng.choice(("insert", "insert", "match", "unlock", "alloc", "free", "evict",
                         "reconnect"))
        try:
            if op == "insert":
                t = _tokens(rng)
                a = svc.alloc(s, P.Alloc(model="m", n=len(t) // 4 // PAGE))
                svc.insert(s, P.Insert(model="m", tokens=t, full_pages=a.full_pages,
                                       swa_pages=a.swa_pages))
            elif op == "match":
                m = svc.match(s, P.Match(model="m", tokens=_tokens(rng), lock=rng.random() < .5))
                if m.receipt is not None:
                    self.receipts.append((s, m.receipt))
            elif op == "unlock" and self.receipts:
                s2, rid = self.receipts.pop(rng.randrange(len(self.receipts)))
                svc.unlock(s2, P.Unlock(model="m", receipt=rid))
            elif op == "alloc":
                a = svc.alloc(s, P.Alloc(model="m", n=rng.randint(1, 3)))
                self.held.append((s, a.full_pages, a.swa_pages))
            elif op == "free" and self.held:
                s2, full, swa = self.held.pop(rng.randrange(len(self.held)))
                svc.free(s2, P.Free(model="m", full_pages=full, swa_pages=swa))
            elif op == "evict":
                svc.evict(s, P.Evict(model="m", full_pages=rng.randint(1, 4)))
            elif op == "reconnect":
                i = self.sessions.index(s)
                svc.close_session(s)
                self.receipts = [(x, r) for x, r in self.receipts if x is not s]
                self.held = [h for h in self.held if h[0] is not s]
                self.sessions[i] = self._open()
        except Exception as exc:  # noqa: BLE001 - refusals (out of pages) are part of the game
            code = getattr(exc, "code", None) or type(exc).__name__
            assert code in ("out_of_memory", "OutOfPages"), exc


async def interleave(svc: Service, step: Callable[[], object], ops: int, gaps: list[int]
                     ) -> Checker:
    """``ops`` calls of ``step`` (each a change of the service's state), each after ``gaps[i]``
    turns of the loop, while stepped passes run back to back (one step per slice); returns the
    checker once the changes are done and a last pass over the quiet state has run. No pass
    may report anything (tests/test_stepped_audits.py uses it too)."""
    checker = Checker(svc, CheckerConfig(slice_ms=0.001, strict=True))
    checker.bind(ops=lambda: 0, stop=lambda code: None, pending=lambda: True)
    done = asyncio.Event()
    results: list[list[str] | None] = []

    async def passes() -> None:
        while not done.is_set():
            results.append(await checker.run_stepped())

    async def operations() -> None:
        for i in range(ops):
            for _ in range(gaps[i % len(gaps)]):
                await asyncio.sleep(0)
            step()
        done.set()

    await asyncio.gather(passes(), operations())
    results.append(await checker.run_stepped())  # the quiet state, to the end
    assert all(not r for r in results), results
    assert results[-1] == []
    return checker


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ops=st.integers(1, 60),
       gaps=st.lists(st.integers(0, 40), min_size=1, max_size=8))
def test_operations_between_steps_never_make_a_finding(seed: int, ops: int,
                                                        gaps: list[int]) -> None:
    """Whatever runs between two slices of a pass, the pass either sees an unchanged state to
    the end and finds nothing, or notices the change and is given up: no finding reaches the
    confirming complete check (``unconfirmed`` stays 0), and the complete check agrees."""
    svc = _service()
    checker = asyncio.run(interleave(svc, Engine(svc, seed).step, ops, gaps))
    assert checker.passes.unconfirmed == 0
    assert checker.passes.done >= 1
    assert svc.check() == []


def test_a_planted_violation_is_found_in_steps_and_confirmed() -> None:
    """A lock count no receipt accounts for (what a lost unlock leaves), planted between two
    slices of a pass that has already walked past the node, is found by the next pass and
    confirmed by the complete check, which makes it the verdict."""
    svc = _service()
    engine = Engine(svc, 1)
    for _ in range(40):
        engine.step()
    tree = svc.models["m"].cache.tree

    async def run() -> tuple[list[str] | None, list[str] | None]:
        checker = Checker(svc, CheckerConfig(slice_ms=0.001))
        checker.bind(ops=lambda: 0, stop=lambda code: None, pending=lambda: True)
        first = asyncio.ensure_future(checker.run_stepped())
        for _ in range(30):
            await asyncio.sleep(0)
        leaf = next(n for n in tree.iter_nodes() if n.parent is not None and not n.children)
        leaf.full_lock += 1  # the fault: nothing the version sees changes
        return await first, await checker.run_stepped()

    first, second = asyncio.run(run())
    assert second and any("receipts account for" in v for v in second), second
    assert svc.check() == second


def test_the_state_version_moves_with_changes_the_counters_alone_miss() -> None:
    """An alloc and a free of one page each, an unlock and a lock of the same path, a release of
    the SWA lock another receipt shares: each leaves every counter as it was, and each must still
    move the version, or a pass spanning it would read a state that changed under it."""
    svc = _service()
    s = svc.open_session(svc.authenticate(None, Peer(0, os.getuid(), os.getgid())), Peer())
    tokens = array("i", PREFIXES[0]).tobytes()
    a = svc.alloc(s, P.Alloc(model="m", n=3))
    svc.insert(s, P.Insert(model="m", tokens=tokens, full_pages=a.full_pages,
                           swa_pages=a.swa_pages))
    r1 = svc.match(s, P.Match(model="m", tokens=tokens, lock=True))
    r2 = svc.match(s, P.Match(model="m", tokens=tokens, lock=True))

    def moved(change) -> bool:
        before = svc.state_version()
        change()
        return svc.state_version() != before

    def alloc_and_free() -> None:
        got = svc.alloc(s, P.Alloc(model="m", n=1))
        svc.free(s, P.Free(model="m", full_pages=got.full_pages, swa_pages=got.swa_pages))

    def unlock_and_lock() -> None:
        svc.unlock(s, P.Unlock(model="m", receipt=r2.receipt))
        svc.match(s, P.Match(model="m", tokens=tokens, lock=True))

    assert moved(alloc_and_free)
    assert moved(unlock_and_lock)
    assert moved(lambda: svc.release_swa(s, P.ReleaseSwa(model="m", receipt=r1.receipt)))
    before = svc.state_version()
    svc.match(s, P.Match(model="m", tokens=tokens))  # a plain match of a cached prefix: no move
    svc.stats(s, P.Stats())
    assert svc.state_version() == before
    assert svc.check() == []


def test_a_background_pass_that_raises_is_counted_and_the_next_one_runs() -> None:
    """A check that cannot run (out of descriptors, a lazy import that fails under EMFILE) is
    an error of that pass, logged and counted as failed; the background checker goes on, and
    the next pass gives a verdict. Before, the exception ended the checker's task, silently,
    for the rest of the daemon's life."""
    svc = _service()
    Engine(svc, 2).step()
    checker = Checker(svc, CheckerConfig(interval_s=0.01, slice_ms=1.0))
    checker.bind(ops=lambda: 0, stop=lambda code: None)
    real = svc.check_steps
    faults = [OSError(24, "Too many open files")]

    def check_steps(v: list[str], *, deep: bool = True) -> Any:
        if faults:  # the fault: the first pass cannot run
            raise faults.pop()
        return real(v, deep=deep)

    svc.check_steps = check_steps  # type: ignore[method-assign]

    async def run() -> None:
        task = asyncio.ensure_future(checker.loop())
        for _ in range(500):
            await asyncio.sleep(0.01)
            if checker.passes.done:
                break
        assert not task.done(), task
        task.cancel()

    asyncio.run(run())
    assert checker.passes.failed == 1 and checker.passes.done >= 1
    assert checker.last.ok is True


def test_a_check_that_raises_on_the_state_is_a_violation_and_stops_a_strict_daemon() -> None:
    """A check that trips over the state itself (a node missing from an index) is not the
    process's limits: it is reported as a violation, the last verdict says so, and strict mode
    stops the daemon (exit 3), as for any other violation."""
    svc = _service()
    Engine(svc, 3).step()
    stops: list[int] = []
    checker = Checker(svc, CheckerConfig(interval_s=0.01, slice_ms=1.0, strict=True))
    checker.bind(ops=lambda: 0, stop=stops.append)
    assert checker.run() == []

    def broken(v: list[str], *, deep: bool = True) -> Any:
        raise KeyError("node 17 is not in the tree's index")

    svc.check_steps = broken  # type: ignore[method-assign]
    svc.check = lambda *, deep=True: broken([])  # type: ignore[method-assign]

    async def run() -> None:
        task = asyncio.ensure_future(checker.loop())
        await asyncio.wait_for(task, 10)  # strict: the loop ends after stopping the daemon

    asyncio.run(run())
    assert stops == [3] and checker.passes.failed == 0
    assert checker.last.ok is False and "raised KeyError" in checker.last.violations[0]
