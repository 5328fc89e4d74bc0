"""The paged forward pass against transformers, without a daemon (pools are plain tensors).

These pin down the semantics the engine must reproduce: HF's sliding window (a query at i sees
``(i - W, i]``), grouped KV heads, RoPE positions across chunks, and that the comparison is
sensitive enough to catch a window that is off by one.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from radixd_client.pools import AttachedPools
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

from examples.hf_engine import (
    LayerSlot,
    MissingKV,
    PagedModel,
    check_model_info,
    daemon_model_config,
    layer_slots,
    paged_attention,
    tiny_config,
    visible,
)
from examples.hf_engine.paged_attention import write_kv

P = 4  # page size
H, D = 2, 16  # KV heads, head dim


def hf_mask(window: int | None, length: int) -> torch.Tensor:
    """The additive eager mask transformers builds for a sequence of ``length`` (1, 1, T, T)."""
    config = tiny_config(sliding_window=window or 8)
    embeds = torch.zeros(1, length, 64)
    positions = torch.arange(length)[None]
    make = create_sliding_window_causal_mask if window is not None else create_causal_mask
    return make(config, embeds, None, None, positions)


def scattered_table(n_pages: int, capacity: int, seed: int) -> torch.Tensor:
    """Distinct, shuffled, non-zero page ids: pages of one sequence are not adjacent."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(capacity - 1, generator=g)[:n_pages] + 1).to(torch.long)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_visible_is_hf_sliding_window_mask(window: int) -> None:
    n = 24
    hf_visible = hf_mask(window, n)[0, 0] == 0
    ours = visible(torch.arange(n), torch.arange(n), window)
    assert torch.equal(ours, hf_visible)
    # A query at i sees itself and the W - 1 tokens before it: min(i + 1, W) keys.
    assert ours.sum(-1).tolist() == [min(i + 1, window) for i in range(n)]
    assert torch.equal(visible(torch.arange(n), torch.arange(n), None), hf_mask(None, n)[0, 0] == 0)


def test_model_really_uses_the_window(hf_model: Any) -> None:
    """The eager attention weights of the HF model itself: sliding layers see W keys, full
    layers all; so comparing with the model is a test of the window, not of full attention."""
    n, w = 20, hf_model.config.sliding_window
    with torch.no_grad():
        out = hf_model(torch.arange(n)[None] % 256, use_cache=False, output_attentions=True)
    for kind, weights in zip(hf_model.config.layer_types, out.attentions, strict=True):
        seen = (weights[0] > 0).sum(-1)  # [heads, T]
        want = [min(i + 1, w) if kind == "sliding_attention" else i + 1 for i in range(n)]
        for head in seen:
            assert head.tolist() == want, kind


@pytest.mark.parametrize("window", [None, 3, 8])
@pytest.mark.parametrize("q_start", [0, 5, 13, 22])
def test_paged_attention_equals_hf_eager(window: int | None, q_start: int) -> None:
    n, heads, scaling = 23, 4, D ** -0.5
    g = torch.Generator().manual_seed(7)
    q = torch.randn(n, heads, D, generator=g)
    k = torch.randn(n, H, D, generator=g)
    v = torch.randn(n, H, D, generator=g)
    capacity = 16
    pool = torch.randn(2, capacity, P, H, D, generator=g) * 100  # garbage where unused
    pool[:, 0] = 0
    table = scattered_table(-(-n // P), capacity, seed=3)
    write_kv(pool, table, torch.arange(n), k, v)

    module = SimpleNamespace(num_key_value_groups=heads // H, training=False)
    want, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], hf_mask(window, n), scaling)
    got = paged_attention(q[q_start:], torch.arange(q_start, n), pool, table, window=window,
                          scaling=scaling)
    torch.testing.assert_close(got, want[0, q_start:], atol=1e-5, rtol=1e-5)


def test_sliding_layer_never_reads_out_of_window_pages() -> None:
    """Pages before the window may be 0 (freed); a full layer reading them raises."""
    n, w = 21, 8
    g = torch.Generator().manual_seed(1)
    pool = torch.zeros(2, 16, P, H, D)
    table = scattered_table(-(-n // P), 16, seed=2)
    write_kv(pool, table, torch.arange(n), torch.randn(n, H, D, generator=g),
             torch.randn(n, H, D, generator=g))
    # The query at 20 sees (12, 20]: pages 3..5. Pages 0..2 ([0, 12)) are not needed.
    table[:3] = 0
    q = torch.randn(1, 4, D, generator=g)
    paged_attention(q, torch.tensor([20]), pool, table, window=w, scaling=0.25)
    with pytest.raises(MissingKV):
        paged_attention(q, torch.tensor([20]), pool, table, window=None, scaling=0.25)
    table[3] = 0  # [12, 16) is inside the window
    with pytest.raises(MissingKV):
        paged_attention(q, torch.tensor([20]), pool, table, window=w, scaling=0.25)


def local_pools(hf_model: Any, capacity: int = 64) -> AttachedPools:
    """Pools shaped as the daemon's, in this process (page 0 zero, the rest garbage)."""
    slots = layer_slots(hf_model.config)
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for pool in ("full", "swa"):
        layers = sum(s.pool == pool for s in slots)
        t = torch.randn(layers, 2, capacity, P, H, D, generator=g) * 50
        t[:, :, 0] = 0
        tensors[pool] = t
    return AttachedPools("local", tensors, {})


def run_chunks(runner: PagedModel, tokens: list[int], chunk: int) -> dict[int, torch.Tensor]:
    """Prefill ``tokens`` in chunks over scattered pages; logits of each chunk's last position."""
    pages = -(-len(tokens) // P)
    full = scattered_table(pages, 64, seed=11).tolist()
    swa = scattered_table(pages, 64, seed=12).tolist()
    out = {}
    for start in range(0, len(tokens), chunk):
        end = min(len(tokens), start + chunk)
        out[end - 1] = runner.forward(tokens, start, end, full, swa)
    return out


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_paged_model_matches_transformers(hf_model: Any, chunk: int) -> None:
    tokens = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = hf_model(torch.tensor([tokens]), use_cache=False).logits[0]
    runner = PagedModel(hf_model, local_pools(hf_model))
    for pos, logits in run_chunks(runner, tokens, chunk).items():
        torch.testing.assert_close(logits, want[pos], atol=1e-4, rtol=0)


@pytest.mark.parametrize("delta", [-1, 1])
def test_window_off_by_one_is_caught(hf_model: Any, delta: int) -> None:
    """Seeing one key more or less than HF in sliding layers changes the logits well past the
    tolerance: the comparison the engine tests rely on can tell the window apart."""
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        want = hf_model(torch.tensor([tokens]), use_cache=False).logits[0]
    runner = PagedModel(hf_model, local_pools(hf_model))
    runner.window = hf_model.config.sliding_window + delta
    got = run_chunks(runner, tokens, 7)
    worst = max(float((logits - want[pos]).abs().max()) for pos, logits in got.items())
    assert worst > 1e-3


def test_layer_slots_and_daemon_profile(hf_config: Any) -> None:
    assert layer_slots(hf_config) == [LayerSlot("swa", 0), LayerSlot("full", 0),
                                      LayerSlot("swa", 1), LayerSlot("full", 1)]
    entry = daemon_model_config(hf_config, name="x", page_size=4, host_pages=8)
    assert entry == {"name": "x", "page_size": 4, "sliding_window": 8, "num_full_layers": 2,
                     "num_swa_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32",
                     "device": "cpu", "full_pages": 512, "swa_pages": 256, "host_pages": 8}


def test_check_model_info_names_every_difference(hf_config: Any) -> None:
    from radixd_client.protocol import ModelInfo

    good = ModelInfo(name="m", page_size=4, sliding_window=8, num_full_layers=2,
                     num_swa_layers=2, num_kv_heads=2, head_dim=16, dtype="float32",
                     device="cpu", full_pages=64, swa_pages=32)
    check_model_info(good, hf_config)
    bad = ModelInfo(name="m", page_size=4, sliding_window=16, num_full_layers=1,
                    num_swa_layers=2, num_kv_heads=2, head_dim=16, dtype="float16",
                    device="cpu", full_pages=64, swa_pages=32)
    with pytest.raises(ValueError, match="sliding_window.*num_full_layers.*dtype"):
        check_model_info(bad, hf_config)
