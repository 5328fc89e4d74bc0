"""The admin HTTP endpoint against a real daemon: auth, every route, bounds, redaction, bad input,
and a schemathesis run over its own OpenAPI document (/metrics: test_metrics.py).

Most tests drive a real ``radixd serve`` (tests/ops/conftest.py: ``admin_daemon``), whose teardown
asks for a full invariant check that must be clean. A few run the admin app in process, where a
state is hard to reach from outside (not ready yet, stopping, the status page missing).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from radixd_client import Client

from .conftest import (
    ADMIN_TOKEN,
    DEVICE_ONLY,
    SMALL_MODEL,
    P,
    cache,
    cache_on_host,
    http_request,
    metric,
    parse_metrics,
    scrape,
    toks,
)

# every route that needs the token: (method, path)
PROTECTED = [
    ("GET", "/readyz"), ("GET", "/metrics"), ("GET", "/v1/stats"), ("GET", "/v1/tenants"),
    ("GET", "/v1/sessions"), ("GET", "/v1/models"), ("GET", "/v1/tree"), ("GET", "/v1/config"),
    ("GET", "/v1/openapi.json"), ("POST", "/v1/check"), ("POST", "/v1/evict"),
]
PUBLIC = [("GET", "/healthz"), ("GET", "/")]


# ---------------------------------------------------------------------------- auth

def test_every_route_needs_the_token_but_liveness_and_the_page(admin_daemon) -> None:
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN}})
    for method, path in PROTECTED + [("GET", "/no/such/route")]:
        r = d.request(method, path, token=None)
        assert r.status == 401, (method, path, r)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["code"] == "unauthorized"
        assert "missing Authorization" in r.json()["error"]["message"]
        r = d.request(method, path, token="wrong-token")
        assert r.status == 401, (method, path, r)
        assert 'error="invalid_token"' in r.headers["www-authenticate"]
        assert r.json()["error"]["message"] == "the bearer token is not valid"
        for header in (f"Basic {ADMIN_TOKEN}", "Bearer", ADMIN_TOKEN, "Bearer  "):
            r = d.request(method, path, token=None, headers={"Authorization": header})
            assert r.status == 401, (method, path, header, r)
        r = d.request(method, path)
        assert r.status != 401, (method, path, r)
    for method, path in PUBLIC:
        r = d.request(method, path, token=None)
        assert r.status in (200, 404), r  # / is 404 only when the page is not installed
    assert d.get("/healthz", token=None).json() == {"status": "alive"}
    r = d.get("/no/such/route")
    assert r.status == 404 and r.json()["error"]["code"] == "not_found"
    r = d.request("PUT", "/v1/evict")
    assert r.status == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"


def test_generated_token_is_written_0600_beside_the_socket(admin_daemon) -> None:
    d = admin_daemon()
    path = Path(d.socket).parent / "admin.token"
    assert path == d.token_file
    token = path.read_text().strip()
    assert len(token) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    log = d.log()
    assert str(path) in log and token not in log
    assert d.get("/v1/stats", token=token).status == 200
    assert d.get("/v1/stats", token=token[:-1]).status == 401


def test_token_file_and_token_sha256_settings(admin_daemon, tmp_path: Path) -> None:
    custom = tmp_path / "secrets" / "radixd-admin.token"
    d = admin_daemon({"admin": {"token_file": str(custom)}})
    assert custom.exists() and stat.S_IMODE(custom.stat().st_mode) == 0o600
    assert not (Path(d.socket).parent / "admin.token").exists()
    assert d.get("/v1/stats", token=custom.read_text().strip()).status == 200

    digest = hashlib.sha256(b"hashed-admin-token").hexdigest()
    d2 = admin_daemon({"admin": {"token_sha256": digest}})
    assert not (Path(d2.socket).parent / "admin.token").exists()
    assert d2.get("/v1/stats", token="hashed-admin-token").status == 200
    assert d2.get("/v1/stats", token=digest).status == 401


# ---------------------------------------------------------------------------- health

def test_readyz_and_healthz_on_a_running_daemon(admin_daemon) -> None:
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN}})
    r = d.get("/readyz")
    assert (r.status, r.json()) == (200, {"ready": True})
    assert d.get("/healthz", token=None).json() == {"status": "alive"}


@pytest.mark.asyncio
async def test_readyz_reports_starting_and_stopping(tmp_path: Path) -> None:
    import aiohttp

    daemon = _in_process_daemon(tmp_path)
    handle = await daemon.start_admin()
    try:
        assert handle.port and handle.url == f"http://127.0.0.1:{handle.port}"
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with aiohttp.ClientSession() as s:
            async with s.get(handle.url + "/readyz", headers=auth) as r:
                assert (r.status, await r.json()) == (503, {"ready": False,
                                                            "reason": "starting"})
            daemon.server.ready = True
            async with s.get(handle.url + "/readyz", headers=auth) as r:
                assert (r.status, await r.json()) == (200, {"ready": True})
            daemon.server.stop()  # what SIGTERM does: not ready, stopping
            async with s.get(handle.url + "/readyz", headers=auth) as r:
                assert (r.status, await r.json()) == (503, {"ready": False,
                                                            "reason": "stopping"})
            async with s.get(handle.url + "/healthz") as r:
                assert r.status == 200
    finally:
        await handle.stop()
        daemon.service.close()


def _in_process_daemon(tmp_path: Path, **admin: Any) -> Any:
    from daemon.app import build
    from daemon.config import load_config

    config = load_config(None, env={}, overrides={
        "server": {"socket": str(tmp_path / "radixd.sock")},
        "admin": {"port": 0, "token": ADMIN_TOKEN, **admin},
        "models": [{**SMALL_MODEL, "export_pools": False}],
    })
    return build(config, create_pools=False)


@pytest.mark.asyncio
async def test_status_page_served_or_a_clear_404(tmp_path: Path, monkeypatch) -> None:
    import aiohttp

    from daemon import admin

    daemon = _in_process_daemon(tmp_path)
    handle = await daemon.start_admin()
    try:
        async with aiohttp.ClientSession() as s:
            page = Path(admin.__file__).parent / "static" / "status.html"
            async with s.get(handle.url + "/") as r:  # no token: the page holds no data
                if page.exists():
                    assert r.status == 200
                    assert r.headers["Content-Type"].startswith("text/html")
                    assert await r.read() == page.read_bytes()
                else:
                    assert r.status == 404
            monkeypatch.setattr(admin.importlib.resources, "files", lambda _pkg: tmp_path)
            async with s.get(handle.url + "/") as r:
                assert r.status == 404
                body = await r.json()
                assert "status page" in body["error"]["message"]
                assert "not installed" in body["error"]["message"]
    finally:
        await handle.stop()
        daemon.service.close()


@pytest.mark.asyncio
async def test_admin_over_a_unix_socket(tmp_path: Path) -> None:
    daemon = _in_process_daemon(tmp_path, unix_socket=str(tmp_path / "admin.sock"))
    handle = await daemon.start_admin()
    try:
        assert handle.url == f"unix:{tmp_path / 'admin.sock'}" and handle.port is None
        assert stat.S_ISSOCK(os.stat(tmp_path / "admin.sock").st_mode)
        import asyncio

        r = await asyncio.to_thread(http_request, handle.url, "GET", "/v1/models",
                                    headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert r.status == 200 and r.json()[0]["name"] == "m"
    finally:
        await handle.stop()
        daemon.service.close()
    assert not (tmp_path / "admin.sock").exists()


@pytest.mark.asyncio
async def test_port_conflicts(tmp_path: Path, monkeypatch, caplog) -> None:
    """A configured port that is taken stops the daemon; the built-in default being taken
    (another daemon on the machine) costs only the admin endpoint, with an error logged."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        daemon = _in_process_daemon(tmp_path, port=busy.getsockname()[1])
        with pytest.raises(OSError, match="admin endpoint 127.0.0.1:"):
            await daemon.start_admin()
        daemon.service.close()

        from daemon import admin

        def taken(host: str, port: int) -> socket.socket:
            raise OSError(98, "Address already in use")

        monkeypatch.setattr(admin, "bind_tcp", taken)
        daemon = _in_process_daemon(tmp_path)
        daemon.config.admin = type(daemon.config.admin)(token=ADMIN_TOKEN)  # port: the default
        assert await daemon.start_admin() is None
        assert "admin endpoint not started: cannot bind 127.0.0.1:8471" in caplog.text
        daemon.service.close()
    finally:
        busy.close()


@pytest.mark.asyncio
async def test_an_unwritable_token_file_is_fatal(tmp_path: Path) -> None:
    """A configuration error (exit 2, which systemd does not restart on), naming the key."""
    from daemon.config import ConfigError

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    daemon = _in_process_daemon(tmp_path, token=None, token_file=str(blocker / "admin.token"))
    with pytest.raises(ConfigError,
                       match="admin.token_file: cannot write the admin token to .*not-a-dir"):
        await daemon.start_admin()
    daemon.service.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("left", ["a" * 64 + "\n", "Ab-_" * 10 + "xyz\n"])
async def test_a_token_a_daemon_left_behind_is_written_over(tmp_path: Path, left: str) -> None:
    """A daemon that did not stop cleanly leaves its token file; versions before 2026-11 wrote
    43 URL-safe characters and never removed it. Either is taken for a daemon's, not refused
    as someone's file."""
    path = tmp_path / "admin.token"
    path.write_text(left)
    daemon = _in_process_daemon(tmp_path, token=None, token_file=str(path))
    handle = await daemon.start_admin()
    try:
        assert handle is not None and re.fullmatch(r"[0-9a-f]{64}\n", path.read_text())
    finally:
        await handle.stop()  # type: ignore[union-attr]
        daemon.service.close()


def test_idle_connections_are_limited_and_closed(admin_daemon) -> None:
    """Connections that send nothing (any local user can open them): one past
    admin.max_connections gets a JSON 503 and is closed, and a request still gets through once
    the daemon has closed the idle ones (no request for 10 s); engines connect all along."""
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN, "max_connections": 4}})
    host, _, port = d.admin_url[len("http://"):].rpartition(":")
    idle = [socket.create_connection((host, int(port)), timeout=30) for _ in range(4)]
    try:
        r = d.get("/v1/stats")
        assert r.status == 503 and r.json()["error"]["code"] == "too_many_connections", r
        for _ in range(30):  # a refused request with a body: the 503, not a reset
            r = d.post("/v1/evict", json_body={"model": "m" * 60000})
            assert r.status == 503, r
        with Client(d.socket) as c:
            assert c.ping(b"x").payload == b"x"
        t0 = time.monotonic()
        for s in idle:
            assert s.recv(1) == b""  # closed by the daemon, not by a timeout here
        assert time.monotonic() - t0 < 25
        deadline = time.monotonic() + 2  # (a busy loop forgets a closed connection a turn late)
        while (status := d.get("/v1/stats").status) != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 200
    finally:
        for s in idle:
            s.close()
    assert "admin endpoint: 4 connections open (admin.max_connections)" in d.log()


def test_a_request_whose_body_never_ends_is_timed_out(admin_daemon) -> None:
    """An authenticated POST that sends its headers and part of its body, then nothing: once
    the idle limit (10 s) has passed since, it gets 408 and its connection is to close; before,
    it held the connection for good, and admin.max_connections of them shut every operator
    out."""
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN, "max_connections": 2}})
    host, _, port = d.admin_url[len("http://"):].rpartition(":")
    stuck = socket.create_connection((host, int(port)), timeout=30)
    try:
        stuck.sendall(b"POST /v1/check HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + ADMIN_TOKEN.encode() +
                      b"\r\nContent-Length: 100\r\n\r\n{")
        answer = b""  # (the daemon then drains what the client still sends, a while, and closes)
        while b'"request_timeout"' not in answer and (chunk := stuck.recv(4096)):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"Connection: close" in answer, answer
    finally:
        stuck.close()
    assert d.get("/v1/stats").status == 200


def test_a_configured_port_in_use_stops_the_daemon(admin_daemon) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"admin endpoint 127.0.0.1:{port}"):
            admin_daemon({"admin": {"port": port, "token": ADMIN_TOKEN}})
    finally:
        busy.close()


@pytest.mark.asyncio
async def test_a_model_without_swa(tmp_path: Path) -> None:
    """No SWA pool: no swa in the pools, no swa series, and swa_pages must be 0 to evict.
    (In process: a TOML file cannot say sliding_window = None.)"""
    import aiohttp

    from daemon.app import build
    from daemon.config import load_config

    config = load_config(None, env={}, overrides={
        "server": {"socket": str(tmp_path / "radixd.sock")},
        "admin": {"port": 0, "token": ADMIN_TOKEN},
        "models": [{**SMALL_MODEL, "sliding_window": None, "num_swa_layers": 0,
                    "export_pools": False}],
    })
    daemon = build(config, create_pools=False)
    handle = await daemon.start_admin()
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        async with aiohttp.ClientSession(headers=auth) as s:
            async with s.get(handle.url + "/v1/stats") as r:
                model = (await r.json())["models"]["m"]
                assert set(model["pools"]) == {"full"} and model["sliding_window"] is None
            async with s.post(handle.url + "/v1/evict", json={"swa_pages": 1}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["parameter"] == "swa_pages"
            async with s.post(handle.url + "/v1/evict", json={"full_pages": 1}) as r:
                assert (r.status, await r.json()) == (200, {"full_pages": 0, "swa_pages": 0,
                                                      "host_pages": 0})
        _, samples = parse_metrics(scrape(daemon))
        assert not [k for k in samples if ("pool", "swa") in k[1]]
    finally:
        await handle.stop()
        daemon.service.close()


# ---------------------------------------------------------------------------- JSON views

MULTI = {
    "models": [SMALL_MODEL, {**SMALL_MODEL, "name": "other", "page_size": 8,
                             "eviction_policy": "lru"}],
    "tenants": [
        {"name": "alice", "token": "alice-secret-token", "namespace": "ns-a",
         "quota_full_pages": 20},
        {"name": "bob", "token_sha256": hashlib.sha256(b"bob-secret-token").hexdigest(),
         "namespace": "ns-b", "models": ["m"]},
    ],
    "admin": {"token": ADMIN_TOKEN},
}


def test_views_tenants_sessions_models_stats(admin_daemon) -> None:
    d = admin_daemon(MULTI)
    with Client(d.socket, token="alice-secret-token", client_name="engine-a") as a, \
            Client(d.socket, token="bob-secret-token", client_name="engine-b") as b:
        cache(a, toks(3))
        other = a.alloc("other", 2)  # pages of 8 tokens there
        a.insert("other", toks(4), other.full_pages, other.swa_pages)
        cache(b, toks(2, base=50))
        a.match("m", toks(3))
        held = b.alloc("m", 1)
        receipt = b.match("m", toks(2, base=50), lock=True).receipt

        models = d.get_json("/v1/models")
        assert [m["name"] for m in models] == ["m", "other"]
        assert models[0]["policy"] == "lru-depth" and models[0]["device"] == "cpu"
        assert models[0]["pools"]["full"]["tree"] == 5 and "swa" in models[0]["pools"]
        assert (models[1]["page_size"], models[1]["policy"]) == (8, "lru")

        tenants = {t["name"]: t for t in d.get_json("/v1/tenants")}
        assert tenants["alice"]["models"] == ["*"] and tenants["bob"]["models"] == ["m"]
        assert tenants["alice"]["quota_full_pages"] == 20
        assert tenants["alice"]["usage"]["m"]["tree_full_pages"] == 3
        assert tenants["alice"]["usage"]["other"]["tree_full_pages"] == 2
        assert set(tenants["bob"]["usage"]) == {"m"}
        assert tenants["bob"]["usage"]["m"] == {"tree_full_pages": 2, "tree_swa_pages": 2,
                                                "held_full_pages": 1, "held_swa_pages": 1}
        assert tenants["alice"]["counters"]["matches"] == 1
        assert tenants["bob"]["sessions"] == 1
        for t in tenants.values():
            assert not {"token", "token_sha256", "digest"} & set(t)

        sessions = {s["client"]: s for s in d.get_json("/v1/sessions")}
        sb = sessions["engine-b"]
        assert sb["tenant"] == "bob" and sb["pid"] == os.getpid() and sb["uid"] == os.getuid()
        assert sb["held"] == {"m": {"full_pages": 1, "swa_pages": 1, "receipts": 1}}
        assert sb["ops"] == 4 and sb["id"] == b.session
        assert set(sessions["engine-a"]["held"]) == {"m", "other"}

        stats = d.get_json("/v1/stats")
        assert stats["sessions"] == 2 and stats["ready"] is True
        assert set(stats["models"]) == {"m", "other"}
        assert set(stats["models"]["m"]) == {"page_size", "sliding_window", "policy", "pools",
                                             "nodes", "matches", "match_tokens",
                                             "hit_tokens", "hit_rate", "evictions", "tiers",
                                             "segments", "keyed", "host_hit_tokens"}
        keyed = stats["models"]["m"]["keyed"]  # the key-addressed store: all namespaces
        assert keyed["pages"] == {"full": 0, "swa": 0} and keyed["pins"] == 0
        assert keyed["counters"]["kv_lookups"] == 0
        tiers = stats["models"]["m"]["tiers"]  # the host tier is on by default
        assert tiers["host_pages_capacity"] == 4095 and tiers["load_failures"] == 0
        assert stats["l3"] is None  # no l3.url configured
        assert set(stats["checker"]) == {"ok", "kind", "at", "violations", "violation_count"}
        ts = {t["name"]: t for t in stats["tenants"]}
        assert ts["alice"] == {"name": "alice", "namespace": "ns-a", "sessions": 1,
                               "hit_tokens": 12, "match_tokens": 12, "hit_rate": 1.0,
                               "quota_refusals": 0, "host_hit_tokens": 0}
        b.unlock("m", receipt)
        b.free("m", held.full_pages, held.swa_pages)


def test_tree_dump_is_bounded(admin_daemon) -> None:
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN, "tree_dump_max_nodes": 4},
                      "models": DEVICE_ONLY})
    assert d.get("/v1/tree").status == 404  # nothing cached yet
    a = toks(2, base=1)
    with Client(d.socket) as c:
        # root -> a -> {b, c}; root -> d; root -> e
        cache(c, a + toks(2, base=100))
        cache(c, a + toks(2, base=200))
        cache(c, toks(2, base=300))
        cache(c, toks(2, base=400))
        receipt = c.match("m", a + toks(2, base=100), lock=True).receipt

        full = d.get("/v1/tree?depth=1")
        assert full.status == 200, full
        t = full.json()
        assert (t["model"], t["namespace"], t["depth"], t["nodes"], t["truncated"]) == \
            ("m", "default", 1, 4, False)
        root = t["root"]
        assert root["depth"] == 0 and root["pages"] == 0 and len(root["children"]) == 3
        first = next(n for n in root["children"] if n["children_omitted"] == 2)
        assert (first["pages"], first["depth"], first["state"], first["host"]) == \
            (2, 2 * P, "live", False)
        assert first["locks"][0] == 1 and first["children"] == []

        t = d.get("/v1/tree?depth=2").json()
        assert t["truncated"] is True and t["nodes"] == 4  # the cap

        t = d.get("/v1/tree?depth=0&model=m&namespace=default").json()
        assert t["nodes"] == 1 and t["root"]["children_omitted"] == 3

        for q, param in (("depth=-1", "depth"), ("depth=65", "depth"), ("depth=x", "depth"),
                         ("depth=1.5", "depth"), ("depth=", "depth"), ("depth=1&depth=2", "depth"),
                         ("bogus=1", "bogus")):
            r = d.get(f"/v1/tree?{q}")
            assert r.status == 400, (q, r)
            assert r.json()["error"]["parameter"] == param and param in \
                r.json()["error"]["message"]
        assert d.get("/v1/tree?model=nope").status == 404
        r = d.get("/v1/tree?namespace=nope")
        assert r.status == 404 and "nope" in r.json()["error"]["message"]
        c.unlock("m", receipt)


def test_tree_and_evict_name_model_and_namespace_when_ambiguous(admin_daemon) -> None:
    d = admin_daemon(MULTI)
    r = d.get("/v1/tree")
    assert r.status == 400 and r.json()["error"]["parameter"] == "model"
    with Client(d.socket, token="alice-secret-token") as a, \
            Client(d.socket, token="bob-secret-token") as b:
        cache(a, toks(3))
        cache(b, toks(4))
        r = d.get("/v1/tree?model=m")
        assert r.status == 400 and r.json()["error"]["parameter"] == "namespace"
        assert "ns-a" in r.json()["error"]["message"]
        assert d.get("/v1/tree?model=m&namespace=ns-b").json()["root"]["children"][0][
            "pages"] == 4

        r = d.post("/v1/evict", json_body={"full_pages": 1})
        assert r.status == 400 and r.json()["error"]["parameter"] == "model"
        r = d.post("/v1/evict", json_body={"model": "m", "namespace": "ns-b", "full_pages": 99})
        assert r.status == 200 and r.json() == {"full_pages": 4, "swa_pages": 4, "host_pages": 0}
        usage = {t["name"]: t["usage"]["m"] for t in d.get_json("/v1/tenants")}
        assert usage["alice"]["tree_full_pages"] == 3 and usage["bob"]["tree_full_pages"] == 0
        r = d.post("/v1/evict", json_body={"model": "m", "namespace": "nobody", "full_pages": 1})
        assert r.status == 404
        assert a.match("m", toks(3)).prefix_len == 3 * P


def test_evict_respects_locks(admin_daemon) -> None:
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN}})
    kept, cold = toks(4), toks(3, base=500)
    with Client(d.socket) as c:
        cache(c, kept)
        cache(c, cold)
        receipt = c.match("m", kept, lock=True).receipt
        r = d.post("/v1/evict", json_body={"model": "m", "full_pages": 1000, "swa_pages": 1000})
        assert r.status == 200, r
        freed = r.json()
        assert freed["full_pages"] == 3  # only the unlocked path
        pools = d.get_json("/v1/stats")["models"]["m"]["pools"]
        assert pools["full"]["tree"] == pools["full"]["locked"] == 4
        assert pools["full"]["evictable"] == 0
        assert pools["swa"]["tree"] == pools["swa"]["locked"] == 2  # the window stays
        assert c.match("m", kept).prefix_len == 4 * P
        assert c.match("m", cold).prefix_len == 0
        assert d.post("/v1/check").json()["ok"] is True
        c.unlock("m", receipt)
        freed = d.post("/v1/evict", json_body={"full_pages": 1000}).json()
        assert freed["full_pages"] == 4
        assert d.get_json("/v1/stats")["models"]["m"]["evictions"]["admin"]["full"] == 7


def test_bad_input_gets_400_naming_it(admin_daemon) -> None:
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN}})
    bad_bodies: list[tuple[bytes, str | None, str]] = [
        (b"", None, "JSON body is required"),
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "JSON object"),
        (b'"x"', None, "JSON object"),
        (b"null", None, "JSON object"),
        (b'{"full_pages": NaN}', None, "not valid JSON"),
        (b'{"full_pages": -1}', "full_pages", "full_pages"),
        (b'{"full_pages": 1.5}', "full_pages", "full_pages"),
        (b'{"full_pages": true}', "full_pages", "full_pages"),
        (b'{"full_pages": "3"}', "full_pages", "full_pages"),
        (b'{"swa_pages": 99999999999999999999}', "swa_pages", "swa_pages"),
        (b'{"model": 3}', "model", "model must be a string"),
        (b'{"namespace": ["a"]}', "namespace", "namespace must be a string"),
        (b'{"full_pages": 1, "extra": 1}', "extra", "unknown field"),
    ]
    for body, param, text in bad_bodies:
        r = d.post("/v1/evict", body=body, headers={"Content-Type": "application/json"})
        assert r.status == 400, (body, r)
        err = r.json()["error"]
        assert err["code"] == "bad_request" and text in err["message"], (body, err)
        assert err.get("parameter") == param, (body, err)
    r = d.post("/v1/evict", json_body={"model": "nope", "full_pages": 1})
    assert r.status == 404 and "nope" in r.json()["error"]["message"]
    r = d.post("/v1/evict", body=b"x" * 100_000)
    assert r.status == 413 and r.json()["error"]["code"] == "payload_too_large"
    for method, path in PROTECTED:
        if path in ("/readyz", "/metrics"):
            continue  # probes and scrapers may add parameters of their own
        r = d.request(method, f"{path}?unexpected=1")
        assert r.status == 400, (path, r)
        assert r.json()["error"]["parameter"] == "unexpected"


def test_config_is_redacted_and_no_secret_leaks(admin_daemon) -> None:
    cfg = {**MULTI, "admin": {"token": "admin-secret-token-xyz"}}
    d = admin_daemon(cfg)
    secrets = ["admin-secret-token-xyz", "alice-secret-token", "bob-secret-token",
               hashlib.sha256(b"admin-secret-token-xyz").hexdigest(),
               hashlib.sha256(b"alice-secret-token").hexdigest(),
               hashlib.sha256(b"bob-secret-token").hexdigest()]
    with Client(d.socket, token="alice-secret-token") as a:
        cache(a, toks(2))
        conf = d.get_json("/v1/config")
        assert conf["admin"]["token"] == "<redacted>" and conf["admin"]["token_sha256"] is None
        assert conf["tenants"][0]["token"] == "<redacted>"
        assert conf["tenants"][1]["token_sha256"] == "<redacted>"
        assert conf["models"][1]["name"] == "other" and conf["server"]["socket"] == d.socket
        responses = []
        for method, path in PROTECTED + PUBLIC + [("GET", "/v1/tree?model=m"),
                                                  ("GET", "/nowhere")]:
            for token in (True, None, "wrong"):
                responses.append(d.request(method, path, token=token))
        responses.append(d.post("/v1/evict", json_body={"model": "m", "full_pages": 1}))
        responses.append(d.post("/v1/evict", json_body={"bad": 1}))
    for r in responses:
        blob = r.text + repr(r.headers)
        for s in secrets:
            assert s not in blob, (s, r)
    log = d.log()
    for s in secrets:
        assert s not in log


# ---------------------------------------------------------------------------- check

def test_check_runs_the_full_check_now(admin_daemon) -> None:
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN},
                      "checker": {"interval_s": 60, "strict": True}})
    with Client(d.socket) as c:
        cache(c, toks(3))
        r = d.post("/v1/check")
        assert r.status == 200
        body = r.json()
        assert body["ok"] is True and body["violations"] == [] and body["seconds"] >= 0
        checker = d.get_json("/v1/stats")["checker"]
        assert checker["ok"] is True and checker["kind"] == "full"
        assert checker["violation_count"] == 0
        _, samples = parse_metrics(d.get("/metrics").text)
        assert metric(samples, "radixd_invariant_checks_total", kind="full") == 1
        big = d.post("/v1/check", body=b"x" * (65 * 1024))  # a body over 64 KiB: 413, as anywhere
        assert big.status == 413 and big.json()["error"]["code"] == "payload_too_large", big
        assert metric(samples, "radixd_invariant_checks_total", kind="counters") == 0


def test_openapi_document_covers_every_route(admin_daemon) -> None:
    from daemon.admin import openapi_document

    d = admin_daemon({"admin": {"token": ADMIN_TOKEN}})
    doc = d.get_json("/v1/openapi.json")
    assert doc == openapi_document()
    assert doc["openapi"].startswith("3.1")  # JSON Schema 2020-12: msgspec's schemas
    documented = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    assert documented == set(PROTECTED + PUBLIC)
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    for method, path in PUBLIC:
        assert doc["paths"][path][method.lower()]["security"] == []
    for method, path in PROTECTED:
        assert "401" in doc["paths"][path][method.lower()]["responses"]


# ---------------------------------------------------------------------------- schemathesis

def test_schemathesis_over_the_openapi_document(admin_daemon) -> None:
    """Every documented route, valid and invalid input (hypothesis-generated from the document),
    with every schemathesis check on by default (no 5xx, status codes, content types and bodies
    as documented, bad input rejected, auth enforced); afterwards the checker is clean."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    d = admin_daemon({"admin": {"token": ADMIN_TOKEN}})
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    schema = schemathesis.openapi.from_url(d.admin_url + "/v1/openapi.json", headers=auth)
    statuses: dict[str, list[int]] = {}
    with Client(d.socket) as c:  # a cached tree, a locked path, held pages: things to evict
        for i in range(6):
            cache(c, toks(2, base=1 + i * 1000) + toks(2, base=50_000 + i))
        receipt = c.match("m", toks(2, base=1) + toks(2, base=50_000), lock=True).receipt
        c.alloc("m", 2)
        operations = [res.ok() for res in schema.get_all_operations()]
        # the document's own route is left out by schemathesis; the test above covers it
        assert {op.label for op in operations} == {f"{m} {p}" for m, p in PROTECTED + PUBLIC
                                                   if p != "/v1/openapi.json"}

        def runner(op: Any, mode: Any, seen: list[int]) -> Any:
            @settings(max_examples=40, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck),
                      phases=[Phase.explicit, Phase.generate])
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                response = case.call_and_validate(base_url=d.admin_url, headers=auth,
                                                  timeout=30)
                seen.append(response.status_code)

            return run

        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                run = runner(op, mode, statuses.setdefault(f"{op.label} {mode.value}", []))
                try:
                    run()
                except Unsatisfiable:
                    # nothing to make invalid: no parameters, no body, no auth (/healthz, /)
                    assert mode == GenerationMode.NEGATIVE and op.path in ("/healthz", "/")
        c.unlock("m", receipt)
    flat = [s for v in statuses.values() for s in v]
    assert flat and all(s < 500 for s in flat)
    assert 400 in statuses["POST /v1/evict negative"]
    assert 200 in statuses["POST /v1/evict positive"]
    assert 400 in statuses["GET /v1/tree negative"]
    check = d.post("/v1/check").json()
    assert check["ok"] is True and check["violations"] == []
    assert d.proc.poll() is None


def test_evict_drops_host_copies_on_request(admin_daemon) -> None:
    d = admin_daemon({"admin": {"token": ADMIN_TOKEN}})
    seq = toks(4)
    with Client(d.socket) as c:
        cache_on_host(c, seq)
        freed = d.post("/v1/evict", json_body={"full_pages": 100, "swa_pages": 100}).json()
        assert freed == {"full_pages": 4, "swa_pages": 4, "host_pages": 0}
        assert c.match("m", seq).host_hit_len == 4 * P  # demoted, still on host
        freed = d.post("/v1/evict", json_body={"host_pages": 100}).json()
        assert freed == {"full_pages": 0, "swa_pages": 0, "host_pages": 4}
        assert c.match("m", seq).host_hit_len == 0
        bad = d.post("/v1/evict", json_body={"host_pages": -1})
        assert bad.status == 400 and bad.json()["error"]["parameter"] == "host_pages"
        tenants = {t["name"]: t for t in d.get_json("/v1/tenants")}
        assert tenants["default"]["quota_host_pages"] == 0
