"""The unified radix tree over full-attention and sliding-window (SWA) pages.

Pure data structure: page ids and token bytes in, page ids out; pages the tree lets go of are
handed to a :class:`PageSink` (the allocator). No torch, no I/O, no asyncio, and no other calls
out of an operation: where the memory tiers must copy a node before it loses its device pages,
the tree stops and names it (see :mod:`daemon.tree.eviction`).

The class is assembled from one mixin per concern (matching, insertion, locks and pins, eviction,
tier copies); this module holds the state they share and the structural steps (queues, splits).

Rules (docs/design.md, the tree section), with the choices this implementation makes:

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
from collections import deque
from collections.abc import Iterable

from .errors import BadArgument, UnknownNode
from .eviction import Eviction
from .hashing import HASH_BLOCK_TOKENS, HASH_BYTES, block_pages, namespace_seed, page_keys
from .insertion import Insertion
from .locks import Locking
from .matching import Matching
from .node import EMPTY, Node, Pin, Receipt
from .page_ids import LEAD_MIN, PageIdCodec, host_swa_ids
from .plain_ids import PlainPageIds
from .policy import DEFAULT_POLICY, EvictionPolicy, make_policy
from .results import (
    CollectingSink,
    EvictResult,
    HostSink,
    InsertResult,
    MatchResult,
    Namespace,
    PageSink,
)
from .tiering import Tiering

#: page-id forms a node in use keeps whatever the codec: an array, and one run (a ``range``,
#: listed by one vector call); other forms are the codec's to keep or list again (``in_use``)
_LISTED_AS_IS = (array, range)

__all__ = ["CollectingSink", "EvictResult", "HostSink", "InsertResult", "MatchResult", "Namespace",
           "PageSink", "RadixTree"]


class RadixTree(Matching, Insertion, Locking, Eviction, Tiering):
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
        hash_block_tokens: int = HASH_BLOCK_TOKENS,
        page_ids: PageIdCodec | None = None,
    ) -> None:
        """``hash_block_tokens``: what a block of the hash chain holds at least; the key format
        of the tiers (protocol.md 9.3) is that of the default, other values are for tests that
        want blocks to end inside short sequences. ``page_ids``: the codec that keeps the device
        page ids of cold nodes (:meth:`compact_cold`) and the host slot ids of every node
        (:meth:`set_host`) in a compact form (daemon.tree.page_ids); the default keeps the
        caller's arrays."""
        if not isinstance(page_size, int) or page_size < 1:
            raise BadArgument(f"page_size must be an int >= 1, got {page_size!r}")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise BadArgument(f"window must be an int >= 1 or None, got {window!r}")
        self.page_size = page_size
        self.page_bytes = page_size * 4
        # the hash chain runs over blocks of whole pages (daemon.tree.hashing)
        if not isinstance(hash_block_tokens, int) or hash_block_tokens < 1:
            raise BadArgument(f"hash_block_tokens must be an int >= 1, got {hash_block_tokens!r}")
        self.block_pages = block_pages(page_size, hash_block_tokens)
        self.block_tokens = self.block_pages * page_size
        self.block_bytes = self.block_tokens * 4
        self.window = window
        self.swa_enabled = window is not None
        self.window_pages = -(-window // page_size) if window else 0
        self.sink = sink
        self.host_sink = host_sink
        self.page_ids: PageIdCodec = page_ids if page_ids is not None else PlainPageIds()
        # host SWA ids that start with this many zeros or more are kept without them
        self.swa_lead_min = LEAD_MIN
        # tokens of churn after which a node nobody used is cold: its page ids go to the codec's
        # compact form (compact_cold), and back to an array when it is used again
        self.compact_after = 0
        # ids of nodes whose page ids are arrays, oldest first, for compact_cold to look at
        self._dense: deque[int] = deque()
        self.layout_fingerprint = layout_fingerprint
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.namespaces: dict[str, Namespace] = {}
        self.nodes: dict[int, Node] = {}
        self.receipts: set[Receipt] = set()
        self.pins: set[Pin] = set()
        # two-phase eviction (daemon.tree.eviction): a device node without a host copy whose hits
        # reach this is not deleted but named in awaiting_copy, for the tiers to copy first
        # (None: no tier wants copies)
        self.host_copy_hits: int | None = None
        self.awaiting_copy: list[Node] = []
        # L3 write_back: host-only leaves dropped from host are kept here, their slots still held,
        # until the tiers have read them (ModelCache.flush_host_drops, then release_host_drops)
        self.report_host_drops = False
        self.host_drops: list[Node] = []
        self._next_id = 1
        self._clock = 0
        # bumped by every new node and every queue change (which every lock, unlock, insert,
        # eviction and tier move makes): the background checker gives a pass up when it moved
        self.changes = 0
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
            "compacted_nodes": 0,  # page ids of cold nodes handed to the codec (compact_cold)
            "expanded_nodes": 0,  # ... and back to arrays when used again
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
            ns = Namespace(name, seed, root, self.policy)
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
        self.changes += 1
        i = self._next_id
        self._next_id = i + 1
        return i

    @property
    def clock(self) -> int:
        """The churn clock recency is measured on (read by the key-addressed store, whose pages
        share the host eviction order with the tree's: daemon/keyed_tier.py)."""
        return self._clock

    def _advance(self, ntokens: int) -> None:
        """Recency is measured in cache churn (tokens of KV handed to the tree), so that "how long
        ago" means "how much new content arrived since", and policies can weigh it against depth.
        An insert that hands over nothing (the whole sequence was cached) leaves the clock where
        it is: nothing arrived, so what was touched before and after it is equally recent, and
        the matches that follow find their nodes' positions current (no queue update)."""
        if ntokens > 0:
            self._clock += ntokens

    def npages(self, node: Node) -> int:
        return len(node.tokens) // self.page_bytes

    # ------------------------------------------------------------------ content keys

    def chain_state(self, node: Node) -> tuple[bytes, bytes]:
        """The hash chain's state at the end of ``node``: the hash of the last block that ends
        there or above, and the token bytes from that block's end to the node's end.

        A node holds the hashes of the blocks that end inside it, so the block hash wanted is
        the last one of the nearest node (itself or an ancestor) that a block ends in; the
        carry is at most a block less one page, gathered on the way up.
        """
        if self.block_pages == 1:
            return (node.hashes[-HASH_BYTES:] if node.parent is not None else node.ns.seed), b""
        need = (node.depth % self.block_tokens) * 4
        parts: list[bytes] = []
        n = node
        while n.parent is not None:
            t = n.tokens
            if len(t) > need:  # the block boundary lies inside this node, or at its end
                if need:
                    parts.append(t[len(t) - need :])
                parts.reverse()
                return n.hashes[-HASH_BYTES:], b"".join(parts)
            parts.append(t)
            need -= len(t)
            n = n.parent
        parts.reverse()
        return n.ns.seed, b"".join(parts)

    def hash_count(self, node: Node) -> int:
        """How many block hashes ``node`` holds: one for each block that ends inside it."""
        bt = self.block_tokens
        return node.depth // bt - (node.depth - len(node.tokens) // 4) // bt

    def page_keys(self, nodes: list[Node], pages: Iterable[int] | None = None) -> list[bytes]:
        """The page keys (daemon.tree.hashing) of the pages of ``nodes``, a path downward in
        which each node is the previous one's child (``pages``: only those page indices into
        the path, ascending): what the Redis tier names values by. Below a page of
        ``HASH_BLOCK_TOKENS`` tokens each key not at a block's end costs a digest, so the tier
        asks only for the pages it publishes."""
        if not nodes:
            return []
        if self.block_pages == 1:  # one page a block: the page keys are the stored hashes
            h = nodes[0].hashes if len(nodes) == 1 else b"".join(n.hashes for n in nodes)
            count = len(h) // HASH_BYTES
            if pages is None:
                return [h[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(count)]
            pages = list(pages)
            if any(not 0 <= i < count for i in pages):
                raise IndexError(f"pages {pages} are not all pages of the {count} of the path")
            return [h[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in pages]
        prev, carry = self.chain_state(nodes[0].parent)
        tokens = nodes[0].tokens if len(nodes) == 1 else b"".join(n.tokens for n in nodes)
        return page_keys(prev, carry, tokens, self.page_bytes, self.block_bytes, pages)

    # ------------------------------------------------------------------ queue bookkeeping

    def _requeue(self, n: Node) -> None:
        """Put ``n`` in exactly the eviction queues it is eligible for, keyed by its priority."""
        if n.parent is None:
            return
        self.changes += 1
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
                ns.host_swa_q.remove(n)
        else:
            if n.full_entry is not None:
                ns.full_q.remove(n)
            if n.swa_entry is not None:
                ns.swa_q.remove(n)
            if n.host is not None and not n.children and not n.host_pin:
                key = pol.host_key(n)
                ns.host_q.push(n, key)
                if n.host_swa is not None:  # (host_swa_ids: None when no slot is set)
                    ns.host_swa_q.push(n, key)
                elif n.host_swa_entry is not None:
                    ns.host_swa_q.remove(n)
            elif n.host_entry is not None:
                ns.host_q.remove(n)
                ns.host_swa_q.remove(n)

    def _unqueue(self, n: Node) -> None:
        self.changes += 1
        ns = n.ns
        ns.full_q.remove(n)
        ns.swa_q.remove(n)
        ns.host_q.remove(n)
        ns.host_swa_q.remove(n)

    def _touch(self, n: Node) -> None:
        if n.ts == self._clock:
            return  # nothing was inserted since its last touch: its position stands
        n.ts = self._clock  # its queue entries stay: a key that rose is seen when it reaches the
        # top of its queue (daemon/tree/lru.py)
        if (n.full is not None and type(n.full) not in _LISTED_AS_IS) or (
                n.swa is not None and type(n.swa) not in _LISTED_AS_IS):
            self._expand(n)

    # ------------------------------------------------------------------ page ids, hot and cold

    def _dense_ids(self, n: Node) -> None:
        """``n`` has just taken (some of) its device page ids as arrays: kept in the codec's
        form for a node in use where it has one (``in_use``: a run or a few), and a node left
        with an array is a candidate for :meth:`compact_cold` if the codec would look at lists
        that long."""
        codec = self.page_ids
        if len(n.full) < codec.min_ids:  # type: ignore[arg-type]
            return
        if type(n.full) is array:
            n.full = codec.in_use(n.full)
        if n.swa is not None and type(n.swa) is array:
            n.swa = codec.in_use(n.swa)
        self._cold_candidate(n)

    def _cold_candidate(self, n: Node) -> None:
        """Note ``n`` for :meth:`compact_cold` if it keeps an array. Ids of nodes gone
        meanwhile are dropped once they could be half of the candidates (a daemon that is never
        idle never compacts, and its list must not grow with every node ever made)."""
        if type(n.full) is not array and type(n.swa) is not array:
            return
        dense = self._dense
        dense.append(n.id)
        if len(dense) > 2 * len(self.nodes) + 64:
            nodes = self.nodes
            self._dense = deque(dict.fromkeys(i for i in dense if i in nodes))

    def _expand(self, n: Node) -> None:
        """A node in use again keeps what a match lists cheaply (``in_use``): every match and
        insert through it lists its ids, which costs a vector call per run and a copy per
        array, so a list of many runs goes back to an array."""
        codec = self.page_ids
        full, swa = n.full, n.swa
        if type(full) not in _LISTED_AS_IS:
            n.full = codec.in_use(full)  # type: ignore[arg-type]
        if swa is not None and type(swa) not in _LISTED_AS_IS:
            n.swa = codec.in_use(swa)
        if n.full is not full or n.swa is not swa:
            self.stats["expanded_nodes"] += 1
            self._cold_candidate(n)

    def compact_cold(self, look: int = 16, most: int = 1) -> int:
        """Hand the page ids of nodes unused for ``compact_after`` tokens of churn to the codec
        to keep in its compact form (daemon.tree.page_ids): ``most`` nodes at most, of ``look``
        candidates at most, those that took arrays of ids earliest first. A compaction costs a
        few vector calls (tens of microseconds at a page of one token), so the daemon runs it
        while no request waits, never inside an operation. Returns the nodes compacted. (Host
        slot ids are compacted when they are set: :meth:`set_host`.)"""
        dense = self._dense
        nodes = self.nodes
        codec = self.page_ids
        horizon = self._clock - self.compact_after
        done = 0
        for _ in range(min(look, len(dense))):
            if done >= most:
                break
            nid = dense.popleft()
            n = nodes.get(nid)
            if n is None or n.full is None:
                continue
            if n.ts > horizon:
                dense.append(nid)  # in use lately: looked at again on the next round
                continue
            full, swa = n.full, n.swa
            if type(full) is array:
                n.full = codec.compact(full)
            if swa is not None and type(swa) is array:
                n.swa = codec.compact(swa)
            done += n.full is not full or n.swa is not swa
        self.stats["compacted_nodes"] += done
        return done

    def _touch_window(self, path: list[Node]) -> None:
        """Refresh the SWA recency of the nodes holding the window that ``path`` ends with."""
        need = self.window_pages
        clock = self._clock
        pb = self.page_bytes
        for n in reversed(path):
            if need <= 0 or n.swa is None:
                break
            need -= len(n.tokens) // pb
            n.swa_ts = clock  # (its queue entry stays, as in _touch)

    # ------------------------------------------------------------------ structure

    def _split(self, node: Node, k: int) -> Node:
        """Split ``node`` after its first ``k`` pages; returns the new upper node.

        The node object keeps the lower part, its id, children and queue entries.
        """
        pb = self.page_bytes
        kb = k * pb
        parent = node.parent
        bt = self.block_tokens
        hb = ((parent.depth + k * self.page_size) // bt - parent.depth // bt) * HASH_BYTES
        up = Node(self._new_id(), parent, node.ns, node.tokens[:kb], node.hashes[:hb])
        node.tokens = node.tokens[kb:]
        node.hashes = node.hashes[hb:]
        if node.full is not None:
            up.full = node.full[:k]
            node.full = node.full[k:]
        if node.swa is not None:
            up.swa = node.swa[:k]
            node.swa = node.swa[k:]
        if up.full is not None and (type(up.full) is array
                                    or (up.swa is not None and type(up.swa) is array)):
            self._dense_ids(up)
        if node.host is not None:
            up.host = node.host[:k]
            node.host = node.host[k:]
        if node.host_swa is not None:
            hs = node.host_swa
            up.host_swa = host_swa_ids(hs[:k], self.swa_lead_min)  # (all zeros: None)
            node.host_swa = host_swa_ids(hs[k:], self.swa_lead_min)
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
        if node.host_swa_entry is not None and node.host_swa is None:  # its window went up
            self._requeue(node)
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

    # ------------------------------------------------------------------ views

    def device_pages(self) -> tuple[int, int]:
        """(full, swa) device pages held by the tree."""
        return (self.full_evictable + self.full_protected, self.swa_evictable + self.swa_protected)

    def iter_nodes(self) -> Iterable[Node]:
        return self.nodes.values()
