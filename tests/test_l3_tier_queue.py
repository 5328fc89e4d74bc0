"""The L3 writer's queue (daemon.l3_tier.L3Tier) over a real tree and a real host tier: every
slot it holds is given back exactly once (when a batch is taken, when a run cannot be held
whole), a full queue holds none for what it refuses, its page count returns to 0 when it
empties, and a full queue keeps the beginnings of paths under both write policies."""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import pytest

from daemon.l3_tier import L3_WRITE_BATCH, L3Tier
from daemon.model_cache import ModelCache
from daemon.storage.host_tier import HostTier
from daemon.tree import Node, as_token_bytes
from tests.tree.helpers import make_cache

NS = "ns"
P = 4  # blocks of 16 pages


@pytest.fixture
def tiers() -> Iterator[tuple[ModelCache, HostTier, L3Tier]]:
    mc = make_cache(P=P, window_pages=2, full=512, swa=512)
    host = HostTier(mc.profile, 512, 512, pin_memory=False)
    mc.tree.host_sink = host
    counters = {"l3_write_skipped": 0, "l3_write_failures": 0}
    try:
        yield mc, host, L3Tier(mc, host, "m", None, {}, {}, counters, set())
    finally:
        host.close()


def cached_on_host(mc: ModelCache, host: HostTier, base: int, pages: int) -> Node:
    """A sequence of ``pages`` pages inserted as one node, with a filled host copy."""
    toks = as_token_bytes(list(range(base, base + pages * P)))
    first = base % 400  # page ids inside the pools, distinct for the bases used here
    full = array("i", range(first + 1, first + pages + 1))
    mc.tree.insert(NS, toks, full, array("i", (p + 50 for p in full)), 0, 0)
    node = mc.tree.nodes[mc.tree.match(NS, toks).node_id]
    slots = host.take("full", pages, NS)
    host.filled("full", slots, NS)
    mc.tree.set_host(node.id, slots)
    return node


def readers(host: HostTier) -> int:
    return sum(host.readers["full"].values())


def test_runs_hold_their_slots_until_taken_and_the_count_returns_to_zero(tiers) -> None:
    mc, host, l3 = tiers
    node = cached_on_host(mc, host, 1000, 40)  # runs of 16, 16 and 8 pages
    l3.queue(node, node.host, None)
    assert [len(slots) for _, _, slots, *_ in l3.pending] == [16, 16, 8]
    assert l3.queued_pages == 40 and readers(host) == 40
    taken = []
    while l3.pending:
        batch = l3.take_batch()  # what the writer takes, without Redis
        assert sum(len(s) for _, _, s, *_ in batch) <= max(L3_WRITE_BATCH, 16)
        for kind, _, slots, *_ in batch:
            host.unhold(kind, slots)
        taken += batch
    assert len(taken) == 3 and l3.queued_pages == 0 and readers(host) == 0
    assert host.full.audit() == []


def test_a_full_queue_refuses_new_values_and_keeps_the_ones_before_them(tiers) -> None:
    """Under write-through a path is queued root first, and a value is read only after the
    values before it: a full queue refuses what comes, holding none of its slots, and keeps
    the beginnings (it used to drop the oldest, so a burst of a deep path's nodes left no
    prefix in Redis)."""
    mc, host, l3 = tiers
    l3.max_queued_pages = 20
    a = cached_on_host(mc, host, 1000, 16)
    b = cached_on_host(mc, host, 50_000, 16)
    l3.queue(a, a.host, None)
    l3.queue(b, b.host, None)  # 32 pages > 20: b's run is refused, its slots never held
    assert [slots for _, _, slots, *_ in l3.pending] == [tuple(a.host)]
    assert l3.queued_pages == 16 and readers(host) == 16
    assert l3.counters["l3_write_failures"] == 1
    for kind, _, slots, *_ in l3.take_batch():  # the writer takes a's run: room again
        host.unhold(kind, slots)
    l3.queue(b, b.host, None)
    assert [slots for _, _, slots, *_ in l3.pending] == [tuple(b.host)]


def test_a_run_with_a_slot_being_filled_is_skipped_and_holds_nothing(tiers) -> None:
    mc, host, l3 = tiers
    node = cached_on_host(mc, host, 1000, 20)  # runs of pages 0-15 and 16-19
    host.pending["full"].add(node.host[3])  # as if a copy were still filling it
    l3.queue(node, node.host, None)
    assert [len(slots) for _, _, slots, *_ in l3.pending] == [4]
    assert l3.counters["l3_write_skipped"] == 1 and readers(host) == 4


def test_values_left_queued_at_a_stop_give_their_slots_back(tiers) -> None:
    mc, host, l3 = tiers
    node = cached_on_host(mc, host, 1000, 40)
    l3.queue(node, node.host, None)
    assert readers(host) == 40
    l3.drop_pending()  # the stop, once the writer has ended
    assert l3.pending == [] and l3.queued_pages == 0 and readers(host) == 0
    assert host.full.refcount(node.host[0]) == 1 and host.full.audit() == []


def test_a_full_queue_under_write_back_keeps_the_beginning_of_a_path(tiers) -> None:
    """Under write_back a host eviction hands nodes over leaf first (a parent leaves host only
    after its children): the oldest queued values are the deepest, and they are the ones a
    full queue loses; the path's first pages stay queued."""
    mc, host, l3 = tiers
    depth = 40
    path = list(range(1000, 1000 + depth * P))
    parent = mc.tree.namespace(NS).root
    for i in range(depth):  # a host-only path of one-page nodes
        slots = host.take("full", 1, NS)
        host.filled("full", slots, NS)
        parent = mc.tree.adopt_host_under(parent, as_token_bytes(path[i * P:(i + 1) * P]),
                                          array("i", slots), array("i", [0]))
        assert parent is not None
    mc.tree.report_host_drops = True
    mc.read_host_drops = l3.host_dropped
    l3.max_queued_pages = 10
    mc.evict_host(depth)
    starts = sorted((int.from_bytes(toks[:4], "little") - 1000) // P
                    for *_, toks, _ in l3.pending)
    assert starts and starts[0] == 0 and l3.queued_pages <= 10
    assert l3.counters["l3_write_failures"] > 0
