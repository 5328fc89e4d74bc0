"""Page hashes: the one key scheme every tier and every engine agrees on.

Hash i = SHA-256(hash i-1 || tokens of page i as int32 little-endian), seeded per namespace and
model layout, so one 32-byte value names a whole prefix and two namespaces never share a key.
Only the daemon computes these (other systems broke on engines computing them differently).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable

HASH_BYTES = 32
_SEED_TAG = b"radixd-namespace-v1"

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("radixd stores token ids as little-endian int32: it needs a "
                      "little-endian host")


def namespace_seed(namespace: str, layout_fingerprint: bytes) -> bytes:
    """The chain seed of a namespace: length-tagged so no two (namespace, layout) pairs collide."""
    ns = namespace.encode("utf-8")
    h = hashlib.sha256(_SEED_TAG)
    for field in (ns, layout_fingerprint):
        h.update(len(field).to_bytes(4, "little"))
        h.update(field)
    return h.digest()


def chain_hashes(prev: bytes, tokens: bytes, page_bytes: int) -> bytes:
    """Hashes of consecutive whole pages of ``tokens``, chained from ``prev``, concatenated."""
    out = bytearray()
    h = prev
    sha = hashlib.sha256
    for off in range(0, len(tokens) - page_bytes + 1, page_bytes):
        h = sha(h + tokens[off : off + page_bytes]).digest()
        out += h
    return bytes(out)


def as_token_bytes(tokens: bytes | bytearray | memoryview | Iterable[int]) -> bytes:
    """Token ids as the int32 little-endian bytes the tree stores and compares.

    Buffers are taken as already encoded (that is how they travel on the wire); anything else is
    treated as a sequence of ints and must fit in int32.
    """
    if isinstance(tokens, bytes):
        return tokens
    if isinstance(tokens, (bytearray, memoryview)):
        return bytes(tokens)
    try:
        return array("i", tokens).tobytes()
    except OverflowError as exc:
        raise ValueError("token ids must fit in int32") from exc
