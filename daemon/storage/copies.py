"""Page copies between a device pool (L1, layer-first) and a host pool (L2, page-first).

A device pool is ``[layers, 2, pages, T]`` and a host pool ``[slots, layers, 2, T]``, where
``T = page_size x kv_heads x head_dim`` elements is one contiguous *row* in both: the K (or V) of
one layer of one page. Both are therefore viewed as 2-D row matrices, and a copy of ``n`` pages is
a gather/scatter of ``n x layers x 2`` rows whose row numbers are computed with tensor arithmetic:

* device row of (page ``p``, layer/kv ``j``) = ``j * pages + p``;
* host row of (slot ``s``, layer/kv ``j``)   = ``s * layers * 2 + j``.

Listing the rows slot-major makes the layer-first -> page-first permute part of the same pass:

* on CPU, for a run of consecutive slots (the allocator hands out low slots first, so a batch is
  usually one run), ``device_to_host`` is one ``index_select`` written straight into the host run
  (``out=``), and ``host_to_device`` one scatter of the host run's rows (a numpy fancy assignment
  on byte views: torch's CPU ``index_copy_`` measured at half of memcpy speed for these rows): one
  pass over the bytes, no staging copy. Non-consecutive slots are handled run by run (a loop
  over runs, not pages). A copy to host of at most 256 KiB (the background copies done on the
  loop) does the same with numpy instead of torch: no OpenMP parallel region to wake or leave
  spinning for so little.
* on CUDA, the device side is gathered (or scattered) with one ``index_select`` / ``index_copy_``
  on the device into a page-first staging tensor, and each slot run is one DMA transfer to or from
  the pinned host pool (``non_blocking``), all on the caller's current stream: :func:`run_copy`
  makes that a dedicated copy stream and awaits its event without blocking the event loop.

:func:`run_copy` runs a copy off the event loop: a dedicated single thread on CPU (torch releases
the GIL while it copies), a dedicated CUDA stream plus an event polled with ``event.query()`` on
CUDA. :func:`plan_device_to_host` splits a copy into its checks and layout (done by the caller,
on the loop) and the moving of bytes (a :class:`CopyPlan`, handed to the copy thread with
:func:`run_plans`), so that the copy thread holds the GIL as little as possible.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import threading
from array import array
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from daemon.gpu.pools import Pool
from daemon.storage.host_pool import HostPool

__all__ = ["CopyError", "CopyInFlight", "CopyPlan", "device_to_host", "host_to_device",
           "plan_device_to_host", "run_copy", "run_plans", "in_thread", "to_the_end"]

T = TypeVar("T")

# Polling of the copy event on CUDA: start short (a small copy is done in microseconds), back off
# to a ceiling so that a long copy costs the loop a wake-up per millisecond at most.
_POLL_FIRST_S = 50e-6
_POLL_MAX_S = 1e-3


class CopyError(ValueError):
    """A copy request that does not fit its pools (layout, kinds, ids, lengths)."""

    code = "bad_copy"


# -- row arithmetic ------------------------------------------------------------------------------


def _check_pair(pool: Pool, host: HostPool) -> None:
    if pool.kind != host.kind:
        raise CopyError(f"pool kinds differ: device {pool.kind!r}, host {host.kind!r}")
    if pool.dtype != host.dtype:
        raise CopyError(f"dtypes differ: device {pool.dtype}, host {host.dtype}")
    device_page = (pool.shape[0], pool.shape[1], *pool.shape[3:])
    if device_page != host.page_shape:
        raise CopyError(
            f"page shapes differ: device {list(device_page)}, host {list(host.page_shape)}"
        )


def _ids(values: Sequence[int] | torch.Tensor, limit: int, what: str) -> np.ndarray:
    """``values`` as a new int64 array, checked to be distinct and within 1..limit-1. In numpy:
    a copy at page 1 checks thousands of ids, and each of the check's few vector calls costs
    several microseconds in torch whatever its size, a few times numpy's (at page 1 the checks
    were a fifth of a request's daemon CPU with write-through copies)."""
    if isinstance(values, torch.Tensor):
        raw: np.ndarray = values.reshape(-1).to(device="cpu", dtype=torch.int64).numpy()
    elif isinstance(values, array) and values.typecode == "i":
        raw = np.frombuffer(values, dtype=np.int32)  # the ids' bytes as they are (no Python int
        # per id); only read here, then copied by astype below
    else:
        raw = np.asarray(values).reshape(-1)
        if not len(raw):
            raw = raw.astype(np.int64)
        elif raw.dtype.kind not in "iu":  # (strings, floats, ints past 64 bits: never ids)
            raise CopyError(f"{what}: ids must be integers, got {raw.dtype} values")
    if len(raw):
        lo, hi = int(raw.min()), int(raw.max())
        if lo < 1 or hi >= limit:
            bad = lo if lo < 1 else hi
            raise CopyError(f"{what}: {bad} is out of range 1..{limit - 1}")
        ranked = np.sort(raw)
        if (ranked[1:] == ranked[:-1]).any():
            raise CopyError(f"{what}: an id is listed twice")
    return raw.astype(np.int64)


def _prepare(
    pool: Pool, page_ids: Any, host: HostPool, slots: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int, int]], torch.Tensor]:
    """Validate; return (device rows, device row matrix, host row matrix, slot runs, slots).

    Device rows are listed in batch order, each page's ``layers x 2`` rows together (that is
    page-first). A slot run ``(i, k, h)`` covers batch positions ``i..k-1``, whose slots are
    consecutive, and starts at host row ``h``. (Laid out in numpy, for the reason of
    :func:`_ids`; the row numbers and slots are handed out as tensors over the same memory.)
    """
    _check_pair(pool, host)
    pages = _ids(page_ids, pool.num_pages, "page_ids")
    slot_ids = _ids(slots, host.capacity, "slots")
    if len(pages) != len(slot_ids):
        raise CopyError(f"{len(pages)} page ids but {len(slot_ids)} slots")
    per_page = pool.num_layers * 2
    row = math.prod(pool.shape[3:])
    device_rows = pool.buffer.view(per_page * pool.num_pages, row)
    host_rows = host.buffer.view(host.capacity * per_page, row)
    j = np.arange(per_page, dtype=np.int64) * pool.num_pages
    rows = (pages[:, None] + j[None, :]).reshape(-1)
    runs: list[tuple[int, int, int]] = []
    n = len(slot_ids)
    if n:
        breaks = (np.flatnonzero(slot_ids[1:] != slot_ids[:-1] + 1) + 1).tolist()
        starts = [0, *breaks]
        # the runs' first slots in one gather: an array indexed once per run cost about a
        # millisecond per copy at page 1, where a copy's slots are hundreds of short runs
        firsts = slot_ids[starts].tolist()
        runs = [
            (i, k, first * per_page)
            for i, k, first in zip(starts, [*breaks, n], firsts, strict=True)
        ]
    return torch.from_numpy(rows), device_rows, host_rows, runs, torch.from_numpy(slot_ids)


# -- copies -----------------------------------------------------------------------------------


class CopyPlan:
    """A copy validated and laid out (row numbers, slot runs, tensor views) on the thread that
    made it; calling it only moves the bytes.

    A background copy is planned on the event loop and run on the copy thread: the plan is
    Python and a dozen small torch calls (the GIL held throughout), the run a few calls that
    release the GIL while they copy. Planned in the copy thread instead, every one of those
    calls would take the GIL back from the loop mid-request."""

    __slots__ = ("_run", "device")

    def __init__(self, device: torch.device, run: Callable[[], None]) -> None:
        self.device = device  # where the copy runs (CopyInFlight picks a thread or a stream)
        self._run = run

    def __call__(self) -> None:
        self._run()


def _noop() -> None:
    pass


def _rows_on(device: torch.device, rows: torch.Tensor) -> torch.Tensor:
    """The row numbers on ``device`` without making the host wait: a pageable tensor's upload
    synchronizes the host with the copy stream, so the event loop would sit behind every copy
    already queued there (a load would wait for the write-through copies ahead of it). Pinned
    memory uploads asynchronously; torch's pinned allocator keeps the block until the upload
    is done and reuses it after (only its first allocation of a size may synchronize)."""
    return rows.pin_memory().to(device, non_blocking=True)


#: slot runs above which a CPU copy gathers and scatters all rows at once
_FEW_RUNS = 16
#: a CPU copy to host of at most this many bytes is done by numpy on the calling thread:
#: torch's index_select would open a parallel region, whose OpenMP workers cost more to wake
#: (or, left spinning, burn a core each for milliseconds) than a copy this small saves (the
#: tiers copy jobs this small on the event loop: daemon.tiers.INLINE_COPY_BYTES)
SERIAL_COPY_BYTES = 256 << 10


def plan_device_to_host(pool: Pool, page_ids: Any, host: HostPool, slots: Any) -> CopyPlan:
    """Validate a copy of device pages ``page_ids`` into host ``slots`` (same length,
    positionally) and lay it out; raises CopyError now, never when the plan runs."""
    rows, device_rows, host_rows, runs, slot_ids = _prepare(pool, page_ids, host, slots)
    if not runs:
        return CopyPlan(pool.device, _noop)
    per_page = pool.num_layers * 2
    if pool.device.type == "cuda":

        def run_cuda() -> None:
            staged = device_rows.index_select(0, _rows_on(pool.device, rows))
            for i, j, h in runs:
                host_rows[h : h + (j - i) * per_page].copy_(
                    staged[i * per_page : j * per_page], non_blocking=True
                )

        return CopyPlan(pool.device, run_cuda)
    serial = rows.numel() * device_rows.shape[1] * device_rows.element_size() <= SERIAL_COPY_BYTES
    if len(runs) > _FEW_RUNS:  # scattered slots (a pool that has seen churn): one gather and
        # one scatter, not a call per run of a page or two
        dst = host_rows.view(torch.uint8).numpy()
        slot_rows = (slot_ids[:, None] * per_page
                     + torch.arange(per_page, dtype=torch.int64)).reshape(-1).numpy()
        if serial:
            src, src_rows = device_rows.view(torch.uint8).numpy(), rows.numpy()

            def run_serial_scattered() -> None:
                dst[slot_rows] = src[src_rows]

            return CopyPlan(pool.device, run_serial_scattered)

        def run_scattered() -> None:
            dst[slot_rows] = device_rows.index_select(0, rows).view(torch.uint8).numpy()

        return CopyPlan(pool.device, run_scattered)
    spans = [(i * per_page, j * per_page, h) for i, j, h in runs]
    if serial:  # each run gathered straight into its host rows by numpy
        src = device_rows.view(torch.uint8).numpy()
        src_rows, dst = rows.numpy(), host_rows.view(torch.uint8).numpy()
        parts = [(src_rows[a:b], dst[h : h + b - a]) for a, b, h in spans]

        def run_serial() -> None:
            for r, out in parts:
                np.take(src, r, axis=0, out=out)

        return CopyPlan(pool.device, run_serial)
    torch_parts = [(rows[a:b], host_rows[h : h + b - a]) for a, b, h in spans]

    def run_cpu() -> None:
        for src_rows, out in torch_parts:
            torch.index_select(device_rows, 0, src_rows, out=out)

    return CopyPlan(pool.device, run_cpu)


def run_plans(*plans: CopyPlan) -> None:
    """Run ``plans`` in order (the function to hand :class:`CopyInFlight` with the plans)."""
    for plan in plans:
        plan()


def device_to_host(pool: Pool, page_ids: Any, host: HostPool, slots: Any) -> None:
    """Copy device pages ``page_ids`` into host ``slots`` (same length, positionally).

    On CUDA the copy is only *enqueued* on the current stream; see :func:`run_copy`.
    """
    plan_device_to_host(pool, page_ids, host, slots)()


def host_to_device(host: HostPool, slots: Any, pool: Pool, page_ids: Any) -> None:
    """Copy host ``slots`` into device pages ``page_ids`` (same length, positionally).

    On CUDA the copy is only *enqueued* on the current stream; see :func:`run_copy`.
    """
    rows, device_rows, host_rows, runs, _ = _prepare(pool, page_ids, host, slots)
    if not runs:
        return
    per_page = pool.num_layers * 2
    if pool.device.type == "cuda":
        staged = torch.empty(
            (rows.numel(), device_rows.shape[1]), dtype=device_rows.dtype, device=pool.device
        )
        for i, j, h in runs:
            staged[i * per_page : j * per_page].copy_(
                host_rows[h : h + (j - i) * per_page], non_blocking=True
            )
        device_rows.index_copy_(0, _rows_on(pool.device, rows), staged)
        return
    # torch's CPU index_copy_ runs at about half of memcpy speed for rows this size; numpy's
    # fancy assignment copies each row with one memcpy (and releases the GIL while it does).
    # Big batches are split over torch's intra-op thread count, as torch's own copies are.
    device_np = device_rows.view(torch.uint8).numpy()
    host_np = host_rows.view(torch.uint8).numpy()
    rows_np = rows.numpy()
    parts: list[tuple[Any, Any]] = []
    for i, j, h in runs:
        src = host_np[h : h + (j - i) * per_page]
        dst_rows = rows_np[i * per_page : j * per_page]
        step = max(1, -(-_SPLIT_BYTES // max(1, src.shape[1])))
        parts.extend((dst_rows[a : a + step], src[a : a + step])
                     for a in range(0, len(dst_rows), step))
    threads = min(torch.get_num_threads(), len(parts))
    if threads <= 1:
        for dst_rows, src in parts:
            device_np[dst_rows] = src
        return

    def scatter(part: tuple[Any, Any]) -> None:
        device_np[part[0]] = part[1]

    list(_scatter_executor(threads).map(scatter, parts))


# -- off the event loop -------------------------------------------------------------------------

_executor: ThreadPoolExecutor | None = None
_scatter: ThreadPoolExecutor | None = None
_scatter_workers = 0  # _scatter's max_workers (ThreadPoolExecutor keeps it private)
_SPLIT_BYTES = 16 << 20  # a scatter part of at least this many bytes goes to a helper thread


def _scatter_executor(threads: int) -> ThreadPoolExecutor:
    global _scatter, _scatter_workers
    with _executor_lock:
        if _scatter is None or _scatter_workers < threads:
            _scatter = ThreadPoolExecutor(max_workers=threads,
                                          thread_name_prefix="radixd-scatter")
            _scatter_workers = threads
        return _scatter

_executor_lock = threading.Lock()
_streams: dict[int, Any] = {}


def _cpu_executor() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixd-copy")
        return _executor


def _copy_device(args: Sequence[Any]) -> torch.device:
    """The device of the first pool (device or host) among the copy's arguments that is on CUDA,
    else cpu."""
    for arg in args:
        device = getattr(arg, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            return device
    return torch.device("cpu")


def _copy_stream(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


class CopyInFlight:
    """A copy started off the event loop: ``await`` it, or :meth:`wait` for it synchronously
    (from the loop, when something cannot proceed until the copy is done)."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        device = _copy_device(args)
        self._event: Any = None
        self._future: Any = None
        self._result: Any = None
        if device.type == "cuda":
            stream = _copy_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                try:
                    self._result = fn(*args)
                except BaseException:
                    # what it queued before raising may still be writing: the caller frees
                    # those pages and slots when this raises, so the stream finishes first
                    stream.synchronize()
                    raise
                self._event = torch.cuda.Event()
                self._event.record(stream)
        else:
            self._future = _cpu_executor().submit(functools.partial(fn, *args))

    def wait(self) -> Any:
        """Block until the copy is done; returns what the copy returned, raises what it
        raised."""
        if self._event is not None:
            self._event.synchronize()
            return self._result
        return self._future.result()

    def finished(self) -> bool:
        """Whether the copy is done, without waiting for it."""
        if self._event is not None:
            return bool(self._event.query())
        return bool(self._future.done())

    def __await__(self) -> Any:
        return self.done().__await__()

    async def done(self) -> Any:
        """The copy's result once it is done, without blocking the loop (a coroutine, so that
        a caller can shield it: a cancelled wait must not abandon a copy still writing)."""
        if self._event is not None:
            delay = _POLL_FIRST_S
            while not self._event.query():
                await asyncio.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
            return self._result
        return await asyncio.wrap_future(self._future)


async def to_the_end(aw: Awaitable[T]) -> T:
    """Await ``aw`` so that a cancellation cannot abandon it: a copy, encode or write still
    running on a thread or a stream may be reading or writing host slots and device pages that
    the caller frees as soon as its await ends (a shutdown cancels every tier task). A
    cancellation therefore waits for ``aw`` to finish, then propagates."""
    fut = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait((fut,))
        if not fut.cancelled():
            fut.exception()  # retrieved: the cancellation is what the caller is told
        raise


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on the loop's default thread pool, :func:`to_the_end` (``fn`` reads or
    writes slots the caller holds until this returns)."""
    return await to_the_end(asyncio.get_running_loop().run_in_executor(None, fn, *args))


async def run_copy(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` (a copy of this module) without blocking the event loop.

    CPU: on a dedicated single thread, so copies run one at a time and in submission order.
    CUDA: enqueued on a dedicated copy stream (after the work already on the current stream),
    then an event recorded behind it is polled with ``event.query()`` until the copy is done.
    """
    return await to_the_end(CopyInFlight(fn, *args).done())  # type: ignore[no-any-return]
