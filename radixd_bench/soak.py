"""``radixd bench soak``: a daemon under pressure on every tier, with faults, and verified pages.

It starts everything it needs in a scratch directory: its own radixd (a CPU model in float32,
device pools about a third of the working set, host tier about half, Redis write-through, a state
directory so a restart keeps the host tier, two tenants with quotas) and its own redis-server on
a spare loopback port (never the one on 6379). Client processes (:mod:`radixd_bench.soak_worker`)
run whole request lifecycles and verify every hit byte for byte; after each request they use
keyed pages (:mod:`radixd_bench.soak_keyed`: stored, looked up with Redis fetches, verified, and
checked for pages served again after a ``kv_clear``). Meanwhile it SIGKILLs a random client
every ``kill_every_s`` (and starts a new one), SIGKILLs Redis and starts it empty every
``redis_kill_every_s``, and restarts the daemon (SIGTERM, start again) at ``restart_at_s``. A
client that dies by itself (an exception the client library or the daemon should not have
caused) is started again and counted.

At the end (all clients gone) it asks the daemon for a full invariant check and for its pool
usage (pages still held by sessions are leaks) and keyed pins (pins left are leaks), then stops
it with SIGTERM, which runs the check at rest (no lock, pin or keyed pin may be left), and reads
its log for violations. It prints the daemon's operations, requests, verified pages, mismatches,
the keyed pages' figures, violations, leaks, failed requests by code, requests restarted by the
daemon restart, the daemon's RSS with the slope of a linear fit over the last three quarters of
the run (MiB/h), its open descriptors, and Redis breaker openings and dropped writes. Exit 1 if
mismatches (of either kind), stale keyed pages, violations, leaks or client crashes are not all
zero, or a stop of the daemon (the restart's or the last) does not exit 0.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .options import BenchError
from .soak_keyed import KEYED_COUNTS, KeyedOptions
from .soak_worker import worker_main
from .unix_http import UnixHTTPConnection

__all__ = ["SoakOptions", "run_soak"]

_ADMIN_TOKEN = "soak-admin"
_TENANTS = (("a", "soak-token-a"), ("b", "soak-token-b"))
_MODEL = "soak"


@dataclass
class SoakOptions:
    duration_s: float = 120.0
    clients: int = 6
    kill_every_s: float = 20.0
    redis_kill_every_s: float = 45.0
    restart_at_s: float | None = None  # default: half way
    docs_per_tenant: int = 12
    doc_tokens: int = 512
    suffix_tokens: int = 48
    output_tokens: int = 40
    prefill_chunk: int = 128
    seed: int = 0
    workdir: str | None = None  # default: a temporary directory, removed at the end
    keyed: KeyedOptions | None = field(default_factory=KeyedOptions)  # None: no keyed pages


@dataclass
class _Daemon:
    proc: subprocess.Popen
    started: float
    rss: list[tuple[float, float]] = field(default_factory=list)  # (time, MiB)
    fds_start: int | None = None


def _spare_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(work: Path, redis_port: int, opts: SoakOptions) -> str:
    P = 16
    pages_per_doc = -(-(opts.doc_tokens + opts.suffix_tokens + opts.output_tokens) // P)
    working_set = len(_TENANTS) * opts.docs_per_tenant * pages_per_doc
    full = max(working_set // 3, opts.clients * (pages_per_doc + 2) + 16)
    # the host tier: about half the tree's working set, plus half the clients' keyed keys (the
    # keyed pages and the tree's host copies share one eviction order, protocol.md 9.4)
    kv = opts.keyed
    kv_full, kv_swa = (opts.clients * kv.full_keys // 2, opts.clients * kv.swa_keys // 2) \
        if kv is not None else (0, 0)
    tenants = "\n".join(
        f'[[tenants]]\nname = "{ns}"\ntoken = "{tok}"\nnamespace = "{ns}"\n'
        f"quota_full_pages = {full * 2 // 3}\n" for ns, tok in _TENANTS)
    return f"""log_level = "info"
[server]
socket = "{work / 'radixd.sock'}"
state_dir = "{work / 'state'}"
[admin]
unix_socket = "{work / 'admin.sock'}"
token = "{_ADMIN_TOKEN}"
[checker]
strict = false
[l3]
url = "redis://127.0.0.1:{redis_port}/0"
write_policy = "write_through"
op_timeout_ms = 200
[[models]]
name = "{_MODEL}"
page_size = {P}
sliding_window = {2 * P}
num_full_layers = 2
num_swa_layers = 2
num_kv_heads = 1
head_dim = 64
dtype = "float32"
device = "cpu"
full_pages = {full}
swa_pages = {max(full // 2, opts.clients * 8 + 16)}
host_pages = {max(2, working_set // 2 + kv_full)}
host_swa_pages = {max(2, working_set // 4 + kv_swa)}
{tenants}"""


def _admin(work: Path, method: str, path: str) -> Any:
    conn = UnixHTTPConnection(str(work / "admin.sock"))
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {_ADMIN_TOKEN}"})
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise BenchError(f"admin {method} {path}: HTTP {resp.status}: {body[:300]!r}")
    return json.loads(body)


def _start_daemon(work: Path, log: Any) -> _Daemon:
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--config",
                             str(work / "radixd.toml")], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = t0 + 60
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BenchError(f"radixd exited with {proc.returncode}; see "
                                 f"{work / 'radixd.log'}")
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(str(work / "radixd.sock"))
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(str(work / "admin.sock"))
                return _Daemon(proc, time.monotonic())
            except OSError:
                time.sleep(0.05)
        raise BenchError("radixd did not come up within 60 s")
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _start_redis(port: int, work: Path) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    if exe is None:
        raise BenchError("redis-server is not installed (the soak starts its own Redis)")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(work)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return proc
            time.sleep(0.05)
        raise BenchError(f"redis-server did not answer on port {port}")
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def slope_mib_per_hour(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) over the last three quarters of the samples."""
    pts = samples[len(samples) // 4:]
    if len(pts) < 3:
        return None
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mr = sum(r for _, r in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    if var == 0:
        return None
    return 3600 * sum((t - mt) * (r - mr) for t, r in pts) / var


def _docs(opts: SoakOptions) -> dict[str, list[list[int]]]:
    rng = random.Random(opts.seed)
    return {ns: [[rng.randrange(1, 30000) for _ in range(opts.doc_tokens)]
                 for _ in range(opts.docs_per_tenant)] for ns, _ in _TENANTS}


def run_soak(opts: SoakOptions, progress: Any = None) -> dict[str, Any]:
    """Run the soak; returns the report (see the module docstring)."""
    own = opts.workdir is None
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="radixd-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    redis_port = _spare_port()
    (work / "radixd.toml").write_text(_config(work, redis_port, opts))
    log = open(work / "radixd.log", "a")  # noqa: SIM115 - closed below
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    results = ctx.Queue()
    docs = _docs(opts)
    totals: dict[str, Any] = {"requests": 0, "verified_pages": 0, "mismatches": 0,
                              "restarted": 0, "failed": {}, **dict.fromkeys(KEYED_COUNTS, 0)}
    events = {"client_kills": 0, "client_crashes": 0, "redis_kills": 0, "daemon_restarts": 0}
    restart_at = opts.restart_at_s if opts.restart_at_s is not None else opts.duration_s / 2
    # a SIGTERM (the operator's kill, a CI timeout) unwinds through the cleanup below, so that
    # no client, Redis or daemon of the soak outlives it
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    redis: subprocess.Popen | None = None
    daemons: list[_Daemon] = []
    procs: dict[int, Any] = {}
    serial = 0

    def spawn(slot: int) -> None:
        nonlocal serial
        serial += 1
        ns, tok = _TENANTS[slot % len(_TENANTS)]
        p = ctx.Process(target=worker_main, daemon=True, args=(
            slot, str(work / "radixd.sock"), tok, _MODEL, docs[ns], opts.seed * 1000 + serial,
            opts.suffix_tokens, opts.output_tokens, opts.prefill_chunk, stop, results, ns,
            opts.keyed))
        p.start()
        procs[slot] = p

    def drain() -> None:
        while True:
            try:
                _, c = results.get_nowait()
            except queue.Empty:
                return
            for k in ("requests", "verified_pages", "mismatches", "restarted", *KEYED_COUNTS):
                totals[k] += c[k]
            for code, n in c["failed"].items():
                totals["failed"][code] = totals["failed"].get(code, 0) + n

    report: dict[str, Any] = {}
    try:
        redis = _start_redis(redis_port, work)
        daemons.append(_start_daemon(work, log))
        for slot in range(opts.clients):
            spawn(slot)
        t0 = time.monotonic()
        rng = random.Random(opts.seed)
        next_kill, next_redis = t0 + opts.kill_every_s, t0 + opts.redis_kill_every_s
        restart_done = False
        restart_figures: dict[str, Any] = {}
        while (now := time.monotonic()) < t0 + opts.duration_s:
            drain()
            d = daemons[-1]
            rss = _rss_mib(d.proc.pid)
            if rss is not None:
                d.rss.append((now - t0, rss))
            if d.fds_start is None and now - d.started > 5:
                d.fds_start = _fds(d.proc.pid)
            for slot, p in list(procs.items()):
                if not p.is_alive():  # it died by itself (its traceback is on stderr)
                    p.join()
                    spawn(slot)
                    events["client_crashes"] += 1
            if now >= next_kill:
                slot = rng.randrange(opts.clients)
                procs[slot].kill()
                procs[slot].join(10)
                spawn(slot)
                events["client_kills"] += 1
                next_kill = now + opts.kill_every_s
            if now >= next_redis:
                redis.kill()
                redis.wait()
                redis = _start_redis(redis_port, work)
                events["redis_kills"] += 1
                next_redis = now + opts.redis_kill_every_s
            if not restart_done and now - t0 >= restart_at:
                restart_done = True
                restart_figures = _restart(work, daemons, log)
                events["daemon_restarts"] += 1
            if d.proc.poll() is not None and d is daemons[-1]:
                raise BenchError(f"radixd exited with {d.proc.returncode} during the soak; see "
                                 f"{work / 'radixd.log'}")
            if progress is not None:
                progress(now - t0, totals)
            time.sleep(0.5)
        stop.set()
        for p in procs.values():
            p.join(30)
            if p.is_alive():
                p.kill()
        drain()
        report = _final(work, daemons[-1], totals, events, restart_figures)
    finally:
        stop.set()
        for p in procs.values():
            if p.is_alive():
                p.kill()
        for d in daemons:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
                try:
                    d.proc.wait(30)
                except subprocess.TimeoutExpired:
                    d.proc.kill()
        if redis is not None:
            redis.kill()
            redis.wait()
        log.close()
        signal.signal(signal.SIGTERM, previous)
        if own and report and report.get("ok"):
            shutil.rmtree(work, ignore_errors=True)
    report["workdir"] = None if own and report.get("ok") else str(work)
    report["options"] = asdict(opts)
    return report


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _restart(work: Path, daemons: list[_Daemon], log: Any) -> dict[str, Any]:
    old = daemons[-1]
    ops = _admin(work, "GET", "/v1/stats")["ops_total"]
    t = time.monotonic()
    old.proc.send_signal(signal.SIGTERM)
    old.proc.wait(60)
    stopped = time.monotonic()
    new = _start_daemon(work, log)
    daemons.append(new)
    wr = _admin(work, "GET", "/v1/stats").get("warm_restart", {})
    return {"stop_s": round(stopped - t, 3), "sigterm_to_serving_s": round(new.started - t, 3),
            "host_pages_kept": wr.get("kept_pages"), "host_pages_dropped": wr.get("dropped_pages"),
            "old_exit_code": old.proc.returncode, "ops_before": ops}


def _final(work: Path, d: _Daemon, totals: dict[str, Any], events: dict[str, int],
           restart: dict[str, Any]) -> dict[str, Any]:
    time.sleep(1.0)  # the sessions of the killed and stopped clients close
    stats = _admin(work, "GET", "/v1/stats")
    held = sum(pool["held"] for m in stats["models"].values() for pool in m["pools"].values())
    # keyed pins and reservations end with their session, however it ends: any left is a leak
    keyed = [m["keyed"] for m in stats["models"].values() if m.get("keyed")]
    keyed_pins = sum(k["pins"] for k in keyed)
    check = _admin(work, "POST", "/v1/check")
    fds_end = _fds(d.proc.pid)
    # the stop runs the check at rest (no lock, tree pin, host slot or keyed pin left) and
    # logs what it finds, as the background checker does
    d.proc.send_signal(signal.SIGTERM)
    try:
        final_exit = d.proc.wait(60)
    except subprocess.TimeoutExpired:
        final_exit = None
    violations = list(check.get("violations", []))
    log_text = (work / "radixd.log").read_text(errors="replace")
    violations += [f"the daemon's log: {line.strip()[:300]}" for line in log_text.splitlines()
                   if "invariant violations" in line][:20]
    if final_exit != 0:
        violations.append(f"the daemon's final stop: exit code {final_exit}")
    l3 = stats.get("l3") or {}
    rss = d.rss
    bad = (totals["mismatches"], totals["keyed_mismatches"], totals["keyed_stale"], held,
           keyed_pins, events["client_crashes"], restart.get("old_exit_code") not in (0, None))
    return {
        **totals, **events, "restart": restart,
        "ops": stats["ops_total"] + restart.get("ops_before", 0),
        "violations": violations, "leaked_pages": held, "leaked_keyed_pins": keyed_pins,
        "keyed_pages_left": sum(sum(k["pages"].values()) for k in keyed),
        "sessions_left": stats["sessions"],
        "rss_mib_start": round(rss[0][1], 1) if rss else None,
        "rss_mib_end": round(rss[-1][1], 1) if rss else None,
        "rss_slope_mib_per_h": (round(s, 1) if (s := slope_mib_per_hour(rss)) is not None
                                else None),
        "fds_start": d.fds_start, "fds_end": fds_end, "final_exit_code": final_exit,
        "redis_breaker_opens": l3.get("breaker_opens"),
        "redis_dropped_writes": l3.get("set_failures"),
        "ok": not any(bad) and not violations,
    }


def format_report(r: dict[str, Any]) -> str:
    """The report as lines for a person."""
    failed = ", ".join(f"{k} {v}" for k, v in sorted(r["failed"].items())) or "none"
    rs = r.get("restart") or {}
    return "\n".join([
        f"soak: {'OK' if r['ok'] else 'FAILED'} ({r['options']['duration_s']:.0f} s, "
        f"{r['options']['clients']} clients)",
        f"  ops {r['ops']}, requests {r['requests']}, verified pages {r['verified_pages']}, "
        f"mismatches {r['mismatches']}",
        f"  keyed pages: {r['keyed_rounds']} rounds, stored {r['keyed_stored']}, verified "
        f"{r['keyed_verified']} ({r['keyed_verified_after_restart']} written before the "
        f"daemon restart; {r['keyed_fetched']} fetched from Redis), of the shared keys "
        f"{r['keyed_shared_verified']}, mismatches "
        f"{r['keyed_mismatches']}, stale {r['keyed_stale']} ({r['keyed_stale_checks']} keys "
        f"looked up that could have served one; after a clear whose answer never came, "
        f"allowed: {r['keyed_stale_unconfirmed']}), declined {r['keyed_declined']}",
        f"  keyed clears {r['keyed_clears']} ({r['keyed_clears_confirmed']} confirmed by "
        f"Redis); keyed pages left {r['keyed_pages_left']}",
        f"  invariant violations {len(r['violations'])}, leaked pages {r['leaked_pages']}, "
        f"leaked keyed pins {r['leaked_keyed_pins']}",
        f"  failed requests by code: {failed}; restarted by the daemon restart or a lost "
        f"connection: {r['restarted']}",
        f"  faults: {r['client_kills']} client kills, {r['redis_kills']} Redis kills, "
        f"{r['daemon_restarts']} daemon restarts; clients that died by themselves: "
        f"{r['client_crashes']}",
        f"  restart: stopped in {rs.get('stop_s')} s, SIGTERM to serving "
        f"{rs.get('sigterm_to_serving_s')} s, host pages kept "
        f"{rs.get('host_pages_kept')}, dropped {rs.get('host_pages_dropped')}",
        f"  daemon RSS {r['rss_mib_start']} -> {r['rss_mib_end']} MiB (since its last start), "
        f"slope {r['rss_slope_mib_per_h']} MiB/h; descriptors {r['fds_start']} -> "
        f"{r['fds_end']}",
        f"  Redis: breaker opened {r['redis_breaker_opens']} times, "
        f"{r['redis_dropped_writes']} page writes dropped",
        *([f"  violation: {v}" for v in r["violations"][:20]]),
        *([f"  scratch directory kept: {r['workdir']}"] if r.get("workdir") else []),
    ])
