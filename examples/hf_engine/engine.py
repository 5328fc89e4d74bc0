"""A small greedy-decoding engine whose KV cache lives in radixd.

Per request (docs/protocol.md sections 6 and 8 are the contract followed here):

1. admission: with L3 on, ``prefetch(wait_complete)`` first, so Redis pages are on host before
   the match; then a probing ``match``. If it reports host (L2) hits, ``load(lock=True)`` brings
   them to device and is the match used; otherwise ``match(lock=True)``. The match gives the full
   pages of the usable prefix and the SWA pages of its trailing window, and a receipt.
2. prefill in chunks: ``alloc`` pages for the chunk, run the model (K/V written into the pools),
   then ``cache_unfinished``, which puts the aligned pages in the tree, moves the lock to the new
   end, and returns the canonical page ids the page tables switch to. A prompt that is entirely
   cached is run again only for its last token's logits, reading (not writing) the tree's pages.
3. decode, one token per step: ``alloc`` a page at each page boundary; SWA pages that left the
   window are given back (``free`` for the request's own pages, ``release_swa`` for the locked
   prefix), which moves the SWA frontier ``swa_evicted_len``.
4. ``cache_finished``: what was computed goes into the tree; everything else is freed.

KV is written only into pages the request got from its own ``alloc`` and has not yet handed to
the tree (:meth:`Engine._check_writable`): a page id that came from anywhere else (a matched
prefix, a result meant for another request) is refused before anything is written, since
writing it would corrupt KV that other requests and other engines read.

Requests run interleaved, round-robin, one prefill chunk or one decode token each per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from radixd_client import Client, pages
from radixd_client.protocol import AllocResult, InsertResult, MatchResult
from transformers import Qwen2ForCausalLM

from .daemon_config import check_model_info
from .paged_model import PagedModel
from .request import Phase, Request


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Engine:
    """Greedy generation for one model over one radixd session.

    The engine does not own ``client`` unless it was made by :meth:`connect`; either way every
    page and receipt it takes belongs to that client's session, so closing the connection
    releases whatever an interrupted request still held.
    """

    def __init__(self, client: Client, model_name: str, model: Qwen2ForCausalLM, *,
                 chunk_size: int = 16, use_l3: bool = False,
                 prefetch_policy: str = "wait_complete") -> None:
        if chunk_size < 1:
            raise ValueError("chunk_size must be at least 1")
        if model_name not in client.models:
            raise ValueError(f"radixd has no model {model_name!r} for this tenant "
                             f"(it has {sorted(client.models)})")
        self.info = client.models[model_name]
        check_model_info(self.info, model.config)
        self.client = client
        self.model_name = model_name
        self.chunk_size = chunk_size
        self.use_l3 = use_l3
        self.prefetch_policy = prefetch_policy
        self.page_size = self.info.page_size
        self.window = self.info.sliding_window
        self.pools = client.attach(model_name)
        self.runner = PagedModel(model, self.pools)
        self.requests: list[Request] = []
        self._next_rid = 1
        self._owns_client = False

    @classmethod
    def connect(cls, socket_path: str, model_name: str, model: Qwen2ForCausalLM, *,
                token: str | None = None, chunk_size: int = 16, use_l3: bool = False,
                prefetch_policy: str = "wait_complete", timeout: float | None = 120.0
                ) -> Engine:
        """An engine on its own new connection (its own daemon session), closed by
        :meth:`close`. ``timeout`` bounds each call to the daemon."""
        client = Client(socket_path, token, client_name="hf-engine", timeout=timeout)
        try:
            engine = cls(client, model_name, model, chunk_size=chunk_size, use_l3=use_l3,
                         prefetch_policy=prefetch_policy)
        except BaseException:
            client.close()
            raise
        engine._owns_client = True
        return engine

    # -- requests -------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], max_new_tokens: int) -> Request:
        """Admit a request: look its prompt up in the cache (all tiers) and lock what is used."""
        if not prompt:
            raise ValueError("empty prompt")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        req = Request(rid=self._next_rid, prompt=list(prompt), max_new_tokens=max_new_tokens,
                      tokens=list(prompt))
        self._next_rid += 1
        self._admit(req)
        self.requests.append(req)
        return req

    def _admit(self, req: Request) -> None:
        """Find and lock the longest usable cached prefix, from whichever tier holds it.

        The probe is unlocked so that no receipt has to be given back when ``load`` (which
        takes its own lock) is the call that decides the prefix.
        """
        c, name = self.client, self.model_name
        if self.use_l3:
            pf = c.prefetch(name, req.prompt, policy=self.prefetch_policy)
            req.prefetch_status, req.l3_hit_len = pf.status, pf.l3_hit_len
            req.fetched_len = pf.fetched_len
        # Probe without a lock: only to learn whether host (L2) holds more than the device.
        probe = c.match(name, req.prompt)
        req.host_hit_len = probe.host_hit_len
        m: MatchResult
        if probe.host_hit_len > 0:
            loaded = c.load(name, req.prompt, lock=True)
            req.loaded_len = loaded.loaded_len
            m = loaded
        else:
            m = c.match(name, req.prompt, lock=True)
        req.receipt = m.receipt
        req.prefix_len = req.cached_len = req.computed_len = m.prefix_len
        req.full_hit_len = m.full_hit_len
        full = list(pages(m.full_pages))
        swa = list(pages(m.swa_pages))
        # The match gives SWA pages only for the prefix's trailing window; 0 before it.
        req.full_table = full
        req.swa_table = [0] * (len(full) - len(swa)) + swa
        if m.prefix_len == len(req.prompt):
            # Every prompt token's KV is cached: nothing to write, but the first new token
            # needs the last prompt position's logits, so that position is run again (reading).
            req.computed_len = m.prefix_len - 1

    def step(self) -> bool:
        """Advance every unfinished request once (a prefill chunk or a decode token), in turn.

        Returns whether any request is still unfinished.
        """
        for req in self.requests:
            if req.phase is Phase.PREFILL:
                self._prefill_chunk(req)
            elif req.phase is Phase.DECODE:
                self._decode_token(req)
        self.requests = [r for r in self.requests if not r.done]
        return bool(self.requests)

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self.step():
            pass

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> Request:
        """One request, run to completion (other submitted requests advance meanwhile)."""
        req = self.submit(prompt, max_new_tokens)
        while not req.done:
            self.step()
        return req

    # -- prefill --------------------------------------------------------------------------------

    def _alloc_through(self, req: Request, end: int) -> None:
        """Make the page tables cover positions ``[0, end)``, allocating the missing pages."""
        need = _ceil_div(end, self.page_size) - len(req.full_table)
        if need > 0:
            self._take_pages(req, self.client.alloc(self.model_name, need), need)

    def _take_pages(self, req: Request, a: AllocResult, n: int) -> None:
        """Append the pages of one ``alloc`` of ``n`` to the tables, as writable by ``req``."""
        full = pages(a.full_pages)
        swa = pages(a.swa_pages) if self.window is not None else [0] * n
        if len(full) != n or len(swa) != n:
            raise RuntimeError(f"request {req.rid}: alloc of {n} returned {len(full)} full and "
                               f"{len(swa)} SWA pages")
        req.full_table += full
        req.swa_table += swa
        req.writable_full.update(full)
        if self.window is not None:
            req.writable_swa.update(swa)

    def _check_writable(self, req: Request, start: int, end: int) -> None:
        """Positions ``[start, end)`` are about to be written: their pages must be this
        request's own (allocated, not yet in the tree)."""
        for j in range(start // self.page_size, _ceil_div(end, self.page_size)):
            full, swa = req.full_table[j], req.swa_table[j]
            if full not in req.writable_full or (self.window is not None
                                                 and swa not in req.writable_swa):
                raise RuntimeError(f"request {req.rid}: refusing to write sequence page {j} "
                                   f"into full page {full} / SWA page {swa}: not pages this "
                                   "request allocated")

    def _prefill_chunk(self, req: Request) -> None:
        start = req.computed_len
        end = min(len(req.prompt), start + self.chunk_size)
        if start < req.cached_len:
            # The prompt was fully cached: rerun the last position for its logits only.
            logits = self.runner.forward(req.tokens, start, end, req.full_table, req.swa_table,
                                         write=False)
        else:
            self._alloc_through(req, end)
            self._check_writable(req, start, end)
            logits = self.runner.forward(req.tokens, start, end, req.full_table, req.swa_table)
            # The forward has completed (synchronous CPU), so the pages may go to the tree.
            self._cache_unfinished(req, end)
        req.computed_len = end
        if end == len(req.prompt):
            req.phase = Phase.DECODE
            self._emit(req, logits)

    def _cache_unfinished(self, req: Request, end: int) -> None:
        lo, hi = req.cached_len // self.page_size, _ceil_div(end, self.page_size)
        res = self.client.cache_unfinished(
            self.model_name, req.tokens[:end], req.full_table[lo:hi], req.swa_table[lo:hi],
            prev_prefix_len=req.cached_len, swa_evicted_len=req.swa_evicted_len,
            receipt=req.receipt)
        self._adopt_canonical(req, res)
        req.receipt = res.receipt
        req.cached_len = res.inserted_len

    def _adopt_canonical(self, req: Request, res: InsertResult) -> None:
        """Switch the page tables to the tree's ids for ``[prev_prefix_len, inserted_len)``:
        the caller's duplicates were freed by the daemon and may already be someone else's."""
        lo = req.cached_len // self.page_size
        handed = range(lo, res.inserted_len // self.page_size)
        req.writable_full.difference_update(req.full_table[j] for j in handed)
        req.writable_swa.difference_update(req.swa_table[j] for j in handed)
        full = pages(res.full_pages)
        req.full_table[lo:lo + len(full)] = full
        if self.window is not None:
            swa = pages(res.swa_pages)
            req.swa_table[lo:lo + len(swa)] = swa

    # -- decode ---------------------------------------------------------------------------------

    def _emit(self, req: Request, logits: torch.Tensor) -> None:
        """Record a step's logits and its greedy token; finish after the last one."""
        req.logits.append(logits.detach().clone())
        token = int(torch.argmax(logits))
        req.output.append(token)
        req.tokens.append(token)
        if len(req.output) >= req.max_new_tokens:
            self._finish(req)

    def _decode_token(self, req: Request) -> None:
        pos = req.computed_len  # the last generated token, whose KV is not written yet
        free_ids, release = self._out_of_window(req, pos)
        need_page = pos // self.page_size == len(req.full_table)
        if free_ids or release or need_page:
            # One round trip for the step's bookkeeping.
            with self.client.batch() as b:
                freed = b.free(self.model_name, swa_pages=free_ids) if free_ids else None
                released = b.release_swa(self.model_name, req.receipt) if release else None
                alloc = b.alloc(self.model_name, 1) if need_page else None
            for fut in (freed, released):
                if fut is not None:
                    fut.result()
            if alloc is not None:
                self._take_pages(req, alloc.result(), 1)
        self._check_writable(req, pos, pos + 1)
        logits = self.runner.forward(req.tokens, pos, pos + 1, req.full_table, req.swa_table)
        req.computed_len = pos + 1
        self._emit(req, logits)

    def _out_of_window(self, req: Request, length: int) -> tuple[list[int], bool]:
        """SWA that the next query (at position ``length``) can no longer see, to give back.

        The daemon's rule (protocol 8.6): with ``length`` tokens computed, a page ``[a, a+P)``
        is out once ``a + P <= length - W``. HF's query at ``length`` sees ``(length - W,
        length]``, so this keeps one token more than needed, never less. Held pages are freed
        in position order (the frontier moves); the locked prefix's window is released with
        ``release_swa`` once it is entirely out. The page tables get 0 for what was given back.
        """
        if self.window is None:
            return [], False
        edge = length - self.window
        release = (req.cached_len > 0 and not req.swa_released and req.receipt is not None
                   and edge >= req.cached_len)
        if release:
            req.swa_released = True
            for j in range(req.cached_len // self.page_size):
                req.swa_table[j] = 0
        P = self.page_size
        free_ids: list[int] = []
        j = max(req.cached_len, req.swa_evicted_len) // P
        while (j + 1) * P <= edge and j < len(req.swa_table):
            page = req.swa_table[j]
            if page == 0:
                raise RuntimeError(f"request {req.rid}: SWA page {j} is already 0 above the "
                                   f"frontier {req.swa_evicted_len}")
            free_ids.append(page)
            req.writable_swa.discard(page)
            req.swa_table[j] = 0
            req.swa_evicted_len = (j + 1) * P
            j += 1
        req.swa_pages_freed += len(free_ids)
        return free_ids, release

    def _finish(self, req: Request) -> None:
        """``cache_finished`` with everything whose KV was written; the request holds nothing
        afterwards (the last generated token has no KV yet, so it is not part of it)."""
        end = req.computed_len
        lo, hi = req.cached_len // self.page_size, _ceil_div(end, self.page_size)
        res = self.client.cache_finished(
            self.model_name, req.tokens[:end], req.full_table[lo:hi], req.swa_table[lo:hi],
            prev_prefix_len=req.cached_len, swa_evicted_len=req.swa_evicted_len,
            receipt=req.receipt)
        req.receipt = None
        req.finished_inserted_len = res.inserted_len
        req.full_table, req.swa_table = [], []
        req.writable_full.clear()
        req.writable_swa.clear()
        req.phase = Phase.DONE

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Drop the pool mappings (and the connection, if this engine made it)."""
        self.pools.close()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
