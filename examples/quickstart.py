"""radixd in one file: two requests that share a prompt prefix, the second reusing the first's KV.

Start the daemon with its built-in default configuration, then run this against it::

    ./scripts/run.sh                                  # terminal 1: `radixd serve`
    .venv/bin/python examples/quickstart.py           # terminal 2

``--socket`` defaults to the socket the daemon uses by default (``/run/radixd/radixd.sock`` for
root, ``$XDG_RUNTIME_DIR/radixd/radixd.sock`` otherwise, ``/tmp/radixd-UID/...`` without
``XDG_RUNTIME_DIR``); ``--token`` (or ``$RADIXD_TOKEN``) is needed only when the daemon has
tenants with tokens. The engine side is :class:`radixd_client.lifecycle.RequestLifecycle`; the
"model" is a stand-in whose forward pass writes each token's id as its K (and minus it as its V),
so that a page read later shows which tokens' KV it holds (as far as the pool's dtype holds the
id exactly: see :func:`kv_value`). ``examples/hf_engine`` is the same
loop around a real transformer.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

import torch
from radixd_client import Client
from radixd_client.errors import RadixdError
from radixd_client.lifecycle import NotWritable, RequestLifecycle
from radixd_client.pools import AttachedPools

VOCAB = 2000  # token ids stay exact in float16 and float32 pools (see kv_value)


def default_socket() -> str:
    """The daemon's default socket path (daemon/config.py ``default_socket_path``; repeated here
    because an engine has the client library, not the daemon, installed)."""
    service = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if service:  # run as a systemd service with RuntimeDirectory=, as the daemon is
        return str(Path(service) / "radixd.sock")
    if os.geteuid() == 0:
        return "/run/radixd/radixd.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime else Path(f"/tmp/radixd-{os.geteuid()}")
    return str(base / "radixd" / "radixd.sock")


def kv_value(token: int, dtype: torch.dtype) -> float:
    """What the stand-in model writes for ``token`` into a pool of ``dtype``: the token id where
    the dtype holds it exactly, else the id folded into the integers it does hold (bfloat16: up
    to 256, float8: 8 or 16), never 0 (an unwritten slot), so the value read back is the value
    written in every KV dtype radixd accepts (2 / eps: the first integer the dtype rounds)."""
    exact = int(2 / torch.finfo(dtype).eps)
    return float(1 + (token - 1) % (exact - 1))


def forward(pools: AttachedPools, lc: RequestLifecycle, start: int, end: int) -> None:
    """The stand-in forward pass: KV for positions ``[start, end)`` into the request's own pages
    (every layer: K = :func:`kv_value` of the token id, V = minus it). ``check_writable`` first:
    a page from a match is shared with other requests and must never be written."""
    lc.check_writable(start, end)
    P = lc.page_size
    for pos in range(start, end):
        j, slot = divmod(pos, P)
        token = kv_value(lc.tokens[pos], pools.full.dtype)
        for pool, table in ((pools.full, lc.full_table), (pools.swa, lc.swa_table)):
            if pool is not None:
                pool[:, 0, table[j], slot] = token
                pool[:, 1, table[j], slot] = -token
    if pools.full.is_cuda:  # the KV must be on the device before the pages are handed on
        torch.cuda.synchronize(pools.full.device)


def next_token(token: int) -> int:
    """The stand-in sampler."""
    return (token * 31 + 7) % VOCAB


def run_request(c: Client, pools: AttachedPools, model: str, label: str, prompt: list[int],
                chunk: int, decode: int) -> list[int]:
    """Admit, prefill in chunks, decode ``decode`` tokens, finish; returns the request's full
    page ids of the prompt (as the tree holds them at the end)."""
    lc = RequestLifecycle(c, model, prompt, label=label)
    try:
        adm = lc.admit()
        print(f"{label}: prompt {len(prompt)} tokens, {adm.prefix_len} cached "
              f"(device {adm.device_hit_len}, host {adm.loaded_len})")
        print(f"  matched full pages: {lc.full_table}")
        if lc.full_table:
            try:
                lc.check_writable(0, 1)
            except NotWritable:
                print("  check_writable refuses a write into a matched page: it is shared")
        while lc.computed_len < lc.prompt_len:  # prefill, chunk by chunk
            start, end = lc.computed_len, min(lc.prompt_len, lc.computed_len + chunk)
            lc.reserve(end)
            forward(pools, lc, start, end)
            lc.computed_len = end
            lc.commit(end)  # the aligned pages enter the tree; canonical ids adopted
            print(f"  prefill [{start}, {end}): {lc.cached_len} tokens in the tree")
        token = next_token(lc.tokens[-1])
        for _ in range(decode):
            lc.append(token)
            pos = len(lc.tokens) - 1
            lc.decode_step(pos, pos + 1)  # frees SWA out of the window, allocates a page per P
            forward(pools, lc, pos, pos + 1)
            lc.computed_len = pos + 1
            token = next_token(token)
        print(f"  decoded {decode} tokens: {len(lc.tokens)} in the sequence, "
              f"{lc.swa_pages_freed} SWA pages freed, prefix SWA released: {lc.swa_released}")
        prompt_pages = lc.full_table[:len(prompt) // lc.page_size]
        res = lc.finish()
        print(f"  finished: {res.inserted_len} tokens in the tree")
        print(f"  full pages of the prompt: {prompt_pages}")
        return prompt_pages
    except BaseException:
        lc.abort()  # give back every page and the lock (closing the session would too)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--socket", default=default_socket(),
                    help="the daemon's socket (default: %(default)s)")
    ap.add_argument("--token", default=os.environ.get("RADIXD_TOKEN"),
                    help="tenant token, if the daemon has tenants (default: $RADIXD_TOKEN)")
    ap.add_argument("--model", default="default",
                    help="the model entry to use (default: %(default)s, the built-in one)")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the prompts (default: fresh ones each run, so request 1 "
                         "starts cold)")
    args = ap.parse_args(argv)
    if not os.path.exists(args.socket):
        print(f"no socket at {args.socket}: is the daemon running (./scripts/run.sh)? "
              "Otherwise pass --socket", file=sys.stderr)
        return 1
    rng = random.Random(args.seed)
    try:
        with Client(args.socket, token=args.token, client_name="quickstart") as c:
            model = args.model
            if model not in c.models:
                print(f"radixd at {args.socket} serves no model {model!r} to this session; it "
                      f"serves {', '.join(sorted(c.models)) or 'none'}: pass --model",
                      file=sys.stderr)
                return 1
            info = c.models[model]
            P, W = info.page_size, info.sliding_window
            print(f"model {model!r}: page size {P}, sliding window {W}, "
                  f"{info.full_pages} full / {info.swa_pages} SWA pages on {info.device}")
            pools = c.attach(model)  # the KV pools, mapped into this process
            shared = [rng.randrange(1, VOCAB) for _ in range(10 * P)]  # a "system prompt"
            prompts = [shared + [rng.randrange(1, VOCAB) for _ in range(P + P // 2)]
                       for _ in range(2)]
            # decode until the window has moved past the whole prompt, so SWA is given back
            decode = (W or 0) + 2 * P
            first = run_request(c, pools, model, "request 1", prompts[0], 4 * P, decode)
            second = run_request(c, pools, model, "request 2", prompts[1], 4 * P, P)
            n = len(shared) // P
            same = first[:n] == second[:n]
            print(f"request 2 reused request 1's first {n} pages: {same}")
            page = second[n - 1]
            held = [int(x) for x in pools.full[0, 0, page, :, 0, 0].float().tolist()]
            tokens = shared[(n - 1) * P:n * P]
            written = held == [kv_value(t, pools.full.dtype) for t in tokens]
            print(f"full page {page} holds the KV request 1 wrote for tokens {tokens}: {written}")
            pools.close()
            return 0 if same and written else 1
    except (RadixdError, OSError) as exc:
        print(f"radixd at {args.socket}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
