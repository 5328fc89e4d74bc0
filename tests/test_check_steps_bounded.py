"""The stepped full check (``ModelCache.check_steps``, the background checker's steps, between
which requests are served) keeps every step bounded however wide the tree and however many
locks it holds, and still finds what its chunked comparisons look for.

A step's work is counted as the Python lines it runs (``sys.settrace``), which is the same on
every machine: no timing. Before, a node's children were all read in one step (a root with
3,000 children: about 18,000 lines in one step).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from bench.check_steps_bench import wide_cache
from daemon.model_cache import ModelCache
from daemon.tree import STEP_ITEMS, Node

NS = "bench"
PAGE = 4
OWNERS = (2, 3)  # wide_cache's
SESSIONS = 1024
#: lines one step may run: a step handles at most STEP_ITEMS items of a few lines each (about
#: 900 lines at most, measured); the root's children in one step were 18,000
LINE_LIMIT = 25 * STEP_ITEMS


def _lines_per_step(steps: Iterator[None]) -> list[int]:
    counts: list[int] = []
    n = 0

    def line(frame: Any, event: str, arg: Any) -> Any:
        nonlocal n
        if event == "line":
            n += 1
        return line

    def call(frame: Any, event: str, arg: Any) -> Any:  # every frame, a generator's resumption too
        return line

    while True:
        n = 0
        sys.settrace(call)
        try:
            next(steps)
        except StopIteration:
            return counts
        finally:  # the step that ends the check (StopIteration) is counted too
            sys.settrace(None)
            counts.append(n)


def test_no_step_runs_long_on_a_wide_tree_with_many_locks_and_sessions() -> None:
    """A root of 3,000 children, 4,000 locks with SWA windows, 1,024 sessions holding a page
    each and no lock."""
    cache, held = wide_cache(roots=3000, locks=4000, page=PAGE, spare=SESSIONS + 8)
    for owner in range(10, 10 + SESSIONS):
        cache.alloc(owner, 1)
    assert len(cache.tree.namespaces[NS].root.children) == 3000
    assert len(cache.holdings) == SESSIONS + 3
    assert sum(1 for r in cache.tree.receipts if r.swa_pages) == 4000
    assert cache.check() == []  # (once first: what its steps import lazily is imported)
    v: list[str] = []
    counts = _lines_per_step(cache.check_steps(v))
    assert v == []
    assert sum(counts) > 100 * LINE_LIMIT  # the tracing saw the whole check's work
    worst = max(counts)
    assert worst <= LINE_LIMIT, (worst, counts.index(worst), len(counts))
    for owner, rid in held:  # what the check read, the locks' release undoes exactly
        cache.unlock(owner, rid)
    assert cache.check() == []


def _findings(cache: ModelCache) -> list[str]:
    v: list[str] = []
    for _ in cache.check_steps(v):
        pass
    assert v == cache.check()  # one check, written once as steps
    return v


def test_the_chunked_comparisons_still_find_what_they_look_for() -> None:
    cache, held = wide_cache(roots=200, locks=150, page=PAGE)
    tree = cache.tree
    assert _findings(cache) == []

    # a node the tree reaches but its registry lost, and a registered node it does not reach
    n = next(iter(tree.namespaces[NS].root.children.values()))
    del tree.nodes[n.id]
    v = _findings(cache)
    assert any("node registry disagrees" in x and f"unregistered [{n.id}]" in x for x in v)
    tree.nodes[n.id] = n
    ghost = Node(max(tree.nodes) + 1, None, n.ns, n.tokens, n.hashes)
    tree.nodes[ghost.id] = ghost
    assert any(f"unreachable [{ghost.id}]" in x for x in _findings(cache))
    del tree.nodes[ghost.id]
    assert _findings(cache) == []

    # an eligible node missing from its eviction queue
    unlocked = next(c for c in tree.nodes.values()
                    if c.parent is not None and c.full_entry is not None)
    q = tree.namespaces[NS].full_q
    del q.node_of[unlocked.full_entry[1]]
    assert any("full queue" in x and f"misses [{unlocked.id}]" in x for x in _findings(cache))
    q.node_of[unlocked.full_entry[1]] = unlocked
    assert _findings(cache) == []

    # a receipt registered for another owner than the one whose holding lists it
    owner, rid = held[0]
    registered = cache._receipts[rid]
    cache._receipts[rid] = (OWNERS[1] if owner == OWNERS[0] else OWNERS[0], registered[1])
    assert any("owners' holdings disagree" in x for x in _findings(cache))
    cache._receipts[rid] = registered
    # a registered receipt the tree no longer counts as active
    tree.receipts.discard(registered[1])
    assert any("the tree's active locks" in x and "disagree" in x for x in _findings(cache))
    tree.receipts.add(registered[1])
    assert _findings(cache) == []
    # one lock registered under two ids, and another one under none (no session can release it)
    other_rid = held[1][1]
    other = cache._receipts[other_rid]
    cache._receipts[other_rid] = (other[0], registered[1])
    assert any("registered under two ids" in x for x in _findings(cache))
    cache._receipts[other_rid] = other
    assert _findings(cache) == []
