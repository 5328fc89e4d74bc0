"""The radix tree over full and SWA pages: pure (no torch, no I/O, no asyncio, no callbacks out of
an operation).

Other packages use only what this module exports and the public attributes and methods of
:class:`RadixTree` and :class:`Node`."""

from .errors import BadArgument, NodeNotUsable, ReceiptError, TreeError, UnknownNode
from .hashing import as_token_bytes, chain_hashes, namespace_seed
from .invariants import check_tree
from .node import Node, Receipt
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
    "RadixTree",
    "Receipt",
    "ReceiptError",
    "TreeError",
    "UnknownNode",
    "as_token_bytes",
    "chain_hashes",
    "check_tree",
    "namespace_seed",
]
