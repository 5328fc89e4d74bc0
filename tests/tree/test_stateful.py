"""Random operation sequences against a page-level reference model, checker after every step.

The model keeps, per namespace, one entry per cached page keyed by the token prefix that ends
with that page: ``[full page id, swa page id or 0 for a tombstone]``. It predicts match and
insert results exactly. Eviction choices are the tree's business, so after an evicting operation
the model adopts the tree's state, but only after checking the change was legal: pages only
disappear or lose their SWA, never a locked one, and every page freed is really free.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

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

from daemon.gpu.allocator import OutOfPages
from daemon.gpu.page_runs import RUN_MIN, PageRuns
from daemon.gpu.profile import ModelProfile
from daemon.model_cache import ModelCache, PageNotHeld
from daemon.tree import BadArgument, NodeNotUsable, ReceiptError, UnknownNode

NAMESPACES = ("alpha", "beta")
OWNERS = (1, 2, 3)


def tok(ids: list[int]) -> bytes:
    return array("i", ids).tobytes()


# sequences share long prefixes: a prefix of one of a few documents, then maybe a private tail
DOCS = [[(d * 7 + i * 3) % 11 + 1 for i in range(40)] for d in range(3)]


@st.composite
def sequences(draw: st.DrawFn) -> list[int]:
    doc = DOCS[draw(st.integers(0, len(DOCS) - 1))]
    n = draw(st.integers(1, len(doc)))
    tail = draw(st.lists(st.integers(20, 23), max_size=4))
    return doc[:n] + tail


@dataclass
class ModelLock:
    ns: str
    full: list[bytes]  # keys of the full-locked pages
    swa: list[bytes]  # keys of the SWA-locked pages
    swa_released: bool = False


@dataclass
class Request:
    owner: int
    ns: str
    tokens: bytes
    prev: int  # tokens the tree owns (prev_prefix_len)
    rid: int | None
    full: list[int] = field(default_factory=list)  # pages [prev, ceil(len / P))
    swa: list[int] = field(default_factory=list)
    frontier: int = 0  # swa_evicted_len in tokens


class CacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")
    receipts = Bundle("receipts")
    nodes = Bundle("nodes")

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        window_pages=st.integers(1, 3),
        window_extra=st.booleans(),
        full_cap=st.integers(12, 96),
        swa_ratio=st.sampled_from([0.5, 1.0]),
        segment_pages=st.sampled_from([None, 3, 8]),
        # blocks of the hash chain that end inside (and across) the short sequences drawn here
        hash_block=st.sampled_from([1, 3, 4, 8, 64]),
        # nodes keep runs of ids as ranges from this many ids (the daemon's RUN_MIN is more
        # than these sequences have pages)
        run_min=st.sampled_from([2, 3, RUN_MIN]),
        cold_after=st.sampled_from([0, 1, 8]),  # pages of churn after which a node is cold
        idle=st.booleans(),  # the daemon idles after every step (compact_cold until done)
    )
    def setup(self, page_size: int, window_pages: int, window_extra: bool, full_cap: int,
              swa_ratio: float, segment_pages: int | None, hash_block: int,
              run_min: int, cold_after: int, idle: bool) -> None:
        self.P = page_size
        window = window_pages * page_size - (1 if window_extra and page_size > 1 else 0)
        self.wp = -(-window // page_size)
        profile = ModelProfile(
            name="m", page_size=page_size, num_full_layers=1, num_kv_heads=1, head_dim=1,
            full_pages=full_cap, sliding_window=window, num_swa_layers=1,
            swa_pages=max(2, int(full_cap * swa_ratio)), dtype="float32", device="cpu")
        # segment_pages: memory isolation (pages of a namespace from its own segments, checked
        # by ModelCache.check), or None, one shared pool
        self.cache = ModelCache(profile, segment_pages=segment_pages,
                                hash_block_tokens=hash_block)
        self.tree = self.cache.tree
        self.tree.page_ids = PageRuns(run_min, 2, run_min)  # runs from 2 ids each on average
        self.tree.compact_after = cold_after * page_size
        self.idle = idle
        self.model: dict[str, dict[bytes, list[int]]] = {ns: {} for ns in NAMESPACES}
        self.locks: dict[int, ModelLock] = {}
        self.live_requests: dict[int, Request] = {}
        self._req_id = 0

    # ------------------------------------------------------------------ model helpers

    def keys(self, tokens: bytes) -> list[bytes]:
        pb = self.P * 4
        return [tokens[: (i + 1) * pb] for i in range(len(tokens) // pb)]

    def model_match(self, ns: str, tokens: bytes) -> tuple[int, list[int], list[int], int]:
        states = []
        for k in self.keys(tokens):
            e = self.model[ns].get(k)
            if e is None:
                break
            states.append(e)
        best = 0
        for kk in range(len(states), 0, -1):
            window = states[max(0, kk - self.wp) : kk]
            if all(s[1] for s in window) and (kk >= self.wp or all(s[1] for s in states[:kk])):
                best = kk
                break
        full = [s[0] for s in states[:best]]
        swa = [s[1] for s in states[max(0, best - self.wp) : best]]
        return best * self.P, full, swa, len(states) * self.P

    def lock_counts(self) -> tuple[dict, dict]:
        full: dict[bytes, int] = {}
        swa: dict[bytes, int] = {}
        for lk in self.locks.values():
            for k in lk.full:
                full[(lk.ns, k)] = full.get((lk.ns, k), 0) + 1
            if not lk.swa_released:
                for k in lk.swa:
                    swa[(lk.ns, k)] = swa.get((lk.ns, k), 0) + 1
        return full, swa

    def model_lock(self, ns: str, endkey: bytes) -> ModelLock:
        """What a lock ending at ``endkey`` must hold: the path, and its live trailing window."""
        pb = self.P * 4
        path = [endkey[: (i + 1) * pb] for i in range(len(endkey) // pb)]
        swa: list[bytes] = []
        for k in reversed(path):
            if len(swa) >= self.wp or not self.model[ns][k][1]:
                break
            swa.append(k)
        return ModelLock(ns, path, swa)

    def node_path(self, node_id: int) -> bytes:
        n = self.tree.nodes[node_id]
        parts = []
        while n.parent is not None:
            parts.append(n.tokens)
            n = n.parent
        return b"".join(reversed(parts))

    def tree_state(self) -> dict[str, dict[bytes, list[int]]]:
        out: dict[str, dict[bytes, list[int]]] = {}
        pb = self.P * 4
        for name, ns in self.tree.namespaces.items():
            d: dict[bytes, list[int]] = {}
            stack = [(ns.root, b"")]
            while stack:
                n, pre = stack.pop()
                for c in (n.children or {}).values():
                    cpre = pre + c.tokens
                    if c.full is not None:
                        for i in range(len(c.tokens) // pb):
                            d[pre + c.tokens[: (i + 1) * pb]] = [
                                c.full[i], c.swa[i] if c.swa is not None else 0]
                    stack.append((c, cpre))
            out[name] = d
        for name in NAMESPACES:
            out.setdefault(name, {})
        return out

    def adopt(self, taken_full=(), taken_swa=()) -> None:
        """After an evicting op: the change must be legal, then the model takes it.

        Pages the tree let go of must be free now, or be among those just allocated.
        """
        full_locks, swa_locks = self.lock_counts()
        now = self.tree_state()
        free_full = self.cache.alloc_state.full.free_set() | set(taken_full)
        free_swa = self.cache.alloc_state.swa.free_set() | set(taken_swa)
        for ns in NAMESPACES:
            before, after = self.model[ns], now[ns]
            for k, (f, s) in after.items():
                assert k in before, "eviction created a page"
                assert before[k][0] == f, "eviction changed a full page"
                assert s == before[k][1] or s == 0, "eviction changed a live SWA page"
                if s != before[k][1]:
                    assert not swa_locks.get((ns, k)), "an SWA-locked page was tombstoned"
                    assert before[k][1] in free_swa
            for k, (f, _s) in before.items():
                if k not in after:
                    assert not full_locks.get((ns, k)), "a locked page was evicted"
                    assert f in free_full
        self.model = now

    def compare(self) -> None:
        assert self.tree_state() == self.model

    def cleanup_model(self) -> None:
        """Unlocked tombstone leaves go (the tree does this at unlock)."""
        full_locks, _ = self.lock_counts()
        for ns in NAMESPACES:
            m = self.model[ns]
            changed = True
            while changed:
                changed = False
                plen = self.P * 4
                parents = {k[:-plen] for k in m}
                for k in list(m):
                    if m[k][1] == 0 and k not in parents and not full_locks.get((ns, k)):
                        del m[k]
                        changed = True

    def predict_insert(self, ns: str, tokens: bytes, prev: int, frontier: int,
                       full: list[int], swa: list[int]):
        """(inserted pages, canonical full, canonical swa, new model dict) or raises expectation."""
        n = len(tokens) // (self.P * 4)
        p = prev // self.P
        f = min(frontier // self.P, n)
        m = dict((k, list(v)) for k, v in self.model[ns].items())
        keys = self.keys(tokens)
        for i in range(p):
            if keys[i] not in m:
                return None
        adopt = f < n
        cfull, cswa = [], []
        i = p
        while i < n:
            k = keys[i]
            j = i - p
            if k in m:
                cfull.append(m[k][0])
                if m[k][1]:
                    cswa.append(m[k][1])
                elif swa[j]:
                    m[k][1] = swa[j]
                    cswa.append(swa[j])
                else:
                    cswa.append(0)
            elif adopt:
                m[k] = [full[j], swa[j]]
                cfull.append(full[j])
                cswa.append(swa[j])
            else:
                break
            i += 1
        return i, cfull, cswa, m

    # ------------------------------------------------------------------ rules

    @rule(target=requests, owner=st.sampled_from(OWNERS), ns=st.sampled_from(NAMESPACES),
          seq=sequences(), cut=st.integers(0, 3))
    def start_request(self, owner, ns, seq, cut):
        tokens = tok(seq[: max(1, len(seq) - cut)])
        exp_len, exp_full, exp_swa, exp_hit = self.model_match(ns, tokens)
        res, rid = self.cache.match(owner, ns, tokens, lock=True)
        assert (res.prefix_len, list(res.full_pages), list(res.swa_pages), res.full_hit_len) == (
            exp_len, exp_full, exp_swa, exp_hit)
        event(f"match: hit {exp_len > 0}, full beyond usable {exp_hit > exp_len}")
        self.locks[rid] = self.model_lock(ns, tokens[: res.prefix_len * 4])
        self.compare()
        total = -(-(len(tokens) // 4) // self.P)
        need = total - res.prefix_len // self.P
        try:
            full, swa = self.cache.alloc(owner, need, ns)
        except OutOfPages as exc:
            event("alloc failed: out of pages")
            assert "evictable" in str(exc) and exc.counts["requested"] == need
            self.adopt()
            self.cache.unlock(owner, rid)
            del self.locks[rid]
            self.cleanup_model()
            self.compare()
            return multiple()
        self.adopt(full, swa)
        self._req_id += 1
        req = Request(owner, ns, tokens, res.prefix_len, rid, list(full), list(swa))
        self.live_requests[self._req_id] = req
        return self._req_id

    @rule(target=requests, owners=st.tuples(st.sampled_from(OWNERS), st.sampled_from(OWNERS)),
          ns=st.sampled_from(NAMESPACES), seq=sequences(), cut=st.integers(1, 6))
    def nested_requests(self, owners, ns, seq, cut):
        """Two live requests, the second a prefix of the first: its match ends inside the first
        one's locked window, so the locked node is split under a live receipt."""
        first = self.start_request(owners[0], ns, seq, 0)
        second = self.start_request(owners[1], ns, seq, min(cut, len(seq) - 1))
        return multiple(*[r for r in (first, second) if isinstance(r, int)])

    @rule(owner=st.sampled_from(OWNERS), ns=st.sampled_from(NAMESPACES), seq=sequences(),
          keep_window=st.integers(0, 6), release=st.booleans())
    def serve_request(self, owner, ns, seq, keep_window, release):
        """A whole request in one step: match+lock, alloc, decode frees SWA, cache_finished."""
        rq = self.start_request(owner, ns, seq, 0)
        if not isinstance(rq, int):
            return
        req = self.live_requests[rq]
        n = len(req.tokens) // (4 * self.P)
        self.decode_frees_swa(rq, max(0, n - keep_window), release)
        self.finish(rq)

    @rule(rq=requests, upto=st.integers(0, 40), release=st.booleans())
    def decode_frees_swa(self, rq, upto, release):
        req = self.live_requests.get(rq)
        if req is None:
            return
        n = len(req.tokens) // (4 * self.P)
        p = req.prev // self.P
        new_f = min(max(req.frontier // self.P, p, upto), n)
        start = max(req.frontier // self.P, p)
        pages = [req.swa[i - p] for i in range(start, new_f) if req.swa[i - p]]
        self.cache.free(req.owner, swa=pages)
        for i in range(start, new_f):
            req.swa[i - p] = 0
        req.frontier = max(req.frontier, new_f * self.P)
        if release and req.rid is not None and not self.locks[req.rid].swa_released:
            self.cache.release_swa(req.owner, req.rid)
            self.locks[req.rid].swa_released = True
            with pytest.raises(ReceiptError):
                self.cache.release_swa(req.owner, req.rid)
        self.compare()

    @rule(rq=consumes(requests))
    def finish(self, rq):
        req = self.live_requests.pop(rq, None)
        if req is None:
            return
        pred = self.predict_insert(req.ns, req.tokens, req.prev, req.frontier,
                                   req.full, req.swa)
        assert pred is not None, "a locked prefix vanished"
        inserted, cfull, cswa, newm = pred
        before = self.tree.stats["splits"]
        res = self.cache.cache_finished(req.owner, req.ns, req.tokens, req.full, req.swa,
                                        req.prev, req.frontier, req.rid)
        partial = inserted < len(req.tokens) // (4 * self.P)
        event(f"finish: overlap {res.prefix_len > req.prev}, tombstones {0 in cswa}, "
              f"split {self.tree.stats['splits'] > before}, partial {partial}")
        revived = any(self.model[req.ns].get(k, [0, 1])[1] == 0 and newm[k][1]
                      for k in newm)
        if revived:
            event("finish revived a tombstone")
        assert res.inserted_len == inserted * self.P
        assert list(res.full_pages) == cfull and list(res.swa_pages) == cswa
        self.model[req.ns] = newm
        if req.rid is not None:
            del self.locks[req.rid]
        self.cleanup_model()
        self.compare()

    @rule(rq=requests)
    def unfinished(self, rq):
        req = self.live_requests.get(rq)
        if req is None:
            return
        pred = self.predict_insert(req.ns, req.tokens, req.prev, req.frontier,
                                   req.full, req.swa)
        inserted, cfull, cswa, newm = pred
        res, rid = self.cache.cache_unfinished(req.owner, req.ns, req.tokens, req.full, req.swa,
                                               req.prev, req.frontier, req.rid)
        assert res.inserted_len == inserted * self.P
        assert list(res.full_pages) == cfull and list(res.swa_pages) == cswa
        self.model[req.ns] = newm
        self.locks[rid] = self.model_lock(req.ns, req.tokens[: inserted * self.P * 4])
        if req.rid is not None:
            del self.locks[req.rid]
        self.cleanup_model()
        k = inserted - req.prev // self.P
        req.full, req.swa = req.full[k:], req.swa[k:]
        req.prev = inserted * self.P
        req.rid = rid
        self.compare()

    @rule(rq=consumes(requests))
    def abort(self, rq):
        req = self.live_requests.pop(rq, None)
        if req is None:
            return
        self.cache.free(req.owner, req.full, [p for p in req.swa if p])
        if req.rid is not None:
            self.cache.unlock(req.owner, req.rid)
            del self.locks[req.rid]
        self.cleanup_model()
        self.compare()

    @rule(target=nodes, owner=st.sampled_from(OWNERS), ns=st.sampled_from(NAMESPACES),
          seq=sequences())
    def plain_match(self, owner, ns, seq):
        tokens = tok(seq)
        exp = self.model_match(ns, tokens)
        res, rid = self.cache.match(owner, ns, tokens)
        assert rid is None
        assert (res.prefix_len, list(res.full_pages), list(res.swa_pages), res.full_hit_len) == (
            exp[0], exp[1], exp[2], exp[3])
        self.compare()
        return (ns, res.node_id, res.prefix_len)

    @rule(target=receipts, node=nodes, owner=st.sampled_from(OWNERS))
    def lock_node(self, node, owner):
        ns, node_id, end = node
        try:
            rid = self.cache.lock(owner, ns, node_id)
        except (UnknownNode, NodeNotUsable):
            self.compare()
            return multiple()
        assert self.tree.nodes[node_id].ns.name == ns
        key = self.node_path(node_id)
        assert len(key) == end * 4
        assert self.model_match(ns, key)[0] == end, "locked a node that is not a usable end"
        self.locks[rid] = self.model_lock(ns, key)
        self.compare()
        return (owner, rid)

    @rule(r=consumes(receipts), wrong_owner=st.booleans())
    def unlock(self, r, wrong_owner):
        owner, rid = r
        if wrong_owner:
            other = OWNERS[(OWNERS.index(owner) + 1) % len(OWNERS)]
            with pytest.raises(ReceiptError):
                self.cache.unlock(other, rid)
        if rid not in self.locks:  # its owner was killed
            with pytest.raises(ReceiptError):
                self.cache.unlock(owner, rid)
            return
        self.cache.unlock(owner, rid)
        del self.locks[rid]
        with pytest.raises(ReceiptError):
            self.cache.unlock(owner, rid)
        self.cleanup_model()
        self.compare()

    @rule(full=st.integers(0, 12), swa=st.integers(0, 12),
          ns=st.sampled_from([None, *NAMESPACES]))
    def evict(self, full, swa, ns):
        before = {k: dict(v) for k, v in self.model.items()}
        r = self.cache.evict(full, swa, namespace=ns)
        if ns is not None:
            other = [n for n in NAMESPACES if n != ns]
            now = self.tree_state()
            assert all(now[n] == before[n] for n in other), "evicted another namespace"
        event(f"evict freed full>0 {r.full_pages > 0} swa>0 {r.swa_pages > 0}")
        self.adopt()

    @rule(owner=st.sampled_from(OWNERS))
    def kill_owner(self, owner):
        self.cache.release_owner(owner)
        for k in [k for k, r in self.live_requests.items() if r.owner == owner]:
            del self.live_requests[k]
        for rid in [rid for rid in self.locks if self.cache._receipts.get(rid) is None]:
            del self.locks[rid]
        self.cleanup_model()
        self.compare()
        assert owner not in self.cache.holdings

    @rule(owner=st.sampled_from(OWNERS), page=st.integers(-2, 45))
    def free_foreign_page(self, owner, page):
        held = self.cache.holdings.get(owner)
        if held is not None and page in held.full:
            return
        with pytest.raises(PageNotHeld):
            self.cache.free(owner, [page])

    @rule(rq=requests, delta=st.integers(-3, 3))
    def bad_insert(self, rq, delta):
        req = self.live_requests.get(rq)
        if req is None or delta == 0 or not req.full:
            return
        full = req.full + [req.full[0]] * delta if delta > 0 else req.full[:delta]
        with pytest.raises((BadArgument, PageNotHeld)):
            self.cache.cache_finished(req.owner, req.ns, req.tokens, full, req.swa,
                                      req.prev, req.frontier, req.rid)
        self.compare()

    @rule(look=st.integers(1, 6), most=st.integers(1, 6))
    def compact_cold(self, look, most):
        """The daemon's idle step: nothing a match or an insert reports changes (compare)."""
        done = self.tree.compact_cold(look, most)
        assert 0 <= done <= min(look, most)
        self.compare()

    @invariant()
    def checker_clean(self):
        if hasattr(self, "cache"):
            if self.idle:
                while self.tree.compact_cold(64, 64):
                    pass
                self.compare()
            assert self.cache.check() == []
            kinds = {type(p).__name__ for n in self.tree.iter_nodes() for p in (n.full, n.swa)
                     if p is not None and n.parent is not None}
            event(f"page id forms in the tree: {sorted(kinds)}")

    @precondition(lambda self: hasattr(self, "cache"))
    @invariant()
    def counters_match_free_lists(self):
        a = self.cache.alloc_state
        full_tree, swa_tree = self.tree.device_pages()
        held_full = sum(len(h.full) for h in self.cache.holdings.values())
        assert a.full.available + full_tree + held_full == a.full.usable


CacheMachine.TestCase.settings = settings(
    max_examples=int(__import__("os").environ.get("RADIXD_STATEFUL_EXAMPLES", "150")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCache = CacheMachine.TestCase
