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

The cache side of all this is :class:`radixd_client.lifecycle.RequestLifecycle`; this engine
supplies the forward passes. KV is written only into pages the request got from its own
``alloc`` and has not yet handed to the tree (``RequestLifecycle.check_writable`` before every
writing pass): a page id from anywhere else is refused before anything is written, since writing
it would corrupt KV that other requests and other engines read.

Requests run interleaved, round-robin, one prefill chunk or one decode token each per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from radixd_client import Client
from radixd_client.lifecycle import RequestLifecycle
from transformers import Qwen2ForCausalLM

from .daemon_config import check_model_info
from .paged_model import PagedModel
from .request import Phase, Request


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
        """Admit a request: look its prompt up in the cache (all tiers) and lock what is used.

        A failed admission gives back whatever it took before the error is raised.
        """
        if not prompt:
            raise ValueError("empty prompt")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        cache = RequestLifecycle(self.client, self.model_name, prompt, use_l3=self.use_l3,
                                 prefetch_policy=self.prefetch_policy,
                                 label=f"request {self._next_rid}")
        req = Request(rid=self._next_rid, prompt=list(prompt), max_new_tokens=max_new_tokens,
                      cache=cache, tokens=list(prompt))
        self._next_rid += 1
        try:
            cache.admit()
        except BaseException:
            cache.abort()
            raise
        if req.prefix_len == len(req.prompt):
            # Every prompt token's KV is cached: nothing to write, but the first new token
            # needs the last prompt position's logits, so that position is run again (reading).
            req.computed_len = req.prefix_len - 1
        self.requests.append(req)
        return req

    def abort(self, req: Request) -> None:
        """Drop a request: its pages and lock go back to the daemon, nothing is inserted."""
        if req in self.requests:
            self.requests.remove(req)
        req.cache.abort()
        req.phase = Phase.DONE

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

    def _prefill_chunk(self, req: Request) -> None:
        cache = req.cache
        start = req.computed_len
        end = min(len(req.prompt), start + self.chunk_size)
        if start < req.cached_len:
            # The prompt was fully cached: rerun the last position for its logits only.
            logits = self.runner.forward(req.tokens, start, end, req.full_table, req.swa_table,
                                         write=False)
        else:
            cache.reserve(end)
            cache.check_writable(start, end)
            logits = self.runner.forward(req.tokens, start, end, req.full_table, req.swa_table)
            # The forward has completed (synchronous CPU), so the pages may go to the tree.
            cache.commit(end)
        req.computed_len = end
        if end == len(req.prompt):
            req.phase = Phase.DECODE
            self._emit(req, logits)

    # -- decode ---------------------------------------------------------------------------------

    def _emit(self, req: Request, logits: torch.Tensor) -> None:
        """Record a step's logits and its greedy token; finish after the last one."""
        req.logits.append(logits.detach().clone())
        token = int(torch.argmax(logits))
        req.output.append(token)
        req.tokens.append(token)
        req.cache.append(token)
        if len(req.output) >= req.max_new_tokens:
            # cache_finished with everything whose KV was written: the last generated token has
            # no KV yet, so it is not part of it. The request holds nothing afterwards.
            req.cache.finish()
            req.phase = Phase.DONE

    def _decode_token(self, req: Request) -> None:
        """One token: SWA the query at ``pos`` cannot see goes back and a page is allocated at a
        page boundary (one round trip), then the forward pass writes position ``pos``.

        HF's query at ``pos`` sees ``(pos - W, pos]``, so the daemon's rule (protocol 8.6)
        keeps one token more than needed, never less.
        """
        pos = req.computed_len  # the last generated token, whose KV is not written yet
        req.cache.decode_step(pos, pos + 1)
        req.cache.check_writable(pos, pos + 1)
        logits = self.runner.forward(req.tokens, pos, pos + 1, req.full_table, req.swa_table)
        req.computed_len = pos + 1
        self._emit(req, logits)

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
