"""Host shared memory for pools: sealed memfds an engine process can map, and how much memory
is left to fill. Shared by the CPU device pools (:mod:`daemon.gpu.pools`) and the host tier
(:mod:`daemon.storage.host_pool`), which must agree on how such memory is made."""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Callable
from typing import Any

from radixd_client.pools import PoolError

MEMFD_NAME_MAX = 249  # bytes, excluding the NUL (memfd_create(2))


def available_host_bytes() -> int | None:
    """Memory this process can still fill: MemAvailable, capped by a cgroup v2 limit if any."""
    available: int | None = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
                current = int(f.read().strip())
            room = max(0, int(limit) - current)
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def create_memfd(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    """Create a sealed, fully backed memfd of ``nbytes`` and map it shared, read-write."""
    fd = create_sealed_memfd(name, nbytes)
    try:
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, mapping


def create_sealed_memfd(name: str, nbytes: int, back: bool = True) -> int:
    """Create a sealed, zeroed memfd of ``nbytes``, not mapped.

    With ``back``, ``posix_fallocate`` backs every page now, so that running out of memory at
    start-up is an error here rather than a failure in the middle of a kernel later; it costs a
    zero-fill of every byte. Without it the pages are allocated (zeroed) when first written, by
    whoever writes them: for replacing memory the daemon already held, on the request path. The
    size is then sealed (no shrink, no grow): an engine holding the fd must not be able to
    truncate it under the daemon's mapping, which would crash the daemon with SIGBUS on its next
    access.
    """
    if not hasattr(os, "memfd_create"):
        raise PoolError("CPU pools need memfd_create (Linux); this platform does not have it")
    encoded = name.encode("utf-8")[:MEMFD_NAME_MAX]
    fd = os.memfd_create(
        encoded.decode("utf-8", "ignore"), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    )
    try:
        os.ftruncate(fd, nbytes)
        try:
            if back:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            raise PoolError(
                f"{name}: cannot back {nbytes} bytes of shared memory ({exc.strerror})"
            ) from exc
        fcntl.fcntl(
            fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        )
    except BaseException:
        os.close(fd)
        raise
    return fd


def renew_segment_memfd(region: Any, seg: int, fds: list[int], epochs: list[int],
                        make_fd: Callable[[int], int]) -> None:
    """Give segment ``seg`` of a segmented pool fresh memory: ``make_fd(seg)`` (a new memfd,
    not backed up front: the kernel zero-fills it as the new owner writes) mapped over the old
    one in ``region`` (a ``radixd_client.segments.SegmentedRegion``); the old memfd is closed,
    so its memory goes with the last process that maps it, and the epoch grows so that clients
    know to map the segment again. Device and host pools share it."""
    fd = make_fd(seg)
    try:
        region.map_segment(seg, fd)
    except BaseException:
        os.close(fd)
        raise
    old, fds[seg] = fds[seg], fd
    os.close(old)
    epochs[seg] += 1


def hide_descriptors() -> bool:
    """Make this process non-dumpable (``PR_SET_DUMPABLE`` 0), so that a process of the same
    non-root user cannot open the pools' memfds through ``/proc/<pid>/fd`` (that would bypass
    memory isolation: docs/operations.md). Also turns off core dumps. False where it failed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        return False
