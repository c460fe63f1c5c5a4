"""The outbox relay's rules, without IO: which outboxes, and what each row becomes.

``--outbox NAME=APP_DSN`` (or ``NAME:SCHEMA=APP_DSN``) names an application database
whose outbox schema (``dmq outbox install``) this server relays. A row read there becomes
a ``Send`` of producer ``outbox:NAME``: its session id is the row's id, unless the
application gave the row its own ``session_id``; then the producer is ``outbox:NAME:own``.
Two producers because an application's own ids and the row ids are both just numbers: one
producer would take row 7 for a repeat of the message the application numbered 7 and
drop it. A delayed row's producer ends in ``:delayed``: dmq records what a relay stored
(schema version 13, ``dmq_outbox_relayed``) when the message enters the delay table, and
its later move into the topic is not a relay (the trigger there tests that suffix).

Rows are published in runs: consecutive rows to one topic from one producer, an
immediate run as one request (the broker checks a topic once per request), a delayed row
alone (a request has one due time). The runs keep the rows' id order, so the rows of one
transaction are stored in the order it sent them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["OutboxSource", "OutboxRow", "parse_outbox", "producer_of", "session_of", "runs", "MAX_NAME"]

# the longest NAME: "outbox:" + NAME + ":own:delayed" stays within a producer id's 64 characters
MAX_NAME = 40
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,%d}" % MAX_NAME)
# the installer's rule for a schema (dmq_server.db.outbox.check_schema)
_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,62}")
DEFAULT_SCHEMA = "dmq_outbox"


@dataclass(frozen=True, slots=True)
class OutboxSource:
    """One outbox to relay: its name (in the producer id), the schema it was installed
    as, and the application database's DSN."""

    name: str
    schema: str
    dsn: str

    def __repr__(self) -> str:  # the DSN may hold a password: never in a log line
        return f"OutboxSource(name={self.name!r}, schema={self.schema!r})"


def parse_outbox(entry: str) -> OutboxSource:
    """``NAME=DSN`` or ``NAME:SCHEMA=DSN`` (the first ``=`` ends the name, so a DSN of
    ``key=value`` pairs passes whole); ValueError saying what is wrong."""
    head, sep, dsn = entry.partition("=")
    if not sep or not dsn.strip():
        raise ValueError(f"{entry.split('=')[0]!r}: give NAME=APP_DSN or NAME:SCHEMA=APP_DSN")
    name, _, schema = head.partition(":")
    schema = schema or DEFAULT_SCHEMA
    if not _NAME.fullmatch(name):
        raise ValueError(f"outbox name {name!r}: use 1-{MAX_NAME} characters from [A-Za-z0-9_.-]")
    if not _SCHEMA.fullmatch(schema):
        raise ValueError(f"outbox {name}: schema {schema!r}: use 1-63 characters from [a-z0-9_], "
                         "not starting with a digit (as at `dmq outbox install --schema`)")
    return OutboxSource(name, schema, dsn.strip())


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """A committed outbox row as the relay read it."""

    id: int
    topic: str
    body: bytes
    due_ms: int | None  # Unix ms; None: deliver at once
    session_id: int | None  # the application's own id; None: the row's id
    created_ms: int  # when the application inserted it (the message's producer time)


def producer_of(name: str, row: OutboxRow) -> str:
    """The producer id the row is stored under (see the module's docstring)."""
    producer = f"outbox:{name}" if row.session_id is None else f"outbox:{name}:own"
    return producer + ":delayed" if row.due_ms is not None else producer


def session_of(row: OutboxRow) -> int:
    """The row's session id: the application's own, else the row's id."""
    return row.id if row.session_id is None else row.session_id


def runs(name: str, rows: list[OutboxRow]) -> list[list[OutboxRow]]:
    """``rows`` (in id order) cut into runs published as one request each: consecutive
    immediate rows with one topic and producer together, each delayed row alone."""
    out: list[list[OutboxRow]] = []
    last: tuple[str, str] | None = None
    for row in rows:
        key = (row.topic, producer_of(name, row))
        if out and key == last:
            out[-1].append(row)
        else:
            out.append([row])
        last = key if row.due_ms is None else None  # a delayed row stands alone
    return out
