"""The `radixd` command line: dispatch, exit codes, configuration errors, --version."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import daemon
from daemon import cli

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"radixd {daemon.__version__}"


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == cli.EXIT_USAGE
    assert "serve" in capsys.readouterr().err


def test_config_without_an_action_prints_its_own_help(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    assert cli.main(["config"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "show" in err and "check" in err and "example" in err and "serve" not in err


def test_config_show_redacts_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[tenants]]\nname = "a"\ntoken = "s3cret"\n')
    assert cli.main(["config", "show", "--config", str(cfg), "--socket", "/tmp/x.sock"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert data["server"]["socket"] == "/tmp/x.sock"
    assert data["tenants"][0]["token"] == "<redacted>"
    assert "s3cret" not in out


def test_config_show_redacts_the_redis_password(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[l3]\nurl = "rediss://engine:hunter2@cache.internal:6380/1"\n')
    assert cli.main(["config", "show", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["l3"]["url"] == "rediss://engine:<redacted>@cache.internal:6380/1"
    assert "hunter2" not in out


def test_bad_l3_settings_name_the_key(tmp_path: Path, capsys) -> None:
    for toml, key in (('[l3]\nurl = "http://x"\n', "l3.url"),
                      ('[l3]\nkey_prefix = "a{b}"\n', "l3.key_prefix"),
                      ('[l3]\nwrite_policy = "sometimes"\n', "l3.write_policy"),
                      ('[[models]]\nname = "m"\nhost_pages = 1\n', "host_pages"),
                      ('[[models]]\nname = "m"\nwrite_policy = "lazy"\n', "write_policy")):
        cfg = tmp_path / "c.toml"
        cfg.write_text(toml)
        assert cli.main(["config", "show", "--config", str(cfg)]) == cli.EXIT_USAGE
        assert key in capsys.readouterr().err, toml


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[server]\nmax_frame_bytes = 3\n", "server.max_frame_bytes"),
        ("[server]\nsocket_mode = \"999\"\n", "server.socket_mode"),
        ("[server]\nbogus = 1\n", "server.bogus"),
        ("[[models]]\nname = \"m\"\npage_size = 0\n", "page_size"),
        ("[[models]]\nname = \"m\"\neviction_policy = \"fifo\"\n", "eviction_policy"),
        ("[[tenants]]\nname = \"t\"\n", "token"),
        ("[checker]\ninterval_s = -1\n", "checker.interval_s"),
        ("[[tenants]]\nname = \"a\"\ntoken = \"x\"\n[[tenants]]\nname = \"b\"\ntoken = \"x\"\n",
         "same token"),
        ("[admin]\nhost = \"0.0.0.0\"\n", "admin.host"),
        ("[server]\nhello_timeout_s = 0\n", "server.hello_timeout_s"),
        ("[server]\nmax_locks_per_session = 0\n", "server.max_locks_per_session"),
        ("[[models]]\nname = \"m\"\nnum_swa_layers = 1\nsliding_window = 0\n", "num_swa_layers"),
        # accepted before 2026-11-29, each a surprise later: a checker that never ran, a model
        # a tenant's models could not name apart from "all", a namespace silently the tenant's
        # name, a uid no peer has
        ("[checker]\ninterval_s = inf\n", "checker.interval_s"),
        ("[server]\nhello_timeout_s = inf\n", "server.hello_timeout_s"),
        ("[[models]]\nname = \"*\"\n", "means every model"),
        ("[[models]]\nname = \"\"\n", ".name"),
        ("[[tenants]]\nname = \"t\"\ntoken = \"x\"\nnamespace = \"\"\n", "namespace"),
        ("[server]\nallowed_uids = [-5]\n", "server.allowed_uids"),
        ("[server]\nallowed_gids = [4294967295]\n", "server.allowed_gids"),
    ],
)
def test_bad_config_is_rejected_naming_the_key(tmp_path: Path, capsys, toml: str, key: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)  # (config check loads it as serve does; accepted, it returns)
    assert cli.main(["config", "check", "--config", str(cfg)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "invalid configuration" in err and key in err


def test_an_empty_socket_flag_is_refused_not_the_default(tmp_path: Path, capsys) -> None:
    """``--socket ''`` (an unset shell variable) served on the default socket, silently."""
    for cmd in (["config", "check"], ["config", "show"]):  # (serve loads it the same way)
        assert cli.main([*cmd, "--socket", ""]) == cli.EXIT_USAGE
        assert "server.socket" in capsys.readouterr().err


def test_missing_and_malformed_config_files(tmp_path: Path, capsys) -> None:
    assert cli.main(["serve", "--config", str(tmp_path / "nope.toml")]) == cli.EXIT_USAGE
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml")
    assert cli.main(["serve", "--config", str(bad)]) == cli.EXIT_USAGE
    assert "not valid TOML" in capsys.readouterr().err


def test_environment_overrides_and_unknown_variables(tmp_path: Path) -> None:
    from daemon.config import ConfigError, load_config

    cfg = load_config(None, env={"RADIXD_SERVER_SOCKET": "/tmp/e.sock",
                                 "RADIXD_CHECKER_STRICT": "true",
                                 "RADIXD_SERVER_MAX_INFLIGHT": "7"})
    assert cfg.server.socket == "/tmp/e.sock"
    assert cfg.checker.strict is True and cfg.server.max_inflight == 7
    with pytest.raises(ConfigError, match="RADIXD_SERVR_SOCKET"):
        load_config(None, env={"RADIXD_SERVR_SOCKET": "/x"})
    with pytest.raises(ConfigError, match="server.max_inflight"):
        load_config(None, env={"RADIXD_SERVER_MAX_INFLIGHT": "0"})


def test_console_script_help_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "serve", "--help"],
                         capture_output=True, text=True, cwd=REPO_ROOT, check=True).stdout
    assert "--config" in out and "RADIXD_" in out


# ------------------------------------------------------------------ status, check, example
# Against a real daemon with its admin endpoint (tests/ops/conftest.py's AdminDaemon).

def _ops_conftest():
    import importlib.util

    name = "radixd_tests_ops_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tests/ops/conftest.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture
def live(tmp_path: Path):
    """``live(config)``: a running daemon (admin on a free port, token generated beside the
    socket), checked clean and stopped at teardown."""
    ops = _ops_conftest()
    daemons = []

    def start(config: dict | None = None):
        d = tmp_path / f"d{len(daemons)}"
        d.mkdir()
        daemons.append(ops.AdminDaemon(d, config or {}))
        return daemons[-1]

    yield start
    for d in daemons:
        if d.proc.poll() is None:
            d.check()
        assert d.stop() == 0, d.log()[-4000:]
        assert "internal error" not in d.log() and "Traceback" not in d.log()


def _cache(sock: str, n_pages: int, base: int = 1) -> None:
    from array import array

    from radixd_client import Client

    with Client(sock) as c:
        tokens = array("i", range(base, base + n_pages * 4)).tobytes()
        a = c.alloc("m", n_pages)
        c.insert("m", tokens, a.full_pages, a.swa_pages)
        assert c.match("m", tokens).prefix_len == n_pages * 4


def test_status_does_not_load_torch_where_no_gpu_driver_is(tmp_path: Path) -> None:
    """Validating a configuration whose device is "auto" imported torch to ask for a GPU: two
    seconds before every ``radixd status`` answered. Without a GPU driver's device node the
    answer is known without it (the node list is pointed at nothing, for GPU hosts too)."""
    code = ("import sys\n"
            "import daemon.gpu.profile as s\n"
            f"s.GPU_DEVICE_NODES = ({str(tmp_path / 'nvidiactl')!r},)\n"
            "from daemon import cli\n"
            f"code = cli.main(['status', '--socket', {str(tmp_path / 'none.sock')!r}])\n"
            "print(code, 'torch' in sys.modules)\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO_ROOT, timeout=60)
    assert got.stdout.split() == [str(cli.EXIT_FAILURE), "False"], got.stdout + got.stderr
    assert "no daemon at" in got.stderr


def test_status_against_a_live_daemon(live, capsys) -> None:
    d = live()
    _cache(d.socket, 3)
    # the token comes from the file the daemon wrote beside the socket named in the config
    assert cli.main(["check", "--config", str(d.config_path), "--admin", d.admin_url]) == 0
    capsys.readouterr()
    assert cli.main(["status", "--config", str(d.config_path), "--admin", d.admin_url]) == 0
    out = capsys.readouterr().out
    assert f"radixd {daemon.__version__}" in out and "ready" in out and "NOT READY" not in out
    assert "model m: page 4 tokens, window 8 tokens, policy lru-depth" in out
    assert re.search(r"full\s+3/63\s+4\.8%", out), out
    assert re.search(r"swa\s+3/31\s+9\.7%", out), out
    assert "hits: 12 of 12 tokens (100.0%, device and host) in 1 requests" in out
    assert "tenants:" in out and re.search(r"default\s+default\s+0\s+100\.0%\s+12/12", out)
    assert "last check: ok" in out

    assert cli.main(["status", "--config", str(d.config_path), "--admin", d.admin_url,
                     "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["models"]["m"]["pools"]["full"]["tree"] == 3

    token = d.token_file.read_text().strip()
    assert cli.main(["status", "--admin", d.admin_url, f"--token={token}"]) == 0
    assert cli.main(["status", "--admin", d.admin_url, "--token-file", str(d.token_file),
                     "--config", str(d.config_path)]) == 0
    capsys.readouterr()


def test_status_and_check_find_the_endpoint_in_the_config(live, tmp_path: Path, capsys) -> None:
    sock = tmp_path / "admin-http.sock"
    d = live({"admin": {"unix_socket": str(sock), "token": "cli-admin-token"}})
    assert d.admin_url == f"unix:{sock}"
    assert cli.main(["status", "--config", str(d.config_path)]) == 0
    assert "model m" in capsys.readouterr().out
    assert cli.main(["check", "--config", str(d.config_path)]) == 0
    assert capsys.readouterr().out.startswith("ok: no invariant violations")


def _b_configured_with_ds_endpoint(live, tmp_path: Path, d_token: str,
                                   b_token: str) -> tuple:
    """Daemons d (admin on a Unix socket) and b (whose endpoint file is gone, as when its admin
    endpoint did not come up), and a configuration of b's socket that names d's endpoint."""
    sock = tmp_path / "admin-http.sock"
    d = live({"admin": {"unix_socket": str(sock), "token": d_token}})
    b = live({"admin": {"token": b_token}})
    Path(b.socket + ".admin").unlink()
    other = tmp_path / "other.toml"
    other.write_text(f'[server]\nsocket = "{b.socket}"\n'
                     f'[admin]\nunix_socket = "{sock}"\ntoken = "{b_token}"\n')
    return d, b, other


def test_status_refuses_an_endpoint_that_answers_for_another_daemon(live, tmp_path: Path,
                                                                    capsys) -> None:
    """A config whose admin address another daemon holds (its own daemon runs without an
    endpoint, or not at all) printed that other daemon's status and ran its check, as a
    review found: the endpoint must answer for the configuration's socket."""
    d, b, other = _b_configured_with_ds_endpoint(live, tmp_path, "shared-token", "shared-token")
    for cmd in ("status", "check"):
        assert cli.main([cmd, "--config", str(other)]) == cli.EXIT_FAILURE
        err = capsys.readouterr().err
        assert f"answers for the daemon on {d.socket}, not {b.socket}" in err
    assert cli.main(["status", "--config", str(d.config_path)]) == 0  # its own: fine
    capsys.readouterr()


def test_status_does_not_blame_the_token_when_the_endpoint_may_be_another_daemons(
        live, tmp_path: Path, capsys) -> None:
    """A daemon that wrote no endpoint file (its admin endpoint off, or not up) and whose
    configuration names an address another daemon holds: status asked that other daemon with
    this one's token and said the token was wrong, sending the operator after the wrong thing.
    A configuration that turns the endpoint off says so before asking anyone."""
    d, b, other = _b_configured_with_ds_endpoint(live, tmp_path, "d-token", "b-token")
    for cmd in ("status", "check"):
        assert cli.main([cmd, "--config", str(other)]) == cli.EXIT_FAILURE
        err = capsys.readouterr().err
        assert f"the daemon on {b.socket} wrote no endpoint file" in err, err
        assert "may be another daemon's" in err and "is not this daemon's" not in err, err
    # named with --admin, the endpoint is the operator's word: a refusal is the token's
    assert cli.main(["status", "--socket", d.socket, "--admin", d.admin_url,
                     "--token", "wrong"]) == cli.EXIT_FAILURE
    err = capsys.readouterr().err
    assert "refused the token" in err and "no endpoint file" not in err, err
    assert cli.main(["status", "--socket", "", "--admin", d.admin_url,
                     "--token", "d-token"]) == cli.EXIT_USAGE
    assert "server.socket" in capsys.readouterr().err
    off = tmp_path / "off.toml"
    off.write_text(f'[server]\nsocket = "{b.socket}"\n[admin]\nenabled = false\n')
    assert cli.main(["status", "--config", str(off)]) == cli.EXIT_FAILURE
    assert "admin.enabled = false" in capsys.readouterr().err
    assert cli.main(["status", "--config", str(d.config_path)]) == 0  # its own: fine
    capsys.readouterr()


def test_status_finds_the_service_socket_when_the_config_names_none(live, tmp_path: Path,
                                                                    monkeypatch, capsys) -> None:
    """Under the shipped unit a daemon whose configuration names no socket serves on its
    runtime directory's (it reads $RUNTIME_DIRECTORY); an operator's shell has another default
    (here: a RUNTIME_DIRECTORY where nothing runs), so status tries the service's socket."""
    import daemon.config as config_module

    d = live()
    monkeypatch.setattr(config_module, "SERVICE_SOCKET", d.socket)
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "nothing-here"))
    cfg = tmp_path / "nosocket.toml"
    cfg.write_text("[checker]\ninterval_s = 5\n")
    assert cli.main(["status", "--config", str(cfg)]) == 0
    assert f"instance {d.get_json('/v1/stats')['instance']}" in capsys.readouterr().out
    cfg.write_text(f'[server]\nsocket = "{tmp_path}/named.sock"\n')  # named: no fallback
    assert cli.main(["status", "--config", str(cfg)]) == cli.EXIT_FAILURE
    assert f"no daemon at {tmp_path}/named.sock" in capsys.readouterr().err


def test_check_against_a_live_daemon(live, capsys) -> None:
    d = live()
    _cache(d.socket, 2)
    assert cli.main(["check", "--config", str(d.config_path), "--admin", d.admin_url]) == 0
    assert "ok: no invariant violations (full check in" in capsys.readouterr().out
    assert cli.main(["check", "--config", str(d.config_path), "--admin", d.admin_url,
                     "--token", "wrong"]) == cli.EXIT_FAILURE
    assert "refused the token" in capsys.readouterr().err


def test_check_exits_4_on_violations(capsys) -> None:
    """A stand-in endpoint that reports violations (a real daemon has none to report)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            ok = self.headers.get("Authorization") == "Bearer t" and self.path == "/v1/check"
            body = json.dumps({"ok": False, "violations": ["m: full pool: pages [3] are free "
                                                           "and in the tree", "second"],
                               "seconds": 0.5} if ok else {"error": {"message": "no"}}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        assert cli.main(["check", "--admin", url, "--token", "t"]) == cli.EXIT_VIOLATIONS == 4
        out = capsys.readouterr().out
        assert out.startswith("2 invariant violation(s)")
        assert "  - m: full pool: pages [3] are free and in the tree" in out and "  - second" in out
    finally:
        srv.shutdown()
        srv.server_close()


def test_unreachable_daemon_is_a_clear_error(tmp_path: Path, capsys) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    for cmd in ("status", "check"):
        assert cli.main([cmd, "--admin", f"http://127.0.0.1:{port}", "--token", "x",
                         "--timeout", "2"]) == cli.EXIT_FAILURE
        err = capsys.readouterr().err
        assert f"cannot reach the radixd admin endpoint at http://127.0.0.1:{port}" in err
        assert "is the daemon running" in err
    assert cli.main(["status", "--admin", f"unix:{tmp_path / 'nope.sock'}", "--token", "x"]) == 1
    assert "cannot reach the radixd admin endpoint at unix:" in capsys.readouterr().err
    assert cli.main(["status", "--admin", "ftp://x", "--token", "x"]) == 1
    assert "give http://HOST:PORT or unix:/PATH" in capsys.readouterr().err


def test_missing_token_file_and_unknown_port(live, tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[server]\nsocket = "{tmp_path}/radixd.sock"\n')
    assert cli.main(["status", "--config", str(cfg)]) == cli.EXIT_FAILURE
    assert f"no daemon at {tmp_path}/radixd.sock" in capsys.readouterr().err  # not the token
    d = live({"admin": {"token": "t"}})  # a daemon whose token is configured, not written
    cfg.write_text(f'[server]\nsocket = "{d.socket}"\n')
    Path(d.socket + ".admin").unlink()  # as when its admin endpoint did not come up
    assert cli.main(["status", "--config", str(cfg)]) == cli.EXIT_FAILURE
    err = capsys.readouterr().err
    assert f"cannot read the admin token from {Path(d.socket).parent}/admin.token" in err
    assert f"The daemon on {d.socket} wrote no endpoint file" in err
    cfg.write_text(f'[server]\nsocket = "{d.socket}"\n[admin]\nport = 0\n')
    assert cli.main(["check", "--config", str(cfg), "--token", "x"]) == cli.EXIT_FAILURE
    assert "pass --admin URL" in capsys.readouterr().err
    cfg.write_text("[admin]\nport = -1\n")
    assert cli.main(["status", "--config", str(cfg)]) == cli.EXIT_USAGE


def test_help_documents_the_exit_codes() -> None:
    for cmd in ("status", "check"):
        out = subprocess.run([sys.executable, "-m", "daemon.cli", cmd, "--help"],
                             capture_output=True, text=True, cwd=REPO_ROOT, check=True).stdout
        assert "exit codes:" in out and "--admin" in out and "--token-file" in out
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "check", "--help"],
                         capture_output=True, text=True, cwd=REPO_ROOT, check=True).stdout
    assert "4 violations found" in " ".join(out.split())


def test_config_example(capsys, monkeypatch, tmp_path: Path) -> None:
    example = REPO_ROOT / "daemon" / "data" / "radixd.example.toml"
    if example.exists():
        assert cli.main(["config", "example"]) == 0
        out = capsys.readouterr().out
        assert out.rstrip("\n") == example.read_text().rstrip("\n")
    import importlib.resources

    monkeypatch.setattr(importlib.resources, "files", lambda _pkg: tmp_path)
    assert cli.main(["config", "example"]) == cli.EXIT_FAILURE
    assert "radixd.example.toml) is not installed" in capsys.readouterr().err


def test_config_show_redacts_the_admin_token(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[admin]\ntoken = "adm1n-s3cret"\n[[tenants]]\nname = "a"\n'
                   'token_sha256 = "' + "ab" * 32 + '"\n')
    assert cli.main(["config", "show", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "adm1n-s3cret" not in out and "ab" * 32 not in out
    data = json.loads(out)
    assert data["admin"]["token"] == "<redacted>"
    assert data["tenants"][0]["token_sha256"] == "<redacted>"


# ------------------------------------------------------------------ the daemon --socket names

def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_status_shows_the_tiers_and_the_breaker(live, capsys) -> None:
    from radixd_client import Client

    redis_down = f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens: every call fails
    d = live({"l3": {"url": redis_down, "op_timeout_ms": 200, "breaker_threshold": 1,
                     "breaker_open_s": 600}})
    _cache(d.socket, 3)
    with Client(d.socket) as c:
        from array import array

        for i in range(2):
            tokens = array("i", range(500 + 100 * i, 500 + 100 * i + 8)).tobytes()
            assert c.prefetch("m", tokens, policy="wait_complete").status == "none"
    args = ["status", "--config", str(d.config_path), "--admin", d.admin_url]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "hits by tier: device 12, host 0 tokens (loaded back); L3 0 pages" in out, out
    assert re.search(r"host tier: full \d+/4095 slots", out), out
    assert "L3 (Redis): breaker OPEN;" in out and "breaker opened 1 times" in out, out
    assert cli.main([*args, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["models"]["m"]["tiers"]["host_pages_capacity"] == 4095
    assert stats["models"]["m"]["tiers"]["loaded_tokens"] == 0
    assert stats["l3"]["breaker_state"] == "open" and stats["models"]["m"]["hit_tokens"] == 12

    bare = live({"models": [{**_ops_conftest().SMALL_MODEL, "host_pages": 0}]})
    assert cli.main(["status", "--config", str(bare.config_path), "--admin",
                     bare.admin_url]) == 0
    out = capsys.readouterr().out
    assert "host tier: off" in out and "L3 (Redis): off" in out, out


def test_status_with_socket_talks_to_the_daemon_on_it(live, tmp_path: Path, capsys) -> None:
    a, b = live(), live()  # each on its own free admin port: not in any configuration
    for d in (a, b):
        instance = d.get_json("/v1/stats")["instance"]
        assert cli.main(["status", "--socket", d.socket]) == 0
        assert f"instance {instance}" in capsys.readouterr().out
        assert cli.main(["check", "--socket", d.socket]) == 0
        capsys.readouterr()
    typo = tmp_path / "radixd.sokc"
    for cmd in ("status", "check"):
        assert cli.main([cmd, "--socket", str(typo)]) == cli.EXIT_FAILURE
        assert f"no daemon at {typo}" in capsys.readouterr().err
    # an endpoint that answers for another daemon than the socket named is refused
    assert cli.main(["status", "--socket", a.socket, "--admin", b.admin_url,
                     "--token", b.token]) == cli.EXIT_FAILURE
    err = capsys.readouterr().err
    assert f"answers for the daemon on {b.socket}, not {a.socket}" in err, err


def test_daemons_whose_sockets_share_a_directory_keep_their_own_tokens(live, tmp_path: Path,
                                                                       capsys) -> None:
    """The second daemon wrote its token over the first one's admin.token, which no command
    could then read back (a review found it): it writes its own beside its socket instead."""
    shared = tmp_path / "run"
    shared.mkdir()
    a = live({"server": {"socket": str(shared / "a.sock")}})
    b = live({"server": {"socket": str(shared / "b.sock")}})
    assert a.token_file == shared / "admin.token"
    assert b.token_file == Path(b.socket + ".token")
    assert a.token != b.token
    for d in (a, b):
        assert cli.main(["status", "--socket", d.socket]) == 0
        assert f"instance {d.get_json('/v1/stats')['instance']}" in capsys.readouterr().out
    elsewhere = tmp_path / "elsewhere"  # an explicit token_file that a running daemon owns,
    elsewhere.mkdir()  # named from another directory: refused, never overwritten
    configured = {"server": {"socket": str(elsewhere / "c.sock")},
                  "admin": {"token_file": str(shared / "admin.token")}}
    with pytest.raises(RuntimeError, match="is the token of another running daemon"):
        live(configured)
    assert cli.main(["status", "--socket", a.socket]) == 0  # a's token still works
    capsys.readouterr()


def test_clean_stop_removes_the_token_file(live) -> None:
    d = live()
    endpoint = Path(d.socket + ".admin")
    assert d.token_file.exists() and endpoint.exists()
    assert json.loads(endpoint.read_text())["token_file"] == str(d.token_file)
    assert d.stop() == 0
    assert not d.token_file.exists() and not endpoint.exists()


def test_stale_token_is_told_apart_from_a_bad_one(live, capsys) -> None:
    import os
    import time

    d = live({"admin": {"token": "configured-admin-token"}})
    stale = Path(d.socket).parent / "admin.token"  # left by an earlier daemon
    stale.write_text("f" * 64 + "\n")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert cli.main(["status", "--socket", d.socket]) == cli.EXIT_FAILURE
    err = capsys.readouterr().err
    assert "refused the token" in err and f"the token in {stale} is stale" in err, err
    assert "configured token" in err, err

    g = live()  # a generated token, overwritten after the daemon started: bad, not stale
    g.token_file.write_text("0" * 64 + "\n")
    assert cli.main(["status", "--socket", g.socket]) == cli.EXIT_FAILURE
    err = capsys.readouterr().err
    assert "refused the token" in err and "is not this daemon's" in err, err
    assert "is stale" not in err, err
    assert g.stop() == 0
    assert g.token_file.read_text() == "0" * 64 + "\n", "not what the daemon wrote: it stays"


# ------------------------------------------------------------------ rough edges a first user hit

def test_a_closed_stdout_ends_the_command_quietly(live, tmp_path: Path) -> None:
    """``radixd status | head -1``: a reader that leaves early printed a BrokenPipeError
    traceback and exited 1, as if radixd had failed."""
    d = live()
    for args in (["config", "example"], ["config", "example", "--cpu"],
                 ["config", "show", "--config", str(d.config_path)],
                 ["status", "--config", str(d.config_path)]):
        proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", *args], cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # before radixd writes: its first write finds no reader
        err = proc.stderr.read()
        assert proc.wait(60) == cli.EXIT_BROKEN_PIPE == 141, (args, err)
        assert err == "", (args, err)


# a real SIGINT, sent the moment the command first imports torch (as a Ctrl-C ~1.5 s into
# `radixd serve`, while torch loads), then the command line as the console script runs it
_INTERRUPT_AT_TORCH = """
import os, signal, sys

class InterruptAtTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptAtTorch())
from daemon.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_during_serve_start_up_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[server]\nsocket = "{tmp_path}/radixd.sock"\n[admin]\nport = 0\n')
    run = subprocess.run([sys.executable, "-c", _INTERRUPT_AT_TORCH, "serve", "--config",
                          str(cfg)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == cli.EXIT_INTERRUPTED == 130, run.stderr
    assert run.stderr == "radixd: interrupted\n" and run.stdout == ""
    assert not (tmp_path / "radixd.sock").exists()


def _serve_config(tmp_path: Path, config: dict) -> Path:
    from tests.harness import daemon_conftest

    dc = daemon_conftest()
    path = tmp_path / "serve.toml"
    dc.write_config(path, {"server": {"socket": str(tmp_path / "serve.sock")},
                           "models": [dc.SMALL_MODEL], **config})
    return path


def test_a_configured_admin_port_in_use_exits_2_naming_the_fix(tmp_path: Path) -> None:
    """Exit 2 (a configuration to change; the systemd unit does not restart it), and the
    message names the key and the fix, as the default port's log line does."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        port = busy.getsockname()[1]
        cfg = _serve_config(tmp_path, {"admin": {"port": port}})
        run = subprocess.run([sys.executable, "-m", "daemon.cli", "serve", "--config", str(cfg)],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    finally:
        busy.close()
    assert run.returncode == cli.EXIT_USAGE, run.stderr
    assert (f"radixd: admin.port: admin endpoint 127.0.0.1:{port}: Address already in use; "
            "set admin.port (0 picks a free port) or admin.unix_socket\n") in run.stderr
    assert "Traceback" not in run.stderr


def test_the_default_admin_port_taken_logs_no_token_file(tmp_path: Path) -> None:
    """The daemon logged that it wrote admin.token, then removed it when the port was taken:
    ``radixd status`` could not read the file the log named."""
    from tests.harness import daemon_conftest

    holder = socket.socket()
    with contextlib.suppress(OSError):  # the default port (already taken is as good)
        holder.bind(("127.0.0.1", 8471))
        holder.listen(1)
    try:
        d = daemon_conftest().Daemon(tmp_path, {"admin": {"host": "127.0.0.1"}})
        try:
            deadline = time.monotonic() + 30
            while "admin endpoint not started" not in d.log():
                assert time.monotonic() < deadline and d.proc.poll() is None, d.log()
                time.sleep(0.05)
            assert "cannot bind 127.0.0.1:8471" in d.log()
            assert "admin token generated" not in d.log()
            assert not (Path(d.socket).parent / "admin.token").exists()
            d.check()
        finally:
            assert d.stop() == 0, d.log()
    finally:
        holder.close()


def test_config_check_passes_while_the_daemon_runs(live, tmp_path: Path, capsys) -> None:
    """An operator checks an edited file before `systemctl restart`, the daemon serving on the
    socket and holding the state_dir: ok (exit 0, for `config show | jq` under pipefail too),
    and nothing touched: the lock file as it was, a state_dir not made yet still not made (as
    another user, the check would leave it theirs). Serve is what refuses a second daemon,
    before it allocates anything: exit 1 for the socket (here), 2 for the state_dir
    (test_warm_restart)."""
    state = tmp_path / "state"
    d = live({"server": {"state_dir": str(state)}})
    lock = state / "radixd.lock"
    before = lock.stat()
    capsys.readouterr()
    for command in ("check", "show"):
        assert cli.main(["config", command, "--config", str(d.config_path)]) == cli.EXIT_OK
    assert capsys.readouterr().err == ""
    assert lock.stat().st_mtime_ns == before.st_mtime_ns and d.proc.poll() is None
    edited = d.config_path.read_text().replace(str(state), str(tmp_path / "new" / "state"))
    d.config_path.write_text(edited)
    assert cli.main(["config", "check", "--config", str(d.config_path)]) == cli.EXIT_OK
    assert not (tmp_path / "new").exists()
    second = subprocess.run([sys.executable, "-m", "daemon.cli", "serve", "--config",
                             str(d.config_path)], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == cli.EXIT_FAILURE, second.stderr
    assert second.stderr == f"radixd: cannot serve: another radixd is serving on {d.socket}\n"
    assert "allocating" not in second.stderr and d.proc.poll() is None


def test_l3_without_a_host_tier_is_warned_of(live, tmp_path: Path, capsys) -> None:
    """``[l3] url`` with host_pages = 0 everywhere turned L3 off without a word."""
    l3 = {"url": "redis://127.0.0.1:6379/0"}
    bare = {**_ops_conftest().SMALL_MODEL, "host_pages": 0}
    cfg = _serve_config(tmp_path, {"l3": l3, "models": [bare]})
    assert cli.main(["config", "check", "--config", str(cfg)]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    assert out.startswith("ok: configuration valid")
    assert err.startswith("radixd: warning: l3.url is set but L3 is off: no model has a host "
                          "tier (host_pages = 0 everywhere), and L3 sits below the host tier")
    assert "give a model host_pages > 0" in err
    cfg = _serve_config(tmp_path, {"l3": l3})  # a host tier (the default): L3 used, no warning
    assert cli.main(["config", "check", "--config", str(cfg)]) == cli.EXIT_OK
    assert capsys.readouterr().err == ""
    d = live({"l3": l3, "models": [bare]})
    assert "WARNING radixd.app: l3.url is set but L3 is off: no model has a host tier" in d.log()


@pytest.mark.parametrize("timeout", ["-1", "nan", "inf", "0", "soon"])
def test_a_timeout_that_is_no_positive_number_of_seconds_is_a_usage_error(timeout: str,
                                                                          capsys) -> None:
    """status and check took any float: -1, nan and inf ended in a traceback, 0 in "Operation
    now in progress"."""
    for cmd in ("status", "check"):
        with pytest.raises(SystemExit) as exc:
            cli.main([cmd, "--admin", "http://127.0.0.1:1", "--token", "x",
                      f"--timeout={timeout}"])
        assert exc.value.code == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert "argument --timeout" in err and "Traceback" not in err


def test_a_config_everyone_may_read_with_secrets_in_clear_is_warned_of(monkeypatch,
                                                                       capsys) -> None:
    """Any user of the host could read a tenant's token from a configuration file of mode 0644
    in directories everyone may enter, and open sessions as that tenant: ``config check`` and
    ``serve`` warn (the start goes on). Not when the file is out of their reach, nor for
    secrets the file does not hold (digests, a token from the environment)."""
    top = Path(tempfile.mkdtemp(prefix="radixd-readable-", dir="/tmp"))  # (tmp_path is 0700)
    try:
        top.chmod(0o711)
        cfg = top / "c.toml"
        cfg.write_text('[admin]\ntoken = "a-token"\n[[tenants]]\nname = "t"\ntoken = "t-token"\n'
                       '[[tenants]]\nname = "u"\ntoken_sha256 = "' + "ab" * 32 + '"\n'
                       '[l3]\nurl = "redis://:secret@127.0.0.1:6379/0"\n')
        cfg.chmod(0o644)
        warning = (f"{cfg} can be read by every user and holds secrets in clear (admin.token, "
                   'tenants["t"].token, the password in l3.url)')
        assert cli.main(["config", "check", "--config", str(cfg)]) == cli.EXIT_OK
        assert warning in capsys.readouterr().err
        not_a_socket = top / "not-a-socket"
        not_a_socket.write_text("")
        served = subprocess.run(  # refused at its socket, after the warning
            [sys.executable, "-m", "daemon.cli", "serve", "--config", str(cfg), "--socket",
             str(not_a_socket)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
        assert served.returncode == cli.EXIT_USAGE and warning in served.stderr, served.stderr
        cfg.write_text('[l3]\nurl = "redis://127.0.0.1:6379/0?password=secret"\n')
        assert cli.main(["config", "check", "--config", str(cfg)]) == cli.EXIT_OK
        assert "clear (the password in l3.url)" in capsys.readouterr().err
        cfg.write_text('[admin]\ntoken = "a-token"\n[l3]\nurl = 5\n')  # (not a URL: refused)
        assert cli.main(["config", "check", "--config", str(cfg)]) == cli.EXIT_USAGE
        assert "l3.url" in capsys.readouterr().err
        monkeypatch.setenv("RADIXD_L3_URL", "redis://127.0.0.1:6379/0")  # the file's replaced
        assert cli.main(["config", "check", "--config", str(cfg)]) == cli.EXIT_OK
        assert "clear (admin.token)" in capsys.readouterr().err  # (it crashed on the 5)
        monkeypatch.delenv("RADIXD_L3_URL")
        cfg.write_text('[admin]\ntoken = "a-token"\n')
        top.chmod(0o700)  # a directory on its way others cannot enter
        assert cli.main(["config", "check", "--config", str(cfg)]) == cli.EXIT_OK
        assert "can be read by every user" not in capsys.readouterr().err
        top.chmod(0o711)
        cfg.chmod(0o640)
        assert cli.main(["config", "check", "--config", str(cfg)]) == cli.EXIT_OK
        assert "can be read by every user" not in capsys.readouterr().err
        cfg.write_text('[[tenants]]\nname = "u"\ntoken_sha256 = "' + "ab" * 32 + '"\n')
        cfg.chmod(0o644)  # digests only, and a token given by the environment: not in the file
        monkeypatch.setenv("RADIXD_ADMIN_TOKEN", "from-the-environment")
        assert cli.main(["config", "check", "--config", str(cfg)]) == cli.EXIT_OK
        assert "can be read by every user" not in capsys.readouterr().err
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_an_endpoint_file_this_user_cannot_read_is_no_crash(tmp_path: Path,
                                                           monkeypatch) -> None:
    """A user outside the daemon's group asking about its socket: reading the endpoint file
    beside it failed with PermissionError before anything was read, and the handler of that
    error (meant for a live daemon of another user) used what was never read. (The refusal is
    injected: the tests may run as root, whom nothing refuses, and the interpreter may not be
    readable by a user made up for the test.)"""
    (tmp_path / "radixd.sock.admin").write_text('{"url": "http://127.0.0.1:1", "pid": 1}')

    def refused(self: Path, *args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", refused)
    assert cli._endpoint_info(str(tmp_path / "radixd.sock")) is None
