"""Operation counters and latency histograms, recorded on the hot path.

Recording must cost next to nothing per operation (it runs on every request): fixed buckets, a
bisect and two integer additions. Rendering to the Prometheus text format happens elsewhere, on
scrape (daemon/exposition.py).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

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
