"""A real radixd with its admin endpoint on, per test (tests/daemon/conftest.py's Daemon, extended).

``admin_daemon(config)`` starts one with ``admin.port = 0`` (a free port; the URL is read from the
daemon's "admin endpoint on URL" log line) unless the config says otherwise. At teardown every
daemon gets a full invariant check that must be clean, then SIGTERM, which must exit 0 with no
violation, internal error or traceback in its log: every test that drives the admin endpoint is
also a test that the cache stayed consistent.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from radixd_client import Client

from tests.harness import daemon_conftest

REPO = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "ops-admin-token-0123456789"




_dc = daemon_conftest()
Daemon = _dc.Daemon
SMALL_MODEL = _dc.SMALL_MODEL

_URL = re.compile(r"admin endpoint on (\S+)")


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status = status
        self.headers = headers  # lower-case names
        self.body = body

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"<{self.status} {self.text[:300]!r}>"


def http_request(url: str, method: str, path: str, *, headers: dict[str, str] | None = None,
         body: bytes | None = None, timeout: float = 30.0) -> Response:
    """One raw HTTP request to an admin URL (``http://host:port`` or ``unix:/path``)."""
    if url.startswith("unix:"):
        conn: http.client.HTTPConnection = http.client.HTTPConnection("localhost",
                                                                      timeout=timeout)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(url[len("unix:"):])
        conn.sock = sock
    else:
        host, _, port = url[len("http://"):].rpartition(":")
        conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


class AdminDaemon(Daemon):
    """A Daemon with the admin endpoint; ``get``/``post`` send the bearer token by default."""

    def __init__(self, tmp: Path, config: dict[str, Any]):
        config = dict(config)
        config["admin"] = {"port": 0, **config.get("admin", {})}
        super().__init__(tmp, config)
        self.admin_url = self._wait_admin()

    def _wait_admin(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _URL.search(self.log())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"radixd exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.02)
        raise RuntimeError(f"no admin endpoint came up:\n{self.log()}")

    @property
    def token_file(self) -> Path:
        """Where the daemon wrote its generated token: the file its endpoint file names (it
        may not be the default when another daemon's socket shares the directory)."""
        if self.config["admin"].get("token_file"):
            return Path(self.config["admin"]["token_file"])
        try:
            return Path(json.loads(Path(self.socket + ".admin").read_text())["token_file"])
        except (OSError, ValueError, KeyError, TypeError):  # stopped: the default
            return Path(self.socket).parent / "admin.token"

    @property
    def token(self) -> str:
        configured = self.config["admin"].get("token")
        return configured if configured else self.token_file.read_text().strip()

    def request(self, method: str, path: str, *, token: str | None | bool = True,
                json_body: Any = None, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> Response:
        h = dict(headers or {})
        if token is True:
            token = self.token
        if token:
            h["Authorization"] = f"Bearer {token}"
        if json_body is not None:
            body = json.dumps(json_body).encode()
            h.setdefault("Content-Type", "application/json")
        return http_request(self.admin_url, method, path, headers=h, body=body)

    def get(self, path: str, **kw: Any) -> Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw: Any) -> Response:
        return self.request("POST", path, **kw)

    def get_json(self, path: str) -> Any:
        r = self.get(path)
        assert r.status == 200, r
        return r.json()


@pytest.fixture
def admin_daemon(tmp_path: Path) -> Iterator:
    """``admin_daemon(config_dict)`` starts a daemon with the admin endpoint; each is checked and
    stopped at teardown."""
    daemons: list[AdminDaemon] = []

    def factory(config: dict[str, Any] | None = None, name: str = "a") -> AdminDaemon:
        d = tmp_path / f"{name}{len(daemons)}"
        d.mkdir()
        daemon = AdminDaemon(d, config or {})
        daemons.append(daemon)
        return daemon

    yield factory
    _dc.check_and_stop(daemons)


# ---------------------------------------------------------------------------- shared by the tests

P = SMALL_MODEL["page_size"]
DEVICE_ONLY = [{**SMALL_MODEL, "host_pages": 0}]  # no demotion to host: exact tree shapes


def toks(n_pages: int, base: int = 1) -> bytes:
    return array("i", range(base, base + n_pages * P)).tobytes()


def cache(c: Client, tokens: bytes, model: str = "m") -> None:
    a = c.alloc(model, len(tokens) // 4 // P)
    c.insert(model, tokens, a.full_pages, a.swa_pages)


# ---------------------------------------------------------------------------- metrics parsing

def cache_on_host(c: Client, tokens: bytes, model: str = "m") -> None:
    """Cache ``tokens`` and wait (10 s at most) until the host tier holds a copy of each page."""
    cache(c, tokens, model)
    pages = len(tokens) // 4 // P
    deadline = time.monotonic() + 10
    while c.stats(model).models[model]["tree_host_pages"] < pages and \
            time.monotonic() < deadline:
        time.sleep(0.02)


def parse_metrics(text: str) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """With prometheus_client's own parser (strict about the format), plus what it does not
    check: no duplicate series. Returns (family -> type, (name, labels) -> value)."""
    from prometheus_client.parser import text_string_to_metric_families

    types: dict[str, str] = {}
    samples: dict[tuple[str, frozenset], float] = {}
    assert text.endswith("\n")
    for fam in text_string_to_metric_families(text):
        # the name as the text format exposes it (the parser drops a counter's _total)
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        assert name not in types, f"second family {name}"
        types[name] = fam.type
        for sample in fam.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in samples, f"duplicate series {sample}"
            samples[key] = sample.value
    return types, samples


def metric(samples: dict, name: str, **labels: Any) -> float:
    key = (name, frozenset((k, str(v)) for k, v in labels.items()))
    assert key in samples, f"no series {name}{labels}"
    return samples[key]


def series(samples: dict, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(lb), v) for (n, lb), v in samples.items() if n == name]


def scrape(daemon: Any, accept: str = "") -> str:
    """The exposition of an in-process daemon, as /metrics renders it."""
    from daemon import exposition

    collector = exposition.Collector(daemon.service, daemon.server, daemon.checker,
                                     daemon.config.admin.tenant_label_limit)
    body, _ = exposition.render(collector, accept)
    return body.decode()
