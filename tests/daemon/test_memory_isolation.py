"""Memory isolation between tenants (issue 16), against a real daemon over real sockets.

Tenant A (this process) writes a secret into pages of its namespace. Tenant B (another process)
then tries to read and to write them through everything it was given: the pools it mapped with
``attach``, A's page ids in ``free``/``insert``/``cache_finished``, and the descriptor numbers
the daemon holds A's segments under. Each attempt must fail. On a model with
``memory_isolation = "none"`` (today's single shared pool) the same read succeeds: that test
shows what the setting gives up, and is how these tests fail on a daemon without segments.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
from array import array
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from radixd_client import AsyncClient, Client, Reconnect, RequestLifecycle
from radixd_client.errors import ConnectFailed, PageError, ReceiptError, SegmentsNotMapped
from radixd_client.segments import SegmentedRegion

from .conftest import REPO, SMALL_MODEL

P = SMALL_MODEL["page_size"]
SECRET = 1234.5

TENANTS = {
    "tenants": [
        {"name": "alice", "token": "alice-token", "namespace": "ns-a"},
        {"name": "bob", "token": "bob-token", "namespace": "ns-b"},
    ],
}

# Tenant B: maps what attach gives it and tries everything it can with A's page ids.
ATTACKER = r"""
import json, os, sys
from radixd_client import Client
from radixd_client.errors import RadixdError
sock, pages, daemon_fds = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
SECRET = float(sys.argv[4])
out = {}
with Client(sock, token="bob-token") as c:
    pools = c.attach("m")
    full, swa = pools.full, pools.swa
    out["read_full"] = [float(full[:, :, p].abs().max()) for p in pages]
    out["read_swa"] = [float(swa[:, :, p].abs().max()) for p in pages]
    for p in pages:  # write over A's pages through B's own mapping
        full[:, :, p] = -1.0
        swa[:, :, p] = -1.0
    refused = {}
    def attempt(name, fn):
        try:
            fn()
            refused[name] = None
        except RadixdError as exc:
            refused[name] = exc.code
    tokens = bytes(4 * P * len(pages))
    attempt("free", lambda: c.free("m", pages, pages))
    attempt("insert", lambda: c.insert("m", tokens, pages, pages))
    attempt("cache_finished", lambda: c.cache_finished("m", tokens, pages, pages))
    out["refused"] = refused
    # the descriptor numbers the daemon holds A's segments under mean nothing here
    seen = []
    for n in daemon_fds:
        try:
            st = os.fstat(n)
            seen.append([n, st.st_ino])
        except OSError:
            pass
    out["fds"] = seen
print(json.dumps(out))
""".replace("P * len", f"{P} * len")


def ids(raw: bytes) -> list[int]:
    return list(array("i", raw))


def segment_inodes(pid: int, tag: str = "-seg") -> dict[int, int]:
    """fd number -> inode of each memfd segment the daemon holds (read as the test's user);
    ``tag`` "-host-seg" picks the host pools' segments."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if "radixd-m-" in target and tag in target:
            out[int(name)] = os.stat(f"/proc/{pid}/fd/{name}").st_ino
    return out


def _attack(sock: str, pages: list[int], daemon_fds: list[int]) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'clients' / 'python'}"}
    proc = subprocess.run([sys.executable, "-c", ATTACKER, sock, json.dumps(pages),
                           json.dumps(daemon_fds), str(SECRET)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _write_secret(c: Client, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    pools = c.attach("m")
    for p in pages:
        pools.full[:, :, p] = SECRET
        pools.swa[:, :, p] = SECRET
    return pools.full, pools.swa


def test_another_tenant_cannot_read_or_write_my_pages(make_daemon) -> None:
    d = make_daemon(TENANTS)
    with Client(d.socket, token="alice-token") as a:
        got = a.alloc("m", 3)
        pages = ids(got.full_pages)
        assert ids(got.swa_pages) == pages  # fresh pools: the same ids in both
        full, swa = _write_secret(a, pages)
        inodes = segment_inodes(d.proc.pid)
        out = _attack(d.socket, pages, sorted(inodes))
        # B's view of A's pages is zeros, not the secret
        assert out["read_full"] == [0.0] * 3 and out["read_swa"] == [0.0] * 3, out
        # B's writes landed in its private memory: A's pages still hold the secret
        for p in pages:
            assert bool((full[:, :, p] == SECRET).all()) and bool((swa[:, :, p] == SECRET).all())
        # A's page ids are not B's to free or to put in B's tree
        assert out["refused"] == {"free": "page_not_held", "insert": "page_not_held",
                                  "cache_finished": "page_not_held"}, out
        # the numbers the daemon holds A's memfds under are no memfd of A's in B
        assert not {ino for _n, ino in out["fds"]} & set(inodes.values()), out
        # and the tree still holds A's pages for A only
        a.insert("m", bytes(4 * P * 3), got.full_pages, got.swa_pages)
    d.check()


def test_a_page_changes_namespace_only_through_the_free_list_and_zeroed(make_daemon) -> None:
    d = make_daemon(TENANTS)
    with Client(d.socket, token="alice-token") as a, Client(d.socket, token="bob-token") as b:
        got = a.alloc("m", 3)
        pages = ids(got.full_pages)
        a_full, _ = _write_secret(a, pages)
        a.free("m", got.full_pages, got.swa_pages)  # the segment empties: back to the free list
        mine = b.alloc("m", 3)  # B takes that segment: fresh memory, zeroed
        assert sorted(ids(mine.full_pages)) == sorted(pages)
        b_pools = b.attach("m")
        for p in pages:
            assert float(b_pools.full[:, :, p].abs().max()) == 0.0
        # A's stale mapping (if its client kept one) is the old memory: its writes reach no one
        for p in pages:
            a_full[:, :, p] = SECRET
        for p in pages:
            assert float(b_pools.full[:, :, p].abs().max()) == 0.0
        # A's next result names a newer generation: its client remaps, the segment is gone
        a.alloc("m", 1)
        for p in pages:
            assert float(a.attach("m").full[:, :, p].abs().max()) == 0.0
        b.free("m", mine.full_pages, mine.swa_pages)
    d.check()


def test_segments_appear_in_a_mapping_as_the_namespace_grows(make_daemon) -> None:
    d = make_daemon(TENANTS)
    with Client(d.socket, token="alice-token") as a, Client(d.socket, token="alice-token") as a2:
        pools = a.attach("m")
        before = dict(pools.segments)
        got = a2.alloc("m", 9)  # another session of the namespace takes new segments
        a2.insert("m", bytes(4 * P * 9), got.full_pages, got.swa_pages)
        for p in ids(got.full_pages):
            pools2 = a2.attach("m")
            pools2.full[:, :, p] = float(p)
        m = a.match("m", bytes(4 * P * 9))  # names pages in segments `a` had not mapped
        assert m.prefix_len == 9 * P and dict(pools.segments) != before
        for p in ids(m.full_pages):
            assert float(pools.full[0, 0, p, 0, 0, 0]) == float(p)
    d.check()


def test_a_segment_taken_back_by_its_namespace_keeps_its_mappings(make_daemon) -> None:
    """A namespace that empties a segment and fills it again (alloc, free, alloc: the common
    case) keeps the same memory: the generation does not move, no attach is needed, and what a
    client writes through its old mapping is what every other session of the namespace reads."""
    d = make_daemon(TENANTS)
    with Client(d.socket, token="alice-token") as a:
        got = a.alloc("m", 3)
        pools = a.attach("m")
        gen, mapped = pools.generation, dict(pools.segments)
        a.free("m", got.full_pages, got.swa_pages)  # the segment empties: on the free list
        again = a.alloc("m", 3)
        assert sorted(ids(again.full_pages)) == sorted(ids(got.full_pages))
        assert again.segments_gen == gen and pools.generation == gen
        assert dict(pools.segments) == mapped
        for p in ids(again.full_pages):
            pools.full[:, :, p] = float(p)
        a.insert("m", bytes(4 * P * 3), again.full_pages, again.swa_pages)
    with Client(d.socket, token="alice-token") as fresh:
        m = fresh.match("m", bytes(4 * P * 3))
        view = fresh.attach("m")
        assert [float(view.full[0, 0, p, 0, 0, 0]) for p in ids(m.full_pages)] == [
            float(p) for p in ids(m.full_pages)]
    d.check()


def test_no_memory_isolation_maps_the_whole_pool(make_daemon, tmp_path: Path) -> None:
    """What memory_isolation = "none" gives up (and what a daemon without segments does)."""
    d = make_daemon({**TENANTS, "models": [{**SMALL_MODEL, "memory_isolation": "none"}]})
    with Client(d.socket, token="alice-token") as a:
        pages = ids(a.alloc("m", 3).full_pages)
        _write_secret(a, pages)
        out = _attack(d.socket, pages, [])
        assert out["read_full"] == [SECRET] * 3
        a.free("m", pages, pages)
    d.check()


@pytest.mark.parametrize("bad", [{"segment_pages": -1}, {"segment_pages": 3},
                                 {"memory_isolation": "some"}])
def test_bad_segment_settings_are_refused_with_the_key(bad, tmp_path: Path) -> None:
    from daemon.config import ConfigError, load_config

    lines = ["[[models]]"] + [f"{k} = {json.dumps(v)}" for k, v in {**SMALL_MODEL, **bad}.items()]
    path = tmp_path / "c.toml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"models\[\"m\"\]\.(segment_pages|memory_isolation)"):
        load_config(path, env={})


@pytest.fixture
def maps_fail(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """``maps_fail(True)``: this process can map no new segment (the ENOMEM or
    ``vm.max_map_count`` an mmap meets when memory runs out, which a test cannot cause
    on demand); ``maps_fail(False)`` lifts it."""
    real = SegmentedRegion.map_segment

    def failing(self: SegmentedRegion, segment: int, fd: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    def set_failing(on: bool) -> None:
        monkeypatch.setattr(SegmentedRegion, "map_segment", failing if on else real)

    return set_failing


def test_a_result_whose_segments_cannot_be_mapped_keeps_what_the_call_took(
        make_daemon, maps_fail) -> None:
    """The daemon carried out the call: the error carries its result, so the caller can give
    back the pages an alloc took and the receipt a match took (they were lost in a raise)."""
    d = make_daemon(TENANTS)
    with Client(d.socket, token="alice-token") as a, Client(d.socket, token="alice-token") as a2:
        pools = a.attach("m")
        before = dict(pools.segments)
        maps_fail(True)
        with pytest.raises(SegmentsNotMapped) as alloc_err:
            a.alloc("m", 9)  # the namespace takes new segments
        got = alloc_err.value.result
        assert len(ids(got.full_pages)) == 9 and alloc_err.value.details["models"] == ["m"]
        assert dict(pools.segments) == before  # nothing half mapped claims to be there
        a.free("m", got.full_pages, got.swa_pages)  # held, and known: they go back
        with pytest.raises(PageError):
            a.free("m", got.full_pages, got.swa_pages)

        more = a2.alloc("m", 9)
        a2.insert("m", bytes(4 * P * 9), more.full_pages, more.swa_pages)
        with pytest.raises(SegmentsNotMapped) as match_err:
            a.match("m", bytes(4 * P * 9), lock=True)
        m = match_err.value.result
        assert m.prefix_len == 9 * P and m.receipt is not None
        a.unlock("m", m.receipt)

        maps_fail(False)  # the next result that names the generation maps it
        m = a.match("m", bytes(4 * P * 9))
        assert dict(pools.segments) != before and pools.generation == m.segments_gen
    d.check()


def test_a_lifecycle_whose_pages_cannot_be_mapped_only_aborts_and_gives_them_back(
        make_daemon, maps_fail) -> None:
    d = make_daemon(TENANTS)
    with Client(d.socket, token="alice-token") as a:
        a.attach("m")
        lc = RequestLifecycle(a, "m", range(1, 9 * P + 1))
        lc.admit()
        maps_fail(True)
        with pytest.raises(SegmentsNotMapped):
            lc.reserve(9 * P)
        held = list(lc.writable_full)
        assert len(held) == 9
        with pytest.raises(SegmentsNotMapped):  # no write into pages not mapped here
            lc.check_writable(0, P)
        with pytest.raises(SegmentsNotMapped):
            lc.commit(P)
        maps_fail(False)
        lc.abort()
        with pytest.raises(PageError):  # abort gave them back
            a.free("m", held)
    d.check()


def test_an_async_batch_whose_segments_cannot_be_mapped_keeps_its_results(
        make_daemon, maps_fail) -> None:
    d = make_daemon(TENANTS)

    async def run() -> None:
        async with await AsyncClient.connect(d.socket, token="alice-token") as a:
            await a.attach("m")
            maps_fail(True)
            with pytest.raises(SegmentsNotMapped):
                async with a.batch() as b:
                    got = b.alloc("m", 9)
                    stats = b.stats()
            assert stats.result() is not None
            pages = got.result().full_pages
            assert len(ids(pages)) == 9
            maps_fail(False)
            await a.free("m", pages, got.result().swa_pages)
            with pytest.raises(PageError):
                await a.free("m", pages)

    asyncio.run(run())
    d.check()


def test_locked_gives_back_the_receipt_of_a_match_it_cannot_hand_over(make_daemon,
                                                                      maps_fail) -> None:
    """``locked()`` whose match names segments this process cannot map: the block never runs
    (its pages are not usable here) and nobody else holds the receipt, so ``locked`` releases
    it before the error goes on, in both clients; a second unlock of it is refused."""
    d = make_daemon(TENANTS)

    def cache_new_segments(c: Client, first: int) -> bytes:
        toks = array("i", range(first, first + 9 * P)).tobytes()
        got = c.alloc("m", 9)  # more than the namespace's segments hold: new ones
        c.insert("m", toks, got.full_pages, got.swa_pages)
        return toks

    with Client(d.socket, token="alice-token") as a, Client(d.socket, token="alice-token") as a2:
        a.attach("m")
        maps_fail(True)
        toks = cache_new_segments(a2, 1)
        with pytest.raises(SegmentsNotMapped) as err:
            with a.locked("m", toks):
                pytest.fail("the block ran with pages this process has not mapped")
        receipt = err.value.result.receipt
        assert receipt is not None and err.value.result.prefix_len == 9 * P
        with pytest.raises(ReceiptError):
            a.unlock("m", receipt)  # locked() gave it back
        maps_fail(False)

        async def run() -> None:
            async with await AsyncClient.connect(d.socket, token="alice-token") as b:
                await b.attach("m")
                maps_fail(True)
                more = cache_new_segments(a2, 10 * P)
                with pytest.raises(SegmentsNotMapped) as aerr:
                    async with b.locked("m", more):
                        pytest.fail("the block ran with pages this process has not mapped")
                areceipt = aerr.value.result.receipt
                assert areceipt is not None
                with pytest.raises(ReceiptError):
                    await b.unlock("m", areceipt)
                maps_fail(False)

        asyncio.run(run())
    d.check()


def test_a_session_gone_during_the_follow_up_attach_is_not_segments_not_mapped(
        make_daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon dies while the client maps the segments a result named, and does not come
    back within the reconnect policy: the call raises ``ConnectFailed`` (the session, and what
    the call took, are gone), not ``SegmentsNotMapped`` offering a result nobody can give back."""
    d = make_daemon(TENANTS)
    a = Client(d.socket, token="alice-token",
               reconnect=Reconnect(max_wait_s=1.0, initial_backoff_s=0.05, max_backoff_s=0.2))
    a.attach("m")
    with Client(d.socket, token="alice-token") as a2:
        got = a2.alloc("m", 9)
        toks = bytes(4 * P * 9)
        a2.insert("m", toks, got.full_pages, got.swa_pages)
    real_attach = a.attach

    def attach_after_the_daemon_died(model: str) -> object:
        d.check()
        assert d.stop() == 0
        return real_attach(model)

    monkeypatch.setattr(a, "attach", attach_after_the_daemon_died)
    with pytest.raises(ConnectFailed, match="did not come back"):
        a.match("m", toks, lock=True)
    a.close()
