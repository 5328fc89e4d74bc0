"""The L3 quota's deletes against a real Redis that stops answering: a value the quota gave up
must not be forgotten while Redis still holds it."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

from daemon.l3_tier import L3Tier
from daemon.model_cache import ModelCache
from daemon.storage.host_tier import HostTier
from daemon.storage.redis_tier import CLOSED, RedisTier
from tests.redis_procs import Server, free_port
from tests.test_keyed_store_model import PROFILE


def test_values_whose_quota_delete_redis_did_not_answer_stay_counted(tmp_path: Path) -> None:
    """Over the quota the oldest value is taken out of the ledger and deleted. With Redis not
    answering, the delete failed and the value stayed in Redis, counted nowhere, so the
    namespace stayed over its quota for good (found over a Redis Cluster shard outage). It
    stays counted, the oldest, and is deleted at the next charge once Redis answers."""
    port = free_port()
    srv = Server(port, tmp_path)
    srv.start()

    async def run() -> None:
        cache = ModelCache(PROFILE)
        host = HostTier(PROFILE, 4, 4, pin_memory=False)
        cache.host = host
        l3 = RedisTier(srv.url, key_prefix="q:", op_timeout=0.3, connect_timeout=0.3,
                       breaker_threshold=1, breaker_open_seconds=0.1)
        counters: Counter[str] = Counter()
        tier = L3Tier(cache, host, "tiny", l3, {}, {"a": 100}, counters, set())  # type: ignore
        try:
            assert await tier.charge([("a", b"h1", "full", 60), ("a", b"h2", "full", 30)]) == 0
            assert await tier.charge([("a", b"h3", "full", 30)]) == 1  # h1 deleted
            srv.kill()
            assert await tier.charge([("a", b"h4", "full", 30)]) == 0  # h2's delete failed
            assert [h for h, *_ in tier.ledger.entries()["a"]] == [b"h2", b"h3", b"h4"]
            assert tier.ledger.total("a") == 90 and counters["l3_quota_deleted_pages"] == 1
            srv.start()
            deadline = time.monotonic() + 10
            while await l3.counter("probe") is None or l3.stats["breaker_state"] != CLOSED:
                assert time.monotonic() < deadline, "Redis did not come back"
                await asyncio.sleep(0.1)
            assert await tier.charge([("a", b"h5", "full", 30)]) == 1  # h2 now
            assert [h for h, *_ in tier.ledger.entries()["a"]] == [b"h3", b"h4", b"h5"]
            assert counters["l3_quota_deleted_pages"] == 2
        finally:
            await l3.aclose()
            host.close()

    try:
        asyncio.run(run())
    finally:
        srv.kill()
