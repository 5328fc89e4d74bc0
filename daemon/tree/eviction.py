"""Eviction: which device pages go, and what becomes of their nodes (demoted to host, tombstoned,
or deleted).

Eviction that wants host copies is two-phase, so that no copy (I/O, a device synchronisation)
runs from inside the tree and nothing re-enters the tree while it evicts:

1. the tree names the victims: when an eviction (or the cleanup of an unlock or unpin) reaches a
   device node without a host copy that ``host_copy_hits`` says belongs on host, it stops before
   touching it and appends it to ``awaiting_copy``; :meth:`Eviction.evict` returns early;
2. the tier layer copies each named node to host (``set_host``), or declines;
3. :meth:`Eviction.commit_evictions` takes their device pages: demoted when they now have a host
   copy, deleted when not. The cleanup the commit goes on with may name more nodes; the caller
   repeats 2 and 3 until none is left, then resumes its eviction for what is still missing.

The tree stops at the node it names, before touching it, so the order of victims, splits and
cleanups is that of an eviction that never stops (tests/tree/test_eviction.py checks it).
"""

from __future__ import annotations

from array import array

from .errors import BadArgument
from .node import EMPTY, Node
from .page_ids import PageIds, host_swa_ids, nonzero, nonzero_count
from .results import EvictResult, Namespace

#: most host leaves an eviction for SWA host slots looks at, past the ones that hold some, for
#: one over an ancestor's window (each costs two queue operations on the event loop)
SHIELD_LOOK = 64


class Eviction:
    """The eviction half of :class:`~daemon.tree.radix.RadixTree` (a mixin: it shares the tree's
    state)."""

    # ------------------------------------------------------------------ eviction

    def _pop(self, kind: str, namespace: Namespace | None) -> Node | None:
        """The next victim of one kind: from one namespace, or the best across all of them."""
        if namespace is not None:
            return getattr(namespace, kind).pop()
        best = None
        best_entry = None
        for ns in self.namespaces.values():
            q = getattr(ns, kind)
            top = q.top()
            if top is not None and (best_entry is None or top[:2] < best_entry[:2]):
                best, best_entry = q, top
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
            if not self._evict_leaf(node, res):
                return self._count_reason(reason, res)
        while res.swa_pages < swa_pages:
            node = self._pop("swa_q", ns)
            if node is None:
                break
            need = swa_pages - res.swa_pages
            np_ = len(node.tokens) // self.page_bytes
            if node.full_lock == 0 and node.dev_children == 0 and np_ <= need:
                if not self._evict_leaf(node, res):
                    break
                continue
            if np_ > need:
                # tombstone the upper part and keep the tail, which holds the window, live
                up = self._split(node, need)
                self._requeue(node)
                node = up
            # a locked leaf may become a tombstone here (its reader released the SWA early);
            # it is cleaned up when its last full lock goes
            self._tombstone(node, res)
        return self._count_reason(reason, res)

    def _count_reason(self, reason: str | None, res: EvictResult) -> EvictResult:
        if reason is not None:
            by = self.evictions_by_reason.setdefault(reason, [0, 0])
            by[0] += res.full_pages
            by[1] += res.swa_pages
        return res

    def commit_evictions(self, reason: str | None = None) -> EvictResult:
        """Phase 3: take the device pages of every node in ``awaiting_copy`` (demoted if the
        tiers gave it a host copy, deleted if not) and go on with the cleanup each one started.
        ``reason`` counts the pages like :meth:`evict` does (None for the cleanup of an unlock
        or unpin, which counts nowhere)."""
        res = EvictResult()
        nodes, self.awaiting_copy = self.awaiting_copy, []
        for n in nodes:
            if (self.nodes.get(n.id) is not n or n.full is None or n.full_lock or n.pin
                    or n.dev_children):  # pragma: no cover - nothing runs between the phases
                raise AssertionError(f"{n!r} changed while it waited for its host copy")
            self._evict_leaf(n, res, committed=True)
        return self._count_reason(reason, res)

    def wants_host_copy(self, n: Node) -> bool:
        """Whether eviction must offer ``n`` to the tiers before it loses its device pages."""
        hits = self.host_copy_hits
        return hits is not None and n.host is None and n.hits >= hits

    def release_host_drops(self) -> None:
        """Free the host slots of the leaves in ``host_drops`` (kept there, with their slots
        held, only under ``report_host_drops``), once the tiers have read them: an L3
        write-back of a page leaving host is the two-phase eviction of the host tier."""
        drops, self.host_drops = self.host_drops, []
        for n in drops:
            hs = n.host_swa
            self._free_host_slots(n.host,  # type: ignore[arg-type]
                                  nonzero(hs) if hs is not None else EMPTY)

    def _free_host_slots(self, host: PageIds, hswa: array) -> None:
        if self.host_sink is not None:
            self.host_sink.free_host(host)
            if hswa:
                self.host_sink.free_host_swa(hswa)

    def evict_host(self, slots: int, namespace: str | None = None, swa_slots: int = 0
                   ) -> EvictResult:
        """Drop host-only leaves until ``slots`` full and ``swa_slots`` SWA host slots are free:
        the coldest leaves while full slots are short, then the coldest of those that hold SWA
        host slots (most hold none: only a node's trailing window is copied, and a leaf without
        any would give up its full host pages for nothing needed here). With none of those
        left, a leaf without any goes when a host-only ancestor holds some (a window copied
        before the leaf's own copy found no SWA slot), so that no window stays out of reach;
        at most :data:`SHIELD_LOOK` other leaves are looked at, and stay."""
        res = EvictResult()
        ns = self.namespaces.get(namespace) if namespace is not None else None
        if namespace is not None and ns is None:
            return res
        passed: list[Node] = []
        while res.host_slots < slots or res.host_swa_slots < swa_slots:
            if res.host_slots < slots:
                node = self._pop("host_q", ns)
            else:
                node = self._pop("host_swa_q", ns) or self._shielding_leaf(ns, passed)
            if node is None:
                break
            self._delete_host_leaf(node, res)
        for n in passed:
            self._requeue(n)
        return res

    def _shielding_leaf(self, ns: Namespace | None, passed: list[Node]) -> Node | None:
        """The coldest host leaf with a host-only ancestor that holds SWA host slots; the leaves
        looked at before it join ``passed`` (at most SHIELD_LOOK in all)."""
        while len(passed) < SHIELD_LOOK:
            node = self._pop("host_q", ns)
            if node is None:
                return None
            a = node.parent
            while a.parent is not None and a.full is None:  # (host-only ancestors)
                if a.host_swa is not None:
                    return node
                a = a.parent
            passed.append(node)
        return None

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

    def _evict_leaf(self, n: Node, res: EvictResult, committed: bool = False) -> bool:
        """Free the device KV of an unlocked device leaf, demote or delete it, clean upward.

        False when it stopped at a node the tiers want a copy of first (now in
        ``awaiting_copy``); ``committed``: ``n`` already had its chance to be copied."""
        while True:
            parent = n.parent
            if not committed and self.wants_host_copy(n):
                # named once: a cleanup that climbed here already may name it again (an unpin
                # checks every node it guarded, a child's cleanup first)
                if n not in self.awaiting_copy:
                    self.awaiting_copy.append(n)
                return False
            committed = False
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
                return True
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
        host = n.host
        hswa = nonzero(n.host_swa) if n.host_swa is not None else EMPTY
        if self.report_host_drops:
            self.host_drops.append(n)  # detached below; its slots stay held until released
        else:
            self._free_host_slots(host, hswa)
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

    # ------------------------------------------------------------------ host copies

    def set_host(self, node_id: int, slots: array, swa_slots: array | None = None) -> None:
        """Record that a device node now has a host copy (its parent must have one already).

        ``swa_slots`` are the host copies of its SWA pages, 0 for a page without one. The node
        keeps ``slots`` in the page-id codec's compact form where it has one (a host copy is
        made of the host pool's ascending runs); ``host_swa`` drops its leading zeros where they
        are many (:func:`~daemon.tree.page_ids.host_swa_ids`)."""
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
        # kept compact from the start, hot or cold: no match or insert reads host slot ids, only
        # a load and the tiers' copies, each of which moves far more bytes than it lists ids
        codec = self.page_ids
        n.host = codec.compact(slots) if len(slots) >= codec.min_ids else slots
        self.host_pages += len(slots)
        n.ns.host_pages += len(slots)
        hs = host_swa_ids(swa_slots, self.swa_lead_min) if swa_slots is not None else None
        if hs is not None:
            n.host_swa = hs
            self.host_swa_pages += nonzero_count(hs)
