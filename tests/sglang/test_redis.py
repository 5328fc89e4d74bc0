"""The backend over radixd's Redis tier (L3): pages the host tier evicted come back from Redis
byte-exact; a corrupted value is never served; Redis down is a miss, never an exception."""

from __future__ import annotations

import socket
import time
import uuid

import redis
import torch
from conftest import MODEL
from test_backend import backend, fill, pages_of

REDIS = "redis://127.0.0.1:6379/0"
# 7 usable host slots: a second batch of 7 pages evicts the first from host
SMALL_HOST = {**MODEL, "host_pages": 8}


def _daemon(make_daemon, url: str, prefix: str):
    return make_daemon({"models": [SMALL_HOST],
                        "l3": {"url": url, "key_prefix": prefix,
                               "write_policy": "write_through", "op_timeout_ms": 200}})


def _wait_for_values(r: redis.Redis, prefix: str, n: int) -> list[bytes]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
        if len(keys) >= n:
            return keys
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} values reached Redis under {prefix}")


def test_evicted_pages_come_back_from_redis_and_corrupted_ones_never(make_daemon) -> None:
    prefix = f"radixd-sglang-test-{uuid.uuid4().hex}"
    r = redis.Redis.from_url(REDIS)
    try:
        d = _daemon(make_daemon, REDIS, prefix)
        b, pool = backend(d, pages=64)
        idx_a, keys_a = fill(pool, 6, 11)
        assert b.batch_set_v1(keys_a, idx_a) == [True] * 6
        _wait_for_values(r, prefix, 6)  # written through
        idx_b, keys_b = fill(pool, 7, 12)
        assert b.batch_set_v1(keys_b, idx_b) == [True] * 7  # A leaves host
        # B's host slots can make room for A only once their write-through has landed
        _wait_for_values(r, prefix, 6 + 7)
        assert b.batch_exists(keys_a) == 6  # found in Redis, fetched into host
        dst = pool.alloc(6 * pool.page_size)
        assert b.batch_get_v1(keys_a, dst) == [True] * 6
        for got, want in zip(pages_of(pool, dst), pages_of(pool, idx_a), strict=True):
            assert torch.equal(got, want)

        idx_c, keys_c = fill(pool, 7, 13)
        assert b.batch_set_v1(keys_c, idx_c) == [True] * 7  # A (and B) leave host again
        for key in _wait_for_values(r, prefix, 6 + 7 + 7):
            value = r.get(key)
            assert value is not None
            r.set(key, value[:-1] + bytes([value[-1] ^ 0xFF]))  # one payload byte flipped
        assert b.batch_exists(keys_a) == 0
        dst2 = pool.alloc(6 * pool.page_size)
        before = torch.stack(pages_of(pool, dst2))
        assert b.batch_get_v1(keys_a, dst2) == [False] * 6
        assert torch.equal(torch.stack(pages_of(pool, dst2)), before)  # nothing written
        assert b.batch_exists(keys_c) == 7  # host pages are not affected
        b.close()
    finally:
        for key in r.scan_iter(match=f"{prefix}:*", count=1000):
            r.delete(key)
        r.close()


def test_redis_down_is_a_miss_and_host_keeps_serving(make_daemon) -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = _daemon(make_daemon, f"redis://127.0.0.1:{port}/0", "radixd-sglang-down")
    b, pool = backend(d, pages=64)
    idx_a, keys_a = fill(pool, 6, 21)
    assert b.batch_set_v1(keys_a, idx_a) == [True] * 6
    idx_b, keys_b = fill(pool, 7, 22)
    # A's slots stay held while their write-through is owed; once Redis has failed those writes
    # (dropped, logged) they can be evicted and B fits
    deadline = time.monotonic() + 20
    while (stored := b.batch_set_v1(keys_b, idx_b)) != [True] * 7:
        assert time.monotonic() < deadline, stored
        time.sleep(0.1)
    assert b.batch_exists(keys_a) == 0  # not on host, and Redis cannot be asked
    dst = pool.alloc(6 * pool.page_size)
    assert b.batch_get_v1(keys_a, dst) == [False] * 6
    assert b.batch_exists(keys_b) == 7
    dst_b = pool.alloc(7 * pool.page_size)
    assert b.batch_get_v1(keys_b, dst_b) == [True] * 7
    for got, want in zip(pages_of(pool, dst_b), pages_of(pool, idx_b), strict=True):
        assert torch.equal(got, want)
    # host is cleared, but Redis did not record the clear: SGLang is told to clear again later
    assert b.clear() is False and b.batch_exists(keys_b) == 0
    b.close()
