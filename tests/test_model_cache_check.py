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
    """model_cache.py:311-316: the holdings/owner-map agreement is checked per holding (pages a
    holding lists must map to it) and, for the full pool only, by a total count. An SWA page left
    in _swa_owner that no holding lists is invisible to check(), yet release_owner() (which walks
    the holding) never frees it: a permanent leak the checker cannot report."""
    c = _cache()
    _, w = c.alloc(1, 2)
    del c.holdings[1].swa[w[0]]  # the corruption a bookkeeping bug would leave
    assert c.check() != []


def test_checker_sees_a_receipt_no_holding_lists() -> None:
    """model_cache.py:317-320: receipts are compared registry-vs-tree only; a receipt in
    _receipts that its owner's holding does not list (so release_owner never unlocks it: a lock
    leaked forever) passes check()."""
    c = _cache()
    f, w = c.alloc(1, 2)
    res, rid = c.insert(1, NS, seq([1, 2]), f, w, lock=True)
    c.holdings[1].receipts.discard(rid)
    assert c.check() != []
