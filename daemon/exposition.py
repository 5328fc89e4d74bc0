"""Prometheus text exposition (format 0.0.4), rendered on scrape from the daemon's live state.

No client library: the daemon's counters already live in plain dicts (the hot path only adds
integers), so a scrape reads them once and writes text. Names follow the Prometheus conventions:
the ``radixd_`` prefix, base units in names, ``_total`` on counters, one ``# HELP`` and one
``# TYPE`` line per family, every label set the daemon knows pre-initialised to 0 so that series
never go missing, and tenant labels guarded against unbounded cardinality.

docs/operations.md has the reference table of every family; keep it in step with ``collect``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from radixd_client import protocol as P

from . import __version__
from .metrics import LATENCY_BUCKETS

if TYPE_CHECKING:
    from .server import Server

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: eviction triggers every model reports, 0 until they happen
EVICTION_REASONS = ("alloc", "quota", "explicit", "admin")
#: invariant check kinds: "full" walks everything, "counters" is the O(1) check while busy
CHECK_KINDS = ("full", "counters")
#: the tenant label value the tenants past ``admin.tenant_label_limit`` are summed under
OTHER_TENANT = "_other"

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


# ---------------------------------------------------------------------------- text format

def escape_label_value(value: str) -> str:
    """Backslash, double quote and line feed are the three characters the format escapes."""
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float | int | bool) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in labels.items()) + "}"


class Family:
    """One metric family: a name, a type, a help text and its samples."""

    def __init__(self, name: str, kind: str, help_text: str):
        assert kind in ("counter", "gauge", "histogram", "untyped"), kind
        self.name = name
        self.kind = kind
        self.help = help_text
        self.samples: list[tuple[str, dict[str, str], float | int]] = []

    def add(self, value: float | int, **labels: Any) -> Family:
        self.samples.append((self.name, {k: str(v) for k, v in labels.items()}, value))
        return self

    def add_histogram(self, buckets: Iterable[tuple[float, int]], total: float, count: int,
                      **labels: Any) -> Family:
        """``buckets``: (upper bound, cumulative count) pairs, +Inf last."""
        base = {k: str(v) for k, v in labels.items()}
        for bound, n in buckets:
            self.samples.append((self.name + "_bucket", {**base, "le": format_value(bound)}, n))
        self.samples.append((self.name + "_sum", base, total))
        self.samples.append((self.name + "_count", base, count))
        return self

    def render(self) -> str:
        lines = [f"# HELP {self.name} {escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        lines += [f"{name}{_labels(labels)} {format_value(value)}"
                  for name, labels, value in self.samples]
        return "\n".join(lines)


class Registry:
    """Families in the order they were declared; names are unique."""

    def __init__(self) -> None:
        self.families: dict[str, Family] = {}

    def family(self, name: str, kind: str, help_text: str) -> Family:
        if name in self.families:
            raise ValueError(f"metric family {name} declared twice")
        fam = self.families[name] = Family(name, kind, help_text)
        return fam

    def render(self) -> str:
        return "\n".join(f.render() for f in self.families.values()) + "\n"


# ---------------------------------------------------------------------------- the daemon's families

def render(server: Server) -> str:
    """The whole exposition of a running server, as text."""
    return collect(server).render()


def collect(server: Server) -> Registry:
    reg = Registry()
    service = server.service
    models = list(service.models)

    # -- pools
    pool_fams = {key: reg.family(name, "gauge", text) for key, name, text in _POOL_GAUGES}
    usage = {m: service.pool_usage(m) for m in models}
    for m in models:
        for pool, values in usage[m].items():
            for key, fam in pool_fams.items():
                fam.add(values[key], model=m, pool=pool)

    # -- lookups and the tree
    matches = reg.family("radixd_matches_total", "counter", "Match operations (prefix lookups).")
    match_tokens = reg.family("radixd_match_tokens_total", "counter",
                              "Tokens looked up by match operations.")
    hit_tokens = reg.family("radixd_hit_tokens_total", "counter",
                            "Tokens of the usable cached prefixes matches found, by tier (device: "
                            "already on device; host: copied back by a load; pages fetched from "
                            "L3 are loaded from host and count there). Hit ratio: "
                            "sum(rate(radixd_hit_tokens_total[5m])) / "
                            "rate(radixd_match_tokens_total[5m]).")
    evicted = reg.family("radixd_evicted_pages_total", "counter",
                         "Pages evicted from the tree, by pool and trigger (alloc: to make room "
                         "for an allocation; quota: a tenant over its quota; explicit: an engine's "
                         "evict; admin: POST /v1/evict).")
    nodes = reg.family("radixd_tree_nodes", "gauge", "Radix tree nodes holding tokens.")
    for m in models:
        entry = service.models[m]
        c = entry.cache.counters
        matches.add(c["matches"], model=m)
        match_tokens.add(c["match_tokens"], model=m)
        hit_tokens.add(c["hit_tokens"], model=m, tier="device")
        tiers = entry.tiers
        hit_tokens.add(tiers.counters["loaded_tokens"] if tiers else 0, model=m, tier="host")
        by_reason = entry.cache.tree.evictions_by_reason
        reasons = list(EVICTION_REASONS) + sorted(set(by_reason) - set(EVICTION_REASONS))
        for reason in reasons:
            full, swa = by_reason.get(reason, (0, 0))
            evicted.add(full, model=m, pool="full", reason=reason)
            if "swa" in usage[m]:
                evicted.add(swa, model=m, pool="swa", reason=reason)
        nodes.add(service.tree_nodes(m), model=m)

    _tier_families(reg, server, models)

    # -- operations
    ops = reg.family("radixd_operations_total", "counter",
                     "Operations handled, by operation and result code (ok or an error code).")
    latency = reg.family("radixd_operation_duration_seconds", "histogram",
                         "Time to handle one operation inside the daemon (socket I/O excluded).")
    stats = server.op_stats
    known = sorted(set(P.OPS) | set(stats.latency) | {op for op, _ in stats.results})
    results = dict(stats.results)
    for op in known:
        results.setdefault((op, "ok"), 0)
    for (op, code), n in sorted(results.items()):
        ops.add(n, op=op, code=code)
    empty = [(b, 0) for b in (*LATENCY_BUCKETS, math.inf)]
    for op in known:
        h = stats.latency.get(op)
        if h is None:
            latency.add_histogram(empty, 0.0, 0, op=op)
        else:
            latency.add_histogram(h.cumulative(), h.total, h.n, op=op)

    reg.family("radixd_sessions", "gauge", "Open sessions (authenticated connections).").add(
        len(service.sessions))

    # -- the invariant checker
    checks = reg.family("radixd_invariant_checks_total", "counter",
                        "Invariant checks run, by kind (full: every invariant; counters: the "
                        "O(1) page-conservation check run while busy).")
    for kind in sorted(set(CHECK_KINDS) | set(server.checks_run)):
        checks.add(server.checks_run.get(kind, 0), kind=kind)
    last = server.last_check
    reg.family("radixd_invariant_violations", "gauge",
               "Violations the last invariant check found (0: healthy).").add(
        len(last.get("violations") or ()))
    reg.family("radixd_invariant_last_check_timestamp_seconds", "gauge",
               "Unix time of the last invariant check (0: none yet).").add(
        float(last.get("at") or 0.0))

    # -- the process
    reg.family("radixd_uptime_seconds", "gauge", "Seconds since the daemon started.").add(
        max(0.0, time.time() - server.started))
    reg.family("radixd_info", "gauge", "Build and instance information (always 1).").add(
        1, version=__version__, instance=service.instance)

    _tenant_families(reg, server, models)
    return reg


#: L3 client events, as RedisTier.stats names them: (key, family, help)
_L3_COUNTERS = (
    ("gets", "radixd_l3_get_pages_total", "Pages asked of Redis."),
    ("hits", "radixd_l3_hit_pages_total", "Pages Redis returned and that verified."),
    ("sets", "radixd_l3_set_pages_total", "Pages written to Redis."),
    ("set_failures", "radixd_l3_set_failures_total",
     "Page writes dropped (Redis down, slow, full, or the breaker open)."),
    ("corrupt", "radixd_l3_corrupt_pages_total",
     "Values that failed verification (checksum, layout, tokens): deleted, served as misses."),
    ("timeouts", "radixd_l3_timeouts_total", "Redis calls that ran past l3.op_timeout_ms."),
    ("errors", "radixd_l3_errors_total", "Redis calls or replies that failed otherwise."),
    ("breaker_rejects", "radixd_l3_breaker_rejects_total",
     "Calls answered as misses at once because the circuit breaker was open."),
    ("breaker_opens", "radixd_l3_breaker_opens_total", "Times the circuit breaker opened."),
    ("bytes_read", "radixd_l3_read_bytes_total", "Value bytes read from Redis."),
    ("bytes_written", "radixd_l3_written_bytes_total", "Value bytes written to Redis."),
)
_BREAKER_STATES = ("closed", "half_open", "open")


def _tier_families(reg: Registry, server: Server, models: list[str]) -> None:
    """The host tier per model (pages, copies, loads, prefetches) and the shared L3 client."""
    service = server.service
    cap = reg.family("radixd_host_pool_capacity_pages", "gauge",
                     "Host (L2) slots a model's host pool can hold, by pool (0: no host tier).")
    used = reg.family("radixd_host_pool_used_pages", "gauge",
                      "Host (L2) slots holding a page (in the tree, being copied, or being "
                      "written to L3).")
    pages = reg.family("radixd_tier_pages_total", "counter",
                       "Pages moved between tiers, by direction (to_host: device copies backed "
                       "up; to_device: loaded back; from_l3: fetched into host; to_l3: written "
                       "to Redis).")
    copy_s = reg.family("radixd_tier_copy_seconds_total", "counter",
                        "Wall time of device<->host copies (off the event loop), by direction.")
    copy_b = reg.family("radixd_tier_copy_bytes_total", "counter",
                        "Bytes of full-pool pages copied between device and host, by direction.")
    loads = reg.family("radixd_loads_total", "counter",
                       "Loads that copied pages from host, by result (ok, failed).")
    prefetch = reg.family("radixd_prefetches_total", "counter",
                          "Prefetch operations that asked L3, and those whose wait timed out.")
    skipped = reg.family("radixd_host_backups_skipped_total", "counter",
                         "Host copies not made: the host pool or the tenant's host quota was "
                         "full of pages that cannot go (copy errors are in "
                         "radixd_loads_total and the log).")
    for m in models:
        t = service.models[m].tiers
        c = t.counters if t is not None else {}
        h = t.host if t is not None else None
        for pool in ("full", "swa") if service.models[m].cache.swa_enabled else ("full",):
            hp = (h.full if pool == "full" else h.swa) if h is not None else None
            cap.add(hp.usable if hp is not None else 0, model=m, pool=pool)
            used.add(hp.used if hp is not None else 0, model=m, pool=pool)
        for direction, key in (("to_host", "backup_pages"), ("to_device", "load_pages"),
                               ("from_l3", "prefetch_pages"), ("to_l3", "l3_write_pages")):
            n = c.get(key, 0) + (c.get("demoted_sync_pages", 0) if key == "backup_pages" else 0)
            pages.add(n, model=m, direction=direction)
        for direction in ("to_host", "to_device"):
            copy_s.add(t.copy_seconds[direction] if t else 0.0, model=m, direction=direction)
            copy_b.add(t.copy_bytes[direction] if t else 0, model=m, direction=direction)
        loads.add(c.get("loads", 0) - c.get("load_failures", 0), model=m, result="ok")
        loads.add(c.get("load_failures", 0), model=m, result="failed")
        prefetch.add(c.get("prefetches", 0), model=m, result="asked")
        prefetch.add(c.get("prefetch_timeouts", 0), model=m, result="timeout")
        skipped.add(c.get("backup_skipped", 0), model=m)
    l3 = service.l3
    st = l3.stats if l3 is not None else {}
    reg.family("radixd_l3_enabled", "gauge", "1 when an L3 (Redis) tier is configured.").add(
        l3 is not None)
    state = reg.family("radixd_l3_breaker_state", "gauge",
                       "The L3 circuit breaker: 1 for its current state (open: every call is a "
                       "miss until a half-open probe succeeds).")
    for s_ in _BREAKER_STATES:
        state.add(st.get("breaker_state") == s_, state=s_)
    for key, name, text in _L3_COUNTERS:
        reg.family(name, "counter", text).add(st.get(key, 0))


def _tenant_families(reg: Registry, server: Server, models: list[str]) -> None:
    """Per tenant, guarded: the first ``admin.tenant_label_limit`` tenants (configuration order)
    get their own label value; the rest are summed under ``tenant="_other"``."""
    service = server.service
    limit = server.config.admin.tenant_label_limit
    tenants = service.tenants
    label = {t.name: (t.name if i < limit else OTHER_TENANT) for i, t in enumerate(tenants)}
    labels = list(dict.fromkeys(label.values()))

    tree = reg.family("radixd_tenant_tree_pages", "gauge",
                      "Pages cached in the tenant's namespace (tenants sharing a namespace "
                      "report the same pages).")
    held = reg.family("radixd_tenant_held_pages", "gauge",
                      "Pages held by the tenant's open sessions.")
    for m in models:
        pools = ["full", "swa"] if service.models[m].cache.swa_enabled else ["full"]
        usage = service.tenant_usage(m)
        sums = {lb: {"tree_full_pages": 0, "tree_swa_pages": 0, "held_full_pages": 0,
                     "held_swa_pages": 0} for lb in labels}
        counted_ns: dict[str, set[str]] = {lb: set() for lb in labels}
        allowed = {lb: False for lb in labels}
        for t in tenants:
            lb = label[t.name]
            if t.models is not None and m not in t.models:
                continue
            allowed[lb] = True
            u = usage[t.name]
            if t.namespace not in counted_ns[lb]:  # a namespace's pages count once per label
                counted_ns[lb].add(t.namespace)
                sums[lb]["tree_full_pages"] += u["tree_full_pages"]
                sums[lb]["tree_swa_pages"] += u["tree_swa_pages"]
            sums[lb]["held_full_pages"] += u["held_full_pages"]
            sums[lb]["held_swa_pages"] += u["held_swa_pages"]
        for lb in labels:
            if not allowed[lb]:
                continue
            for pool in pools:
                tree.add(sums[lb][f"tree_{pool}_pages"], tenant=lb, model=m, pool=pool)
                held.add(sums[lb][f"held_{pool}_pages"], tenant=lb, model=m, pool=pool)

    counters = (
        ("hit_tokens", "radixd_tenant_hit_tokens_total",
         "Tokens of cached prefixes the tenant's matches found (every model, device tier)."),
        ("match_tokens", "radixd_tenant_match_tokens_total",
         "Tokens the tenant's matches looked up (every model)."),
        ("quota_refusals", "radixd_tenant_quota_refusals_total",
         "Allocations refused because the tenant was over a page quota."),
    )
    for key, name, text in counters:
        fam = reg.family(name, "counter", text)
        sums_c = dict.fromkeys(labels, 0)
        for t in tenants:
            sums_c[label[t.name]] += t.counters.get(key, 0)
        for lb in labels:
            fam.add(sums_c[lb], tenant=lb)
