"""The page copies of one get or set, on a bounded number of threads.

One thread's memcpy is bounded by what one core can move, well below the memory bandwidth of a
server: a large get (a long prefix is hundreds of 9 MiB pages) copies faster on a few threads.
torch's ``copy_`` releases the GIL, so plain Python threads copy in parallel. A batch is cut into
contiguous runs of pages, one a thread, the calling thread taking the first; small batches stay on
the calling thread (handing work to a thread costs more than it saves).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import TypeVar

import torch

DEFAULT_MAX_THREADS = 4  # past a few threads one process's copies saturate a socket's bandwidth
CPUS_PER_DEFAULT_THREAD = 4  # SGLang's scheduler, tokenizer and detokenizer need the rest
DEFAULT_MIN_BYTES_PER_THREAD = 32 << 20

T = TypeVar("T")
PageCopy = Callable[[int, torch.Tensor], None]


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_copy_threads() -> int:
    """One copy thread per 4 CPUs this process may run on, between 1 and 4: a server's copies
    get a few threads, and a small or shared machine (where a second copy thread only fights
    SGLang's own processes for a core) copies on SGLang's calling thread."""
    return max(1, min(DEFAULT_MAX_THREADS, usable_cpus() // CPUS_PER_DEFAULT_THREAD))


class PageCopier:
    """Runs ``copy(page, slot)`` for each (page, slot) of a batch on up to ``threads`` threads,
    each with at least ``min_bytes_per_thread`` of it; returns once every copy has ended."""

    def __init__(self, threads: int, min_bytes_per_thread: int,
                 executor: Executor | None = None) -> None:
        """``executor``: the threads to copy on besides the caller's (at least ``threads`` - 1
        workers; an engine may share its own); by default the copier starts its own when a batch
        first needs one, and :meth:`close` shuts only that one down."""
        if threads < 1:
            raise ValueError(f"radixd: extra_config copy_threads must be >= 1, not {threads}")
        if min_bytes_per_thread < 0:
            raise ValueError(f"radixd: extra_config copy_min_bytes_per_thread must be >= 0, "
                             f"not {min_bytes_per_thread}")
        self.threads = threads
        self.min_bytes_per_thread = min_bytes_per_thread
        self._pool: Executor | None = executor
        self._owns_pool = executor is None

    def ways(self, pages: int, page_nbytes: int) -> int:
        """How many threads a batch of ``pages`` pages is copied on."""
        by_bytes = pages * page_nbytes // max(1, self.min_bytes_per_thread)
        return max(1, min(self.threads, pages, by_bytes))

    def run(self, copy: PageCopy, pairs: Sequence[tuple[int, torch.Tensor]],
            page_nbytes: int) -> None:
        """Copy every pair. An exception in any run is raised here, but only after every run
        has ended, so no copy is still touching the slots when the caller releases their pin."""
        ways = self.ways(len(pairs), page_nbytes)
        if ways == 1:
            _copy_run(copy, pairs)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads - 1,
                                            thread_name_prefix="radixd-copy")
        runs = split(pairs, ways)
        futures: list[Future[None]] = []
        try:
            for r in runs[1:]:  # a submit that fails must still wait for the runs started
                futures.append(self._pool.submit(_copy_run, copy, r))
            _copy_run(copy, runs[0])
        finally:
            wait(futures)
        for f in futures:
            f.result()

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None and self._owns_pool:
            pool.shutdown(wait=True)


def split(pairs: Sequence[T], ways: int) -> list[Sequence[T]]:
    """``pairs`` cut into ``ways`` contiguous runs whose lengths differ by at most one."""
    step, extra = divmod(len(pairs), ways)
    runs, start = [], 0
    for i in range(ways):
        end = start + step + (1 if i < extra else 0)
        runs.append(pairs[start:end])
        start = end
    return runs


def _copy_run(copy: PageCopy, pairs: Sequence[tuple[int, torch.Tensor]]) -> None:
    for page, slot in pairs:
        copy(page, slot)
