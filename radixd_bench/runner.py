"""The run of ``radixd bench multiturn``: one process per client, the sender, the pool sampler.

* one OS process per client (``multiprocessing``, spawn), each with its own session: clients hold
  locks and pages concurrently, exactly like separate engine processes;
* the parent is the sender of ``bench_multiturn``: it releases requests at ``request_rate``
  (Poisson or uniform gaps; unlimited by default), keeps at most ``max_parallel`` in flight, and
  with the round barrier (the default) starts round r+1 only once every client finished round r,
  serving the clients in the same order every round (the pattern that defeats plain LRU);
* each client owns its conversation: the first prompt is ``first_prompt`` random tokens, and
  after every answer the history grows by the ``output`` generated tokens plus a ``subq``-token
  sub-question, so round r sends ``first_prompt + r * (output + subq)`` tokens.

Pool usage is polled with the ``stats`` operation from a separate session of the parent (tree
plus session-held pages of the tenant's namespace, every ``sample_interval_s`` and at every
request's end), so a peak inside a request that lasts less than one interval can be missed; the
report says so in ``pool.source``.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import queue
import random
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, TextIO

from radixd_client.errors import RadixdError

from .engines import as_outcome, connect, hf_engine_module, make_engine
from .options import (
    OP_TIMEOUT_S,
    BenchError,
    BenchUsageError,
    EngineSpec,
    Options,
)
from .report import build_report
from .workload import Workload

__all__ = ["ProgressBar", "run"]


# ---------------------------------------------------------------------------- client process


def _client_main(index: int, spec: EngineSpec, engine_kind: str, first_prompt: int,
                 subq: int, go: Any, results: Any) -> None:
    """One client: its engine, its conversation; runs a request per message on ``go``."""
    try:
        try:
            engine = make_engine(engine_kind, spec)
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
                    res = as_outcome(engine.run_request(history, output_len), len(history))
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
        self.client = connect(socket_path, token, "radixd-bench-multiturn-sampler")
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
    main = connect(opts.socket, opts.token, "radixd-bench-multiturn")
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
    return build_report(opts, seed, model, info, instance, wl, records,
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
