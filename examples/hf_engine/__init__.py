"""A real model engine on radixd: a tiny hybrid (sliding-window + full attention) Qwen2 from
HF transformers, whose KV lives in the daemon's pools and whose prefixes come from its tree.

Modules: :mod:`.model` (config, weights, reference generation), :mod:`.daemon_config` (the
daemon's ``[[models]]`` entry for the model), :mod:`.paged_attention` (attention over paged KV),
:mod:`.paged_model` (the forward pass with pooled KV), :mod:`.request` (per-request state),
:mod:`.engine` (the round-robin loop; the daemon protocol per request is
``radixd_client.lifecycle.RequestLifecycle``), :mod:`.check` (comparison with plain
transformers). ``python -m examples.hf_engine --help`` runs it.
"""

from .check import Comparison, assert_matches_reference, compare
from .daemon_config import check_model_info, daemon_model_config, to_toml
from .engine import Engine
from .model import Generation, LayerSlot, build_model, layer_slots, reference_generate, tiny_config
from .paged_attention import MissingKV, paged_attention, visible
from .paged_model import PagedModel
from .request import Phase, Request

__all__ = [
    "Comparison", "Engine", "Generation", "LayerSlot", "MissingKV", "PagedModel", "Phase",
    "Request", "assert_matches_reference", "build_model", "check_model_info", "compare",
    "daemon_model_config", "layer_slots", "paged_attention", "reference_generate", "tiny_config",
    "to_toml", "visible",
]
