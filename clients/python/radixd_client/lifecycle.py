"""One engine request's life in radixd, from admission to ``cache_finished`` or an abort.

Every engine repeats the same bookkeeping around its forward passes (docs/protocol.md sections
6, 8, 9 and 10 are the contract): find and lock the longest usable prefix in whichever tier holds
it, allocate pages chunk by chunk, hand each completed prefill chunk to the tree and switch to the
canonical page ids it returns, give SWA back as it leaves the window during decode while keeping
the single ``swa_evicted_len`` frontier right, and finally insert what was computed. Getting one
of these wrong does not fail loudly: it corrupts KV other requests read, or leaks pages until the
session ends. :class:`RequestLifecycle` holds that state once so that an engine only supplies the
forward pass.

The caller drives it (the class never computes anything)::

    lc = RequestLifecycle(client, "m", prompt)
    lc.admit()                                  # prefetch?, match(lock), load?
    while lc.computed_len < len(prompt):        # chunked prefill
        end = min(len(prompt), lc.computed_len + chunk)
        lc.reserve(end)                         # alloc
        lc.check_writable(lc.computed_len, end) # protocol 8.9, before the kernel writes
        ...forward pass writing [computed_len, end), synchronized (protocol 8.1)...
        lc.commit(end)                          # cache_unfinished, canonical ids adopted
    while generating:
        lc.append(token)
        pos = len(lc.tokens) - 1
        lc.decode_step(pos, pos + 1)            # free/release_swa/alloc in one round trip
        lc.check_writable(pos, pos + 1)
        ...forward pass writing position pos...
        lc.computed_len = pos + 1
    lc.finish()                                 # cache_finished; or lc.abort() at any point

A step whose result names pool segments this process could not map raises
:class:`~radixd_client.errors.SegmentsNotMapped` after recording what the step took: from then on
the request refuses every step but ``lc.abort()``, which gives it back.

With a client that rides through daemon restarts (``Client(..., reconnect=Reconnect())``), any
step may raise :class:`~radixd_client.errors.SessionRestarted`: call ``lc.restart()`` and go back
to ``lc.admit()``, recomputing from the prefix it finds.

Only public methods of :class:`~radixd_client.Client` are used, so any object with the same
methods (a test double, an adapter over an in-process cache) can stand in for it; its
``on_session`` is used where it has one (a stand-in without it is trusted to be used by one
thread).
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .client import pages
from .errors import SegmentsNotMapped, SessionRestarted
from .protocol import InsertResult

__all__ = ["Admission", "NotWritable", "RequestLifecycle", "out_of_window_edge"]

_R = TypeVar("_R")


class NotWritable(RuntimeError):
    """A forward pass was about to write KV into a page this request does not own.

    Raised before anything is written: a page id from a match, a stale table entry or another
    request's result would overwrite KV that other requests and other engines read (protocol
    8.9), and the daemon cannot see writes into the mapped pools to catch it.
    """


@dataclass
class Admission:
    """Where the request's usable prefix came from, as the daemon reported it.

    Kept because benches and logs split hits by tier: ``device_hit_len`` was usable at once,
    ``prefix_len - device_hit_len`` only after ``load`` copied it from host.
    """

    prefix_len: int = 0  # the usable prefix the request starts from (match or load)
    device_hit_len: int = 0  # prefix_len of the first (locked) match
    full_hit_len: int = 0
    host_hit_len: int = 0  # as the first match reported it, before any load
    loaded_len: int = 0  # as load reported it (0 without a load)
    l3_hit_len: int = 0  # as prefetch reported it
    fetched_len: int = 0  # as prefetch reported it
    prefetch_status: str = ""


def out_of_window_edge(length: int, window: int) -> int:
    """The position below which SWA KV is dead once ``length`` tokens have KV (protocol 8.6):
    a page ``[a, a + P)`` may be given back when ``a + P <= edge``."""
    return length - window


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class RequestLifecycle:
    """The cache-side state of one request over one radixd session.

    Page tables are indexed by sequence page: ``full_table[j]`` / ``swa_table[j]`` hold the page
    ids of positions ``[j*P, (j+1)*P)`` (SWA 0 where the request has none: before the matched
    prefix's window, freed pages, tombstones). ``cached_len`` is the prefix in the tree and
    covered by ``receipt``; ``swa_evicted_len`` the frontier of freed SWA after it.

    ``swa_free_interval``: decode frees out-of-window SWA only once the sequence has grown that
    many tokens since the last freeing pass (SGLang frees every 128 tokens; 1 frees as early as
    possible). Releasing the locked prefix's SWA is never delayed. ``free_swa=False`` keeps
    every SWA page to the end (the baseline that shows what freeing saves).

    Every page and receipt belongs to the client's session, so closing that session returns
    whatever an interrupted request still held; :meth:`abort` returns it without closing.
    """

    def __init__(self, client: Any, model: str, prompt: Iterable[int], *,
                 use_l3: bool = False, prefetch_policy: str = "wait_complete",
                 swa_free_interval: int = 1, free_swa: bool = True,
                 label: str = "request") -> None:
        info = client.models.get(model)
        if info is None:
            raise ValueError(f"radixd serves no model {model!r} to this session")
        if swa_free_interval < 1:
            raise ValueError("swa_free_interval must be at least 1")
        self.client = client
        self.model = model
        self.label = label
        self.page_size: int = info.page_size
        self.window: int | None = info.sliding_window if info.swa_pages else None
        self.use_l3 = use_l3
        self.prefetch_policy = prefetch_policy
        self.swa_free_interval = swa_free_interval
        self.free_swa = free_swa
        self.tokens = array("i", prompt)
        self.prompt_len = len(self.tokens)
        if not self.prompt_len:
            raise ValueError("empty prompt")
        self.admission = Admission()
        self.full_table: list[int] = []
        self.swa_table: list[int] = []
        # Pages this request's own allocs returned and it has not handed to the tree or freed:
        # the only ones its forward passes may write into (protocol 8.9).
        self.writable_full: set[int] = set()
        self.writable_swa: set[int] = set()
        self.computed_len = 0  # tokens[:computed_len] have their KV written (caller-maintained)
        self.cached_len = 0  # [0, cached_len) is in the tree, locked by `receipt`
        self.receipt: int | None = None
        self.swa_evicted_len = 0
        self.swa_released = False
        self.swa_pages_freed = 0
        self.finished_inserted_len = 0
        self.closed = False
        # The protocol operation under way or last made: names the step an error came from.
        self.last_op = ""
        self._last_free = 0
        # the client's session the pages and receipt belong to (its count of sessions opened
        # again): another request's call may have met the restart, not this one's
        self._session = _restarts(client)
        # a step's result named segments this process could not map: only abort() goes on
        self.not_mapped: SegmentsNotMapped | None = None

    def _check_session(self) -> None:
        """SessionRestarted, nothing sent, when the client reconnected since this request took
        what it holds: the new session numbers pages and receipts afresh, so the old ids may
        be another request's now. SegmentsNotMapped again after a step met it: some of the
        request's pages are not mapped here."""
        if self.not_mapped is not None:
            raise self.not_mapped
        if _restarts(self.client) != self._session:
            raise SessionRestarted(f"{self.label}: its pages and receipt belonged to the "
                                   "daemon session the client has lost (another call met the "
                                   "restart); call restart(), then admit()")

    def _on_session(self) -> contextlib.AbstractContextManager[Any]:
        """The step's calls go only to the session its ids belong to
        (:meth:`~radixd_client.Client.on_session`): another thread sharing the client may
        reconnect between :meth:`_check_session` and a send. A stand-in client without it is
        trusted to be used by one thread."""
        on_session = getattr(self.client, "on_session", None)
        return contextlib.nullcontext() if on_session is None else on_session(self._session)

    # -- admission --------------------------------------------------------------------------

    def admit(self) -> Admission:
        """Find and lock the longest usable cached prefix, from whichever tier holds it.

        The first match is locked, so it is the request's prefix as it stands when no load is
        needed (the common case costs one round trip); when it reports host hits, ``load``
        takes its own lock and the match's is dropped (protocol 9.2, a locked probe). On an
        error the request keeps what it took: :meth:`abort` gives it back. A request that holds
        nothing yet is bound to whichever session the client has, and tries once more on the
        next one when its call was refused unsent because another thread's call met a restart
        meanwhile (``details["sent"]`` False). A restart that cuts its own call raises, as for
        every call: that error is the one that says which pools to attach again.
        """
        c, name, adm = self.client, self.model, self.admission
        retried = False
        while True:
            fresh = not self.full_table and self.receipt is None  # holds nothing: any session
            if fresh:
                self._session = _restarts(c)
            self._check_session()
            try:
                with self._on_session():
                    return self._admit(c, name, adm)
            except SessionRestarted as exc:
                if (retried or not fresh or self.full_table or self.receipt is not None
                        or exc.details.get("sent", True)):
                    raise
                retried = True

    def _admit(self, c: Any, name: str, adm: Admission) -> Admission:
        prompt = self.tokens.tobytes()
        if self.use_l3:
            self.last_op = "prefetch"
            pf = c.prefetch(name, prompt, self.prefetch_policy)
            adm.prefetch_status, adm.l3_hit_len = pf.status, pf.l3_hit_len
            adm.fetched_len = pf.fetched_len
        self.last_op = "match"
        m = self._applied(c.match, name, prompt, lock=True)
        self.receipt = m.receipt
        self._raise_not_mapped()  # (its receipt is recorded: abort() unlocks it)
        adm.device_hit_len, adm.host_hit_len = m.prefix_len, m.host_hit_len
        adm.full_hit_len = m.full_hit_len
        used: Any = m
        if m.host_hit_len > 0:
            self.last_op = "load"
            loaded = self._applied(c.load, name, prompt, lock=True)
            adm.loaded_len = loaded.loaded_len
            keep, drop = (loaded, m) if loaded.prefix_len >= m.prefix_len else (m, loaded)
            self.receipt = keep.receipt
            if drop.receipt is not None:
                self.last_op = "unlock"
                c.unlock(name, drop.receipt)
            used = keep
            adm.full_hit_len = keep.full_hit_len
        adm.prefix_len = used.prefix_len
        self.cached_len = self.computed_len = self._last_free = used.prefix_len
        self.swa_evicted_len = used.prefix_len
        self.full_table = list(pages(used.full_pages))
        # A match gives SWA pages for the prefix's trailing window only; 0 before it.
        swa = list(pages(used.swa_pages)) if self.window is not None else []
        self.swa_table = [0] * (len(self.full_table) - len(swa)) + swa
        self._raise_not_mapped()
        return adm

    def _applied(self, call: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
        """``call``'s result, also when the daemon carried it out but this process could not
        map the segments it names: then the error is kept (:meth:`_raise_not_mapped` raises it
        once the step has recorded what it took, so that :meth:`abort` gives that back)."""
        try:
            return call(*args, **kwargs)
        except SegmentsNotMapped as err:
            self.not_mapped = self.not_mapped or err
            return err.result  # type: ignore[no-any-return]

    def _raise_not_mapped(self) -> None:
        if self.not_mapped is not None:
            raise self.not_mapped

    # -- pages ------------------------------------------------------------------------------

    def reserve(self, end: int) -> None:
        """Make the page tables cover positions ``[0, end)``, allocating what is missing."""
        need = _ceil_div(end, self.page_size) - len(self.full_table)
        self._check_session()
        if need > 0:
            self.last_op = "alloc"
            with self._on_session():
                res = self._applied(self.client.alloc, self.model, need)
            self._take(res, need)
            self._raise_not_mapped()

    def _take(self, res: Any, n: int) -> None:
        full = pages(res.full_pages)
        swa = pages(res.swa_pages) if self.window is not None else array("i", bytes(4 * n))
        if len(full) != n or len(swa) != n:
            raise RuntimeError(f"{self.label}: alloc of {n} returned {len(full)} full and "
                               f"{len(swa)} SWA pages")
        self.full_table += full
        self.swa_table += swa
        self.writable_full.update(full)
        if self.window is not None:
            self.writable_swa.update(swa)

    def check_writable(self, start: int, end: int) -> None:
        """Refuse (NotWritable) unless the pages of positions ``[start, end)`` are this
        request's own; call it before every forward pass that writes KV."""
        self._check_session()
        P = self.page_size
        for j in range(start // P, _ceil_div(end, P)):
            full = self.full_table[j] if j < len(self.full_table) else 0
            swa = self.swa_table[j] if j < len(self.swa_table) else 0
            if full not in self.writable_full or (self.window is not None
                                                  and swa not in self.writable_swa):
                raise NotWritable(f"{self.label}: refusing to write sequence page {j} into "
                                  f"full page {full} / SWA page {swa}: not pages this request "
                                  "allocated")

    def append(self, tokens: Sequence[int] | int) -> None:
        """Extend the sequence (generated tokens); their KV is the caller's to write."""
        if isinstance(tokens, int):
            self.tokens.append(tokens)
        else:
            self.tokens.extend(tokens)

    # -- SWA --------------------------------------------------------------------------------

    def out_of_window(self, length: int) -> list[int]:
        """Take the request's own SWA pages that no query at or after ``length`` can see out of
        the tables (freed by the caller or by :meth:`free_out_of_window`), moving the frontier.

        Pages go in position order because the insert protocol has a single frontier: every
        page below ``swa_evicted_len`` must be 0, every one at or after it live.
        """
        if self.window is None or not self.free_swa:
            return []
        P, edge = self.page_size, out_of_window_edge(length, self.window)
        self._last_free = length
        ids: list[int] = []
        j = max(self.cached_len, self.swa_evicted_len) // P
        while (j + 1) * P <= edge and j < len(self.swa_table):
            page = self.swa_table[j]
            if page == 0:
                raise RuntimeError(f"{self.label}: SWA page {j} is already 0 above the "
                                   f"frontier {self.swa_evicted_len}")
            ids.append(page)
            self.writable_swa.discard(page)
            self.swa_table[j] = 0
            self.swa_evicted_len = (j + 1) * P
            j += 1
        self.swa_pages_freed += len(ids)
        return ids

    def free_out_of_window(self, length: int) -> int:
        """``free`` the SWA pages :meth:`out_of_window` takes (in prefill, where nothing else
        shares the round trip); returns how many."""
        self._check_session()
        ids = self.out_of_window(length)
        if ids:
            self.last_op = "free"
            with self._on_session():
                self.client.free(self.model, swa_pages=ids)
        return len(ids)

    def _release_due(self, length: int) -> bool:
        return (self.window is not None and self.free_swa and not self.swa_released
                and self.cached_len > 0 and self.receipt is not None
                and out_of_window_edge(length, self.window) >= self.cached_len)

    def decode_step(self, length: int, end: int) -> None:
        """The bookkeeping before a decode forward pass, in one round trip.

        ``length``: tokens whose KV is written (the next query's position); ``end``: the tables
        must cover ``[0, end)`` for the pass. Gives back SWA no query from ``length`` on can see
        (``free`` for own pages, every ``swa_free_interval`` tokens; ``release_swa`` for the
        locked prefix once it is all out, keeping the receipt for the full KV) and allocates
        the missing pages. Frees go first so their pages can serve the alloc.
        """
        self._check_session()
        free_ids: list[int] = []
        if self.window is not None and length - self._last_free >= self.swa_free_interval:
            free_ids = self.out_of_window(length)
        release = self._release_due(length)
        if release:
            self.swa_released = True
            for j in range(self.cached_len // self.page_size):
                self.swa_table[j] = 0
        need = max(0, _ceil_div(end, self.page_size) - len(self.full_table))
        calls = [x for x in (free_ids and ("free", free_ids), release and ("release", None),
                             need and ("alloc", need)) if x]
        if not calls:
            return
        with self._on_session():
            self._decode_calls(calls, free_ids, release, need)

    def _decode_calls(self, calls: list[Any], free_ids: list[int], release: bool,
                      need: int) -> None:
        c, name = self.client, self.model
        if len(calls) == 1:
            self.last_op = calls[0][0] if calls[0][0] != "release" else "release_swa"
            if free_ids:
                c.free(name, swa_pages=free_ids)
            elif release:
                c.release_swa(name, self.receipt)
            else:
                self._take(self._applied(c.alloc, name, need), need)
                self._raise_not_mapped()
            return
        self.last_op = "batch"
        try:
            with c.batch() as b:
                freed = b.free(name, swa_pages=free_ids) if free_ids else None
                released = b.release_swa(name, self.receipt) if release else None
                alloc = b.alloc(name, need) if need else None
        except SegmentsNotMapped as err:  # it ran: the futures hold its results
            self.not_mapped = self.not_mapped or err
        for op, fut in (("free", freed), ("release_swa", released), ("alloc", alloc)):
            if fut is not None:
                self.last_op = op
                fut.result()
        if alloc is not None:
            self._take(alloc.result(), need)
        self._raise_not_mapped()

    # -- inserts ----------------------------------------------------------------------------

    def _insert_args(self, end: int) -> tuple[bytes, list[int], list[int], int, int]:
        lo, hi = self.cached_len // self.page_size, _ceil_div(end, self.page_size)
        swa = self.swa_table[lo:hi] if self.window is not None else []
        frontier = self.swa_evicted_len if self.window is not None else 0
        return (self.tokens[:end].tobytes(), self.full_table[lo:hi], swa, self.cached_len,
                frontier)

    def commit(self, end: int) -> InsertResult:
        """``cache_unfinished`` for ``tokens[:end]`` (their KV written and synchronized): the
        aligned pages go to the tree, the lock moves to the new end, and the tables switch to
        the canonical ids, since the daemon freed the duplicates and may already have handed
        them to someone else (protocol 8.2)."""
        self._check_session()
        toks, full, swa, prev, frontier = self._insert_args(end)
        self.last_op = "cache_unfinished"
        with self._on_session():
            res: InsertResult = self._applied(self.client.cache_unfinished,
                self.model, toks, full, swa, prev, frontier, self.receipt)
        lo = prev // self.page_size
        handed = range(lo, res.inserted_len // self.page_size)
        self.writable_full.difference_update(self.full_table[j] for j in handed)
        self.writable_swa.difference_update(self.swa_table[j] for j in handed)
        canon = pages(res.full_pages)
        self.full_table[lo:lo + len(canon)] = canon
        if self.window is not None:
            canon_swa = pages(res.swa_pages)
            self.swa_table[lo:lo + len(canon_swa)] = canon_swa
        self.receipt = res.receipt
        self.cached_len = res.inserted_len
        self.swa_evicted_len = max(self.swa_evicted_len, self.cached_len)
        self.swa_released = False  # the new receipt pins the window at the new end
        self._raise_not_mapped()
        return res

    def finish(self, end: int | None = None) -> InsertResult:
        """``cache_finished`` with ``tokens[:end]`` (default ``computed_len``: the last sampled
        token has no KV yet); afterwards the request holds nothing."""
        self._check_session()
        end = self.computed_len if end is None else end
        toks, full, swa, prev, frontier = self._insert_args(end)
        # pages reserved past ``end`` (a decode step allocated ahead, an engine that stopped
        # early) are not part of the insert: they are freed with it, in the same round trip
        hi = _ceil_div(end, self.page_size)
        rest_full = [p for p in self.full_table[hi:] if p in self.writable_full]
        rest_swa = [p for p in self.swa_table[hi:] if p and p in self.writable_swa]
        self.last_op = "cache_finished"
        with self._on_session():
            res = self._finish_calls(toks, full, swa, prev, frontier, rest_full, rest_swa)
        self.finished_inserted_len = res.inserted_len
        self._forget()
        return res

    def _finish_calls(self, toks: bytes, full: list[int], swa: list[int], prev: int,
                      frontier: int, rest_full: list[int], rest_swa: list[int]
                      ) -> InsertResult:
        if not rest_full and not rest_swa:
            # (the request holds nothing afterwards: segments its result names that are not
            # mapped here are no error for it)
            res: InsertResult = self._applied(self.client.cache_finished,
                self.model, toks, full, swa, prev, frontier, self.receipt)
        else:
            # on an error nothing is forgotten: abort() cleans. SegmentsNotMapped: it ran (the
            # futures hold its results), and the request holds nothing afterwards
            with contextlib.suppress(SegmentsNotMapped), self.client.batch() as b:
                fin = b.cache_finished(self.model, toks, full, swa, prev, frontier, self.receipt)
                freed = b.free(self.model, rest_full, rest_swa)
            res = fin.result()
            self.last_op = "free"
            freed.result()
        return res

    def abort(self) -> None:
        """Give back every page and the receipt, in one round trip, without inserting anything
        (the KV may be incomplete). Safe to call twice; errors come from the daemon (or are
        ``ConnectionLost`` without a reconnect policy). Where the session went before or
        during the call, all of it went with it, and nothing is sent or raised."""
        if self.closed:
            return
        full, swa = sorted(self.writable_full), sorted(self.writable_swa)
        receipt = self.receipt
        self._forget()
        if (not full and not swa and receipt is None) or _restarts(self.client) != self._session:
            return  # nothing held, or all of it went with the old session: the ids may be
            # another request's in the new one
        self.last_op = "abort"
        try:
            with self._on_session(), self.client.batch(stop_on_error=False) as b:
                freed = b.free(self.model, full, swa) if full or swa else None
                unlocked = b.unlock(self.model, receipt) if receipt is not None else None
        except SessionRestarted:
            return  # the session went meanwhile, with all of it
        errors = [f.exception() for f in (freed, unlocked) if f is not None]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def restart(self) -> None:
        """Start this request over after ``SessionRestarted`` (the daemon restarted and the
        client reconnected): everything the old session held is gone, so every page id, the
        receipt and the progress are forgotten (``check_writable`` refuses the old ids), and the
        tokens so far (prompt and generated) are kept. Call :meth:`admit` next and recompute
        from the prefix it finds: a restart costs recompute, never KV written into memory the
        request does not own. Nothing is sent to the daemon."""
        self._forget()
        self.closed = False
        self.admission = Admission()
        self.computed_len = self.cached_len = self._last_free = 0
        self.swa_evicted_len = self.swa_pages_freed = self.finished_inserted_len = 0
        self.swa_released = False
        self.last_op = ""
        self.not_mapped = None
        self._session = _restarts(self.client)

    def _forget(self) -> None:
        self.receipt = None
        self.full_table, self.swa_table = [], []
        self.writable_full.clear()
        self.writable_swa.clear()
        self.closed = True

    @property
    def done(self) -> bool:
        """Whether the request has handed everything back (finished or aborted)."""
        return self.closed


def _restarts(client: Any) -> int:
    """How many sessions the client has opened again after losing one (0 for a client that
    never reconnects)."""
    return int(getattr(client, "restarts", 0))
