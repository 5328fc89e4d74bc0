"""What this daemon has written to Redis per namespace, for ``quota_l3_bytes``.

Redis does not say who wrote a key or when, so the quota counts what this daemon wrote: one
entry per value (a page's full and SWA values are separate keys, counted and aged apart), in
write order. A value written again is the newest again at its new size. Over the quota the
oldest values go first, whoever wrote them (the tree's tiers or the keyed store). The ledger
survives a warm restart (daemon.warm_restart), so pages written before it keep counting.
Pure bookkeeping: the caller deletes what :meth:`L3Ledger.charge` returns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["L3Ledger"]


class L3Ledger:
    def __init__(self) -> None:
        self._values: dict[str, OrderedDict[tuple[bytes, str], int]] = {}
        self._totals: dict[str, int] = {}  # running sums: a ledger may hold a million values

    def charge(self, ns: str, page_id: bytes, pool: str, nbytes: int, quota: int
               ) -> list[tuple[bytes, str, int]]:
        """Count a value just written; returns the ``(page id, pool, bytes)`` of the values to
        delete so that the namespace stays within ``quota`` bytes (0: unbounded, nothing
        counted)."""
        if not quota:
            return []
        values, key = self._values.setdefault(ns, OrderedDict()), (page_id, pool)
        total = self._totals.get(ns, 0) - values.pop(key, 0) + nbytes
        values[key] = nbytes
        gone: list[tuple[bytes, str, int]] = []
        while total > quota and values:
            (old, old_pool), size = values.popitem(last=False)
            total -= size
            gone.append((old, old_pool, size))
        self._totals[ns] = total
        return gone

    def forget(self, ns: str, keys: Iterable[tuple[bytes, str]]) -> None:
        """Values deleted from Redis by their owner (a namespace's keyed pages cleared): they no
        longer count, and are not deleted again for the quota."""
        values = self._values.get(ns)
        if not values:
            return
        total = self._totals.get(ns, 0)
        for key in keys:
            total -= values.pop(key, 0)
        self._totals[ns] = total

    def total(self, ns: str) -> int:
        return self._totals.get(ns, 0)

    def entries(self) -> dict[str, list[tuple[bytes, str, int]]]:
        """Every namespace's values, oldest first (what a warm restart carries over)."""
        return {ns: [(h, pool, n) for (h, pool), n in values.items()]
                for ns, values in self._values.items() if values}

    def give_back(self, ns: str, entries: list[tuple[bytes, str, int]]) -> None:
        """Values :meth:`charge` gave to delete that Redis did not delete: counted again, as
        the oldest, to go first next time; one written again meanwhile stays where that put it.
        In place: a ledger may hold a million values."""
        values = self._values.setdefault(ns, OrderedDict())
        total = self._totals.get(ns, 0)
        for page_id, pool, nbytes in reversed(entries):
            key = (page_id, pool)
            if key not in values:
                values[key] = nbytes
                values.move_to_end(key, last=False)
                total += nbytes
        self._totals[ns] = total

    def adopt(self, ns: str, entries: Iterable[tuple[bytes, str, int]]) -> None:
        """Entries of a previous run, older than anything this run wrote (:meth:`give_back`)."""
        self.give_back(ns, list(entries))
