"""The example configuration (daemon/data/radixd.example.toml, `radixd config example`).

It must load, and document every key of every section of daemon/config.py (found by walking the
pydantic models, so a new key fails here until it is documented): each key with a comment block
above it that says ``default: ...`` (checked against the code where the default is a TOML value)
or ``required``. Keys with no TOML spelling of their default (``None``) appear commented out; each
of those lines must load when uncommented.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import typing
import zipfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest
from pydantic import BaseModel

from daemon.config import Config, load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "daemon" / "data" / "radixd.example.toml"

_HEADER = re.compile(r"^\[\[?([a-z_][a-z0-9_]*)\]\]?\s*$")
_ASSIGN = re.compile(r"^(#\s?)?([a-z_][a-z0-9_]*) = (.+)$")


def sections() -> dict[str, type[BaseModel]]:
    """Section name ("" for top-level keys) -> its model, from Config's fields."""
    out: dict[str, type[BaseModel]] = {"": Config}
    for name, field in Config.model_fields.items():
        ann = field.annotation
        if typing.get_origin(ann) is list:
            ann = typing.get_args(ann)[0]
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out[name] = ann
    return out


def keys() -> list[tuple[str, str]]:
    secs = sections()
    out = [("", name) for name in Config.model_fields if name not in secs]
    for sec, model in secs.items():
        if sec:
            out += [(sec, name) for name in model.model_fields]
    return out


@dataclass
class Entry:
    section: str
    key: str
    value: str
    commented: bool
    doc: list[str]
    line: int


def entries() -> list[Entry]:
    out: list[Entry] = []
    section, doc = "", []
    for n, raw in enumerate(EXAMPLE.read_text().splitlines()):
        line = raw.strip()
        if not line:
            doc = []
        elif m := _HEADER.match(line):
            section, doc = m.group(1), []
        elif m := _ASSIGN.match(line):
            out.append(Entry(section, m.group(2), m.group(3), bool(m.group(1)), doc, n))
            doc = []
        elif line.startswith("#"):
            doc.append(line.lstrip("#").strip())
        else:
            raise AssertionError(f"line {n + 1}: not understood: {raw!r}")
    return out


def test_example_loads() -> None:
    config = load_config(EXAMPLE, env={})
    assert config.server.socket == "/run/radixd/radixd.sock"
    assert config.server.socket_mode == "0660"
    assert config.models and config.models[0].device.startswith("cuda")
    assert config.tenants, "the example shows tenants"
    assert all(t.token is None and t.token_sha256 for t in config.tenants), \
        "the example keeps no token in clear"
    assert {e.section for e in entries()} == set(sections()), "every section appears"


@pytest.mark.parametrize(("section", "key"), keys(), ids=lambda v: v or "top")
def test_every_key_documented(section: str, key: str) -> None:
    found = [e for e in entries() if (e.section, e.key) == (section, key)]
    where = f"[{section}] {key}" if section else key
    assert found, f"{where} is not in {EXAMPLE.name}"
    # a comment block: what the key does, and a line "default: ..." (or "required")
    documented = [e for e in found if len(e.doc) >= 2
                  and any(d.startswith("default:") or d == "required" for d in e.doc)]
    assert documented, f"{where}: needs a comment saying what it does and 'default: ...'"

    model = sections()[section]
    field = model.model_fields[key]
    for e in documented:
        stated = [d[len("default:"):].strip() for d in e.doc if d.startswith("default:")]
        if field.is_required():
            assert "required" in e.doc, f"{where} is required; say so"
            continue
        assert len(stated) == 1, f"{where}: one 'default:' line"
        try:
            value = tomllib.loads(f"v = {stated[0]}")["v"]
        except tomllib.TOMLDecodeError:
            continue  # prose ("none", a path that depends on the user): nothing to compare
        assert value == field.get_default(call_default_factory=True), \
            f"{where}: the comment says default {stated[0]}, the code says otherwise"


def test_commented_out_keys_load_when_uncommented() -> None:
    lines = EXAMPLE.read_text().splitlines()
    commented = [e for e in entries() if e.commented]
    assert commented, "keys without a TOML default are shown commented out"
    for e in commented:
        edited = list(lines)
        edited[e.line] = f"{e.key} = {e.value}"
        try:
            Config.model_validate(tomllib.loads("\n".join(edited) + "\n"))
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            # the example tenant already has token_sha256; token is its documented alternative
            if "not both" not in str(exc):
                raise AssertionError(f"line {e.line + 1} ({e.key}) does not load: {exc}") from None


def test_example_ships_in_the_package(tmp_path: Path) -> None:
    """`radixd config example` reads daemon/data/radixd.example.toml as package data: it must be
    in the wheel, not only in the source tree."""
    resource = resources.files("daemon").joinpath("data", "radixd.example.toml")
    assert resource.read_text() == EXAMPLE.read_text()
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools")
    # a copy of what the build reads, so that no build output lands in the working tree
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "daemon", src / "daemon",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "dist").glob("radixd-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read("daemon/data/radixd.example.toml").decode() == EXAMPLE.read_text()


def test_radixd_config_example_prints_it() -> None:
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "config", "example"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == EXAMPLE.read_text()


CPU_EXAMPLE = REPO / "daemon" / "data" / "radixd.cpu.toml"


def test_radixd_config_example_cpu_prints_the_cpu_variant() -> None:
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "config", "example", "--cpu"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == CPU_EXAMPLE.read_text()
    config = load_config(CPU_EXAMPLE, env={})
    assert all(m.device == "cpu" for m in config.models) and not config.tenants


def test_cpu_example_starts_a_daemon(tmp_path: Path) -> None:
    """The CPU variant, exactly as shipped, passes `radixd config check` and starts a daemon
    that serves an engine (only the socket and admin port are moved, by environment, so that
    the test does not collide with a daemon on this machine)."""
    import os
    import signal
    import socket
    import time
    from array import array

    from radixd_client import Client

    sock = str(tmp_path / "radixd.sock")
    env = {**os.environ, "RADIXD_SERVER_SOCKET": sock, "RADIXD_ADMIN_PORT": "0",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "daemon.cli"]
    check = subprocess.run([*cmd, "config", "check", "--config", str(CPU_EXAMPLE)], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    assert check.stdout.startswith("ok: configuration valid; 1 model(s): default: ")
    log = tmp_path / "radixd.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*cmd, "serve", "--config", str(CPU_EXAMPLE)], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, log.read_text()
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(sock)
                break
            except OSError:
                time.sleep(0.1)
        with Client(sock) as c:
            tokens = array("i", range(1, 1 + 3 * 16)).tobytes()
            a = c.alloc("default", 3)
            c.insert("default", tokens, a.full_pages, a.swa_pages)
            assert c.match("default", tokens).prefix_len == 3 * 16
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "Traceback" not in text and "invariant violations" not in text, text
