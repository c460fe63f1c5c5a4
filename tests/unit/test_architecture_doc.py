"""docs/architecture.md stays true to the code: the modules it names exist, every module of
the server is named there, and its layer diagram is the one import-linter enforces."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "architecture.md").read_text()
SERVER = REPO / "dmq_server"


def _named_paths() -> set[str]:
    """Paths the page names in backticks, relative to dmq_server/ (``db/steps.py``)."""
    return {m for m in re.findall(r"`([a-z0-9_]+(?:/[a-z0-9_]+)*\.py)`", DOC)}


def test_every_module_the_page_names_exists():
    missing = sorted(
        p for p in _named_paths()
        if not (SERVER / p).is_file() and not (REPO / p).is_file()
    )
    assert missing == [], f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_server_module_is_named_on_the_page():
    modules = {
        str(p.relative_to(SERVER)) for p in SERVER.rglob("*.py") if p.name != "__init__.py"
    }
    unnamed = sorted(modules - _named_paths())
    assert unnamed == [], f"add these modules to docs/architecture.md: {unnamed}"


def test_the_layer_diagram_is_the_enforced_one():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    block = DOC.split("## Layers", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    drawn = [line.strip() for line in block.splitlines() if line.strip().startswith("dmq_server.")]
    # a drawn line is the layer followed by its description (two or more spaces apart)
    drawn = [re.split(r"\s{2,}", line)[0] for line in drawn]
    assert drawn == layers


def test_a_long_module_says_why_in_its_docstring():
    """Modules of one concept: one over 400 lines says why it is one module (or that it
    is still to be split), so a long module is a decision, not an accident."""
    import ast

    unexplained = []
    for path in sorted(SERVER.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") <= 400:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if "Why one long module:" not in doc and "Still too long" not in doc:
            unexplained.append(str(path.relative_to(SERVER)))
    assert unexplained == [], f"over 400 lines without a reason in the docstring: {unexplained}"


def test_no_two_server_modules_share_a_file_name():
    """A file's name says what it holds: ``console.py`` in two packages (the admin line
    console and the web console) or ``store.py`` for both stores sent readers to the wrong
    one (issue 43)."""
    seen: dict[str, list[str]] = {}
    for path in sorted((REPO / "dmq_server").rglob("*.py")):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(REPO / "dmq_server")))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}
