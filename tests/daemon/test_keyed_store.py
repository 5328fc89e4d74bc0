"""The key-addressed page store through a real daemon on a real socket: engines map the host pools
(kv_attach), reserve slots, write pages into them, commit, and other sessions look them up and read
the same bytes. Every daemon fixture ends with a strict full check (the keyed store's included)."""

from __future__ import annotations

import torch
from radixd_client import Client

from .conftest import SMALL_MODEL

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
