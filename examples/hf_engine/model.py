"""The model: a tiny hybrid Qwen2 (sliding-window and full-attention layers) and its reference.

Qwen2 is used because its forward is the plainest of the transformers classes that take
per-layer ``layer_types``: RMSNorm, q/k/v projections with bias, default RoPE (the same for every
layer), eager attention with a mask, SiLU MLP. Gemma 3 adds query pre-scaling, soft-capping,
extra norms and a second RoPE base for local layers; GPT-OSS adds attention sinks and MoE. Every
step of Qwen2 can be reproduced exactly over paged KV, so the engine's logits can be compared
with plain transformers to 1e-4 in float32.

The weights are random (a fixed seed), built from a config in code: nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

SLIDING = "sliding_attention"
FULL = "full_attention"

#: Layer kinds of the default model: two sliding-window and two full-attention layers, mixed.
DEFAULT_LAYER_TYPES = (SLIDING, FULL, SLIDING, FULL)


def tiny_config(*, vocab_size: int = 256, hidden_size: int = 64, intermediate_size: int = 128,
                num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 16,
                layer_types: Sequence[str] = DEFAULT_LAYER_TYPES, sliding_window: int = 8,
                max_position_embeddings: int = 4096, initializer_range: float = 0.1
                ) -> Qwen2Config:
    """A small hybrid Qwen2 config, float32 and eager attention.

    The window is tiny (8 tokens by default) so that prompts of a few dozen tokens span many
    windows. ``initializer_range`` is larger than Qwen's 0.02 so that the random model's logits
    are spread out: greedy decoding then does not hinge on near-ties.
    """
    kinds = list(layer_types)
    unknown = sorted(set(kinds) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"layer_types: unknown kinds {unknown}; use {SLIDING!r} or {FULL!r}")
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=len(kinds), num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim,
        use_sliding_window=True, sliding_window=sliding_window, layer_types=kinds,
        max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
        tie_word_embeddings=False, attn_implementation="eager", dtype="float32")


def build_model(config: Qwen2Config | None = None, seed: int = 0) -> Qwen2ForCausalLM:
    """The model with random weights drawn from ``seed``: the same weights in every process."""
    config = config if config is not None else tiny_config()
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.config._attn_implementation = "eager"
    return model.to(torch.float32).eval()


@dataclass(frozen=True)
class LayerSlot:
    """Where a model layer keeps its KV: ``pool`` ('full' or 'swa') and its layer in that pool.

    The daemon's full pool holds the full-attention layers in model order, its SWA pool the
    sliding-window layers in model order; every engine sharing the pools must agree on this.
    """

    pool: str
    index: int


def layer_slots(config: Qwen2Config) -> list[LayerSlot]:
    """Model layer i -> its pool and its index among the layers of its kind."""
    counts = {"full": 0, "swa": 0}
    slots = []
    for kind in config.layer_types:
        pool = "swa" if kind == SLIDING else "full"
        slots.append(LayerSlot(pool, counts[pool]))
        counts[pool] += 1
    return slots


def window_of(config: Qwen2Config) -> int | None:
    """The sliding window, or None when no layer is a sliding-window layer."""
    if SLIDING not in config.layer_types:
        return None
    if config.sliding_window is None:
        raise ValueError("the config has sliding_attention layers but no sliding_window "
                         "(Qwen2 needs use_sliding_window=True)")
    return int(config.sliding_window)


@dataclass
class Generation:
    """Greedy generation: the new tokens and, for each, the logits it was chosen from."""

    tokens: list[int]
    logits: torch.Tensor  # [len(tokens), vocab], float32


@torch.no_grad()
def reference_generate(model: Qwen2ForCausalLM, prompt: Sequence[int],
                       max_new_tokens: int) -> Generation:
    """Greedy generation with plain transformers and no cache at all.

    Every step runs the whole sequence through ``model(...)`` with ``use_cache=False``: this is
    the ground truth the paged engine is compared with, independent of any KV handling.
    """
    if not prompt:
        raise ValueError("an empty prompt has nothing to generate from")
    seq = list(prompt)
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        out = model(input_ids=torch.tensor([seq]), use_cache=False)
        last = out.logits[0, -1].to(torch.float32)
        nxt = int(torch.argmax(last))
        rows.append(last.clone())
        tokens.append(nxt)
        seq.append(nxt)
    vocab = int(model.config.vocab_size)
    logits = torch.stack(rows) if rows else torch.empty(0, vocab)
    return Generation(tokens, logits)
