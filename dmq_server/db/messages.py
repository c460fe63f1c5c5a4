"""The reliable store's hot statements: group commit, durable acks, backlog reads.

The group commit and the ack batch are steps (``dmq_server.db.steps``), so the
reactor-driven connection and the worker threads run the same code.

Delivery state is a cursor per (topic, channel, owner) (migration 0007): a stored
message is one row owned by the incarnation that stored it, an acknowledgement moves
its channel's cursor (``CursorProgress``, computed by the node that holds the copies in
memory), and a backlog read is an index range above the cursor.

Why one long module: the rows each statement takes and returns (``NewMessage``,
``AckRow``, ``BacklogRow``…) are defined beside the steps that pack them into the
statements' array parameters, which ``sql/queries.sql`` names one for one; split, a
parameter and its column would be read in different files.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from dataclasses import dataclass
from operator import attrgetter
from typing import Mapping, NotRequired, Protocol, Sequence, TypedDict

import psycopg

from dmq_client.wire.properties import NO_PROPERTIES, PRIORITY_MAX, Properties, PropertiesError, encode_properties

from dmq_server.db.arrays import ByteaArray, Int4Array, Int8Array, TextArray, TextRuns
from dmq_server.db.outbox_ledger import RECORDING
from dmq_server.db.seek import seek_bounds_steps
from dmq_server.db.storage_errors import Fenced, Misplaced, StorageError
from dmq_server.db.steps import Params, Rows, Statement, Steps, add_statement, run_steps
from dmq_sql import queries

__all__ = [
    "NewMessage",
    "SendFields",
    "SendColumns",
    "StoredMessage",
    "BacklogRow",
    "AckRow",
    "AckRun",
    "CursorProgress",
    "OwnerState",
    "create_owner",
    "create_owner_steps",
    "retire_silent_owners_steps",
    "owner_heartbeat_steps",
    "read_owners_steps",
    "backends_alive_steps",
    "empty_channel_steps",
    "insert_messages",
    "insert_messages_steps",
    "send_columns",
    "INSERT_NEW_MESSAGES",
    "ACK_NEW_DELIVERIES",
    "insert_params",
    "holds_outbox_rows",
    "with_outbox_record",
    "OUTBOX_PRODUCERS",
    "HOT_STATEMENTS",
    "ack_deliveries_steps",
    "load_backlog_steps",
    "load_priority_backlog_steps",
    "NOTHING_AHEAD",
    "SweepTarget",
    "sweep_plan_steps",
    "sweep_topic_steps",
    "prune_owners_steps",
    "sweep_all_steps",
    "run_query_steps",
    "read_channel_state_steps",
    "depth_slice_steps",
    "MAX_ID",
]




@dataclass(slots=True)
class NewMessage:
    """A send to store, as tests and tools name one (the server's group commit stores
    ``core.publish.Send``s as they are: both are ``SendFields``)."""

    topic: str
    producer: str
    session_id: int
    produced_ms: int
    body: bytes
    properties: Properties = NO_PROPERTIES

    @property
    def status(self) -> str:
        """The properties as a send carries them (what the group commit stores)."""
        return encode_properties(self.properties)


@dataclass(slots=True)
class StoredMessage:
    """What the commit made of a NewMessage. ``duplicate``: it was stored before."""

    message_id: int
    published_ms: int
    channels: tuple[str, ...]
    duplicate: bool


# Resends are rare, and ON CONFLICT's speculative insertion costs PostgreSQL about a
# sixth of the statement's CPU per message (bench/insert_cost.py). So a batch is
# first inserted without it; only a batch that meets a stored pair (a unique
# violation, which inserts nothing) runs the statement as written in queries.sql.
_ON_CONFLICT = "ON CONFLICT (producer, session_id) DO NOTHING"
if queries["insert_messages"].count(_ON_CONFLICT) != 1:
    raise RuntimeError(f"sql/queries.sql: insert_messages must hold {_ON_CONFLICT!r} once")
INSERT_NEW_MESSAGES = queries["insert_messages"].replace(_ON_CONFLICT, "")
# its own name, so the in-memory double answers it (a stored pair: a unique violation)
add_statement("insert_new_messages", INSERT_NEW_MESSAGES)

def with_outbox_record(statement: str, before_cte: str, where: str, record: str, condition: str) -> str:
    """``statement`` (insert_messages, insert_delayed) as it runs for a batch that holds
    outbox rows (schema version 15): the CTE ``claimed`` (``record``, a part of
    sql/outbox/ledger.sql) put before the one that ``before_cte`` starts, and ``condition``
    added to the ``where`` of the insert that stores; each text must occur once."""
    if statement.count(before_cte) != 1 or statement.count(where) != 1:
        raise RuntimeError(f"sql/queries.sql: a storing statement must hold {before_cte!r} and {where!r} once")
    record, condition = (_without_comments(part) for part in (record, condition))
    # the condition first: the record's own text may hold ``where``
    return statement.replace(where, f"{where}\n  AND {condition}").replace(
        before_cte, f"), claimed AS (\n{record}\n{before_cte}")


def _without_comments(sql: str) -> str:
    return "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))


# A batch holding outbox rows records them as it stores them (insert_outbox_messages: the
# record first, and only the rows recorded now stored). The first try is
# insert_new_messages recording the outbox rows it stored (record_new_stored): a pair stored
# or recorded before is a unique violation, and insert_outbox_messages runs instead. The
# record stores only what the rows would, so the rows' gate (the owner, the placed topics,
# the ordered ones locked) becomes a CTE that both read: evaluated once, as the rows' is.
_GATE = re.compile(r"\n    WHERE topic <> ALL\((CASE WHEN EXISTS .*? END)\)\n    ON CONFLICT", re.S)
_FIRST_CTE = "WITH ins AS ("
_GATED = "WHERE topic <> ALL((SELECT misplaced FROM gate)::text[])"


def with_gate_cte(statement: str) -> str:
    """insert_messages with its rows' gate as the CTE ``gate`` (one row: ``misplaced``)."""
    gates = _GATE.findall(statement)
    if len(gates) != 1 or statement.count(_FIRST_CTE) != 1:
        raise RuntimeError(f"sql/queries.sql: insert_messages must start {_FIRST_CTE!r} and gate its rows once")
    statement = _GATE.sub(lambda _: f"\n    {_GATED}\n    ON CONFLICT", statement)
    return statement.replace(_FIRST_CTE, f"WITH gate AS MATERIALIZED (\n    SELECT {gates[0]} AS misplaced\n), ins AS (")


INSERT_OUTBOX_MESSAGES = with_outbox_record(
    with_gate_cte(queries["insert_messages"]), "), ins AS (", _GATED,
    RECORDING["record_stored"], RECORDING["stored_if_recorded"])
add_statement("insert_outbox_messages", INSERT_OUTBOX_MESSAGES)
_ANSWER = "\n)\nSELECT id, producer, session_id, (SELECT (extract(epoch FROM now()) * 1000)::bigint)"
if INSERT_NEW_MESSAGES.count(_ANSWER) != 1:
    raise RuntimeError(f"sql/queries.sql: insert_messages must end its CTEs with {_ANSWER!r} once")
INSERT_NEW_OUTBOX_MESSAGES = INSERT_NEW_MESSAGES.replace(
    _ANSWER, f"\n), claimed AS (\n{_without_comments(RECORDING['record_new_stored'])}{_ANSWER}")
add_statement("insert_new_outbox_messages", INSERT_NEW_OUTBOX_MESSAGES)


# A batch in which some send has properties (key, priority, headers: schema version 16)
# stores them with insert_messages' ``_props`` variants: one more array, each send's status
# as it came (checked then), from which PostgreSQL takes the three columns. The text goes
# as it is because the server's time is the scarcer: writing the headers again as their
# column's JSON cost ~3 us a message in Python (json.dumps), reading the status as jsonb
# costs PostgreSQL's backends a little more instead. A batch without properties runs the
# statements as written and pays nothing for them (the columns' defaults: NULL, 0, NULL).
_PROPERTY_PARTS = (
    ("INSERT INTO dmq_message (topic, producer, session_id, produced_at, node_id, owner, body)",
     "INSERT INTO dmq_message (topic, producer, session_id, produced_at, node_id, owner, body, key, priority, headers)"),
    ("%(node_id)s, %(owner)s::integer, body\n",
     "%(node_id)s, %(owner)s::integer, body, props->>'key', coalesce((props->>'priority')::smallint, 0),\n"
     "           props->'headers'\n"),
    ("unnest(%(bodies)b::bytea[]) AS body",
     "unnest(%(bodies)b::bytea[]) AS body,\n                 unnest(%(statuses)b::text[])::jsonb AS props"),
)


def with_properties(statement: str, parts: Sequence[tuple[str, str]] = _PROPERTY_PARTS) -> str:
    """``statement`` storing a batch's properties too: each of ``parts``' texts (which must
    occur once) replaced by its version with the three columns."""
    for old, new in parts:
        if statement.count(old) != 1:
            raise RuntimeError(f"sql/queries.sql: a storing statement must hold {old!r} once")
        statement = statement.replace(old, new)
    return statement


#: the statements a batch with properties runs, by the name of the one without
PROPERTY_STATEMENTS = {
    name: add_statement(f"{name}_props", with_properties(sql)) for name, sql in (
        ("insert_messages", queries["insert_messages"]), ("insert_new_messages", INSERT_NEW_MESSAGES),
        ("insert_outbox_messages", INSERT_OUTBOX_MESSAGES), ("insert_new_outbox_messages", INSERT_NEW_OUTBOX_MESSAGES))
}

# the producers of outbox rows (dmq_server.core.outbox_rows): the lowest such id sorts
# first among them, so a sorted batch holds one if the first id not below it starts so
OUTBOX_PRODUCERS = "outbox:"


def holds_outbox_rows(sorted_producers: Sequence[str]) -> bool:
    """Whether a batch's producers, in sorted order, hold an outbox producer: one search,
    not a test per message (every batch asks)."""
    i = bisect_left(sorted_producers, OUTBOX_PRODUCERS)
    return i < len(sorted_producers) and sorted_producers[i].startswith(OUTBOX_PRODUCERS)

# Likewise an ack batch holds a repeat (an ack of a copy done before: a redelivery after a
# restart or a takeover) only rarely, and the part of ack_deliveries that builds the log's
# row again from the new acks alone is prepared and set up on every execution: ~240,000
# of PostgreSQL's ~1,050,000 instructions a statement (bench/pg_cost.py --batch 1, session
# 27). So a batch is first tried without that part, with a guard that divides by zero
# when not every ack is new: the statement fails whole (nothing applied, nothing logged)
# and ack_deliveries as written runs instead.
_REBUILD = re.compile(r"\n    UNION ALL\n    -- some ack was done before.*?\n    HAVING count\(\*\) > 0\n", re.S)
_TAKEN = "WHERE NOT EXISTS (SELECT 1 FROM saved s WHERE"
if len(_REBUILD.findall(queries["ack_deliveries"])) != 1 or queries["ack_deliveries"].count(_TAKEN) != 1:
    raise RuntimeError("sql/queries.sql: ack_deliveries must hold its rebuild branch and its taken-cursor query once")
ACK_NEW_DELIVERIES = _REBUILD.sub("\n", queries["ack_deliveries"]).replace(
    _TAKEN, "WHERE (SELECT 1 / all_new::integer FROM batch) = 1  -- a repeat: division by zero\n  AND " + _TAKEN[6:]
)
add_statement("ack_new_deliveries", ACK_NEW_DELIVERIES)


_PAIR = attrgetter("producer", "session_id")


class SendFields(Protocol):
    """What every stored send carries: the server's ``core.publish.Send`` (the group
    commit stores the sends as the broker made them, not a copy), a ``NewMessage`` of
    tests and tools, or a delayed one (``delays.NewDelayed``); ``send_columns`` and
    ``insert_messages_steps`` read these fields and no others."""

    @property
    def topic(self) -> str: ...
    @property
    def producer(self) -> str: ...
    @property
    def session_id(self) -> int: ...
    @property
    def produced_ms(self) -> int: ...
    @property
    def body(self) -> bytes: ...
    @property
    def status(self) -> str: ...  # its properties' wire text ("" for none), stored as it is


class SendColumns(TypedDict):
    """``send_columns``' parameters: one array per column, and the storing node; the
    sends' statuses only for a batch with properties (the ``_props`` statements)."""

    topics: TextArray
    producers: TextArray
    session_ids: Int8Array
    produced_ms: Int8Array
    bodies: ByteaArray
    node_id: str
    statuses: NotRequired[TextArray]  # each the properties' JSON text, or None for none


def send_columns(batch: Sequence[SendFields], node_id: str) -> SendColumns:
    """The array parameters every stored send carries (insert_messages, insert_delayed):
    one list per column, in batch order, and the storing node. The statuses when some
    send has properties: a send without has an empty one, so the batches without cost
    one count, not a test per send."""
    columns: SendColumns = {
        "topics": TextArray([m.topic for m in batch]),
        "producers": TextArray([m.producer for m in batch]),
        "session_ids": Int8Array([m.session_id for m in batch]),
        "produced_ms": Int8Array([m.produced_ms for m in batch]),
        "bodies": ByteaArray([m.body for m in batch]),
        "node_id": node_id,
    }
    statuses = [m.status for m in batch]
    if statuses.count("") != len(statuses):
        columns["statuses"] = TextArray([status or None for status in statuses])
    return columns


def headers_text(headers: Mapping[str, str]) -> str | None:
    """A message's headers as their column's JSON text (None for none: one spelling)."""
    return json.dumps(headers, ensure_ascii=False, separators=(",", ":")) if headers else None


def stored_status(key: str | None, priority: int, headers: Mapping[str, str] | None) -> str:
    """The status a stored message's pushes carry, from its three columns ("" for none).
    Every stored value was checked when it came in; one that no longer passes (written
    by hand into the table) is pushed without properties rather than failing its load.
    The headers in name order: jsonb keeps its own order, and one text for one message
    whichever store answered it (the in-memory double keeps the order sent)."""
    if key is None and not priority and not headers:
        return ""
    try:
        return encode_properties(Properties(key, priority, dict(sorted(headers.items())) if headers else {}))
    except PropertiesError:
        return ""


class InsertParams(SendColumns):
    """``insert_params``: the columns, the storing incarnation, the batch's topics once each."""

    owner: int
    batch_topics: TextArray


def insert_params(batch: Sequence[SendFields], node_id: str, owner: int) -> InsertParams:
    """insert_messages' parameters for ``batch``. The rows are sorted by pair: the
    statement inserts them in the order sent, and that order is what keeps two writers
    from deadlocking on a pair both insert (see the statement); its answer is matched by
    pair, not by place. The batch's topics go once each, on their own."""
    columns = send_columns(sorted(batch, key=_PAIR), node_id)
    return {**columns, "owner": owner, "batch_topics": TextArray(dict.fromkeys(columns["topics"]))}


def insert_messages_steps(
    batch: Sequence[SendFields], node_id: str, owner: int
) -> Steps[list[StoredMessage | Misplaced]]:
    """Store a batch owned by incarnation ``owner``: one statement, atomic on its own
    (the writers run it in autocommit); resent pairs are then read back. One
    StoredMessage per item, in order (``Misplaced`` for one whose topic is not placed
    on this database's cluster). ``Fenced`` if the owner was retired (a takeover
    presumed this node dead): nothing was stored."""
    params = insert_params(batch, node_id, owner)
    # a batch with outbox rows records them as it stores them (insert_outbox_messages):
    # a row recorded before is not stored and is answered below as a resend, or as not
    # stored once its message was swept (the relay then asks the ledger again)
    outbox = holds_outbox_rows(params["producers"])
    first, then = ("insert_new_outbox_messages", "insert_outbox_messages") if outbox else (
        "insert_new_messages", "insert_messages")
    if "statuses" in params:  # some send has properties
        first, then = PROPERTY_STATEMENTS[first], PROPERTY_STATEMENTS[then]
    try:
        answer = yield Statement(first, params, may_fail=True)
    except psycopg.errors.UniqueViolation:
        answer = yield Statement(then, params)
    rows, topics = _stored_rows(answer)
    fresh = {}
    for r in rows:
        message_id = r[0]
        names, starts, newest = topics.get(r[4], _NO_CHANNELS)
        if message_id <= newest:  # older than a channel of its topic (rare): not that one's
            names = tuple(name for name, start in zip(names, starts) if start < message_id)
        fresh[(r[1], r[2])] = StoredMessage(message_id, r[3], names, False)
    missing = [m for m in batch if (m.producer, m.session_id) not in fresh]
    if missing and not rows:
        # nothing inserted: every pair was stored before, or the owner is retired
        owners = yield Statement("owner_states", {})
        if not any(row[0] == owner and not row[2] for row in owners):
            raise Fenced(
                f"this server's incarnation {owner} was retired (another node took its messages "
                "over, or another server started on this database): it stores nothing more; restart it"
            )
    if missing:
        found = yield Statement(
            "find_messages",
            {
                "producers": [m.producer for m in missing],
                "session_ids": [m.session_id for m in missing],
            },
        )
        for r in found:
            fresh.setdefault((r[1], r[2]), StoredMessage(r[0], r[3], (), True))
    results: list[StoredMessage | Misplaced] = []
    seen: set[tuple[str, int]] = set()
    for m in batch:
        key = (m.producer, m.session_id)
        stored = fresh.get(key)
        if stored is None:  # the statement stores only topics placed on its cluster
            results.append(Misplaced(f"topic {m.topic!r} is not placed on this cluster (moved): not stored, send again"))
            continue
        if key in seen and not stored.duplicate:
            # the same pair twice in one batch: the second is a resend
            stored = StoredMessage(stored.message_id, stored.published_ms, (), True)
        seen.add(key)
        results.append(stored)
    return results


# a topic without channels: no names, and every id newer than its newest
_NO_CHANNELS: tuple[tuple[str, ...], list[int], int] = ((), [], 0)


def _stored_rows(answer: Rows) -> tuple[Rows, dict[str, tuple[tuple[str, ...], list[int], int]]]:
    """insert_messages' answer taken apart: the rows of the messages stored, and per topic
    its channels' names in name order, their start ids and the newest of them (a message
    is for the channels with a lower start_id: nearly always all). The channels' rows come
    last, so they are looked for from the end: the statement's UNION ALL is run part
    after part (a statement that writes is never given a parallel plan)."""
    channels: dict[str, list[tuple[str, int]]] = {}
    end = len(answer)
    while end and answer[end - 1][0] is None:
        end -= 1
        r = answer[end]
        channels.setdefault(r[4], []).append((r[5], r[6]))
    topics = {}
    for topic, named in channels.items():
        named.sort()
        starts = [start for _, start in named]
        topics[topic] = (tuple(name for name, _ in named), starts, max(starts))
    return (answer[:end] if end < len(answer) else answer), topics


def find_stored_steps(pairs: Sequence[tuple[str, int]]) -> Steps[list[tuple[str, int]]]:
    """Which of the (producer, session id) pairs are stored: sends whose outcome was
    unknown (``Broker``'s check, until the store shows them)."""
    rows = yield Statement(
        "find_messages",
        {"producers": [p for p, _ in pairs], "session_ids": [s for _, s in pairs]},
    )
    return [(r[1], r[2]) for r in rows]


# prepared once per connection by the reactor-driven writers and acker (reactor_db)
HOT_STATEMENTS = (INSERT_NEW_MESSAGES, queries["insert_messages"], ACK_NEW_DELIVERIES, queries["ack_deliveries"],
                  INSERT_NEW_OUTBOX_MESSAGES, INSERT_OUTBOX_MESSAGES)


def insert_messages(
    conn: psycopg.Connection, batch: Sequence[SendFields], node_id: str, owner: int
) -> list[StoredMessage | Misplaced]:
    """``insert_messages_steps`` over a blocking connection."""
    return run_steps(conn, insert_messages_steps(batch, node_id, owner))


@dataclass(slots=True)
class OwnerState:
    owner: int
    node_id: str
    retired: bool


def create_owner_steps(node_id: str) -> Steps[int]:
    """A new incarnation of ``node_id``: the owner of what it stores from now on."""
    rows = yield Statement("create_owner", {"node_id": node_id})
    return int(rows[0][0])


def create_owner(conn: psycopg.Connection, node_id: str) -> int:
    """``create_owner_steps`` over a blocking connection (tests, tools)."""
    return run_steps(conn, create_owner_steps(node_id))


def retire_silent_owners_steps(owner: int, node_id: str, silent_s: float) -> Steps[list[int]]:
    """Without ZooKeeper: this node's earlier incarnations, and those whose server has not
    beaten for ``silent_s``, are over; the ids retired now."""
    rows = yield Statement("retire_silent_owners", {"owner": owner, "node_id": node_id, "silent_s": silent_s})
    return [int(r[0]) for r in rows]


def owner_heartbeat_steps(owner: int) -> Steps[bool]:
    """This incarnation is alive; False if it was retired meanwhile."""
    rows = yield Statement("owner_heartbeat", {"owner": owner})
    return bool(rows)


def read_owners_steps() -> Steps[list[OwnerState]]:
    rows = yield Statement("owner_states", {})
    return [OwnerState(int(r[0]), r[1], bool(r[2])) for r in rows]


def backends_alive_steps(pids: Sequence[int]) -> Steps[set[int]]:
    """Which of these PostgreSQL backends still run (a write whose answer was lost is
    settled once the backend that ran it is gone)."""
    rows = yield Statement("backends_alive", {"pids": list(pids)})
    return {int(r[0]) for r in rows}


def empty_channel_steps(topic: str, channel: str) -> Steps[int]:
    """Move every owner's cursor of the channel past what is stored; how many waited."""
    rows = yield Statement("empty_channel", {"topic": topic, "channel": channel})
    return int(rows[0][0]) if rows else 0


@dataclass(slots=True)
class AckRow:
    """One acknowledged copy, as tests, benchmarks and tools name one; the server batches
    ``AckRun``s, and ``ack_deliveries_steps`` takes an ``AckRow`` as a run of one."""

    topic: str
    channel: str
    message_id: int
    first_ms: int
    acked_ms: int
    attempts: int
    consumer: str = ""  # who acknowledged it (the message trace)
    delivered_ms: int = 0  # when the acknowledged delivery was pushed
    owner: int = 0  # the incarnation that stored the message
    published_ms: int = 0  # when it was stored (the delivery log's published_at)
    counted: bool = False  # its attempts may be kept in dmq_attempts (delivered again, or max_attempts)
    epoch: int = 0  # the channel's epoch when it was pushed (a seek raises it: ``AckRun.epoch``)


@dataclass(slots=True)
class AckRun:
    """The acks one consumer sent together for one channel (one ``ack_held`` call): what
    they share once, what differs as columns, in the order acknowledged. The ack batch
    is made of these: a copy's ack costs a place in six lists instead of an ``AckRow``
    of eleven fields, and the statement's arrays are the columns joined, the shared
    values repeated (bench/channel_cost.py)."""

    topic: str
    channel: str
    consumer: str  # who acknowledged them (the message trace)
    acked_ms: int
    counts_all: bool  # the channel keeps attempts (max_attempts): every ack is ``counted``
    message_ids: list[int]
    owners: list[int]  # the incarnation that stored each message
    published_ms: list[int]
    first_ms: list[int]
    attempts: list[int]
    delivered_ms: list[int]  # when each acknowledged delivery was pushed
    # the channel's epoch the copies were pushed in: their acks apply to the cursors of
    # that epoch only (a seek since wrote them anew, schema 21)
    epoch: int = 0

    def __len__(self) -> int:
        return len(self.message_ids)

    def split(self, at: int) -> tuple[AckRun, AckRun]:
        """The first ``at`` acks and the rest, as two runs (a batch's size limit)."""
        def part(cut: slice) -> AckRun:
            ids, owners, published, first, attempts, delivered = (column[cut] for column in self.columns())
            return AckRun(self.topic, self.channel, self.consumer, self.acked_ms, self.counts_all,
                          ids, owners, published, first, attempts, delivered, self.epoch)

        return part(slice(None, at)), part(slice(at, None))

    def absorb(self, other: AckRun) -> bool:
        """Take ``other``'s acks after this run's when they share what a run shares (a
        consumer acknowledging one copy a frame: one run for a read's acks, not one each);
        False, with nothing changed, when they do not."""
        if (other.acked_ms != self.acked_ms or other.channel != self.channel or other.topic != self.topic
                or other.consumer != self.consumer or other.counts_all != self.counts_all
                or other.epoch != self.epoch):
            return False
        for mine, theirs in zip(self.columns(), other.columns()):
            mine += theirs
        return True

    def columns(self) -> tuple[list[int], ...]:
        return self.message_ids, self.owners, self.published_ms, self.first_ms, self.attempts, self.delivered_ms

    def counted(self) -> list[int]:
        """The positions of the acks whose attempts may be kept in dmq_attempts: all when
        the channel counts attempts, else those delivered more than once (nearly none)."""
        if self.counts_all:
            return list(range(len(self.message_ids)))
        attempts = self.attempts
        if max(attempts, default=0) <= 1:
            return []
        return [i for i, n in enumerate(attempts) if n > 1]

    def single_owner(self) -> int | None:
        """The owner of every ack of the run when they share one (nearly always), else None."""
        owners = self.owners
        if owners and owners.count(owners[0]) == len(owners):
            return owners[0]
        return None

    @classmethod
    def of(cls, row: AckRow) -> AckRun:
        """One ack as a run of one."""
        return cls(row.topic, row.channel, row.consumer, row.acked_ms, row.counted, [row.message_id], [row.owner],
                   [row.published_ms], [row.first_ms], [row.attempts], [row.delivered_ms], row.epoch)


@dataclass(slots=True)
class CursorProgress:
    """What the node holding a channel's copies of one owner knows to be done: every
    id up to ``floor``, and the inclusive ``spans`` above it. Merged into the cursor
    (a floor only rises, spans only add), so a stale or concurrent proposal is safe;
    but only into a cursor of ``epoch`` or an earlier one (a seek's cursors are not
    merged into: they are what the seek asked for)."""

    topic: str
    channel: str
    owner: int
    floor: int
    spans: list[tuple[int, int]]
    epoch: int = 0


def ack_deliveries_steps(
    acks: Sequence[AckRun | AckRow], progress: Sequence[CursorProgress] = (), holder: str = "", fenced: bool = False
) -> Steps[list[tuple[str, str, int]]]:
    """Make a batch of acks durable: the cursors move by ``progress``, each ack not done
    before is logged (one dmq_delivery_batch row). One statement, atomic on its own
    (a second only when some ack was done before: see ACK_NEW_DELIVERIES). In a cluster
    (``fenced``) only cursors ``holder`` still holds move, and anywhere only cursors of the
    proposal's epoch or an earlier one: returns the (topic, channel, owner) of those
    another node took over or a seek wrote since, whose acks were neither applied nor
    logged (nearly always none). ``acks``: the server's runs
    (``AckRun``), or single acks (``AckRow``, each a run of one)."""
    runs = [a if isinstance(a, AckRun) else AckRun.of(a) for a in acks]
    spans = [(n, lo, hi) for n, p in enumerate(progress, 1) for lo, hi in p.spans]
    ids, published, first, delivered = Int8Array(), Int8Array(), Int8Array(), Int8Array()
    owners, attempts = Int4Array(), Int4Array()
    topics: list[tuple[str, int]] = []  # runs of (value, count) for the text arrays
    channels: list[tuple[str, int]] = []
    consumers: list[tuple[str, int]] = []
    acked_ms = Int8Array()
    c_topics, c_channels, c_owners, c_ids = TextArray(), TextArray(), Int4Array(), Int8Array()
    groups: dict[tuple[str, str, int], list[int]] = {}  # [low, high, acks] of each cursor's acks
    for run in runs:
        n = len(run.message_ids)
        for column, values in zip((ids, owners, published, first, attempts, delivered), run.columns()):
            column += values
        for column, value in ((topics, run.topic), (channels, run.channel), (consumers, run.consumer)):
            if column and column[-1][0] == value:  # one consumer's runs one after another (acks sent one by one)
                column[-1] = (value, column[-1][1] + n)
            else:
                column.append((value, n))
        acked_ms += [run.acked_ms] * n
        owner = run.single_owner()
        keyed = [((run.topic, run.channel, owner), run.message_ids)] if owner is not None else [
            ((run.topic, run.channel, o), [mid]) for mid, o in zip(run.message_ids, run.owners)
        ]
        for key, mids in keyed:
            low, high = min(mids), max(mids)
            g = groups.get(key)
            if g is None:
                groups[key] = [low, high, len(mids)]
            else:
                g[0], g[1], g[2] = min(g[0], low), max(g[1], high), g[2] + len(mids)
        for i in run.counted():
            c_topics.append(run.topic)
            c_channels.append(run.channel)
            c_owners.append(run.owners[i])
            c_ids.append(run.message_ids[i])
    params = {
        "topics": TextRuns(topics),
        "channels": TextRuns(channels),
        "owners": owners,
        "message_ids": ids,
        "published_ms": published,
        "first_ms": first,
        "acked_ms": acked_ms,
        "attempts": attempts,
        "consumers": TextRuns(consumers),
        "delivered_ms": delivered,
        "c_topics": c_topics,
        "c_channels": c_channels,
        "c_owners": c_owners,
        "c_ids": c_ids,
        **{f"g_{name}": kind([key[i] for key in groups]) for i, (name, kind) in
           enumerate((("topics", TextArray), ("channels", TextArray), ("owners", Int4Array)))},
        **{f"g_{name}": Int8Array([g[i] for g in groups.values()]) for i, name in enumerate(("low", "high", "acks"))},
        "k_topics": [p.topic for p in progress],
        "k_channels": [p.channel for p in progress],
        "k_owners": [p.owner for p in progress],
        "k_floors": [p.floor for p in progress],
        "k_epochs": [p.epoch for p in progress],
        "r_cursors": [n for n, _, _ in spans],
        "r_lo": [lo for _, lo, _ in spans],
        "r_hi": [hi for _, _, hi in spans],
        "holder": holder,
        "fenced": fenced,
        # the batch row's summary, when every ack is logged (else the statement's own)
        "last_acked_ms": max((run.acked_ms for run in runs), default=0),
        "low_id": min(ids, default=0),
        "high_id": max(ids, default=0),
    }
    try:
        taken = yield Statement("ack_new_deliveries", params, may_fail=True)
    except psycopg.errors.DivisionByZero:
        # a repeat among the acks, or a cursor row the sweep opened after the statement
        # began (ack_deliveries' `batch` says why): nothing was applied. The statement as
        # written takes a new snapshot, which holds that row
        try:
            taken = yield Statement("ack_deliveries", params, may_fail=True)
        except psycopg.errors.DivisionByZero:
            # another cursor of the batch opened in between (the sweep opens a channel's
            # rows once); failed again, the batch is sent again by the acker
            taken = yield Statement("ack_deliveries", params)
    return [tuple(row) for row in taken]


@dataclass(slots=True)
class BacklogRow:
    message_id: int
    producer: str
    session_id: int
    published_ms: int
    body: bytes
    attempts: int
    owner: int = 0
    status: str = ""  # its properties as its pushes carry them (``stored_status``)
    key: str | None = None  # its key (an ordered topic's channels push one copy of a key at a time)
    priority: int = 0  # 0 to 9, higher first (issue 45 §3: load_priority_backlog_steps loads those above 0)
    epoch: int = 0  # the channel's epoch the load read its cursors in (a seek raises it)


def load_backlog_steps(
    topic: str, channel: str, after: int, limit: int, holder: str | None = None, owner: int = 0,
    skip_keys: Sequence[str] = (), only_key: str | None = None,
) -> Steps[list[BacklogRow]]:
    """A channel's stored copies after ``after``, oldest first. In a cluster (``holder``
    set) only the copies of this node's incarnation ``owner`` and of the owners whose
    cursors ``holder`` holds; on one node, every owner's. Without the copies of
    ``skip_keys``; with ``only_key``, only that key's (an ordered topic's channel reads a
    key with many copies waiting apart: ``ChannelCursor.skipped``)."""
    params: Params = {
        "topic": topic, "channel": channel, "after": after, "limit": limit, "holder": holder, "owner": owner,
        "skip_keys": list(skip_keys), "only_key": only_key,
    }
    return _backlog_rows((yield Statement("load_backlog", params)))


#: the levels a read-ahead reads, highest first (priority 0 has no entry in their index)
_LEVELS = tuple(range(PRIORITY_MAX, 0, -1))
#: above every message id (bigint's largest): the bound ``ChannelCursor.lookahead_from`` gives
#: a level with nothing to read; a read-ahead does not ask that level
NOTHING_AHEAD = 2**63 - 1


def load_priority_backlog_steps(
    topic: str, channel: str, afters: Sequence[int], limit: int, holder: str | None = None, owner: int = 0
) -> Steps[list[BacklogRow]]:
    """A channel's stored copies of a priority above 0, highest priority first, then
    oldest first: of each level p (1 to 9) only the copies after ``afters[p - 1]`` (what
    the channel loaded of that level before), at most ``limit`` in all. Owners as
    ``load_backlog_steps``'s. The index it reads holds only such messages (schema 18),
    so a channel finds them without walking the copies of priority 0 stored before.

    One statement a level, highest first, each asked for what the levels above left of
    the limit: a load stops where its limit is reached instead of reading up to the limit
    of every level and sorting them (sql/queries.sql ``load_priority_level``). A level
    bounded above every id is not asked. The statements run one after another, each with
    its own snapshot: a copy committed meanwhile is one committed after the load, as with
    any load (the cursor's own-write horizon)."""
    if len(afters) != PRIORITY_MAX:
        raise ValueError(f"load_priority_backlog: {len(afters)} bounds, one a priority 1 to {PRIORITY_MAX} expected")
    rows: list[BacklogRow] = []
    for level in _LEVELS:
        after = afters[level - 1]
        if after >= NOTHING_AHEAD:
            continue
        params: Params = {
            "topic": topic, "channel": channel, "limit": limit - len(rows), "holder": holder, "owner": owner,
            "priority": level, "after": after,
        }
        rows += _backlog_rows((yield Statement("load_priority_level", params)))
        if len(rows) >= limit:
            break
    return rows


def _backlog_rows(rows: Rows) -> list[BacklogRow]:
    """The rows of load_backlog and load_priority_level (one column list)."""
    return [BacklogRow(r[0], r[1], r[2], r[3], bytes(r[4]), r[5], r[6],
                       "" if r[7] is None and not r[8] and r[9] is None else stored_status(r[7], r[8], r[9]), r[7],
                       r[8], r[10])
            for r in rows]



def run_query_steps(name: str, params: Params) -> Steps[int]:
    """The named statement of ``sql/queries.sql``; returns the rows it changed."""
    ((changed,),) = yield Statement(name, params, count=True)
    return changed



def read_channel_state_steps() -> Steps[tuple[set[tuple[str, str]], set[int], dict[tuple[str, str], int]]]:
    """The channels an operator paused, the incarnations that were retired, and the
    epochs of the channels ever sought (the stored depths are counted apart, a slice at
    a time: ``depth_slice_steps``)."""
    pause_rows = yield Statement("channel_pauses", {})
    owner_rows = yield Statement("owner_states", {})
    epoch_rows = yield Statement("channel_epochs", {})
    held = {(t, c) for t, c in pause_rows}
    retired = {int(r[0]) for r in owner_rows if r[2]}
    return held, retired, {(t, c): int(e) for t, c, e in epoch_rows}



#: above every message id: the last slice's upper bound
MAX_ID = 2**63 - 1


def depth_slice_steps(low: int | None, rows: int) -> Steps:
    """One slice of the stored depths' count: the unacknowledged copies per (topic,
    channel) among the next ``rows`` stored messages above id ``low`` (None: a new pass,
    from the lowest cursor floor), with the lowest of their ids. ``(low, high, counts,
    lowest)``; ``high`` is None when the slice reached the last stored message (the pass
    is complete)."""
    if low is None:
        ((low,),) = yield Statement("depth_scan_start", {})
    bound = yield Statement("depth_slice_end", {"low": low, "rows": rows})
    high = bound[0][0] if bound else None
    counted = yield Statement("channel_depth_slice", {"low": low, "high": MAX_ID if high is None else high})
    return low, high, {(t, c): n for t, c, n, _ in counted}, {(t, c): lowest for t, c, _, lowest in counted}


@dataclass(frozen=True, slots=True)
class SweepTarget:
    """A topic the retention sweep visits: its retention, and the first id (of any topic)
    still inside that window, below which the topic's batches look (``MAX_ID``: none is)."""

    topic: str
    retention_s: float
    below: int


def sweep_plan_steps(
    default_retention_s: float, starts: Mapping[float, int]
) -> Steps[tuple[list[SweepTarget], dict[float, int]]]:
    """A retention sweep's pass: the topics with something stored (``sweep_topics``), each
    with its retention (``default_retention_s`` for a topic without one, and the rows of a
    deleted topic), and per distinct retention the first id inside its window, looked for
    from ``starts[retention]`` (the previous pass's answer: the walk then passes only what
    left the window since). Returns the topics with something older than their window, and
    the starts for the next pass (of the retentions seen)."""
    topics = yield Statement("sweep_topics", {})
    retention = {name: default_retention_s if ms is None else ms / 1000 for name, ms in topics}
    below: dict[float, int] = {}
    next_starts: dict[float, int] = {}
    for r in sorted(set(retention.values())):
        start = starts.get(r)
        if start is None:
            start = yield from sweep_start_steps(r)
        ((lowest, highest, first_kept),) = yield Statement("sweep_bounds", {"retention_s": r, "start": start})
        # with nothing inside the window, nothing up to the highest id is: not walked again
        # (a row committed later below it is still tested on its publish time by sweep_topic)
        next_starts[r] = (start if highest is None else highest + 1) if first_kept is None else first_kept
        if lowest is not None and (first_kept is None or lowest < first_kept):  # something is that old
            below[r] = MAX_ID if first_kept is None else first_kept
    targets = [SweepTarget(name, r, below[r]) for name, r in sorted(retention.items()) if r in below]
    return targets, next_starts


def sweep_start_steps(retention_s: float) -> Steps[int]:
    """Where a retention's first walk to its window starts (a pass with no start for it: the
    server's first, or a retention no topic had before): ``lo`` of a binary search of the
    primary key for the window's start (``seek_bounds_steps``), a row published so long before
    it that every id up to it is outside the window; 0 when no row is known to be. Walking
    from id 0 instead reads every row older than the window, kept by another topic's longer
    retention or not yet done: 10 million rows a topic keeps for a week were read, one by one,
    by the first pass of each server start for a topic kept for 10 minutes."""
    ((now_ms,),) = yield Statement("sweep_clock", {})
    bounds = yield from seek_bounds_steps(now_ms - round(retention_s * 1000), high=False)
    return 0 if bounds.lo is None else bounds.lo


def sweep_topic_steps(target: SweepTarget, limit: int, after: int = 0) -> Steps[tuple[int, int] | None]:
    """One batch of one topic's sweep (``sweep_topic``, ids above ``after``): None when
    another node is sweeping the topic; else how many went and the highest id deleted
    (``after`` if none: where the topic's next batch starts). What went is noted in
    ``dmq_retention`` in the same transaction."""
    ((_, mine),) = yield Statement("sweep_topic_lock", {"topic": target.topic})
    if not mine:
        return None
    rows = yield Statement("sweep_topic", {
        "topic": target.topic, "retention_s": target.retention_s, "after": after,
        "below": target.below, "limit": limit,
    })
    if not rows:
        return 0, after
    highest = max(mid for mid, _, _ in rows)
    yield Statement("note_swept", {
        "topic": target.topic, "swept_id": highest, "swept_ms": max(ms for _, ms, _ in rows),
    }, count=True)
    # the topic's retained figures (db.retained) lose the rows they had counted
    yield Statement("uncount_swept", {
        "topic": target.topic, "ids": [mid for mid, _, _ in rows], "lengths": [n for _, _, n in rows],
    }, count=True)
    return len(rows), highest


def prune_owners_steps() -> Steps[int]:
    """The end of a sweep's pass: retired incarnations nothing is left of, with their
    cursors, and attempts of copies that are done."""
    ((count,),) = yield Statement("prune_owners", {}, count=True)
    return count


def sweep_all_steps(default_retention_s: float, limit: int) -> Steps[int]:
    """A whole pass in one transaction, each topic's batches until one is not full (tests
    and tools; the server runs a pass a batch at a time, ``ReliableStore.sweep``): how many
    messages went."""
    targets, _ = yield from sweep_plan_steps(default_retention_s, {})
    swept = 0
    for target in targets:
        after = 0
        while True:
            batch = yield from sweep_topic_steps(target, limit, after)
            if batch is None:
                break
            count, after = batch
            swept += count
            if count < limit:
                break
    yield from prune_owners_steps()
    return swept
