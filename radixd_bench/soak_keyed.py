"""Keyed pages in ``radixd bench soak``: each client also uses the key-addressed page store
(protocol.md 9.4: ``kv_attach``, ``kv_lookup``, ``kv_reserve``, ``kv_commit``, ``kv_release``,
``kv_clear``) and verifies every page it is served.

A client names its own keys (its process and key space are in every key, so no other client ever
looks them up or pins them) and writes into each slot it reserves a page that only the namespace,
the pool kind, the key and the client's **clear epoch** decide: a header (magic, epoch, a check
of the key) and words drawn from a hash of all four. A page served by ``kv_lookup`` (from host,
or brought back from Redis by ``fetch``) is read through the mapped host pool while it is pinned
and classified:

- **mismatch**: not the page the client wrote for this key at the epoch its header names (any
  byte differs, another key's or namespace's page, zeros), or an epoch at which the client never
  reserved this key;
- **stale**: the page is whole, but its epoch is below the client's *floor*: written before a
  ``kv_clear`` of this client that was answered. The client holds no pin and no reservation
  when it clears and every commit of before has been answered, so no page of its keys stored
  before that clear may be served again, from host or from Redis, whatever ``l3_cleared`` said
  (protocol.md 9.4): the clear drops the host pages at once, and until Redis has recorded it
  the daemon reads nothing of the namespace from Redis; the soak's daemon keeps a state
  directory and stops with SIGTERM, so a raise still pending at its restart is carried over;
- **stale after a clear whose answer never came** (tolerated, counted): written before such a
  clear (the connection was cut) and at or above the floor. The clear may not have reached the
  daemon, so the page may legitimately come back until a later clear is answered;
- otherwise **verified**.

Some rounds use **shared keys** instead: the same few key names in every client, of every
tenant. Their pages carry no epoch (one page per namespace, kind and key, whoever writes it), so
any client of a namespace can check them, and a tenant served another tenant's page for the same
key (from host, or fetched from Redis) sees a mismatch: the soak checks that namespaces stay apart
under its faults. They are not checked for staleness (other clients clear them).

The epoch is raised after every clear attempt, whatever its outcome, so pages written after an
attempt are always told apart from those written before it. Clears by other clients of the same
namespace drop this client's pages too (fewer hits), but only the client's own clears raise its
floor: another client's clear may overlap one of this client's pins, which keeps a page.

A new session on the *same* daemon instance (a call that timed out, a lost connection) starts a
new key space: the old session's pins may outlive it for a moment on the daemon, and a page they
kept through a clear would be a false stale. After a daemon restart (a new instance) the pins are
gone with the old process, and the keys stay: what the warm restart kept is verified too.
"""

from __future__ import annotations

import hashlib
import random
import zlib
from dataclasses import dataclass
from typing import Any

__all__ = ["KEYED_COUNTS", "SHARED_EPOCH", "KeyedOptions", "KeyedSoak", "keyed_page"]

#: the counts a client reports for its keyed pages (summed by the soak)
KEYED_COUNTS = (
    "keyed_rounds", "keyed_stored", "keyed_verified", "keyed_verified_after_restart",
    "keyed_mismatches", "keyed_stale", "keyed_stale_unconfirmed", "keyed_stale_checks",
    "keyed_fetched", "keyed_shared_verified",
    "keyed_declined", "keyed_clears", "keyed_clears_confirmed")

_MAGIC = 0x504B5852  # b"RXKP" little-endian
_WORDS_HEADER = 3
#: the epoch in a shared key's page (see the module): none of a client's own epochs
SHARED_EPOCH = -1


@dataclass
class KeyedOptions:
    """How a soak client uses keyed pages."""

    full_keys: int = 48  # keys of the full host pool in a client's key space
    swa_keys: int = 16  # keys of the SWA host pool (0: none)
    batch: int = 8  # keys per lookup (and reservation of those missing)
    swa_share: float = 0.25  # share of the rounds on the SWA pool
    shared_keys: int = 8  # keys every client of every tenant uses (0: none)
    shared_share: float = 0.25  # share of the rounds on the shared keys
    fetch_share: float = 0.5  # share of the lookups that fetch from Redis
    fetch_timeout_s: float = 1.0
    clear_every: int = 120  # a kv_clear every this many rounds, on average (0: never)


def _signed32(x: int) -> int:
    return x - (1 << 32) if x >= 1 << 31 else x


def keyed_page(ns: str, kind: str, key: bytes, epoch: int, nbytes: int) -> Any:
    """The page a client writes for ``key`` at clear epoch ``epoch``: ``nbytes`` bytes (a
    ``torch.uint8`` tensor) that differ in every word from those of any other (namespace, kind,
    key, epoch), with the magic, the epoch and a check of the key in its first three words, so
    that a served page says which epoch it claims to be."""
    import torch

    d = hashlib.blake2b(b"\0".join([ns.encode(), kind.encode(), key, str(epoch).encode()]),
                        digest_size=16).digest()
    a = int.from_bytes(d[:4], "little") | 1
    b = int.from_bytes(d[4:8], "little")
    words = (torch.arange(nbytes // 4, dtype=torch.int64) * a + b) & 0xFFFFFFFF
    words ^= words >> 15
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    words[:_WORDS_HEADER] = torch.tensor(
        [_signed32(_MAGIC), epoch, _signed32(zlib.crc32(key))], dtype=torch.int32)
    return words.view(torch.uint8)


class KeyedSoak:
    """One soak client's keyed pages: its keys, the epochs it wrote them at, its clear floor."""

    def __init__(self, model: str, namespace: str, ident: str, opts: KeyedOptions,
                 rng: random.Random) -> None:
        self.model = model
        self.ns = namespace
        self.ident = ident
        self.opts = opts
        self.rng = rng
        #: the epoch of the pages written now: one more after every kv_clear attempt
        self.epoch = 0
        #: the least epoch a served page may carry: raised to ``epoch`` by an answered clear
        self.floor = 0
        #: (kind, key) -> {epoch at which a slot was reserved for it (and written): the daemon
        #: instance that gave the slot}
        self.written: dict[tuple[str, bytes], dict[int, str | None]] = {}
        self.space = 0
        self.instance: str | None = None
        self.session: int | None = None
        self._client: Any = None
        self._pools: Any = None

    # ------------------------------------------------------------------ verdicts

    def key(self, kind: str, i: int) -> bytes:
        """Key ``i`` of pool ``kind``: no other client's, nor this client's in another session
        on the same daemon instance (see the module)."""
        return f"soak/{self.ident}/{self.space}/{kind}/{i}".encode()

    @staticmethod
    def shared_key(kind: str, i: int) -> bytes:
        """Shared key ``i`` of pool ``kind``: the same name in every client and tenant."""
        return f"soak/shared/{kind}/{i}".encode()

    def classify_shared(self, kind: str, key: bytes, page: Any) -> str:
        """``shared`` for this namespace's page of a shared key, else ``mismatch`` (another
        tenant's page, any byte off)."""
        import torch

        mine = keyed_page(self.ns, kind, key, SHARED_EPOCH, page.numel())
        return "shared" if torch.equal(page, mine) else "mismatch"

    def classify(self, kind: str, key: bytes, page: Any) -> str:
        """``verified``, ``mismatch``, ``stale`` or ``unconfirmed`` for a page served for
        ``key`` (the module docstring says which is which). ``page``: its bytes
        (``torch.uint8``), read while pinned."""
        import torch

        words = page.view(torch.int32)
        if int(words[0]) != _signed32(_MAGIC):
            return "mismatch"
        epoch = int(words[1])
        if epoch not in self.written.get((kind, key), ()):
            return "mismatch"  # never written at that epoch: not this key's page
        if not torch.equal(page, keyed_page(self.ns, kind, key, epoch, page.numel())):
            return "mismatch"
        if epoch < self.floor:
            return "stale"
        if epoch < self.epoch:
            return "unconfirmed"
        return "verified"

    # ------------------------------------------------------------------ a round

    def bind(self, client: Any) -> None:
        """Follow the client's session: a new one on the same daemon instance starts a new key
        space; after a restart (or with a new client) the host pools are mapped again."""
        if self.instance is not None and client.instance == self.instance and \
                client.session != self.session:
            self.space += 1
        self.instance, self.session = client.instance, client.session
        if self._client is not client or self._pools is None or self._pools.closed:
            self._pools = client.kv_attach(self.model)
            self._client = client

    def round(self, client: Any, counts: dict[str, Any]) -> None:
        """One lookup of a batch of keys (with a Redis fetch now and then), every page served
        checked, then a reservation, write and commit of those missing; or, now and then, a
        ``kv_clear`` of the namespace. Adds to ``counts``."""
        self.bind(client)
        counts["keyed_rounds"] += 1
        o = self.opts
        if o.clear_every and self.rng.random() * o.clear_every < 1:
            self.clear(client, counts)
            return
        kind = "swa" if o.swa_keys and self.rng.random() < o.swa_share else "full"
        shared = bool(o.shared_keys) and self.rng.random() < o.shared_share
        universe = o.shared_keys if shared else o.swa_keys if kind == "swa" else o.full_keys
        name = self.shared_key if shared else self.key
        keys = [name(kind, i) for i in self.rng.sample(range(universe), min(o.batch, universe))]
        fetch = self.rng.random() < o.fetch_share
        got = client.kv_lookup(self.model, keys, kind, pin=True, fetch=fetch,
                               timeout_s=o.fetch_timeout_s)
        counts["keyed_fetched"] += got.fetched
        try:
            pool = self._pools.pool(kind)
            for key, present, slot in zip(keys, got.present, got.slots, strict=True):
                if shared:
                    if present:
                        counts[_COUNT_OF[self.classify_shared(kind, key, pool[slot])]] += 1
                    continue
                epochs = self.written.get((kind, key))
                if epochs and max(epochs) < self.floor:
                    counts["keyed_stale_checks"] += 1  # whatever is served for it is stale
                if present:
                    verdict = self.classify(kind, key, pool[slot])
                    counts[_COUNT_OF[verdict]] += 1
                    if verdict == "verified" and self._before_restart(kind, key, pool[slot]):
                        counts["keyed_verified_after_restart"] += 1
        finally:
            if got.pin:
                client.kv_release(self.model, got.pin)
        missing = [k for k, p in zip(keys, got.present, strict=True) if not p]
        if missing:
            self.store(client, kind, missing, counts, shared)

    def store(self, client: Any, kind: str, keys: list[bytes], counts: dict[str, Any],
              shared: bool = False) -> None:
        """Reserve ``keys``, write each page given a slot at the current epoch (``shared``
        keys: the epoch-free page), commit."""
        r = client.kv_reserve(self.model, keys, kind)
        counts["keyed_declined"] += r.full + r.busy
        if not r.pin:
            return
        pool = self._pools.pool(kind)
        stored = 0
        for key, slot in zip(keys, r.slots, strict=True):
            if slot:
                # recorded before the commit: a commit carried out whose answer is lost (a
                # restart) leaves a page this client must recognise
                if not shared:
                    self.written.setdefault((kind, key), {})[self.epoch] = self.instance
                epoch = SHARED_EPOCH if shared else self.epoch
                pool[slot].copy_(keyed_page(self.ns, kind, key, epoch, pool.shape[1]))
                stored += 1
        client.kv_commit(self.model, r.pin)
        counts["keyed_stored"] += stored

    def _before_restart(self, kind: str, key: bytes, page: Any) -> bool:
        """Whether a verified page was written under an earlier daemon instance (kept by the
        warm restart, or brought back from Redis)."""
        import torch

        epoch = int(page.view(torch.int32)[1])
        return self.written[(kind, key)][epoch] != self.instance

    def clear(self, client: Any, counts: dict[str, Any]) -> None:
        """``kv_clear`` of the namespace; an answered one raises the floor to the new epoch:
        every page of this client's written before it is stale from now on (the module says
        why, whatever ``l3_cleared`` said; those that said true are counted apart)."""
        counts["keyed_clears"] += 1
        try:
            cleared = client.kv_clear(self.model)
        finally:
            self.epoch += 1  # whatever the outcome: later pages are told apart from earlier
        self.floor = self.epoch
        if cleared.l3_cleared is True:
            counts["keyed_clears_confirmed"] += 1


_COUNT_OF = {"verified": "keyed_verified", "mismatch": "keyed_mismatches",
             "stale": "keyed_stale", "unconfirmed": "keyed_stale_unconfirmed",
             "shared": "keyed_shared_verified"}
