"""A PostgreSQL connection driven by the reactor thread, for the hot statements.

A ``DbWorker`` thread costs the send path more than its statement: the worker must
take the GIL to start a batch, again when the result comes back, and the reactor
must be woken to answer it. The reactor thread holds the GIL most of the time
under load, and a thread waiting for it waits up to the interpreter's 5 ms switch
interval, so a 2 ms group commit took 5-20 ms of wall time (bench/reliable.py
``steady``). ``ReactorDb`` has no thread: it sends a statement on a non-blocking
libpq connection and reads the result when the reactor finds its socket readable,
so a batch is answered as soon as PostgreSQL has committed it.

It runs the same *steps* as ``steps.run_steps`` (sans-IO generators yielding
``Statement``s), one run at a time, in autocommit: each statement commits on its
own, which is what group commit and durable acks want. Parameters are sent in
binary with the types their casts name (``%(ids)b::bigint[]``); statements named
in ``prepare`` are prepared once per connection. A broken connection fails the
run in progress with ``StorageError`` and is re-opened (in a thread) by the next
run, so the server recovers from a PostgreSQL restart or failover without
restarting itself. A run PostgreSQL has not answered within ``timeout`` seconds
(``--pg-timeout``: a paused or hung server, a link that swallows packets) is failed
the same way, its connection dropped: its outcome is unknown, as for a broken one.

Why one long module: the socket, the run in progress and its deadline are one state
machine driven by the reactor's callbacks; split, each half would reach into the
other's state.
"""

from __future__ import annotations

import os
import re
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, TypeVar, cast

import psycopg
from psycopg import pq
from psycopg.abc import Transformer as PgTransformer
from psycopg.adapt import PyFormat, Transformer
from psycopg.pq.abc import PGconn, PGresult
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads, IReadWriteDescriptor
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from zope.interface import implementer

from dmq_server.core.clock import Clock, Timer
from dmq_server.db.outage import Outage
from dmq_server.db.storage_errors import StorageError, describe_error, storage_error
from dmq_server.db.steps import Rows, Statement, Steps
from dmq_server.db.deadline import Watchdog, hung_error
from dmq_server.db.worker import connect

__all__ = ["ReactorDb", "PreparedSql"]

log = Logger()

T = TypeVar("T")


class Reactor(Clock, Protocol):
    """What a ``ReactorDb`` asks of the reactor: timers, watching its socket, the
    thread pool it connects on (``callFromThread``: how that thread answers)."""

    def addReader(self, reader: ReactorDb) -> None: ...
    def removeReader(self, reader: ReactorDb) -> None: ...
    def addWriter(self, writer: ReactorDb) -> None: ...
    def removeWriter(self, writer: ReactorDb) -> None: ...
    def getThreadPool(self) -> ThreadPool: ...
    def callFromThread(self, callable: Callable[..., object], *args: object, **kwargs: object) -> None: ...

# %(name)s or %(name)b, optionally followed by a cast naming the parameter's type
_PLACEHOLDER = re.compile(r"%\((\w+)\)([sb])(?:::(\w+(?:\[\])?))?")


@dataclass(frozen=True)
class PreparedSql:
    """A statement with ``%(name)s`` placeholders rewritten to ``$n`` for libpq, and
    the type of each parameter (from its cast; text without one)."""

    query: bytes
    names: tuple[str, ...]
    oids: tuple[int, ...]

    @classmethod
    def parse(cls, sql: str) -> PreparedSql:
        names: list[str] = []
        oids: list[int] = []

        def number(match: re.Match) -> str:
            name, cast = match.group(1), match.group(3)
            oid = _oid(cast or "text")
            if name in names:
                index = names.index(name)
                if cast and oids[index] != oid:
                    raise ValueError(f"parameter {name!r} is cast to two types")
            else:
                names.append(name)
                oids.append(oid)
                index = len(names) - 1
            return f"${index + 1}" + (f"::{cast}" if cast else "")

        query = _PLACEHOLDER.sub(number, sql)
        if "%" in query.replace("%%", ""):
            raise ValueError("a % in the statement is not a %(name)s or %(name)b placeholder")
        return cls(query.replace("%%", "%").encode(), tuple(names), tuple(oids))


def _oid(type_name: str) -> int:
    array = type_name.endswith("[]")
    info = psycopg.adapters.types.get(type_name.removesuffix("[]"))
    if info is None:
        raise ValueError(f"unknown parameter type {type_name!r}")
    if info.name in ("int2", "int4"):
        # psycopg's binary int2/int4 dumpers wrap values that do not fit; sent as int8,
        # the statement's own cast refuses them ("integer out of range") as the
        # blocking path would
        info = psycopg.adapters.types["int8"]
    return info.array_oid if array else info.oid


class _Run:
    __slots__ = ("steps", "deferred", "count", "started")

    def __init__(self, steps: Steps[object], deferred: Deferred[object], started: float):
        self.steps = steps
        self.deferred = deferred
        self.count = False  # the statement in progress answers with its row count
        self.started = started  # for the deadline (``timeout``)


@implementer(IReadWriteDescriptor)
class ReactorDb:
    """One non-blocking connection; ``run_steps`` calls run one after another."""

    def __init__(self, reactor: Reactor, dsn: str, name: str, *, prepare: Sequence[str] = (),
                 timeout: float | None = None):
        self._reactor = reactor
        self.timeout = timeout if timeout and timeout > 0 else None
        self._deadline: Timer | None = None  # the one timer of the runs' deadlines (_check_deadline)
        self._dsn = dsn
        self.name = name
        self._prepare = tuple(prepare)
        self._parsed: dict[str, tuple[PreparedSql, PgTransformer]] = {}
        self._conn: psycopg.Connection | None = None
        self._pgconn: PGconn | None = None
        self._backend_pid: int | None = None
        self._fd = -1
        self._named: dict[str, bytes] = {}  # sql -> prepared statement name on this connection
        self._loader: PgTransformer | None = None
        self._queue: deque[tuple[Callable[..., Steps[object]], tuple[object, ...], Deferred[object]]] = deque()
        self._run: _Run | None = None
        self._outage = Outage(f"{name} (PostgreSQL connection)", reactor)
        self._results: list[PGresult] = []
        self._connecting = False
        self._stopped = False
        self._encoding = "utf-8"

    # -- the DbWorker interface the batchers use -------------------------------

    def start(self) -> None:
        self._stopped = False

    def stop(self) -> None:
        self._stopped = True
        self._close()
        self._cancel_deadline()
        if self._run is not None:  # its outcome is unknown: answered as a storage error
            run, self._run = self._run, None
            run.steps.close()
            run.deferred.errback(StorageError(f"{self.name}: stopped with a statement in progress"))
        self._fail_queued(StorageError(f"{self.name}: stopped"))

    def run_steps(self, steps_fn: Callable[..., Steps[T]], *args: object) -> Deferred[T]:
        """Deferred with what ``steps_fn(*args)`` returns once its statements ran,
        or a StorageError."""
        d: Deferred[T] = Deferred()
        if self._stopped:
            d.errback(StorageError(f"{self.name}: stopped"))
            return d
        # the queue holds runs of every result type, each Deferred fired with its own
        # steps' result: a pairing the element type cannot state (Deferred is invariant)
        self._queue.append((steps_fn, args, d))  # type: ignore[arg-type]
        self._next()
        return d

    def state(self) -> dict[str, bool | int]:
        """The connection as ``/metrics`` shows it: open, running a statement, calls queued."""
        return {"connected": self._pgconn is not None, "busy": self._run is not None, "queued": len(self._queue)}

    # -- running steps ----------------------------------------------------------

    def _next(self) -> None:
        if self._run is not None or self._connecting or self._stopped or not self._queue:
            return
        if self._pgconn is None:
            self._connect()
            return
        steps_fn, args, d = self._queue.popleft()
        try:
            steps = steps_fn(*args)
        except Exception as exc:
            d.errback(exc)
            self._next()
            return
        timeout = self.timeout
        if timeout is None:
            self._run = _Run(steps, d, 0.0)
        else:
            self._run = _Run(steps, d, self._reactor.seconds())
            if self._deadline is None:
                self._deadline = self._reactor.callLater(timeout, self._check_deadline)
        self._advance(None, None)

    def _check_deadline(self) -> None:
        """The deadline's one timer: fails the run in progress if it started ``timeout``
        ago, else waits for its deadline; an idle connection's next run arms it again. A
        timer kept across runs, not one per run: a group commit at 5,000 msgs/s runs
        about a thousand statements a second, and each ``callLater`` and ``cancel`` cost
        ~3.8 µs of the reactor thread besides the timer heap's upkeep."""
        self._deadline = None
        run, timeout = self._run, self.timeout
        if run is None or timeout is None:
            return
        left = run.started + timeout - self._reactor.seconds()
        if left > 0:
            self._deadline = self._reactor.callLater(left, self._check_deadline)
        else:
            hung = hung_error(self.name, timeout)
            self._broken(hung, hung)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            if self._deadline.active():
                self._deadline.cancel()
            self._deadline = None

    def _advance(self, rows: Rows | None, error: BaseException | None) -> None:
        """Hand the last statement's outcome to the steps and send what they yield next."""
        run = self._run
        assert run is not None
        try:
            if error is not None:
                stmt = run.steps.throw(error)
            elif rows is None:
                stmt = next(run.steps)
            else:
                stmt = run.steps.send(rows)
        except StopIteration as stop:
            self._finish(stop.value, None)
            return
        except Exception as exc:  # the steps gave up (or did not handle a statement's error)
            self._finish(None, exc)
            return
        try:
            self._send(stmt)
        except Exception as exc:
            if self._pgconn is not None and self._pgconn.status == pq.ConnStatus.OK:
                # nothing was sent (a parameter that cannot be converted, a bad statement)
                self._advance(None, exc)
            else:
                self._broken(exc)

    def _send(self, stmt: Statement) -> None:
        sql = stmt.sql  # the text of the statement's name (steps.STATEMENTS)
        pgconn = self._pgconn
        assert pgconn is not None  # a run is sent only on an open connection (_next)
        parsed, dumper = self._parse(sql)
        values = dumper.dump_sequence([stmt.params[n] for n in parsed.names], [PyFormat.BINARY] * len(parsed.names))
        formats = [pq.Format.BINARY] * len(values)
        name = self._named.get(sql)
        if name is not None:
            pgconn.send_query_prepared(name, values, param_formats=formats, result_format=pq.Format.BINARY)
        else:
            pgconn.send_query_params(
                parsed.query, values, param_types=parsed.oids, param_formats=formats,
                result_format=pq.Format.BINARY,
            )
        self._results = []
        if self._run is not None:
            self._run.count = stmt.count
        self.doWrite()

    def _parse(self, sql: str) -> tuple[PreparedSql, PgTransformer]:
        entry = self._parsed.get(sql)
        if entry is None:
            parsed = PreparedSql.parse(sql)
            dumper = Transformer()
            dumper.set_dumper_types(parsed.oids, pq.Format.BINARY)
            entry = self._parsed[sql] = (parsed, dumper)
        return entry

    def _statement_done(self) -> None:
        results, self._results = self._results, []
        for res in results:
            if res.status not in _SUCCESS:
                self._advance(None, _error(res, self._encoding))
                return
        rows: Rows = []
        if self._run is not None and self._run.count:
            rows = [(results[-1].command_tuples or 0 if results else 0,)]
        elif results and results[-1].status == pq.ExecStatus.TUPLES_OK:
            loader = self._loader
            assert loader is not None
            loader.set_pgresult(results[-1])
            rows = loader.load_rows(0, results[-1].ntuples, tuple)
        self._advance(rows, None)

    def _finish(self, result: object, error: BaseException | None) -> None:
        run, self._run = self._run, None  # the deadline's timer stays for the next run
        assert run is not None
        if error is None:
            run.deferred.callback(result)
        else:
            if isinstance(error, psycopg.Error):
                error = storage_error(self.name, error)
            # anything else is a bug, passed on as it is (as a DbWorker does) to be logged
            run.deferred.errback(error)
        self._next()

    # -- the socket ---------------------------------------------------------------

    def fileno(self) -> int:
        return self._fd

    def logPrefix(self) -> str:
        return f"ReactorDb({self.name})"

    def doRead(self) -> None:
        pgconn = self._pgconn
        if pgconn is None:
            return
        try:
            pgconn.consume_input()
            while self._run is not None and not pgconn.is_busy():
                res = pgconn.get_result()
                if res is None:
                    self._statement_done()  # may send the next statement, or finish the run
                else:
                    self._results.append(res)
            if self._pgconn is not pgconn:
                return  # a statement of the loop found the connection broken and dropped it
            if self._run is None and pgconn.status != pq.ConnStatus.OK:
                raise psycopg.OperationalError("connection lost")
        except psycopg.Error as exc:
            self._broken(exc)

    def doWrite(self) -> None:
        pgconn = self._pgconn
        if pgconn is None:
            return
        try:
            if pgconn.flush() == 0:
                self._reactor.removeWriter(self)
            else:  # the socket's buffer is full: the rest when it is writable
                self._reactor.addWriter(self)
        except psycopg.Error as exc:
            self._broken(exc)

    def connectionLost(self, reason: Failure) -> None:
        # the reactor is shutting down with the connection still registered
        self._broken(psycopg.OperationalError("connection closed by the reactor"))

    def _broken(self, exc: BaseException, error: StorageError | None = None) -> None:
        """The connection cannot be used: fail the run in progress (with ``error``, by
        default a StorageError saying what ``exc`` was); the next run reconnects."""
        if self._pgconn is not None:
            self._outage.failed(f"connection lost: {describe_error(exc)}")
        pid = self._backend_pid
        self._close()
        self._cancel_deadline()
        if self._run is not None:
            run, self._run = self._run, None
            run.steps.close()
            if error is None:
                error = StorageError(f"{self.name}: {describe_error(exc)}")
            error.backend_pid = pid  # the statement may still commit until that backend ends
            run.deferred.errback(error)
        self._next()

    def _close(self) -> None:
        if self._fd >= 0:
            self._reactor.removeReader(self)
            self._reactor.removeWriter(self)
            os.close(self._fd)
        self._fd = -1
        self._pgconn = None
        self._backend_pid = None
        self._named = {}
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # closing a dead connection may fail; nothing to do
                pass

    # -- connecting -------------------------------------------------------------------

    def _connect(self) -> None:
        self._connecting = True
        pool = self._reactor.getThreadPool()
        # IReactorFromThreads is a zope interface, nominal to mypy; Reactor holds the
        # callFromThread it needs, which the reactor provides
        d = deferToThreadPool(cast(IReactorFromThreads, self._reactor), pool, _open, self._dsn, self._prepare, self.timeout, self.name)
        d.addCallbacks(self._connected, self._connect_failed)

    def _connected(self, opened: tuple[psycopg.Connection, dict[str, bytes]]) -> None:
        self._connecting = False
        conn, named = opened
        if self._stopped:
            conn.close()
            return
        self._conn, self._named = conn, named
        self._backend_pid = conn.info.backend_pid
        self._outage.recovered()
        try:
            self._pgconn = conn.pgconn
            self._encoding = conn.info.encoding
            # the reactor watches a duplicate of libpq's socket: libpq closes its own
            # descriptor when it finds the connection broken, and epoll (and Twisted's
            # bookkeeping) must not be left holding a closed or reused number
            self._fd = os.dup(self._pgconn.socket)
            self._loader = Transformer(conn)
            self._reactor.addReader(self)
        except Exception as exc:  # e.g. out of file descriptors
            self._close()
            self._fail_queued(StorageError(f"{self.name}: {describe_error(exc)}"))
            return
        self._next()

    def _connect_failed(self, failure: Failure) -> None:
        self._connecting = False
        error = failure.value
        if not isinstance(error, StorageError):
            error = StorageError(f"{self.name}: {describe_error(error)}")
        self._outage.failed(error)
        # like a DbWorker call: what waits for this connection fails; the next run tries again
        self._fail_queued(error)

    def _fail_queued(self, error: StorageError) -> None:
        queued, self._queue = self._queue, deque()
        for _, _, d in queued:
            d.errback(StorageError(str(error)))


def _open(dsn: str, prepare: Sequence[str], timeout: float | None = None,
          name: str = "reactor") -> tuple[psycopg.Connection, dict[str, bytes]]:
    """Connect (blocking, on a pool thread), prepare the named statements, and
    switch the connection to non-blocking for the reactor. A server that accepted
    the connection but does not answer the prepares within ``timeout`` is cut off."""
    conn = connect(dsn, autocommit=True)
    watchdog = Watchdog(timeout, f"{name}-open")
    watchdog.arm(conn)
    try:
        named: dict[str, bytes] = {}
        for i, sql in enumerate(prepare):
            parsed = PreparedSql.parse(sql)
            prepared = f"dmq_hot_{i}".encode()
            res = conn.pgconn.prepare(prepared, parsed.query, parsed.oids)
            if res.status != pq.ExecStatus.COMMAND_OK:
                raise StorageError(f"cannot prepare a statement: {describe_error(_error(res, conn.info.encoding))}")
            named[sql] = prepared
        conn.pgconn.nonblocking = 1
    except BaseException as exc:
        conn.close()
        if watchdog.disarm():
            raise hung_error(name, timeout) from exc
        raise
    finally:
        watchdog.disarm()
        watchdog.close()
    return conn, named


_SUCCESS = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)


def _error(res: PGresult, encoding: str = "utf-8") -> psycopg.Error:
    """The psycopg exception for a failed result, as the blocking path raises it
    (UniqueViolation for 23505, ..., with its diagnostics)."""
    if res.status == pq.ExecStatus.FATAL_ERROR:
        return psycopg.errors.error_from_result(res, encoding=encoding)
    return psycopg.DatabaseError(f"unexpected result status {pq.ExecStatus(res.status).name}")
