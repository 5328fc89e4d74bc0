"""The ``radixd`` command line.

Subcommands import their implementation lazily, so ``radixd --help`` stays fast and does not pull
in torch.

Exit codes: 0 success; 1 runtime failure (e.g. the socket is taken); 2 usage or configuration
error; 3 the daemon stopped on an invariant violation (strict mode).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from daemon import __version__

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INVARIANT = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser (separate from ``main`` so tests can inspect it)."""
    parser = argparse.ArgumentParser(
        prog="radixd",
        description="KV-cache and prefix radix tree daemon for LLM inference engines.",
        epilog="exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error, "
               "3 stopped on an invariant violation (strict mode)",
    )
    parser.add_argument("--version", action="version", version=f"radixd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="run the daemon",
        description="Run the daemon until SIGTERM/SIGINT. Without --config it serves a small "
                    "default model on the CPU (or the first GPU), with one tenant that needs no "
                    "token, on a socket in the per-user runtime directory "
                    "(/run/radixd/radixd.sock for root). Settings: built-in defaults < the TOML "
                    "file < RADIXD_<SECTION>_<KEY> environment variables < these flags.")
    _config_args(serve)
    serve.add_argument("--strict", action="store_true", default=None,
                       help="stop the daemon (exit 3) on the first invariant violation")
    serve.add_argument("--check-interval", type=float, metavar="SECONDS",
                       help="seconds between background invariant checks")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(handler=_serve)

    config = sub.add_parser("config", help="show the effective configuration")
    csub = config.add_subparsers(dest="config_command", metavar="ACTION")
    show = csub.add_parser("show", help="print the effective configuration as JSON "
                                        "(tokens redacted)")
    _config_args(show)
    show.set_defaults(handler=_config_show)
    return parser


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML configuration file "
                                                    "(default: $RADIXD_CONFIG if set)")
    p.add_argument("--socket", metavar="PATH", help="Unix socket path engines connect to")


def _load(args: argparse.Namespace):
    from .config import ConfigError, load_config

    overrides: dict = {}
    if getattr(args, "socket", None):
        overrides.setdefault("server", {})["socket"] = args.socket
    if getattr(args, "strict", None):
        overrides.setdefault("checker", {})["strict"] = True
    if getattr(args, "check_interval", None) is not None:
        overrides.setdefault("checker", {})["interval_s"] = args.check_interval
    if getattr(args, "log_level", None):
        overrides["log_level"] = args.log_level
    try:
        return load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"radixd: {exc}", file=sys.stderr)
        return None


def _serve(args: argparse.Namespace) -> int:
    config = _load(args)
    if config is None:
        return EXIT_USAGE
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .server import run

    try:
        return run(config)
    except OSError as exc:
        print(f"radixd: cannot serve: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def _config_show(args: argparse.Namespace) -> int:
    config = _load(args)
    if config is None:
        return EXIT_USAGE
    data = config.model_dump()
    for t in data["tenants"]:
        if t.get("token") is not None:
            t["token"] = "<redacted>"
    print(json.dumps(data, indent=2))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``radixd`` console script; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return int(handler(args))


if __name__ == "__main__":
    sys.exit(main())
