"""The radix tree over full and SWA pages: pure (no torch, no I/O, no asyncio)."""

from .errors import BadArgument, NodeNotUsable, ReceiptError, TreeError, UnknownNode
from .hashing import as_token_bytes, chain_hashes, namespace_seed
from .invariants import check_tree
from .node import Node, Receipt
from .radix import (
    CollectingSink,
    EvictResult,
    InsertResult,
    MatchResult,
    PageSink,
    RadixTree,
)

__all__ = [
    "BadArgument",
    "CollectingSink",
    "EvictResult",
    "InsertResult",
    "MatchResult",
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
