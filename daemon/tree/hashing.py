"""Content keys: the one key scheme every tier and every engine agrees on.

The chain runs over *blocks* of whole pages, at least ``HASH_BLOCK_TOKENS`` tokens each
(``block_pages``): block hash b = SHA-256(block hash b-1 || tokens of block b as int32
little-endian), seeded per namespace and model layout, so one 32-byte value names a whole prefix
and two namespaces never share a key. The tree stores one hash per block, not per page: at a page
of one token a per-page chain would cost a SHA-256 and 32 bytes per token on every insert.

The host and Redis tiers still name each page, by its *page key*: SHA-256 of the previous block's
hash and the tokens from the block's start to the page's end. The key of a block's last page is
the block hash itself, so with pages of 64 tokens or more (one page a block) page keys and block
hashes are the same chain. A page key names exactly the prefix up to its page's end, like the
block hash, and is derived only where a tier needs it.

Only the daemon computes these (other systems broke on engines computing them differently).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable

HASH_BYTES = 32
#: the least number of tokens one chained hash covers (a block is this rounded up to whole pages)
HASH_BLOCK_TOKENS = 64
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


def block_pages(page_size: int, block_tokens: int = HASH_BLOCK_TOKENS) -> int:
    """Pages in one hash block: the fewest whole pages that hold ``block_tokens`` tokens."""
    return max(1, -(-block_tokens // page_size))


def block_hashes(prev: bytes, carry: bytes, tokens: bytes, block_bytes: int) -> bytes:
    """Hashes of the blocks that ``tokens`` completes, concatenated.

    ``prev`` is the hash of the last complete block before ``tokens`` (the namespace seed at the
    root) and ``carry`` the token bytes between that block's end and ``tokens`` (shorter than a
    block): the chain state at the point where ``tokens`` starts.
    """
    data = carry + tokens if carry else tokens
    out: list[bytes] = []
    keep = out.append
    h = prev
    sha = hashlib.sha256
    for off in range(0, len(data) - block_bytes + 1, block_bytes):
        h = sha(h + data[off : off + block_bytes]).digest()
        keep(h)
    return b"".join(out)


def page_keys(prev: bytes, carry: bytes, tokens: bytes, page_bytes: int, block_bytes: int
              ) -> tuple[list[bytes], bytes, bytes]:
    """The page key of every whole page of ``tokens``, and the chain state after them.

    ``prev`` and ``carry`` are the chain state where ``tokens`` starts, as for
    :func:`block_hashes`; the result's last two items are the state where the pages end.
    """
    keys: list[bytes] = []
    sha = hashlib.sha256
    end = len(tokens) - len(tokens) % page_bytes
    if block_bytes == page_bytes and not carry:
        h = prev
        for off in range(0, end, page_bytes):
            h = sha(h + tokens[off : off + page_bytes]).digest()
            keys.append(h)
        return keys, h, b""
    run = sha(prev + carry)
    filled = len(carry)
    start = 0  # where the current block's bytes in ``tokens`` begin
    for off in range(0, end, page_bytes):
        run.update(tokens[off : off + page_bytes])
        filled += page_bytes
        if filled == block_bytes:
            prev = run.digest()
            keys.append(prev)
            run = sha(prev)
            filled = 0
            start = off + page_bytes
        else:
            keys.append(run.copy().digest())
    if filled == 0:
        return keys, prev, b""
    return keys, prev, (carry + tokens[:end] if start == 0 else tokens[start:end])


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
