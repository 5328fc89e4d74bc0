"""The Redis names of one model's keyed pages, and the kv_clear generations they include.

A keyed page's value in Redis is named by its content address and its namespace's **clear
generation** (docs/protocol.md 9.4), an integer kept in Redis under a key of its own. A
``kv_clear`` raises it, so that no value written before the clear is asked for again: those of
the pages still on host, which the store deletes, and those of pages evicted from host long ago,
of which it keeps no record. The generation is read before each fetch and each write batch (a
daemon sharing the Redis may have raised it), and put back if Redis lost it. Until a clear's
raise has reached Redis, the namespace's generation is unknown (None): nothing of it is read from
or written to Redis.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable

from .redis_tier import RedisTier

log = logging.getLogger("radixd.keyed")

#: a raise that Redis did not take is tried again after this many seconds, doubling up to the
#: most, until Redis answers
RAISE_RETRY_S = 0.05
RAISE_RETRY_MAX_S = 5.0
#: how long a write batch waits for a raise under way (its pages of that namespace are then
#: failed writes: named under the old generation, they would never be read)
RAISE_WAIT_S = 1.0


class KeyedNames:
    def __init__(self, model: str) -> None:
        self.model = model
        # salted with the model's name (as the tiers do for tree pages): two models of one
        # layout must not share values
        self._page_salt = b"radixd-l3-keyed\x00" + model.encode() + b"\x00"
        self._gen_salt = b"radixd-l3-keyed-gen\x00" + model.encode() + b"\x00"
        self._known: dict[str, int] = {}  # as last read from Redis or raised there
        # a raise under way, per namespace (one covers the clears that come meanwhile: nothing
        # of the namespace is written to Redis until it ends)
        self._raising: dict[str, asyncio.Task] = {}
        self._at_start: set[str] = set()  # raises a warm restart carried over
        self._learning: dict[str, asyncio.Task] = {}  # reads of a generation not yet known
        self._l3: RedisTier | None = None  # (from start: where learn reads)
        #: called with (namespace, generation) once this daemon's own raise has reached Redis
        self.on_raised: Callable[[str, int], None] | None = None

    def page_id(self, page_hash: bytes, gen: int) -> bytes:
        """A keyed page's id in Redis under clear generation ``gen`` (0 adds nothing: the name
        from before generations)."""
        h = hashlib.sha256(self._page_salt + page_hash)
        if gen:
            h.update(gen.to_bytes(8, "little"))
        return h.digest()

    def gen_key(self, ns: str) -> str:
        """The Redis key (after the key prefix) of the namespace's clear generation."""
        return "kvgen:" + hashlib.sha256(self._gen_salt + ns.encode()).hexdigest()

    def known(self, ns: str) -> int | None:
        """The namespace's generation as this daemon last knew it (None: never read)."""
        return self._known.get(ns)

    @property
    def raising(self) -> bool:
        """Whether a raise is under way (a shutdown's drain waits for it)."""
        return bool(self._raising)

    async def current(self, l3: RedisTier, ns: str) -> int | None:
        """The namespace's generation, read from Redis; never lower than this daemon knew it.
        None while a raise is under way, or when Redis does not answer."""
        if ns in self._raising or ns in self._at_start:
            return None
        got = await l3.counter(self.gen_key(ns), self._known.get(ns, 0))
        if got is None or ns in self._raising or ns in self._at_start:
            return None
        gen = self._known[ns] = max(got, self._known.get(ns, 0))
        return gen

    def stored_as(self, ns: str) -> int | None:
        """The generation a page of ``ns`` stored now is of (KeyedPage.gen): the one known, and
        0 while none is, so that a page stored before this daemon first read it counts as
        older than any clear (a miss if it was not: never stale KV). None while this daemon's
        own clear of ``ns`` is on its way to Redis: the one known is of before that clear."""
        return self._known.get(ns, 0) if self.raised(ns) else None

    def learn(self, ns: str) -> None:
        """Read the namespace's generation in the background if it is not known yet, so that
        the pages an engine is about to store are of the generation Redis holds, not of 0 (an
        engine looks keys up, or reserves, before it computes what it stores). Nothing before
        :meth:`start`, or without Redis."""
        if self._l3 is not None and ns not in self._known and ns not in self._learning:
            self._learning[ns] = asyncio.get_running_loop().create_task(
                self._learn(self._l3, ns), name=f"radixd-kv-gen-{self.model}")

    async def _learn(self, l3: RedisTier, ns: str) -> None:
        try:
            await self.current(l3, ns)
        finally:
            self._learning.pop(ns, None)

    async def to_write(self, l3: RedisTier, ns: str) -> int | None:
        """:meth:`current` for a write batch, which waits a little for a raise under way."""
        await self.wait_raised(ns, RAISE_WAIT_S)
        return await self.current(l3, ns)

    def raise_gen(self, l3: RedisTier, ns: str) -> None:
        """A kv_clear of ``ns``: raise its generation in Redis, in the background, trying again
        until Redis answers."""
        if ns not in self._raising:
            self._raising[ns] = asyncio.get_running_loop().create_task(
                self._raise_in_redis(l3, ns), name=f"radixd-kv-clear-{self.model}")

    def owe(self, ns: str) -> None:
        """A kv_clear of ``ns`` in a run without Redis (L3 off for the model, or no ``[l3]``):
        Redis may still hold the namespace's values of before it, from an earlier run, so the
        raise waits for the next start that has Redis (a warm restart carries it over), and
        nothing of the namespace is read from Redis until it is recorded there."""
        if ns not in self._at_start:
            log.info("keyed %s: the kv_clear of namespace %r is made without Redis; it is "
                     "recorded there at the next start with Redis that takes back the saved "
                     "state (server.state_dir or the fd store), and lost otherwise", self.model,
                     ns)
        self._at_start.add(ns)

    def raised(self, ns: str) -> bool:
        """Whether no raise of ``ns`` is under way or waiting for the next start."""
        return ns not in self._raising and ns not in self._at_start

    async def wait_raised(self, ns: str, timeout: float) -> bool:
        """:meth:`raised`, after waiting at most ``timeout`` seconds for a raise under way."""
        task = self._raising.get(ns)
        if task is not None:
            await asyncio.wait((task,), timeout=timeout)
        return self.raised(ns)

    async def _raise_in_redis(self, l3: RedisTier, ns: str) -> None:
        delay = RAISE_RETRY_S
        try:
            while True:
                floor = self._known.get(ns, 0) + 1
                got = await l3.raise_counter(self.gen_key(ns), floor)
                if got is not None:  # (lower than the floor: another daemon counted it again)
                    self._known[ns] = max(got, floor)
                    if self.on_raised is not None:
                        self.on_raised(ns, self._known[ns])
                    if delay > RAISE_RETRY_S:
                        log.info("keyed %s: the kv_clear of namespace %r reached Redis",
                                 self.model, ns)
                    return
                if delay == RAISE_RETRY_S:
                    log.warning("keyed %s: Redis does not answer; the kv_clear of namespace %r "
                                "is tried again until it does, and its pages are not read from "
                                "or written to Redis meanwhile", self.model, ns)
                await asyncio.sleep(delay)
                delay = min(2 * delay, RAISE_RETRY_MAX_S)
        finally:
            self._raising.pop(ns, None)

    def start(self, l3: RedisTier) -> None:
        """Go on with the raises a warm restart carried over (on the running loop)."""
        self._l3 = l3
        for ns in sorted(self._at_start):
            self.raise_gen(l3, ns)
        self._at_start.clear()

    def cancel(self) -> None:
        """Stop the raises under way (shutdown): :meth:`state` still names them, for a warm
        restart to go on with."""
        for task in self._learning.values():
            task.cancel()
        self._learning.clear()
        for task in self._raising.values():
            task.cancel()  # (one cancelled before its first step never runs its finally)
        self._at_start.update(self._raising)
        self._raising.clear()

    def state(self) -> tuple[dict[str, int], list[str]]:
        """What a warm restart keeps: the generations known, and the namespaces whose raise
        has not reached Redis (raised again at the next start)."""
        return dict(self._known), sorted({*self._raising, *self._at_start})

    def restore(self, known: dict[str, int], raising: list[str]) -> None:
        for ns, gen in known.items():
            self._known[ns] = max(gen, self._known.get(ns, 0))
        self._at_start.update(raising)
