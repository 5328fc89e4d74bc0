"""bench/daemon_cpu_bench.py --batch K against a real daemon: a scheduler step of K requests is
three batch frames of K items that do what K mixed requests do, and leave nothing held."""

from __future__ import annotations

import random
from array import array

from radixd_client import Client

from bench import daemon_cpu_bench as dcb
from bench import rpc_bench

from .conftest import SMALL_MODEL

BENCH_MODEL = {**SMALL_MODEL, "name": dcb.MODEL, "page_size": dcb.PAGE, "sliding_window": 128,
               "full_pages": 256, "swa_pages": 128}


def test_a_scheduler_step_caches_its_requests_then_hits_them_and_holds_nothing(
        make_daemon) -> None:
    d = make_daemon({"models": [BENCH_MODEL]})
    rng = random.Random(3)
    with Client(d.socket) as c:
        def stats() -> dict[str, int]:
            return c.stats(dcb.MODEL).models[dcb.MODEL]

        prefixes = rpc_bench._prefixes(rng, dcb.PREFIX_TOKENS, n=2)
        for p in prefixes:
            rpc_bench._cache_prompt(c, array("i", p).tobytes(), dcb.PAGE)
        step = rpc_bench._requests(rng, prefixes, n=5)
        before = stats()["tree_full_pages"]
        assert dcb._step_ops(c, step, dcb.PAGE) == 15
        after = stats()["tree_full_pages"]
        assert after - before == 5 * dcb.FRESH_TOKENS // dcb.PAGE  # each one's fresh pages
        assert dcb._step_ops(c, step, dcb.PAGE) == 15  # all full hits: nothing more
        assert stats()["tree_full_pages"] == after
        assert [c.match(dcb.MODEL, t).prefix_len for t in step] == [len(t) // 4 for t in step]
        assert (stats()["held_full_pages"], stats()["held_swa_pages"]) == (0, 0)
