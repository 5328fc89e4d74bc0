"""The engines a bench client process drives: :class:`SyntheticEngine` (every protocol step of a
real engine, no model) and :class:`HFEngine` (the HF transformers engine of
``examples/hf_engine``). Both leave the request's cache bookkeeping to
:class:`radixd_client.lifecycle.RequestLifecycle`, so the bench measures the same protocol steps
an engine built on the client library performs.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import time
from collections.abc import Iterator
from typing import Any, Protocol

from radixd_client import Client
from radixd_client.errors import (
    AuthError,
    ConnectFailed,
    ConnectionLost,
    RadixdError,
    ShuttingDown,
)
from radixd_client.lifecycle import RequestLifecycle

from .options import (
    FATAL_CODES,
    OP_TIMEOUT_S,
    SYNTHETIC_VOCAB,
    BenchError,
    EngineSpec,
    RequestOutcome,
    fitting_chunk,
    split_loaded,
)

__all__ = ["Engine", "HFEngine", "SyntheticEngine", "as_outcome", "connect", "hf_engine_module",
           "make_engine", "synthetic_steps"]


class Engine(Protocol):
    """What the client process drives; see the module docstring."""

    vocab_size: int

    def run_request(self, prompt: list[int], output_len: int) -> RequestOutcome: ...

    def close(self) -> None: ...



def connect(socket_path: str, token: str | None, name: str) -> Client:
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



def _request_failed(lc: RequestLifecycle | None, exc: RadixdError) -> str:
    op = lc.last_op if lc is not None and lc.last_op else "connect"
    return f"{op}: {exc.code}: {exc.message}"


def synthetic_steps(lc: RequestLifecycle, output: list[int], prefill_chunk: int
                    ) -> Iterator[bool]:
    """Drive an admitted request like an engine that computes nothing: chunked prefill, then
    decode a page of tokens at a time, then ``cache_finished`` of the committed KV (the last
    sampled token is never forwarded).

    A generator, so that the in-process replay (bench/multiturn.py) can interleave requests at
    the same points as real engines do; it yields after each prefill chunk and each decode
    page, True once the whole prompt is prefilled.
    """
    L = lc.prompt_len
    seq = lc.computed_len
    while seq < L:  # the forward pass would write [computed_len, seq) here
        seq = min(L, seq + prefill_chunk)
        lc.reserve(seq)
        lc.check_writable(lc.computed_len, seq)
        lc.computed_len = seq
        lc.free_out_of_window(seq)
        if seq < L:
            lc.commit(seq)
        yield seq == L
    committed = L + len(output) - 1
    lc.append(output)
    P = lc.page_size
    while seq < committed:
        seq += min(P - seq % P if seq % P else P, committed - seq)
        lc.decode_step(seq, seq)
        lc.computed_len = seq
        yield True
    lc.finish(committed)


class SyntheticEngine:
    """An engine without a model: every protocol step of a real one, no forward pass.

    Per request, through :class:`RequestLifecycle`: admission (``prefetch(wait_complete)`` when
    L3 is on, a locked ``match``, ``load`` when it reports host hits); chunked prefill (``alloc``
    per chunk, the chunk's out-of-window SWA freed, ``cache_unfinished`` after each chunk but the
    last); decode a page at a time (``alloc`` at each page boundary), freeing out-of-window SWA
    every ``swa_eviction_interval`` tokens and releasing the prefix's SWA lock once it is out of
    the window; ``cache_finished`` with the committed KV (the last sampled token is never
    forwarded) and the SWA frontier. The same steps as ``bench/multiturn.py``'s in-process
    replay, over the socket.

    A request refused for capacity (``out_of_memory``, ``quota_exceeded``, a prompt larger than
    the pool) is counted as failed and aborted, which gives back everything it held; if even
    that fails the session is closed (which does the same) and the next request reconnects. A
    protocol error that means a bug stops the run.
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
        self.prefill_chunk = fitting_chunk(info, spec.prefill_chunk)

    def _open(self) -> Client:
        return connect(self.spec.socket, self.spec.token,
                       f"radixd-bench-multiturn-{self.spec.client_index}")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def run_request(self, prompt: list[int], output_len: int) -> RequestOutcome:
        """Serve one request; capacity failures come back as ``failed`` outcomes."""
        out = RequestOutcome(prompt_len=len(prompt),
                             output=[self._rng.randrange(1, self.vocab_size)
                                     for _ in range(output_len)])
        if self._client is None:
            self._client = self._open()
        t0 = time.perf_counter()
        lc = RequestLifecycle(self._client, self.spec.model, prompt, use_l3=self.spec.l3,
                              swa_free_interval=self.spec.swa_eviction_interval,
                              label=f"client {self.spec.client_index}")
        try:
            self._serve(lc, out, t0)
        except (ConnectionLost, ShuttingDown) as exc:
            self.close()
            out.failed, out.error = True, f"connection lost: {exc}"
            self._client = self._open()  # BenchError when the daemon is gone for good
        except RadixdError as exc:
            if exc.code in FATAL_CODES:
                self.close()
                raise BenchError(f"the daemon failed a request: {_request_failed(lc, exc)}"
                                 ) from None
            out.failed, out.error = True, _request_failed(lc, exc)
            try:
                lc.abort()
            except RadixdError:
                self.close()  # the session's end returns every page and lock it held
        out.latency_s = time.perf_counter() - t0
        return out

    def _serve(self, lc: RequestLifecycle, out: RequestOutcome, t0: float) -> None:
        adm = lc.admit()
        out.l3_hit_len, out.fetched_len = adm.l3_hit_len, adm.fetched_len
        out.prefetch_status = adm.prefetch_status
        out.device_hit, out.host_hit_len, out.loaded_len = (
            adm.device_hit_len, adm.host_hit_len, adm.loaded_len)
        out.host_hit, out.l3_hit = split_loaded(adm.prefix_len - adm.device_hit_len,
                                                adm.host_hit_len, adm.fetched_len)
        out.prefill_tokens = lc.prompt_len - adm.prefix_len
        if lc.computed_len >= lc.prompt_len:  # all cached: decode starts at once
            out.ttft_s = time.perf_counter() - t0
        for prefilled in synthetic_steps(lc, out.output, self.prefill_chunk):
            if prefilled and out.ttft_s is None:
                out.ttft_s = time.perf_counter() - t0  # the first decode step starts now
        P = lc.page_size
        if lc.window is not None:
            out.swa_evicted_len = lc.swa_evicted_len
            out.swa_freed_tokens = lc.swa_pages_freed * P


def hf_engine_module() -> Any:
    """``examples.hf_engine``, or a BenchError that says what is missing.

    The example engine is not installed with the daemon (it needs torch and transformers and is
    meant to be read): it is imported from wherever ``examples`` is importable, which is a
    radixd source checkout that is the working directory of ``python -m daemon.cli`` or is on
    ``PYTHONPATH``.
    """
    try:
        return importlib.import_module("examples.hf_engine")
    except ImportError as exc:
        raise BenchError(f"--engine hf needs the HF transformers engine of examples/hf_engine, "
                         f"which cannot be imported ({type(exc).__name__}: {exc}); put a "
                         "radixd source checkout on PYTHONPATH with the 'hf' extra installed "
                         "(pip install -e '.[hf]'), or use --engine synthetic") from None
class HFEngine:
    """``--engine hf``: the engine of ``examples/hf_engine`` (a tiny random-weight hybrid Qwen2
    from HF transformers whose KV lives in the daemon's pools), one request at a time.

    That engine performs the protocol through the same :class:`RequestLifecycle` (prefetch, a
    locked match, load for host hits, chunked prefill, decode with SWA frees, cache_finished);
    this adapter times it and reads what its request's lifecycle recorded. The daemon's model
    must have the example model's KV layout (``python -m examples.hf_engine config`` prints such
    a configuration). Weights come from a fixed seed, so every client process runs the same
    model.
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
            probe = connect(s.socket, s.token, f"radixd-bench-multiturn-{s.client_index}")
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
            if exc.code in FATAL_CODES:
                raise BenchError(f"the daemon failed a request of the hf engine: {exc.code}: "
                                 f"{exc.message}") from None
            out.failed, out.error = True, f"{exc.code}: {exc.message}"
        out.latency_s = time.perf_counter() - t0
        if req is not None:
            out.output = list(req.output)
            adm = req.cache.admission
            out.host_hit_len, out.loaded_len = adm.host_hit_len, adm.loaded_len
            out.l3_hit_len, out.fetched_len = adm.l3_hit_len, adm.fetched_len
            out.prefetch_status = adm.prefetch_status
            out.device_hit = adm.device_hit_len
            out.host_hit, out.l3_hit = split_loaded(adm.prefix_len - adm.device_hit_len,
                                                    adm.host_hit_len, adm.fetched_len)
            out.prefill_tokens = len(prompt) - adm.prefix_len
            out.swa_evicted_len = req.cache.swa_evicted_len
            out.swa_freed_tokens = req.cache.swa_pages_freed * int(engine.page_size)
        # A request cut short still adds a full answer to the conversation, as in the replay.
        out.output += [self._rng.randrange(1, self.vocab_size)
                       for _ in range(output_len - len(out.output))]
        return out


def make_engine(kind: str, spec: EngineSpec) -> Engine:
    if kind == "hf":
        return HFEngine(spec)
    return SyntheticEngine(spec)


def as_outcome(obj: Any, prompt_len: int) -> RequestOutcome:
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
