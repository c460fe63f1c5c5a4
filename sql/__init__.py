"""dmq's SQL, kept out of Python and loaded by name.

``queries.sql`` is a series of ``-- name: <name>`` blocks, each followed by a
``-- <description>`` line and one statement. ``migrations/NNNN_<desc>.sql`` are
applied in order by ``dmq_server.store`` and recorded in ``dmq_schema_version``.
Installed as the package ``dmq_sql``.
"""

from __future__ import annotations

import re
from importlib import resources

__all__ = ["queries", "migrations", "load_queries"]

_BLOCK = re.compile(r"^-- name: (?P<name>[a-z_0-9]+)\s*$", re.MULTILINE)
_MIGRATION = re.compile(r"^(?P<version>\d{4})_(?P<desc>[a-z0-9_]+)\.sql$")


def load_queries(text: str) -> dict[str, str]:
    """Split a ``-- name:`` file into ``{name: statement}``."""
    found: dict[str, str] = {}
    parts = _BLOCK.split(text)
    for name, body in zip(parts[1::2], parts[2::2]):
        if name in found:
            raise ValueError(f"query {name!r} defined twice")
        found[name] = body.strip().rstrip(";")
    return found


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
