"""The service's invariant checks: the complete check, the same check in bounded steps for the
background checker (daemon/checker.py), the state version a stepped pass compares between its
slices, the O(1) counter check; and the handler decorators that count the operations that
change what the check reads. A mixin of :class:`daemon.service.Service`, as the query API is."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from .holdings import is_load_owner
from .queries import held_pages
from .tree import chunked

if TYPE_CHECKING:
    from .entities import ModelEntry, Session

T = TypeVar("T")

log = logging.getLogger("radixd.service")


def mutating(handler: Callable[..., T]) -> Callable[..., T]:
    """A handler that changes what the invariant check reads counts in ``mutations``, part of
    :meth:`ServiceChecks.state_version`: a stepped check spanning it is given up. (Counters
    alone miss changes that leave them as they were: an alloc and a free of one page each, an
    unlock and a lock of the same path.)"""

    @functools.wraps(handler)
    def counted(self: ServiceChecks, s: Session, r: Any) -> T:
        self.mutations += 1
        return handler(self, s, r)

    return counted


def mutating_async(handler: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """:func:`mutating` for a handler that waits: counted when it starts and when it ends."""

    @functools.wraps(handler)
    async def counted(self: ServiceChecks, s: Session, r: Any) -> T:
        self.mutations += 1
        try:
            return await handler(self, s, r)
        finally:
            self.mutations += 1

    return counted


class ServiceChecks:
    """What :class:`daemon.service.Service` checks; it provides ``models`` and ``sessions``."""

    models: dict[str, ModelEntry]
    sessions: dict[int, Session]
    #: operations that changed what the check reads (:func:`mutating`)
    mutations: int = 0

    def check(self, *, deep: bool = True) -> list[str]:
        """Every invariant of every model, plus sessions: each owner must be a live session."""
        v: list[str] = []
        for _ in self.check_steps(v, deep=deep):
            pass
        return v

    def check_steps(self, v: list[str], *, deep: bool = True) -> Iterator[None]:
        """:meth:`check` into ``v`` in bounded steps, for the background checker, which runs
        them between requests and gives the pass up when :meth:`state_version` moved between
        two of them (daemon/checker.py)."""
        for name, entry in self.models.items():
            mv: list[str] = []
            yield from entry.cache.check_steps(mv, deep=deep)
            if entry.keyed is not None:
                yield from entry.keyed.check_steps(set(self.sessions), mv)
            v += [f"{name}: {x}" for x in mv]
            ghosts: list[Any] = []
            for chunk in chunked(entry.cache.holdings):  # (a thousand sessions: 16 steps)
                ghosts += [o for o in chunk if o not in self.sessions and not is_load_owner(o)]
                yield
            if ghosts:
                v.append(f"{name}: pages or receipts held by sessions that are gone: {ghosts[:10]}")
            yield

    def state_version(self) -> tuple:
        """A value that changes whenever the state the full check reads changes: the trees'
        change counters and clocks, page counters, pools, holdings, host slots and the host
        tier's change count, the keyed store's change count and counters, and the sessions. (A
        change that leaves all of them as they were is possible in principle: the checker
        confirms what a stepped pass finds with a complete check.)"""
        out: list[Any] = [self.mutations, len(self.sessions), next(reversed(self.sessions), 0)]
        for entry in self.models.values():
            c = entry.cache
            t = c.tree
            a = c.alloc_state
            out += (t.changes, t.clock, t.full_evictable, t.full_protected, t.swa_evictable,
                    t.swa_protected, t.host_pages, t.host_swa_pages, len(t.receipts),
                    len(t.pins), len(t.awaiting_copy), len(t.host_drops), a.full.available,
                    a.swa.available if a.swa is not None else 0, c.held_full_pages,
                    c.held_swa_pages, len(c.holdings))
            if c.host is not None:  # changes no tree counter sees (an L3 reader's reference,
                # a copy filled, a keyed slot) move c.host.changes
                out += (c.host.changes, c.host.full.available,
                        c.host.swa.available if c.host.swa is not None else 0)
            if entry.keyed is not None:
                out.append(entry.keyed.pages.changes)
                out += entry.keyed.counters.values()
        return tuple(out)

    def check_at_rest(self, busy: Collection[str] = ()) -> list[str]:
        """What must all be gone once no session is open and every tier job has ended (the
        stop, after its drain): a lock, pin, holding, reserved or read host slot left then
        belongs to nobody and would never have been given back while serving (a leak that
        evictions cannot reach). ``busy``: models a job may still use (a wait-operation that
        did not end, a drain that failed), left out, as is a model with a tier copy the stop
        could not end; the others are checked all the same. What is left out is logged."""
        v: list[str] = []
        skipped = [name for name, entry in self.models.items()
                   if name in busy or (entry.tiers is not None
                                       and (entry.tiers.stuck or entry.tiers.copying))]
        if skipped:
            log.warning("the check at rest leaves out %s: a job may still hold what it took",
                        ", ".join(map(repr, skipped)))
        for name, entry in self.models.items():
            if name in skipped:
                continue
            c = entry.cache
            t = c.tree
            left = {"tree locks": len(t.receipts), "tree pins": len(t.pins),
                    "nodes awaiting a host copy": len(t.awaiting_copy),
                    "owners holding pages": len(c.holdings)}
            if c.host is not None:
                for kind in ("full", "swa"):
                    left[f"{kind} host slots reserved, never filled"] = len(c.host.pending[kind])
                    # counted per slot: a negative count (one release too many) must not
                    # hide another slot's leaked reader
                    left[f"{kind} host slot readers"] = sum(
                        1 for n in c.host.readers[kind].values() if n)
            if entry.keyed is not None:
                left["keyed pins"] = len(entry.keyed.pages.pins)
            v += [f"{name}: {n} {what} left with no session or job" for what, n in left.items()
                  if n]
        return v

    def quick_check(self) -> list[str]:
        """O(1) counter check for busy periods: free + tree + held = capacity, per pool."""
        v: list[str] = []
        for name, entry in self.models.items():
            c = entry.cache
            a = c.alloc_state
            tree_full, tree_swa = c.tree.device_pages()
            held_full, held_swa = held_pages(c)
            if a.full.available + tree_full + held_full != a.full.usable:
                v.append(f"{name}: full pool free {a.full.available} + tree {tree_full} + held "
                         f"{held_full} != {a.full.usable}")
            if a.swa is not None and a.swa.available + tree_swa + held_swa != a.swa.usable:
                v.append(f"{name}: swa pool free {a.swa.available} + tree {tree_swa} + held "
                         f"{held_swa} != {a.swa.usable}")
        return v

