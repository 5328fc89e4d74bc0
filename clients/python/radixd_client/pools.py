"""Mapping the daemon's KV pools into an engine process.

The daemon answers ``attach`` with an :class:`~radixd_client.protocol.AttachResult`: one
:class:`~radixd_client.protocol.PoolInfo` per pool (full, and swa for models with sliding-window
layers). A CPU pool (kind ``"memfd"``) lives in a sealed memfd whose fd arrives with the response
frame (SCM_RIGHTS); :func:`map_pool_fd` maps it. A GPU pool (kind ``"cuda_ipc"``) is opened from
the CUDA IPC handle in ``PoolInfo.handle`` (see :func:`export_cuda_ipc_handle` for its format).

A segmented pool (kind ``"memfd_segments"``: the daemon isolates tenants in memory) arrives as one
memfd per segment of this session's namespace (``AttachResult.segments``); they are mapped in
place in one address range (:mod:`radixd_client.segments`), and the rest of the range is private
zeros. When a result's ``segments_gen`` is above :attr:`AttachedPools.generation`, the namespace
got segments this process has not mapped: attaching again (``Client.attach``, which the clients
do by themselves) maps them into the same tensors (:meth:`AttachedPools.update`).

Each pool is one tensor ``[layers, 2, pages, page_size, kv_heads, head_dim]``; ``pool[layer, 0]``
(K) and ``pool[layer, 1]`` (V) are contiguous page-major views ``[pages, page_size, kv_heads,
head_dim]``, which is what paged-attention kernels index with a page id.

This module is also the daemon's implementation of :func:`map_pool_fd` (``daemon.gpu.pools``
imports it), so the two sides cannot drift. torch is imported lazily, inside the functions that
need it: importing this module (or the package) does not import torch.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import msgspec

from .errors import ConnectFailed, ConnectionLost, PoolError, SegmentsNotMapped, ShuttingDown
from .fds import close_fds
from .protocol import AttachResult, KvAttachResult, PoolInfo
from .segments import SegmentedRegion, map_fixed_shared, shared_span

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = [
    "DESCRIPTION_VERSION",
    "DTYPE_ITEMSIZE",
    "POOL_LAYOUT",
    "AttachedPools",
    "CudaIpcHandle",
    "KvHostPools",
    "PoolError",
    "attach_host_pools",
    "attach_or_update",
    "attach_pools",
    "export_cuda_ipc_handle",
    "map_pool_fd",
    "models_to_update",
    "open_cuda_ipc",
]

#: Axis names of a pool tensor, outermost first; part of the pool description.
POOL_LAYOUT: tuple[str, ...] = ("layer", "kv", "page", "token", "kv_head", "head_dim")
#: Version of the pool description dict; a client refuses descriptions it does not know.
DESCRIPTION_VERSION = 1
#: KV dtypes a pool may have, with their size in bytes (the daemon's profile uses the same set).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


# ---------------------------------------------------------------------------- description

def _torch_dtype(name: str) -> torch.dtype:
    import torch

    result = getattr(torch, name, None)
    if not isinstance(result, torch.dtype):
        raise PoolError(f"description.dtype: {name!r} is not supported by torch "
                        f"{torch.__version__}")
    return result


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of ``shape``."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def tensor_over(mapping: mmap.mmap, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over the whole of ``mapping``.

    The tensor keeps a reference to the mmap object (not a buffer export), so the mapping stays
    alive exactly as long as some tensor uses it. Never ``close()`` such a mapping explicitly:
    a tensor still using it would then read unmapped memory and crash the process.
    """
    import torch

    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def _check_description(description: Any, storage: str) -> tuple[torch.dtype, tuple[int, ...], int]:
    """Validate a pool description for ``storage``; return (dtype, shape, nbytes)."""

    def bad(field: str, why: str) -> PoolError:
        return PoolError(f"description.{field}: {why}")

    if not isinstance(description, Mapping):
        raise PoolError(f"description: expected a mapping, got {type(description).__name__}")
    version = description.get("version")
    if version != DESCRIPTION_VERSION:
        raise bad("version", f"unsupported {version!r}, expected {DESCRIPTION_VERSION}")
    got_storage = description.get("storage")
    if got_storage != storage:
        if storage == "memfd":
            raise bad("storage", f"only 'memfd' pools can be mapped from an fd, got "
                                 f"{got_storage!r}")
        raise bad("storage", f"expected {storage!r}, got {got_storage!r}")
    dtype_name = description.get("dtype")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPE_ITEMSIZE:
        raise bad("dtype", f"unsupported {dtype_name!r}")
    dtype = _torch_dtype(dtype_name)
    shape_in = description.get("shape")
    if (
        not isinstance(shape_in, (list, tuple))
        or len(shape_in) != len(POOL_LAYOUT)
        or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape_in)
    ):
        raise bad("shape", f"expected {len(POOL_LAYOUT)} positive ints, got {shape_in!r}")
    shape = tuple(shape_in)
    strides = description.get("strides")
    if (
        not isinstance(strides, (list, tuple))
        or list(strides) != list(contiguous_strides(shape))
    ):
        raise bad("strides", f"expected contiguous {list(contiguous_strides(shape))}, "
                             f"got {strides!r}")
    nbytes = description.get("nbytes")
    expected = math.prod(shape) * DTYPE_ITEMSIZE[dtype_name]
    if nbytes != expected:
        raise bad("nbytes", f"{nbytes!r} does not match shape x dtype ({expected})")
    return dtype, shape, expected


# ---------------------------------------------------------------------------- memfd pools

def map_pool_fd(fd: int, description: Mapping[str, Any]) -> torch.Tensor:
    """Map a pool fd received from the daemon as the tensor its description describes.

    ``description`` is what the daemon's ``Pool.describe()`` returns (``PoolInfo.description``).
    The returned tensor shares memory with the daemon's pool and keeps its own mapping alive, so
    ``fd`` may be closed right after this call (the caller owns it either way). A description
    that claims more memory than the fd holds is refused here instead of crashing the process
    with SIGBUS on first access.
    """
    _dtype, _shape, expected = _check_description(description, "memfd")
    return _map_fd(fd, expected, _dtype, _shape)


def _map_fd(fd: int, expected: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``expected`` bytes of a memfd, mapped shared as a tensor of ``dtype`` and ``shape``."""
    size = os.fstat(fd).st_size
    if size < expected:
        raise PoolError(f"description.nbytes: {expected} bytes but the fd only holds {size}")
    import torch

    raw = torch.frombuffer(shared_span(fd, expected), dtype=torch.uint8)  # keeps the span
    return raw.view(dtype).view(shape)


# ---------------------------------------------------------------------------- CUDA IPC pools

class CudaIpcHandle(msgspec.Struct, kw_only=True):
    """What ``PoolInfo.handle`` holds for a ``cuda_ipc`` pool: msgpack of this struct.

    The fields are those of torch's ``UntypedStorage._share_cuda_()`` (the mechanism behind
    ``torch.multiprocessing``), plus the GPU's UUID so the client opens the handle on the right
    device even when its ``CUDA_VISIBLE_DEVICES`` numbers the GPUs differently from the daemon's,
    and the tensor's offset in its storage.
    """

    version: int = 1
    device_uuid: str = ""
    device: int  # the daemon's ordinal; used only when device_uuid is empty
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes | None = None
    ref_counter_offset: int = 0
    event_handle: bytes | None = None
    event_sync_required: bool = False
    tensor_offset: int = 0


_handle_decoder = msgspec.msgpack.Decoder(CudaIpcHandle)


def export_cuda_ipc_handle(tensor: torch.Tensor) -> bytes:
    """The ``PoolInfo.handle`` bytes for a CUDA pool tensor (the daemon side of ``attach``)."""
    import torch

    if tensor.device.type != "cuda":
        raise PoolError(f"export_cuda_ipc_handle: expected a CUDA tensor, got {tensor.device}")
    storage = tensor.untyped_storage()
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
     event_sync) = storage._share_cuda_()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return msgspec.msgpack.encode(CudaIpcHandle(
        device_uuid=uuid, device=int(device), handle=bytes(handle),
        storage_size_bytes=int(size_bytes), storage_offset_bytes=int(offset_bytes),
        ref_counter_handle=None if ref_handle is None else bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=None if event_handle is None else bytes(event_handle),
        event_sync_required=bool(event_sync), tensor_offset=int(tensor.storage_offset()),
    ))


def _local_cuda_device(h: CudaIpcHandle) -> int:
    import torch

    if not h.device_uuid:
        return h.device
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == h.device_uuid:
            return i
    raise PoolError(f"the daemon's pool is on GPU {h.device_uuid}, which this process cannot "
                    "see (check CUDA_VISIBLE_DEVICES)")


def open_cuda_ipc(info: PoolInfo) -> torch.Tensor:
    """Open a ``cuda_ipc`` pool: the daemon's device memory, as a tensor in this process.

    Needs torch with CUDA on a machine that sees the daemon's GPU. The handle is opened once per
    process (torch caches it); the daemon keeps the memory for its whole life, and the mapping
    stays valid as long as the returned tensor (or a view of it) is alive.
    """
    try:
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
    except ImportError as exc:
        raise PoolError("attaching a GPU pool needs torch with CUDA (pip install "
                        "'radixd-client[torch]')") from exc
    if not torch.cuda.is_available():
        raise PoolError(f"the {info.pool} pool is on {info.device}: attaching it needs torch "
                        "with CUDA and a visible GPU, and this process has none")
    if not info.handle:
        raise PoolError(f"the {info.pool} pool is of kind 'cuda_ipc' but carries no handle")
    dtype, shape, _nbytes = _check_description(info.description, "cuda")
    try:
        h = _handle_decoder.decode(info.handle)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PoolError(f"the {info.pool} pool's CUDA IPC handle is not in the expected format "
                        f"(radixd_client.pools.CudaIpcHandle): {exc}") from exc
    if h.version != 1:
        raise PoolError(f"CUDA IPC handle version {h.version} is not supported (expected 1)")
    device = _local_cuda_device(h)
    return rebuild_cuda_tensor(
        torch.Tensor, shape, contiguous_strides(shape), h.tensor_offset,
        torch.storage.TypedStorage, dtype, device, h.handle, h.storage_size_bytes,
        h.storage_offset_bytes, False, h.ref_counter_handle, h.ref_counter_offset,
        h.event_handle, h.event_sync_required,
    )


# ---------------------------------------------------------------------------- attached pools

class AttachedPools:
    """The KV pools of one model, mapped into this process.

    ``full`` and ``swa`` (None for a model without sliding-window layers) are the whole pool
    tensors ``[layers, 2, pages, page_size, kv_heads, head_dim]``; :meth:`k` and :meth:`v` give
    the per-layer page-major views ``[pages, page_size, kv_heads, head_dim]``. Page 0 of each pool
    is the padding page: point unused slots at it, never write it.

    The object keeps the mappings alive. :meth:`close` drops its references; the memory is
    unmapped once no tensor or view of it is left (it is never pulled from under a live view).
    """

    def __init__(self, model: str, tensors: Mapping[str, torch.Tensor],
                 infos: Mapping[str, PoolInfo],
                 regions: Mapping[str, SegmentedRegion] | None = None) -> None:
        if "full" not in tensors:
            raise PoolError(f"{model}: the daemon sent no full pool")
        self.model = model
        self.infos: dict[str, PoolInfo] = dict(infos)
        self._tensors: dict[str, torch.Tensor] | None = dict(tensors)
        self._regions: dict[str, SegmentedRegion] = dict(regions or {})
        #: (pool, segment) -> epoch of each segment mapped here
        self.segments: dict[tuple[str, int], int] = {}
        #: the namespace's segment generation these mappings reflect
        self.generation = 0

    # -- segments -------------------------------------------------------------------------------

    def needs_update(self, segments_gen: int) -> bool:
        """Whether a result's ``segments_gen`` names segments this process has not mapped."""
        return bool(self._regions) and self._tensors is not None and (
            segments_gen > self.generation)

    def update(self, result: AttachResult, fds: Sequence[int]) -> None:
        """Map the segments an attach response lists (new ones, and those with a new epoch) and
        put private zeros where segments no longer listed were. ``fds`` are not closed here."""
        map_listed_segments(self.model, self._regions, self.segments, result.segments, fds)
        self.generation = result.generation

    def rebind(self, result: AttachResult, fds: Sequence[int]) -> None:
        """Point these tensors at a restarted daemon's pools, in place (same addresses, so views
        and anything captured over them stay valid). The layout must be the same; a GPU pool
        (CUDA IPC) cannot be rebound: its memory was the old daemon's and is gone. ``fds`` are
        closed here, rebound or not."""
        try:
            self._rebind(result, fds)
        finally:
            close_fds(fds)

    def _rebind(self, result: AttachResult, fds: Sequence[int]) -> None:
        if self._tensors is None:
            raise PoolError(f"{self.model}: the pools are closed")
        new = {info.pool: info for info in result.pools}
        if set(new) != set(self.infos):
            raise PoolError(f"{self.model}: the restarted daemon has pools {sorted(new)}, this "
                            f"process mapped {sorted(self.infos)}: attach again")
        for name, info in new.items():
            old = self.infos[name]
            region = self._regions.get(name)
            if region is not None and region.segment_pages != result.segment_pages:
                raise PoolError(f"{self.model} {name} pool: the restarted daemon cuts it into "
                                f"segments of {result.segment_pages} pages, not "
                                f"{region.segment_pages}: attach again and rebuild the views")
            if (info.kind, list(info.shape), info.dtype) != (old.kind, list(old.shape),
                                                              old.dtype):
                raise PoolError(f"{self.model} {name} pool: the restarted daemon's layout "
                                f"({info.kind} {list(info.shape)} {info.dtype}) is not the one "
                                "mapped here: attach again and rebuild the views")
            if info.kind == "cuda_ipc":
                raise PoolError(f"{self.model} {name} pool: GPU pools do not survive a daemon "
                                "restart: attach again and rebuild the views")
        for name, info in new.items():
            if info.kind == "memfd_segments":  # everything goes: the new list is mapped below
                for key in [k for k in self.segments if k[0] == name]:
                    self._regions[name].unmap_segment(key[1])
                    del self.segments[key]
            else:
                if not 0 <= info.fd_index < len(fds):
                    raise PoolError(f"{self.model} {name} pool: fd_index {info.fd_index} but "
                                    f"{len(fds)} fds came with the response")
                tensor = self._tensors[name]
                nbytes = tensor.numel() * tensor.element_size()
                if os.fstat(fds[info.fd_index]).st_size < nbytes:
                    raise PoolError(f"{self.model} {name} pool: the new memfd is too small")
                map_fixed_shared(tensor.data_ptr(), nbytes, fds[info.fd_index])
            self.infos[name] = info
        self.generation = -1
        self.update(result, fds)

    # -- pools ----------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._tensors is None

    def pool(self, name: str) -> torch.Tensor:
        """The whole tensor of pool ``name`` ('full' or 'swa')."""
        if self._tensors is None:
            raise PoolError(f"{self.model}: the attached pools are closed")
        try:
            return self._tensors[name]
        except KeyError:
            raise PoolError(f"pool: {self.model} has no {name!r} pool") from None

    @property
    def full(self) -> torch.Tensor:
        return self.pool("full")

    @property
    def swa(self) -> torch.Tensor | None:
        if self._tensors is None:
            raise PoolError(f"{self.model}: the attached pools are closed")
        return self._tensors.get("swa")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.infos)

    def num_layers(self, pool: str = "full") -> int:
        return int(self.pool(pool).shape[0])

    def num_pages(self, pool: str = "full") -> int:
        return int(self.pool(pool).shape[2])

    @property
    def page_size(self) -> int:
        return int(self.full.shape[3])

    def _layer(self, pool: str, layer: int) -> torch.Tensor:
        t = self.pool(pool)
        if not 0 <= layer < t.shape[0]:
            raise PoolError(f"layer: {layer} out of range for the {pool} pool "
                            f"({t.shape[0]} layers)")
        return t[layer]

    def k(self, pool: str, layer: int) -> torch.Tensor:
        """K of one layer of ``pool``: a contiguous ``[pages, page_size, kv_heads, head_dim]``."""
        return self._layer(pool, layer)[0]

    def v(self, pool: str, layer: int) -> torch.Tensor:
        """V of one layer of ``pool``: a contiguous ``[pages, page_size, kv_heads, head_dim]``."""
        return self._layer(pool, layer)[1]

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Drop this object's references to the pools; idempotent."""
        self._tensors = None
        self._regions = {}

    def __enter__(self) -> AttachedPools:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._tensors is None:
            return f"<AttachedPools {self.model} closed>"
        parts = ", ".join(f"{name}={list(t.shape)} {t.dtype} {t.device}"
                          for name, t in self._tensors.items())
        return f"<AttachedPools {self.model}: {parts}>"


def map_listed_segments(model: str, regions: Mapping[str, SegmentedRegion],
                        mapped: dict[tuple[str, int], int], segments: Sequence[Any],
                        fds: Sequence[int]) -> None:
    """Bring ``mapped`` ((pool, segment) -> epoch mapped here) to the ``segments`` a response
    lists (:class:`~radixd_client.protocol.SegmentInfo`): map those that are new or have a new
    epoch, put private zeros where a segment no longer listed was. For ``attach`` and
    ``kv_attach`` alike; ``fds`` are not closed here."""
    listed: dict[tuple[str, int], tuple[int, int]] = {}
    for seg in segments:
        if seg.pool not in regions:
            raise PoolError(f"{model}: segment {seg.index} of the {seg.pool!r} pool, which is "
                            "not segmented")
        if not 0 <= seg.fd_index < len(fds):
            raise PoolError(f"{model} {seg.pool} segment {seg.index}: fd_index "
                            f"{seg.fd_index} but {len(fds)} fds came with the response")
        listed[(seg.pool, seg.index)] = (seg.epoch, fds[seg.fd_index])
    for key in [k for k in mapped if k not in listed]:
        regions[key[0]].unmap_segment(key[1])
        del mapped[key]
    for key, (epoch, fd) in listed.items():
        if mapped.get(key) != epoch:
            regions[key[0]].map_segment(key[1], fd)
            mapped[key] = epoch


def models_to_update(req: Any, value: Any, attached: Mapping[str, Any],
                     field: str = "segments_gen") -> list[str]:
    """The models whose attached pools a call's result says are out of date: it names a segment
    generation above theirs (for a batch, ``value`` is its ``(ok, result)`` outcomes in the
    order of ``req.ops``). The clients attach those again before returning (protocol.md 4.3).
    ``field``: ``segments_gen`` for device pools (``attach``), ``host_segments_gen`` for host
    pools (``kv_attach``)."""
    if not attached:
        return []
    pairs = (zip(req.ops, (v for _ok, v in value), strict=False)
             if isinstance(value, list) else ((req, value),))
    out: list[str] = []
    for r, v in pairs:
        model = getattr(r, "model", "")
        pools = attached.get(model)
        if (pools is not None and model not in out
                and pools.needs_update(getattr(v, field, 0))):
            out.append(model)
    return out


def segments_to_follow(req: Any, value: Any, attached: Mapping[str, Any],
                       kv_attached: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(op, model)`` for each mapping a call's result says is behind: ``("attach", model)``
    for device pools, ``("kv_attach", model)`` for host pools (:func:`models_to_update`)."""
    return ([("attach", m) for m in models_to_update(req, value, attached)]
            + [("kv_attach", m)
               for m in models_to_update(req, value, kv_attached, "host_segments_gen")])


#: what a follow-up attach raises as it is, not as ``SegmentsNotMapped``: the session, and what
#: the call took with it, is gone (``ConnectFailed``: a reconnect the daemon did not answer in
#: time), so the result it would carry names nothing the caller could give back
SESSION_GONE = (ConnectionLost, ShuttingDown, ConnectFailed)


def segments_not_mapped(op: str, attach_op: str, model: str, value: Any,
                        err: BaseException) -> SegmentsNotMapped:
    """The error for a call whose follow-up ``attach_op`` of ``model`` failed: it carries the
    call's result (``value``), which the daemon has applied, so that nothing it took is lost."""
    return SegmentsNotMapped(
        f"{op} was carried out, but the new pool segments of {model!r} its result names could "
        f"not be mapped here ({attach_op}: {type(err).__name__}: {err}): the pages in them are "
        "not usable in this process; give back what the call took (this error's result)",
        details={"models": [model], "op": attach_op}, result=value)


def attach_pools(model: str, result: AttachResult, fds: Sequence[int]) -> AttachedPools:
    """Map every pool of an ``attach`` response. ``fds`` are the descriptors that came with the
    frame; they are not closed here (the caller closes them, mapped or not)."""
    tensors: dict[str, Any] = {}
    infos: dict[str, PoolInfo] = {}
    regions: dict[str, SegmentedRegion] = {}
    for info in result.pools:
        if info.pool in infos:
            raise PoolError(f"{model}: the daemon sent the {info.pool!r} pool twice")
        if info.kind == "memfd_segments":
            dtype, shape, _nbytes = _check_description(info.description, "memfd_segments")
            if result.segment_pages < 1:
                raise PoolError(f"{model} {info.pool} pool: segmented, but segment_pages is "
                                f"{result.segment_pages}")
            region = regions[info.pool] = SegmentedRegion(
                shape, DTYPE_ITEMSIZE[info.description["dtype"]], result.segment_pages)
            tensor = region.tensor(dtype)
        elif info.kind == "memfd":
            if not 0 <= info.fd_index < len(fds):
                raise PoolError(f"{model} {info.pool} pool: fd_index {info.fd_index} but "
                                f"{len(fds)} fds came with the response")
            tensor = map_pool_fd(fds[info.fd_index], info.description)
        elif info.kind == "cuda_ipc":
            tensor = open_cuda_ipc(info)
        else:
            raise PoolError(f"{model} {info.pool} pool: unknown kind {info.kind!r} (this client "
                            "knows 'memfd' and 'cuda_ipc')")
        if list(tensor.shape) != list(info.shape) or str(tensor.dtype) != f"torch.{info.dtype}":
            raise PoolError(f"{model} {info.pool} pool: shape/dtype {list(info.shape)} "
                            f"{info.dtype} disagree with its description "
                            f"{list(tensor.shape)} {tensor.dtype}")
        tensors[info.pool] = tensor
        infos[info.pool] = info
    pools = AttachedPools(model, tensors, infos, regions)
    pools.update(result, fds)
    return pools



def attach_or_update(attached: dict[str, AttachedPools], model: str, result: AttachResult,
                     fds: Sequence[int]) -> AttachedPools:
    """The pools of an ``attach`` response: a model attached before keeps its tensors, updated
    in place (segments mapped or dropped), so an engine's views stay valid; ``fds`` are not
    closed here."""
    pools = attached.get(model)
    if pools is not None and not pools.closed:
        pools.update(result, fds)
        return pools
    pools = attached[model] = attach_pools(model, result, fds)
    return pools

# ---------------------------------------------------------------------------- host pools

class KvHostPools:
    """The host (L2) pools of one model as ``kv_attach`` maps them, for the key-addressed store.

    ``full`` and ``swa`` (None when the model has no SWA host pool) are ``torch.uint8`` tensors
    ``[slots, page_nbytes]`` over the daemon's own host memory: row ``s`` is the slot ``s`` that
    ``kv_lookup`` and ``kv_reserve`` name. Slot 0 is reserved: never write it.
    ``page_nbytes`` maps each pool kind to its page size in bytes.

    Segmented host pools (kind ``memfd_segments``: the daemon isolates tenants in memory) map
    only the segments of this session's namespace; every other slot reads private zeros and a
    write to it reaches no one. A result whose ``host_segments_gen`` is above
    :attr:`generation` names slots of segments not mapped here: ``kv_attach`` again (the clients
    do it by themselves) maps them in place (:meth:`update`), so the tensors stay valid.
    """

    def __init__(self, model: str, tensors: Mapping[str, torch.Tensor],
                 infos: Mapping[str, Any],
                 regions: Mapping[str, SegmentedRegion] | None = None) -> None:
        if "full" not in tensors:
            raise PoolError(f"{model}: the daemon sent no full host pool")
        self.model = model
        self.infos: dict[str, Any] = dict(infos)
        self.full: torch.Tensor = tensors["full"]
        self.swa: torch.Tensor | None = tensors.get("swa")
        self.page_nbytes: dict[str, int] = {k: int(t.shape[1]) for k, t in tensors.items()}
        self._regions: dict[str, SegmentedRegion] = dict(regions or {})
        #: (pool, segment) -> epoch of each host segment mapped here
        self.segments: dict[tuple[str, int], int] = {}
        #: the namespace's host segment generation these mappings reflect
        self.generation = 0
        self.closed = False

    def pool(self, kind: str) -> torch.Tensor:
        if self.closed:
            raise PoolError(f"{self.model}: these host pools are closed (the daemon restarted: "
                            "kv_attach again)")
        t = self.full if kind == "full" else self.swa if kind == "swa" else None
        if t is None:
            raise PoolError(f"{self.model}: no {kind!r} host pool")
        return t

    def needs_update(self, host_segments_gen: int) -> bool:
        """Whether a result's ``host_segments_gen`` names segments not mapped here."""
        return bool(self._regions) and not self.closed and host_segments_gen > self.generation

    def update(self, result: KvAttachResult, fds: Sequence[int]) -> None:
        """Map the host segments a ``kv_attach`` response lists, in place; ``fds`` are not
        closed here."""
        map_listed_segments(self.model, self._regions, self.segments, result.segments, fds)
        self.generation = result.generation

    def close(self) -> None:
        """Stop following segments; the tensors stay valid for as long as they are held."""
        self.closed = True
        self._regions = {}

    def __repr__(self) -> str:
        shapes = {"full": self.full, "swa": self.swa}
        return f"<KvHostPools {self.model}: " + ", ".join(
            f"{k}={n}B x {t.shape[0]}" for k, n in self.page_nbytes.items()
            if (t := shapes.get(k)) is not None) + (" closed" if self.closed else "") + ">"


def attach_host_pools(model: str, result: KvAttachResult, fds: Sequence[int],
                      attached: dict[str, KvHostPools] | None = None) -> KvHostPools:
    """Map every host pool of a ``kv_attach`` response; ``fds`` are not closed here. With
    ``attached`` (the client's), a model mapped before keeps its tensors, updated in place."""
    import torch

    old = attached.get(model) if attached is not None else None
    if old is not None and not old.closed and old._regions:
        old.update(result, fds)
        return old
    tensors: dict[str, Any] = {}
    infos: dict[str, Any] = {}
    regions: dict[str, SegmentedRegion] = {}
    for info in result.pools:
        if info.pool in infos:
            raise PoolError(f"{model}: the daemon sent the {info.pool!r} host pool twice")
        if info.slots < 1 or info.page_nbytes < 1 or info.nbytes != info.slots * info.page_nbytes:
            raise PoolError(f"{model} {info.pool} host pool: {info.slots} slots x "
                            f"{info.page_nbytes} B disagree with nbytes {info.nbytes}")
        if info.kind == "memfd_segments":
            if result.segment_pages < 1:
                raise PoolError(f"{model} {info.pool} host pool: segmented, but segment_pages "
                                f"is {result.segment_pages}")
            region = regions[info.pool] = SegmentedRegion(
                (1, 1, info.slots, info.page_nbytes), 1, result.segment_pages)
            tensors[info.pool] = region.tensor(torch.uint8).view(info.slots, info.page_nbytes)
        elif info.kind == "memfd":
            if not 0 <= info.fd_index < len(fds):
                raise PoolError(f"{model} {info.pool} host pool: fd_index {info.fd_index} but "
                                f"{len(fds)} fds came with the response")
            tensors[info.pool] = _map_fd(fds[info.fd_index], info.nbytes, torch.uint8,
                                         (info.slots, info.page_nbytes))
        else:
            raise PoolError(f"{model} {info.pool} host pool: unknown kind {info.kind!r} (this "
                            "client knows 'memfd' and 'memfd_segments')")
        infos[info.pool] = info
    pools = KvHostPools(model, tensors, infos, regions)
    pools.update(result, fds)
    if attached is not None:
        attached[model] = pools
    return pools
