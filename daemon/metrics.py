"""Operation counters and latency histograms, recorded on the hot path.

Recording must cost next to nothing per operation (it runs on every request): fixed buckets, a
bisect and two integer additions. Rendering to the Prometheus text format happens elsewhere, on
scrape (daemon/exposition.py).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field

from .log_throttle import LogThrottle

log = logging.getLogger("radixd.gc")

# seconds; fine at the bottom, where the daemon's operations live (microseconds)
LATENCY_BUCKETS: tuple[float, ...] = (
    5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0,
)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count) per bucket, +Inf last, as Prometheus wants them."""
        out = []
        acc = 0
        for bound, c in zip((*self.buckets, float("inf")), self.counts, strict=True):
            acc += c
            out.append((bound, acc))
        return out


class OpStats:
    """Per operation: a latency histogram and a count per result code ("ok" or an error code).

    Only refusals are counted apart (``errors``): the ok count of an operation is its
    observations less its refusals, worked out when ``results`` is read (at scrape time), so an
    answered operation costs one dict lookup and the histogram's update."""

    def __init__(self) -> None:
        self.latency: dict[str, Histogram] = {}
        self.errors: dict[tuple[str, str], int] = {}

    def observe(self, op: str, seconds: float, code: str = "ok") -> None:
        h = self.latency.get(op)
        if h is None:
            h = self.latency[op] = Histogram()
        h.counts[bisect_left(h.buckets, seconds)] += 1
        h.total += seconds
        h.n += 1
        if code != "ok":
            key = (op, code)
            self.errors[key] = self.errors.get(key, 0) + 1

    @property
    def results(self) -> dict[tuple[str, str], int]:
        """(operation, code) -> count, "ok" included (for the metrics)."""
        out = dict(self.errors)
        for op, h in self.latency.items():
            refused = sum(n for (o, _), n in self.errors.items() if o == op)
            if h.n > refused:
                out[(op, "ok")] = h.n - refused
        return out


#: a collection at least this long is logged (a warning, one line a minute at most)
GC_WARN_S = 0.05
GENERATIONS = (0, 1, 2)


class GcPauses:
    """How long Python's cyclic collector stopped the daemon, by generation.

    A collection holds the GIL, and with it the event loop and every request, for its whole
    length; a full one traverses every container object the tree keeps (three per node) and
    the young ones whatever survived since theirs, so on a large tree under churn they are the
    longest stalls a request can meet (tens to hundreds of milliseconds: docs/operations.md,
    "Garbage collector pauses"). Installed as a ``gc.callbacks`` entry while the server runs;
    recording is two clock reads and a histogram update per collection."""

    def __init__(self, warn_s: float = GC_WARN_S) -> None:
        self.pauses = {g: Histogram() for g in GENERATIONS}
        self.longest = dict.fromkeys(GENERATIONS, 0.0)
        self.warn_s = warn_s
        self._log = LogThrottle(60.0)
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        s = time.perf_counter() - self._started
        g = min(info.get("generation", 2), 2)
        self.pauses[g].observe(s)
        if s > self.longest[g]:
            self.longest[g] = s
        if s >= self.warn_s and self._log.due():
            held = self._log.take_held_back()
            log.warning("the garbage collector (generation %d) stopped the daemon for %.0f ms%s",
                        g, s * 1e3, f"; {held} more collections of {self.warn_s * 1e3:.0f} ms "
                        "or longer since the last such line" if held else "")

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    @contextlib.contextmanager
    def installed(self) -> Iterator[GcPauses]:
        """Installed for the block (the server's life)."""
        self.install()
        try:
            yield self
        finally:
            self.remove()

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self)
        if held := self._log.take_held_back():
            log.warning("%d collections of the garbage collector of %.0f ms or longer not "
                        "logged before the stop", held, self.warn_s * 1e3)
