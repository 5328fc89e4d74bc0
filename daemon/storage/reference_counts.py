"""A live, read-only view of a host pool's slot reference counts as a mapping."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from daemon.gpu.allocator import AUDIT_STEP_PAGES

__all__ = ["BLOCK_SLOTS", "ReferenceCounts"]

#: slots scanned at once (one numpy comparison): about what the audits scan in one step
BLOCK_SLOTS = 64 * AUDIT_STEP_PAGES


class ReferenceCounts(Mapping[int, int]):
    """Slot -> reference count of every held slot of a pool, read-only and live over the pool's
    array of counts. Iteration walks the array a block of slots at a time; a stepped audit walks
    :meth:`item_chunks`."""

    __slots__ = ("_counts",)

    def __init__(self, counts: np.ndarray) -> None:
        self._counts = counts

    def __getitem__(self, slot: int) -> int:
        if slot in self:
            return int(self._counts[slot])
        raise KeyError(slot)

    def __contains__(self, slot: object) -> bool:
        return (isinstance(slot, int) and not isinstance(slot, bool)
                and 0 <= slot < len(self._counts) and self._counts[slot] > 0)

    def __len__(self) -> int:
        return int(np.count_nonzero(self._counts > 0))

    def __repr__(self) -> str:
        return f"ReferenceCounts({len(self)} of {len(self._counts)} slots held)"

    def __iter__(self) -> Iterator[int]:
        for slots in self._blocks():
            yield from slots.tolist()

    def items(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        for chunk in self.item_chunks(BLOCK_SLOTS):
            yield from chunk

    def item_chunks(self, size: int) -> Iterator[list[tuple[int, int]]]:
        """(slot, count) of the held slots in order, at most ``size`` a list, and an empty list
        for each block of ``BLOCK_SLOTS`` slots that holds none: a stepped audit that yields
        after each list neither walks many held slots nor scans a sparse pool whole in a step."""
        for slots in self._blocks():
            if not len(slots):
                yield []
            for i in range(0, len(slots), size):
                part = slots[i:i + size]
                yield list(zip(part.tolist(), self._counts[part].tolist(), strict=True))

    def _blocks(self) -> Iterator[np.ndarray]:
        for start in range(0, len(self._counts), BLOCK_SLOTS):
            yield np.flatnonzero(self._counts[start:start + BLOCK_SLOTS] > 0) + start
