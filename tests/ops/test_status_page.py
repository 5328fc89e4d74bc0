"""The status page (daemon/static/status.html at GET / of the admin endpoint) in headless Chromium.

A real daemon with the admin endpoint on (``admin_daemon`` of tests/ops/conftest.py), real traffic
through the client, then Chromium renders the page with the token in the URL fragment; every number
the page shows (``data-metric`` and ``data-value`` attributes, and the text beside them) must equal
what ``GET /v1/stats`` and ``GET /v1/sessions`` answer right after. Traffic has stopped by then, so
nothing moves between the two reads (the background checker is slowed down for the same reason)
but the uptime.

A screenshot goes to ``$RADIXD_ARTIFACTS/status_page.png`` (default ``build/artifacts/``, ignored
by git); its path is printed in the test output.

Chromium is Debian's ``chromium`` package; ``scripts/test.sh`` installs it (``radixd_chromium`` in
``scripts/_env.sh``, without recommended packages). The tests that run it are marked ``browser``:
where it is missing they fail saying how to install it or deselect them (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from array import array
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
from radixd_client import Client
from radixd_client.errors import QuotaExceeded

from tests.redis_procs import SHARED_URL, Server, free_port

from .conftest import SMALL_MODEL  # tests/daemon/conftest.py's; the admin_daemon fixture is here

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "daemon" / "static" / "status.html"
CHROMIUM = "/usr/bin/chromium"
ADMIN_TOKEN = "test-admin-token"
P = SMALL_MODEL["page_size"]



# ---------------------------------------------------------------------------------------- helpers

def toks(n_pages: int, base: int = 1) -> bytes:
    return array("i", range(base, base + n_pages * P)).tobytes()


def http_get(url: str, token: str | None = ADMIN_TOKEN) -> tuple[int, bytes]:
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def get_json(url: str) -> Any:
    status, body = http_get(url)
    assert status == 200, (url, status, body[:500])
    return json.loads(body)


def chromium(tmp: Path, url: str, *extra: str, budget_ms: int = 8000) -> str:
    """Headless Chromium on ``url`` with a fresh profile; returns its stdout."""
    profile = tmp / f"chromium-profile-{time.monotonic_ns()}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
           f"--virtual-time-budget={budget_ms}", *extra, url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"chromium exited {r.returncode}:\n{r.stderr[-4000:]}"
    return r.stdout


class Metrics(HTMLParser):
    """Every element with ``data-metric``: name -> (parsed data-value or None, its text)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: dict[str, tuple[Any, str]] = {}
        self._open: list[list[Any]] = []  # [tag, name or None, raw value, text parts]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self._open.append([tag, a.get("data-metric"), a.get("data-value"), []])

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            t, name, raw, text = self._open.pop()
            if name is not None:
                assert name not in self.found, f"data-metric {name!r} rendered twice"
                value = json.loads(raw) if raw is not None else None
                self.found[name] = (value, "".join(text).strip())
            if t == tag:
                return

    def handle_data(self, data: str) -> None:
        for entry in self._open:
            entry[3].append(data)


def rendered_metrics(dom: str) -> dict[str, tuple[Any, str]]:
    parser = Metrics()
    parser.feed(dom)
    parser.close()
    return parser.found


def expected_metrics(stats: dict[str, Any], sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """What the page must render, by data-metric name, from the two API answers."""
    want: dict[str, Any] = {
        "instance": stats["instance"], "version": stats["version"], "ready": stats["ready"],
        "sessions.count": stats["sessions"], "ops_total": stats["ops_total"],
        "tenants.count": len(stats["tenants"]), "sessions.listed": len(sessions),
    }
    c = stats["checker"]
    want |= {"checker.ok": c["ok"], "checker.kind": c["kind"], "checker.at": c["at"],
             "checker.violation_count": c["violation_count"]}
    for i, v in enumerate(c["violations"]):
        want[f"checker.violations.{i}"] = v  # a list item: the text only
    for name, m in stats["models"].items():
        b = f"model.{name}"
        for k in ("page_size", "sliding_window", "policy", "nodes", "matches", "match_tokens",
                  "hit_tokens", "host_hit_tokens", "hit_rate"):
            want[f"{b}.{k}"] = m[k]
        for pool, p in m["pools"].items():
            for k in ("capacity", "free", "tree", "evictable", "locked", "held"):
                want[f"{b}.pools.{pool}.{k}"] = p[k]
            for k in ("tree", "locked", "held", "free"):
                want[f"{b}.pools.{pool}.{k}_pct"] = p[k] / p["capacity"] * 100
        for reason, by_pool in m["evictions"].items():
            for pool in m["pools"]:
                want[f"{b}.evictions.{reason}.{pool}"] = by_pool.get(pool, 0)
    for t in stats["tenants"]:
        b = f"tenant.{t['name']}"
        for k in ("namespace", "sessions", "hit_tokens", "host_hit_tokens", "match_tokens",
                  "hit_rate", "quota_refusals"):
            want[f"{b}.{k}"] = t[k]
    for s in sessions:
        b = f"session.{s['id']}"
        want |= {f"{b}.id": s["id"], f"{b}.pid": s["pid"], f"{b}.ops": s["ops"]}
        for model, h in s["held"].items():
            for k in ("full_pages", "swa_pages", "receipts"):
                want[f"{b}.held.{model}.{k}"] = h[k]
    for name, m in stats["models"].items():
        b = f"model.{name}"
        want[f"{b}.hits.device"] = m["hit_tokens"]
        t = m["tiers"]
        if t is not None:
            want[f"{b}.hits.host"] = t["loaded_tokens"]
            want[f"{b}.hits.l3_pages"] = t["l3_hit_pages"]
            for k, v in t.items():
                if k not in ("loaded_tokens", "l3_hit_pages"):  # shown as hits by tier
                    want[f"{b}.tiers.{k}"] = v
    for k, v in (stats["l3"] or {}).items():
        want[f"l3.{k}"] = v
    return want


def check_rendered(found: dict[str, tuple[Any, str]], want: dict[str, Any],
                   uptime_s: float) -> None:
    """Every expected metric rendered with that value (and a text that says it), nothing else."""
    problems: list[str] = []
    for name, value in want.items():
        if name not in found:
            problems.append(f"{name}: not rendered (want {value!r})")
            continue
        got, text = found[name]
        if name.endswith("_pct"):
            # the page rounds to one decimal
            if got is None or abs(got - value) > 0.051 or text != f"{got:.1f}%":
                problems.append(f"{name}: {got!r} / {text!r}, want {value:.3f}")
            continue
        if name.startswith("checker.violations."):
            if text != value:
                problems.append(f"{name}: text {text!r}, want {value!r}")
            continue
        # JSON from JavaScript writes 1.0 as 1: numbers compare by value, booleans by identity
        if got != value or (isinstance(got, bool) != isinstance(value, bool)):
            problems.append(f"{name}: data-value {got!r}, want {value!r}")
        if isinstance(value, bool) or value is None:
            continue
        if name.endswith("hit_rate"):
            match_tokens = want[name.removesuffix("hit_rate") + "match_tokens"]
            if match_tokens and abs(float(text.rstrip("%")) - value * 100) > 0.051:
                problems.append(f"{name}: text {text!r} for {value!r}")
        elif isinstance(value, (int, float)) and name != "checker.at":
            if text.replace(",", "") != str(value):
                problems.append(f"{name}: text {text!r} for {value!r}")
        elif isinstance(value, str) and text != value:
            problems.append(f"{name}: text {text!r} for {value!r}")
    extra = set(found) - set(want) - {"uptime_s"}
    problems += [f"{name}: rendered but not in the API answer" for name in sorted(extra)]
    up, _ = found.get("uptime_s", (None, ""))
    if not isinstance(up, (int, float)) or not 0 <= uptime_s - up < 60:
        problems.append(f"uptime_s: rendered {up!r}, the API said {uptime_s!r} right after")
    assert not problems, "the page disagrees with the API:\n  " + "\n  ".join(problems)


def artifacts_dir() -> Path:
    return Path(os.environ.get("RADIXD_ARTIFACTS") or REPO / "build" / "artifacts")


# ---------------------------------------------------------------------------------------- tests

def test_page_is_self_contained() -> None:
    """No build step, no external assets: nothing to fetch but the page and the admin API."""
    html = PAGE.read_text()
    assert html.lstrip().lower().startswith("<!doctype html>")
    assert not re.search(r"<script[^>]*\bsrc\s*=", html, re.I), "external script"
    assert not re.search(r"<link[^>]*rel\s*=\s*\"?stylesheet", html, re.I), "external stylesheet"
    assert not re.search(r"@import|url\(\s*['\"]?(?!data:)", html, re.I), "CSS fetching assets"
    for m in re.finditer(r"\b(?:src|href|action)\s*=\s*\"([^\"]*)\"", html, re.I):
        assert m.group(1).startswith(("data:", "#")), f"external reference {m.group(0)}"
    # only relative API paths (the page may sit behind a proxy under a prefix), token as bearer
    assert re.findall(r"getJSON\(\"([^\"]+)\"", html) == ["v1/stats", "v1/sessions"]
    assert '"Bearer " + token' in html
    assert "innerHTML" not in html, "names come from clients: render them as text only"


ADMIN_CONFIG_TENANTS = [
    {"name": "alice", "token": "alice-token", "namespace": "ns-a",
     "quota_full_pages": 12, "quota_swa_pages": 12},
    {"name": "bob", "token": "bob-token", "namespace": "ns-b"},
]


def drive_traffic(sock: str) -> Client:
    """A few sessions of real work; returns the one left open (pages held, a prefix locked)."""
    # bob: caches a prefix and hits it, twice over, on both models
    with Client(sock, token="bob-token", client_name="bench-bob") as bob:
        for model in ("m", "m2"):
            t = toks(6, 1000)
            assert bob.match(model, t).prefix_len == 0
            a = bob.alloc(model, 6)
            bob.insert(model, t, a.full_pages, a.swa_pages)
            assert bob.match(model, t).prefix_len == 6 * P
            assert bob.match(model, t + toks(2, 9000)).prefix_len == 6 * P
    # alice: a hit, an eviction of her own cold pages for quota, then a quota refusal
    with Client(sock, token="alice-token", client_name="worker-alice-1") as alice:
        for i in range(4):  # 4 x 2 pages cached: 8 of 12
            t = toks(2, 100 * (i + 1))
            a = alice.alloc("m", 2)
            alice.insert("m", t, a.full_pages, a.swa_pages)
        assert alice.match("m", toks(2, 400)).prefix_len == 2 * P
        a = alice.alloc("m", 8)  # over quota: her two coldest entries go
        m = alice.match("m", toks(2, 400), lock=True)
        with pytest.raises(QuotaExceeded):
            alice.alloc("m", 6)  # 8 held + 2 locked + 6 > 12 and nothing left to evict
        alice.unlock("m", m.receipt)
        alice.free("m", a.full_pages, a.swa_pages)
    # left open: alice's second worker holds 3 pages and a locked prefix (a hit) on "m"
    open_session = Client(sock, token="alice-token", client_name="worker-alice-2")
    m = open_session.match("m", toks(2, 400), lock=True)
    assert m.prefix_len == 2 * P
    open_session.alloc("m", 3)
    open_session.ping(b"x")
    return open_session


@pytest.fixture
def l3_prefix() -> Iterator[str]:
    """A key prefix of this test's own on the shared Redis, its keys removed afterwards."""
    prefix = f"radixd-status-{uuid.uuid4().hex[:12]}"
    yield prefix
    raw = redis_sync.Redis.from_url(SHARED_URL)
    keys = list(raw.scan_iter(match=prefix + ":*", count=1000))
    if keys:
        raw.delete(*keys)
    raw.close()


def wait_for(fn: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def host_round_trip(sock: str, base: str) -> None:
    """bob's pages reach host (write-through), leave the device, and come back by a load: a
    host hit on the page; their L3 write-through copies make Redis traffic."""
    t = toks(6, 5000)
    with Client(sock, token="bob-token", client_name="host-bob") as bob:
        a = bob.alloc("m", 6)
        bob.insert("m", t, a.full_pages, a.swa_pages)
        wait_for(lambda: get_json(base + "/v1/stats")["models"]["m"]["tiers"]
                 ["host_pages_in_tree"] >= 6, "the host copy")
        bob.evict("m", full_pages=1000, swa_pages=1000)
        m = bob.match("m", t)
        assert (m.prefix_len, m.host_hit_len) == (0, 6 * P)
        assert bob.load("m", t).loaded_len == 6 * P


def settled_stats(base: str) -> None:
    """Wait until the background copies (host, Redis) are done and /v1/stats stands still, so
    that the page and the test read the same numbers."""
    def still() -> bool:
        a = get_json(base + "/v1/stats")
        time.sleep(0.3)
        b = get_json(base + "/v1/stats")
        queues = [t[k] for m in b["models"].values() if (t := m["tiers"])
                  for k in ("backup_queue", "l3_write_queue")]
        return not any(queues) and (a["models"], a["l3"]) == (b["models"], b["l3"])

    wait_for(still, "the tiers to settle")


@pytest.mark.browser
def test_status_page_renders_what_the_api_says(admin_daemon, tmp_path: Path, l3_prefix: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    d = admin_daemon({
        "l3": {"url": SHARED_URL, "key_prefix": l3_prefix},
        "admin": {"token": ADMIN_TOKEN},  # and port 0: the URL comes from the daemon's log
        # slow background checks: the only one is the full check requested below, so the
        # checker's verdict and time stand still between the page's read and ours
        "checker": {"interval_s": 3600.0, "strict": True},
        "models": [SMALL_MODEL, {**SMALL_MODEL, "name": "m2", "full_pages": 32, "swa_pages": 16,
                                 "eviction_policy": "lru"}],
        "tenants": ADMIN_CONFIG_TENANTS,
    })
    base = d.admin_url

    # the page itself is public and holds no data; the API is not
    status, body = http_get(base + "/", token=None)
    assert status == 200 and body == PAGE.read_bytes()
    assert http_get(base + "/v1/stats", token=None)[0] == 401

    host_round_trip(d.socket, base)
    open_session = drive_traffic(d.socket)
    try:
        settled_stats(base)
        d.check()  # a full invariant check, for the page to show (traffic has stopped)

        dom = chromium(tmp_path, f"{base}/#token={ADMIN_TOKEN}", "--dump-dom")
        stats = get_json(base + "/v1/stats")
        sessions = get_json(base + "/v1/sessions")

        assert 'data-state="live"' in dom, dom[-3000:]
        assert ADMIN_TOKEN not in dom  # the token is never rendered
        found = rendered_metrics(dom)
        want = expected_metrics(stats, sessions)
        check_rendered(found, want, stats["uptime_s"])

        # the traffic above shows up where it should (the API's numbers, hence the page's)
        assert stats["ready"] is True and stats["checker"]["ok"] is True
        assert stats["checker"]["kind"] == "full"
        assert stats["sessions"] == 1 and len(sessions) == 1
        me = sessions[0]
        assert (me["tenant"], me["client"], me["pid"]) == ("alice", "worker-alice-2", os.getpid())
        assert me["held"]["m"]["full_pages"] == 3 and me["held"]["m"]["receipts"] == 1
        full = stats["models"]["m"]["pools"]["full"]
        assert full["held"] == 3 and full["locked"] == 2 and full["tree"] > 0
        assert full["tree"] + full["held"] + full["free"] <= full["capacity"]
        for name in ("m", "m2"):
            assert 0 < stats["models"][name]["hit_tokens"] <= stats["models"][name]["match_tokens"]
        tenants = {t["name"]: t for t in stats["tenants"]}
        assert tenants["alice"]["quota_refusals"] >= 1 and tenants["bob"]["quota_refusals"] == 0
        assert tenants["alice"]["sessions"] >= 1
        assert found["tenant.alice.quota_refusals"][0] >= 1
        assert found["model.m.pools.full.held"] == (3, "3")
        # the tiers: a host hit, host pages in use, Redis written to, the breaker closed
        assert found["model.m.hits.host"][0] == 6 * P
        assert found["model.m.tiers.host_pages_used"][0] > 0
        assert found["model.m.tiers.load_pages"][0] >= 6
        assert found["l3.sets"][0] > 0 and found["l3.set_failures"][0] == 0
        assert found["l3.breaker_state"] == ("closed", "closed")

        # the screenshot, kept as a build artifact
        shot = tmp_path / "status_page.png"
        chromium(tmp_path, f"{base}/#token={ADMIN_TOKEN}", f"--screenshot={shot}",
                 "--window-size=1280,1600")
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, len(data)
        out = artifacts_dir()
        out.mkdir(parents=True, exist_ok=True)
        kept = shutil.copyfile(shot, out / "status_page.png")
        with capsys.disabled():
            print(f"\nstatus page screenshot: {Path(kept).resolve()}")
    finally:
        open_session.close()


@pytest.mark.browser
def test_status_page_asks_for_a_token(admin_daemon, tmp_path: Path) -> None:
    """No token in the fragment or storage: a form; a wrong one: rejected, no data shown."""
    base = admin_daemon({"admin": {"token": ADMIN_TOKEN}}).admin_url

    dom = chromium(tmp_path, base + "/", "--dump-dom", budget_ms=3000)
    assert re.search(r'<section id="login"(?![^>]*hidden)', dom), "no token form"
    assert not rendered_metrics(dom)

    dom = chromium(tmp_path, base + "/#token=wrong-token", "--dump-dom", budget_ms=3000)
    assert re.search(r'<section id="login"(?![^>]*hidden)', dom), "no token form"
    assert "token rejected" in dom and 'data-state="unauthorized"' in dom
    assert not rendered_metrics(dom)


@pytest.mark.browser
def test_status_page_shows_an_open_breaker(admin_daemon, tmp_path: Path) -> None:
    """Redis killed under a daemon: the breaker opens, and the page says so (in the API's words,
    with the alarm style), beside the failures that opened it."""
    srv = Server(free_port(), tmp_path)
    srv.start()
    try:
        d = admin_daemon({"admin": {"token": ADMIN_TOKEN}, "checker": {"interval_s": 3600.0},
                          "l3": {"url": srv.url, "key_prefix": "status-breaker",
                                 "op_timeout_ms": 300, "breaker_threshold": 2,
                                 "breaker_open_s": 3600.0}})
        base = d.admin_url
        srv.kill()
        with Client(d.socket) as c:
            for i in range(3):
                c.prefetch("m", toks(2, 100 * (i + 1)), policy="wait_complete")
        wait_for(lambda: get_json(base + "/v1/stats")["l3"]["breaker_state"] == "open",
                 "the breaker to open")
        dom = chromium(tmp_path, f"{base}/#token={ADMIN_TOKEN}", "--dump-dom")
        stats = get_json(base + "/v1/stats")
        found = rendered_metrics(dom)
        check_rendered(found, expected_metrics(stats, get_json(base + "/v1/sessions")),
                       stats["uptime_s"])
        assert found["l3.breaker_state"] == ("open", "open")
        assert re.search(r'data-metric="l3.breaker_state"[^>]*class="bad"', dom), dom[-3000:]
        assert "Redis is failing" in dom
        assert found["l3.breaker_opens"][0] == 1
        assert found["l3.errors"][0] + found["l3.timeouts"][0] >= 2
    finally:
        srv.kill()
