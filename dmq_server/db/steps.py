"""Steps: database work written as a generator of ``Statement``s, sans-IO.

A steps generator yields statements and receives their rows (or has the error
thrown in); it never touches a connection. ``run_steps`` drives one over a blocking
connection (a ``DbWorker`` thread, tests, tools), ``dmq_server.db.reactor.ReactorDb``
drives the same steps from the reactor thread, and ``dmq_server.db.memory`` answers
them by name in unit tests: a statement carries the *name* of its query in
``sql/queries.sql`` (or of a variant registered with ``add_statement``), and the
runners look its text up in ``STATEMENTS``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Generator, Mapping, TypeVar

import psycopg
from psycopg.rows import TupleRow

from dmq_sql import queries

__all__ = ["Params", "Rows", "Statement", "Steps", "STATEMENTS", "add_statement", "run_steps"]

T = TypeVar("T")

# a statement's named parameters: handed to psycopg (or the in-memory double) as they are
Params = Mapping[str, object]
# what a steps generator receives for a statement: its rows as psycopg loads them (a
# tuple per row, []: none), each column's Python type named by the statement's SQL. A
# ``count`` statement answers with one row holding the number of rows it changed, so
# every statement's answer has the one shape and a step unpacks it without narrowing
Rows = list[TupleRow]

# name -> SQL text: every query of sql/queries.sql, and the variants the db modules
# derive from them (e.g. messages.INSERT_NEW_MESSAGES)
STATEMENTS: dict[str, str] = dict(queries)


def add_statement(name: str, sql: str) -> str:
    """Register a statement derived from queries.sql under its own name; returns the name."""
    if STATEMENTS.get(name, sql) != sql:
        raise ValueError(f"statement {name!r} registered twice with different text")
    STATEMENTS[name] = sql
    return name


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement of a steps generator, by the name of its query (``STATEMENTS``).

    ``may_fail``: the steps catch its error and go on, so inside a caller's
    transaction it runs in a savepoint. ``count``: the steps receive the number of
    rows the statement changed (one row, ``[(n,)]``) instead of its rows."""

    name: str
    params: Params
    may_fail: bool = False
    count: bool = False

    @property
    def sql(self) -> str:
        return STATEMENTS[self.name]


# yields Statements, receives each one's Rows (``[(n,)]`` for a ``count`` statement)
# or has its psycopg error thrown in; returns the result
Steps = Generator[Statement, Rows, T]


def _in_savepoint(conn: psycopg.Connection, stmt: Statement) -> psycopg.Cursor:
    """``stmt`` in a savepoint of the caller's transaction, begun by it if need be (as
    every statement on a connection that is not autocommit begins one). Not
    ``conn.transaction()``: on a connection with no transaction yet that is a transaction
    of its own, committed at once, and the caller's rollback would not take it back."""
    conn.execute("SAVEPOINT dmq_may_fail")
    try:
        cur = conn.execute(stmt.sql, stmt.params)
    except psycopg.Error:
        try:
            conn.execute("ROLLBACK TO SAVEPOINT dmq_may_fail")
        except psycopg.Error:
            pass  # the connection is gone: the error that matters is the statement's
        raise
    conn.execute("RELEASE SAVEPOINT dmq_may_fail")
    return cur


def run_steps(conn: psycopg.Connection, steps: Steps[T]) -> T:
    """Drive ``steps`` over a blocking connection; returns what the steps return."""
    advance: Callable[[], Statement] = functools.partial(next, steps)
    while True:
        try:
            stmt = advance()
        except StopIteration as stop:
            return stop.value
        try:
            if stmt.may_fail and not conn.autocommit:
                cur = _in_savepoint(conn, stmt)
            else:
                cur = conn.execute(stmt.sql, stmt.params)
            rows: Rows
            if stmt.count:
                rows = [(cur.rowcount,)]
            else:
                rows = cur.fetchall() if cur.description is not None else []
        except psycopg.Error as exc:
            advance = functools.partial(steps.throw, exc)
        else:
            advance = functools.partial(steps.send, rows)
