"""The PostgreSQL store (with ``reactor_db``, the only modules that import psycopg).

Most roles (backlog loader, admin, delay workers) get their own ``DbWorker``: one
thread holding one connection. Work for a role runs in order on its thread, so
the reactor never blocks on the database and a slow backlog scan never delays a
commit. A broken connection is dropped and re-opened on the next call, so the
server recovers from a PostgreSQL restart without restarting itself. Errors
leave this module as ``StorageError``.

The hot statements (group commit, durable acks) are written as *steps*: a
generator that yields ``Statement``s and receives their rows, sans-IO. ``run_steps``
drives them over a blocking connection (a ``DbWorker`` thread, tests, tools);
``reactor_db.ReactorDb`` drives the same steps from the reactor thread.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence, TypeVar

import psycopg
import psycopg.conninfo
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool

from dmq_sql import migrations, queries

__all__ = [
    "StorageError",
    "RefusedError",
    "storage_error",
    "describe_error",
    "DbWorker",
    "Statement",
    "Steps",
    "run_steps",
    "TopicRow",
    "StoredMessage",
    "NewMessage",
    "BacklogRow",
    "AckRow",
    "migrate",
    "connect",
    "list_topics",
    "insert_messages",
    "insert_messages_steps",
    "send_columns",
    "INSERT_NEW_MESSAGES",
    "HOT_STATEMENTS",
    "ack_deliveries_steps",
    "load_backlog",
    "sweep_messages",
    "run_query",
    "read_channel_state",
]

T = TypeVar("T")
log = Logger()


class StorageError(Exception):
    """PostgreSQL could not do what was asked; the message says what failed.

    Unless it is a ``RefusedError``, the outcome is *unknown*: a connection that
    broke after a statement was sent may have committed it (the answer was lost),
    so whoever wrote must find out from the store what is there.
    """


class RefusedError(StorageError):
    """PostgreSQL answered the statement with an error about its input (a data
    exception, a constraint, a limit): nothing of it was committed, and running the
    same input again fails the same way, so a batch that held it is split to find
    the rows at fault (see ``writer.GroupCommitWriter``)."""

    def __init__(self, message: str, sqlstate: str):
        super().__init__(message)
        self.sqlstate = sqlstate


# SQLSTATE classes that blame the statement's input, not the server or the link:
# 22 data exception, 23 integrity constraint, 54 program limit exceeded.
_INPUT_ERROR_CLASSES = ("22", "23", "54")


def storage_error(where: str, exc: BaseException) -> StorageError:
    """The StorageError for ``exc`` raised at ``where``: a RefusedError when the
    server answered with an input error (so the outcome is known: not committed)."""
    sqlstate = getattr(exc, "sqlstate", None)
    text = f"{where}: {describe_error(exc)}"
    if isinstance(exc, psycopg.Error) and sqlstate and sqlstate[:2] in _INPUT_ERROR_CLASSES:
        return RefusedError(text, sqlstate)
    return StorageError(text)


# A database host that vanishes without closing its connections (power, network
# partition) would otherwise hold a batch until the kernel gives up on TCP, many
# minutes later: keepalives find an idle connection dead in about 25 s, and
# tcp_user_timeout a connection whose sent statement stays unacknowledged for 30 s.
# A setting the DSN names itself wins.
DEAD_PEER_SETTINGS = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}


def connect(dsn: str, *, autocommit: bool = False, connect_timeout: int = 5) -> psycopg.Connection:
    """A connection with the settings dmq relies on (durable commits, UTC, dead peers noticed)."""
    try:
        given = psycopg.conninfo.conninfo_to_dict(dsn)
        conn = psycopg.connect(
            dsn,
            autocommit=autocommit,
            connect_timeout=connect_timeout,
            options="-c synchronous_commit=on -c TimeZone=UTC",
            application_name="dmq",
            **{k: v for k, v in DEAD_PEER_SETTINGS.items() if k not in given},
        )
    except psycopg.Error as exc:
        raise StorageError(f"cannot connect to PostgreSQL: {describe_error(exc)}") from exc
    return conn


def describe_error(exc: BaseException) -> str:
    """The first line of an error's text (psycopg's carry a context and hints after it)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else exc.__class__.__name__


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement of a steps generator. ``may_fail``: the steps catch its error
    and go on, so inside a caller's transaction it runs in a savepoint."""

    sql: str
    params: dict[str, Any]
    may_fail: bool = False


# yields Statements, receives each one's rows (a list of tuples, [] if it returns
# none) or has its psycopg error thrown in; returns the result
Steps = Generator[Statement, list, T]


def run_steps(conn: psycopg.Connection, steps: Steps) -> Any:
    """Drive ``steps`` over a blocking connection; returns what the steps return."""
    advance: Callable[[], Statement] = functools.partial(next, steps)
    while True:
        try:
            stmt = advance()
        except StopIteration as stop:
            return stop.value
        try:
            if stmt.may_fail and not conn.autocommit:
                with conn.transaction():
                    cur = conn.execute(stmt.sql, stmt.params)
            else:
                cur = conn.execute(stmt.sql, stmt.params)
            rows = cur.fetchall() if cur.description is not None else []
        except psycopg.Error as exc:
            advance = functools.partial(steps.throw, exc)
        else:
            advance = functools.partial(steps.send, rows)


class DbWorker:
    """One thread, one connection, calls run in submission order.

    By default each call runs in a transaction. With ``autocommit`` every statement
    commits on its own: for callers whose only write is one statement (group
    commit's insert, then at most a read of rows already stored; the ack batch's
    delete-and-log). It saves the BEGIN and COMMIT round trips, and with them two
    waits of the worker thread for the GIL, which the reactor thread holds most of
    the time under load.
    """

    def __init__(self, reactor: Any, dsn: str, name: str, *, autocommit: bool = False):
        self._reactor = reactor
        self._dsn = dsn
        self.name = name
        self.autocommit = autocommit
        self._pool = ThreadPool(minthreads=1, maxthreads=1, name=f"dmq-db-{name}")
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        self._pool.start()

    def stop(self) -> None:
        self._pool.stop()
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # closing a dead connection may fail; nothing to do
                pass
            self._conn = None

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Deferred:
        """Run ``fn(conn, *args)`` on this worker's thread, in a transaction unless
        the worker is ``autocommit``."""
        return deferToThreadPool(self._reactor, self._pool, self._call, fn, args, kwargs)

    def run_steps(self, steps_fn: Callable[..., Steps], *args: Any) -> Deferred:
        """Run the steps ``steps_fn(*args)`` on this worker's thread (as ``run`` does)."""
        return self.run(_steps_call, steps_fn, args)

    def _call(self, fn: Callable[..., T], args: Sequence[Any], kwargs: dict) -> T:
        with self._lock:
            if self._conn is None or self._conn.closed:
                self._conn = connect(self._dsn, autocommit=self.autocommit)
            conn = self._conn
            try:
                if self.autocommit:
                    return fn(conn, *args, **kwargs)
                with conn.transaction():
                    return fn(conn, *args, **kwargs)
            except StorageError:
                self._drop_if_broken(conn)
                raise
            except psycopg.Error as exc:
                self._drop_if_broken(conn)
                raise storage_error(self.name, exc) from exc

    def _drop_if_broken(self, conn: psycopg.Connection) -> None:
        if conn.closed or conn.broken or conn.info.transaction_status == psycopg.pq.TransactionStatus.UNKNOWN:
            try:
                conn.close()
            finally:
                self._conn = None


def _steps_call(conn: psycopg.Connection, steps_fn: Callable[..., Steps], args: Sequence[Any]) -> Any:
    return run_steps(conn, steps_fn(*args))


# -- schema ---------------------------------------------------------------


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


# -- registry -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TopicRow:
    name: str
    store: str
    msg_timeout_ms: int
    rate_limit: int | None
    ttl_ms: int | None
    max_attempts: int | None
    channels: tuple[str, ...]


def list_topics(conn: psycopg.Connection) -> list[TopicRow]:
    return [
        TopicRow(r[0], r[1], r[2], r[3], r[4], r[5], tuple(r[6]))
        for r in conn.execute(queries["list_topics"])
    ]


def ping(conn: psycopg.Connection) -> bool:
    return conn.execute(queries["ping"]).fetchone()[0] == 1


# -- messages -------------------------------------------------------------


@dataclass(slots=True)
class NewMessage:
    """A validated send waiting for the group commit."""

    topic: str
    producer: str
    session_id: int
    produced_ms: int
    body: bytes


@dataclass(slots=True)
class StoredMessage:
    """What the commit made of a NewMessage. ``duplicate``: it was stored before."""

    message_id: int
    published_ms: int
    channels: tuple[str, ...]
    duplicate: bool


# Resends are rare, and ON CONFLICT's speculative insertion costs PostgreSQL about a
# sixth of the statement's CPU per message (bench/insert_cost.py). So a batch is
# first inserted without it; only a batch that meets a stored pair (a unique
# violation, which inserts nothing) runs the statement as written in queries.sql.
_ON_CONFLICT = "ON CONFLICT (producer, session_id) DO NOTHING"
if queries["insert_messages"].count(_ON_CONFLICT) != 1:
    raise RuntimeError(f"sql/queries.sql: insert_messages must hold {_ON_CONFLICT!r} once")
INSERT_NEW_MESSAGES = queries["insert_messages"].replace(_ON_CONFLICT, "")


def send_columns(batch: Sequence[Any], node_id: str) -> dict[str, Any]:
    """The array parameters every stored send carries (insert_messages, insert_delayed):
    one list per column, in batch order, and the storing node."""
    return {
        "topics": [m.topic for m in batch],
        "producers": [m.producer for m in batch],
        "session_ids": [m.session_id for m in batch],
        "produced_ms": [m.produced_ms for m in batch],
        "bodies": [m.body for m in batch],
        "node_id": node_id,
    }


def insert_messages_steps(batch: Sequence[NewMessage], node_id: str) -> Steps:
    """Store a batch and its deliveries: one statement, atomic on its own (the
    writers run it in autocommit); resent pairs are then read back. One
    StoredMessage per item, in order."""
    params = send_columns(batch, node_id)
    try:
        rows = yield Statement(INSERT_NEW_MESSAGES, params, may_fail=True)
    except psycopg.errors.UniqueViolation:
        rows = yield Statement(queries["insert_messages"], params)
    fresh = {(r[1], r[2]): StoredMessage(r[0], r[3], tuple(r[4]), False) for r in rows}
    missing = [m for m in batch if (m.producer, m.session_id) not in fresh]
    if missing:
        found = yield Statement(
            queries["find_messages"],
            {
                "producers": [m.producer for m in missing],
                "session_ids": [m.session_id for m in missing],
            },
        )
        for r in found:
            fresh.setdefault((r[1], r[2]), StoredMessage(r[0], r[3], (), True))
    results = []
    seen: set[tuple[str, int]] = set()
    for m in batch:
        key = (m.producer, m.session_id)
        stored = fresh.get(key)
        if stored is None:
            raise StorageError(f"message {key} neither stored nor found")
        if key in seen and not stored.duplicate:
            # the same pair twice in one batch: the second is a resend
            stored = StoredMessage(stored.message_id, stored.published_ms, (), True)
        seen.add(key)
        results.append(stored)
    return results


# prepared once per connection by the reactor-driven writers and acker (reactor_db)
HOT_STATEMENTS = (INSERT_NEW_MESSAGES, queries["insert_messages"], queries["ack_deliveries"])


def insert_messages(
    conn: psycopg.Connection, batch: Sequence[NewMessage], node_id: str
) -> list[StoredMessage]:
    """``insert_messages_steps`` over a blocking connection."""
    return run_steps(conn, insert_messages_steps(batch, node_id))


@dataclass(slots=True)
class AckRow:
    topic: str
    channel: str
    message_id: int
    first_ms: int
    acked_ms: int
    attempts: int


def ack_deliveries_steps(acks: Sequence[AckRow]) -> Steps:
    """Drop the acknowledged delivery rows and log them: one statement. Returns how
    many acks the batch held (acks of rows already gone, e.g. acked twice, change nothing)."""
    yield Statement(
        queries["ack_deliveries"],
        {
            "topics": [a.topic for a in acks],
            "channels": [a.channel for a in acks],
            "message_ids": [a.message_id for a in acks],
            "first_ms": [a.first_ms for a in acks],
            "acked_ms": [a.acked_ms for a in acks],
            "attempts": [a.attempts for a in acks],
        },
    )
    return len(acks)


@dataclass(slots=True)
class BacklogRow:
    message_id: int
    producer: str
    session_id: int
    published_ms: int
    body: bytes
    attempts: int


def load_backlog(
    conn: psycopg.Connection,
    topic: str,
    channel: str,
    after: int,
    limit: int,
    owner: str | None = None,
) -> list[BacklogRow]:
    """A channel's stored copies after ``after``; in a cluster (``owner`` set) only the
    copies that node owns."""
    params = {"topic": topic, "channel": channel, "after": after, "limit": limit}
    if owner is None:
        rows = conn.execute(queries["load_backlog"], params).fetchall()
    else:
        rows = conn.execute(queries["load_owned_backlog"], dict(params, owner=owner)).fetchall()
    return [BacklogRow(r[0], r[1], r[2], r[3], bytes(r[4]), r[5]) for r in rows]


def run_query(conn: psycopg.Connection, name: str, params: dict[str, Any]) -> int:
    """Run the named statement of ``sql/queries.sql``; returns the rows it changed."""
    return conn.execute(queries[name], params).rowcount


def read_channel_state(
    conn: psycopg.Connection,
) -> tuple[dict[tuple[str, str], int], set[tuple[str, str]]]:
    """Stored copies per (topic, channel), and the channels an operator paused."""
    depths = {(t, c): n for t, c, n in conn.execute(queries["channel_depths"])}
    held = {(t, c) for t, c in conn.execute(queries["channel_pauses"])}
    return depths, held


def sweep_messages(conn: psycopg.Connection, retention_s: float, limit: int) -> int:
    cur = conn.execute(queries["sweep_messages"], {"retention_s": retention_s, "limit": limit})
    return cur.rowcount
