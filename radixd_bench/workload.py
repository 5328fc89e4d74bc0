"""The multi-turn chat workload (the shape of SGLang's bench_multiturn), and its ideal hit rate.

Shared by ``radixd bench multiturn`` (radixd_bench), which replays it against a running daemon,
and by bench/multiturn.py and bench/tier_bench.py, which replay it in process. Its field defaults
are the workload's defaults everywhere (the CLI, ``radixd_bench.Options``, bench/, the tests).

Each client starts with a prompt of ``first_prompt`` random tokens; every round it sends its whole
history, decodes ``output`` tokens, and the history grows by the output plus a ``subq``-token
sub-question. Hit rate is SGLang's ``sum(cached tokens) / sum(prompt tokens)``; the ideal counts,
for rounds after the first, the page-aligned previous prompt plus its committed output (the last
sampled token is never forwarded, so it has no KV).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Workload:
    """One multi-turn workload and its page geometry (``page_size``, ``window``, ``swa_ratio``
    size the in-process replay's pools; the daemon run takes them from the daemon)."""

    clients: int = 10
    rounds: int = 10
    first_prompt: int = 300
    output: int = 3000
    subq: int = 300
    page_size: int = 64
    window: int = 128
    swa_ratio: float = 0.2
    max_parallel: int = 1
    prefill_chunk: int = 2048  # chunked prefill, with cache_unfinished after each chunk
    swa_eviction_interval: int = 128  # decode tokens between SWA frees (SGLang's default)
    seed: int = 1

    def prompt_len(self, r: int) -> int:
        return self.first_prompt + r * (self.output + self.subq)

    def working_set_pages(self) -> int:
        """Pages of every conversation's committed KV at the end of the run."""
        last = self.prompt_len(self.rounds - 1) + self.output - 1
        return self.clients * (last // self.page_size)

    def ideal_hit_rate(self) -> float:
        P = self.page_size
        hit = total = 0
        for r in range(self.rounds):
            total += self.prompt_len(r) * self.clients
            if r:
                hit += (self.prompt_len(r - 1) + self.output - 1) // P * P * self.clients
        return hit / total
