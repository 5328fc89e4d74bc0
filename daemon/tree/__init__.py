"""The radix tree over full and SWA pages: pure (no torch, no I/O, no asyncio; an operation calls
out only to the sinks that take back the pages it frees).

Other packages use only what this module exports and the public attributes and methods of
:class:`RadixTree` and :class:`Node`."""

from .errors import BadArgument, NodeNotUsable, ReceiptError, TreeError, UnknownNode
from .hashing import (
    HASH_BLOCK_TOKENS,
    HASH_BYTES,
    as_token_bytes,
    block_hashes,
    block_pages,
    namespace_seed,
    page_keys,
)
from .invariants import (
    STEP_ITEMS,
    PageMarks,
    TreeAudit,
    audit_steps,
    audit_tree,
    check_tree,
    chunked,
)
from .node import Node, Pin, Receipt
from .page_ids import PageIdCodec, PageIds, concat_pages
from .plain_ids import PlainPageIds
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
    "HASH_BLOCK_TOKENS",
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
    "PageIdCodec",
    "PageIds",
    "PageSink",
    "Pin",
    "PlainPageIds",
    "RadixTree",
    "Receipt",
    "ReceiptError",
    "TreeError",
    "UnknownNode",
    "as_token_bytes",
    "audit_steps",
    "PageMarks",
    "audit_tree",
    "chunked",
    "concat_pages",
    "STEP_ITEMS",
    "TreeAudit",
    "block_hashes",
    "block_pages",
    "check_tree",
    "namespace_seed",
    "page_keys",
]
