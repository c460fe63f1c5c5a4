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

from dmq_server.core.errors import DmqError, Invalid, Refused, Unavailable, reply_for

__all__ = ["CliError", "open_database", "open_registry"]


#: a refused request's exit status: 2 for input to fix (as argparse's usage errors), 1
#: for anything else refused (a dead letter that is not there); 3 is for an unreachable
#: database or server, raised where it is found
_EXIT_STATUS = {Invalid: 2, Refused: 1, Unavailable: 3}


class CliError(Exception):
    """Ends a ``dmq`` command: the message goes to stderr, ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code

    @classmethod
    def of(cls, error: DmqError) -> "CliError":
        """The CLI's answer to an error of the family (``core.errors``)."""
        return cls(error.description, reply_for(error, _EXIT_STATUS, 1))


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


@contextmanager
def open_registry(args: argparse.Namespace) -> Iterator[Any]:
    """The registry the topic and channel commands manage: ZooKeeper with --zk (a
    cluster; every node mirrors it into its PostgreSQL within moments), else the
    PostgreSQL tables of a single node."""
    if args.zk:
        from registry.model import RegistryError
        from registry.zk import ZkRegistry, connect

        try:
            client = connect(args.zk, timeout=args.zk_timeout)
        except (RegistryError, ValueError) as exc:
            raise CliError(str(exc), 3) from exc
        zk_registry = ZkRegistry(client)
        try:
            yield zk_registry
        finally:
            zk_registry.close()
        return
    from registry.pg import PgRegistry

    with open_database(args) as conn:
        yield PgRegistry(conn)
