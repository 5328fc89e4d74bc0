"""One request's state in the engine: its sequence, page tables and daemon bookkeeping.

The page tables are the engine's view of where each sequence page's KV lives. They start as the
match result (full pages of the whole prefix; SWA pages only for its trailing window, 0 before
it), grow with ``alloc``, switch to the canonical ids that ``cache_unfinished`` returns, and get
0 for SWA pages freed during decode. ``cached_len`` is the prefix that is in the tree and covered
by ``receipt`` (the ``prev_prefix_len`` of the next insert); ``swa_evicted_len`` is the SWA
frontier of the pages after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


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
    tokens: list[int] = field(default_factory=list)  # prompt, then generated tokens
    output: list[int] = field(default_factory=list)  # generated tokens
    logits: list[torch.Tensor] = field(default_factory=list)  # one row per generated token
    full_table: list[int] = field(default_factory=list)  # sequence page -> full page id
    swa_table: list[int] = field(default_factory=list)  # sequence page -> SWA page id (0: none)
    # Pages this request got from its own ``alloc`` and has not handed to the tree: the only
    # ones its forward passes may write into.
    writable_full: set[int] = field(default_factory=set)
    writable_swa: set[int] = field(default_factory=set)
    computed_len: int = 0  # tokens[:computed_len] have their KV in the pools
    cached_len: int = 0  # [0, cached_len) is in the tree and locked by `receipt`
    receipt: int | None = None
    swa_evicted_len: int = 0  # SWA frontier: pages in [cached_len, frontier) were freed
    swa_released: bool = False  # release_swa done for the locked prefix
    phase: Phase = Phase.PREFILL
    # what the cache gave at admission (for tests and logs)
    prefix_len: int = 0  # usable device prefix taken from the match (or the load)
    full_hit_len: int = 0
    host_hit_len: int = 0  # from the probing match, before any load
    loaded_len: int = 0  # tokens `load` brought back from host (L2) to device
    l3_hit_len: int = 0  # from prefetch: tokens only Redis (L3) had
    fetched_len: int = 0  # from prefetch: of those, tokens on host when it answered
    prefetch_status: str = ""
    swa_pages_freed: int = 0  # SWA pages this request freed during decode
    finished_inserted_len: int = 0  # cache_finished's inserted_len

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def step_logits(self) -> torch.Tensor:
        """``[generated, vocab]``: the logits each generated token was chosen from."""
        if not self.logits:
            return torch.empty(0)
        return torch.stack(self.logits)
