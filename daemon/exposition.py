"""Prometheus exposition, rendered on scrape from the daemon's live state.

The hot path stays free of any metrics library: the daemon's counters are plain ints in dicts that
operations add to on the event loop. At scrape time ``Collector`` (a prometheus_client custom
collector) reads them through the service's query API, the checker and ``ServerState``, and
prometheus_client writes the text format 0.0.4 or, when the scraper's Accept header asks for it,
OpenMetrics 1.0.0. Names follow the Prometheus conventions: the ``radixd_`` prefix, base units in
names, ``_total`` on counters, every label set the daemon knows pre-initialised to 0 so that series
never go missing, and tenant labels guarded against unbounded cardinality.

docs/operations.md has the reference table of every family; keep it in step with ``collect``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString
from radixd_client import protocol as P

from . import __version__
from .checker import CHECK_KINDS, Checker
from .config import OTHER_TENANT
from .metrics import LATENCY_BUCKETS, GcPauses
from .open_files import NearLimit, open_count, soft_limit
from .process_memory import HeapTrimmer, heap_stats, rss_bytes
from .queries import ModelView, ServerState
from .service import Service

_POOL_GAUGES = (
    ("capacity", "radixd_pool_capacity_pages",
     "Pages a pool can hand out (the padding page 0 excluded)."),
    ("free", "radixd_pool_free_pages", "Pages on a pool's free list."),
    ("tree", "radixd_pool_tree_pages", "Pages cached in the radix tree (evictable + locked)."),
    ("evictable", "radixd_pool_evictable_pages",
     "Cached pages no lock protects: the next to go under memory pressure."),
    ("locked", "radixd_pool_locked_pages",
     "Cached pages protected by a session's lock (match or insert with lock)."),
    ("held", "radixd_pool_held_pages",
     "Pages allocated to sessions and not yet given to the tree or freed."),
)



def render(collector: Collector, accept: str = "") -> tuple[bytes, str]:
    """The exposition and its content type, in the format the Accept header asks for; an
    Accept prometheus_client cannot read (``version=abc``) gets the text format, as none does."""
    try:
        encoder, content_type = choose_encoder(accept)
    except (TypeError, ValueError):  # the version compared as a string with numbers
        encoder, content_type = choose_encoder("")
    return encoder(collector), content_type  # an encoder only calls collect()


class _Families:
    """Families in the order they are declared; a name declared twice is a bug."""

    def __init__(self) -> None:
        self.out: dict[str, Metric] = {}

    def _add(self, fam: Metric) -> Any:
        if fam.name in self.out:
            raise ValueError(f"metric family {fam.name} declared twice")
        self.out[fam.name] = fam
        return fam

    def counter(self, name: str, text: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
        return self._add(CounterMetricFamily(name, text, labels=labels))

    def gauge(self, name: str, text: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
        return self._add(GaugeMetricFamily(name, text, labels=labels))

    def histogram(self, name: str, text: str, labels: tuple[str, ...] = ()
                  ) -> HistogramMetricFamily:
        return self._add(HistogramMetricFamily(name, text, labels=labels))


class Collector:
    """A prometheus_client collector over the daemon's counters (read at scrape time only)."""

    def __init__(self, service: Service, state: ServerState, checker: Checker,
                 tenant_label_limit: int):
        self.service = service
        self.state = state
        self.checker = checker
        self.tenant_label_limit = tenant_label_limit

    def collect(self) -> Iterator[Metric]:
        reg = _Families()
        service = self.service
        views = service.model_views()

        # -- pools
        pool_fams = {key: reg.gauge(name, text, ("model", "pool"))
                     for key, name, text in _POOL_GAUGES}
        for v in views:
            for pool, usage in v.pools.items():
                for key, fam in pool_fams.items():
                    fam.add_metric([v.name, pool], getattr(usage, key))

        _segment_families(reg, views)

        # -- lookups and the tree
        matches = reg.counter("radixd_matches_total", "Match operations (prefix lookups).",
                              ("model",))
        match_tokens = reg.counter("radixd_match_tokens_total",
                                   "Tokens looked up by match operations.", ("model",))
        hit_tokens = reg.counter(
            "radixd_hit_tokens_total",
            "Tokens of the usable cached prefixes matches found, by tier (device: already on "
            "device; host: copied back by a load; pages fetched from L3 are loaded from host and "
            "count there). Hit ratio: sum without (tier) (rate(radixd_hit_tokens_total[5m])) / "
            "rate(radixd_match_tokens_total[5m]).", ("model", "tier"))
        evicted = reg.counter(
            "radixd_evicted_pages_total",
            "Pages evicted from the tree, by pool and trigger (alloc: to make room for an "
            "allocation; quota: a tenant over its quota; explicit: an engine's evict; admin: "
            "POST /v1/evict).", ("model", "pool", "reason"))
        nodes = reg.gauge("radixd_tree_nodes", "Radix tree nodes holding tokens.", ("model",))
        compactions = reg.counter(
            "radixd_tree_page_id_compactions_total",
            "Tree nodes whose page ids changed form: compacted (a cold node's ids kept as their "
            "runs, while the daemon is idle) or expanded (back to an array when used again).",
            ("model", "direction"))
        listings = reg.gauge(
            "radixd_tree_page_id_listing_bytes",
            "Bytes of page-id listings of runs kept for the next matches (at most 512 KiB a "
            "model): a match through a kept run copies it instead of listing it again.",
            ("model",))
        for v in views:
            matches.add_metric([v.name], v.matches)
            match_tokens.add_metric([v.name], v.match_tokens)
            hit_tokens.add_metric([v.name, "device"], v.hit_tokens)
            hit_tokens.add_metric([v.name, "host"], v.host_hits)
            for reason, n in v.evictions.items():
                evicted.add_metric([v.name, "full", reason], n.full)
                if v.swa:
                    evicted.add_metric([v.name, "swa", reason], n.swa)
            nodes.add_metric([v.name], v.nodes)
            compactions.add_metric([v.name, "compacted"], v.compacted_nodes)
            compactions.add_metric([v.name, "expanded"], v.expanded_nodes)
            listings.add_metric([v.name], v.listing_bytes)

        _tier_families(reg, service, views)
        _keyed_families(reg, views)

        # -- operations
        ops = reg.counter("radixd_operations_total",
                          "Operations handled, by operation and result code (ok or an error "
                          "code).", ("op", "code"))
        latency = reg.histogram("radixd_operation_duration_seconds",
                                "Time to handle one operation inside the daemon (socket I/O "
                                "excluded).", ("op",))
        stats = self.state.op_stats
        known = sorted(set(P.OPS) | set(stats.latency) | {op for op, _ in stats.results})
        results = dict(stats.results)
        for op in known:
            results.setdefault((op, "ok"), 0)
        for (op, code), n in sorted(results.items()):
            ops.add_metric([op, code], n)
        bounds = [floatToGoString(b) for b in (*LATENCY_BUCKETS, math.inf)]
        for op in known:
            h = stats.latency.get(op)
            cumulative = [n for _, n in h.cumulative()] if h is not None else [0] * len(bounds)
            latency.add_metric([op], list(zip(bounds, cumulative, strict=True)),
                               h.total if h is not None else 0.0)

        reg.gauge("radixd_sessions", "Open sessions (authenticated connections).").add_metric(
            [], service.session_count())

        # -- the invariant checker
        checks = reg.counter("radixd_invariant_checks_total",
                             "Invariant checks run, by kind (full: every invariant; counters: "
                             "the O(1) page-conservation check run while busy).", ("kind",))
        runs = self.checker.runs
        for kind in sorted(set(CHECK_KINDS) | set(runs)):
            checks.add_metric([kind], runs.get(kind, 0))
        ps = self.checker.passes
        passes = reg.counter("radixd_invariant_stepped_passes_total",
                             "Background full checks run in steps between requests, by outcome "
                             "(done: to the end over an unchanged state; given_up: the state "
                             "changed during it; unconfirmed: the complete check did not confirm "
                             "what it found; failed: it raised, logged).", ("outcome",))
        for outcome, n in (("done", ps.done), ("given_up", ps.given_up),
                           ("unconfirmed", ps.unconfirmed), ("failed", ps.failed)):
            passes.add_metric([outcome], n)
        ended = reg.counter("radixd_invariant_slices_total",
                            "Slices of the stepped background check, by what ended them (request: "
                            "a request waited; budget: checker.slice_ms ran out, or the pass "
                            "ended).", ("ended",))
        ended.add_metric(["request"], ps.gave_way)
        ended.add_metric(["budget"], ps.slices - ps.gave_way)
        slices = reg.gauge("radixd_invariant_longest_slice_seconds",
                           "The longest the stepped background check held the event loop at "
                           "once, by clock (wall: including time the process was not running; "
                           "cpu: the thread's own time).", ("clock",))
        slices.add_metric(["wall"], ps.longest_slice_s)
        slices.add_metric(["cpu"], ps.longest_slice_cpu_s)
        reg.gauge("radixd_invariant_longest_step_seconds",
                  "The longest single step of the stepped background check (wall clock): the "
                  "most a request that arrives during a slice waits for it to give way."
                  ).add_metric([], ps.longest_step_s)
        last = self.checker.last
        reg.gauge("radixd_invariant_violations",
                  "Violations the last invariant check found (0: healthy).").add_metric(
            [], len(last.violations))
        reg.gauge("radixd_invariant_last_check_timestamp_seconds",
                  "Unix time of the last invariant check (0: none yet).").add_metric(
            [], float(last.at or 0.0))

        # -- the process
        reg.gauge("radixd_uptime_seconds", "Seconds since the daemon started.").add_metric(
            [], max(0.0, time.time() - self.state.started))
        reg.gauge("radixd_info", "Build and instance information (always 1).",
                  ("version", "instance")).add_metric([__version__, service.instance], 1)
        _heap_families(reg, self.state.heap_trimmer)
        _gc_families(reg, self.state.gc_pauses)
        _descriptor_families(reg, self.state.near_limit)
        reg.counter("radixd_idle_compaction_seconds",
                    "Seconds the event loop spent keeping cold nodes' page ids as runs, while no "
                    "request waited.").add_metric([], self.state.compact_seconds)

        # -- the last start's warm restart of the host tier (server.state_dir)
        wr = service.restart
        pages = reg.gauge("radixd_warm_restart_pages",
                  "Host pages the last start restored (kept) or refused (dropped: failed "
                  "verification, layout changed, or did not fit) from server.state_dir or the "
                  "fd store.",
                          ("outcome",))
        pages.add_metric(["kept"], wr.kept_pages)
        pages.add_metric(["dropped"], wr.dropped_pages)
        reg.gauge("radixd_warm_restart_restore_seconds",
                  "Seconds the last start spent restoring the host tier (0: nothing saved)."
                  ).add_metric([], wr.restore_seconds)

        _tenant_families(reg, service, self.tenant_label_limit)
        return iter(reg.out.values())


def _segment_families(reg: _Families, views: list[ModelView]) -> None:
    """Memory isolation's segments: how many serve no namespace, and how often one changed
    namespace (each such move zeroes the segment's memory first)."""
    count = reg.gauge("radixd_pool_segments", "Segments of a pool under memory isolation, by "
                      "state (free: on the free list; assigned: serving a namespace).",
                      ("model", "pool", "state"))
    moves = reg.counter("radixd_pool_segment_assignments_total",
                        "Segments handed to a namespace, by kind (clean: it had served no other "
                        "namespace; moved: it last served another namespace, so its memory was "
                        "replaced with zeroed memory first).",
                        ("model", "pool", "kind"))
    for v in views:
        for pool, seg in (v.segments or {}).items():
            count.add_metric([v.name, pool, "free"], seg.free)
            count.add_metric([v.name, pool, "assigned"], seg.segments - seg.free)
            moves.add_metric([v.name, pool, "clean"], seg.assigned - seg.moved)
            moves.add_metric([v.name, pool, "moved"], seg.moved)


def _descriptor_families(reg: _Families, near: NearLimit) -> None:
    """Open descriptors against the limit: an alert on their ratio comes before engines'
    connections are reset (daemon/open_files.py)."""
    count = open_count()
    if count is not None:
        reg.gauge("radixd_open_fds", "Descriptors the daemon has open.").add_metric([], count)
    reg.gauge("radixd_max_fds", "The most descriptors the daemon may open (its soft "
              "RLIMIT_NOFILE).").add_metric([], soft_limit())
    reg.counter("radixd_connections_near_fd_limit", "Engine connections accepted with a "
                "descriptor past 90% of the limit (a warning is logged at most once a minute)."
                ).add_metric([], near.seen)


def _heap_families(reg: _Families, trimmer: HeapTrimmer) -> None:
    rss = rss_bytes()
    if rss is not None:
        reg.gauge("radixd_resident_memory_bytes", "The daemon's resident set size.").add_metric(
            [], rss)
    heap = heap_stats()
    if heap is not None:
        fam = reg.gauge("radixd_heap_bytes", "glibc's heap over all arenas: in_use (handed out, "
                        "mmapped blocks included), free_held (freed but kept by glibc).",
                        ("kind",))
        fam.add_metric(["in_use"], heap.in_use)
        fam.add_metric(["free_held"], heap.free_held)
    reg.counter("radixd_malloc_trims", "malloc_trim(0) calls (server.malloc_trim_interval_s)."
                ).add_metric([], trimmer.runs)
    reg.counter("radixd_malloc_trim_seconds", "Seconds spent in malloc_trim (in a worker thread)."
                ).add_metric([], trimmer.seconds)
    reg.counter("radixd_malloc_trim_released_bytes",
                "RSS the trims gave back (RSS before minus after each trim).").add_metric(
        [], trimmer.released_bytes)


def _gc_families(reg: _Families, gc_pauses: GcPauses) -> None:
    pauses = reg.histogram(
        "radixd_gc_pause_seconds",
        "Collections of Python's cyclic garbage collector, by generation, and how long each held "
        "the event loop (every request waits for one in progress).", ("generation",))
    longest = reg.gauge("radixd_gc_longest_pause_seconds",
                        "The longest collection of each generation since the start.",
                        ("generation",))
    bounds = [floatToGoString(b) for b in (*LATENCY_BUCKETS, math.inf)]
    for g, h in gc_pauses.pauses.items():
        pauses.add_metric([str(g)], list(zip(bounds, (n for _, n in h.cumulative()), strict=True)),
                          h.total)
        longest.add_metric([str(g)], gc_pauses.longest[g])


#: L3 client events, as RedisTier.stats names them: (key, family, help)
_L3_COUNTERS = (
    ("gets", "radixd_l3_get_pages_total",
     "Values asked of Redis (a page, or a run of a hash block's pages when pages are small)."),
    ("hits", "radixd_l3_hit_pages_total", "Values Redis returned and that verified."),
    ("sets", "radixd_l3_set_pages_total", "Values written to Redis."),
    ("set_failures", "radixd_l3_set_failures_total",
     "Value writes dropped (Redis down, slow, full, or the breaker open)."),
    ("corrupt", "radixd_l3_corrupt_pages_total",
     "Values that failed verification (checksum, layout, tokens): deleted, served as misses."),
    ("stale", "radixd_l3_stale_values_total",
     "Values that verified but were not the run their key names (an older format): deleted."),
    ("timeouts", "radixd_l3_timeouts_total", "Redis calls that ran past l3.op_timeout_ms."),
    ("errors", "radixd_l3_errors_total", "Redis calls or replies that failed otherwise."),
    ("breaker_rejects", "radixd_l3_breaker_rejects_total",
     "Calls answered as misses at once because the circuit breaker was open."),
    ("breaker_opens", "radixd_l3_breaker_opens_total", "Times the circuit breaker opened."),
    ("bytes_read", "radixd_l3_read_bytes_total", "Value bytes read from Redis."),
    ("bytes_written", "radixd_l3_written_bytes_total", "Value bytes written to Redis."),
)
_BREAKER_STATES = ("closed", "half_open", "open")


def _tier_families(reg: _Families, service: Service, views: list[ModelView]) -> None:
    """The host tier per model (pages, copies, loads, prefetches) and the shared L3 client."""
    mp, md, mr = ("model", "pool"), ("model", "direction"), ("model", "result")
    cap = reg.gauge("radixd_host_pool_capacity_pages",
                    "Host (L2) slots a model's host pool can hold, by pool (0: no host tier).", mp)
    used = reg.gauge("radixd_host_pool_used_pages",
                     "Host (L2) slots holding a page (in the tree, being copied, or being "
                     "written to L3).", mp)
    pages = reg.counter("radixd_tier_pages_total",
                        "Pages moved between tiers, by direction (to_host: device copies backed "
                        "up; to_device: loaded back; from_l3: fetched into host; to_l3: written "
                        "to Redis).", md)
    copy_s = reg.counter("radixd_tier_copy_seconds_total",
                         "Wall time of device<->host copies (off the event loop), by direction.",
                         md)
    copy_b = reg.counter("radixd_tier_copy_bytes_total",
                         "Bytes of full-pool pages copied between device and host, by "
                         "direction.", md)
    loads = reg.counter("radixd_loads_total",
                        "Loads that copied pages from host, by result (ok, failed).", mr)
    prefetch = reg.counter("radixd_prefetches_total",
                           "Prefetch operations that asked L3, and those whose wait timed out.",
                           mr)
    skipped = reg.counter("radixd_host_backups_skipped_total",
                          "Host copies not made: the host pool or the tenant's host quota was "
                          "full of pages that cannot go (copy errors are in "
                          "radixd_loads_total and the log).", ("model",))
    for v in views:
        m, t = v.name, v.tiers
        c = t.counters if t is not None else {}
        for pool in ("full", "swa") if v.swa else ("full",):
            hp = t.host.get(pool) if t is not None else None
            cap.add_metric([m, pool], hp.capacity if hp is not None else 0)
            used.add_metric([m, pool], hp.used if hp is not None else 0)
        for direction, key in (("to_host", "backup_pages"), ("to_device", "load_pages"),
                               ("from_l3", "prefetch_pages"), ("to_l3", "l3_write_pages")):
            n = c.get(key, 0) + (c.get("demoted_sync_pages", 0) if key == "backup_pages" else 0)
            pages.add_metric([m, direction], n)
        for direction in ("to_host", "to_device"):
            copy_s.add_metric([m, direction], t.copy_seconds[direction] if t else 0.0)
            copy_b.add_metric([m, direction], t.copy_bytes[direction] if t else 0)
        loads.add_metric([m, "ok"], c.get("loads", 0) - c.get("load_failures", 0))
        loads.add_metric([m, "failed"], c.get("load_failures", 0))
        prefetch.add_metric([m, "asked"], c.get("prefetches", 0))
        prefetch.add_metric([m, "timeout"], c.get("prefetch_timeouts", 0))
        skipped.add_metric([m], c.get("backup_skipped", 0))
    st = service.l3_stats()
    reg.gauge("radixd_l3_enabled", "1 when an L3 (Redis) tier is configured.").add_metric(
        [], st is not None)
    st = st or {}
    state = reg.gauge("radixd_l3_breaker_state",
                      "The L3 circuit breaker: 1 for its current state (open: every call is a "
                      "miss until a half-open probe succeeds).", ("state",))
    for s_ in _BREAKER_STATES:
        state.add_metric([s_], st.get("breaker_state") == s_)
    for key, name, text in _L3_COUNTERS:
        reg.counter(name, text).add_metric([], st.get(key, 0))


def _keyed_families(reg: _Families, views: list[ModelView]) -> None:
    """The key-addressed store per model, all namespaces (protocol.md 9.4)."""
    pages = reg.gauge("radixd_keyed_pages",
                      "Pages stored in a model's key-addressed store, by pool (host slots).",
                      ("model", "pool"))
    pins = reg.gauge("radixd_keyed_pins",
                     "Lookup pins and reservations held now in a model's key-addressed store.",
                     ("model",))
    events = reg.counter(
        "radixd_keyed_events_total",
        "The key-addressed store's counters (operations.md, \"Tiers in /v1/stats\"), by event: "
        "the kv_ name of the stats counter without its prefix, e.g. lookups, hit_keys, "
        "reserved, committed, declined, evicted, l3_write_pages.", ("model", "event"))
    for v in views:
        if v.keyed is None:
            continue
        for pool, n in v.keyed.pages.items():
            pages.add_metric([v.name, pool], n)
        pins.add_metric([v.name], v.keyed.pins)
        for key, n in v.keyed.counters.items():
            events.add_metric([v.name, key.removeprefix("kv_")], n)


def _tenant_families(reg: _Families, service: Service, limit: int) -> None:
    """Per tenant, guarded: the first ``admin.tenant_label_limit`` tenants (configuration order)
    get their own label value; the rest are summed under ``tenant="_other"``."""
    tenants = service.tenant_views()
    label = {t.name: (t.name if i < limit else OTHER_TENANT) for i, t in enumerate(tenants)}
    labels = list(dict.fromkeys(label.values()))

    tree = reg.gauge("radixd_tenant_tree_pages",
                     "Pages cached in the tenant's namespace (tenants sharing a namespace "
                     "report the same pages).", ("tenant", "model", "pool"))
    held = reg.gauge("radixd_tenant_held_pages", "Pages held by the tenant's open sessions.",
                     ("tenant", "model", "pool"))
    for m in service.model_names():
        pools = ["full", "swa"] if service.has_swa(m) else ["full"]
        sums = {lb: {"tree_full_pages": 0, "tree_swa_pages": 0, "held_full_pages": 0,
                     "held_swa_pages": 0} for lb in labels}
        counted_ns: dict[str, set[str]] = {lb: set() for lb in labels}
        allowed = dict.fromkeys(labels, False)
        for t in tenants:
            u = t.usage.get(m)
            if u is None:  # a model the tenant may not use
                continue
            lb = label[t.name]
            allowed[lb] = True
            if t.namespace not in counted_ns[lb]:  # a namespace's pages count once per label
                counted_ns[lb].add(t.namespace)
                sums[lb]["tree_full_pages"] += u.tree_full_pages
                sums[lb]["tree_swa_pages"] += u.tree_swa_pages
            sums[lb]["held_full_pages"] += u.held_full_pages
            sums[lb]["held_swa_pages"] += u.held_swa_pages
        for lb in labels:
            if not allowed[lb]:
                continue
            for pool in pools:
                tree.add_metric([lb, m, pool], sums[lb][f"tree_{pool}_pages"])
                held.add_metric([lb, m, pool], sums[lb][f"held_{pool}_pages"])

    def summed(key: str) -> dict[str, int]:
        out = dict.fromkeys(labels, 0)
        for t in tenants:
            out[label[t.name]] += t.counters.get(key, 0)
        return out

    hits = reg.counter("radixd_tenant_hit_tokens_total",
                       "Tokens of the usable cached prefixes the tenant's matches found (every "
                       "model), by tier, as radixd_hit_tokens_total.", ("tenant", "tier"))
    for tier, key in (("device", "hit_tokens"), ("host", "host_hit_tokens")):
        for lb, n in summed(key).items():
            hits.add_metric([lb, tier], n)
    counters = (
        ("match_tokens", "radixd_tenant_match_tokens_total",
         "Tokens the tenant's matches looked up (every model)."),
        ("quota_refusals", "radixd_tenant_quota_refusals_total",
         "Allocations refused because the tenant was over a page quota."),
    )
    for key, name, text in counters:
        fam = reg.counter(name, text, ("tenant",))
        for lb, n in summed(key).items():
            fam.add_metric([lb], n)
