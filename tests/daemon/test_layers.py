"""The daemon's modules import downward only: no cycles (function-level imports included), and
the admin endpoint and the socket server never import each other (docs/design.md, layers)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "daemon"


def _graph() -> dict[str, set[str]]:
    mods: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
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
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
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


def test_no_import_cycles_above_the_tree() -> None:
    # daemon.tree's own modules are being restructured elsewhere; everything else must be acyclic
    cycles = [c for c in _cycles(_graph()) if not all(m.startswith("daemon.tree") for m in c)]
    assert cycles == []


def test_admin_and_server_do_not_import_each_other() -> None:
    g = _graph()
    assert "daemon.server" not in g["daemon.admin"]
    assert "daemon.admin" not in g["daemon.server"]
    assert "daemon.server" not in g["daemon.exposition"]
    for mod in ("daemon.admin", "daemon.exposition", "daemon.server"):
        assert not {"daemon.model_cache", "daemon.tiers", "daemon.tree"} & g[mod], mod
    assert "daemon.app" not in set().union(*(v for k, v in g.items() if k != "daemon.cli"))
