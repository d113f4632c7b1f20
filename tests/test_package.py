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
    for leaf in ("jaxcert.base.validate", "jaxcert.base.paths"):
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


# The layers, lowest first; a module may import its own layer and the ones below it.
LAYERS = (
    "jaxcert.base",
    "jaxcert.core",
    "jaxcert.losses",
    "jaxcert.models",
    "jaxcert.decoding",
    "jaxcert.pipeline",
    "jaxcert.training",
    "jaxcert.cli",
)


def _layer(module: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return i
    return None  # the package itself (jaxcert/__init__: the public surface)


def test_every_import_runs_down_the_layers():
    """The README's design section draws these layers; an upward import fails here."""
    modules = _modules()
    known = set(modules)
    upward = []
    for name, path in modules.items():
        mine = _layer(name)
        assert mine is not None or name == "jaxcert", f"{name} is in no layer"
        for target in _imports(name, path, known) - {"jaxcert"}:  # the parent: implicit
            theirs = _layer(target)
            if mine is not None and (theirs is None or theirs > mine):
                upward.append(f"{name} -> {target}")
        # The public surface itself (``import jaxcert``, ``from jaxcert import certificate``)
        # sits above every layer but the command line.
        for node in ast.walk(ast.parse(path.read_text())):
            top = (
                isinstance(node, ast.Import) and any(a.name == "jaxcert" for a in node.names)
            ) or (
                isinstance(node, ast.ImportFrom)
                and node.module == "jaxcert"
                and any(f"jaxcert.{a.name}" not in known for a in node.names)
            )
            if top and mine is not None and mine < len(LAYERS) - 1:
                upward.append(f"{name} -> jaxcert (the public surface)")
    assert not upward, "imports that run up the layers:\n" + "\n".join(sorted(upward))
    assert {_layer(m) for m in modules} >= set(range(len(LAYERS)))


def test_no_module_uses_another_modules_private_names():
    """``from x import _name`` or ``x._name`` across modules of jaxcert."""
    found = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxcert"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{name}: from {node.module} import {a.name}")
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{name}: {node.value.id}.{node.attr}")
    assert not found, "\n".join(sorted(set(found)))
