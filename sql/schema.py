"""The schema: migrations applied in order, and the version a database is at.

Shared by the server (``dmq_server.db.schema``) and the pipeline, which migrates
before it writes its own tables. Failures leave as psycopg's errors.
"""

from __future__ import annotations

import psycopg

from . import migrations, queries

__all__ = ["migrate", "schema_version", "ping"]


def migrate(conn: psycopg.Connection, up_to: int | None = None) -> list[int]:
    """Apply every migration not yet recorded (up to version ``up_to``: tests and
    bench/migration.py build a database as an older server left it), in one
    transaction on ``conn``; returns the versions applied now."""
    applied_now: list[int] = []
    with conn.transaction():
        # the lock comes first: two nodes creating the ledger table at once race
        # in PostgreSQL's catalog (pg_type_typname_nsp_index) despite IF NOT EXISTS
        conn.execute(queries["lock_migrations"])
        conn.execute(queries["create_schema_version"])
        done = {row[0] for row in conn.execute(queries["schema_versions"])}
        for version, description, sql in migrations():
            if version in done or (up_to is not None and version > up_to):
                continue
            conn.execute(sql)
            conn.execute(queries["record_migration"], {"version": version, "description": description})
            applied_now.append(version)
    return applied_now


def schema_version(conn: psycopg.Connection) -> int:
    """The newest migration recorded (UndefinedTable before the first migration)."""
    rows = conn.execute(queries["schema_versions"]).fetchall()
    return rows[-1][0] if rows else 0


def ping(conn: psycopg.Connection) -> bool:
    row = conn.execute(queries["ping"]).fetchone()
    return row is not None and row[0] == 1
