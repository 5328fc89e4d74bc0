"""``RadixdHiCacheStorage``: SGLang's HiCache storage (L3) interface over radixd's key-addressed
page store, so the SGLang instances of one node share radixd's host tier and its Redis tier.

SGLang loads it with ``--hicache-storage-backend dynamic`` (docs/sglang.md). Page bytes never cross
the socket: the backend maps radixd's host pools (``kv_attach``) and copies between SGLang's host
pool pages and radixd's slots. A radixd page of kind ``full`` (SGLang's ``kv`` pool) or ``swa``
holds one SGLang page of a ``page_first`` host pool: its K block, then its V block.

Under radixd's memory isolation ``kv_attach`` maps only the host segments of this tenant's
namespace, and the radixd client maps the segments the namespace gains before the ``kv_lookup`` or
``kv_reserve`` whose slots lie in them returns (``host_segments_gen``, docs/protocol.md 9.4), in
place: the slot tensors this backend holds keep their address and stay valid.

It never raises into SGLang's cache controller: radixd down or restarting, Redis down, a page that
does not fit, anything unexpected, is a miss (0 / False) and the connection is tried again later
with a growing backoff.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from radixd_client import Client
from radixd_client import protocol as P
from radixd_client.errors import (
    BadArgument,
    LimitExceeded,
    NotFoundError,
    OutOfMemory,
    QuotaExceeded,
    ReceiptError,
)
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from .copier import DEFAULT_MIN_BYTES_PER_THREAD, PageCopier, default_copy_threads
from .pages import KvPageView, page_view, restorable_lengths

logger = logging.getLogger(__name__)
#: SGLang keeps an FP8 KV cache as uint8 (its pools' ``store_dtype``): a uint8 host pool is an FP8
#: entry's, e4m3 or e5m2 alike (the bytes do not say which: instances of the two must not share
#: a model entry)
STORED_AS = {"float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
FP8_HINT = ("float8_e4m3fn or float8_e5m2 (the one of SGLang's --kv-cache-dtype, which it "
            "stores as uint8)")

T = TypeVar("T")

# SGLang's pool names -> radixd's pool kinds; any other pool (Mamba state, DSA indexer, ...) is
# not stored here: its pages are always a miss, which SGLang's hit policies handle.
POOL_KINDS = {PoolName.KV.value: "full", PoolName.SWA.value: "swa"}
#: radixd's answers to one request that leave the session as it was (the call is a miss, the
#: session goes on); anything else (the daemon gone, restarting, a broken frame) reopens it
REFUSALS = (BadArgument, LimitExceeded, NotFoundError, OutOfMemory, QuotaExceeded, ReceiptError)
#: the most bytes one key takes in a request (radixd's longest key, msgpack's bin header), and
#: more than a request takes beside its keys and its model's name
KEY_BYTES, REQUEST_BYTES = P.KV_KEY_MAX + 2, 512


class RadixdHiCacheStorage(HiCacheStorage):
    """One SGLang rank's view of radixd's keyed pages of one model entry.

    ``extra_config`` keys (beside SGLang's ``backend_name``, ``module_path``, ``class_name``,
    ``interface_v1``): ``socket`` (radixd's Unix socket), ``token`` (the tenant's token; one tenant
    per SGLang instance is advised), ``model`` (radixd's model entry whose host page is one SGLang
    page), ``timeout_s`` (per request, default 5), ``fetch_timeout_s`` (bringing pages only Redis
    holds into host, default 2), ``backoff_max_s`` (the longest wait between reconnects, default 5),
    ``copy_threads`` (the most threads one get or set copies pages on, default one per 4 CPUs,
    1 to 4; 1 copies on SGLang's calling thread only) and ``copy_min_bytes_per_thread`` (a
    batch gets one more thread per this many bytes, default 32 MiB, so small batches never pay
    a hand-off).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.socket_path = str(extra.get("socket", "/run/radixd/radixd.sock"))
        self.token = extra.get("token")
        self.model = str(extra.get("model", "default"))
        self.timeout_s = float(extra.get("timeout_s", 5.0))
        self.fetch_timeout_s = float(extra.get("fetch_timeout_s", 2.0))
        self.backoff_max_s = float(extra.get("backoff_max_s", 5.0))
        self._copier = PageCopier(
            _int_setting(extra, "copy_threads", default_copy_threads()),
            _int_setting(extra, "copy_min_bytes_per_thread", DEFAULT_MIN_BYTES_PER_THREAD))
        self.suffix = key_suffix(storage_config)
        self.is_writer = storage_config.is_storage_writer
        self._lock = threading.RLock()  # the session and its calls (held for a whole call)
        # SGLang only drains these (get_stats) with --enable-metrics: kept only when it asks,
        # under a lock of their own so the scheduler never waits behind a radixd call
        self._keep_metrics = bool(storage_config.enable_storage_metrics)
        self._metrics_lock = threading.Lock()
        self._client: Client | None = None
        self._slots: dict[str, torch.Tensor] = {}
        self._views: dict[str, KvPageView] = {}  # radixd kind -> the SGLang host pool's pages
        self._backoff = 0.0
        self._next_try = 0.0
        self._refused: str | None = None  # a configuration error: every call is a miss
        self._metrics = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                         "backup_bandwidth": []}

    # ---- registration ----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV host pool: checked now (layout; page bytes against radixd's when it answers)."""
        super().register_mem_pool_host(mem_pool_host)
        self._register("full", mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        kind = POOL_KINDS.get(str(getattr(host_pool_name, "value", host_pool_name)))
        if kind is None:
            logger.warning("radixd: host pool %s is not stored in radixd (only kv and swa): its "
                           "pages are always a miss", host_pool_name)
            return
        self._register(kind, host_pool)

    def _register(self, kind: str, pool: Any) -> None:
        self._views[kind] = page_view(pool)  # raises for a layout it cannot copy
        with self._lock:
            client = self._connect()
            if client is not None:
                self._check_kind(kind, client.models[self.model])
            if self._refused is not None:
                raise ValueError(self._refused)

    # ---- the connection --------------------------------------------------------------------

    def _connect(self) -> Client | None:
        """The session to radixd, (re)opened when due; None while radixd cannot be reached."""
        if self._client is not None:
            return self._client
        if self._refused is not None or time.monotonic() < self._next_try:
            return None
        try:
            client = Client(self.socket_path, token=self.token, client_name="sglang-hicache",
                            timeout=self.timeout_s)
            try:
                pools = client.kv_attach(self.model)
            except BaseException:
                client.close()
                raise
        except Exception as exc:  # radixd down, restarting, refusing us: a miss
            self._backoff = min(self.backoff_max_s, max(0.05, self._backoff * 2))
            self._next_try = time.monotonic() + self._backoff
            logger.warning("radixd: cannot use %s (model %r): %s; retrying in %.2fs",
                           self.socket_path, self.model, exc, self._backoff)
            return None
        self._client = client
        # views of radixd's host memory; the client remaps new host segments under them in place
        self._slots = {"full": pools.full}
        if pools.swa is not None:
            self._slots["swa"] = pools.swa
        info = client.models[self.model]
        for kind in self._views:
            if self._refused is None:  # (a refusal drops the session: the first one says why)
                self._check_kind(kind, info)
        return None if self._refused is not None else client

    def _check_kind(self, kind: str, info: Any) -> None:
        """Refuse a pool whose pages radixd lays out otherwise: equal bytes are not enough (a
        bfloat16 page read as float16, or 8 tokens of 1 layer as 4 of 2, is wrong KV)."""
        view = self._views[kind]
        slots = self._slots.get(kind)
        layers = info.num_full_layers if kind == "full" else info.num_swa_layers
        if slots is None:
            self._refused = (f"radixd model {self.model!r} has no {kind!r} host pool, but SGLang "
                             f"registered one: give the model entry host_swa_pages and a "
                             f"sliding_window (docs/sglang.md)")
        elif int(slots.shape[1]) != view.page_nbytes or (
                info.page_size, info.num_kv_heads, info.head_dim, layers) != (
                view.page_size, view.heads, view.head_dim, view.layers) or (
                view.dtype_name not in (info.dtype, STORED_AS.get(info.dtype))):
            self._refused = (
                f"SGLang's {kind} host page is {view.page_nbytes} B ({view.describe()}) but radixd "
                f"model {self.model!r} has {int(slots.shape[1])} B host pages of page_size "
                f"{info.page_size}, {layers} layers, {info.num_kv_heads} heads, head_dim "
                f"{info.head_dim}, {info.dtype}: set that model "
                f"entry's page_size = {view.page_size}, num_kv_heads = {view.heads}, head_dim = "
                f"{view.head_dim}, dtype = "
                f"{FP8_HINT if view.dtype_name == 'uint8' else view.dtype_name}, and "
                f"{'num_full_layers' if kind == 'full' else 'num_swa_layers'} = {view.layers}")
        if self._refused is not None:
            logger.error("radixd: %s", self._refused)
            self._drop()

    def _drop(self) -> None:
        client, self._client = self._client, None
        self._slots = {}
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a dead session
                pass

    def _guarded(self, what: str, miss: T, fn: Callable[[Client], T]) -> T:
        """Run ``fn`` on a live session under the lock; anything that goes wrong is ``miss``.
        A refusal keeps the session; any other failure drops it, and the next call opens a new
        one after a backoff that grows while calls keep failing."""
        with self._lock:
            client = self._connect()
            if client is None:
                return miss
            try:
                out = fn(client)
            except REFUSALS as exc:
                logger.warning("radixd: %s refused (%s); a miss", what, exc)
                return miss
            except Exception as exc:
                self._drop()  # the first failure reconnects at once, the next ones back off
                self._next_try = time.monotonic() + self._backoff
                logger.warning("radixd: %s failed (%s: %s); a miss, reconnecting in %.2fs",
                               what, type(exc).__name__, exc, self._backoff)
                self._backoff = min(self.backoff_max_s, max(0.05, self._backoff * 2))
                return miss
            self._backoff = 0.0
            return out

    # ---- keys ------------------------------------------------------------------------------

    def _key(self, key: str) -> bytes:
        raw = (key + self.suffix).encode()
        if len(raw) <= P.KV_KEY_MAX:
            return raw
        return hashlib.sha256(raw).hexdigest().encode()  # a long model name: still scoped

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        return [self._key(k) for k in keys]

    # ---- lookups ---------------------------------------------------------------------------

    def _present(self, client: Client, keys: Sequence[str], kind: str,
                 prefix: bool = True) -> bytes:
        """One byte per key, 1 where radixd holds it. ``prefix``: only up to the first absent
        key (0 after it: only a prefix of the KV is ever used, and asking for more would fetch
        it from Redis for nothing); an extra pool's pages (SWA's trailing ones) are asked for
        whole, their presence being no prefix."""
        out = bytearray()
        for span in _spans(len(keys), _most(client, self.model)):
            present = client.kv_lookup(self.model, self._keys(keys[span]), kind, pin=False,
                                       fetch=True, timeout_s=self.fetch_timeout_s).present
            out += present
            if prefix and 0 in present:
                break
        return bytes(out) + bytes(len(keys) - len(out))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading keys radixd holds (host, or Redis: fetched into host meanwhile)."""
        def run(client: Client) -> int:
            present = self._present(client, keys, "full")
            return present.index(0) if 0 in present else len(present)
        return self._guarded("batch_exists", 0, run)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The KV prefix, cut by each extra pool's hit policy exactly as SGLang's HiCacheFile
        does (TRAILING_PAGES: only the last ``len(transfer.keys)`` pages must be present)."""
        def run(client: Client) -> PoolTransferResult:
            full = self._present(client, keys, "full")
            kv_pages = full.index(0) if 0 in full else len(full)
            pools: list[tuple[str, PoolHitPolicy, int, bytes]] = []
            for t in pool_transfers or []:
                kind = POOL_KINDS.get(str(getattr(t.name, "value", t.name)))
                present = (self._present(client, keys[:kv_pages], kind, prefix=False)
                           if kind in self._slots and kind in self._views and kv_pages
                           else bytes(kv_pages))
                pools.append((t.name, t.hit_policy, max(1, len(t.keys or []) or 1), present))
            final, hits, restorable = restorable_lengths(kv_pages, pools)
            return PoolTransferResult(final, hits, restorable)
        return self._guarded("batch_exists_v2", PoolTransferResult(0, {}, []), run)

    # ---- copies ----------------------------------------------------------------------------

    def _get(self, client: Client, kind: str, keys: Sequence[str],
             pages: Sequence[int]) -> list[bool]:
        """Copy each present key's slot into SGLang's host page; a prefix of True."""
        view, slots = self._views[kind], self._slots[kind]
        hits = 0
        for span in _spans(len(keys), _most(client, self.model, pinned=True)):
            chunk = keys[span]
            got = client.kv_lookup(self.model, self._keys(chunk), kind, pin=True, fetch=True,
                                   timeout_s=self.fetch_timeout_s)
            n = got.present.index(0) if 0 in got.present else len(chunk)
            try:
                self._copier.run(view.load, [(pages[span.start + i], slots[got.slots[i]])
                                             for i in range(n)], view.page_nbytes)
            finally:
                if got.pin:
                    client.kv_release(self.model, got.pin)
            hits += n
            if n < len(chunk):
                break
        return [True] * hits + [False] * (len(keys) - hits)

    def _set(self, client: Client, kind: str, keys: Sequence[str],
             pages: Sequence[int]) -> list[bool]:
        """:meth:`_set_some` over chunks of at most radixd's keys per request."""
        ok: list[bool] = []
        for span in _spans(len(keys), _most(client, self.model, pinned=True)):
            ok += self._set_some(client, kind, keys[span], pages[span])
        return ok

    def _set_some(self, client: Client, kind: str, keys: Sequence[str],
                  pages: Sequence[int]) -> list[bool]:
        """Reserve, copy SGLang's host pages into the fresh slots, commit. A key already stored
        counts as written; one radixd declined (room, quota) or another session is writing is
        not."""
        if not keys:
            return []
        view, slots = self._views[kind], self._slots[kind]
        names = self._keys(keys)
        r = client.kv_reserve(self.model, names, kind)
        try:
            self._copier.run(view.store, [(pages[i], slots[s]) for i, s in enumerate(r.slots) if s],
                             view.page_nbytes)
        except BaseException:
            if r.pin:
                client.kv_release(self.model, r.pin)
            raise
        if r.pin:
            client.kv_commit(self.model, r.pin)
        ok = [bool(s) for s in r.slots]
        rest = [i for i, s in enumerate(r.slots) if not s]
        if rest:
            present = client.kv_lookup(self.model, [names[i] for i in rest], kind,
                                       pin=False).present
            for i, p in zip(rest, present, strict=True):
                ok[i] = bool(p)
        return ok

    def _pages(self, kind: str, n: int, host_indices: torch.Tensor) -> list[int] | None:
        page = self._views[kind].page_size
        if host_indices is None or host_indices.numel() != n * page:
            logger.error("radixd: %d keys but %s host indices (page size %d)", n,
                         None if host_indices is None else host_indices.numel(), page)
            return None
        return host_indices[::page].tolist()

    def _io(self, what: str, kind: str, keys: list[str], host_indices: torch.Tensor,
            op: Callable[[Client, str, Sequence[str], Sequence[int]], list[bool]]) -> list[bool]:
        miss = [False] * len(keys)
        if kind not in self._views:
            return miss
        pages = self._pages(kind, len(keys), host_indices)
        if pages is None:
            return miss
        start = time.perf_counter()
        ok = self._guarded(what, miss, lambda c: op(c, kind, keys, pages))
        self._record(what, sum(ok), time.perf_counter() - start, self._views[kind].page_nbytes)
        return ok

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._io("batch_get_v1", "full", keys, host_indices, self._get)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._io("batch_set_v1", "full", keys, host_indices, self._set)

    def _io_v2(self, what: str, transfers: list[PoolTransfer], op: Callable
               ) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            kind = POOL_KINDS.get(str(getattr(t.name, "value", t.name)))
            if kind is None or kind not in self._views:
                out[t.name] = [False] * len(keys)
                continue
            out[t.name] = self._io(what, kind, keys, t.host_indices, op)
        return out

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._io_v2("batch_get_v2", transfers, self._get)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._io_v2("batch_set_v2", transfers, self._set)

    # ---- the older per-key interface (SGLang's generic page path) --------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Flat pages (``get_dummy_flat_data_page``: K block then V block for page_first)."""
        def run(client: Client) -> list[torch.Tensor | None]:
            out: list[torch.Tensor | None] = [None] * len(keys)
            for span in _spans(len(keys), _most(client, self.model, pinned=True)):
                got = client.kv_lookup(self.model, self._keys(keys[span]), "full", pin=True,
                                       fetch=True, timeout_s=self.fetch_timeout_s)
                try:
                    for i, (p, s) in enumerate(zip(got.present, got.slots, strict=True),
                                               span.start):
                        target = target_locations[i]
                        if p and target is not None and \
                                target.nbytes == self._slots["full"].shape[1]:
                            target.view(torch.uint8).copy_(self._slots["full"][s])
                            out[i] = target
                finally:
                    if got.pin:
                        client.kv_release(self.model, got.pin)
            return out
        return self._guarded("batch_get", [None] * len(keys), run)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        def run(client: Client) -> bool:
            slots = self._slots["full"]
            if any(v.nbytes != slots.shape[1] for v in values):
                return False
            stored = True
            for span in _spans(len(keys), _most(client, self.model, pinned=True)):
                r = client.kv_reserve(self.model, self._keys(keys[span]), "full")
                for s, v in zip(r.slots, values[span], strict=True):
                    if s:
                        slots[s].copy_(v.contiguous().view(torch.uint8).reshape(-1))
                if r.pin:
                    client.kv_commit(self.model, r.pin)
                stored = stored and r.full == 0 and r.busy == 0
            return stored
        return self._guarded("batch_set", False, run)

    # ---- the rest --------------------------------------------------------------------------

    def clear(self) -> bool:
        """Drop this tenant's keyed pages of the model (host and Redis); False when Redis has
        not recorded the clear (it is down: clear again once it answers)."""
        # (None: a radixd from before the answer said; it cleared what it knew, as ever)
        return self._guarded("clear", False,
                             lambda c: c.kv_clear(self.model).l3_cleared is not False)

    def _record(self, what: str, pages: int, seconds: float, page_nbytes: int) -> None:
        if not self._keep_metrics:
            return
        side = "prefetch" if "get" in what else "backup"
        with self._metrics_lock:
            self._metrics[f"{side}_pgs"].append(pages)
            self._metrics[f"{side}_bandwidth"].append(
                pages * page_nbytes / seconds / 1e9 if seconds > 0 else 0.0)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call: pages and GB/s per get and set."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._metrics_lock:
            metrics, self._metrics = self._metrics, {k: [] for k in self._metrics}
        return StorageMetrics(**metrics)

    def close(self) -> None:
        with self._lock:
            self._drop()
            self._copier.close()


def _spans(n: int, most: int) -> Iterator[slice]:
    """``n`` keys in runs of at most ``most`` (:func:`_most`)."""
    for start in range(0, n, most):
        yield slice(start, min(n, start + most))


def _most(client: Client, model: str, pinned: bool = False) -> int:
    """Most keys one request on ``model`` may name: radixd's keys per request, as many as its
    frame limit takes (a daemon may set ``max_frame_bytes`` as low as 1 KiB: hello's limits say
    it), and for a pinned lookup or a reservation the session's pin cap
    (``max_locks_per_session``; this backend holds one pin at a time)."""
    room = client.limits.max_frame_bytes - REQUEST_BYTES - len(model.encode())
    most = min(P.KV_MAX_KEYS, room // KEY_BYTES)
    cap = client.limits.max_locks_per_session
    if pinned and cap > 0:
        most = min(most, cap)
    return max(1, most)


def _int_setting(extra: dict, name: str, default: int) -> int:
    """An integer ``extra_config`` setting; a clear error at launch for anything else."""
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"radixd: extra_config {name} must be an integer, not {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"radixd: extra_config {name} must be an integer, not {value!r}") from None


def key_suffix(config: HiCacheStorageConfig) -> str:
    """What SGLang's HiCacheFile appends to a page hash: the model, and the TP rank and size
    (not for MLA, whose KV every TP rank holds alike), PP when pipelined, the attention CP
    rank. Not the DP rank: DP attention groups hold the same KV for the same prefix (SGLang's
    HiCacheFile and Mooncake keys leave it out too), so they share it."""
    model = "-".join(config.model_name.split("/")) if config.model_name else ""
    suffix = f"_{config.pp_size}_{config.pp_rank}" if config.pp_size > 1 else ""
    if config.attn_cp_size > 1:
        suffix += f"_cp{config.attn_cp_rank}_{config.attn_cp_size}"
    if config.is_mla_model:
        return f"_{model}{suffix}"
    return f"_{model}_{config.tp_rank}_{config.tp_size}{suffix}"
