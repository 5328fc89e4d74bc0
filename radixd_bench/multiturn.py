"""The multi-turn chat workload against a running radixd, over its socket: the public API of
``radixd bench multiturn``.

Why this exists: ``bench/multiturn.py`` replays SGLang's ``bench_multiturn`` shape (section 9 of
the SGLang reference) against the cache core in process. That cannot see what only the daemon
does (the host tier, Redis, the socket, several sessions at once), so this replays the same
shape against a real daemon the way engines drive it, and measures what an operator wants to
know before sizing the tiers: the hit rate per round split by where the hit came from, a
time-to-first-token proxy, and the peak device pool usage.

Where things are: :mod:`.options` (what a run is made of; defaults from :mod:`.workload`),
:mod:`.engines` (the synthetic and HF engines, both on
:class:`radixd_client.lifecycle.RequestLifecycle`), :mod:`.runner` (client processes, the
sender, the pool sampler), :mod:`.report` (figures, text, JSON, PNG; the hit accounting is
documented there), :mod:`.cli` (the command line).

An engine (:class:`Engine`) has ``vocab_size``, ``run_request(prompt, output_len) ->
RequestOutcome`` and ``close()``.
"""

from __future__ import annotations

from .engines import Engine, HFEngine, SyntheticEngine, hf_engine_module
from .options import (
    BenchError,
    BenchUsageError,
    EngineSpec,
    Options,
    RequestOutcome,
    fitting_chunk,
    split_loaded,
)
from .report import format_report, plot_available, write_json, write_plot
from .runner import ProgressBar, run
from .workload import Workload

__all__ = [
    "BenchError", "BenchUsageError", "Engine", "EngineSpec", "HFEngine", "Options",
    "ProgressBar", "RequestOutcome", "SyntheticEngine", "Workload", "fitting_chunk",
    "format_report", "hf_engine_module", "plot_available", "run", "split_loaded", "write_json",
    "write_plot",
]
