"""The unified radix tree over full-attention and sliding-window (SWA) pages.

Pure data structure: page ids and token bytes in, page ids out; pages the tree lets go of are
handed to a :class:`PageSink` (the allocator). No torch, no I/O, no asyncio.

Rules (DESIGN.md section 5), with the choices this implementation makes:

* Nodes split only at page boundaries; the lower half keeps the node object and its id, so an
  anchor (the deepest node of a lock) never changes identity.
* A match may end only where every token of the last ``window`` tokens has live SWA KV, or where
  the whole path from the root is live. Full KV beyond that is reported separately.
* A lock takes the full KV of the whole path and the SWA KV of the trailing window only, splitting
  the node that straddles the window edge so it pins exactly ``ceil(window / page)`` pages.
* SWA pages are stored per node independently of the full pages (no full->SWA mapping table), so
  reviving a tombstone never touches the full KV, locked or not.
* No *unlocked* device leaf is ever a tombstone: it is removed (or demoted to host) at once, and the
  cleanup walks upward. A leaf whose full KV is locked may lose its SWA (its reader released the SWA
  early); it is cleaned when its last full lock goes.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import BadArgument, NodeNotUsable, ReceiptError, UnknownNode
from .hashing import HASH_BYTES, chain_hashes, namespace_seed
from .lru import EvictionQueue
from .node import EMPTY, Node, Pin, Receipt
from .policy import DEFAULT_POLICY, EvictionPolicy, make_policy
from .tiering import usable_end, walk


class PageSink(Protocol):
    """Where the tree returns device pages it no longer needs."""

    def free_full(self, pages: array) -> None: ...

    def free_swa(self, pages: array) -> None: ...


class HostSink(Protocol):
    """Where the tree returns host (L2) slots it no longer needs."""

    def free_host(self, slots: array) -> None: ...

    def free_host_swa(self, slots: array) -> None: ...


class CollectingSink:
    """A sink that just records what was freed (tests, benchmarks, simulations)."""

    def __init__(self) -> None:
        self.full: list[int] = []
        self.swa: list[int] = []
        self.host: list[int] = []
        self.host_swa: list[int] = []

    def free_full(self, pages: array) -> None:
        self.full.extend(pages)

    def free_swa(self, pages: array) -> None:
        self.swa.extend(pages)

    def free_host(self, slots: array) -> None:
        self.host.extend(slots)

    def free_host_swa(self, slots: array) -> None:
        self.host_swa.extend(slots)


@dataclass(slots=True)
class MatchResult:
    """What a match found. Lengths are in tokens, always whole pages."""

    prefix_len: int  # usable device prefix (the SWA rule holds at its end)
    full_pages: array  # full-pool page ids of [0, prefix_len)
    swa_pages: array  # SWA page ids of the trailing window of the prefix (all live)
    node_id: int  # the node that ends exactly at prefix_len (a root id when prefix_len == 0)
    full_hit_len: int  # device full KV matched, possibly beyond prefix_len through tombstones
    host_hit_len: int  # tokens past prefix_len that a load from host would make usable
    receipt: Receipt | None = None


@dataclass(slots=True)
class InsertResult:
    """What an insert did. Page arrays cover [prev_prefix_len, inserted_len)."""

    prefix_len: int  # tokens that were already on device before this insert (the overlap)
    inserted_len: int  # tokens of this sequence now in the tree on device
    full_pages: array  # canonical full page ids for [prev_prefix_len, inserted_len)
    swa_pages: array  # canonical SWA page ids for the same range, 0 where tombstoned
    node_id: int  # the node that ends at inserted_len
    receipt: Receipt | None = None


@dataclass(slots=True)
class EvictResult:
    full_pages: int = 0
    swa_pages: int = 0
    host_slots: int = 0
    host_swa_slots: int = 0


class Namespace:
    """A separate subtree: its own root, hash seed, eviction queues and page counts (so a tenant
    over quota can evict its own cold pages without scanning anyone else's)."""

    __slots__ = ("name", "seed", "root", "full_q", "swa_q", "host_q", "full_pages", "swa_pages",
                 "host_pages")

    def __init__(self, name: str, seed: bytes, root: Node):
        self.name = name
        self.seed = seed
        self.root = root
        self.full_q = EvictionQueue("full_entry")
        self.swa_q = EvictionQueue("swa_entry")
        self.host_q = EvictionQueue("host_entry")
        self.full_pages = 0  # device pages of this namespace's nodes
        self.swa_pages = 0
        self.host_pages = 0


class RadixTree:
    """One tree per model profile; namespaces are separate subtrees with their own roots."""

    def __init__(
        self,
        page_size: int,
        window: int | None,
        sink: PageSink,
        *,
        host_sink: HostSink | None = None,
        layout_fingerprint: bytes = b"",
        policy: str | EvictionPolicy = DEFAULT_POLICY,
    ):
        if not isinstance(page_size, int) or page_size < 1:
            raise BadArgument(f"page_size must be an int >= 1, got {page_size!r}")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise BadArgument(f"window must be an int >= 1 or None, got {window!r}")
        self.page_size = page_size
        self.page_bytes = page_size * 4
        self.window = window
        self.swa_enabled = window is not None
        self.window_pages = -(-window // page_size) if window else 0
        self.sink = sink
        self.host_sink = host_sink
        self.layout_fingerprint = layout_fingerprint
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.namespaces: dict[str, Namespace] = {}
        self.nodes: dict[int, Node] = {}
        self.receipts: set[Receipt] = set()
        self.pins: set[Pin] = set()
        # write_back: called with a device node about to lose its last device copy and without a
        # host copy; it may give the node one (set_host) so that it is demoted, not deleted
        self.demote: Callable[[Node], None] | None = None
        # L3 write_back: called with a host-only leaf about to be dropped from host
        self.host_dropped: Callable[[Node], None] | None = None
        self._next_id = 1
        self._clock = 0
        # page counters, kept incrementally and recomputed by the checker
        self.full_evictable = 0
        self.full_protected = 0
        self.swa_evictable = 0
        self.swa_protected = 0
        self.host_pages = 0
        self.host_swa_pages = 0
        # pages evicted per trigger ("alloc", "quota", "explicit"): [full, swa]
        self.evictions_by_reason: dict[str, list[int]] = {}
        self.stats = {
            "evicted_full_pages": 0,
            "evicted_swa_pages": 0,
            "demoted_pages": 0,
            "evicted_host_pages": 0,
            "splits": 0,
        }

    # ------------------------------------------------------------------ namespaces and lookup

    def namespace(self, name: str) -> Namespace:
        ns = self.namespaces.get(name)
        if ns is None:
            seed = namespace_seed(name, self.layout_fingerprint)
            root = Node(self._new_id(), None, None, b"", b"")
            root.full = EMPTY
            root.swa = EMPTY if self.swa_enabled else None
            root.host = EMPTY
            ns = Namespace(name, seed, root)
            root.ns = ns
            self.namespaces[name] = ns
            self.nodes[root.id] = root
        return ns

    def get_node(self, node_id: int, namespace: str | None = None) -> Node:
        node = self.nodes.get(node_id) if isinstance(node_id, int) else None
        if node is None or (namespace is not None and node.ns.name != namespace):
            raise UnknownNode(f"node {node_id!r} is not in the tree" + (
                f" of namespace {namespace!r}" if namespace is not None else ""))
        return node

    def _new_id(self) -> int:
        i = self._next_id
        self._next_id = i + 1
        return i

    def _advance(self, ntokens: int) -> None:
        """Recency is measured in cache churn (tokens of KV handed to the tree), so that "how long
        ago" means "how much new content arrived since", and policies can weigh it against depth."""
        self._clock += max(1, ntokens)

    def npages(self, node: Node) -> int:
        return len(node.tokens) // self.page_bytes

    # ------------------------------------------------------------------ queue bookkeeping

    def _requeue(self, n: Node) -> None:
        """Put ``n`` in exactly the eviction queues it is eligible for, keyed by its priority."""
        if n.parent is None:
            return
        pol = self.policy
        ns = n.ns
        if n.pin:
            self._unqueue(n)
            return
        if n.full is not None:
            if n.full_lock == 0 and n.dev_children == 0:
                ns.full_q.push(n, pol.full_key(n))
            elif n.full_entry is not None:
                ns.full_q.remove(n)
            if n.swa is not None and n.swa_lock == 0 and self.swa_enabled:
                ns.swa_q.push(n, pol.swa_key(n))
            elif n.swa_entry is not None:
                ns.swa_q.remove(n)
            if n.host_entry is not None:
                ns.host_q.remove(n)
        else:
            if n.full_entry is not None:
                ns.full_q.remove(n)
            if n.swa_entry is not None:
                ns.swa_q.remove(n)
            if n.host is not None and not n.children and not n.host_pin:
                ns.host_q.push(n, pol.host_key(n))
            elif n.host_entry is not None:
                ns.host_q.remove(n)

    def _unqueue(self, n: Node) -> None:
        ns = n.ns
        ns.full_q.remove(n)
        ns.swa_q.remove(n)
        ns.host_q.remove(n)

    def _touch(self, n: Node) -> None:
        if n.ts == self._clock:
            return  # nothing was inserted since its last touch: its position stands
        n.ts = self._clock
        if n.full_entry is not None or n.host_entry is not None:
            self._requeue(n)

    def _touch_window(self, path: list[Node]) -> None:
        """Refresh the SWA recency of the nodes holding the window that ``path`` ends with."""
        need = self.window_pages
        clock = self._clock
        pb = self.page_bytes
        for n in reversed(path):
            if need <= 0 or n.swa is None:
                break
            need -= len(n.tokens) // pb
            if n.swa_ts != clock:
                n.swa_ts = clock
                if n.swa_entry is not None:
                    self._requeue(n)

    # ------------------------------------------------------------------ structure

    def _split(self, node: Node, k: int) -> Node:
        """Split ``node`` after its first ``k`` pages; returns the new upper node.

        The node object keeps the lower part, its id, children and queue entries.
        """
        pb = self.page_bytes
        kb = k * pb
        parent = node.parent
        up = Node(self._new_id(), parent, node.ns, node.tokens[:kb], node.hashes[: k * HASH_BYTES])
        node.tokens = node.tokens[kb:]
        node.hashes = node.hashes[k * HASH_BYTES :]
        if node.full is not None:
            up.full = node.full[:k]
            node.full = node.full[k:]
        if node.swa is not None:
            up.swa = node.swa[:k]
            node.swa = node.swa[k:]
        if node.host is not None:
            up.host = node.host[:k]
            node.host = node.host[k:]
        if node.host_swa is not None:
            hs = node.host_swa
            up.host_swa = hs[:k] if any(hs[:k]) else None  # an all-zero list is kept as None
            node.host_swa = hs[k:] if any(hs[k:]) else None
        up.full_lock = node.full_lock
        up.swa_lock = node.swa_lock
        up.pin = node.pin
        up.host_pin = node.host_pin
        up.ts = node.ts
        up.swa_ts = node.swa_ts
        up.hits = node.hits
        up.children = {node.tokens[:pb]: node}
        up.dev_children = 1 if node.full is not None else 0
        parent.children[up.tokens[:pb]] = up
        node.parent = up
        self.nodes[up.id] = up
        self._requeue(up)
        self.stats["splits"] += 1
        return up

    def _matched_pages(self, child: Node, tokens: bytes, off: int, limit_pages: int) -> int:
        """How many leading pages of ``child`` equal ``tokens`` at ``off`` (at least 1: the key)."""
        pb = self.page_bytes
        ct = child.tokens
        hi = min(len(ct) // pb, limit_pages)
        if tokens.startswith(ct if hi * pb == len(ct) else ct[: hi * pb], off):
            return hi
        lo = 1  # the first page matched through the children key
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if tokens.startswith(ct[: mid * pb], off):
                lo = mid
            else:
                hi = mid
        return lo

    # ------------------------------------------------------------------ match

    def match(self, namespace: str, tokens: bytes, *, lock: bool = False, tag: Any = None
              ) -> MatchResult:
        """Longest usable cached prefix of ``tokens``; refreshes recency along the path."""
        ns = self.namespace(namespace)
        pb = self.page_bytes
        n_pages = len(tokens) // pb
        window = self.window or 0
        swa = self.swa_enabled
        node = ns.root
        off = 0
        path: list[Node] = []
        host_path: list[Node] = []
        best_i = -1  # index in path of the best end; -1: the root
        best_m = 0  # pages of path[best_i] that are matched
        run = 0
        tomb = False
        dev_off = 0
        children = node.children
        while off < n_pages * pb and children:
            child = children.get(tokens[off : off + pb])
            if child is None:
                break
            m = self._matched_pages(child, tokens, off, n_pages - off // pb)
            if child.full is None:
                if child.host is None:
                    break
                host_path.append(child)
            else:
                path.append(child)
                dev_off = off + m * pb
                if not swa:
                    best_i, best_m = len(path) - 1, m
                elif child.swa is None:
                    tomb = True
                    run = 0
                else:
                    run += m * self.page_size
                    if not tomb or run >= window:
                        best_i, best_m = len(path) - 1, m
            off += m * pb
            if m * pb < len(child.tokens):
                break
            children = child.children
        if best_i >= 0:
            best = path[best_i]
            if best_m * pb < len(best.tokens):
                best = self._split(best, best_m)
                path[best_i] = best
            usable = path[: best_i + 1]
        else:
            best = ns.root
            usable = []
        for n in path:
            self._touch(n)
        for n in host_path:
            self._touch(n)
        if swa:
            self._touch_window(usable)
        for n in usable:
            n.hits += 1
        full_pages = _concat(n.full for n in usable)
        swa_pages = self._window_swa(usable) if swa else EMPTY
        prefix_len = best.depth
        host_len = 0
        if host_path or (swa and any(n.host_swa is not None for n in path[best_i + 1 :])):
            end = usable_end(self, walk(self, namespace, tokens))
            host_len = max(0, end * self.page_size - prefix_len)
        receipt = self._lock(best, tag) if lock else None
        return MatchResult(
            prefix_len,
            full_pages,
            swa_pages,
            best.id,
            dev_off // 4,
            host_len,
            receipt,
        )

    def _window_swa(self, path: list[Node]) -> array:
        need = self.window_pages
        parts: list[array] = []
        for n in reversed(path):
            if need <= 0:
                break
            s = n.swa
            if s is None:
                break
            parts.append(s if len(s) <= need else s[len(s) - need :])
            need -= len(s)
        parts.reverse()
        return _concat(parts)

    def is_usable_end(self, node: Node) -> bool:
        """Whether a match may end at ``node`` (DESIGN 5.2)."""
        if node.full is None:
            return False
        if not self.swa_enabled or node.parent is None:
            return True
        run = 0
        n = node
        while n.parent is not None:
            if n.swa is None:
                return False
            run += len(n.tokens) // 4
            if run >= self.window:
                return True
            n = n.parent
        return True

    # ------------------------------------------------------------------ locks

    def lock(self, node_id: int, namespace: str | None = None, tag: Any = None) -> Receipt:
        """Protect the path ending at a node; the node must be a usable match end."""
        node = self.get_node(node_id, namespace)
        if not self.is_usable_end(node):
            raise NodeNotUsable(
                f"node {node_id} cannot be locked: its sliding window (or device copy) was "
                "evicted; match again")
        return self._lock(node, tag)

    def _lock(self, node: Node, tag: Any = None) -> Receipt:
        n = node
        while n.parent is not None:
            if n.full_lock == 0 and not n.pin:
                np_ = len(n.tokens) // self.page_bytes
                self.full_evictable -= np_
                self.full_protected += np_
                if n.full_entry is not None:
                    n.ns.full_q.remove(n)
            n.full_lock += 1
            n = n.parent
        covered = 0
        if self.swa_enabled:
            need = self.window_pages
            n = node
            pb = self.page_bytes
            while n.parent is not None and covered < need and n.swa is not None:
                np_ = len(n.tokens) // pb
                if covered + np_ > need:
                    self._split(n, np_ - (need - covered))
                    np_ = need - covered
                if n.swa_lock == 0 and not n.pin:
                    self.swa_evictable -= np_
                    self.swa_protected += np_
                    if n.swa_entry is not None:
                        n.ns.swa_q.remove(n)
                n.swa_lock += 1
                covered += np_
                n = n.parent
        r = Receipt(node, covered, tag)
        self.receipts.add(r)
        return r

    def release_swa(self, receipt: Receipt) -> None:
        """Early SWA-only release (decode past the window); the full lock stays."""
        if not receipt.active or receipt.swa_released:
            raise ReceiptError("the SWA part of this lock was already released")
        self._release_swa(receipt)
        receipt.swa_released = True

    def _release_swa(self, r: Receipt) -> None:
        left = r.swa_pages
        n = r.anchor
        pb = self.page_bytes
        while left > 0:
            np_ = len(n.tokens) // pb
            if n.swa_lock <= 0 or n.swa is None or n.parent is None:
                raise AssertionError(f"SWA release walked onto an unlocked node {n!r} for {r!r}")
            n.swa_lock -= 1
            if n.swa_lock == 0 and not n.pin:
                self.swa_protected -= np_
                self.swa_evictable += np_
                self._requeue(n)
            left -= np_
            n = n.parent
        if left != 0:
            raise AssertionError(f"SWA release of {r!r} ended off a node boundary")
        r.swa_pages = 0

    def unlock(self, receipt: Receipt) -> None:
        """Release exactly what the receipt took; a second release is refused."""
        if not receipt.active:
            raise ReceiptError("this lock was already released")
        if not receipt.swa_released:
            self._release_swa(receipt)
        anchor = receipt.anchor
        n = anchor
        pb = self.page_bytes
        while n.parent is not None:
            if n.full_lock <= 0:
                raise AssertionError(f"full release walked onto an unlocked node {n!r}")
            n.full_lock -= 1
            if n.full_lock == 0 and not n.pin:
                np_ = len(n.tokens) // pb
                self.full_protected -= np_
                self.full_evictable += np_
                self._requeue(n)
            n = n.parent
        receipt.active = False
        self.receipts.discard(receipt)
        self._drop_dead_leaf(anchor)

    # ------------------------------------------------------------------ insert

    def insert(
        self,
        namespace: str,
        tokens: bytes,
        full_pages: array,
        swa_pages: array | None,
        prev_prefix_len: int = 0,
        swa_evicted_len: int = 0,
        *,
        lock: bool = False,
        tag: Any = None,
    ) -> InsertResult:
        """Hand computed pages to the tree.

        ``tokens`` is the sequence (its unaligned tail is ignored). ``full_pages`` and
        ``swa_pages`` cover the pages [prev_prefix_len, aligned end): the caller's own pages. The
        tree already owns [0, prev_prefix_len). ``swa_pages[i]`` is 0 exactly for the pages below
        ``swa_evicted_len`` (the caller already freed their SWA). Every caller page in
        [prev_prefix_len, inserted_len) is consumed: adopted by the tree or freed as a duplicate
        of the tree's canonical page. Pages beyond ``inserted_len`` stay the caller's (that
        happens when none of them would have live SWA at the end of the path: a tombstone leaf is
        never created).
        """
        ns = self.namespace(namespace)
        P = self.page_size
        pb = self.page_bytes
        n = len(tokens) // pb
        prev, f = self._check_insert_args(n, full_pages, swa_pages, prev_prefix_len,
                                          swa_evicted_len)
        swa = self.swa_enabled
        # a path whose new part would end without live SWA takes no new device pages
        adopt = (not swa) or f < n
        node = ns.root
        i = 0
        overlap = 0
        out_full: list[array] = []
        out_swa: list[array] = []
        to_free_full = array("i")
        to_free_swa = array("i")
        path: list[Node] = []
        while i < n and node.children:
            child = node.children.get(tokens[i * pb : (i + 1) * pb])
            if child is None:
                break
            m = self._matched_pages(child, tokens, i * pb, n - i)
            if i < prev < i + m:
                m = prev - i  # process the tree-owned part and the caller's part separately
            e = i + m
            if e < prev and m * pb < len(child.tokens):
                raise BadArgument(
                    f"prev_prefix_len={prev * P} is longer than the cached prefix "
                    f"({e * P} tokens) of this sequence (lock the prefix you reuse)")
            if e <= prev:
                if child.full is None:
                    raise BadArgument(
                        f"prev_prefix_len={prev * P} claims pages the tree holds on device, but "
                        f"tokens [{i * P}, {e * P}) are not on device (lock the prefix you reuse)")
                overlap = e
            elif child.full is None and not adopt:
                break
            if m * pb < len(child.tokens):
                child = self._split(child, m)
            if e > prev:
                cf = full_pages[i - prev : e - prev]
                cs = swa_pages[i - prev : e - prev] if swa else None
                if child.full is not None:
                    overlap = e
                    out_full.append(child.full)
                    if swa:
                        out_swa.append(child.swa if child.swa is not None else cs)
                    child = self._merge_into_device(child, i, e, f, cf, cs, to_free_full,
                                                    to_free_swa)
                else:
                    out_full.append(cf)
                    if swa:
                        out_swa.append(cs)
                    self._unevict(child, i, e, f, cf, cs)
            path.append(child)
            node = child
            i = e
        if i < prev:
            raise BadArgument(f"prev_prefix_len={prev * P} is longer than the cached prefix "
                              f"({i * P} tokens) of this sequence (lock the prefix you reuse)")
        # nothing may change before this point: every refusal above leaves the tree as it was
        self._advance((n - prev) * P)
        if i < n and adopt:
            new = self._append(node, tokens, i, n, f, full_pages[i - prev :],
                               swa_pages[i - prev :] if swa else None)
            out_full.append(full_pages[i - prev :])
            if swa:
                out_swa.append(swa_pages[i - prev :])
            path.extend(new)
            node = new[-1]
            i = n
        for nn in path:
            self._touch(nn)
            nn.hits += 1
        if swa:
            self._touch_window(path)
        if to_free_full:
            self.sink.free_full(to_free_full)
        if to_free_swa:
            self.sink.free_swa(to_free_swa)
        receipt = self._lock(node, tag) if lock else None
        return InsertResult(
            overlap * P,
            i * P,
            _concat(out_full),
            _concat(out_swa) if swa else array("i"),
            node.id,
            receipt,
        )

    def _check_insert_args(
        self, n: int, full_pages: Any, swa_pages: Any, prev_prefix_len: Any, swa_evicted_len: Any
    ) -> tuple[int, int]:
        P = self.page_size
        if not isinstance(prev_prefix_len, int) or prev_prefix_len < 0 or prev_prefix_len % P:
            raise BadArgument(f"prev_prefix_len must be a non-negative multiple of page_size {P}, "
                              f"got {prev_prefix_len!r}")
        if prev_prefix_len > n * P:
            raise BadArgument(f"prev_prefix_len={prev_prefix_len} is beyond the page-aligned "
                              f"length {n * P} of the sequence")
        if not isinstance(swa_evicted_len, int) or swa_evicted_len < 0 or swa_evicted_len % P:
            raise BadArgument(f"swa_evicted_len must be a non-negative multiple of page_size {P}, "
                              f"got {swa_evicted_len!r}")
        prev = prev_prefix_len // P
        # a frontier past the end means every SWA page was freed: cap it (never a cursor overrun)
        f = min(swa_evicted_len // P, n)
        if not self.swa_enabled:
            f = 0
        want = n - prev
        if len(full_pages) != want:
            raise BadArgument(f"full_pages has {len(full_pages)} ids; pages [{prev}, {n}) "
                              f"need {want}")
        if self.swa_enabled:
            if swa_pages is None or len(swa_pages) != want:
                got = None if swa_pages is None else len(swa_pages)
                raise BadArgument(f"swa_pages has {got} ids; pages [{prev}, {n}) need {want}")
            for j, sp in enumerate(swa_pages):
                freed = prev + j < f
                if freed and sp != 0:
                    raise BadArgument(f"swa_pages[{j}] must be 0: page {prev + j} is below "
                                      f"swa_evicted_len={swa_evicted_len}")
                if not freed and sp <= 0:
                    raise BadArgument(f"swa_pages[{j}] must be a page id: page {prev + j} is at or "
                                      f"after swa_evicted_len={swa_evicted_len}")
        elif swa_pages:
            raise BadArgument("this model has no sliding-window layers: swa_pages must be empty")
        if len(set(full_pages)) != want or any(p <= 0 for p in full_pages):
            raise BadArgument("full_pages must be distinct page ids > 0")
        if self.swa_enabled and want:
            live = [p for p in swa_pages if p]
            if len(set(live)) != len(live):
                raise BadArgument("swa_pages must be distinct page ids")
        return prev, f

    def _merge_into_device(
        self, child: Node, i: int, e: int, f: int, cf: array, cs: array | None,
        to_free_full: array, to_free_swa: array,
    ) -> Node:
        """Overlap with a device node: free the caller's duplicates, revive a tombstone if the
        caller brings live SWA for it. Returns the node that ends at ``e``."""
        to_free_full.extend(cf)
        if cs is None:
            return child
        if child.swa is not None:
            to_free_swa.extend(p for p in cs if p)
            return child
        # tombstone: three cases by where the caller's SWA frontier falls
        if f >= e:
            return child  # the caller's SWA for this span is gone too (cs is all 0)
        if f > i:
            self._split(child, f - i)  # upper [i, f) stays a tombstone
            cs = cs[f - i :]
        child.swa = array("i", cs)
        child.swa_ts = self._clock
        np_ = len(cs)
        if child.swa_lock:  # pragma: no cover - tombstones are never SWA-locked
            raise AssertionError(f"SWA-locked tombstone {child!r}")
        self._count_swa(child, np_)
        child.ns.swa_pages += np_
        self._requeue(child)
        return child

    def _count_swa(self, n: Node, np_: int) -> None:
        """New live SWA pages of ``n``: protected when a lock or a pin guards it."""
        if n.swa_lock or n.pin:
            self.swa_protected += np_
        else:
            self.swa_evictable += np_

    def _unevict(self, child: Node, i: int, e: int, f: int, cf: array, cs: array | None) -> None:
        """A host-only node gets device pages again from the caller's fresh copy."""
        if cs is not None and i < f < e:
            up = self._split(child, f - i)
            self._set_device(up, cf[: f - i], None)
            self._set_device(child, cf[f - i :], array("i", cs[f - i :]))
        else:
            live = cs is not None and f <= i
            self._set_device(child, cf, array("i", cs) if live else None)

    def _set_device(self, n: Node, full: array, swa: array | None) -> None:
        n.full = array("i", full)
        n.swa = swa
        n.ts = n.swa_ts = self._clock
        np_ = len(full)
        if n.full_lock or n.pin:
            self.full_protected += np_
        else:
            self.full_evictable += np_
        n.ns.full_pages += np_
        if swa is not None:
            self._count_swa(n, np_)
            n.ns.swa_pages += np_
        n.parent.dev_children += 1
        self._requeue(n)
        self._requeue(n.parent)

    def _append(
        self, parent: Node, tokens: bytes, i: int, n: int, f: int, cf: array, cs: array | None
    ) -> list[Node]:
        """New nodes for pages [i, n): a tombstone part below the frontier, then a live leaf."""
        pb = self.page_bytes
        prev_hash = parent.hashes[-HASH_BYTES:] if parent.hashes else parent.ns.seed
        seg = tokens[i * pb : n * pb]
        hashes = chain_hashes(prev_hash, seg, pb)
        out: list[Node] = []
        cuts = [i, n]
        if cs is not None and i < f < n:
            cuts = [i, f, n]
        cur = parent
        for a, b in zip(cuts, cuts[1:], strict=False):
            nd = Node(self._new_id(), cur, parent.ns, seg[(a - i) * pb : (b - i) * pb],
                      hashes[(a - i) * HASH_BYTES : (b - i) * HASH_BYTES])
            if cur.children is None:
                cur.children = {}
            cur.children[nd.tokens[:pb]] = nd
            self.nodes[nd.id] = nd
            live = cs is not None and a >= f
            self._set_device(nd, cf[a - i : b - i], array("i", cs[a - i : b - i]) if live else None)
            out.append(nd)
            cur = nd
        return out

    # ------------------------------------------------------------------ composite engine steps

    def cache_finished(
        self, namespace: str, tokens: bytes, full_pages: array, swa_pages: array | None,
        prev_prefix_len: int, swa_evicted_len: int, receipt: Receipt | None,
    ) -> InsertResult:
        """End of a request: insert what it computed, free the rest of its pages, drop its lock.

        ``full_pages``/``swa_pages`` cover [prev_prefix_len, ceil(len(tokens) / page)), so they
        include the unaligned tail page, which is never cached.
        """
        n, cf, cs, tf, ts_ = self._split_tail(tokens, full_pages, swa_pages, prev_prefix_len)
        if receipt is not None and not receipt.active:
            raise ReceiptError("this lock was already released")
        res = self.insert(namespace, tokens[: n * self.page_bytes], cf, cs, prev_prefix_len,
                          swa_evicted_len)
        left = res.inserted_len // self.page_size - prev_prefix_len // self.page_size
        rest_full = array("i", cf[left:]) + tf
        rest_swa = array("i", (p for p in (cs[left:] if cs is not None else ()) if p)) + array(
            "i", (p for p in ts_ if p))
        if rest_full:
            self.sink.free_full(rest_full)
        if rest_swa:
            self.sink.free_swa(rest_swa)
        if receipt is not None:
            self.unlock(receipt)
        return res

    def cache_unfinished(
        self, namespace: str, tokens: bytes, full_pages: array, swa_pages: array | None,
        prev_prefix_len: int, swa_evicted_len: int, receipt: Receipt | None, tag: Any = None,
    ) -> InsertResult:
        """After a prefill chunk: insert, move the lock to the new end, keep the unaligned tail.

        The result's receipt replaces ``receipt``; its ``inserted_len`` is the next call's
        ``prev_prefix_len``. Pages past ``inserted_len`` (the tail page included) stay the caller's.
        """
        n, cf, cs, _tf, _ts = self._split_tail(tokens, full_pages, swa_pages, prev_prefix_len)
        if receipt is not None and not receipt.active:
            raise ReceiptError("this lock was already released")
        res = self.insert(namespace, tokens[: n * self.page_bytes], cf, cs, prev_prefix_len,
                          swa_evicted_len, lock=True, tag=tag)
        if receipt is not None:
            self.unlock(receipt)
        return res

    def _split_tail(
        self, tokens: bytes, full_pages: array, swa_pages: array | None, prev_prefix_len: int
    ) -> tuple[int, array, array | None, array, array]:
        P = self.page_size
        n = len(tokens) // self.page_bytes
        total = -(-(len(tokens) // 4) // P)
        if not isinstance(prev_prefix_len, int) or prev_prefix_len < 0:
            raise BadArgument(
                f"prev_prefix_len must be a non-negative int, got {prev_prefix_len!r}")
        prev = prev_prefix_len // P
        want = total - prev
        if len(full_pages) != want:
            raise BadArgument(f"full_pages has {len(full_pages)} ids; pages [{prev}, {total}) "
                              f"(the unaligned tail page included) need {want}")
        if self.swa_enabled and (swa_pages is None or len(swa_pages) != want):
            got = None if swa_pages is None else len(swa_pages)
            raise BadArgument(f"swa_pages has {got} ids; pages [{prev}, {total}) need {want}")
        k = max(0, n - prev)
        cs = swa_pages[:k] if self.swa_enabled else None
        ts_ = swa_pages[k:] if self.swa_enabled else array("i")
        if self.swa_enabled and any(p < 0 for p in ts_):
            raise BadArgument("swa_pages ids must be >= 0")
        if any(p <= 0 for p in full_pages[k:]):
            raise BadArgument("full_pages must be page ids > 0")
        # the tail is split off before insert() checks its range: check the whole lists here
        if len(set(full_pages)) != len(full_pages):
            raise BadArgument("full_pages must be distinct page ids")
        if self.swa_enabled:
            live = [p for p in swa_pages if p]
            if len(set(live)) != len(live):
                raise BadArgument("swa_pages must be distinct page ids")
        return n, full_pages[:k], cs, array("i", full_pages[k:]), array("i", ts_)

    # ------------------------------------------------------------------ eviction

    def _pop(self, kind: str, namespace: Namespace | None) -> Node | None:
        """The next victim of one kind: from one namespace, or the best across all of them."""
        if namespace is not None:
            return getattr(namespace, kind).pop()
        best = None
        best_entry = None
        for ns in self.namespaces.values():
            q = getattr(ns, kind)
            if q.peek() is not None and (best_entry is None or q.heap[0][:2] < best_entry[:2]):
                best, best_entry = q, q.heap[0]
        return best.pop() if best is not None else None

    def evict(self, full_pages: int = 0, swa_pages: int = 0, reason: str = "explicit",
              namespace: str | None = None) -> EvictResult:
        """Free at least the requested pages of each pool (exactly, unless a cleanup cascades),
        or as many as the unlocked part of the tree (of one namespace, if given) holds."""
        res = EvictResult()
        ns = self.namespaces.get(namespace) if namespace is not None else None
        if namespace is not None and ns is None:
            return res
        while res.full_pages < full_pages:
            node = self._pop("full_q", ns)
            if node is None:
                break
            need = full_pages - res.full_pages
            np_ = len(node.tokens) // self.page_bytes
            if np_ > need:
                self._split(node, np_ - need)
            self._evict_leaf(node, res)
        while res.swa_pages < swa_pages:
            node = self._pop("swa_q", ns)
            if node is None:
                break
            need = swa_pages - res.swa_pages
            np_ = len(node.tokens) // self.page_bytes
            if node.full_lock == 0 and node.dev_children == 0 and np_ <= need:
                self._evict_leaf(node, res)
                continue
            if np_ > need:
                # tombstone the upper part and keep the tail, which holds the window, live
                up = self._split(node, need)
                self._requeue(node)
                node = up
            # a locked leaf may become a tombstone here (its reader released the SWA early);
            # it is cleaned up when its last full lock goes
            self._tombstone(node, res)
        by = self.evictions_by_reason.setdefault(reason, [0, 0])
        by[0] += res.full_pages
        by[1] += res.swa_pages
        return res

    def evict_host(self, slots: int, namespace: str | None = None, swa_slots: int = 0
                   ) -> EvictResult:
        """Drop host-only leaves until ``slots`` full and ``swa_slots`` SWA host slots are free."""
        res = EvictResult()
        ns = self.namespaces.get(namespace) if namespace is not None else None
        if namespace is not None and ns is None:
            return res
        while res.host_slots < slots or res.host_swa_slots < swa_slots:
            node = self._pop("host_q", ns)
            if node is None:
                break
            self._delete_host_leaf(node, res)
        return res

    def _tombstone(self, n: Node, res: EvictResult) -> None:
        swa = n.swa
        np_ = len(swa)
        self.sink.free_swa(swa)
        n.swa = None
        self.swa_evictable -= np_
        n.ns.swa_pages -= np_
        res.swa_pages += np_
        self.stats["evicted_swa_pages"] += np_
        self._requeue(n)

    def _evict_leaf(self, n: Node, res: EvictResult) -> None:
        """Free the device KV of an unlocked device leaf, demote or delete it, clean upward."""
        while True:
            parent = n.parent
            if n.host is None and self.demote is not None:
                self.demote(n)
            np_ = len(n.full)
            self.sink.free_full(n.full)
            self.full_evictable -= np_
            n.ns.full_pages -= np_
            res.full_pages += np_
            self.stats["evicted_full_pages"] += np_
            if n.swa is not None:
                self.sink.free_swa(n.swa)
                self.swa_evictable -= np_
                n.ns.swa_pages -= np_
                res.swa_pages += np_
                self.stats["evicted_swa_pages"] += np_
            n.full = None
            n.swa = None
            parent.dev_children -= 1
            if n.host is not None:
                self.stats["demoted_pages"] += np_
                self._requeue(n)
            else:
                self._unqueue(n)
                del parent.children[n.tokens[: self.page_bytes]]
                if not parent.children:
                    parent.children = None
                del self.nodes[n.id]
            self._requeue(parent)
            if not self._is_dead_leaf(parent):
                return
            n = parent

    def _is_dead_leaf(self, n: Node) -> bool:
        """An unlocked device leaf without SWA: useless, and never left behind."""
        return (
            self.swa_enabled
            and n.parent is not None
            and n.full is not None
            and n.swa is None
            and n.dev_children == 0
            and n.full_lock == 0
            and n.pin == 0
        )

    def _drop_dead_leaf(self, n: Node) -> None:
        if self._is_dead_leaf(n):
            self._evict_leaf(n, EvictResult())

    def _delete_host_leaf(self, n: Node, res: EvictResult) -> None:
        if self.host_dropped is not None:
            self.host_dropped(n)
        host = n.host
        hswa = array("i", (p for p in n.host_swa if p)) if n.host_swa is not None else EMPTY
        if self.host_sink is not None:
            self.host_sink.free_host(host)
            if hswa:
                self.host_sink.free_host_swa(hswa)
        self.host_pages -= len(host)
        self.host_swa_pages -= len(hswa)
        n.ns.host_pages -= len(host)
        res.host_slots += len(host)
        res.host_swa_slots += len(hswa)
        self.stats["evicted_host_pages"] += len(host)
        parent = n.parent
        self._unqueue(n)
        del parent.children[n.tokens[: self.page_bytes]]
        if not parent.children:
            parent.children = None
        del self.nodes[n.id]
        self._requeue(parent)

    # ------------------------------------------------------------------ host tier hooks

    def set_host(self, node_id: int, slots: array, swa_slots: array | None = None) -> None:
        """Record that a device node now has a host copy (its parent must have one already).

        ``swa_slots`` are the host copies of its SWA pages, 0 for a page without one."""
        n = self.get_node(node_id)
        if n.parent is None:
            raise BadArgument("the root has no pages")
        if n.full is None or n.host is not None:
            raise BadArgument(f"node {node_id} is not a device node without a host copy")
        if n.parent.host is None:
            raise BadArgument(
                f"node {node_id}: back up the parent first (host copies are prefix-closed)")
        if len(slots) != self.npages(n) or (swa_slots is not None
                                            and len(swa_slots) != self.npages(n)):
            raise BadArgument(
                f"node {node_id} has {self.npages(n)} pages, got {len(slots)} host slots")
        self._give_host(n, array("i", slots),
                        array("i", swa_slots) if swa_slots is not None else None)
        self._requeue(n)

    def _give_host(self, n: Node, slots: array, swa_slots: array | None) -> None:
        n.host = slots
        self.host_pages += len(slots)
        n.ns.host_pages += len(slots)
        if swa_slots is not None and any(swa_slots):
            n.host_swa = swa_slots
            self.host_swa_pages += sum(1 for p in swa_slots if p)

    # ------------------------------------------------------------------ pins (tier copies)

    def pin(self, anchor: Node, host_only: bool = False) -> Pin:
        """Keep every page of the path root..anchor where it is while a tier copy runs
        (``host_only``: only the host copies, for a fetch that attaches below them)."""
        n = anchor
        pb = self.page_bytes
        while n.parent is not None:
            if host_only:
                n.host_pin += 1
                if n.host_pin == 1:
                    self._requeue(n)
            else:
                n.pin += 1
                if n.pin == 1:
                    self._guard(n, len(n.tokens) // pb)
                    self._unqueue(n)
            n = n.parent
        p = Pin(anchor, host_only)
        self.pins.add(p)
        return p

    def _guard(self, n: Node, np_: int) -> None:
        """A pin starts (``np_`` > 0) or ends (< 0) on ``n``: its pages no lock guards move
        between evictable and protected."""
        if n.full is not None and not n.full_lock:
            self.full_evictable -= np_
            self.full_protected += np_
        if n.swa is not None and not n.swa_lock:
            self.swa_evictable -= np_
            self.swa_protected += np_

    def unpin(self, p: Pin) -> None:
        if not p.active:
            raise ReceiptError("this pin was already released")
        n = p.anchor
        pb = self.page_bytes
        freed: list[Node] = []  # nodes no pin guards now, lowest first
        while n.parent is not None:
            if (n.host_pin if p.host_only else n.pin) <= 0:
                raise AssertionError(f"unpin walked onto an unpinned node {n!r} for {p!r}")
            if p.host_only:
                n.host_pin -= 1
                if n.host_pin == 0:
                    self._requeue(n)
            else:
                n.pin -= 1
                if n.pin == 0:
                    self._guard(n, -(len(n.tokens) // pb))
                    self._requeue(n)
                    freed.append(n)
            n = n.parent
        p.active = False
        self.pins.discard(p)
        # an ancestor may have lost its last device child while pinned (its pinned child can be
        # host-only): every node the pin guarded is checked, not only the anchor
        for n in freed:
            if self.nodes.get(n.id) is n:
                self._drop_dead_leaf(n)

    # ------------------------------------------------------------------ views

    def device_pages(self) -> tuple[int, int]:
        """(full, swa) device pages held by the tree."""
        return (self.full_evictable + self.full_protected, self.swa_evictable + self.swa_protected)

    def iter_nodes(self) -> Iterable[Node]:
        return self.nodes.values()


def _concat(parts: Iterable[array]) -> array:
    out = array("i")
    for p in parts:
        out += p
    return out
