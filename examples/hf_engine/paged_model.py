"""The model's forward pass with its KV in radixd's pools.

Everything but attention is the HF module itself (embedding, RMSNorms, q/k/v/o projections,
rotary embedding and ``apply_rotary_pos_emb``, MLP, final norm, lm_head), called on one
sequence's new positions. Attention is :func:`paged_attention`: each layer writes the new K/V
into its pages (pool and layer index from :func:`layer_slots`), then reads the keys it may see
back from the pool, so every token of context really comes from the daemon's memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from radixd_client.pools import AttachedPools
from transformers import Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from .model import layer_slots, window_of
from .paged_attention import paged_attention, write_kv


class PagedModel:
    """A Qwen2 model whose attention reads and writes the attached pools."""

    def __init__(self, model: Qwen2ForCausalLM, pools: AttachedPools) -> None:
        self.model = model
        self.config = model.config
        self.pools = pools
        self.slots = layer_slots(self.config)
        self.window = window_of(self.config)
        self.page_size = pools.page_size
        for pool in ("full", "swa"):
            need = sum(s.pool == pool for s in self.slots)
            tensor = pools.full if pool == "full" else pools.swa
            have = int(tensor.shape[0]) if tensor is not None else 0
            if have != need:
                raise ValueError(f"the {pool} pool has {have} layers, the model needs {need}")

    def _pool_layer(self, pool: str, index: int) -> torch.Tensor:
        return self.pools.pool(pool)[index]

    @torch.no_grad()
    def forward(self, tokens: Sequence[int], start: int, end: int, full_table: Sequence[int],
                swa_table: Sequence[int], *, write: bool = True) -> torch.Tensor:
        """Run positions ``[start, end)`` of ``tokens``; return the last position's logits.

        With ``write`` the new K/V go into the pages of the tables first (the caller allocated
        them); without it the positions' K/V must already be in the pool (a fully cached prompt
        whose last token is run again only for its logits), and nothing is written to pages the
        tree shares with other engines.
        """
        if not 0 <= start < end <= len(tokens):
            raise ValueError(f"positions [{start}, {end}) outside a sequence of {len(tokens)}")
        layers = self.model.model.layers
        positions = torch.arange(start, end, dtype=torch.long)
        ids = torch.tensor(list(tokens[start:end]), dtype=torch.long)
        tables = {"full": torch.tensor(list(full_table), dtype=torch.long),
                  "swa": torch.tensor(list(swa_table), dtype=torch.long)}

        hidden = self.model.model.embed_tokens(ids)  # [T, hidden]
        cos, sin = self.model.model.rotary_emb(hidden[None], positions[None])
        cos, sin = cos[0], sin[0]  # [T, head_dim]
        for layer, slot in zip(layers, self.slots, strict=True):
            attn = layer.self_attn
            residual = hidden
            x = layer.input_layernorm(hidden)
            n = x.shape[0]
            q = attn.q_proj(x).view(n, -1, attn.head_dim)
            k = attn.k_proj(x).view(n, -1, attn.head_dim)
            v = attn.v_proj(x).view(n, -1, attn.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
            pool_layer = self._pool_layer(slot.pool, slot.index)
            table = tables[slot.pool]
            if write:
                write_kv(pool_layer, table, positions, k, v)
            window = self.window if slot.pool == "swa" else None
            out = paged_attention(q, positions, pool_layer, table, window=window,
                                  scaling=attn.scaling)
            hidden = residual + attn.o_proj(out.reshape(n, -1))
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.model.model.norm(hidden[-1:])
        return self.model.lm_head(hidden)[0].to(torch.float32)
