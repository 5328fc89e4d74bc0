"""The host tier of one model: its full and SWA host pools, and the slots a copy is still filling.

The tree records which node holds which host slot; this object owns the memory and the slot
references, and is the tree's :class:`~daemon.tree.radix.HostSink`: slots the tree lets go of
come back here. A slot handed out by :meth:`take` is *pending* until the copy that fills it is
done (:meth:`filled`): it is indexed by its hash at once (``HostPool.store``), so the pending set
is what keeps anyone from reading it early, and what the conservation check counts as "in flight".

Memory isolation (``segment_pages``): both pools are built from segments and every slot is taken
for a namespace (:meth:`take`'s ``ns``), from that namespace's segments only (daemon.storage.
host_pool); :meth:`space` is the allocator key of a namespace, :meth:`generation` what
``kv_attach`` results report so that engines map the segments their namespace gains.
"""

from __future__ import annotations

import asyncio
from array import array
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from daemon.gpu.allocator import AUDIT_STEP_SLOTS, OutOfPages, as_page_array, nonzero_ids
from daemon.gpu.profile import ModelProfile
from daemon.tree import chunked

from .host_pool import MARK_HELD, HostPool


class HostTier:
    def __init__(self, profile: ModelProfile, full_pages: int, swa_pages: int,
                 *, pin_memory: bool | None = None, segment_pages: int | None = None) -> None:
        """``segment_pages``: slots per segment, each serving one namespace (memory isolation);
        None: one pool every namespace shares."""
        self.isolated = segment_pages is not None
        self.segment_pages = segment_pages
        self.full = HostPool(profile, full_pages, "full", pin_memory=pin_memory,
                             segment_pages=segment_pages)
        self.swa: HostPool | None = None
        if profile.sliding_window is not None and profile.num_swa_layers and swa_pages:
            try:
                self.swa = HostPool(profile, swa_pages, "swa", pin_memory=pin_memory,
                                    segment_pages=segment_pages)
            except BaseException:
                self.full.close()
                raise
        self.pending: dict[str, set[int]] = {"full": set(), "swa": set()}
        # pending full slots per namespace: a tenant's host quota counts them, so that copies
        # planned together or running at once cannot each fit the quota alone. Kept per batch
        # (the callers name the namespace of the slots they fill or drop), never per slot
        self.pending_full: dict[str, int] = {}
        # references taken by readers that outlive the tree's hold (the L3 writer)
        self.readers: dict[str, Counter[int]] = {"full": Counter(), "swa": Counter()}
        # slots the key-addressed store (daemon/keyed_tier.py) holds, one reference each
        self.keyed: dict[str, set[int]] = {"full": set(), "swa": set()}
        # slots let go of by the tree or the keyed store while a reader still held them: free
        # once the readers let go too, so room that is coming (see coming_to)
        self.orphans: dict[str, set[int]] = {"full": set(), "swa": set()}
        self._unhold_waiters: list[asyncio.Future[None]] = []
        self._filled = 0  # calls of filled(): see changes

    @property
    def changes(self) -> int:
        """Grows with every change of what :meth:`audit` reads (the pools' slots and references,
        the pending set): part of the checker's state version, so that a stepped audit spanning
        a change is given up (daemon/service_checks.py). Every other change here takes or gives
        back a pool reference, which the pool counts."""
        return self._filled + sum(p.changes for p in self.pools())

    def pool(self, kind: str) -> HostPool:
        p = self.full if kind == "full" else self.swa
        if p is None:
            raise ValueError(f"no {kind} host pool")
        return p

    def pools(self) -> list[HostPool]:
        return [p for p in (self.full, self.swa) if p is not None]

    def space(self, ns: str) -> str:
        """The slot allocators' key for namespace ``ns``: itself when isolated, else shared."""
        return ns if self.isolated else ""

    def generation(self, ns: str) -> int:
        """Grows whenever ``ns`` is given a host segment it did not serve last: an engine whose
        host mapping is older attaches again (``kv_attach``; docs/protocol.md). 0 when shared."""
        if not self.isolated:
            return 0
        return sum(p.allocator.generations.get(ns, 0) for p in self.pools())

    def available_to(self, kind: str, ns: str) -> int:
        """Free slots of ``kind`` namespace ``ns`` can take now."""
        p = self.full if kind == "full" else self.swa
        return p.available_to(self.space(ns)) if p is not None else 0

    # -- slots ----------------------------------------------------------------------------------

    def take(self, kind: str, count: int, ns: str) -> array:
        """``count`` new pending slots of namespace ``ns`` for the tree's copies, all or none
        (OutOfPages). They carry no hash: the tree is their index."""
        pool = self.pool(kind)
        key = self.space(ns)
        free = pool.available_to(key)
        if count > free:
            raise OutOfPages(f"{kind} host pool: {count} slots wanted, {free} free to "
                             f"namespace {ns!r}", requested=count, available=free)
        out = pool.store_unnamed(count, key)  # all or none: a segment that could not get
        # fresh memory takes nothing
        self.pending[kind].update(out)
        if kind == "full":
            self.pending_full[ns] = self.pending_full.get(ns, 0) + len(out)
        return out

    def _settle(self, kind: str, ns: str | None, before: int) -> None:
        """``ns``'s pending full slots less those that just left the pending set (it held
        ``before``)."""
        gone = before - len(self.pending[kind])
        if kind != "full" or not gone:
            return
        if ns is None:
            raise ValueError("pending full host slots settled without their namespace")
        left = self.pending_full[ns] - gone
        if left:
            self.pending_full[ns] = left
        else:
            del self.pending_full[ns]

    def filled(self, kind: str, slots: Iterable[int], ns: str | None = None) -> None:
        """The copy into these slots (of namespace ``ns``) is done: they may be read."""
        self._filled += 1
        before = len(self.pending[kind])
        self.pending[kind].difference_update(slots)
        self._settle(kind, ns, before)

    def drop(self, kind: str, slots: Iterable[int], ns: str | None = None) -> None:
        """Release slots nobody adopted (pending or not; pending full ones are namespace
        ``ns``'s); 0 entries mean "no slot". Listed as one int32 array (a node's runs too),
        which the pool releases in numpy."""
        live = nonzero_ids(as_page_array(slots))
        if not live:
            return
        self.pool(kind).release_many(live)  # checks every slot before anything changes
        before = len(self.pending[kind])
        self.pending[kind].difference_update(live)
        self._settle(kind, ns, before)
        self.let_go(kind, live)

    def let_go(self, kind: str, slots: Sequence[int]) -> None:
        """Their owner (the tree, the keyed store) has released these slots: those a reader
        still holds are orphans, free once it lets go."""
        readers = self.readers[kind]
        if not readers:
            return
        pool = self.pool(kind)
        self.orphans[kind].update(s for s in readers.keys() & set(slots)
                                  if pool.refcount(s) == readers[s])

    def hold(self, kind: str, slots: Iterable[int]) -> list[int]:
        """One more reference on each slot, so its bytes stay valid after the tree drops it."""
        live = [s for s in slots if s]
        if not live:
            return []
        pool = self.pool(kind)
        out = []
        for s in live:
            if pool.refcount(s) and s not in self.pending[kind]:
                pool.hold(s)
                self.readers[kind][s] += 1
                out.append(s)
        return out

    def unhold(self, kind: str, slots: Iterable[int]) -> None:
        slots = list(slots)
        self.pool(kind).release_many(slots)  # checks every slot before anything changes
        readers = self.readers[kind]
        for s in slots:
            readers[s] -= 1
            if not readers[s]:
                del readers[s]
        orphans = self.orphans[kind]
        if orphans:
            pool = self.pool(kind)
            orphans.difference_update([s for s in slots if not pool.refcount(s)])
        waiters, self._unhold_waiters = self._unhold_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def unheld(self) -> asyncio.Future[None]:
        """A future resolved at the next :meth:`unhold`: a slot whose page was let go of while a
        reader held it is free from then on, so a caller short of slots may find room again.
        Registered at once, so an unhold between this call and the caller's await is not
        missed; a waiter given up (cancelled, as by a timeout) is dropped at the next call."""
        waiter = asyncio.get_running_loop().create_future()
        self._unhold_waiters = [w for w in self._unhold_waiters if not w.done()]
        self._unhold_waiters.append(waiter)
        return waiter

    def coming_to(self, kind: str, ns: str) -> int:
        """Slots of ``kind`` that namespace ``ns`` gets once the readers (Redis writes) holding
        the orphans let go. When isolated, the orphans in ``ns``'s segments, and the whole
        segments of others that hold nothing else."""
        orphans = self.orphans[kind]
        if not self.isolated or not orphans:
            return len(orphans)
        alloc = self.pool(kind).allocator
        out = 0
        for seg, n in Counter(map(alloc.segment_of, orphans)).items():
            if alloc.owner[seg] == ns:
                out += n
            elif alloc.used_in(seg) == n:  # it empties onto the free list, which ns may take
                out += len(alloc.segment_range(seg)) - (seg == 0)
        return out

    def available(self, kind: str) -> int:
        p = self.full if kind == "full" else self.swa
        return p.available if p is not None else 0

    # -- the tree's HostSink ----------------------------------------------------------------------

    def free_host(self, slots: Sequence[int]) -> None:
        self.drop("full", slots)

    def free_host_swa(self, slots: array) -> None:
        self.drop("swa", slots)

    # -- checking and reporting -------------------------------------------------------------------

    def audit(self, in_tree: Mapping[str, Collection[int]]) -> list[str]:
        """Conservation per host pool: every held slot is in the tree or pending, never both."""
        v: list[str] = []
        for _ in self.audit_steps(in_tree, v):
            pass
        return v

    def audit_steps(self, in_tree: Mapping[str, Collection[int]], v: list[str]
                    ) -> Iterator[None]:
        """:meth:`audit` into ``v``, yielding after each bounded piece of work (at most
        :data:`~daemon.gpu.allocator.AUDIT_STEP_SLOTS` slots), so that the background checker
        never holds a request back for a whole host pool (daemon/checker.py). ``in_tree``: per
        pool kind, the host slots the tree holds (a set, or the tree audit's page marks: any
        collection whose membership test is O(1))."""
        for kind, pool in (("full", self.full), ("swa", self.swa)):
            tree = in_tree.get(kind) or set()
            if pool is None:
                if tree:
                    v.append(f"{kind} host slots in the tree but no {kind} host pool")
                continue
            marks = bytearray(pool.capacity)
            yield from pool.audit_steps(v, marks)  # leaves MARK_HELD on every held slot
            pend = self.pending[kind]
            readers = self.readers[kind]
            keyed = self.keyed[kind]
            named = pool.slot_hashes()
            wrong: tuple[int, int, int] | None = None  # the first miscounted slot
            tree_held = 0  # held slots in the tree
            tree_named: list[int] = []  # tree copies are the tree's to index, never hashed
            stray = False  # a held slot nothing accounts for
            for chunk in pool.reference_counts().item_chunks(AUDIT_STEP_SLOTS):
                for s, n in chunk:
                    t = s in tree
                    tree_held += t
                    if t and s in named:
                        tree_named.append(s)
                    want = t + (s in pend) + readers.get(s, 0) + (s in keyed)
                    if wrong is None and n != want:
                        wrong = (s, n, want)
                    if not want and s not in readers:  # (only readers count below 0)
                        stray = True
                yield
            if tree_named:
                v.append(f"{kind} host slots {sorted(tree_named)[:10]} are in the tree and "
                         "indexed under a hash (only keyed pages are)")
            if wrong is not None:
                s, n, want = wrong
                v.append(f"{kind} host slot {s}: {n} references, the tree, copies and readers "
                         f"account for {want}")
            both: list[int] = []
            for chunk in chunked(pend, AUDIT_STEP_SLOTS):
                both += (s for s in chunk if s in tree)
                stray |= _unheld(chunk, marks)
                yield
            if both:
                v.append(f"{kind} host slots {sorted(both)[:10]} are in the tree and pending a "
                         "copy")
            if kind == "full" and sum(self.pending_full.values()) != len(pend):
                v.append(f"pending full host slots {len(pend)} != those of the namespaces "
                         f"{self.pending_full}")
            both = []
            for chunk in chunked(keyed, AUDIT_STEP_SLOTS):
                both += (s for s in chunk if s in tree or s in pend)
                stray |= _unheld(chunk, marks)
                yield
            if both:
                v.append(f"{kind} host slots {sorted(both)[:10]} are keyed and in the tree or "
                         "pending")
            orphans = self.orphans[kind]
            wrong_orphans: list[int] = [s for s in orphans if s not in readers]
            for chunk in chunked(readers, AUDIT_STEP_SLOTS):
                stray |= _unheld(chunk, marks)
                wrong_orphans += (s for s in chunk
                                  if (pool.refcount(s) == readers[s]) != (s in orphans))
                yield
            if wrong_orphans:
                v.append(f"{kind} host slots {sorted(wrong_orphans)[:10]}: counted as orphans "
                         "(only readers hold them) or not, wrongly")
            n_tree = len(tree)
            if stray or tree_held != n_tree:  # the report: a rare path, in one step
                held = pool.held()
                accounted = set(tree) | pend | set(readers) | keyed
                v.append(f"{kind} host pool: held {len(held)} != tree {n_tree} + pending "
                         f"{len(pend)} + read {len(readers)} + keyed {len(keyed)}; unaccounted "
                         f"{sorted(held ^ accounted)[:10]}")

    def audit_owners(self, kind: str, slots: Iterable[int], ns: str, what: str) -> list[str]:
        """Isolated: every slot of ``slots`` lies in a host segment of namespace ``ns``."""
        if not self.isolated:
            return []
        return self.pool(kind).audit_owners(slots, ns, what)

    def audit_tree_owners_steps(self, nodes: Iterable[Any], v: list[str]) -> Iterator[None]:
        """Isolated: the host copies of every tree node (``daemon.tree.Node``, duck-typed: the
        tree sits above storage) lie in host segments of the node's namespace; into ``v``,
        yielding between bounded steps (the checker's stepped pass)."""
        if not self.isolated:
            return
        bad: dict[tuple[str, str], set[int]] = {}
        for i, n in enumerate(list(nodes)):
            if not i % 16:
                yield
            if n.ns is None:
                continue
            for kind, slots in (("full", n.host), ("swa", n.host_swa)):
                if slots and (kind == "full" or self.swa is not None):
                    # (a node's host slot ids have no 0: listed as they are, runs in numpy)
                    self.pool(kind).allocator.misplaced(
                        slots if kind == "full" else (s for s in slots if s), n.ns.name,
                        bad.setdefault((kind, n.ns.name), set()))
        for (kind, ns), segs in bad.items():
            v += self.pool(kind).allocator.audit_owners(ns, f"tree {kind} host slots", segs)

    def describe(self) -> dict[str, Any]:
        out = {"full": self.full.describe()}
        if self.swa is not None:
            out["swa"] = self.swa.describe()
        out["pending"] = {k: len(v) for k, v in self.pending.items()}
        out["read"] = {k: len(v) for k, v in self.readers.items()}
        out["keyed"] = {k: len(v) for k, v in self.keyed.items()}
        return out

    def close(self) -> None:
        self.full.close()
        if self.swa is not None:
            self.swa.close()


def _unheld(slots: list[int], marks: bytearray) -> bool:
    """Whether a slot of ``slots`` holds no page, by the marks of ``HostPool.audit_steps``."""
    cap = len(marks)
    return any(not (isinstance(s, int) and 0 < s < cap and marks[s] & MARK_HELD) for s in slots)
