"""The schema as the server sees it: ``dmq_sql.schema``'s migrations, failing as
``StorageError``, and the server's health check. The migration runner itself is shared
with the pipeline."""

from __future__ import annotations

import psycopg

from dmq_server.db.storage_errors import StorageError, describe_error
from dmq_server.db.steps import Statement, Steps
from dmq_server.db.worker import connect
from dmq_sql.schema import schema_version
from dmq_sql.schema import migrate as _migrate

__all__ = ["migrate", "schema_version", "ping_steps"]


def migrate(dsn: str, up_to: int | None = None) -> list[int]:
    """Apply every migration not yet recorded (up to version ``up_to``); returns the
    versions applied now."""
    with connect(dsn) as conn:
        try:
            return _migrate(conn, up_to)
        except psycopg.Error as exc:
            raise StorageError(f"migration failed: {describe_error(exc)}") from exc


def ping_steps() -> Steps:
    """Is the database answering? (``/ping``, the metrics' round trip)"""
    rows = yield Statement("ping", {})
    return rows[0][0] == 1
