"""How one SGLang host-pool page maps onto one radixd host slot, and SGLang's v2 hit policies.

Only SGLang's ``page_first`` MHA layout is copied: its ``kv_buffer`` is ``[2, tokens, layers,
heads, head_dim]``, so a page's K block (``kv_buffer[0, i:i+P]``) and V block are each one
contiguous run of bytes; the slot holds the K block, then the V block (the byte order of SGLang's
own flat data page).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy

SUPPORTED_LAYOUTS = ("page_first",)


class KvPageView:
    """The K and V blocks of each page of one SGLang host pool, as bytes."""

    def __init__(self, pool: Any) -> None:
        buf: torch.Tensor = pool.kv_buffer
        self.page_size = int(pool.page_size)
        self.k = buf[0]
        self.v = buf[1]
        _, self.layers, self.heads, self.head_dim = (int(n) for n in self.k.shape)
        self.dtype_name = str(buf.dtype).removeprefix("torch.")
        self.half = self.page_size * self.layers * self.heads * self.head_dim * buf.element_size()
        self.page_nbytes = 2 * self.half

    def describe(self) -> str:
        return (f"page_first: 2 x {self.page_size} tokens x {self.layers} layers x {self.heads} "
                f"heads x {self.head_dim} x {self.dtype_name}")

    def _blocks(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = index + self.page_size
        return (self.k[index:end].reshape(-1).view(torch.uint8),
                self.v[index:end].reshape(-1).view(torch.uint8))

    def store(self, index: int, slot: torch.Tensor) -> None:
        """SGLang's page at token ``index`` -> radixd's slot."""
        k, v = self._blocks(index)
        slot[: self.half].copy_(k)
        slot[self.half:].copy_(v)

    def load(self, index: int, slot: torch.Tensor) -> None:
        """radixd's slot -> SGLang's page at token ``index``."""
        k, v = self._blocks(index)
        k.copy_(slot[: self.half])
        v.copy_(slot[self.half:])


def page_view(pool: Any) -> KvPageView:
    """The page view of a registered host pool; a clear error for one it cannot copy."""
    layout = getattr(pool, "layout", None)
    buf = getattr(pool, "kv_buffer", None)
    if layout not in SUPPORTED_LAYOUTS:
        raise ValueError(
            f"radixd's HiCache backend copies only MHA host pools in the page_first layout; this "
            f"{type(pool).__name__} has layout {layout!r}: launch SGLang with "
            f"--hicache-mem-layout page_first (docs/sglang.md)")
    if not isinstance(buf, torch.Tensor) or buf.dim() != 5:  # (K/V, page, layer, head, dim)
        raise ValueError(
            f"radixd's HiCache backend copies only MHA host pools (a kv_buffer of K and V per "
            f"head); this {type(pool).__name__} is not one (MLA and other pools are not "
            f"supported yet: docs/sglang.md, Limits)")
    if not buf.is_contiguous():
        raise ValueError(f"{type(pool).__name__}: the host kv_buffer is not contiguous")
    view = KvPageView(pool)
    # a pool that keeps part of a page outside kv_buffer (MXFP8's per-page scales) says so in
    # its own size per token: copying kv_buffer alone would restore pages with stale scales
    size = getattr(pool, "get_size_per_token", None)
    declared = size() if callable(size) else None
    have = view.page_nbytes // view.page_size
    if declared != have:
        raise ValueError(
            f"radixd's HiCache backend copies a page's kv_buffer bytes only; this "
            f"{type(pool).__name__} keeps {declared} B per token against {have} B in kv_buffer "
            f"(per-page scales or other state beside it): its pages cannot be stored in radixd")
    return view


def restorable_lengths(kv_pages: int, pools: Sequence[tuple[str, PoolHitPolicy, int, bytes]]
                       ) -> tuple[int, dict[str, int], list[int]]:
    """SGLang 0.5.23's ``batch_exists_v2`` verdict (as its HiCacheFile computes it) from which
    pages are present: ``kv_pages`` leading KV pages, and per extra pool ``(name, policy,
    trailing, present)`` with ``present[i]`` for KV page i. Returns the usable prefix, the hit
    count per pool and the restorable prefix lengths."""
    hits: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for name, policy, trailing, present in pools:
        if not restorable:
            break
        if policy == PoolHitPolicy.ALL_PAGES:
            boundary = next((i for i in range(kv_pages) if not present[i]), kv_pages)
            ok = set(range(1, boundary + 1))
        elif policy == PoolHitPolicy.TRAILING_PAGES:
            ok = {n for n in range(1, kv_pages + 1)
                  if all(present[i] for i in range(max(0, n - trailing), n))}
            boundary = max(ok, default=0)
        else:  # BLOCK_GROUPS and later policies: nothing of such a pool is stored here
            ok, boundary = set(), 0
        if boundary:
            hits[name] = boundary
        restorable = [n for n in restorable if n in ok]
    return (restorable[-1] if restorable else 0), hits, restorable
