"""radixd-client stands alone: msgspec is its only dependency, and importing it is cheap."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import radixd_client

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DIST = Path(__file__).resolve().parents[2] / "clients" / "python"  # the source tree
PKG = DIST / "radixd_client"
FORBIDDEN = {"aiohttp", "redis", "pydantic", "daemon", "numpy", "uvloop", "pytest"}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_forbidden_imports_anywhere_in_the_package() -> None:
    files = sorted(PKG.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "protocol.py", "errors.py", "client.py",
                                       "aio.py", "pools.py"}
    for f in files:
        bad = _imported_modules(f) & FORBIDDEN
        assert not bad, f"{f.name} imports {sorted(bad)}"
    # torch only lazily: never at module level
    for f in files:
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""])
                assert not any(m.split(".")[0] == "torch" for m in mods), f.name


def test_importing_the_package_imports_neither_torch_nor_numpy() -> None:
    code = ("import sys, radixd_client, radixd_client.pools, radixd_client.aio; "
            "print(sorted(m for m in ('torch', 'numpy', 'daemon') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_distribution_metadata() -> None:
    meta = tomllib.loads((DIST / "pyproject.toml").read_text(encoding="utf-8"))
    project = meta["project"]
    assert project["name"] == "radixd-client" and project["version"] == "0.2.0"
    assert project["version"] == radixd_client.__version__
    assert project["requires-python"] == ">=3.10"
    assert project["dependencies"] == ["msgspec>=0.18"]
    assert project["optional-dependencies"] == {"torch": ["torch>=2.4,<3"]}
    assert (PKG / "py.typed").exists() and (DIST / "README.md").exists()


def test_public_names() -> None:
    for name in radixd_client.__all__:
        assert hasattr(radixd_client, name), name
