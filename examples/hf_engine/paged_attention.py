"""Attention over KV kept in radixd's paged pools (plain torch, CPU).

A pool layer is ``[2, pages, page_size, kv_heads, head_dim]`` (K then V), as the daemon lays it
out. A request's page table maps its sequence page ``j`` (tokens ``[j*P, (j+1)*P)``) to a page id
of the pool; id 0 is the padding page, which here means "no KV for this page" (never handed out,
or already freed). Reading or writing through a 0 raises instead of silently using zeros: a wrong
page table is a bug the tests must see.

Sliding-window semantics are HF's (``transformers.masking_utils.sliding_window_overlay``): a
query at position i sees the keys at positions ``(i - W, i]``, i.e. itself and the W - 1 tokens
before it. Full-attention layers see ``[0, i]``.
"""

from __future__ import annotations

import torch


class MissingKV(RuntimeError):
    """A position's page is 0 in the page table: its KV was freed or never placed."""


def visible(q_positions: torch.Tensor, k_positions: torch.Tensor,
            window: int | None) -> torch.Tensor:
    """``[T, N]`` bool: may the query at ``q_positions[t]`` see the key at ``k_positions[n]``."""
    q = q_positions[:, None]
    k = k_positions[None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (k > q - window)
    return allowed


def key_span(q_start: int, q_end: int, window: int | None) -> tuple[int, int]:
    """The key positions ``[start, end)`` that queries ``[q_start, q_end)`` may read.

    A full layer reads the whole prefix; a sliding layer only from ``q_start - W + 1``, so the
    pages before that are never touched (and may have been freed).
    """
    start = 0 if window is None else max(0, q_start - window + 1)
    return start, q_end


def page_slots(table: torch.Tensor, positions: torch.Tensor,
               page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page ids and in-page offsets of ``positions`` under page table ``table`` (int64)."""
    index = torch.div(positions, page_size, rounding_mode="floor")
    if int(index.max()) >= table.numel():
        raise MissingKV(f"position {int(positions.max())} is past the page table "
                        f"({table.numel()} pages of {page_size})")
    ids = table[index]
    if bool((ids == 0).any()):
        bad = positions[ids == 0]
        raise MissingKV(f"positions {int(bad.min())}..{int(bad.max())} map to the padding page "
                        "0: their KV was freed or never placed")
    return ids, positions - index * page_size


def write_kv(pool_layer: torch.Tensor, table: torch.Tensor, positions: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store K and V (``[T, kv_heads, head_dim]``) of ``positions`` into their pages."""
    ids, offsets = page_slots(table, positions, pool_layer.shape[2])
    pool_layer[0, ids, offsets] = k.to(pool_layer.dtype)
    pool_layer[1, ids, offsets] = v.to(pool_layer.dtype)


def gather_kv(pool_layer: torch.Tensor, table: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``positions``, each ``[N, kv_heads, head_dim]``, read from the pool."""
    ids, offsets = page_slots(table, positions, pool_layer.shape[2])
    return pool_layer[0, ids, offsets], pool_layer[1, ids, offsets]


def paged_attention(q: torch.Tensor, q_positions: torch.Tensor, pool_layer: torch.Tensor,
                    table: torch.Tensor, *, window: int | None, scaling: float) -> torch.Tensor:
    """Attention of queries ``q`` (``[T, heads, head_dim]``, at consecutive ``q_positions``)
    over the KV in the pool, which must already hold the queries' own K/V.

    The arithmetic follows transformers' ``eager_attention_forward``: ``q @ k^T * scaling``,
    masked, softmax in float32, then ``@ v``; KV heads are shared by ``heads / kv_heads`` query
    heads each, in HF's ``repeat_kv`` order. Returns ``[T, heads, head_dim]``.
    """
    q_start, q_end = int(q_positions[0]), int(q_positions[-1]) + 1
    start, end = key_span(q_start, q_end, window)
    k_positions = torch.arange(start, end, dtype=torch.long)
    k, v = gather_kv(pool_layer, table, k_positions)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # heads first
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scaling  # [heads, T, N]
    mask = visible(q_positions, k_positions, window)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)  # [T, heads, head_dim]
