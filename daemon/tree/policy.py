"""Eviction priorities: which eligible node goes first (smallest key first)."""

from __future__ import annotations

from .errors import BadArgument
from .node import Node


class EvictionPolicy:
    """Plain LRU: the least recently used eligible node goes first."""

    name = "lru"

    def full_key(self, n: Node) -> float:
        return n.ts

    def swa_key(self, n: Node) -> float:
        return n.ts

    def host_key(self, n: Node) -> float:
        return n.ts


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": EvictionPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise BadArgument(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
