"""Comparison of an engine's generation with plain transformers (no cache at all).

This is the correctness oracle of the example: equal greedy tokens, and every step's logits
within ``atol`` (1e-4 in float32; the paged engine sums attention over fewer keys and in another
order than HF's masked full matrix, so bit equality is not expected).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import Qwen2ForCausalLM

from .model import reference_generate

DEFAULT_ATOL = 1e-4


@dataclass
class Comparison:
    """How an engine's generation differs from the reference."""

    engine_tokens: list[int]
    reference_tokens: list[int]
    max_abs_diff: float  # over every step's logits (steps both have)
    worst_step: int  # the step where max_abs_diff occurs (-1: no steps)

    @property
    def tokens_equal(self) -> bool:
        return self.engine_tokens == self.reference_tokens

    def ok(self, atol: float = DEFAULT_ATOL) -> bool:
        return self.tokens_equal and self.max_abs_diff <= atol

    def describe(self) -> str:
        return (f"tokens {'equal' if self.tokens_equal else 'DIFFER'} "
                f"(engine {self.engine_tokens}, reference {self.reference_tokens}); "
                f"max |logit diff| {self.max_abs_diff:.3g} at step {self.worst_step}")


def compare(model: Qwen2ForCausalLM, prompt: Sequence[int], tokens: Sequence[int],
            logits: torch.Tensor) -> Comparison:
    """Generate greedily from ``prompt`` with no cache and compare step by step."""
    ref = reference_generate(model, prompt, len(tokens))
    n = min(len(tokens), ref.logits.shape[0], logits.shape[0])
    if n == 0:
        return Comparison(list(tokens), ref.tokens, 0.0, -1)
    diff = (logits[:n].to(torch.float32) - ref.logits[:n]).abs().amax(dim=-1)
    worst = int(torch.argmax(diff))
    return Comparison(list(tokens), ref.tokens, float(diff[worst]), worst)


def assert_matches_reference(model: Qwen2ForCausalLM, prompt: Sequence[int],
                             tokens: Sequence[int], logits: torch.Tensor,
                             atol: float = DEFAULT_ATOL) -> Comparison:
    """Raise AssertionError unless tokens are equal and logits within ``atol``."""
    cmp = compare(model, prompt, tokens, logits)
    if not cmp.ok(atol):
        raise AssertionError(f"engine differs from plain transformers: {cmp.describe()}")
    return cmp
