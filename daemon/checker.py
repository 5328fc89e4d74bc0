"""The invariant checker: full checks when idle, the O(1) counter check while busy, on request.

A violation means the daemon's bookkeeping is wrong and pages may be handed out twice; the
checker makes that visible (the log, ``/v1/stats``, metrics) and in strict mode stops the daemon
before it does damage. It is shared by the server (its timer, SIGUSR1) and the admin endpoint
(``POST /v1/check``), which is why it lives in neither.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from .config import CheckerConfig

log = logging.getLogger("radixd.checker")

#: invariant check kinds: "full" walks everything, "counters" is the O(1) check while busy
CHECK_KINDS = ("full", "counters")


class Checkable(Protocol):
    def check(self, *, deep: bool = True) -> list[str]: ...

    def quick_check(self) -> list[str]: ...


class CheckerState(msgspec.Struct):
    """The verdict of the last check (``ok`` is None until one has run)."""

    ok: bool | None = None
    violations: list[str] = msgspec.field(default_factory=list)
    at: float | None = None
    kind: str | None = None
    seconds: float = 0.0


class Checker:
    def __init__(self, target: Checkable, config: CheckerConfig):
        self.target = target
        self.config = config
        self._ops: Callable[[], int] = lambda: 0
        self.stop: Callable[[int], None] | None = None
        self.last = CheckerState()
        self.runs: dict[str, int] = dict.fromkeys(CHECK_KINDS, 0)
        self.requested = 0

    def bind(self, ops: Callable[[], int], stop: Callable[[int], None]) -> None:
        """The server that runs the checker: its operation count (a busy daemon, whose count
        moved, gets the cheap check) and how strict mode stops it (exit code 3)."""
        self._ops = ops
        self.stop = stop

    def run(self, deep: bool | None = None) -> list[str]:
        """A full check now; its verdict becomes the last one."""
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
        """SIGUSR1: a full check now, its verdict logged (tests and operators use it)."""
        self.requested += 1
        self.verdict(self.run(), f"#{self.requested} (requested)")

    async def loop(self) -> None:
        """Full check when idle since the last one, cheap counter check while busy."""
        seen = -1
        while True:
            await asyncio.sleep(self.config.interval_s)
            ops = self._ops()
            violations = self.run() if ops == seen else self.run_counters()
            seen = ops
            if violations:
                log.error("invariant violations: %s", "; ".join(violations[:20]))
                self._strict_stop()
                if self.config.strict:
                    return
