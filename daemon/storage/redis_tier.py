"""L3: pages in Redis (standalone or Cluster) through redis-py's asyncio client.

One key per value: ``prefix + page_id.hex()`` for a full-attention value (a run of pages, named by
its last page) and the same form with ``:swa`` appended for an SWA value (a node's window), which
daemon/l3_runs.py plans (docs/protocol.md 9.3). The value is one self-verifying blob
(daemon/storage/codec.py), so there is no metadata key that can outlive or race its payload.

Failure model: Redis being down, slow, flushed or full is a *miss*, never an exception to the
caller. Every pipeline runs under ``asyncio.wait_for(op_timeout)`` on top of the socket timeouts;
redis-py's own retry is set explicitly to one quick retry (it re-dials a pooled connection that a
restarted server dropped) instead of its defaults of ten; and a circuit breaker stops calling a
Redis that keeps failing:

* closed: calls go through; ``breaker_threshold`` consecutive failed calls (timeouts, connection
  errors) open it;
* open: every call is answered at once as a miss (exists 0, get all None, set dropped and counted)
  for ``breaker_open_seconds``;
* half-open: the next call is let through as the one probe (concurrent calls still miss); its
  success closes the breaker, its failure opens it again for another period.

Every breaker transition that an operator needs is logged once, under ``radixd.storage.redis``:
closed → open as a warning with the failure that tripped it, the recovery (half-open → closed) as
info with how long L3 was off. While Redis stays down the breaker goes open → half-open → open
every ``breaker_open_seconds``; those repeats are logged at debug level only, so an outage is two
lines, not one per probe. At start the daemon pings Redis once (:meth:`RedisTier.start_probe`) and
logs whether it answers. URLs in the log have their password replaced by ``***``.

Corrupt values (any check of ``decode_page`` failing) are counted, deleted and returned as misses.
A server-side error reply to one command (for example OOM under ``maxmemory-policy noeviction``)
fails that page only and is counted in ``errors``; it does not trip the breaker, since the server
is up and answering.

Cluster: pages spread over all slots (no ``{hash tag}`` in the prefix, which would pin every page
of the daemon to one node), and batches go through the cluster pipeline, which groups the single-key
commands per node and runs the groups concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from daemon.storage.codec import (
    POOL_SWA,
    CorruptPage,
    PageValue,
    decode_page,
    peek_header,
    pool_code,
)
from daemon.storage.redis_urls import CLUSTER_SCHEMES, client_for_url, redact_url

#: Fetched bytes up to which a chunk is verified on the event loop (a thread hop costs more).
VERIFY_INLINE_BYTES = 256 * 1024

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"

log = logging.getLogger("radixd.storage.redis")


class CircuitBreaker:
    """Consecutive-failure breaker with a single half-open probe. ``name`` (the redacted URL)
    is what its log lines call the Redis it guards."""

    def __init__(self, threshold: int, open_seconds: float,
                 clock: Callable[[], float] = time.monotonic, name: str = "Redis") -> None:
        if threshold < 1:
            raise ValueError("breaker threshold must be >= 1")
        self.threshold = threshold
        self.open_seconds = open_seconds
        self._clock = clock
        self.state = CLOSED
        self.failures = 0
        self.opens = 0
        self._opened_at = 0.0
        self._probe_in_flight = False
        self.name = name
        # When the current outage began (the closed -> open transition), for the recovery line.
        self._outage_since = 0.0
        # Recent transitions, oldest first (for tests and the admin view).
        self.history: deque[str] = deque([CLOSED], maxlen=32)

    def _set(self, state: str, cause: str = "") -> None:
        if state == self.state:
            return
        before, self.state = self.state, state
        self.history.append(state)
        if before == CLOSED and state == OPEN:
            self._outage_since = self._clock()
            log.warning("L3 Redis %s: circuit breaker open after %d consecutive failed calls "
                        "(last: %s); L3 reads miss and writes are dropped, next probe in %.1fs",
                        self.name, self.failures, cause or "unknown", self.open_seconds)
        elif state == CLOSED:
            log.info("L3 Redis %s: circuit breaker closed, the probe succeeded after %.1fs "
                     "open; L3 is used again", self.name, self._clock() - self._outage_since)
        else:  # open -> half-open -> open while Redis stays down: not worth a line each time
            log.debug("L3 Redis %s: circuit breaker %s -> %s%s", self.name, before, state,
                      f" ({cause})" if cause else "")

    def admit(self) -> str | None:
        """'call' or 'probe' when the caller may go to Redis, None when it must miss."""
        if self.state == CLOSED:
            return "call"
        if self.state == OPEN:
            if self._clock() - self._opened_at < self.open_seconds:
                return None
            self._set(HALF_OPEN)
        if self._probe_in_flight:
            return None
        self._probe_in_flight = True
        return "probe"

    def _open(self, cause: str) -> None:
        self._opened_at = self._clock()
        self.opens += 1
        self._set(OPEN, cause)

    def record(self, ticket: str, ok: bool, cause: str = "") -> None:
        """The outcome of an admitted call; ``cause`` (a failure's description) goes into the
        log line of a transition it causes."""
        if ticket == "probe":
            self._probe_in_flight = False
            self.failures = 0 if ok else self.failures + 1
            if ok:
                self._set(CLOSED)
            else:
                self._open(cause)
            return
        if self.state != CLOSED:
            return  # a call admitted before the breaker opened: the probe decides now
        if ok:
            self.failures = 0
        else:
            self.failures += 1
            if self.failures >= self.threshold:
                self._open(cause)

    def abandon(self, ticket: str) -> None:
        """The admitted call was cancelled: let another call probe."""
        if ticket == "probe":
            self._probe_in_flight = False


class _CallFailed(Exception):
    """A pipeline of this call failed in a way that counts against the breaker."""


def _never_dialled(exc: BaseException) -> str | None:
    """The ``host:port`` whose connection a failure never made (redis-py's "Error 111
    connecting to host:port."), "" when it names none (no free connection, a connect timeout),
    None when the failure came later, once the request may have been sent."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, MaxConnectionsError) or str(seen).startswith(
                ("Timeout connecting", "No connection available")):
            return ""
        found = re.search(r"connecting to (\S+?:\d+)", str(seen))
        if found:
            return found.group(1)
        seen = seen.__cause__ or seen.__context__
    return None


def describe(exc: BaseException) -> str:
    """An exception as one short log phrase: its type and, when it has one, its message (redis-py
    messages name host and port, never credentials)."""
    if isinstance(exc, (asyncio.TimeoutError, RedisTimeoutError)):
        return f"timeout: {exc}" if str(exc) else "timeout"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class RedisTier:
    """Pipelined, verified, fail-soft page store on Redis or Redis Cluster."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        key_prefix: str,
        cluster: bool | None = None,
        ttl_seconds: int = 0,
        op_timeout: float = 0.5,
        connect_timeout: float = 0.5,
        max_pipeline: int = 64,
        max_pipeline_bytes: int = 16 << 20,
        concurrency: int = 4,
        max_connections: int = 32,
        health_check_interval: int = 30,
        breaker_threshold: int = 3,
        breaker_open_seconds: float = 5.0,
        client: Any | None = None,
    ) -> None:
        """``url``: redis://[user:password@]host:port/db, rediss:// for TLS; a ``+cluster``
        scheme (redis+cluster://, rediss+cluster://) or ``cluster=True`` for Redis Cluster,
        the URL naming any one startup node. ``ttl_seconds`` 0 means no expiry (leave eviction
        to Redis ``maxmemory-policy allkeys-lru``). ``op_timeout`` bounds each pipeline;
        ``max_pipeline`` commands and ``max_pipeline_bytes`` of values at most go in one, and at
        most ``concurrency`` pipelines of one call run at once. ``client`` replaces the client
        built from the URL (tests)."""
        if max_pipeline < 1 or concurrency < 1:
            raise ValueError("max_pipeline and concurrency must be >= 1")
        if ttl_seconds < 0:
            raise ValueError("ttl_seconds must be >= 0")
        self.url = redact_url(url)  # as configured (+cluster included): what logs call it
        scheme = urlsplit(url).scheme
        if scheme in CLUSTER_SCHEMES:
            cluster = True if cluster is None else cluster
            if not cluster:
                raise ValueError(f"{scheme}:// names a cluster but cluster=False was passed")
        elif scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"unsupported Redis URL scheme {scheme!r}")
        self.cluster = bool(cluster)
        if self.cluster and "{" in key_prefix:
            raise ValueError("a '{' in the key prefix is a Redis Cluster hash tag: every page "
                             "would land in one slot; leave it out")
        self.key_prefix = key_prefix
        self.ttl = int(ttl_seconds)
        self.op_timeout = float(op_timeout)
        self.max_pipeline = int(max_pipeline)
        self.max_pipeline_bytes = int(max_pipeline_bytes)
        # a cluster node's pool refuses a connection past max_connections (a plain one waits),
        # and redis-py then closes the whole client, failing the other pipelines in flight
        self._sem = asyncio.Semaphore(min(concurrency, max_connections) if self.cluster
                                      else concurrency)
        self.breaker = CircuitBreaker(breaker_threshold, breaker_open_seconds, name=self.url)
        self._start_probe: asyncio.Task[None] | None = None
        self._stats = dict.fromkeys(
            ("gets", "hits", "misses", "sets", "set_failures", "corrupt", "stale", "timeouts",
             "errors", "breaker_rejects", "exists_calls", "deletes", "bytes_read",
             "bytes_written"), 0)
        if client is not None:
            self._client = client
            return
        # One quick retry re-dials a connection a restarted server dropped; the breaker and the
        # wait_for bound handle everything longer. No silent retry loops.
        common: dict[str, Any] = dict(
            socket_timeout=self.op_timeout,
            socket_connect_timeout=min(connect_timeout, self.op_timeout),
            retry=Retry(ExponentialBackoff(cap=0.05, base=0.005), retries=1,
                        supported_errors=(RedisConnectionError, RedisTimeoutError)),
            health_check_interval=health_check_interval,
            socket_keepalive=True,
            decode_responses=False,
        )
        if self.cluster and scheme not in CLUSTER_SCHEMES:  # (cluster=True, a plain scheme)
            url = url.replace("://", "+cluster://", 1)
        self._client = client_for_url(url, max_connections, self.op_timeout, common)

    # -- keys and stats -----------------------------------------------------------------------

    def key(self, page_hash: bytes, pool: str = "full") -> str:
        pool_code(pool)
        k = self.key_prefix + page_hash.hex()
        return k + ":swa" if pool == POOL_SWA else k

    @property
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._stats)
        out["breaker_state"] = self.breaker.state
        out["breaker_opens"] = self.breaker.opens
        return out

    def start_probe(self) -> None:
        """Ping Redis once in the background (on the running loop) and log whether it answers:
        without it a Redis unreachable from the start shows nowhere until the breaker opens under
        traffic. Later calls do nothing (every model's tier manager calls it). The ping is not
        counted by the breaker."""
        if self._start_probe is None:
            self._start_probe = asyncio.ensure_future(self._ping_at_start())

    async def _ping_at_start(self) -> None:
        try:
            await asyncio.wait_for(self._client.ping(), self.op_timeout)
            node = not self.cluster and await self._cluster_node()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is logged, never raised
            hint = ("; a rediss:// URL to a port that does not speak TLS times out like this"
                    if self.url.startswith("rediss") and "timeout" in describe(exc).lower()
                    else "")
            log.warning("L3 Redis %s unreachable at start (%s%s); L3 is a miss until it "
                        "answers", self.url, describe(exc), hint)
        else:
            if node:
                log.warning("L3 Redis %s is a node of a Redis Cluster: the keys the other "
                            "nodes own are refused (MOVED); use a redis+cluster:// URL",
                            self.url)
            else:
                log.info("L3 Redis %s answers", self.url)

    async def _cluster_node(self) -> bool:
        """Whether a plain client's Redis is a node of a cluster, which answers, then refuses
        (MOVED) the keys the other nodes own: most writes would fail, seen only in counters.
        False when it cannot tell (INFO refused by an ACL or a proxy, or slow)."""
        try:
            info = await asyncio.wait_for(self._client.info("cluster"), self.op_timeout)
        except (RedisError, asyncio.TimeoutError):
            return False
        return bool(info.get("cluster_enabled"))

    async def aclose(self) -> None:
        if self._start_probe is not None and not self._start_probe.done():
            self._start_probe.cancel()
            try:
                await self._start_probe
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it is being dropped
                pass
        try:
            await self._client.aclose()
        except Exception:  # noqa: BLE001 - closing a dead connection must not raise either
            pass

    # -- plumbing -----------------------------------------------------------------------------

    async def _pipeline(self, queue: Callable[[Any], None]) -> list[Any]:
        """Run one pipeline (commands queued by ``queue``) under the timeout; per-command error
        replies come back as exception objects in the result list."""
        async def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            queue(pipe)
            return await pipe.execute(raise_on_error=False)

        async with self._sem:
            try:
                return await asyncio.wait_for(run(), self.op_timeout)
            except (asyncio.TimeoutError, RedisTimeoutError) as exc:
                self._stats["timeouts"] += 1
                raise _CallFailed(f"timeout after {self.op_timeout}s") from exc
            except (RedisError, RedisClusterException, OSError) as exc:
                self._stats["errors"] += 1
                raise _CallFailed(describe(exc)) from exc

    async def _guarded(self, body: Callable[[], Awaitable[Any]], on_reject: Any) -> Any:
        """Run ``body`` under the breaker; a failure or a rejection yields ``on_reject()``."""
        ticket = self.breaker.admit()
        if ticket is None:
            self._stats["breaker_rejects"] += 1
            return on_reject()
        ok = False
        cause = ""
        try:
            result = await body()
            ok = True
            return result
        except _CallFailed as exc:
            cause = str(exc)
            return on_reject()
        except asyncio.CancelledError:
            self.breaker.abandon(ticket)
            ticket = ""
            raise
        except Exception as exc:  # noqa: BLE001 - an L3 failure must never reach the engine
            self._stats["errors"] += 1
            cause = describe(exc)
            return on_reject()
        finally:
            if ticket:
                self.breaker.record(ticket, ok, cause)

    def _chunks(self, n: int) -> list[range]:
        step = self.max_pipeline
        return [range(i, min(i + step, n)) for i in range(0, n, step)]

    def _left_of(self, exc: BaseException, key: str) -> bool | None:
        """What a write of ``key`` that failed with ``exc`` left in Redis: nothing (False) when
        the connection it needed was never made, else maybe (None). A Cluster pipeline fails as
        a whole when one node's connection fails: there only that node's keys are not stored."""
        node = _never_dialled(exc)
        if node is None or (self.cluster and not node):
            return None
        if not self.cluster:
            return False
        owner = self._client.get_node_from_key(key)
        return False if owner is not None and owner.name == node else None

    @staticmethod
    def _is_error(reply: Any) -> bool:
        return isinstance(reply, BaseException)

    def _reply_errors(self, replies: list[Any]) -> None:
        """Connection-level failures inside a pipeline's replies fail the call (breaker)."""
        for r in replies:
            if isinstance(r, (RedisConnectionError, RedisTimeoutError, OSError)):
                self._stats["errors"] += 1
                raise _CallFailed(describe(r))

    # -- operations ---------------------------------------------------------------------------

    async def exists_prefix(self, hashes: Sequence[bytes], pool: str = "full") -> int:
        """How many leading pages of this chain are stored (pipelined EXISTS, stops at a miss)."""
        keys = [self.key(h, pool) for h in hashes]
        self._stats["exists_calls"] += 1

        async def body() -> int:
            found = 0
            for chunk in self._chunks(len(keys)):
                replies = await self._pipeline(
                    lambda p, c=chunk: [p.exists(keys[i]) for i in c])
                self._reply_errors(replies)
                for r in replies:
                    if self._is_error(r) or not r:
                        self._stats["errors"] += self._is_error(r)
                        return found
                    found += 1
            return found

        return await self._guarded(body, lambda: 0) if keys else 0

    async def exists_each(self, hashes: Sequence[bytes], pool: str = "full") -> list[bool]:
        """Whether each page is stored (pipelined EXISTS); all False when Redis cannot answer."""
        keys = [self.key(h, pool) for h in hashes]
        self._stats["exists_calls"] += 1
        out = [False] * len(keys)

        async def body() -> list[bool]:
            for chunk in self._chunks(len(keys)):
                replies = await self._pipeline(
                    lambda p, c=chunk: [p.exists(keys[i]) for i in c])
                self._reply_errors(replies)
                for i, r in zip(chunk, replies, strict=True):
                    out[i] = not self._is_error(r) and bool(r)
            return out

        return await self._guarded(body, lambda: [False] * len(keys)) if keys else []

    async def get_pages(self, hashes: Sequence[bytes], pool: str,
                        fingerprint: bytes, page_keys: Sequence[bytes] | None = None
                        ) -> list[PageValue | None]:
        """The stored, verified pages (None for a miss or a corrupt value, which is deleted).
        ``page_keys``: keyed pages, each value must carry its key (codec, KEYED)."""
        n = len(hashes)
        keys = [self.key(h, pool) for h in hashes]
        out: list[PageValue | None] = [None] * n
        self._stats["gets"] += n
        if not n:
            return out
        corrupt: list[str] = []

        def verify(got: list[tuple[int, bytes]]) -> list[tuple[int, PageValue | None]]:
            checked: list[tuple[int, PageValue | None]] = []
            for i, raw in got:
                try:
                    checked.append((i, decode_page(raw, hashes[i], fingerprint, pool,
                                                   page_keys[i] if page_keys else None)))
                except CorruptPage:
                    checked.append((i, None))
            return checked

        async def one(chunk: range) -> None:
            replies = await self._pipeline(lambda p: [p.get(keys[i]) for i in chunk])
            self._reply_errors(replies)
            got: list[tuple[int, bytes]] = []
            for i, raw in zip(chunk, replies, strict=True):
                if raw is None:
                    continue
                if self._is_error(raw):
                    self._stats["errors"] += 1
                    continue
                self._stats["bytes_read"] += len(raw)
                got.append((i, raw))
            size = sum(len(raw) for _, raw in got)
            # the checksum runs at memory speed: big chunks go to a thread, off the event loop
            checked = (await asyncio.get_running_loop().run_in_executor(None, verify, got)
                       if size > VERIFY_INLINE_BYTES else verify(got))
            for i, value in checked:
                if value is None:
                    self._stats["corrupt"] += 1
                    corrupt.append(keys[i])
                out[i] = value

        async def body() -> None:
            results = await asyncio.gather(*(one(c) for c in self._chunks(n)),
                                           return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if corrupt:
                await self._delete_keys(corrupt)
            for r in failed:
                if isinstance(r, _CallFailed):
                    raise r
                raise _CallFailed(describe(r)) from r

        await self._guarded(body, lambda: None)
        hits = sum(v is not None for v in out)
        self._stats["hits"] += hits
        self._stats["misses"] += n - hits
        return out

    async def set_pages(self, values: Sequence[bytes]) -> int:
        """Store encoded page values (codec.encode_page), each under the key its header names;
        SET with EX when a TTL is configured. Returns how many were stored; the rest (Redis down,
        breaker open, error replies) are counted in ``set_failures``."""
        return (await self.set_pages_each(values)).count(True)

    async def set_pages_each(self, values: Sequence[bytes]) -> list[bool | None]:
        """:meth:`set_pages`, saying of each value, in order, whether Redis confirmed it stored
        it (True), refused it or was never asked (False), or may hold it (None: its pipeline
        failed once sent, a timeout, or a Cluster pipeline of which one node failed while the
        others stored their part). Part of a pipeline can fail (an ACL, ``maxmemory`` crossed
        half way); a writer charges what Redis may hold to the namespace's quota."""
        items: list[tuple[str, bytes, int]] = []
        for i, v in enumerate(values):
            pool, page_hash = peek_header(v)
            items.append((self.key(page_hash, pool), v, i))
        ok: list[bool | None] = [False] * len(items)
        if not items:
            return ok
        # Pipelines bounded by command count and by bytes.
        chunks: list[list[tuple[str, bytes, int]]] = [[]]
        size = 0
        for kv in items:
            cur = chunks[-1]
            full = len(cur) >= self.max_pipeline or size + len(kv[1]) > self.max_pipeline_bytes
            if cur and full:
                chunks.append([])
                size = 0
            chunks[-1].append(kv)
            size += len(kv[1])
        ex = self.ttl or None

        stored = 0

        async def one(chunk: list[tuple[str, bytes, int]]) -> None:
            nonlocal stored
            try:
                replies = await self._pipeline(
                    lambda p: [p.set(k, v, ex=ex) for k, v, _ in chunk])
            except _CallFailed as exc:
                for (k, _v, i) in chunk:
                    ok[i] = self._left_of(exc.__cause__ or exc, k)
                raise
            for (k, v, i), r in zip(chunk, replies, strict=True):
                if isinstance(r, (RedisConnectionError, RedisTimeoutError, OSError)):
                    ok[i] = self._left_of(r, k)  # (a node of a cluster failed, the others not)
                elif self._is_error(r) or not r:
                    self._stats["errors"] += isinstance(r, ResponseError)
                else:
                    stored += 1
                    ok[i] = True
                    self._stats["bytes_written"] += len(v)
            self._reply_errors(replies)

        async def body() -> None:
            results = await asyncio.gather(*(one(c) for c in chunks), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r if isinstance(r, _CallFailed) else _CallFailed(describe(r))

        await self._guarded(body, lambda: None)
        self._stats["sets"] += stored
        self._stats["set_failures"] += len(items) - stored
        return ok

    async def counter(self, name: str, at_least: int = 0) -> int | None:
        """The integer under ``<key_prefix><name>`` (0 when the key is absent), or None when
        Redis does not answer or holds something else there. An absent key is set to
        ``at_least`` first (``SET NX``), so that a counter Redis lost (a restart, an eviction)
        comes back where its caller knew it, for the other callers too."""
        key = self.key_prefix + name

        async def body() -> int | None:
            replies = await self._pipeline(
                lambda p: [p.set(key, at_least, nx=True), p.get(key)] if at_least
                else [p.get(key)])
            self._reply_errors(replies)
            reply = replies[-1]
            if reply is None:
                return 0
            try:
                return int(reply)
            except (TypeError, ValueError):
                self._stats["errors"] += 1
                return None

        return await self._guarded(body, lambda: None)

    async def raise_counter(self, name: str, at_least: int) -> int | None:
        """Add one to the integer under ``<key_prefix><name>``; an absent one (never set, or
        lost by Redis) first becomes ``at_least - 1``, so that it comes back where its caller
        knew it. Plain ``SET NX`` and ``INCRBY`` (no script: an ACL for the daemon's keys need not
        allow scripting). Returns the new value, or None when Redis does not answer."""
        key = self.key_prefix + name

        async def body() -> int | None:
            replies = await self._pipeline(
                lambda p: [p.set(key, at_least - 1, nx=True), p.incr(key)])
            self._reply_errors(replies)
            reply = replies[1]
            if self._is_error(reply) or not isinstance(reply, int):
                self._stats["errors"] += 1
                return None
            return reply

        return await self._guarded(body, lambda: None)

    async def delete(self, hashes: Sequence[bytes], pool: str = "full") -> int:
        """Remove these pages of this pool; returns how many keys existed (0 when unreachable)."""
        return await self.unlink(hashes, pool) or 0

    async def unlink(self, hashes: Sequence[bytes], pool: str = "full") -> int | None:
        """:meth:`delete`, or None when Redis did not answer (some may be gone): for a caller
        that must know the values may still be there, to delete them again later."""
        keys = [self.key(h, pool) for h in hashes]
        if not keys:
            return 0
        return await self._guarded(lambda: self._delete_keys(keys), lambda: None)

    async def delete_stale(self, hashes: Sequence[bytes], pool: str = "full") -> int:
        """Remove values that verified but are not what a reader above the codec expects under
        their key (a run of another length, a value of an older layout of values): counted in
        ``stale``, so that they are not read, and refused, on every fetch until overwritten."""
        self._stats["stale"] += len(hashes)
        return await self.delete(hashes, pool)

    async def _delete_keys(self, keys: list[str]) -> int:
        removed = 0
        for chunk in self._chunks(len(keys)):
            # UNLINK frees large values off the server's main thread. Sent as a raw single-key
            # command: the cluster pipeline's unlink() is a multi-key coroutine, not a queued one.
            replies = await self._pipeline(
                lambda p, c=chunk: [p.execute_command("UNLINK", keys[i]) for i in c])
            self._reply_errors(replies)
            removed += sum(r for r in replies if isinstance(r, int))
        self._stats["deletes"] += removed
        return removed
