"""``radixd bench``'s command line (multiturn, soak): their options, and the runs they start.

``radixd``'s own CLI (daemon/cli.py) only hands the ``bench`` subcommand to
:func:`add_bench_commands`, so the daemon's command line does not import the bench (or
multiprocessing, matplotlib, the client engines) until a benchmark actually runs. Every default
shown here is :class:`~radixd_bench.options.Options`', declared once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from .options import DISTRIBUTIONS, ENGINES, Options

__all__ = ["add_bench_commands"]

_D = Options(socket="")  # the defaults
# the exit codes of the ``radixd`` command (docs/operations.md): ok, failure, usage
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

#: The daemon's socket from a configuration file path (None: the default configuration), or None
#: with the reason printed. Given by the ``radixd`` command, which owns the configuration: the
#: bench is a client and imports nothing of the daemon.
SocketResolver = Callable[[str | None], str | None]


def add_bench_commands(bench: argparse.ArgumentParser, resolve_socket: SocketResolver) -> None:
    """Add the benchmarks under ``radixd bench``."""
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    _bench_multiturn_args(bsub)
    _bench_soak_args(bsub)
    bench.set_defaults(resolve_socket=resolve_socket)


_MULTITURN_DESCRIPTION = """\
Replay the multi-turn chat workload of SGLang's bench_multiturn (the shape of bench/multiturn.py)
against a running daemon over its socket, and report the prefix-cache hit rate per round, split by
where the hit came from: device (the match), host (loaded from L2) and l3 (prefetched from Redis,
then loaded); a time-to-first-token proxy per round (wall time from a request's start to its first
decode step); and the peak full and SWA device pool usage (polled with the stats operation).

Each client is one OS process with its own session. Client i starts with a prompt of
--first-prompt random tokens; after each answer its history grows by the --output generated tokens
and a --subq-token sub-question, and the whole history is the next prompt. With the round barrier
(the default) round r+1 starts once every client finished round r, clients served in the same
order every round.

The synthetic engine (default) runs no model but performs every protocol step an engine performs:
match (locked); load when the match reports host hits; with --l3, prefetch(wait_complete) before
the match; alloc; chunked prefill with cache_unfinished; decode a page at a time, freeing SWA
pages that left the window (free, release_swa) and passing the SWA frontier to cache_finished.
--engine hf drives the HF transformers engine of examples/hf_engine instead.

A request the daemon refuses for capacity (out_of_memory, quota_exceeded) is counted as failed and
the run goes on; a protocol error that means a bug stops it (exit 1). The token streams come from
--seed: the same seed against the same daemon replays the same conversations, so a second run
finds the first one's cache (the default seed is random and printed)."""


def _positive_int(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _bench_multiturn_args(bsub: Any) -> None:
    p = bsub.add_parser(
        "multiturn", help="the multi-turn chat workload: hit rates by tier, TTFT, pool peaks",
        description=_MULTITURN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes: 0 ok; 1 runtime failure (the daemon is unreachable or refused the "
               "token, a client or the daemon failed, the report could not be written); 2 bad "
               "arguments (or a model the daemon does not serve)")
    d = p.add_argument_group("the daemon")
    d.add_argument("--socket", metavar="PATH",
                   help="the daemon's engine socket (default: server.socket of --config, else "
                        "the daemon's default path)")
    d.add_argument("--config", metavar="FILE",
                   help="the daemon's TOML configuration, to find its socket (default: "
                        "$RADIXD_CONFIG if set)")
    d.add_argument("--token", metavar="TOKEN",
                   help="tenant token (only when the daemon configures tenants)")
    d.add_argument("--model", metavar="NAME",
                   help="model profile to use (default: the first one the tenant may use)")
    w = p.add_argument_group("the workload (defaults as bench/multiturn.py)")
    w.add_argument("--clients", type=_positive_int(1), default=_D.clients, metavar="N",
                   help="concurrent conversations, one process each (default %(default)s)")
    w.add_argument("--rounds", type=_positive_int(1), default=_D.rounds, metavar="N",
                   help="turns per conversation (default %(default)s)")
    w.add_argument("--first-prompt", type=_positive_int(1), default=_D.first_prompt,
                   metavar="TOKENS",
                   help="tokens of each client's first prompt (default %(default)s)")
    w.add_argument("--output", type=_positive_int(1), default=_D.output, metavar="TOKENS",
                   help="tokens generated per request (default %(default)s)")
    w.add_argument("--subq", type=_positive_int(0), default=_D.subq, metavar="TOKENS",
                   help="tokens of the sub-question appended after each answer (default "
                        "%(default)s)")
    w.add_argument("--request-rate", type=_positive_float, default=_D.request_rate, metavar="R",
                   help="requests per second over all clients (default inf: no gaps)")
    w.add_argument("--distribution", choices=DISTRIBUTIONS, default=_D.distribution,
                   help="gaps between requests at --request-rate: exponential (poisson) or "
                        "U(0, 2/R) (default poisson)")
    w.add_argument("--no-round-barrier", dest="round_barrier", action="store_false",
                   help="let a client start its next round as soon as its answer arrives")
    w.add_argument("--max-parallel", type=_positive_int(1), default=_D.max_parallel, metavar="N",
                   help="requests in flight at once (default %(default)s, as the in-process "
                        "replay)")
    w.add_argument("--prefill-chunk", type=_positive_int(1), default=_D.prefill_chunk,
                   metavar="TOKENS",
                   help="chunked prefill: cache_unfinished after every chunk; lowered where "
                        "one chunk would not fit the smaller pool (default %(default)s)")
    w.add_argument("--swa-eviction-interval", type=_positive_int(1),
                   default=_D.swa_eviction_interval, metavar="TOKENS",
                   help="decode tokens between SWA frees (default %(default)s)")
    w.add_argument("--seed", type=int, metavar="N",
                   help="seed of the token streams and arrival gaps (default: random, printed)")
    e = p.add_argument_group("the engine")
    e.add_argument("--engine", choices=ENGINES, default=_D.engine,
                   help="synthetic: protocol steps without a model (default); hf: the HF "
                        "transformers engine of examples/hf_engine (not installed with the "
                        "daemon: a radixd source checkout must be importable, e.g. on "
                        "PYTHONPATH; the daemon's model must have its KV layout: python -m "
                        "examples.hf_engine config)")
    e.add_argument("--l3", action="store_true",
                   help="prefetch(wait_complete) from L3 (Redis) before every match")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the full report (per round, totals, "
                                                  "pool timeline, every request) as JSON")
    o.add_argument("--plot", metavar="PATH",
                   help="write a PNG of pool usage and hit rate over time (needs matplotlib)")
    o.add_argument("--sample-interval", type=_positive_float, default=_D.sample_interval_s,
                   metavar="SECONDS",
                   help="seconds between pool-usage polls with the stats operation, which also "
                        "runs at every request's end (default %(default)s)")
    o.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    p.set_defaults(handler=_bench_multiturn)


def _bench_multiturn(args: argparse.Namespace) -> int:
    from . import multiturn as mt

    if args.plot:
        why = mt.plot_available()
        if why is not None:
            print(f"radixd: {why}", file=sys.stderr)
            return EXIT_FAILURE
    socket_path = args.socket or args.resolve_socket(args.config)
    if not socket_path:
        return EXIT_USAGE
    opts = mt.Options(
        socket=socket_path, token=args.token, model=args.model, clients=args.clients,
        rounds=args.rounds, first_prompt=args.first_prompt, output=args.output, subq=args.subq,
        request_rate=args.request_rate, distribution=args.distribution,
        round_barrier=args.round_barrier, max_parallel=args.max_parallel,
        prefill_chunk=args.prefill_chunk, swa_eviction_interval=args.swa_eviction_interval,
        seed=args.seed, engine=args.engine, l3=args.l3, sample_interval_s=args.sample_interval)
    try:
        report = mt.run(opts, progress=not args.quiet)
    except mt.BenchUsageError as exc:
        print(f"radixd bench multiturn: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except mt.BenchError as exc:
        print(f"radixd bench multiturn: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("radixd bench multiturn: interrupted", file=sys.stderr)
        return EXIT_FAILURE
    print(mt.format_report(report))
    try:
        if args.json:
            mt.write_json(report, args.json)
            print(f"report written to {args.json}")
        if args.plot:
            mt.write_plot(report, args.plot)
            print(f"plot written to {args.plot}")
    except OSError as exc:
        print(f"radixd bench multiturn: cannot write the report: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _bench_soak_args(bsub: Any) -> None:
    from .soak import SoakOptions

    d = SoakOptions()
    p = bsub.add_parser(
        "soak", help="a daemon of its own under pressure and faults, every hit verified",
        description=(
            "Start a radixd (CPU, float32 pools: device about a third of the working set, host "
            "tier about half, Redis write-through to a redis-server of its own on a spare port, "
            "a state directory, two tenants with quotas), run client processes that verify every "
            "page they hit, SIGKILL clients and Redis periodically, restart the daemon once, and "
            "report mismatches, invariant violations, leaked pages, failed requests by code, "
            "RSS and its slope, descriptors and Redis breaker figures. Needs redis-server on "
            "PATH and a radixd source or install importable by this Python."),
        epilog="exit codes: 0 ok; 1 mismatches, violations or leaks, or a failure; 2 bad "
               "arguments")
    p.add_argument("--duration", type=_positive_float, default=d.duration_s, metavar="SECONDS",
                   help="length of the run (default %(default)s)")
    p.add_argument("--clients", type=_positive_int(1), default=d.clients, metavar="N",
                   help="client processes (default %(default)s)")
    p.add_argument("--kill-every", type=_positive_float, default=d.kill_every_s,
                   metavar="SECONDS", help="SIGKILL a random client this often (default "
                                           "%(default)s)")
    p.add_argument("--redis-kill-every", type=_positive_float, default=d.redis_kill_every_s,
                   metavar="SECONDS", help="SIGKILL Redis and start it empty this often "
                                           "(default %(default)s)")
    p.add_argument("--restart-at", type=float, default=None, metavar="SECONDS",
                   help="restart the daemon this long into the run (default: half way; "
                        "negative: never)")
    p.add_argument("--seed", type=int, default=d.seed, metavar="N",
                   help="seed of the documents, prompts and faults (default %(default)s)")
    p.add_argument("--workdir", metavar="DIR",
                   help="scratch directory (config, logs, state), kept (default: a temporary "
                        "one, removed after a clean run)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.set_defaults(handler=_bench_soak)


def _bench_soak(args: argparse.Namespace) -> int:
    import json

    from .options import BenchError
    from .soak import SoakOptions, format_report, run_soak

    restart = args.restart_at
    opts = SoakOptions(duration_s=args.duration, clients=args.clients,
                       kill_every_s=args.kill_every, redis_kill_every_s=args.redis_kill_every,
                       restart_at_s=(float("inf") if restart is not None and restart < 0
                                     else restart),
                       seed=args.seed, workdir=args.workdir)
    try:
        report = run_soak(opts)
    except BenchError as exc:
        print(f"radixd bench soak: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("radixd bench soak: interrupted", file=sys.stderr)
        return EXIT_FAILURE
    print(format_report(report))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2, default=str)
        except OSError as exc:
            print(f"radixd bench soak: cannot write the report: {exc}", file=sys.stderr)
            return EXIT_FAILURE
    return EXIT_OK if report["ok"] else EXIT_FAILURE
