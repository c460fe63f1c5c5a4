"""Sending a message inside the application's own database transaction (the outbox).

``send(conn, topic, body)`` adds the message to the outbox table that ``dmq outbox
install`` created in the application's database, through that schema's SQL function
``send``: one INSERT in the caller's transaction, nothing committed here. If the
transaction rolls back the message never existed; once it commits, dmq's relay moves it
into the topic. So an order and its "order created" are written together or not at all.

``conn`` is the caller's: a psycopg 3 ``Connection`` (or cursor), or a SQLAlchemy 2
``Session`` or ``Connection``. This module imports neither library (dmq-client is
standard library only): a psycopg object is used through its ``execute``; SQLAlchemy's
``text`` is imported only when the caller handed over a SQLAlchemy object, which means it
is loaded already. The statement is written here, not in ``sql/``, because the client
ships without dmq's SQL package; it only calls the installed function.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from .wire import valid_name
from .wire.properties import Properties, PropertiesError, encode_properties

__all__ = ["DEFAULT_SCHEMA", "send", "check_schema", "driver_of"]

DEFAULT_SCHEMA = "dmq_outbox"

# the installer's rule (dmq_server.db.outbox): lower case, so it is used unquoted
_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_MAX_SESSION_ID = 2**63 - 1


def check_schema(schema: str) -> str:
    if not isinstance(schema, str) or not _SCHEMA.fullmatch(schema):
        raise ValueError(f"invalid outbox schema name {schema!r}: use 1-63 characters from [a-z0-9_], "
                         "not starting with a digit (as at `dmq outbox install --schema`)")
    return schema


def driver_of(conn: Any, *, asynchronous: bool = False) -> str:
    """``"psycopg"`` or ``"sqlalchemy"``: which library ``conn`` belongs to, by its class's
    module (so neither is imported to find out); TypeError for anything else, async
    objects included (their execute must be awaited), or, ``asynchronous``, only async
    ones (psycopg's ``AsyncConnection``, SQLAlchemy's ``AsyncSession`` or ``AsyncConnection``:
    ``inbox.atransaction``)."""
    module = type(conn).__module__
    name = type(conn).__name__
    if name.startswith("Async") and not asynchronous:
        raise TypeError(f"{name} is asynchronous: call outbox.send through its run_sync, or with a "
                        "synchronous connection")
    if asynchronous:
        if not name.startswith("Async"):
            raise TypeError(f"{name} is not asynchronous: use inbox.transaction with it")
        name = name[len("Async"):]
    if module.split(".")[0] == "psycopg" and hasattr(conn, "execute"):
        return "psycopg"
    if module.split(".")[0] == "sqlalchemy" and name in ("Session", "Connection"):
        return "sqlalchemy"
    raise TypeError(f"need a psycopg 3 Connection or cursor, or a SQLAlchemy Session or Connection; "
                    f"got {module}.{name}")


def in_transaction_psycopg(conn: Any) -> bool:
    """Would a statement on ``conn`` (psycopg) join an open transaction, or start one that
    the caller commits? False only for autocommit outside ``conn.transaction()``."""
    connection = getattr(conn, "connection", conn)  # a cursor's connection
    return not connection.autocommit or connection.info.transaction_status.name != "IDLE"


def _delay_ms(delay: Any) -> int | None:
    if delay is None:
        return None
    if isinstance(delay, datetime.timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, (int, float)) and not isinstance(delay, bool):
        seconds = float(delay)
    else:
        raise TypeError(f"delay must be seconds (a number) or a timedelta, not {type(delay).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"delay must be 0 or more seconds, got {delay!r}")
    return round(seconds * 1000)


def _body(body: Any) -> bytes:
    if isinstance(body, str):
        return body.encode("utf-8")
    if isinstance(body, (bytes, bytearray, memoryview)):
        return bytes(body)
    raise TypeError(f"body must be bytes or str, not {type(body).__name__}")


def _properties(key: str | None, priority: int, headers: Mapping[str, str] | None) -> Properties:
    """The message's properties, checked by the rules of a SEND (``PropertiesError``)."""
    if headers is not None and not isinstance(headers, Mapping):
        raise PropertiesError(f"headers must be a mapping of names to texts, not {type(headers).__name__}")
    props = Properties(key, priority, dict(headers or {}))
    encode_properties(props)  # every rule, the 4,096-byte bound of the whole included
    return props


def send(conn: Any, topic: str, body: bytes | str, *, delay: float | datetime.timedelta | None = None,
         session_id: int | None = None, key: str | None = None, priority: int = 0,
         headers: Mapping[str, str] | None = None, schema: str = DEFAULT_SCHEMA) -> None:
    """Add a message for ``topic`` to the outbox, in ``conn``'s current transaction.

    ``body`` is bytes (a str is sent as UTF-8). ``delay``: seconds (or a timedelta) after
    the send until it is due. ``session_id``: your own id for the message (0 to 2**63-1),
    under which the relay is to store it once however often it relays it; by default the
    relay numbers it. ``key``, ``priority`` and ``headers``: the message's properties, as
    ``BlockingClient.send`` takes them (``dmq_client.wire.properties``: a key of 1-255
    bytes, priority 0-9, at most 32 headers), checked before the insert: a broken rule is a
    ``PropertiesError`` and nothing is inserted. A message with any of them needs the
    outbox at version 3 (``dmq outbox install`` brings it there). Nothing is committed: the
    message leaves when the caller's transaction commits, and never if it rolls back. A
    psycopg connection in autocommit mode outside ``conn.transaction()`` is refused (the
    message would be committed on its own)."""
    if not isinstance(topic, str) or not valid_name(topic):
        raise ValueError(f"invalid topic name {topic!r}: use 1-64 characters from [.a-zA-Z0-9_-], "
                         "optionally ending in #ephemeral")
    if session_id is not None and (
        isinstance(session_id, bool) or not isinstance(session_id, int) or not 0 <= session_id <= _MAX_SESSION_ID
    ):
        raise ValueError(f"session_id must be a whole number from 0 to 2**63-1, got {session_id!r}")
    props = _properties(key, priority, headers)
    params = {"topic": topic, "body": _body(body), "delay_ms": _delay_ms(delay), "session_id": session_id}
    # the properties' arguments only for a message that has some: a message without them
    # is the call of outbox versions 1 and 2 too
    extra = ""
    if props:
        params.update(key=props.key, priority=props.priority,
                      headers=json.dumps(dict(props.headers), ensure_ascii=False) if props.headers else None)
        extra = ", key => {key}, priority => {priority}, headers => {headers}"
    check_schema(schema)
    if driver_of(conn) == "psycopg":
        if not in_transaction_psycopg(conn):
            raise ValueError("outbox.send needs a transaction: this connection is in autocommit mode; "
                             "send inside `with conn.transaction():`")
        conn.execute(f"SELECT {schema}.send(%(topic)s, %(body)s::bytea, %(delay_ms)s::bigint, %(session_id)s::bigint"
                     + extra.format(key="%(key)s::text", priority="%(priority)s::integer",
                                    headers="%(headers)s::jsonb") + ")", params)
        return
    from sqlalchemy import text  # the caller's object is SQLAlchemy's: it is imported already

    conn.execute(text(f"SELECT {schema}.send(:topic, CAST(:body AS bytea), CAST(:delay_ms AS bigint), "
                      "CAST(:session_id AS bigint)"
                      + extra.format(key="CAST(:key AS text)", priority="CAST(:priority AS integer)",
                                     headers="CAST(:headers AS jsonb)") + ")"), params)
