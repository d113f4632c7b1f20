"""The README is a user's document: its examples import what they name, outside the repository.

The examples that need real weights cannot run here; their imports and the names they use
from jaxcert are checked instead (an ``import models`` worked only inside the repository
root). ``tests/test_sharding.py`` runs the README's sharded training step.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return [b.split("```", 1)[0] for b in README.read_text().split("```python\n")[1:]]


def _imports(code: str) -> list[ast.stmt]:
    return [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Import | ast.ImportFrom)]


def test_readme_examples_import_only_what_an_installed_jaxcert_has(tmp_path):
    """Every import of every example, run from a folder outside the repository."""
    blocks = _python_blocks()
    assert len(blocks) >= 3
    lines = sorted({ast.unparse(node) for code in blocks for node in _imports(code)})
    assert any("jaxcert" in line for line in lines)
    script = "\n".join(lines) + "\nprint('ok')\n"
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def test_readme_examples_use_names_jaxcert_has():
    """``module.name`` of every imported jaxcert module, as written in the examples."""
    missing = []
    for code in _python_blocks():
        tree = ast.parse(code)
        modules = {}
        for node in _imports(code):
            source = node.module if isinstance(node, ast.ImportFrom) else None
            if source and source.startswith("jaxcert"):
                for alias in node.names:
                    name = f"{source}.{alias.name}"
                    try:
                        modules[alias.asname or alias.name] = importlib.import_module(name)
                    except ImportError:
                        obj = importlib.import_module(source)
                        if not hasattr(obj, alias.name):
                            missing.append(name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("jaxcert"):
                        modules[alias.asname or alias.name] = importlib.import_module(alias.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                module = modules.get(node.value.id)
                if module is not None and not hasattr(module, node.attr):
                    missing.append(f"{node.value.id}.{node.attr}")
    assert not missing, missing


def test_readme_speaks_to_users_not_to_the_project_history():
    text = README.read_text()
    assert not re.search(r"\bissue\s*#?\d+|#\d{1,3}\b", text, re.I), "issue numbers"
    assert not re.search(r"\b[0-9a-f]{7,40}\b", text), "commit hashes"
    assert "shared/" not in text and "../shared" not in text
    # The CPU caveat of speculative decoding comes with its headline, not far below it.
    decoding = text.index("## Speculative decoding")
    assert "target-only" in text[decoding : decoding + 1500]
