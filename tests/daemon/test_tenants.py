"""Tenants: tokens, namespaces, allowed models, quotas, against a real daemon."""

from __future__ import annotations

import hashlib
import socket
import struct
from array import array
from typing import Any

import pytest
from radixd_client import Client, protocol
from radixd_client.errors import AuthError, OutOfMemory, QuotaExceeded

from .conftest import SMALL_MODEL
from .test_tiers import wait_for

P = 4


def toks(n_pages: int, base: int = 1) -> bytes:
    return array("i", range(base, base + n_pages * P)).tobytes()


def cache(c: Client, model: str, tokens: bytes) -> None:
    a = c.alloc(model, len(tokens) // 4 // P)
    c.insert(model, tokens, a.full_pages, a.swa_pages)


TENANTS = {
    "models": [SMALL_MODEL, {**SMALL_MODEL, "name": "other"}],
    "tenants": [
        {"name": "alice", "token": "alice-token", "namespace": "ns-a",
         "quota_full_pages": 10, "quota_swa_pages": 10},
        {"name": "bob", "token_sha256": hashlib.sha256(b"bob-token").hexdigest(),
         "namespace": "ns-b"},
        {"name": "carol", "token": "carol-token", "namespace": "ns-b", "models": ["m"]},
    ],
}


def test_tokens_are_required_and_checked(make_daemon) -> None:
    d = make_daemon(TENANTS)
    with pytest.raises(AuthError, match="token is required"):
        Client(d.socket)
    with pytest.raises(AuthError, match="unknown tenant token"):
        Client(d.socket, token="alice-token-wrong")
    with Client(d.socket, token="bob-token") as c:
        assert (c.tenant, c.namespace) == ("bob", "ns-b")
    # a session that is refused can still authenticate afterwards, up to max_auth_failures
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(d.socket)

        def call(req) -> protocol.Response:
            s.sendall(protocol.encode(req))
            (n,) = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))
            return protocol.decode_response(s.recv(n, socket.MSG_WAITALL))

        assert call(protocol.Ping(id=1)).error.code == "not_authenticated"
        assert call(protocol.Hello(id=2, token="nope")).error.code == "auth_failed"
        assert call(protocol.Hello(id=3, token="alice-token")).ok
        assert call(protocol.Hello(id=4, token="alice-token")).error.code == \
            "already_authenticated"


def test_namespaces_never_share_prefixes(make_daemon) -> None:
    d = make_daemon(TENANTS)
    t = toks(4)
    with Client(d.socket, token="alice-token") as alice, \
            Client(d.socket, token="bob-token") as bob, \
            Client(d.socket, token="carol-token") as carol:
        cache(alice, "m", t)
        assert alice.match("m", t).prefix_len == 4 * P
        assert bob.match("m", t).prefix_len == 0  # another namespace: no hit
        cache(bob, "m", t)
        assert carol.match("m", t).prefix_len == 4 * P  # carol shares bob's namespace
        # a node id from another namespace is unknown here
        node = alice.match("m", t).node
        with pytest.raises(Exception) as ei:
            bob.lock("m", node)
        assert ei.value.code == "unknown_node"
        # carol may not use the other model
        with pytest.raises(Exception) as ei:
            carol.match("other", t)
        assert ei.value.code == "model_not_allowed"
        # bob's explicit evict only touches bob's namespace
        bob.evict("m", full_pages=100, swa_pages=100)
        assert alice.match("m", t).prefix_len == 4 * P
        assert carol.match("m", t).prefix_len == 0
    d.check()


def test_quota_evicts_own_cold_pages_first_then_refuses(make_daemon) -> None:
    d = make_daemon(TENANTS)
    with Client(d.socket, token="alice-token") as alice, \
            Client(d.socket, token="bob-token") as bob:
        cache(bob, "m", toks(6, 1000))
        for i in range(4):  # 4 x 2 pages cached: 8 of alice's 10
            cache(alice, "m", toks(2, 100 * (i + 1)))
        st = alice.stats("m").models["m"]
        assert st["tree_full_pages"] == 8
        a = alice.alloc("m", 6)  # over quota by 4: alice's own two coldest entries go
        st = alice.stats("m").models["m"]
        assert st["tree_full_pages"] + st["held_full_pages"] <= 10
        assert st["quota_evicted_pages"] >= 4
        assert alice.match("m", toks(2, 100)).prefix_len == 0  # the coldest is gone
        assert alice.match("m", toks(2, 400)).prefix_len == 2 * P  # the newest stays
        m = alice.match("m", toks(2, 400), lock=True)
        with pytest.raises(QuotaExceeded) as ei:
            alice.alloc("m", 4)  # 6 held + 2 locked + 4 > 10, nothing left to evict
        assert ei.value.details["pool"] in ("full", "swa") and ei.value.details["limit"] == 10
        alice.unlock("m", m.receipt)
        alice.free("m", a.full_pages, a.swa_pages)
        # bob (no quota) was never touched
        assert bob.match("m", toks(6, 1000)).prefix_len == 6 * P
        b = bob.alloc("m", 20)
        bob.free("m", b.full_pages, b.swa_pages)
    d.check()


def test_a_request_beyond_the_quota_is_quota_exceeded_even_when_the_pool_is_short(
        make_daemon) -> None:
    """What alice's sessions hold plus the request is over her quota whatever she evicts: the
    answer is quota_exceeded (fix the request), not out_of_memory (wait and retry), however
    little the pool has free; and no quota eviction is made for it."""
    d = make_daemon(TENANTS)
    with Client(d.socket, token="alice-token") as alice, \
            Client(d.socket, token="bob-token") as bob:
        cache(alice, "m", toks(2, 100))
        with pytest.raises(QuotaExceeded) as ei:
            alice.alloc("m", 20)  # the pool has room: over her quota of 10 all the same
        assert ei.value.details == {"pool": "full", "limit": 10, "requested": 20, "over": 10}
        held = []
        with pytest.raises(OutOfMemory):
            while True:  # bob takes every page left
                held.append(bob.alloc("m", 1))
        with pytest.raises(QuotaExceeded):
            alice.alloc("m", 20)  # the pool is short now too: still the quota's answer
        with pytest.raises(OutOfMemory):
            alice.alloc("m", 5)  # within her quota: the pool is what is short
        assert alice.stats("m").models["m"]["quota_evicted_pages"] == 0
        for a in held:
            bob.free("m", a.full_pages, a.swa_pages)
    d.check()


def test_a_load_no_eviction_could_admit_is_refused_with_nothing_evicted(make_daemon) -> None:
    """A load whose pages, with what the tenant's sessions hold, are over its quota whatever it
    evicts: quota_exceeded, and its cached pages stay (as for alloc). The load used to evict
    them first, then be refused."""
    model = {**SMALL_MODEL, "host_pages": 64, "host_swa_pages": 32}
    d = make_daemon({"models": [model], "tenants": [
        {"name": "alice", "token": "a", "namespace": "ns-a", "quota_full_pages": 10,
         "quota_swa_pages": 10}]})
    x, y = toks(5, 1000), toks(3, 5000)
    with Client(d.socket, token="a") as c:
        cache(c, "m", x)
        wait_for(lambda: c.stats("m").models["m"]["tree_host_pages"] >= 5, "the host copy")
        c.evict("m", full_pages=100, swa_pages=100)
        assert c.match("m", x).host_hit_len == 5 * P  # on host only
        cache(c, "m", y)
        held = c.alloc("m", 6)  # 6 held + 3 cached: within 10; 6 + 5 to load: over it
        with pytest.raises(QuotaExceeded) as ei:
            c.load("m", x, lock=True)
        assert "even without any of its cached pages" in str(ei.value)
        assert c.match("m", y).prefix_len == 3 * P
        assert c.stats("m").models["m"]["quota_evicted_pages"] == 0
        c.free("m", held.full_pages, held.swa_pages)
    d.check()


def test_concurrent_loads_of_one_tenant_stay_within_its_quota(make_daemon) -> None:
    """Several sessions of one tenant load host-only prefixes at once (each load alone within
    the quota): the pages a load is still copying count against the quota of the next, so the
    tenant does not end with sessions x quota locked device pages (it did)."""
    import asyncio
    import time

    from radixd_client import AsyncClient

    model = {**SMALL_MODEL, "full_pages": 256, "swa_pages": 128, "head_dim": 256,
             "num_full_layers": 4, "host_pages": 512, "host_swa_pages": 256}  # copies off-loop
    d = make_daemon({"models": [model], "tenants": [
        {"name": "alice", "token": "a", "namespace": "ns-a", "quota_full_pages": 10,
         "quota_swa_pages": 10}]})
    prompts = [toks(8, 1000 * (i + 1)) for i in range(4)]
    with Client(d.socket, token="a") as c:
        for i, t in enumerate(prompts):  # 8 pages each, backed up to host, then evicted
            cache(c, "m", t)
            deadline = time.monotonic() + 20
            while c.stats("m").models["m"]["tree_host_pages"] < 8 * (i + 1):
                assert time.monotonic() < deadline, "the host copies"
                time.sleep(0.02)
            c.evict("m", full_pages=100, swa_pages=100)
        assert c.stats("m").models["m"]["tree_full_pages"] == 0

    async def loads() -> list[Any]:
        clients = [await AsyncClient.connect(d.socket, "a") for _ in prompts]
        try:
            got = await asyncio.gather(*(cl.load("m", t, lock=True)
                                         for cl, t in zip(clients, prompts, strict=True)),
                                       return_exceptions=True)
            st = (await clients[0].stats("m")).models["m"]
            assert st["tree_full_pages"] <= 10, (st, got)
            return got
        finally:
            for cl in clients:
                await cl.close()

    got = asyncio.run(loads())
    assert sum(isinstance(g, QuotaExceeded) for g in got) >= 3, got
    assert sum(getattr(g, "loaded_len", 0) == 8 * P for g in got) == 1, got
    d.check()
