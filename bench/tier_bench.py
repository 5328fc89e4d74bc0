"""Benchmark of the memory tiers: page copies between them, and what they do for the hit rate.

Usage (from the repository root)::

    python bench/tier_bench.py [--quick] [--json out.json] [--redis URL]

Three parts, each against a baseline measured in the same run:

* **L1 <-> L2** (device pool <-> host pool): ``bench/host_copy_bench.py`` as it is (the same
  profile, batch and timing), i.e. ``l1_to_l2_gbps`` / ``l2_to_l1_gbps`` against ``memcpy_gbps``,
  a plain tensor copy of the same bytes, and their ratios.
* **L2 <-> L3** (host <-> Redis): ``RedisTier.set_pages`` / ``get_pages`` (pipelined, checksummed,
  behind the circuit breaker) of codec-encoded values of one real page each (the same profile: 32
  layers, 8 KV heads, head_dim 128, bfloat16, page size 16, 2 MiB per page), against a bare
  redis-py asyncio pipeline of SET / GET of the very same keys and values through the same client
  (same connection pool and settings). The raw baseline is the faster of two ways: one pipeline
  of every command, and the tier's own batching (at most 64 commands and 16 MiB per pipeline, 4
  pipelines at once) without the codec, the checks and the breaker; both are reported.
  ``get_pages`` includes the verification of every value (that is part of the tier). Figures
  are bytes of values per second, the median of several repetitions after a warm-up, the
  operations interleaved so drift hits all alike.
* **Hit rate**: the multi-turn workload of ``bench/multiturn.py`` (10 clients x 10 rounds, first
  prompt 300, output 3000, sub-question 300, page 64, window 128) replayed by ``radixd_bench``
  (``radixd bench multiturn``) against a real ``radixd serve`` started here (temporary config and
  socket), with the device pool holding 40% of the working set: ``hit_rate_l1_only`` (no host
  tier), ``hit_rate_l1_l2`` (host tier larger than the working set), ``hit_rate_l1_l2_l3`` (host
  tier at half the working set, Redis behind it under a unique key prefix that is deleted
  afterwards; every request prefetches with ``wait_complete`` first), and ``hit_rate_ideal``, what
  an infinite cache would hit. ``*_device``, ``*_host``, ``*_l3`` split each hit rate by tier.

Targets: tier copies at >= 0.8 of their raw baseline; ``hit_rate_l1_l2_l3`` within 0.02 of the
ideal. A part that cannot run (no Redis, a daemon without the tier operations) is reported with
its error and the script exits 1.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Only light imports at module level: the multi-turn clients are spawned processes, which import
# this file again (as __mp_main__); torch and the daemon load inside the functions that use them.
import argparse  # noqa: E402
import asyncio  # noqa: E402
import secrets  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from bench._common import write_json  # noqa: E402

REDIS_URL = "redis://127.0.0.1:6379/0"
DEVICE_FRACTION = 0.4  # device pool / working set
HOST_ROOMY = 1.25  # host pool / working set, L1+L2
HOST_SMALL = 0.5  # host pool / working set, L1+L2+L3
REDIS_OP_TIMEOUT_S = 10.0  # one pipeline of many 2 MiB values is legitimately slow
REDIS_CONCURRENCY = 4  # pipelines at once, the tier's default
TARGETS: dict[str, tuple[str, float]] = {
    "l1_to_l2_ratio": (">=", 0.8),
    "l2_to_l1_ratio": (">=", 0.8),
    "l2_to_l3_ratio": (">=", 0.8),
    "l3_to_l2_ratio": (">=", 0.8),
    "hit_rate_l1_l2_l3_gap_to_ideal": ("<=", 0.02),
}


# ---------------------------------------------------------------------------- L1 <-> L2


def copy_figures(quick: bool) -> dict[str, Any]:
    """The host copy benchmark's figures, unchanged (its run, its baseline)."""
    from bench import host_copy_bench

    hc = host_copy_bench.run(quick)
    keys = ("device", "host_memory", "page_bytes", "batch_pages", "l1_to_l2_gbps",
            "l2_to_l1_gbps", "memcpy_gbps", "memcpy_d2h_gbps", "memcpy_h2d_gbps",
            "l1_to_l2_ratio", "l2_to_l1_ratio", "verified")
    out = {k: hc[k] for k in keys}
    out["copy_device"] = out.pop("device")
    out["copy_verified"] = out.pop("verified")
    return out


# ---------------------------------------------------------------------------- L2 <-> L3


async def _median_time(fns: dict[str, Callable[[], Awaitable[None]]], reps: int
                       ) -> dict[str, float]:
    """Median seconds of each coroutine function; one warm-up each, then ``reps`` rounds with
    the order rotated every round."""
    for fn in fns.values():
        await fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            await fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


async def _redis_figures(quick: bool, url: str) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from bench.host_copy_bench import LAYOUT
    from daemon.gpu.profile import ModelProfile
    from daemon.storage.codec import POOL_FULL, encode_page
    from daemon.storage.redis_tier import RedisTier

    n = 32 if quick else 128  # pages: 64 MiB / 256 MiB of values
    reps = 3 if quick else 7
    profile = ModelProfile(name="bench", device="cpu", full_pages=2, **LAYOUT)
    fingerprint = profile.layout_fingerprint()
    page_bytes = profile.full_page_bytes
    payload = os.urandom(page_bytes)
    hashes = [secrets.token_bytes(32) for _ in range(n)]
    t0 = time.perf_counter()
    values = [encode_page(pool=POOL_FULL, page_hash=h, fingerprint=fingerprint,
                          tokens=range(i * LAYOUT["page_size"], (i + 1) * LAYOUT["page_size"]),
                          payload=payload) for i, h in enumerate(hashes)]
    encode_s = time.perf_counter() - t0
    nbytes = sum(len(v) for v in values)
    # One client, one pool, one set of settings for both the tier and the raw pipeline.
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=32, timeout=REDIS_OP_TIMEOUT_S, socket_timeout=REDIS_OP_TIMEOUT_S,
        socket_connect_timeout=1.0, socket_keepalive=True, decode_responses=False)
    client = aioredis.Redis.from_pool(pool)
    prefix = f"radixd-tierbench-{secrets.token_hex(6)}:"
    tier = RedisTier(url, key_prefix=prefix, op_timeout=REDIS_OP_TIMEOUT_S, client=client,
                     concurrency=REDIS_CONCURRENCY)
    keys = [tier.key(h, POOL_FULL) for h in hashes]
    # The tier's own batching (commands and bytes per pipeline, pipelines at once), for the raw
    # baseline that gets the same help.
    set_chunks: list[list[int]] = [[]]
    size = 0
    for i, v in enumerate(values):
        if set_chunks[-1] and (len(set_chunks[-1]) >= tier.max_pipeline
                               or size + len(v) > tier.max_pipeline_bytes):
            set_chunks.append([])
            size = 0
        set_chunks[-1].append(i)
        size += len(v)
    get_chunks = [list(range(i, min(i + tier.max_pipeline, n)))
                  for i in range(0, n, tier.max_pipeline)]
    sem = asyncio.Semaphore(REDIS_CONCURRENCY)
    try:
        try:
            await client.ping()
        except Exception as exc:  # noqa: BLE001 - reported as the part's error
            raise RuntimeError(f"Redis at {url} does not answer: {type(exc).__name__}: {exc}"
                               ) from None

        async def set_pipe(idx: list[int]) -> None:
            async with sem:
                pipe = client.pipeline(transaction=False)
                for i in idx:
                    pipe.set(keys[i], values[i])
                replies = await pipe.execute()
            assert all(replies), "raw SET failed"

        async def get_pipe(idx: list[int]) -> None:
            async with sem:
                pipe = client.pipeline(transaction=False)
                for i in idx:
                    pipe.get(keys[i])
                replies = await pipe.execute()
            assert all(r is not None and len(r) == len(values[i])
                       for i, r in zip(idx, replies, strict=True)), "raw GET missed"

        async def raw_set() -> None:
            await set_pipe(list(range(n)))

        async def raw_set_chunked() -> None:
            await asyncio.gather(*(set_pipe(c) for c in set_chunks))

        async def raw_get() -> None:
            await get_pipe(list(range(n)))

        async def raw_get_chunked() -> None:
            await asyncio.gather(*(get_pipe(c) for c in get_chunks))

        async def tier_set() -> None:
            stored = await tier.set_pages(values)
            assert stored == n, f"set_pages stored {stored} of {n}: {tier.stats}"

        async def tier_get() -> None:
            got = await tier.get_pages(hashes, POOL_FULL, fingerprint)
            missing = sum(v is None for v in got)
            assert not missing, f"get_pages missed {missing} of {n}: {tier.stats}"

        # SETs first (the GETs read what they wrote), each pair interleaved.
        sets = await _median_time({"raw": raw_set, "raw_chunked": raw_set_chunked,
                                   "tier": tier_set}, reps)
        gets = await _median_time({"raw": raw_get, "raw_chunked": raw_get_chunked,
                                   "tier": tier_get}, reps)
        stats = tier.stats
    finally:
        try:
            await tier.delete(hashes, POOL_FULL)
        finally:
            await tier.aclose()
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    raw_set_s = min(sets["raw"], sets["raw_chunked"])  # the baseline: the better raw way
    raw_get_s = min(gets["raw"], gets["raw_chunked"])
    return {
        "redis_pages": n,
        "redis_value_bytes": len(values[0]),
        "l2_to_l3_gbps": gbps(sets["tier"]),
        "l3_to_l2_gbps": gbps(gets["tier"]),
        "redis_raw_set_gbps": gbps(raw_set_s),
        "redis_raw_get_gbps": gbps(raw_get_s),
        "redis_raw_set_one_pipeline_gbps": gbps(sets["raw"]),
        "redis_raw_set_batched_gbps": gbps(sets["raw_chunked"]),
        "redis_raw_get_one_pipeline_gbps": gbps(gets["raw"]),
        "redis_raw_get_batched_gbps": gbps(gets["raw_chunked"]),
        "l2_to_l3_ratio": raw_set_s / sets["tier"],
        "l3_to_l2_ratio": raw_get_s / gets["tier"],
        "codec_encode_gbps": gbps(encode_s),
        "redis_tier_errors": stats["errors"] + stats["timeouts"] + stats["corrupt"],
    }


def redis_figures(quick: bool, url: str) -> dict[str, Any]:
    """L2 <-> L3 through RedisTier against the raw redis-py pipeline (see the module doc)."""
    return asyncio.run(_redis_figures(quick, url))


# ---------------------------------------------------------------------------- a real daemon


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(v)


def _toml(config: dict[str, Any]) -> str:
    lines: list[str] = []
    for section, body in config.items():
        tables = body if isinstance(body, list) else [body]
        for table in tables:
            lines.append(f"[[{section}]]" if isinstance(body, list) else f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
            lines.append("")
    return "\n".join(lines)


class Daemon:
    """``radixd serve`` in a subprocess, with its config, socket and log in a temp folder."""

    def __init__(self, folder: Path, config: dict[str, Any]) -> None:
        self.socket = str(folder / "radixd.sock")
        config = {"server": {"socket": self.socket}, **config}
        self.config_path = folder / "radixd.toml"
        self.config_path.write_text(_toml(config))
        self.log_path = folder / "radixd.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli", "serve", "--config", str(self.config_path)],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=_ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"radixd exited with {self.proc.returncode} at start:\n"
                                   f"{self.log_tail()}")
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(self.socket)
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"radixd did not come up:\n{self.log_tail()}") from None
                time.sleep(0.05)

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _delete_prefix(url: str, prefix: str) -> int:
    """Remove every key under ``prefix`` (what the L3 run left in Redis)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=REDIS_OP_TIMEOUT_S)
    try:
        removed = 0
        batch: list[bytes] = []
        for key in client.scan_iter(match=prefix + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                removed += client.unlink(*batch)
                batch.clear()
        if batch:
            removed += client.unlink(*batch)
        return removed
    finally:
        client.close()


# ---------------------------------------------------------------------------- hit rates


def _workload(quick: bool) -> Any:
    from radixd_bench.workload import Workload

    if quick:  # the same shape, fewer and shorter conversations
        return Workload(clients=6, rounds=6, output=1500)
    return Workload()


def hit_rate_figures(quick: bool, url: str) -> dict[str, Any]:
    """The multi-turn replay through a real daemon with L1 only, L1+L2, L1+L2+L3."""
    from radixd_bench import multiturn as mt

    w = _workload(quick)
    ws = w.working_set_pages()
    device = int(ws * DEVICE_FRACTION)
    model = {
        "name": "mt", "page_size": w.page_size, "sliding_window": w.window,
        "num_full_layers": 1, "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 8,
        "dtype": "float16", "device": "cpu", "full_pages": device + 1,
        "swa_pages": max(2, int(device * w.swa_ratio)) + 1,
    }
    roomy, small = int(ws * HOST_ROOMY) + 16, int(ws * HOST_SMALL)
    prefix = f"radixd-tierbench-{secrets.token_hex(6)}"
    runs = {
        "l1_only": ({"host_pages": 0, "host_swa_pages": 0, "l3": False}, None),
        "l1_l2": ({"host_pages": roomy, "host_swa_pages": roomy, "l3": False}, None),
        "l1_l2_l3": ({"host_pages": small, "host_swa_pages": max(64, small // 4), "l3": True},
                     {"url": url, "key_prefix": prefix}),
    }
    out: dict[str, Any] = {
        "multiturn_clients": w.clients, "multiturn_rounds": w.rounds,
        "multiturn_working_set_pages": ws, "multiturn_device_pages": device,
        "multiturn_host_pages_l1_l2": roomy, "multiturn_host_pages_l1_l2_l3": small,
        "hit_rate_ideal": w.ideal_hit_rate(),
    }
    for name, (tiers, l3) in runs.items():
        config: dict[str, Any] = {
            "admin": {"enabled": False},
            "checker": {"interval_s": 2.0, "strict": True},
            "models": [{**model, **tiers}],
        }
        if l3 is not None:
            config["l3"] = l3
        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="radixd-tierbench-") as tmp:
            daemon = None
            try:
                daemon = Daemon(Path(tmp), config)
                report = mt.run(mt.Options(
                    socket=daemon.socket, clients=w.clients, rounds=w.rounds,
                    first_prompt=w.first_prompt, output=w.output, subq=w.subq,
                    max_parallel=w.max_parallel, prefill_chunk=w.prefill_chunk,
                    swa_eviction_interval=w.swa_eviction_interval, seed=w.seed,
                    l3=l3 is not None))
                tot = report["total"]
                out[f"hit_rate_{name}"] = tot["hit_rate"]
                out[f"hit_rate_{name}_device"] = tot["device_hit_rate"]
                out[f"hit_rate_{name}_host"] = tot["host_hit_rate"]
                out[f"hit_rate_{name}_l3"] = tot["l3_hit_rate"]
                out[f"failed_requests_{name}"] = tot["failed"]
                out[f"peak_full_usage_{name}"] = report["pool"]["peak_full_usage"]
            except (mt.BenchError, mt.BenchUsageError, RuntimeError) as exc:
                out[f"hit_rate_{name}"] = None
                out[f"error_{name}"] = str(exc).splitlines()[0]
            finally:
                if daemon is not None:
                    code = daemon.stop()
                    if code != 0 and f"error_{name}" not in out:
                        out[f"error_{name}"] = f"radixd exited with {code}: {daemon.log_tail(5)}"
                if l3 is not None:
                    try:
                        out["l3_keys_cleaned"] = _delete_prefix(url, prefix)
                    except Exception as exc:  # noqa: BLE001 - reported, never fatal
                        out["l3_cleanup_error"] = f"{type(exc).__name__}: {exc}"
        print(f"  hit rate {name}: {out[f'hit_rate_{name}']} in {time.perf_counter() - t:.1f} s",
              file=sys.stderr)
    got = out.get("hit_rate_l1_l2_l3")
    out["hit_rate_l1_l2_l3_gap_to_ideal"] = (out["hit_rate_ideal"] - got
                                             if got is not None else None)
    return out


# ---------------------------------------------------------------------------- driver


def run(quick: bool, url: str = REDIS_URL) -> dict[str, Any]:
    """Every figure, flat; a part that fails leaves ``error_<part>`` and None figures."""
    figures: dict[str, Any] = {}
    parts: list[tuple[str, Callable[[], dict[str, Any]], tuple[str, ...]]] = [
        ("l1_l2_copy", lambda: copy_figures(quick),
         ("l1_to_l2_gbps", "l2_to_l1_gbps", "memcpy_gbps", "l1_to_l2_ratio", "l2_to_l1_ratio")),
        ("l2_l3_copy", lambda: redis_figures(quick, url),
         ("l2_to_l3_gbps", "l3_to_l2_gbps", "redis_raw_set_gbps", "redis_raw_get_gbps",
          "l2_to_l3_ratio", "l3_to_l2_ratio")),
        ("hit_rate", lambda: hit_rate_figures(quick, url), ()),
    ]
    for name, fn, names in parts:
        t = time.perf_counter()
        print(f"tier_bench: {name}{' (quick)' if quick else ''}", file=sys.stderr)
        try:
            figures.update(fn())
        except Exception as exc:  # noqa: BLE001 - one part failing must not hide the others
            figures[f"error_{name}"] = f"{type(exc).__name__}: {exc}"
            figures.update(dict.fromkeys(names))
        print(f"  {name} done in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return figures


def _unit(name: str) -> str:
    if name.endswith("_gbps"):
        return "GB/s"
    if name.endswith("_bytes"):
        return "B"
    if "_pages" in name:
        return "pages"
    return ""


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool) or isinstance(v, str):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.3f}" if abs(v) < 100 else f"{v:,.1f}"


def format_table(figures: dict[str, Any]) -> str:
    """Figures with their targets; errors listed after the table."""
    rows = [("figure", "value", "unit", "target", "")]
    errors = []
    for name, v in figures.items():
        if name.startswith("error_") or name.endswith("_error"):
            errors.append(f"{name}: {v}")
            continue
        tgt = TARGETS.get(name)
        status = ""
        if tgt is not None:
            if v is None:
                status = "NOT MEASURED"
            else:
                status = "ok" if (v >= tgt[1] if tgt[0] == ">=" else v <= tgt[1]) else "MISS"
        rows.append((name, _fmt(v), _unit(name), f"{tgt[0]} {tgt[1]:g}" if tgt else "", status))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w[i]) if i == 1 else c.ljust(w[i])
                               for i, c in enumerate(r)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * x for x in w))
    ratios = []
    for tier, raw, label in (("l1_to_l2_gbps", "memcpy_gbps", "L1->L2 / memcpy"),
                             ("l2_to_l1_gbps", "memcpy_gbps", "L2->L1 / memcpy"),
                             ("l2_to_l3_gbps", "redis_raw_set_gbps", "L2->L3 / raw SET"),
                             ("l3_to_l2_gbps", "redis_raw_get_gbps", "L3->L2 / raw GET")):
        a, b = figures.get(tier), figures.get(raw)
        if a is not None and b:
            ratios.append(f"  {label}: {a:.2f} / {b:.2f} GB/s = {a / b:.2f}")
    ideal = figures.get("hit_rate_ideal")
    if ideal:
        for name in ("l1_only", "l1_l2", "l1_l2_l3"):
            v = figures.get(f"hit_rate_{name}")
            if v is not None:
                ratios.append(f"  hit rate {name} / ideal: {v:.4f} / {ideal:.4f} = "
                              f"{v / ideal:.3f}")
    out = lines + ["", "ratios:"] + ratios
    if errors:
        out += ["", "not measured:"] + [f"  {e}" for e in errors]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smaller copies, fewer repetitions, a shorter multi-turn workload")
    ap.add_argument("--json", metavar="PATH", help="write the figures as a flat JSON object")
    ap.add_argument("--redis", default=REDIS_URL, metavar="URL",
                    help=f"Redis for the L3 parts (default {REDIS_URL}); keys go under a unique "
                         "prefix and are deleted afterwards")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    figures = run(args.quick, args.redis)
    print(format_table(figures))
    print(f"total {time.perf_counter() - t:.1f} s")
    if args.json:
        write_json(args.json, figures)
    failed = any(k.startswith("error_") for k in figures) or figures.get("copy_verified") is False
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
