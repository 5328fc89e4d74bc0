"""`radixd bench multiturn` (radixd_bench): a tiny workload against a real daemon, the
report's figures checked for consistency, and the exit codes of bad arguments and a missing daemon.

Every daemon here comes from tests/daemon/conftest.py's ``make_daemon``: strict checker, a full
invariant check and a clean exit at teardown, so each run is also a check that the protocol steps
of the synthetic engine leave the cache consistent.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest
from radixd_client import protocol as P

from daemon import cli
from radixd_bench import engines
from radixd_bench import multiturn as mt
from tests.harness import daemon_conftest

REPO = Path(__file__).resolve().parents[1]

make_daemon = daemon_conftest().make_daemon  # the fixture, reused

MODEL = {
    "name": "m", "page_size": 4, "sliding_window": 8, "num_full_layers": 1,
    "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "float32",
    "device": "cpu", "full_pages": 256, "swa_pages": 128, "host_pages": 0,
    "host_swa_pages": 0,
}
CLIENTS, ROUNDS, FIRST, OUTPUT, SUBQ = 2, 3, 40, 30, 10
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _workload_args(**over: Any) -> list[str]:
    args = {"clients": CLIENTS, "rounds": ROUNDS, "first-prompt": FIRST, "output": OUTPUT,
            "subq": SUBQ, "seed": 5, **over}
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon.cli", "bench", "multiturn", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _check_consistent(report: dict[str, Any], clients: int, rounds: int) -> None:
    """Figures that must agree with each other whatever the cache did."""
    total, per_round = report["total"], report["rounds"]
    assert len(per_round) == rounds
    assert [r["round"] for r in per_round] == list(range(rounds))
    assert total["requests"] == clients * rounds == len(report["requests"])
    assert all(r["requests"] == clients for r in per_round)
    for s in [total, *per_round]:
        assert s["hit_tokens"] == s["device_hit_tokens"] + s["host_hit_tokens"] + \
            s["l3_hit_tokens"]
        assert s["prefill_tokens"] == s["prompt_tokens"] - s["hit_tokens"]
        for key in ("hit_rate", "device_hit_rate", "host_hit_rate", "l3_hit_rate",
                    "ideal_hit_rate"):
            assert 0.0 <= s[key] <= 1.0, (key, s[key])
        assert s["hit_rate"] == pytest.approx(
            s["device_hit_rate"] + s["host_hit_rate"] + s["l3_hit_rate"])
        assert s["hit_rate"] <= s["ideal_hit_rate"] + 1e-9  # nothing beats an infinite cache
        for key in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_max_s"):
            assert s[key] is None or s[key] >= 0.0
    for key in ("prompt_tokens", "hit_tokens", "device_hit_tokens", "host_hit_tokens",
                "l3_hit_tokens", "prefill_tokens", "failed", "swa_freed_tokens"):
        assert total[key] == sum(r[key] for r in per_round), key
    o = report["options"]
    assert total["prompt_tokens"] == clients * sum(
        o["first_prompt"] + r * (o["output"] + o["subq"]) for r in range(rounds))
    assert total["output_tokens"] == clients * rounds * o["output"]
    assert per_round[0]["ideal_hit_rate"] == 0.0
    for rec in report["requests"]:
        assert rec["device_hit"] + rec["host_hit"] + rec["l3_hit"] + rec["prefill_tokens"] \
            == rec["prompt_len"]
        assert rec["device_hit"] % report["page_size"] == 0
        assert 0.0 <= rec["start"] <= rec["end"]
    pool = report["pool"]
    assert 0 < pool["peak_full_pages"] <= pool["full_capacity"]
    assert 0 <= pool["peak_swa_pages"] <= pool["swa_capacity"]
    assert 0.0 < pool["peak_full_usage"] <= 1.0 and 0.0 <= pool["peak_swa_usage"] <= 1.0
    assert pool["samples"] == len(report["timeline"]["t_s"]) >= 2
    assert max(report["timeline"]["full_pages"]) == pool["peak_full_pages"]


def test_cli_run_writes_consistent_json_and_a_png(make_daemon: Any, tmp_path: Path) -> None:
    d = make_daemon({"models": [MODEL]})
    out, png = tmp_path / "out" / "report.json", tmp_path / "plot.png"
    res = _cli("--socket", d.socket, *_workload_args(), "--json", str(out), "--plot", str(png))
    assert res.returncode == 0, res.stderr
    assert "total" in res.stdout and "peak device pool usage" in res.stdout
    assert f"{CLIENTS * ROUNDS}/{CLIENTS * ROUNDS} requests" in res.stderr  # the progress bar
    report = json.loads(out.read_text())
    _check_consistent(report, CLIENTS, ROUNDS)
    total = report["total"]
    # A roomy pool, no host tier: every hit is a device hit, and it is the ideal one.
    assert total["failed"] == 0
    assert total["host_hit_tokens"] == total["l3_hit_tokens"] == 0
    assert total["hit_rate"] == pytest.approx(total["ideal_hit_rate"])
    for r in report["rounds"]:
        assert r["hit_rate"] == pytest.approx(r["ideal_hit_rate"])
    assert total["swa_freed_tokens"] > 0  # outputs are longer than the window
    assert report["options"]["seed"] == 5 and "token" not in report["options"]
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert png.stat().st_size > 1000


def test_library_run_under_pressure_counts_failures(make_daemon: Any) -> None:
    """A pool too small for the later prompts: failed requests are counted, the run goes on,
    nothing leaks (the teardown's invariant check), the figures still add up."""
    d = make_daemon({"models": [{**MODEL, "full_pages": 24, "swa_pages": 24}]})
    # One request at a time: round 0 fits (18 pages), the longer rounds (28+ pages) cannot.
    report = mt.run(mt.Options(socket=d.socket, clients=2, rounds=3, first_prompt=40, output=30,
                               subq=10, round_barrier=False, seed=9))
    _check_consistent(report, 2, 3)
    total = report["total"]
    assert total["failed"] == 4
    assert [r["failed"] for r in report["rounds"]] == [0, 2, 2]
    failed = [r for r in report["requests"] if r["failed"]]
    assert all(r["error"].startswith("alloc: ") for r in failed), failed
    assert report["pool"]["peak_full_pages"] <= 23


@pytest.mark.parametrize(("args", "message"), [
    (["--clients", "0"], "--clients: must be >= 1"),
    (["--rounds", "x"], "--rounds: expected an integer"),
    (["--request-rate", "0"], "--request-rate: must be > 0"),
    (["--output", "0"], "--output: must be >= 1"),
    (["--distribution", "zipf"], "--distribution: invalid choice"),
    (["--engine", "vllm"], "--engine: invalid choice"),
    (["--sample-interval", "nan"], "--sample-interval: must be > 0"),
])
def test_bad_arguments_exit_2(args: list[str], message: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "multiturn", "--socket", "/nonexistent.sock", *args])
    assert exc.value.code == cli.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_unknown_model_exits_2(make_daemon: Any) -> None:
    d = make_daemon({"models": [MODEL]})
    res = _cli("--socket", d.socket, "--model", "nope", "--clients", "1", "--rounds", "1")
    assert res.returncode == cli.EXIT_USAGE
    assert "does not serve model 'nope'" in res.stderr and "'m'" in res.stderr


def test_unreachable_daemon_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["bench", "multiturn", "--socket", str(tmp_path / "none.sock"), "--quiet"])
    assert code == cli.EXIT_FAILURE
    err = capsys.readouterr().err
    assert "cannot connect to radixd" in err and "is the daemon running?" in err


def test_help_documents_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "multiturn", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--socket", "--token", "--model", "--clients", "--rounds", "--first-prompt",
                "--output", "--subq", "--request-rate", "--no-round-barrier", "--engine",
                "--l3", "--json", "--plot", "exit codes"):
        assert opt in text, opt


@pytest.mark.parametrize(("field", "value"), [
    ("clients", 0), ("rounds", True), ("subq", -1), ("request_rate", 0.0),
    ("distribution", "zipf"), ("engine", "x"), ("sample_interval_s", 0.0), ("socket", ""),
])
def test_options_validate(field: str, value: Any) -> None:
    opts = mt.Options(socket="/x.sock")
    setattr(opts, field, value)
    with pytest.raises(mt.BenchUsageError, match=field):
        opts.validate()


def test_hf_engine_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(module: str) -> Any:
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)

    monkeypatch.setattr(engines.importlib, "import_module", missing)
    with pytest.raises(mt.BenchError, match="--engine hf needs .*examples/hf_engine.*"
                                            "PYTHONPATH.*--engine synthetic"):
        mt.hf_engine_module()


def test_defaults_are_the_workloads() -> None:
    """One set of defaults: the CLI's come from Options, whose come from Workload."""
    w, o = mt.Workload(), mt.Options(socket="/x.sock")
    for name in ("clients", "rounds", "first_prompt", "output", "subq", "max_parallel",
                 "prefill_chunk", "swa_eviction_interval"):
        assert getattr(o, name) == getattr(w, name), name
    args = cli.build_parser().parse_args(["bench", "multiturn"])
    assert (args.clients, args.output, args.prefill_chunk) == (w.clients, w.output,
                                                               w.prefill_chunk)


def test_split_loaded() -> None:
    # L2 held 8 tokens past the device match, the prefetch brought 4 more from L3.
    assert mt.split_loaded(12, 12, 4) == (8, 4)
    assert mt.split_loaded(6, 12, 4) == (6, 0)  # a partial load cuts the L3 part first
    assert mt.split_loaded(4, 4, 4) == (0, 4)
    assert mt.split_loaded(0, 0, 0) == (0, 0)


# ---------------------------------------------------------------------------- L2/L3 paths


class _FakeClient:
    """Answers the protocol like a daemon whose host tier holds [8, 16) and whose L3 held
    [16, 20) of the prompt (fetched by prefetch); records every call."""

    def __init__(self) -> None:
        self.models = {"m": P.ModelInfo(
            name="m", page_size=4, sliding_window=8, num_full_layers=1, num_swa_layers=1,
            num_kv_heads=1, head_dim=4, dtype="float32", device="cpu", full_pages=64,
            swa_pages=64)}
        self.calls: list[tuple[str, Any]] = []
        self._next_page = 1
        self._receipt = 0

    def _ids(self, n: int) -> bytes:
        ids = array("i", range(self._next_page, self._next_page + n))
        self._next_page += n
        return ids.tobytes()

    def _new_receipt(self) -> int:
        self._receipt += 1
        return self._receipt

    def prefetch(self, model: str, tokens: bytes, policy: str) -> P.PrefetchResult:
        self.calls.append(("prefetch", policy))
        return P.PrefetchResult(status="complete", l3_hit_len=4, fetched_len=4)

    def match(self, model: str, tokens: bytes, lock: bool = False) -> P.MatchResult:
        self.calls.append(("match", lock))
        return P.MatchResult(prefix_len=8, full_pages=self._ids(2), swa_pages=self._ids(2),
                             node=2, full_hit_len=8, host_hit_len=12,
                             receipt=self._new_receipt() if lock else None)

    def load(self, model: str, tokens: bytes, lock: bool = False) -> P.LoadResult:
        self.calls.append(("load", lock))
        return P.LoadResult(prefix_len=20, full_pages=self._ids(5), swa_pages=self._ids(2),
                            node=3, full_hit_len=20, host_hit_len=0,
                            receipt=self._new_receipt() if lock else None, loaded_len=12)

    def unlock(self, model: str, receipt: int) -> P.Empty:
        self.calls.append(("unlock", receipt))
        return P.Empty()

    def alloc(self, model: str, n: int) -> P.AllocResult:
        self.calls.append(("alloc", n))
        return P.AllocResult(full_pages=self._ids(n), swa_pages=self._ids(n))

    def free(self, model: str, full_pages: Any = (), swa_pages: Any = ()) -> P.Empty:
        self.calls.append(("free", len(swa_pages)))
        return P.Empty()

    def release_swa(self, model: str, receipt: int) -> P.Empty:
        self.calls.append(("release_swa", receipt))
        return P.Empty()

    def cache_finished(self, model: str, tokens: bytes, full_pages: Any, swa_pages: Any,
                       prev_prefix_len: int, swa_evicted_len: int, receipt: int | None
                       ) -> P.InsertResult:
        self.calls.append(("cache_finished", (len(tokens) // 4, prev_prefix_len,
                                              swa_evicted_len, receipt)))
        return P.InsertResult(prefix_len=prev_prefix_len, inserted_len=len(tokens) // 16 * 4,
                              full_pages=b"", swa_pages=b"", node=4, receipt=None)

    def batch(self, stop_on_error: bool = True) -> _FakeBatch:
        return _FakeBatch(self)

    def close(self) -> None:
        self.calls.append(("close", None))


class _FakeBatch:
    """Runs each queued call at once, in order, as the daemon runs a batch's operations."""

    class _Done:
        def __init__(self, value: Any) -> None:
            self.value = value

        def result(self) -> Any:
            return self.value

        def exception(self) -> None:
            return None

    def __init__(self, client: _FakeClient) -> None:
        self.client = client

    def __enter__(self) -> _FakeBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __getattr__(self, op: str) -> Any:
        call = getattr(self.client, op)
        return lambda *a, **k: self._Done(call(*a, **k))


def test_synthetic_engine_follows_the_tier_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """prefetch(wait_complete) -> match(lock) -> load(lock) -> unlock of the match's receipt,
    prefill from the loaded prefix, and the hit split device/host/l3 from the answers."""
    fake = _FakeClient()
    monkeypatch.setattr(engines, "connect", lambda *a, **k: fake)
    engine = mt.SyntheticEngine(mt.EngineSpec(
        socket="/x.sock", token=None, model="m", client_index=0, seed=1, l3=True,
        prefill_chunk=64, swa_eviction_interval=4))
    out = engine.run_request(list(range(1, 23)), 20)  # 22 prompt tokens, 20 generated
    assert not out.failed, out.error
    ops = [c[0] for c in fake.calls]
    assert ops[:4] == ["prefetch", "match", "load", "unlock"]
    assert fake.calls[0] == ("prefetch", "wait_complete")
    assert fake.calls[1] == ("match", True) and fake.calls[2] == ("load", True)
    assert fake.calls[3] == ("unlock", 1)  # the match's receipt, replaced by the load's
    assert (out.device_hit, out.host_hit, out.l3_hit) == (8, 8, 4)
    assert (out.l3_hit_len, out.fetched_len, out.loaded_len) == (4, 4, 12)
    assert out.prefill_tokens == 22 - 20
    assert fake.calls[4] == ("alloc", 1)  # page 5 (tokens 20, 21): the rest is loaded
    # Decode to 41 tokens: the loaded prefix's SWA is released once 28 - W >= 20 (protocol
    # 8.6), held pages [20, 24), [24, 28), [28, 32) leave the window at 32, 36, 40.
    assert ("release_swa", 2) in fake.calls and ops[-1] == "cache_finished"
    assert [c[1] for c in fake.calls if c[0] == "free"] == [1, 1, 1]
    assert fake.calls[-1][1] == (22 + 20 - 1, 20, 32, 2)  # tokens, prev, frontier, receipt
    assert out.swa_evicted_len == 32 and out.swa_freed_tokens == 12
    assert out.ttft_s is not None and len(out.output) == 20


# ---------------------------------------------------------------------------- with the tiers


def test_host_tier_hits_are_counted_as_host(make_daemon: Any) -> None:
    """A device pool smaller than the conversations, a host tier larger: later rounds hit in
    L2. (How close to the ideal depends on timing: the synthetic engine computes nothing, so
    the next request can come before the write-through copies of the last one are done.)"""
    model = {**MODEL, "full_pages": 48, "swa_pages": 32, "host_pages": 512,
             "host_swa_pages": 256}
    d = make_daemon({"models": [model]})
    report = mt.run(mt.Options(socket=d.socket, clients=3, rounds=3, first_prompt=40,
                               output=30, subq=10, seed=3))
    _check_consistent(report, 3, 3)
    total = report["total"]
    assert total["failed"] == 0
    assert total["host_hit_tokens"] > 0 and total["l3_hit_tokens"] == 0
    for r in report["requests"]:  # load adds at most what the match saw on host
        assert r["host_hit"] <= r["host_hit_len"]


def test_l3_hits_are_counted_as_l3(make_daemon: Any) -> None:
    """Device and host both smaller than the working set (the host holds a few
    conversations), Redis behind them: some hits come from L3 through prefetch(wait_complete)
    and load."""
    import redis

    prefix = f"radixd-test-mt-{secrets.token_hex(4)}"
    model = {**MODEL, "full_pages": 48, "swa_pages": 32, "host_pages": 96,
             "host_swa_pages": 48, "l3": True}
    d = make_daemon({"models": [model],
                     "l3": {"url": "redis://127.0.0.1:6379/0", "key_prefix": prefix}})
    try:
        report = mt.run(mt.Options(socket=d.socket, clients=6, rounds=3, first_prompt=40,
                                   output=30, subq=10, seed=4, l3=True))
        _check_consistent(report, 6, 3)
        total = report["total"]
        assert total["failed"] == 0 and total["l3_hit_tokens"] > 0
        for r in report["requests"]:
            assert r["l3_hit"] <= r["fetched_len"] <= r["l3_hit_len"]
            assert r["prefetch_status"] in ("none", "started", "complete", "timeout",
                                            "unavailable")
    finally:
        r = redis.Redis.from_url("redis://127.0.0.1:6379/0")
        keys = list(r.scan_iter(match=prefix + "*"))
        if keys:
            r.unlink(*keys)
        r.close()
