"""The byte format of a run of pages stored outside the daemon (the L3 value).

One value is one or more consecutive whole pages of one pool (full or SWA), all layers, page by
page, preceded by a fixed header so that a reader can prove the bytes are what it asked for before
using them::

    offset size  field
    0      4     magic b"RXP1"
    4      2     format version (u16, currently 1)
    6      1     pool kind (0 = full, 1 = swa)
    7      1     flags (0: a tree page; 1 = KEYED: a keyed page, see below; others refused)
    8      4     tokens: the value's token count, n * page_size for n pages (u32); KEYED: the
                 key's length in bytes
    12     8     payload length in bytes (u64)
    20     32    layout fingerprint (ModelProfile.layout_fingerprint())
    52     32    page hash (the chain hash that names the prefix ending with the last page)
    84     4     checksum (u32, CRC-32 of bytes 0..84, the tokens and the payload)
    88     4*tokens   the token ids, int32 little-endian
    ...    payload length  the payload (n pages, each all layers, page-first)

The daemon stores a full-pool value as a run of the pages of one hash block (the tiers' L3 runs),
so that a value holds at least 64 tokens when the pages are smaller; with pages of 64 tokens or
more a run is one page. The codec itself does not care how many pages a value holds: the caller
knows its page size and checks the payload length against it.

A **keyed page** (the key-addressed store, daemon/keyed_tier.py) has flag KEYED: its header
carries the engine's key (1..128 bytes) where a tree page carries its tokens, the page hash field
names the keyed page's L3 identity, and the checksum covers the key instead of the tokens. A
reader expecting one kind refuses the other, and a keyed value whose key differs from the one
asked for is refused (``decode_page(..., expect_key=...)``).

All integers are little-endian. The value is self-describing: one key, one round trip, atomic under
Redis eviction (no metadata key that can outlive its payload, the race two-key layouts have).

Checksum choice: ``zlib.crc32`` (the stdlib's fastest integrity function; zlib >= 1.2.12 computes
it with a braided, table-driven loop at several GB/s, far above what redis-py moves per core, so it
is never the bottleneck; see ``bench()``). CRC-32 detects every error burst of 32 bits or fewer,
so any single corrupted byte anywhere in the value is *guaranteed* to be caught, and random
multi-byte corruption escapes with probability 2**-32. It guards against storage/transport
corruption and bugs, not against an adversary who can write to Redis (that is what Redis ACLs and
TLS are for); the cryptographic identity of the content is the page hash itself, which the header
must match. The header fields are covered too, so a flipped length or pool byte is caught even
when it happens to stay plausible.

Encoding copies the payload exactly once (into the joined value); decoding copies nothing: the
returned payload is a memoryview into the value the caller read from Redis.
"""

from __future__ import annotations

import struct
import sys
import time
import zlib
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

MAGIC = b"RXP1"
FORMAT_VERSION = 1
#: Flag of a keyed page: the bytes after the header are its key, not tokens.
FLAG_KEYED = 0x01
FINGERPRINT_BYTES = 32
HASH_BYTES = 32

POOL_FULL = "full"
POOL_SWA = "swa"
_POOL_CODES = {POOL_FULL: 0, POOL_SWA: 1}
_POOL_NAMES = {code: name for name, code in _POOL_CODES.items()}

# Everything before the checksum, then the checksum; the tokens and the payload follow.
_PRE = struct.Struct("<4sHBBIQ32s32s")
_CRC = struct.Struct("<I")
HEADER_BYTES = _PRE.size + _CRC.size  # 88
#: What ``encode_page`` takes as a page's bytes (any C-contiguous buffer does: a numpy array too).
PagePayload = bytes | bytearray | memoryview

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("radixd stores token ids as little-endian int32: it needs a "
                      "little-endian host")


class CorruptPage(ValueError):
    """A stored page value failed verification; ``reason`` says which check."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class PageValue:
    """A verified page read back from a tier. ``payload`` is a view into the stored value."""

    pool: str
    token_count: int  # the header's count: n * page_size for a run of n pages (keyed: key bytes)
    fingerprint: bytes
    page_hash: bytes
    tokens: bytes  # int32 little-endian, token_count of them (a keyed page: its key)
    payload: memoryview
    keyed: bool = False

    def token_ids(self) -> list[int]:
        return list(memoryview(self.tokens).cast("i"))


def _token_bytes(tokens: bytes | bytearray | memoryview | Iterable[int]) -> bytes:
    if isinstance(tokens, bytes):
        return tokens
    if isinstance(tokens, (bytearray, memoryview)):
        return bytes(memoryview(tokens).cast("B"))
    try:
        return array("i", tokens).tobytes()
    except OverflowError as exc:
        raise ValueError("token ids must fit in int32") from exc


def pool_code(pool: str) -> int:
    try:
        return _POOL_CODES[pool]
    except KeyError:
        raise ValueError(f"unknown pool kind {pool!r} (expected 'full' or 'swa')") from None


def encode_page(
    *,
    pool: str,
    page_hash: bytes,
    fingerprint: bytes,
    tokens: bytes | bytearray | memoryview | Iterable[int] = b"",
    payload: PagePayload | Sequence[PagePayload],
    key: bytes | None = None,
) -> bytes:
    """One stored value: header + tokens + payload, the payload copied once (by the join).

    ``tokens`` is the value's token ids, either already encoded as int32 little-endian bytes (how
    the tree keeps them) or a sequence of ints; the header's token count is their number (one
    page's, or a run of whole pages'). ``payload`` is any C-contiguous buffer (bytes, a
    memoryview, a numpy array of a host page), or a list of them: the pages of a run, joined in
    order without an intermediate copy.
    """
    code = pool_code(pool)
    if len(page_hash) != HASH_BYTES:
        raise ValueError(f"page_hash must be {HASH_BYTES} bytes, got {len(page_hash)}")
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    if key is not None:  # a keyed page: the key where the tokens go
        if not 1 <= len(key) <= 128:
            raise ValueError(f"key must be 1..128 bytes, got {len(key)}")
        tok, flags, count = bytes(key), FLAG_KEYED, len(key)
    else:
        tok = _token_bytes(tokens)
        if len(tok) % 4:
            raise ValueError("token bytes must be a whole number of int32")
        flags, count = 0, len(tok) // 4
    views = [_byte_view(p) for p in (payload if isinstance(payload, (list, tuple))
                                     else (payload,))]
    pre = _PRE.pack(MAGIC, FORMAT_VERSION, code, flags, count, sum(v.nbytes for v in views),
                    bytes(fingerprint), bytes(page_hash))
    crc = zlib.crc32(tok, zlib.crc32(pre))
    for v in views:
        crc = zlib.crc32(v, crc)
    return b"".join((pre, _CRC.pack(crc), tok, *views))


def _byte_view(payload: PagePayload) -> memoryview:
    view = memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("payload must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def peek_header(value: bytes | memoryview) -> tuple[str, bytes]:
    """(pool, page_hash) of an encoded value, without verifying it (used to name its key)."""
    if len(value) < HEADER_BYTES:
        raise CorruptPage("truncated")
    magic, version, code, _flags, _ps, _plen, _fp, page_hash = _PRE.unpack_from(value, 0)
    if magic != MAGIC:
        raise CorruptPage("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptPage(f"unsupported version {version}")
    if code not in _POOL_NAMES:
        raise CorruptPage(f"unknown pool code {code}")
    return _POOL_NAMES[code], page_hash


def decode_page(
    value: bytes | memoryview,
    expect_hash: bytes,
    expect_fingerprint: bytes,
    expect_pool: str,
    expect_key: bytes | None = None,
) -> PageValue:
    """Verify ``value`` completely and return it as a PageValue; CorruptPage on any mismatch.

    ``expect_key``: the value must be a keyed page of exactly this key (None: a tree page)."""
    expect_code = pool_code(expect_pool)
    mv = memoryview(value)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    n = mv.nbytes
    if n < HEADER_BYTES:
        raise CorruptPage("truncated")
    magic, version, code, flags, count, plen, fingerprint, page_hash = _PRE.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptPage("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptPage(f"unsupported version {version}")
    if flags & ~FLAG_KEYED:
        raise CorruptPage(f"unknown flags {flags:#x}")
    if bool(flags & FLAG_KEYED) != (expect_key is not None):
        raise CorruptPage("wrong page kind (a keyed page and a tree page are not each other)")
    if code != expect_code:
        raise CorruptPage(f"wrong pool (stored code {code}, expected {expect_pool})")
    tok_end = HEADER_BYTES + (count if flags & FLAG_KEYED else 4 * count)
    if n != tok_end + plen:
        kind = "truncated" if n < tok_end + plen else "length mismatch"
        raise CorruptPage(f"{kind} (value {n} bytes, header says {tok_end + plen})")
    if fingerprint != expect_fingerprint:
        raise CorruptPage("wrong layout fingerprint")
    if page_hash != expect_hash:
        raise CorruptPage("wrong page hash")
    (stored_crc,) = _CRC.unpack_from(mv, _PRE.size)
    tokens = mv[HEADER_BYTES:tok_end]
    payload = mv[tok_end:]
    crc = zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(mv[: _PRE.size])))
    if crc != stored_crc:
        raise CorruptPage("checksum mismatch")
    if expect_key is not None and tokens != expect_key:
        raise CorruptPage("wrong key")
    return PageValue(
        pool=expect_pool,
        token_count=count,
        fingerprint=fingerprint,
        page_hash=page_hash,
        tokens=tokens.tobytes(),
        payload=payload,
        keyed=expect_key is not None,
    )


def bench(payload_bytes: int = 1 << 20, seconds: float = 0.5) -> dict[str, float]:
    """Print and return encode/decode throughput (GB/s of payload) for one page value."""
    payload = bytes(range(256)) * (payload_bytes // 256) + bytes(payload_bytes % 256)
    h = bytes(range(32))
    fp = bytes(range(32, 64))
    tokens = list(range(64))

    def rate(fn: Callable[[], object]) -> float:
        fn()
        n = 0
        t0 = time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= seconds:
                return n * payload_bytes / dt / 1e9

    value = encode_page(pool=POOL_FULL, page_hash=h, fingerprint=fp, tokens=tokens,
                        payload=payload)
    out = {
        "payload_bytes": float(payload_bytes),
        "encode_gbps": rate(lambda: encode_page(pool=POOL_FULL, page_hash=h, fingerprint=fp,
                                                tokens=tokens, payload=payload)),
        "decode_gbps": rate(lambda: decode_page(value, h, fp, POOL_FULL)),
        "crc32_gbps": rate(lambda: zlib.crc32(payload)),
        "memcpy_gbps": rate(lambda: bytearray(payload)),
    }
    for k, v in out.items():
        print(f"{k:>14}: {v:.2f}" if k != "payload_bytes" else f"{k:>14}: {int(v)}")
    return out


if __name__ == "__main__":
    bench()
