"""The pipeline's connector: the only module of dmq_pipeline that imports psycopg.

The Spark driver keeps one autocommit connection for bookkeeping (archive
batches, validation, progress); executors open their own with
:func:`executor_connection` (replay records what it sent). The same DSN is
turned into the JDBC URL and properties that Spark's JDBC source uses, and
:meth:`Database.render` binds a ``jdbc_*`` query's parameters as SQL literals
client-side, because Spark passes ``dbtable`` to PostgreSQL as text.
"""

from __future__ import annotations

from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

import psycopg
from psycopg.conninfo import conninfo_to_dict

from dmq_sql import load_queries
from dmq_sql.connection import connect, describe_error
from dmq_sql.embedded import EmbeddedPostgres, EmbeddedPostgresError
from dmq_sql.schema import migrate, schema_version

from .errors import DatabaseUnreachable, PipelineError, UsageError

__all__ = ["Database", "dsn_host", "locate", "executor_connection", "queries"]

#: The pipeline's named queries (``sql/pipeline.sql``).
queries: dict[str, str] = load_queries(
    resources.files("dmq_sql").joinpath("pipeline.sql").read_text(encoding="utf-8")
)


def executor_connection(dsn: str) -> psycopg.Connection:
    """An autocommit connection for code running on a Spark executor."""
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=10,
                               application_name="dmq-pipeline-executor")
    except psycopg.Error as exc:
        raise DatabaseUnreachable(f"cannot connect to PostgreSQL: {describe_error(exc)}") from exc


def mark_replayed(conn: psycopg.Connection, ids: list[int], message_ids: list[int]) -> int:
    """Record replayed dead letters; returns how many were not recorded before."""
    return conn.execute(queries["mark_replayed"], {"ids": ids, "message_ids": message_ids}).rowcount


def dsn_host(dsn: str) -> str | None:
    """The host a DSN names (None for none; a Unix socket directory starts with /)."""
    try:
        return conninfo_to_dict(dsn).get("host") or None
    except psycopg.ProgrammingError as exc:
        raise UsageError(f"--pg-dsn: {describe_error(exc)}") from None


class Database:
    """dmq's PostgreSQL as seen by the pipeline driver."""


    def check_topic_channel(self, topic: str, channel: str) -> None:
        """UsageError for a topic or channel filter naming nothing registered, so a
        job refuses a typo before Spark starts instead of reporting an empty range."""
        topics = self.topics()
        if topic and topic not in topics:
            known = ", ".join(sorted(topics)) or "none"
            raise UsageError(f"unknown topic {topic!r} (registered: {known})")
        if channel:
            channels = topics.get(topic, ()) if topic else {c for names in topics.values() for c in names}
            if channel not in channels:
                where = f"on topic {topic!r}" if topic else "on any topic"
                raise UsageError(f"unknown channel {channel!r} {where}")

    def __init__(self, dsn: str):
        self.dsn = dsn
        self._conn: psycopg.Connection | None = None

    # -- connection -----------------------------------------------------------
    @property
    def conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            try:
                self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5,
                                             application_name="dmq-pipeline",
                                             options="-c TimeZone=UTC")
            except psycopg.Error as exc:
                raise DatabaseUnreachable(f"cannot connect to PostgreSQL: {describe_error(exc)}") from exc
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def one(self, name: str, **params: Any) -> tuple:
        return self._run(name, params).fetchone()

    def all(self, name: str, **params: Any) -> list[tuple]:
        return self._run(name, params).fetchall()

    def execute(self, name: str, **params: Any) -> int:
        return self._run(name, params).rowcount

    def _run(self, name: str, params: dict[str, Any]) -> psycopg.Cursor:
        try:
            return self.conn.execute(queries[name], params or None)
        except psycopg.OperationalError as exc:
            raise DatabaseUnreachable(f"{name}: {describe_error(exc)}") from exc
        except psycopg.Error as exc:
            raise PipelineError(f"{name}: {describe_error(exc)}") from exc

    @contextmanager
    def transaction(self) -> Iterator["Database"]:
        """Run the enclosed calls in one transaction (rolled back on an exception)."""
        try:
            with self.conn.transaction():
                yield self
        except psycopg.OperationalError as exc:
            raise DatabaseUnreachable(describe_error(exc)) from exc

    def schema_version(self) -> int:
        try:
            with self.conn.transaction():
                return schema_version(self.conn)
        except psycopg.errors.UndefinedTable:
            return 0

    def migrate(self) -> None:
        try:
            conn = connect(self.dsn)
        except psycopg.Error as exc:
            raise DatabaseUnreachable(f"cannot connect to PostgreSQL: {describe_error(exc)}") from exc
        with conn:
            try:
                migrate(conn)
            except psycopg.Error as exc:
                raise PipelineError(f"migration failed: {describe_error(exc)}") from exc

    def topics(self) -> dict[str, tuple[str, ...]]:
        """Registered topics and their channels."""
        from registry.pg import list_topics

        with self.conn.transaction():
            return {row.name: row.channels for row in list_topics(self.conn)}

    def rate_limits(self) -> dict[str, int | None]:
        """Each registered topic's rate limit (messages per second per node; None: none)."""
        from registry.pg import list_topics

        with self.conn.transaction():
            return {row.name: row.rate_limit for row in list_topics(self.conn)}

    # -- Spark's view -------------------------------------------------------------
    def render(self, name: str, **params: Any) -> str:
        """Query ``name`` with its parameters bound as literals (for Spark's ``dbtable``)."""
        text = "\n".join(line for line in queries[name].splitlines() if not line.startswith("--"))
        return psycopg.ClientCursor(self.conn).mogrify(text, params)

    @property
    def jdbc_url(self) -> str:
        info = conninfo_to_dict(self.dsn)
        host = dsn_host(self.dsn) or ""
        if not host or host.startswith("/") or "," in host:
            raise UsageError(
                f"the DSN must name one TCP host for Spark's JDBC reads (got host {host or 'none'!r})"
            )
        if ":" in host:
            host = f"[{host}]"
        port = info.get("port") or "5432"
        dbname = info.get("dbname") or info.get("user") or "postgres"
        return f"jdbc:postgresql://{host}:{port}/{dbname}"

    @property
    def jdbc_properties(self) -> dict[str, str]:
        info = conninfo_to_dict(self.dsn)
        props = {
            "driver": "org.postgresql.Driver",
            "ApplicationName": "dmq-pipeline",
            # server-prepared from the first execution, so rows arrive in binary: bodies
            # as bytes rather than hex text, times as integers (about a third faster)
            "prepareThreshold": "-1",
        }
        for key, prop in (("user", "user"), ("password", "password"), ("sslmode", "sslmode")):
            if info.get(key):
                props[prop] = str(info[key])
        if "password" not in props and self.conn.info.password:
            # JDBC reads no libpq password file (the embedded database's DSN names one):
            # hand it the password libpq used for our own connection
            props["password"] = self.conn.info.password
        return props


@contextmanager
def locate(pg_dsn: str, data_path: str) -> Iterator[Database]:
    """The database named by ``--pg-dsn``, else the embedded one under ``--data-path``.

    An embedded PostgreSQL that is not running is started for the job and
    stopped afterwards, as the ``dmq`` admin command does.
    """
    embedded = None
    started_here = False
    dsn = pg_dsn
    try:
        if not dsn:
            data_dir = Path(data_path).resolve()
            if not (data_dir / "pg").exists():
                raise DatabaseUnreachable(
                    f"no dmq data under {data_dir}: pass --pg-dsn, or --data-path of a dmq-server"
                )
            embedded = EmbeddedPostgres(data_dir)
            started_here = not embedded.is_running()
            try:
                dsn = embedded.start()
            except EmbeddedPostgresError as exc:
                raise DatabaseUnreachable(f"cannot start the embedded PostgreSQL: {exc}") from exc
        db = Database(dsn)
        try:
            db.conn  # fail now, before anything else happens
            yield db
        finally:
            db.close()
    finally:
        if embedded is not None and started_here:
            embedded.stop()
