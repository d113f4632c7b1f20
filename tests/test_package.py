"""Package structure: no import cycle, no top-level `models` package, public surface intact."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"jaxcert": ROOT / "jaxcert", "jaxcert.models": ROOT / "models"}


def _modules() -> dict[str, pathlib.Path]:
    """Module name -> file, for jaxcert/ and models/ (installed as jaxcert.models)."""
    out = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if name.startswith("jaxcert.models") and package == "jaxcert":
                continue
            out[name] = path
    return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Every jaxcert module `name` imports, at module level or inside functions."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_import_graph_has_no_cycle():
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    # A submodule's parent package is imported first by Python; an edge from a submodule to
    # one of its own parents is that implicit import, not a cycle of ideas.
    for name, edges in graph.items():
        edges -= {p for p in known if name.startswith(p + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert "jaxcert.models.gguf" in graph and "jaxcert.decoding.loop" in graph


def test_leaf_modules_import_nothing_from_jaxcert():
    modules = _modules()
    for leaf in ("jaxcert._validate", "jaxcert._paths"):
        assert _imports(leaf, modules[leaf], set(modules)) == set(), leaf


def test_no_top_level_models_package(tmp_path):
    code = (
        "import importlib.util, jaxcert.models as m; "
        "print(importlib.util.find_spec('models') is None, m.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "jaxcert.models"]
