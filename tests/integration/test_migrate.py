"""Migrations started at once on a fresh database all succeed (real PostgreSQL).

deploy/cluster-local.sh starts three nodes together; each migrates at start. The
ledger table was created before the migration lock was taken, and concurrent
``CREATE TABLE IF NOT EXISTS`` statements collide in PostgreSQL's catalog
(``duplicate key value violates unique constraint "pg_type_typname_nsp_index"``),
so some of the nodes failed to start on a first run.
"""

from __future__ import annotations

import threading

import pytest

from dmq_sql import migrations
from dmq_server.db.schema import migrate
from tests.integration.support import db_rows

pytestmark = pytest.mark.integration

MIGRATORS = 6


@pytest.mark.parametrize("attempt", range(3))
def test_concurrent_migrations_on_a_fresh_database_all_succeed(pg_empty_dsn, attempt):
    """Six threads call migrate() on the same empty database, released together: every
    one returns, each migration is applied exactly once between them, and the ledger
    records each version once. (Before the fix most runs had a thread fail on the
    catalog's unique index.)"""
    start = threading.Barrier(MIGRATORS)
    applied: list[list[int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        start.wait()
        try:
            done = migrate(pg_empty_dsn)
        except BaseException as exc:  # reported below with the others
            with lock:
                errors.append(exc)
        else:
            with lock:
                applied.append(done)

    threads = [threading.Thread(target=run) for _ in range(MIGRATORS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert len(applied) == MIGRATORS
    versions = [version for version, _, _ in migrations()]
    assert sorted(v for done in applied for v in done) == versions  # each applied once
    assert [row[0] for row in db_rows(pg_empty_dsn, "SELECT version FROM dmq_schema_version ORDER BY version")] == versions
