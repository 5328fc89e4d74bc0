"""The keyed rounds of ``radixd bench soak``'s clients (radixd_bench/soak_keyed.py) against a real
daemon and a real Redis: what the soak counts as verified, fetched and stale is what the daemon
serves, and a stale page the daemon does serve (one another session pinned through the clear) is
caught, which is also why only a client's own clears raise what it counts as stale."""

from __future__ import annotations

import random

from radixd_client import Client

from radixd_bench.soak_keyed import KEYED_COUNTS, KeyedOptions, KeyedSoak
from tests.redis_procs import SHARED_URL

from .test_tiers import l3_config


def test_keyed_rounds_store_fetch_verify_and_clear_without_a_stale_page(
        make_daemon, prefix: str) -> None:
    """Nine usable full host slots for twelve keys: pages leave host and the lookups' fetches
    bring them back from Redis. After a clear Redis confirmed, every key's page is of before it,
    and nothing of them is served again."""
    d = make_daemon(l3_config(SHARED_URL, prefix, host_pages=10, host_swa_pages=6))
    opts = KeyedOptions(full_keys=12, swa_keys=4, batch=4, fetch_share=1.0,
                        fetch_timeout_s=2.0, clear_every=0)
    with Client(d.socket) as c:
        kv = KeyedSoak("m", c.namespace, "t", opts, random.Random(0))
        counts = dict.fromkeys(KEYED_COUNTS, 0)
        for _ in range(60):
            kv.round(c, counts)
        assert counts["keyed_mismatches"] == 0 and counts["keyed_stale"] == 0, counts
        assert counts["keyed_stored"] >= 16 and counts["keyed_verified"] > 20, counts
        assert counts["keyed_fetched"] > 0, counts  # evicted from host, served from Redis
        assert counts["keyed_stale_checks"] == 0, counts
        kv.clear(c, counts)
        assert counts["keyed_clears_confirmed"] == 1 and kv.floor == kv.epoch == 1
        verified = counts["keyed_verified"]
        for _ in range(6):
            kv.round(c, counts)
        assert counts["keyed_stale_checks"] > 0 and counts["keyed_stale"] == 0, counts
        assert counts["keyed_mismatches"] == 0, counts
        for _ in range(20):  # the keys stored again are served again, at the new epoch
            kv.round(c, counts)
        assert counts["keyed_verified"] > verified and counts["keyed_stale"] == 0, counts
        assert c.stats("m").models["m"]["kv_pins"] == 0  # every round released its pins


def test_a_page_another_session_pinned_through_the_clear_is_counted_stale(make_daemon,
                                                                           prefix: str) -> None:
    """A clear keeps the pages pinned at the time (protocol.md 9.4): here another session of the
    namespace holds one, so the daemon rightly serves it after the clear, and the soak's check
    calls it stale. The soak therefore raises a client's floor only with its own clears, made
    while it holds no pin on its own keys, which no other client looks up."""
    d = make_daemon(l3_config(SHARED_URL, prefix, host_pages=16, host_swa_pages=8))
    opts = KeyedOptions(full_keys=4, swa_keys=0, batch=4, fetch_share=0.0, clear_every=0)
    with Client(d.socket) as c, Client(d.socket) as other:
        kv = KeyedSoak("m", c.namespace, "t", opts, random.Random(0))
        counts = dict.fromkeys(KEYED_COUNTS, 0)
        kv.round(c, counts)
        assert counts["keyed_stored"] == 4 and counts["keyed_verified"] == 0
        held = other.kv_lookup("m", [kv.key("full", 0)])
        assert held.pin
        kv.clear(c, counts)
        assert counts["keyed_clears_confirmed"] == 1
        other.kv_release("m", held.pin)
        kv.round(c, counts)
        assert counts["keyed_stale"] == 1 and counts["keyed_stale_checks"] == 4, counts
        assert counts["keyed_mismatches"] == 0 and counts["keyed_stored"] == 4 + 3, counts


def test_two_tenants_on_the_shared_keys_each_get_their_own_pages(make_daemon,
                                                                 prefix: str) -> None:
    """The shared keys have the same names in both tenants: each stores and reads back its own
    namespace's page, from host and fetched from Redis (few host slots), never the other's."""
    d = make_daemon({**l3_config(SHARED_URL, prefix, host_pages=6, host_swa_pages=4),
                     "tenants": [{"name": "t1", "token": "one"}, {"name": "t2", "token": "two"}]})
    opts = KeyedOptions(full_keys=4, swa_keys=0, shared_keys=8, shared_share=1.0, batch=4,
                        fetch_share=1.0, fetch_timeout_s=2.0, clear_every=0)
    with Client(d.socket, token="one") as a, Client(d.socket, token="two") as b:
        assert a.namespace != b.namespace
        sides = [(c, KeyedSoak("m", c.namespace, ident, opts, random.Random(i)),
                  dict.fromkeys(KEYED_COUNTS, 0))
                 for i, (c, ident) in enumerate(((a, "a"), (b, "b")))]
        for _ in range(40):
            for c, kv, counts in sides:
                kv.round(c, counts)
        for _, _, counts in sides:
            assert counts["keyed_mismatches"] == 0, counts
            assert counts["keyed_shared_verified"] > 10 and counts["keyed_fetched"] > 0, counts
            assert counts["keyed_verified"] == 0  # (only shared keys were used)
