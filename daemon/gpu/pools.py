"""Device KV pools: one contiguous allocation per pool, shareable with engine processes.

Each pool (full attention, and sliding-window attention when the model has SWA layers) is a single
tensor shaped ``[layers, 2, pages, page_size, kv_heads, head_dim]``. ``buf[layer, 0]`` (K) and
``buf[layer, 1]`` (V) are then contiguous page-major views ``[pages, page_size, kv_heads,
head_dim]``: exactly what paged-attention kernels index with a page id, with no per-layer
allocation and no re-layout (docs/design.md, the L1 tier).

Engines attach to the very same memory, never a copy. On CPU the allocation lives in a sealed
memfd (:mod:`daemon.gpu.shared_memory`): the daemon's ``attach`` answer passes the fd
(SCM_RIGHTS) with :meth:`Pool.describe`, and the engine calls :func:`map_pool_fd`. On CUDA the
pool is a plain ``torch.empty`` on the device (``fd`` is None): ``attach`` passes a CUDA IPC
handle of it instead (``radixd_client.pools.export_cuda_ipc_handle``).

Page 0 of every pool is the padding page: engines point unused slots at it, it is never handed
out, and it is zeroed at creation so that reading it is harmless.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref
from types import TracebackType
from typing import Any

import torch
from radixd_client.pools import (
    DESCRIPTION_VERSION,
    POOL_LAYOUT,
    PoolError,
    map_pool_fd,
    tensor_over,
)
from radixd_client.segments import SegmentedRegion, segment_bytes

from daemon.gpu.profile import DTYPE_ITEMSIZE, ModelProfile, torch_dtype
from daemon.gpu.shared_memory import (
    available_host_bytes,
    create_memfd,
    create_sealed_memfd,
    renew_segment_memfd,
)

__all__ = ["POOL_LAYOUT", "KVPools", "Pool", "PoolError", "map_pool_fd"]

# POOL_LAYOUT (the axis names of a pool tensor), DESCRIPTION_VERSION (of the Pool.describe dict),
# PoolError and map_pool_fd come from the client library: the engine maps what the daemon
# describes, so both sides share one definition.
_POOL_KINDS = ("full", "swa")


# -- pools ------------------------------------------------------------------------------------


class Pool:
    """One KV pool (full or SWA): a single tensor ``[layers, 2, pages, page_size, heads, dim]``."""

    def __init__(self, profile: ModelProfile, kind: str, device: torch.device,
                 segment_pages: int | None = None) -> None:
        if kind not in _POOL_KINDS:
            raise ValueError(f"kind: expected one of {_POOL_KINDS}, got {kind!r}")
        layers = profile.num_full_layers if kind == "full" else profile.num_swa_layers
        pages = profile.full_pages if kind == "full" else profile.swa_pages
        if layers < 1 or pages < 2:
            raise PoolError(f"{profile.name}: the model has no {kind} pool")
        self.kind = kind
        self.model = profile.name
        self.dtype_name = profile.dtype
        self.dtype = torch_dtype(profile.dtype)
        self.device = device
        self.num_layers = layers
        self.num_pages = pages
        self.page_size = profile.page_size
        self.shape: tuple[int, ...] = (
            layers, 2, pages, profile.page_size, profile.num_kv_heads, profile.head_dim
        )
        self.nbytes = math.prod(self.shape) * DTYPE_ITEMSIZE[profile.dtype]
        self._fingerprint = profile.layout_fingerprint().hex()
        self.fd: int | None = None
        self._mapping: mmap.mmap | None = None
        self._finalizer: weakref.finalize | None = None
        label = f"{profile.name} {kind} pool"
        # segmented (memory isolation): one memfd per segment, assembled into one range
        self.segment_pages = segment_pages
        self.segment_fds: list[int] = []
        self.segment_epochs: list[int] = []
        self._region: SegmentedRegion | None = None
        if segment_pages is not None and device.type != "cpu":
            raise PoolError(f"{label}: memory_isolation = \"segments\" is built for CPU pools "
                            f"only in this version; {device} pools need memory_isolation = "
                            "\"none\" (no memory isolation between tenants)")
        if segment_pages is not None:
            self._region = SegmentedRegion(self.shape, DTYPE_ITEMSIZE[profile.dtype],
                                           segment_pages)
            self._finalizer = weakref.finalize(self, _close_all, self.segment_fds)
            for seg in range(self._region.num_segments):
                self.segment_fds.append(self._segment_memfd(seg))
                self.segment_epochs.append(0)
                self._region.map_segment(seg, self.segment_fds[seg])
            buffer = self._region.tensor(self.dtype)
        elif device.type == "cpu":
            fd, mapping = create_memfd(f"radixd-{profile.name}-{kind}", self.nbytes)
            # An unclosed pool must not leak its fd for the daemon's lifetime.
            self._finalizer = weakref.finalize(self, os.close, fd)
            self.fd, self._mapping = fd, mapping
            buffer = tensor_over(mapping, self.dtype, self.shape)
        elif device.type == "cuda":
            try:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=device)
            except torch.cuda.OutOfMemoryError as exc:
                raise PoolError(
                    f"{label}: cannot allocate {self.nbytes} bytes on {device}"
                ) from exc
        else:
            raise PoolError(f"{label}: unsupported device {device}")
        self._buffer: torch.Tensor | None = buffer
        # Zero the padding page through a byte view: fill_ is not implemented for every dtype
        # (float8) on every device, zeroing bytes always is.
        buffer.view(torch.uint8)[:, :, 0].zero_()

    # -- segments -----------------------------------------------------------------------------

    def _segment_memfd(self, seg: int, back: bool = True) -> int:
        return create_sealed_memfd(
            f"radixd-{self.model}-{self.kind}-seg{seg}",
            segment_bytes(self.shape, DTYPE_ITEMSIZE[self.dtype_name], self.segment_pages or 0,
                          seg), back=back)

    @property
    def num_segments(self) -> int:
        return 0 if self._region is None else self._region.num_segments

    def renew_segment(self, seg: int) -> None:
        """Give segment ``seg`` fresh zeroed memory (a new memfd mapped in place of the old one,
        whose fd is closed): it changes namespace. A process that still maps the old memfd
        keeps seeing only the old bytes, never what the new namespace writes, and the memory
        is zero for the new one. Its epoch grows so that clients remap it."""
        if self._region is None:
            raise PoolError(f"{self.model} {self.kind} pool is not segmented")
        # not backed up front: the zero-fill happens as the new namespace's engines write the
        # pages, not inside the alloc that moved the segment (the old memory is freed as the
        # last mapping of it goes, so the total stays about the same)
        renew_segment_memfd(self._region, seg, self.segment_fds, self.segment_epochs,
                            lambda s: self._segment_memfd(s, back=False))

    # -- views --------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._buffer is None

    @property
    def buffer(self) -> torch.Tensor:
        """The whole pool tensor ``[layers, 2, pages, page_size, kv_heads, head_dim]``."""
        if self._buffer is None:
            raise PoolError(f"{self.model} {self.kind} pool is closed")
        return self._buffer

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise PoolError(
                f"layer: {layer} out of range for the {self.kind} pool ({self.num_layers} layers)"
            )

    def k(self, layer: int) -> torch.Tensor:
        """K of one layer: a contiguous ``[pages, page_size, kv_heads, head_dim]`` view."""
        self._check_layer(layer)
        return self.buffer[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        """V of one layer: a contiguous ``[pages, page_size, kv_heads, head_dim]`` view."""
        self._check_layer(layer)
        return self.buffer[layer, 1]

    def page(self, page_id: int) -> torch.Tensor:
        """One page across all layers: a ``[layers, 2, page_size, kv_heads, head_dim]`` view."""
        if not 0 <= page_id < self.num_pages:
            raise PoolError(
                f"page_id: {page_id} out of range for the {self.kind} pool ({self.num_pages} pages)"
            )
        return self.buffer[:, :, page_id]

    def describe(self) -> dict[str, Any]:
        """JSON-able description with everything a client needs to map this pool's fd.

        Strides are in elements, as torch reports them; ``nbytes`` is the size to map.
        """
        buffer = self.buffer
        return {
            "version": DESCRIPTION_VERSION,
            "model": self.model,
            "kind": self.kind,
            "storage": ("memfd_segments" if self._region is not None
                        else "memfd" if self.fd is not None else self.device.type),
            "device": str(self.device),
            "dtype": self.dtype_name,
            "shape": list(buffer.shape),
            "strides": list(buffer.stride()),
            "nbytes": self.nbytes,
            "num_layers": self.num_layers,
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "layout": list(POOL_LAYOUT),
            "layout_fingerprint": self._fingerprint,
            "segment_pages": self.segment_pages or 0,
            "num_segments": self.num_segments,
        }

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the fd and drop the pool's references to its memory; idempotent.

        The mapping is not ``munmap``-ed by force: a view someone still holds would then point at
        unmapped memory and a read would crash the process. It is unmapped as soon as the last
        tensor that uses it is gone, which is immediately when nobody else holds a view.
        """
        self._buffer = None
        self._mapping = None
        self._region = None
        if self._finalizer is not None:
            self._finalizer()  # closes the fd(s) exactly once
            self._finalizer = None
        self.fd = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.nbytes} bytes on {self.device}"
        return f"<Pool {self.model}/{self.kind} {list(self.shape)} {self.dtype_name} {state}>"


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()


class KVPools:
    """The device KV pools of one model profile: ``full`` always, ``swa`` when the model has SWA.

    A context manager; :meth:`close` releases the fds and the memory.
    """

    def __init__(self, profile: ModelProfile, segment_pages: int | None = None) -> None:
        """``segment_pages``: build each pool from segments of that many pages (memory
        isolation between namespaces); None: one allocation per pool, shared by all."""
        self.profile = profile
        self.device = profile.resolve_device()
        self.segment_pages = segment_pages
        self._check_fits()
        self.full = Pool(profile, "full", self.device, segment_pages)
        self.swa: Pool | None = None
        if profile.has_swa:
            try:
                self.swa = Pool(profile, "swa", self.device, segment_pages)
            except BaseException:
                self.full.close()
                raise

    def _check_fits(self) -> None:
        """Refuse a size that cannot be allocated with an error that says how far off it is."""
        p = self.profile
        need = p.full_pool_bytes + p.swa_pool_bytes
        detail = (
            f"full: {p.full_pages} pages x {p.full_page_bytes} B = {p.full_pool_bytes} B"
            + (f"; swa: {p.swa_pages} pages x {p.swa_page_bytes} B = {p.swa_pool_bytes} B"
               if p.has_swa else "")
        )
        if self.device.type == "cpu":
            available = available_host_bytes()
            where = "host memory"
        else:
            available, _total = torch.cuda.mem_get_info(self.device)
            where = f"free memory on {self.device}"
        if available is not None and need > available:
            raise PoolError(
                f"{p.name}: pools need {need} bytes ({detail}) but only {available} bytes of "
                f"{where} are available; lower full_pages/swa_pages (or full_bytes/swa_bytes)"
            )

    def pools(self) -> tuple[Pool, ...]:
        """The open pools, full first."""
        return (self.full,) if self.swa is None else (self.full, self.swa)

    def pool(self, kind: str) -> Pool:
        """The pool named ``kind`` ('full' or 'swa')."""
        if kind == "full":
            return self.full
        if kind == "swa" and self.swa is not None:
            return self.swa
        raise PoolError(f"pool: {self.profile.name} has no {kind!r} pool")

    def renew_segment(self, kind: str, seg: int) -> None:
        """Fresh zeroed memory for segment ``seg`` of pool ``kind`` (see Pool.renew_segment)."""
        self.pool(kind).renew_segment(seg)

    def page_view(self, kind: str, page_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer ``(K, V)`` views ``[page_size, kv_heads, head_dim]`` of one page."""
        page = self.pool(kind).page(page_id)
        return [(page[layer, 0], page[layer, 1]) for layer in range(page.shape[0])]

    def describe(self) -> dict[str, Any]:
        """JSON-able description of all pools of this model (see :meth:`Pool.describe`)."""
        return {
            "model": self.profile.name,
            "full": self.full.describe(),
            "swa": None if self.swa is None else self.swa.describe(),
        }

    @property
    def closed(self) -> bool:
        return self.full.closed

    def close(self) -> None:
        for pool in self.pools():
            pool.close()

    def __enter__(self) -> KVPools:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
