"""The `radixd` command line: dispatch, exit codes, configuration errors, --version."""

from __future__ import annotations

import json
import subprocess
import sys
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


def test_config_show_redacts_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[tenants]]\nname = "a"\ntoken = "s3cret"\n')
    assert cli.main(["config", "show", "--config", str(cfg), "--socket", "/tmp/x.sock"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert data["server"]["socket"] == "/tmp/x.sock"
    assert data["tenants"][0]["token"] == "<redacted>"
    assert "s3cret" not in out


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
    ],
)
def test_bad_config_is_rejected_naming_the_key(tmp_path: Path, capsys, toml: str, key: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    assert cli.main(["serve", "--config", str(cfg)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "invalid configuration" in err and key in err


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
