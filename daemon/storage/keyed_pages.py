"""The bookkeeping of the key-addressed page store: which engine-supplied key names which host slot,
who pins what, and the store's recency order. Pure: no memory, no I/O (``daemon.keyed_tier``
composes it with the host pools, the tree's host pages and Redis).

A keyed page lives in one namespace, one model (this object is per model) and one pool kind
("full" or "swa"), and occupies exactly one host slot. Its identity in the content-addressed host
pool is :func:`keyed_hash`, domain-separated from the tree's chain hashes.

States of a key:

* **reserved**: a session holds a fresh slot for it under a reservation pin and is writing it;
  invisible to lookups; freed if the pin is released or the session ends;
* **stored** (a :class:`KeyedPage`): visible to every session of the namespace, in the recency
  order; a lookup pin on it keeps it from eviction and :meth:`KeyedPages.clear`.

Not thread-safe: the daemon calls it from its event loop only.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from daemon.gpu.allocator import AUDIT_STEP_SLOTS
from daemon.tree import chunked

#: Domain tag of a keyed page's host-pool hash (tree page hashes chain from a namespace seed).
KEYED_HASH_TAG = b"radixd-keyed-page\x00"

Slot = int
PageId = tuple[str, str, bytes]  # (namespace, pool kind, key)


def keyed_hash(namespace: str, fingerprint: bytes, kind: str, key: bytes) -> bytes:
    """The 32-byte content address of a keyed page: SHA-256 over a domain tag and the
    length-prefixed namespace, layout fingerprint, pool kind and key, so it can equal neither a
    tree page hash nor the hash of another (namespace, layout, kind, key)."""
    h = hashlib.sha256(KEYED_HASH_TAG)
    for part in (namespace.encode(), fingerprint, kind.encode(), key):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


class KvError(Exception):
    """A refused keyed-store request, with its protocol error code."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.details = details


@dataclass(eq=False)
class KeyedPage:
    """A stored keyed page. ``stamp``: last commit or hit, on the tree's churn clock."""

    ns: str
    kind: str
    key: bytes
    slot: Slot
    hash: bytes
    stamp: int
    pins: int = 0
    in_l3: bool = False  # written to Redis (or read from it): an eviction owes Redis nothing
    cleared: bool = False  # dropped by kv_clear: a Redis write of it must not bring it back
    # the namespace's kv_clear generation as this daemon knew it when the page's reservation
    # was made (KeyedNames.stored_as; None while a clear of this daemon's own is on its way to
    # Redis): a write to Redis that finds a later one drops the page, since another daemon's
    # clear came after it was computed
    gen: int | None = None

    def outdated(self, gen: int) -> bool:
        """Whether a kv_clear of the page's namespace by another daemon sharing the Redis came
        after the page was stored here (``gen``: the generation Redis holds now): written under
        the generation that clear raised, the page would be read as newer than the clear."""
        return self.gen is not None and gen > self.gen


@dataclass(eq=False)
class KvPin:
    """A lookup pin (``pages``) or a reservation (``reserved``: key -> (slot, hash))."""

    id: int
    owner: Hashable
    ns: str
    kind: str
    pages: list[KeyedPage] = field(default_factory=list)
    reserved: dict[bytes, tuple[Slot, bytes]] | None = None
    gen: int | None = None  # a reservation's: what its pages will be of (KeyedPage.gen)

    @property
    def is_reservation(self) -> bool:
        return self.reserved is not None


class KeyedPages:
    """Keys, slots, pins and recency of one model's keyed pages."""

    def __init__(self) -> None:
        self.pages: dict[PageId, KeyedPage] = {}
        # per pool kind, every stored page, least recently used first
        self.order: dict[str, OrderedDict[PageId, KeyedPage]] = {
            "full": OrderedDict(), "swa": OrderedDict()}
        self.reserving: dict[PageId, int] = {}  # key being written -> its reservation pin
        self.pins: dict[int, KvPin] = {}
        self.by_owner: dict[Hashable, set[int]] = {}
        # keys each owner's pins and reservations name (the per-session cap counts them)
        self.owner_keys: dict[Hashable, int] = {}
        # full-pool host pages per namespace, stored or reserved (the host quota counts them)
        self.ns_pages: dict[str, int] = {}
        self._next_pin = 1
        #: bumped by every change :meth:`audit` would see (a pin, a reservation, a page stored or
        #: removed): part of the checker's state version, so that a stepped audit spanning one is
        #: given up. A hit (:meth:`touch`) only reorders pages and is not counted: reads do not
        #: cut passes short, and the audit never walks the order itself across steps
        self.changes = 0

    # -- queries ---------------------------------------------------------------------------------

    def get(self, ns: str, kind: str, key: bytes) -> KeyedPage | None:
        return self.pages.get((ns, kind, key))

    def is_reserved(self, ns: str, kind: str, key: bytes) -> bool:
        return (ns, kind, key) in self.reserving

    def pages_of(self, ns: str) -> int:
        """Full-pool host slots the namespace's keyed pages occupy (stored or reserved)."""
        return self.ns_pages.get(ns, 0)

    def victims(self, kind: str, ns: str | None = None, exclude: str | None = None
                ) -> Iterator[KeyedPage]:
        """Unpinned stored pages of ``kind`` (of one namespace, if given; of any namespace but
        ``exclude``, if given), least recent first."""
        for page in self.order[kind].values():
            if not page.pins and (ns is None or page.ns == ns) and page.ns != exclude:
                yield page

    def keys_held(self, owner: Hashable) -> int:
        """Keys the owner's pins and reservations name now."""
        return self.owner_keys.get(owner, 0)

    def pin_of(self, owner: Hashable, pin_id: int) -> KvPin | None:
        """The owner's pin ``pin_id``, or None when it has none by that id."""
        pin = self.pins.get(pin_id)
        return pin if pin is not None and pin.owner == owner else None

    # -- changes ---------------------------------------------------------------------------------

    def _count(self, ns: str, kind: str, delta: int) -> None:
        if kind == "full":
            left = self.ns_pages.get(ns, 0) + delta
            if left:
                self.ns_pages[ns] = left
            else:
                self.ns_pages.pop(ns, None)

    def _new_pin(self, owner: Hashable, ns: str, kind: str, keys: int) -> KvPin:
        self.changes += 1
        pin = KvPin(self._next_pin, owner, ns, kind)
        self._next_pin += 1
        self.pins[pin.id] = pin
        self.by_owner.setdefault(owner, set()).add(pin.id)
        self.owner_keys[owner] = self.owner_keys.get(owner, 0) + keys
        return pin

    def _end_pin(self, pin: KvPin) -> None:
        self.changes += 1
        del self.pins[pin.id]
        ids = self.by_owner[pin.owner]
        ids.discard(pin.id)
        if not ids:
            del self.by_owner[pin.owner]
            del self.owner_keys[pin.owner]
        else:
            self.owner_keys[pin.owner] -= len(pin.pages) if pin.reserved is None \
                else len(pin.reserved)

    def touch(self, page: KeyedPage, stamp: int) -> None:
        """A hit: the page becomes the most recent of its kind."""
        page.stamp = stamp
        self.order[page.kind].move_to_end((page.ns, page.kind, page.key))

    @contextlib.contextmanager
    def held(self, pages: list[KeyedPage]) -> Iterator[None]:
        """``pages`` (distinct) cannot be evicted while the block runs, which must not await:
        the audit, between requests, counts a page's pins against the pins recorded."""
        for page in pages:
            page.pins += 1
        try:
            yield
        finally:
            for page in pages:
                page.pins -= 1

    def pin_pages(self, owner: Hashable, ns: str, kind: str, pages: list[KeyedPage]) -> KvPin:
        """A lookup pin over distinct ``pages``."""
        pin = self._new_pin(owner, ns, kind, len(pages))
        pin.pages = pages
        for p in pages:
            p.pins += 1
        return pin

    def reserve(self, owner: Hashable, ns: str, kind: str,
                slots: dict[bytes, tuple[Slot, bytes]], gen: int | None) -> KvPin:
        """A reservation pin over fresh slots (key -> (slot, hash)) the caller took, whose pages
        will be of clear generation ``gen``."""
        pin = self._new_pin(owner, ns, kind, len(slots))
        pin.reserved, pin.gen = dict(slots), gen
        for key in slots:
            self.reserving[(ns, kind, key)] = pin.id
        self._count(ns, kind, len(slots))
        return pin

    def commit(self, pin: KvPin, stamp: int) -> list[KeyedPage]:
        """The reservation's keys become stored pages (the most recent); the pin ends."""
        assert pin.reserved is not None
        self._end_pin(pin)
        out = []
        for key, (slot, h) in pin.reserved.items():
            pid = (pin.ns, pin.kind, key)
            del self.reserving[pid]
            page = KeyedPage(pin.ns, pin.kind, key, slot, h, stamp, gen=pin.gen)
            self.pages[pid] = page
            self.order[pin.kind][pid] = page
            out.append(page)
        return out

    def release(self, pin: KvPin) -> list[Slot]:
        """End a pin; returns the slots of an aborted reservation, for the caller to free."""
        self._end_pin(pin)
        if pin.reserved is None:
            for p in pin.pages:
                p.pins -= 1
            return []
        for key in pin.reserved:
            del self.reserving[(pin.ns, pin.kind, key)]
        self._count(pin.ns, pin.kind, -len(pin.reserved))
        return [slot for slot, _ in pin.reserved.values()]

    def kept_by_clear(self, ns: str) -> None:
        """A kv_clear of ``ns`` kept these pages and reservations (pinned): their values in
        Redis are gone, and they are of the generation the clear raises, once it is known
        (:meth:`raised`)."""
        for page in self.pages.values():
            if page.ns == ns:
                page.in_l3, page.gen = False, None
        for pin in self.pins.values():
            if pin.ns == ns and pin.reserved is not None:
                pin.gen = None

    def raised(self, ns: str, gen: int, queued: Iterable[KeyedPage] = ()) -> None:
        """This daemon's kv_clear of ``ns`` reached Redis as ``gen``: what it kept, and what was
        reserved while it was on its way, is of that generation; ``queued``: pages whose Redis
        writes wait, some of them no longer stored (evicted meanwhile)."""
        for page in (*self.pages.values(), *queued):
            if page.ns == ns and page.gen is None:
                page.gen = gen
        for pin in self.pins.values():
            if pin.ns == ns and pin.reserved is not None and pin.gen is None:
                pin.gen = gen

    def owner_pins(self, owner: Hashable) -> list[KvPin]:
        return [self.pins[i] for i in sorted(self.by_owner.get(owner, ()))]

    def remove(self, page: KeyedPage) -> None:
        """Forget an unpinned stored page (evicted or cleared); the caller frees its slot."""
        if page.pins:
            raise ValueError(f"keyed page {page.key!r} is pinned {page.pins} times")
        self.changes += 1
        pid = (page.ns, page.kind, page.key)
        del self.pages[pid]
        del self.order[page.kind][pid]
        self._count(page.ns, page.kind, -1)

    def add_stored(self, ns: str, kind: str, key: bytes, slot: Slot, h: bytes, stamp: int,
                   in_l3: bool = True, gen: int | None = None) -> KeyedPage:
        """A page that arrived stored: fetched from Redis, or restored by a warm restart (in
        Redis or not, as it was): no reservation in between."""
        self.changes += 1
        pid = (ns, kind, key)
        page = KeyedPage(ns, kind, key, slot, h, stamp, in_l3=in_l3, gen=gen)
        self.pages[pid] = page
        self.order[kind][pid] = page
        self._count(ns, kind, 1)
        return page

    # -- checking ----------------------------------------------------------------------------------

    def audit(self, live_owners: set[Hashable]) -> list[str]:
        """Internal consistency: indexes, pin counts, owners alive, counters recomputed."""
        v: list[str] = []
        for _ in self.audit_steps(live_owners, v):
            pass
        return v

    def audit_steps(self, live_owners: set[Hashable], v: list[str]) -> Iterator[None]:
        """:meth:`audit` into ``v``, yielding after each bounded piece of work (at most
        :data:`~daemon.gpu.allocator.AUDIT_STEP_SLOTS` pages, pins or keys looked at), so that
        the background checker never holds a request back for a whole store
        (daemon/checker.py)."""
        for kind, order in self.order.items():
            n = 0
            missing = False  # a page of this kind the recency order lacks
            for chunk in chunked(self.pages, AUDIT_STEP_SLOTS):
                for pid in chunk:
                    if pid[1] == kind:
                        n += 1
                        missing |= pid not in order
                yield
            if missing or n != len(order):  # the report: a rare path, in one step
                mine = {pid for pid in self.pages if pid[1] == kind}
                v.append(f"keyed {kind}: recency order and pages disagree on "
                         f"{sorted(set(order) ^ mine)[:5]}")
        for chunk in chunked(self.pages.items(), AUDIT_STEP_SLOTS):
            for pid, page in chunk:
                if pid != (page.ns, page.kind, page.key):
                    v.append(f"keyed page {pid!r} is indexed under another key")
            yield
        want_pins: dict[int, int] = {}
        reserving: dict[PageId, int] = {}
        counts: dict[str, int] = {}
        work = 0  # pages and keys looked at since the last step (one pin may name 64k)
        for pin_id, pin in self.pins.items():
            if pin.id != pin_id:
                v.append(f"keyed pin {pin_id} records id {pin.id}")
            if pin.owner not in live_owners:
                v.append(f"keyed pin {pin_id} belongs to {pin.owner!r}, which is gone")
            if pin_id not in self.by_owner.get(pin.owner, ()):
                v.append(f"keyed pin {pin_id} is not listed for its owner")
            work += 1
            if pin.reserved is None:
                for p in pin.pages:
                    if self.pages.get((p.ns, p.kind, p.key)) is not p:
                        v.append(f"keyed pin {pin_id} pins a page that is not stored")
                    want_pins[id(p)] = want_pins.get(id(p), 0) + 1
                    work += 1
                    if work >= AUDIT_STEP_SLOTS:
                        work = 0
                        yield
            else:
                for key in pin.reserved:
                    pid = (pin.ns, pin.kind, key)
                    if pid in reserving or pid in self.pages:
                        v.append(f"keyed key {key!r} is reserved twice or reserved and stored")
                    reserving[pid] = pin_id
                    if pin.kind == "full":
                        counts[pin.ns] = counts.get(pin.ns, 0) + 1
                    work += 1
                    if work >= AUDIT_STEP_SLOTS:
                        work = 0
                        yield
            if work >= AUDIT_STEP_SLOTS:
                work = 0
                yield
        yield
        same = len(reserving) == len(self.reserving)
        for chunk in chunked(reserving.items(), AUDIT_STEP_SLOTS):
            same = same and all(self.reserving.get(pid, 0) == i for pid, i in chunk)
            yield
        if not same:
            v.append("keyed reservations and the reserving index disagree")
        listed: set[int] = set()
        unknown = False  # an owner lists a pin that does not exist
        owned = (i for ids in self.by_owner.values() for i in ids)
        for chunk in chunked(owned, AUDIT_STEP_SLOTS):
            listed.update(chunk)
            unknown |= any(i not in self.pins for i in chunk)
            yield
        if unknown or len(listed) != len(self.pins):
            v.append(f"keyed pins listed by owners {len(listed)} != pins {len(self.pins)}")
        keys: dict[Hashable, int] = {}
        for chunk in chunked(self.pins.values(), AUDIT_STEP_SLOTS):
            for pin in chunk:
                keys[pin.owner] = keys.get(pin.owner, 0) + (
                    len(pin.pages) if pin.reserved is None else len(pin.reserved))
            yield
        if keys != self.owner_keys:
            v.append(f"keys held per owner {self.owner_keys} != recomputed {keys}")
        for chunk in chunked(self.pages.values(), AUDIT_STEP_SLOTS):
            for page in chunk:
                if page.pins != want_pins.get(id(page), 0):
                    v.append(f"keyed page {page.key!r}: pin count {page.pins}, pins account "
                             f"for {want_pins.get(id(page), 0)}")
                if page.kind == "full":
                    counts[page.ns] = counts.get(page.ns, 0) + 1
            yield
        if counts != self.ns_pages:
            v.append(f"keyed pages per namespace {self.ns_pages} != recomputed {counts}")
