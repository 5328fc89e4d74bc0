"""Each operation written once (the redis-py commands-mixin pattern), and the batch builder.

:class:`BatchOperations` and :class:`Operations` build each request and hand it to
``self._call(op, request)``; what that returns is the caller's. :class:`~radixd_client.Client`
returns the typed result, :class:`~radixd_client.aio.AsyncClient` an awaitable of it, and a batch
(:class:`BatchBuilder`) a :class:`BatchFuture` of it. Adding an operation is its request and
result in ``protocol.py`` and one method here.

The annotations give the typed result: the asyncio client's methods return an awaitable of it,
a batch's a :class:`BatchFuture` of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .errors import (
    BatchSkipped,
    ConnectionLost,
    ProtocolError,
    RadixdError,
    UndecodableResult,
)
from .protocol import (
    Alloc,
    AllocResult,
    Batch,
    CacheFinished,
    CacheUnfinished,
    Code,
    Empty,
    Evict,
    EvictResult,
    Free,
    Insert,
    InsertResult,
    KvClear,
    KvClearResult,
    KvCommit,
    KvLookup,
    KvLookupResult,
    KvRelease,
    KvReserve,
    KvReserveResult,
    Load,
    LoadResult,
    Lock,
    LockResult,
    Match,
    MatchResult,
    Ping,
    PingResult,
    Prefetch,
    PrefetchResult,
    ReleaseSwa,
    Request,
    Stats,
    StatsResult,
    Unlock,
    int32_bytes,
)

__all__ = ["BatchBuilder", "BatchFuture", "BatchOperations", "Operations"]

T = TypeVar("T")


class BatchOperations:
    """The operations a batch may hold (every one but hello, attach, load and prefetch)."""

    __slots__ = ()

    #: Sends a request and gives what the caller gets: the result (``Client``), an awaitable
    #: (``AsyncClient``) or a future (a batch); defined by each class that mixes this in.
    _call: Callable[[str, Request], Any]

    def ping(self, payload: bytes = b"") -> PingResult:
        return self._call("ping", Ping(payload=payload))  # type: ignore[no-any-return]

    def match(self, model: str, tokens: Any, lock: bool = False) -> MatchResult:
        """Longest usable cached prefix of ``tokens``; with ``lock``, also a receipt for it."""
        return self._call(  # type: ignore[no-any-return]
            "match", Match(model=model, tokens=int32_bytes(tokens), lock=lock))

    def lock(self, model: str, node: int) -> LockResult:
        return self._call("lock", Lock(model=model, node=node))  # type: ignore[no-any-return]

    def unlock(self, model: str, receipt: int) -> Empty:
        return self._call(  # type: ignore[no-any-return]
            "unlock", Unlock(model=model, receipt=receipt))

    def release_swa(self, model: str, receipt: int) -> Empty:
        """Release only the SWA part of a receipt (a decoding request past the window)."""
        return self._call(  # type: ignore[no-any-return]
            "release_swa", ReleaseSwa(model=model, receipt=receipt))

    def alloc(self, model: str, n: int) -> AllocResult:
        """``n`` full pages and, for SWA models, ``n`` SWA pages, held by this session."""
        return self._call("alloc", Alloc(model=model, n=n))  # type: ignore[no-any-return]

    def free(self, model: str, full_pages: Any = (), swa_pages: Any = ()) -> Empty:
        return self._call("free", Free(  # type: ignore[no-any-return]
            model=model, full_pages=int32_bytes(full_pages), swa_pages=int32_bytes(swa_pages)))

    def insert(self, model: str, tokens: Any, full_pages: Any, swa_pages: Any = (),
               prev_prefix_len: int = 0, swa_evicted_len: int = 0, lock: bool = False
               ) -> InsertResult:
        return self._call("insert", Insert(  # type: ignore[no-any-return]
            model=model, tokens=int32_bytes(tokens), full_pages=int32_bytes(full_pages),
            swa_pages=int32_bytes(swa_pages), prev_prefix_len=prev_prefix_len,
            swa_evicted_len=swa_evicted_len, lock=lock))

    def cache_unfinished(self, model: str, tokens: Any, full_pages: Any, swa_pages: Any = (),
                         prev_prefix_len: int = 0, swa_evicted_len: int = 0,
                         receipt: int | None = None) -> InsertResult:
        return self._call("cache_unfinished", CacheUnfinished(  # type: ignore[no-any-return]
            model=model, tokens=int32_bytes(tokens), full_pages=int32_bytes(full_pages),
            swa_pages=int32_bytes(swa_pages), prev_prefix_len=prev_prefix_len,
            swa_evicted_len=swa_evicted_len, receipt=receipt))

    def cache_finished(self, model: str, tokens: Any, full_pages: Any, swa_pages: Any = (),
                       prev_prefix_len: int = 0, swa_evicted_len: int = 0,
                       receipt: int | None = None) -> InsertResult:
        return self._call("cache_finished", CacheFinished(  # type: ignore[no-any-return]
            model=model, tokens=int32_bytes(tokens), full_pages=int32_bytes(full_pages),
            swa_pages=int32_bytes(swa_pages), prev_prefix_len=prev_prefix_len,
            swa_evicted_len=swa_evicted_len, receipt=receipt))

    def evict(self, model: str, full_pages: int = 0, swa_pages: int = 0,
              host_pages: int = 0) -> EvictResult:
        """Free up to these pages of this session's namespace (unlocked, coldest first)."""
        return self._call("evict", Evict(  # type: ignore[no-any-return]
            model=model, full_pages=full_pages, swa_pages=swa_pages, host_pages=host_pages))

    def stats(self, model: str | None = None) -> StatsResult:
        return self._call("stats", Stats(model=model))  # type: ignore[no-any-return]

    # -- the key-addressed page store (docs/protocol.md, "Keyed pages") ------------------------

    def kv_lookup(self, model: str, keys: list[bytes], pool: str = "full", *, pin: bool = True,
                  fetch: bool = False, timeout_s: float = 0.0) -> KvLookupResult:
        """Which ``keys`` the store holds in host pool ``pool``, and their slots.

        With ``pin`` the present keys' slots are neither evicted nor reused until
        :meth:`kv_release` of the returned pin: copy out of them meanwhile. ``fetch`` first
        brings keys only Redis (L3) holds into host, waiting at most ``timeout_s`` (0: the
        daemon's ``prefetch_timeout_ms``); not allowed in a batch.
        """
        return self._call("kv_lookup", KvLookup(  # type: ignore[no-any-return]
            model=model, keys=list(keys), pool=pool, pin=pin, fetch=fetch,
            timeout_ms=max(0, round(timeout_s * 1000))))

    def kv_reserve(self, model: str, keys: list[bytes], pool: str = "full") -> KvReserveResult:
        """A fresh host slot for each key not stored yet (0: nothing to write), under a pin.

        Write each page into its slot, then :meth:`kv_commit` publishes them (or
        :meth:`kv_release` gives the slots back). Keys that found no room or quota get slot 0
        and are counted in ``full``: a cache may decline to store.
        """
        return self._call("kv_reserve", KvReserve(  # type: ignore[no-any-return]
            model=model, keys=list(keys), pool=pool))

    def kv_commit(self, model: str, pin: int) -> Empty:
        """Publish a reservation's pages to every session of the namespace; ends the pin."""
        return self._call("kv_commit", KvCommit(model=model, pin=pin))  # type: ignore[no-any-return]

    def kv_release(self, model: str, pin: int) -> Empty:
        """End a lookup pin, or abort a reservation (its slots are freed)."""
        return self._call(  # type: ignore[no-any-return]
            "kv_release", KvRelease(model=model, pin=pin))

    def kv_clear(self, model: str) -> KvClearResult:
        """Drop this namespace's unpinned keyed pages of ``model``."""
        return self._call("kv_clear", KvClear(model=model))  # type: ignore[no-any-return]


class Operations(BatchOperations):
    """Every operation of a session, the ones not allowed in a batch included."""

    __slots__ = ()

    def load(self, model: str, tokens: Any, lock: bool = False) -> LoadResult:
        """Copy the host (L2) part of the match of ``tokens`` back to device, then match.

        Answered only once the data is on device; the result is a match (``lock`` as in
        :meth:`match`) plus ``loaded_len``. Not allowed in a batch.
        """
        return self._call(  # type: ignore[no-any-return]
            "load", Load(model=model, tokens=int32_bytes(tokens), lock=lock))

    def prefetch(self, model: str, tokens: Any, policy: str = "best_effort",
                 timeout_ms: int = 0) -> PrefetchResult:
        """Fetch the pages of ``tokens`` that only L3 (Redis) holds into L2 (host).

        ``policy``: ``best_effort`` answers once L3 was asked what it holds and fetches in the
        background; ``wait_complete`` answers when the fetch is done; ``timeout`` answers when it
        is done or after ``timeout_ms``. Not allowed in a batch.
        """
        return self._call(  # type: ignore[no-any-return]
            "prefetch", Prefetch(model=model, tokens=int32_bytes(tokens), policy=policy,
                                 timeout_ms=timeout_ms))


# ---------------------------------------------------------------------------- batches

class BatchFuture(Generic[T]):
    """The outcome of one operation queued in a batch; :meth:`result` after the ``with`` block."""

    __slots__ = ("_done", "_error", "_result", "op")

    def __init__(self, op: str) -> None:
        self.op = op
        self._done = False
        self._result: Any = None
        self._error: RadixdError | None = None

    def _set(self, result: Any) -> None:
        self._done, self._result = True, result

    def _fail(self, error: RadixdError) -> None:
        self._done, self._error = True, error

    def done(self) -> bool:
        return self._done

    def result(self) -> T:
        """The typed result; raises the operation's error if it failed (or did not run)."""
        if not self._done:
            raise RuntimeError(f"the batch holding this {self.op} has not been sent yet: read "
                               "results after its `with` block")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[no-any-return]

    def exception(self) -> RadixdError | None:
        """The operation's error, or None if it succeeded."""
        if not self._done:
            raise RuntimeError(f"the batch holding this {self.op} has not been sent yet")
        return self._error

    def __repr__(self) -> str:
        state = ("pending" if not self._done else
                 f"failed {self._error.code}" if self._error is not None else "ok")
        return f"<BatchFuture {self.op} {state}>"


class BatchBuilder(BatchOperations):
    """Queues operations for one ``batch`` frame; the sync and the async batch only send it.

    The connection decodes the response's items as it reads them
    (:func:`~radixd_client.connection.decode_batch`); :meth:`_distribute` only hands the
    outcomes to the futures.
    """

    def __init__(self, stop_on_error: bool) -> None:
        self.stop_on_error = stop_on_error
        self._ops: list[Any] = []
        self._futures: list[BatchFuture[Any]] = []
        self._sent = False
        self._batch: Batch | None = None  # the request, once made (its id is given as it is sent)

    def __len__(self) -> int:
        return len(self._ops)

    def _call(self, op: str, req: Request) -> BatchFuture[Any]:
        if self._sent:
            raise RuntimeError("this batch was already sent; start a new one")
        fut: BatchFuture[Any] = BatchFuture(op)
        self._ops.append(req)
        self._futures.append(fut)
        return fut

    def _request(self) -> Batch:
        self._sent = True
        self._batch = Batch(ops=self._ops, stop_on_error=self.stop_on_error)
        return self._batch

    def _abandon(self, why: str, cause: BaseException | None) -> None:
        """Fail every unsettled future: the batch did not run (its frame never made: the id a
        request is given as its frame is made is still 0; or the daemon refused it whole), or
        no one knows whether it did (the connection went, or the call was interrupted, once its
        frame was made; or the answer could not be decoded)."""
        self._sent = True
        sent = self._batch is not None and self._batch.id != 0
        refused = (isinstance(cause, RadixdError)
                   and not isinstance(cause, (ConnectionLost, UndecodableResult)))
        unknown = sent and not refused
        for fut in self._futures:
            if not fut.done():
                err = BatchSkipped(f"{fut.op}: no result, it may have run: {why}" if unknown
                                   else f"{fut.op} not run: {why}")
                err.__cause__ = cause
                fut._fail(err)

    def _distribute(self, outcomes: list[tuple[bool, Any]]) -> None:
        """Settle every future from the decoded outcomes, in order."""
        first_failure: RadixdError | None = None
        for i, fut in enumerate(self._futures):
            if first_failure is not None and self.stop_on_error:
                # Whatever the daemon reports for the rest (a placeholder error, or nothing),
                # these did not run.
                err = BatchSkipped(f"{fut.op} not run: an earlier operation of the batch "
                                   f"failed ({first_failure.code}) and stop_on_error is set")
                err.__cause__ = first_failure
                fut._fail(err)
                continue
            if i >= len(outcomes):
                fut._fail(ProtocolError(f"the daemon answered {len(outcomes)} of "
                                        f"{len(self._futures)} batch operations",
                                        code=Code.BAD_FRAME))
                continue
            ran_ok, value = outcomes[i]
            if isinstance(value, RadixdError):
                fut._fail(value)
                if not ran_ok and first_failure is None:
                    first_failure = value
            else:
                fut._set(value)
