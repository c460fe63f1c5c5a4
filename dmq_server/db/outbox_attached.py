"""The outboxes attached at run time, in dmq's own database: attach, detach, read.

``dmq outbox attach NAME --dsn APP_DSN`` keeps an outbox in ``dmq_outbox_attached``
(schema version 14) instead of on each node's command line (``--outbox``): every node
reads the table (``protocols.outbox_relay.OutboxRelays``) and starts a relay for an
outbox attached, or stops the one of an outbox detached, without a restart. The table,
not ZooKeeper, holds the entries because an application DSN may hold a password;
ZooKeeper's ``/dmq/outbox`` (``registry.outboxes``) names them only, to tell a cluster's
nodes at once. The statements are ``sql/outbox/attached.sql``; each function takes a
connection to dmq's main database in autocommit (each statement its own transaction).
"""

from __future__ import annotations

from importlib import resources

import psycopg

from dmq_server.core.errors import Refused
from dmq_server.core.outbox_rows import OutboxSource
from dmq_sql import load_queries

__all__ = ["attach", "detach", "attached"]

_QUERIES = load_queries(resources.files("dmq_sql").joinpath("outbox", "attached.sql").read_text(encoding="utf-8"))


def attach(conn: psycopg.Connection, source: OutboxSource) -> None:
    """Attach ``source`` (checked by ``core.outbox_rows.parse_outbox``); Refused when its
    name is attached already (detach it first: two entries of one name would be two
    relays storing as one producer)."""
    found = conn.execute(_QUERIES["attach_outbox"],
                         {"name": source.name, "schema": source.schema, "dsn": source.dsn}).fetchone()
    if found is None:
        raise Refused(f"outbox {source.name!r} is attached already: `dmq outbox detach {source.name}` first")


def detach(conn: psycopg.Connection, name: str) -> OutboxSource:
    """Detach the outbox ``name``; returns what was attached. Refused when it was not."""
    found = conn.execute(_QUERIES["detach_outbox"], {"name": name}).fetchone()
    if found is None:
        raise Refused(f"no outbox {name!r} is attached (an outbox given with --outbox is "
                      "removed from that node's command line instead)")
    return OutboxSource(name, found[0], found[1])


def attached(conn: psycopg.Connection) -> list[OutboxSource]:
    """Every attached outbox, by name."""
    return [OutboxSource(row[0], row[1], row[2]) for row in conn.execute(_QUERIES["attached_outboxes"])]
