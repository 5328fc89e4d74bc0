"""A background device-to-host copy that fails (planted: tests/daemon/fault_launcher.py's
``FAULT_COPY=fail``, a device error after a delay) while requests wait for it: each failure is
counted once, the nodes it copied get no host copy, and the cache stays consistent. The daemons
are stopped here, not by the fixture, whose teardown refuses a traceback in the log (the copy's
failure is logged with one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from radixd_client import Client

from .conftest import SMALL_MODEL, Daemon
from .test_checker_daemon import LAUNCHER
from .test_tiers import admin_stats, seq, wait_for

MODEL = {**SMALL_MODEL, "num_full_layers": 4, "num_kv_heads": 2, "full_pages": 256,
         "swa_pages": 128, "host_pages": 256, "host_swa_pages": 32}
N = 64  # full pages of 16 KiB: a job too large to copy inline, it runs on the copy thread


@pytest.fixture
def failing(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path, {"models": [MODEL]}, launcher=LAUNCHER,
               env={"FAULT_COPY": "fail", "FAULT_COPY_DELAY_S": "3"})
    try:
        yield d
    finally:
        if d.proc.poll() is None:
            d.check()
        assert d.stop() == 0, d.log()[-3000:]
        assert d.log().count("device-to-host copy failed") == 1


def _tiers(d: Any) -> dict[str, int]:
    return admin_stats(d)["models"]["m"]["tiers"]  # type: ignore[no-any-return]


def _cache_while_copying(c: Client, d: Any) -> list[int]:
    tokens = seq(N)
    got = c.alloc("m", N)
    c.insert("m", tokens, got.full_pages, got.swa_pages)  # write_through: the copy starts
    wait_for(lambda: _tiers(d)["backup_queue"] == 0, "the copy to start")
    return tokens


def _counted(d: Daemon, **want: int) -> dict[str, int]:
    """The tier counters once the failed job is finished (counted when its task resumes)."""
    def done() -> dict[str, int] | None:
        t = _tiers(d)
        return t if all(t[k] == v for k, v in want.items()) else None
    return wait_for(done, f"the counters {want}")  # type: ignore[no-any-return]


def test_an_eviction_that_waits_for_a_failed_copy_counts_it_once(failing: Daemon) -> None:
    d = failing
    with Client(d.socket) as c:
        tokens = _cache_while_copying(c, d)
        assert c.evict("m", full_pages=N).full_pages == N  # waits for the copy, which fails
        t = _counted(d, evictions_waited=1, copy_errors=1)
        assert t["backup_pages"] == 0
        m = c.match("m", tokens)
        assert (m.prefix_len, m.host_hit_len) == (0, 0)  # deleted: no host copy to demote to


def test_a_free_that_waits_for_a_failed_copy_counts_it_once(failing: Daemon) -> None:
    d = failing
    with Client(d.socket) as c:
        tokens = _cache_while_copying(c, d)
        m = c.match("m", tokens, lock=True)
        c.release_swa("m", m.receipt)
        assert c.evict("m", swa_pages=N).swa_pages > 0  # a tombstone: its window freed
        t = _counted(d, frees_waited=1, copy_errors=1)
        assert t["backup_pages"] == 0
        c.unlock("m", m.receipt)
        assert c.match("m", tokens).host_hit_len == 0
