"""Memory isolation of the host tier (L2) between tenants (issue 16, item 2), against a real daemon.

Tenant A (this process) stores a secret in host slots of its namespace twice over: keyed pages
(``kv_reserve``, written through its ``kv_attach`` mapping, ``kv_commit``) and the tree's own host
copies of its prefixes. Tenant B (another process) then tries to read and to write them through
everything ``kv_attach`` gave it: its mapping of the host pools, every slot id of them (it
guesses all), A's keys, and the descriptor numbers the daemon holds A's host segments under
(through ``/proc`` too). It reads zeros and its writes reach no one. With ``memory_isolation =
"none"`` (the shared host pool) the same read finds the secret: that test shows what the setting
gives up, and is how the first test fails on a daemon whose ``kv_attach`` maps the whole pool.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from radixd_client import Client, pages

from .conftest import REPO, SMALL_MODEL
from .test_checker_daemon import LAUNCHER
from .test_memory_isolation import TENANTS, segment_inodes
from .test_tiers import Engine, admin_stats, seq, wait_for

P = SMALL_MODEL["page_size"]
SECRET = 0xAB
KEYS = [b"alice-%d" % i for i in range(3)]

# Tenant B: stores a page of its own, then reads and writes every other slot it can reach.
ATTACKER = r"""
import json, os, sys
from radixd_client import Client
sock, pid, daemon_fds, keys = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), [
    k.encode() for k in json.loads(sys.argv[4])]
out = {}
with Client(sock, token="bob-token") as c:
    pools = c.kv_attach("m")
    r = c.kv_reserve("m", [b"bob-0"], "full")  # a segment of B's own: mapped on the result
    pools.full[r.slots[0]] = 0x11
    c.kv_commit("m", r.pin)
    out["own"] = int(pools.full[r.slots[0]].min())
    out["mapped"] = sorted(list(k) for k in getattr(pools, "segments", {}))  # old clients: none
    mine = {"full": {r.slots[0]}, "swa": set()}
    out["read"], out["nonzero"] = {}, {}
    for kind in ("full", "swa"):
        t = pools.pool(kind)
        others = [s for s in range(1, t.shape[0]) if s not in mine[kind]]  # every slot id
        out["read"][kind] = int(t[others].max())
        out["nonzero"][kind] = sum(1 for s in others if int(t[s].max()))
        t[others] = 0xEE  # written over: lands in B's private memory, or nowhere
    out["present"] = list(c.kv_lookup("m", keys, "full", pin=False).present)
    seen, opened = [], []
    for n in daemon_fds:  # the numbers the daemon holds A's segments under
        try:
            seen.append([n, os.fstat(n).st_ino])
        except OSError:
            pass
        try:
            with open(f"/proc/{pid}/fd/{n}", "rb") as f:
                opened.append([n, len(f.read(16))])
        except OSError:
            pass
    out["fds"], out["opened"] = seen, opened
print(json.dumps(out))
"""


def _attack(d: Any, daemon_fds: list[int]) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'clients' / 'python'}"}
    proc = subprocess.run([sys.executable, "-c", ATTACKER, d.socket, str(d.proc.pid),
                           json.dumps(daemon_fds), json.dumps([k.decode() for k in KEYS])],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _host_pages(c: Client) -> int:
    return c.stats("m").models["m"]["tree_host_pages"]


def _store_secret(a: Client) -> list[int]:
    """A's keyed pages holding SECRET in every byte; returns their slots."""
    pools = a.kv_attach("m")
    r = a.kv_reserve("m", KEYS, "full")
    assert all(r.slots), r
    for s in r.slots:
        pools.full[s] = SECRET
    a.kv_commit("m", r.pin)
    return list(r.slots)


def _secret_intact(token: str, sock: str) -> None:
    """A fresh session of A reads its keyed pages back byte for byte."""
    with Client(sock, token=token) as a:
        got = a.kv_lookup("m", KEYS, "full", pin=True)
        assert list(got.present) == [1, 1, 1]
        pools = a.kv_attach("m")
        assert all(bool((pools.full[s] == SECRET).all()) for s in got.slots)
        a.kv_release("m", got.pin)


def test_another_tenant_cannot_read_or_write_my_host_pages(make_daemon) -> None:
    d = make_daemon(TENANTS)
    toks = seq(4)
    e = Engine(d.socket, token="alice-token")  # the tree's host copies of A's prefix
    try:
        e.cache(toks)
        wait_for(lambda: _host_pages(e.c) == 4, "A's host copies")
        with Client(d.socket, token="alice-token") as a:
            _store_secret(a)
            inodes = segment_inodes(d.proc.pid, "-host-seg")
            out = _attack(d, sorted(inodes))
        # every other slot of both host pools reads zeros in B: A's keyed pages and tree copies
        assert out["read"] == {"full": 0, "swa": 0} and out["nonzero"] == {"full": 0, "swa": 0}
        # B mapped only its own segment, and its own page is real memory
        assert out["own"] == 0x11 and [k[0] for k in out["mapped"]] == ["full"], out
        assert out["present"] == [0, 0, 0]  # A's keys are not B's
        # the numbers the daemon holds A's memfds under: nothing of A's in B, not via /proc
        assert not {ino for _n, ino in out["fds"]} & set(inodes.values()), out
        if os.getuid() != 0:  # root opens any process's fds (and reads its memory): by design
            assert out["opened"] == [], out  # the daemon is non-dumpable (PR_SET_DUMPABLE 0)
        # B's writes reached no one: A's keyed pages, and the tree's host copies loaded back
        _secret_intact("alice-token", d.socket)
        e.c.evict("m", full_pages=1000, swa_pages=1000)
        r = e.c.load("m", toks)
        assert (r.prefix_len, r.loaded_len) == (4 * P, 4 * P)
        assert e.verify(toks, r) > 4
    finally:
        e.close()
    d.check()


def test_a_host_segment_changes_namespace_only_zeroed(make_daemon) -> None:
    """A host segment A emptied goes to B with fresh zeroed memory; A's stale mapping of it is
    the old memory (its writes reach no one), and A's next result that names a new segment
    makes its client map it (host_segments_gen)."""
    model = {**SMALL_MODEL, "host_pages": 9, "host_swa_pages": 4, "host_segment_pages": 4}
    d = make_daemon({**TENANTS, "models": [model]})
    with Client(d.socket, token="alice-token") as a, Client(d.socket, token="bob-token") as b:
        slots = _store_secret(a)
        a_pools = a.kv_attach("m")
        assert a.kv_clear("m").removed == 3  # the segment empties: back to the free list
        b_pools = b.kv_attach("m")
        r = b.kv_reserve("m", KEYS, "full")  # B takes that segment: a new memfd, zeroed
        assert sorted(r.slots) == sorted(slots) and r.host_segments_gen == b_pools.generation
        assert all(int(b_pools.full[s].max()) == 0 for s in r.slots)
        for s in slots:  # A writes through what it still maps: the old memory
            a_pools.full[s] = SECRET
        assert all(int(b_pools.full[s].max()) == 0 for s in r.slots)
        b.kv_commit("m", r.pin)
        gen = a_pools.generation
        again = a.kv_reserve("m", [b"more"], "full")  # a segment A never served: remapped
        assert again.host_segments_gen > gen and a_pools.generation == again.host_segments_gen
        assert all(seg[1] != slots[0] // 4 for seg in a_pools.segments if seg[0] == "full")
        a_pools.full[again.slots[0]] = 7
        a.kv_commit("m", again.pin)
        with Client(d.socket, token="alice-token") as a2:
            got = a2.kv_lookup("m", [b"more"], "full", pin=False)
            assert int(a2.kv_attach("m").full[got.slots[0]].max()) == 7
    segs = admin_stats(d)["models"]["m"]["segments"]["host_full"]
    assert (segs["segments"], segs["segment_pages"], segs["moved"]) == (3, 4, 1), segs
    d.check()


def test_host_segments_appear_in_a_mapping_as_the_namespace_grows(make_daemon) -> None:
    model = {**SMALL_MODEL, "host_pages": 33, "host_swa_pages": 4, "host_segment_pages": 4}
    d = make_daemon({**TENANTS, "models": [model]})
    with Client(d.socket, token="alice-token") as a, Client(d.socket, token="alice-token") as a2:
        pools = a.kv_attach("m")
        assert pools.segments == {}
        keys = [b"k%d" % i for i in range(10)]  # three segments' worth
        w = a2.kv_attach("m")
        r = a2.kv_reserve("m", keys, "full")
        for s in r.slots:
            w.full[s] = s
        a2.kv_commit("m", r.pin)
        got = a.kv_lookup("m", keys, "full", pin=False)  # slots `a` has not mapped: it maps them
        assert pools.generation == got.host_segments_gen > 0 and len(pools.segments) == 3
        assert [int(pools.full[s].max()) for s in got.slots] == list(got.slots)
    d.check()


def test_no_memory_isolation_maps_the_whole_host_pool(make_daemon) -> None:
    """What memory_isolation = "none" gives up for the host tier (and what a daemon whose
    kv_attach maps the whole pool does): B reads A's keyed pages."""
    d = make_daemon({**TENANTS, "models": [{**SMALL_MODEL, "memory_isolation": "none"}]})
    with Client(d.socket, token="alice-token") as a:
        _store_secret(a)
        out = _attack(d, [])
        assert out["read"]["full"] == SECRET and out["nonzero"]["full"] >= 3
    assert admin_stats(d)["models"]["m"]["segments"] is None
    d.check()


def test_bad_host_segment_settings_are_refused_with_the_key(tmp_path) -> None:
    from daemon.config import ConfigError, load_config

    bad = {**SMALL_MODEL, "host_pages": 64, "host_segment_pages": 3}  # 3 x 2048 B: not OS pages
    path = tmp_path / "c.toml"
    path.write_text("[[models]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in bad.items()))
    with pytest.raises(ConfigError, match=r'models\["m"\]\.host_segment_pages.*multiple of 2'):
        load_config(path, env={})


def test_a_warm_restart_puts_each_namespace_back_in_its_own_host_segments(make_daemon,
                                                                          tmp_path) -> None:
    """Across a restart through ``state_dir`` the restored keyed pages and tree host copies get
    slots in their own namespace's host segments (the strict check after the restore proves it
    for every slot); B's mapping still reads zeros where A's pages are, A reads them back."""
    cfg = {**TENANTS, "server": {"state_dir": str(tmp_path / "state")}}
    d1 = make_daemon(cfg)
    toks = seq(4)
    e = Engine(d1.socket, token="alice-token")
    try:
        e.cache(toks)
        wait_for(lambda: _host_pages(e.c) == 4, "A's host copies")
        with Client(d1.socket, token="alice-token") as a, \
                Client(d1.socket, token="bob-token") as b:
            _store_secret(a)
            pools = b.kv_attach("m")
            r = b.kv_reserve("m", [b"bob-%d" % i for i in range(50)], "full")
            for s in r.slots:
                pools.full[s] = 0x22
            b.kv_commit("m", r.pin)
    finally:
        e.close()
    d1.check()
    assert d1.stop() == 0, d1.log()[-3000:]
    d2 = make_daemon(cfg)
    assert admin_stats(d2)["warm_restart"]["dropped_pages"] == 0
    d2.check()  # every restored slot lies in a host segment of its namespace
    _secret_intact("alice-token", d2.socket)
    with Client(d2.socket, token="bob-token") as b:
        mine = b.kv_lookup("m", [b"bob-%d" % i for i in range(50)], "full", pin=False)
        pools = b.kv_attach("m")
        assert list(mine.present) == [1] * 50
        assert all(int(pools.full[s].min()) == 0x22 for s in mine.slots)
        others = [s for s in range(1, pools.full.shape[0]) if s not in set(mine.slots)]
        assert int(pools.full[others].max()) == 0 and int(pools.swa.max()) == 0
    d2.check()


def test_a_background_copy_never_reads_pages_another_tenant_got_since(make_daemon) -> None:
    """A's node is being copied to host (a slow copy, planted) when A frees its SWA pages (lock,
    release_swa, evict: a tombstone) and B allocates their emptied segments and writes its KV
    there. The free waits for the copy, so the copy never reads B's KV into A's host slots,
    which A maps. It used to: A read B's KV through kv_attach, in its own host segment."""
    model = {**SMALL_MODEL, "num_full_layers": 4, "num_kv_heads": 2, "full_pages": 256,
             "swa_pages": 128, "segment_pages": 16, "host_pages": 256, "host_swa_pages": 32}
    d = make_daemon({**TENANTS, "models": [model]}, launcher=LAUNCHER,
                    env={"FAULT_COPY": "slow", "FAULT_COPY_DELAY_S": "3"})
    n = 64  # full pages of 16 KiB: a job too large to copy inline, it runs on the copy thread
    with Client(d.socket, token="alice-token") as a, Client(d.socket, token="bob-token") as b:
        def stats() -> dict[str, int]:
            return admin_stats(d)["models"]["m"]["tiers"]  # type: ignore[no-any-return]

        tokens = seq(n)
        got = a.alloc("m", n)
        a.insert("m", tokens, got.full_pages, got.swa_pages)  # write_through: a copy starts
        wait_for(lambda: stats()["backup_queue"] == 0, "the copy to start")
        m = a.match("m", tokens, lock=True)
        a.release_swa("m", m.receipt)
        assert a.evict("m", swa_pages=n).swa_pages > 0  # the locked node's window freed
        mine = b.alloc("m", n)  # A's emptied SWA segments, written by B
        theirs = b.attach("m")
        for s in pages(mine.swa_pages):
            theirs.swa[:, :, s] = SECRET
        a.unlock("m", m.receipt)
        wait_for(lambda: stats()["backups"] >= 1 or stats()["copy_errors"], "copy")
        host = a.kv_attach("m")
        assert int((host.swa.view(torch.float32) == SECRET).sum()) == 0, "B's KV in A's host"
        assert stats()["frees_waited"] >= 1
        b.free("m", mine.full_pages, mine.swa_pages)
