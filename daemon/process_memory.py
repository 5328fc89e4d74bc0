"""The daemon's own heap: glibc's figures, and handing memory it freed back to the kernel.

A daemon that runs for weeks must not creep. The soak (issue 15) found the Python heap and the
bytes glibc has in use flat while RSS rose: what grew was memory glibc had been given back by
``free`` but kept (free chunks inside its arenas, which it returns to the kernel only from the top
of the main heap, and only past ``M_TRIM_THRESHOLD``). ``malloc_trim(0)`` returns the free pages of
every arena with ``madvise(MADV_DONTNEED)``; doing it periodically bounds RSS by what is in use
plus what a trim cannot split off. It runs in a worker thread (ctypes releases the GIL for the
call), so the event loop keeps serving; glibc locks one arena at a time while it trims it.

Outside glibc (musl, macOS) both functions report that they are unavailable and nothing runs.
The cyclic garbage collector's settings for a long-lived daemon (:func:`tune_gc`) live here too.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import time
from dataclasses import dataclass

log = logging.getLogger("radixd.memory")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):  # not glibc, or glibc older than 2.33 (no mallinfo2)
        return None
    return libc


_LIBC = _libc()


@dataclass(frozen=True)
class HeapStats:
    """glibc's view of the heap, summed over all arenas (``mallinfo2``)."""

    in_use: int  # bytes handed out by malloc and not freed (uordblks + hblkhd)
    free_held: int  # bytes freed but still held by glibc's arenas (fordblks)
    mmapped: int  # bytes in blocks that have their own mmap (hblkhd), part of in_use


def heap_stats() -> HeapStats | None:
    """The heap now, or None where the C library is not glibc."""
    if _LIBC is None:
        return None
    m = _LIBC.mallinfo2()
    return HeapStats(in_use=m.uordblks + m.hblkhd, free_held=m.fordblks, mmapped=m.hblkhd)


def rss_bytes() -> int | None:
    """Resident set size now (Linux ``/proc/self/statm``), None elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def trim() -> bool:
    """``malloc_trim(0)``: True when glibc returned memory to the kernel."""
    return _LIBC is not None and bool(_LIBC.malloc_trim(0))


class HeapTrimmer:
    """Trims the heap every ``interval_s`` seconds (0: never) and counts what that did, for the
    metrics: how often, how long, and how much RSS the trims gave back (RSS before minus after,
    so allocations made meanwhile make it an underestimate)."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.runs = 0
        self.seconds = 0.0
        self.released_bytes = 0

    @property
    def available(self) -> bool:
        return _LIBC is not None

    async def loop(self) -> None:
        if self.interval_s <= 0 or not self.available:
            return
        while True:
            await asyncio.sleep(self.interval_s)
            await self.run_once()

    async def run_once(self) -> None:
        before = rss_bytes()
        t0 = time.perf_counter()
        await asyncio.to_thread(trim)
        self.seconds += time.perf_counter() - t0
        self.runs += 1
        after = rss_bytes()
        if before is not None and after is not None and before > after:
            self.released_bytes += before - after
            log.debug("malloc_trim gave back %d bytes of RSS", before - after)


def tune_gc() -> None:
    """Keep the cyclic GC off the hot path.

    After start-up the heap holds torch and every module it imported: hundreds of thousands of
    objects that live forever, which every full collection would traverse again. Freeze them out
    of the collector, and collect the young generation less often (each operation allocates a few
    dozen short-lived objects, most freed by reference counting alone).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
