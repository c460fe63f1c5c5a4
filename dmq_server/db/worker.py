"""Blocking connections and the worker threads that hold them.

Most roles (backlog loader, admin, delay workers) get their own ``DbWorker``: one
thread holding one connection. Work for a role runs in order on its thread, so
the reactor never blocks on the database and a slow backlog scan never delays a
commit. A broken connection is dropped and re-opened on the next call, so the
server recovers from a PostgreSQL restart (or a failover: the DSN may list every
member of a Patroni cluster) without restarting itself.

A server that stops answering without closing its connections (a paused or hung
PostgreSQL, a link that drops packets after the kernel acknowledged them) would hold
a call forever: TCP keepalives and ``tcp_user_timeout`` only notice a peer whose
kernel went silent. So each call has a deadline (``--pg-timeout``): a
``deadline.Watchdog`` shuts the connection's socket down when it passes, the call
fails with a ``StorageError`` (outcome unknown) and the next call connects again,
maybe to another member.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence, TypeVar

import psycopg
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool

from dmq_server.db.deadline import Watchdog, hung_error
from dmq_server.db.storage_errors import StorageError, describe_error, storage_error
from dmq_server.db.steps import Steps, run_steps
from dmq_sql.connection import connect as shared_connect

__all__ = ["connect", "DbWorker"]

T = TypeVar("T")


#: The server's statements are short, and two of its periodic ones have plans whose estimated
#: cost passes PostgreSQL's jit_above_cost once the tables grow: JIT compiled the TTL cursors'
#: statement for 30 ms a call and the retention sweep for 0.3-0.45 s, each a core taken from
#: the group commit; the hot statements never reached it (pg_stat_statements,
#: docs/benchmarks.md, session 15). The pipeline keeps JIT.
SERVER_SETTINGS = {"jit": "off"}

#: A worker's transaction runs start to end on its thread, so one left idle this long is a
#: server frozen in it (SIGSTOP, a paused VM): PostgreSQL ends it, and the locks it holds go.
#: The group commit holds its node's owner row FOR SHARE until COMMIT, so a node frozen
#: between its insert and its COMMIT kept the takeover's claim of that row (``claim_owners``)
#: waiting until it woke (tests/chaos: node-pause-slow-taker, 60 s). Its sends were not
#: acknowledged: the producers resend them.
WORKER_SETTINGS = {**SERVER_SETTINGS, "idle_in_transaction_session_timeout": "10s"}


def connect(dsn: str, *, autocommit: bool = False, connect_timeout: int = 5,
            settings: dict[str, str] = SERVER_SETTINGS) -> psycopg.Connection:
    """A connection with the settings dmq relies on (durable commits, UTC, dead peers
    noticed: ``dmq_sql.connection``, shared with the pipeline; no JIT); StorageError if not."""
    try:
        return shared_connect(dsn, autocommit=autocommit, connect_timeout=connect_timeout,
                              settings=settings)
    except psycopg.Error as exc:
        raise StorageError(f"cannot connect to PostgreSQL: {describe_error(exc)}") from exc


class DbWorker:
    """One thread, one connection, calls run in submission order.

    By default each call runs in a transaction. With ``autocommit`` every statement
    commits on its own: for callers whose only write is one statement (group
    commit's insert, then at most a read of rows already stored; the ack batch's
    delete-and-log). It saves the BEGIN and COMMIT round trips, and with them two
    waits of the worker thread for the GIL, which the reactor thread holds most of
    the time under load.
    """

    def __init__(self, reactor: IReactorFromThreads, dsn: str, name: str, *, autocommit: bool = False,
                 timeout: float | None = None):
        self._reactor = reactor
        self._dsn = dsn
        self.name = name
        self.autocommit = autocommit
        self._pool = ThreadPool(minthreads=1, maxthreads=1, name=f"dmq-db-{name}")
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()
        self._watchdog = Watchdog(timeout, name)

    def start(self) -> None:
        self._pool.start()

    def stop(self) -> None:
        self._pool.stop()
        self._watchdog.close()
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # closing a dead connection may fail; nothing to do
                pass
            self._conn = None

    def state(self) -> dict[str, bool | int]:
        """The worker as ``/metrics`` shows it: its connection open, a call running,
        calls queued (read from the reactor thread; a moment stale at worst)."""
        conn = self._conn
        return {
            "connected": conn is not None and not conn.closed,
            "busy": bool(self._pool.working),
            "queued": self._pool.q.qsize(),
        }

    def run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> Deferred[T]:
        """Run ``fn(conn, *args)`` on this worker's thread, in a transaction unless
        the worker is ``autocommit``."""
        return deferToThreadPool(self._reactor, self._pool, self._call, fn, args, kwargs)

    def run_steps(self, steps_fn: Callable[..., Steps[T]], *args: object) -> Deferred[T]:
        """Run the steps ``steps_fn(*args)`` on this worker's thread (as ``run`` does)."""
        return self.run(_steps_call, steps_fn, args)

    def _call(self, fn: Callable[..., T], args: Sequence[object], kwargs: dict[str, object]) -> T:
        with self._lock:
            if self._conn is None or self._conn.closed:
                self._conn = connect(self._dsn, autocommit=self.autocommit, settings=WORKER_SETTINGS)
            conn = self._conn
            pid = conn.info.backend_pid
            self._watchdog.arm(conn)
            error: BaseException | None = None
            try:
                if self.autocommit:
                    result = fn(conn, *args, **kwargs)
                else:
                    with conn.transaction():
                        result = fn(conn, *args, **kwargs)
            except BaseException as exc:
                error = exc
            hung = self._watchdog.disarm()  # the deadline passed: the socket was cut under the call
            if hung:
                self._drop(conn)
            if error is None:
                return result  # answered as the deadline passed: a known outcome all the same
            if hung:
                failure = hung_error(self.name, self._watchdog.timeout)
                failure.backend_pid = pid  # the statement may still commit until that backend ends
                raise failure from error
            if isinstance(error, (StorageError, psycopg.Error)):
                self._drop_if_broken(conn)
            if isinstance(error, psycopg.Error):
                failure = storage_error(self.name, error)
                failure.backend_pid = pid  # a lost answer is settled once this backend is gone
                raise failure from error
            if isinstance(error, StorageError) and error.backend_pid is None:
                error.backend_pid = pid
            raise error

    def _drop_if_broken(self, conn: psycopg.Connection) -> None:
        if conn.closed or conn.broken or conn.info.transaction_status == psycopg.pq.TransactionStatus.UNKNOWN:
            self._drop(conn)

    def _drop(self, conn: psycopg.Connection) -> None:
        try:
            conn.close()
        except Exception:  # closing a cut connection may fail; nothing to do
            pass
        finally:
            self._conn = None


def _steps_call(conn: psycopg.Connection, steps_fn: Callable[..., Steps[T]], args: Sequence[object]) -> T:
    return run_steps(conn, steps_fn(*args))
