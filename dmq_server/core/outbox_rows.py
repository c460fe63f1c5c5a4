"""The outbox relay's rules, without IO: which outboxes, and what each row becomes.

``--outbox NAME=APP_DSN`` (or ``NAME:SCHEMA=APP_DSN``) names an application database
whose outbox schema (``dmq outbox install``) this server relays. A row read there becomes
a ``Send`` of producer ``outbox:NAME:TAG``: TAG is the install's own random tag (the
outbox's ``installation`` table, version 2), its session id the row's id. The row ids
start at 1 again when an outbox is uninstalled and installed again; the tag makes each
install's numbering its own, so a new row 7 is never taken for a repeat of an earlier
install's row 7 (still stored under its pair within ``--message-retention``) and dropped.
A row the application gave its own ``session_id`` goes as producer ``outbox:NAME:own``
under that id, whatever the install: the application's numbers are its own, promised to
name one message each, across installs too. Two producers because an application's own
ids and the row ids are both just numbers: one producer would take row 7 for a repeat of
the message the application numbered 7 and drop it. A delayed row's producer ends in
``:delayed``: dmq records what a relay stored (schema version 13,
``dmq_outbox_relayed``) when the message enters the delay table, and its later move into
the topic is not a relay (the storing statement's record tests that suffix:
``sql/outbox/ledger.sql``, ``record_stored``).

A row's key, priority and headers (outbox version 3) are one JSON document in the row,
checked here by the rules of a SEND (``outbox_row``) and carried by its ``Send`` as a
SEND's are; a row whose document breaks a rule (written by hand: the client and the SQL
function check before they insert) is refused as a row of an unknown topic is.

Rows are published in runs: consecutive rows to one topic from one producer, at most
``max_run`` of them (the group commit's batch: ``GroupCommitWriter`` keeps a run that
fits in one transaction), an immediate run as one request (the broker checks a topic
once per request), a delayed row alone (a request has one due time). The runs keep the
rows' id order; the relay publishes a topic's runs one after another, so the rows of one
transaction are stored in the order it sent them (message ids rise with the row ids; a
run of the application's own session ids is stored in the order of those ids).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from dmq_client.wire.properties import (
    NO_PROPERTIES, Properties, PropertiesError, decode_properties, encode_properties,
)

__all__ = ["OutboxSource", "OutboxRow", "outbox_row", "parse_outbox", "producer_of", "relay_producers", "check_tag", "session_of",
           "runs", "MAX_NAME", "TAG"]

# the longest NAME: "outbox:" + NAME + ":" + TAG + ":delayed" (and ":own:delayed") stays
# within a producer id's 64 characters
MAX_NAME = 40
# an install's tag: 8 hex digits, 32 random bits (sql/outbox/0002_installation.sql); two
# installs of one outbox share one with a chance of 1 in 4 billion
TAG = re.compile(r"[0-9a-f]{8}")
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
    # the message's key, priority and headers and their wire text (Send.properties and
    # .status); a row whose stored properties break a rule has none and says why in
    # ``refused`` (it becomes a dead letter, never a message without them)
    properties: Properties = NO_PROPERTIES
    status: str = ""
    refused: str = ""


def outbox_row(row_id: int, topic: str, body: bytes, due_ms: int | None, session_id: int | None, created_ms: int,
               document: object) -> OutboxRow:
    """The row read with its properties ``document`` (the outbox's ``headers`` column since
    version 3: a JSON object of the fields a SEND's status has, as psycopg loads jsonb;
    None for none), checked by the rules of a SEND (``decode_properties``, strict: a field
    dmq does not know is refused, not dropped). The document is written again compact, as
    a client writes a status, before the check: jsonb's own text has spaces, and the
    4,096-byte bound is the wire's. The headers go in name order, as a stored message's
    pushes have them (``db.messages.stored_status``): one text for the message, whether
    its push comes from the relay's send or from a load out of PostgreSQL."""
    if document is None:
        return OutboxRow(row_id, topic, body, due_ms, session_id, created_ms)
    try:
        props = decode_properties(json.dumps(document, ensure_ascii=False, separators=(",", ":")))
        if len(props.headers) > 1:
            props = Properties(props.key, props.priority, dict(sorted(props.headers.items())))
        status = encode_properties(props)
    except PropertiesError as exc:
        return OutboxRow(row_id, topic, body, due_ms, session_id, created_ms, refused=exc.status())
    return OutboxRow(row_id, topic, body, due_ms, session_id, created_ms, props, status)


def producer_of(name: str, tag: str, row: OutboxRow) -> str:
    """The producer id the row is stored under, for the install tagged ``tag`` (see the
    module's docstring)."""
    producer = f"outbox:{name}:{tag}" if row.session_id is None else f"outbox:{name}:own"
    return producer + ":delayed" if row.due_ms is not None else producer


def relay_producers(name: str, tag: str) -> list[str]:
    """The producers of the rows numbered by the install tagged ``tag`` (immediate, delayed)."""
    return [f"outbox:{name}:{tag}", f"outbox:{name}:{tag}:delayed"]


def check_tag(schema: str, tag: object) -> str:
    """The install's tag as read from its ``installation`` table; ValueError if it is not
    one (a table changed by hand: relaying under it could take new rows for old ones)."""
    if not isinstance(tag, str) or not TAG.fullmatch(tag):
        raise ValueError(f"{schema}.installation holds {tag!r}, not an install tag of 8 hex digits: "
                         "run `dmq outbox install` again, or uninstall and install it")
    return tag


def session_of(row: OutboxRow) -> int:
    """The row's session id: the application's own, else the row's id."""
    return row.id if row.session_id is None else row.session_id


def runs(rows: list[OutboxRow], max_run: int) -> list[list[OutboxRow]]:
    """``rows`` (in id order) cut into runs published as one request each: consecutive
    immediate rows with one topic and producer together, at most ``max_run`` in one, each
    delayed row alone."""
    out: list[list[OutboxRow]] = []
    last: tuple[str, bool] | None = None
    for row in rows:
        key = (row.topic, row.session_id is None)  # the producer: numbered by the install or own
        if key == last and row.due_ms is None and len(out[-1]) < max_run:
            out[-1].append(row)
        else:
            out.append([row])
        last = key if row.due_ms is None else None  # a delayed row stands alone
    return out
