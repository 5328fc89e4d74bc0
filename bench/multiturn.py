"""Multi-turn chat replay against the cache core (the shape of SGLang's bench_multiturn).

Each client starts with a prompt of ``first_prompt`` random tokens; every round it sends its whole
history, the engine prefills what was not cached, decodes ``output`` tokens, and the history grows
by the output plus a ``subq``-token sub-question. Rounds are separated by a barrier and clients
are served in the same order every round, the pattern that makes plain LRU evict exactly the
conversation asked for next.

The engine side is simulated faithfully at page granularity, through :class:`ModelCache` (the
same object the daemon serves): match+lock, allocate the prefill pages, decode a page at a time,
free out-of-window SWA pages during decode (when enabled, as SGLang does), release the prefix's SWA
lock once the request's own tokens cover the window, and ``cache_finished`` with the committed KV
(the last sampled token is never forwarded, so it has no KV).

Hit rate is SGLang's ``sum(cached tokens) / sum(prompt tokens)``; the ideal counts, for rounds
after the first, the page-aligned previous prompt plus its committed output.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

from daemon.gpu.allocator import OutOfPages
from daemon.gpu.profile import ModelProfile
from daemon.model_cache import ModelCache
from daemon.tree.policy import DEFAULT_POLICY
from daemon.workload import Workload


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
    history = [[rng.randrange(1, 50000) for _ in range(w.first_prompt)] for _ in range(w.clients)]
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
            history[c] = history[c] + out + [rng.randrange(1, 50000) for _ in range(w.subq)]
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


def _request(cache: ModelCache, usage: _Usage, w: Workload, client: int, prompt: list[int],
             rng: random.Random, swa_free: bool, stats: dict
             ) -> Generator[None, None, tuple[int, list[int]]]:
    P = w.page_size
    owner = client
    out = [rng.randrange(1, 50000) for _ in range(w.output)]
    tokens = array("i", prompt)
    res, rid = cache.match(owner, "default", tokens.tobytes(), lock=True)
    L = len(prompt)
    stats["hit"] += res.prefix_len
    stats["prompt"] += L
    stats["prefill"] += L - res.prefix_len
    prev = res.prefix_len
    full: list[int] = []
    swa: list[int] = []
    frontier = prev  # swa_evicted_len: SWA below it was freed (the tree owns [0, prev))
    swa_released = False

    def grow(n_tokens: int) -> None:
        need = -(-n_tokens // P) - prev // P - len(full)
        if need > 0:
            f, s = cache.alloc(owner, need)
            full.extend(f)
            swa.extend(s if len(s) else [0] * need)
            usage.sample()

    def free_out_of_window(seq_len: int) -> None:
        nonlocal frontier
        threshold = seq_len - -(-max(w.window, P) // P) * P
        new = max(frontier, threshold) // P * P
        if new > frontier:
            lo, hi = (frontier - prev) // P, (new - prev) // P
            pages = [p for p in swa[lo:hi] if p]
            cache.free(owner, swa=pages)
            for i in range(lo, hi):
                swa[i] = 0
            frontier = new

    try:
        seq = prev
        while seq < L:  # chunked prefill
            seq = min(L, seq + w.prefill_chunk)
            grow(seq)
            if swa_free:
                free_out_of_window(seq)
            if seq < L:
                ins, rid = cache.cache_unfinished(owner, "default", tokens[:seq].tobytes(), full,
                                                  swa, prev, frontier, rid)
                k = (ins.inserted_len - prev) // P
                del full[:k]
                del swa[:k]
                prev = ins.inserted_len
                frontier = max(frontier, prev)
            yield
        committed = L + w.output - 1
        last_free = L
        while seq < committed:
            step = min(P - seq % P if seq % P else P, committed - seq)
            seq += step
            grow(seq)
            if swa_free and not swa_released and seq - prev >= w.window + P:
                cache.release_swa(owner, rid)
                swa_released = True
            if swa_free and seq - last_free >= w.swa_eviction_interval:
                free_out_of_window(seq)
                last_free = seq
            yield
        final = array("i", prompt + out)[:committed]
        cache.cache_finished(owner, "default", final.tobytes(), full, swa, prev, frontier, rid)
    except OutOfPages:
        stats["failed"] += 1
        cache.release_owner(owner)
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
