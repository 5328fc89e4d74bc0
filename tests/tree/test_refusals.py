"""RadixTree (daemon/tree) refusals leave the tree unchanged (found by a review)."""

from __future__ import annotations

from array import array

import pytest

from daemon.tree import BadArgument, CollectingSink, RadixTree, as_token_bytes
from daemon.tree.invariants import check_tree

P = 4


def _pages(*labels: int) -> bytes:
    out: list[int] = []
    for lab in labels:
        out += [lab * 1000 + j for j in range(P)]
    return as_token_bytes(out)


def test_refused_insert_leaves_the_tree_unchanged() -> None:
    """radix.py:571 (insert loop) + 590-592: with a prev_prefix_len longer than the cached
    prefix, the loop first splits the node the sequence diverges in (`child =
    self._split(child, m)` for the tree-owned part), and only then refuses with 'prev_prefix_len
    ... is longer than the cached prefix'. _advance (line 542) has already moved the churn clock
    too. TreeError's contract: 'the request was refused and the tree is unchanged'. Low severity
    (the split is structurally valid), but a client can fragment nodes with requests that fail."""
    sink = CollectingSink()
    t = RadixTree(P, 2 * P, sink)
    t.insert("ns", _pages(1, 2, 3), array("i", [1, 2, 3]), array("i", [1, 2, 3]))
    before = (sorted(t.nodes), t._clock, t.stats["splits"])
    with pytest.raises(BadArgument, match="longer than the cached prefix"):
        t.insert("ns", _pages(1, 5, 6), array("i", [9]), array("i", [9]), prev_prefix_len=2 * P)
    assert check_tree(t) == []
    assert (sorted(t.nodes), t._clock, t.stats["splits"]) == before


@pytest.mark.parametrize("bad", [0, -64, 1.5, "64", None])
def test_a_bad_hash_block_size_is_refused_by_name(bad) -> None:
    """``hash_block_tokens`` (tests draw small blocks through it) must be a positive int."""
    with pytest.raises(BadArgument, match="hash_block_tokens must be an int >= 1"):
        RadixTree(4, 8, CollectingSink(), hash_block_tokens=bad)
