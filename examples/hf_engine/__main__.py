"""Command line: ``python -m examples.hf_engine {config,run}`` (from the repository root).

``config`` prints a radixd config (TOML) whose ``[[models]]`` entry fits the example model;
``run`` connects to a daemon, runs a conversation of one or more turns and prints, per turn,
what came from the cache and the generated tokens (``--check`` compares with plain
transformers; ``--out`` saves tokens and logits for another process to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .check import compare
from .daemon_config import daemon_model_config, to_toml
from .engine import Engine
from .model import build_model, tiny_config


def _parse_tokens(text: str) -> list[int]:
    return [int(t) for t in text.replace(",", " ").split()]


def _prompt(args: argparse.Namespace, vocab: int) -> list[int]:
    if args.prompt is not None:
        return _parse_tokens(args.prompt)
    if args.prompt_file is not None:
        with open(args.prompt_file) as f:
            return [int(t) for t in json.load(f)]
    rng = random.Random(args.prompt_seed)
    return [rng.randrange(vocab) for _ in range(args.prompt_len)]


def cmd_config(args: argparse.Namespace) -> int:
    """Print a daemon config for the example model."""
    model = daemon_model_config(tiny_config(), name=args.model, page_size=args.page_size)
    config: dict[str, Any] = {}
    if args.socket:
        config["server"] = {"socket": args.socket}
    if args.redis:
        config["l3"] = {"url": args.redis, "key_prefix": args.key_prefix}
    config["models"] = [model]
    sys.stdout.write(to_toml(config))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run a conversation against a daemon; exit 1 if ``--check`` finds a difference."""
    torch.set_num_threads(args.threads)
    config = tiny_config()
    model = build_model(config, seed=args.seed)
    rng = random.Random(args.prompt_seed + 1)
    prompt = _prompt(args, config.vocab_size)
    turns: list[dict[str, Any]] = []
    failed = False
    with Engine.connect(args.socket, args.model, model, chunk_size=args.chunk_size,
                        use_l3=args.l3) as engine:
        for turn in range(args.turns):
            req = engine.generate(prompt, args.max_new_tokens)
            report: dict[str, Any] = {
                "turn": turn, "prompt_len": len(prompt), "prefix_len": req.prefix_len,
                "host_hit_len": req.host_hit_len, "loaded_len": req.loaded_len,
                "l3_hit_len": req.l3_hit_len, "fetched_len": req.fetched_len,
                "swa_pages_freed": req.swa_pages_freed, "output": req.output,
            }
            if args.check:
                cmp = compare(model, prompt, req.output, req.step_logits())
                report["check"] = cmp.describe()
                failed = failed or not cmp.ok()
            print(json.dumps(report), flush=True)
            turns.append({**report, "prompt": list(prompt), "logits": req.step_logits()})
            # The next turn: the whole conversation so far plus a new "user message".
            prompt = req.tokens + [rng.randrange(config.vocab_size)
                                   for _ in range(args.user_len)]
    if args.out:
        torch.save(turns, args.out)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m examples.hf_engine", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("config", help="print a radixd config for the example model")
    p.add_argument("--socket", default="", help="server.socket to put in the config")
    p.add_argument("--model", default="hf-tiny", help="the model's name in radixd")
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--redis", default="", help="an l3.url, e.g. redis://127.0.0.1:6379/0")
    p.add_argument("--key-prefix", default="radixd-hf-example", help="l3.key_prefix")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("run", help="run a conversation against a daemon")
    p.add_argument("--socket", default=os.environ.get("RADIXD_SERVER_SOCKET", ""),
                   required="RADIXD_SERVER_SOCKET" not in os.environ)
    p.add_argument("--model", default="hf-tiny")
    p.add_argument("--seed", type=int, default=0, help="weights seed")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="token ids, space or comma separated")
    src.add_argument("--prompt-file", help="a JSON list of token ids")
    p.add_argument("--prompt-len", type=int, default=48, help="random prompt length")
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--turns", type=int, default=1)
    p.add_argument("--user-len", type=int, default=12, help="new tokens per later turn")
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (the model is tiny: more only adds overhead)")
    p.add_argument("--l3", action="store_true", help="prefetch from Redis before matching")
    p.add_argument("--check", action="store_true", help="compare with plain transformers")
    p.add_argument("--out", help="save every turn's tokens and logits here (torch.save)")
    p.set_defaults(func=cmd_run)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
