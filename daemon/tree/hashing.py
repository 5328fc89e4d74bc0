"""Content keys: the one key scheme every tier and every engine agrees on.

The chain runs over *blocks* of whole pages, at least ``HASH_BLOCK_TOKENS`` tokens each
(``block_pages``): block hash b = SHA-256(block hash b-1 || tokens of block b as int32
little-endian), seeded per namespace and model layout, so one 32-byte value names a whole prefix
and two namespaces never share a key. The tree stores one hash per block, not per page: at a page
of one token a per-page chain would cost a SHA-256 and 32 bytes per token on every insert.

The Redis tier names values by a page's *page key*: SHA-256 of the previous block's hash and the
tokens from the block's start to the page's end. The key of a block's last page is the block hash
itself, so with pages of 64 tokens or more (one page a block) page keys and block hashes are the
same chain. A page key names exactly the prefix up to its page's end, like the block hash, and is
derived only for the pages a tier names (a run's last page, an SWA page); the host tier names
none, since the tree indexes its host copies.

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


def page_keys(prev: bytes, carry: bytes, tokens: bytes, page_bytes: int, block_bytes: int,
              pages: Iterable[int] | None = None) -> list[bytes]:
    """The page keys of the whole pages of ``tokens`` (``pages``: of those page indices only,
    ascending; the keys come back in that order).

    ``prev`` and ``carry`` are the chain state where ``tokens`` starts, as for
    :func:`block_hashes`. The tokens are hashed once; what each key asked for adds is one
    digest, so asking only for the keys a tier publishes (a block's end, a window's pages) is
    what keeps small pages cheap.
    """
    sha = hashlib.sha256
    count = len(tokens) // page_bytes
    if pages is None and block_bytes == page_bytes and not carry:
        keys: list[bytes] = []
        h = prev
        for off in range(0, count * page_bytes, page_bytes):
            h = sha(h + tokens[off : off + page_bytes]).digest()
            keys.append(h)
        return keys
    want = range(count) if pages is None else pages
    keys = []
    run = sha(prev + carry)
    filled = len(carry)  # bytes of the current block hashed into ``run``
    pos = 0  # bytes of ``tokens`` hashed
    last = -1
    for j in want:
        if not 0 <= j < count:
            raise IndexError(f"page {j} is not a whole page of {count}")
        if j <= last:
            raise ValueError("pages must be ascending and distinct")
        last = j
        end = (j + 1) * page_bytes
        while filled + end - pos >= block_bytes:  # the blocks that end up to this page's end
            step = block_bytes - filled
            run.update(tokens[pos : pos + step])
            pos += step
            prev = run.digest()
            run = sha(prev)
            filled = 0
        if end > pos:
            run.update(tokens[pos:end])
            filled += end - pos
            pos = end
            keys.append(run.copy().digest())
        else:  # the page ends its block
            keys.append(prev)
    return keys


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
