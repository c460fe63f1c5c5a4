"""Steps: database work written as a generator of ``Statement``s, sans-IO.

A steps generator yields statements and receives their rows (or has the error
thrown in); it never touches a connection. ``run_steps`` drives one over a blocking
connection (a ``DbWorker`` thread, tests, tools), ``dmq_server.db.reactor.ReactorDb``
drives the same steps from the reactor thread, and an in-memory double can answer
them by name in unit tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Generator, TypeVar

import psycopg

__all__ = ["Statement", "Steps", "run_steps"]

T = TypeVar("T")


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
