"""The memory tiers through a real daemon: KV written by a client into the mapped device pools goes
to host (L2) and Redis (L3) and comes back byte-exact, for full and SWA pages; Redis dying,
corrupt values, two daemons sharing Redis, a three-node Cluster; the checker stays clean (every
daemon fixture ends with a strict full check)."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis as redis_sync
import torch
from radixd_client import Client
from radixd_client.errors import RadixdError
from radixd_client.protocol import Code, Load, Prefetch, int32_list

from daemon.storage.codec import encode_page
from tests.redis_procs import SHARED_URL, Server, free_port, start_cluster

from .conftest import SMALL_MODEL, Raw

P = SMALL_MODEL["page_size"]
WINDOW_PAGES = SMALL_MODEL["sliding_window"] // P
BLOCK_PAGES = max(1, -(-64 // P))  # pages of a hash block, and the most pages one value holds


def l3_config(url: str, prefix: str, **model: Any) -> dict[str, Any]:
    return {"models": [{**SMALL_MODEL, **model}],
            "l3": {"url": url, "key_prefix": prefix, "op_timeout_ms": 300,
                   "breaker_open_s": 0.5, "breaker_threshold": 2}}


class Engine:
    """A client that writes known KV into the pages it allocates and remembers it per page."""

    def __init__(self, socket: str, seed: int = 0, token: str | None = None):
        self.c = Client(socket, token, timeout=20)
        self.pools = self.c.attach("m")
        self.gen = torch.Generator().manual_seed(seed)
        self.full: dict[bytes, torch.Tensor] = {}  # page tokens (as bytes) -> its KV
        self.swa: dict[bytes, torch.Tensor] = {}

    def _rand(self, t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=self.gen)

    def cache(self, tokens: list[int]) -> None:
        """Compute (random KV) and insert ``tokens`` whole, as an engine after a prefill."""
        n = len(tokens) // P
        a = self.c.alloc("m", n)
        fp, sp = int32_list(a.full_pages), int32_list(a.swa_pages)
        for i, (f, s) in enumerate(zip(fp, sp, strict=True)):
            key = page_key(tokens, i)
            if key not in self.full:  # the same tokens compute the same KV, as in a model
                self.full[key] = self._rand(self.pools.full[:, :, f])
                self.swa[key] = self._rand(self.pools.swa[:, :, s])
            self.pools.full[:, :, f] = self.full[key]
            self.pools.swa[:, :, s] = self.swa[key]
        self.c.insert("m", tokens, fp, sp)

    def verify(self, tokens: list[int], result: Any, expect: dict | None = None) -> int:
        """The pages a match or load reports hold exactly the KV written for those tokens
        (by this engine, or ``expect``, another engine's record). Returns pages checked."""
        full_want, swa_want = expect or (self.full, self.swa)
        fp, sp = int32_list(result.full_pages), int32_list(result.swa_pages)
        n = result.prefix_len // P
        assert len(fp) == n
        for i, f in enumerate(fp):
            assert torch.equal(self.pools.full[:, :, f], full_want[page_key(tokens, i)]), i
        for j, s in enumerate(sp):  # the trailing window
            i = n - len(sp) + j
            assert torch.equal(self.pools.swa[:, :, s], swa_want[page_key(tokens, i)]), i
        return len(fp) + len(sp)

    def close(self) -> None:
        self.c.close()


def page_key(tokens: list[int], i: int) -> bytes:
    return bytes(str(tokens[: (i + 1) * P]), "ascii")


def value_of_page(e: Engine, tokens: list[int], i: int, pool: str = "full") -> bytes:
    """The bytes L3 stores for page ``i`` of ``tokens`` (its KV of ``pool``, page-first)."""
    kv = e.full if pool == "full" else e.swa
    return kv[page_key(tokens, i)].contiguous().numpy().tobytes()


def fetched_whole(eb: Engine, tokens: list[int], pages: int, expect: Engine) -> int:
    """Prefetch ``tokens`` expecting ``pages`` pages from Redis, load them, and check their KV
    against what ``expect`` wrote; returns the pages checked."""
    pr = eb.c.prefetch("m", tokens, policy="wait_complete")
    assert (pr.l3_hit_len, pr.fetched_len) == (pages * P, pages * P)
    r = eb.c.load("m", tokens)
    assert r.prefix_len == pages * P
    return eb.verify(tokens, r, expect=(expect.full, expect.swa))


def wait_for(fn: Any, what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def admin_get(d: Any, path: str) -> bytes:
    """GET ``path`` of the daemon's admin endpoint (its URL is in the log, its token beside the
    socket)."""
    # the daemon accepts on its socket before its admin endpoint is up: wait for that line
    url = wait_for(lambda: re.findall(r"admin endpoint on (http://\S+)", d.log()),
                   "the admin endpoint")[-1]
    token = (d.tmp / "admin.token").read_text().strip()
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read()


def admin_stats(d: Any) -> dict[str, Any]:
    """GET /v1/stats of the daemon's admin endpoint."""
    return json.loads(admin_get(d, "/v1/stats"))


def l3_stats(d: Any) -> dict[str, Any]:
    return admin_stats(d)["l3"]


def l3_pages(prefix: str, port: int = 6379) -> int:
    """Keys (page values) stored under a key prefix."""
    raw = redis_sync.Redis(port=port, socket_timeout=2)
    try:
        return sum(1 for _ in raw.scan_iter(match=prefix + ":*", count=1000))
    finally:
        raw.close()


def l3_values(pages: int) -> int:
    """The Redis values of a sequence of ``pages`` pages cached as one node: a full-pool run per
    hash block (protocol.md 9.3: blocks of BLOCK_PAGES pages, the last one cut at the node's
    end) and one SWA value, the trailing window."""
    return -(-pages // BLOCK_PAGES) + 1


def tier_stats(d: Any) -> dict[str, int]:
    with Client(d.socket) as c:
        return c.stats("m").models["m"]


def seq(n_pages: int, base: int = 1) -> list[int]:
    return list(range(base, base + n_pages * P))


def cache_until_on_host(d: Any, seqs: list[list[int]]) -> tuple[dict, dict]:
    """Cache ``seqs`` through an ``Engine`` and wait for their host copies; returns the KV the
    tree kept per page (the first writer's: a later duplicate page is freed)."""
    e = Engine(d.socket)
    kept: tuple[dict, dict] = ({}, {})
    for toks in seqs:
        e.cache(toks)
        for mine, theirs in zip(kept, (e.full, e.swa), strict=True):
            for k, v in theirs.items():
                mine.setdefault(k, v)
    want = len({tuple(t[: (i + 1) * P]) for t in seqs for i in range(len(t) // P)})
    wait_for(lambda: tier_stats(d)["tree_host_pages"] == want, "the host copies")
    e.close()
    return kept


# ---------------------------------------------------------------------------- L1 <-> L2


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_device_host_device_round_trip(make_daemon, policy: str) -> None:
    d = make_daemon({"models": [{**SMALL_MODEL, "write_policy": policy,
                                 "write_through_threshold": 2}]})
    e = Engine(d.socket)
    try:
        toks = seq(10)
        e.cache(toks)
        if policy == "write_through_selective":
            assert tier_stats(d)["tree_host_pages"] == 0  # one use: below the threshold
            e.c.match("m", toks)
        if policy != "write_back":  # copied in the background, before any eviction
            wait_for(lambda: tier_stats(d)["tree_host_pages"] == 10, "the host copy")
        ev = e.c.evict("m", full_pages=1000, swa_pages=1000)
        assert ev.full_pages == 10
        m = e.c.match("m", toks)
        assert (m.prefix_len, m.host_hit_len) == (0, 10 * P)  # demoted, not deleted
        r = e.c.load("m", toks, lock=True)
        assert (r.prefix_len, r.loaded_len, r.host_hit_len) == (10 * P, 10 * P, 0)
        assert e.verify(toks, r) == 10 + WINDOW_PAGES
        e.c.unlock("m", r.receipt)
        # a second load has nothing to copy: a plain match
        r2 = e.c.load("m", toks)
        assert (r2.prefix_len, r2.loaded_len) == (10 * P, 0)
    finally:
        e.close()


def test_load_extends_a_device_prefix_with_the_host_tail(make_daemon) -> None:
    """Device holds the head, host the tail: only the tail is copied. A longer prompt loads the
    whole cached part; one diverging inside the host part loads nothing there, because host
    keeps SWA copies of a node's trailing window only, and a usable end needs a whole window."""
    d = make_daemon({"models": [{**SMALL_MODEL, "host_pages": 64, "host_swa_pages": 16}]})
    e = Engine(d.socket)
    try:
        head, full = seq(4), seq(12)
        e.cache(full)
        wait_for(lambda: tier_stats(d)["tree_host_pages"] == 12, "the host copy")
        e.c.evict("m", full_pages=8)  # the 8 tail pages (deepest first)
        m = e.c.match("m", full)
        assert m.prefix_len == 4 * P and m.host_hit_len == 8 * P
        diverging = full[: 9 * P] + [999] * (3 * P)
        r = e.c.load("m", diverging)
        assert (r.prefix_len, r.loaded_len) == (4 * P, 0)
        longer = full + [7] * (5 * P)
        r = e.c.load("m", longer)
        assert (r.prefix_len, r.loaded_len) == (12 * P, 8 * P)
        e.verify(longer, r)
        assert e.c.match("m", head).prefix_len == 4 * P
    finally:
        e.close()


def test_a_request_that_loads_counts_once_and_its_host_hits_in_its_hit_rate(
        make_daemon) -> None:
    """A cached prompt is evicted to host; the same prompt comes again as an engine sends it: a
    locked match (the probe), then a load. The load matched again inside the daemon and
    counted a second request, its device hits again, and the hit rate left host hits out: 0%
    where every token was a hit (the first-hour hunt). Two requests, the second a full hit from
    host: 50%, for the model and the tenant; a load on its own still counts as a request."""
    d = make_daemon({"models": [{**SMALL_MODEL, "host_pages": 64, "host_swa_pages": 16}]})
    e = Engine(d.socket)
    try:
        toks = seq(8)
        assert e.c.match("m", toks).prefix_len == 0  # the first request: a miss
        e.cache(toks)
        wait_for(lambda: tier_stats(d)["tree_host_pages"] == 8, "the host copy")
        e.c.evict("m", full_pages=100)
        m = e.c.match("m", toks, lock=True)
        assert m.prefix_len == 0 and m.host_hit_len == 8 * P
        r = e.c.load("m", toks, lock=True)
        assert r.loaded_len == 8 * P
        e.c.unlock("m", m.receipt)
        e.c.unlock("m", r.receipt)
        stats = admin_stats(d)
        model, tenant = stats["models"]["m"], stats["tenants"][0]
        for v in (model, tenant):
            assert (v["match_tokens"], v["hit_tokens"], v["host_hit_tokens"]) == (
                16 * P, 0, 8 * P), v
            assert v["hit_rate"] == 0.5
        assert model["matches"] == 2
        metrics = admin_get(d, "/metrics").decode()  # the tenant's series by tier, as the model's
        for tier, n in (("device", 0), ("host", 8 * P)):
            for series in (f'radixd_hit_tokens_total{{model="m",tier="{tier}"}} {n}',
                           f'radixd_tenant_hit_tokens_total{{tenant="default",tier="{tier}"}} '
                           f'{n}'):
                assert series in metrics, (series, metrics)
        e.c.evict("m", full_pages=100)
        assert e.c.load("m", toks).loaded_len == 8 * P  # no match before it: a request
        model = admin_stats(d)["models"]["m"]
        assert (model["matches"], model["match_tokens"], model["host_hit_tokens"]) == (
            3, 24 * P, 16 * P)
        # an unlocked probe finds the head on device; it is evicted before the load brings the
        # whole back: each token is one hit (counting every loaded one passed 100%)
        other = seq(8, base=5000)
        e.c.evict("m", full_pages=100)  # (so that the eviction below takes other's tail)
        e.cache(other)
        wait_for(lambda: tier_stats(d)["tree_host_pages"] == 16, "the host copy")
        e.c.evict("m", full_pages=4)  # the tail (deepest first): the head stays on device
        before = admin_stats(d)["models"]["m"]
        probe = e.c.match("m", other)
        assert (probe.prefix_len, probe.host_hit_len) == (4 * P, 4 * P)
        e.c.evict("m", full_pages=100)
        assert e.c.load("m", other).loaded_len == 8 * P
        after = admin_stats(d)["models"]["m"]
        assert after["matches"] - before["matches"] == 1
        assert (after["hit_tokens"] - before["hit_tokens"],
                after["host_hit_tokens"] - before["host_hit_tokens"]) == (4 * P, 4 * P)
        assert after["hit_rate"] <= 1.0
    finally:
        e.close()


def test_host_tier_off_and_bad_requests(make_daemon) -> None:
    d = make_daemon({"models": [{**SMALL_MODEL, "host_pages": 0}]})
    e = Engine(d.socket)
    try:
        toks = seq(4)
        e.cache(toks)
        e.c.evict("m", full_pages=100)
        r = e.c.load("m", toks)
        assert (r.prefix_len, r.loaded_len) == (0, 0)
        assert e.c.prefetch("m", toks).status == "unavailable"
        for call, code in ((lambda: e.c.load("nope", toks), Code.UNKNOWN_MODEL),
                           (lambda: e.c.prefetch("m", toks, policy="eager"), Code.BAD_ARGUMENT),
                           (lambda: e.c.prefetch("m", toks, policy="timeout", timeout_ms=-1),
                            Code.BAD_ARGUMENT),
                           (lambda: e.c.evict("m", host_pages=-1), Code.BAD_ARGUMENT)):
            with pytest.raises(RadixdError) as info:
                call()
            assert info.value.code == code
        assert e.c.ping().payload == b""  # the session survived every refusal
    finally:
        e.close()
    raw = Raw(d.socket)
    try:
        resp = raw.call(Load(id=3, model="m", tokens=b"\x01\x02\x03"))  # not int32
        assert not resp.ok and resp.error.code == Code.BAD_ARGUMENT and resp.id == 3
        resp = raw.call(Prefetch(id=4, model="m", tokens=b"\x01\x00\x00\x00" * P))
        assert resp.ok
    finally:
        raw.close()


def test_load_and_prefetch_are_not_batch_operations(make_daemon) -> None:
    d = make_daemon()
    raw = Raw(d.socket)
    try:
        import msgspec

        body = msgspec.msgpack.encode({"op": "batch", "id": 5, "ops": [
            {"op": "load", "model": "m", "tokens": b"\x01\x00\x00\x00" * P}]})
        raw.send(body)
        resp = raw.recv()
        assert not resp.ok and resp.error.code == Code.BAD_FRAME and resp.id == 5
    finally:
        raw.close()


def test_host_quota_bounds_a_tenants_host_pages(make_daemon) -> None:
    d = make_daemon({"tenants": [{"name": "t", "token": "tok", "quota_host_pages": 6}]})
    c = Client(d.socket, token="tok")
    try:
        pools = c.attach("m")
        assert pools is not None
        for base in (1, 1000, 2000):  # 3 conversations of 4 pages: 12 > 6
            toks = seq(4, base)
            a = c.alloc("m", 4)
            c.insert("m", toks, a.full_pages, a.swa_pages)
            time.sleep(0.05)
        wait_for(lambda: c.stats("m").models["m"]["tree_host_pages"] > 0, "host copies")
        time.sleep(0.2)
        st = c.stats("m").models["m"]
        assert 0 < st["tree_host_pages"] <= 6 and st["quota_host_pages"] == 6
    finally:
        c.close()


def test_host_quota_counts_the_copies_planned_together(make_daemon) -> None:
    """Fifteen 4-page conversations inserted in one batch are backed up by one job: each node's
    host slots were checked against the quota without the job's earlier ones (60 host pages
    against a quota of 6, as a review found). Pending copies count now."""
    d = make_daemon({"models": [{**SMALL_MODEL, "swa_pages": 64}],
                     "tenants": [{"name": "t", "token": "tok", "quota_host_pages": 6}]})
    with Client(d.socket, token="tok") as c:
        c.attach("m")
        allocs = [c.alloc("m", 4) for _ in range(15)]
        with c.batch() as b:
            for i, a in enumerate(allocs):
                b.insert("m", seq(4, 1 + 1000 * i), a.full_pages, a.swa_pages)
        tiers = lambda: admin_stats(d)["models"]["m"]["tiers"]  # noqa: E731
        wait_for(lambda: tiers()["host_pages_pending"] == 0 and tiers()["backup_queue"] == 0
                 and c.stats("m").models["m"]["tree_host_pages"] > 0, "the host copies")
        assert 0 < c.stats("m").models["m"]["tree_host_pages"] <= 6


def test_host_quota_holds_for_concurrent_prefetches_of_one_tenant(make_daemon, prefix: str
                                                                  ) -> None:
    """Six sessions of one tenant prefetch six 4-page conversations from Redis at once: each
    fetch's host slots were checked without the others' in flight (24 host pages against a
    quota of 6, as a review found)."""
    model = {"full_pages": 96, "swa_pages": 96}
    convs = [seq(4, 1 + 10000 * i) for i in range(6)]
    config = l3_config(SHARED_URL, prefix, **model)
    config["tenants"] = [{"name": "t", "token": "tok"}]  # pages are named by namespace
    first = make_daemon(config)
    with Client(first.socket, token="tok") as c:
        c.attach("m")
        for toks in convs:
            a = c.alloc("m", 4)
            c.insert("m", toks, a.full_pages, a.swa_pages)
        wait_for(lambda: l3_pages(prefix) >= 6 * l3_values(4), "the L3 writes")
    config["tenants"] = [{"name": "t", "token": "tok", "quota_host_pages": 6}]
    d = make_daemon(config)
    clients = [Client(d.socket, token="tok", timeout=30) for _ in convs]
    try:
        with ThreadPoolExecutor(len(convs)) as ex:
            got = list(ex.map(lambda ct: ct[0].prefetch("m", ct[1], policy="wait_complete"),
                              zip(clients, convs, strict=True)))
        assert sum(r.fetched_len for r in got) > 0
        assert 0 < clients[0].stats("m").models["m"]["tree_host_pages"] <= 6
    finally:
        for c in clients:
            c.close()


# ---------------------------------------------------------------------------- L3


def test_round_trip_through_redis(make_daemon, prefix: str) -> None:
    """L1 -> L2 -> L3 -> (L1 and L2 evicted) -> L2 -> L1, byte-exact, full and SWA."""
    d = make_daemon(l3_config(SHARED_URL, prefix))
    e = Engine(d.socket)
    try:
        toks = seq(10)
        e.cache(toks)
        wait_for(lambda: l3_pages(prefix) >= l3_values(10), "the L3 write")
        ev = e.c.evict("m", full_pages=1000, swa_pages=1000, host_pages=1000)
        assert (ev.full_pages, ev.host_pages) == (10, 10)
        assert e.c.match("m", toks).host_hit_len == 0
        pr = e.c.prefetch("m", toks, policy="wait_complete")
        assert (pr.status, pr.l3_hit_len, pr.fetched_len) == ("complete", 10 * P, 10 * P)
        m = e.c.match("m", toks)
        assert (m.prefix_len, m.host_hit_len) == (0, 10 * P)
        r = e.c.load("m", toks, lock=True)
        assert r.prefix_len == 10 * P
        assert e.verify(toks, r) == 10 + WINDOW_PAGES
        e.c.unlock("m", r.receipt)
        st = tier_stats(d)
        assert st["tree_host_pages"] == 10
    finally:
        e.close()


def documented_page_ids(fp: bytes, ns: str, model: str, tokens: list[int]) -> list[str]:
    """protocol.md 9.3's page ids, computed from the formula alone, as a third-party reader
    would: the chain runs over blocks of ceil(64 / P) pages, each page keyed by its block's
    tokens up to its own end."""
    sha = hashlib.sha256
    nsb = ns.encode()
    seed = sha(b"radixd-namespace-v1" + len(nsb).to_bytes(4, "little") + nsb
               + len(fp).to_bytes(4, "little") + fp).digest()
    salt = sha(b"radixd-l3-model\0" + model.encode()).digest()
    B = max(1, -(-64 // P))
    raw = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens)
    prev, ids = seed, []
    for j in range(len(tokens) // P):
        b = j // B
        h = sha(prev + raw[b * B * P * 4 : (j + 1) * P * 4]).digest()
        if j % B == B - 1:
            prev = h
        ids.append(sha(salt + h).hexdigest())
    return ids


def test_l3_keys_follow_the_documented_formula(make_daemon, prefix: str) -> None:
    """Pages of 4 tokens: blocks of 16 pages. Each whole block is one value at its last page's
    documented key, the trailing part block one value at the node's last page; no other page
    key holds a full-pool value; each value holds its run's tokens and pages."""
    d = make_daemon(l3_config(SHARED_URL, prefix, full_pages=96, swa_pages=64))
    e = Engine(d.socket)
    try:
        n = 40  # two whole blocks and half of a third
        toks = seq(n, base=7)
        e.cache(toks)
        wait_for(lambda: l3_pages(prefix) >= l3_values(n), "the L3 write")
        fp = bytes.fromhex(e.pools.infos["full"].description["layout_fingerprint"])
        ids = documented_page_ids(fp, "default", "m", toks)
        raw = redis_sync.Redis.from_url(SHARED_URL)
        try:
            runs = {15: 0, 31: 16, 39: 32}  # last page -> first page of each run
            page_bytes = len(value_of_page(e, toks, 0))
            for j, i in enumerate(ids):
                value = raw.get(f"{prefix}:{i}")
                if j not in runs:
                    assert value is None, f"page {j}: a value inside a run"
                    continue
                assert value is not None, f"page {j}: no value at its documented key"
                first = runs[j]
                count = (j + 1 - first) * P
                assert value[52:84] == bytes.fromhex(i)
                assert int.from_bytes(value[8:12], "little") == count
                want = b"".join(t.to_bytes(4, "little") for t in toks[first * P : (j + 1) * P])
                assert value[88 : 88 + 4 * count] == want, j
                payload = value[88 + 4 * count :]
                assert payload == b"".join(value_of_page(e, toks, k)
                                           for k in range(first, j + 1)), j
                assert len(payload) == (j + 1 - first) * page_bytes
            # one SWA value, the window, under the last page's key: its tokens and pages
            assert [j for j, i in enumerate(ids) if raw.exists(f"{prefix}:{i}:swa")] == [n - 1]
            window = raw.get(f"{prefix}:{ids[-1]}:swa")
            count = WINDOW_PAGES * P
            assert int.from_bytes(window[8:12], "little") == count
            assert window[88 : 88 + 4 * count] == b"".join(
                t.to_bytes(4, "little") for t in toks[(n - WINDOW_PAGES) * P :])
            assert window[88 + 4 * count :] == b"".join(
                value_of_page(e, toks, k, "swa") for k in range(n - WINDOW_PAGES, n))
        finally:
            raw.close()
    finally:
        e.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_runs_span_nodes_and_a_prefix_may_end_inside_a_block(make_daemon, prefix: str,
                                                             policy: str) -> None:
    """Two nodes, pages 0-9 and 10-19: the block of pages 0-15 is one value whose first ten
    pages come from the parent node's host copy (under write_back, a parent dropped in the same
    host eviction). Another daemon fetches all 20 pages; a prefix of 12 pages finds the run
    the parent's end wrote (pages 0-9) and stops there; so does the whole sequence once the
    child's SWA window is gone from Redis."""
    cfg = l3_config(SHARED_URL, prefix, full_pages=96, swa_pages=64)
    cfg["l3"]["write_policy"] = policy
    a = make_daemon(cfg, name="a")
    ea = Engine(a.socket, seed=1)
    raw = redis_sync.Redis.from_url(SHARED_URL)
    try:
        ea.cache(seq(10))
        ea.cache(seq(20))
        wait_for(lambda: tier_stats(a)["tree_host_pages"] == 20, "the host copies")
        if policy == "write_back":
            ea.c.evict("m", full_pages=100, swa_pages=100, host_pages=100)
        # runs [0-9], [0-15], [16-19]; SWA windows [8-9], [18-19]
        wait_for(lambda: l3_pages(prefix) >= 5, "the L3 writes")
        fp = bytes.fromhex(ea.pools.infos["full"].description["layout_fingerprint"])
        ids = documented_page_ids(fp, "default", "m", seq(20))
        assert [j for j, i in enumerate(ids) if raw.exists(f"{prefix}:{i}")] == [9, 15, 19]
        spanning = raw.get(f"{prefix}:{ids[15]}")
        assert spanning[88 + 16 * 4 * P :] == b"".join(value_of_page(ea, seq(20), k)
                                                       for k in range(16))
        b = make_daemon(l3_config(SHARED_URL, prefix, full_pages=96, swa_pages=64), name="b")
        eb = Engine(b.socket, seed=2)
        try:
            assert fetched_whole(eb, seq(20), 20, ea) == 20 + WINDOW_PAGES
            eb.c.evict("m", full_pages=100, swa_pages=100, host_pages=100)
            pr = eb.c.prefetch("m", seq(12), policy="wait_complete")
            assert (pr.l3_hit_len, pr.fetched_len) == (10 * P, 10 * P)
            r = eb.c.load("m", seq(12))
            assert r.prefix_len == 10 * P
            eb.verify(seq(12), r, expect=(ea.full, ea.swa))
            assert admin_stats(b)["models"]["m"]["tiers"]["l3_hit_pages"] == 30
            # without the window at page 20 (SWA of pages 18-19), the parent's end is usable
            raw.delete(f"{prefix}:{ids[19]}:swa")
            eb.c.evict("m", full_pages=100, swa_pages=100, host_pages=100)
            assert fetched_whole(eb, seq(20), 10, ea) == 10 + WINDOW_PAGES
            b.check()
        finally:
            eb.close()
        a.check()
    finally:
        ea.close()
        raw.close()


def test_a_window_shorter_than_w_continues_in_the_parents_window(make_daemon,
                                                                  prefix: str) -> None:
    """A node of one page holds one page of SWA window: its value is that page alone, and a
    reader gets the rest of the window from the value at its parent's end (protocol.md 9.3)."""
    a = make_daemon(l3_config(SHARED_URL, prefix, full_pages=96, swa_pages=64), name="a")
    ea = Engine(a.socket, seed=1)
    raw = redis_sync.Redis.from_url(SHARED_URL)
    try:
        ea.cache(seq(10))
        ea.cache(seq(11))
        # runs [0-9], [0-10]; SWA windows [8-9] and [10]
        wait_for(lambda: l3_pages(prefix) >= 4, "the L3 writes")
        fp = bytes.fromhex(ea.pools.infos["full"].description["layout_fingerprint"])
        ids = documented_page_ids(fp, "default", "m", seq(11))
        assert [j for j, i in enumerate(ids) if raw.exists(f"{prefix}:{i}:swa")] == [9, 10]
        assert int.from_bytes(raw.get(f"{prefix}:{ids[10]}:swa")[8:12], "little") == P
        b = make_daemon(l3_config(SHARED_URL, prefix, full_pages=96, swa_pages=64), name="b")
        eb = Engine(b.socket, seed=2)
        try:
            assert fetched_whole(eb, seq(11), 11, ea) == 11 + WINDOW_PAGES
            b.check()
        finally:
            eb.close()
        raw.delete(f"{prefix}:{ids[9]}:swa")  # the parent's window is gone: no usable end
        c = make_daemon(l3_config(SHARED_URL, prefix, full_pages=96, swa_pages=64), name="c")
        ec = Engine(c.socket, seed=3)
        try:
            pr = ec.c.prefetch("m", seq(11), policy="wait_complete")
            assert (pr.l3_hit_len, pr.fetched_len) == (0, 0)  # the hit is what reads whole
            assert ec.c.match("m", seq(11)).host_hit_len == 0
            c.check()
        finally:
            ec.close()
        a.check()
    finally:
        ea.close()
        raw.close()


def test_the_fetch_ends_at_the_largest_node_end_whose_window_reads(make_daemon,
                                                                   prefix: str) -> None:
    """Nodes of pages [0, 16), [16, 20) and [20, 24): the runs L3 holds end at pages 15 (a whole
    block) and 23. Without the last node's window, the fetch looks at every page and ends at 20,
    not at the block's end (16); without the windows at 20 and 24 too, at 16."""
    a = make_daemon(l3_config(SHARED_URL, prefix, full_pages=96, swa_pages=64), name="a")
    ea = Engine(a.socket, seed=1)
    raw = redis_sync.Redis.from_url(SHARED_URL)
    try:
        for n in (16, 20, 24):
            ea.cache(seq(n))
        wait_for(lambda: tier_stats(a)["tree_host_pages"] == 24, "the host copies")
        fp = bytes.fromhex(ea.pools.infos["full"].description["layout_fingerprint"])
        ids = documented_page_ids(fp, "default", "m", seq(24))
        wait_for(lambda: all(raw.exists(f"{prefix}:{ids[j]}:swa") for j in (15, 19, 23)),
                 "the windows in Redis")
        for gone, want in (((23,), 20), ((19,), 16)):
            raw.delete(*(f"{prefix}:{ids[j]}:swa" for j in gone))
            b = make_daemon(l3_config(SHARED_URL, prefix, full_pages=96, swa_pages=64),
                            name=f"b{want}")
            eb = Engine(b.socket, seed=2)
            try:
                assert fetched_whole(eb, seq(24), want, ea) == want + WINDOW_PAGES
                b.check()
            finally:
                eb.close()
        a.check()
    finally:
        ea.close()
        raw.close()


def block_to_plant(e: Engine) -> tuple[bytes, bytes, list[str]]:
    """A block's tokens, the layout fingerprint and the block's documented page ids: what a
    test needs to plant values in Redis by hand."""
    toks = seq(BLOCK_PAGES)
    fp = bytes.fromhex(e.pools.infos["full"].description["layout_fingerprint"])
    return toks, fp, documented_page_ids(fp, "default", "m", toks)


def test_a_one_page_value_at_a_run_key_is_stale(make_daemon, prefix: str) -> None:
    """A value from before runs: one page, verified (key, layout, checksum) at the key of a
    block's last page, where a run of the whole block belongs. It is a miss, counted as stale
    and deleted, so that later fetches do not read it again."""
    d = make_daemon(l3_config(SHARED_URL, prefix))
    e = Engine(d.socket)
    raw = redis_sync.Redis.from_url(SHARED_URL)
    try:
        toks, fp, ids = block_to_plant(e)
        key = f"{prefix}:{ids[-1]}"
        raw.set(key, encode_page(pool="full", page_hash=bytes.fromhex(ids[-1]), fingerprint=fp,
                                 tokens=toks[-P:], payload=bytes(64)))
        swa_page = 2 * P * SMALL_MODEL["head_dim"] * 4  # one layer of float32 K and V
        for j in range(BLOCK_PAGES - WINDOW_PAGES, BLOCK_PAGES):  # the window, as it was written
            raw.set(f"{prefix}:{ids[j]}:swa", encode_page(   # before windows: a value a page
                pool="swa", page_hash=bytes.fromhex(ids[j]), fingerprint=fp,
                tokens=toks[j * P : (j + 1) * P], payload=bytes(swa_page)))
        pr = e.c.prefetch("m", toks, policy="wait_complete")
        assert (pr.l3_hit_len, pr.fetched_len) == (BLOCK_PAGES * P, 0)
        assert not raw.exists(key)
        assert (l3_stats(d)["stale"], l3_stats(d)["corrupt"]) == (1, 0)
        assert e.c.prefetch("m", toks, policy="wait_complete").status == "none"
        d.check()
    finally:
        e.close()
        raw.close()


def test_a_window_value_of_other_tokens_is_stale(make_daemon, prefix: str) -> None:
    """A verified SWA value under a node end's key that holds another prefix's tokens: that end
    is not usable (nothing is fetched, the hit is 0), the value is counted stale and deleted."""
    d = make_daemon(l3_config(SHARED_URL, prefix))
    e = Engine(d.socket)
    raw = redis_sync.Redis.from_url(SHARED_URL)
    try:
        toks, fp, ids = block_to_plant(e)
        raw.set(f"{prefix}:{ids[-1]}", encode_page(
            pool="full", page_hash=bytes.fromhex(ids[-1]), fingerprint=fp, tokens=toks,
            payload=bytes(BLOCK_PAGES * 2 * P * SMALL_MODEL["head_dim"] * 4)))
        swa = f"{prefix}:{ids[-1]}:swa"
        other = seq(WINDOW_PAGES, base=90000)  # right length, wrong tokens
        raw.set(swa, encode_page(pool="swa", page_hash=bytes.fromhex(ids[-1]), fingerprint=fp,
                                 tokens=other,
                                 payload=bytes(WINDOW_PAGES * 2 * P * SMALL_MODEL["head_dim"] * 4)))
        pr = e.c.prefetch("m", toks, policy="wait_complete")
        assert (pr.l3_hit_len, pr.fetched_len) == (0, 0)
        assert not raw.exists(swa) and raw.exists(f"{prefix}:{ids[-1]}")
        assert (l3_stats(d)["stale"], l3_stats(d)["corrupt"]) == (1, 0)
        d.check()
    finally:
        e.close()
        raw.close()


def test_l3_write_back_on_host_eviction(make_daemon, prefix: str) -> None:
    d = make_daemon({**l3_config(SHARED_URL, prefix),
                     "l3": {**l3_config(SHARED_URL, prefix)["l3"], "write_policy": "write_back"}})
    e = Engine(d.socket)
    try:
        toks = seq(6)
        e.cache(toks)
        wait_for(lambda: tier_stats(d)["tree_host_pages"] == 6, "the host copy")
        time.sleep(0.1)
        assert l3_pages(prefix) == 0  # write_back: nothing in Redis yet
        e.c.evict("m", full_pages=100, swa_pages=100, host_pages=100)
        wait_for(lambda: l3_pages(prefix) >= l3_values(6), "the write-back")
        pr = e.c.prefetch("m", toks, policy="wait_complete")
        assert pr.fetched_len == 6 * P
        r = e.c.load("m", toks)
        e.verify(toks, r)
    finally:
        e.close()


def test_two_daemons_share_redis(make_daemon, prefix: str) -> None:
    a = make_daemon(l3_config(SHARED_URL, prefix), name="a")
    b = make_daemon(l3_config(SHARED_URL, prefix), name="b")
    ea, eb = Engine(a.socket, seed=1), Engine(b.socket, seed=2)
    try:
        toks = seq(8)
        ea.cache(toks)
        wait_for(lambda: l3_pages(prefix) >= l3_values(8), "the L3 write")
        assert eb.c.match("m", toks).prefix_len == 0
        for policy in ("best_effort", "timeout"):
            pr = eb.c.prefetch("m", toks, policy=policy, timeout_ms=2000)
            assert pr.l3_hit_len == 8 * P
        wait_for(lambda: eb.c.match("m", toks).host_hit_len == 8 * P, "the fetch")
        r = eb.c.load("m", toks)
        assert r.prefix_len == 8 * P
        assert eb.verify(toks, r, expect=(ea.full, ea.swa)) == 8 + WINDOW_PAGES
    finally:
        ea.close()
        eb.close()


def test_a_corrupt_value_is_a_counted_miss(make_daemon, prefix: str) -> None:
    a = make_daemon(l3_config(SHARED_URL, prefix), name="a")
    ea = Engine(a.socket)
    raw = redis_sync.Redis.from_url(SHARED_URL)
    try:
        toks = seq(8)
        ea.cache(toks)
        wait_for(lambda: l3_pages(prefix) >= l3_values(8), "the L3 write")
        keys = sorted(k for k in raw.scan_iter(match=prefix + ":*") if not k.endswith(b":swa"))
        # the run holding page 5 (find it by its tokens) gets one payload byte flipped
        bad = next(k for k in keys if raw.get(k).find(
            bytes(memoryview(__import__("array").array("i", toks[5 * P: 6 * P])))) >= 0)
        value = raw.get(bad)
        raw.setrange(bad, len(value) - 1, bytes([value[-1] ^ 0xFF]))
        b = make_daemon(l3_config(SHARED_URL, prefix), name="b")
        eb = Engine(b.socket)
        try:
            pr = eb.c.prefetch("m", toks, policy="wait_complete")
            # exists() saw the run of 8 pages; its read failed verification: nothing usable
            assert pr.l3_hit_len == 8 * P and pr.fetched_len == 0
            assert not raw.exists(bad)  # deleted, never served
            assert l3_stats(b)["corrupt"] == 1
            r = eb.c.load("m", toks)
            assert (r.prefix_len, r.host_hit_len) == (0, 0)
            # the engine recomputes and re-caches; the good copy goes back to Redis
            eb.cache(toks)
            wait_for(lambda: raw.exists(bad), "the rewrite")
            eb.c.evict("m", full_pages=100, swa_pages=100, host_pages=100)
            assert eb.c.prefetch("m", toks, policy="wait_complete").fetched_len == 8 * P
            r = eb.c.load("m", toks)
            assert r.prefix_len == 8 * P
            eb.verify(toks, r)
        finally:
            eb.close()
    finally:
        ea.close()
        raw.close()


def test_a_prefetch_of_pages_on_their_way_waits_for_them(make_daemon, tmp_path) -> None:
    """Two engines prefetch one sequence at once: the second waits for the first's fetch
    (Redis is stopped meanwhile, so both are surely in flight) instead of reading the same
    values and taking host slots for them again, and reports the pages it brought."""
    srv = Server(free_port(), tmp_path)
    srv.start()
    try:
        cfg = l3_config(srv.url, "twice", full_pages=96, swa_pages=64)
        cfg["l3"]["op_timeout_ms"] = 10000
        a = make_daemon(cfg, name="a")
        ea = Engine(a.socket, seed=1)
        try:
            ea.cache(seq(20))
            wait_for(lambda: l3_pages("twice", port=srv.port) >= l3_values(20), "the L3 writes")
        finally:
            ea.close()
        b = make_daemon(cfg, name="b")
        c1, c2 = Client(b.socket, timeout=30), Client(b.socket, timeout=30)
        try:
            assert srv.proc is not None
            srv.proc.send_signal(signal.SIGSTOP)
            try:
                with ThreadPoolExecutor(2) as pool:
                    first = pool.submit(c1.prefetch, "m", seq(20), policy="wait_complete")
                    time.sleep(0.3)
                    second = pool.submit(c2.prefetch, "m", seq(20), policy="wait_complete")
                    time.sleep(0.3)
                    srv.proc.send_signal(signal.SIGCONT)
                    r1, r2 = first.result(timeout=20), second.result(timeout=20)
            finally:
                srv.proc.send_signal(signal.SIGCONT)
            # the second counts the pages the first brought for it
            for r in (r1, r2):
                assert (r.status, r.l3_hit_len, r.fetched_len) == ("complete", 20 * P, 20 * P)
            tiers = admin_stats(b)["models"]["m"]["tiers"]
            assert (tiers["prefetches"], tiers["prefetch_pages"]) == (2, 20)
            assert l3_stats(b)["gets"] == l3_values(20)  # each value read once
            assert c2.load("m", seq(20)).prefix_len == 20 * P
            b.check()
        finally:
            c1.close()
            c2.close()
    finally:
        srv.kill()


def test_redis_dies_and_returns(make_daemon, tmp_path) -> None:
    srv = Server(free_port(), tmp_path)
    srv.start()
    try:
        d = make_daemon(l3_config(srv.url, "died"))
        e = Engine(d.socket)
        try:
            e.cache(seq(4))
            wait_for(lambda: l3_stats(d)["sets"] >= l3_values(4), "the first L3 write")
            srv.kill()
            # everything keeps working, L3 is a miss; the breaker opens
            for i in range(4):
                toks = seq(4, 1000 + 100 * i)
                e.cache(toks)
                assert e.c.match("m", toks).prefix_len == 4 * P
                pr = e.c.prefetch("m", seq(6, 5000 + i * 100), policy="wait_complete")
                assert pr.fetched_len == 0 and pr.status in ("unavailable", "none")
            wait_for(lambda: l3_stats(d)["breaker_state"] == "open", "the breaker to open")
            # the L3 writes follow the (coalesced) background host copies: wait for them
            wait_for(lambda: l3_stats(d)["set_failures"] > 0, "the failed L3 writes")
            srv.start()  # back, empty
            time.sleep(0.6)  # breaker_open_s: the next call is the half-open probe
            e.cache(seq(4, 9000))
            wait_for(lambda: l3_stats(d)["breaker_state"] == "closed", "the breaker to close")
            wait_for(lambda: l3_pages("died", port=srv.port) >= l3_values(4),
                     "writes after recovery")
        finally:
            e.close()
    finally:
        srv.kill()


def test_cluster_round_trip(make_daemon, tmp_path) -> None:
    servers, ports = start_cluster(tmp_path)
    try:
        url = f"redis+cluster://127.0.0.1:{ports[0]}"
        a = make_daemon(l3_config(url, "clu", full_pages=96, swa_pages=64), name="a")
        ea = Engine(a.socket)
        try:
            toks = seq(40)  # three runs of full pages and two SWA pages: five keys
            ea.cache(toks)
            per_node = lambda: [redis_sync.Redis(port=p).dbsize() for p in ports]  # noqa: E731
            wait_for(lambda: sum(per_node()) >= l3_values(40), "the L3 write")
            assert sum(1 for n in per_node() if n) >= 2  # the pages spread over the nodes
            ea.c.evict("m", full_pages=100, swa_pages=100, host_pages=100)
            pr = ea.c.prefetch("m", toks, policy="wait_complete")
            assert pr.fetched_len == 40 * P
            r = ea.c.load("m", toks)
            assert r.prefix_len == 40 * P
            ea.verify(toks, r)
        finally:
            ea.close()
    finally:
        for s in servers:
            s.kill()


def test_models_of_one_layout_do_not_share_l3_pages(make_daemon, prefix: str) -> None:
    """A base model and its fine-tune have the same layout: the same tokens must not fetch the
    other's KV (L3 names pages by model as well as by tokens)."""
    cfg = l3_config(SHARED_URL, prefix)
    cfg["models"] = [{**SMALL_MODEL, "name": "m"}, {**SMALL_MODEL, "name": "tuned"}]
    d = make_daemon(cfg)
    e = Engine(d.socket)
    try:
        toks = seq(6)
        e.cache(toks)
        wait_for(lambda: l3_pages(prefix) >= l3_values(6), "the L3 write")
        pr = e.c.prefetch("tuned", toks, policy="wait_complete")
        assert (pr.l3_hit_len, pr.fetched_len) == (0, 0)
        e.c.evict("m", full_pages=100, swa_pages=100, host_pages=100)
        assert e.c.prefetch("m", toks, policy="wait_complete").fetched_len == 6 * P
    finally:
        e.close()


@pytest.mark.parametrize("model", [
    {"sliding_window": None, "num_swa_layers": 0},  # dense: no SWA pool anywhere
    {"host_swa_pages": 0},  # SWA layers, but no host SWA pool
])
def test_tiers_without_a_host_swa_pool(make_daemon, prefix: str, model: dict) -> None:
    d = make_daemon(l3_config(SHARED_URL, prefix, **model))
    c = Client(d.socket, timeout=20)
    try:
        pools = c.attach("m")
        dense = model.get("num_swa_layers") == 0
        toks = seq(6)
        a = c.alloc("m", 6)
        fp = int32_list(a.full_pages)
        want = {}
        for i, f in enumerate(fp):
            pools.full[:, :, f] = torch.full(pools.full[:, :, f].shape, float(i + 1))
            want[i] = pools.full[:, :, f].clone()
        if not dense:
            for s in int32_list(a.swa_pages):
                pools.swa[:, :, s] = 7.0
        c.insert("m", toks, fp, a.swa_pages)
        wait_for(lambda: c.stats("m").models["m"]["tree_host_pages"] == 6, "the host copy")
        c.evict("m", full_pages=100, swa_pages=0 if dense else 100, host_pages=100)
        pr = c.prefetch("m", toks, policy="wait_complete")  # never an internal error
        r = c.load("m", toks)
        if dense:  # no window to complete: the whole prefix comes back, byte-exact
            assert pr.fetched_len == 6 * P and r.prefix_len == 6 * P
            for i, f in enumerate(int32_list(r.full_pages)):
                assert torch.equal(pools.full[:, :, f], want[i])
        else:  # without SWA copies no end is usable: nothing is fetched or loaded
            assert pr.fetched_len == 0 and r.prefix_len == 0
        assert c.ping().payload == b""
    finally:
        c.close()


def test_hello_tells_which_tiers_a_model_has(make_daemon, prefix: str) -> None:
    cfg = l3_config(SHARED_URL, prefix)
    cfg["models"] = [{**SMALL_MODEL, "name": "m"},
                     {**SMALL_MODEL, "name": "device_only", "host_pages": 0},
                     {**SMALL_MODEL, "name": "no_l3", "l3": False}]
    d = make_daemon(cfg)
    with Client(d.socket) as c:
        info = {m.name: (m.host_pages, m.l3) for m in c.models.values()}
    assert info == {"m": (4096, True), "device_only": (0, False), "no_l3": (4096, False)}


def test_eviction_right_after_insert_demotes_under_write_through(make_daemon) -> None:
    """Whether the background copy has not started, is running or is done when eviction
    reaches the node, the node ends on host (demoted), never deleted: eviction copies it itself,
    or waits for the running copy. Big pages make the running case likely."""
    model = {**SMALL_MODEL, "num_full_layers": 4, "num_swa_layers": 2, "head_dim": 256,
             "full_pages": 512, "swa_pages": 512, "host_pages": 2048, "host_swa_pages": 512}
    d = make_daemon({"models": [model]})
    with Client(d.socket, timeout=20) as c:
        for k, delay in enumerate((0.0, 0.0005, 0.002, 0.005, 0.02)):
            toks = seq(96, base=1 + 10_000 * k)
            a = c.alloc("m", 96)
            c.insert("m", toks, a.full_pages, a.swa_pages)
            time.sleep(delay)
            assert c.evict("m", full_pages=1000, swa_pages=1000).full_pages >= 96
            m = c.match("m", toks)
            assert (m.prefix_len, m.host_hit_len) == (0, 96 * P), delay
    tiers = admin_stats(d)["models"]["m"]["tiers"]
    assert tiers["backup_pages"] + tiers["demoted_sync_pages"] >= 5 * 96


def test_eviction_does_not_retry_a_skipped_host_copy(make_daemon) -> None:
    """Under write_through, eviction copies a node itself only when it overtook the node's
    background copy. A node whose copy the copier skipped (no evictable room in host: the host
    pool holds pages still on device) is deleted when eviction takes its device copy: retrying
    the copy there would run inside the evicting request and drop other host-only pages."""
    d = make_daemon({"models": [{**SMALL_MODEL, "host_pages": 9, "host_swa_pages": 9}]})
    with Client(d.socket, timeout=20) as c:
        old, new = seq(4), seq(8, base=100_000)
        a = c.alloc("m", 4)
        c.insert("m", old, a.full_pages, a.swa_pages)
        wait_for(lambda: tier_stats(d)["tree_host_pages"] == 4, "the old node's host copy")
        a = c.alloc("m", 8)
        c.insert("m", new, a.full_pages, a.swa_pages)
        # 8 usable host slots, 4 of them the old node's (still on device): no room for 8
        wait_for(lambda: admin_stats(d)["models"]["m"]["tiers"]["backup_skipped"] == 1,
                 "the skipped copy of the new node")
        c.match("m", new)  # the new node is now the more recent
        assert c.evict("m", full_pages=4).full_pages == 4  # the old node: demoted, host-only
        # the new node: its copy is not retried (at the cost of the old node's host copy)
        assert c.evict("m", full_pages=8).full_pages == 8
        m = c.match("m", old)
        assert (m.prefix_len, m.host_hit_len) == (0, 4 * P)  # demoted: it had a host copy
        m = c.match("m", new)
        assert (m.prefix_len, m.host_hit_len) == (0, 0)  # deleted, not copied inside the evict
        assert tier_stats(d)["tree_host_pages"] == 4
    assert admin_stats(d)["models"]["m"]["tiers"]["demoted_sync_pages"] == 0
