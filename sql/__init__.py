"""dmq's SQL, kept out of Python and loaded by name.

``queries.sql`` is a series of ``-- name: <name>`` blocks, each followed by a
``-- <description>`` line and one statement. A ``-- fragment: <name>`` block holds
a condition several statements share; a statement uses it as ``/*<name>*/`` and
gets it in parentheses. ``migrations/NNNN_<desc>.sql`` are
applied in order by ``dmq_server.db.schema`` and recorded in ``dmq_schema_version``.
Installed as the package ``dmq_sql``.
"""

from __future__ import annotations

import re
from importlib import resources

__all__ = ["queries", "migrations", "load_queries"]

_BLOCK = re.compile(r"^-- (?P<kind>name|fragment): (?P<name>[a-z_0-9]+)\s*$", re.MULTILINE)
_USE = re.compile(r"/\*(?P<name>[a-z_0-9]+)\*/")
_MIGRATION = re.compile(r"^(?P<version>\d{4})_(?P<desc>[a-z0-9_]+)\.sql$")


def load_queries(text: str) -> dict[str, str]:
    """Split a ``-- name:`` file into ``{name: statement}``, fragments filled in."""
    found: dict[str, str] = {}
    fragments: dict[str, str] = {}
    parts = _BLOCK.split(text)
    for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3]):
        into = found if kind == "name" else fragments
        if name in into:
            raise ValueError(f"{kind} {name!r} defined twice")
        body = body.strip().rstrip(";")
        if kind == "fragment":  # its description stays in the file, not in every statement
            body = "\n".join(line for line in body.splitlines() if not line.startswith("--"))
        into[name] = body

    def fill(match: re.Match) -> str:
        fragment = fragments.get(match["name"])
        if fragment is None:
            raise ValueError(f"unknown fragment /*{match['name']}*/")
        return f"({fragment})"

    return {name: _USE.sub(fill, statement) for name, statement in found.items()}


def _read(name: str) -> str:
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def migrations() -> list[tuple[int, str, str]]:
    """``[(version, description, sql)]`` in version order."""
    folder = resources.files(__name__).joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = _MIGRATION.match(entry.name)
        if match:
            found.append((int(match["version"]), match["desc"], entry.read_text(encoding="utf-8")))
    found.sort()
    versions = [v for v, _, _ in found]
    if versions != list(range(1, len(versions) + 1)):
        raise RuntimeError(f"migrations must be numbered 1..N without gaps, found {versions}")
    return found


queries: dict[str, str] = load_queries(_read("queries.sql"))
