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


def _bash_commands() -> list[str]:
    """The README's bash blocks, one command a string (comments dropped, continuations joined)."""
    commands = []
    for block in README.read_text().split("```bash\n")[1:]:
        text = block.split("```", 1)[0].replace("\\\n", " ")
        commands += [ln.strip() for ln in text.splitlines() if ln.strip() and ln[0] != "#"]
    return commands


def test_readme_is_short():
    assert len(README.read_text().splitlines()) < 300


def test_quickstart_commands_install_and_run_what_the_repository_has():
    """Command 1 sets up and runs ``jaxcert certify`` on its defaults; command 2 is CI's."""
    root = README.parent
    first, second = _bash_commands()[:2]
    setup = "python3 -m venv .venv && .venv/bin/pip install -q -e "
    assert first == setup + ". && .venv/bin/jaxcert certify"
    assert second.startswith(setup + "'.[test]' && ")
    assert second in (root / ".ci" / "run").read_text().splitlines()
    for tool in (".venv/bin/ruff check .", ".venv/bin/mypy", "pytest -q --run-slow"):
        assert tool in second
    pyproject = (root / "pyproject.toml").read_text()
    assert 'jaxcert = "jaxcert.cli:main"' in pyproject
    for extra in ('"pytest>=', '"pytest-xdist', '"ruff==', '"mypy=='):
        assert extra in pyproject.split("[project.optional-dependencies]")[1].split("[project.")[0]
    from jaxcert.cli import build_parser

    args = build_parser().parse_args(["certify"])
    assert args.target == "qwen2.5-coder-0.5b-instruct" and args.prompts == "mtbench"


def test_readme_jaxcert_commands_parse():
    """Every ``jaxcert ...`` (or ``.venv/bin/jaxcert ...``) command of the README's bash
    blocks is accepted by the parser."""
    from jaxcert.cli import build_parser

    parser = build_parser()
    commands = [c.removeprefix(".venv/bin/") for c in _bash_commands()]
    commands = [c for c in commands if c.startswith("jaxcert ")]
    assert any(c.startswith("jaxcert decode ") for c in commands)
    for command in commands:
        parser.parse_args(command.split()[1:])


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_relative_link_of_the_docs_resolves():
    """README and docs/*.md: each relative link names a file that exists, and its anchor."""
    pages = [README, *sorted((README.parent / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            name, _, anchor = target.partition("#")
            path = (page.parent / name).resolve() if name else page
            if not path.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.name}: {target} (no such section)")
    assert not broken, broken


def test_docs_carry_no_dates_of_work():
    pages = [README, *sorted((README.parent / "docs").rglob("*.md"))]
    dated = [p.name for p in pages if re.search(r"\b20\d\d-\d\d-\d\d\b", p.read_text())]
    assert not dated, dated
