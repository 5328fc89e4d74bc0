"""The host-tier audit and the keyed store's check in bounded steps (``HostTier.audit_steps``,
``KeyedTier.check_steps``; docs/design.md section 5), against real host pools and a real keyed
store:

- on random states, with or without one planted fault, they find exactly what the audits found
  when each ran as one set-based piece (kept here as the reference), at any step size;
- random host and keyed-store changes between the steps of background passes (the L3 writer's
  reader references, a copy that fills or is abandoned, reservations, commits, pins) never make
  a pass report anything: a pass that spans one is given up (the state version sees them);
- on a large host pool no step does more than a bounded piece of the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import os
import random
import re
import time
from collections.abc import Hashable, Iterator

from hypothesis import given, settings
from hypothesis import strategies as st
from radixd_client import protocol as P

import daemon.storage.host_pool as host_pool_module
import daemon.storage.host_tier as host_tier_module
import daemon.storage.keyed_audit as keyed_audit_module
import daemon.storage.keyed_pages as keyed_pages_module
from daemon.app import build_service
from daemon.checker import Checker
from daemon.config import CheckerConfig, Config
from daemon.entities import Peer
from daemon.gpu.profile import ModelProfile
from daemon.keyed_tier import KeyedTier
from daemon.model_cache import ModelCache
from daemon.service import Service
from daemon.storage.host_pool import HASH_BYTES, HostPool
from daemon.storage.host_tier import HostTier
from tests.test_checker_steps import interleave

PROFILE = ModelProfile(name="tiny", page_size=4, sliding_window=8, num_full_layers=1,
                       num_swa_layers=1, num_kv_heads=1, head_dim=512, dtype="float32",
                       device="cpu", full_pages=8, swa_pages=8)
OWNERS = ("s1", "s2")
NS = {"s1": "a", "s2": "b"}


@contextlib.contextmanager
def step_size(n: int) -> Iterator[None]:
    """Audit steps of ``n`` slots (the daemon's is AUDIT_STEP_SLOTS): small pools then still
    span many steps, and every chunk boundary is crossed."""
    modules = (host_pool_module, host_tier_module, keyed_pages_module, keyed_audit_module)
    saved = [m.AUDIT_STEP_SLOTS for m in modules]
    for m in modules:
        m.AUDIT_STEP_SLOTS = n
    try:
        yield
    finally:
        for m, was in zip(modules, saved, strict=True):
            m.AUDIT_STEP_SLOTS = was


# -- the reference: the audits as they were before they were stepped (one set-based piece) ----


def ref_pool_audit(p: HostPool) -> list[str]:
    name = f"{p.model} {p.kind} host pool"
    v: list[str] = list(p.allocator.audit())
    for page_hash, slot in p._slot_of.items():
        if not isinstance(page_hash, bytes) or len(page_hash) != HASH_BYTES:
            v.append(f"{name}: index key {page_hash!r} is not a {HASH_BYTES}-byte hash")
        if p._hash_of.get(slot) != page_hash:
            v.append(f"{name}: hash {page_hash.hex()[:16]}... maps to slot {slot}, "
                     f"which is recorded for another hash")
    if len(set(p._slot_of.values())) != len(p._slot_of):
        v.append(f"{name}: a slot is indexed under two hashes")
    for slot, page_hash in p._hash_of.items():
        if p._slot_of.get(page_hash) != slot:
            v.append(f"{name}: slot {slot} records a hash the index does not map to it")
    counts = dict(p.reference_counts())
    unheld = sorted(set(p._hash_of) - set(counts))
    if unheld:
        v.append(f"{name}: slots {unheld[:10]} record a hash but are not held")
    if p._refs[0] > 0:
        v.append(f"{name}: slot 0 (reserved) has {int(p._refs[0])} references")
    negative = [s for s in range(p.capacity) if p._refs[s] < 0]
    if negative:
        v.append(f"{name}: slots {negative[:10]} have a negative reference count")
    free = p.allocator.free_set()
    both = sorted(free & set(counts))
    if both:
        v.append(f"{name}: slots {both[:10]} are both free and held")
    allocated = set(range(1, p.capacity)) - free
    lost = sorted(allocated - set(counts))
    if lost:
        v.append(f"{name}: slots {lost[:10]} are allocated but hold no reference (leak)")
    return v


def ref_host_audit(host: HostTier, in_tree: dict[str, set[int]]) -> list[str]:
    v: list[str] = []
    for kind, pool in (("full", host.full), ("swa", host.swa)):
        if pool is None:
            if in_tree.get(kind):
                v.append(f"{kind} host slots in the tree but no {kind} host pool")
            continue
        v += ref_pool_audit(pool)
        held = pool.held()
        tree = in_tree.get(kind, set())
        pend = host.pending[kind]
        readers = host.readers[kind]
        keyed = host.keyed[kind]
        for s in held:
            want = (s in tree) + (s in pend) + readers.get(s, 0) + (s in keyed)
            if pool.refcount(s) != want:
                v.append(f"{kind} host slot {s}: {pool.refcount(s)} references, the tree, "
                         f"copies and readers account for {want}")
                break
        named = tree & set(pool.slot_hashes())
        if named:
            v.append(f"{kind} host slots {sorted(named)[:10]} are in the tree and indexed "
                     "under a hash (only keyed pages are)")
        if tree & pend:
            v.append(f"{kind} host slots {sorted(tree & pend)[:10]} are in the tree and "
                     "pending a copy")
        if kind == "full" and sum(host.pending_full.values()) != len(pend):
            v.append(f"pending full host slots {len(pend)} != those of the namespaces "
                     f"{host.pending_full}")
        if keyed & (tree | pend):
            v.append(f"{kind} host slots {sorted(keyed & (tree | pend))[:10]} are keyed "
                     "and in the tree or pending")
        orphans = host.orphans[kind]
        wrong = {s for s in orphans if s not in readers} | {
            s for s, n in readers.items() if (pool.refcount(s) == n) != (s in orphans)}
        if wrong:
            v.append(f"{kind} host slots {sorted(wrong)[:10]}: counted as orphans (only "
                     "readers hold them) or not, wrongly")
        if held != tree | pend | set(readers) | keyed:
            v.append(f"{kind} host pool: held {len(held)} != tree {len(tree)} + pending "
                     f"{len(pend)} + read {len(readers)} + keyed {len(keyed)}; unaccounted "
                     f"{sorted(held ^ (tree | pend | set(readers) | keyed))[:10]}")
    return v


def ref_pages_audit(kp: keyed_pages_module.KeyedPages, live_owners: set[Hashable]) -> list[str]:
    v: list[str] = []
    for kind, order in kp.order.items():
        mine = {pid for pid in kp.pages if pid[1] == kind}
        if set(order) != mine:
            v.append(f"keyed {kind}: recency order and pages disagree on "
                     f"{sorted(set(order) ^ mine)[:5]}")
    for pid, page in kp.pages.items():
        if pid != (page.ns, page.kind, page.key):
            v.append(f"keyed page {pid!r} is indexed under another key")
    want_pins: dict[int, int] = {}
    reserving: dict = {}
    counts: dict[str, int] = {}
    for pin_id, pin in kp.pins.items():
        if pin.id != pin_id:
            v.append(f"keyed pin {pin_id} records id {pin.id}")
        if pin.owner not in live_owners:
            v.append(f"keyed pin {pin_id} belongs to {pin.owner!r}, which is gone")
        if pin_id not in kp.by_owner.get(pin.owner, ()):
            v.append(f"keyed pin {pin_id} is not listed for its owner")
        if pin.reserved is None:
            for p in pin.pages:
                if kp.pages.get((p.ns, p.kind, p.key)) is not p:
                    v.append(f"keyed pin {pin_id} pins a page that is not stored")
                want_pins[id(p)] = want_pins.get(id(p), 0) + 1
        else:
            for key in pin.reserved:
                pid = (pin.ns, pin.kind, key)
                if pid in reserving or pid in kp.pages:
                    v.append(f"keyed key {key!r} is reserved twice or reserved and stored")
                reserving[pid] = pin_id
                if pin.kind == "full":
                    counts[pin.ns] = counts.get(pin.ns, 0) + 1
    if reserving != kp.reserving:
        v.append("keyed reservations and the reserving index disagree")
    listed = {i for ids in kp.by_owner.values() for i in ids}
    if listed != set(kp.pins):
        v.append(f"keyed pins listed by owners {len(listed)} != pins {len(kp.pins)}")
    keys: dict[Hashable, int] = {}
    for pin in kp.pins.values():
        keys[pin.owner] = keys.get(pin.owner, 0) + (
            len(pin.pages) if pin.reserved is None else len(pin.reserved))
    if keys != kp.owner_keys:
        v.append(f"keys held per owner {kp.owner_keys} != recomputed {keys}")
    for page in kp.pages.values():
        if page.pins != want_pins.get(id(page), 0):
            v.append(f"keyed page {page.key!r}: pin count {page.pins}, pins account for "
                     f"{want_pins.get(id(page), 0)}")
        if page.kind == "full":
            counts[page.ns] = counts.get(page.ns, 0) + 1
    if counts != kp.ns_pages:
        v.append(f"keyed pages per namespace {kp.ns_pages} != recomputed {counts}")
    return v


def ref_keyed_check(kv: KeyedTier, live_owners: set[Hashable]) -> list[str]:
    v = ref_pages_audit(kv.pages, live_owners)
    for kind in ("full", "swa"):
        pool = kv.host.full if kind == "full" else kv.host.swa
        stored = [p.slot for p in kv.pages.pages.values() if p.kind == kind]
        reserved = [s for pin in kv.pages.pins.values()
                    if pin.kind == kind and pin.reserved is not None
                    for s, _ in pin.reserved.values()]
        if pool is None:
            if stored or reserved:
                v.append(f"keyed {kind} pages but no {kind} host pool")
            continue
        mine = set(stored) | set(reserved)
        if len(mine) != len(stored) + len(reserved):
            v.append(f"keyed {kind}: a host slot is held by two keyed pages or reservations")
        if mine != kv.host.keyed[kind]:
            v.append(f"keyed {kind}: slots {sorted(mine ^ kv.host.keyed[kind])[:10]} "
                     "disagree with the host tier's keyed set")
        held = pool.held()
        if mine - held:
            v.append(f"keyed {kind}: slots {sorted(mine - held)[:10]} are free in the pool")
        others = held - mine
        if pool.available + len(others) + len(stored) + len(reserved) != pool.usable:
            v.append(f"keyed {kind}: free {pool.available} + tree and copies {len(others)} "
                     f"+ keyed {len(stored)} + reserved {len(reserved)} != capacity "
                     f"{pool.usable}")
        for page in kv.pages.pages.values():
            if page.kind == kind and pool.hash_of(page.slot) != page.hash:
                v.append(f"keyed page {page.key!r}: slot {page.slot} holds another hash")
                break
        by_ns: dict[str, list[int]] = {}
        for page in kv.pages.pages.values():
            if page.kind == kind:
                by_ns.setdefault(page.ns, []).append(page.slot)
        for pin in kv.pages.pins.values():
            if pin.kind == kind and pin.reserved is not None:
                by_ns.setdefault(pin.ns, []).extend(s for s, _ in pin.reserved.values())
        for ns, slots in by_ns.items():
            v += kv.host.audit_owners(kind, slots, ns, f"keyed {kind} slots")
    return v


def normal(v: list[str]) -> list[str]:
    """Which miscounted slot is named first depends on the order a set or a dict is walked in:
    that one finding is compared by its pool kind only."""
    return [re.sub(r"^(\w+) host slot \d+: \d+ references.*", r"\1 host slot miscounted", x)
            for x in v]


# -- random states, with or without a planted fault --------------------------------------------


class Store:
    """A keyed store and a host tier over real host pools, plus the tree's side of the host
    tier as the tiers drive it (a copy's slots pending, then the tree's; the L3 writer's reader
    references)."""

    def __init__(self, segment: int | None, seed: int) -> None:
        self.rng = random.Random(seed)
        self.cache = ModelCache(PROFILE)
        self.host = HostTier(PROFILE, 13, 7, pin_memory=False, segment_pages=segment)
        self.cache.host = self.host
        self.kv = KeyedTier(self.cache, self.host, {"a": 6}, "tiny")
        self.tree: dict[str, set[int]] = {"full": set(), "swa": set()}
        self.pins: list[tuple[str, int, bool]] = []  # (owner, pin, is a reservation)
        self.copying: dict[tuple[str, int], str] = {}  # pending (kind, slot) -> namespace
        self.n = 0

    def _hash(self) -> bytes:
        self.n += 1
        return hashlib.sha256(b"page %d" % self.n).digest()

    def step(self) -> None:
        rng, kv, host = self.rng, self.kv, self.host
        owner = rng.choice(OWNERS)
        ns, kind = NS[owner], rng.choice(("full", "swa"))
        keys = [b"k%d" % rng.randrange(12) for _ in range(rng.randint(1, 4))]
        op = rng.choice(("reserve", "reserve", "lookup", "end", "end", "copy", "copy",
                         "filled", "read", "unread", "drop", "clear"))
        if op == "reserve":
            r = kv.reserve(owner, ns, kind, list(dict.fromkeys(keys)), 64)
            if r.pin:
                self.pins.append((owner, r.pin, True))
        elif op == "lookup":
            r2 = kv.lookup(owner, ns, kind, keys, True, 64)
            if r2.pin:
                self.pins.append((owner, r2.pin, False))
        elif op == "end" and self.pins:
            o, pin, reservation = self.pins.pop(rng.randrange(len(self.pins)))
            if reservation and rng.random() < 0.7:
                kv.commit(o, pin)
            else:
                kv.release(o, pin)
        elif op == "copy" and host.available_to(kind, ns) > 1:
            self.copying.update(((kind, s), ns) for s in host.take(kind, rng.randint(1, 2), ns))
        elif op == "filled" and host.pending[kind]:
            s = rng.choice(sorted(host.pending[kind]))
            host.filled(kind, [s], self.copying.pop((kind, s)))
            self.tree[kind].add(s)  # the tree adopts the copy
        elif op == "read" and self.tree[kind]:
            host.hold(kind, [rng.choice(sorted(self.tree[kind]))])
        elif op == "unread" and host.readers[kind]:
            host.unhold(kind, [rng.choice(sorted(host.readers[kind]))])
        elif op == "drop" and self.tree[kind]:
            s = rng.choice(sorted(self.tree[kind]))
            self.tree[kind].discard(s)
            host.drop(kind, [s])
        elif op == "clear":
            kv.clear(ns)

    def plant(self, fault: str) -> bool:
        """One fault of the given kind; False where the state offers nothing to plant it on."""
        rng, host, kp = self.rng, self.host, self.kv.pages
        kind = rng.choice(("full", "swa"))
        pool = host.pool(kind)
        held = sorted(pool.held())
        pages = list(kp.pages.values())
        if fault == "refcount" and held:
            pool._refs[rng.choice(held)] += rng.choice((1, -1))
        elif fault == "index" and len(held) > 1 and pool.slot_hashes():
            a = rng.choice(sorted(pool.slot_hashes()))
            pool._slot_of[pool._hash_of[a]] = rng.choice([x for x in held if x != a])
        elif fault == "tree_named" and self.tree[kind]:
            s, h = rng.choice(sorted(self.tree[kind])), self._hash()
            pool._hash_of[s], pool._slot_of[h] = h, s
        elif fault == "hash_unheld" and len(held) < pool.capacity - 1:
            s, h = next(x for x in range(1, pool.capacity) if x not in held), self._hash()
            pool._hash_of[s], pool._slot_of[h] = h, s
        elif fault == "free_and_held" and held:
            pool.allocator.free([rng.choice(held)])
        elif fault == "leak" and pool.available_to(space := host.space(rng.choice("ab"))):
            pool.allocator.alloc(1, space)
        elif fault == "double_index" and held:
            pool._slot_of[self._hash()] = rng.choice(held)
        elif fault == "reader" and held:
            host.readers[kind][rng.choice(held)] += 1
        elif fault == "orphan" and held:  # a slot its page still holds, counted as read only
            host.orphans[kind].symmetric_difference_update({rng.choice(held)})
        elif fault == "tree_and_pending" and host.pending[kind]:
            self.tree[kind].add(rng.choice(sorted(host.pending[kind])))
        elif fault == "tree_lost" and self.tree[kind]:
            self.tree[kind].discard(rng.choice(sorted(self.tree[kind])))
        elif fault == "tree_free_slot":
            self.tree[kind].add(rng.choice([s for s in range(1, pool.capacity)
                                            if s not in held] or [pool.capacity + 3]))
        elif fault == "keyed_set" and held:
            host.keyed[kind].symmetric_difference_update({rng.choice(held)})
        elif fault == "page_pins" and pages:
            rng.choice(pages).pins += 1
        elif fault == "page_slot" and pages:
            page = rng.choice(pages)
            others = [x for x in sorted(host.pool(page.kind).held()) if x != page.slot]
            if not others:
                return False
            page.slot = rng.choice(others)
        elif fault == "page_hash" and pages:
            rng.choice(pages).hash = self._hash()
        elif fault == "order" and pages:
            p = rng.choice(pages)
            del kp.order[p.kind][(p.ns, p.kind, p.key)]
        elif fault == "ns_count":
            kp.ns_pages["a"] = kp.ns_pages.get("a", 0) + 1
        elif fault == "pin_owner" and kp.pins:
            rng.choice(list(kp.pins.values())).owner = "gone"
        elif fault == "by_owner" and kp.by_owner:
            ids = kp.by_owner[rng.choice(sorted(kp.by_owner))]
            ids.discard(next(iter(ids)))
        elif fault == "reserving" and kp.reserving:
            del kp.reserving[next(iter(kp.reserving))]
        elif fault == "owner_keys" and kp.owner_keys:
            kp.owner_keys[next(iter(kp.owner_keys))] += 1
        elif fault == "pending_ns":
            self.host.pending_full["a"] = self.host.pending_full.get("a", 0) + 1
        else:
            return False
        return True

    def audits(self) -> list[str]:
        return self.host.audit(self.tree) + self.kv.check(set(OWNERS))

    def expected(self) -> list[str]:
        return ref_host_audit(self.host, self.tree) + ref_keyed_check(self.kv, set(OWNERS))


FAULTS = ["refcount", "index", "tree_named", "hash_unheld", "free_and_held", "leak",
          "double_index", "reader", "orphan",
          "tree_and_pending", "tree_lost", "tree_free_slot", "keyed_set", "page_pins",
          "page_slot", "page_hash", "order", "ns_count", "pin_owner", "by_owner", "reserving",
          "owner_keys", "pending_ns"]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ops=st.integers(0, 60),
       segment=st.sampled_from([None, 1, 2, 3]), step=st.sampled_from([1, 2, 3, 256]),
       fault=st.sampled_from([None, *FAULTS]))
def test_the_stepped_audits_find_what_the_set_based_ones_found(
        seed: int, ops: int, segment: int | None, step: int, fault: str | None) -> None:
    """Whatever the state and the step size, the stepped audits report the same findings, in
    the same order, as the reference; a planted fault is found by both."""
    store = Store(segment, seed)
    try:
        for _ in range(ops):
            store.step()
        planted = fault is not None and store.plant(fault)
        with step_size(step):
            got = store.audits()
        want = store.expected()
        assert normal(got) == normal(want)
        assert bool(got) == planted, (fault, got)
    finally:
        store.host.close()


def test_a_stepped_audit_yields_every_few_slots() -> None:
    """The steps are bounded: the host audit of a pool of n used slots takes about n / step
    steps per pass over them, and the keyed check likewise (a single step each before)."""
    store = Store(None, 1)
    try:
        r = store.kv.reserve("s2", "b", "full", [b"x%d" % i for i in range(12)], 64)
        store.kv.commit("s2", r.pin)
        with step_size(2):
            v: list[str] = []
            host_steps = sum(1 for _ in store.host.audit_steps(store.tree, v))
            keyed_steps = sum(1 for _ in store.kv.check_steps(set(OWNERS), v))
        assert v == []
        assert store.host.full.used == 12
        assert host_steps >= 4 * 12 // 2  # index, reverse index, references, tree and keyed
        assert keyed_steps >= 2 * 12 // 2  # the store's bookkeeping, the slots
    finally:
        store.host.close()


# -- a large host pool: how long a step is ------------------------------------------------------


def _keyed_service(host_pages: int, segment: int = 0) -> Service:
    model = {"name": "m", "page_size": 4, "sliding_window": 8, "num_full_layers": 1,
             "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "float32",
             "device": "cpu", "full_pages": 64, "swa_pages": 64, "host_pages": host_pages,
             "host_swa_pages": 16, "memory_isolation": "segments" if segment else "none",
             "host_segment_pages": segment}
    return build_service(Config(models=[model]), create_pools=True)


def _session(svc: Service) -> object:
    return svc.open_session(svc.authenticate(None, Peer(0, os.getuid(), os.getgid())), Peer())


def test_no_step_of_a_pass_over_a_large_host_pool_is_long() -> None:
    """20,000 keyed pages fill the host pool: the longest step of the stepped pass (CPU time,
    the collector off) is a small part of the whole pass; when the host audit and the keyed
    check were one step each, the longest step was about half of it."""
    svc = _keyed_service(20_001)
    try:
        s = _session(svc)
        r = svc.kv_reserve(s, P.KvReserve(model="m", keys=[b"k%d" % i for i in range(20_000)]))
        svc.kv_commit(s, P.KvCommit(model="m", pin=r.pin))
        gc.collect()
        gc.disable()
        try:
            steps: list[float] = []
            v: list[str] = []
            gen = svc.check_steps(v)
            while True:
                t = time.thread_time()
                try:
                    next(gen)
                except StopIteration:
                    break
                finally:
                    steps.append(time.thread_time() - t)
        finally:
            gc.enable()
        assert v == []
        total = sum(steps)
        assert len(steps) > 4 * 20_000 // host_pool_module.AUDIT_STEP_SLOTS
        assert max(steps) < total / 20, (max(steps), total)
    finally:
        svc.close()


# -- changes between the steps of background passes ---------------------------------------------


class Traffic:
    """Random keyed-store requests through the service, and the host tier's own changes as the
    tiers make them outside any request: a copy's slots taken, then filled and handed over, or
    abandoned; the L3 writer's reader references on keyed slots."""

    #: the changes the tiers make outside requests (no request count moves)
    INTERNAL = ("copy", "copy_done", "copy_done", "copy_abandon", "read", "read", "unread",
                "unread")

    def __init__(self, svc: Service, seed: int, internal: float = 0.0) -> None:
        """``internal``: the share of changes drawn from :data:`INTERNAL` alone."""
        self.svc = svc
        self.rng = random.Random(seed)
        self.internal = internal
        self.entry = svc.models["m"]
        self.sessions = [_session(svc) for _ in range(2)]
        self.pins: list[tuple[object, int, bool]] = []
        self.copies: list[tuple[str, int]] = []

    def step(self) -> None:
        rng, svc = self.rng, self.svc
        host = self.entry.cache.host
        kv = self.entry.keyed
        assert host is not None and kv is not None
        s = rng.choice(self.sessions)
        kind = rng.choice(("full", "swa"))
        keys = list(dict.fromkeys(b"k%d" % rng.randrange(40) for _ in range(rng.randint(1, 5))))
        op = rng.choice(self.INTERNAL if rng.random() < self.internal else (
            "reserve", "reserve", "lookup", "lookup_pin", "end", "end", "copy", "copy_done",
            "copy_abandon", "read", "unread", "clear", "reconnect"))
        try:
            if op == "reserve":
                r = svc.kv_reserve(s, P.KvReserve(model="m", pool=kind, keys=keys))
                if r.pin:
                    self.pins.append((s, r.pin, True))
            elif op in ("lookup", "lookup_pin"):
                r2 = svc.kv_lookup(s, P.KvLookup(model="m", pool=kind, keys=keys,
                                                 pin=op == "lookup_pin"))
                if r2.pin:
                    self.pins.append((s, r2.pin, False))
            elif op == "end" and self.pins:
                s2, pin, reservation = self.pins.pop(rng.randrange(len(self.pins)))
                if reservation and rng.random() < 0.7:
                    svc.kv_commit(s2, P.KvCommit(model="m", pin=pin))
                else:
                    svc.kv_release(s2, P.KvRelease(model="m", pin=pin))
            elif op == "copy" and host.available_to(kind, "") > 2:
                self.copies.append((kind, host.take(kind, 1, "")[0]))
            elif op == "copy_done" and self.copies:
                # the copy is done and its slot handed to a reader (as a tree would adopt
                # it), in one go: the pool's free count does not move
                k, slot = self.copies.pop(rng.randrange(len(self.copies)))
                host.filled(k, [slot], "")
                assert host.hold(k, [slot]) == [slot]
                host.drop(k, [slot])
            elif op == "copy_abandon" and self.copies:
                k, slot = self.copies.pop(rng.randrange(len(self.copies)))
                host.drop(k, [slot], "")
            elif op == "read" and kv.host.keyed[kind]:
                host.hold(kind, [rng.choice(sorted(kv.host.keyed[kind]))])
            elif op == "unread" and host.readers[kind]:
                host.unhold(kind, [rng.choice(sorted(host.readers[kind]))])
            elif op == "clear":
                svc.kv_clear(s, P.KvClear(model="m"))
            elif op == "reconnect":
                i = self.sessions.index(s)
                svc.close_session(s)
                self.pins = [p for p in self.pins if p[0] is not s]
                self.sessions[i] = _session(svc)
        except Exception as exc:  # noqa: BLE001 - a full pool is a refusal, nothing else is
            assert getattr(exc, "code", None) == "out_of_memory", exc


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ops=st.integers(1, 80),
       gaps=st.lists(st.integers(0, 200), min_size=1, max_size=6),
       step=st.sampled_from([1, 3]))
def test_host_and_keyed_changes_between_steps_never_make_a_finding(
        seed: int, ops: int, gaps: list[int], step: int) -> None:
    """Changes between two slices of a pass, in the host audit or the keyed check, never reach
    the confirming complete check: the pass notices them and is given up (``unconfirmed`` and
    the results stay empty), and the complete check agrees at the end."""
    svc = _keyed_service(24)
    try:
        traffic = Traffic(svc, seed)
        for _ in range(20):  # a store with pages, pins and copies to walk over
            traffic.step()
        with step_size(step):
            checker = asyncio.run(interleave(svc, traffic.step, ops, gaps))
        assert checker.passes.unconfirmed == 0
        assert checker.passes.done >= 1
        assert svc.check() == []
    finally:
        svc.close()


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_change_after_any_step_of_a_pass_gives_it_up_or_changes_nothing(seed: int) -> None:
    """For every step of a pass, one random change (mostly the tiers' own: copies, reader
    references) made right after that step: the pass is given up, or ends with nothing found;
    the complete check never has a finding to refute (``unconfirmed`` stays 0). Unlike random
    gaps, this reaches the few steps in which the host audit walks the pending and reader
    sets."""
    svc = _keyed_service(24)
    try:
        traffic = Traffic(svc, seed)
        for _ in range(30):
            traffic.step()
        traffic.internal = 0.8
        k = 0
        with step_size(1):
            while True:
                steps = 0

                def pending(at: int = k) -> bool:
                    nonlocal steps
                    steps += 1
                    if steps == at:
                        traffic.step()
                    return True  # one step a slice: the version is compared after each

                # share 1: no pause between slices (nothing else runs on this loop)
                checker = Checker(svc, CheckerConfig(slice_ms=0.001, share=1.0, strict=True))
                checker.bind(ops=lambda: 0, stop=lambda code: None, pending=pending)
                result = asyncio.run(checker.run_stepped())
                assert not result, (k, result)
                assert checker.passes.unconfirmed == 0, k
                if steps < k:  # the pass ended before step k: every step had its change
                    break
                k += 1
        assert k > 20  # (a pass over this state is that long, at one slot a step)
        assert svc.check() == []
    finally:
        svc.close()


def test_the_state_version_moves_with_host_changes_no_request_counts() -> None:
    """A copy filled and handed over, a reader reference on a keyed slot taken or dropped, a
    keyed page removed outside a request: none changes a pool's free count or a request count,
    and each must still move the version, or a pass spanning it would read a host pool that
    changed under it."""
    svc = _keyed_service(24)
    try:
        s = _session(svc)
        entry = svc.models["m"]
        host, kv = entry.cache.host, entry.keyed
        assert host is not None and kv is not None
        r = svc.kv_reserve(s, P.KvReserve(model="m", keys=[b"a", b"b"]))
        svc.kv_commit(s, P.KvCommit(model="m", pin=r.pin))
        slot = host.take("full", 1, "")[0]
        keyed_slot = next(iter(host.keyed["full"]))

        def moved(change) -> bool:
            before = svc.state_version()
            change()
            return svc.state_version() != before

        def copy_done() -> None:
            host.filled("full", [slot], "")
            host.hold("full", [slot])
            host.drop("full", [slot])

        assert moved(copy_done)
        assert moved(lambda: host.hold("full", [keyed_slot]))
        assert moved(lambda: host.unhold("full", [keyed_slot]))
        page = kv.pages.get("default", "full", b"a") or next(iter(kv.pages.pages.values()))
        assert moved(lambda: kv.pages.remove(page) or kv.pages.add_stored(
            page.ns, page.kind, page.key, page.slot, page.hash, page.stamp))
        before = svc.state_version()
        kv.pages.touch(page, 7)  # a hit reorders, the audit does not walk the order: no move
        assert svc.state_version() == before
        host.unhold("full", [slot])
        assert svc.check() == []
    finally:
        svc.close()


def test_a_fault_planted_in_the_host_pool_between_steps_is_found_and_confirmed() -> None:
    """A reference no one accounts for, planted between two slices of a pass (nothing the
    version sees changes), is found by a pass and confirmed by the complete check."""
    svc = _keyed_service(24)
    try:
        s = _session(svc)
        r = svc.kv_reserve(s, P.KvReserve(model="m", keys=[b"k%d" % i for i in range(10)]))
        svc.kv_commit(s, P.KvCommit(model="m", pin=r.pin))
        host = svc.models["m"].cache.host
        assert host is not None

        async def run() -> tuple[list[str] | None, list[str] | None]:
            checker = Checker(svc, CheckerConfig(slice_ms=0.001))
            checker.bind(ops=lambda: 0, stop=lambda code: None, pending=lambda: True)
            first = asyncio.ensure_future(checker.run_stepped())
            for _ in range(5):
                await asyncio.sleep(0)
            slot = next(iter(host.keyed["full"]))
            host.full._refs[slot] += 1  # the fault: a lost release
            return await first, await checker.run_stepped()

        with step_size(2):
            _, second = asyncio.run(run())
        assert second and any("references, the tree, copies and readers account for" in x
                              for x in second), second
        assert svc.check() == second
    finally:
        svc.close()

