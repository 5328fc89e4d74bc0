"""radixd_client.lifecycle.RequestLifecycle against a real daemon.

Every daemon comes from tests/daemon/conftest.py's ``make_daemon`` (strict checker, a full
invariant check and a clean exit at teardown), so each test is also a check that the class's
protocol steps leave the cache consistent. The model is that of docs/protocol.md section 10:
page 4, window 8.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from radixd_client import Client, pages
from radixd_client.errors import ReceiptError
from radixd_client.lifecycle import NotWritable, RequestLifecycle

from tests.harness import daemon_conftest

make_daemon = daemon_conftest().make_daemon  # the fixture, reused

P, W = 4, 8
MODEL = {
    "name": "m", "page_size": P, "sliding_window": W, "num_full_layers": 1,
    "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "float32",
    "device": "cpu", "full_pages": 64, "swa_pages": 32, "host_pages": 0, "host_swa_pages": 0,
}


@pytest.fixture
def client(make_daemon: Any) -> Iterator[Client]:
    d = make_daemon({"models": [MODEL]})
    with Client(d.socket, client_name="lifecycle-test", timeout=30) as c:
        yield c


def stats(c: Client) -> dict[str, int]:
    return c.stats("m").models["m"]


def prefill(lc: RequestLifecycle, chunk: int) -> None:
    """What an engine does around its prefill forward passes (which write nothing here)."""
    while lc.computed_len < lc.prompt_len:
        end = min(lc.prompt_len, lc.computed_len + chunk)
        lc.reserve(end)
        lc.check_writable(lc.computed_len, end)
        lc.computed_len = end
        lc.commit(end)


def decode(lc: RequestLifecycle, new_tokens: list[int]) -> int:
    """One token per step, as a real engine; returns the most SWA pages held at once."""
    peak = 0
    for tok in new_tokens:
        lc.append(tok)
        pos = len(lc.tokens) - 1
        lc.decode_step(pos, pos + 1)
        lc.check_writable(pos, pos + 1)
        lc.computed_len = pos + 1
        peak = max(peak, stats(lc.client)["held_swa_pages"])
    return peak


def test_full_lifecycle_with_chunked_prefill_and_decode_past_the_window(client: Client
                                                                         ) -> None:
    """Section 10's request: 18 prompt tokens in chunks of 10 and 8, decode to 30 tokens of KV,
    then the next turn reuses all of it."""
    prompt = list(range(100, 118))
    lc = RequestLifecycle(client, "m", prompt)
    adm = lc.admit()
    assert adm.prefix_len == 0 and lc.receipt is not None

    lc.reserve(10)
    lc.check_writable(0, 10)
    lc.computed_len = 10
    own = list(lc.full_table)
    res = lc.commit(10)
    assert res.inserted_len == 8 == lc.cached_len
    # the aligned pages went to the tree: no longer writable; the tail page still is
    assert lc.writable_full == {own[2]}
    with pytest.raises(NotWritable):
        lc.check_writable(0, 8)
    lc.check_writable(8, 10)
    prefill(lc, 8)
    assert lc.cached_len == 16 and stats(client)["held_full_pages"] == 1

    peak = decode(lc, list(range(118, 130)))  # KV of 30 tokens afterwards (last has none)
    lc.append(130)
    assert lc.swa_released  # the locked prefix [8, 16) left the window
    assert lc.swa_pages_freed >= 1 and lc.swa_evicted_len >= 20
    assert peak <= W // P + 1  # about one window of SWA held, never the whole sequence
    res = lc.finish()
    assert res.inserted_len == 28 and lc.done
    s = stats(client)
    assert s["held_full_pages"] == s["held_swa_pages"] == 0
    assert s["tree_full_pages"] == 7

    nxt = RequestLifecycle(client, "m", list(range(100, 131)) + [7, 7, 7])
    assert nxt.admit().prefix_len == 28  # the last window stayed live
    nxt.abort()


def test_abort_mid_prefill_gives_everything_back(client: Client) -> None:
    prompt = list(range(1, 31))
    lc = RequestLifecycle(client, "m", prompt)
    lc.admit()
    lc.reserve(12)
    lc.computed_len = 12
    lc.commit(12)  # [0, 12) in the tree, locked
    lc.reserve(24)  # the next chunk's pages, held
    receipt = lc.receipt
    s = stats(client)
    assert receipt is not None and s["held_full_pages"] == 3 and s["held_swa_pages"] == 3
    lc.abort()
    s = stats(client)
    assert s["held_full_pages"] == 0 and s["held_swa_pages"] == 0
    with pytest.raises(ReceiptError):
        client.unlock("m", receipt)  # already released by the abort
    lc.abort()  # twice is harmless
    # the committed chunk stays cached and, unlocked, evictable
    assert client.match("m", prompt).prefix_len == 12
    assert client.evict("m", full_pages=64, swa_pages=32).full_pages == 3


def test_abort_after_admission_with_a_matched_prefix(client: Client) -> None:
    first = RequestLifecycle(client, "m", list(range(40)))
    first.admit()
    prefill(first, 16)
    first.append(99)
    first.finish()
    second = RequestLifecycle(client, "m", list(range(40)) + [5, 6, 7])
    assert second.admit().prefix_len == 40
    second.abort()
    assert stats(client)["held_full_pages"] == 0
    assert client.evict("m", full_pages=64, swa_pages=32).full_pages == 10  # nothing locked


def test_refuses_a_write_into_a_page_it_does_not_own(client: Client) -> None:
    first = RequestLifecycle(client, "m", list(range(20)))
    first.admit()
    prefill(first, 20)
    first.append(0)
    first.finish()
    cached = pages(client.match("m", list(range(20))).full_pages)

    lc = RequestLifecycle(client, "m", list(range(50, 70)))
    lc.admit()
    lc.reserve(8)
    lc.check_writable(0, 8)
    lc.full_table[1] = cached[0]  # a misrouted id: another request's cached page
    with pytest.raises(NotWritable, match="refusing to write sequence page 1"):
        lc.check_writable(0, 8)
    with pytest.raises(NotWritable, match="sequence page 2"):
        lc.check_writable(8, 9)  # not allocated yet
    lc.abort()  # the planted id is not the request's: abort gives back only its own
    assert stats(client)["held_full_pages"] == 0


def test_matched_prefix_is_read_only_and_duplicates_switch_to_canonical(client: Client
                                                                         ) -> None:
    """Two requests compute the same prompt at once: the second's commit gets the first's
    pages back as canonical, and its own duplicates stop being writable."""
    prompt = list(range(200, 216))
    a = RequestLifecycle(client, "m", prompt)
    b = RequestLifecycle(client, "m", prompt)
    a.admit()
    b.admit()
    prefill(a, 16)
    b.reserve(16)
    mine = list(b.full_table)
    b.computed_len = 16
    res = b.commit(16)
    assert list(pages(res.full_pages)) == a.full_table[:4] == b.full_table[:4] != mine
    assert not b.writable_full and not b.writable_swa
    with pytest.raises(NotWritable):
        b.check_writable(0, 4)
    for lc in (a, b):
        lc.append(1)
        lc.finish()
    assert stats(client)["held_full_pages"] == 0


def test_finish_frees_pages_reserved_past_the_end(client: Client) -> None:
    """A decode step allocated the next page, then the request ended before writing it:
    ``finish`` inserts what was computed and frees the rest, so the session holds nothing."""
    lc = RequestLifecycle(client, "m", list(range(300, 310)))
    lc.admit()
    prefill(lc, 16)
    lc.reserve(lc.computed_len + 3 * P)  # pages ahead of what is computed
    assert stats(client)["held_full_pages"] > 0
    res = lc.finish()
    assert res.inserted_len == 8  # the aligned part of the 10 computed tokens
    s = stats(client)
    assert (s["held_full_pages"], s["held_swa_pages"]) == (0, 0), s
    assert lc.done
