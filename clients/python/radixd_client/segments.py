"""A pool assembled from segment memfds: one address range, each segment's pages mapped in place.

A segmented pool (``PoolInfo.kind == "memfd_segments"``, docs/protocol.md 4.3) keeps the layout
of a whole pool, one tensor ``[layers, 2, pages, page_size, kv_heads, head_dim]``, but its memory
is one memfd per segment: segment ``s`` holds pages ``[s*S, min((s+1)*S, pages))`` of every
``(layer, kv)`` strip, strip after strip (its own ``[layers, 2, n, page_size, kv_heads,
head_dim]``). :class:`SegmentedRegion` reserves the whole range and maps each segment's strips
at their places (``MAP_FIXED``), so paged-attention kernels index the result with plain page ids.

Where no segment of this process is mapped, the range is private anonymous memory: reading a page
of a segment you were not given reads zeros (or what you wrote there yourself), writing it changes
only your own copy. The daemon maps every segment; an engine maps only those of its namespaces.

Used by the daemon (``daemon.gpu.pools``) and by :mod:`radixd_client.pools`, so both sides share
one definition of where a segment's bytes go. Linux only (memfds, ``MAP_FIXED``).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import weakref
from typing import TYPE_CHECKING

from .errors import PoolError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = ["SegmentedRegion", "check_segment_alignment", "map_fixed_shared", "segment_bytes"]

_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _mmap(addr: int | None, length: int, flags: int, fd: int, offset: int) -> int:
    got = _libc.mmap(addr, length, _PROT_RW, flags, fd, offset)
    if got in (None, _FAILED):
        err = ctypes.get_errno()
        raise PoolError(f"mmap of {length} bytes failed: {os.strerror(err)}")
    return int(got)


def _anonymous(addr: int | None, length: int) -> int:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    return _mmap(addr, length, flags | (_MAP_FIXED if addr is not None else 0), -1, 0)


def shared_span(fd: int, length: int) -> ctypes.Array:
    """``length`` bytes of ``fd`` mapped shared, as a buffer whose mapping goes when the last
    view of it does. It keeps no descriptor: ``mmap.mmap`` keeps a copy of the fd before
    Python 3.13, which kept a restarted daemon's old pool memory alive after its rebind."""
    address = _mmap(None, length, mmap.MAP_SHARED, fd, 0)
    span = type("_Span", (ctypes.c_uint8 * length,), {}).from_address(address)
    weakref.finalize(span, _libc.munmap, address, length)
    return span


def map_fixed_shared(address: int, length: int, fd: int) -> None:
    """Map ``length`` bytes of ``fd`` shared at ``address``, over what was mapped there: a pool
    tensor keeps its address while the memory under it changes (a restarted daemon's pool)."""
    _mmap(address, length, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)


def check_segment_alignment(strip_page_bytes: int, segment_pages: int, pages: int,
                            what: str) -> None:
    """Raise unless a segment's strips, and the pool's, start and end on OS page boundaries
    (``mmap`` maps whole OS pages: a strip ending mid-page would share it with a neighbour)."""
    ps = mmap.PAGESIZE
    for n, label in ((segment_pages, "segment_pages"), (pages, "the pool's page count")):
        if (n * strip_page_bytes) % ps:
            unit = ps // math.gcd(ps, strip_page_bytes)
            raise PoolError(
                f"{what}: {label} {n} x {strip_page_bytes} bytes per page and layer is not a "
                f"multiple of the {ps}-byte OS page, so segments cannot be mapped apart; use a "
                f"multiple of {unit} pages (or memory_isolation = \"none\")")


def segment_bytes(shape: tuple[int, ...], itemsize: int, segment_pages: int, segment: int
                  ) -> int:
    """Size of segment ``segment``'s memfd for a pool of ``shape``."""
    layers, kv, pages = shape[:3]
    n = min(pages, (segment + 1) * segment_pages) - segment * segment_pages
    return layers * kv * n * math.prod(shape[3:]) * itemsize


class SegmentedRegion:
    """The address range of one pool, with segment memfds mapped into it (see the module)."""

    def __init__(self, shape: tuple[int, ...], itemsize: int, segment_pages: int) -> None:
        self.shape = tuple(shape)
        self.itemsize = itemsize
        self.segment_pages = segment_pages
        self.strips = shape[0] * shape[1]
        self.pages = shape[2]
        self.page_bytes = math.prod(shape[3:]) * itemsize  # one page of one (layer, kv) strip
        self.num_segments = -(-self.pages // segment_pages)
        # one strip (a page-first host pool): only segment starts need OS page alignment, the
        # last segment ends where the range ends
        check_segment_alignment(self.page_bytes, segment_pages,
                                self.pages if self.strips > 1 else segment_pages, "pool")
        self.nbytes = math.prod(shape) * itemsize
        self.address = _anonymous(None, self.nbytes)
        span = type("_Span", (ctypes.c_uint8 * self.nbytes,), {})
        self._span = span.from_address(self.address)
        # unmapped when the last tensor over the span is gone, never under a live view
        weakref.finalize(self._span, _libc.munmap, self.address, self.nbytes)

    def _places(self, segment: int) -> list[tuple[int, int, int]]:
        """(address, offset in the segment's memfd, length) of each strip of ``segment``."""
        if not 0 <= segment < self.num_segments:
            raise PoolError(f"segment {segment} out of range (0..{self.num_segments - 1})")
        first = segment * self.segment_pages
        n = min(self.pages, first + self.segment_pages) - first
        length = n * self.page_bytes
        return [(self.address + (i * self.pages + first) * self.page_bytes, i * length, length)
                for i in range(self.strips)]

    def map_segment(self, segment: int, fd: int) -> None:
        """Map ``fd`` (that segment's memfd) shared, over whatever the range held there."""
        places = self._places(segment)
        need = places[-1][1] + places[-1][2]
        size = os.fstat(fd).st_size
        if size < need:
            raise PoolError(f"segment {segment}: its memfd holds {size} bytes, {need} needed")
        for addr, offset, length in places:
            _mmap(addr, length, mmap.MAP_SHARED | _MAP_FIXED, fd, offset)

    def unmap_segment(self, segment: int) -> None:
        """Put private zeros back where ``segment`` was mapped (it left this process's
        namespaces, or was replaced)."""
        for addr, _offset, length in self._places(segment):
            _anonymous(addr, length)

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole pool as one contiguous tensor of ``shape`` (it keeps the range alive)."""
        import torch

        raw = torch.frombuffer(self._span, dtype=torch.uint8)
        return raw.view(dtype).view(self.shape)
