"""The delay table (``dmq_delay``): storing delayed sends, peeking at due times,
moving due rows into the reliable flow, and its statistics; all steps (``db.steps``),
so the in-memory double answers them too.

The scheduling around it (fragments, timers, polls) is ``dmq_server.reliable.delay``;
this module only builds the parameters, runs the named statements and turns rows
into values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import psycopg

from dmq_server.db.storage_errors import Fenced, Misplaced
from dmq_server.db.messages import OUTBOX_PRODUCERS, SendFields, send_columns, stored_status, with_outbox_record, with_properties
from dmq_server.db.outbox_ledger import RECORDING
from dmq_server.db.steps import Statement, Steps, add_statement, run_steps
from dmq_server.db.trace_steps import body_preview, properties_of_row
from dmq_sql import queries

__all__ = [
    "NewDelayed",
    "StoredDelay",
    "MovedMessage",
    "insert_delayed",
    "insert_delayed_steps",
    "peek_delayed_steps",
    "move_due",
    "move_due_steps",
    "delay_stats_steps",
    "list_delayed_steps",
    "due_histogram_steps",
    "deliver_delayed_now_steps",
    "cancel_delayed_steps",
]


@dataclass(slots=True)
class NewDelayed:
    """A delayed send waiting for its group commit: the send as it came (the broker's
    ``core.publish.Send``, or a ``messages.NewMessage`` of tests and tools: not copied
    field by field), when it is due and the delay fragment whose worker moves it. It is
    a ``SendFields`` itself, so ``send_columns`` reads it as any stored send."""

    send: SendFields
    due_ms: int
    fragment: int

    @property
    def topic(self) -> str:
        return self.send.topic

    @property
    def producer(self) -> str:
        return self.send.producer

    @property
    def session_id(self) -> int:
        return self.send.session_id

    @property
    def produced_ms(self) -> int:
        return self.send.produced_ms

    @property
    def body(self) -> bytes:
        return self.send.body

    @property
    def status(self) -> str:
        return self.send.status


@dataclass(slots=True)
class StoredDelay:
    """What the commit made of a NewDelayed. ``message_id`` is the delay entry's id;
    for a resend of a pair already moved into the reliable flow (``kind ==
    "message"``), the stored message's id."""

    message_id: int
    due_ms: int
    fragment: int
    duplicate: bool
    kind: str = "delay"


@dataclass(slots=True)
class MovedMessage:
    """A delayed row now stored as a message for ``channels``."""

    message_id: int
    topic: str
    producer: str
    session_id: int
    published_ms: int
    channels: tuple[str, ...]
    due_ms: int
    body: bytes = field(repr=False)
    owner: int = 0  # the incarnation that moved it (stored it as a message)
    # the row's own channel (a replayed dead letter's); None: for every channel of the
    # topic registered in the move's snapshot, which ``channels`` then names, as a group
    # commit's answer does (ReliableStore._confirm_channels counts it)
    channel: str | None = None
    status: str = ""  # its properties as its pushes carry them (db.messages.stored_status)
    key: str | None = None
    priority: int = 0  # 0 to 9, higher first, as the message was sent (a replay: as its dead letter kept it)


# insert_delayed for a batch holding outbox rows: records them as it stores them
INSERT_OUTBOX_DELAYED = with_outbox_record(
    queries["insert_delayed"], ")\nINSERT INTO dmq_delay", "  AND i.topic IN (SELECT name FROM placed)",
    RECORDING["record_delayed"], RECORDING["delayed_if_recorded"])
add_statement("insert_outbox_delayed", INSERT_OUTBOX_DELAYED)
# and both for a batch with properties (as insert_messages: db.messages.with_properties)
_PROPERTY_PARTS = (
    ("%(bodies)b::bytea[])", "%(bodies)b::bytea[], %(statuses)b::text[])"),
    ("AS u(topic, producer, session_id, produced_ms, due_ms, fragment, body)",
     "AS u(topic, producer, session_id, produced_ms, due_ms, fragment, body, status)"),
    ("INSERT INTO dmq_delay (fragment, due_ms, topic, producer, session_id, produced_ms, node_id, body)",
     "INSERT INTO dmq_delay (fragment, due_ms, topic, producer, session_id, produced_ms, node_id, body, key, priority, "
     "headers)"),
    ("i.produced_ms, %(node_id)s, i.body\n", "i.produced_ms, %(node_id)s, i.body, i.status::jsonb->>'key',\n"
     "       coalesce((i.status::jsonb->>'priority')::smallint, 0), i.status::jsonb->'headers'\n"),
)
_DELAYED_PROPERTY_STATEMENTS = {
    name: add_statement(f"{name}_props", with_properties(sql, _PROPERTY_PARTS))
    for name, sql in (("insert_delayed", queries["insert_delayed"]), ("insert_outbox_delayed", INSERT_OUTBOX_DELAYED))
}


def insert_delayed_steps(batch: Sequence[NewDelayed], node_id: str) -> Steps[list[StoredDelay | Misplaced]]:
    """Store a batch: one statement, atomic on its own (also in autocommit); one
    StoredDelay per item, in order. Steps, for the group commit."""
    params = {
        **send_columns(batch, node_id),
        "due_ms": [m.due_ms for m in batch],
        "fragments": [m.fragment for m in batch],
    }
    # a batch with outbox rows records them as it stores them (insert_outbox_delayed); a
    # row recorded before is not stored and is answered below as a resend, or as not
    # stored once its message was swept
    outbox = any(m.producer.startswith(OUTBOX_PRODUCERS) for m in batch)
    name = "insert_outbox_delayed" if outbox else "insert_delayed"
    rows = yield Statement(_DELAYED_PROPERTY_STATEMENTS[name] if "statuses" in params else name, params)
    fresh: dict[tuple[str, int], StoredDelay] = {}
    for delay_id, producer, session_id, due_ms in rows:
        fresh[(producer, session_id)] = StoredDelay(delay_id, due_ms, 0, False)
    missing = [m for m in batch if (m.producer, m.session_id) not in fresh]
    if missing:
        found = yield Statement(
            "find_delayed",
            {
                "producers": [m.producer for m in missing],
                "session_ids": [m.session_id for m in missing],
            },
        )
        for row_id, producer, session_id, due_ms, kind in found:
            fresh.setdefault((producer, session_id), StoredDelay(row_id, due_ms, 0, True, kind))
    results: list[StoredDelay | Misplaced] = []
    seen: set[tuple[str, int]] = set()
    for m in batch:
        key = (m.producer, m.session_id)
        stored = fresh.get(key)
        if stored is None:  # the statement stores only topics placed on its cluster
            results.append(Misplaced(f"topic {m.topic!r} is not placed on this cluster (moved): not stored, send again"))
            continue
        duplicate = stored.duplicate or key in seen
        seen.add(key)
        results.append(StoredDelay(stored.message_id, stored.due_ms, m.fragment, duplicate, stored.kind))
    return results


def insert_delayed(conn: psycopg.Connection, batch: Sequence[NewDelayed], node_id: str) -> list[StoredDelay | Misplaced]:
    """``insert_delayed_steps`` over a blocking connection (tests, tools)."""
    return run_steps(conn, insert_delayed_steps(batch, node_id))


def _fragment_params(fragments: Sequence[int], max_fragment: int) -> dict:
    return {
        "fragments": list(fragments),
        # the worker holding the highest fragment also serves rows above it, left by
        # a larger --delay-fragments earlier or given by a CLI with another setting
        "overflow": max_fragment in fragments,
        "max_fragment": max_fragment,
    }


def peek_delayed_steps(fragments: Sequence[int], max_fragment: int, until_ms: int, limit: int) -> Steps[list[int]]:
    """Due times (ms) in ``fragments`` up to ``until_ms``, soonest first, at most ``limit``."""
    params = _fragment_params(fragments, max_fragment)
    params.update(until_ms=until_ms, limit=limit)
    return [r[0] for r in (yield Statement("peek_delayed", params))]


def move_due_steps(
    fragments: Sequence[int], max_fragment: int, now_ms: int, limit: int, node_id: str, owner: int
) -> Steps[tuple[int, list[MovedMessage]]]:
    """Move up to ``limit`` rows due by ``now_ms`` into the reliable flow (run in a
    transaction: a ``DbWorker``'s), as messages of incarnation ``owner``. Returns (rows
    taken, messages stored); rows whose channels are all gone became dead letters and
    are counted but not returned. A retired owner moves nothing (``Fenced``)."""
    params = _fragment_params(fragments, max_fragment)
    params.update(now_ms=now_ms, limit=limit, node_id=node_id, owner=owner)
    rows = yield Statement("move_due", params)
    taken = rows[0][0] if rows else 0
    if not taken:
        owners = yield Statement("owner_states", {})
        if not any(r[0] == owner and not r[2] for r in owners):
            raise Fenced(f"incarnation {owner} was retired: it moves no delayed message any more")
    moved = [
        MovedMessage(r[1], r[2], r[3], r[4], r[5], tuple(r[6]), r[7], bytes(r[8]), owner, r[9],
                     stored_status(r[10], r[11], r[12]), r[10], r[11])
        for r in rows
        if r[1] is not None
    ]
    return taken, moved


def move_due(
    conn: psycopg.Connection, fragments: Sequence[int], max_fragment: int, now_ms: int, limit: int, node_id: str, owner: int
) -> tuple[int, list[MovedMessage]]:
    """``move_due_steps`` over a blocking connection, in its transaction (tests, tools)."""
    return run_steps(conn, move_due_steps(fragments, max_fragment, now_ms, limit, node_id, owner))


def delay_stats_steps() -> Steps:
    return [
        {"fragment": r[0], "pending": r[1], "next_due_ms": r[2], "last_due_ms": r[3]}
        for r in (yield Statement("delay_stats", {}))
    ]


# -- for operators: browse, deliver now, cancel (the console's delay view) ----------------


def list_delayed_steps(
    topic: str | None, after_due: int, after_id: int, limit: int, preview: int = 256
) -> Steps:
    """Waiting entries in due-time order after the keyset ``(after_due, after_id)``, each
    with the properties its message will have."""
    rows = yield Statement(
        "list_delayed",
        {"topic": topic, "after_due": after_due, "after_id": after_id, "limit": limit, "preview": preview},
    )
    return [
        {"delay_id": r[0], "topic": r[1], "channel": r[2], "producer": r[3], "session_id": r[4],
         "due_ms": r[5], "fragment": r[6], "replay_of": r[9], **properties_of_row(*r[10:13]),
         **body_preview(r[8], r[7])}
        for r in rows
    ]


def due_histogram_steps(topic: str | None, now_ms: int, width_ms: int) -> Steps:
    """``[(bucket, count)]``: waiting entries by due time in buckets of ``width_ms`` from
    ``now_ms`` (bucket 0 also holds what is already due)."""
    rows = yield Statement("delay_due_histogram", {"topic": topic, "now_ms": now_ms, "width_ms": width_ms})
    return [(int(b), int(n)) for b, n in rows]


def deliver_delayed_now_steps(ids: Sequence[int], now_ms: int) -> Steps:
    """Make the entries due now; returns the ids changed (gone or already due: not listed)."""
    return [r[0] for r in (yield Statement("deliver_delayed_now", {"ids": list(ids), "now_ms": now_ms}))]


def cancel_delayed_steps(ids: Sequence[int]) -> Steps:
    """Delete the entries before they fall due; returns the ids deleted."""
    return [r[0] for r in (yield Statement("cancel_delayed", {"ids": list(ids)}))]
