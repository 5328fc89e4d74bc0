"""One client process of ``radixd bench soak``: whole request lifecycles with verified pages.

The worker is an engine that computes nothing but writes, into every page it allocates, values
that only the tokens decide: position ``p`` of a sequence gets ``f(tokens[:p + 1])``, a rolling
hash below 2**24 (exact in float32). A page the tree hands back on a hit therefore holds exactly
the values this worker can recompute from its own prompt, whichever client wrote it and however
it travelled (device, host, Redis, a warm restart). Every hit is read back through the mapped
pools and compared; the full pages of the whole hit and the SWA pages of its window.

A daemon restart is ridden through the way an engine would: the client has a reconnect policy
(``radixd_client.Reconnect``), so it connects again by itself, maps its pools again into the same
tensors and raises ``SessionRestarted`` once; the request in flight is given up (its locks and
pages died with the session) and the next one starts over. Counts go to the parent after every
request.
"""

from __future__ import annotations

import random
import time
from typing import Any

from radixd_client import Client, Reconnect
from radixd_client.errors import (
    ConnectFailed,
    ConnectionLost,
    RadixdError,
    SessionRestarted,
    ShuttingDown,
)
from radixd_client.lifecycle import RequestLifecycle

from .soak_keyed import KEYED_COUNTS, KeyedOptions, KeyedSoak

__all__ = ["PageVerifier", "expected_values", "worker_main"]

_MOD = 1 << 24


def expected_values(tokens: Any, start: int, end: int, h0: int = 0) -> list[float]:
    """The values of positions [start, end): a rolling hash of the tokens up to each position
    (``h0`` is the hash through ``start - 1``; 0 at the start of a sequence)."""
    out: list[float] = []
    h = h0
    for p in range(start, end):
        h = (h * 1_000_003 + int(tokens[p]) + 1) % _MOD
        out.append(float(h + 1))
    return out


def _prefix_hash(tokens: Any, end: int) -> int:
    h = 0
    for p in range(end):
        h = (h * 1_000_003 + int(tokens[p]) + 1) % _MOD
    return h


class PageVerifier:
    """Reads and writes token positions in the mapped pools (float32 pools only)."""

    def __init__(self, pools: Any, page_size: int) -> None:
        self.pools = pools
        self.P = page_size

    def write(self, kind: str, table: list[int], tokens: Any, start: int, end: int) -> None:
        import torch

        pool = self.pools.pool(kind)  # [layers, 2, pages, P, heads, dim]
        vals = expected_values(tokens, start, end, _prefix_hash(tokens, start))
        P = self.P
        p = start
        while p < end:
            j, off = divmod(p, P)
            n = min(P - off, end - p)
            if table[j]:  # 0: an SWA page already freed (out of the window)
                chunk = torch.tensor(vals[p - start: p - start + n], dtype=pool.dtype)
                pool[:, :, table[j], off:off + n] = chunk.view(1, 1, n, 1, 1)
            p += n

    def verify(self, kind: str, table: list[int], tokens: Any, start: int, end: int
               ) -> tuple[int, int]:
        """(pages checked, pages whose values differ) over positions [start, end)."""
        pool = self.pools.pool(kind)
        vals = expected_values(tokens, start, end, _prefix_hash(tokens, start))
        P = self.P
        checked = bad = 0
        p = start
        while p < end:
            j, off = divmod(p, P)
            n = min(P - off, end - p)
            page = pool[:, :, table[j], off:off + n]
            want = vals[p - start: p - start + n]
            got = page.amin(dim=(0, 1, 3, 4)).tolist(), page.amax(dim=(0, 1, 3, 4)).tolist()
            checked += 1
            if got[0] != want or got[1] != want:
                bad += 1
            p += n
        return checked, bad


_RECONNECT = Reconnect(max_wait_s=60.0)


def _connect(socket_path: str, token: str, name: str) -> Client:
    """The first connection (a worker started while the daemon restarts waits for it too)."""
    attempts = _RECONNECT.attempts(socket_path)
    while True:
        try:
            return Client(socket_path, token=token, client_name=name, reconnect=_RECONNECT)
        except (ConnectFailed, ConnectionLost, ShuttingDown) as exc:
            time.sleep(attempts.wait_after(exc))


def worker_main(index: int, socket_path: str, token: str, model: str, docs: list[list[int]],
                seed: int, suffix: int, output: int, chunk: int, stop: Any, results: Any,
                namespace: str = "", keyed: KeyedOptions | None = None) -> None:
    """Run requests (each followed by a round of keyed pages, with ``keyed``) until ``stop`` is
    set; put a counts dict on ``results`` after each one. ``namespace``: the tenant's, which
    the keyed pages' values are derived from."""
    rng = random.Random(seed)
    name = f"radixd-soak-{index}"
    client: Client | None = None
    pages: PageVerifier | None = None
    kv = (KeyedSoak(model, namespace, f"{index}.{seed}", keyed, random.Random(~seed))
          if keyed is not None else None)
    while not stop.is_set():
        counts: dict[str, Any] = {"requests": 0, "verified_pages": 0, "mismatches": 0,
                                  "restarted": 0, "failed": {}, **dict.fromkeys(KEYED_COUNTS, 0)}
        try:
            if client is None:
                client = _connect(socket_path, token, name)
            if pages is None:  # (an attach that a daemon restart cut short is made again)
                pages = PageVerifier(client.attach(model), client.models[model].page_size)
            prompt = rng.choice(docs) + [rng.randrange(1, 30000) for _ in range(suffix)]
            out = [rng.randrange(1, 30000) for _ in range(output)]
            _serve(client, pages, model, prompt, out, chunk, counts)
            counts["requests"] = 1
            if kv is not None:
                kv.round(client, counts)
        except SessionRestarted:
            counts["restarted"] = 1  # the client is on the successor, its pools mapped again
        except (ConnectionLost, ShuttingDown, ConnectFailed):
            counts["restarted"] = 1
            if client is not None:
                client.close()
            client, pages = None, None
        except RadixdError as exc:
            counts["failed"] = {exc.code: 1}
            if client is not None:
                client.close()  # the session's end gives back what the request held
            client, pages = None, None
        results.put((index, counts))
    if client is not None:
        client.close()


def _serve(client: Client, pages: PageVerifier, model: str, prompt: list[int], out: list[int],
           chunk: int, counts: dict[str, Any]) -> None:
    lc = RequestLifecycle(client, model, prompt, use_l3=True, label="soak")
    adm = lc.admit()
    hit = adm.prefix_len
    if hit:
        c, b = pages.verify("full", lc.full_table, lc.tokens, 0, hit)
        counts["verified_pages"] += c
        counts["mismatches"] += b
        if lc.window is not None:
            lo = max(0, hit - lc.window)
            lo -= lo % lc.page_size
            if all(lc.swa_table[j] for j in range(lo // lc.page_size, -(-hit // lc.page_size))):
                c, b = pages.verify("swa", lc.swa_table, lc.tokens, lo, hit)
                counts["verified_pages"] += c
                counts["mismatches"] += b
    L = lc.prompt_len
    seq = lc.computed_len
    while seq < L:
        seq = min(L, seq + chunk)
        lc.reserve(seq)
        lc.check_writable(lc.computed_len, seq)
        _write(pages, lc, lc.computed_len, seq)
        lc.computed_len = seq
        lc.free_out_of_window(seq)
        if seq < L:
            lc.commit(seq)
    committed = L + len(out) - 1
    lc.append(out)
    P = lc.page_size
    while seq < committed:
        nxt = seq + min(P - seq % P if seq % P else P, committed - seq)
        lc.decode_step(nxt, nxt)
        lc.check_writable(seq, nxt)
        _write(pages, lc, seq, nxt)
        seq = lc.computed_len = nxt
    lc.finish(committed)


def _write(pages: PageVerifier, lc: RequestLifecycle, start: int, end: int) -> None:
    pages.write("full", lc.full_table, lc.tokens, start, end)
    if lc.window is not None:
        pages.write("swa", lc.swa_table, lc.tokens, start, end)
