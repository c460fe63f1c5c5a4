"""What the outbox relays stored, in dmq's own database: read, dead-letter, forget.

``dmq_outbox_relayed`` (schema version 13) holds a (producer, session id) for every outbox
row stored and not yet known deleted from its outbox; the triggers of that migration write
it in the storing statement itself and skip a row recorded before, so the group commit
stays as it is. The relay (``dmq_server.protocols.outbox_relay``) asks here which rows of
a batch were recorded before (a relay that died between the store and the delete),
records the rows that cannot be stored as dead letters together with their record, and
forgets records once the rows' delete has committed in the application's database. The
statements are ``sql/outbox/ledger.sql``; each function runs on the relay's worker thread
(``db.worker.DbWorker``, autocommit: each statement is its own transaction).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import psycopg

from dmq_server.db.arrays import Int8Array, TextArray
from dmq_sql import load_queries

__all__ = ["RECORDING", "DeadRow", "relayed_before", "dead_letter_rows", "forget_relayed", "forget_and_check",
           "recorded_rows"]

_QUERIES = load_queries(resources.files("dmq_sql").joinpath("outbox", "ledger.sql").read_text(encoding="utf-8"))
# the parts db.messages and db.delays add to the group commit's storing statements for a
# batch that holds outbox rows (insert_outbox_messages, insert_outbox_delayed)
RECORDING = {name: _QUERIES[name] for name in ("record_stored", "stored_if_recorded", "record_new_stored",
                                                "record_delayed", "delayed_if_recorded")}

Pair = tuple[str, int]


@dataclass(frozen=True, slots=True)
class DeadRow:
    """An outbox row dmq cannot store, and why (the dead letter's detail)."""

    topic: str
    producer: str
    session_id: int
    body: bytes
    detail: str
    produced_ms: int


def _pairs(pairs: list[Pair]) -> dict[str, TextArray | Int8Array]:
    return {"producers": TextArray([p for p, _ in pairs]), "session_ids": Int8Array([s for _, s in pairs])}


def relayed_before(conn: psycopg.Connection, pairs: list[Pair]) -> set[Pair]:
    """Which of ``pairs`` are recorded: stored or dead-lettered before."""
    return {(row[0], row[1]) for row in conn.execute(_QUERIES["relayed_before"], _pairs(pairs))}


def dead_letter_rows(conn: psycopg.Connection, rows: list[DeadRow]) -> int:
    """Record ``rows`` as dead letters (reason ``client_reported``, the detail saying
    which outbox row and why) and as relayed, in one statement; a row recorded before is
    skipped. Returns how many dead letters were written."""
    params = {
        "topics": [r.topic for r in rows],
        "producers": [r.producer for r in rows],
        "session_ids": [r.session_id for r in rows],
        "bodies": [r.body for r in rows],
        "details": [r.detail for r in rows],
        "produced_ms": [r.produced_ms for r in rows],
    }
    return conn.execute(_QUERIES["dead_letter_rows"], params).rowcount


def forget_relayed(conn: psycopg.Connection, pairs: list[Pair]) -> int:
    """Drop the records of ``pairs`` (their outbox rows' delete has committed)."""
    return conn.execute(_QUERIES["forget_relayed"], _pairs(pairs)).rowcount


def forget_and_check(conn: psycopg.Connection, forget: list[Pair], check: list[Pair]) -> set[Pair]:
    """``forget_relayed(forget)`` (the rows of the batch before, their delete committed),
    then ``relayed_before(check)`` (the batch read with that delete): the relay's one call
    to a ledger a batch. Either list may be empty: its statement is not run."""
    if forget:
        forget_relayed(conn, forget)
    return relayed_before(conn, check) if check else set()


def recorded_rows(conn: psycopg.Connection, producers: list[str], limit: int) -> list[Pair]:
    """Up to ``limit`` records of ``producers``, lowest session id first."""
    return [(row[0], row[1]) for row in
            conn.execute(_QUERIES["recorded_rows"], {"producers": producers, "limit": limit})]
