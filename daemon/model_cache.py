"""One model's cache: the tree, the page allocators and the pools, plus who holds what.

This is the layer that knows *owners* (a session, to the server): every page handed out by
``alloc`` and every lock receipt belongs to exactly one owner until it is given to the tree,
released, or the owner goes away. It validates every page and receipt against its owner before
anything changes, so bad input is refused with the cache untouched, and it checks page
conservation (free + tree + held = capacity, no page in two places) on demand.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .gpu.allocator import (
    AllocatorError,
    OutOfPages,
    as_page_array,
    has_duplicates,
    nonzero_ids,
)
from .gpu.page_runs import IN_USE_MIN, NEVER_IN_USE, PageRuns, cold_after_tokens
from .gpu.segments import PairedSegmentAllocator, audit_model_segments_steps
from .holdings import Holders, Holding, is_load_owner
from .page_conservation import conserved_steps
from .page_sink import TreeSink
from .tree import (
    DEFAULT_POLICY,
    HASH_BLOCK_TOKENS,
    STEP_ITEMS,
    BadArgument,
    EvictResult,
    InsertResult,
    MatchResult,
    Node,
    Pin,
    RadixTree,
    Receipt,
    ReceiptError,
    TreeAudit,
    audit_steps,
    chunked,
)

if TYPE_CHECKING:
    from .gpu.pools import KVPools
    from .gpu.profile import ModelProfile
    from .storage.host_tier import HostTier

Owner = Hashable

log = logging.getLogger("radixd.model_cache")


class PageNotHeld(AllocatorError):
    """A page the caller named is not one it holds."""

    code = "page_not_held"


class ModelCache:
    """Tree + allocators (+ pools) of one model profile, with per-owner accounting."""

    def __init__(
        self, profile: ModelProfile, *, pools: KVPools | None = None, policy: str = DEFAULT_POLICY,
        segment_pages: int | None = None, hash_block_tokens: int = HASH_BLOCK_TOKENS,
        long_runs_in_use: bool = True,
    ) -> None:
        """``segment_pages``: pages per segment, each serving one namespace (memory isolation,
        daemon.gpu.segments); None: one segment per pool that every namespace shares.
        ``hash_block_tokens``: see :class:`RadixTree` (tests only). ``long_runs_in_use``: the
        config key ``server.long_runs_in_use`` (daemon.gpu.page_runs.IN_USE_MIN)."""
        self.profile = profile
        self.pools = pools
        self.isolated = segment_pages is not None
        renew = pools.renew_segment if pools is not None and self.isolated else None
        self.alloc_state = PairedSegmentAllocator(
            profile.full_pages, profile.swa_pages or 0,
            segment_pages or max(profile.full_pages, profile.swa_pages or 0), renew)
        self.sink = TreeSink(self.alloc_state)
        self.tree = RadixTree(
            profile.page_size,
            profile.sliding_window,
            self.sink,
            layout_fingerprint=profile.layout_fingerprint(),
            policy=policy,
            hash_block_tokens=hash_block_tokens,
            page_ids=PageRuns(in_use_min=IN_USE_MIN if long_runs_in_use else NEVER_IN_USE),
        )
        self.tree.compact_after = cold_after_tokens(profile.full_pages, profile.page_size)
        self.swa_enabled = self.tree.swa_enabled
        self.host: HostTier | None = None  # set by the tier manager when L2 is on
        # the key-addressed store sharing the host pools (daemon/keyed_tier.py): host copies
        # make room through its make_room and count its pages against host quotas
        self.keyed: Any = None
        # The tier layer's half of a two-phase eviction (daemon.tree.eviction), called by this
        # cache between tree operations, never from inside one: copy a node the tree named to
        # host (or decline), and read host pages the tree dropped before their slots are reused.
        self.copy_to_host: Callable[[Node], None] | None = None
        self.read_host_drops: Callable[[list[Node]], None] | None = None
        # per namespace, [full, swa] device pages of loads still copying: held by no session and
        # not yet the tree's, they count against the tenants' quotas all the same
        self.loading_pages: dict[str, list[int]] = {}
        self.holders = Holders(profile.full_pages, profile.swa_pages or 0)
        self.holdings: dict[Owner, Holding] = self.holders.by_owner
        self._receipts: dict[int, tuple[Owner, Receipt]] = {}
        self._next_receipt = 1
        self.counters = {
            "matches": 0,
            "match_tokens": 0,
            "hit_tokens": 0,
            "host_hit_tokens": 0,  # (counted by the service's loads: entities.count_load)
            "allocs": 0,
            "alloc_failures": 0,
            "evicted_for_alloc_full": 0,
            "evicted_for_alloc_swa": 0,
        }

    # ------------------------------------------------------------------ owners

    def _holding(self, owner: Owner) -> Holding:
        return self.holders.holding(owner)

    def _register(self, owner: Owner, r: Receipt) -> int:
        rid = self._next_receipt
        self._next_receipt = rid + 1
        self._receipts[rid] = (owner, r)
        r.tag = rid
        self._holding(owner).receipts.add(rid)
        return rid

    def _receipt(self, owner: Owner, rid: int) -> Receipt:
        entry = self._receipts.get(rid) if isinstance(rid, int) else None
        if entry is None or entry[0] != owner:
            raise ReceiptError(f"receipt {rid!r} is not held by this session "
                               "(never taken, already released, or another session's)")
        return entry[1]

    def _drop_receipt(self, owner: Owner, rid: int) -> None:
        del self._receipts[rid]
        self.holdings[owner].receipts.discard(rid)

    def _check_held(self, owner: Owner, full: array, swa: array, *, swa_zeros: bool) -> None:
        """Ownership, after the shape checks (_check_ids, _check_shape). ``swa_zeros``: a 0 in
        ``swa`` stands for no SWA page (cache_*, insert) rather than a page id (free)."""
        h = self.holdings.get(owner)
        live = nonzero_ids(swa) if swa_zeros else swa
        if h is not None and h.full.covers(full) and h.swa.covers(live):
            return  # the usual case, in numpy
        for pages, held, pool in ((full, h.full if h else (), "full"),
                                  (live, h.swa if h else (), "swa")):
            for p in pages:
                if p not in held:
                    raise PageNotHeld(f"{pool} page {p} is not held by this session")

    @staticmethod
    def _check_ids(full: array, swa: array) -> None:
        """The request's own faults come first (bad_argument), ownership second (page_not_held):
        a client is told what is wrong with what it sent whatever the daemon's state, and an
        answer never depends on whether another id of a malformed list happens to be held. Any
        int32 is a well-formed id: 0, negative ids and ids outside the pool are ids this session
        does not hold (page_not_held)."""
        for pages, pool in ((full, "full"), (swa, "swa")):
            if has_duplicates(pages):
                raise BadArgument(f"{pool}_pages lists a page twice")

    def _check_shape(self, tokens: bytes, full: array, swa: array, prev_prefix_len: int,
                     swa_evicted_len: int, *, tail: bool) -> None:
        """bad_argument for what the request alone shows (counts, alignment, duplicates, the SWA
        frontier), before any ownership check: the tree checks the same again (and, against its
        own state, whether prev_prefix_len is cached), but only after _check_held would have
        answered page_not_held. Ids that are no held page (0 in full_pages, negative ids) are
        left to _check_held, as in free. ``tail``: the lists include the unaligned tail page
        (cache_*)."""
        P = self.profile.page_size
        n = len(tokens) // (4 * P)
        total = -(-(len(tokens) // 4) // P) if tail else n
        if not (isinstance(prev_prefix_len, int) and isinstance(swa_evicted_len, int)
                and prev_prefix_len >= 0 and swa_evicted_len >= 0
                and not prev_prefix_len % P and not swa_evicted_len % P):
            for name, v in (("prev_prefix_len", prev_prefix_len),
                            ("swa_evicted_len", swa_evicted_len)):
                if not isinstance(v, int) or v < 0 or v % P:
                    raise BadArgument(f"{name} must be a non-negative multiple of page_size "
                                      f"{P}, got {v!r}")
        prev = prev_prefix_len // P
        if prev > n:
            raise BadArgument(f"prev_prefix_len={prev_prefix_len} is beyond the page-aligned "
                              f"length {n * P} of the sequence")
        want = total - prev
        if len(full) != want:
            raise BadArgument(f"full_pages has {len(full)} ids; pages [{prev}, {total}) need "
                              f"{want}")
        if self.swa_enabled:
            if len(swa) != want:
                raise BadArgument(f"swa_pages has {len(swa)} ids; pages [{prev}, {total}) need "
                                  f"{want}")
            frontier = min(swa_evicted_len // P, n)
            k = max(0, min(frontier - prev, want))  # below the frontier (checks in C: min, set)
            if k and (min(swa[:k]) != 0 or max(swa[:k]) != 0):
                j = next(j for j in range(k) if swa[j] != 0)
                raise BadArgument(f"swa_pages[{j}] must be 0: page {prev + j} is below "
                                  f"swa_evicted_len={swa_evicted_len}")
            e = n - prev  # [k, e): from the frontier to the aligned end, ids; then the tail
            if e > k and swa[k:e].count(0):
                j = swa.index(0, k)
                raise BadArgument(f"swa_pages[{j}] must be a page id: page {prev + j} is at "
                                  f"or after swa_evicted_len={swa_evicted_len}")
            if has_duplicates(nonzero_ids(swa[k:])):  # a tail page may come without SWA (0)
                raise BadArgument("swa_pages must be distinct page ids")
        elif (any(swa) if tail else len(swa)):  # (cache_* accept zeros there, as before)
            raise BadArgument("this model has no sliding-window layers: swa_pages must be empty")
        if has_duplicates(full):
            raise BadArgument("full_pages must be distinct page ids")

    def _release_pages(self, owner: Owner, full: array, swa: array) -> None:
        """Pages that left the owner (to the tree or back to the free list), all held by it
        (_check_held); a 0 in ``swa`` (no SWA page) is skipped."""
        h = self.holdings.get(owner)
        if h is None:  # it holds nothing: _check_held already refused any page it named
            return
        h.full.remove(full)
        h.swa.remove(swa)

    # ------------------------------------------------------------------ operations

    def match(self, owner: Owner, namespace: str, tokens: bytes, *, lock: bool = False
              ) -> tuple[MatchResult, int | None]:
        res = self.tree.match(namespace, tokens, lock=lock)
        self.counters["matches"] += 1
        self.counters["match_tokens"] += len(tokens) // 4
        self.counters["hit_tokens"] += res.prefix_len
        rid = self._register(owner, res.receipt) if res.receipt is not None else None
        return res, rid

    def lock(self, owner: Owner, namespace: str, node_id: int) -> int:
        return self._register(owner, self.tree.lock(node_id, namespace))

    def unlock(self, owner: Owner, rid: int) -> None:
        r = self._receipt(owner, rid)
        self.tree.unlock(r)
        self._drop_receipt(owner, rid)
        self.settle()

    def release_swa(self, owner: Owner, rid: int) -> None:
        self.tree.release_swa(self._receipt(owner, rid))

    def space(self, namespace: str) -> str:
        """The allocator's key for ``namespace``: itself when isolated, else the shared one."""
        return namespace if self.isolated else ""

    def segment_generation(self, namespace: str) -> int:
        """Grows whenever ``namespace`` is given a segment it did not serve last: a client whose
        mapping is of an older generation attaches again (docs/protocol.md 4.3). 0 without
        isolation."""
        if not self.isolated:
            return 0
        a = self.alloc_state
        g = a.full.generations.get(namespace, 0)
        return g if a.swa is None else g + a.swa.generations.get(namespace, 0)

    def _short(self, key: str, n_full: int, n_swa: int) -> tuple[int, int]:
        a = self.alloc_state
        swa_free = a.swa.available_to(key) if a.swa is not None else 0
        return max(0, n_full - a.full.available_to(key)), max(0, n_swa - swa_free)

    def _make_room(self, namespace: str, n_full: int, n_swa: int, reason: str) -> None:
        """Evict until ``namespace`` can take the pages: its own cold pages first (they free
        pages of its segments), then, when isolated, other namespaces' cold pages, the largest
        first, until enough of their segments empty and return to the free list."""
        key = self.space(namespace)
        need_full, need_swa = self._short(key, n_full, n_swa)
        if not (need_full or need_swa):
            return
        ev = self._evict(need_full, need_swa, reason, namespace if self.isolated else None)
        need_full, need_swa = self._short(key, n_full, n_swa)
        if self.isolated and (need_full or need_swa):
            step = self.alloc_state.full.segment_pages
            others = sorted((ns for ns in self.tree.namespaces.values() if ns.name != namespace),
                            key=lambda ns: -(ns.full_pages + ns.swa_pages))
            for victim in others:
                while need_full or need_swa:
                    got = self._evict(step if need_full else 0, step if need_swa else 0, reason,
                                      victim.name)
                    ev.add(got)
                    need_full, need_swa = self._short(key, n_full, n_swa)
                    if not (got.full_pages or got.swa_pages):
                        break
        self.counters["evicted_for_alloc_full"] += ev.full_pages
        self.counters["evicted_for_alloc_swa"] += ev.swa_pages

    def alloc(self, owner: Owner, n: int, namespace: str = "") -> tuple[array, array]:
        """Full and SWA pages together from ``namespace``'s segments, evicting unlocked cached
        pages if they are short."""
        if not isinstance(n, int) or n < 0:
            raise BadArgument(f"n_pages must be a non-negative int, got {n!r}")
        a = self.alloc_state
        key = namespace if self.isolated else ""
        if n > a.full.available_to(key) or (a.swa is not None and n > a.swa.available_to(key)):
            # short of free pages: evict, unless that cannot succeed (then refuse before
            # evicting anyone's cache for nothing)
            if not self.can_alloc(n, namespace):
                self.counters["alloc_failures"] += 1
                raise self.oom_error(n, namespace)
            self._make_room(namespace, n, n if a.swa is not None else 0, "alloc")
        try:
            full, swa = a.alloc(n, key)
        except OutOfPages as exc:
            self.counters["alloc_failures"] += 1
            raise self.oom_error(n, namespace) from exc
        except OSError as exc:
            self.counters["alloc_failures"] += 1
            raise self.no_segment_memory(n, namespace, exc) from exc
        self.counters["allocs"] += 1
        if n:
            self._hand_out(owner, full, swa, namespace)
        return full, swa

    def alloc_unpaired(self, owner: Owner, n_full: int, n_swa: int, namespace: str = ""
                       ) -> tuple[array, array]:
        """``n_full`` full and ``n_swa`` SWA pages of ``namespace`` (a load needs fewer SWA pages
        than full ones), evicting unlocked, unpinned cached pages if the pools are short."""
        a = self.alloc_state
        if n_swa and a.swa is None:
            raise BadArgument("this model has no SWA pool")
        key = self.space(namespace)
        need_full, need_swa = self._short(key, n_full, n_swa)
        if need_full > self.tree.full_evictable or need_swa > self.tree.swa_evictable:
            raise self.oom_error(max(n_full, n_swa), namespace)
        self._make_room(namespace, n_full, n_swa, "load")
        if any(self._short(key, n_full, n_swa)):
            raise self.oom_error(max(n_full, n_swa), namespace)  # the evictable pages were pinned
        full = None
        try:
            full = a.full.alloc(n_full, key)
            swa = a.swa.alloc(n_swa, key) if n_swa else array("i")  # type: ignore[union-attr]
        except BaseException as exc:  # all or none: the full pages are nobody's yet
            if full is not None:
                a.full.free(full)
            if isinstance(exc, OSError):  # a segment got no fresh memory
                raise self.no_segment_memory(max(n_full, n_swa), namespace, exc) from exc
            raise
        self._hand_out(owner, full, swa, namespace)
        return full, swa

    def _hand_out(self, owner: Owner, full: array, swa: array, namespace: str) -> None:
        h = self._holding(owner)
        h.full.add(namespace, full)
        h.swa.add(namespace, swa)

    def disown(self, owner: Owner, known: tuple[array, array] | None = None
               ) -> tuple[array, array]:
        """Every page ``owner`` holds, no longer held by it (the caller hands them on).
        ``known``: the pages the caller believes it holds (a load job's); when they are all
        it holds, the page tables are not scanned for them."""
        h = self.holdings.get(owner)
        if h is None:
            return array("i"), array("i")
        if (known is not None and len(known[0]) == len(h.full) and len(known[1]) == len(h.swa)
                and not has_duplicates(known[0]) and not has_duplicates(known[1])
                and h.full.covers(known[0]) and h.swa.covers(known[1])):
            full, swa = known
        else:
            full, swa = array("i", h.full), array("i", h.swa)  # a scan of the tables
        h.full.remove(full)
        h.swa.remove(swa)
        self.holders.drop(owner)
        return full, swa

    def can_alloc(self, n: int, namespace: str = "") -> bool:
        """Whether ``n`` pages of each pool are free to ``namespace`` or might be made free by
        evicting (isolated: an upper bound, as another namespace's cold pages help only when a
        whole segment of theirs empties)."""
        a = self.alloc_state
        key = self.space(namespace)
        if n > a.full.available_to(key) + self.tree.full_evictable:
            return False
        return a.swa is None or n <= a.swa.available_to(key) + self.tree.swa_evictable

    def no_segment_memory(self, n: int, namespace: str, exc: OSError) -> OutOfPages:
        """The refusal when a segment handed to ``namespace`` got no fresh memory (its new memfd
        failed: EMFILE, ENOMEM): no room, like a short pool, never an internal error; nothing
        was taken (the allocators are all or none)."""
        log.warning("model %r: a segment for namespace %r got no fresh memory (%s): an "
                    "allocation of %d pages refused", self.profile.name, namespace,
                    exc.strerror or exc, n)
        err = self.oom_error(n, namespace)
        return OutOfPages(f"cannot allocate {n} pages: a pool segment for this namespace could "
                          f"not get fresh memory ({exc.strerror or exc}); {err}",
                          **err.counts, segment_memory=1)

    def oom_error(self, n: int, namespace: str = "") -> OutOfPages:
        a = self.alloc_state
        t = self.tree
        held_full = self.held_full_pages
        held_swa = self.held_swa_pages
        key = self.space(namespace)
        swa_free = a.swa.available_to(key) if a.swa is not None else 0
        return OutOfPages(
            f"cannot allocate {n} pages: full pool {a.full.available_to(key)} free, "
            f"{t.full_evictable} evictable, {t.full_protected} locked, {held_full} held by "
            f"sessions; "
            f"swa pool {swa_free} free, {t.swa_evictable} evictable, {t.swa_protected} locked, "
            f"{held_swa} held by sessions",
            requested=n,
            full_available=a.full.available_to(key),
            full_evictable=t.full_evictable,
            full_locked=t.full_protected,
            full_held=held_full,
            swa_available=swa_free,
            swa_evictable=t.swa_evictable,
            swa_locked=t.swa_protected,
            swa_held=held_swa,
        )

    def free(self, owner: Owner, full: Iterable[int] = (), swa: Iterable[int] = ()) -> None:
        full, swa = _ids(full), _ids(swa)
        self._check_ids(full, swa)
        self._check_held(owner, full, swa, swa_zeros=False)
        self._release_pages(owner, full, swa)
        if full:
            self.alloc_state.free_full(full)
        if swa:
            self.alloc_state.free_swa(swa)

    def insert(
        self, owner: Owner, namespace: str, tokens: bytes, full: array, swa: array,
        prev_prefix_len: int = 0, swa_evicted_len: int = 0, *, lock: bool = False,
    ) -> tuple[InsertResult, int | None]:
        full, swa = _ids(full), _ids(swa)
        self._check_shape(tokens, full, swa, prev_prefix_len, swa_evicted_len, tail=False)
        self._check_held(owner, full, swa, swa_zeros=True)
        res = self.tree.insert(namespace, tokens, full, swa, prev_prefix_len, swa_evicted_len,
                               lock=lock, trusted=True)
        k = res.inserted_len // self.profile.page_size - prev_prefix_len // self.profile.page_size
        self._release_pages(owner, full[:k], swa[:k])
        rid = self._register(owner, res.receipt) if res.receipt is not None else None
        self.settle()
        return res, rid

    def cache_finished(
        self, owner: Owner, namespace: str, tokens: bytes, full: array, swa: array,
        prev_prefix_len: int, swa_evicted_len: int, rid: int | None,
    ) -> InsertResult:
        full, swa = _ids(full), _ids(swa)
        self._check_shape(tokens, full, swa, prev_prefix_len, swa_evicted_len, tail=True)
        r = self._receipt(owner, rid) if rid is not None else None
        self._check_held(owner, full, swa, swa_zeros=True)
        res = self.tree.cache_finished(namespace, tokens, full, swa, prev_prefix_len,
                                       swa_evicted_len, r, trusted=True)
        self._release_pages(owner, full, swa)
        if rid is not None:
            self._drop_receipt(owner, rid)
        self.settle()
        return res

    def cache_unfinished(
        self, owner: Owner, namespace: str, tokens: bytes, full: array, swa: array,
        prev_prefix_len: int, swa_evicted_len: int, rid: int | None,
    ) -> tuple[InsertResult, int]:
        full, swa = _ids(full), _ids(swa)
        self._check_shape(tokens, full, swa, prev_prefix_len, swa_evicted_len, tail=True)
        r = self._receipt(owner, rid) if rid is not None else None
        self._check_held(owner, full, swa, swa_zeros=True)
        res = self.tree.cache_unfinished(namespace, tokens, full, swa, prev_prefix_len,
                                         swa_evicted_len, r, trusted=True)
        k = res.inserted_len // self.profile.page_size - prev_prefix_len // self.profile.page_size
        self._release_pages(owner, full[:k], swa[:k])
        if rid is not None:
            self._drop_receipt(owner, rid)
        self.settle()
        return res, self._register(owner, res.receipt)

    def evict(self, full_pages: int = 0, swa_pages: int = 0, namespace: str | None = None,
              reason: str = "explicit") -> EvictResult:
        """Explicit eviction, of one namespace's unlocked pages when ``namespace`` is given."""
        for name, v in (("full_pages", full_pages), ("swa_pages", swa_pages)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise BadArgument(f"{name} must be a non-negative int, got {v!r}")
        return self._evict(full_pages, swa_pages, reason, namespace)

    def evict_host(self, slots: int, namespace: str | None = None, swa_slots: int = 0
                   ) -> EvictResult:
        """Drop host-only pages (coldest first); under L3 write-back the tiers read them first."""
        res = self.tree.evict_host(slots, namespace=namespace, swa_slots=swa_slots)
        self.flush_host_drops()
        return res

    def unpin(self, pin: Pin) -> None:
        """End a tier copy's pin; the cleanup it starts may demote nodes (two-phase)."""
        self.tree.unpin(pin)
        self.settle()

    def _evict(self, full: int, swa: int, reason: str, namespace: str | None = None
               ) -> EvictResult:
        """An eviction run to the end: each time the tree stops at nodes the tiers want on
        host, they are copied and committed, and the eviction resumes for what is missing."""
        tree = self.tree
        res = tree.evict(full, swa, reason=reason, namespace=namespace)
        while tree.awaiting_copy:
            res.add(self.settle(reason))
            res.add(tree.evict(max(0, full - res.full_pages), max(0, swa - res.swa_pages),
                               reason=reason, namespace=namespace))
        return res

    def settle(self, reason: str | None = None) -> EvictResult:
        """Phases 2 and 3 of an eviction (phase 1 is the tree naming nodes in
        ``awaiting_copy``): the tiers copy them, the tree commits them, repeated while the
        cleanups the commits go on with name more. Also hands dropped host pages to the tiers
        while their bytes are still intact."""
        tree = self.tree
        res = EvictResult()
        if not tree.awaiting_copy and not tree.host_drops:  # the usual case: nothing named
            return res
        while tree.awaiting_copy:
            if self.copy_to_host is not None:
                for n in list(tree.awaiting_copy):
                    self.copy_to_host(n)
            res.add(tree.commit_evictions(reason))
        self.flush_host_drops()
        return res

    def flush_host_drops(self) -> None:
        """Hand host pages the tree dropped to the tiers to read, then free their slots. Safe
        inside a phase-2 copy: it touches no device node."""
        if self.tree.host_drops:
            if self.read_host_drops is not None:
                self.read_host_drops(list(self.tree.host_drops))
            self.tree.release_host_drops()

    def release_owner(self, owner: Owner) -> tuple[int, int, int]:
        """Everything an owner holds goes back: its locks and its pages. Returns the counts."""
        h = self.holdings.get(owner)
        if h is None:
            return (0, 0, 0)
        receipts = len(h.receipts)
        if receipts:  # (unlock_all refuses before it moves anything: nothing is dropped then)
            self.tree.unlock_all([self._receipts[rid][1] for rid in h.receipts])
            for rid in h.receipts:
                del self._receipts[rid]
            h.receipts.clear()
            self.settle()
        full, swa = self.disown(owner)
        if full:
            self.alloc_state.free_full(full)
        if swa:
            self.alloc_state.free_swa(swa)
        return (receipts, len(full), len(swa))

    @property
    def held_full_pages(self) -> int:
        """Full pages sessions hold (allocated, not yet given to the tree or freed)."""
        return sum(len(h.full) for h in self.holdings.values())

    @property
    def held_swa_pages(self) -> int:
        """SWA pages sessions hold (allocated, not yet given to the tree or freed)."""
        return sum(len(h.swa) for h in self.holdings.values())

    # ------------------------------------------------------------------ checking

    def check(self, *, deep: bool = True) -> list[str]:
        """Tree invariants plus page conservation per pool; empty when healthy."""
        v: list[str] = []
        for _ in self.check_steps(v, deep=deep):
            pass
        return v

    def _check_receipts_steps(self, v: list[str]) -> Iterator[None]:
        """The receipt registry against the holdings and the tree's locks, in chunks: a session
        may hold 65,536 locks, and comparing them as whole sets is a step of milliseconds. Each
        lock carries its registry id (``_register``), so that two ids of one lock show."""
        reg, active = self._receipts, self.tree.receipts
        listed, wrong, missing = 0, False, False
        for i, (o, h) in enumerate(list(self.holdings.items())):
            for chunk in chunked(h.receipts):
                listed += len(chunk)
                wrong = wrong or any(reg.get(rid, (None,))[0] != o for rid in chunk)
                yield
            if not i % STEP_ITEMS:
                yield
        for chunk in chunked(reg.items()):
            missing = missing or any(r not in active or r.tag != rid for rid, (_, r) in chunk)
            yield
        if wrong or listed != len(reg):
            v.append("receipt registry and the owners' holdings disagree (a receipt no session "
                     "can release, or one listed for the wrong session)")
        if missing or len(reg) != len(active):
            v.append(f"receipt registry ({len(reg)}) and the tree's active locks ({len(active)}) "
                     "disagree, or one lock is registered under two ids")

    def check_steps(self, v: list[str], *, deep: bool = True) -> Iterator[None]:
        """:meth:`check` into ``v``, yielding between bounded steps (the daemon runs them between
        requests, and gives a pass up when anything changed between two of its steps:
        daemon/checker.py). The first step settles the host drops; the state is read after it."""
        self.flush_host_drops()  # their slots are held for the tiers, out of the tree already
        yield
        audit = TreeAudit(v)
        yield from audit_steps(self.tree, audit, deep=deep)
        yield from audit_model_segments_steps(self, v)
        a = self.alloc_state
        pools = [("full", a.full, audit.full_pages, self.holders.full)]
        if a.swa is not None:
            pools.append(("swa", a.swa, audit.swa_pages, self.holders.swa))
        for name, alloc, in_tree, table in pools:
            free = bytearray(alloc.capacity)
            yield from alloc.audit_steps(v, free)
            counts: list[np.ndarray] = []
            yield from conserved_steps(name, alloc, free, in_tree, table.holder_np, counts, v)
            yield from self.holders.audit_counts_steps(name, v, counts[0])
        yield
        if len(self.sink.watches) > 1:  # background copies run one at a time
            v.append(f"{len(self.sink.watches)} copy watches registered: one at most (a leak)")
        yield
        if self.host is not None:
            yield from self.host.audit_steps({"full": audit.host_slots,
                                              "swa": audit.host_swa_slots}, v)
            yield from self.host.audit_tree_owners_steps(self.tree.iter_nodes(), v)
        elif audit.host_slots or audit.host_swa_slots:
            v.append("host slots in the tree of a model without a host tier")
        yield from self._check_receipts_steps(v)
        loads: list[Holding] = []
        for chunk in chunked(self.holdings.items()):
            loads += [h for o, h in chunk if is_load_owner(o)]
            yield
        loading = [sum(c[i] for c in self.loading_pages.values()) for i in (0, 1)]
        held = [sum(len(h.full) for h in loads), sum(len(h.swa) for h in loads)]
        if loading != held:
            v.append(f"pages counted as loading ({loading}) are not those the loads hold "
                     f"({held})")


def _ids(pages: Iterable[int] | bytes) -> array:
    """Page ids as an int32 array: what the checks and the page tables read."""
    if isinstance(pages, (bytes, bytearray, memoryview)):
        out = array("i")
        out.frombytes(pages)
        return out
    try:
        return as_page_array(pages)
    except OverflowError:
        raise BadArgument("page ids must be 32-bit integers") from None
