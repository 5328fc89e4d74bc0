"""The multi-turn chat workload against a running radixd, over its socket.

This is ``radixd bench multiturn``.

Why this exists: ``bench/multiturn.py`` replays SGLang's ``bench_multiturn`` shape (section 9 of
the SGLang reference) against the cache core in process. That cannot see what only the daemon does
(the host tier, Redis, the socket, several sessions at once), so this module replays the same shape
against a real daemon the way engines drive it, and measures what an operator wants to know before
sizing the tiers: the hit rate per round split by where the hit came from, a time-to-first-token
proxy, and the peak device pool usage.

How it runs:

* one OS process per client (``multiprocessing``, spawn), each with its own session: clients hold
  locks and pages concurrently, exactly like separate engine processes;
* the parent is the sender of ``bench_multiturn``: it releases requests at ``request_rate`` (Poisson
  or uniform gaps; unlimited by default), keeps at most ``max_parallel`` in flight, and with the
  round barrier (the default) starts round r+1 only once every client finished round r, serving the
  clients in the same order every round (the pattern that defeats plain LRU);
* each client owns its conversation: the first prompt is ``first_prompt`` random tokens, and after
  every answer the history grows by the ``output`` generated tokens plus a ``subq``-token
  sub-question, so round r sends ``first_prompt + r * (output + subq)`` tokens;
* the default engine is synthetic: it computes nothing but performs every protocol step a real
  engine performs, at page granularity (see :class:`SyntheticEngine`); ``engine="hf"`` runs the
  HF transformers engine of ``examples/hf_engine`` instead.

Hit accounting, per request: ``device`` = the ``prefix_len`` of the first ``match`` (KV already in
the device pool and usable); ``host`` + ``l3`` = what ``load`` added to it (its ``prefix_len``
minus the match's), split by where it was before the request: ``l3`` is the part that
``prefetch`` had just brought from Redis into L2, ``host`` the rest. That added part is the
``loaded_len`` copied from L2, plus device-resident full KV that only became usable because the
load restored its SWA window from L2 (both are hits thanks to the host tier; the raw
``loaded_len`` is kept in every request's record). ``device + host + l3`` is the usable prefix the
request started its prefill from. The
ideal is what an infinite cache would hit: for round r >= 1, the previous prompt plus the committed
part of its output, page-aligned (``daemon.workload.Workload``, the same formula the in-process
replay is checked against).

Pool usage is polled with the ``stats`` operation from a separate session of the parent (tree plus
session-held pages of the tenant's namespace, every ``sample_interval_s`` and at every request's
end), so a peak inside a request that lasts less than one interval can be missed; the report says
so in ``pool.source``.

An engine (:class:`Engine`) has ``vocab_size``, ``run_request(prompt, output_len) ->
RequestOutcome`` and ``close()``; :class:`SyntheticEngine` and :class:`HFEngine` (an adapter of
``examples/hf_engine``'s ``Engine``) are the two.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import threading
import time
import traceback
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from radixd_client import Client, pages
from radixd_client.errors import (
    AuthError,
    ConnectFailed,
    ConnectionLost,
    RadixdError,
    ShuttingDown,
)

from .workload import Workload

__all__ = [
    "BenchError",
    "BenchUsageError",
    "Engine",
    "EngineSpec",
    "HFEngine",
    "Options",
    "ProgressBar",
    "RequestOutcome",
    "SyntheticEngine",
    "fitting_chunk",
    "format_report",
    "hf_engine_module",
    "plot_available",
    "run",
    "split_loaded",
    "write_json",
    "write_plot",
]

#: Token ids of the synthetic conversations are drawn from [1, SYNTHETIC_VOCAB), as in
#: bench/multiturn.py.
SYNTHETIC_VOCAB = 50_000
ENGINES = ("synthetic", "hf")
DISTRIBUTIONS = ("poisson", "uniform")
#: Seconds one protocol call may take before the bench gives up on the daemon (a load of many
#: host pages is the slowest legitimate call).
OP_TIMEOUT_S = 120.0
#: Error codes that mean a broken engine or daemon rather than a full cache: the run stops.
_FATAL_CODES = frozenset({"internal", "unknown_op", "bad_frame", "bad_receipt", "page_not_held",
                          "not_authenticated", "auth_failed", "unknown_model",
                          "model_not_allowed", "too_many_locks"})
_REPO_ROOT = Path(__file__).resolve().parents[1]


class BenchError(RuntimeError):
    """The run could not be carried out (daemon unreachable, refused, broken): exit status 1."""


class BenchUsageError(ValueError):
    """The options are invalid (or name a model the daemon does not serve): exit status 2."""


# ---------------------------------------------------------------------------- options


@dataclass
class Options:
    """Everything one run needs. Defaults follow ``bench/multiturn.py``'s ``Workload``."""

    socket: str
    token: str | None = None
    model: str | None = None  # None: the first model the tenant may use
    clients: int = 10
    rounds: int = 10
    first_prompt: int = 300
    output: int = 3000
    subq: int = 300
    request_rate: float = math.inf  # requests per second over all clients; inf: no gaps
    distribution: str = "poisson"
    round_barrier: bool = True
    max_parallel: int = 1  # requests in flight at once (1: one at a time, like the replay)
    prefill_chunk: int = 2048
    swa_eviction_interval: int = 128  # decode tokens between SWA frees (SGLang's default)
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


class Engine(Protocol):
    """What the client process drives; see the module docstring."""

    vocab_size: int

    def run_request(self, prompt: list[int], output_len: int) -> RequestOutcome: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------- synthetic engine


class _RequestFailed(Exception):
    """One protocol call of a request failed; ``fatal`` ends the run."""

    def __init__(self, op: str, err: RadixdError) -> None:
        super().__init__(f"{op}: {err.code}: {err.message}")
        self.fatal = err.code in _FATAL_CODES


def _connect(socket_path: str, token: str | None, name: str) -> Client:
    """A session, with the daemon's refusal turned into a BenchError that says what to do."""
    try:
        return Client(socket_path, token, client_name=name, timeout=OP_TIMEOUT_S)
    except ConnectFailed as exc:
        raise BenchError(f"{exc} (is the daemon running? pass its socket with --socket)"
                         ) from None
    except AuthError as exc:
        raise BenchError(f"radixd refused the session ({exc.code}): {exc.message} (check "
                         "--token)") from None
    except RadixdError as exc:
        raise BenchError(f"cannot open a session on {socket_path}: {exc.code}: {exc.message}"
                         ) from None


class SyntheticEngine:
    """An engine without a model: every protocol step of a real one, no forward pass.

    Per request: ``prefetch(wait_complete)`` when L3 is on; ``match(lock)``; ``load(lock)`` when
    the match reports host hits (the match's lock is then dropped for the load's); chunked
    prefill (``alloc`` per chunk, ``cache_unfinished`` after each but the last); decode a page at a
    time (``alloc`` at each page boundary), freeing out-of-window SWA pages every
    ``swa_eviction_interval`` tokens and releasing the prefix's SWA lock once the request's own
    tokens cover the window; ``cache_finished`` with the committed KV (the last sampled token is
    never forwarded) and the SWA frontier. The same steps as ``bench/multiturn.py``'s in-process
    engine, over the socket.

    A request refused for capacity (``out_of_memory``, ``quota_exceeded``, a prompt larger than
    the pool) is counted as failed and its session closed, which returns everything it held;
    the next request reconnects. A protocol error that means a bug stops the run.
    """

    vocab_size = SYNTHETIC_VOCAB

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self._rng = random.Random(f"{spec.seed}:{spec.client_index}:output")
        self._client: Client | None = self._open()
        info = self._client.models.get(spec.model)
        if info is None:
            raise BenchError(f"the daemon does not serve model {spec.model!r} to this tenant")
        self.page_size = info.page_size
        self.window = info.sliding_window if info.swa_pages else None
        self.prefill_chunk = fitting_chunk(info, spec.prefill_chunk)

    def _open(self) -> Client:
        return _connect(self.spec.socket, self.spec.token,
                        f"radixd-bench-multiturn-{self.spec.client_index}")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @staticmethod
    def _op(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ConnectionLost, ShuttingDown):
            raise
        except RadixdError as exc:
            raise _RequestFailed(name, exc) from exc

    def run_request(self, prompt: list[int], output_len: int) -> RequestOutcome:
        """Serve one request; capacity failures come back as ``failed`` outcomes."""
        out = RequestOutcome(prompt_len=len(prompt),
                             output=[self._rng.randrange(1, self.vocab_size)
                                     for _ in range(output_len)])
        if self._client is None:
            self._client = self._open()
        t0 = time.perf_counter()
        try:
            self._serve(self._client, prompt, output_len, out, t0)
        except _RequestFailed as exc:
            self.close()  # the session's end returns every page and lock it held
            if exc.fatal:
                raise BenchError(f"the daemon failed a request: {exc}") from None
            out.failed, out.error = True, str(exc)
        except (ConnectionLost, ShuttingDown) as exc:
            self.close()
            out.failed, out.error = True, f"connection lost: {exc}"
            self._client = self._open()  # BenchError when the daemon is gone for good
        out.latency_s = time.perf_counter() - t0
        return out

    def _serve(self, c: Client, prompt: list[int], output_len: int, out: RequestOutcome,
               t0: float) -> None:
        op = self._op
        model, P, W = self.spec.model, self.page_size, self.window
        L = len(prompt)
        tokens = array("i", prompt).tobytes()
        if self.spec.l3:
            pf = op("prefetch", c.prefetch, model, tokens, "wait_complete")
            out.l3_hit_len, out.fetched_len, out.prefetch_status = (
                pf.l3_hit_len, pf.fetched_len, pf.status)
        m = op("match", c.match, model, tokens, lock=True)
        rid = m.receipt
        out.device_hit = prefix = m.prefix_len
        out.host_hit_len = m.host_hit_len
        if m.host_hit_len > 0:
            try:
                ld = op("load", c.load, model, tokens, lock=True)
            finally:
                if rid is not None:
                    with contextlib.suppress(RadixdError):
                        c.unlock(model, rid)
            rid = ld.receipt
            out.loaded_len = ld.loaded_len
            prefix = max(ld.prefix_len, out.device_hit)
            out.host_hit, out.l3_hit = split_loaded(prefix - out.device_hit, m.host_hit_len,
                                                    out.fetched_len)
        out.prefill_tokens = L - prefix

        prev = prefix  # the tree holds [0, prev) under our receipt
        frontier = prefix  # swa_evicted_len: our SWA below it is freed
        full: list[int] = []  # our held pages from prev on
        swa: list[int] = []
        window_pages = -(-max(W or 0, P) // P)

        def grow(n_tokens: int) -> None:
            need = -(-n_tokens // P) - prev // P - len(full)
            if need > 0:
                a = op("alloc", c.alloc, model, need)
                full.extend(pages(a.full_pages))
                if W is not None:
                    swa.extend(pages(a.swa_pages))

        def out_of_window(seq_len: int) -> list[int]:
            """Our SWA pages that left the window (marked freed here); the caller frees them."""
            nonlocal frontier
            new = max(frontier, seq_len - window_pages * P) // P * P
            if new <= frontier:
                return []
            lo, hi = (frontier - prev) // P, (new - prev) // P
            ids = [p for p in swa[lo:hi] if p]
            swa[lo:hi] = [0] * (hi - lo)
            frontier = new
            return ids

        seq = prev
        while seq < L:  # chunked prefill
            seq = min(L, seq + self.prefill_chunk)
            grow(seq)
            if W is not None:
                ids = out_of_window(seq)
                if ids:
                    op("free", c.free, model, swa_pages=ids)
            if seq < L:
                ins = op("cache_unfinished", c.cache_unfinished, model, tokens[:4 * seq], full,
                         swa, prev, frontier if W is not None else 0, rid)
                k = (ins.inserted_len - prev) // P
                del full[:k]
                del swa[:k]
                prev, rid = ins.inserted_len, ins.receipt
                frontier = max(frontier, prev)
        out.ttft_s = time.perf_counter() - t0  # the first decode step starts now

        committed = L + output_len - 1  # the last sampled token is never forwarded
        swa_released = False
        last_free = seq
        while seq < committed:
            seq += min(P - seq % P if seq % P else P, committed - seq)
            grow(seq)
            if W is None:
                continue
            if not swa_released and seq - prev >= W + P and rid is not None:
                op("release_swa", c.release_swa, model, rid)
                swa_released = True
            if seq - last_free >= self.spec.swa_eviction_interval:
                ids = out_of_window(seq)
                if ids:
                    op("free", c.free, model, swa_pages=ids)
                last_free = seq
        final = array("i", prompt)
        final.extend(out.output)
        op("cache_finished", c.cache_finished, model, final[:committed].tobytes(), full, swa,
           prev, frontier if W is not None else 0, rid)
        if W is not None:
            out.swa_evicted_len = frontier
            out.swa_freed_tokens = frontier - prefix


# ---------------------------------------------------------------------------- optional parts


def _import_from_checkout(module: str, folder: str) -> Any:
    """Import ``module`` (under ``bench/`` or ``examples/`` of the source checkout): these
    folders are not installed with the daemon, so fall back to the checkout this daemon runs
    from."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and not module.startswith(exc.name):
            raise  # the module exists but one of its own imports is missing
        if not (_REPO_ROOT / folder).is_dir():
            raise
    if str(_REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(_REPO_ROOT))
    return importlib.import_module(module)


def hf_engine_module() -> Any:
    """``examples.hf_engine``, or a BenchError that says what is missing."""
    try:
        return _import_from_checkout("examples.hf_engine", "examples")
    except ImportError as exc:
        raise BenchError(f"--engine hf needs the HF transformers engine of examples/hf_engine, "
                         f"which cannot be imported ({type(exc).__name__}: {exc}); run from a "
                         "radixd source checkout with the 'hf' extra installed "
                         "(pip install -e '.[hf]'), or use --engine synthetic") from None


class HFEngine:
    """``--engine hf``: the engine of ``examples/hf_engine`` (a tiny random-weight hybrid Qwen2
    from HF transformers whose KV lives in the daemon's pools), one request at a time.

    That engine performs the protocol itself (prefetch, a probing match, load or a locked match,
    chunked prefill, decode with SWA frees, cache_finished); this adapter times it and reads what
    it recorded on its request. The daemon's model must have the example model's KV layout
    (``python -m examples.hf_engine config`` prints such a configuration). Weights come from a
    fixed seed, so every client process runs the same model.
    """

    WEIGHTS_SEED = 0

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self._hf = hf_engine_module()
        config = self._hf.tiny_config()
        self._model = self._hf.build_model(config, seed=self.WEIGHTS_SEED)
        self.vocab_size = int(config.vocab_size)
        self._rng = random.Random(f"{spec.seed}:{spec.client_index}:hf-padding")
        self._engine: Any = None
        self._engine = self._open()

    def _open(self) -> Any:
        s = self.spec
        try:
            probe = _connect(s.socket, s.token, f"radixd-bench-multiturn-{s.client_index}")
            try:
                info = probe.models.get(s.model)
            finally:
                probe.close()
            if info is None:
                raise BenchError(f"the daemon does not serve model {s.model!r} to this tenant")
            return self._hf.Engine.connect(s.socket, s.model, self._model, token=s.token,
                                           chunk_size=fitting_chunk(info, s.prefill_chunk),
                                           use_l3=s.l3)
        except ConnectFailed as exc:
            raise BenchError(f"{exc} (is the daemon running? pass its socket with --socket)"
                             ) from None
        except RadixdError as exc:
            raise BenchError(f"the hf engine could not start: {exc.code}: {exc.message}"
                             ) from None
        except ValueError as exc:
            raise BenchError(f"the daemon's model {s.model!r} does not fit the example model of "
                             f"examples/hf_engine: {exc} (serve the configuration that `python "
                             "-m examples.hf_engine config` prints)") from None

    def close(self) -> None:
        if self._engine is not None:
            with contextlib.suppress(Exception):
                self._engine.close()
            self._engine = None

    def run_request(self, prompt: list[int], output_len: int) -> RequestOutcome:
        out = RequestOutcome(prompt_len=len(prompt))
        if self._engine is None:
            self._engine = self._open()
        engine = self._engine
        prefill = self._hf.Phase.PREFILL
        t0 = time.perf_counter()
        req = None
        try:
            req = engine.submit(prompt, output_len)
            while req.phase is prefill:
                engine.step()
            out.ttft_s = time.perf_counter() - t0
            while not req.done:
                engine.step()
        except (ConnectionLost, ShuttingDown) as exc:
            self.close()
            out.failed, out.error = True, f"connection lost: {exc}"
        except RadixdError as exc:
            self.close()  # the session's end returns every page and lock it held
            if exc.code in _FATAL_CODES:
                raise BenchError(f"the daemon failed a request of the hf engine: {exc.code}: "
                                 f"{exc.message}") from None
            out.failed, out.error = True, f"{exc.code}: {exc.message}"
        out.latency_s = time.perf_counter() - t0
        if req is not None:
            out.output = list(req.output)
            out.host_hit_len, out.loaded_len = req.host_hit_len, req.loaded_len
            out.l3_hit_len, out.fetched_len = req.l3_hit_len, req.fetched_len
            out.prefetch_status = req.prefetch_status
            prefix = req.prefix_len
            # That engine keeps no record of its probing match's prefix: the device part is
            # what the load did not copy.
            out.device_hit = max(0, prefix - req.loaded_len)
            out.host_hit, out.l3_hit = split_loaded(prefix - out.device_hit, req.host_hit_len,
                                                    req.fetched_len)
            out.prefill_tokens = len(prompt) - prefix
            out.swa_evicted_len = req.swa_evicted_len
            out.swa_freed_tokens = req.swa_pages_freed * int(engine.page_size)
        # A request cut short still adds a full answer to the conversation, as in the replay.
        out.output += [self._rng.randrange(1, self.vocab_size)
                       for _ in range(output_len - len(out.output))]
        return out


def _make_engine(kind: str, spec: EngineSpec) -> Engine:
    if kind == "hf":
        return HFEngine(spec)
    return SyntheticEngine(spec)


def _as_outcome(obj: Any, prompt_len: int) -> RequestOutcome:
    """The engine's result as a RequestOutcome (an engine may return any object with the same
    attribute names)."""
    if isinstance(obj, RequestOutcome):
        return obj
    out = RequestOutcome(prompt_len=prompt_len)
    for name in RequestOutcome.__dataclass_fields__:
        if hasattr(obj, name):
            setattr(out, name, getattr(obj, name))
    out.output = list(out.output)
    return out


# ---------------------------------------------------------------------------- client process


def _client_main(index: int, spec: EngineSpec, engine_kind: str, first_prompt: int,
                 subq: int, go: Any, results: Any) -> None:
    """One client: its engine, its conversation; runs a request per message on ``go``."""
    try:
        try:
            engine = _make_engine(engine_kind, spec)
        except BenchError as exc:
            results.put(("fatal", index, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which exits 1
            results.put(("fatal", index, f"client {index}: the {engine_kind} engine did not "
                                         f"start: {type(exc).__name__}: {exc}"))
            return
        rng = random.Random(f"{spec.seed}:{index}:history")
        vocab = int(engine.vocab_size)
        history = [rng.randrange(1, vocab) for _ in range(first_prompt)]
        results.put(("ready", index, None))
        try:
            while True:
                msg = go.get()
                if msg is None:
                    break
                rnd, output_len = msg
                start = time.monotonic()
                try:
                    res = _as_outcome(engine.run_request(history, output_len), len(history))
                except BenchError as exc:
                    results.put(("fatal", index, str(exc)))
                    break
                except Exception as exc:  # noqa: BLE001
                    tb = traceback.format_exc(limit=3)
                    results.put(("fatal", index, f"client {index}: the engine raised "
                                                 f"{type(exc).__name__}: {exc}\n{tb}"))
                    break
                record = asdict(res)
                output = record.pop("output")
                record.update(client=index, round=rnd, start=start, end=time.monotonic(),
                              output_len=len(output))
                results.put(("done", index, record))
                history = history + list(output) + [rng.randrange(1, vocab)
                                                    for _ in range(subq)]
        finally:
            with contextlib.suppress(Exception):
                engine.close()
    except KeyboardInterrupt:
        pass


# ---------------------------------------------------------------------------- pool sampler


class _Sampler(threading.Thread):
    """Polls ``stats`` from its own session: pool usage over time, and the peaks.

    It samples every ``interval`` and also whenever :meth:`poke` is called (the dispatcher pokes
    at every request's end), so that a fast run still has a sample per request.
    """

    def __init__(self, socket_path: str, token: str | None, model: str, interval: float):
        super().__init__(name="radixd-bench-sampler", daemon=True)
        self.client = _connect(socket_path, token, "radixd-bench-multiturn-sampler")
        self.model = model
        self.interval = interval
        self.samples: list[tuple[float, int, int]] = []
        self._wake = threading.Event()
        self._done = False
        self._lock = threading.Lock()  # one caller of the (not thread-safe) client at a time

    def sample(self) -> None:
        with self._lock:
            st = self.client.stats(self.model).models[self.model]
        self.samples.append((time.monotonic(),
                             st["tree_full_pages"] + st["held_full_pages"],
                             st["tree_swa_pages"] + st["held_swa_pages"]))

    def poke(self) -> None:
        self._wake.set()

    def run(self) -> None:
        while not self._done:
            try:
                self.sample()
            except RadixdError:
                return  # the daemon went away: the run itself reports that
            self._wake.wait(self.interval)
            self._wake.clear()

    def stop(self) -> None:
        self._done = True
        self._wake.set()
        if self.is_alive():
            self.join(timeout=OP_TIMEOUT_S)
        with contextlib.suppress(RadixdError):
            self.sample()  # the state at the end
        self.client.close()


# ---------------------------------------------------------------------------- progress


class ProgressBar:
    """A one-line text bar on a stream (redrawn in place on a terminal; one line per round
    otherwise, so logs stay readable)."""

    def __init__(self, total: int, rounds: int, stream: TextIO | None = None,
                 width: int = 30) -> None:
        self.total = total
        self.rounds = rounds
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_round = 0

    def update(self, done: int, rounds_done: int, hit_rate: float) -> None:
        """``rounds_done``: rounds every client has finished."""
        filled = self.width * done // max(1, self.total)
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} requests, "
                f"{rounds_done}/{self.rounds} rounds done, hit rate {hit_rate:.3f}")
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif rounds_done != self._last_round:
            self._last_round = rounds_done
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------------------- the run


def _gap(rng: random.Random, rate: float, distribution: str) -> float:
    if math.isinf(rate):
        return 0.0
    if distribution == "poisson":
        return rng.expovariate(rate)
    return rng.uniform(0.0, 2.0 / rate)


def _stop_children(procs: Sequence[Any], gos: Sequence[Any], grace: float = 10.0) -> None:
    for g in gos:
        with contextlib.suppress(Exception):
            g.put(None)
    deadline = time.monotonic() + grace
    started = [p for p in procs if p.pid is not None]
    for p in started:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in started:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)


def run(opts: Options, progress: ProgressBar | bool | None = None) -> dict[str, Any]:
    """Run the workload against the daemon at ``opts.socket``; the report as a JSON-able dict.

    ``progress``: True for a bar on stderr, or a ProgressBar. Raises BenchUsageError for invalid
    options or an unknown model, BenchError when the run cannot be carried out.

    The clients are spawned processes, which import the caller's ``__main__`` again: a script
    that calls this must do so under ``if __name__ == "__main__":``.
    """
    opts.validate()
    seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(1 << 31)
    main = _connect(opts.socket, opts.token, "radixd-bench-multiturn")
    try:
        if opts.model is None:
            if not main.models:
                raise BenchUsageError("the daemon serves no model to this tenant")
            model = next(iter(main.models))
        elif opts.model not in main.models:
            raise BenchUsageError(f"the daemon does not serve model {opts.model!r} to this "
                                  f"tenant (models: {sorted(main.models)})")
        else:
            model = opts.model
        info = main.models[model]
        instance = main.instance
    finally:
        main.close()
    if opts.engine == "hf":
        hf_engine_module()  # fail here, with the reason, rather than in every client
    window = info.sliding_window if info.swa_pages else None
    wl = Workload(clients=opts.clients, rounds=opts.rounds, first_prompt=opts.first_prompt,
                  output=opts.output, subq=opts.subq, page_size=info.page_size,
                  window=window or 0, max_parallel=opts.max_parallel,
                  prefill_chunk=opts.prefill_chunk,
                  swa_eviction_interval=opts.swa_eviction_interval, seed=seed)
    bar = ProgressBar(opts.clients * opts.rounds, opts.rounds) if progress is True else (
        progress or None)

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    gos = [ctx.Queue() for _ in range(opts.clients)]
    procs = []
    for i in range(opts.clients):
        spec = EngineSpec(socket=opts.socket, token=opts.token, model=model, client_index=i,
                          seed=seed, l3=opts.l3, prefill_chunk=opts.prefill_chunk,
                          swa_eviction_interval=opts.swa_eviction_interval)
        p = ctx.Process(target=_client_main, name=f"radixd-bench-client-{i}",
                        args=(i, spec, opts.engine, opts.first_prompt, opts.subq, gos[i],
                              results), daemon=True)
        procs.append(p)
    records: list[dict[str, Any]] = []
    sampler: _Sampler | None = None
    started = time.monotonic()
    try:
        for p in procs:
            p.start()
        _wait_ready(procs, results)
        sampler = _Sampler(opts.socket, opts.token, model, opts.sample_interval_s)
        started = time.monotonic()
        sampler.sample()
        sampler.start()
        _dispatch(opts, seed, procs, gos, results, records, bar, sampler.poke)
        finished = time.monotonic()
    except RadixdError as exc:  # the parent's own calls (the sampler's first stats)
        raise BenchError(f"radixd failed the bench's stats session: {exc.code}: {exc}"
                         ) from None
    finally:
        if sampler is not None:
            sampler.stop()
        _stop_children(procs, gos)
        if bar is not None:
            bar.close()
    wall = finished - started
    return _report(opts, seed, model, info, instance, wl, records,
                   sampler.samples if sampler else [], started, wall)


def _wait_ready(procs: Sequence[Any], results: Any) -> None:
    ready: set[int] = set()
    while len(ready) < len(procs):
        try:
            kind, idx, payload = results.get(timeout=0.5)
        except queue.Empty:
            _check_alive(procs, results)
            continue
        if kind == "fatal":
            raise BenchError(payload)
        ready.add(idx)


def _check_alive(procs: Sequence[Any], results: Any) -> None:
    """Every client process runs until told to stop: one that ended failed. Its own report
    (sent just before it exited) is the better message, so look for it first."""
    dead = [(i, p.exitcode) for i, p in enumerate(procs) if not p.is_alive()]
    if not dead:
        return
    with contextlib.suppress(queue.Empty):
        while True:
            kind, _idx, payload = results.get(timeout=1.0)
            if kind == "fatal":
                raise BenchError(payload)
    i, code = dead[0]
    raise BenchError(f"client process {i} exited (status {code}) in the middle of the run")


def _dispatch(opts: Options, seed: int, procs: Sequence[Any], gos: Sequence[Any], results: Any,
              records: list[dict[str, Any]], bar: ProgressBar | None,
              on_done: Callable[[], None] = lambda: None) -> None:
    """The sender: arrival gaps, the in-flight bound and the round barrier."""
    total = opts.clients * opts.rounds
    arrivals = random.Random(f"{seed}:arrivals")
    ready: deque[int] = deque(range(opts.clients))
    waiting: list[int] = []  # finished this round, held by the barrier
    round_of = [0] * opts.clients
    in_flight = 0
    next_send = time.monotonic()
    hit = prompt = 0
    while len(records) < total:
        now = time.monotonic()
        while ready and in_flight < opts.max_parallel and now >= next_send:
            c = ready.popleft()
            gos[c].put((round_of[c], opts.output))
            in_flight += 1
            next_send = max(next_send, now) + _gap(arrivals, opts.request_rate,
                                                    opts.distribution)
            now = time.monotonic()
        timeout = 0.5
        if ready and in_flight < opts.max_parallel:
            timeout = max(0.0, min(timeout, next_send - now))
        try:
            kind, idx, payload = results.get(timeout=timeout)
        except queue.Empty:
            _check_alive(procs, results)
            continue
        if kind == "fatal":
            raise BenchError(payload)
        if kind != "done":
            continue
        records.append(payload)
        on_done()
        in_flight -= 1
        hit += payload["device_hit"] + payload["host_hit"] + payload["l3_hit"]
        prompt += payload["prompt_len"]
        round_of[idx] += 1
        if round_of[idx] < opts.rounds:
            if not opts.round_barrier:
                ready.append(idx)
            else:
                waiting.append(idx)
                if len(waiting) == opts.clients:
                    ready.extend(sorted(waiting))  # the same order every round
                    waiting.clear()
        if bar is not None:
            bar.update(len(records), min(round_of), hit / prompt if prompt else 0.0)


# ---------------------------------------------------------------------------- the report


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _summary(recs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(r["prompt_len"] for r in recs)
    device = sum(r["device_hit"] for r in recs)
    host = sum(r["host_hit"] for r in recs)
    l3 = sum(r["l3_hit"] for r in recs)
    ttfts = sorted(r["ttft_s"] for r in recs if r["ttft_s"] is not None)

    def pct(q: float) -> float | None:
        if not ttfts:
            return None
        return ttfts[min(len(ttfts) - 1, max(0, math.ceil(q * len(ttfts)) - 1))]

    return {
        "requests": len(recs),
        "failed": sum(1 for r in recs if r["failed"]),
        "prompt_tokens": prompt,
        "hit_tokens": device + host + l3,
        "device_hit_tokens": device,
        "host_hit_tokens": host,
        "l3_hit_tokens": l3,
        "prefill_tokens": sum(r["prefill_tokens"] for r in recs),
        "output_tokens": sum(r["output_len"] for r in recs),
        "hit_rate": _ratio(device + host + l3, prompt),
        "device_hit_rate": _ratio(device, prompt),
        "host_hit_rate": _ratio(host, prompt),
        "l3_hit_rate": _ratio(l3, prompt),
        "swa_freed_tokens": sum(r["swa_freed_tokens"] for r in recs),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "ttft_p50_s": pct(0.5),
        "ttft_p90_s": pct(0.9),
        "ttft_max_s": ttfts[-1] if ttfts else None,
    }


def _report(opts: Options, seed: int, model: str, info: Any, instance: str, wl: Any,
            records: list[dict[str, Any]], samples: list[tuple[float, int, int]],
            started: float, wall: float) -> dict[str, Any]:
    P = info.page_size
    records.sort(key=lambda r: (r["round"], r["start"]))
    rounds = []
    for r in range(opts.rounds):
        recs = [x for x in records if x["round"] == r]
        s = _summary(recs)
        ideal = 0.0
        if r:
            ideal = (wl.prompt_len(r - 1) + opts.output - 1) // P * P / wl.prompt_len(r)
        s.update(round=r, ideal_hit_rate=ideal,
                 wall_s=(max(x["end"] for x in recs) - min(x["start"] for x in recs))
                 if recs else 0.0)
        rounds.append(s)
    total = _summary(records)
    total["ideal_hit_rate"] = wl.ideal_hit_rate()
    full_cap = info.full_pages - 1
    swa_cap = info.swa_pages - 1 if info.swa_pages else 0
    peak_full = max((s[1] for s in samples), default=0)
    peak_swa = max((s[2] for s in samples), default=0)
    for rec in records:
        rec["start"] = round(rec["start"] - started, 6)
        rec["end"] = round(rec["end"] - started, 6)
    options = asdict(opts)
    options.pop("token", None)  # never written out
    options["seed"] = seed
    if math.isinf(options["request_rate"]):
        options["request_rate"] = None  # JSON has no infinity: null means "no gaps"
    return {
        "format": 1,
        "daemon_instance": instance,
        "model": model,
        "page_size": P,
        "sliding_window": info.sliding_window if info.swa_pages else None,
        "options": options,
        "working_set_pages": wl.working_set_pages(),
        "wall_s": wall,
        "total": total,
        "rounds": rounds,
        "pool": {
            "source": f"stats operation (tree + session-held pages of the tenant's namespace), "
                      f"polled every {opts.sample_interval_s:g} s and at every request's end "
                      "from a separate session",
            "full_capacity": full_cap,
            "swa_capacity": swa_cap,
            "peak_full_pages": peak_full,
            "peak_swa_pages": peak_swa,
            "peak_full_usage": _ratio(peak_full, full_cap),
            "peak_swa_usage": _ratio(peak_swa, swa_cap),
            "samples": len(samples),
        },
        "timeline": {
            "t_s": [round(t - started, 6) for t, _, _ in samples],
            "full_pages": [f for _, f, _ in samples],
            "swa_pages": [s for _, _, s in samples],
        },
        "requests": records,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.1f}"


def format_report(report: dict[str, Any]) -> str:
    """The human summary: one row per round, the totals, the pool peaks."""
    o = report["options"]
    head = (f"multi-turn on model {report['model']} (page {report['page_size']}, window "
            f"{report['sliding_window'] or '-'}), engine {o['engine']}"
            f"{', L3 prefetch' if o['l3'] else ''}: {o['clients']} clients x {o['rounds']} "
            f"rounds, first prompt {o['first_prompt']}, output {o['output']}, sub-question "
            f"{o['subq']}, seed {o['seed']}")
    rows = [["round", "reqs", "failed", "prompt tok", "hit", "device", "host", "l3", "ideal",
             "ttft p50 ms", "ttft max ms"]]

    def row(name: str, s: dict[str, Any], ideal: float) -> list[str]:
        return [name, str(s["requests"]), str(s["failed"]), str(s["prompt_tokens"]),
                f"{s['hit_rate']:.3f}", f"{s['device_hit_rate']:.3f}",
                f"{s['host_hit_rate']:.3f}", f"{s['l3_hit_rate']:.3f}", f"{ideal:.3f}",
                _ms(s["ttft_p50_s"]), _ms(s["ttft_max_s"])]

    for s in report["rounds"]:
        rows.append(row(str(s["round"]), s, s["ideal_hit_rate"]))
    t = report["total"]
    rows.append(row("total", t, t["ideal_hit_rate"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head, ""]
    for j, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if j == 0 or j == len(rows) - 2:
            lines.append("  ".join("-" * w for w in widths))
    p = report["pool"]
    lines.append("")
    lines.append(f"peak device pool usage: full {p['peak_full_pages']}/{p['full_capacity']} "
                 f"pages ({100 * p['peak_full_usage']:.1f}%), SWA {p['peak_swa_pages']}/"
                 f"{p['swa_capacity']} pages ({100 * p['peak_swa_usage']:.1f}%); from the "
                 f"{p['source']}")
    lines.append(f"SWA KV freed early: {t['swa_freed_tokens']} tokens; prefill computed "
                 f"{t['prefill_tokens']} of {t['prompt_tokens']} prompt tokens; "
                 f"wall {report['wall_s']:.2f} s")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str) -> None:
    """The report as one JSON document (the folder is created if needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
        fh.write("\n")


def plot_available() -> str | None:
    """None when matplotlib can be imported, else why not (checked before a run, not after)."""
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        return (f"--plot needs matplotlib ({exc}); install it with pip install "
                "'radixd[bench]'")
    return None


def write_plot(report: dict[str, Any], path: str) -> None:
    """A PNG: device pool usage over time (top) and hit rate over time (bottom), with the round
    boundaries; matplotlib is imported here only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl, p = report["timeline"], report["pool"]
    reqs = sorted(report["requests"], key=lambda r: r["end"])
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    try:
        if p["full_capacity"]:
            ax1.plot(tl["t_s"], [100 * f / p["full_capacity"] for f in tl["full_pages"]],
                     label="full pool")
        if p["swa_capacity"]:
            ax1.plot(tl["t_s"], [100 * s / p["swa_capacity"] for s in tl["swa_pages"]],
                     label="SWA pool")
        ax1.set_ylabel("device pool used (%)")
        ax1.set_ylim(0, 105)
        ax1.legend(loc="lower right")
        ax1.grid(alpha=0.3)
        ax2.scatter([r["end"] for r in reqs],
                    [(r["device_hit"] + r["host_hit"] + r["l3_hit"]) / r["prompt_len"]
                     for r in reqs], marker="x", s=18, color="black", linewidths=0.8,
                    label="request (all tiers)")
        for key, label in (("device_hit", "from device"), ("host_hit", "from host (L2)"),
                           ("l3_hit", "from L3")):
            part = [r for r in reqs if r[key]]
            if part:
                ax2.scatter([r["end"] for r in part], [r[key] / r["prompt_len"] for r in part],
                            s=12, alpha=0.7, label=label)
        hit = prompt = 0
        cum = []
        for r in reqs:
            hit += r["device_hit"] + r["host_hit"] + r["l3_hit"]
            prompt += r["prompt_len"]
            cum.append(hit / prompt)
        ax2.plot([r["end"] for r in reqs], cum, color="black", label="cumulative hit rate")
        ax2.axhline(report["total"]["ideal_hit_rate"], color="grey", linestyle="--",
                    label="ideal (cumulative, end of run)")
        for rnd in report["rounds"][1:]:
            starts = [r["start"] for r in reqs if r["round"] == rnd["round"]]
            if starts:
                for ax in (ax1, ax2):
                    ax.axvline(min(starts), color="tab:red", alpha=0.5, linewidth=0.8,
                               linestyle=":")
                ax1.annotate(f"round {rnd['round']}", (min(starts), 1.0),
                             xycoords=("data", "axes fraction"), xytext=(2, -10),
                             textcoords="offset points", fontsize="x-small", color="tab:red")
        ax2.set_ylabel("hit rate (per request)")
        ax2.set_xlabel("seconds since the first request")
        ax2.set_ylim(0, 1.05)
        ax2.legend(loc="best", fontsize="small")
        ax2.grid(alpha=0.3)
        o = report["options"]
        fig.suptitle(f"radixd multi-turn: {report['model']}, {o['clients']} clients x "
                     f"{o['rounds']} rounds, engine {o['engine']}"
                     f"{', L3 prefetch' if o['l3'] else ''}")
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)
