"""Consuming a message inside the application's own database transaction (the inbox).

A handler's writes and the record that it handled the message commit together, and the
ack goes to dmq only after that commit::

    with inbox.transaction(conn, message) as fresh:
        if fresh:
            conn.execute("INSERT INTO payments ...")   # the handler's business writes

``transaction`` begins a transaction on the caller's connection (psycopg 3, or a
SQLAlchemy 2 Session or Connection), inserts (channel, message id) into the inbox table
that ``dmq outbox install`` created, and yields True; the block's writes join the transaction, which commits when the block ends
(and rolls back, re-raising, when it raises: no record, no ack, so the redelivery runs the
handler again). Then it acknowledges the message. If the record exists already, the
message was handled and committed before but its ack was lost (a consumer killed between
its commit and its ack): it yields False, the caller skips the handler, and the message
is acknowledged. A redelivery that arrives while the first transaction is still open
waits on the record's key until that one commits (then False) or rolls back (then True):
PostgreSQL's unique index does the arbitration.

``atransaction`` is the same for asyncio, on psycopg's ``AsyncConnection`` or SQLAlchemy's
``AsyncSession`` or ``AsyncConnection`` (SQLAlchemy's asyncio needs its ``asyncio`` extra,
greenlet), acknowledging with the asyncio client's awaitable ``ack()`` after the commit::

    async with inbox.atransaction(aconn, message) as fresh:
        if fresh:
            await aconn.execute("INSERT INTO payments ...")

The key is (channel, message id). ``channel`` defaults to ``"<topic>/<channel>"``, since a
channel's name is unique only within its topic. Records are kept until an operator prunes
them (``dmq outbox prune-inbox --older-than 7d``): see docs/client.md for the bound.
"""

from __future__ import annotations

import inspect
from contextlib import asynccontextmanager, contextmanager
from typing import Any, AsyncIterator, Callable, Iterator

from .outbox import DEFAULT_SCHEMA, check_schema, driver_of

__all__ = ["atransaction", "transaction", "inbox_key"]


def inbox_key(message: Any, channel: str | None = None) -> tuple[str, str]:
    """(channel, message id) as stored: the id as text (dmq's numbers and NSQ's 16-byte
    ids alike)."""
    if channel is None:
        channel = f"{message.topic}/{message.channel}"
    elif not isinstance(channel, str) or not channel:
        raise ValueError(f"channel must be a non-empty string, got {channel!r}")
    message_id = message.message_id if hasattr(message, "message_id") else message.id
    if isinstance(message_id, (bytes, bytearray)):
        message_id = bytes(message_id).decode("ascii")
    return channel, str(message_id)


@contextmanager
def transaction(conn: Any, message: Any, *, channel: str | None = None,
                ack: Callable[[Any], Any] | None = None, schema: str = DEFAULT_SCHEMA) -> Iterator[bool]:
    """Run a handler's writes and the message's inbox record in one transaction on
    ``conn``, then acknowledge ``message``; yields whether the handler should run (False:
    handled and committed before).

    ``conn`` is a psycopg 3 ``Connection`` or a SQLAlchemy 2 ``Session`` or ``Connection``.
    ``message`` is an MqClient ``ReceivedMessage`` (acknowledged by its ``ack()``) or
    anything with ``topic``, ``channel`` and ``message_id`` plus an ``ack`` callable taking
    it: ``ack=client.ack`` for a blocking client's push. The transaction must be this
    helper's own: a connection already inside one is refused, since the ack must wait for a
    real commit, not a savepoint's release."""
    driver, ack, statement, params = _prepare(conn, message, channel, ack, schema, asynchronous=False)
    with conn.transaction() if driver == "psycopg" else conn.begin():
        yield conn.execute(statement, params).rowcount == 1
    ack(message)


@asynccontextmanager
async def atransaction(conn: Any, message: Any, *, channel: str | None = None,
                       ack: Callable[[Any], Any] | None = None, schema: str = DEFAULT_SCHEMA) -> AsyncIterator[bool]:
    """``transaction`` for asyncio: ``conn`` is a psycopg 3 ``AsyncConnection`` or a
    SQLAlchemy 2 ``AsyncSession`` or ``AsyncConnection``; ``message`` an ``AioMessage`` of
    ``dmq_client.aio`` (its ``ack()`` is awaited after the commit) or anything with the
    fields and an ``ack`` callable, whose result is awaited when it is awaitable."""
    driver, ack, statement, params = _prepare(conn, message, channel, ack, schema, asynchronous=True)
    async with conn.transaction() if driver == "psycopg" else conn.begin():
        yield (await conn.execute(statement, params)).rowcount == 1
    done = ack(message)
    if inspect.isawaitable(done):
        await done


def _prepare(conn: Any, message: Any, channel: str | None, ack: Callable[[Any], Any] | None, schema: str,
             *, asynchronous: bool) -> tuple[str, Callable[[Any], Any], Any, Any]:
    """What both forms check and run: the driver, the ack, and the record's statement
    and parameters in the driver's style."""
    check_schema(schema)
    driver = driver_of(conn, asynchronous=asynchronous)
    key = inbox_key(message, channel)
    if ack is None:
        ack = getattr(type(message), "ack", None)
        if ack is None:
            raise TypeError(f"{type(message).__name__} has no ack(): pass ack=, e.g. ack=client.ack")
    record = f"INSERT INTO {schema}.inbox (channel, message_id) VALUES "
    if driver == "psycopg":
        if not hasattr(conn, "transaction"):
            raise TypeError("inbox.transaction needs a psycopg 3 Connection, not a cursor")
        if conn.info.transaction_status.name != "IDLE":
            raise ValueError(_OPEN)
        return driver, ack, record + "(%s, %s) ON CONFLICT DO NOTHING", key
    from sqlalchemy import text  # the caller's object is SQLAlchemy's: it is imported already

    if conn.in_transaction():
        raise ValueError(_OPEN)
    params = {"channel": key[0], "message_id": key[1]}
    return driver, ack, text(record + "(:channel, :message_id) ON CONFLICT DO NOTHING"), params


_OPEN = ("inbox.transaction begins the transaction itself (the ack waits for its commit): "
         "commit or roll back the connection's open transaction first")
