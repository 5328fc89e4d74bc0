"""One request's state in the engine: its sequence, its logits, and its cache lifecycle.

Everything the daemon protocol needs per request (page tables, the pages the request may write,
the locked prefix and its receipt, the SWA frontier) lives in ``cache``, a
:class:`radixd_client.lifecycle.RequestLifecycle`; the properties here only name its figures the
way this engine's tests and command line read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch
from radixd_client.lifecycle import RequestLifecycle


class Phase(Enum):
    """Where a request is: computing its prompt, generating, or finished (pages handed back)."""

    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass
class Request:
    """A greedy generation request and everything the engine tracks for it."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    cache: RequestLifecycle
    tokens: list[int] = field(default_factory=list)  # prompt, then generated tokens
    output: list[int] = field(default_factory=list)  # generated tokens
    logits: list[torch.Tensor] = field(default_factory=list)  # one row per generated token
    phase: Phase = Phase.PREFILL

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def computed_len(self) -> int:
        """``tokens[:computed_len]`` have their KV in the pools."""
        return self.cache.computed_len

    @computed_len.setter
    def computed_len(self, value: int) -> None:
        self.cache.computed_len = value

    @property
    def cached_len(self) -> int:
        """``[0, cached_len)`` is in the tree and locked by the request's receipt."""
        return self.cache.cached_len

    @property
    def full_table(self) -> list[int]:
        return self.cache.full_table

    @property
    def swa_table(self) -> list[int]:
        return self.cache.swa_table

    @property
    def prefix_len(self) -> int:
        """The usable device prefix taken from the match (or the load)."""
        return self.cache.admission.prefix_len

    @property
    def host_hit_len(self) -> int:
        return self.cache.admission.host_hit_len

    @property
    def loaded_len(self) -> int:
        return self.cache.admission.loaded_len

    @property
    def l3_hit_len(self) -> int:
        return self.cache.admission.l3_hit_len

    @property
    def fetched_len(self) -> int:
        return self.cache.admission.fetched_len

    @property
    def prefetch_status(self) -> str:
        return self.cache.admission.prefetch_status

    @property
    def swa_released(self) -> bool:
        return self.cache.swa_released

    @property
    def swa_pages_freed(self) -> int:
        return self.cache.swa_pages_freed

    @property
    def finished_inserted_len(self) -> int:
        return self.cache.finished_inserted_len

    def step_logits(self) -> torch.Tensor:
        """``[generated, vocab]``: the logits each generated token was chosen from."""
        if not self.logits:
            return torch.empty(0)
        return torch.stack(self.logits)
