"""Warm restart of the host tier through real daemons: host pages written through, SIGTERM, a new
daemon on the same ``[server] state_dir``; a second client matches and loads the prefix and reads
back byte-exact pages. Corrupted pages are dropped, never served; a layout change drops the
model's pages with a log line. Every daemon fixture ends with a strict full invariant check."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
from radixd_client import Client

from daemon.cli import format_status
from tests.redis_procs import SHARED_URL, free_port

from .conftest import SMALL_MODEL
from .test_keyed_store import gone_from_host
from .test_tiers import (
    Engine,
    P,
    admin_get,
    admin_stats,
    cache_until_on_host,
    l3_config,
    seq,
    tier_stats,
    wait_for,
)


def _config(state: Path, **model: Any) -> dict[str, Any]:
    return {"server": {"state_dir": str(state)}, "models": [{**SMALL_MODEL, **model}]}


def _metrics(d: Any) -> str:
    return admin_get(d, "/metrics").decode()


def _stop(d: Any) -> None:
    d.check()
    assert d.stop() == 0, d.log()[-3000:]


def _fill(make_daemon: Any, state: Path, seqs: list[list[int]], **model: Any
          ) -> tuple[tuple[dict, dict], Any]:
    """Cache ``seqs`` in a daemon on ``state``, wait for their host copies, stop it; returns the
    KV the tree kept per page (the first writer's: a later duplicate page is freed) and the
    daemon."""
    d = make_daemon(_config(state, **model))
    kept = cache_until_on_host(d, seqs)
    _stop(d)
    return kept, d


def test_host_tier_survives_a_restart_byte_exact(make_daemon, tmp_path: Path) -> None:
    state = tmp_path / "state"
    a, b = seq(10), seq(6, base=5000)
    e1, d1 = _fill(make_daemon, state, [a, b])
    saved = re.search(r"warm restart: saved (\d+) host pages", d1.log())
    assert saved and int(saved.group(1)) == 16 + 2 * 2  # full pages and two SWA windows
    d2 = make_daemon(_config(state))
    assert "warm restart: kept" in d2.log()
    e2 = Engine(d2.socket, seed=9)
    try:
        m = e2.c.match("m", a)
        assert (m.prefix_len, m.host_hit_len) == (0, 10 * P)  # host only: device starts empty
        r = e2.c.load("m", a, lock=True)
        assert (r.prefix_len, r.loaded_len) == (10 * P, 10 * P)
        assert e2.verify(a, r, expect=e1) > 10
        e2.c.unlock("m", r.receipt)
        r = e2.c.load("m", b)
        assert r.prefix_len == 6 * P
        e2.verify(b, r, expect=e1)
        stats = admin_stats(d2)
        st = stats["warm_restart"]
        assert st["source"] == "state_dir" and st["dropped_pages"] == 0
        assert st["kept_pages"] == 16 + 2 * 2
        assert "warm restart (state_dir): kept 20 host pages, dropped 0" in format_status(stats)
        metrics = _metrics(d2)
        assert 'radixd_warm_restart_pages{outcome="kept"} 20.0' in metrics
        assert "radixd_warm_restart_restore_seconds" in metrics
    finally:
        e2.close()
    d2.check()


def test_device_only_pages_are_copied_to_host_at_stop(make_daemon, tmp_path: Path) -> None:
    """Under write_back nothing reaches host before an eviction: a stop followed by a warm
    restart copies the device-only nodes first, so the next run serves them (byte-exact)."""
    state = tmp_path / "state"
    a, b = seq(10), seq(6, base=5000)
    d1 = make_daemon(_config(state, write_policy="write_back"))
    e1 = Engine(d1.socket, seed=4)
    try:
        e1.cache(a)
        e1.cache(b)
        assert tier_stats(d1)["tree_host_pages"] == 0
        kept = (e1.full, e1.swa)
    finally:
        e1.close()
    _stop(d1)
    assert "the tree's host pages grew by 16 in the stop's drain" in d1.log()
    d2 = make_daemon(_config(state, write_policy="write_back"))
    e2 = Engine(d2.socket, seed=9)
    try:
        for toks in (a, b):
            m = e2.c.match("m", toks)
            assert (m.prefix_len, m.host_hit_len) == (0, len(toks))
            r = e2.c.load("m", toks)
            assert (r.prefix_len, r.loaded_len) == (len(toks), len(toks))
            assert e2.verify(toks, r, expect=kept) > len(toks) // P
    finally:
        e2.close()


def test_a_path_branching_at_every_page_comes_back_whole(make_daemon, tmp_path: Path) -> None:
    """A path of 30 pages with a branch at every page (59 nodes, 30 deep): each node is
    restored under the node made for its parent, every saved page kept, byte exact."""
    state = tmp_path / "state"
    main = seq(30)
    seqs = [main] + [main[: i * P] + seq(1, base=100_000 + 10 * i) for i in range(1, 30)]
    e1, d1 = _fill(make_daemon, state, seqs, full_pages=256, swa_pages=256)
    saved = re.search(r"warm restart: saved (\d+) host pages", d1.log())
    d2 = make_daemon(_config(state, full_pages=256, swa_pages=256))
    kept = re.search(r"warm restart: kept (\d+)", d2.log())
    assert saved and kept and kept.group(1) == saved.group(1), d2.log()[-2000:]
    assert admin_stats(d2)["warm_restart"]["dropped_pages"] == 0
    assert tier_stats(d2)["tree_host_pages"] == 30 + 29
    e2 = Engine(d2.socket, seed=9)
    try:
        for toks in (main, seqs[-1], seqs[1]):
            r = e2.c.load("m", toks)
            assert r.prefix_len == len(toks)
            e2.verify(toks, r, expect=e1)
    finally:
        e2.close()
    d2.check()


def test_a_corrupted_page_is_dropped_never_served(make_daemon, tmp_path: Path) -> None:
    state = tmp_path / "state"
    a = seq(8)
    e1, _ = _fill(make_daemon, state, [a[: 4 * P], a])  # two nodes: pages 0-3, then 4-7
    files = sorted(state.glob("host-*-full.pages"))
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    page = len(raw) // 8
    raw[5 * page + 5] ^= 0xFF  # a page of the second node: that node goes, the first stays
    files[0].write_bytes(bytes(raw))
    assert_only_the_first_node_served(make_daemon(_config(state)), a, e1)


def assert_only_the_first_node_served(d2: Any, a: list[int], e1: Any) -> None:
    """After a restart whose saved second node (pages 4-7 of ``a``) had a flipped byte: the
    first node comes back byte-exact as ``e1`` wrote it, the second is dropped, never served."""
    assert "failed verification" in d2.log()
    e2 = Engine(d2.socket, seed=3)
    try:
        m = e2.c.match("m", a)
        assert (m.prefix_len, m.host_hit_len) == (0, 4 * P)
        r = e2.c.load("m", a)
        assert (r.prefix_len, r.loaded_len) == (4 * P, 4 * P)
        e2.verify(a, r, expect=e1)  # what is served is exactly right
        assert admin_stats(d2)["warm_restart"]["dropped_pages"] >= 4
    finally:
        e2.close()


def test_a_layout_change_drops_the_models_pages(make_daemon, tmp_path: Path) -> None:
    state = tmp_path / "state"
    _fill(make_daemon, state, [seq(6)])
    d2 = make_daemon(_config(state, head_dim=8))
    assert "its layout changed" in d2.log()
    with Client(d2.socket) as c:
        assert c.match("m", seq(6)).host_hit_len == 0
    assert admin_stats(d2)["warm_restart"]["kept_pages"] == 0


def test_an_unclean_stop_restores_nothing(make_daemon, tmp_path: Path) -> None:
    """The index is consumed at start: a daemon killed later (no save) must not bring back
    pages it may have overwritten since."""
    state = tmp_path / "state"
    _fill(make_daemon, state, [seq(6)])
    d2 = make_daemon(_config(state))
    assert not (state / "host-index.bin").exists()
    d2.proc.kill()
    d2.proc.wait()
    d2.proc.returncode = 0  # killed on purpose: the fixture's exit check does not apply
    d3 = make_daemon(_config(state))
    with Client(d3.socket) as c:
        assert c.match("m", seq(6)).host_hit_len == 0


def test_state_dir_must_be_absolute(tmp_path: Path) -> None:
    from daemon.config import ConfigError, load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text('[server]\nstate_dir = "relative/dir"\n')
    try:
        load_config(str(cfg))
    except ConfigError as exc:
        assert "state_dir" in str(exc) and "absolute" in str(exc)
    else:
        raise AssertionError("a relative state_dir was accepted")
    assert os.path.isabs(str(tmp_path))


def test_the_l3_quota_keeps_counting_across_a_restart(make_daemon, tmp_path: Path,
                                                      prefix: str) -> None:
    """A tree page is ~2.1 KB in Redis in each pool; the two pages cached first are two values
    (the run of both full pages and the window of both SWA pages, ~4.2 KB each). 10000 bytes
    hold them. One more page (two values of ~2.1 KB) after the restart puts the namespace over
    its quota only if the ledger of what was written before was carried over, and then the
    oldest value (the run) is deleted."""
    def config() -> dict[str, Any]:
        return {**l3_config(SHARED_URL, prefix), "server": {"state_dir": str(tmp_path / "s")},
                "tenants": [{"name": "t1", "token": "one", "quota_l3_bytes": 10000}]}

    def stored() -> int:
        raw = redis_sync.Redis.from_url(SHARED_URL)
        try:
            return len(list(raw.scan_iter(match=prefix + ":*", count=1000)))
        finally:
            raw.close()

    d1 = make_daemon(config())
    e = Engine(d1.socket, token="one")
    e.cache(seq(2))
    wait_for(lambda: stored() == 2, "the first two pages in Redis")
    e.close()
    assert admin_stats(d1)["models"]["m"]["tiers"]["l3_quota_deleted_pages"] == 0
    _stop(d1)
    d2 = make_daemon(config())
    e = Engine(d2.socket, token="one")
    e.cache(seq(1, base=5000))
    wait_for(lambda: admin_stats(d2)["models"]["m"]["tiers"]["l3_quota_deleted_pages"] == 1,
             "the quota deleting the oldest values")
    assert stored() == 3
    e.close()


def _alice(state: Path, quota_host_pages: int = 0, **model: Any) -> dict[str, Any]:
    return {**_config(state, **model), "tenants": [{"name": "alice", "token": "A",
                                                    "quota_host_pages": quota_host_pages}]}


def _alice_holds(d: Any) -> dict[str, Any]:
    with Client(d.socket, "A") as c:
        st = c.stats("m").models["m"]
    return {k: st[k] for k in ("tree_host_pages", "kv_pages", "quota_host_pages")}


def _cache_two_prompts_and_stop(d: Any) -> None:
    """Alice's prompts of six pages, seq(6) then seq(6, base=5000), on host; then the stop."""
    e = Engine(d.socket, token="A")
    e.cache(seq(6))
    e.cache(seq(6, base=5000))
    wait_for(lambda: _alice_holds(d)["tree_host_pages"] == 12, "the host copies")
    e.close()
    _stop(d)


def test_a_host_quota_lowered_across_a_restart_drops_the_oldest_tree_pages(
        make_daemon, tmp_path: Path) -> None:
    """Two prompts of six host pages cached without a quota; the next start sets
    quota_host_pages = 6. The restore drops one of the prompts (host pages go a node at a time,
    as when a copy makes room) and says so, instead of leaving the tenant over its quota until it
    copies again; the other one still loads from host."""
    state = tmp_path / "state"
    d1 = make_daemon(_alice(state))
    _cache_two_prompts_and_stop(d1)
    d2 = make_daemon(_alice(state, quota_host_pages=6))
    assert _alice_holds(d2) == {"tree_host_pages": 6, "kv_pages": 0, "quota_host_pages": 6}
    assert re.search(r"namespace 'alice' held 12 saved full host pages, over its "
                     r"quota_host_pages of 6: 6 of them went", d2.log()), d2.log()[-2000:]
    e = Engine(d2.socket, token="A")
    hits = sorted(e.c.match("m", s).host_hit_len for s in (seq(6), seq(6, base=5000)))
    e.close()
    assert hits == [0, 6 * P]


@pytest.mark.parametrize("reused", [True, False])
def test_tree_pages_keep_their_eviction_order_across_a_restart(
        make_daemon, tmp_path: Path, reused: bool) -> None:
    """Prompts A (six pages), B (six) and C (one) cached in that order, then (``reused``) A
    matched again: the least recently used is B, else A. The next start lowers the quota to 7
    pages: exactly that prompt goes, as it would have before the restart (plain LRU, so that
    only recency decides; before 2026-11-29 the restored nodes all counted as used at the
    restart, and the order of the saved list decided)."""
    state = tmp_path / "state"
    a, b, c = seq(6), seq(6, base=5000), seq(1, base=9000)
    d1 = make_daemon(_alice(state, eviction_policy="lru"))
    e = Engine(d1.socket, token="A")
    for toks in (a, b, c):
        e.cache(toks)
    if reused:
        assert e.c.match("m", a).prefix_len == len(a)
    wait_for(lambda: _alice_holds(d1)["tree_host_pages"] == 13, "the host copies")
    e.close()
    _stop(d1)
    d2 = make_daemon(_alice(state, quota_host_pages=7, eviction_policy="lru"))
    assert _alice_holds(d2)["tree_host_pages"] == 7
    e = Engine(d2.socket, token="A")
    hits = {name: e.c.match("m", toks).host_hit_len
            for name, toks in (("a", a), ("b", b), ("c", c))}
    e.close()
    gone = "b" if reused else "a"
    assert hits == {"a": 6 * P, "b": 6 * P, "c": P, gone: 0}


def test_keyed_pages_keep_their_order_across_a_restart(make_daemon, tmp_path: Path) -> None:
    """k0, k1, k2 committed, then k0 looked up: k1 is the least recently used, and the one a
    quota of two pages drops at the next start (before 2026-11-29 the snapshot listed keyed
    pages in the order they were first stored, and k0 went)."""
    state = tmp_path / "state"
    d1 = make_daemon(_alice(state))
    keys = [b"k0", b"k1", b"k2"]
    with Client(d1.socket, "A") as c:
        c.kv_attach("m")
        c.kv_commit("m", c.kv_reserve("m", keys).pin)
        assert list(c.kv_lookup("m", [b"k0"], pin=False).present) == [1]
    _stop(d1)
    d2 = make_daemon(_alice(state, quota_host_pages=2))
    with Client(d2.socket, "A") as c:
        assert list(c.kv_lookup("m", keys, pin=False).present) == [1, 0, 1]


def test_keyed_and_tree_pages_keep_their_order_across_a_restart(
        make_daemon, tmp_path: Path) -> None:
    """A keyed page stored before two prompts is the least recently used of the three; a quota
    one page short at the next start drops it, not a prompt (before 2026-11-29 a keyed page
    restored as used at the restart, after every tree page, and a prompt of six pages went)."""
    state = tmp_path / "state"
    d1 = make_daemon(_alice(state, eviction_policy="lru"))
    with Client(d1.socket, "A") as c:
        c.kv_attach("m")
        c.kv_commit("m", c.kv_reserve("m", [b"k0"]).pin)
    _cache_two_prompts_and_stop(d1)
    d2 = make_daemon(_alice(state, quota_host_pages=12, eviction_policy="lru"))
    assert _alice_holds(d2) == {"tree_host_pages": 12, "kv_pages": 0, "quota_host_pages": 12}


def test_a_host_quota_lowered_across_a_restart_drops_the_oldest_keyed_pages(
        make_daemon, tmp_path: Path) -> None:
    state = tmp_path / "state"
    d1 = make_daemon(_alice(state))
    keys = [b"k%d" % i for i in range(10)]
    with Client(d1.socket, "A") as c:
        c.kv_attach("m")
        c.kv_commit("m", c.kv_reserve("m", keys).pin)
    _stop(d1)
    d2 = make_daemon(_alice(state, quota_host_pages=3))
    assert _alice_holds(d2) == {"tree_host_pages": 0, "kv_pages": 3, "quota_host_pages": 3}
    with Client(d2.socket, "A") as c:
        found = c.kv_lookup("m", keys, pin=False)
    assert list(found.present) == [0] * 7 + [1] * 3  # the newest kept


def test_keyed_pages_a_lowered_quota_drops_at_restore_go_to_redis_under_write_back(
        make_daemon, tmp_path: Path, prefix: str) -> None:
    """Under L3 write_back the 7 keyed pages over the new quota go to Redis as they are
    dropped: they were queued before the writer started, which then waited for the next
    write-back to wake it (a tenant that only reads never made one)."""
    def config(quota: int) -> dict[str, Any]:
        return {**l3_config(SHARED_URL, prefix), "server": {"state_dir": str(tmp_path / "s")},
                "l3": {**l3_config(SHARED_URL, prefix)["l3"], "write_policy": "write_back"},
                "tenants": [{"name": "alice", "token": "A", "quota_host_pages": quota}]}

    keys = [b"k%d" % i for i in range(10)]
    d1 = make_daemon(config(0))
    with Client(d1.socket, "A") as c:
        c.kv_attach("m")
        c.kv_commit("m", c.kv_reserve("m", keys).pin)
        assert c.stats("m").models["m"]["kv_l3_write_pages"] == 0  # write_back: not yet
    _stop(d1)
    d2 = make_daemon(config(3))
    with Client(d2.socket, "A") as c:
        wait_for(lambda: c.stats("m").models["m"]["kv_l3_write_pages"] == 7,
                 "the dropped pages written to Redis")


def test_cold_nodes_host_slot_ids_kept_as_runs_load_and_restart_byte_exact(
        make_daemon, tmp_path: Path) -> None:
    """Long nodes keep their host slot ids as runs from their host copy on, and their page ids
    too once cold and the daemon idle (docs/operations.md, "Host slot ids kept as runs"; the
    forms themselves are tested in tests/gpu/test_page_runs.py). With the device copies
    evicted, a load brings the KV back byte-exact through those slot ids; the stop saves them
    for a warm restart, whose loads are byte-exact too."""
    state = tmp_path / "state"
    model = {"full_pages": 2000, "swa_pages": 2000}  # cold after 2000 * 4 / 2 tokens of churn
    seqs = [seq(200, base=10_000 * k + 1) for k in range(7)]  # 200 pages: kept as runs
    d1 = make_daemon(_config(state, **model))
    kept = cache_until_on_host(d1, seqs)
    wait_for(lambda: re.search(r'radixd_tree_page_id_compactions_total\{direction="compacted",'
                               r'model="m"\} [1-9]', _metrics(d1)), "an idle compaction")
    e1 = Engine(d1.socket, seed=3)
    try:
        assert e1.c.evict("m", full_pages=2000, swa_pages=2000).full_pages == 7 * 200
        assert e1.c.match("m", seqs[0]).host_hit_len == 200 * P
        r = e1.c.load("m", seqs[0])
        assert (r.prefix_len, r.loaded_len) == (200 * P, 200 * P)
        assert e1.verify(seqs[0], r, expect=kept) > 200
    finally:
        e1.close()
    _stop(d1)
    assert "warm restart: saved" in d1.log()
    d2 = make_daemon(_config(state, **model))
    e2 = Engine(d2.socket, seed=9)
    try:
        for toks in seqs:
            r = e2.c.load("m", toks)
            assert (r.prefix_len, r.loaded_len) == (200 * P, 200 * P)
            assert e2.verify(toks, r, expect=kept) > 200
    finally:
        e2.close()
    d2.check()


def test_a_keyed_page_never_written_to_redis_is_written_back_after_a_restart(
        make_daemon, tmp_path: Path, prefix: str) -> None:
    """Under write-back a keyed page goes to Redis when host evicts it. Restored pages came
    back marked as in Redis, so one never written was then lost on eviction (a review found
    it): the snapshot keeps the mark."""
    import torch

    def config() -> dict[str, Any]:
        c = l3_config(SHARED_URL, prefix, host_pages=16, host_swa_pages=8)
        c["l3"]["write_policy"] = "write_back"
        c["server"] = {"state_dir": str(tmp_path / "s")}
        return c

    d1 = make_daemon(config())
    with Client(d1.socket) as c:
        pools = c.kv_attach("m")
        r = c.kv_reserve("m", [b"precious"])
        page = torch.randint(0, 256, (pools.page_nbytes["full"],), dtype=torch.uint8)
        pools.full[r.slots[0]].copy_(page)
        c.kv_commit("m", r.pin)
        assert c.stats("m").models["m"]["kv_l3_write_pages"] == 0  # write-back: not yet
    _stop(d1)
    d2 = make_daemon(config())
    with Client(d2.socket) as c:
        pools = c.kv_attach("m")
        assert c.kv_lookup("m", [b"precious"], pin=False).present == b"\x01"  # restored
        for i in range(3):  # 15 usable host slots: the restored page is the oldest to go
            r = c.kv_reserve("m", [b"other-%d-%d" % (i, j) for j in range(8)])
            c.kv_commit("m", r.pin)
        wait_for(lambda: c.kv_lookup("m", [b"precious"], pin=False).present == b"\x00"
                 and c.stats("m").models["m"]["kv_l3_write_pages"] >= 1, "its eviction")
        got = c.kv_lookup("m", [b"precious"], fetch=True, timeout_s=5)
        assert got.present == b"\x01" and got.fetched == 1
        assert torch.equal(pools.full[got.slots[0]], page)
        c.kv_release("m", got.pin)


def test_a_restored_page_of_before_another_daemons_clear_is_not_written_back(
        make_daemon, tmp_path: Path, prefix: str) -> None:
    """A keyed page keeps, across a restart, the clear generation its daemon knew when it was
    stored: one restored as of no generation was written under the one another daemon's clear
    raised while this one was down, and that daemon fetched the KV of before its clear."""
    def config(state: bool) -> dict[str, Any]:
        c = l3_config(SHARED_URL, prefix, host_pages=16, host_swa_pages=8)
        c["l3"]["write_policy"] = "write_back"
        if state:
            c["server"] = {"state_dir": str(tmp_path / "s")}
        return c

    b1 = make_daemon(config(True), name="b1")
    with Client(b1.socket) as c:
        c.kv_attach("m")
        assert c.kv_lookup("m", [b"none"], fetch=True, timeout_s=5).present == b"\x00"
        c.kv_commit("m", c.kv_reserve("m", [b"old"]).pin)
    _stop(b1)
    a = make_daemon(config(False), name="a")
    with Client(a.socket) as ca:
        ca.kv_attach("m")
        assert ca.kv_clear("m").l3_cleared is True
        b2 = make_daemon(config(True), name="b2")
        with Client(b2.socket) as c:
            c.kv_attach("m")
            assert c.kv_lookup("m", [b"old"], pin=False).present == b"\x01"  # restored
            for i in range(3):  # 15 usable host slots: the restored page is the oldest to go
                c.kv_commit("m", c.kv_reserve("m", [b"o-%d-%d" % (i, j) for j in range(8)]).pin)
            wait_for(lambda: c.kv_lookup("m", [b"old"], pin=False).present == b"\x00"
                     and (s := c.stats("m").models["m"])["kv_l3_write_pages"]
                     + s["kv_l3_write_outdated"] >= 1, "its eviction")
        got = ca.kv_lookup("m", [b"old"], fetch=True, timeout_s=5)
        assert got.present == b"\x00" and got.fetched == 0


def test_a_clear_the_stop_could_not_record_in_redis_is_recorded_at_the_next_start(
        make_daemon, tmp_path: Path, prefix: str) -> None:
    """A kv_clear whose raise of the generation has not reached Redis when the daemon stops
    (Redis unreachable): the saved state names it and the next start raises it, before any
    fetch reads the values of before the clear. It used to be forgotten, and those values
    (of pages evicted from host before the clear) were served again."""
    def config(url: str) -> dict[str, Any]:
        c = l3_config(url, prefix, host_pages=16, host_swa_pages=8)
        c["server"] = {"state_dir": str(tmp_path / "s")}
        c["l3"]["drain_timeout_s"] = 0.2
        return c

    names = [f"k{i}" for i in range(24)]
    d1 = make_daemon(config(SHARED_URL))
    with Client(d1.socket) as c:
        gone_from_host(c, c.kv_attach("m"), names)  # some pages live in Redis only
    _stop(d1)
    d2 = make_daemon(config(f"redis://127.0.0.1:{free_port()}/0"))  # Redis out of reach
    with Client(d2.socket) as c:
        assert c.kv_clear("m").removed > 0
    _stop(d2)
    d3 = make_daemon(config(SHARED_URL))
    _nothing_of_before_the_clear(d3, prefix, [n.encode() for n in names])


def _l3_state(tmp_path: Path, prefix: str, l3: bool, **model: Any) -> dict[str, Any]:
    """A model with a host tier and keyed pages, Redis (``l3``: on for the model) and a state
    directory kept across the test's daemons."""
    c = l3_config(SHARED_URL, prefix, **{"host_pages": 16, "host_swa_pages": 8, **model}, l3=l3)
    c["server"] = {"state_dir": str(tmp_path / "s")}
    return c


def _store_and_write(c: Client, keys: list[bytes]) -> None:
    """Store ``keys`` (bytes 0x5A, the KV of before a clear) and wait for their Redis writes."""
    pools = c.kv_attach("m")
    r = c.kv_reserve("m", keys)
    for s in r.slots:
        pools.full[s] = 0x5A
    c.kv_commit("m", r.pin)
    wait_for(lambda: c.stats("m").models["m"]["kv_l3_write_pages"] >= len(keys),
             "the Redis writes")


def _written_then_l3_off(make_daemon: Any, tmp_path: Path, prefix: str,
                         keys: list[bytes]) -> Any:
    """A run with Redis stores ``keys`` and writes them there, then stops; returns the next
    run, on the same state directory, with the model's L3 off."""
    d1 = make_daemon(_l3_state(tmp_path, prefix, True))
    with Client(d1.socket) as c:
        _store_and_write(c, keys)
    _stop(d1)
    return make_daemon(_l3_state(tmp_path, prefix, False))


def _nothing_of_before_the_clear(d: Any, prefix: str, keys: list[bytes]) -> None:
    """Once ``d`` recorded the owed clear in Redis, none of ``keys`` comes back from there."""
    _wait_clear_recorded(prefix)
    with Client(d.socket) as c:
        got = c.kv_lookup("m", keys, fetch=True, timeout_s=5)
        assert got.present == bytes(len(keys)) and got.fetched == 0


def _wait_clear_recorded(prefix: str) -> None:
    raw = redis_sync.Redis.from_url(SHARED_URL)
    try:
        wait_for(lambda: [raw.get(k) for k in raw.scan_iter(match=f"{prefix}:kvgen:*")]
                 == [b"1"], "the clear recorded in Redis")
    finally:
        raw.close()


def test_a_clear_made_with_l3_off_is_recorded_at_the_next_start_with_l3(
        make_daemon, tmp_path: Path, prefix: str) -> None:
    """A kv_clear in a run whose model has L3 off (the same state directory, Redis holding the
    namespace's values from the run before): the next run with L3 records the clear before any
    fetch, so the values of before it are not served. It used to be forgotten, and all three
    keys came back from Redis with their old bytes."""
    keys = [b"k%d" % i for i in range(3)]
    d2 = _written_then_l3_off(make_daemon, tmp_path, prefix, keys)
    with Client(d2.socket) as c:
        assert c.kv_lookup("m", keys, pin=False).present == b"\x01" * 3  # the host state kept
        got = c.kv_clear("m")
        assert got.removed == 3 and got.l3_cleared  # (no Redis in this run)
        assert c.kv_lookup("m", keys, pin=False).present == bytes(3)
    _stop(d2)
    d3 = make_daemon(_l3_state(tmp_path, prefix, True))
    _nothing_of_before_the_clear(d3, prefix, keys)


def test_an_owed_clear_survives_a_saved_state_the_next_start_refuses(
        make_daemon, tmp_path: Path, prefix: str) -> None:
    """The clear is owed by a run with L3 off; the next run with L3 refuses the saved pages
    (its host pools changed shape) but still takes the owed clear and records it."""
    keys = [b"k%d" % i for i in range(3)]
    d2 = _written_then_l3_off(make_daemon, tmp_path, prefix, keys)
    with Client(d2.socket) as c:
        assert c.kv_clear("m").removed == 3
        r = c.kv_reserve("m", [b"s"], "swa")  # a saved SWA host page: the shape to refuse
        c.kv_commit("m", r.pin)
    _stop(d2)
    d3 = make_daemon(_l3_state(tmp_path, prefix, True, host_swa_pages=0))
    assert "its host pools changed shape" in d3.log()
    _nothing_of_before_the_clear(d3, prefix, keys)


def _pinned_at_an_l3_off_clear(make_daemon: Any, tmp_path: Path, prefix: str) -> Any:
    """A page "precious", written to Redis, then pinned at a clear made with L3 off; returns
    the next run, with L3 under write_back, once it has recorded that clear."""
    d2 = _written_then_l3_off(make_daemon, tmp_path, prefix, [b"precious"])
    with Client(d2.socket) as c:
        got = c.kv_lookup("m", [b"precious"])  # pinned across the clear
        assert got.present == b"\x01" and c.kv_clear("m").removed == 0
        c.kv_release("m", got.pin)
    _stop(d2)
    cfg = _l3_state(tmp_path, prefix, True)
    cfg["l3"]["write_policy"] = "write_back"
    d3 = make_daemon(cfg)
    _wait_clear_recorded(prefix)
    return d3


def _evict_precious(c: Client) -> None:
    assert c.kv_lookup("m", [b"precious"], pin=False).present == b"\x01"
    for i in range(3):  # 15 usable host slots: the restored page is the oldest to go
        c.kv_commit("m", c.kv_reserve("m", [b"other-%d-%d" % (i, j) for j in range(8)]).pin)
    wait_for(lambda: c.kv_lookup("m", [b"precious"], pin=False).present == b"\x00",
             "its eviction")


def test_a_page_pinned_at_a_clear_made_with_l3_off_is_written_again(
        make_daemon, tmp_path: Path, prefix: str) -> None:
    """A page pinned at that clear keeps its content; its Redis value of before the clear is
    unreadable once the clear is recorded, so under write_back its eviction writes it again,
    and a fetch finds it. It used to keep its mark of being in Redis: evicted, it was lost."""
    d3 = _pinned_at_an_l3_off_clear(make_daemon, tmp_path, prefix)
    with Client(d3.socket) as c:
        pools = c.kv_attach("m")
        _evict_precious(c)
        got = c.kv_lookup("m", [b"precious"], fetch=True, timeout_s=5)
        assert got.present == b"\x01" and got.fetched == 1
        assert int(pools.full[got.slots[0]].min()) == 0x5A == int(pools.full[got.slots[0]].max())
        c.kv_release("m", got.pin)


def test_a_page_kept_by_its_own_clear_is_still_dropped_for_another_daemons_later_clear(
        make_daemon, tmp_path: Path, prefix: str) -> None:
    """The page pinned at the clear made with L3 off is of the generation that clear raises
    once the next run records it. Another daemon clears after that, and the page's write-back
    is dropped: of no generation, it was written under the other daemon's, and fetched as
    newer than its clear (a review found it)."""
    d3 = _pinned_at_an_l3_off_clear(make_daemon, tmp_path, prefix)
    other = make_daemon(l3_config(SHARED_URL, prefix, host_pages=16, host_swa_pages=8),
                        name="other")
    with Client(other.socket) as b, Client(d3.socket) as c:
        b.kv_attach("m")
        assert b.kv_clear("m").l3_cleared is True
        c.kv_attach("m")
        _evict_precious(c)
        wait_for(lambda: c.stats("m").models["m"]["kv_l3_write_outdated"] >= 1,
                 "the dropped write-back")
        got = b.kv_lookup("m", [b"precious"], fetch=True, timeout_s=5)
        assert got.present == b"\x00" and got.fetched == 0


def test_a_second_daemon_on_the_same_state_dir_is_refused(make_daemon, tmp_path: Path) -> None:
    """Two daemons on one state directory would delete each other's page files at their stops
    and restore the other's index: the second start is refused (exit 2, one line naming the
    holder), the first keeps serving, and once it stops the directory is free again."""
    state = tmp_path / "state"
    a = seq(6)
    d1 = make_daemon(_config(state))
    e1 = Engine(d1.socket, seed=3)
    try:
        e1.cache(a)
    finally:
        e1.close()
    with pytest.raises(RuntimeError) as info:
        make_daemon(_config(state))
    assert "radixd exited with 2" in str(info.value)
    assert (f"radixd: server.state_dir: '{state}' is in use by another radixd "
            f"(pid {d1.proc.pid}); give each daemon a state_dir of its own") in str(info.value)
    with Client(d1.socket) as c:
        assert c.match("m", a).prefix_len == 6 * P
    wait_for(lambda: tier_stats(d1)["tree_host_pages"] >= 6, "the host copies")
    _stop(d1)
    d3 = make_daemon(_config(state))
    assert admin_stats(d3)["warm_restart"]["kept_pages"] >= 6


def test_a_state_dir_others_could_write_is_refused(make_daemon, tmp_path: Path) -> None:
    """What a start finds in the state directory it restores and serves to every tenant as
    cached KV: a directory another user could write (mode 0777, as a state_dir under /tmp made
    by hand often is), or replace (one of another user's, or below one, also through a link),
    let them choose what engines read. The start is refused (exit 2, naming the key and why);
    the directories a start makes are 0700, those above the state directory too (the umask
    made them 0770 under the shipped unit: its engines' group could have renamed it)."""
    state = tmp_path / "state"
    state.mkdir()
    for mode in (0o777, 0o750):  # 0750: the group could read every tenant's KV a stop saved
        state.chmod(mode)
        with pytest.raises(RuntimeError) as info:
            make_daemon(_config(state))
        assert "radixd exited with 2" in str(info.value)
        assert (f"radixd: server.state_dir: '{state}': {state} is open to its group or others "
                f"(mode {mode:04o})") in str(info.value)
    state.chmod(0o700)
    if os.geteuid() == 0:  # (only root can give a directory away)
        other = tmp_path / "other"
        (other / "state").mkdir(parents=True, mode=0o700)
        os.chown(other, 54321, -1)
        (tmp_path / "link").symlink_to(other / "state")
        for given in (other / "state", tmp_path / "link"):
            with pytest.raises(RuntimeError) as info:
                make_daemon(_config(given))
            assert f"{other} belongs to uid 54321, not to this user" in str(info.value)
        (tmp_path / "ours").mkdir(mode=0o700)  # a link of ours, in their directory: they
        (other / "to-ours").symlink_to(tmp_path / "ours")  # could point it elsewhere
        (tmp_path / "hop").symlink_to(other / "to-ours")  # also behind a link of ours
        for given in (other / "to-ours", tmp_path / "hop"):
            with pytest.raises(RuntimeError) as info:
                make_daemon(_config(given))
            assert f"{other} belongs to uid 54321, not to this user" in str(info.value)
    umask = os.umask(0o007)
    try:
        d = make_daemon(_config(tmp_path / "warm" / "state"))
    finally:
        os.umask(umask)
    assert ((tmp_path / "warm").stat().st_mode & 0o777,
            (tmp_path / "warm" / "state").stat().st_mode & 0o777) == (0o700, 0o700)
    e = Engine(d.socket, seed=3)
    try:
        e.cache(seq(6))
    finally:
        e.close()
    wait_for(lambda: tier_stats(d)["tree_host_pages"] >= 6, "the host copies")
    _stop(d)  # what a stop saves is this user's alone, whatever the umask
    saved = sorted((tmp_path / "warm" / "state").iterdir())
    assert any(f.name.endswith(".pages") for f in saved), saved
    assert {f.name: f.stat().st_mode & 0o777 for f in saved if f.name != "radixd.lock"} == \
        {f.name: 0o600 for f in saved if f.name != "radixd.lock"}
