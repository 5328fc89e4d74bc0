"""The backend's multi-threaded page copies (``copy_threads``): byte-exact over SGLang's own host
pool and a real radixd, really on several threads, and a copy failing on a worker thread is a
miss, never an exception in SGLang's controller, with the pin released (the checker at teardown)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import extra
from hypothesis import given, settings
from hypothesis import strategies as st
from radixd_sglang.copier import PageCopier, split
from radixd_sglang.testing import storage_config
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from test_backend import backend, fill, pages_of


def test_get_and_set_on_three_threads_are_byte_exact(make_daemon) -> None:
    d = make_daemon()
    b, pool = backend(d, pages=32, copy_threads=3, copy_min_bytes_per_thread=1)
    view = b._views["full"]  # noqa: SLF001 - observing which threads ran the real copies
    threads: dict[str, set[str]] = {"store": set(), "load": set()}
    for name in threads:
        real = getattr(view, name)

        def observed(page: int, slot: torch.Tensor, real=real, seen=threads[name]) -> None:
            seen.add(threading.current_thread().name)
            real(page, slot)

        setattr(view, name, observed)
    idx, keys = fill(pool, 10, 3)
    assert b.batch_set_v1(keys[:7], idx[:7 * pool.page_size]) == [True] * 7
    dst = pool.alloc(10 * pool.page_size)
    assert b.batch_get_v1(keys, dst) == [True] * 7 + [False] * 3
    for got, want in zip(pages_of(pool, dst)[:7], pages_of(pool, idx)[:7], strict=True):
        assert torch.equal(got, want)
    for seen in threads.values():  # the calling thread and the backend's copy thread(s)
        assert threading.current_thread().name in seen
        assert 2 <= len(seen) <= 3 and all(n.startswith("radixd-copy") for n in seen
                                           - {threading.current_thread().name})
    b.close()


def test_a_copy_failing_on_a_worker_thread_is_a_miss_then_a_hit(make_daemon) -> None:
    d = make_daemon()
    b, pool = backend(d, pages=32, copy_threads=2, copy_min_bytes_per_thread=1,
                      backoff_max_s=0.05)
    idx, keys = fill(pool, 6, 4)
    assert all(b.batch_set_v1(keys, idx))
    view = b._views["full"]  # noqa: SLF001 - a copy that fails on a worker thread
    real_load, copied = view.load, []

    def load_or_fail(page: int, slot: torch.Tensor) -> None:
        if threading.current_thread().name.startswith("radixd-copy") and not copied:
            copied.append(page)
            raise MemoryError("injected: a copy failed on a worker thread")
        real_load(page, slot)

    view.load = load_or_fail
    dst = pool.alloc(6 * pool.page_size)
    assert b.batch_get_v1(keys, dst) == [False] * 6
    assert copied  # the failure did happen on a worker thread
    dst2 = pool.alloc(6 * pool.page_size)
    assert b.batch_get_v1(keys, dst2) == [True] * 6  # reconnected; the pin had been released
    assert all(torch.equal(x, y) for x, y in zip(pages_of(pool, dst2), pages_of(pool, idx),
                                                 strict=True))
    b.close()


def test_bad_copy_threads_is_refused_at_construction(make_daemon) -> None:
    d = make_daemon()
    with pytest.raises(ValueError, match="copy_threads must be >= 1"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(extra(d, copy_threads=0)), None)
    with pytest.raises(ValueError, match="copy_min_bytes_per_thread must be an integer"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(extra(d, copy_min_bytes_per_thread="8M")), None)


@settings(max_examples=60, deadline=None)
@given(threads=st.integers(1, 5), pages=st.integers(0, 40), page_nbytes=st.integers(1, 64),
       min_bytes=st.integers(0, 300))
def test_every_page_is_copied_once_on_as_many_threads_as_ways(
        threads: int, pages: int, page_nbytes: int, min_bytes: int) -> None:
    """Against the plain model: ``ways`` = min(threads, pages, bytes // min_bytes), at least one;
    the batch cut into that many contiguous runs of nearly equal length; each (page, slot) copied
    exactly once, in order within a thread; the calling thread plus at least one copy thread
    whenever ways > 1, and never more threads than ways."""
    copier = PageCopier(threads, min_bytes)
    slots = [torch.zeros(1) for _ in range(pages)]
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def copy(page: int, slot: torch.Tensor) -> None:
        slot += 1
        with lock:
            seen.append((threading.current_thread().name, page))

    pairs = list(zip(range(pages), slots, strict=True))
    want = max(1, min(threads, pages, pages * page_nbytes // max(1, min_bytes)))
    assert copier.ways(pages, page_nbytes) == want
    runs = split(pairs, want)
    assert len(runs) == want and [p for r in runs for p in r] == pairs
    assert max(map(len, runs)) - min(map(len, runs)) <= 1
    copier.run(copy, pairs, page_nbytes)
    copier.close()
    assert sorted(p for _, p in seen) == list(range(pages))
    assert all(float(s) == 1 for s in slots)
    by_thread: dict[str, list[int]] = {}
    for name, p in seen:
        by_thread.setdefault(name, []).append(p)
    assert all(v == sorted(v) for v in by_thread.values())
    assert len(by_thread) <= want
    if pages:
        assert threading.current_thread().name in by_thread
        assert (len(by_thread) >= 2) == (want >= 2)


class _SecondSubmitFails(ThreadPoolExecutor):
    """A thread that cannot be started ("can't start new thread"): a fault no real part
    produces on demand."""

    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.submits = 0

    def submit(self, *args, **kwargs):  # type: ignore[override]
        self.submits += 1
        if self.submits == 2:
            raise RuntimeError("can't start new thread")
        return super().submit(*args, **kwargs)


def test_a_copy_run_that_cannot_start_waits_for_the_runs_already_copying() -> None:
    """Until run() returns, the pages' pin is held; a run still copying after it would write
    into slots radixd may already have given to someone else."""
    pool = _SecondSubmitFails()
    copier = PageCopier(3, 1, executor=pool)
    started, finished = threading.Event(), []

    def copy(page: int, slot: torch.Tensor) -> None:
        if threading.current_thread() is not threading.main_thread():
            started.set()
            time.sleep(0.2)
            finished.append(page)

    with pytest.raises(RuntimeError, match="can't start new thread"):
        copier.run(copy, [(i, torch.zeros(1)) for i in range(3)], 1)
    assert started.is_set() and finished == [1]  # the worker's run ended before run() returned
    copier.close()
    pool.shutdown()
