"""A warning that a flood of events would repeat, let through at most once per interval.

Failed hellos, connections past the open-files threshold and refused admin connections can each
come thousands of times a second, from a client the daemon does not control; one line per
interval, with the count of those held back, tells the operator as much without flooding the
journal.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class LogThrottle:
    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.held_back = 0  # events since the last line that went out
        self._at = -math.inf  # when it went out (the first event always goes out)

    def due(self) -> bool:
        """Whether this event's line goes out now; if not, it is counted in ``held_back``."""
        now = self.clock()
        if now - self._at < self.interval_s:
            self.held_back += 1
            return False
        self._at = now
        return True

    def take_held_back(self) -> int:
        """The events held back since the last line, counted afresh from now on."""
        n, self.held_back = self.held_back, 0
        return n
