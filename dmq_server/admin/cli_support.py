"""What every ``dmq`` subcommand shares: its error (with the exit status) and the
database it opens.

Its own module so that ``cli`` (the parser and the topic/channel commands) and
``cli_operations`` (dead letters, delays, clients) both use it without importing
each other.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = ["CliError", "open_database"]


class CliError(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


@contextmanager
def open_database(args: argparse.Namespace) -> Iterator[Any]:
    from dmq_server.db.errors import StorageError
    from dmq_server.db.schema import migrate
    from dmq_server.db.worker import connect

    embedded = None
    started_here = False
    dsn = args.pg_dsn
    try:
        if not dsn:
            from dmq_server.db.embedded import EmbeddedPostgres, EmbeddedPostgresError

            data_dir = Path(args.data_path).resolve()
            if not (data_dir / "pg").exists():
                raise CliError(
                    f"no dmq data under {data_dir}: start dmq-server there first, or pass --pg-dsn",
                    3,
                )
            embedded = EmbeddedPostgres(data_dir)
            started_here = not embedded.is_running()
            try:
                dsn = embedded.start()
            except EmbeddedPostgresError as exc:
                raise CliError(f"cannot start the embedded PostgreSQL: {exc}", 3) from exc
        try:
            migrate(dsn)
            conn = connect(dsn, autocommit=True)
        except StorageError as exc:
            raise CliError(str(exc), 3) from exc
        try:
            yield conn
        finally:
            conn.close()
    finally:
        if embedded is not None and started_here:
            embedded.stop()
