"""Multi-turn chat replay against the cache core (the shape of SGLang's bench_multiturn).

Each client starts with a prompt of ``first_prompt`` random tokens; every round it sends its whole
history, the engine prefills what was not cached, decodes ``output`` tokens, and the history grows
by the output plus a ``subq``-token sub-question. Rounds are separated by a barrier and clients
are served in the same order every round, the pattern that makes plain LRU evict exactly the
conversation asked for next.

The engine side is the socket bench's synthetic engine (``radixd_bench.engines.synthetic_steps``
over :class:`radixd_client.lifecycle.RequestLifecycle`), pointed at :class:`ModelCache` (the
same object the daemon serves) through :class:`_InProcessClient` instead of a socket: match+lock,
allocate the prefill pages, decode a page at a time, free out-of-window SWA pages during decode
(when enabled, as SGLang does), release the prefix's SWA lock once it is out of the window, and
``cache_finished`` with the committed KV (the last sampled token is never forwarded, so it has
no KV).

Hit rate is SGLang's ``sum(cached tokens) / sum(prompt tokens)``; the ideal counts, for rounds
after the first, the page-aligned previous prompt plus its committed output.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from radixd_client.lifecycle import RequestLifecycle

from daemon.gpu.allocator import OutOfPages
from daemon.gpu.profile import ModelProfile
from daemon.model_cache import ModelCache
from daemon.tree.policy import DEFAULT_POLICY
from radixd_bench.engines import synthetic_steps
from radixd_bench.options import SYNTHETIC_VOCAB
from radixd_bench.workload import Workload

MODEL = "multiturn"
NAMESPACE = "default"


@dataclass
class RunResult:
    hit_rate: float
    round_hit_rates: list[float]
    peak_full_pages: int
    peak_swa_pages: int
    full_capacity: int
    swa_capacity: int
    failed_requests: int
    prefill_tokens_per_round: list[int] = field(default_factory=list)

    @property
    def late_hit_rate(self) -> float:
        last = self.round_hit_rates[-3:]
        return sum(last) / len(last)


class _Usage:
    def __init__(self, cache: ModelCache):
        self.cache = cache
        self.peak_full = 0
        self.peak_swa = 0

    def sample(self) -> None:
        a = self.cache.alloc_state
        self.peak_full = max(self.peak_full, a.full.usable - a.full.available)
        if a.swa is not None:
            self.peak_swa = max(self.peak_swa, a.swa.usable - a.swa.available)


def run(w: Workload, full_pages: int, *, swa_free: bool = True,
        policy: str = DEFAULT_POLICY) -> RunResult:
    """Replay the workload on a fresh cache with ``full_pages`` usable full pages."""
    P = w.page_size
    profile = ModelProfile(
        name="multiturn", page_size=P, num_full_layers=1, num_kv_heads=1, head_dim=1,
        full_pages=full_pages + 1, sliding_window=w.window, num_swa_layers=1,
        swa_pages=max(2, int(full_pages * w.swa_ratio)) + 1, dtype="float32", device="cpu")
    cache = ModelCache(profile, policy=policy)
    usage = _Usage(cache)
    rng = random.Random(w.seed)
    history = [[rng.randrange(1, SYNTHETIC_VOCAB) for _ in range(w.first_prompt)]
               for _ in range(w.clients)]
    round_rates: list[float] = []
    prefill: list[int] = []
    hit_total = prompt_total = 0
    failed = 0
    for _r in range(w.rounds):
        stats = {"hit": 0, "prompt": 0, "prefill": 0, "failed": 0}
        reqs = [_request(cache, usage, w, c, history[c], rng, swa_free, stats)
                for c in range(w.clients)]
        outputs = _schedule(reqs, w.max_parallel)
        for c, out in outputs.items():
            history[c] = history[c] + out + [rng.randrange(1, SYNTHETIC_VOCAB)
                                             for _ in range(w.subq)]
        round_rates.append(stats["hit"] / stats["prompt"])
        prefill.append(stats["prefill"])
        hit_total += stats["hit"]
        prompt_total += stats["prompt"]
        failed += stats["failed"]
    violations = cache.check(deep=False)
    if violations:
        raise AssertionError(f"invariant violations after the replay: {violations[:5]}")
    a = cache.alloc_state
    return RunResult(hit_total / prompt_total, round_rates, usage.peak_full, usage.peak_swa,
                     a.full.usable, a.swa.usable if a.swa is not None else 0, failed, prefill)


def _schedule(reqs: list[Generator[None, None, tuple[int, list[int]]]], max_parallel: int
              ) -> dict[int, list[int]]:
    """Run request coroutines interleaved a page at a time, at most ``max_parallel`` at once."""
    pending: Iterator = iter(reqs)
    active: list = []
    done: dict[int, list[int]] = {}
    while True:
        while len(active) < max_parallel:
            nxt = next(pending, None)
            if nxt is None:
                break
            active.append(nxt)
        if not active:
            return done
        for g in list(active):
            try:
                next(g)
            except StopIteration as stop:
                c, out = stop.value
                done[c] = out
                active.remove(g)


class _Done:
    """A batch operation's outcome: the in-process cache answers at once."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value

    def exception(self) -> None:
        return None


class _InProcessBatch:
    """``client.batch()`` for :class:`_InProcessClient`: each operation runs when queued, in
    order, as the daemon runs a batch's operations (an error raises at once)."""

    def __init__(self, client: _InProcessClient) -> None:
        self._client = client

    def __enter__(self) -> _InProcessBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __getattr__(self, op: str) -> Any:
        call = getattr(self._client, op)
        return lambda *a, **k: _Done(call(*a, **k))


def _b(ids: Iterable[int]) -> bytes:
    return array("i", ids).tobytes()


class _InProcessClient:
    """The ``Client`` methods :class:`RequestLifecycle` uses, answered by a :class:`ModelCache`
    for one owner: the replay runs the socket bench's engine without a socket, so both measure
    the same protocol steps. Results carry page ids as int32 bytes, as the daemon sends them."""

    def __init__(self, cache: ModelCache, usage: _Usage, owner: int, w: Workload) -> None:
        self.cache, self.usage, self.owner = cache, usage, owner
        self.models = {MODEL: SimpleNamespace(page_size=w.page_size, sliding_window=w.window,
                                              swa_pages=cache.alloc_state.swa is not None)}

    def match(self, model: str, tokens: bytes, lock: bool = False) -> Any:
        res, rid = self.cache.match(self.owner, NAMESPACE, tokens, lock=lock)
        return SimpleNamespace(prefix_len=res.prefix_len, full_pages=_b(res.full_pages),
                               swa_pages=_b(res.swa_pages), full_hit_len=res.full_hit_len,
                               host_hit_len=0, receipt=rid)  # no host tier in process

    def alloc(self, model: str, n: int) -> Any:
        full, swa = self.cache.alloc(self.owner, n)
        self.usage.sample()
        return SimpleNamespace(full_pages=_b(full), swa_pages=_b(swa))

    def free(self, model: str, full_pages: Iterable[int] = (), swa_pages: Iterable[int] = ()
             ) -> None:
        self.cache.free(self.owner, full_pages, swa_pages)

    def release_swa(self, model: str, receipt: int) -> None:
        self.cache.release_swa(self.owner, receipt)

    def unlock(self, model: str, receipt: int) -> None:
        self.cache.unlock(self.owner, receipt)

    def _insert(self, fn: Any, tokens: bytes, full: list[int], swa: list[int], prev: int,
                frontier: int, receipt: int | None) -> Any:
        res = fn(self.owner, NAMESPACE, tokens, array("i", full), array("i", swa), prev,
                 frontier, receipt)
        res, rid = res if isinstance(res, tuple) else (res, None)
        return SimpleNamespace(prefix_len=res.prefix_len, inserted_len=res.inserted_len,
                               full_pages=_b(res.full_pages), swa_pages=_b(res.swa_pages),
                               receipt=rid)

    def cache_unfinished(self, model: str, *args: Any) -> Any:
        return self._insert(self.cache.cache_unfinished, *args)

    def cache_finished(self, model: str, *args: Any) -> Any:
        return self._insert(self.cache.cache_finished, *args)

    def batch(self, stop_on_error: bool = True) -> _InProcessBatch:
        return _InProcessBatch(self)


def _request(cache: ModelCache, usage: _Usage, w: Workload, client: int, prompt: list[int],
             rng: random.Random, swa_free: bool, stats: dict
             ) -> Generator[None, None, tuple[int, list[int]]]:
    out = [rng.randrange(1, SYNTHETIC_VOCAB) for _ in range(w.output)]
    lc = RequestLifecycle(_InProcessClient(cache, usage, client, w), MODEL, prompt,
                          swa_free_interval=w.swa_eviction_interval, free_swa=swa_free,
                          label=f"client {client}")
    try:
        prefix = lc.admit().prefix_len
        stats["hit"] += prefix
        stats["prompt"] += len(prompt)
        stats["prefill"] += len(prompt) - prefix
        for _ in synthetic_steps(lc, out, w.prefill_chunk):
            yield
    except OutOfPages:
        stats["failed"] += 1
        cache.release_owner(client)
    return client, out


def figures(quick: bool = False, policy: str = DEFAULT_POLICY) -> dict[str, float]:
    """The multi-turn figures of the tree benchmark (roomy and 40% pools, SWA freeing on/off)."""
    w = Workload()
    ws = w.working_set_pages()
    out: dict[str, float] = {"multiturn_ideal_hit_rate": round(w.ideal_hit_rate(), 4),
                             "multiturn_working_set_pages": ws}
    for pool_name, pages in (("roomy", int(ws * 1.3) + 1024), ("pressure", int(ws * 0.4))):
        for swa_free in (True, False):
            r = run(w, pages, swa_free=swa_free, policy=policy)
            tag = f"{pool_name}_{'swafree' if swa_free else 'noswafree'}"
            out[f"multiturn_hit_rate_{tag}"] = round(r.hit_rate, 4)
            out[f"multiturn_peak_swa_usage_{tag}"] = round(r.peak_swa_pages / r.swa_capacity, 4)
            out[f"multiturn_peak_full_usage_{tag}"] = round(r.peak_full_pages / r.full_capacity, 4)
            out[f"multiturn_peak_swa_pages_{tag}"] = r.peak_swa_pages
            out[f"multiturn_failed_requests_{tag}"] = r.failed_requests
            out[f"multiturn_late_hit_rate_{tag}"] = round(r.late_hit_rate, 4)
            if pool_name == "pressure" and swa_free:
                out["multiturn_pressure_late_hit_rate"] = round(r.late_hit_rate, 4)
                for i, x in enumerate(r.round_hit_rates):
                    out[f"multiturn_pressure_round{i}_hit_rate"] = round(x, 4)
                # the baseline the policy exists to beat, in the same run
                base = run(w, pages, swa_free=True, policy="lru")
                out["multiturn_pressure_late_hit_rate_lru"] = round(base.late_hit_rate, 4)
                out["multiturn_hit_rate_pressure_swafree_lru"] = round(base.hit_rate, 4)
    roomy = out["multiturn_hit_rate_roomy_swafree"]
    out["multiturn_hit_rate"] = roomy
    out["multiturn_peak_swa_usage"] = out["multiturn_peak_swa_usage_roomy_swafree"]
    out["multiturn_peak_full_usage"] = out["multiturn_peak_full_usage_roomy_swafree"]
    off = out["multiturn_peak_swa_pages_roomy_noswafree"]
    out["multiturn_swa_peak_ratio_free_vs_nofree"] = round(
        out["multiturn_peak_swa_pages_roomy_swafree"] / off, 4) if off else 0.0
    return out


if __name__ == "__main__":
    import json
    import sys
    import time

    t = time.perf_counter()
    pol = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_POLICY
    print(json.dumps(figures(policy=pol), indent=1))
    print(f"{time.perf_counter() - t:.1f}s")
