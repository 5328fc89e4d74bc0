"""The tree node and the lock receipt.

A node is a run of whole pages under one parent. Its token ids are kept as int32 little-endian
bytes (compared with memcmp, never per token in Python), and its device page ids and host slot
ids as ``array('i')`` or, given a codec, as a compact form of their ascending runs
(daemon/tree/page_ids.py), which is what keeps metadata near the token ids' own 4 bytes per
token. ``host_swa`` is an array, or its tail after many leading zeros (``LeadingZeros``).

Tier state of a node:

* ``full``: device page ids of the full-attention pool, or ``None`` when the node lives only on
  host (demoted);
* ``swa``: device page ids of the SWA pool, or ``None``: a *tombstone* when ``full`` is set (the
  SWA KV was freed early; the full KV stays) and simply absent when the node is host-only;
* ``host``: host (L2) slot ids when the node has a host copy, else ``None``;
* ``host_swa``: host slot ids of its SWA pages beside ``host`` (0 for a page without an SWA copy:
  only the trailing window of what was backed up is kept), or ``None``.

``pin`` counts the tier copies in flight that read or fill this node or a node below it: a pinned
node is in no eviction queue, so its pages stay where the copy expects them, and its device pages
count as protected (like locked ones). ``host_pin`` only keeps its host copy (a fetch from L3
attaching below it); its device pages stay evictable, since eviction demotes a node with a host
copy instead of deleting it.
"""

from __future__ import annotations

from array import array
from typing import Any

from .page_ids import HostSwaIds, PageIds

EMPTY = array("i")


class Node:
    __slots__ = (
        "id",
        "parent",
        "children",
        "ns",
        "tokens",
        "hashes",
        "full",
        "swa",
        "host",
        "host_swa",
        "full_lock",
        "swa_lock",
        "pin",
        "host_pin",
        "dev_children",
        "ts",
        "swa_ts",
        "hits",
        "depth",
        "full_entry",
        "swa_entry",
        "host_entry",
        "host_swa_entry",
    )

    def __init__(self, node_id: int, parent: Node | None, ns: Any, tokens: bytes,
                 hashes: bytes) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[bytes, Node] | None = None
        self.ns = ns
        self.tokens = tokens
        self.hashes = hashes
        self.full: PageIds | None = None
        self.swa: PageIds | None = None
        self.host: PageIds | None = None
        self.host_swa: HostSwaIds | None = None
        self.full_lock = 0
        self.swa_lock = 0
        self.pin = 0
        self.host_pin = 0
        # number of children whose full KV is on device: a node is a device leaf when this is 0
        self.dev_children = 0
        self.ts = 0  # last use, on the tree's churn clock (full and host queues)
        self.swa_ts = 0  # last use of its SWA inside a window (SWA queue)
        self.hits = 0
        # tokens from the root to the end of this node (eviction policies weigh by it)
        self.depth = (parent.depth if parent is not None else 0) + len(tokens) // 4
        # live entries in the eviction queues (None when not queued); see lru.EvictionQueue
        self.full_entry: tuple | None = None
        self.swa_entry: tuple | None = None
        self.host_entry: tuple | None = None
        self.host_swa_entry: tuple | None = None  # (host leaves that hold SWA host slots)

    def __repr__(self) -> str:
        state = "host" if self.full is None else ("tomb" if self.swa is None else "live")
        return (
            f"Node(id={self.id}, tokens={len(self.tokens) // 4}, {state}, "
            f"host={self.host is not None}, locks={self.full_lock}/{self.swa_lock}, pin={self.pin})"
        )


class Receipt:
    """What a lock took, and so exactly what its release gives back.

    The SWA part is recorded as a count of pages walked up from the anchor, not as a node: splits
    only subdivide nodes, so the same count always ends at the same token boundary (the bug class
    of a window edge moved by a split cannot happen). ``tag`` is the caller's: the model cache
    keeps the id it gave the lock there, which its check reads.
    """

    __slots__ = ("anchor", "swa_pages", "active", "swa_released", "tag")

    def __init__(self, anchor: Node, swa_pages: int, tag: Any = None) -> None:
        self.anchor = anchor
        self.swa_pages = swa_pages
        self.active = True
        self.swa_released = False
        self.tag = tag

    def __repr__(self) -> str:
        return (
            f"Receipt(anchor={self.anchor.id}, swa_pages={self.swa_pages}, active={self.active}, "
            f"swa_released={self.swa_released})"
        )


class Pin:
    """A tier copy in flight over the path from the root to ``anchor`` (see ``Node.pin``)."""

    __slots__ = ("anchor", "active", "host_only")

    def __init__(self, anchor: Node, host_only: bool = False) -> None:
        self.anchor = anchor
        self.active = True
        self.host_only = host_only

    def __repr__(self) -> str:
        return (f"Pin(anchor={self.anchor.id}, active={self.active}, "
                f"host_only={self.host_only})")

