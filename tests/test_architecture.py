"""The architecture of docs/design.md, checked: the import contracts (import-linter, configured in
pyproject.toml), no import cycle (function-level imports included), no private name used across
modules, no oversized module, ruff clean.

A new module that breaks a rule fails here with the rule's name, not in a review.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"daemon": REPO / "daemon", "radixd_client": REPO / "clients/python/radixd_client",
            "radixd_bench": REPO / "radixd_bench"}
MAX_LINES = 700


def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = (pkg, *path.relative_to(root).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> project modules it imports, wherever the import statement stands."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg
                for _ in range(max(0, node.level - 1)):
                    base = base.rpartition(".")[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level \
                    else node.module or ""
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod and not mod.startswith(name + "."):
                    graph[mod].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def run_tool(name: str, *args: str) -> None:
    """Run a tool of the test extras from this venv; its output is the failure message."""
    exe = shutil.which(name, path=str(Path(sys.executable).parent))
    assert exe, f"{name} is missing: install the test extras (pip install -e '.[test]')"
    r = subprocess.run([exe, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_import_contracts_hold() -> None:
    """Layers, the pure tree, the client and the bench free of the daemon (pyproject.toml)."""
    run_tool("lint-imports", "--no-logo", "--no-cache")


def test_no_import_cycle_anywhere() -> None:
    assert cycles(import_graph()) == []


def test_the_fixture_finds_a_cycle() -> None:
    """The cycle finder itself (a checker that finds nothing proves nothing)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def _defined_privates(tree: ast.AST) -> set[str]:
    """Private names a module defines itself: functions, classes, attributes it assigns."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return {n for n in out if n.startswith("_")}


# `x._y` where the private belongs to another project: (module, attribute) -> why it is fine.
FOREIGN_PRIVATES = {
    ("radixd_client.pools", "_share_cuda_"): "torch's documented CUDA IPC export "
                                              "(torch.multiprocessing uses it the same way)",
}


def test_no_private_name_crosses_a_module() -> None:
    """Neither ``from m import _x`` of a project module nor ``obj._x`` on an object of another
    module: what one module needs of another is that module's public API."""
    mods = modules()
    bad: list[str] = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        own = _defined_privates(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(
                    ".")[0] in PACKAGES):
                bad += [f"{mod}: imports {a.name} from {node.module}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") and node.attr not in own \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self",
                                                                                    "cls")):
                if (mod, node.attr) not in FOREIGN_PRIVATES:
                    bad.append(f"{mod}:{node.lineno}: .{node.attr} of another module")
    assert bad == []


def test_no_module_is_oversized() -> None:
    """Small modules with names that say what they hold: none over about 700 lines."""
    big = {m: n for m, p in modules().items()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}


def test_ruff_is_clean() -> None:
    run_tool("ruff", "check", ".")
