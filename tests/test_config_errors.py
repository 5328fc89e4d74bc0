"""A new user's configuration mistakes: one line naming the key, exit 2, no traceback.

The start-up errors are checked on a real ``radixd serve`` process (what an operator sees), and
``radixd config check`` must find the same problems without binding anything.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from daemon import cli
from daemon.config import ConfigError, load_config

REPO_ROOT = Path(__file__).resolve().parents[1]

CPU_MODEL = ('[[models]]\nname = "tiny"\npage_size = 4\nsliding_window = 8\n'
             'num_full_layers = 1\nnum_swa_layers = 1\nnum_kv_heads = 1\nhead_dim = 64\n'
             'dtype = "float32"\ndevice = "cpu"\nfull_pages = 16\nswa_pages = 8\n'
             'host_pages = 0\n')


def _radixd(*args: str, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _config(tmp_path: Path, models: str, socket: str | None = None) -> Path:
    path = tmp_path / "radixd.toml"
    sock = socket or str(tmp_path / "radixd.sock")
    path.write_text(f'[server]\nsocket = "{sock}"\n[admin]\nport = 0\n{models}')
    return path


def _one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == cli.EXIT_USAGE, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.mark.cpu_only  # deselected where CUDA is there (tests/conftest.py)
def test_cuda_device_without_cuda_is_a_one_line_error(tmp_path: Path) -> None:
    cfg = _config(tmp_path, CPU_MODEL.replace('"cpu"', '"cuda:0"').replace("tiny", "llama"))
    for args in (("serve",), ("config", "check"), ("config", "show")):
        out = _radixd(*args, "--config", str(cfg))
        line = _one_line_error(out)
        assert 'models["llama"].device' in line and "CUDA is not available" in line, line
    assert not (tmp_path / "radixd.sock").exists(), "config check binds nothing"


def test_pools_bigger_than_memory_are_a_one_line_error(tmp_path: Path) -> None:
    big = CPU_MODEL.replace("full_pages = 16", "full_bytes = 1125899906842624")  # 1 PiB
    cfg = _config(tmp_path, big.replace("tiny", "huge"))
    for args in (("serve",), ("config", "check"), ("config", "show")):
        line = _one_line_error(_radixd(*args, "--config", str(cfg)))
        assert 'models["huge"].full_pages' in line and "host memory" in line, line
        assert "full_bytes" in line, line
    host = CPU_MODEL.replace("host_pages = 0", "host_pages = 1000000000000")
    line = _one_line_error(_radixd("config", "check", "--config", str(_config(tmp_path, host))))
    assert 'models["tiny"].host_pages' in line, line


def test_config_check_ok_summary(tmp_path: Path) -> None:
    cfg = _config(tmp_path, CPU_MODEL)
    out = _radixd("config", "check", "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok: configuration valid; 1 model(s): tiny: ")
    assert len(out.stdout.strip().splitlines()) == 1
    assert not (tmp_path / "radixd.sock").exists(), "config check binds nothing"


def test_full_bytes_and_swa_bytes_size_the_pools() -> None:
    base = {"name": "b", "page_size": 4, "sliding_window": 8, "num_full_layers": 1,
            "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32",
            "device": "cpu", "memory_isolation": "none"}  # 10 pages: no whole OS pages
    page = 2 * 4 * 1 * 4 * 4  # k and v, page_size, heads, head_dim, 4 bytes: one layer's page
    cfg = load_config(None, env={}, overrides={"models": [
        {**base, "full_bytes": 10 * page + 5, "swa_bytes": 4 * page}]})
    assert (cfg.models[0].full_pages, cfg.models[0].swa_pages) == (10, 4)
    assert cfg.models[0].profile().full_pages == 10
    with pytest.raises(ConfigError, match=r'models\["b"\]\.full_bytes: .*not both'):
        load_config(None, env={}, overrides={"models": [
            {**base, "full_bytes": 10 * page, "full_pages": 10}]})
    # a pool sized in bytes too small for a window and a page past it is refused as well
    with pytest.raises(ConfigError, match=r'models\["b"\]\.sliding_window: .*2 usable pages'):
        load_config(None, env={}, overrides={"models": [{**base, "swa_bytes": 3 * page}]})


def test_pools_in_bytes_round_to_pages_segments_can_be_mapped_apart_at() -> None:
    """Page 1, 24 layers of 2 bf16 heads of 64: a strip is 256 bytes, so isolated CPU pools
    come in multiples of 16 pages. full_bytes = 1 GiB (87,381 pages) was refused, blamed on
    segment_pages, a key the operator never set; a page count given outright that misfits is
    refused naming full_pages."""
    qwen = {"name": "q", "page_size": 1, "sliding_window": 0, "num_full_layers": 24,
            "num_kv_heads": 2, "head_dim": 64, "dtype": "bfloat16", "device": "cpu"}
    cfg = load_config(None, env={}, overrides={"models": [{**qwen, "full_bytes": 1 << 30}]})
    assert cfg.models[0].full_pages == cfg.models[0].profile().full_pages == 87376
    shared = load_config(None, env={}, overrides={"models": [
        {**qwen, "full_bytes": 1 << 30, "memory_isolation": "none"}]})
    assert shared.models[0].full_pages == 87381
    with pytest.raises(ConfigError, match=r'models\["q"\]\.full_pages: .*multiple of 16 pages'):
        load_config(None, env={}, overrides={"models": [{**qwen, "full_pages": 100001}]})


def test_a_sections_key_written_above_every_section_names_its_section() -> None:
    for key, value, home in (("socket", "/x.sock", "[server]"), ("page_size", 4, "[[models]]")):
        with pytest.raises(ConfigError, match=rf"{key}: not a configuration key; it is a key "
                                              rf"of \[{re.escape(home[1:])}"):
            load_config(None, env={}, overrides={key: value})


@pytest.mark.parametrize("overrides, where", [
    ({"checker": {"strict": "yes"}}, "checker.strict"),
    ({"server": {"max_sessions": 1.5}}, "server.max_sessions"),
    ({"server": {"max_sessions": 1.0}}, "server.max_sessions"),
    ({"models": [{"page_size": "16"}]}, "page_size"),
])
def test_a_value_of_the_wrong_type_is_refused_not_converted(overrides: dict, where: str) -> None:
    """`strict = "yes"` was read as true and `page_size = "16"` as 16: a config that means
    something else than it says is refused, naming the key (an integer where a number of
    seconds goes stays fine)."""
    with pytest.raises(ConfigError, match=re.escape(where)):
        load_config(None, env={}, overrides=overrides)
    assert load_config(None, env={}, overrides={"checker": {"interval_s": 2}}
                       ).checker.interval_s == 2.0


def test_no_tenant_takes_the_metrics_label_of_the_others() -> None:
    """A tenant named _other shared its series with the tenants past tenant_label_limit."""
    with pytest.raises(ConfigError, match=r'tenants\["_other"\]\.name: .*tenant_label_limit'):
        load_config(None, env={}, overrides={"tenants": [{"name": "_other", "token": "x"}]})


def test_model_errors_name_the_model() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides={"models": [{"name": "a"},
                                                        {"name": "llama", "full_pages": 1}]})
    assert str(info.value).startswith('invalid configuration: models["llama"].full_pages: ')
    assert "models.1" not in str(info.value)
    with pytest.raises(ConfigError, match=r'models\["llama"\]\.ful_pages: not a configuration '
                                          r'key; did you mean full_pages\?'):
        load_config(None, env={}, overrides={"models": [{"name": "llama", "ful_pages": 8}]})
    with pytest.raises(ConfigError, match=r'tenants\["t"\]\.quota_full_pages'):
        load_config(None, env={}, overrides={"tenants": [
            {"name": "t", "token": "x", "quota_full_pages": -1}]})


def test_misspelt_environment_variable_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"RADIXD_SERVER_SOKET": "/x.sock"})
    msg = str(info.value)
    assert "RADIXD_SERVER_SOKET" in msg and "did you mean RADIXD_SERVER_SOCKET?" in msg, msg
    with pytest.raises(ConfigError, match=r"RADIXD_SERVER_MAX_INFLIGHT \(setting "
                                          r"server\.max_inflight\)"):
        load_config(None, env={"RADIXD_SERVER_MAX_INFLIGHT": "0"})
    out = _radixd("config", "check", "--config", str(_config(tmp_path, CPU_MODEL)),
                  env={"RADIXD_SERVER_SOKET": "/x.sock"})
    assert "RADIXD_SERVER_SOKET" in _one_line_error(out)


def test_other_programs_radixd_variables_are_left_to_them(tmp_path: Path) -> None:
    """The client examples' RADIXD_TOKEN and the test scripts' switches were refused as unknown
    settings: exported in a shell, they stopped the daemon and `radixd status` there. A name
    close to one of the daemon's is still a typo, named."""
    other = {"RADIXD_TOKEN": "t", "RADIXD_STATEFUL_EXAMPLES": "2000", "RADIXD_NO_APT": "1"}
    assert load_config(None, env=other) == load_config(None, env={})
    out = _radixd("config", "check", "--config", str(_config(tmp_path, CPU_MODEL)), env=other)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr
    with pytest.raises(ConfigError, match="did you mean RADIXD_LOG_LEVEL"):
        load_config(None, env={"RADIXD_LOG_LEVLE": "debug"})
    with pytest.raises(ConfigError, match="did you mean RADIXD_SERVER_SOCKET"):
        load_config(None, env={"RADIXD_SOCKET": "/x.sock"})  # a key without its section
    with pytest.raises(ConfigError, match="RADIXD_SERVER: unknown setting"):
        load_config(None, env={"RADIXD_SERVER": "x"})  # a section without a key


def test_socket_under_a_regular_file_names_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    sock = blocker / "sub" / "radixd.sock"
    cfg = _config(tmp_path, CPU_MODEL, socket=str(sock))
    for args in (("serve",), ("config", "check")):
        line = _one_line_error(_radixd(*args, "--config", str(cfg)))
        assert line.startswith(f"radixd: server.socket: {sock}: "), line
        assert f"{blocker} is a file, not a directory" in line and "Errno" not in line, line
    admin = cfg.read_text().replace(str(sock), str(tmp_path / "ok.sock")).replace(
        "port = 0", f'unix_socket = "{sock}"')
    cfg.write_text(admin)
    for args in (("serve",), ("config", "check")):
        line = _one_line_error(_radixd(*args, "--config", str(cfg)))
        assert line.startswith(f"radixd: admin.unix_socket: {sock}: "), line
    not_a_socket = tmp_path / "plain"
    not_a_socket.write_text("")
    line = _one_line_error(_radixd("serve", "--config",
                                   str(_config(tmp_path, CPU_MODEL, socket=str(not_a_socket)))))
    assert str(not_a_socket) in line and "not a socket" in line, line


def test_a_socket_others_could_replace_is_refused(tmp_path: Path) -> None:
    """A socket path in /tmp below a directory another user made (the /tmp/radixd-$UID
    fallback, made first by someone else): whoever could put their own socket there would read
    the tenant tokens engines send. Serve refuses it, naming the path; config check, which may
    run as another user than the daemon's, leaves it to serve. A relative path is refused by
    both."""
    cases = [("rel/radixd.sock", "'rel/radixd.sock' is not an absolute path", ("serve", "check"))]
    if os.geteuid() == 0:  # (only root can give a directory away)
        theirs = tmp_path / "radixd-1001"  # tmp_path is below /tmp, sticky and world-writable
        (theirs / "radixd").mkdir(parents=True)
        os.chown(theirs, 65534, 65534)
        sticky = tmp_path / "radixd-1002"  # made sticky by its owner: they may still rename
        (sticky / "radixd").mkdir(parents=True)
        sticky.chmod(0o1777)
        os.chown(sticky, 65534, 65534)
        link = tmp_path / "radixd-1003"  # their link to a directory of ours
        (tmp_path / "ours-too").mkdir()
        link.symlink_to(tmp_path / "ours-too")
        os.lchown(link, 65534, 65534)
        for d in (theirs, sticky, link):
            cases.append((str(d / "radixd" / "radixd.sock") if d != link else
                          str(d / "radixd.sock"),
                          f"{d} belongs to uid 65534, not to this user", ("serve",)))
    for sock, why, refusing in cases:
        cfg = _config(tmp_path, CPU_MODEL, socket=sock)
        for command in refusing:
            args = ("serve",) if command == "serve" else ("config", "check")
            line = _one_line_error(_radixd(*args, "--config", str(cfg)))
            assert line.startswith(("radixd: invalid configuration: server.socket: ",
                                    f"radixd: server.socket: {sock}: ")) and why in line, line
        if "check" not in refusing:
            assert _radixd("config", "check", "--config", str(cfg)).returncode == 0
    ours = tmp_path / "ours" / "radixd"  # this user's, below /tmp: served
    d = _config(tmp_path, CPU_MODEL, socket=str(ours / "radixd.sock"))
    assert _radixd("config", "check", "--config", str(d)).returncode == 0


def test_sliding_window_0_describes_a_model_without_swa() -> None:
    cfg = load_config(None, env={}, overrides={"models": [{"name": "llama", "sliding_window": 0}]})
    model = cfg.models[0]
    assert model.num_swa_layers == 0 and model.profile().sliding_window is None
    assert model.profile().swa_pages == 0
    with pytest.raises(ConfigError, match=r'models\["llama"\]\.num_swa_layers: must be 0 when '
                                          r"sliding_window = 0"):
        load_config(None, env={}, overrides={"models": [
            {"name": "llama", "sliding_window": 0, "num_swa_layers": 2}]})


@pytest.mark.parametrize(("overrides", "key"), [
    ({"checker": {"slice_ms": 0}}, "checker.slice_ms"),
    ({"checker": {"slice_ms": "fast"}}, "checker.slice_ms"),
    ({"checker": {"share": 1.5}}, "checker.share"),
    ({"checker": {"share": -0.1}}, "checker.share"),
    ({"server": {"malloc_trim_interval_s": -1}}, "server.malloc_trim_interval_s"),
    ({"server": {"idle_compaction": "sometimes"}}, "server.idle_compaction"),
    ({"server": {"idle_compaction": 2}}, "server.idle_compaction"),
    ({"server": {"long_runs_in_use": "yes please"}}, "server.long_runs_in_use"),
    ({"models": [{"name": "m", "host_segment_pages": -1}]}, 'models["m"].host_segment_pages'),
    ({"admin": {"max_connections": 0}}, "admin.max_connections"),
    ({"admin": {"max_connections": 5000}}, "admin.max_connections"),
    ({"admin": {"max_connections": "many"}}, "admin.max_connections"),
])
def test_the_newer_keys_refuse_bad_values_by_name(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides=overrides)
    assert str(info.value).startswith(f"invalid configuration: {key}: "), str(info.value)


@pytest.mark.parametrize(("overrides", "key", "why"), [
    ({"l3": {"url": "redis://127.0.0.1:abc/0"}}, "l3.url", "Port could not be cast"),
    ({"l3": {"url": "redis://127.0.0.1:6379?db=x"}}, "l3.url", "Invalid value for 'db'"),
    ({"l3": {"url": "redis://127.0.0.1:6379/notadb"}}, "l3.url", "must be a number"),
    ({"l3": {"url": "http://127.0.0.1:6379/0"}}, "l3.url", "must start with redis://"),
    ({"l3": {"url": "redis+cluster://127.0.0.1:7000/1"}}, "l3.url", "must be 0"),
    ({"l3": {"url": "redis+cluster://127.0.0.1:7000?db=2"}}, "l3.url", "must be 0"),
    ({"l3": {"url": "rediss+cluster://127.0.0.1:7000?sslcacerts=/x"}}, "l3.url",
     "unknown query option 'sslcacerts'"),
    ({"l3": {"url": "redis://127.0.0.1:6379?ssl_ca_cert=/x"}}, "l3.url",
     "unknown query option 'ssl_ca_cert'"),
    ({"l3": {"url": "rediss://127.0.0.1:6379?ssl_ca_certs=/nonexistent/ca.pem"}}, "l3.url",
     "ssl_ca_certs: no such file '/nonexistent/ca.pem'"),
    ({"admin": {"token": "abc", "token_sha256": "0" * 64}}, "admin", "not both"),
    ({"admin": {"token": ""}}, "admin", "token is empty"),
    ({"admin": {"token_file": "rel.token"}}, "admin.token_file", "must be an absolute path"),
    ({"models": [{"name": "m", "page_size": 4, "sliding_window": 2048, "swa_pages": 64}]},
     'models["m"].sliding_window', "512 pages of 4, and a request past the window holds"),
    ({"models": [{"name": "m", "page_size": 4, "sliding_window": 8, "swa_pages": 3}]},
     'models["m"].sliding_window', "more than the SWA pool's 2 usable pages"),
    ({"admin": {"unix_socket": "/tmp/r.sock"}, "server": {"socket": "/tmp/r.sock"}}, "admin",
     "unix_socket is the engines' socket"),
    ({"tenants": [{"name": "a", "token": "t"}, {"name": "b", "token": "t"}]}, "tenants",
     "'a' and 'b' have the same token"),
    ({"tenants": [{"name": "a", "token": ""}]}, 'tenants["a"]', "token is empty"),
    ({"tenants": [{"name": "", "token": "t"}]}, "tenants", "at least 1 character"),
])
def test_settings_that_would_fail_later_are_refused_when_read(overrides: dict, key: str,
                                                              why: str) -> None:
    """A Redis URL whose port or database redis-py cannot read (before: a traceback and exit 1
    once the pools existed, while config check said ok; a database name that is no number was
    silently db 0), a cluster URL with a database or a query option no client takes (a
    traceback at the start), the same option on a plain URL (L3 off for good, the log saying
    Redis was unreachable) or a TLS file that is not there, both admin token forms (the
    digest was ignored), empty tokens (nothing could authenticate) and an empty tenant
    name."""
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides=overrides)
    assert str(info.value).startswith(f"invalid configuration: {key}"), str(info.value)
    assert why in str(info.value), str(info.value)


def test_a_config_file_that_cannot_be_read_is_a_one_line_error(tmp_path: Path) -> None:
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[server]\n")
    for path, why in ((tmp_path, "cannot be read: Is a directory"), (binary, "not UTF-8")):
        for args in (("config", "check"), ("serve",)):
            line = _one_line_error(_radixd(*args, "--config", str(path)))
            assert str(path) in line and why in line, line


def test_config_check_refuses_the_socket_paths_serve_refuses(tmp_path: Path) -> None:
    """A directory where the socket should go, and a path longer than a socket address holds:
    config check said ok and serve refused them (after building the pools)."""
    long = tmp_path / ("x" * (120 - len(str(tmp_path)))) / "radixd.sock"
    for sock, why in ((tmp_path, "exists and is not a socket"), (long, "longer than the 107")):
        cfg = _config(tmp_path, CPU_MODEL, socket=str(sock))
        for args in (("config", "check"), ("serve",)):
            line = _one_line_error(_radixd(*args, "--config", str(cfg)))
            assert line.startswith(("radixd: invalid configuration: server.socket: ",
                                    f"radixd: server.socket: {sock}: ")) and why in line, line


def test_the_redis_password_is_redacted_wherever_it_is_in_the_url() -> None:
    from daemon.config import redacted

    for url in ("redis://user:TOPSECRET@127.0.0.1:6379/0",
                "redis://127.0.0.1:6379/0?password=TOPSECRET",
                "unix:///run/redis.sock?db=1&password=TOPSECRET"):
        shown = redacted(load_config(None, env={}, overrides={"l3": {"url": url}}))["l3"]["url"]
        assert "TOPSECRET" not in shown and "<redacted>" in shown, shown
        assert shown.split("://")[0] == url.split("://")[0], shown


def test_l3_is_off_for_models_that_do_not_export_their_pools() -> None:
    """The tiers exist only for exported pools: no Redis client (nor radixd_l3_enabled 1) for
    a daemon whose only model with l3 keeps its pools to itself."""
    from daemon.app import build_l3

    model = {"name": "m", "host_pages": 64, "l3": True}
    url = {"l3": {"url": "redis://127.0.0.1:6379/0"}}
    off = load_config(None, env={}, overrides={**url, "models": [{**model,
                                                                 "export_pools": False}]})
    assert build_l3(off) is None
    on = load_config(None, env={}, overrides={**url, "models": [model]})
    assert build_l3(on) is not None


def test_an_all_digit_token_from_the_environment_is_text() -> None:
    """Environment values parse as TOML scalars (numbers, booleans, arrays), but a key that
    takes text keeps the text: an all-digit admin token was a number, refused, with no way to
    quote it."""
    cfg = load_config(None, env={"RADIXD_ADMIN_TOKEN": "123456",
                                 "RADIXD_SERVER_MAX_FRAME_BYTES": "4096"})
    assert cfg.admin.token == "123456" and cfg.server.max_frame_bytes == 4096


def test_a_cluster_url_redis_py_refuses_is_a_one_line_error_at_the_start(tmp_path: Path) -> None:
    """redis-py refuses a cluster URL with a database only when the client is built, after the
    pools: serve died with a traceback (exit 1), and under systemd restarted in a loop."""
    cfg = _config(tmp_path, CPU_MODEL)
    cfg.write_text(cfg.read_text() + '[l3]\nurl = "redis+cluster://127.0.0.1:7000/1"\n')
    for args in (("serve",), ("config", "check")):
        line = _one_line_error(_radixd(*args, "--config", str(cfg)))
        assert "l3.url" in line and "must be 0" in line, line


@pytest.mark.parametrize("what", ["someone's file", "a directory", "a FIFO", "a symlink"])
def test_an_admin_token_file_that_is_not_a_token_is_left_alone(tmp_path: Path, what: str) -> None:
    """admin.token_file naming an existing file that is no token: the daemon wrote the token
    over it and removed it at the stop (its text was lost); a directory failed with exit 1
    (systemd restarts on it) and left the token behind in a temporary file beside it. Both
    are refused with exit 2, and nothing there changes."""
    target = tmp_path / "notes.txt"
    if what == "a directory":
        target.mkdir()
    elif what == "a FIFO":  # (opened to be read, it blocked the start for good)
        os.mkfifo(target)
    elif what == "a symlink":  # (to a token-like file: the link was replaced, then removed)
        (tmp_path / "real").write_text("a" * 64 + "\n")
        target.symlink_to(tmp_path / "real")
    else:
        target.write_text("my notes\n")
    cfg = _config(tmp_path, CPU_MODEL)
    cfg.write_text(cfg.read_text().replace("[admin]\n", f'[admin]\ntoken_file = "{target}"\n'))
    out = _radixd("serve", "--config", str(cfg))
    assert out.returncode == cli.EXIT_USAGE, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr
    assert f"admin.token_file: {target} exists and is not an admin token" \
        in out.stderr, out.stderr[-2000:]
    if what == "a directory":
        assert target.is_dir() and list(target.iterdir()) == []
    elif what == "a FIFO":
        assert stat.S_ISFIFO(target.lstat().st_mode)
    elif what == "a symlink":
        assert target.is_symlink() and (tmp_path / "real").read_text() == "a" * 64 + "\n"
    else:
        assert target.read_text() == "my notes\n"
    assert sorted(p.name for p in tmp_path.iterdir() if "notes" in p.name) == [
        "notes.txt", "notes.txt.lock"]


@pytest.mark.parametrize(("env", "why"), [
    ({"RADIXD_MODELS_PAGE_SIZE": "8"}, "RADIXD_MODELS_PAGE_SIZE: [[models]] are set in the "
                                       "configuration file only"),
    ({"RADIXD_TENANTS_TOKEN": "x"}, "RADIXD_TENANTS_TOKEN: [[tenants]] are set in the "
                                    "configuration file only"),
    ({"RADIXD_CONFIG": ""}, "RADIXD_CONFIG is empty"),
])
def test_environment_a_daemon_cannot_take_is_refused(env: dict[str, str], why: str) -> None:
    """These were ignored without a word (the docs promise a typo does not go unnoticed), and
    an empty RADIXD_CONFIG said 'config file  does not exist'."""
    with pytest.raises(ConfigError) as info:
        load_config(None, env=env)
    assert why in str(info.value), str(info.value)


def test_a_config_file_with_a_byte_order_mark_says_so(tmp_path: Path) -> None:
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[server]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert "byte-order mark" in str(info.value), str(info.value)
