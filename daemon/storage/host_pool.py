"""The host tier (L2): a page-first pool of host memory; keyed pages indexed by their hash.

One ``HostPool`` holds the pages of one pool kind (``full`` or ``swa``) of one model layout. Its
memory is a single tensor shaped ``[pages, layers, 2, page_size, kv_heads, head_dim]``: the
page-first layout of docs/design.md (the L2 tier), so one page of all layers is one contiguous
block of ``page_nbytes`` bytes that can go to Redis as one value (:meth:`HostPool.page_bytes`,
zero-copy) and come back without re-layout (:meth:`HostPool.write_page_bytes`).

Memory: a sealed memfd mapped shared, exactly like the CPU device pools (``daemon.gpu.pools``), so
it can be handed to another process (``kv_attach``). When CUDA is available the same mapping is
also page-locked (``cudaHostRegister``), so device<->host copies are DMA transfers that can run
asynchronously on a stream.

Memory isolation (``segment_pages``, docs/operations.md "Memory isolation between tenants"): the
pool is then cut into segments of ``segment_pages`` consecutive slots, one memfd each, mapped in
place in one address range (:class:`radixd_client.segments.SegmentedRegion`, the device pools'
machinery, with one strip: a page-first pool's segment is one contiguous block). Slots come from a
:class:`~daemon.gpu.segments.SegmentedAllocator`: a namespace's slots only from its own segments,
an emptied segment back on the free list, and a segment that changes namespace gets a fresh,
zeroed memfd (:meth:`renew_segment`), so ``kv_attach`` can hand a tenant the memfds of its own
segments and nothing else. Without it there is one memfd and one segment every namespace shares.

Slot 0 is reserved (never handed out, zeroed). Every held slot has a reference count. Keyed
pages (daemon/keyed_tier.py) are also content-addressed: an index maps a 32-byte hash to the slot
holding that content. Keyed hashes are seeded per namespace, so a hash never names another
namespace's slot. The tree's host copies are not indexed: the tree itself records which node
holds which slot, and a per-page hash would cost a SHA-256 per page at small pages:

* :meth:`lookup` -- the slot holding ``hash``, or None;
* :meth:`store` -- a new slot for ``hash`` in a namespace's segments (reference 1); the caller
  then fills it; :meth:`store_unnamed` -- new slots with no hash (the tree's copies);
* :meth:`hold` -- one more reference on a held slot, named or not;
* :meth:`release` -- reference - 1; the slot is freed (and its hash forgotten) at 0.

This module is bookkeeping plus memory; the copies between device pools and a host pool are in
:mod:`daemon.storage.copies`. Not thread-safe: the daemon calls it from its event loop only.
"""

from __future__ import annotations

import math
import os
import weakref
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from radixd_client.pools import PoolError, tensor_over
from radixd_client.segments import SegmentedRegion

from daemon.gpu.allocator import (
    AUDIT_STEP_PAGES,
    AUDIT_STEP_SLOTS,
    AllocatorError,
    OutOfPages,
    ascends,
    page_ids,
)
from daemon.gpu.profile import DTYPE_ITEMSIZE, ModelProfile, cuda_available, torch_dtype
from daemon.gpu.segments import SegmentedAllocator
from daemon.gpu.shared_memory import (
    available_host_bytes,
    create_memfd,
    create_sealed_memfd,
    renew_segment_memfd,
)
from daemon.storage.reference_counts import ReferenceCounts
from daemon.tree import chunked

__all__ = ["HASH_BYTES", "HOST_POOL_LAYOUT", "MARK_FREE", "MARK_HELD", "AllocatorError",
           "HostPool", "OutOfPages", "PoolError"]

#: Axis names of a host pool tensor, outermost first (page-first).
HOST_POOL_LAYOUT: tuple[str, ...] = ("page", "layer", "kv", "token", "kv_head", "head_dim")
#: Length of a page hash (SHA-256).
HASH_BYTES = 32
_KINDS = ("full", "swa")
#: :meth:`HostPool.audit_steps`'s marks: the slot is on a free list / holds a page
MARK_FREE = 1
MARK_HELD = 2
#: releases and stores of fewer slots go a slot at a time: below it the loop costs less than
#: numpy's fixed cost per call (bench/alloc_bench.py's store_us_2 and release_us_2 time it)
FEW_SLOTS = 16
#: the most references one slot can hold (its count is an int32)
MAX_REFERENCES = 2**31 - 1
#: a mark byte -> 1 where the slot is neither free nor held (a leak)
_LOST = bytes(1 if not b & (MARK_FREE | MARK_HELD) else 0 for b in range(256))


def _check_hash(page_hash: object) -> bytes:
    if not isinstance(page_hash, bytes) or len(page_hash) != HASH_BYTES:
        raise ValueError(
            f"page_hash: expected {HASH_BYTES} bytes, got "
            f"{type(page_hash).__name__}"
            + (f" of length {len(page_hash)}" if isinstance(page_hash, bytes) else "")
        )
    return page_hash


def page_lock(ptr: int, nbytes: int) -> Callable[[], None]:
    """Page-lock an existing host mapping for CUDA (``cudaHostRegister``), so device<->host
    copies are asynchronous DMA like those of ``pin_memory=True`` tensors, while the memory stays
    a memfd that can be handed to engines. Returns the matching unregister call."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed with CUDA error {int(err)}")
    return lambda: cudart.cudaHostUnregister(ptr)


def _release(fds: list[int], unregister: list[Callable[[], None] | None]) -> None:
    for undo in unregister:
        if undo is not None:
            undo()
    for fd in fds:
        os.close(fd)
    fds.clear()
    unregister.clear()


class HostPool:
    """Page-first host memory for one pool kind of one model profile, indexed by page hash.

    ``capacity_pages`` counts slots including the reserved slot 0 (as device pool capacities
    count the padding page), so at most ``capacity_pages - 1`` pages are held at a time.
    ``pin_memory``: None (the default) pins when CUDA is available; True/False force it.
    ``segment_pages``: build the pool from segments of that many slots (memory isolation, see the
    module); None: one memfd every namespace shares.
    """

    def __init__(
        self,
        profile: ModelProfile,
        capacity_pages: int,
        kind: str,
        *,
        pin_memory: bool | None = None,
        segment_pages: int | None = None,
    ) -> None:
        if kind not in _KINDS:
            raise ValueError(f"kind: expected one of {_KINDS}, got {kind!r}")
        if isinstance(capacity_pages, bool) or not isinstance(capacity_pages, int):
            raise ValueError(f"capacity_pages: expected an int, got {capacity_pages!r}")
        if capacity_pages < 2:
            raise ValueError(
                f"capacity_pages: must be >= 2 (slot 0 is reserved), got {capacity_pages}"
            )
        layers = profile.num_full_layers if kind == "full" else profile.num_swa_layers
        if layers < 1:
            raise PoolError(f"{profile.name}: the model has no {kind} pool")
        self.kind = kind
        self.model = profile.name
        self.dtype_name = profile.dtype
        self.dtype = torch_dtype(profile.dtype)
        self.layout_fingerprint = profile.layout_fingerprint()
        self.num_layers = layers
        self.page_size = profile.page_size
        self.num_kv_heads = profile.num_kv_heads
        self.head_dim = profile.head_dim
        self.capacity = capacity_pages
        #: Shape of one page: ``[layers, 2, page_size, kv_heads, head_dim]``.
        self.page_shape: tuple[int, ...] = (
            layers, 2, profile.page_size, profile.num_kv_heads, profile.head_dim
        )
        self.shape: tuple[int, ...] = (capacity_pages, *self.page_shape)
        self.page_nbytes = math.prod(self.page_shape) * DTYPE_ITEMSIZE[profile.dtype]
        self.nbytes = capacity_pages * self.page_nbytes
        if pin_memory is None:
            pin_memory = cuda_available()
        self.pinned = bool(pin_memory)
        self.fd: int | None = None  # the single memfd (not segmented), else None
        self._finalizer: weakref.finalize | None = None
        label = f"{profile.name} {kind} host pool"
        available = available_host_bytes()
        if available is not None and self.nbytes > available:
            raise PoolError(
                f"{label}: {capacity_pages} pages x {self.page_nbytes} B = {self.nbytes} B but "
                f"only {available} bytes of host memory are available; lower its capacity"
            )
        # Always memfds, pinned or not: engines map them (kv_attach) and a warm restart keeps them.
        self._label = label
        self.segment_pages = segment_pages
        #: one memfd per segment (segmented), and the times each got fresh memory
        self.segment_fds: list[int] = []
        self.segment_epochs: list[int] = []
        self._unregister: list[Callable[[], None] | None] = []
        self._region: SegmentedRegion | None = None
        self._finalizer = weakref.finalize(self, _release, self.segment_fds, self._unregister)
        if segment_pages is not None:
            itemsize = DTYPE_ITEMSIZE[profile.dtype]
            # one (layer, kv) "strip" of whole pages: a page-first segment is one block
            self._region = SegmentedRegion((1, 1, capacity_pages, *self.page_shape), itemsize,
                                           segment_pages)
            for seg in range(self._region.num_segments):
                self.segment_fds.append(self._segment_memfd(seg))
                self.segment_epochs.append(0)
                self._region.map_segment(seg, self.segment_fds[seg])
            buffer = self._region.tensor(self.dtype).view(self.shape)
        else:
            fd, mapping = create_memfd(f"radixd-{profile.name}-{kind}-host", self.nbytes)
            self.segment_fds.append(fd)
            self.fd = fd
            buffer = tensor_over(mapping, self.dtype, self.shape)
        self._buffer: torch.Tensor | None = buffer
        if self.pinned:
            for seg in range(self.num_segments or 1):
                self._unregister.append(None)
                self._pin(seg)
        # A flat byte view of the whole pool for zero-copy page access (numpy keeps the tensor,
        # and so the memory, alive for as long as a memoryview of it exists).
        self._bytes = buffer.view(-1).view(torch.uint8).numpy()
        self._bytes[: self.page_nbytes] = 0  # slot 0: reserved, zero
        self._alloc = SegmentedAllocator(capacity_pages, segment_pages or capacity_pages, label,
                                         on_assign=self.renew_segment)
        self._slot_of: dict[bytes, int] = {}  # page hash -> slot
        self._hash_of: dict[int, bytes] = {}  # slot -> page hash
        # slot -> reference count, 0 for a slot holding nothing: 4 bytes a slot, where a dict of
        # the held ones took 60-80 a held slot, and a copy's thousands of slots (pages of a few
        # tokens) are counted and released in a few numpy calls
        self._refs = np.zeros(capacity_pages, dtype=np.int32)
        #: bumped by every change of the slots' bookkeeping (store, hold, release): part of
        #: the checker's state version, so that a stepped audit spanning a change is given up
        self.changes = 0

    # -- memory -----------------------------------------------------------------------------

    @property
    def num_segments(self) -> int:
        """Segments of this pool (0: not segmented, one memfd every namespace shares)."""
        return 0 if self._region is None else self._region.num_segments

    def segment_range(self, seg: int) -> range:
        """The slots of segment ``seg``."""
        size = self.segment_pages or self.capacity
        return range(seg * size, min(self.capacity, (seg + 1) * size))

    def _segment_memfd(self, seg: int, back: bool = True) -> int:
        size = self.segment_pages or self.capacity
        n = min(self.capacity, (seg + 1) * size) - seg * size
        return create_sealed_memfd(f"radixd-{self.model}-{self.kind}-host-seg{seg}",
                                   n * self.page_nbytes, back=back)

    def _pin(self, seg: int) -> None:
        """Page-lock segment ``seg`` (the whole pool when not segmented) for CUDA."""
        r = self.segment_range(seg)
        start = self.buffer[r.start].data_ptr()
        try:
            self._unregister[seg] = page_lock(start, len(r) * self.page_nbytes)
        except RuntimeError as exc:
            raise PoolError(f"{self._label}: cannot pin {len(r) * self.page_nbytes} bytes "
                            f"({exc})") from exc

    def renew_segment(self, seg: int) -> None:
        """Give segment ``seg`` fresh zeroed memory: it changes namespace (the allocator's
        ``on_assign``). A new memfd is mapped in place of the old one, whose fd is closed: a
        process of the old namespace that still maps it sees only the old bytes, never the new
        namespace's, and the new namespace reads zeros. Its epoch grows so that clients remap."""
        if self._region is None:
            raise PoolError(f"{self._label} is not segmented")
        undo = self._unregister[seg] if self.pinned else None
        if undo is not None:
            undo()
            self._unregister[seg] = None
        renew_segment_memfd(self._region, seg, self.segment_fds, self.segment_epochs,
                            lambda s: self._segment_memfd(s, back=False))
        if self.pinned:
            self._pin(seg)

    @property
    def closed(self) -> bool:
        return self._buffer is None

    @property
    def buffer(self) -> torch.Tensor:
        """The whole pool tensor ``[pages, layers, 2, page_size, kv_heads, head_dim]``."""
        if self._buffer is None:
            raise PoolError(f"{self.model} {self.kind} host pool is closed")
        return self._buffer

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _check_slot(self, slot: int) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 < slot < self.capacity:
            raise AllocatorError(
                f"{self.model} {self.kind} host pool: slot {slot!r} is not a slot of this pool "
                f"(1..{self.capacity - 1})"
            )
        return slot

    def _check_held(self, slot: int) -> int:
        self._check_slot(slot)
        if self._refs[slot] <= 0:
            raise AllocatorError(
                f"{self.model} {self.kind} host pool: slot {slot} is not held"
            )
        return slot

    def page(self, slot: int) -> torch.Tensor:
        """One slot (0, the reserved zero slot, included) as a contiguous
        ``[layers, 2, page_size, kv_heads, head_dim]`` view."""
        if slot != 0:
            self._check_slot(slot)
        return self.buffer[slot]

    def page_bytes(self, slot: int) -> memoryview:
        """The bytes of a held slot, zero-copy: one contiguous block of ``page_nbytes``."""
        self.buffer  # noqa: B018 - raises when closed
        self._check_held(slot)
        start = slot * self.page_nbytes
        return self._bytes[start : start + self.page_nbytes].data

    def write_page_bytes(self, slot: int, data: Any) -> None:
        """Overwrite a held slot with ``data`` (any buffer of exactly ``page_nbytes`` bytes)."""
        self.buffer  # noqa: B018 - raises when closed
        self._check_held(slot)
        view = memoryview(data).cast("B")
        if view.nbytes != self.page_nbytes:
            raise ValueError(
                f"data: {view.nbytes} bytes, a page of the {self.kind} host pool is "
                f"{self.page_nbytes}"
            )
        start = slot * self.page_nbytes
        self._bytes[start : start + self.page_nbytes] = view

    # -- slots: references, and the hash index of keyed pages ----------------------------------

    @property
    def used(self) -> int:
        """Slots holding a page."""
        return len(self.reference_counts())

    @property
    def available(self) -> int:
        """Free slots (in the whole pool: see :meth:`available_to` for one namespace)."""
        return self._alloc.available

    def available_to(self, space: str = "") -> int:
        """Slots the namespace ``space`` can take now: free ones in its segments plus those of
        free segments (``space`` is the allocator key: the namespace, or "" when shared)."""
        return self._alloc.available_to(space)

    @property
    def allocator(self) -> SegmentedAllocator:
        """The slot allocator: segment owners, what each namespace may map."""
        return self._alloc

    @property
    def usable(self) -> int:
        """Slots that can ever hold a page (capacity minus the reserved slot 0)."""
        return self._alloc.usable

    def lookup(self, page_hash: bytes) -> int | None:
        """The slot holding ``page_hash``, or None; no reference is taken."""
        return self._slot_of.get(_check_hash(page_hash))

    def held(self) -> set[int]:
        """The slots holding a page."""
        return set(np.flatnonzero(self._refs > 0).tolist())

    def slot_hashes(self) -> Mapping[int, bytes]:
        """Slot -> hash of every slot indexed by hash (keyed pages; the tree's copies are not), a
        read-only live view: an audit looks up many slots without :meth:`hash_of`'s per-call
        validation."""
        return MappingProxyType(self._hash_of)

    def reference_counts(self) -> Mapping[int, int]:
        """Slot -> reference count of every held slot, a read-only live view: a stepped audit
        walks it a chunk at a time rather than copying it all in one step."""
        return ReferenceCounts(self._refs)

    def refcount(self, slot: int) -> int:
        """References held on ``slot`` (0 when it is free)."""
        return max(0, int(self._refs[self._check_slot(slot)]))

    def hash_of(self, slot: int) -> bytes | None:
        return self._hash_of.get(self._check_slot(slot))

    def store(self, page_hash: bytes, space: str = "") -> int:
        """A new slot for ``page_hash`` with one reference, in the segments of namespace
        ``space`` ("" when the pool is shared); the caller fills it.

        Raises :class:`OutOfPages` when no slot is free and ``ValueError`` when the hash is
        already held (content is stored once: :meth:`lookup` and :meth:`hold` it).

        The hash is indexed at once, before the caller's copy has filled the slot: whoever wires
        this to a reader must keep such slots pending until the copy completes, or a reader
        could find a slot that is still being written.
        """
        return self.store_many((page_hash,), space)[0]

    def store_many(self, page_hashes: Sequence[bytes], space: str = "") -> array:
        """:meth:`store` of each hash, all or none (nothing changes when one fails). One
        allocation and index updates in C: at pages of a few tokens a copy stores thousands of
        pages, and a call per page was most of what a host copy cost the daemon."""
        if set(map(type, page_hashes)) - {bytes} or set(map(len, page_hashes)) - {HASH_BYTES}:
            for h in page_hashes:
                _check_hash(h)
        if (len(set(page_hashes)) != len(page_hashes)
                or not self._slot_of.keys().isdisjoint(page_hashes)):
            seen: set[bytes] = set()
            for h in page_hashes:
                if h in self._slot_of or h in seen:
                    held = (f"held in slot {self._slot_of[h]}" if h in self._slot_of
                            else "listed twice")
                    raise ValueError(f"page_hash {h.hex()[:16]}... is already {held}; "
                                     "hold it instead")
                seen.add(h)
        slots = self._alloc.alloc(len(page_hashes), space)
        self.changes += len(slots)
        self._slot_of.update(zip(page_hashes, slots, strict=True))
        self._hash_of.update(zip(slots, page_hashes, strict=True))
        self._count_new(slots)
        return slots

    def store_unnamed(self, count: int, space: str = "") -> array:
        """``count`` new slots with one reference each and no hash, in the segments of
        namespace ``space``, all or none (:class:`OutOfPages`): pages whose index is the caller's
        (the tree's host copies), which nobody looks up by content."""
        slots = self._alloc.alloc(count, space)
        self.changes += len(slots)
        self._count_new(slots)
        return slots

    def _count_new(self, slots: array) -> None:
        """One reference on each slot just allocated."""
        if len(slots) < FEW_SLOTS:
            refs = self._refs
            for slot in slots:
                refs[slot] = 1
        else:
            self._refs[page_ids(slots)] = 1

    def hold(self, slot: int) -> None:
        """One more reference on a held slot (a reader that must outlive its owner's)."""
        if self._refs[self._check_held(slot)] >= MAX_REFERENCES:
            raise AllocatorError(f"{self.model} {self.kind} host pool: slot {slot} holds "
                                 f"{MAX_REFERENCES} references, the most a slot can")
        self._refs[slot] += 1
        self.changes += 1

    def release(self, slot: int) -> None:
        """Drop one reference; at 0 the slot is freed and its hash forgotten."""
        self.release_many((slot,))

    def release_many(self, slots: Sequence[int]) -> None:
        """:meth:`release` of each slot (one listed twice loses two references), all or none:
        every slot is checked before anything changes. The slots left without a reference are
        freed in one allocator call."""
        if not len(slots):
            return
        if isinstance(slots, (bytes, bytearray)):  # their items are ints, but array() below
            # would read their bytes as int32 values
            raise AllocatorError(f"{self.model} {self.kind} host pool: slots must be a sequence "
                                 f"of ints, not {type(slots).__name__}")
        if len(slots) < FEW_SLOTS:
            self._release_few(slots)
            return
        refs = self._refs
        typed = isinstance(slots, array) and slots.typecode == "i"
        # the checks and the common case (the tree's copies: one reference each, no hash, as an
        # int32 array) in numpy over the whole list: evicting host copies at page 1 releases
        # thousands of slots. Anything else is checked slot by slot, for the error's message
        if typed:
            # a copy: a view of the caller's array, kept by the traceback of an error below,
            # would keep the caller from resizing it
            ids = page_ids(slots).copy()
        elif set(map(type, slots)) == {int} and -2**31 <= min(slots) and max(slots) < 2**31:
            ids = np.array(slots, dtype=np.int32)
        else:  # raises unless every slot is held (int subclasses pass, as ints)
            for slot in slots:
                self._check_held(slot)
            ids = np.array([int(slot) for slot in slots], dtype=np.int32)
        if not 0 < ids.min() or not ids.max() < self.capacity:
            for slot in slots:
                self._check_held(slot)
        held = refs[ids]
        if (held <= 0).any():
            for slot in slots:
                self._check_held(slot)
        if ascends(ids):  # no slot twice
            self.changes += len(ids)
            if held.max() == 1:  # the common case: every slot freed
                refs[ids] = 0
                freed = ids
            else:
                held -= 1
                refs[ids] = held
                freed = ids[held == 0]
        else:
            uniq, first, counts = np.unique(ids, return_index=True, return_counts=True)
            over = np.flatnonzero(counts > refs[uniq])
            if len(over):  # named as a slot at a time would: the first in the list
                i = over[np.argmin(first[over])]
                raise self._over_released(int(uniq[i]), int(counts[i]))
            self.changes += len(ids)
            np.subtract.at(refs, ids, 1)
            # each slot freed once, where its last reference goes (its last mention), as
            # releases one at a time would: the order in which the allocator gets them back
            back = ids[refs[ids] == 0][::-1]
            freed = back[np.sort(np.unique(back, return_index=True)[1])[::-1]]
        if not len(freed):
            return
        if self._hash_of:
            self._forget_hashes(freed.tolist())
        self._alloc.free(slots if freed is ids and typed else array("i", freed.tobytes()))

    def _release_few(self, slots: Sequence[int]) -> None:
        """:meth:`release_many` a slot at a time."""
        for slot in slots:
            self._check_held(slot)
        refs = self._refs
        if len(set(slots)) != len(slots):
            for slot, n in Counter(slots).items():
                if n > refs[slot]:
                    raise self._over_released(slot, n)
        self.changes += len(slots)
        freed = array("i")
        for slot in slots:
            left = int(refs[slot]) - 1
            refs[slot] = left
            if not left:
                freed.append(slot)
        if freed:
            if self._hash_of:
                self._forget_hashes(freed)
            self._alloc.free(freed)

    def _over_released(self, slot: int, n: int) -> AllocatorError:
        return AllocatorError(f"{self.model} {self.kind} host pool: slot {slot} released {n} "
                              f"times, holds {int(self._refs[slot])} references")

    def _forget_hashes(self, freed: Iterable[int]) -> None:
        """Drop the hash index entries of freed slots (keyed pages; most have none)."""
        hash_of = self._hash_of
        if hash_of.keys().isdisjoint(freed):
            return
        for slot in freed:
            page_hash = hash_of.pop(slot, None)
            if page_hash is not None:
                del self._slot_of[page_hash]

    def audit_owners(self, slots: Iterable[int], space: str, what: str) -> list[str]:
        """Every slot of ``slots`` lies in a segment namespace ``space`` holds."""
        bad: set[int] = set()
        self._alloc.misplaced(slots, space, bad)
        return self._alloc.audit_owners(space, what, bad)

    def audit(self) -> list[str]:
        """Violations: index, reverse index, reference counts and allocator must agree (and a
        free segment holds no slot in use: the allocator's own audit)."""
        v: list[str] = []
        for _ in self.audit_steps(v):
            pass
        return v

    def audit_steps(self, v: list[str], marks: bytearray | None = None) -> Iterator[None]:
        """:meth:`audit` into ``v``, yielding after each bounded piece of work (at most
        :data:`~daemon.gpu.allocator.AUDIT_STEP_SLOTS` slots looked at one by one, or a chunk of
        bytes compared at once), so that the background checker never holds a request back
        behind a large pool (daemon/checker.py). ``marks`` (``capacity`` zero bytes) is left
        with :data:`MARK_FREE` for every slot on a free list and :data:`MARK_HELD` for every
        slot holding a page, for the host tier's audit one layer up."""
        name = f"{self.model} {self.kind} host pool"
        cap = self.capacity
        m = bytearray(cap) if marks is None else marks
        yield from self._alloc.audit_steps(v, m)  # leaves 1 (MARK_FREE) on free-listed slots
        hash_at = self._hash_of.get
        agree = True
        for chunk in chunked(self._slot_of.items(), AUDIT_STEP_SLOTS):
            for page_hash, slot in chunk:
                if not isinstance(page_hash, bytes) or len(page_hash) != HASH_BYTES:
                    v.append(f"{name}: index key {page_hash!r} is not a {HASH_BYTES}-byte hash")
                if hash_at(slot) != page_hash:
                    agree = False
                    v.append(f"{name}: hash {page_hash.hex()[:16]}... maps to slot {slot}, "
                             f"which is recorded for another hash")
            yield
        # two hashes indexed to one slot cannot both agree with the slot's one hash: only a
        # disagreement makes it worth counting (a rare path, in one step)
        if not agree and len(set(self._slot_of.values())) != len(self._slot_of):
            v.append(f"{name}: a slot is indexed under two hashes")
        refs = self._refs
        unheld: list[int] = []  # a hash recorded for a slot nobody holds
        for chunk in chunked(self._hash_of.items(), AUDIT_STEP_SLOTS):
            for slot, page_hash in chunk:
                if self._slot_of.get(page_hash) != slot:
                    v.append(f"{name}: slot {slot} records a hash the index does not map to it")
                if not (isinstance(slot, int) and 0 < slot < cap and refs[slot] > 0):
                    unheld.append(slot)
            yield
        if unheld:
            v.append(f"{name}: slots {sorted(unheld)[:10]} record a hash but are not held")
        if refs[0] > 0:
            v.append(f"{name}: slot 0 (reserved) has {int(refs[0])} references")
        low: list[int] = []  # released more often than held
        both: list[int] = []  # free and held
        all_marks = np.frombuffer(m, dtype=np.uint8)
        step = 64 * AUDIT_STEP_PAGES  # compared as arrays (and below as bytes), not one by one
        for start in range(0, cap, step):
            counts = refs[start:start + step]
            held = counts > 0
            marked = all_marks[start:start + step]
            low += (np.flatnonzero(counts < 0)[:10] + start).tolist()
            both += (np.flatnonzero(held & ((marked & MARK_FREE) != 0))[:10] + start).tolist()
            marked[held] |= MARK_HELD
            yield
        if low:
            v.append(f"{name}: slots {low[:10]} have a negative reference count")
        if both:
            v.append(f"{name}: slots {both[:10]} are both free and held")
        lost: list[int] = []  # neither on a free list nor held: allocated to nobody
        for start in range(0, cap, step):
            flags = m[start:start + step].translate(_LOST)
            i = flags.find(1, 1 if start == 0 else 0)  # slot 0 is reserved
            while i >= 0 and len(lost) < 10:
                lost.append(start + i)
                i = flags.find(1, i + 1)
            yield
        if lost:
            v.append(f"{name}: slots {lost} are allocated but hold no reference (leak)")

    # -- lifetime ---------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """JSON-able summary: layout, sizes, memory kind and occupancy."""
        return {
            "model": self.model,
            "kind": self.kind,
            "memory": "pinned" if self.pinned else "memfd",
            "dtype": self.dtype_name,
            "shape": list(self.shape),
            "layout": list(HOST_POOL_LAYOUT),
            "page_nbytes": self.page_nbytes,
            "nbytes": self.nbytes,
            "capacity": self.capacity,
            "segment_pages": self.segment_pages or 0,
            "num_segments": self.num_segments,
            "used": self.used,
            "available": self.available,
            "layout_fingerprint": self.layout_fingerprint.hex(),
        }

    def close(self) -> None:
        """Drop the pool's references to its memory and close the fd; idempotent.

        As for device pools, the mapping is unmapped once the last view of it is gone.
        """
        self._buffer = None
        self._bytes = None  # type: ignore[assignment]
        self._region = None
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.fd = None

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.used}/{self.usable} slots used"
        memory = "pinned" if self.pinned else "memfd"
        return (f"<HostPool {self.model}/{self.kind} {list(self.shape)} {self.dtype_name} "
                f"{memory} {state}>")

