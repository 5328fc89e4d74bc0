"""The `radixd` command line: dispatch to subcommands, exit codes, --version."""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
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
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_demo_dispatches_lazily_with_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []

    def fake_main(args: argparse.Namespace) -> int:
        seen.append(args)
        return 3

    fake = types.ModuleType("daemon.demo")
    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "daemon.demo", fake)
    assert cli.main(["demo", "--pages", "64", "-v"]) == 3
    assert len(seen) == 1
    assert seen[0].command == "demo"
    assert seen[0].demo_args == ["--pages", "64", "-v"]


def test_demo_returning_none_is_success(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("daemon.demo")
    fake.main = lambda args: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "daemon.demo", fake)
    assert cli.main(["demo"]) == 0


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from daemon import cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "usage: radixd" in result.stdout


def test_unknown_option_before_subcommand_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--bogus", "demo"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_unknown_command_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve-nothing"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
