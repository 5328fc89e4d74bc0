"""Several sessions interleaving whole request lifecycles, and the socket's access control."""

from __future__ import annotations

import asyncio
import os
import random
import stat
from array import array

import pytest
from radixd_client import Client, errors
from radixd_client.aio import AsyncClient

MODEL = "m"
P = 4
W_PAGES = 2  # window 8 tokens


async def engine(path: str, seed: int, requests: int, stats: dict) -> None:
    """One engine session: conversations that share prefixes, with chunked prefill
    (cache_unfinished), decode that frees out-of-window SWA, and cache_finished."""
    rng = random.Random(seed)
    docs = [[(d * 31 + i) % 97 + 1 for i in range(48)] for d in range(3)]
    async with await AsyncClient.connect(path, client_name=f"engine-{seed}") as c:
        for _ in range(requests):
            seq = docs[rng.randrange(3)][: rng.randrange(8, 48)] + \
                [rng.randrange(200, 300) for _ in range(rng.randrange(0, 9))]
            tokens = array("i", seq)
            m = await c.match(MODEL, tokens.tobytes(), lock=True)
            stats["hit"] += m.prefix_len
            prev, rid = m.prefix_len, m.receipt
            total = -(-len(seq) // P)
            try:
                a = await c.alloc(MODEL, total - prev // P)
            except errors.OutOfMemory:
                await c.unlock(MODEL, rid)
                stats["oom"] += 1
                continue
            full, swa = list(array("i", a.full_pages)), list(array("i", a.swa_pages))
            await asyncio.sleep(0)  # let the other engines interleave here
            mid = (len(seq) // P // 2) * P
            if mid > prev:  # a prefill chunk
                u = await c.cache_unfinished(MODEL, tokens[:mid].tobytes(),
                                             full[: (mid - prev) // P], swa[: (mid - prev) // P],
                                             prev, prev, rid)
                k = (u.inserted_len - prev) // P
                full, swa = full[k:], swa[k:]
                prev, rid = u.inserted_len, u.receipt
            frontier = prev
            cut = max(prev, (len(seq) // P - W_PAGES - 1) * P)  # decode freed SWA below here
            if cut > frontier:
                k = (cut - prev) // P
                await c.free(MODEL, swa_pages=array("i", swa[:k]).tobytes())
                swa[:k] = [0] * k
                frontier = cut
            await asyncio.sleep(0)
            await c.cache_finished(MODEL, tokens.tobytes(), full, swa, prev, frontier, rid)
            stats["done"] += 1


@pytest.mark.asyncio
async def test_concurrent_engines_interleave_whole_requests(daemon) -> None:
    stats = {"hit": 0, "done": 0, "oom": 0}
    await asyncio.gather(*(engine(daemon.socket, s, 25, stats) for s in range(4)))
    assert stats["done"] + stats["oom"] == 100 and stats["done"] > 50
    assert stats["hit"] > 0  # the shared documents were reused across sessions
    async with await AsyncClient.connect(daemon.socket) as c:
        st = (await c.stats(MODEL)).models[MODEL]
        assert st["held_full_pages"] == 0 and st["held_swa_pages"] == 0
    daemon.check()


def test_socket_is_created_with_a_restrictive_mode(daemon) -> None:
    mode = stat.S_IMODE(os.stat(daemon.socket).st_mode)
    assert mode == 0o660


def test_peer_allow_lists(make_daemon) -> None:
    other = os.getuid() + 12345
    d = make_daemon({"server": {"allowed_uids": [other]}})
    with pytest.raises(errors.AuthError, match="not allowed"):
        Client(d.socket)
    d2 = make_daemon({"server": {"allowed_uids": [other], "allowed_gids": [os.getgid()]}})
    with Client(d2.socket) as c:  # the gid is listed: allowed
        assert c.ping(b"ok").payload == b"ok"
    d3 = make_daemon({"server": {"allowed_uids": [os.getuid()], "socket_mode": "0600"}})
    assert stat.S_IMODE(os.stat(d3.socket).st_mode) == 0o600
    with Client(d3.socket) as c:
        assert c.ping(b"ok").payload == b"ok"
