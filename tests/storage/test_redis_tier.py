"""RedisTier against real Redis: round trips, verification, TTL, Redis down/slow, Cluster."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
import pytest_asyncio
import redis as redis_sync
from redis.backoff import NoBackoff
from redis.retry import Retry

from daemon.storage.codec import encode_page
from daemon.storage.redis_tier import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, RedisTier
from tests.redis_procs import SHARED_URL, Server, free_port, start_cluster

FP = bytes(range(32))
OP_TIMEOUT = 0.3



def _hashes(n: int, salt: bytes) -> list[bytes]:
    import hashlib

    return [hashlib.sha256(salt + i.to_bytes(4, "little")).digest() for i in range(n)]


def _page(h: bytes, pool: str = "full", size: int = 8192, page_size: int = 16) -> bytes:
    payload = (h * (size // 32 + 1))[:size]
    return encode_page(pool=pool, page_hash=h, fingerprint=FP,
                       tokens=list(range(page_size)), payload=payload)


def _prefix() -> str:
    return f"radixd-test:{uuid.uuid4().hex}:"


def _cleanup(client: redis_sync.Redis, prefix: str) -> None:
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)


@pytest_asyncio.fixture
async def shared():
    prefix = _prefix()
    tier = RedisTier(SHARED_URL, key_prefix=prefix, ttl_seconds=0, op_timeout=2.0,
                     connect_timeout=2.0, max_pipeline=8)
    raw = redis_sync.Redis.from_url(SHARED_URL)
    try:
        yield tier, raw
    finally:
        await tier.aclose()
        _cleanup(raw, prefix)
        raw.close()


# -- servers this test file starts itself ----------------------------------------------------


@pytest.fixture
def own_server(tmp_path):
    srv = Server(free_port(), tmp_path, "--enable-debug-command", "yes")
    try:
        srv.start()
        yield srv
    finally:
        srv.kill()


# -- against the shared server ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_round_trip_byte_exact(shared) -> None:
    tier, raw = shared
    hs = _hashes(20, b"rt")
    full = [_page(h, "full", size=4096 + i) for i, h in enumerate(hs)]
    swa = [_page(h, "swa", size=1024 + i) for i, h in enumerate(hs[-4:])]
    assert await tier.set_pages(full + swa) == 24
    assert raw.exists(tier.key(hs[0])) and raw.exists(tier.key(hs[-1], "swa"))
    assert tier.key(hs[-1], "swa") == tier.key(hs[-1]) + ":swa"
    assert raw.get(tier.key(hs[3])) == full[3]  # one key, the encoded value as is

    got = await tier.get_pages(hs, "full", FP)
    assert all(p is not None for p in got)
    for p, v, h in zip(got, full, hs, strict=True):
        assert p.page_hash == h and bytes(p.payload) == v[-len(p.payload):]
        assert p.token_ids() == list(range(16))
    got_swa = await tier.get_pages(hs, "swa", FP)
    assert [p is not None for p in got_swa] == [False] * 16 + [True] * 4
    assert bytes(got_swa[-1].payload) == swa[-1][-len(got_swa[-1].payload):]

    assert await tier.exists_prefix(hs) == 20
    assert await tier.exists_prefix(hs, "swa") == 0
    assert await tier.exists_prefix(hs[-4:], "swa") == 4
    assert await tier.exists_prefix([]) == 0

    s = tier.stats
    assert s["sets"] == 24 and s["gets"] == 40 and s["hits"] == 24 and s["misses"] == 16
    assert s["bytes_written"] == sum(map(len, full + swa))
    assert s["bytes_read"] == s["bytes_written"]
    assert s["corrupt"] == s["timeouts"] == s["errors"] == 0
    assert s["breaker_state"] == CLOSED

    assert await tier.delete(hs[:2]) == 2
    again = await tier.get_pages(hs[:3], "full", FP)
    assert again[:2] == [None, None] and bytes(again[2].payload) == bytes(got[2].payload)
    assert not raw.exists(tier.key(hs[0]))
    assert raw.ttl(tier.key(hs[5])) == -1  # no TTL configured: persistent


@pytest.mark.asyncio
async def test_counters_count_up_and_never_fall_below_the_floor(shared) -> None:
    """What a kv_clear's generation rests on (daemon/keyed_tier.py): an absent counter reads 0,
    a raise adds one (to the floor less one if the counter is absent), and a key that holds
    something else reads as no answer rather than a wrong number."""
    tier, raw = shared
    assert await tier.counter("gen") == 0
    assert await tier.raise_counter("gen", 1) == 1
    assert await tier.raise_counter("gen", 1) == 2
    assert await tier.raise_counter("gen", 10) == 3  # it is there: counted on
    raw.delete(tier.key_prefix + "gen")  # Redis lost it
    assert await tier.raise_counter("gen", 10) == 10  # back where its caller knew it
    assert await tier.counter("gen") == 10 == int(raw.get(tier.key_prefix + "gen"))
    assert await tier.counter("gen", 4) == 10  # there: read as it is
    raw.delete(tier.key_prefix + "gen")
    assert await tier.counter("gen", 4) == 4 == int(raw.get(tier.key_prefix + "gen"))
    raw.set(tier.key_prefix + "odd", b"not a number")
    assert await tier.counter("odd") is None
    assert await tier.raise_counter("odd", 1) is None
    assert raw.get(tier.key_prefix + "odd") == b"not a number"


@pytest.mark.asyncio
async def test_counters_of_a_redis_that_does_not_answer_are_none() -> None:
    tier = RedisTier(f"redis://127.0.0.1:{free_port()}/0", key_prefix=_prefix(),
                     op_timeout=OP_TIMEOUT, connect_timeout=OP_TIMEOUT)
    try:
        assert await tier.counter("gen") is None
        assert await tier.raise_counter("gen", 1) is None
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_a_cluster_url_on_a_redis_without_cluster_mode_is_named_and_counted() -> None:
    """redis+cluster:// pointed at a plain Redis: the logs named it redis://, and its failures
    (RedisClusterException, no RedisError) were not counted in errors, which the
    troubleshooting guide says to look at."""
    hostport = SHARED_URL.split("://", 1)[1].split("/", 1)[0]
    tier = RedisTier(f"redis+cluster://{hostport}", key_prefix=_prefix(),
                     op_timeout=OP_TIMEOUT, connect_timeout=OP_TIMEOUT)
    try:
        assert tier.url == f"redis+cluster://{hostport}"
        assert await tier.set_pages([_page(h) for h in _hashes(2, b"cl")]) == 0
        assert tier.stats["errors"] >= 1
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_exists_prefix_counts_leading_run_only(shared) -> None:
    tier, _ = shared
    hs = _hashes(30, b"lead")
    # stored: 0..11, 13..29 (a gap at 12) -> leading run is 12, across pipeline chunks of 8
    assert await tier.set_pages([_page(h) for i, h in enumerate(hs) if i != 12]) == 29
    assert await tier.exists_prefix(hs) == 12
    assert await tier.exists_prefix(hs[13:]) == 17
    assert await tier.exists_prefix(hs[12:]) == 0
    assert await tier.exists_prefix(list(reversed(hs[:12]))) == 12


@pytest.mark.asyncio
async def test_ttl_applied() -> None:
    prefix = _prefix()
    tier = RedisTier(SHARED_URL, key_prefix=prefix, ttl_seconds=120)
    raw = redis_sync.Redis.from_url(SHARED_URL)
    try:
        hs = _hashes(3, b"ttl")
        assert await tier.set_pages([_page(h) for h in hs] + [_page(hs[0], "swa")]) == 4
        for key in [tier.key(h) for h in hs] + [tier.key(hs[0], "swa")]:
            assert 100 < raw.ttl(key) <= 120
    finally:
        await tier.aclose()
        _cleanup(raw, prefix)
        raw.close()


@pytest.mark.asyncio
async def test_corrupt_value_is_counted_deleted_and_missed(shared) -> None:
    tier, raw = shared
    hs = _hashes(5, b"bad")
    values = [_page(h) for h in hs]
    assert await tier.set_pages(values) == 5
    flipped = bytearray(values[1])
    flipped[-100] ^= 0x40
    raw.set(tier.key(hs[1]), bytes(flipped))                      # payload bit flip
    raw.set(tier.key(hs[2]), values[2][:-10])                     # truncated
    raw.set(tier.key(hs[3]), values[4])                           # another page's value
    other_fp = encode_page(pool="full", page_hash=hs[4], fingerprint=bytes(32),
                           tokens=list(range(16)), payload=b"z" * 64)
    raw.set(tier.key(hs[4]), other_fp)                            # another model layout

    got = await tier.get_pages(hs, "full", FP)
    assert got[0] is not None and got[1:] == [None] * 4
    assert tier.stats["corrupt"] == 4 and tier.stats["hits"] == 1
    assert [raw.exists(tier.key(h)) for h in hs] == [1, 0, 0, 0, 0]
    # a swa value under the full key is a wrong-pool mismatch
    raw.set(tier.key(hs[0]), _page(hs[0], "swa"))
    assert (await tier.get_pages(hs[:1], "full", FP)) == [None]
    assert tier.stats["corrupt"] == 5 and not raw.exists(tier.key(hs[0]))
    assert tier.stats["breaker_state"] == CLOSED and tier.stats["errors"] == 0


def test_cluster_prefix_without_hash_tag_and_url_checks() -> None:
    with pytest.raises(ValueError):
        RedisTier("redis+cluster://127.0.0.1:7000", key_prefix="radixd:{ns}:")
    with pytest.raises(ValueError):
        RedisTier("http://127.0.0.1:6379", key_prefix="p:")
    t = RedisTier("rediss://user:secret@127.0.0.1:6390/2", key_prefix="p:")
    kw = t._client.connection_pool.connection_kwargs
    assert kw["username"] == "user" and kw["password"] == "secret" and kw["db"] == 2
    assert kw["socket_timeout"] == t.op_timeout and kw["retry"].get_retries() == 1
    assert t._client.connection_pool.connection_class.__name__ == "SSLConnection"


# -- Redis down, slow, and back --------------------------------------------------------------


@pytest.mark.asyncio
async def test_redis_down_breaker_opens_and_recovers(own_server) -> None:
    url = f"redis://127.0.0.1:{own_server.port}/0"
    tier = RedisTier(url, key_prefix=_prefix(), op_timeout=OP_TIMEOUT, connect_timeout=OP_TIMEOUT,
                     breaker_threshold=3, breaker_open_seconds=0.5)
    hs = _hashes(6, b"down")
    values = [_page(h) for h in hs]
    try:
        assert await tier.set_pages(values) == 6
        assert await tier.exists_prefix(hs) == 6

        own_server.kill()
        # closed -> failures: every call is a miss within the timeout bound, never an exception
        for _ in range(3):
            t0 = time.monotonic()
            assert await tier.exists_prefix(hs) == 0
            assert time.monotonic() - t0 < OP_TIMEOUT + 0.5
        assert tier.stats["breaker_state"] == OPEN and tier.stats["breaker_opens"] == 1
        # open: answered at once, without touching the network
        t0 = time.monotonic()
        assert await tier.get_pages(hs, "full", FP) == [None] * 6
        assert await tier.set_pages(values) == 0
        assert await tier.delete(hs) == 0
        # three calls well inside one operation timeout: none of them waited for the network
        assert time.monotonic() - t0 < OP_TIMEOUT
        s = tier.stats
        assert s["breaker_rejects"] >= 3 and s["set_failures"] == 6 and s["misses"] == 6

        # half-open probe while still down: fails and re-opens
        await asyncio.sleep(0.55)
        assert await tier.exists_prefix(hs) == 0
        assert tier.stats["breaker_state"] == OPEN and tier.stats["breaker_opens"] == 2

        own_server.start()  # same port, empty (no persistence)
        await asyncio.sleep(0.55)
        assert await tier.set_pages(values) == 6  # the probe: succeeds and closes
        assert tier.stats["breaker_state"] == CLOSED
        assert list(tier.breaker.history)[-3:] == [OPEN, HALF_OPEN, CLOSED]
        got = await tier.get_pages(hs, "full", FP)
        assert [bytes(p.payload) for p in got] == [v[-len(p.payload):] for p, v in
                                                   zip(got, values, strict=True)]
        assert tier.stats["timeouts"] + tier.stats["errors"] >= 4
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_slow_redis_is_a_miss_within_timeout(own_server) -> None:
    url = f"redis://127.0.0.1:{own_server.port}/0"
    tier = RedisTier(url, key_prefix=_prefix(), op_timeout=OP_TIMEOUT, breaker_threshold=5,
                     breaker_open_seconds=0.5)
    hs = _hashes(4, b"slow")
    try:
        assert await tier.set_pages([_page(h) for h in hs]) == 4
        blocker = redis_sync.Redis(port=own_server.port, socket_timeout=5)
        sleeper = asyncio.get_running_loop().run_in_executor(
            None, lambda: blocker.execute_command("DEBUG", "SLEEP", "2.0"))
        # wait until the server is inside DEBUG SLEEP (it stops answering)
        # (no retries: redis-py's default would retry the timed-out PING through the sleep)
        probe = redis_sync.Redis(port=own_server.port, socket_timeout=0.05,
                                 retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            try:
                probe.ping()
                await asyncio.sleep(0.01)
            except redis_sync.TimeoutError:
                break
        probe.close()
        for call in (tier.exists_prefix(hs), tier.get_pages(hs, "full", FP),
                     tier.set_pages([_page(hs[0])])):
            t0 = time.monotonic()
            result = await call
            assert time.monotonic() - t0 < OP_TIMEOUT + 0.2
            assert result in (0, [None] * 4)
        assert tier.stats["timeouts"] >= 3 and tier.stats["breaker_state"] == CLOSED
        await sleeper
        blocker.close()
        # the server is responsive again; the timed-out connections did not poison the pool
        got = await tier.get_pages(hs, "full", FP)
        assert all(p is not None for p in got)
        assert await tier.exists_prefix(hs) == 4
    finally:
        await tier.aclose()


# -- Redis Cluster ---------------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path) -> Iterator[tuple[list[Server], list[int]]]:
    """A real three-node Redis Cluster (servers, ports); every node is killed at the end, a
    stopped one (SIGSTOP) too."""
    servers, ports = start_cluster(tmp_path)
    try:
        yield servers, ports
    finally:
        for srv in servers:
            if srv.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(srv.proc.pid, signal.SIGCONT)
            srv.kill()


def _keys_on(ports: list[int], prefix: str) -> set[str]:
    """The keys under ``prefix`` that these nodes hold."""
    return {k.decode() for p in ports
            for k in redis_sync.Redis(port=p).scan_iter(match=prefix + "*")}


@pytest.mark.asyncio
async def test_cluster_round_trip(cluster) -> None:
    servers, ports = cluster
    tier = RedisTier(f"redis+cluster://127.0.0.1:{ports[0]}", key_prefix=_prefix(),
                     op_timeout=2.0, connect_timeout=2.0, ttl_seconds=60, max_pipeline=16)
    try:
        assert tier.cluster
        hs = _hashes(48, b"cluster")
        values = [_page(h, size=2048) for h in hs] + [_page(h, "swa", 512) for h in hs[-8:]]
        assert await tier.set_pages(values) == 56
        assert await tier.exists_prefix(hs) == 48
        assert await tier.exists_prefix(hs[-8:], "swa") == 8
        got = await tier.get_pages(hs, "full", FP)
        assert [bytes(p.payload) for p in got] == [v[-2048:] for v in values[:48]]
        # the pages spread over the three nodes
        per_node = [redis_sync.Redis(port=p).dbsize() for p in ports]
        assert all(n > 0 for n in per_node) and sum(per_node) == 56
        assert await tier.delete(hs[:10]) == 10
        assert await tier.exists_prefix(hs) == 0
        assert tier.stats["errors"] == tier.stats["timeouts"] == 0
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_a_cluster_with_fewer_connections_than_pipelines_serves_them_all(cluster) -> None:
    """With max_connections below the pipelines a call runs at once (4), a node's pool refused
    the extra connections and redis-py then closed the client: concurrent reads of a healthy
    cluster all failed and the breaker opened. They wait for a connection instead."""
    servers, ports = cluster
    tier = RedisTier(f"redis+cluster://127.0.0.1:{ports[0]}", key_prefix=_prefix(),
                     op_timeout=2.0, connect_timeout=2.0, max_pipeline=2,
                     max_connections=1)
    try:
        hs = _hashes(32, b"fewconn")
        assert await tier.set_pages([_page(h, size=256) for h in hs]) == 32
        got = await asyncio.gather(*(tier.get_pages(hs, "full", FP) for _ in range(6)))
        assert all(p is not None for pages in got for p in pages)
        assert tier.stats["errors"] == tier.stats["timeouts"] == 0
        assert tier.stats["breaker_state"] == CLOSED
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_a_cluster_write_that_failed_on_one_node_says_what_the_others_may_hold(
        cluster) -> None:
    """One node of three is down. A pipeline spans the nodes; the live ones store their part,
    but the pipeline fails as a whole: every value was reported not stored, so a namespace's
    L3 quota never counted those Redis holds (found over a shard outage: 2.9x the quota,
    for good). A value reported not stored (False) is never in Redis; those of a failed
    pipeline are reported as maybe (None)."""
    servers, ports = cluster
    prefix = _prefix()
    tier = RedisTier(f"redis+cluster://127.0.0.1:{ports[0]}", key_prefix=prefix,
                     op_timeout=2.0, connect_timeout=0.5, breaker_threshold=100)
    try:
        assert await tier.set_pages([_page(h, size=64) for h in _hashes(1, b"warm")]) == 1
        servers[2].kill()
        hs = _hashes(30, b"partial")
        got = await tier.set_pages_each([_page(h, size=256) for h in hs])
        keys = _keys_on(ports[:2], prefix)
        held = [tier.key(h) in keys for h in hs]
        assert any(held) and not all(held)  # the live nodes took their part
        assert all(status is not False for status, h in zip(got, held, strict=True) if h)
        # the dead node's keys are never reported stored: not sent (False) when its
        # connection had to be dialled again, maybe (None) when the one kept from the warm-up
        # failed on the write, which cannot tell how much went out
        dead = f"127.0.0.1:{ports[2]}"
        on_dead = [tier._client.get_node_from_key(tier.key(h)).name == dead for h in hs]
        assert any(on_dead) and all(
            status is not True for status, d in zip(got, on_dead, strict=True) if d)
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_a_cluster_node_that_dies_mid_write_leaves_what_the_others_stored_reported(
        cluster) -> None:
    """The third node stops, then dies while a pipeline that spans the nodes waits for it.
    redis-py answers its keys with connection errors and the others' with OK; the write was
    reported all not stored, though Redis held the others' values (a review found it)."""
    servers, ports = cluster
    prefix = _prefix()
    tier = RedisTier(f"redis+cluster://127.0.0.1:{ports[0]}", key_prefix=prefix,
                     op_timeout=3.0, connect_timeout=0.5, breaker_threshold=100)
    try:
        assert await tier.set_pages([_page(h, size=64) for h in _hashes(30, b"w")]) == 30
        assert servers[2].proc is not None
        os.kill(servers[2].proc.pid, signal.SIGSTOP)

        async def kill_later() -> None:
            await asyncio.sleep(0.5)
            os.kill(servers[2].proc.pid, signal.SIGKILL)  # type: ignore[union-attr]

        killer = asyncio.create_task(kill_later())
        hs = _hashes(30, b"mid")
        got = await tier.set_pages_each([_page(h, size=256) for h in hs])
        await killer
        keys = _keys_on(ports[:2], prefix)
        held = [tier.key(h) in keys for h in hs]
        assert any(held)
        assert all(status is not False for status, h in zip(got, held, strict=True) if h)
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_a_write_to_a_redis_that_is_not_there_is_reported_not_stored() -> None:
    """Nothing listens: the connection was never made, so nothing is stored (False), not
    maybe (None): every write batch the breaker let through while Redis was down was charged
    to the namespace's L3 quota in full, pushing real values out (a review found it)."""
    tier = RedisTier(f"redis://127.0.0.1:{free_port()}/0", key_prefix=_prefix(),
                     op_timeout=OP_TIMEOUT, connect_timeout=OP_TIMEOUT)
    try:
        got = await tier.set_pages_each([_page(h, size=64) for h in _hashes(5, b"nobody")])
        assert got == [False] * 5
    finally:
        await tier.aclose()


def test_environment_has_redis_cli() -> None:
    assert shutil.which("redis-cli") is not None, os.environ.get("PATH")


def test_breaker_state_machine_single_probe() -> None:
    now = [0.0]
    b = CircuitBreaker(threshold=2, open_seconds=1.0, clock=lambda: now[0])
    b.record(b.admit(), ok=False)
    b.record(b.admit(), ok=True)  # success resets the consecutive count
    b.record(b.admit(), ok=False)
    assert b.state == CLOSED
    b.record(b.admit(), ok=False)
    assert b.state == OPEN and b.opens == 1 and b.admit() is None
    now[0] = 1.0
    assert b.admit() == "probe" and b.state == HALF_OPEN
    assert b.admit() is None  # only one probe at a time
    b.abandon("probe")  # the probe was cancelled: another call may probe
    t = b.admit()
    assert t == "probe"
    b.record(t, ok=False)
    assert b.state == OPEN and b.opens == 2
    now[0] = 2.5
    t = b.admit()
    b.record("call", ok=False)  # a straggler admitted earlier does not change half-open
    b.record(t, ok=True)
    assert b.state == CLOSED and b.failures == 0
    assert list(b.history) == [CLOSED, OPEN, HALF_OPEN, OPEN, HALF_OPEN, CLOSED]


@pytest.mark.asyncio
async def test_set_pages_each_says_which_values_redis_stored(tmp_path) -> None:
    """Part of a pipeline refused (an ACL that lets half the keys be written): the flags name
    exactly the values Redis holds, across pipelines, so that writers charge those alone."""
    srv = Server(free_port(), tmp_path)
    srv.start()
    raw = redis_sync.Redis(port=srv.port)
    try:
        raw.execute_command("ACL", "SETUSER", "half", "on", ">pw", "+@all", "%R~*",
                            "%W~p:[0-7]*")
        tier = RedisTier(f"redis://half:pw@127.0.0.1:{srv.port}/0", key_prefix="p:",
                         ttl_seconds=0, op_timeout=2.0, max_pipeline=8, breaker_threshold=1000)
        try:
            hs = _hashes(30, b"each")
            got = await tier.set_pages_each([_page(h) for h in hs])
            held = [bool(raw.exists(tier.key(h, "full"))) for h in hs]
            assert got == held and 0 < sum(got) < 30
            assert tier.stats["set_failures"] == 30 - sum(got)
            assert await tier.set_pages_each([]) == []
        finally:
            await tier.aclose()
    finally:
        raw.close()
        srv.kill()
