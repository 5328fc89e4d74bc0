"""Tree operations of the memory tiers: what a load from host needs, and putting its result (or a
fetch from L3) into the tree.

Pure, like the rest of the tree: it decides which pages move and records where they landed; the
copies themselves are done by the caller between :func:`plan_load` and :func:`commit_load`, with
the path pinned (:meth:`RadixTree.pin`) so that nothing it reads or fills is evicted meanwhile.
These are methods of the tree (a mixin), so that the tier layer changes the tree only through
them.

Everything here works on page indices from the root rather than on node objects, and re-walks the
path at commit: nodes may be split by other operations while a copy runs (splits only subdivide,
so page indices stay valid where node references would not).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from .hashing import block_hashes
from .id_checks import next_nonzero, next_zero
from .node import Node
from .page_ids import host_swa_ids


@dataclass(slots=True)
class LoadPlan:
    """Pages a load copies from host, and the usable prefix (in pages) it makes."""

    end: int  # pages of the usable prefix after the load
    full: list[tuple[int, int]]  # (page index, host slot): full pages to bring to device
    swa: list[tuple[int, int]]  # (page index, host SWA slot): the window's missing SWA pages
    anchor: Node  # the node holding page end - 1 (what to pin)


def _take(pages: dict[int, int], a: int, b: int) -> array | None:
    """The device pages of [a, b) if all are there (removed from ``pages``), else None."""
    if any(k not in pages for k in range(a, b)):
        return None
    return array("i", (pages.pop(k) for k in range(a, b)))


class Tiering:
    """Tier copies of :class:`~daemon.tree.radix.RadixTree` (a mixin: it shares the tree's
    state)."""

    def walk(self, namespace: str, tokens: bytes, limit: int | None = None
             ) -> list[tuple[Node, int]]:
        """The cached path of ``tokens`` (device or host) as (node, pages of it matched)."""
        pb = self.page_bytes
        n_pages = len(tokens) // pb if limit is None else min(limit, len(tokens) // pb)
        node = self.namespace(namespace).root
        out: list[tuple[Node, int]] = []
        i = 0
        while i < n_pages and node.children:
            child = node.children.get(tokens[i * pb : (i + 1) * pb])
            if child is None:
                break
            m = self._matched_pages(child, tokens, i * pb, n_pages - i)
            out.append((child, m))
            i += m
            if m * pb < len(child.tokens):
                break
            node = child
        return out

    def usable_end(self, path: list[tuple[Node, int]]) -> int:
        """Pages of the longest prefix of ``path`` that would be usable with every host copy on
        device: the SWA rule of a match, where a page's SWA counts if it is live on device or has a
        host copy."""
        if not self.swa_enabled:
            return sum(m for _, m in path)
        wp = self.window_pages
        best = i = run = 0
        tomb = False
        for node, m in path:
            if node.swa is not None or node.host_swa is None:
                if node.swa is not None:
                    run += m
                    i += m
                    if not tomb or run >= wp:
                        best = i
                else:
                    tomb, run = True, 0
                    i += m
                continue
            hs = node.host_swa
            j = 0
            while j < m:  # by runs: at a page of one token a node has thousands of pages
                z = next_zero(hs, j, m)
                if z > j:  # pages [j, z) have SWA copies on host
                    run += z - j
                    i += z - j
                    if not tomb or run >= wp:
                        best = i
                j = next_nonzero(hs, z, m)  # pages [z, j) have none
                if j > z:
                    tomb, run = True, 0
                    i += j - z
        return best

    def plan_load(self, namespace: str, tokens: bytes, device_len: int
                  ) -> LoadPlan | None:
        """What a load of ``tokens`` copies, or None when host holds nothing past ``device_len``
        tokens (the usable device prefix) that would be usable."""
        path = self.walk(namespace, tokens)
        end = self.usable_end(path)
        if end * self.page_size <= device_len:
            return None
        ws = max(0, end - self.window_pages) if self.swa_enabled else end
        full: list[tuple[int, int]] = []
        swa: list[tuple[int, int]] = []
        anchor = path[0][0]
        i = 0
        for node, m in path:
            if i >= end:
                break
            anchor = node
            k = min(m, end - i)
            if node.full is None:
                # (sliced, not indexed: a compact list finds a position by bisection)
                full.extend(zip(range(i, i + k), node.host[:k], strict=True))  # type: ignore[index]
            if self.swa_enabled and node.swa is None and i + k > ws:
                hs = node.host_swa
                for j in range(max(0, ws - i), k):
                    swa.append((i + j, hs[j]))  # type: ignore[index]
            i += k
        return LoadPlan(end, full, swa, anchor)

    def commit_load(self, namespace: str, tokens: bytes, plan: LoadPlan,
                    full_pages: dict[int, int], swa_pages: dict[int, int]) -> int:
        """Give the host-only pages of the plan's path the device pages now holding their copy, and
        revive the window's SWA. Consumes the entries it uses from ``full_pages``/``swa_pages``
        (page index -> device page); what is left there was not needed (another request put the
        same pages on device meanwhile) and is the caller's to free. Returns pages made resident."""
        end = plan.end
        swa_on = self.swa_enabled
        ws = max(0, end - self.window_pages) if swa_on else end
        loaded = 0
        for child, a, m in self._cut_path(self.namespace(namespace).root, tokens, end):
            b = a + m
            if swa_on and a < ws < b and child.swa is None:
                up = self._split(child, ws - a)
                loaded += self._resident(up, a, ws, ws, full_pages, swa_pages)
                a = ws
            loaded += self._resident(child, a, b, ws, full_pages, swa_pages)
        return loaded

    def _cut_path(self, root: Node, tokens: bytes, end: int
                  ) -> Iterator[tuple[Node, int, int]]:
        """The cached path of the first ``end`` pages of ``tokens`` as (node, first page, pages),
        each node split so that it ends where the match does. A caller may split a yielded node
        again: the lower part keeps the object, so the walk goes on from it."""
        pb = self.page_bytes
        node, i = root, 0
        while i < end and node.children:
            child = node.children.get(tokens[i * pb : (i + 1) * pb])
            if child is None:
                return
            m = self._matched_pages(child, tokens, i * pb, end - i)
            if m * pb < len(child.tokens):
                child = self._split(child, m)
            yield child, i, m
            node, i = child, i + m

    def _resident(self, n: Node, a: int, b: int, ws: int, full_pages: dict[int, int],
                  swa_pages: dict[int, int]) -> int:
        """Node ``n`` covers pages [a, b): make it resident from the copies, if it is not."""
        swa = _take(swa_pages, a, b) if self.swa_enabled and n.swa is None and a >= ws else None
        if n.full is None:
            full = _take(full_pages, a, b)
            if full is None:  # pragma: no cover - a pinned path cannot lose what the plan saw
                raise AssertionError(f"load: no device copy for host-only pages [{a}, {b})")
            self._set_device(n, full, swa)
            return b - a
        if swa is not None:
            if n.swa_lock:  # pragma: no cover - tombstones are never SWA-locked
                raise AssertionError(f"SWA-locked tombstone {n!r}")
            n.swa = swa
            n.swa_ts = self._clock
            self._dense_ids(n)
            self._count_swa(n, len(swa))
            n.ns.swa_pages += len(swa)
            self._requeue(n)
        return 0

    def host_prefix(self, namespace: str, tokens: bytes) -> tuple[int, Node | None]:
        """Pages of the longest prefix of ``tokens`` whose every node has a host copy (so L3 pages
        can be attached under it), and the node holding its last page."""
        i = 0
        last = None
        for node, m in self.walk(namespace, tokens):
            if node.host is None:
                break
            i += m
            last = node
        return i, last

    def adopt_host(self, namespace: str, tokens: bytes, start: int, end: int,
                   slots: dict[int, int], swa_slots: dict[int, int], *, used: int | None = None
                   ) -> tuple[int, int]:
        """Attach host copies fetched from L3 for pages [start, end) of ``tokens``.

        Nodes that exist without a host copy get one; a missing SWA copy is filled in; pages past
        the cached path become new host-only nodes. The prefix [0, start) must still have host
        copies. Consumes the used entries of ``slots``/``swa_slots`` (page index -> host slot);
        the rest are the caller's to release. Returns (pages attached, SWA copies attached).
        ``used``: when the new node was last used, on the churn clock (a warm restart's saved
        recency; may lie before the clock's start); None: now."""
        pb = self.page_bytes
        ns = self.namespace(namespace)
        node = ns.root
        i = 0  # the first page past the walked path
        got = got_swa = 0
        for child, a, m in self._cut_path(ns.root, tokens, end):
            if child.host is None:
                hs = _take(slots, a, a + m) if a >= start else None
                if hs is None:
                    return got, got_swa  # a hole in the host prefix: nothing below can attach
                sw = array("i", (swa_slots.pop(k, 0) for k in range(a, a + m)))
                self._give_host(child, hs, sw)
                self._requeue(child)
                got += m
                got_swa += sum(1 for p in sw if p)
            elif a >= start:
                got_swa += self._fill_swa(child, a, swa_slots)
            node, i = child, a + m
        if i >= end or i < start:
            return got, got_swa
        stop = i
        while stop < end and stop in slots:
            stop += 1
        if stop == i:
            return got, got_swa
        sw = array("i", (swa_slots.pop(k, 0) for k in range(i, stop)))
        self._new_host_node(node, tokens[i * pb : stop * pb], _take(slots, i, stop), sw,
                            used)  # type: ignore[arg-type]
        return got + stop - i, got_swa + sum(1 for p in sw if p)

    def adopt_host_under(self, parent: Node, seg: bytes, slots: array, swa_slots: array, *,
                         used: int | None = None) -> Node | None:
        """A new host-only child of ``parent`` holding ``seg`` (whole pages) in host slots
        ``slots`` (``swa_slots``: 0 for a page without an SWA copy): a warm restart rebuilds its
        tree parent before child, so it attaches each node under the one it made last, with no
        walk from the root (which made a path thousands of nodes deep quadratic). None, taking
        nothing, when ``parent`` (not a root) has no host copy, already has a child of that
        first page, or the lengths disagree."""
        pb = self.page_bytes
        k = len(seg) // pb
        if (parent.parent is not None and parent.host is None) or not k or len(seg) != k * pb \
                or len(slots) != k or len(swa_slots) != k \
                or (parent.children is not None and seg[:pb] in parent.children):
            return None
        return self._new_host_node(parent, seg, slots, swa_slots, used)

    def _new_host_node(self, node: Node, seg: bytes, slots: array, swa_slots: array,
                       used: int | None) -> Node:
        new = Node(self._new_id(), node, node.ns, seg,
                   block_hashes(*self.chain_state(node), seg, self.block_bytes))
        if node.children is None:
            node.children = {}
        node.children[seg[: self.page_bytes]] = new
        self.nodes[new.id] = new
        self._give_host(new, slots, swa_slots)
        new.ts = self._clock if used is None else used
        self._requeue(new)
        self._requeue(node)
        return new

    def _fill_swa(self, n: Node, a: int, swa_slots: dict[int, int]) -> int:
        """Missing SWA copies of a node that has a host copy, from fetched slots."""
        k = len(n.tokens) // self.page_bytes
        hs = array("i", n.host_swa if n.host_swa is not None else bytes(4 * k))
        filled = 0
        for j in range(k):
            if not hs[j] and (a + j) in swa_slots:
                hs[j] = swa_slots.pop(a + j)
                filled += 1
        if filled:
            n.host_swa = host_swa_ids(hs, self.swa_lead_min)
            self.host_swa_pages += filled
            self._requeue(n)  # a host leaf that holds SWA host slots now
        return filled
