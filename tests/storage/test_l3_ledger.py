"""The L3 quota ledger against a plain list model: random writes and rewrites under random
quotas, and a ledger carried over a restart (adopt) counting as older than what came after."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.storage.l3_ledger import L3Ledger

writes = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 5),
                            st.sampled_from(["full", "swa"]), st.integers(1, 50)), max_size=60)


def _model_charge(model: list, key: tuple, nbytes: int, quota: int) -> list:
    if not quota:
        return []
    model[:] = [(k, n) for k, n in model if k != key] + [(key, nbytes)]
    gone = []
    while sum(n for _, n in model) > quota and model:
        (h, pool), n = model.pop(0)
        gone.append((h, pool, n))
    return gone


@settings(max_examples=200, deadline=None)
@given(writes, st.integers(0, 120), writes)
def test_the_ledger_keeps_the_newest_values_within_the_quota(before, quota, after) -> None:
    ledger, models = L3Ledger(), {"a": [], "b": []}
    for ns, page, pool, n in before:
        got = ledger.charge(ns, bytes([page]), pool, n, quota)
        assert got == _model_charge(models[ns], (bytes([page]), pool), n, quota)
    # a restart: the next daemon adopts what this one wrote, then goes on writing
    carried = ledger.entries()
    ledger = L3Ledger()
    for ns, values in carried.items():
        ledger.adopt(ns, values)
    for ns, page, pool, n in after:
        got = ledger.charge(ns, bytes([page]), pool, n, quota)
        assert got == _model_charge(models[ns], (bytes([page]), pool), n, quota)
    for ns, model in models.items():
        assert ledger.total(ns) == sum(n for _, n in model) <= max(quota, 0) or not quota
        assert ledger.entries().get(ns, []) == [(h, p, n) for (h, p), n in model]


def test_values_given_back_are_the_oldest_and_counted_once() -> None:
    """What Redis did not delete comes back at the old end, in its order; a value written
    again meanwhile is not given back over its newer place."""
    ledger = L3Ledger()
    for page in range(4):
        assert ledger.charge("a", bytes([page]), "full", 10, 30) == (
            [] if page < 3 else [(bytes([0]), "full", 10)])
    gone = ledger.charge("a", bytes([4]), "full", 20, 30)
    assert gone == [(bytes([1]), "full", 10), (bytes([2]), "full", 10)]
    ledger.charge("a", bytes([2]), "full", 5, 100)  # written again meanwhile (no quota pass)
    ledger.give_back("a", [(bytes([0]), "full", 10), *gone])
    assert ledger.entries()["a"] == [(bytes([0]), "full", 10), (bytes([1]), "full", 10),
                                     (bytes([3]), "full", 10), (bytes([4]), "full", 20),
                                     (bytes([2]), "full", 5)]
    assert ledger.total("a") == 55
