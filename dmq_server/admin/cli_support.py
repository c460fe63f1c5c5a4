"""What every ``dmq`` subcommand shares: its error (with the exit status) and the
database it opens.

Its own module so that ``cli`` (the parser and the topic/channel commands) and
``cli_operations`` (dead letters, delays, clients) both use it without importing
each other.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from dmq_server.core.errors import DmqError, Invalid, Refused, Unavailable, reply_for

__all__ = ["CliError", "open_database", "open_registry", "cluster_dsns", "connect_cluster", "open_clusters", "cluster_of_id",
           "admin_get"]


#: a refused request's exit status: 2 for input to fix (as argparse's usage errors), 1
#: for anything else refused (a dead letter that is not there); 3 is for an unreachable
#: database or server, raised where it is found
_EXIT_STATUS: dict[type[DmqError], int] = {Invalid: 2, Refused: 1, Unavailable: 3}


class CliError(Exception):
    """Ends a ``dmq`` command: the message goes to stderr, ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code

    @classmethod
    def of(cls, error: DmqError) -> "CliError":
        """The CLI's answer to an error of the family (``core.errors``)."""
        return cls(error.description, reply_for(error, _EXIT_STATUS, 1))


def admin_get(args: argparse.Namespace, path: str) -> dict[str, object]:
    """``GET /admin/PATH`` of the running server at --http-address (with --admin-token),
    its JSON object; CliError 1 when it refuses, 3 when none answers."""
    request = urllib.request.Request(f"http://{args.http_address}/admin/{path}")
    if args.admin_token:
        request.add_header("Authorization", f"Bearer {args.admin_token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            answer = json.load(resp)
    except urllib.error.HTTPError as exc:
        try:
            message = json.load(exc).get("message", exc.reason)
        except ValueError:
            message = exc.reason
        raise CliError(f"server refused: {message}", 1) from exc
    except (OSError, ValueError) as exc:
        raise CliError(f"no server reachable at http://{args.http_address}: {exc}", 3) from exc
    if not isinstance(answer, dict):
        raise CliError(f"http://{args.http_address}/admin/{path} answered no JSON object", 3)
    return answer


@contextmanager
def open_database(args: argparse.Namespace) -> Iterator[Any]:
    from dmq_server.db.storage_errors import StorageError
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


def cluster_dsns(args: argparse.Namespace) -> dict[str, str]:
    """The CLI's ``--pg-cluster NAME=DSN`` entries (besides main), checked as the server does."""
    from dmq_server.core.options import ConfigError, Options

    entries: list[str] = []
    for raw in args.pg_cluster or ():
        entries += [e.strip() for e in raw.replace(";", "\n").splitlines() if e.strip()]
    try:
        return Options(pg_cluster=tuple(entries)).validate().pg_clusters
    except ConfigError as exc:
        raise CliError(str(exc), 2) from exc


def connect_cluster(name: str, dsn: str) -> Any:
    from dmq_server.db.storage_errors import StorageError
    from dmq_server.db.worker import connect

    try:
        return connect(dsn, autocommit=True)
    except StorageError as exc:
        raise CliError(f"cluster {name!r}: {exc}", 3) from exc


@contextmanager
def open_clusters(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Connections to the main cluster and to every ``--pg-cluster``, by name; only the
    one ``--cluster`` names when given (refused when it is not among them)."""
    from contextlib import ExitStack

    wanted = getattr(args, "cluster", None)
    others = cluster_dsns(args)
    if wanted is not None and wanted != "main" and wanted not in others:
        raise CliError(f"cluster {wanted!r} is not given: add --pg-cluster {wanted}=DSN", 2)
    with ExitStack() as stack:
        conns = {"main": stack.enter_context(open_database(args))}
        for name, dsn in others.items():
            if wanted in (None, name):
                conns[name] = stack.enter_context(connect_cluster(name, dsn))
        if wanted is not None and wanted != "main":
            conns.pop("main")
        yield conns


def cluster_of_id(args: argparse.Namespace, any_id: int) -> str:
    """The cluster that drew ``any_id`` (a message, delay or dead letter id), from the
    slots the main cluster's database records."""
    from registry.pg import clusters

    with open_database(args) as conn:
        by_slot = {slot: name for name, slot in clusters(conn).items()}
    return by_slot.get(any_id >> 48, "main")
