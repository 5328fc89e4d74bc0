"""The HF engine on a real daemon: generation with cached prefixes equals plain transformers.

Every generation is compared with the same model run without any cache (a full forward over the
whole sequence per step): equal greedy tokens, every step's logits within 1e-4 (float32). The
prefixes come from each place the cache can hold them: the same engine (L1), another engine
process, host memory after the device copy was evicted (L2), Redis after a daemon restart (L3),
and a long conversation whose SWA was mostly freed. A planted wrong page must be caught.

Page size 4 and window 8 (model and daemon), so prompts of 40-90 tokens span many windows.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from radixd_client import Client, pages

from examples.hf_engine import Engine, Request, assert_matches_reference

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "hf-tiny"  # as in conftest's daemon_config
P = 4  # page size of the daemon config (conftest)
W = 8  # the model's sliding window


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def cached_end(req: Request) -> int:
    """How far a finished request is in the tree: its KV covers every token but the last
    generated one, and only whole pages are cached."""
    return req.computed_len // P * P


def check(model: Any, req: Request) -> None:
    assert_matches_reference(model, req.prompt, req.output, req.step_logits())


def model_stats(client: Client) -> dict[str, int]:
    return client.stats(MODEL_NAME).models[MODEL_NAME]


def assert_nothing_held(client: Client) -> None:
    """Every page the engine took went to the tree or back: none is left with the session."""
    stats = model_stats(client)
    assert stats["held_full_pages"] == 0 and stats["held_swa_pages"] == 0, stats


def wait_for_host_copies(client: Client, timeout: float = 10.0) -> None:
    """Wait until every device page of the tree has its host (L2) copy.

    write_through copies run off the daemon's loop after the insert has answered. An ``evict``
    that comes first drops the page whose copy is still in flight instead of demoting it (seen
    with the daemon as of this writing: the last page of a just finished request was lost from
    L2, so the next turn loaded 44 of 48 tokens); this test is about the engine, so it waits.
    """
    deadline = time.monotonic() + timeout
    while True:
        stats = model_stats(client)
        if stats.get("tree_host_pages", -1) >= stats["tree_full_pages"]:
            return
        assert time.monotonic() < deadline, f"host copies did not complete: {stats}"
        time.sleep(0.02)


def evict_device_copies(client: Client, timeout: float = 10.0) -> None:
    """Evict every device page of the model (unlocked: no request runs). Pages still being
    copied to host may be pinned for a moment, so this repeats until the tree is empty."""
    info = client.models[MODEL_NAME]
    deadline = time.monotonic() + timeout
    while True:
        client.evict(MODEL_NAME, full_pages=info.full_pages, swa_pages=info.swa_pages)
        stats = model_stats(client)
        if stats["tree_full_pages"] == 0 and stats["tree_swa_pages"] == 0:
            return
        assert time.monotonic() < deadline, f"device pages left after evict: {stats}"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------ L1

def test_second_turn_from_the_same_engine(make_daemon: Any, daemon_config: dict[str, Any],
                                          hf_model: Any) -> None:
    """Two conversations sharing a system prompt, interleaved in one engine, two turns each."""
    daemon = make_daemon(daemon_config)
    system = tokens(20, 1)
    with Engine.connect(daemon.socket, MODEL_NAME, hf_model, chunk_size=16) as engine:
        a1 = engine.submit(system + tokens(30, 2), 6)
        b1 = engine.submit(system + tokens(26, 3), 6)
        engine.run()
        # Both were admitted on a cold cache and computed the system prompt side by side; the
        # second insert of it found the first and switched to its pages.
        assert a1.prefix_len == b1.prefix_len == 0
        a2 = engine.submit(a1.tokens + tokens(10, 4), 6)
        b2 = engine.submit(b1.tokens + tokens(14, 5), 5)
        engine.run()
        assert a2.prefix_len == cached_end(a1) == 52
        assert b2.prefix_len == cached_end(b1) == 48
        c = engine.generate(system + tokens(9, 6), 4)  # a third one reuses the system prompt
        assert c.prefix_len == 20
        # A prompt that is cached entirely: its last token is run again only for its logits.
        d = engine.generate(a2.tokens[:cached_end(a2)], 4)
        assert d.prefix_len == len(d.prompt) == cached_end(a2)
        assert_nothing_held(engine.client)
    for req in (a1, b1, a2, b2, c, d):
        check(hf_model, req)


# ---------------------------------------------------------------------- another process

def test_prefix_from_another_engine_process(make_daemon: Any, daemon_config: dict[str, Any],
                                            hf_model: Any, tmp_path: Path) -> None:
    """Turn 1 runs in a separate engine process (the example's CLI); turn 2 here reuses it."""
    daemon = make_daemon(daemon_config)
    prompt = tokens(44, 10)
    prompt_file, out_file = tmp_path / "prompt.json", tmp_path / "turn1.pt"
    prompt_file.write_text(json.dumps(prompt))
    proc = subprocess.run(
        [sys.executable, "-m", "examples.hf_engine", "run", "--socket", daemon.socket,
         "--model", MODEL_NAME, "--prompt-file", str(prompt_file), "--max-new-tokens", "6",
         "--out", str(out_file)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (turn1,) = torch.load(out_file)
    assert turn1["prompt"] == prompt and turn1["prefix_len"] == 0
    assert_matches_reference(hf_model, prompt, turn1["output"], turn1["logits"])

    history = prompt + turn1["output"]
    with Engine.connect(daemon.socket, MODEL_NAME, hf_model) as engine:
        req = engine.generate(history + tokens(12, 11), 6)
        assert req.prefix_len == (len(history) - 1) // P * P == 48
        assert_nothing_held(engine.client)
    check(hf_model, req)


# ------------------------------------------------------------------------------------ L2

def test_prefix_from_host_after_device_eviction(make_daemon: Any,
                                                daemon_config: dict[str, Any],
                                                hf_model: Any) -> None:
    """Turn 1's device pages are all evicted; turn 2 gets the prefix back from host (load)."""
    daemon = make_daemon(daemon_config)
    with Engine.connect(daemon.socket, MODEL_NAME, hf_model) as engine:
        first = engine.generate(tokens(46, 20), 6)
        wait_for_host_copies(engine.client)
        evict_device_copies(engine.client)
        prompt = first.tokens + tokens(12, 21)
        assert engine.client.match(MODEL_NAME, prompt).prefix_len == 0
        second = engine.generate(prompt, 6)
        assert second.host_hit_len > 0
        assert second.loaded_len > 0
        assert second.prefix_len == cached_end(first) == 48
        assert_nothing_held(engine.client)
    check(hf_model, first)
    check(hf_model, second)


# ------------------------------------------------------------------------------------ L3

def test_prefix_from_redis_after_restart(make_daemon: Any, daemon_config: dict[str, Any],
                                         hf_model: Any, l3_section: dict[str, Any]) -> None:
    """Turn 1 on one daemon; it stops (device and host copies are gone with it); a new daemon
    with the same Redis gets the prefix through prefetch, then load."""
    config = {**daemon_config, "l3": l3_section}
    first_daemon = make_daemon(config)
    with Engine.connect(first_daemon.socket, MODEL_NAME, hf_model) as engine:
        first = engine.generate(tokens(46, 30), 6)
    first_daemon.check()
    assert first_daemon.stop() == 0

    second_daemon = make_daemon(config)
    prompt = first.tokens + tokens(12, 31)
    with Engine.connect(second_daemon.socket, MODEL_NAME, hf_model, use_l3=True) as engine:
        second = engine.generate(prompt, 6)
        assert second.fetched_len > 0, second.prefetch_status
        assert second.host_hit_len > 0
        assert second.loaded_len > 0
        assert second.prefix_len == cached_end(first) == 48
        assert_nothing_held(engine.client)
    check(hf_model, first)
    check(hf_model, second)


# ------------------------------------------------------------------ SWA freed in decode

def test_long_history_reuses_only_the_live_window(make_daemon: Any,
                                                  daemon_config: dict[str, Any],
                                                  hf_model: Any) -> None:
    """A turn that decodes past several windows frees most of its SWA on the way; the next turn
    still reuses the whole history, because the trailing window stayed live."""
    daemon = make_daemon(daemon_config)
    with Engine.connect(daemon.socket, MODEL_NAME, hf_model) as engine:
        first = engine.generate(tokens(40, 40), 48)  # KV of 87 tokens: ~11 windows
        # Decode ran from 40 to 87: the prompt's locked window was released, and the request's
        # own SWA pages [40, 76) were freed, each as soon as it was out of the window.
        assert first.swa_released
        assert first.swa_pages_freed == (76 - 40) // P
        assert cached_end(first) == 84
        stats = model_stats(engine.client)
        assert stats["tree_full_pages"] == 84 // P
        assert stats["tree_swa_pages"] == 40 // P + W // P  # the prompt, and the last window

        # Inside the freed stretch nothing is usable: a match ending at 64 falls back to 40,
        # the last end whose window [e - W, e) is live; the full KV goes on to 64.
        inside = engine.client.match(MODEL_NAME, first.tokens[:64])
        assert (inside.prefix_len, inside.full_hit_len) == (40, 64)

        second = engine.generate(first.tokens + tokens(10, 41), 8)
        assert second.prefix_len == 84
        assert_nothing_held(engine.client)
    check(hf_model, first)
    check(hf_model, second)


# ------------------------------------------------------------------------ the oracle bites

@pytest.mark.parametrize("pool", ["full", "swa"])
def test_a_planted_wrong_page_is_caught(make_daemon: Any, daemon_config: dict[str, Any],
                                        hf_model: Any, pool: str) -> None:
    """Garbage written into one cached page of the mapped pool (a full page in the middle of
    the prefix, or the last SWA page of its window) makes the comparison fail: the tests above
    would see a wrong page, so their passing means the pages were right."""
    daemon = make_daemon(daemon_config)
    with Engine.connect(daemon.socket, MODEL_NAME, hf_model) as engine:
        first = engine.generate(tokens(46, 50), 6)
        check(hf_model, first)
        prompt = first.tokens + tokens(12, 51)
        m = engine.client.match(MODEL_NAME, prompt)
        assert m.prefix_len == 48
        g = torch.Generator().manual_seed(0)
        if pool == "full":
            ids = pages(m.full_pages)
            page = ids[len(ids) // 2]
            target = engine.pools.full[:, :, page]
        else:
            page = pages(m.swa_pages)[-1]
            target = engine.pools.swa[:, :, page]
        target.copy_(torch.randn(target.shape, generator=g) * 10)
        second = engine.generate(prompt, 6)
        assert second.prefix_len == 48  # the planted page was used
    with pytest.raises(AssertionError, match="engine differs from plain transformers"):
        check(hf_model, second)


def test_the_engine_writes_only_into_pages_it_allocated(make_daemon: Any,
                                                        daemon_config: dict[str, Any],
                                                        hf_model: Any) -> None:
    """A page id the request did not get from its own alloc (here: a cached page of another
    request, as a misrouted result would hand it) is refused before anything is written, and
    the cached page keeps its bytes."""
    daemon = make_daemon(daemon_config)
    with Engine.connect(daemon.socket, MODEL_NAME, hf_model, chunk_size=8) as engine:
        first = engine.generate(tokens(40, 60), 4)
        cached = pages(engine.client.match(MODEL_NAME, first.tokens).full_pages)
        before = engine.pools.full[:, :, cached[0]].clone()
        req = engine.submit(tokens(30, 61), 4)  # a cold prompt: all its pages are its own
        engine.step()  # the first chunk: allocated, written, handed to the tree
        assert req.phase.value == "prefill" and req.cached_len == 8
        req.cache.reserve(16)
        req.full_table[2] = cached[0]  # a page id that is not this request's
        with pytest.raises(RuntimeError, match="refusing to write sequence page 2"):
            engine.step()
        assert torch.equal(engine.pools.full[:, :, cached[0]], before)
        engine.abort(req)  # its pages and lock go back
        assert_nothing_held(engine.client)
    check(hf_model, first)
