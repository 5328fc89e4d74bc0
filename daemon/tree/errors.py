"""Errors raised by the tree.

Each carries a stable ``code`` so the server can map it onto the wire without knowing the tree;
the message says what was wrong in terms a client author can act on.
"""

from __future__ import annotations


class TreeError(Exception):
    """Base class: the request was refused and the tree is unchanged in any way that matters."""

    code = "tree_error"


class BadArgument(TreeError):
    """An argument is malformed (lengths, alignment, ranges)."""

    code = "bad_argument"


class UnknownNode(TreeError):
    """A node id that is not (or no longer) in the tree, or not in the caller's namespace."""

    code = "unknown_node"


class NodeNotUsable(TreeError):
    """The node exists but its sliding window is no longer live: it cannot be locked to read."""

    code = "node_not_usable"


class ReceiptError(TreeError):
    """A release that does not match an acquire: already released, or never taken."""

    code = "bad_receipt"
