"""The radix tree over full and SWA pages: pure (no torch, no I/O, no asyncio; an operation calls
out only to the sinks that take back the pages it frees).

Other packages use only what this module exports and the public attributes and methods of
:class:`RadixTree` and :class:`Node`."""

from .errors import BadArgument, NodeNotUsable, ReceiptError, TreeError, UnknownNode
from .hashing import HASH_BYTES, as_token_bytes, chain_hashes, namespace_seed
from .invariants import audit_tree, check_tree
from .node import Node, Pin, Receipt
from .policy import DEFAULT_POLICY, POLICIES
from .radix import RadixTree
from .results import (
    CollectingSink,
    EvictResult,
    HostSink,
    InsertResult,
    MatchResult,
    Namespace,
    PageSink,
)
from .tiering import LoadPlan

__all__ = [
    "DEFAULT_POLICY",
    "HASH_BYTES",
    "POLICIES",
    "BadArgument",
    "CollectingSink",
    "EvictResult",
    "HostSink",
    "InsertResult",
    "LoadPlan",
    "MatchResult",
    "Namespace",
    "Node",
    "NodeNotUsable",
    "PageSink",
    "Pin",
    "RadixTree",
    "Receipt",
    "ReceiptError",
    "TreeError",
    "UnknownNode",
    "as_token_bytes",
    "audit_tree",
    "chain_hashes",
    "check_tree",
    "namespace_seed",
]
