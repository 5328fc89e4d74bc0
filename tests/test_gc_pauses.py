"""daemon.metrics.GcPauses: each collection of the cyclic collector recorded by generation while
installed, installed once however often asked, nothing after removal; a collection at or over
``warn_s`` logged, at most one line a minute, those held back counted at removal."""

from __future__ import annotations

import gc
import logging
import re

import pytest

from daemon.metrics import GENERATIONS, GcPauses


def test_collections_are_recorded_by_generation_and_a_long_one_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    p = GcPauses(warn_s=0.0)  # every collection is "long"
    caplog.set_level(logging.WARNING, logger="radixd.gc")
    p.install()
    p.install()
    try:
        assert gc.callbacks.count(p) == 1
        gc.collect(0)
        gc.collect(2)
    finally:
        p.remove()
    assert p not in gc.callbacks
    assert p.pauses[0].n >= 1 and p.pauses[2].n >= 1
    for g in GENERATIONS:
        h = p.pauses[g]
        assert sum(h.counts) == h.n
        assert (h.n == 0) == (p.longest[g] == 0.0)
        assert p.longest[g] <= h.total
    lines = [r.getMessage() for r in caplog.records if r.name == "radixd.gc"]
    # the second within the minute is held back, and counted when the watch is removed
    assert len(lines) == 2, lines
    assert re.fullmatch(r"the garbage collector \(generation [012]\) stopped the daemon for \d+ ms",
                        lines[0]), lines[0]
    assert re.fullmatch(r"[1-9]\d* collections of the garbage collector of 0 ms or longer not "
                        r"logged before the stop", lines[1]), lines[1]
    seen = {g: p.pauses[g].n for g in GENERATIONS}
    gc.collect()
    assert {g: p.pauses[g].n for g in GENERATIONS} == seen  # removed: nothing recorded
    p.remove()  # twice: no error


def test_a_short_collection_is_recorded_but_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    p = GcPauses(warn_s=3600.0)
    caplog.set_level(logging.WARNING, logger="radixd.gc")
    p.install()
    try:
        gc.collect(1)
    finally:
        p.remove()
    assert p.pauses[1].n >= 1
    assert not [r for r in caplog.records if r.name == "radixd.gc"]


def test_installed_for_a_block_even_one_that_raises() -> None:
    p = GcPauses()
    with pytest.raises(KeyError), p.installed() as watch:
        assert watch is p and p in gc.callbacks
        raise KeyError("the server's life ended badly")
    assert p not in gc.callbacks
