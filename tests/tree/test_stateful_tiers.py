"""The memory tiers under random operation sequences, checker after every step.

A pure :class:`RadixTree` (a :class:`CollectingSink` for device pages, another for host slots)
takes inserts (with and without early SWA frees), matches, locks, both kinds of eviction, backups
(``set_host``), loads from host (``plan_load``, a pin, other operations while it is held,
``commit_load``) and fetches from L3 (``host_prefix``, a pin, ``adopt_host``), in any order. It is
driven as the daemon drives it (:class:`TwoPhaseTree`): nodes the tree names for a host copy
before eviction takes them are copied (write_back) or declined, then committed; host pages it
drops are reported to the model.

The reference model extends test_stateful.py's: one entry per cached page, keyed by the token
prefix that ends with that page, ``[full, swa, host, host_swa]`` (None, or 0, where absent). It
predicts match (``host_hit_len`` included), insert, backup, load and fetch results exactly; after
an eviction it checks that the change was legal (no locked or pinned page touched, a page with a
host copy demoted rather than deleted, a short eviction left nothing evictable) and adopts the
tree's state. Page ids of all four pools are conserved: each id ever handed out is free in the
model, owned by the tree or held by a copy in flight, never in two of these places.

Loads and fetches are rules of their own at both ends (anything may run while a path is pinned)
and also whole flows in one rule (``load``, ``fetch``: with eviction while pinned), as are a
request (``serve``) and a backup under pressure (``offload``): a flow spread over several
independent rules is rare in random sequences. Loads and fetches may aim at a page the model
knows to be loadable, or to have a host copy.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from daemon.gpu.page_runs import PageRuns
from daemon.tree import CollectingSink, EvictResult, LoadPlan, RadixTree, ReceiptError, check_tree
from daemon.tree.node import Node, Pin, Receipt
from daemon.tree.page_ids import LEAD_MIN

from .test_stateful import DOCS, NAMESPACES, CacheMachine, ModelLock, tok

F, S, H, HS = 0, 1, 2, 3  # fields of a model page: full, swa, host, host swa
KINDS = ("full", "swa", "host", "hswa")
SCOPES = st.sampled_from([None, *NAMESPACES])
FRONTIERS = st.one_of(st.just(0), st.integers(0, 9))  # eighths of the pages with SWA freed
PATH_NS = st.sampled_from([NAMESPACES[0], NAMESPACES[0], NAMESPACES[1]])
EVICT = st.one_of(st.integers(0, 3), st.just(1000))  # a few pages, or all that can go
MOSTLY = st.sampled_from([True, True, False])
AIMS = st.one_of(st.none(), st.integers(0, 63))
CUTS = st.sampled_from([0, 0, 1, 3])  # pages cut off a path's end: its prefixes meet it too


@st.composite
def sequences(draw: st.DrawFn) -> list[int]:
    """test_stateful.py's documents, shorter: paths of a few pages that share prefixes often."""
    doc = DOCS[draw(st.integers(0, 1))]
    n = draw(st.integers(1, 14))
    return doc[:n] + draw(st.lists(st.integers(20, 21), max_size=2))


def on_device(e: list) -> bool:
    return e[F] is not None


def on_host(e: list) -> bool:
    return e[H] is not None


def host_only(e: list) -> bool:
    return e[F] is None



class TwoPhaseTree(RadixTree):
    """The tree as :class:`daemon.model_cache.ModelCache` drives it: after each operation the
    nodes it named for a host copy are offered to ``copy`` and committed (repeated while the
    cleanups name more), an eviction resumes for what is missing, and dropped host pages go to
    ``dropped``."""

    copy: Callable[[Node], None]
    dropped: Callable[[Node], None]

    def _settle(self, reason: str | None = None) -> EvictResult:
        res = EvictResult()
        while self.awaiting_copy:
            for n in list(self.awaiting_copy):
                self.copy(n)
            res.add(self.commit_evictions(reason))
        for n in self.host_drops:
            self.dropped(n)
        self.release_host_drops()
        return res

    def evict(self, full_pages: int = 0, swa_pages: int = 0, reason: str = "explicit",
              namespace: str | None = None) -> EvictResult:
        res = super().evict(full_pages, swa_pages, reason, namespace)
        while self.awaiting_copy:
            res.add(self._settle(reason))
            res.add(super().evict(max(0, full_pages - res.full_pages),
                                  max(0, swa_pages - res.swa_pages), reason, namespace))
        return res

    def evict_host(self, slots: int, namespace: str | None = None, swa_slots: int = 0
                   ) -> EvictResult:
        res = super().evict_host(slots, namespace, swa_slots)
        self._settle()
        return res

    def unlock(self, receipt: Receipt) -> None:
        super().unlock(receipt)
        self._settle()

    def unpin(self, p: Pin) -> None:
        super().unpin(p)
        self._settle()


@dataclass
class Load:
    ns: str
    tokens: bytes
    plan: LoadPlan
    pin: Pin
    full: dict[int, int]  # page index -> fresh device page
    swa: dict[int, int]


@dataclass
class Fetch:
    ns: str
    tokens: bytes
    start: int
    end: int
    pin: Pin | None
    slots: dict[int, int]  # page index -> fetched host slot
    swa: dict[int, int]


class TierMachine(RuleBasedStateMachine):
    paths = Bundle("paths")  # the sequences operated on (few, so that they meet)
    receipts = Bundle("receipts")
    loads = Bundle("loads")
    fetches = Bundle("fetches")

    # model helpers shared with test_stateful.py (same page keys, the same lock shape; a page's
    # SWA id is field 1 in both models)
    keys = CacheMachine.keys
    model_lock = CacheMachine.model_lock
    lock_counts = CacheMachine.lock_counts
    node_path = CacheMachine.node_path

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        window_pages=st.sampled_from([1, 2, 3, 0]),  # 0: no SWA layers (window None)
        window_extra=st.booleans(),
        policy=st.sampled_from(["lru", "lru-depth"]),
        write_back=st.booleans(),  # evictions (and the cleanups of unlock, unpin) demote
        hash_block=st.sampled_from([1, 3, 4, 8, 64]),  # blocks ending inside short paths
        run_min=st.sampled_from([0, 2, 3]),  # 0: the default codec (no runs)
        cold_after=st.sampled_from([0, 1, 8]),  # pages of churn after which a node is cold
        idle=st.booleans(),  # the daemon idles after every step (compact_cold until done)
        swa_lead_min=st.sampled_from([1, 2, LEAD_MIN]),  # host SWA ids without leading zeros
    )
    def setup(self, page_size: int, window_pages: int, window_extra: bool, policy: str,
              write_back: bool, hash_block: int, run_min: int, cold_after: int,
              idle: bool, swa_lead_min: int) -> None:
        self.P = page_size
        self.pb = 4 * page_size
        window = None
        if window_pages:
            window = window_pages * page_size - (1 if window_extra and page_size > 1 else 0)
        self.swa_on = window is not None
        self.wp = -(-window // page_size) if window else 0
        self.sink = CollectingSink()
        self.hsink = CollectingSink()
        self.tree = TwoPhaseTree(page_size, window, self.sink, host_sink=self.hsink,
                                 policy=policy, hash_block_tokens=hash_block,
                                 page_ids=PageRuns(run_min, 2, run_min) if run_min else None)
        self.tree.compact_after = cold_after * page_size
        self.tree.swa_lead_min = swa_lead_min
        self.idle = idle
        self.tree.copy = self._demote
        self.tree.dropped = self._host_dropped
        self.tree.host_copy_hits = 0  # every node is offered; _demote declines unless write_back
        self.tree.report_host_drops = True
        self.write_back = write_back
        self.demoted: dict[tuple[str, bytes], tuple[int, int]] = {}
        self.dropped: list[tuple[str, bytes]] = []
        self.model: dict[str, dict[bytes, list]] = {ns: {} for ns in NAMESPACES}
        self.locks: dict[int, ModelLock] = {}
        self.held_receipts: dict[int, Receipt] = {}
        self.pins: dict[int, tuple[Pin, str, list[bytes], bool]] = {}  # ..., host_only
        self.pending_loads: dict[int, Load] = {}
        self.pending_fetches: dict[int, Fetch] = {}
        self.free: dict[str, set[int]] = {k: set() for k in KINDS}
        self.issued = dict.fromkeys(KINDS, 0)
        self._ids = 0

    # ------------------------------------------------------------------ pools and tier copies

    def new_id(self) -> int:
        self._ids += 1
        return self._ids

    def alloc(self, kind: str, n: int) -> list[int]:
        """``n`` page ids of a pool, reusing freed ones first (so a page the tree still holds
        and also freed would end up in two places)."""
        free = self.free[kind]
        out = sorted(free)[:n]
        free.difference_update(out)
        while len(out) < n:
            self.issued[kind] += 1
            out.append(self.issued[kind])
        return out

    def give_back(self, kind: str, pages) -> None:
        free = self.free[kind]
        for p in pages:
            assert p not in free, f"{kind} page {p} freed twice"
            free.add(p)

    def host_copy(self, n: Node, with_swa: bool = True) -> tuple[list[int], list[int]]:
        """Host slots for a node as plan_backup gives them: SWA copies only for the trailing
        window of a node whose SWA is live."""
        k = self.tree.npages(n)
        slots = self.alloc("host", k)
        swa = [0] * k
        if with_swa and n.swa is not None:
            first = max(0, k - self.wp)
            swa[first:] = self.alloc("hswa", k - first)
        return slots, swa

    def node_keys(self, n: Node) -> list[bytes]:
        """Page keys of ``n``; through its parent links, so that also of a node just dropped."""
        parts = []
        a = n
        while a.parent is not None:
            parts.append(a.tokens)
            a = a.parent
        path = b"".join(reversed(parts))
        d = len(path) // self.pb
        return [path[: (i + 1) * self.pb] for i in range(d - self.tree.npages(n), d)]

    def _demote(self, node: Node) -> None:
        """write_back: give the node (and the ancestors it needs) a host copy, so the commit
        demotes it."""
        if not self.write_back:
            return
        chain = []
        n = node
        while n.host is None:
            chain.append(n)
            n = n.parent
        for n in reversed(chain):
            slots, swa = self.host_copy(n)
            self.tree.set_host(n.id, array("i", slots), array("i", swa) if self.swa_on else None)
            for k, h, s in zip(self.node_keys(n), slots, swa, strict=True):
                self.demoted[(n.ns.name, k)] = (h, s)

    def _host_dropped(self, node: Node) -> None:
        assert node.full is None and not node.children and not node.pin and not node.host_pin
        self.dropped.extend((node.ns.name, k) for k in self.node_keys(node))

    # ------------------------------------------------------------------ model

    def ok(self) -> None:
        assert check_tree(self.tree) == []

    def has(self, pred) -> bool:
        return any(pred(e) for m in self.model.values() for e in m.values())

    def loadable(self, e: list) -> bool:
        """Whether a load could end at this page: its copy is on host, its SWA is not."""
        if not self.swa_on:
            return e[F] is None
        return not e[S] and bool(e[HS])

    def pinned(self, host_only: bool = False) -> set[tuple[str, bytes]]:
        """Pages a pin guards whole (or, ``host_only``, only their host copy)."""
        return {(ns, k) for _, ns, ks, h in self.pins.values() if h == host_only for k in ks}

    def pin(self, ns: str, node: Node, host_only: bool = False) -> Pin:
        p = self.tree.pin(node, host_only=host_only)
        self.ok()
        path = self.node_path(node.id)
        self.pins[id(p)] = (p, ns, self.keys(path), host_only)
        return p

    def unpin(self, p: Pin) -> None:
        del self.pins[id(p)]
        self.tree.unpin(p)
        self.ok()
        with pytest.raises(ReceiptError):
            self.tree.unpin(p)
        self.cleanup()

    def tree_state(self) -> dict[str, dict[bytes, list]]:
        out: dict[str, dict[bytes, list]] = {ns: {} for ns in NAMESPACES}
        pb = self.pb
        for name, ns in self.tree.namespaces.items():
            d = out.setdefault(name, {})
            stack = [(ns.root, b"")]
            while stack:
                n, pre = stack.pop()
                for c in (n.children or {}).values():
                    for i in range(len(c.tokens) // pb):
                        d[pre + c.tokens[: (i + 1) * pb]] = [
                            c.full[i] if c.full is not None else None,
                            c.swa[i] if c.swa is not None else 0,
                            c.host[i] if c.host is not None else None,
                            c.host_swa[i] if c.host_swa is not None else 0,
                        ]
                    stack.append((c, pre + c.tokens))
        return out

    def copy_model(self) -> dict[str, dict[bytes, list]]:
        return {ns: {k: list(e) for k, e in m.items()} for ns, m in self.model.items()}

    def compare(self) -> None:
        assert self.tree_state() == self.model

    def states(self, ns: str, tokens: bytes) -> list[list]:
        out = []
        for k in self.keys(tokens):
            e = self.model[ns].get(k)
            if e is None:
                break
            out.append(e)
        return out

    def usable(self, avail: list[bool]) -> int:
        """Pages of the longest prefix a match may end at, given which pages have their SWA."""
        if not self.swa_on:
            return len(avail)
        best = run = 0
        tomb = False
        for i, a in enumerate(avail, 1):
            if a:
                run += 1
                if not tomb or run >= self.wp:
                    best = i
            else:
                tomb, run = True, 0
        return best

    def host_end(self, states: list[list]) -> int:
        """The usable end with every host copy counted (what a load would make usable)."""
        return self.usable([bool(e[S] or e[HS]) for e in states])

    def expect_match(self, ns: str, tokens: bytes) -> tuple:
        states = self.states(ns, tokens)
        dev = []
        for e in states:
            if e[F] is None:
                break
            dev.append(e)
        best = self.usable([bool(e[S]) for e in dev])
        full = [e[F] for e in dev[:best]]
        swa = [e[S] for e in dev[max(0, best - self.wp) : best]] if self.swa_on else []
        host = max(0, self.host_end(states) - best)
        return best * self.P, full, swa, len(dev) * self.P, host * self.P

    def cleanup(self) -> None:
        """What an unlock or unpin does: host copies made in phase 2 (_demote) land in the
        model, then unlocked, unpinned tombstone device leaves go (demoted when they have a host
        copy)."""
        for (ns, k), (h, s) in self.demoted.items():
            e = self.model[ns][k]
            assert e[H] is None
            e[H], e[HS] = h, s
        self.demoted.clear()
        if not self.swa_on:
            return
        full_locks, _ = self.lock_counts()
        pins = self.pinned()
        pb = self.pb
        for ns, m in self.model.items():
            changed = True
            while changed:
                parents = {k[:-pb] for k, e in m.items() if e[F] is not None}
                dead = [k for k, e in m.items() if e[F] is not None and not e[S]
                        and k not in parents and not full_locks.get((ns, k))
                        and (ns, k) not in pins]
                for k in dead:
                    if m[k][H] is not None:
                        m[k][F] = None
                    else:
                        del m[k]
                changed = bool(dead)

    def adopt_eviction(self, before: dict, scope: str | None) -> None:
        """After ``evict``: every change must be legal; then the model takes the tree's state."""
        now = self.tree_state()
        full_locks, swa_locks = self.lock_counts()
        pins = self.pinned()
        for ns in NAMESPACES:
            b_m, a_m = before[ns], now[ns]
            assert set(a_m) <= set(b_m), "eviction created a page"
            if scope is not None and ns != scope:
                assert a_m == b_m, "evicted another namespace"
                continue
            for k, b in b_m.items():
                key = (ns, k)
                a = a_m.get(k)
                given = self.demoted.get(key)
                if a is None:
                    assert b[F] is not None and b[H] is None and given is None, (
                        "a page with a host copy was deleted instead of demoted")
                    assert not full_locks.get(key), "a locked page was evicted"
                    assert key not in pins, "a pinned page was evicted"
                    continue
                if given is not None:
                    assert b[H] is None and (a[H], a[HS]) == given
                else:
                    assert (a[H], a[HS]) == (b[H], b[HS]), "eviction changed a host copy"
                if a[F] != b[F]:
                    assert a[F] is None and a[H] is not None, "eviction changed a full page"
                    assert not full_locks.get(key), "a locked page was demoted"
                    assert key not in pins, "a pinned page was demoted"
                if a[S] != b[S]:
                    assert a[S] == 0, "eviction changed a live SWA page"
                    assert not swa_locks.get(key), "an SWA-locked page was tombstoned"
                    assert key not in pins, "a pinned page was tombstoned"
        self.demoted.clear()
        self.model = now

    def do_match(self, ns: str, tokens: bytes, lock: bool = False):
        exp = self.expect_match(ns, tokens)
        res = self.tree.match(ns, tokens, lock=lock)
        self.ok()
        got = (res.prefix_len, list(res.full_pages), list(res.swa_pages), res.full_hit_len,
               res.host_hit_len)
        assert got == exp
        assert self.node_path(res.node_id) == tokens[: res.prefix_len * 4]
        event(f"match: hit {exp[0] > 0}, host hit {exp[4] > 0}")
        return res

    def hold(self, ns: str, endkey: bytes, receipt: Receipt) -> int:
        rid = self.new_id()
        self.locks[rid] = self.model_lock(ns, endkey)
        self.held_receipts[rid] = receipt
        return rid

    def release(self, rid: int) -> None:
        r = self.held_receipts.pop(rid)
        del self.locks[rid]
        self.tree.unlock(r)
        self.ok()
        with pytest.raises(ReceiptError):
            self.tree.unlock(r)
        self.cleanup()

    def predict_insert(self, ns: str, tokens: bytes, prev: int, f: int, full: list[int],
                       swa: list[int]):
        """(inserted pages, overlap pages, canonical full, canonical swa, new model dict)."""
        n = len(tokens) // self.pb
        m = {k: list(e) for k, e in self.model[ns].items()}
        keys = self.keys(tokens)
        overlap = 0
        while overlap < n and m.get(keys[overlap], [None])[F] is not None:
            overlap += 1
        adopt = not self.swa_on or f < n
        cfull: list[int] = []
        cswa: list[int] = []
        i = prev
        while i < n:
            j = i - prev
            e = m.get(keys[i])
            if e is not None and e[F] is not None:
                cfull.append(e[F])
                if self.swa_on:
                    if not e[S] and swa[j]:
                        e[S] = swa[j]  # a tombstone revived by the caller's live SWA
                    cswa.append(e[S])
            elif adopt:
                if e is None:
                    e = m[keys[i]] = [None, 0, None, 0]
                e[F] = full[j]  # new, or a host-only page back on device
                e[S] = swa[j] if self.swa_on else 0
                cfull.append(full[j])
                if self.swa_on:
                    cswa.append(swa[j])
            else:
                break
            i += 1
        return i, overlap, cfull, cswa, m

    def take(self, path: tuple[str, list[int]], cut: int) -> tuple[str, bytes]:
        ns, seq = path
        return ns, tok(seq[: max(1, len(seq) - cut * self.P)])

    def aimed(self, path: tuple[str, list[int]], cut: int, aim: int | None, pred
              ) -> tuple[str, bytes]:
        """A path, or (``aim`` given) the tokens of a cached page that ``pred`` accepts."""
        if aim is not None:
            pages = sorted((ns, k) for ns, m in self.model.items() for k, e in m.items()
                           if pred(e))
            if pages:
                return pages[aim % len(pages)]
        return self.take(path, cut)

    # ------------------------------------------------------------------ rules: device

    @initialize(target=paths, ns=PATH_NS,
                seqs=st.lists(sequences(), min_size=1, max_size=3))
    def first_paths(self, ns, seqs):
        return multiple(*((ns, seq) for seq in seqs))

    @rule(target=paths, ns=PATH_NS, seq=sequences(), frontier=FRONTIERS)
    def new_path(self, ns, seq, frontier):
        """A new sequence, inserted."""
        self.insert((ns, seq), 0, frontier, False)
        return (ns, seq)

    @rule(target=receipts, path=paths, cut=CUTS, frontier=FRONTIERS, lock=st.booleans())
    def insert(self, path, cut, frontier, lock, reuse=False):
        """Insert fresh pages, with the first ``frontier``/8 of the pages' SWA already freed
        (swa_evicted_len); ``reuse``: over a locked matched prefix (prev_prefix_len), as a
        request does."""
        ns, tokens = self.take(path, cut)
        n = len(tokens) // self.pb
        prev = 0
        r0 = None
        if reuse:
            res0 = self.do_match(ns, tokens, lock=True)
            prev = res0.prefix_len // self.P
            r0 = self.hold(ns, tokens[: res0.prefix_len * 4], res0.receipt)
        f = n * frontier // 8 if self.swa_on else 0
        full = self.alloc("full", n - prev)
        swa = [0 if q < f or not self.swa_on else self.alloc("swa", 1)[0]
               for q in range(prev, n)]
        i, overlap, cfull, cswa, newm = self.predict_insert(ns, tokens, prev, f, full, swa)
        res = self.tree.insert(ns, tokens, array("i", full),
                               array("i", swa) if self.swa_on else None, prev * self.P,
                               f * self.P, lock=lock)
        self.ok()
        assert (res.prefix_len, res.inserted_len) == (overlap * self.P, i * self.P)
        assert list(res.full_pages) == cfull and list(res.swa_pages) == cswa
        assert self.node_path(res.node_id) == tokens[: i * self.pb]
        event(f"insert: host pages reloaded {any(e[F] is None for e in self.states(ns, tokens))}"
              f", partial {i < n}")
        self.model[ns] = newm
        self.give_back("full", full[i - prev :])
        self.give_back("swa", [p for p in swa[i - prev :] if p])
        rid = self.hold(ns, tokens[: i * self.pb], res.receipt) if lock else None
        if r0 is not None:
            self.release(r0)
        self.compare()
        return rid if rid is not None else multiple()

    @rule(target=receipts, path=paths, cut=CUTS, frontier=FRONTIERS, lock=st.booleans())
    def serve(self, path, cut, frontier, lock):
        """A request: match and lock, compute the rest, insert it, unlock."""
        return self.insert(path, cut, frontier, lock, reuse=True)

    @rule(target=receipts, path=paths, cut=CUTS, lock=st.booleans())
    def match(self, path, cut, lock):
        ns, tokens = self.take(path, cut)
        res = self.do_match(ns, tokens, lock)
        self.compare()
        if lock:
            return self.hold(ns, tokens[: res.prefix_len * 4], res.receipt)
        return multiple()

    @rule(rid=consumes(receipts))
    def unlock(self, rid):
        self.release(rid)
        self.compare()

    @rule(rid=receipts)
    def release_swa(self, rid):
        r = self.held_receipts[rid]
        if self.locks[rid].swa_released:
            with pytest.raises(ReceiptError):
                self.tree.release_swa(r)
            return
        self.tree.release_swa(r)
        self.ok()
        self.locks[rid].swa_released = True
        self.compare()

    @precondition(lambda self: self.has(on_device))
    @rule(full=EVICT, swa=EVICT, scope=SCOPES)
    def evict(self, full, swa, scope):
        before = self.copy_model()
        nf, ns_ = len(self.sink.full), len(self.sink.swa)
        res = self.tree.evict(full, swa, namespace=scope)
        self.ok()
        assert len(self.sink.full) - nf == res.full_pages
        assert len(self.sink.swa) - ns_ == res.swa_pages
        event(f"evict: demoted {bool(self.demoted)}, short {res.full_pages < full}")
        self.adopt_eviction(before, scope)
        full_locks, swa_locks = self.lock_counts()
        pins = self.pinned()
        for ns, m in self.model.items():
            if scope is not None and ns != scope:
                continue
            for k, e in m.items():
                held = full_locks.get((ns, k)) or (ns, k) in pins
                if res.full_pages < full and e[F] is not None:
                    assert held, "evict stopped short with an unlocked device page left"
                if res.swa_pages < swa and e[S]:
                    assert swa_locks.get((ns, k)) or (ns, k) in pins, (
                        "evict stopped short with an unlocked SWA page left")

    # ------------------------------------------------------------------ rules: host

    def set_host(self, n: Node, with_swa: bool) -> None:
        slots, swa = self.host_copy(n, with_swa)
        self.tree.set_host(n.id, array("i", slots), array("i", swa) if with_swa else None)
        self.ok()
        m = self.model[n.ns.name]
        for k, h, s in zip(self.node_keys(n), slots, swa, strict=True):
            assert m[k][H] is None
            m[k][H], m[k][HS] = h, s
        event(f"backup: pinned {n.pin > 0}, with SWA copies {any(swa)}")

    @precondition(lambda self: self.has(on_device))
    @rule(pick=st.integers(0, 63), with_swa=MOSTLY)
    def backup_node(self, pick, with_swa):
        """set_host on a device node without a host copy whose parent has one (or is the root)."""
        cands = sorted((n for n in self.tree.nodes.values() if n.parent is not None
                        and n.full is not None and n.host is None and n.parent.host is not None),
                       key=lambda n: n.id)
        if cands:
            self.set_host(cands[pick % len(cands)], with_swa)
            self.compare()

    @rule(path=paths, cut=CUTS, with_swa=MOSTLY)
    def backup_path(self, path, cut, with_swa):
        """Back up the device nodes of a sequence's path, top-down (as plan_backup's chain)."""
        ns, tokens = self.take(path, cut)
        for n, _ in self.tree.walk(ns, tokens):
            if n.full is None:
                break
            if n.host is None:
                self.set_host(n, with_swa)
        self.compare()

    @precondition(lambda self: self.has(on_device))
    @rule(path=paths, cut=CUTS, full=st.integers(0, 3), swa=st.integers(0, 3), with_swa=MOSTLY)
    def offload(self, path, cut, full, swa, with_swa):
        """Write-through backup of a path, then device pressure (SWA pressure tombstones nodes
        whose SWA was just backed up: a load revives them)."""
        self.backup_path(path, cut, with_swa)
        self.evict(full, swa, path[0])

    @precondition(lambda self: self.has(host_only))
    @rule(slots=st.integers(0, 12), swa_slots=st.integers(0, 3), scope=SCOPES)
    def evict_host(self, slots, swa_slots, scope):
        before = self.model
        nh, nhs = len(self.hsink.host), len(self.hsink.host_swa)
        res = self.tree.evict_host(slots, namespace=scope, swa_slots=swa_slots)
        self.ok()
        assert len(self.hsink.host) - nh == res.host_slots
        assert len(self.hsink.host_swa) - nhs == res.host_swa_slots
        now = self.tree_state()
        pins = self.pinned() | self.pinned(host_only=True)
        gone = []
        for ns in NAMESPACES:
            assert set(now[ns]) <= set(before[ns])
            for k, b in before[ns].items():
                a = now[ns].get(k)
                if a is None:
                    assert b[F] is None, "evict_host dropped a page on device"
                    assert (ns, k) not in pins, "evict_host dropped a pinned page"
                    assert scope in (None, ns), "evict_host dropped another namespace's page"
                    gone.append((ns, k))
                else:
                    assert a == b
        assert sorted(self.dropped) == sorted(gone), "host_dropped was not told exactly"
        self.dropped.clear()
        if res.host_slots < slots:
            for ns in NAMESPACES:
                if scope in (None, ns):
                    assert all(e[F] is not None or (ns, k) in pins
                               for k, e in now[ns].items()), "evict_host stopped short"
        elif res.host_swa_slots < swa_slots:  # no host leaf left in scope holds SWA host slots
            assert not [n for n in self.tree.nodes.values()
                        if n.parent is not None and scope in (None, n.ns.name)
                        and n.full is None and n.host is not None and not n.children
                        and not n.host_pin and not n.pin and n.host_swa is not None
                        and any(n.host_swa)], "evict_host stopped short of SWA host slots"
        event(f"evict_host: dropped {len(gone) > 0}")
        self.model = now

    @precondition(lambda self: self.has(self.loadable))
    @rule(target=loads, path=paths, cut=CUTS, aim=AIMS)
    def begin_load(self, path, cut, aim):
        """Plan a load from host, pin its path and take fresh device pages for it."""
        ns, tokens = self.aimed(path, cut, aim, self.loadable)
        probe = self.do_match(ns, tokens)
        states = self.states(ns, tokens)
        end = self.host_end(states)
        plan = self.tree.plan_load(ns, tokens, probe.prefix_len)
        self.ok()
        if end * self.P <= probe.prefix_len:
            assert plan is None
            return multiple()
        assert plan is not None and plan.end == end
        ws = max(0, end - self.wp) if self.swa_on else end
        assert plan.full == [(i, e[H]) for i, e in enumerate(states[:end]) if e[F] is None]
        assert plan.swa == [(i, e[HS]) for i, e in enumerate(states[:end])
                            if i >= ws and not e[S]]
        apath = self.node_path(plan.anchor.id)
        d1 = len(apath) // self.pb
        assert d1 - self.tree.npages(plan.anchor) < end <= d1
        assert apath[: end * self.pb] == tokens[: end * self.pb]
        pin = self.pin(ns, plan.anchor)
        fd = dict(zip((i for i, _ in plan.full), self.alloc("full", len(plan.full)), strict=True))
        sd = dict(zip((i for i, _ in plan.swa), self.alloc("swa", len(plan.swa)), strict=True))
        lid = self.new_id()
        self.pending_loads[lid] = Load(ns, tokens, plan, pin, fd, sd)
        event(f"load: full {len(plan.full) > 0}, swa {len(plan.swa) > 0}")
        return lid

    @rule(lid=consumes(loads), copied=MOSTLY)
    def finish_load(self, lid, copied):
        """Commit the load (or drop it, as after a failed copy) and unpin."""
        ld = self.pending_loads.pop(lid)
        ns, tokens, plan = ld.ns, ld.tokens, ld.plan
        if copied:
            m = {k: list(e) for k, e in self.model[ns].items()}
            keys = self.keys(tokens)
            fd, sd = dict(ld.full), dict(ld.swa)
            ws = max(0, plan.end - self.wp) if self.swa_on else plan.end
            before = [m[keys[i]][F] for i in range(plan.end)]
            loaded = 0
            for i in range(plan.end):
                e = m[keys[i]]
                if e[F] is None:
                    e[F] = fd.pop(i)
                    e[S] = sd.pop(i) if self.swa_on and i >= ws else 0
                    loaded += 1
                elif self.swa_on and i >= ws and not e[S]:
                    e[S] = sd.pop(i)
            got_f, got_s = dict(ld.full), dict(ld.swa)
            got = self.tree.commit_load(ns, tokens, plan, got_f, got_s)
            self.ok()
            assert got == loaded and (got_f, got_s) == (fd, sd)
            event(f"commit: leftover pages {bool(fd or sd)}")
            self.model[ns] = m
            self.give_back("full", got_f.values())
            self.give_back("swa", got_s.values())
            self.compare()
            res = self.do_match(ns, tokens)
            assert res.prefix_len >= plan.end * self.P
            for i in range(plan.end):
                assert res.full_pages[i] in (ld.full.get(i), before[i])
        else:
            self.give_back("full", ld.full.values())
            self.give_back("swa", ld.swa.values())
        self.unpin(ld.pin)
        self.compare()

    @precondition(lambda self: self.has(self.loadable))
    @rule(path=paths, cut=CUTS, aim=AIMS, other=paths, serve=st.booleans(), full=EVICT,
          swa=EVICT, copied=MOSTLY)
    def load(self, path, cut, aim, other, serve, full, swa, copied):
        """A whole load: while its path is pinned, maybe a request on another path, then
        eviction (pinned pages must stay); then the commit (or a failed copy's unpin)."""
        lid = self.begin_load(path, cut, aim)
        if isinstance(lid, int):
            if serve:
                self.serve(other, 0, 0, False)
            self.evict(full, swa, None)
            self.finish_load(lid, copied)

    @rule(target=fetches, path=paths, cut=CUTS, aim=AIMS,
          tail=st.lists(st.integers(20, 21), max_size=8), pages=st.integers(1, 8),
          gaps=st.sets(st.integers(0, 7), max_size=2), swa_tail=st.integers(0, 4),
          back=st.sampled_from([0, 0, 1, 2]), host_pin=st.booleans())
    def begin_fetch(self, path, cut, aim, tail, pages, gaps, swa_tail, back, host_pin):
        """What L3 returns past the host prefix: host slots for up to ``pages`` pages (``gaps``
        missing), SWA copies for the last ``swa_tail`` of them; the host prefix is pinned (its
        host copies only, as tier_jobs.begin_fetch does, when ``host_pin``). ``aim``: a cached
        page with a host copy (then ``tail`` tokens past it) instead of a path. ``back``: the
        fetch starts that many pages inside the host prefix (SWA copies missing there are
        filled in; the full slots are not needed)."""
        ns, tokens = self.aimed(path, cut, aim, on_host)
        if aim is not None:
            tokens += tok(tail)
        n = len(tokens) // self.pb
        start, last = self.tree.host_prefix(ns, tokens)
        self.ok()
        states = self.states(ns, tokens)
        exp = 0
        while exp < len(states) and states[exp][H] is not None:
            exp += 1
        assert start == exp
        pin = None
        if last is None:
            assert start == 0
        else:
            lpath = self.node_path(last.id)
            d1 = len(lpath) // self.pb
            assert d1 - self.tree.npages(last) < start <= d1
            assert lpath[: start * self.pb] == tokens[: start * self.pb]
            pin = self.pin(ns, last, host_only=host_pin)
        start = max(0, start - back)
        end = min(n, start + pages)
        idx = [i for i in range(start, end) if i - start not in gaps]
        slots = dict(zip(idx, self.alloc("host", len(idx)), strict=True))
        sidx = list(range(max(start, end - swa_tail), end)) if self.swa_on else []
        swa = dict(zip(sidx, self.alloc("hswa", len(sidx)), strict=True))
        fid = self.new_id()
        self.pending_fetches[fid] = Fetch(ns, tokens, start, end, pin, slots, swa)
        return fid

    @rule(path=paths, cut=CUTS, aim=AIMS, tail=st.lists(st.integers(20, 21), max_size=8),
          pages=st.integers(1, 8), back=st.sampled_from([0, 0, 1, 2]), host_pin=st.booleans(),
          full=EVICT, swa=EVICT)
    def fetch(self, path, cut, aim, tail, pages, back, host_pin, full, swa):
        """A whole fetch (no holes, SWA copies for the last page or two), with eviction while
        its host prefix is pinned."""
        fid = self.begin_fetch(path, cut, aim, tail, pages, set(), 2, back, host_pin)
        self.evict(full, swa, None)
        self.finish_fetch(fid, True)

    @rule(fid=consumes(fetches), copied=MOSTLY)
    def finish_fetch(self, fid, copied):
        """Attach the fetched pages (adopt_host), give back the unused slots, unpin."""
        fe = self.pending_fetches.pop(fid)
        ns, tokens, start, end = fe.ns, fe.tokens, fe.start, fe.end
        sl, sw = dict(fe.slots), dict(fe.swa)
        if copied and end > start:
            m = {k: list(e) for k, e in self.model[ns].items()}
            keys = self.keys(tokens)
            got = got_swa = 0
            i = 0
            stopped = False
            # the tree's node boundaries decide what attaches (a node gets a host copy whole)
            for _node, k in self.tree.walk(ns, tokens, end):
                es = [m[key] for key in keys[i : i + k]]
                if es[0][H] is None:
                    assert all(e[H] is None for e in es)
                    if i < start or any(j not in sl for j in range(i, i + k)):
                        stopped = True
                        break
                    for j, e in zip(range(i, i + k), es, strict=True):
                        e[H], e[HS] = sl.pop(j), sw.pop(j, 0)
                        got += 1
                        got_swa += bool(e[HS])
                elif i >= start:
                    for j, e in zip(range(i, i + k), es, strict=True):
                        if not e[HS] and j in sw:
                            e[HS] = sw.pop(j)
                            got_swa += 1
                i += k
            if not stopped and start <= i < end:
                while i < end and i in sl:
                    m[keys[i]] = [None, 0, sl.pop(i), sw.pop(i, 0)]
                    got += 1
                    got_swa += bool(m[keys[i]][HS])
                    i += 1
            gs, gw = dict(fe.slots), dict(fe.swa)
            res = self.tree.adopt_host(ns, tokens, start, end, gs, gw)
            self.ok()
            assert res == (got, got_swa) and (gs, gw) == (sl, sw)
            event(f"fetch: attached {got > 0}, stopped at a hole {stopped}")
            self.model[ns] = m
        self.give_back("host", sl.values())
        self.give_back("hswa", sw.values())
        if fe.pin is not None:
            self.unpin(fe.pin)
        self.compare()
        self.do_match(ns, tokens)  # host_hit_len now counts what was attached

    @precondition(lambda self: hasattr(self, "tree"))
    @rule(look=st.integers(1, 6), most=st.integers(1, 6))
    def compact_cold(self, look, most):
        """The daemon's idle step: no page changes place (compare, in the invariant)."""
        assert 0 <= self.tree.compact_cold(look, most) <= min(look, most)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def consistent(self):
        if not hasattr(self, "tree"):
            return
        if self.idle:
            while self.tree.compact_cold(64, 64):
                pass
        self.ok()
        for kind, freed in (("full", self.sink.full), ("swa", self.sink.swa),
                            ("host", self.hsink.host), ("hswa", self.hsink.host_swa)):
            self.give_back(kind, freed)
            freed.clear()
        kinds = {type(p).__name__ for n in self.tree.nodes.values() for p in (n.full, n.swa)
                 if p is not None and n.parent is not None}
        event(f"page id forms in the tree: {sorted(kinds)}")
        hosts = {type(n.host).__name__ for n in self.tree.nodes.values()
                 if n.host is not None and n.parent is not None}
        event(f"host slot id forms in the tree: {sorted(hosts)}")
        owned: dict[str, list[int]] = {k: [] for k in KINDS}
        for n in self.tree.nodes.values():
            if n.parent is None:
                continue
            owned["full"] += n.full or ()
            owned["swa"] += n.swa or ()
            owned["host"] += n.host or ()
            owned["hswa"] += [p for p in n.host_swa or () if p]
        for ld in self.pending_loads.values():
            owned["full"] += ld.full.values()
            owned["swa"] += ld.swa.values()
        for fe in self.pending_fetches.values():
            owned["host"] += fe.slots.values()
            owned["hswa"] += fe.swa.values()
        for kind in KINDS:
            every = owned[kind] + list(self.free[kind])
            assert len(every) == len(set(every)), f"a {kind} page is in two places"
            assert set(every) == set(range(1, self.issued[kind] + 1)), f"a {kind} page was lost"
        assert not self.demoted and not self.dropped
        self.compare()


TierMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("RADIXD_STATEFUL_EXAMPLES", "150")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestTiers = TierMachine.TestCase
