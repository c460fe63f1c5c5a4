"""The schema: migrations in order, and the version a database is at."""

from __future__ import annotations

import psycopg

from dmq_server.db.errors import StorageError, describe_error
from dmq_server.db.worker import connect
from dmq_sql import migrations, queries

__all__ = ["migrate", "schema_version", "ping"]


def migrate(dsn: str) -> list[int]:
    """Apply every migration not yet recorded; returns the versions applied now."""
    applied_now: list[int] = []
    with connect(dsn) as conn:
        try:
            with conn.transaction():
                # the lock comes first: two nodes creating the ledger table at once race
                # in PostgreSQL's catalog (pg_type_typname_nsp_index) despite IF NOT EXISTS
                conn.execute(queries["lock_migrations"])
                conn.execute(queries["create_schema_version"])
                done = {row[0] for row in conn.execute(queries["schema_versions"])}
                for version, description, sql in migrations():
                    if version in done:
                        continue
                    conn.execute(sql)
                    conn.execute(
                        queries["record_migration"],
                        {"version": version, "description": description},
                    )
                    applied_now.append(version)
        except psycopg.Error as exc:
            raise StorageError(f"migration failed: {describe_error(exc)}") from exc
    return applied_now


def schema_version(conn: psycopg.Connection) -> int:
    rows = conn.execute(queries["schema_versions"]).fetchall()
    return rows[-1][0] if rows else 0


def ping(conn: psycopg.Connection) -> bool:
    return conn.execute(queries["ping"]).fetchone()[0] == 1
