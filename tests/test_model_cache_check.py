"""ModelCache.check (daemon/model_cache.py) sees the bookkeeping corruptions a review found it
blind to."""

from __future__ import annotations

from daemon.gpu.profile import ModelProfile
from daemon.model_cache import ModelCache
from daemon.tree import as_token_bytes

NS = "ns"


def seq(labels: list[int]) -> bytes:
    return as_token_bytes([lab * 1000 + j for lab in labels for j in range(4)])


def _cache() -> ModelCache:
    profile = ModelProfile(
        name="m", page_size=4, num_full_layers=1, num_kv_heads=1, head_dim=1, full_pages=32,
        sliding_window=8, num_swa_layers=1, swa_pages=32, dtype="float32", device="cpu")
    return ModelCache(profile)


def test_checker_sees_an_swa_page_owned_by_no_holding() -> None:
    """A page that drops out of a holding without going anywhere (the corruption a
    bookkeeping bug would leave) is a permanent leak: release_owner() walks the holding and
    never frees it. The checker sees the holding's count disagree with its sets, and the page
    accounted nowhere."""
    c = _cache()
    _, w = c.alloc(1, 2)
    c.holders.swa.holder[w[0]] = 0  # the corruption a bookkeeping bug would leave
    v = c.check()
    assert any("its swa holding counts 2 pages, the page table gives it 1" in s for s in v)
    assert any("swa pool" in s and "unaccounted" in s and str(w[0]) in s for s in v)


def test_checker_sees_a_receipt_no_holding_lists() -> None:
    """model_cache.py:317-320: receipts are compared registry-vs-tree only; a receipt in
    _receipts that its owner's holding does not list (so release_owner never unlocks it: a lock
    leaked forever) passes check()."""
    c = _cache()
    f, w = c.alloc(1, 2)
    res, rid = c.insert(1, NS, seq([1, 2]), f, w, lock=True)
    c.holdings[1].receipts.discard(rid)
    assert c.check() != []


def test_the_trees_host_copies_carry_no_hash_and_the_check_keeps_it_so() -> None:
    """The tree is the index of its host copies: a background copy takes slots without a
    per-page hash (at pages of 4 tokens a key inside a block would cost a SHA-256 a page), and
    the check reports a tree host slot that is indexed under a hash, as only keyed pages are."""
    import asyncio
    import os
    import time
    from array import array

    from radixd_client import protocol as P

    from daemon.app import build_service
    from daemon.config import Config
    from daemon.entities import Peer

    model = {"name": "m", "page_size": 4, "sliding_window": 8, "num_full_layers": 1,
             "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32",
             "device": "cpu", "full_pages": 64, "swa_pages": 32, "host_pages": 32,
             "write_policy": "write_through"}
    svc = build_service(Config(models=[model]), create_pools=True)
    tree = svc.models["m"].cache.tree

    async def fill() -> None:
        svc.start_tiers()
        s = svc.open_session(svc.authenticate(None, Peer(0, os.getuid(), os.getgid())), Peer())
        a = svc.alloc(s, P.Alloc(model="m", n=8))
        svc.insert(s, P.Insert(model="m", tokens=array("i", range(1, 33)).tobytes(),
                               full_pages=a.full_pages, swa_pages=a.swa_pages))
        deadline = time.monotonic() + 10
        while tree.host_pages < 8 and time.monotonic() < deadline:  # the background copy
            await asyncio.sleep(0.01)
        await svc.stop_tiers(time.monotonic() + 5)

    try:
        asyncio.run(fill())
        node = next(n for n in tree.iter_nodes() if n.host is not None and len(n.host) > 1)
        assert svc.check() == []
        pool = svc.models["m"].cache.host.full
        assert [pool.hash_of(s) for s in node.host] == [None] * len(node.host)
        keyed = svc.models["m"].cache.host.keyed["full"]
        keyed_slot = pool.store(bytes(32))  # a keyed page's slot, adopted by the tree
        keyed.add(keyed_slot)
        node.host[0], lost = keyed_slot, node.host[0]
        found = svc.check()
        assert any("in the tree and indexed under a hash" in x for x in found)
        node.host[0] = lost
        keyed.discard(keyed_slot)
        pool.release(keyed_slot)
        assert svc.check() == []
    finally:
        svc.close()


def test_the_check_at_rest_counts_host_readers_per_slot() -> None:
    """A reader count left on a host slot at the stop is a leak, and one release too many on
    another slot (a negative count) must not hide it: readers are counted per slot, not summed."""
    import os

    from daemon.app import build_service
    from daemon.config import Config
    from daemon.entities import Peer

    model = {"name": "m", "page_size": 4, "sliding_window": 8, "num_full_layers": 1,
             "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32",
             "device": "cpu", "full_pages": 64, "swa_pages": 32, "host_pages": 32}
    svc = build_service(Config(models=[model]), create_pools=True)
    try:
        s = svc.open_session(svc.authenticate(None, Peer(0, os.getuid(), os.getgid())), Peer())
        svc.close_session(s)
        assert svc.check_at_rest() == []
        readers = svc.models["m"].cache.host.readers["full"]
        readers[3] += 1  # a reader that never let go
        readers[5] -= 1  # a slot released once too often
        assert svc.check_at_rest() == ["m: 2 full host slot readers left with no session or job"]
        del readers[3], readers[5]
        assert svc.check_at_rest() == [] and svc.check() == []
    finally:
        svc.close()
