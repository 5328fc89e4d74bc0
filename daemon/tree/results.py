"""Values the tree hands out and takes in: sinks for the pages it lets go of, the results of
its operations, and the per-namespace state (kept apart so that every tree module can use them
without importing the tree)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Protocol

from .lru import EvictionQueue
from .node import Node, Receipt
from .page_ids import PageIds
from .policy import EvictionPolicy


class PageSink(Protocol):
    """Where the tree returns device pages it no longer needs: an array, or a node's ids in its
    codec's compact form (daemon.tree.page_ids)."""

    def free_full(self, pages: PageIds) -> None: ...

    def free_swa(self, pages: PageIds) -> None: ...


class HostSink(Protocol):
    """Where the tree returns host (L2) slots it no longer needs."""

    def free_host(self, slots: PageIds) -> None: ...

    def free_host_swa(self, slots: array) -> None: ...


class CollectingSink:
    """A sink that just records what was freed (tests, benchmarks, simulations)."""

    def __init__(self) -> None:
        self.full: list[int] = []
        self.swa: list[int] = []
        self.host: list[int] = []
        self.host_swa: list[int] = []

    def free_full(self, pages: PageIds) -> None:
        self.full.extend(pages)

    def free_swa(self, pages: PageIds) -> None:
        self.swa.extend(pages)

    def free_host(self, slots: PageIds) -> None:
        self.host.extend(slots)

    def free_host_swa(self, slots: array) -> None:
        self.host_swa.extend(slots)


@dataclass(slots=True)
class MatchResult:
    """What a match found. Lengths are in tokens, always whole pages."""

    prefix_len: int  # usable device prefix (the SWA rule holds at its end)
    full_pages: array  # full-pool page ids of [0, prefix_len)
    swa_pages: array  # SWA page ids of the trailing window of the prefix (all live)
    node_id: int  # the node that ends exactly at prefix_len (a root id when prefix_len == 0)
    full_hit_len: int  # device full KV matched, possibly beyond prefix_len through tombstones
    host_hit_len: int  # tokens past prefix_len that a load from host would make usable
    receipt: Receipt | None = None


@dataclass(slots=True)
class InsertResult:
    """What an insert did. Page arrays cover [prev_prefix_len, inserted_len)."""

    prefix_len: int  # tokens that were already on device before this insert (the overlap)
    inserted_len: int  # tokens of this sequence now in the tree on device
    full_pages: array  # canonical full page ids for [prev_prefix_len, inserted_len)
    swa_pages: array  # canonical SWA page ids for the same range, 0 where tombstoned
    node_id: int  # the node that ends at inserted_len
    receipt: Receipt | None = None


@dataclass(slots=True)
class EvictResult:
    """Pages and host slots one eviction (or one commit of waiting victims) let go of."""

    full_pages: int = 0
    swa_pages: int = 0
    host_slots: int = 0
    host_swa_slots: int = 0

    def add(self, other: EvictResult) -> None:
        """Fold in the result of a later step of the same eviction (two-phase evictions run in
        several steps, and callers report one result)."""
        self.full_pages += other.full_pages
        self.swa_pages += other.swa_pages
        self.host_slots += other.host_slots
        self.host_swa_slots += other.host_swa_slots


class Namespace:
    """A separate subtree: its own root, hash seed, eviction queues and page counts (so a tenant
    over quota can evict its own cold pages without scanning anyone else's)."""

    __slots__ = ("name", "seed", "root", "full_q", "swa_q", "host_q", "host_swa_q",
                 "full_pages", "swa_pages", "host_pages")

    def __init__(self, name: str, seed: bytes, root: Node, policy: EvictionPolicy) -> None:
        self.name = name
        self.seed = seed
        self.root = root
        self.full_q = EvictionQueue("full_entry", policy.full_key)
        self.swa_q = EvictionQueue("swa_entry", policy.swa_key)
        self.host_q = EvictionQueue("host_entry", policy.host_key)
        # the host_q leaves that hold SWA host slots, in the same order: what an eviction for
        # SWA host slots takes (most host leaves hold none: only a node's window is copied)
        self.host_swa_q = EvictionQueue("host_swa_entry", policy.host_key)
        self.full_pages = 0  # device pages of this namespace's nodes
        self.swa_pages = 0
        self.host_pages = 0
