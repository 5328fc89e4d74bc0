"""Eviction priorities: which eligible node goes first (smallest key first).

Recency (``Node.ts``) is measured on the tree's churn clock: it advances by the tokens of KV each
insert hands over, so "how long ago" means "how much new content arrived since", independent of
request rate and of how much cached content requests re-read.
"""

from __future__ import annotations

from .errors import BadArgument
from .node import Node


class EvictionPolicy:
    """Plain LRU: the least recently used eligible node goes first."""

    name = "lru"

    def full_key(self, n: Node) -> float:
        return n.ts

    def swa_key(self, n: Node) -> tuple[float, int]:
        # SWA recency is refreshed only inside the window a match or insert ends with, so SWA
        # outside every recent window ages and goes first; between nodes refreshed together, the
        # one nearer the root goes first
        return (n.swa_ts, n.depth)

    def host_key(self, n: Node) -> float:
        return self.full_key(n)


class DepthCreditLRU(EvictionPolicy):
    """LRU on the churn clock, with a credit of ``weight`` x depth: the longest paths are trimmed
    first, and recency decides between paths of similar length.

    Why: under pressure, plain LRU on a prefix tree evicts whole conversations in the order they
    were last used. In a round-robin multi-turn workload that is exactly the order they come back
    in, so every request finds its own history just evicted and the hit rate falls to zero
    (bench/multiturn.py: 0.00 in the last rounds with the pool at 40% of the working set).
    Trimming the deepest tails first gives every cached path a fair share of the pool: each
    conversation keeps its prefix and a returning request recomputes only its trimmed tail
    (0.38 in the last rounds on the same run). Cost-aware GreedyDual with cost ~ depth and a
    re-age-on-trim CLOCK sweep were measured too and do not break the loop (all conversations
    cost the same, so both fall back to LRU order).

    Recency still bounds staleness: a path idle for ``weight * depth`` more tokens of churn than
    another goes first, so dead conversations do leave. ``weight`` 64 sits on the plateau of the
    sweep (32: 0.33, 64: 0.38, 128: 0.38, infinite: 0.38 in the last rounds at 40%); with no
    eviction (a roomy pool) the policy changes nothing.
    """

    name = "lru-depth"

    def __init__(self, weight: float = 64.0) -> None:
        if weight < 0:
            raise BadArgument(f"eviction depth weight must be >= 0, got {weight}")
        self.weight = weight

    def full_key(self, n: Node) -> float:
        return n.ts - self.weight * n.depth


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": EvictionPolicy, "lru-depth": DepthCreditLRU}
DEFAULT_POLICY = "lru-depth"


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise BadArgument(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
