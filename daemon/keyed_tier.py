"""The key-addressed page store of one model: engine-supplied keys naming host (L2) slots, beside
the tree's token-addressed pages and sharing their host pools, eviction order and quotas.

Engines (the SGLang HiCache backend) map the model's host pools (``kv_attach``) and copy page
bytes in and out of the slots this store names; no page byte travels through the socket. The
bookkeeping (keys, pins, recency) is :class:`~daemon.storage.keyed_pages.KeyedPages`; this layer
takes and frees the slots in the content-addressed :class:`~daemon.storage.host_pool.HostPool`
(each keyed page holds one reference, recorded in ``HostTier.keyed`` for the conservation check).

Eviction (one order for keyed pages and the tree's host-only pages): both are stamped on the
tree's churn clock (a keyed page when it is committed or hit). When a pool kind runs short, the
next victim is whichever is older: the least recently used unpinned keyed page, or the tree's next
host victim (the head of its host eviction queue, whose key is the tree policy's ``host_key``);
a tie goes to the keyed page. The tree's own host copies (``tier_jobs.reserve_host``) make room
through :meth:`KeyedTier.make_room` too, so neither side can starve the other. With memory
isolation (the host pools built from segments, daemon.storage.host_pool) a namespace's slots come
only from its own host segments: room is made from its own oldest pages first, then from the
others' oldest until segments of theirs empty and return to the free list (as on device).

Quotas: a tenant's ``quota_host`` counts full host pages of its namespace, the tree's and the
keyed ones (stored or reserved) together; over it, its own oldest host pages go first, then the
keys that do not fit are declined (slot 0, counted in ``full``). Its ``quota_l3_bytes`` counts
what this store writes to Redis in the tiers' L3 ledger (``l3_charge``), beside the tree's pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Iterator
from typing import Any

from radixd_client import protocol as P

from .model_cache import ModelCache
from .storage.codec import encode_page
from .storage.copies import in_thread
from .storage.host_pool import HostPool
from .storage.host_tier import HostTier
from .storage.keyed_audit import keyed_pool_audit_steps
from .storage.keyed_names import KeyedNames
from .storage.keyed_pages import KeyedPage, KeyedPages, KvError, KvPin, keyed_hash
from .storage.redis_tier import RedisTier

log = logging.getLogger("radixd.keyed")

#: Most keyed pages one L3 write batch encodes.
L3_WRITE_BATCH = 64
#: Most keyed pages waiting for Redis (each holds its host slot): past it the oldest are dropped.
MAX_L3_QUEUE = 4096
#: the longest a shutdown's drain waits for a kv_clear's raise that has not reached Redis
RAISE_DRAIN_S = 0.5
#: (pool kind, held host slot or 0, key, the page's bytes when no slot holds them, the
#: namespace's kv_clear count when it was queued, the page)
L3Item = tuple[str, int, bytes, bytes | None, int, KeyedPage]
#: The store's counters, model-wide and per namespace (operations.md, "Tiers in /v1/stats").
KV_COUNTERS = (
    "kv_lookups", "kv_lookup_keys", "kv_hit_keys", "kv_reserved", "kv_committed", "kv_aborted",
    "kv_declined", "kv_evicted", "kv_cleared", "kv_l3_write_pages", "kv_l3_write_failures",
    "kv_l3_write_outdated", "kv_l3_fetched", "kv_l3_fetch_timeouts")


#: TierManager.charge_l3: (namespace, Redis page id, pool, value bytes) of written values
L3Charge = Callable[[list[tuple[str, bytes, str, int]]], Awaitable[int]]


class KeyedTier:
    """Keyed pages of one model over its host tier."""

    def __init__(self, cache: ModelCache, host: HostTier, host_quotas: dict[str, int],
                 model: str, l3: RedisTier | None = None, l3_policy: str = "write_through",
                 l3_charge: L3Charge | None = None,
                 l3_forget: Callable[[str, list[tuple[bytes, str]]], None] | None = None
                 ) -> None:
        """``l3_charge``: counts pages written to Redis against their namespace's L3 quota
        (``TierManager.charge_l3``, one ledger with the tree's pages); None: not counted.
        ``l3_forget``: takes values deleted from Redis out of that ledger (``L3Ledger.forget``)."""
        self.cache = cache
        self.host = host
        self.host_quotas = host_quotas
        self.model = model
        self.fingerprint = cache.profile.layout_fingerprint()
        self.pages = KeyedPages()
        cache.keyed = self  # the tree's host copies make room through make_room
        self.l3 = l3
        self.l3_policy = l3_policy
        self.l3_charge = l3_charge
        self.l3_forget = l3_forget
        self._clears: dict[str, int] = {}  # kv_clear calls per namespace: a fetch spanning one
        # stores nothing it read before it
        # Redis deletes of cleared pages, run by the writer after the batch it is writing (which
        # may hold them), and their ids until they are done: a fetch never brings them back
        self._deletes: list[tuple[str, list[bytes]]] = []
        self._unwanted: Counter[bytes] = Counter()
        #: the pages' names in Redis, under each namespace's kv_clear generation
        self.names = KeyedNames(model)
        self.names.on_raised = lambda ns, gen: self.pages.raised(  # (writes queued too: their
            ns, gen, [item[-1] for item in (*self._l3_queue, *self._batch)])  # pages may be gone)
        self._l3_queue: list[L3Item] = []
        self._batch: list[L3Item] = []  # the one the writer is at
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._writing = False
        #: model-wide, for operators (/metrics, /v1/stats); a tenant's ``stats`` shows only its
        #: namespace's (``ns_counters``): another tenant's volumes are not its business
        self.counters = dict.fromkeys(KV_COUNTERS, 0)
        self.ns_counters: dict[str, dict[str, int]] = {}

    def count(self, ns: str, key: str, n: int = 1, model: bool = True) -> None:
        """Add ``n`` to counter ``key`` of namespace ``ns`` and (``model``) of the model."""
        if model:
            self.counters[key] += n
        mine = self.ns_counters.get(ns)
        if mine is None:
            mine = self.ns_counters[ns] = dict.fromkeys(KV_COUNTERS, 0)
        mine[key] += n

    # ------------------------------------------------------------------ validation

    def pool(self, kind: str) -> HostPool:
        if kind not in P.KV_POOLS:
            raise KvError(P.Code.BAD_ARGUMENT,
                          f"pool must be one of {list(P.KV_POOLS)}, got {kind!r}")
        p = self.host.full if kind == "full" else self.host.swa
        if p is None:
            raise KvError(P.Code.BAD_ARGUMENT,
                          f"model {self.model!r} has no {kind} host pool (no sliding-window "
                          "layers, or host_swa_pages = 0)")
        return p

    @staticmethod
    def check_keys(keys: list[bytes], unique: bool) -> None:
        if len(keys) > P.KV_MAX_KEYS:
            raise KvError(P.Code.BAD_ARGUMENT,
                          f"{len(keys)} keys; at most {P.KV_MAX_KEYS} per request")
        for i, k in enumerate(keys):
            if not P.KV_KEY_MIN <= len(k) <= P.KV_KEY_MAX:
                raise KvError(P.Code.BAD_ARGUMENT,
                              f"keys[{i}]: {len(k)} bytes; a key is {P.KV_KEY_MIN} to "
                              f"{P.KV_KEY_MAX} bytes")
        if unique and len(set(keys)) != len(keys):
            raise KvError(P.Code.BAD_ARGUMENT, "keys: a key appears twice in one reservation")

    def _pin(self, owner: Hashable, pin_id: int) -> KvPin:
        pin = self.pages.pin_of(owner, pin_id) if isinstance(pin_id, int) else None
        if pin is None:
            raise KvError(P.Code.BAD_RECEIPT,
                          f"pin {pin_id!r} is not one this session holds on model {self.model!r} "
                          "(never taken, already committed or released)")
        return pin

    # ------------------------------------------------------------------ slots

    def _take(self, kind: str, h: bytes, ns: str) -> int:
        slot = self.host.pool(kind).store(h, self.host.space(ns))
        self.host.keyed[kind].add(slot)
        return slot

    def _free(self, kind: str, slots: list[int]) -> None:
        pool = self.host.pool(kind)
        for s in slots:
            self.host.keyed[kind].discard(s)
            pool.release(s)
        self.host.let_go(kind, slots)

    def _drop(self, page: KeyedPage, evicted: bool = False) -> None:
        """Forget a page and free its slot; the bytes of an evicted page that L3 write-back
        still owes Redis are copied first (they are intact until the slot is freed), and
        encoded by the writer under the generation Redis holds then."""
        if evicted and self.l3 is not None and self.l3_policy == "write_back" and not page.in_l3:
            payload = bytes(self.host.pool(page.kind).page_bytes(page.slot))
            self._queue((page.kind, 0, page.key, payload, self._clears.get(page.ns, 0), page))
        self.pages.remove(page)
        self._free(page.kind, [page.slot])

    def _tree_victim(self, kind: str, ns: str | None, exclude: str | None = None
                     ) -> tuple[str, float] | None:
        """The namespace and key of the tree's next host victim for a slot of ``kind`` (of ``ns``
        if given, of any namespace but ``exclude`` if that is given)."""
        best: tuple[str, float] | None = None
        for name, space in self.cache.tree.namespaces.items():
            if (ns is not None and name != ns) or name == exclude:
                continue
            q = space.host_q if kind == "full" else space.host_swa_q
            if q.peek() is not None and (best is None or q.heap[0][0] < best[1]):
                best = (name, q.heap[0][0])
        return best

    def _evict_one(self, kind: str, ns: str | None, exclude: str | None = None) -> bool:
        """Evict the older of the next keyed victim and the tree's next host victim (of ``ns``
        if given; of any namespace but ``exclude`` if given); False when neither exists.

        A keyed page whose slot a Redis write still reads is passed over: its eviction would
        free no slot until the write has read it."""
        read = self.host.readers[kind]
        victims = self.pages.victims(kind, ns, exclude)
        page = next(victims if not read else (p for p in victims if p.slot not in read), None)
        tree = self._tree_victim(kind, ns, exclude)
        if page is None and tree is None:  # a window behind a host leaf without one may be left
            return kind == "swa" and self.cache.evict_host(  # (RadixTree.evict_host)
                0, namespace=ns, swa_slots=1).host_swa_slots > 0
        if page is not None and (tree is None or page.stamp <= tree[1]):
            self._drop(page, evicted=True)
            self.count(page.ns, "kv_evicted")
        elif kind == "full":
            self.cache.evict_host(1, namespace=tree[0])  # type: ignore[index]
        else:
            self.cache.evict_host(0, namespace=tree[0], swa_slots=1)  # type: ignore[index]
        return True

    def make_room(self, kind: str, need: int, ns: str) -> int:
        """Evict (keyed and tree host pages, one order) until namespace ``ns`` can take ``need``
        slots of ``kind`` or nothing evictable is left. Shared pools: the oldest pages of any
        namespace go. Isolated: ``ns``'s own oldest first (they free slots of its segments),
        then the others' oldest, until segments of theirs empty onto the free list.

        Slots that a Redis write still reads are not free when their page goes: keyed pages
        holding one are passed over, and the host tier's orphans (pages gone, slots still read)
        count as room (``HostTier.coming_to``). Evicting on until the room is there at once
        would take every other page when Redis is slow. Returns that room to come, which the
        namespace gets as the writes read the slots (``HostTier.unheld``)."""
        self.cache.flush_host_drops()
        host = self.host
        if host.available_to(kind, ns) >= need:
            return 0
        coming = host.coming_to(kind, ns)

        def evict(victims: str | None, exclude: str | None = None) -> bool:
            nonlocal coming
            if host.available_to(kind, ns) + coming >= need:
                return False
            if not self._evict_one(kind, victims, exclude):
                return False
            if host.orphans[kind]:
                coming = host.coming_to(kind, ns)
            return True

        if not host.isolated:
            while evict(None):
                pass
            return coming
        while evict(ns):
            pass
        while evict(None, exclude=ns):
            pass
        return coming

    def read_pages(self, kind: str, ns: str | None = None) -> int:
        """Unpinned keyed pages of ``kind`` (of ``ns`` if given) whose slot a Redis write still
        reads: eviction passes over them until it has. A walk over every keyed page of the kind,
        for the rare caller that is short of room."""
        read = self.host.readers[kind]
        if not read:
            return 0
        return sum(1 for p in self.pages.victims(kind, ns) if p.slot in read)

    def host_used(self, ns: str) -> int:
        """Full host pages the namespace holds: the tree's, those its copies are filling, and
        the keyed ones."""
        space = self.cache.tree.namespaces.get(ns)
        return ((space.host_pages if space is not None else 0) + self.pages.pages_of(ns)
                + self.host.pending_full.get(ns, 0))

    def fit_quota(self, ns: str, want: int) -> int:
        """How many of ``want`` new full host pages the namespace's quota admits, after its own
        oldest host pages went."""
        quota = self.host_quotas.get(ns, 0)
        if not quota:
            return want
        while self.host_used(ns) + want > quota and self._evict_one("full", ns):
            pass
        return max(0, min(want, quota - self.host_used(ns)))

    # ------------------------------------------------------------------ operations

    def check_pins(self, owner: Hashable, want: int, limit: int) -> None:
        """An owner's pins and reservations may name at most ``limit`` keys together (each
        costs daemon memory, and what it pins cannot be evicted): ``too_many_locks`` when
        ``want`` more would pass it."""
        held = self.pages.keys_held(owner)
        if held + want > limit:
            raise KvError(P.Code.TOO_MANY_LOCKS,
                          f"this session's keyed-store pins and reservations on model "
                          f"{self.model!r} name {held} keys, and this request {want} more; the "
                          f"limit is {limit}: release some first", limit=limit)

    def check_lookup(self, kind: str, keys: list[bytes]) -> None:
        """A lookup's argument checks, which come before any limit's (protocol.md 9.4)."""
        self.pool(kind)
        self.check_keys(keys, unique=False)

    def _kept(self, ns: str, kind: str, keys: list[bytes]) -> contextlib.AbstractContextManager:
        """The request's stored pages stay while room is made for its others (no eviction trades
        them for what it brings): held meanwhile, and touched, the first key last."""
        kept = [p for p in dict.fromkeys(self.pages.get(ns, kind, k) for k in reversed(keys)) if p]
        for page in kept:
            self.pages.touch(page, self.cache.tree.clock)
        return self.pages.held(kept)

    def lookup(self, owner: Hashable, ns: str, kind: str, keys: list[bytes], pin: bool,
               max_pins: int) -> P.KvLookupResult:
        self.check_lookup(kind, keys)
        self.names.learn(ns)
        present = bytearray(len(keys))
        slots = array("i", bytes(4 * len(keys)))
        found: dict[KeyedPage, None] = {}  # distinct: a key named twice is pinned once
        hits = 0
        prefix = -1
        for i, k in enumerate(keys):
            page = self.pages.get(ns, kind, k)
            if page is None:
                if prefix < 0:
                    prefix = i
                continue
            present[i] = 1
            slots[i] = page.slot
            found[page] = None
            hits += 1
        if pin and found:  # before anything changes
            self.check_pins(owner, len(found), max_pins)
        clock = self.cache.tree.clock
        for page in found:
            self.pages.touch(page, clock)
        self.count(ns, "kv_lookups")
        self.count(ns, "kv_lookup_keys", len(keys))
        self.count(ns, "kv_hit_keys", hits)
        pin_id = self.pages.pin_pages(owner, ns, kind, list(found)).id if pin and found else 0
        return P.KvLookupResult(present=bytes(present), slots=slots,
                                prefix=len(keys) if prefix < 0 else prefix, pin=pin_id,
                                host_segments_gen=self.host.generation(ns))

    def reserve(self, owner: Hashable, ns: str, kind: str, keys: list[bytes], max_pins: int
                ) -> P.KvReserveResult:
        pool = self.pool(kind)
        self.check_keys(keys, unique=True)
        self.check_pins(owner, len(keys), max_pins)
        self.names.learn(ns)
        slots = array("i", bytes(4 * len(keys)))
        want = 0
        hashes: dict[bytes, bytes] = {}
        for k in (k for k in keys if self.pages.get(ns, kind, k) is None):
            h = hashes[k] = keyed_hash(ns, self.fingerprint, kind, k)
            if not self.pages.is_reserved(ns, kind, k) and pool.lookup(h) is None:
                want += 1
        with self._kept(ns, kind, keys):
            fit = self.fit_quota(ns, want) if kind == "full" else want
            self.make_room(kind, fit, ns)
        # after the eviction: a key it took is no longer stored, and is written (or declined)
        todo: list[tuple[int, bytes]] = []
        busy = 0
        for i, k in enumerate(keys):
            if self.pages.get(ns, kind, k) is not None:
                continue  # stored: nothing to write
            h = hashes.get(k) or keyed_hash(ns, self.fingerprint, kind, k)
            # another reservation is writing it, or its old page is gone but its slot is still
            # read (an L3 write in flight holds it): a new copy can be reserved once that ends
            if self.pages.is_reserved(ns, kind, k) or pool.lookup(h) is not None:
                busy += 1
                continue
            todo.append((i, h))
        fit = min(fit, len(todo), pool.available_to(self.host.space(ns)))
        taken: dict[bytes, tuple[int, bytes]] = {}
        try:
            for i, h in todo[:fit]:
                slots[i] = self._take(kind, h, ns)
                taken[keys[i]] = (slots[i], h)
        except OSError as exc:  # a segment got no fresh memory (EMFILE, ENOMEM): no room
            log.warning("keyed %s: a host segment for namespace %r got no memory (%s); %d "
                        "keys declined", kind, ns, exc.strerror or exc, fit - len(taken))
            fit = len(taken)
        except BaseException:  # no pin holds them yet: give them back before the error goes up
            self._free(kind, [slot for slot, _ in taken.values()])
            raise
        declined = len(todo) - fit
        self.count(ns, "kv_reserved", fit)
        self.count(ns, "kv_declined", declined)
        pin_id = self.pages.reserve(owner, ns, kind, taken,
                                    self.names.stored_as(ns)).id if taken else 0
        return P.KvReserveResult(slots=slots, pin=pin_id, full=declined, busy=busy,
                                 host_segments_gen=self.host.generation(ns))

    def commit(self, owner: Hashable, pin_id: int) -> list[KeyedPage]:
        pin = self._pin(owner, pin_id)
        if not pin.is_reservation:
            raise KvError(P.Code.BAD_ARGUMENT,
                          f"pin {pin_id} is a lookup pin: release it (kv_release), only a "
                          "reservation is committed")
        pages = self.pages.commit(pin, self.cache.tree.clock)
        self.count(pin.ns, "kv_committed", len(pages))
        if self.l3 is not None and self.l3_policy == "write_through":
            for page in pages:  # the slot is held (a reader) until its value is encoded
                if self.host.hold(page.kind, (page.slot,)):
                    self._queue((page.kind, page.slot, page.key, None,
                                 self._clears.get(page.ns, 0), page))
        return pages

    def release(self, owner: Hashable, pin_id: int) -> None:
        pin = self._pin(owner, pin_id)
        freed = self.pages.release(pin)
        if freed:
            self._free(pin.kind, freed)
            self.count(pin.ns, "kv_aborted", len(freed))

    def release_owner(self, owner: Hashable) -> int:
        """Every pin and reservation of an owner ends (its session is gone)."""
        pins = self.pages.owner_pins(owner)
        for pin in pins:
            self.release(owner, pin.id)
        return len(pins)

    def clear(self, ns: str) -> list[KeyedPage]:
        """Drop the namespace's unpinned keyed pages and their Redis copies (in the background,
        fail-soft), and raise its generation in Redis, which leaves every value of it written
        before unreadable, those of pages no longer on host included; returns the pages."""
        gen = self.names.known(ns)
        gone = [p for p in self.pages.pages.values() if p.ns == ns and not p.pins]
        self._clears[ns] = self._clears.get(ns, 0) + 1
        for page in gone:
            page.cleared = True
            self._drop(page)
        self.count(ns, "kv_cleared", len(gone))
        if self._l3_queue:  # the namespace's writes not begun are of before the clear (pages
            # evicted since included): written now, they would be read again
            self._let_go([item for item in self._l3_queue if item[-1].ns == ns])
            self._l3_queue[:] = [item for item in self._l3_queue if item[-1].ns != ns]
        self.pages.kept_by_clear(ns)
        if self.l3 is None:
            self.names.owe(ns)
            return gone
        self.names.raise_gen(self.l3, ns)
        if gone and gen is not None:
            for kind in P.KV_POOLS:
                ids = [self.names.page_id(p.hash, gen) for p in gone if p.kind == kind]
                if not ids:
                    continue
                self._unwanted.update(ids)
                if self._wake is not None:  # after the write under way, which may hold them
                    self._deletes.append((kind, ids))
                    self._wake.set()
                else:
                    asyncio.get_running_loop().create_task(self._delete(kind, ids))
                if self.l3_forget is not None:
                    self.l3_forget(ns, [(i, kind) for i in ids])
        return gone

    # ------------------------------------------------------------------ L3 (Redis)

    @property
    def l3_queued(self) -> int:
        """Pages waiting for the Redis writer (the batch it is writing not counted)."""
        return len(self._l3_queue)

    def _uncleared(self, ns: str, clears: int) -> bool:
        """Whether no kv_clear of ``ns`` came since its count of clears was ``clears``."""
        return self._clears.get(ns, 0) == clears

    def _let_go(self, items: list[L3Item]) -> None:
        """The host slots that queued writes held (to read them) are held no more."""
        for kind, slot, *_ in items:
            if slot:
                self.host.unhold(kind, (slot,))

    def _queue(self, item: L3Item) -> None:
        self._l3_queue.append(item)
        if len(self._l3_queue) > MAX_L3_QUEUE:
            drop = len(self._l3_queue) - MAX_L3_QUEUE
            self._let_go(self._l3_queue[:drop])
            for *_, page in self._l3_queue[:drop]:
                self.count(page.ns, "kv_l3_write_failures")
            del self._l3_queue[:drop]
        if self._wake is not None:
            self._wake.set()

    def start(self) -> None:
        """Start the L3 writer (on the running loop) when the model writes to Redis."""
        if self.l3 is not None:
            self.names.start(self.l3)
            self._wake = asyncio.Event()
            if self._l3_queue or self._deletes:  # queued before the start (a warm restore's)
                self._wake.set()
            self._task = asyncio.create_task(self._writer(), name=f"radixd-kv-l3-{self.model}")

    async def drain(self, deadline: float) -> None:
        """Finish queued Redis writes by ``deadline`` (time.monotonic(); shutdown), and give a
        clear's raise under way a moment more (RAISE_DRAIN_S: one that Redis does not take
        would hold the other models' drains back; a saved host state carries it over)."""
        while (self._l3_queue or self._deletes or self._writing or self._unwanted) and \
                time.monotonic() < deadline:  # (_unwanted: a delete under way)
            if self._wake is not None:
                self._wake.set()
            await asyncio.sleep(0.01)
        deadline = min(deadline, time.monotonic() + RAISE_DRAIN_S)
        while self.names.raising and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def aclose(self) -> None:
        self.names.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        self._let_go(self._l3_queue)
        self._l3_queue.clear()

    async def _writer(self) -> None:
        assert self._wake is not None and self.l3 is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._l3_queue or self._deletes:
                while self._deletes:
                    await self._delete(*self._deletes.pop(0))
                if not self._l3_queue:
                    break
                batch = self._batch = self._l3_queue[:L3_WRITE_BATCH]
                del self._l3_queue[:L3_WRITE_BATCH]
                self._writing = True
                uncounted, named_all = batch, False  # what a failure counts (see below)
                try:
                    try:  # named under the generations Redis holds now (a clear raises them)
                        gens = {ns: await self.names.to_write(self.l3, ns)
                                for ns in {i[-1].ns for i in batch}}
                        # nothing queued before a clear of its namespace is written: named
                        # under a generation read after the clear, it would be read again (one
                        # cleared from here on is named under the one before, never read again)
                        named = [(item, self.names.page_id(item[-1].hash, gen)) for item in batch
                                 if (gen := gens[item[-1].ns]) is not None
                                 and self._uncleared(item[-1].ns, item[4])
                                 and not item[-1].outdated(gen)]
                        values = await in_thread(self._encode, named)
                    finally:
                        self._let_go(batch)
                    for *_, clears, page in batch:
                        if not self._uncleared(page.ns, clears):
                            continue
                        if (gen := gens[page.ns]) is None:
                            self.count(page.ns, "kv_l3_write_failures")
                        elif page.outdated(gen):
                            self.count(page.ns, "kv_l3_write_outdated")
                    uncounted, named_all = [item for item, _ in named], True
                    stored = await self.l3.set_pages_each(values)
                    dead: dict[str, list[bytes]] = {}  # values a clear overtook: deleted too
                    for ((kind, *_, clears, page), l3id), ok in zip(named, stored, strict=True):
                        live = self._uncleared(page.ns, clears)
                        page.in_l3 = page.in_l3 or (ok is True and live)
                        self.count(page.ns, "kv_l3_write_pages" if ok
                                   else "kv_l3_write_failures")
                        if ok is not False and not live and l3id not in self._unwanted:
                            dead.setdefault(kind, []).append(l3id)  # (else its clear does)
                    for kind, ids in dead.items():  # never charged: never left in Redis
                        self._unwanted.update(ids)
                        self._deletes.append((kind, ids))
                    uncounted = []
                    if self.l3_charge is not None:  # what Redis stored, or may have
                        await self.l3_charge([
                            (page.ns, l3id, kind, len(v))
                            for ((kind, *_, clears, page), l3id), v, ok in zip(
                                named, values, stored, strict=True)
                            if ok is not False and self._uncleared(page.ns, clears)])
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("keyed L3 write failed")
                    for *_, clears, page in uncounted:  # as the path it left would have:
                        # named pages whatever a clear did meanwhile, others unless overtaken
                        if named_all or self._uncleared(page.ns, clears):
                            self.count(page.ns, "kv_l3_write_failures")
                finally:
                    self._writing, self._batch = False, []

    async def _delete(self, kind: str, ids: list[bytes]) -> None:
        """Delete cleared pages' values from Redis (fail-soft); fetches may read them again
        once it is done."""
        assert self.l3 is not None
        try:
            await self.l3.delete(ids, kind)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("deleting cleared keyed pages from Redis failed")
        finally:
            self._unwanted.subtract(ids)
            for i in ids:
                if self._unwanted[i] <= 0:
                    del self._unwanted[i]

    def _encode(self, named: list[tuple[L3Item, bytes]]) -> list[bytes]:
        """Runs in a worker thread: the slots are held, so their bytes cannot change."""
        return [encode_page(pool=kind, page_hash=l3id, fingerprint=self.fingerprint, key=key,
                            payload=payload if payload is not None
                            else self.host.pool(kind).page_bytes(slot))
                for (kind, slot, key, payload, *_), l3id in named]

    async def fetch(self, ns: str, kind: str, keys: list[bytes], timeout_s: float) -> int:
        """Bring the keys only Redis holds into host (verified values; any mismatch is a miss),
        waiting at most ``timeout_s``, for Redis and for slots that Redis writes still read;
        returns how many arrived. Redis down is a miss."""
        self.check_lookup(kind, keys)
        if self.l3 is None:
            return 0
        missing = list(dict.fromkeys(
            k for k in keys if self.pages.get(ns, kind, k) is None
            and not self.pages.is_reserved(ns, kind, k)))
        if not missing:
            return 0
        hashes = [keyed_hash(ns, self.fingerprint, kind, k) for k in missing]
        clears = self._clears.get(ns, 0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        async def read() -> tuple[list[bytes], list[Any]] | None:
            gen = await self.names.current(self.l3, ns)  # type: ignore[arg-type]
            if gen is None:
                return None
            ids = [self.names.page_id(h, gen) for h in hashes]
            return ids, await self.l3.get_pages(ids, kind, self.fingerprint, page_keys=missing)

        try:
            got = await asyncio.wait_for(read(), timeout_s)
        except asyncio.TimeoutError:
            self.count(ns, "kv_l3_fetch_timeouts")
            return 0
        if got is None:  # Redis down, or a clear not yet recorded there: a miss
            return 0
        ids, values = got
        found = [(k, h, v) for k, h, i, v in zip(missing, hashes, ids, values, strict=True)
                 if v is not None and self._uncleared(ns, clears)
                 and i not in self._unwanted]
        pool = self.host.pool(kind)
        waited_out = False
        while True:
            # what arrived meanwhile (another fetch, a commit) is not stored twice; after a wait
            # everything is read again, as other sessions went on meanwhile
            found = [(k, h, v) for k, h, v in found if self.pages.get(ns, kind, k) is None
                     and not self.pages.is_reserved(ns, kind, k) and pool.lookup(h) is None]
            with self._kept(ns, kind, keys):
                fit = self.fit_quota(ns, len(found)) if kind == "full" else len(found)
                coming = self.make_room(kind, fit, ns)
            fit = min(fit, self.host.available_to(kind, ns))
            if fit == len(found) or waited_out:
                break
            # short while Redis writes read slots of pages they hold (the quota's included):
            # those come free as each write has read them, within the time this fetch was given
            own = self.host.isolated or (kind == "full" and self.host_quotas.get(ns))
            if not coming and not self.read_pages(kind, ns if own else None):
                break
            try:
                await asyncio.wait_for(self.host.unheld(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                waited_out = True  # once more, for what the other sessions changed meanwhile
        if not self._uncleared(ns, clears):  # read before a kv_clear: never brought back
            return 0
        clock = self.cache.tree.clock
        stored = 0
        for k, h, v in found[:fit]:  # on the loop: a slot is never visible before it is full
            try:
                slot = self._take(kind, h, ns)
            except OSError as exc:  # a segment got no fresh memory: the rest are misses
                log.warning("keyed %s: a host segment for namespace %r got no memory (%s)",
                            kind, ns, exc.strerror or exc)
                break
            pool.write_page_bytes(slot, v.payload)
            self.pages.add_stored(ns, kind, k, slot, h, clock)
            stored += 1
        self.count(ns, "kv_l3_fetched", stored)
        return stored

    # ------------------------------------------------------------------ checking and reporting

    def check(self, live_owners: set[Hashable]) -> list[str]:
        """The store's invariants: its bookkeeping, and per host pool kind free + tree host +
        keyed + reserved (+ copies in flight) = capacity, with no slot in two places and every
        keyed slot holding the page's own hash."""
        v: list[str] = []
        for _ in self.check_steps(live_owners, v):
            pass
        return v

    def check_steps(self, live_owners: set[Hashable], v: list[str]) -> Iterator[None]:
        """:meth:`check` into ``v``, yielding after each bounded piece of work (at most
        :data:`~daemon.gpu.allocator.AUDIT_STEP_SLOTS` pages or keys), so that the background
        checker never holds a request back for a whole store (daemon/checker.py)."""
        yield from self.pages.audit_steps(live_owners, v)
        for kind in P.KV_POOLS:
            yield from keyed_pool_audit_steps(self.pages, self.host, kind, v)

    def stats(self, ns: str) -> dict[str, int]:
        """The namespace's keyed pages, pins and counters (a tenant's ``stats``)."""
        out = {
            "kv_pages": sum(1 for p in self.pages.pages.values() if p.ns == ns),
            "kv_pins": sum(1 for p in self.pages.pins.values() if p.ns == ns),
        }
        out.update(self.ns_counters.get(ns) or dict.fromkeys(KV_COUNTERS, 0))
        return out
