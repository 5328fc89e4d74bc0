"""The invariant checker: stepped full checks in the background, the O(1) counter check, and
complete checks on request.

A violation means the daemon's bookkeeping is wrong and pages may be handed out twice; the
checker makes that visible (the log, ``/v1/stats``, metrics) and in strict mode stops the daemon
before it does damage. It is shared by the server (its timer, SIGUSR1) and the admin endpoint
(``POST /v1/check``), which is why it lives in neither.

The background full check never holds a request back for more than one step (docs/design.md,
section 5): it runs the check as steps of bounded work (``check_steps``) between requests, for at
most ``slice_ms`` at a time, gives way after the current step as soon as a request waits on a
socket (``pending``), and sleeps after each slice so as to take at most ``share`` of the loop's
time. A pass reads the state across many turns of the event loop, so it only
counts when nothing changed in between (``state_version`` is the same at every turn); otherwise
it is given up and the next interval starts a new one. What a pass finds is confirmed by a
complete check (all at once, as SIGUSR1 runs it) before anything is reported: only the complete
check's verdict reaches the log, the stats and strict mode.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Protocol

import msgspec

from .config import CheckerConfig

log = logging.getLogger("radixd.checker")

#: invariant check kinds: "full" walks everything (complete or stepped), "counters" is the O(1)
#: check while busy
CHECK_KINDS = ("full", "counters")


class Checkable(Protocol):
    def check(self, *, deep: bool = True) -> list[str]: ...

    def check_steps(self, v: list[str], *, deep: bool = True) -> Iterator[None]: ...

    def state_version(self) -> Hashable: ...

    def quick_check(self) -> list[str]: ...


class CheckerState(msgspec.Struct):
    """The verdict of the last check (``ok`` is None until one has run)."""

    ok: bool | None = None
    violations: list[str] = msgspec.field(default_factory=list)
    at: float | None = None
    kind: str | None = None
    seconds: float = 0.0


class PassStats(msgspec.Struct):
    """What the stepped background passes did (the metrics show it; bench/check_bench.py reads
    it there)."""

    done: int = 0  # passes that read a state nothing changed during, to the end
    given_up: int = 0  # passes a change cut short
    unconfirmed: int = 0  # passes whose findings the complete check did not confirm
    failed: int = 0  # passes that raised (logged): the checker goes on at the next interval
    steps: int = 0
    slices: int = 0
    gave_way: int = 0  # slices ended because a request waited
    longest_slice_s: float = 0.0  # the longest the loop was held at once (wall clock)
    longest_slice_cpu_s: float = 0.0  # the same in the thread's CPU time (no preemption)
    longest_step_s: float = 0.0  # the longest step: what a waiting request waits for, at most


class Checker:
    def __init__(self, target: Checkable, config: CheckerConfig):
        self.target = target
        self.config = config
        self._ops: Callable[[], int] = lambda: 0
        self._pending: Callable[[], bool] = lambda: False
        self.stop: Callable[[int], None] | None = None
        self.last = CheckerState()
        self.runs: dict[str, int] = dict.fromkeys(CHECK_KINDS, 0)
        self.requested = 0
        self.passes = PassStats()

    def bind(self, ops: Callable[[], int], stop: Callable[[int], None],
             pending: Callable[[], bool] | None = None) -> None:
        """The server that runs the checker: its operation count (a busy daemon, whose count
        moved, gets the cheap check too), how strict mode stops it (exit code 3), and whether a
        request waits to be read (the stepped check gives way to it)."""
        self._ops = ops
        self.stop = stop
        if pending is not None:
            self._pending = pending

    def run(self, deep: bool | None = None) -> list[str]:
        """A complete full check now, all at once; its verdict becomes the last one."""
        deep = self.config.deep if deep is None else deep
        t0 = time.perf_counter()
        violations = self.target.check(deep=deep)
        self._record("full", violations, time.perf_counter() - t0)
        return violations

    def run_counters(self) -> list[str]:
        t0 = time.perf_counter()
        violations = self.target.quick_check()
        self._record("counters", violations, time.perf_counter() - t0)
        return violations

    async def run_stepped(self, deep: bool | None = None) -> list[str] | None:
        """A full check in steps between requests. None: given up (the state changed during it);
        otherwise the violations, each confirmed by a complete check."""
        deep = self.config.deep if deep is None else deep
        budget = self.config.slice_ms / 1000.0
        rest = (1.0 - self.config.share) / self.config.share
        pending = self._pending
        target = self.target
        stats = self.passes
        found: list[str] = []
        steps = target.check_steps(found, deep=deep)
        clock = time.perf_counter
        t0 = clock()
        version = None
        done = False
        cpu = time.thread_time
        while not done:
            start = clock()
            start_cpu = cpu()
            n = 0
            longest = 0.0
            try:
                while True:
                    t = clock()
                    try:
                        next(steps)
                    finally:  # the step that ends the pass is a step too
                        longest = max(longest, clock() - t)
                    n += 1
                    if version is None:  # the first step settles what a check settles
                        version = target.state_version()
                    if pending():
                        stats.gave_way += 1
                        break
                    if clock() - start >= budget:
                        break
            except StopIteration:
                done = True
            except Exception as exc:  # noqa: BLE001 - the complete check is the judge
                found.append(f"the stepped check raised {type(exc).__name__}: {exc}")
                done = True
            held = clock() - start
            stats.steps += n
            stats.slices += 1
            stats.longest_slice_s = max(stats.longest_slice_s, held)
            stats.longest_slice_cpu_s = max(stats.longest_slice_cpu_s, cpu() - start_cpu)
            stats.longest_step_s = max(stats.longest_step_s, longest)
            if not done:
                # requests that arrived meanwhile run now; and the check takes at most `share`
                # of the loop's time, so that the process mostly waits in epoll, where the
                # kernel wakes it promptly for a request, rather than queued behind other work
                await asyncio.sleep(held * rest)
                if target.state_version() != version:
                    steps.close()
                    stats.given_up += 1
                    return None
        if not found:
            stats.done += 1
            self._record("full", [], clock() - t0)
            return []
        log.warning("the stepped check found %d possible violations; confirming with a "
                    "complete check", len(found))
        confirmed = self.run(deep)
        if not confirmed:
            stats.unconfirmed += 1
            log.warning("the complete check did not confirm the stepped check's findings (%s); "
                        "nothing to report", "; ".join(found[:5]))
        else:
            stats.done += 1
        return confirmed

    def _record(self, kind: str, violations: list[str], seconds: float) -> None:
        self.runs[kind] = self.runs.get(kind, 0) + 1
        self.last = CheckerState(not violations, violations, time.time(), kind, seconds)

    def verdict(self, violations: list[str], label: str, *, delay: float = 0.0) -> None:
        """Log a check's verdict; in strict mode a violation stops the daemon (``delay``: after
        a response that reports it is on its way)."""
        if not violations:
            log.info("invariant check %s: ok", label)
            return
        log.error("invariant check %s: %d violations: %s", label, len(violations),
                  "; ".join(violations[:20]))
        self._strict_stop(delay)

    def _strict_stop(self, delay: float = 0.0) -> None:
        if not self.config.strict or self.stop is None:
            return
        log.critical("strict mode: stopping on an invariant violation")
        if delay:
            asyncio.get_running_loop().call_later(delay, self.stop, 3)
        else:
            self.stop(3)

    def on_request(self) -> None:
        """SIGUSR1: a complete full check now, its verdict logged (tests and operators use it)."""
        self.requested += 1
        self.verdict(self.run(), f"#{self.requested} (requested)")

    async def loop(self) -> None:
        """Every interval: the cheap counter check if state-changing operations ran since the
        last one, then a stepped full pass (given up if the state changes while it runs)."""
        seen = self._ops()
        while True:
            await asyncio.sleep(self.config.interval_s)
            ops = self._ops()
            try:
                violations = self.run_counters() if ops != seen else []
                if not violations:
                    violations = await self.run_stepped() or []
            except (OSError, MemoryError):  # the process's limits, not the state: no verdict,
                self.passes.failed += 1  # and the next pass must still run (before, the task
                log.exception("the background invariant check could not run; it runs again "
                              "in %s s", self.config.interval_s)  # ended, silently)
                violations = []
            except Exception as exc:  # the complete check itself breaks on the state: a finding
                log.exception("the background invariant check raised")
                violations = [f"the invariant check raised {type(exc).__name__}: {exc}"]
                self._record("full", violations, 0.0)
            seen = self._ops()
            if violations:
                log.error("invariant violations: %s", "; ".join(violations[:20]))
                self._strict_stop()
                if self.config.strict:
                    return
