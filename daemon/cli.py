"""The ``radixd`` command line.

Subcommands import their implementation lazily, so ``radixd --help`` stays fast and does not pull
in torch, and a subcommand whose module is missing fails with a clear message instead of breaking
the whole command.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from daemon import __version__


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser (separate from ``main`` so tests can inspect it)."""
    parser = argparse.ArgumentParser(
        prog="radixd",
        description="KV-cache and prefix radix tree daemon for LLM inference engines.",
    )
    parser.add_argument("--version", action="version", version=f"radixd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="run the core's built-in demo/benchmark (no daemon, no engine)",
        description="Run the core's built-in demo/benchmark. Extra arguments go to the demo.",
    )
    # The demo owns its options: whatever follows `demo` is handed to it untouched, as
    # `args.demo_args` (see main), so it can grow options without touching this file.
    demo.set_defaults(handler=_run_demo, passthrough=True)
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    try:
        demo = importlib.import_module("daemon.demo")
    except ModuleNotFoundError as exc:
        if exc.name != "daemon.demo":
            raise
        print("radixd: the demo is not available in this build (daemon.demo missing)",
              file=sys.stderr)
        return 2
    result = demo.main(args)
    return int(result or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``radixd`` console script; returns the process exit status."""
    parser = build_parser()
    argv_list = list(sys.argv[1:] if argv is None else argv)
    args, _extra = parser.parse_known_args(argv_list)
    if getattr(args, "passthrough", False):
        # Everything before the subcommand is parsed strictly; everything after belongs to it.
        cut = argv_list.index(args.command) + 1
        args = parser.parse_args(argv_list[:cut])
        args.demo_args = argv_list[cut:]
    else:
        args = parser.parse_args(argv_list)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    return int(handler(args))


if __name__ == "__main__":
    sys.exit(main())
