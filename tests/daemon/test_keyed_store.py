"""The key-addressed page store through a real daemon on a real socket: engines map the host pools
(kv_attach), reserve slots, write pages into them, commit, and other sessions look them up and read
the same bytes. Every daemon fixture ends with a strict full check (the keyed store's included)."""

from __future__ import annotations

import pytest
import redis as redis_sync
import torch
from radixd_client import Client
from radixd_client.errors import RadixdError
from radixd_client.protocol import Code, KvAttach, KvClear, KvCommit, KvLookup, int32_list

from tests.redis_procs import SHARED_URL, Server, free_port

from .conftest import SMALL_MODEL, Raw
from .test_tiers import (
    Engine,
    admin_get,
    admin_stats,
    l3_config,
    seq,
    wait_for,
)

HOST = {**SMALL_MODEL, "host_pages": 16, "host_swa_pages": 8}


def keys(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def fill(pools, kind: str, slots, seed: int) -> list[torch.Tensor]:
    """Write a distinct random page into each non-zero slot; returns what was written."""
    g = torch.Generator().manual_seed(seed)
    pool = pools.pool(kind)
    out = []
    for s in slots:
        page = torch.randint(0, 256, (pools.page_nbytes[kind],), dtype=torch.uint8, generator=g)
        if s:
            pool[s].copy_(page)
        out.append(page)
    return out


def test_first_slice_store_then_lookup_from_another_session(make_daemon) -> None:
    d = make_daemon({"models": [HOST]})
    with Client(d.socket) as a, Client(d.socket) as b:
        pa = a.kv_attach("m")
        assert pa.full.dtype == torch.uint8 and pa.full.shape[0] == 16
        assert pa.swa is not None and pa.swa.shape[0] == 8
        r = a.kv_reserve("m", keys("k1", "k2", "k3"))
        assert r.pin and r.full == 0 and all(r.slots) and len(set(r.slots)) == 3
        pages = fill(pa, "full", r.slots, 1)
        # reserved keys are invisible until committed
        assert b.kv_lookup("m", keys("k1"), pin=False).present == b"\x00"
        a.kv_commit("m", r.pin)
        pb = b.kv_attach("m")
        got = b.kv_lookup("m", keys("k1", "k2", "k3", "nope"))
        assert got.present == b"\x01\x01\x01\x00" and got.prefix == 3 and got.pin
        assert list(got.slots) == [*r.slots, 0]
        for s, want in zip(got.slots[:3], pages, strict=True):
            assert torch.equal(pb.full[s], want)
        b.kv_release("m", got.pin)
        # a key stored already gets slot 0: nothing to write
        again = a.kv_reserve("m", keys("k2", "k4"))
        assert again.slots[0] == 0 and again.slots[1] and again.pin
        a.kv_release("m", again.pin)  # abort: k4 is not stored
        assert b.kv_lookup("m", keys("k4"), pin=False).present == b"\x00"
        s = b.stats("m").models["m"]
        assert s["kv_pages"] == 3 and s["kv_committed"] == 3 and s["kv_aborted"] == 1


def stats(c: Client) -> dict[str, int]:
    return c.stats("m").models["m"]


def store(c: Client, pools, names: list[str], seed: int, kind: str = "full"
          ) -> dict[str, torch.Tensor]:
    """Reserve, write and commit these keys; returns what each key's page holds."""
    r = c.kv_reserve("m", keys(*names), kind)
    pages = fill(pools, kind, r.slots, seed)
    if r.pin:
        c.kv_commit("m", r.pin)
    return {n: p for n, p, s in zip(names, pages, r.slots, strict=True) if s}


def read(c: Client, pools, names: list[str], kind: str = "full", fetch: bool = False
         ) -> dict[str, torch.Tensor]:
    got = c.kv_lookup("m", keys(*names), kind, fetch=fetch, timeout_s=5)
    out = {n: pools.pool(kind)[s].clone() for n, p, s in
           zip(names, got.present, got.slots, strict=True) if p}
    if got.pin:
        c.kv_release("m", got.pin)
    return out


def test_bad_input_is_refused_with_a_code_and_changes_nothing(make_daemon) -> None:
    d = make_daemon({"models": [HOST, {**HOST, "name": "nowin", "sliding_window": None,
                                       "num_swa_layers": 0, "swa_pages": 0}]})
    with Client(d.socket) as c:
        pools = c.kv_attach("m")
        store(c, pools, ["a"], 1)

        def code(fn, *args, **kw) -> str:
            with pytest.raises(RadixdError) as info:
                fn(*args, **kw)
            return info.value.code

        assert code(c.kv_lookup, "nope", keys("a")) == Code.UNKNOWN_MODEL
        assert code(c.kv_clear, "nope") == Code.UNKNOWN_MODEL  # (refused before any wait)
        assert code(c.kv_reserve, "m", [b""]) == Code.BAD_ARGUMENT
        assert code(c.kv_reserve, "m", [b"x" * 129]) == Code.BAD_ARGUMENT
        assert code(c.kv_lookup, "m", [b"x" * 129]) == Code.BAD_ARGUMENT
        assert code(c.kv_reserve, "m", keys("b", "b")) == Code.BAD_ARGUMENT
        assert code(c.kv_reserve, "m", keys("b"), "mamba") == Code.BAD_ARGUMENT
        assert code(c.kv_reserve, "nowin", keys("b"), "swa") == Code.BAD_ARGUMENT
        assert code(c.kv_release, "m", 12345) == Code.BAD_RECEIPT
        assert code(c.kv_commit, "m", 12345) == Code.BAD_RECEIPT
        r = c.kv_reserve("m", keys("b"))
        c.kv_release("m", r.pin)
        assert code(c.kv_release, "m", r.pin) == Code.BAD_RECEIPT  # double release
        assert code(c.kv_commit, "m", r.pin) == Code.BAD_RECEIPT  # commit after release
        look = c.kv_lookup("m", keys("a"))
        assert code(c.kv_commit, "m", look.pin) == Code.BAD_ARGUMENT  # a lookup pin
        c.kv_release("m", look.pin)
        # a pin is the session's own: another session cannot end it
        look = c.kv_lookup("m", keys("a"))
        with Client(d.socket) as other:
            assert code(other.kv_release, "m", look.pin) == Code.BAD_RECEIPT
        c.kv_release("m", look.pin)
        # fetch is not a batch operation
        with c.batch() as b:
            f = b._call("kv_lookup", KvLookup(model="m", keys=keys("a"), fetch=True))
        assert f.exception() is not None and f.exception().code == Code.BAD_ARGUMENT
        s = stats(c)
        assert s["kv_pages"] == 1 and s["kv_pins"] == 0
        assert read(c, pools, ["a", "b"]).keys() == {"a"}


def test_tenants_do_not_see_each_others_keys_and_quota_declines(make_daemon) -> None:
    d = make_daemon({"models": [HOST], "tenants": [
        {"name": "t1", "token": "one", "quota_host_pages": 4},
        {"name": "t2", "token": "two"}]})
    with Client(d.socket, token="one") as a, Client(d.socket, token="two") as b:
        pa, pb = a.kv_attach("m"), b.kv_attach("m")
        store(b, pb, ["shared-name"], 2)
        assert read(a, pa, ["shared-name"]) == {}
        r = a.kv_reserve("m", keys("k1", "k2", "k3", "k4", "k5", "k6"))
        assert r.full == 2 and list(r.slots[4:]) == [0, 0] and all(r.slots[:4])
        a.kv_commit("m", r.pin)
        assert stats(a)["kv_pages"] == 4 and stats(b)["kv_pages"] == 1
        # over quota the tenant's own oldest pages go first
        r = a.kv_reserve("m", keys("k7"))
        assert r.full == 0 and r.slots[0]
        a.kv_commit("m", r.pin)
        assert read(a, pa, ["k1", "k7"]).keys() == {"k7"} and stats(a)["kv_pages"] == 4
        assert read(b, pb, ["shared-name"]).keys() == {"shared-name"}


def test_a_tenants_stats_count_only_its_namespace_and_operators_see_the_model(
        make_daemon) -> None:
    """A tenant's ``stats`` shows its own namespace's keyed pages, pins and counters, never the
    volumes of another tenant's store; /v1/stats and /metrics show the model's."""
    d = make_daemon({"models": [HOST], "tenants": [
        {"name": "t1", "token": "one"}, {"name": "t2", "token": "two"}]})
    with Client(d.socket, token="one") as a, Client(d.socket, token="two") as b:
        pa = a.kv_attach("m")
        store(a, pa, ["k1", "k2", "k3"], 1)
        held = a.kv_lookup("m", keys("k1", "k2", "nope"))
        assert held.pin
        mine, theirs = stats(a), stats(b)
        assert mine["kv_pages"] == 3 and mine["kv_pins"] == 1
        assert mine["kv_committed"] == 3 and mine["kv_lookups"] == 1
        assert mine["kv_lookup_keys"] == 3 and mine["kv_hit_keys"] == 2
        assert "kv_pages_model" not in mine
        for info in pa.infos.values():  # the host pools' occupancy is every namespace's
            assert "used" not in info.description and "available" not in info.description
            assert info.description["capacity"] == info.slots
        assert theirs["kv_pages"] == 0 and theirs["kv_pins"] == 0
        assert all(theirs[k] == 0 for k in ("kv_reserved", "kv_committed", "kv_lookups",
                                             "kv_lookup_keys", "kv_hit_keys"))
        b.kv_lookup("m", keys("k1"), pin=False)  # t1's key: a miss for t2
        assert stats(b)["kv_lookups"] == 1 and stats(b)["kv_hit_keys"] == 0
        model = admin_stats(d)["models"]["m"]["keyed"]
        assert model["pages"] == {"full": 3, "swa": 0} and model["pins"] == 1
        assert model["counters"]["kv_lookups"] == 2 and model["counters"]["kv_committed"] == 3
        text = admin_get(d, "/metrics").decode()
        assert 'radixd_keyed_pages{model="m",pool="full"} 3.0' in text
        assert 'radixd_keyed_pins{model="m"} 1.0' in text
        assert 'radixd_keyed_events_total{event="lookups",model="m"} 2.0' in text
        a.kv_release("m", held.pin)


def test_a_session_may_pin_at_most_max_locks_per_session_keys(make_daemon) -> None:
    """The keys a session's pins and reservations name are capped like lock receipts: each
    costs daemon memory and keeps its page from eviction. Past the cap ``too_many_locks``
    (details.limit), nothing taken; a lookup without a pin still answers, a key named many
    times is pinned once, and a released pin makes room."""
    d = make_daemon({"models": [HOST], "server": {"max_locks_per_session": 3}})
    with Client(d.socket) as c, Client(d.socket) as other:
        pools = c.kv_attach("m")
        store(c, pools, ["a"], 1)
        pins = [c.kv_lookup("m", keys("a")).pin for _ in range(2)]
        pins.append(c.kv_reserve("m", keys("b")).pin)
        assert all(pins) and stats(c)["kv_pins"] == 3
        for call in (lambda: c.kv_lookup("m", keys("a")),
                     lambda: c.kv_reserve("m", keys("x")),
                     lambda: c.kv_lookup("m", keys("a"), fetch=True, timeout_s=1)):
            with pytest.raises(RadixdError) as info:
                call()
            assert info.value.code == Code.TOO_MANY_LOCKS
            assert info.value.details == {"limit": 3}
        assert stats(c)["kv_pins"] == 3 and stats(c)["kv_reserved"] == 2
        long_keys = [b"y" * n for n in range(129, 133)]  # distinct: 4 more than the cap
        for fetch in (False, True):  # the argument checks come first, with a fetch too
            for args in ({"keys": long_keys}, {"keys": keys("a", "b", "c", "d"),
                                               "pool": "bogus"}):
                with pytest.raises(RadixdError) as info:
                    c.kv_lookup("m", fetch=fetch, timeout_s=1, **args)
                assert info.value.code == Code.BAD_ARGUMENT, (fetch, args, info.value)
        assert c.kv_lookup("m", keys("a"), pin=False).present == b"\x01"
        theirs = other.kv_lookup("m", keys("a")).pin  # the cap is per session
        assert theirs
        other.kv_release("m", theirs)
        c.kv_release("m", pins.pop())
        with pytest.raises(RadixdError) as info:  # a fetch counts every distinct key it names
            c.kv_lookup("m", keys("a", "zz"), fetch=True, timeout_s=1)
        assert info.value.code == Code.TOO_MANY_LOCKS
        many = c.kv_lookup("m", keys(*["a"] * 1000))  # one distinct key: one more held
        assert many.pin and stats(c)["kv_pins"] == 3
        with pytest.raises(RadixdError):
            c.kv_reserve("m", keys("x"))
        c.kv_release("m", many.pin)
        assert c.kv_reserve("m", keys("x")).pin


def test_session_death_releases_pins_and_reservations(make_daemon) -> None:
    d = make_daemon({"models": [HOST]})
    with Client(d.socket) as keep:
        pools = keep.kv_attach("m")
        store(keep, pools, ["a"], 1)
        dying = Client(d.socket)
        dying.kv_lookup("m", keys("a"))
        r = dying.kv_reserve("m", keys("b", "c"))
        assert r.pin and stats(keep)["kv_pins"] == 2
        dying.close()
        wait_for(lambda: stats(keep)["kv_pins"] == 0, "the session's pins to end")
        assert read(keep, pools, ["a", "b", "c"]).keys() == {"a"}
        cleared = keep.kv_clear("m")
        assert cleared.removed == 1 and cleared.l3_cleared is True  # no Redis: nothing to record


def test_eviction_is_shared_with_tree_host_pages_and_spares_pins(make_daemon) -> None:
    """16 host slots (15 usable): keyed pages and the tree's host copies compete for them."""
    d = make_daemon({"models": [HOST]})
    e = Engine(d.socket)
    try:
        pools = e.c.kv_attach("m")
        written = store(e.c, pools, [f"k{i}" for i in range(10)], 3)
        pin = e.c.kv_lookup("m", keys("k0", "k1")).pin  # pinned: never evicted
        e.cache(seq(10))  # write_through: 10 pages to host, only 5 slots free
        wait_for(lambda: stats(e.c)["tree_host_pages"] == 10, "the tree's host copies")
        s = stats(e.c)
        assert s["kv_evicted"] == 5 and s["kv_pages"] == 5
        got = read(e.c, pools, [f"k{i}" for i in range(10)])
        assert {"k0", "k1"} <= got.keys()
        for name, page in got.items():
            assert torch.equal(page, written[name])
        e.c.kv_release("m", pin)
        # and the other way round: keyed pages take the tree's (older) host-only pages
        e.c.evict("m", full_pages=1000, swa_pages=1000)
        store(e.c, pools, [f"n{i}" for i in range(12)], 4)
        s = stats(e.c)
        assert s["kv_pages"] >= 12 and s["tree_host_pages"] < 10
    finally:
        e.close()


def test_redis_write_through_then_eviction_then_fetch(make_daemon, prefix: str) -> None:
    d = make_daemon(l3_config(SHARED_URL, prefix, host_pages=8, host_swa_pages=4))
    with Client(d.socket) as c:
        pools = c.kv_attach("m")
        written = store(c, pools, ["a", "b", "c"], 5)
        sw = store(c, pools, ["w"], 6, "swa")
        wait_for(lambda: stats(c)["kv_l3_write_pages"] == 4, "the Redis writes")
        store(c, pools, [f"x{i}" for i in range(7)], 7)  # 7 usable slots: a, b, c evicted
        assert read(c, pools, ["a", "b", "c"]) == {}
        got = c.kv_lookup("m", keys("a", "b", "c", "never"), fetch=True, timeout_s=5)
        assert got.present == b"\x01\x01\x01\x00" and got.fetched == 3 and got.prefix == 3
        for name, s in zip("abc", got.slots, strict=False):
            assert torch.equal(pools.full[s], written[name])
        c.kv_release("m", got.pin)
        # a corrupted value in Redis is a miss, never served
        raw = redis_sync.Redis.from_url(SHARED_URL)
        try:
            for k in raw.scan_iter(match=prefix + ":*"):
                v = bytearray(raw.get(k))
                v[-1] ^= 0xFF
                raw.set(k, bytes(v))
        finally:
            raw.close()
        store(c, pools, [f"y{i}" for i in range(7)], 8)  # a, b, c leave host again
        assert c.kv_lookup("m", keys("a"), fetch=True, pin=False).present == b"\x00"
        # the SWA page went through Redis too, kind-checked
        assert read(c, pools, ["w"], "swa", fetch=True).keys() == sw.keys()


def test_a_fetch_makes_room_from_other_pages_than_the_requests_own(make_daemon,
                                                                     prefix: str) -> None:
    """Seven host slots. k0..k5 written to Redis; k0..k2 hit, then four newer pages push
    k3..k5 out of host. A lookup of k0..k5 with fetch brings k3..k5 back in place of three of
    the four newer pages, not of k0..k2: before 2026-11-29 the fetch made room before the
    lookup touched the request's own pages, took k0..k2 (the least recently used), and the
    request's prefix came back empty (the SGLang backend's batch_exists saw 0 of 6)."""
    d = make_daemon(l3_config(SHARED_URL, prefix, host_pages=8, host_swa_pages=4))
    names = [f"k{i}" for i in range(6)]
    with Client(d.socket) as c:
        pools = c.kv_attach("m")
        written = store(c, pools, names, 11)
        wait_for(lambda: stats(c)["kv_l3_write_pages"] == 6, "the Redis writes")
        assert read(c, pools, names[:3]).keys() == set(names[:3])
        store(c, pools, [f"u{i}" for i in range(4)], 12)
        assert read(c, pools, names[3:]) == {}  # only in Redis now (k0..k2 left untouched)
        got = read(c, pools, names, fetch=True)
        assert got.keys() == set(names)
        assert all(torch.equal(got[n], written[n]) for n in names)
        assert read(c, pools, [f"u{i}" for i in range(4)]).keys() == {"u3"}


def test_a_fetch_never_trades_the_requests_own_pages_for_its_others(make_daemon,
                                                                      prefix: str) -> None:
    """Seven host slots hold k0..k6; k7..k9 are only in Redis. A lookup of k0..k9 with fetch
    keeps its prefix of seven (nothing else could make room, so nothing is fetched): the
    request's own pages are pinned while room is made (before, a touch alone left them the only
    victims, and the prefix came back empty)."""
    d = make_daemon(l3_config(SHARED_URL, prefix, host_pages=8, host_swa_pages=4))
    names = [f"k{i}" for i in range(10)]
    with Client(d.socket) as c:
        pools = c.kv_attach("m")
        written = store(c, pools, names[7:], 13)
        wait_for(lambda: stats(c)["kv_l3_write_pages"] == 3, "the Redis writes")
        written.update(store(c, pools, names[:7], 14))
        assert read(c, pools, names[7:]) == {}
        got = c.kv_lookup("m", keys(*names), fetch=True, timeout_s=2)
        assert got.present == b"\x01" * 7 + b"\x00" * 3 and got.prefix == 7
        assert all(torch.equal(pools.full[s], written[n])
                   for n, s in zip(names[:7], got.slots, strict=False))
        c.kv_release("m", got.pin)


@pytest.mark.parametrize("on_device", [False, True])
def test_an_swa_reservation_takes_the_tree_leaves_that_hold_swa_host_slots(
        make_daemon, on_device: bool) -> None:
    """Twelve prompts on host, only the first with SWA host copies (three SWA host slots); it is
    matched, so it is the most recent. Two keyed SWA pages need its two slots: that prompt goes
    (4 full host pages), not the eleven that hold none (before 2026-11-29 all twelve went, 48
    full host pages for 2 SWA slots). ``on_device``: the first prompt stays on device, so no
    host leaf holds SWA host slots: the tree keeps all 48 and the reservation declines what
    does not fit."""
    d = make_daemon({"models": [{**SMALL_MODEL, "full_pages": 256, "swa_pages": 128,
                                 "host_pages": 64, "host_swa_pages": 4}]})
    prompts = [[1000 * p + i for i in range(16)] for p in range(12)]
    with Client(d.socket) as c:
        c.attach("m")
        for toks in prompts:
            a = c.alloc("m", 4)
            c.insert("m", toks, int32_list(a.full_pages), int32_list(a.swa_pages))
        wait_for(lambda: stats(c)["tree_host_pages"] == 48, "the host copies")
        assert c.match("m", prompts[0]).prefix_len == 16
        c.evict("m", full_pages=44 if on_device else 1000, swa_pages=0 if on_device else 1000)
        tiers = admin_stats(d)["models"]["m"]["tiers"]
        assert stats(c)["tree_full_pages"] == (4 if on_device else 0)
        assert tiers["host_swa_pages_used"] == 2
        c.kv_attach("m")
        c.kv_commit("m", c.kv_reserve("m", keys("s0"), "swa").pin)
        r = c.kv_reserve("m", keys("s1", "s2"), "swa")
        if on_device:
            assert sorted(bool(x) for x in r.slots) == [False, True] and r.full == 1
            assert stats(c)["tree_host_pages"] == 48
        else:
            assert all(r.slots) and stats(c)["tree_host_pages"] == 44
            assert c.match("m", prompts[0]).host_hit_len == 0
        assert all(c.match("m", t).host_hit_len == 0 for t in prompts[1:])  # no SWA window
        c.kv_release("m", r.pin)


def test_an_swa_reservation_reaches_a_window_behind_a_host_leaf_without_one(make_daemon) -> None:
    """Prompt A's host copy took both SWA host slots (its window); B extends A, and B's copy
    found no SWA slot. On host only, B is a leaf without SWA slots over A's window, so no leaf
    holds any: a keyed SWA reservation was declined with both slots out of its reach. It takes
    B then A, as the tree's own SWA host eviction does."""
    d = make_daemon({"models": [{**SMALL_MODEL, "full_pages": 256, "swa_pages": 128,
                                 "host_pages": 64, "host_swa_pages": 3}]})
    a_toks = [1000 + i for i in range(8)]
    b_toks = a_toks + [2000 + i for i in range(8)]
    with Client(d.socket) as c:
        c.attach("m")
        a = c.alloc("m", 2)
        c.insert("m", a_toks, int32_list(a.full_pages), int32_list(a.swa_pages))
        wait_for(lambda: stats(c)["tree_host_pages"] == 2, "A's host copy")
        b = c.alloc("m", 2)
        c.insert("m", b_toks, int32_list(b.full_pages), int32_list(b.swa_pages),
                 prev_prefix_len=8)
        wait_for(lambda: stats(c)["tree_host_pages"] == 4, "B's host copy")
        tiers = admin_stats(d)["models"]["m"]["tiers"]
        assert tiers["host_swa_pages_used"] == tiers["host_swa_pages_capacity"] == 2
        c.evict("m", full_pages=1000, swa_pages=1000)
        assert c.match("m", b_toks).host_hit_len == 8  # A's window, behind B
        c.kv_attach("m")
        r = c.kv_reserve("m", keys("s1"), "swa")
        assert r.pin and all(r.slots) and r.full == 0
        assert stats(c)["tree_host_pages"] == 0 and c.match("m", b_toks).host_hit_len == 0
        c.kv_release("m", r.pin)


def test_a_fetch_waits_for_the_slots_redis_writes_still_read(make_daemon, tmp_path) -> None:
    """Seven host slots (8, one reserved); writes are paused on the Redis server, so the pages
    committed meanwhile stay queued for it, their slots held until the writer has read them. A
    fetch that needs three slots evicts the one page that is not held, passes over the held ones
    (evicting them frees no slot while a write still reads it, so every page would go) and waits,
    within its timeout, for the writes to read them; then it evicts two more and brings all
    three values back, byte-exact."""
    srv = Server(free_port(), tmp_path)
    srv.start()
    raw = redis_sync.Redis.from_url(srv.url)
    try:
        cfg = l3_config(srv.url, "held", host_pages=8, host_swa_pages=4)
        cfg["l3"]["op_timeout_ms"] = 20000
        d = make_daemon(cfg)
        with Client(d.socket, timeout=30) as c:
            pools = c.kv_attach("m")
            written = store(c, pools, ["a", "b", "c"], 1)
            wait_for(lambda: stats(c)["kv_l3_write_pages"] == 3, "the Redis writes")
            raw.client_pause(3000, all=False)  # writes wait on the server, reads are served
            store(c, pools, ["s0"], 2)  # its write is taken, then waits on the server
            wait_for(lambda: raw.info("clients")["blocked_clients"] >= 1, "a paused write")
            # evicts a, b and c; their writes queue behind s0's, their slots held
            later = store(c, pools, [f"s{i}" for i in range(1, 7)], 3)
            assert read(c, pools, ["a", "b", "c"]) == {}
            got = c.kv_lookup("m", keys("a", "b", "c"), fetch=True, timeout_s=15)
            assert got.present == b"\x01\x01\x01" and got.fetched == 3
            for name, s in zip("abc", got.slots, strict=True):
                assert torch.equal(pools.full[s], written[name])
            c.kv_release("m", got.pin)
            # s0 (not held) and then the two oldest of the held pages made the room: no more
            kept = read(c, pools, [f"s{i}" for i in range(7)])
            assert kept.keys() == {"s3", "s4", "s5", "s6"}
            for name, page in kept.items():
                assert torch.equal(page, later[name])
            s = stats(c)
            assert s["kv_evicted"] == 6 and s["kv_l3_fetched"] == 3
            wait_for(lambda: stats(c)["kv_l3_write_pages"] == 10, "the paused writes")
    finally:
        raw.close()
        srv.kill()


def redis_keys(key_prefix: str) -> int:
    """The page values under the prefix (not the namespaces' clear generations)."""
    raw = redis_sync.Redis.from_url(SHARED_URL)
    try:
        return sum(1 for k in raw.scan_iter(match=key_prefix + ":*")
                   if not k.startswith(f"{key_prefix}:kvgen:".encode()))
    finally:
        raw.close()


def test_keyed_pages_count_against_the_tenants_l3_quota(make_daemon, prefix: str) -> None:
    """A full keyed page is 2048 payload bytes plus its header: 7168 bytes admit 3 values, not 4.
    Over the quota, the namespace's least recently written pages leave Redis (counted, as tree
    pages are); the other tenant's pages stay."""
    config = l3_config(SHARED_URL, prefix, host_pages=16, host_swa_pages=8)
    config["tenants"] = [{"name": "t1", "token": "one", "quota_l3_bytes": 7168},
                         {"name": "t2", "token": "two"}]
    d = make_daemon(config)
    tiers = lambda: admin_stats(d)["models"]["m"]["tiers"]  # noqa: E731
    with Client(d.socket, token="one") as a, Client(d.socket, token="two") as b:
        pa, pb = a.kv_attach("m"), b.kv_attach("m")
        written = store(a, pa, ["a", "b", "c", "d", "e"], 1)  # one batch, written in this order
        store(b, pb, [f"o{i}" for i in range(5)], 2)
        wait_for(lambda: tiers()["l3_write_failures"] == 0
                 and stats(a)["kv_l3_write_pages"] == 5 and stats(b)["kv_l3_write_pages"] == 5,
                 "the Redis writes")
        wait_for(lambda: tiers()["l3_quota_deleted_pages"] == 2, "the quota deletions")
        assert redis_keys(prefix) == 3 + 5
        # t2 (no L3 quota) fills host: every t1 page leaves host, only Redis can answer now
        store(b, pb, [f"x{i}" for i in range(15)], 3)
        wait_for(lambda: stats(b)["kv_l3_write_pages"] == 20, "t2's Redis writes")
        assert stats(a)["kv_pages"] == 0
        got = a.kv_lookup("m", keys("a", "b", "c", "d", "e"), fetch=True, timeout_s=5)
        assert got.present == b"\x00\x00\x01\x01\x01" and got.fetched == 3
        for name, s in zip("cde", got.slots[2:], strict=True):
            assert torch.equal(pa.full[s], written[name])
        a.kv_release("m", got.pin)
        assert tiers()["l3_quota_deleted_pages"] == 2 and redis_keys(prefix) == 3 + 20


def test_keyed_and_tree_pages_share_one_l3_ledger(make_daemon, prefix: str
                                                  ) -> None:
    """A keyed page's value is ~2.1 KB; the two tree pages are two values of ~4.2 KB, their
    full run and their SWA window, counted apart. Two tree pages and one keyed page fit 11500
    bytes; a second keyed page does not, and the namespace's least recently written value, the
    tree pages' full run, leaves Redis."""
    config = l3_config(SHARED_URL, prefix, host_pages=16, host_swa_pages=8)
    config["tenants"] = [{"name": "t1", "token": "one", "quota_l3_bytes": 11500}]
    d = make_daemon(config)
    tiers = lambda: admin_stats(d)["models"]["m"]["tiers"]  # noqa: E731
    e = Engine(d.socket, token="one")  # the tenant's engine: its tree pages go to host, Redis
    try:
        e.cache(seq(2))
        wait_for(lambda: tiers()["l3_write_pages"] == 4, "the tree's Redis writes")
        pools = e.c.kv_attach("m")
        store(e.c, pools, ["a", "b"], 1)
        wait_for(lambda: stats(e.c)["kv_l3_write_pages"] == 2, "the keyed Redis writes")
        wait_for(lambda: tiers()["l3_quota_deleted_pages"] == 1, "the quota deletion")
        raw = redis_sync.Redis.from_url(SHARED_URL)
        try:
            left = [k.decode() for k in raw.scan_iter(match=prefix + ":*")]
        finally:
            raw.close()
        # the tree's SWA window and both keyed pages
        assert len(left) == 3 and sum(k.endswith(":swa") for k in left) == 1
    finally:
        e.close()


def test_redis_down_is_a_miss(make_daemon) -> None:
    d = make_daemon(l3_config(f"redis://127.0.0.1:{free_port()}/0", "down"))
    with Client(d.socket) as c:
        pools = c.kv_attach("m")
        store(c, pools, ["a"], 1)
        got = c.kv_lookup("m", keys("a", "b"), fetch=True, timeout_s=2)
        assert got.present == b"\x01\x00" and got.fetched == 0
        c.kv_release("m", got.pin)


def test_kv_attach_raw_frame_without_fds_reader_still_answers(make_daemon) -> None:
    """kv_attach on a model without a host tier is a clean error, the session survives."""
    d = make_daemon({"models": [{**SMALL_MODEL, "host_pages": 0}]})
    raw = Raw(d.socket)
    try:
        r = raw.call(KvAttach(id=7, model="m"))
        assert not r.ok and r.error.code == Code.BAD_ARGUMENT
        r = raw.call(KvClear(id=8, model="m"))  # a waiting operation, refused as plainly
        assert not r.ok and r.error.code == Code.BAD_ARGUMENT and r.id == 8
    finally:
        raw.close()


def test_a_clear_right_after_a_commit_leaves_nothing_in_redis(make_daemon, prefix: str) -> None:
    """The commit queues the page's Redis write; the clear in the same batch ran its delete
    before that write, which then stored the cleared page, and a fetch served it again (as a
    review found). A clear takes the queued writes back, and a write under way deletes after
    itself."""
    d = make_daemon(l3_config(SHARED_URL, prefix, host_pages=16, host_swa_pages=8))
    with Client(d.socket) as c:
        pools = c.kv_attach("m")
        names = [f"gone{i}" for i in range(6)]
        for round_ in range(3):
            r = c.kv_reserve("m", keys(*names[2 * round_:2 * round_ + 2]))
            assert r.pin and all(r.slots)
            fill(pools, "full", r.slots, round_)
            with c.batch() as b:
                b._call("kv_commit", KvCommit(model="m", pin=r.pin))
                cleared = b._call("kv_clear", KvClear(model="m"))
            # in a batch the answer does not wait for Redis to record the clear
            assert cleared.result().removed == 2 and cleared.result().l3_cleared is False
        wait_for(lambda: admin_stats(d)["models"]["m"]["keyed"]["counters"]["kv_cleared"] == 6,
                 "the clears")
        store(c, pools, ["after"], 9)  # a later write: once it is in Redis, so is all before
        wait_for(lambda: stats(c)["kv_l3_write_pages"] >= 1 and redis_keys(prefix) == 1,
                 "the writes to settle")
        got = c.kv_lookup("m", keys(*names), fetch=True, timeout_s=5)
        assert got.present == bytes(6) and got.fetched == 0


def gone_from_host(c: Client, pools, names: list[str]) -> dict[str, torch.Tensor]:
    """Store ``names`` four at a time in a host pool of 16 slots, each four written before the
    next (a slot a write still reads is not evicted: the next keys would be declined): the
    oldest are evicted and live in Redis only; returns what each stored key's page holds."""
    stored: dict[str, torch.Tensor] = {}
    for i in range(0, len(names), 4):
        stored |= store(c, pools, names[i:i + 4], i)
        written = len(stored)
        wait_for(lambda w=written: stats(c)["kv_l3_write_pages"] == w, "the Redis writes")
    assert len(stored) == len(names) and stats(c)["kv_evicted"] > 0
    return stored


def test_a_clear_leaves_no_page_readable_in_redis_those_gone_from_host_included(
        make_daemon, prefix: str) -> None:
    """Pages evicted from host live on in Redis; a clear dropped only those on host and deleted
    only their values, so a fetch brought the others back after it: the KV of before the
    clear (after a weight update, stale KV). The clear raises the namespace's generation in
    Redis, which names every keyed value: nothing written before it is found, by this daemon
    or by one started later on the same Redis; what is stored after it is."""
    cfg = l3_config(SHARED_URL, prefix, host_pages=16, host_swa_pages=8)
    d = make_daemon(cfg)
    names = [f"k{i}" for i in range(24)]
    with Client(d.socket) as c:
        pools = c.kv_attach("m")
        stored = gone_from_host(c, pools, names)
        on_host = stats(c)["kv_pages"]
        cleared = c.kv_clear("m")
        assert cleared.removed == on_host < len(stored) and cleared.l3_cleared is True
        got = c.kv_lookup("m", keys(*names), fetch=True, timeout_s=5)
        assert got.present == bytes(len(names)) and got.fetched == 0 and not got.pin
        after = store(c, pools, ["new"], 99)
        wait_for(lambda: stats(c)["kv_l3_write_pages"] == len(stored) + 1, "the new write")
    later = make_daemon(cfg, name="later")  # another daemon on the same Redis
    with Client(later.socket) as c:
        pools = c.kv_attach("m")
        assert read(c, pools, names + ["new"], fetch=True).keys() == {"new"}
        assert torch.equal(read(c, pools, ["new"])["new"], after["new"])


def test_a_clear_that_cannot_reach_redis_keeps_the_namespace_from_reading_it(
        make_daemon, tmp_path) -> None:
    """This Redis refuses the clear's raise of the generation (INCRBY disabled). Until the raise
    lands, nothing of the namespace is read from Redis, so the values of before the clear that
    it could not make unreadable are not found; nor is anything written under the old
    generation (a failed write, counted)."""
    srv = Server(free_port(), tmp_path, "--rename-command", "INCRBY", "")
    srv.start()
    try:
        cfg = l3_config(srv.url, "noincr", host_pages=16, host_swa_pages=8)
        cfg["l3"]["drain_timeout_s"] = 0.2  # the raise never lands: the stop need not wait
        d = make_daemon(cfg)
        names = [f"k{i}" for i in range(24)]
        with Client(d.socket) as c:
            pools = c.kv_attach("m")
            stored = gone_from_host(c, pools, names)
            assert c.kv_clear("m").l3_cleared is False  # the engine is told: clear again later
            got = c.kv_lookup("m", keys(*names), fetch=True, timeout_s=2)
            assert got.present == bytes(len(names)) and got.fetched == 0
            store(c, pools, ["new"], 9)
            wait_for(lambda: stats(c)["kv_l3_write_failures"] == 1, "the refused write")
            assert stats(c)["kv_l3_write_pages"] == len(stored)
    finally:
        srv.kill()


def test_pages_stored_before_another_daemons_clear_are_not_written_back_after_it(
        make_daemon, prefix: str) -> None:
    """Two daemons on one Redis, under write-back. B stored pages, then A cleared the namespace;
    B's eviction wrote them later under the generation A's clear had raised, and A fetched them
    back: KV of before the clear, served after it (found by the keyed-store hunt). A page is
    written only under the generation B knew when it stored it: those of before the clear are
    dropped and counted, and what B stores once it knows the new one is written, and found."""
    cfg = l3_config(SHARED_URL, prefix, host_pages=16, host_swa_pages=8)
    cfg["l3"]["write_policy"] = "write_back"
    a, b = make_daemon(cfg, name="a"), make_daemon(cfg, name="b")
    old = [f"old{i}" for i in range(4)]
    with Client(a.socket) as ca, Client(b.socket) as cb:
        pa, pb = ca.kv_attach("m"), cb.kv_attach("m")
        assert read(cb, pb, ["none"], fetch=True) == {}  # B reads the generation
        store(cb, pb, old, 1)
        assert ca.kv_clear("m").l3_cleared is True

        def evict_from_b(seed: int) -> None:  # 16 more pages: the oldest 4 leave B's host
            for i in range(4):
                store(cb, pb, [f"fill{seed}_{i}_{j}" for j in range(4)], seed + i)

        evict_from_b(10)
        wait_for(lambda: stats(cb)["kv_l3_write_pages"] + stats(cb)["kv_l3_write_outdated"]
                 >= 4, "B's write-backs")
        assert read(cb, pb, old) == {}  # gone from B's host
        assert read(ca, pa, old, fetch=True) == {}  # and never in Redis under the new name
        assert stats(cb)["kv_l3_write_outdated"] >= 4
        written = stats(cb)["kv_l3_write_pages"]
        new = store(cb, pb, ["new0", "new1"], 50)  # B knows the new generation now
        evict_from_b(60)
        wait_for(lambda: stats(cb)["kv_l3_write_pages"] >= written + 2, "the new write-backs")
        got = read(ca, pa, ["new0", "new1"], fetch=True)
        assert got.keys() == new.keys()
        assert all(torch.equal(got[k], new[k]) for k in new)


def test_cleared_pages_no_longer_count_against_the_l3_quota(make_daemon, prefix: str) -> None:
    """7168 bytes admit three keyed values. After a clear of two, two more fit beside the one
    kept; the clear's values stayed charged before, and a live value was deleted instead."""
    config = l3_config(SHARED_URL, prefix, host_pages=16, host_swa_pages=8)
    config["tenants"] = [{"name": "t1", "token": "one", "quota_l3_bytes": 7168}]
    d = make_daemon(config)
    with Client(d.socket, token="one") as c:
        pools = c.kv_attach("m")
        store(c, pools, ["a"], 1)
        wait_for(lambda: redis_keys(prefix) == 1, "a written")
        store(c, pools, ["b", "c"], 2)
        wait_for(lambda: redis_keys(prefix) == 3, "b and c written")
        keep = c.kv_lookup("m", keys("a")).pin  # pinned: the clear spares it
        assert c.kv_clear("m").removed == 2
        wait_for(lambda: redis_keys(prefix) == 1, "b and c deleted")
        store(c, pools, ["d", "e"], 3)
        wait_for(lambda: stats(c)["kv_l3_write_pages"] == 5, "d and e written")
        assert redis_keys(prefix) == 3
        assert admin_stats(d)["models"]["m"]["tiers"]["l3_quota_deleted_pages"] == 0
        c.kv_release("m", keep)


def test_what_redis_stored_of_a_partly_failed_batch_is_charged(make_daemon, tmp_path) -> None:
    """Redis refuses part of a write batch (an ACL here; in service, one failed shard or
    maxmemory crossed half way): the values it stored are counted as written, marked as in
    Redis, and charged to the namespace's quota_l3_bytes, which then keeps what Redis holds of
    the namespace within it. They used to be counted as failures and never charged: 8 values,
    17 KB, stayed in Redis against a quota of 7 KB."""
    srv = Server(free_port(), tmp_path)
    srv.start()
    raw = redis_sync.Redis(port=srv.port)
    try:  # may read every key, write the generations and about half of the page keys
        raw.execute_command("ACL", "SETUSER", "half", "on", ">pw", "+@all", "%R~*",
                            "%W~pfx:kvgen:*", "%W~pfx:[0-7]*")
        cfg = l3_config(f"redis://half:pw@127.0.0.1:{srv.port}/0", "pfx",
                        host_pages=32, host_swa_pages=8)
        cfg["l3"]["breaker_threshold"] = 1000  # (refused SETs are errors, not an outage)
        cfg["tenants"] = [{"name": "t1", "token": "one", "quota_l3_bytes": 7168}]
        d = make_daemon(cfg)

        def values() -> list[bytes]:
            return [k for k in raw.scan_iter(match="pfx:*") if not k.startswith(b"pfx:kvgen:")]
        with Client(d.socket, token="one") as c:
            pools = c.kv_attach("m")
            store(c, pools, [f"a{i}" for i in range(10)], 1)  # one batch
            wait_for(lambda: stats(c)["kv_l3_write_pages"] + stats(c)["kv_l3_write_failures"]
                     == 10, "the partly refused batch")
            first = stats(c)["kv_l3_write_pages"]
            assert 0 < first < 10
            within = lambda: sum(raw.strlen(k) for k in values()) <= 7168  # noqa: E731
            wait_for(within, "the quota")
            raw.execute_command("ACL", "SETUSER", "half", "%W~*")  # every write taken now
            store(c, pools, [f"b{i}" for i in range(6)], 2)
            wait_for(lambda: stats(c)["kv_l3_write_pages"] == first + 6, "the second batch")
            wait_for(within, "the quota")
            tiers = admin_stats(d)["models"]["m"]["tiers"]
            assert tiers["l3_quota_deleted_pages"] == first + 6 - len(values()) > 0
    finally:
        raw.close()
        srv.kill()
