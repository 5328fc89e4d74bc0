"""/metrics against a real daemon and in process: families, labels and values that follow real
traffic, escaping and the tenant label guard, OpenMetrics on request."""

from __future__ import annotations

import math
import time
from array import array
from pathlib import Path

import pytest
from radixd_client import Client
from radixd_client.errors import NotFoundError

from daemon import __version__

from .conftest import (
    ADMIN_TOKEN,
    DEVICE_ONLY,
    SMALL_MODEL,
    P,
    cache,
    cache_on_host,
    metric,
    parse_metrics,
    scrape,
    series,
    toks,
)

# ---------------------------------------------------------------------------- metrics

def test_metrics_follow_real_traffic(admin_daemon) -> None:
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN}, "models": DEVICE_ONLY})
    r = d.get("/metrics")
    assert r.status == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    types, samples = parse_metrics(r.text)
    assert metric(samples, "radixd_matches_total", model="m") == 0  # pre-initialised
    assert metric(samples, "radixd_evicted_pages_total", model="m", pool="swa",
                  reason="alloc") == 0

    t1, t2 = toks(4), toks(3, base=1000)
    with Client(d.socket, client_name="metrics-test") as c:
        cache(c, t1)
        cache(c, t2)
        assert c.match("m", t1).prefix_len == 4 * P
        assert c.match("m", toks(2, base=5000)).prefix_len == 0
        locked = c.match("m", t1, lock=True)
        assert locked.prefix_len == 4 * P and locked.receipt is not None
        with pytest.raises(NotFoundError):
            c.match("nope", t1)
        assert c.evict("m", full_pages=10).full_pages == 3  # t2 only: t1 is locked
        c.alloc("m", 2)  # held by the session
        tenant = c.stats("m").models["m"]
        assert d.post("/v1/check").json()["ok"] is True

        types, samples = parse_metrics(d.get("/metrics").text)
        api = d.get_json("/v1/stats")

        # every family is named by the conventions and typed
        for name, kind in types.items():
            assert name.startswith("radixd_"), name
            assert (kind == "counter") == name.endswith("_total"), name
        model = api["models"]["m"]

        # pools: what the API says, and what the traffic implies
        want = {"full": {"capacity": 63, "tree": 4, "locked": 4, "evictable": 0, "held": 2},
                "swa": {"capacity": 31, "tree": 4, "locked": 2, "evictable": 2, "held": 2}}
        for pool, values in want.items():
            got = model["pools"][pool]
            for key, value in values.items():
                assert got[key] == value, (pool, key, got)
            assert got["free"] == got["capacity"] - got["tree"] - got["held"]
            for key, value in got.items():
                assert metric(samples, f"radixd_pool_{key}_pages", model="m",
                              pool=pool) == value, (pool, key)

        # lookups: 3 matches of 16 + 8 + 16 tokens, 32 of them hits
        assert (model["matches"], model["match_tokens"], model["hit_tokens"]) == (3, 40, 32)
        assert metric(samples, "radixd_matches_total", model="m") == 3
        assert metric(samples, "radixd_match_tokens_total", model="m") == 40
        assert metric(samples, "radixd_hit_tokens_total", model="m", tier="device") == 32
        assert model["hit_rate"] == pytest.approx(32 / 40)
        assert (tenant["matches"], tenant["match_tokens"], tenant["hit_tokens"]) == (3, 40, 32)
        assert metric(samples, "radixd_tenant_match_tokens_total", tenant="default") == 40
        assert metric(samples, "radixd_tenant_hit_tokens_total", tenant="default",
                      tier="device") == 32
        assert metric(samples, "radixd_tenant_hit_tokens_total", tenant="default",
                      tier="host") == 0
        assert metric(samples, "radixd_tenant_quota_refusals_total", tenant="default") == 0

        # evictions by trigger (evicting a leaf's full KV frees its SWA KV too)
        assert model["evictions"]["explicit"] == {"full": 3, "swa": 3}
        assert metric(samples, "radixd_evicted_pages_total", model="m", pool="full",
                      reason="explicit") == 3
        assert metric(samples, "radixd_evicted_pages_total", model="m", pool="swa",
                      reason="explicit") == 3
        assert metric(samples, "radixd_evicted_pages_total", model="m", pool="full",
                      reason="admin") == 0

        # the tree: t1 split at the window edge by the lock (2 + 2 pages)
        assert model["nodes"] == 2 == metric(samples, "radixd_tree_nodes", model="m")

        # per tenant usage, as the tenant's own stats say
        for pool in ("full", "swa"):
            assert metric(samples, "radixd_tenant_tree_pages", tenant="default", model="m",
                          pool=pool) == tenant[f"tree_{pool}_pages"] == 4
            assert metric(samples, "radixd_tenant_held_pages", tenant="default", model="m",
                          pool=pool) == tenant[f"held_{pool}_pages"] == 2

        # operations by result code, and their latency histograms
        ops = {(lb["op"], lb["code"]): v for lb, v in series(samples, "radixd_operations_total")}
        assert ops[("hello", "ok")] == 1
        assert ops[("alloc", "ok")] == 3
        assert ops[("insert", "ok")] == 2
        assert ops[("match", "ok")] == 3
        assert ops[("match", "unknown_model")] == 1
        assert ops[("evict", "ok")] == 1
        assert ops[("stats", "ok")] == 1
        assert ops[("lock", "ok")] == 0  # pre-initialised
        for op in ("match", "alloc", "insert", "lock"):
            n = sum(v for (o, _), v in ops.items() if o == op)
            assert metric(samples, "radixd_operation_duration_seconds_count", op=op) == n
            buckets = sorted(((float(lb["le"]), v) for lb, v in
                              series(samples, "radixd_operation_duration_seconds_bucket")
                              if lb["op"] == op))
            assert buckets[-1] == (math.inf, n)
            assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:], strict=False))
        assert api["ops_total"] >= sum(ops.values())

        # sessions, the checker, the process
        assert metric(samples, "radixd_sessions") == api["sessions"] == 1
        assert metric(samples, "radixd_invariant_checks_total", kind="full") >= 1
        assert metric(samples, "radixd_invariant_violations") == 0
        assert metric(samples, "radixd_invariant_last_check_timestamp_seconds") > 1e9
        assert metric(samples, "radixd_uptime_seconds") > 0
        assert metric(samples, "radixd_info", version=__version__, instance=c.instance) == 1
        assert api["instance"] == c.instance and api["version"] == __version__

    # once the session is gone its lock is, and the admin's eviction counts under its reason
    deadline = time.monotonic() + 10
    while d.get_json("/v1/stats")["sessions"] and time.monotonic() < deadline:
        time.sleep(0.01)
    r = d.request("POST", "/v1/evict", json_body={"full_pages": 100, "swa_pages": 100})
    assert r.json() == {"full_pages": 4, "swa_pages": 4, "host_pages": 0}
    _, samples = parse_metrics(d.get("/metrics").text)
    assert metric(samples, "radixd_sessions") == 0
    assert metric(samples, "radixd_evicted_pages_total", model="m", pool="full",
                  reason="admin") == 4  # unlocked once the session ended
    assert metric(samples, "radixd_pool_tree_pages", model="m", pool="full") == 0


def test_metric_label_values_are_escaped_and_tenants_guarded(tmp_path: Path) -> None:
    weird = 'we"ird\\ten\nant'
    tenants = [{"name": n, "token": f"tok-{i}", "namespace": f"ns{i}"}
               for i, n in enumerate(["a", weird, "c", "d", "e"])]
    from daemon.app import build
    from daemon.config import load_config
    from daemon.entities import Peer

    config = load_config(None, env={}, overrides={
        "server": {"socket": str(tmp_path / "s.sock")},
        "admin": {"tenant_label_limit": 2},
        "models": [{**SMALL_MODEL, "export_pools": False}],
        "tenants": tenants,
    })
    daemon = build(config, create_pools=False)
    svc = daemon.service
    for i, t in enumerate(svc.tenants):
        t.counters["hit_tokens"] = 10 ** i
        t.counters["host_hit_tokens"] = 2 * 10 ** i
        svc.open_session(t, Peer())
    text = scrape(daemon)
    assert 'tenant="we\\"ird\\\\ten\\nant"' in text
    _, samples = parse_metrics(text)
    hits = {(lb["tenant"], lb["tier"]): v
            for lb, v in series(samples, "radixd_tenant_hit_tokens_total")}
    assert hits == {("a", "device"): 1, (weird, "device"): 10,
                    ("_other", "device"): 100 + 1000 + 10000, ("a", "host"): 2,
                    (weird, "host"): 20, ("_other", "host"): 2 * (100 + 1000 + 10000)}
    tree = {(lb["tenant"], lb["pool"]) for lb, _ in series(samples, "radixd_tenant_tree_pages")}
    assert tree == {(t, p) for t in ("a", weird, "_other") for p in ("full", "swa")}
    assert metric(samples, "radixd_sessions") == 5
    svc.close()


def test_a_load_that_finds_no_room_on_device_is_a_failed_load_not_a_negative_ok(
        admin_daemon) -> None:
    """Host pages to bring back, and the device pool all held by the session: the load loads
    nothing and counts as one load, failed; radixd_loads_total{result="ok"} stays at 0 (it was
    loads minus failures, and went to -1 for each such load)."""
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN},
                      "models": [{**SMALL_MODEL, "swa_pages": 64}]})
    seq = toks(4)
    with Client(d.socket) as c:
        cache_on_host(c, seq)
        assert d.post("/v1/evict", json_body={"full_pages": 100, "swa_pages": 100}).json()[
            "full_pages"] == 4
        assert c.match("m", seq).host_hit_len == 4 * P
        pools = d.get_json("/v1/stats")["models"]["m"]["pools"]
        held = c.alloc("m", min(pools["full"]["free"], pools["swa"]["free"]))
        assert c.load("m", seq).loaded_len == 0
        tiers = d.get_json("/v1/stats")["models"]["m"]["tiers"]
        samples = parse_metrics(d.get("/metrics").text)[1]
        c.free("m", held.full_pages, held.swa_pages)
    assert (tiers["loads"], tiers["load_failures"]) == (1, 1)
    assert metric(samples, "radixd_loads_total", model="m", result="ok") == 0
    assert metric(samples, "radixd_loads_total", model="m", result="failed") == 1


def test_openmetrics_on_request(admin_daemon) -> None:
    """Accept: application/openmetrics-text gets OpenMetrics 1.0.0 with the same series; a
    plain scrape stays on the text format 0.0.4."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    d = admin_daemon({"admin": {"token": ADMIN_TOKEN}})
    with Client(d.socket) as c:
        cache(c, toks(2))
        plain = d.get("/metrics")
        om = d.get("/metrics", headers={"Accept": "application/openmetrics-text; "
                                                  "version=1.0.0"})
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n")
    _, text_samples = parse_metrics(plain.text)
    om_samples = {(s.name, frozenset(s.labels.items())): s.value
                  for fam in text_string_to_metric_families(om.text) for s in fam.samples}
    volatile = {"radixd_uptime_seconds", "radixd_operations_total", "radixd_heap_bytes",
                "radixd_resident_memory_bytes",
                "radixd_operation_duration_seconds_bucket",
                "radixd_operation_duration_seconds_count", "radixd_operation_duration_seconds_sum",
                "radixd_gc_pause_seconds_bucket", "radixd_gc_pause_seconds_count",
                "radixd_gc_pause_seconds_sum", "radixd_gc_longest_pause_seconds"}
    assert {k for k in om_samples if k[0] not in volatile} == {
        k for k in text_samples if k[0] not in volatile}
    assert metric(om_samples, "radixd_matches_total", model="m") == 0
    assert metric(om_samples, "radixd_pool_tree_pages", model="m", pool="full") == 2
    for accept in ("application/openmetrics-text; version=abc", "text/plain; version=1.x"):
        bad = d.get("/metrics", headers={"Accept": accept})  # the text format, not a 500
        assert bad.status == 200, (accept, bad.status, bad.text[:300])
        assert bad.headers["content-type"].startswith("text/plain; version=0.0.4"), accept
        assert metric(parse_metrics(bad.text)[1], "radixd_pool_tree_pages", model="m",
                      pool="full") == 2


def test_heap_is_trimmed_on_its_interval_and_reported(admin_daemon) -> None:
    """server.malloc_trim_interval_s drives malloc_trim in the daemon; /metrics shows the heap,
    RSS and what the trims did. 0 turns trimming off."""
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN},
                      "server": {"malloc_trim_interval_s": 0.1}})
    with Client(d.socket) as c:
        cache(c, toks(2))
    deadline = time.monotonic() + 30
    while True:
        _, samples = parse_metrics(d.get("/metrics").text)
        if metric(samples, "radixd_malloc_trims_total") >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert metric(samples, "radixd_malloc_trims_total") >= 2
    assert metric(samples, "radixd_malloc_trim_seconds_total") > 0
    assert metric(samples, "radixd_malloc_trim_released_bytes_total") >= 0
    rss = metric(samples, "radixd_resident_memory_bytes")
    in_use = metric(samples, "radixd_heap_bytes", kind="in_use")
    assert 0 < in_use < rss
    assert metric(samples, "radixd_heap_bytes", kind="free_held") >= 0

    off = admin_daemon({"admin": {"token": ADMIN_TOKEN}, "server": {"malloc_trim_interval_s": 0}})
    with Client(off.socket) as c:
        cache(c, toks(2))
    time.sleep(0.5)
    _, samples = parse_metrics(off.get("/metrics").text)
    assert metric(samples, "radixd_malloc_trims_total") == 0


def test_segment_moves_between_tenants_are_reported(admin_daemon) -> None:
    """A segment emptied by one tenant and taken by another is counted as moved (zeroed), in
    /v1/stats and in /metrics; a model without isolation reports no segments."""
    tenants = [{"name": "alice", "token": "alice-token", "namespace": "ns-a"},
               {"name": "bob", "token": "bob-token", "namespace": "ns-b"}]
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN}, "tenants": tenants,
                      "models": [{**SMALL_MODEL, "host_pages": 0, "segment_pages": 4},
                                 {**SMALL_MODEL, "name": "shared", "host_pages": 0,
                                  "memory_isolation": "none"}]})
    seg = d.get_json("/v1/stats")["models"]["m"]["segments"]["full"]
    assert seg["assigned"] == seg["moved"] == 0 and seg["free"] == seg["segments"]
    with Client(d.socket, token="alice-token") as a, Client(d.socket, token="bob-token") as b:
        got = a.alloc("m", 3)
        a.free("m", got.full_pages, got.swa_pages)
        mine = b.alloc("m", 3)  # the segment alice emptied is the one bob gets
        stats = d.get_json("/v1/stats")["models"]
        _, samples = parse_metrics(d.get("/metrics").text)
        b.free("m", mine.full_pages, mine.swa_pages)
    seg = stats["m"]["segments"]["full"]
    assert seg["segment_pages"] == 4
    assert (seg["assigned"], seg["moved"]) == (2, 1)
    assert seg["free"] == seg["segments"] - 1  # bob's segment; alice's went back to the list
    assert stats["shared"]["segments"] is None
    assert metric(samples, "radixd_pool_segment_assignments_total", model="m", pool="full",
                  kind="moved") == 1
    assert metric(samples, "radixd_pool_segment_assignments_total", model="m", pool="full",
                  kind="clean") == 1
    assert metric(samples, "radixd_pool_segments", model="m", pool="full",
                  state="assigned") == 1
    assert not [lb for lb, _ in series(samples, "radixd_pool_segments") if lb["model"] == "shared"]


def test_cold_nodes_page_ids_are_compacted_while_idle_and_expanded_when_used(
        admin_daemon) -> None:
    """At a page of one token a cold node's page ids are kept as their runs while the daemon is
    idle (the compacted count in /metrics), and a match through it lists the same ids as before
    and brings a node of more runs than one in use keeps back to an array (the expanded count).
    The teardown's full check covers the pages' accounting."""
    page1 = {**SMALL_MODEL, "page_size": 1, "sliding_window": 32, "full_pages": 4000,
             "swa_pages": 4000, "host_pages": 0}
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN}, "models": [page1]})
    seqs = [array("i", range(10_000 * k + 1, 10_000 * k + 401)).tobytes() for k in range(7)]
    with Client(d.socket) as c:
        pages = []
        for s in seqs:  # 2800 tokens of churn: the first sequence is cold (after 4000 / 2)
            a = c.alloc("m", 400)
            ids = array("i", a.full_pages)  # five runs of 80, the last first: an array in use
            full = array("i", [p for k in range(4, -1, -1) for p in ids[80 * k:80 * (k + 1)]])
            c.insert("m", s, full.tobytes(), a.swa_pages)
            pages.append(full.tobytes())
        deadline = time.monotonic() + 30
        while True:
            _, samples = parse_metrics(d.get("/metrics").text)
            done = metric(samples, "radixd_tree_page_id_compactions_total", model="m",
                          direction="compacted")
            if done >= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert done >= 1
        assert metric(samples, "radixd_idle_compaction_seconds_total") > 0
        assert metric(samples, "radixd_tree_page_id_compactions_total", model="m",
                      direction="expanded") == 0
        kept = metric(samples, "radixd_tree_page_id_listing_bytes", model="m")
        for s, p in zip(seqs, pages, strict=True):
            m = c.match("m", s)
            assert m.prefix_len == 400 and bytes(m.full_pages) == p
        _, samples = parse_metrics(d.get("/metrics").text)
        assert metric(samples, "radixd_tree_page_id_compactions_total", model="m",
                      direction="expanded") >= 1
        # the windows' SWA runs of compacted nodes are listed once and kept for the next match
        assert kept < metric(samples, "radixd_tree_page_id_listing_bytes", model="m") <= 512 << 10
        assert d.post("/v1/check").json()["ok"] is True

    # server.idle_compaction = false: the same traffic leaves every node's ids an array
    off = admin_daemon({"admin": {"token": ADMIN_TOKEN}, "models": [page1],
                        "server": {"idle_compaction": False}})
    with Client(off.socket) as c:
        for s in seqs:
            a = c.alloc("m", 400)
            c.insert("m", s, a.full_pages, a.swa_pages)
    time.sleep(0.5)
    _, samples = parse_metrics(off.get("/metrics").text)
    assert metric(samples, "radixd_tree_page_id_compactions_total", model="m",
                  direction="compacted") == 0
    assert metric(samples, "radixd_idle_compaction_seconds_total") == 0


def test_garbage_collector_pauses_are_counted_by_generation(admin_daemon) -> None:
    """Every collection of Python's cyclic collector holds the event loop: /metrics counts them
    by generation with how long they took (each generation's series there from the start). A
    few thousand new nodes (several tracked objects each) set off young collections."""
    model = {**SMALL_MODEL, "full_pages": 6000, "swa_pages": 6000, "host_pages": 0}
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN}, "models": [model]})
    _, before = parse_metrics(d.get("/metrics").text)
    for g in ("0", "1", "2"):
        assert metric(before, "radixd_gc_pause_seconds_count", generation=g) >= 0
        assert metric(before, "radixd_gc_longest_pause_seconds", generation=g) >= 0
    with Client(d.socket) as c:
        a = c.alloc("m", 5000)
        for start in range(0, 5000, 250):
            with c.batch() as b:
                for i in range(start, start + 250):
                    b.insert("m", toks(1, base=10 * P * i + 1),
                             a.full_pages[4 * i:4 * i + 4], a.swa_pages[4 * i:4 * i + 4])
    _, after = parse_metrics(d.get("/metrics").text)
    young = (metric(after, "radixd_gc_pause_seconds_count", generation="0")
             - metric(before, "radixd_gc_pause_seconds_count", generation="0"))
    assert young >= 1
    for g in ("0", "1", "2"):
        n = metric(after, "radixd_gc_pause_seconds_count", generation=g)
        assert metric(after, "radixd_gc_pause_seconds_bucket", generation=g, le="+Inf") == n
        total = metric(after, "radixd_gc_pause_seconds_sum", generation=g)
        longest = metric(after, "radixd_gc_longest_pause_seconds", generation=g)
        assert (n == 0) == (total == 0) == (longest == 0)
        assert longest <= total
    assert metric(after, "radixd_gc_longest_pause_seconds", generation="0") > 0
