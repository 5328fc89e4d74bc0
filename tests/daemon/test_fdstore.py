"""Warm restart through systemd's file-descriptor store, with this test playing systemd: a real
AF_UNIX datagram NOTIFY_SOCKET receives the daemon's ``FDSTORE=1`` messages and their fds
(SCM_RIGHTS) at SIGTERM, and the next daemon is started the way systemd starts it, those fds as
3.. with ``LISTEN_FDS``/``LISTEN_FDNAMES``/``LISTEN_PID`` (a small launcher sets them after the
fork, then execs the daemon). A client reads the restored pages back byte-exact; a corrupted
page is dropped, a changed layout refused whole, and every fd the daemon got back is removed
from the store (``FDSTOREREMOVE=1``). Every daemon ends with a strict full invariant check."""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from radixd_client import Client

from bench.restart_bench import FdStore
from daemon.cli import format_status
from daemon.storage.host_snapshot import INDEX_NAME, as_slots, decode_index, read_fd
from daemon.warm_restart import INDEX_FD

from .test_tiers import Engine, P, admin_stats, cache_until_on_host, seq, tier_stats, wait_for
from .test_warm_restart import assert_only_the_first_node_served


@pytest.fixture
def store() -> Iterator[FdStore]:
    path = Path(tempfile.mkdtemp(prefix="rxfd-", dir="/tmp"))  # sun_path holds 107 bytes
    s = FdStore(str(path))
    yield s
    s.close()
    shutil.rmtree(path, ignore_errors=True)


def _config(**model: Any) -> dict[str, Any]:
    from .conftest import SMALL_MODEL

    return {"models": [{**SMALL_MODEL, **model}]}


def _fill(make_daemon: Any, store: FdStore, seqs: list[list[int]], **model: Any
          ) -> tuple[dict, dict]:
    """Cache ``seqs`` in a daemon under ``store``, wait for their host copies, SIGTERM it and
    take its fds into the store; returns the KV kept per page (the first writer's)."""
    d = make_daemon(_config(**model), **store.launch())
    kept = cache_until_on_host(d, seqs)
    d.check()
    assert d.stop() == 0, d.log()[-3000:]
    store.pump()
    return kept


def _stored_names(store: FdStore) -> set[str]:
    """The fd names a stop must have stored: the index and, per host pool with saved pages,
    its memfd, or (memory isolation) the memfd of each segment holding a saved slot."""
    img = decode_index(read_fd(store.fds[INDEX_FD])).models["m"]
    names = {INDEX_FD}
    for kind, pool in img.pools.items():
        sp = pool.segment_pages
        names |= ({f"{pool.file}-seg{s // sp}" for s in as_slots(pool.slots)} if sp
                  else {pool.file})
        assert pool.file == f"radixd-host-0-{kind}"
    return names


def _stored_page(store: FdStore, kind: str, slot: int) -> tuple[int, int]:
    """(stored fd, byte offset) of saved host slot ``slot`` of pool ``kind``."""
    pool = decode_index(read_fd(store.fds[INDEX_FD])).models["m"].pools[kind]
    if not pool.segment_pages:
        return store.fds[pool.file], slot * pool.page_nbytes
    seg, at = divmod(slot, pool.segment_pages)
    return store.fds[f"{pool.file}-seg{seg}"], at * pool.page_nbytes


@pytest.mark.parametrize("isolation", ["segments", "none"])
def test_host_pools_survive_through_the_fd_store_byte_exact(make_daemon, store,
                                                            isolation: str) -> None:
    a, b = seq(10), seq(6, base=5000)
    e1 = _fill(make_daemon, store, [a, b], memory_isolation=isolation)
    stored = _stored_names(store)
    assert set(store.fds) == stored
    if isolation == "none":
        assert stored == {INDEX_FD, "radixd-host-0-full", "radixd-host-0-swa"}
    else:  # one memfd per host segment holding a saved page, none of the empty ones
        assert all("-seg" in n for n in stored - {INDEX_FD}) and len(stored) >= 3
    d2 = make_daemon(_config(memory_isolation=isolation), **store.launch())
    assert "stored 20 host pages" in (d2.tmp.parent / "d0" / "radixd.log").read_text()
    store.pump()
    assert store.fds == {}  # consumed: removed from the store (FDSTOREREMOVE=1)
    assert sorted(store.removed) == sorted(stored)
    e2 = Engine(d2.socket, seed=9)
    try:
        m = e2.c.match("m", a)
        assert (m.prefix_len, m.host_hit_len) == (0, 10 * P)
        r = e2.c.load("m", a)
        assert (r.prefix_len, r.loaded_len) == (10 * P, 10 * P)
        assert e2.verify(a, r, expect=e1) > 10
        r = e2.c.load("m", b)
        assert r.prefix_len == 6 * P
        e2.verify(b, r, expect=e1)
        stats = admin_stats(d2)
        st = stats["warm_restart"]
        assert (st["source"], st["kept_pages"], st["dropped_pages"]) == ("fdstore", 20, 0)
        assert "warm restart (fdstore): kept 20 host pages, dropped 0" in format_status(stats)
    finally:
        e2.close()
    d2.check()


def test_a_corrupted_page_in_a_stored_pool_is_dropped(make_daemon, store) -> None:
    a = seq(8)
    e1 = _fill(make_daemon, store, [a[: 4 * P], a])  # two nodes: pages 0-3, then 4-7
    snap = decode_index(read_fd(store.fds[INDEX_FD]))
    img = snap.models["m"]
    second = as_slots(img.tree[1].host)[1]  # a page of the second node
    fd, at = _stored_page(store, "full", second)
    with mmap.mmap(fd, os.fstat(fd).st_size) as mem:
        mem[at + 5] ^= 0xFF
    assert_only_the_first_node_served(make_daemon(_config(), **store.launch()), a, e1)
    store.pump()
    assert store.fds == {}


def test_a_changed_layout_refuses_the_stored_pools_whole(make_daemon, store) -> None:
    _fill(make_daemon, store, [seq(6)])
    d2 = make_daemon(_config(head_dim=8), **store.launch())
    assert "its layout changed" in d2.log()
    with Client(d2.socket) as c:
        assert c.match("m", seq(6)).host_hit_len == 0
    st = admin_stats(d2)["warm_restart"]
    assert (st["source"], st["kept_pages"], st["dropped_pages"]) == ("fdstore", 0, 6 + 2)
    store.pump()
    assert store.fds == {}  # refused fds are removed from the store too


def test_restart_under_load_keeps_verified_pages(make_daemon, store) -> None:
    """Three clients cache sequences without pause while SIGTERM arrives; whatever the next
    daemon serves from the kept host tier is byte-exact what its writer wrote."""
    d1 = make_daemon(_config(), **store.launch())
    written: list[list[int]] = []
    records: tuple[dict, dict] = ({}, {})
    lock = threading.Lock()
    stop = threading.Event()

    def client(k: int) -> None:
        e = Engine(d1.socket, seed=k)
        try:
            n = 0
            while not stop.is_set():
                toks = seq(3, base=100_000 * (k + 1) + 1000 * n)
                n += 1
                e.cache(toks)
                with lock:
                    written.append(toks)
                    for mine, theirs in zip(records, (e.full, e.swa), strict=True):
                        mine.update(theirs)
        except Exception:  # noqa: BLE001 - the daemon going away mid-request is the point
            pass
        finally:
            e.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: tier_stats(d1)["tree_host_pages"] >= 30, "host pages under load", 60)
    assert d1.stop() == 0, d1.log()[-3000:]  # SIGTERM with the clients still running
    stop.set()
    for t in threads:
        t.join()
    store.pump()
    d2 = make_daemon(_config(), **store.launch())
    kept = admin_stats(d2)["warm_restart"]
    assert kept["source"] == "fdstore" and kept["kept_pages"] > 0
    e2 = Engine(d2.socket, seed=99)
    checked = 0
    try:
        for toks in written:
            r = e2.c.load("m", toks)
            checked += e2.verify(toks, r, expect=records)
    finally:
        e2.close()
    assert checked > 0
    d2.check()


def test_socket_activation_and_the_fd_store_together(make_daemon, store, tmp_path) -> None:
    """systemd passes the listening socket of radixd.socket and the stored fds in one
    LISTEN_FDS; the names tell them apart: the daemon serves on the socket and restores."""
    a = seq(6)
    e1 = _fill(make_daemon, store, [a])
    (tmp_path / "d1").mkdir()  # where make_daemon puts the next daemon: its configured socket
    path = str(tmp_path / "d1" / "radixd.sock")  # is this passed one (readiness waits on it)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    try:
        d2 = make_daemon(_config(), **store.launch({"radixd.socket": listener.fileno()}))
        # (the passed socket accepts before the daemon is up: wait for it to say it serves)
        wait_for(lambda: "serving on" in d2.log(), "the daemon to serve", 60)
        assert "(socket passed by systemd)" in d2.log() and "ignoring extra socket" not in d2.log()
        assert d2.socket == path
        e2 = Engine(path, seed=5)  # served on the passed socket
        try:
            r = e2.c.load("m", a)
            assert (r.prefix_len, r.loaded_len) == (6 * P, 6 * P)
            e2.verify(a, r, expect=e1)
        finally:
            e2.close()
        assert admin_stats(d2)["warm_restart"]["source"] == "fdstore"
        store.pump()
        assert store.fds == {}
    finally:
        listener.close()


def test_a_store_too_small_for_the_host_segments_falls_back_to_state_dir(make_daemon,
                                                                          tmp_path) -> None:
    """Memory isolation stores one fd per host segment holding pages: when systemd keeps fewer
    (FileDescriptorStoreMax=, passed as $FDSTORE), the stop stores none, says which setting to
    raise, and the state directory keeps the host tier instead."""
    path = Path(tempfile.mkdtemp(prefix="rxfd-", dir="/tmp"))
    small = FdStore(str(path), limit=2)
    try:
        cfg = {**_config(), "server": {"state_dir": str(tmp_path / "state")}}
        d1 = make_daemon(cfg, **small.launch())
        cache_until_on_host(d1, [seq(10)])
        d1.check()
        assert d1.stop() == 0, d1.log()[-3000:]
        small.pump()
        assert small.fds == {}
        assert "raise FileDescriptorStoreMax=" in d1.log()
        d2 = make_daemon(cfg, **small.launch())
        st = admin_stats(d2)["warm_restart"]
        assert (st["source"], st["dropped_pages"]) == ("state_dir", 0) and st["kept_pages"] > 10
        d2.check()
    finally:
        small.close()
        shutil.rmtree(path, ignore_errors=True)


def test_pools_left_in_the_store_without_an_index_fall_back_to_state_dir(make_daemon, store,
                                                                          tmp_path) -> None:
    """A stop whose fd-store save fails half way saves to the state directory instead, leaving
    systemd holding the pools it had already stored but no index. The next start refuses those
    (and removes them from the store) and restores what the state directory kept."""
    cfg = {**_config(), "server": {"state_dir": str(tmp_path / "state")}}
    a = seq(10)
    d1 = make_daemon(cfg)  # the fallback save: no fd store reached, the state directory
    kept = cache_until_on_host(d1, [a])
    d1.check()
    assert d1.stop() == 0, d1.log()[-3000:]
    stray = os.memfd_create("radixd-host-0-full", os.MFD_CLOEXEC)
    os.ftruncate(stray, 1 << 16)
    store.fds["radixd-host-0-full"] = stray  # what the half-done save left with systemd
    d2 = make_daemon(cfg, **store.launch())
    assert "no index" in d2.log()
    st = admin_stats(d2)["warm_restart"]
    assert (st["source"], st["dropped_pages"]) == ("state_dir", 0) and st["kept_pages"] >= 10
    store.pump()
    assert store.fds == {} and store.removed == ["radixd-host-0-full"]
    e2 = Engine(d2.socket, seed=9)
    try:
        r = e2.c.load("m", a)
        assert r.prefix_len == 10 * P
        assert e2.verify(a, r, expect=kept) > 10
    finally:
        e2.close()
    d2.check()


def test_a_restore_from_the_fd_store_discards_an_older_state_dir_snapshot(make_daemon, store,
                                                                          tmp_path) -> None:
    """What state_dir holds when the fd store restored is older than what the fd store held: it
    is discarded, so that a later start that falls back to state_dir never restores it."""
    state = tmp_path / "state"
    cfg = {**_config(), "server": {"state_dir": str(state)}}
    d0 = make_daemon(cfg)
    cache_until_on_host(d0, [seq(6, base=7000)])
    assert d0.stop() == 0, d0.log()[-3000:]
    old = {p.name: p.read_bytes() for p in state.iterdir()}
    assert INDEX_NAME in old
    d1 = make_daemon(cfg, **store.launch())  # restores state_dir (and consumes it)
    # the restored pages count too: waiting for the new ones alone was met by the restored six
    # until the new copies landed (then never: a loaded machine timed out)
    cache_until_on_host(d1, [seq(6, base=7000), seq(6)])
    assert d1.stop() == 0, d1.log()[-3000:]
    store.pump()
    assert INDEX_FD in store.fds
    for name, raw in old.items():  # the older snapshot, back in place
        (state / name).write_bytes(raw)
    d2 = make_daemon(cfg, **store.launch())
    assert admin_stats(d2)["warm_restart"]["source"] == "fdstore"
    assert "older host snapshot" in d2.log()
    assert not [p.name for p in state.iterdir() if p.name.startswith("host-")]
    d2.check()
