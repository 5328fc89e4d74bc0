"""What one run of the multi-turn bench is made of: its options, the per-client engine spec, the
per-request outcome, and the two errors that map to the CLI's exit codes.

The workload's defaults are :class:`~radixd_bench.workload.Workload`'s, declared once there:
:class:`Options` takes them from it, the CLI's ``--help`` shows them from :class:`Options`, and
``bench/multiturn.py`` replays the same :class:`Workload` in process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .workload import Workload

__all__ = [
    "DISTRIBUTIONS", "ENGINES", "FATAL_CODES", "OP_TIMEOUT_S", "SYNTHETIC_VOCAB", "BenchError",
    "BenchUsageError", "EngineSpec", "Options", "RequestOutcome", "fitting_chunk",
    "split_loaded",
]

_W = Workload()  # the defaults
#: Token ids of the synthetic conversations are drawn from [1, SYNTHETIC_VOCAB), as in
#: bench/multiturn.py.
SYNTHETIC_VOCAB = 50_000
ENGINES = ("synthetic", "hf")
DISTRIBUTIONS = ("poisson", "uniform")
#: Seconds one protocol call may take before the bench gives up on the daemon (a load of many
#: host pages is the slowest legitimate call).
OP_TIMEOUT_S = 120.0
#: Error codes that mean a broken engine or daemon rather than a full cache: the run stops.
FATAL_CODES = frozenset({"internal", "unknown_op", "bad_frame", "bad_receipt", "page_not_held",
                         "not_authenticated", "auth_failed", "unknown_model",
                         "model_not_allowed", "too_many_locks"})

class BenchError(RuntimeError):
    """The run could not be carried out (daemon unreachable, refused, broken): exit status 1."""


class BenchUsageError(ValueError):
    """The options are invalid (or name a model the daemon does not serve): exit status 2."""


@dataclass
class Options:
    """Everything one run needs. The workload's defaults are :class:`Workload`'s, so the
    daemon run and the in-process replay of ``bench/multiturn.py`` cannot drift apart."""

    socket: str
    token: str | None = None
    model: str | None = None  # None: the first model the tenant may use
    clients: int = _W.clients
    rounds: int = _W.rounds
    first_prompt: int = _W.first_prompt
    output: int = _W.output
    subq: int = _W.subq
    request_rate: float = math.inf  # requests per second over all clients; inf: no gaps
    distribution: str = "poisson"
    round_barrier: bool = True
    max_parallel: int = _W.max_parallel  # requests in flight at once (1: like the replay)
    prefill_chunk: int = _W.prefill_chunk
    swa_eviction_interval: int = _W.swa_eviction_interval  # decode tokens between SWA frees
    seed: int | None = None  # None: drawn at random (reported, so a run can be repeated)
    engine: str = "synthetic"
    l3: bool = False  # prefetch(wait_complete) from L3 before every match
    sample_interval_s: float = 0.01

    def validate(self) -> None:
        """Raise BenchUsageError naming the first bad option (before anything is started)."""
        ints = {"clients": 1, "rounds": 1, "first_prompt": 1, "output": 1, "subq": 0,
                "max_parallel": 1, "prefill_chunk": 1, "swa_eviction_interval": 1}
        for name, low in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise BenchUsageError(f"{name} must be an integer >= {low}, got {v!r}")
        if not self.socket:
            raise BenchUsageError("socket: the daemon's socket path is needed")
        if not isinstance(self.request_rate, (int, float)) or not self.request_rate > 0:
            raise BenchUsageError(f"request_rate must be > 0 (inf: no gaps), got "
                                  f"{self.request_rate!r}")
        if self.distribution not in DISTRIBUTIONS:
            raise BenchUsageError(f"distribution must be one of {DISTRIBUTIONS}, got "
                                  f"{self.distribution!r}")
        if self.engine not in ENGINES:
            raise BenchUsageError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if not self.sample_interval_s > 0:
            raise BenchUsageError(f"sample_interval_s must be > 0, got {self.sample_interval_s!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed,
                                                                                    int)):
            raise BenchUsageError(f"seed must be an integer, got {self.seed!r}")


@dataclass
class EngineSpec:
    """What one client process's engine is built from (picklable: it crosses the process
    boundary)."""

    socket: str
    token: str | None
    model: str
    client_index: int
    seed: int
    l3: bool
    prefill_chunk: int
    swa_eviction_interval: int


@dataclass
class RequestOutcome:
    """One request as the engine saw it; ``output`` is the generated tokens (its committed KV
    is ``prompt + output[:-1]``). ``device_hit + host_hit + l3_hit`` is the usable prefix the
    prefill started from (see the module docstring for the split)."""

    prompt_len: int
    output: list[int] = field(default_factory=list)
    device_hit: int = 0  # prefix_len of the first match
    host_hit: int = 0  # made usable by load from what L2 held before this request
    l3_hit: int = 0  # made usable by load from what prefetch brought from L3 into L2
    host_hit_len: int = 0  # as match reported it
    loaded_len: int = 0  # as load reported it
    l3_hit_len: int = 0  # as prefetch reported it
    fetched_len: int = 0  # as prefetch reported it
    prefetch_status: str = ""
    prefill_tokens: int = 0  # prompt tokens computed (not reused)
    swa_evicted_len: int = 0  # the SWA frontier passed to cache_finished
    swa_freed_tokens: int = 0  # tokens whose SWA KV this request freed early
    ttft_s: float | None = None  # request start to the first decode step
    latency_s: float = 0.0
    failed: bool = False
    error: str = ""


def split_loaded(loaded: int, host_hit_len: int, fetched_len: int) -> tuple[int, int]:
    """(host, l3) parts of the ``loaded`` tokens that ``load`` added to the usable prefix.

    They lie past the device match: first what L2 held before the request
    (``host_hit_len`` counts it together with what the prefetch fetched), then what the prefetch
    brought from L3, which fetched only tokens past L1/L2. A partial load cuts the L3 part first.
    """
    host = min(loaded, max(0, host_hit_len - fetched_len))
    return host, loaded - host


def fitting_chunk(info: Any, requested: int) -> int:
    """The prefill chunk (tokens) to use: ``requested``, or less where one chunk's ``alloc``
    would not fit the smaller pool beside the window the chunk keeps live (a real engine sizes
    its chunked prefill to its pools the same way)."""
    P = info.page_size
    W = info.sliding_window if info.swa_pages else None
    usable = info.full_pages - 1 if W is None else min(info.full_pages, info.swa_pages) - 1
    window_pages = -(-max(W, P) // P) if W is not None else 0
    return min(requested, max(1, usable - window_pages - 1) * P)
