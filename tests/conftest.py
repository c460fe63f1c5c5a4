"""Shared pytest fixtures: real PostgreSQL servers, no mocks.

Why real servers: dmq's guarantees (a message acknowledged is a message stored)
live in PostgreSQL transactions, so tests must exercise the real thing.  One
embedded server is shared by the whole session (starting one costs ~1-2 s) and
every test gets its own database on it: a copy of one database migrated once per
session (``CREATE DATABASE ... TEMPLATE``), so no test pays for the migrations, and
an empty one (``pg_empty_dsn``) for the tests of migrating itself. Tests that stop
or kill PostgreSQL get a private server so they cannot disturb the others.

The server data lives in ``tempfile.mkdtemp`` directories (mode 755), not in
pytest's ``tmp_path``: when the tests run as root, PostgreSQL runs as an
unprivileged user that cannot enter pytest's ``/tmp/pytest-of-root`` (mode 700).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from dmq_server.db.embedded import EmbeddedPostgres


def _make_pg_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="dmq-test-pg-"))
    path.chmod(0o755)  # the PostgreSQL user must be able to enter it when we are root
    return path


def _dispose(pg: EmbeddedPostgres, path: Path) -> None:
    try:
        pg.stop(mode="immediate")
    finally:
        if pg.is_running():  # stop failed: never leave a server behind
            pg.kill()
        shutil.rmtree(path, ignore_errors=True)


# One tier per folder, cheapest first; `pytest -m unit` runs the tier without IO.
TIERS = ("unit", "integration", "zk", "compat", "pipeline", "chaos")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its folder's tier. A test outside the tier folders, or one
    that claims another tier's marker, is a collection error: a tier must mean what
    its name says (``unit`` never touches PostgreSQL, ZooKeeper or a socket)."""
    root = Path(__file__).resolve().parent
    for item in items:
        parts = Path(str(item.path)).resolve().relative_to(root).parts
        tier = parts[0] if len(parts) > 1 else None
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in one of tests/{{{','.join(TIERS)}}}/")
        claimed = {m.name for m in item.iter_markers() if m.name in TIERS} - {tier}
        if claimed:
            raise pytest.UsageError(f"{item.nodeid}: in tests/{tier}/ but marked {sorted(claimed)}")
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "unit":
            slow = {"pg_server", "pg_dsn", "pg_private"} & set(getattr(item, "fixturenames", ()))
            if slow:
                raise pytest.UsageError(f"{item.nodeid}: a unit test may not use {sorted(slow)}")


@pytest.fixture(scope="session", autouse=True)
def _scrub_dmq_env() -> Iterator[None]:
    """Remove ``DMQ_*`` variables (except DMQ_PG_BINDIR) so a developer's shell
    configuration cannot change what the tests see; restore them afterwards."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("DMQ_") and k != "DMQ_PG_BINDIR"}
    for key in saved:
        del os.environ[key]
    yield
    os.environ.update(saved)


@pytest.fixture(scope="session")
def pg_server(_scrub_dmq_env: None) -> Iterator[EmbeddedPostgres]:
    """One embedded PostgreSQL for the whole session, removed at the end."""
    path = _make_pg_dir()
    pg = EmbeddedPostgres(path)
    try:
        pg.start()
        yield pg
    finally:
        _dispose(pg, path)


@pytest.fixture(scope="session")
def pg_template(pg_server: EmbeddedPostgres) -> str:
    """The name of a database migrated once for the session; ``pg_dsn`` copies it."""
    from dmq_server.db.schema import migrate

    name = f"dmq_template_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    migrate(pg_server.dsn_for(name))  # its connection is closed again: a template must have none
    return name


@contextmanager
def _database(pg_server: EmbeddedPostgres, template: str | None) -> Iterator[str]:
    """A database of its own for one test (a copy of ``template``, or empty), dropped after it."""
    name = f"test_{uuid.uuid4().hex[:16]}"
    copy = f' TEMPLATE "{template}"' if template else ""
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{copy}')
    try:
        yield pg_server.dsn_for(name)
    finally:
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_dsn(pg_server: EmbeddedPostgres, pg_template: str) -> Iterator[str]:
    """The DSN of a fresh database with dmq's schema at the latest version, dropped after the test."""
    with _database(pg_server, pg_template) as dsn:
        yield dsn


@pytest.fixture
def pg_empty_dsn(pg_server: EmbeddedPostgres) -> Iterator[str]:
    """The DSN of a fresh, empty database (no schema), dropped after the test."""
    with _database(pg_server, None) as dsn:
        yield dsn


@pytest.fixture
def scratch_dir() -> Iterator[Path]:
    """A fresh mode-755 directory (not pytest's tmp_path, see above) for a test that
    starts an embedded PostgreSQL or a server with ``--data-path`` in it: whatever
    PostgreSQL is left running there is killed and the directory removed afterwards."""
    path = _make_pg_dir()
    try:
        yield path
    finally:
        EmbeddedPostgres(path).kill()
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pg_private(_scrub_dmq_env: None) -> Iterator[EmbeddedPostgres]:
    """A private, already started EmbeddedPostgres for tests that stop or kill it.

    ``pg_private.dsn`` is ready to use; ``start()`` again is harmless (it
    returns the same DSN).  It is stopped and its directory removed afterwards.
    """
    path = _make_pg_dir()
    pg = EmbeddedPostgres(path)
    try:
        pg.start()
        yield pg
    finally:
        _dispose(pg, path)
