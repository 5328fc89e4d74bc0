"""The radixd wire protocol: the one definition, shared by the daemon and every Python client.

Framing: a Unix stream socket carries frames; a frame is a 4-byte unsigned little-endian body
length, then the body. A body is one MessagePack map. Requests carry ``op`` (the operation) and
``id`` (chosen by the client, echoed in the response, so requests can be pipelined); responses are
``{"id", "ok": true, "result": {...}}`` or ``{"id", "ok": false, "error": {"code", "message",
"details"}}``. Token arrays and page-id arrays travel as MessagePack ``bin`` holding little-endian
int32 values, never as arrays of numbers. See docs/protocol.md for the full specification.

This module imports nothing but msgspec and the standard library: no torch, no daemon code.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any, Union

import msgspec

PROTOCOL_VERSION = 1
HEADER = struct.Struct("<I")
HEADER_SIZE = HEADER.size
DEFAULT_MAX_FRAME = 16 * 1024 * 1024


# ---------------------------------------------------------------------------- error codes

class Code:
    """Stable error codes (the ``error.code`` string of a failed response)."""

    BAD_FRAME = "bad_frame"  # the body is not a valid request (undecodable, wrong types)
    FRAME_TOO_LARGE = "frame_too_large"  # the length prefix exceeds max_frame_bytes
    UNKNOWN_OP = "unknown_op"
    BAD_ARGUMENT = "bad_argument"  # well-formed but invalid (lengths, alignment, ranges)
    NOT_AUTHENTICATED = "not_authenticated"  # an operation before a successful hello
    AUTH_FAILED = "auth_failed"  # wrong or missing tenant token, or peer not allowed
    VERSION_UNSUPPORTED = "version_unsupported"
    ALREADY_AUTHENTICATED = "already_authenticated"
    UNKNOWN_MODEL = "unknown_model"
    MODEL_NOT_ALLOWED = "model_not_allowed"  # the tenant may not use this model
    UNKNOWN_NODE = "unknown_node"
    NODE_NOT_USABLE = "node_not_usable"  # its sliding window was evicted: match again
    BAD_RECEIPT = "bad_receipt"  # not this session's, already released, never taken
    PAGE_NOT_HELD = "page_not_held"  # a page id this session does not hold
    BAD_PAGE = "bad_page"  # a page id outside the pool
    OUT_OF_MEMORY = "out_of_memory"  # details: available/evictable/locked/held per pool
    QUOTA_EXCEEDED = "quota_exceeded"  # details: pool, limit, requested, over
    TOO_MANY_TOKENS = "too_many_tokens"  # details: limit
    TOO_MANY_INFLIGHT = "too_many_inflight"  # a batch longer than max_inflight; details: limit
    TOO_MANY_SESSIONS = "too_many_sessions"  # the daemon serves max_sessions already
    TOO_MANY_LOCKS = "too_many_locks"  # the session holds max_locks_per_session receipts
    NOT_EXECUTED = "not_executed"  # a batch item skipped after an earlier one failed
    SHUTTING_DOWN = "shutting_down"  # the daemon is stopping; reconnect to its successor
    INTERNAL = "internal"  # a daemon bug; the cache stays consistent and the session survives


ALL_CODES = tuple(v for k, v in vars(Code).items() if not k.startswith("_"))


# ---------------------------------------------------------------------------- requests

class Request(msgspec.Struct, tag_field="op", kw_only=True, omit_defaults=True):
    # chosen by the client and echoed in the response; 0 is reserved: the daemon answers with
    # id 0 when it cannot read a request's id (an undecodable body, an oversize frame)
    id: int = 0


class Hello(Request, tag="hello", omit_defaults=False):
    # Every field is sent, the version above all: were it omitted as a default, a later protocol
    # with another default would read an old client as speaking the new version.
    version: int = PROTOCOL_VERSION
    token: str | None = None
    client: str = ""


class Ping(Request, tag="ping"):
    payload: bytes = b""


class Attach(Request, tag="attach"):
    model: str


class Match(Request, tag="match"):
    model: str
    tokens: bytes
    lock: bool = False


class Lock(Request, tag="lock"):
    model: str
    node: int


class Unlock(Request, tag="unlock"):
    model: str
    receipt: int


class ReleaseSwa(Request, tag="release_swa"):
    model: str
    receipt: int


class Alloc(Request, tag="alloc"):
    model: str
    n: int


class Free(Request, tag="free"):
    model: str
    full_pages: bytes = b""
    swa_pages: bytes = b""


class _Computed(Request):
    """The fields of every request that hands computed pages to the tree (not an operation)."""

    model: str
    tokens: bytes
    full_pages: bytes
    swa_pages: bytes = b""
    prev_prefix_len: int = 0
    swa_evicted_len: int = 0


class Insert(_Computed, tag="insert"):
    lock: bool = False


class CacheUnfinished(_Computed, tag="cache_unfinished"):
    receipt: int | None = None


class CacheFinished(_Computed, tag="cache_finished"):
    receipt: int | None = None


class Evict(Request, tag="evict"):
    model: str
    full_pages: int = 0
    swa_pages: int = 0
    host_pages: int = 0  # host (L2) copies to drop (with L3 write_back they go to Redis first)


class Stats(Request, tag="stats"):
    model: str | None = None


class Load(Request, tag="load"):
    """Host (L2) copies of the matched path back to device; answered once the data is there."""

    model: str
    tokens: bytes
    lock: bool = False


PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


class Prefetch(Request, tag="prefetch"):
    """Pages of ``tokens`` that only L3 (Redis) holds, fetched into L2 (host)."""

    model: str
    tokens: bytes
    policy: str = "best_effort"  # one of PREFETCH_POLICIES
    timeout_ms: int = 0  # policy "timeout": the wait; 0 takes the daemon's prefetch_timeout_ms


# ---- the key-addressed page store (docs/protocol.md, "Keyed pages")

#: Pool kinds of a keyed page; "swa" only on a model with an SWA host pool.
KV_POOLS = ("full", "swa")
#: Length bounds of a keyed page's key, in bytes.
KV_KEY_MIN, KV_KEY_MAX = 1, 128
#: Most keys one kv_lookup or kv_reserve may name (docs/protocol.md 9.4).
KV_MAX_KEYS = 65536


class KvAttach(Request, tag="kv_attach"):
    """Map the model's host (L2) pools: their memfds come with the response (SCM_RIGHTS)."""

    model: str


class KvLookup(Request, tag="kv_lookup"):
    """Which keys the store holds (and their slots); with ``pin``, the slots stay put."""

    model: str
    keys: list[bytes]
    pool: str = "full"
    pin: bool = True
    fetch: bool = False  # first bring keys only Redis (L3) holds into host
    timeout_ms: int = 0  # fetch: the wait; 0 takes the daemon's prefetch_timeout_ms


class KvReserve(Request, tag="kv_reserve"):
    """Fresh host slots for the keys not stored yet, to write and then ``kv_commit``."""

    model: str
    keys: list[bytes]
    pool: str = "full"


class KvCommit(Request, tag="kv_commit"):
    model: str
    pin: int


class KvRelease(Request, tag="kv_release"):
    model: str
    pin: int


class KvClear(Request, tag="kv_clear"):
    model: str


# operations allowed inside a batch (everything but hello, attach, kv_attach, load, prefetch,
# kv_lookup with fetch, and batch itself)
BatchOp = Union[  # noqa: UP007 - msgspec needs a real Union of tagged structs
    Ping, Match, Lock, Unlock, ReleaseSwa, Alloc, Free, Insert, CacheUnfinished, CacheFinished,
    Evict, Stats, KvLookup, KvReserve, KvCommit, KvRelease, KvClear,
]


class Batch(Request, tag="batch"):
    ops: list[BatchOp]
    stop_on_error: bool = True


AnyRequest = Union[  # noqa: UP007
    Hello, Ping, Attach, Match, Lock, Unlock, ReleaseSwa, Alloc, Free, Insert, CacheUnfinished,
    CacheFinished, Evict, Stats, Load, Prefetch, Batch, KvAttach, KvLookup, KvReserve,
    KvCommit, KvRelease, KvClear,
]

OPS: dict[str, type[Request]] = {
    t.__struct_config__.tag: t for t in AnyRequest.__args__  # type: ignore[attr-defined]
}


# ---------------------------------------------------------------------------- results

class Result(msgspec.Struct, kw_only=True, omit_defaults=False):
    pass


class ModelInfo(Result):
    name: str
    page_size: int
    sliding_window: int | None
    num_full_layers: int
    num_swa_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    full_pages: int
    swa_pages: int
    host_pages: int = 0  # host (L2) pages of its full pool; 0: no host tier (load is a match)
    l3: bool = False  # prefetch can reach Redis (L3) for this model


class Limits(Result):
    max_frame_bytes: int
    max_tokens: int
    max_inflight: int
    # lock receipts per model, and keys pinned or reserved per model (0: not told, a daemon
    # from before it)
    max_locks_per_session: int = 0


class HelloResult(Result):
    session: int
    version: int
    instance: str  # random per daemon start: a change means a restart (remap the pools)
    tenant: str
    namespace: str
    models: list[ModelInfo]
    limits: Limits


class PingResult(Result):
    payload: bytes


class PoolInfo(Result):
    pool: str  # "full" or "swa"
    # "memfd": an fd arrives with the frame (SCM_RIGHTS); "cuda_ipc": see handle;
    # "memfd_segments": one fd per segment, listed in AttachResult.segments (protocol.md 4.3)
    kind: str
    fd_index: int  # index into the fds that came with this frame (-1 if none)
    dtype: str
    shape: list[int]  # [layers, 2, pages, page_size, kv_heads, head_dim]
    nbytes: int
    device: str
    description: dict[str, Any] = {}
    handle: bytes = b""  # cuda_ipc only: an opaque handle (see docs/protocol.md)


class SegmentInfo(Result):
    """One segment of a segmented pool this session may map (docs/protocol.md 4.3)."""

    pool: str  # "full" or "swa"
    index: int  # pages [index * segment_pages, (index + 1) * segment_pages) of that pool
    epoch: int  # grows each time the segment gets fresh memory: a new epoch is a new memfd
    fd_index: int  # index into the fds that came with this frame
    nbytes: int  # size of that memfd


class AttachResult(Result):
    pools: list[PoolInfo]
    segment_pages: int = 0  # 0: pools are not segmented (memory_isolation = "none")
    segments: list[SegmentInfo] = []  # the segments of this session's namespace, now
    generation: int = 0  # segments_gen of the namespace these segments are of


class MatchResult(Result):
    prefix_len: int
    full_pages: bytes
    swa_pages: bytes
    node: int
    full_hit_len: int
    host_hit_len: int
    receipt: int | None = None
    segments_gen: int = 0  # above the attach's generation: attach again (protocol.md 4.3)


class LoadResult(MatchResult):
    loaded_len: int = 0  # tokens of usable prefix this load added (KV copied from host)


class PrefetchResult(Result):
    status: str  # "none" | "started" | "complete" | "timeout" | "unavailable" (L3 off or down)
    l3_hit_len: int  # tokens past what L1/L2 hold that L3 holds (ending on a complete window)
    fetched_len: int  # of those, tokens on host (L2) when this response was sent


class LockResult(Result):
    receipt: int


class Empty(Result):
    pass


class AllocResult(Result):
    full_pages: bytes
    swa_pages: bytes
    segments_gen: int = 0  # above the attach's generation: attach again (protocol.md 4.3)


class InsertResult(Result):
    prefix_len: int
    inserted_len: int
    full_pages: bytes
    swa_pages: bytes
    node: int
    receipt: int | None = None
    segments_gen: int = 0  # above the attach's generation: attach again (protocol.md 4.3)


class EvictResult(Result):
    full_pages: int
    swa_pages: int
    host_pages: int = 0


class KvPoolInfo(Result):
    """One host pool of a model, as ``kv_attach`` maps it: ``slots`` x ``page_nbytes`` bytes."""

    pool: str  # "full" or "swa"
    fd_index: int  # index into the fds that came with this frame; -1 for "memfd_segments"
    slots: int  # slot 0 is reserved (never handed out)
    page_nbytes: int
    nbytes: int  # slots * page_nbytes
    description: dict[str, Any] = {}  # the host pool's own description (dtype, page shape)
    kind: str = "memfd"  # "memfd": one fd, the whole pool; "memfd_segments": see segments


class KvAttachResult(Result):
    pools: list[KvPoolInfo]
    segment_pages: int = 0  # slots per segment; 0: the pools are shared (memory_isolation none)
    segments: list[SegmentInfo] = []  # the host segments of this session's namespace, now
    generation: int = 0  # host_segments_gen of the namespace these segments are of


class KvLookupResult(Result):
    present: bytes  # one byte per key: 1 present, 0 absent
    slots: array  # the slot of each present key, 0 where absent (int32 LE bin on the wire)
    prefix: int  # leading keys present
    pin: int  # 0 when not pinned or nothing present
    fetched: int = 0  # keys brought from Redis (L3) into host by this call
    host_segments_gen: int = 0  # above the kv_attach's generation: kv_attach again


class KvReserveResult(Result):
    slots: array  # a fresh slot per key, 0 where there is nothing to write (int32 LE bin)
    pin: int  # 0 when no slot was reserved
    full: int = 0  # keys that got no slot for want of room or quota (declined, not an error)
    busy: int = 0  # keys another session has reserved and not committed yet (slot 0)
    host_segments_gen: int = 0  # above the kv_attach's generation: kv_attach again


class KvClearResult(Result):
    removed: int
    # Redis has recorded the clear: nothing of before it can be read from there any more (true
    # without Redis). In a batch the answer does not wait for Redis (protocol.md 9.4). None: a
    # daemon from before the field, which does not say
    l3_cleared: bool | None = None


class StatsResult(Result):
    tenant: str
    namespace: str
    models: dict[str, dict[str, int]]


class Error(msgspec.Struct, kw_only=True):
    code: str
    message: str
    details: dict[str, Any] = {}


class BatchItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    ok: bool
    result: msgspec.Raw = msgspec.Raw()
    error: Error | None = None


class BatchResult(Result):
    results: list[BatchItem]


RESULT_TYPES: dict[str, type[Result]] = {
    "hello": HelloResult,
    "ping": PingResult,
    "attach": AttachResult,
    "match": MatchResult,
    "lock": LockResult,
    "unlock": Empty,
    "release_swa": Empty,
    "alloc": AllocResult,
    "free": Empty,
    "insert": InsertResult,
    "cache_unfinished": InsertResult,
    "cache_finished": InsertResult,
    "evict": EvictResult,
    "stats": StatsResult,
    "load": LoadResult,
    "prefetch": PrefetchResult,
    "batch": BatchResult,
    "kv_attach": KvAttachResult,
    "kv_lookup": KvLookupResult,
    "kv_reserve": KvReserveResult,
    "kv_commit": Empty,
    "kv_release": Empty,
    "kv_clear": KvClearResult,
}


class Response(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: int
    ok: bool
    result: msgspec.Raw = msgspec.Raw()
    error: Error | None = None


# ---------------------------------------------------------------------------- codec

def _enc_hook(obj: Any) -> Any:
    """``array('i')`` fields (the keyed store's slots) travel as int32 little-endian ``bin``."""
    if isinstance(obj, array):
        return int32_bytes(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is array and isinstance(obj, (bytes, bytearray)):
        if len(obj) & 3:
            raise ValueError(f"int32 bytes: length {len(obj)} is not a multiple of 4")
        return int32_array(obj)
    raise NotImplementedError(f"cannot decode {kind.__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_request_decoder = msgspec.msgpack.Decoder(AnyRequest)
_response_decoder = msgspec.msgpack.Decoder(Response)
_result_decoders = {op: msgspec.msgpack.Decoder(t, dec_hook=_dec_hook)
                    for op, t in RESULT_TYPES.items()}


def encode(obj: Any) -> bytes:
    """A whole frame (header + body) for any struct or plain mapping."""
    body = _encoder.encode(obj)
    return HEADER.pack(len(body)) + body


def encode_body(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode_request(body: bytes | memoryview) -> AnyRequest:
    """Raises msgspec.DecodeError / msgspec.ValidationError on a malformed request."""
    return _request_decoder.decode(body)


def decode_response(body: bytes | memoryview) -> Response:
    return _response_decoder.decode(body)


def decode_result(op: str, raw: msgspec.Raw | bytes) -> Result:
    return _result_decoders[op].decode(raw)


_OK_ID = b"\x83\xa2id"  # a 3-entry map, then the key "id"
_OK_RESULT = b"\xa2ok\xc3\xa6result"  # "ok": true, then the key "result"


def ok_frame(req_id: int, result: Any) -> bytes:
    """A success frame, assembled around the encoded result (no second encoding pass)."""
    body = b"".join((_OK_ID, _encoder.encode(req_id), _OK_RESULT, _encoder.encode(result)))
    return HEADER.pack(len(body)) + body


def error_frame(req_id: int, code: str, message: str, details: dict[str, Any] | None = None
                ) -> bytes:
    body = _encoder.encode(Response(id=req_id, ok=False,
                                    error=Error(code=code, message=message, details=details or {})))
    return HEADER.pack(len(body)) + body


_BIG_ENDIAN = sys.byteorder == "big"
_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1


def int32_bytes(values: Any) -> bytes:
    """Page ids or token ids as the little-endian int32 bytes the protocol carries.

    Accepts ``bytes``/``bytearray``/``memoryview`` (taken as already-encoded int32 bytes, so their
    length must be a multiple of 4), ``array.array`` of any integer type, 1-D numpy integer arrays,
    1-D torch integer tensors (on any device; copied to the CPU), and any iterable of ints (lists,
    tuples, ranges). ``array('i')`` and int32 numpy arrays/tensors are not converted element by
    element. Floats, bool arrays and multi-dimensional arrays raise ``TypeError``/``ValueError``;
    values outside int32 raise ``OverflowError``. Neither numpy nor torch is imported here.
    """
    cls = type(values)
    if cls is bytes:
        if len(values) & 3:
            raise ValueError(f"int32 bytes: length {len(values)} is not a multiple of 4")
        return values
    if cls is array and values.typecode == "i" and values.itemsize == 4 and not _BIG_ENDIAN:
        return values.tobytes()
    return _int32_bytes_slow(values)


def _int32_bytes_slow(values: Any) -> bytes:
    if isinstance(values, (bytes, bytearray)):
        if len(values) & 3:
            raise ValueError(f"int32 bytes: length {len(values)} is not a multiple of 4")
        return bytes(values)
    if isinstance(values, memoryview):
        if values.itemsize == 1:
            return _int32_bytes_slow(values.tobytes())
        if values.format in ("i", "=i", "<i", "l", "=l", "<l") and values.itemsize == 4 \
                and not _BIG_ENDIAN:
            if values.ndim != 1:
                raise ValueError(f"int32 values: expected 1-D, got {values.ndim}-D memoryview")
            return values.tobytes()
        return _int32_bytes_slow(values.tolist())
    if hasattr(values, "__array_interface__") and hasattr(values, "dtype"):  # numpy
        if values.ndim != 1:
            raise ValueError(f"int32 values: expected a 1-D array, got shape {values.shape}")
        dt = values.dtype
        if dt.str == "<i4":
            return values.tobytes()
        if dt.kind not in "iu":
            raise TypeError(f"int32 values: expected an integer array, got dtype {dt}")
        if values.size and (int(values.min()) < _INT32_MIN or int(values.max()) > _INT32_MAX):
            raise OverflowError("int32 values: a value does not fit in int32")
        return values.astype("<i4").tobytes()
    if hasattr(values, "detach") and hasattr(values, "numpy"):  # torch, imported by the caller
        t = values.detach()
        if t.dim() != 1:
            raise ValueError(f"int32 values: expected a 1-D tensor, got shape {tuple(t.shape)}")
        if t.is_floating_point() or t.is_complex() or str(t.dtype) == "torch.bool":
            raise TypeError(f"int32 values: expected an integer tensor, got {t.dtype}")
        if t.device.type != "cpu":
            t = t.cpu()
        try:
            return _int32_bytes_slow(t.numpy())
        except RuntimeError:  # torch without numpy
            return _int32_bytes_slow(t.tolist())
    if isinstance(values, str):
        raise TypeError("int32 values: expected integers, got a str")
    a = array("i", values)  # always a new array: a big-endian host swaps it below
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tobytes()


def int32_array(data: bytes | bytearray | memoryview) -> array:
    """The int32 values of protocol bytes (page ids, tokens) as an ``array('i')``."""
    a = array("i")
    a.frombytes(data)
    if _BIG_ENDIAN:
        a.byteswap()
    return a


def int32_list(data: bytes) -> list[int]:
    return int32_array(data).tolist()
