"""An in-memory double of the database seam, for unit tests of the broker and the protocols.

It has the interface the server's callers use (``run_steps(steps_fn, *args)``
returning a Deferred, like a ``DbWorker`` or a ``ReactorDb``) and answers each
``Statement`` *by its query name* with a Python handler over dicts, the way
PostgreSQL answers the SQL of ``sql/queries.sql``: topics and channels, messages
unique by (producer, session_id) and owned by an incarnation, a cursor per (topic,
channel, owner) moved by acks, the delivery log, pauses, depths, the sweep, delayed
sends and dead letters, and seeks (a channel's epoch: ``channel_epochs``; a cursor's:
``_Cursor.epoch``). ``deliveries`` shows the copies waiting, as the ``dmq_pending``
view does. A statement
without a handler fails loudly (``UnknownStatement``), so a test never passes on a
statement the double silently ignored. ``tests/integration/test_memory_db_contract.py``
runs the same steps here and on a migrated PostgreSQL and compares the answers, so
the double cannot drift from the SQL unnoticed.

Failures are injected by name (``fail_next``), with the two outcomes callers must
tell apart (see ``dmq_server.db.storage_errors``):

* ``"refused"``: PostgreSQL refused the statement's input; nothing of it is applied
  and the error reaches the steps as psycopg's (the runners turn an unhandled one
  into a ``RefusedError``), so the writer's bisecting can be tested;
* ``"unknown"``: the statement *was applied* and its answer lost (a connection that
  broke after the commit): the run fails with a plain ``StorageError``;
* ``"lost"``: the connection broke before the statement arrived: nothing applied,
  same ``StorageError``.

Like the reactor-driven writers, every statement commits on its own (autocommit).
Answers arrive at once, or after ``delay`` seconds on the given clock.

It is longer than most modules (one handler per statement) on purpose: the handlers
sit together, in the order of ``sql/queries.sql``, so a change of the SQL has one
place to follow.

Why one long module: one handler per named statement the server runs, so that the double
answers everything the real database does; tests/integration/test_memory_db_contract.py
holds them to the same answers.
"""

from __future__ import annotations

import functools
import itertools
import json
from datetime import datetime, timezone
from dataclasses import dataclass, field
from typing import Callable, Iterable, TypedDict, TypeVar

import psycopg
from twisted.internet.defer import Deferred

from dmq_server.core.clock import Clock
from dmq_server.db import delays as _delayed_variants  # noqa: F401  registers insert_outbox_delayed, *_props
from dmq_server.db import messages as _variants  # noqa: F401  registers insert_new_messages, ack_new_deliveries
from dmq_server.db.storage_errors import StorageError, storage_error
from dmq_server.db.steps import STATEMENTS, Params, Rows, Statement, Steps
from dmq_server.db.trace_steps import ReturnRow

__all__ = ["MemoryDb", "UnknownStatement", "FAILURE_KINDS", "MIGRATOR_STATEMENTS"]

FAILURE_KINDS = ("refused", "unknown", "lost")

#: the statements of sql/queries.sql the double does not answer: the migrator's
#: (``dmq_sql.schema``, shared with the pipeline), which builds the tables the double
#: holds as dicts. Every other statement has a handler here and a case in
#: tests/integration/test_memory_db_contract.py, which fails naming any that has neither.
MIGRATOR_STATEMENTS = ("create_schema_version", "lock_migrations", "schema_versions", "record_migration")

#: timestamps PostgreSQL's statements make of Unix milliseconds (``CASE WHEN ms BETWEEN
#: 1 AND ...``): others are NULL
_MAX_MS = 253402300799999


def _relayed_here(producer: str) -> bool:
    """An outbox row that insert_outbox_messages records (its producer's test there)."""
    return producer.startswith("outbox:") and not producer.endswith(":delayed")


def _property_columns(p: dict) -> tuple[list, list, list]:
    """A storing statement's key, priority and headers columns, as PostgreSQL takes them
    from the ``_props`` statements' statuses (NULL, 0, NULL without), headers as jsonb
    answers them: dicts."""
    count = len(p["topics"])
    if "statuses" not in p:
        return [None] * count, [0] * count, [None] * count
    fields = [json.loads(s) if s is not None else {} for s in p["statuses"]]
    return ([f.get("key") for f in fields], [f.get("priority", 0) for f in fields],
            [_jsonb_object(json.dumps(f["headers"])) if "headers" in f else None for f in fields])


def _jsonb_object(text: str) -> dict[str, str]:
    """A JSON object's text as PostgreSQL's jsonb answers it: a name given twice keeps
    its last value, and the names come shortest first, then in byte order (jsonb's
    storage order; a message's status is encoded from this order)."""
    fields = json.loads(text)
    return {name: fields[name] for name in sorted(fields, key=lambda n: (len(n.encode()), n.encode()))}


def _ms_or_none(ms: int | None) -> int | None:
    return ms if ms is not None and 1 <= ms <= _MAX_MS else None


T = TypeVar("T")


# the tables the double holds as dicts: a row of each, by the columns the statements use


class _Topic(TypedDict):  # dmq_topic
    store: str
    msg_timeout_ms: int
    rate_limit: int | None
    ttl_ms: int | None
    max_attempts: int | None
    cluster: str
    draining: list[str]
    ordered: bool
    retention_ms: int | None  # None: the server's --message-retention
    registry_epoch: int  # the registry's version of the row (schema 19), compared in order
    version: int


class _Owner(TypedDict):  # dmq_owner
    node_id: str
    retired: bool
    seen_ms: int


class _Logged(TypedDict):  # dmq_delivery_batch, one row per ack it logs
    message_id: int
    topic: str
    channel: str
    published_ms: int
    first_ms: int | None
    acked_ms: int
    attempts: int
    consumer: str
    delivered_ms: int | None


class _Delayed(TypedDict):  # dmq_delay
    id: int
    fragment: int
    due_ms: int
    topic: str
    channel: str | None
    producer: str
    session_id: int
    produced_ms: int
    node_id: str
    body: bytes
    replay_of: int | None
    created_ms: int
    key: str | None  # the properties (schema 16), as PostgreSQL answers them (headers: a dict)
    priority: int
    headers: dict[str, str] | None


class _DeadLetter(TypedDict):  # dmq_dead_letter
    id: int
    reason: str
    detail: str
    topic: str
    channel: str | None
    producer: str
    session_id: int | None
    message_id: int | None
    attempts: int
    body: bytes
    published_ms: int | None
    dead_ms: int
    replayed_ms: int | None
    replay_message_id: int | None
    key: str | None  # the message's properties (schema 16; headers: jsonb's dict)
    priority: int
    headers: dict[str, str] | None


@dataclass(frozen=True)
class _Return:  # dmq_trace: a recorded return, its identity and the node that wrote it
    id: int
    node_id: str
    row: ReturnRow


class _AdminLog(TypedDict):  # dmq_admin_log
    id: int
    at_ms: int
    surface: str
    actor: str
    operation: str
    filters: str
    affected: int


class UnknownStatement(KeyError):
    """The double has no handler for a statement name."""


@dataclass
class _Failure:
    name: str
    kind: str
    times: int
    when: Callable[[Params], bool] | None


@dataclass
class _Message:
    id: int
    topic: str
    producer: str
    session_id: int
    produced_ms: int
    published_ms: int
    node_id: str
    body: bytes = field(repr=False)
    owner: int = 0
    channel: str | None = None  # stored for one channel only (a replay)
    # its properties (schema 16): as PostgreSQL's row answers them (headers: jsonb's dict)
    key: str | None = None
    priority: int = 0
    headers: dict[str, str] | None = None


@dataclass
class _Cursor:
    """dmq_cursor: every id up to ``floor`` done, and the inclusive ``done`` spans above."""

    holder: str
    floor: int
    done: list[tuple[int, int]] = field(default_factory=list)
    epoch: int = 0  # dmq_cursor.epoch (schema 21): the channel's epoch when a seek wrote it

    def covers(self, message_id: int) -> bool:
        return message_id <= self.floor or any(lo <= message_id <= hi for lo, hi in self.done)

    def merge(self, floor: int, spans: Iterable[tuple[int, int]]) -> None:
        self.floor = max(self.floor, floor)
        self.done = sorted({(lo, hi) for lo, hi in [*self.done, *spans] if hi > self.floor})


class MemoryDb:
    """Tables as dicts; ``run_steps`` answers named statements. One instance plays the
    whole database: pass it as every worker role the broker takes."""

    def __init__(self, clock: Clock | None = None, *, delay: float = 0.0, name: str = "memory",
                 cluster: str = "main", first_id: int = 1):
        self.clock = clock
        self.delay = delay
        self.name = name
        self.cluster = cluster  # dmq_cluster_self.name: the group commit stores only topics placed here
        # dmq_topic: name -> settings; dmq_channel: topic -> channel names
        self.topics: dict[str, _Topic] = {}
        self.retention: dict[str, tuple[int, int]] = {}  # dmq_retention: topic -> (swept_id, swept_ms)
        # dmq_retained (schema 22): topic -> [counted_to, messages, bytes, counted_ms]
        self.retained: dict[str, list] = {}
        self._topic_versions = 0  # the sequence dmq_topic_version
        self.channels: dict[str, set[str]] = {}
        self.start_ids: dict[tuple[str, str], int] = {}  # dmq_channel.start_id
        # dmq_channel.epoch (schema 21; absent: 0), raised by a seek; every cursor a seek
        # writes takes it, so the double compares an ack's proposal with the channel's
        self.channel_epochs: dict[tuple[str, str], int] = {}
        self.messages: dict[int, _Message] = {}
        self._pairs: dict[tuple[str, int], int] = {}  # UNIQUE (producer, session_id)
        self.owners: dict[int, _Owner] = {}
        self.cursors: dict[tuple[str, str, int], _Cursor] = {}
        self.attempts: dict[tuple[str, str, int], int] = {}  # dmq_attempts
        self.delivery_log: list[_Logged] = []
        self.pauses: set[tuple[str, str]] = set()
        self.delayed: dict[int, _Delayed] = {}
        self._delayed_pairs: dict[tuple[str, int], int] = {}
        # dmq_outbox_relayed: the (producer, session_id) of outbox rows stored
        self.relayed: set[tuple[str, int]] = set()
        self.dead_letters: dict[int, _DeadLetter] = {}
        self.returns: list[_Return] = []
        self.admin_log: list[_AdminLog] = []
        self.cluster_slot = 0  # dmq_cluster_self.slot, and whether a node claimed it
        self.cluster_claimed = False
        self.cluster_slots: dict[str, int] = {"main": 0}  # dmq_cluster (the main cluster's)
        # one sequence is enough: ids only need to grow (``first_id``: the cluster's id slot)
        self._ids = itertools.count(first_id)
        self._log_ids = itertools.count(1)  # dmq_admin_log's and dmq_trace's identities
        self._trace_ids = itertools.count(1)
        self._owner_ids = itertools.count(1)
        self.executed: list[tuple[str, Params]] = []  # every statement run, in order
        self._failures: list[_Failure] = []
        # in the order of sql/queries.sql; MIGRATOR_STATEMENTS are not the server's
        # each statement's handler: its rows, or the count of rows it changed; it reads
        # the parameters (a copy) by the types the statement's SQL gives them
        self._handlers: dict[str, Callable[[dict], list[tuple] | int]] = {
            "ping": lambda p: [(1,)],
            "list_topics": self._list_topics,
            "create_topic": self._create_topic,
            "place_topic": self._place_topic,
            "lock_topic_settings": self._lock_topic_settings,
            "update_topic_settings": self._update_topic_settings,
            "delete_topic": self._delete_topic,
            "add_channel": self._add_channel,
            "remove_channel": self._remove_channel,
            "insert_messages": lambda p: self._insert_messages(p, on_conflict=True),
            "insert_new_messages": lambda p: self._insert_messages(p, on_conflict=False),
            "insert_outbox_messages": lambda p: self._insert_messages(p, on_conflict=True, outbox=True),
            "insert_new_outbox_messages": lambda p: self._insert_messages(p, on_conflict=False, outbox=True),
            # with properties (db.messages.PROPERTY_STATEMENTS): the same, three more arrays
            "insert_messages_props": lambda p: self._insert_messages(p, on_conflict=True),
            "insert_new_messages_props": lambda p: self._insert_messages(p, on_conflict=False),
            "insert_outbox_messages_props": lambda p: self._insert_messages(p, on_conflict=True, outbox=True),
            "insert_new_outbox_messages_props": lambda p: self._insert_messages(p, on_conflict=False, outbox=True),
            "find_messages": self._find_messages,
            "ack_deliveries": self._ack_deliveries,
            "ack_new_deliveries": self._ack_new_deliveries,
            "load_backlog": self._load_backlog,
            "load_priority_level": self._load_priority_level,
            "sweep_bounds": self._sweep_bounds,
            "sweep_clock": lambda p: [(self._now_ms(),)],
            "sweep_topics": self._sweep_topics,
            "sweep_topic_lock": lambda p: [(None, True)],  # one process: nobody else sweeps or seeks
            "sweep_topic": self._sweep_topic,
            "note_swept": self._note_swept,
            "uncount_swept": self._uncount_swept,
            # no other transaction is open in the double: the oldest writer is none
            "count_settle_time": lambda p: [(self._now_ms(), None)],
            "retained_topics": lambda p: [(t,) for t in sorted(self.retained)],
            "count_retained": self._count_retained,
            "drop_retained": self._drop_retained,
            "retained_figures": lambda p: [(t, r[1], r[2], r[3]) for t, r in sorted(self.retained.items())],
            "channel_depths": self._channel_depths,
            "depth_scan_start": self._depth_scan_start,
            "depth_slice_end": self._depth_slice_end,
            "channel_depth_slice": self._channel_depth_slice,
            "table_counts": self._table_counts,
            "insert_delayed": self._insert_delayed,
            "insert_outbox_delayed": lambda p: self._insert_delayed(p, outbox=True),
            "insert_delayed_props": self._insert_delayed,
            "insert_outbox_delayed_props": lambda p: self._insert_delayed(p, outbox=True),
            "find_delayed": self._find_delayed,
            "peek_delayed": self._peek_delayed,
            "move_due": self._move_due,
            "delay_stats": self._delay_stats,
            "insert_dead_letters": self._insert_dead_letters,
            "record_attempts": self._record_attempts,
            "exhaust_deliveries": self._exhaust_deliveries,
            "open_ttl_cursors": self._open_ttl_cursors,
            "expire_deliveries": self._expire_deliveries,
            "list_dead_letters": self._list_dead_letters,
            "count_dead_letters": self._count_dead_letters,
            "show_dead_letter": self._show_dead_letter,
            "replay_dead_letters": self._replay_dead_letters,
            "delete_dead_letters": self._delete_dead_letters,
            "dead_letter_counts": self._dead_letter_counts,
            "log_admin_operation": self._log_admin_operation,
            "lock_registry_mirror": lambda p: [(None,)],  # one database, one caller at a time
            "upsert_topic": self._upsert_topic,
            "create_owner": self._create_owner,
            "retire_silent_owners": self._retire_silent_owners,
            "owner_heartbeat": self._owner_heartbeat,
            "owner_states": self._owner_states,
            "takeover_candidates": self._takeover_candidates,
            "claim_owners": self._claim_owners,
            "open_ordered_cursors": self._open_ordered_cursors,
            "claim_ordered_cursors": self._claim_ordered_cursors,
            "release_ordered_cursors": self._release_ordered_cursors,
            "prune_owners": self._prune_owners,
            "backends_alive": lambda p: [],  # the double's "connections" end with the failure
            "owner_depths": self._owner_depths,
            "channel_pauses": self._channel_pauses,
            "channel_epochs": self._channel_epochs,
            "pause_channel": self._pause_channel,
            "unpause_channel": self._unpause_channel,
            "empty_channel": self._empty_channel,
            "record_returns": self._record_returns,
            "sweep_trace": self._sweep_trace,
            "trace_stored": self._trace_stored,
            "trace_pending": self._trace_pending,
            "trace_returns": self._trace_returns,
            "trace_acks": self._trace_acks,
            "trace_dead_letters": self._trace_dead_letters,
            "trace_delayed": self._trace_delayed,
            "find_message_by_session": self._find_message_by_session,
            "peek_channel": self._peek_channel,
            "published_at": self._published_at,
            "delay_pending_by_topic": self._delay_pending_by_topic,
            "delay_due_histogram": self._delay_due_histogram,
            "list_delayed": self._list_delayed,
            "deliver_delayed_now": self._deliver_delayed_now,
            "cancel_delayed": self._cancel_delayed,
            "list_admin_log": self._list_admin_log,
            "lock_clusters": lambda p: [(None,)],
            "list_clusters": self._list_clusters,
            "add_cluster": self._add_cluster,
            "cluster_self": lambda p: [(self.cluster, self.cluster_slot, self.cluster_claimed)],
            "claim_cluster_self": self._claim_cluster_self,
            "raise_id_sequences": self._raise_id_sequences,
            "topic_leftovers": self._topic_leftovers,
            "consumed_states": self._consumed_states,
            "seek_lock": lambda p: [(None,)],  # one database, one caller at a time
            "seek_state": self._seek_state,
            "seek_ends": self._seek_ends,
            "seek_probe": self._seek_probe,
            "seek_channel": self._seek_channel,
        }
        unknown = set(self._handlers) - set(STATEMENTS)
        if unknown:  # a handler for a query that sql/queries.sql does not have
            raise RuntimeError(f"in-memory handlers for unknown statements: {sorted(unknown)}")

    # -- arranging a test -----------------------------------------------------------

    def create_topic(
        self,
        name: str,
        channels: Iterable[str] = (),
        *,
        store: str = "reliable",
        msg_timeout_ms: int = 60000,
        rate_limit: int | None = None,
        ttl_ms: int | None = None,
        max_attempts: int | None = None,
        cluster: str = "main",
        draining: tuple[str, ...] = (),
        ordered: bool = False,
        retention_ms: int | None = None,
    ) -> None:
        self.topics[name] = {
            "store": store,
            "msg_timeout_ms": msg_timeout_ms,
            "rate_limit": rate_limit,
            "ttl_ms": ttl_ms,
            "max_attempts": max_attempts,
            "cluster": cluster,
            "draining": list(draining),
            "ordered": ordered,
            "retention_ms": retention_ms,
            "registry_epoch": 0,
            "version": self._next_topic_version(0),
        }
        for channel in channels:
            self.add_channel(name, channel)

    def add_channel(self, topic: str, name: str) -> None:
        """Register a channel: its messages are those stored from now on (start_id)."""
        if name not in self.channels.setdefault(topic, set()):
            self.channels[topic].add(name)
            self.start_ids[(topic, name)] = next(self._ids)

    def store_moved(
        self, topic: str, producer: str, session_id: int, body: bytes, owner: int, channel: str | None = None
    ) -> int:
        """Store a message as move_due stores a due delayed row (for ``channel`` alone: a
        replay); its id. move_due itself runs on PostgreSQL only (its answer is handed to
        the store as ``MovedMessage``s)."""
        message = _Message(next(self._ids), topic, producer, session_id, 0, self._now_ms(), "", body, owner, channel)
        self.messages[message.id] = message
        self._pairs[(producer, session_id)] = message.id
        return message.id

    @property
    def deliveries(self) -> dict[tuple[str, str, int], int]:
        """The copies waiting, as ``dmq_pending`` shows them: (topic, channel, id) -> attempts."""
        return {
            (m.topic, channel, m.id): self.attempts.get((m.topic, channel, m.id), 0)
            for m in self.messages.values()
            for channel in self._channels_of(m)
            if not self._done(m.topic, channel, m)
        }

    def _channels_of(self, m: _Message) -> list[str]:
        return sorted(
            c for c in self.channels.get(m.topic, ())
            if self.start_ids[(m.topic, c)] < m.id and (m.channel is None or m.channel == c)
        )

    def _done(self, topic: str, channel: str, m: _Message) -> bool:
        cursor = self.cursors.get((topic, channel, m.owner))
        return cursor is not None and cursor.covers(m.id)

    def _cursor(self, topic: str, channel: str, owner: int, holder: str) -> _Cursor:
        key = (topic, channel, owner)
        cursor = self.cursors.get(key)
        if cursor is None:
            cursor = self.cursors[key] = _Cursor(holder, self.start_ids.get((topic, channel), 0))
        return cursor

    def fail_next(
        self, name: str, kind: str = "refused", *, times: int = 1, when: Callable[[Params], bool] | None = None
    ) -> None:
        """Make the next ``times`` runs of statement ``name`` (whose parameters pass
        ``when``, if given) fail with ``kind`` (see the module docstring)."""
        if kind not in FAILURE_KINDS:
            raise ValueError(f"failure kind must be one of {FAILURE_KINDS}, got {kind!r}")
        if name not in self._handlers:
            raise UnknownStatement(name)
        self._failures.append(_Failure(name, kind, times, when))

    def names_run(self) -> list[str]:
        return [name for name, _ in self.executed]

    # -- the worker interface --------------------------------------------------------

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def run_steps(self, steps_fn: Callable[..., Steps[T]], *args: object) -> Deferred[T]:
        """Deferred with what ``steps_fn(*args)`` returns once its statements ran, or
        the StorageError a runner would give (RefusedError for refused input)."""
        d: Deferred[T] = Deferred()
        outcome: T | Exception
        try:
            outcome = self._drive(steps_fn(*args))
        except StorageError as exc:
            outcome = exc
        except psycopg.Error as exc:  # the steps did not handle a statement's error
            outcome = storage_error(self.name, exc)
        except Exception as exc:  # a bug in the steps: passed on as the runners do
            outcome = exc
        if self.clock is not None and self.delay > 0:
            self.clock.callLater(self.delay, _fire, d, outcome)
        else:
            _fire(d, outcome)
        return d

    def _drive(self, steps: Steps[T]) -> T:
        send: Callable[[], Statement] = functools.partial(next, steps)
        while True:
            try:
                stmt = send()
            except StopIteration as stop:
                return stop.value
            try:
                rows = self.execute(stmt)
            except psycopg.Error as exc:
                send = functools.partial(steps.throw, exc)
            except StorageError:
                steps.close()
                raise
            else:
                send = functools.partial(steps.send, rows)

    def execute(self, stmt: Statement) -> Rows:
        """One statement: its rows (a list of tuples), or the changed row count for a
        ``count`` statement (one row); psycopg's error for refused input."""
        handler = self._handlers.get(stmt.name)
        if handler is None:
            raise UnknownStatement(f"the in-memory database has no handler for statement {stmt.name!r}")
        self.executed.append((stmt.name, stmt.params))
        failure = self._take_failure(stmt)
        if failure == "refused":
            raise psycopg.errors.NumericValueOutOfRange(f"{stmt.name}: input refused (injected)")
        if failure == "lost":
            raise StorageError(f"{self.name}: connection lost before {stmt.name} (injected)")
        rows = handler(dict(stmt.params))
        if failure == "unknown":
            raise StorageError(f"{self.name}: connection lost after {stmt.name} committed (injected)")
        if stmt.count:
            return [(rows if isinstance(rows, int) else len(rows),)]
        return [] if isinstance(rows, int) else rows

    def _take_failure(self, stmt: Statement) -> str | None:
        for failure in self._failures:
            if failure.name == stmt.name and (failure.when is None or failure.when(stmt.params)):
                failure.times -= 1
                if failure.times <= 0:
                    self._failures.remove(failure)
                return failure.kind
        return None

    def _now_ms(self) -> int:
        if self.clock is None:
            import time

            return int(time.time() * 1000)
        return int(self.clock.seconds() * 1000)

    # -- topics ------------------------------------------------------------------------

    def _list_topics(self, p: dict) -> list[tuple]:
        return [
            (
                name, t["store"], t["msg_timeout_ms"], t["rate_limit"], t["ttl_ms"], t["max_attempts"],
                sorted(self.channels.get(name, ())), t["cluster"], t["draining"], t["ordered"], t["retention_ms"],
                t["registry_epoch"], t["version"],
            )
            for name, t in sorted(self.topics.items())
        ]

    def _create_topic(self, p: dict) -> list[tuple]:
        if p["name"] in self.topics:
            self._topic_versions += 1  # the statement's nextval ran before its conflict
            return []
        self.create_topic(p["name"], store=p["store"], msg_timeout_ms=p["msg_timeout_ms"], rate_limit=p["rate_limit"],
                          ttl_ms=p["ttl_ms"], max_attempts=p["max_attempts"], cluster=p["cluster"],
                          ordered=p["ordered"], retention_ms=p["retention_ms"])
        return [(p["name"],)]

    def _place_topic(self, p: dict) -> list[tuple]:
        row = self.topics.get(p["name"])
        if row is None:
            return []
        old = (row["cluster"], list(row["draining"]))
        row["cluster"], row["draining"] = p["cluster"], list(p["draining"])
        row["version"] = self._next_topic_version(row["version"])
        return [old]

    def _lock_topic_settings(self, p: dict) -> list[tuple]:
        row = self.topics.get(p["name"])
        if row is None:
            return []
        return [(row["msg_timeout_ms"], row["rate_limit"], row["ttl_ms"], row["max_attempts"], row["ordered"],
                 row["retention_ms"], row["store"])]

    def _update_topic_settings(self, p: dict) -> int:
        row = self.topics.get(p["name"])
        if row is None:
            return 0
        row["msg_timeout_ms"], row["rate_limit"] = p["msg_timeout_ms"], p["rate_limit"]
        row["ttl_ms"], row["max_attempts"] = p["ttl_ms"], p["max_attempts"]
        row["ordered"], row["retention_ms"] = p["ordered"], p["retention_ms"]
        row["version"] = self._next_topic_version(row["version"])
        return 1

    def _next_topic_version(self, version: int) -> int:
        """``greatest(version + 1, nextval('dmq_topic_version'))``."""
        self._topic_versions += 1
        return max(version + 1, self._topic_versions)

    def _upsert_topic(self, p: dict) -> list[tuple]:
        row = self.topics.get(p["name"])
        if row is not None and (row["registry_epoch"], row["version"]) > (p["registry_epoch"], p["version"]):
            return []  # a newer row stays (a stale view's copy)
        self.topics[p["name"]] = {
            "store": p["store"], "msg_timeout_ms": p["msg_timeout_ms"], "rate_limit": p["rate_limit"],
            "ttl_ms": p["ttl_ms"], "max_attempts": p["max_attempts"], "cluster": p["cluster"],
            "draining": list(p["draining"]), "ordered": p["ordered"], "retention_ms": p["retention_ms"],
            "registry_epoch": p["registry_epoch"],
            "version": p["version"],
        }
        return [(p["name"],)]

    def _delete_topic(self, p: dict) -> list[tuple]:
        """The topic, its channels (and their pauses: cascades), cursors and kept attempts."""
        name = p["name"]
        for key in [k for k in self.cursors if k[0] == name]:
            del self.cursors[key]
        for key in [k for k in self.attempts if k[0] == name]:
            del self.attempts[key]
        if name not in self.topics:
            return []
        del self.topics[name]
        for channel in self.channels.pop(name, set()):
            del self.start_ids[(name, channel)]
            self.channel_epochs.pop((name, channel), None)
            self.pauses.discard((name, channel))
        return [(name,)]

    def _add_channel(self, p: dict) -> list[tuple]:
        topic, name = p["topic"], p["name"]
        if topic not in self.topics:  # dmq_channel's foreign key to dmq_topic
            raise psycopg.errors.ForeignKeyViolation(f"topic {topic!r} is not registered")
        start = next(self._ids)  # nextval, drawn also when the channel is there
        if name in self.channels.setdefault(topic, set()):
            return []
        self.channels[topic].add(name)
        self.start_ids[(topic, name)] = start
        return [(name,)]

    def _remove_channel(self, p: dict) -> list[tuple]:
        topic, name = p["topic"], p["name"]
        for key in [k for k in self.cursors if k[:2] == (topic, name)]:
            del self.cursors[key]
        for key in [k for k in self.attempts if k[:2] == (topic, name)]:
            del self.attempts[key]
        if name not in self.channels.get(topic, ()):
            return []
        self.channels[topic].discard(name)
        del self.start_ids[(topic, name)]
        self.channel_epochs.pop((topic, name), None)
        self.pauses.discard((topic, name))
        return [(name,)]

    # -- messages and deliveries ----------------------------------------------------

    def _insert_messages(self, p: dict, *, on_conflict: bool, outbox: bool = False) -> list[tuple]:
        """insert_messages (resent pairs skipped) and insert_new_messages (any stored
        pair is a unique violation and nothing is inserted); nothing for a retired owner
        (but the topics' rows, as PostgreSQL answers them). ``outbox``: their
        insert_outbox_ variants, which record each outbox row's pair (``relayed``) and
        store only those recorded now (one recorded before: skipped, or a unique violation
        without ON CONFLICT)."""
        owner = self.owners.get(p["owner"])
        if owner is None or owner["retired"]:
            return self._topic_rows(p["batch_topics"])
        # PostgreSQL inserts in the order sent (the server sorts by pair): the ids follow it
        items = list(zip(p["topics"], p["producers"], p["session_ids"], p["produced_ms"], p["bodies"],
                         *_property_columns(p)))
        seen: set[tuple[str, int]] = set()
        fresh = []
        for item in items:
            if not self._placed_here(item[0]):
                continue  # moved to another cluster: not stored here
            key = (item[1], item[2])
            if outbox and _relayed_here(item[1]):
                if key in self.relayed and not on_conflict:
                    raise psycopg.errors.UniqueViolation(
                        "duplicate key value violates unique constraint \"dmq_outbox_relayed_pkey\""
                    )
                if key in self.relayed:
                    continue
                self.relayed.add(key)  # recorded even when the message's pair is stored (as PostgreSQL)
            if key in self._pairs or key in seen:
                if not on_conflict:
                    raise psycopg.errors.UniqueViolation(
                        "duplicate key value violates unique constraint \"dmq_message_session_producer_key\""
                    )
                continue
            seen.add(key)
            fresh.append(item)
        now = self._now_ms()
        rows = []
        for topic, producer, session_id, produced_ms, body, message_key, priority, headers in fresh:
            message = _Message(
                next(self._ids), topic, producer, session_id, produced_ms, now, p["node_id"], bytes(body), p["owner"],
                key=message_key, priority=priority, headers=headers,
            )
            self.messages[message.id] = message
            self._pairs[(producer, session_id)] = message.id
            rows.append((message.id, producer, session_id, now, topic, None, None))
        return rows + self._topic_rows(p["batch_topics"])

    def _topic_rows(self, topics: list[str]) -> list[tuple]:
        """insert_messages' row per channel of the batch's topics: its name and start id.
        PostgreSQL answers them in no order promised; here in name order, which the
        server, reading the answer from its end, gets reversed unless it orders them
        itself (test_memory_db's channel tuples fail without that)."""
        rows = []
        for topic in dict.fromkeys(topics):
            for name in sorted(self.channels.get(topic, ())):
                rows.append((None, None, None, None, topic, name, self.start_ids[(topic, name)]))
        return rows

    def _not_elsewhere(self, topic: str) -> bool:
        """Not a topic placed on another cluster (one it does not know is not)."""
        row = self.topics.get(topic)
        return row is None or row["cluster"] == self.cluster

    def _placed_here(self, topic: str) -> bool:
        row = self.topics.get(topic)
        return row is not None and row["cluster"] == self.cluster

    def _find_messages(self, p: dict) -> list[tuple]:
        rows = []
        for key in zip(p["producers"], p["session_ids"]):
            message_id = self._pairs.get(key)
            if message_id is not None:
                m = self.messages[message_id]
                rows.append((m.id, m.producer, m.session_id, m.published_ms))
        return rows

    def _ack_new_deliveries(self, p: dict) -> list[tuple[str, str, int]]:
        """ack_deliveries when every ack is new, as PostgreSQL decides it (per cursor the
        batch moves: its acks' lowest id above the floor and no done span between its
        lowest and highest, and every ack's cursor among those); else the division by
        zero that fails the statement whole."""
        total = 0
        proposed = dict(zip(zip(p["k_topics"], p["k_channels"], p["k_owners"]), p["k_epochs"]))
        for topic, channel, owner, low, high, acks in zip(
            p["g_topics"], p["g_channels"], p["g_owners"], p["g_low"], p["g_high"], p["g_acks"]
        ):
            if channel not in self.channels.get(topic, ()):
                continue
            cursor = self.cursors.get((topic, channel, owner))
            if p["fenced"] and cursor is not None and cursor.holder != p["holder"]:
                continue
            if self._sought_since(topic, channel, proposed.get((topic, channel, owner), 0)):
                continue
            floor = cursor.floor if cursor is not None else self.start_ids[(topic, channel)]
            if low <= floor or (cursor is not None and any(lo <= high and low <= hi for lo, hi in cursor.done)):
                raise psycopg.errors.DivisionByZero("division by zero")
            total += acks
        if total != len(p["message_ids"]):
            raise psycopg.errors.DivisionByZero("division by zero")
        return self._ack_deliveries(p)

    def _ack_deliveries(self, p: dict) -> list[tuple[str, str, int]]:
        """The cursors take the proposals (floors rise, spans add), in a cluster only
        those the proposing node holds; each ack of a copy not done before this statement
        is logged, unless its cursor is another node's. Returns those cursors."""
        before = {key: _Cursor(c.holder, c.floor, list(c.done)) for key, c in self.cursors.items()}
        spans: dict[int, list[tuple[int, int]]] = {}
        for n, lo, hi in zip(p["r_cursors"], p["r_lo"], p["r_hi"]):
            spans.setdefault(n, []).append((lo, hi))
        taken: set[tuple[str, str, int]] = set()
        for n, (topic, channel, owner, floor, epoch) in enumerate(
            zip(p["k_topics"], p["k_channels"], p["k_owners"], p["k_floors"], p["k_epochs"]), 1
        ):
            if channel not in self.channels.get(topic, ()):
                continue
            held = self.cursors.get((topic, channel, owner))
            if (p["fenced"] and held is not None and held.holder != p["holder"]) or self._sought_since(
                topic, channel, epoch
            ):
                taken.add((topic, channel, owner))
                continue
            start = self.start_ids[(topic, channel)]
            self._cursor(topic, channel, owner, p["holder"]).merge(max(floor, start), spans.get(n, ()))
        for topic, channel, owner, message_id in zip(p["c_topics"], p["c_channels"], p["c_owners"], p["c_ids"]):
            if (topic, channel, owner) not in taken:
                self.attempts.pop((topic, channel, message_id), None)
        columns = ("topics", "channels", "owners", "message_ids", "published_ms", "first_ms", "acked_ms",
                   "attempts", "consumers", "delivered_ms")
        for topic, channel, owner, message_id, published_ms, first_ms, acked_ms, attempts, consumer, delivered_ms in zip(
            *(p[c] for c in columns)
        ):
            if channel not in self.channels.get(topic, ()) or (topic, channel, owner) in taken:
                continue
            cursor = before.get((topic, channel, owner))
            floor = cursor.floor if cursor is not None else self.start_ids[(topic, channel)]
            if message_id <= floor or (cursor is not None and cursor.covers(message_id)):
                continue
            before.setdefault((topic, channel, owner), _Cursor("", floor)).done.append((message_id, message_id))
            self.delivery_log.append(
                {
                    "message_id": message_id,
                    "topic": topic,
                    "channel": channel,
                    "published_ms": published_ms,
                    "first_ms": first_ms if first_ms > 0 else None,
                    "acked_ms": acked_ms,
                    "attempts": attempts,
                    "consumer": consumer,
                    "delivered_ms": delivered_ms if delivered_ms > 0 else None,
                }
            )
        return sorted(taken)

    def _record_returns(self, p: dict) -> int:
        columns = ("message_ids", "topics", "channels", "attempts", "reasons", "consumers", "delivered_ms",
                   "returned_ms")
        rows = [_Return(next(self._trace_ids), p["node_id"], ReturnRow(*values))
                for values in zip(*(p[c] for c in columns))]
        self.returns.extend(rows)
        return len(rows)

    def _load_backlog(self, p: dict) -> list[tuple]:
        skip, only = set(p["skip_keys"]), p["only_key"]
        return self._backlog(p, lambda m: m.id > p["after"] and (m.key is None or m.key not in skip)
                             and (only is None or m.key == only))

    def _load_priority_level(self, p: dict) -> list[tuple]:
        # one level's copies after its bound; priority 0 has none (the index's predicate)
        level, after = p["priority"], p["after"]
        return self._backlog(p, lambda m: m.priority == level > 0 and m.id > after)

    def _backlog(self, p: dict, wanted: Callable[[_Message], bool]) -> list[tuple]:
        """The load statements' rows: the channel's waiting copies ``wanted`` of the
        owners its node loads (all without a holder; else its own and those of the
        cursors it holds), the first ``limit`` in id order."""
        topic, channel, holder = p["topic"], p["channel"], p["holder"]
        if channel not in self.channels.get(topic, ()):
            return []

        def loads(owner: int) -> bool:
            if holder is None or owner == p["owner"]:
                return True
            cursor = self.cursors.get((topic, channel, owner))
            return cursor is not None and cursor.holder == holder

        found = sorted(
            (m for m in self.messages.values()
             if m.topic == topic and wanted(m) and loads(m.owner)
             and channel in self._channels_of(m) and not self._done(topic, channel, m)),
            key=lambda m: m.id,
        )[: p["limit"]]
        rows = []
        for m in found:
            attempts = self.attempts.get((topic, channel, m.id), 0)
            rows.append((m.id, m.producer, m.session_id, m.published_ms, m.body, attempts, m.owner, m.key, m.priority,
                         m.headers, self.channel_epochs.get((topic, channel), 0)))
        return rows

    def _channel_depths(self, p: dict) -> list[tuple]:
        depths: dict[tuple[str, str], int] = {}
        for topic, channel, _ in self.deliveries:
            depths[(topic, channel)] = depths.get((topic, channel), 0) + 1
        return [(t, c, n) for (t, c), n in sorted(depths.items())]

    def _depth_scan_start(self, p: dict) -> list[tuple]:
        """Per (channel, incarnation): its cursor's floor (at least the channel's start), or
        without a cursor just below the incarnation's first message of the topic above the
        start (none: it waits for nothing); the lowest, else the highest id stored."""
        starts = []
        for t, c in self.start_ids:
            start = self.start_ids[(t, c)]
            for o in self.owners:
                if (t, c, o) in self.cursors:
                    starts.append(max(start, self.cursors[(t, c, o)].floor))
                    continue
                first = min((mid for mid, m in self.messages.items()
                             if m.topic == t and m.owner == o and mid > start), default=None)
                if first is not None:
                    starts.append(first - 1)
        return [(min(starts, default=max(self.messages, default=0)),)]

    def _depth_slice_end(self, p: dict) -> list[tuple]:
        above = sorted(mid for mid in self.messages if mid > p["low"])
        return [(above[p["rows"] - 1],)] if len(above) >= p["rows"] else []

    def _channel_depth_slice(self, p: dict) -> list[tuple]:
        depths: dict[tuple[str, str], list[int]] = {}
        for topic, channel, mid in self.deliveries:
            if p["low"] < mid <= p["high"]:
                depths.setdefault((topic, channel), []).append(mid)
        return [(t, c, len(ids), min(ids)) for (t, c), ids in sorted(depths.items())]

    def _table_counts(self, p: dict) -> list[tuple]:
        return [(len(self.messages), len(self.deliveries), len(self.delivery_log), len(self.dead_letters))]

    # -- incarnations ------------------------------------------------------------------

    def _create_owner(self, p: dict) -> list[tuple]:
        owner = next(self._owner_ids)  # an identity: never reused, also once pruned
        while owner in self.owners:  # one a test placed by hand
            owner = next(self._owner_ids)
        self.owners[owner] = {"node_id": p["node_id"], "retired": False, "seen_ms": self._now_ms()}
        return [(owner,)]

    def _retire_silent_owners(self, p: dict) -> list[tuple]:
        silent_before = self._now_ms() - p["silent_s"] * 1000
        retired = [
            o for o, row in sorted(self.owners.items())
            if o != p["owner"] and not row["retired"]
            and (row["node_id"] == p["node_id"] or row.get("seen_ms", self._now_ms()) < silent_before)
        ]
        for o in retired:
            self.owners[o]["retired"] = True
        return [(o,) for o in retired]

    def _owner_heartbeat(self, p: dict) -> list[tuple]:
        row = self.owners.get(p["owner"])
        if row is None or row["retired"]:
            return []
        row["seen_ms"] = self._now_ms()
        return [(p["owner"],)]

    def _owner_states(self, p: dict) -> list[tuple]:
        return [(o, row["node_id"], row["retired"]) for o, row in sorted(self.owners.items())]

    def _prune_owners(self, p: dict) -> int:
        gone = [
            o for o, row in self.owners.items()
            if row["retired"] and not any(m.owner == o and m.topic in self.topics for m in self.messages.values())
        ]
        for o in gone:
            del self.owners[o]
            for key in [k for k in self.cursors if k[2] == o]:
                del self.cursors[key]
        pending = self.deliveries
        for key in [k for k in self.attempts if k not in pending]:
            del self.attempts[key]
        return len(gone)

    def _channel_pauses(self, p: dict) -> list[tuple]:
        return sorted(self.pauses)

    def _channel_epochs(self, p: dict) -> list[tuple]:
        return [(t, c, e) for (t, c), e in sorted(self.channel_epochs.items()) if e > 0]

    def _pause_channel(self, p: dict) -> int:
        key = (p["topic"], p["channel"])
        if p["channel"] not in self.channels.get(p["topic"], ()):
            # the pause table's foreign key to dmq_channel
            raise psycopg.errors.ForeignKeyViolation(f"channel {key} is not registered")
        if key in self.pauses:
            return 0
        self.pauses.add(key)
        return 1

    def _unpause_channel(self, p: dict) -> int:
        key = (p["topic"], p["channel"])
        if key in self.pauses:
            self.pauses.discard(key)
            return 1
        return 0

    def _empty_channel(self, p: dict) -> list[tuple]:
        topic, channel = p["topic"], p["channel"]
        if channel not in self.channels.get(topic, ()):
            return [(0,)]
        waiting = sum(1 for t, c, _ in self.deliveries if (t, c) == (topic, channel))
        for owner, row in self.owners.items():
            top = max((m.id for m in self.messages.values() if m.topic == topic and m.owner == owner), default=None)
            if top is not None:
                self._cursor(topic, channel, owner, row["node_id"]).merge(top, ())
        for key in [k for k in self.attempts if k[:2] == (topic, channel)]:
            del self.attempts[key]
        return [(waiting,)]

    def _consumed_states(self, p: dict) -> list[tuple]:
        """Each watched message's channels (those registered before its id, or a replay's
        one) and what each did with it: waiting, dead (a dead letter of that channel) or acked."""
        rows = []
        for message_id, topic in zip(p["ids"], p["topics"]):
            m = self.messages.get(message_id)
            for channel in sorted(self.channels.get(topic, ())):
                if self.start_ids.get((topic, channel), 0) >= message_id or (
                        m is not None and m.channel is not None and m.channel != channel):
                    continue
                cursor = self.cursors.get((topic, channel, m.owner)) if m is not None else None
                if m is not None and (cursor is None or not cursor.covers(message_id)):
                    rows.append((message_id, channel, "waiting"))
                elif any(d["message_id"] == message_id and (d["topic"], d["channel"]) == (topic, channel)
                         for d in self.dead_letters.values()):
                    rows.append((message_id, channel, "dead"))
                else:
                    rows.append((message_id, channel, "acked"))
        return sorted(rows)

    def _sweep_bounds(self, p: dict) -> list[tuple]:
        """The lowest and highest stored ids and the first (by id) still inside the
        retention window."""
        cutoff = self._now_ms() - p["retention_s"] * 1000
        ids = sorted(self.messages)
        kept = [i for i in ids if i >= p["start"] and self.messages[i].published_ms >= cutoff]
        return [(ids[0] if ids else None, ids[-1] if ids else None, kept[0] if kept else None)]

    def _sweep_topics(self, p: dict) -> list[tuple]:
        """Every topic with a message stored, with its registered retention (None: the
        default; also for the rows of a topic no longer registered)."""
        stored = {m.topic for m in self.messages.values()}
        return [(name, self.topics[name]["retention_ms"] if name in self.topics else None) for name in sorted(stored)]

    def _note_swept(self, p: dict) -> int:
        swept_id, swept_ms = self.retention.get(p["topic"], (0, 0))
        self.retention[p["topic"]] = (max(swept_id, p["swept_id"]), max(swept_ms, p["swept_ms"]))
        return 1

    def _uncount_swept(self, p: dict) -> int:
        row = self.retained.get(p["topic"])
        if row is None:
            return 0
        gone = [n for i, n in zip(p["ids"], p["lengths"]) if i <= row[0]]
        if not gone:
            return 0
        row[1] -= len(gone)
        row[2] -= sum(gone)
        return 1

    def _count_retained(self, p: dict) -> list[tuple]:
        """The topic's rows in (counted_to, upto], at most ``limit``, added to its figures."""
        topic, limit = p["topic"], p["limit"]
        row = self.retained.get(topic, [0, 0, 0, None])
        picked = sorted(i for i, m in self.messages.items() if m.topic == topic and row[0] < i <= p["upto"])[:limit]
        full = len(picked) >= limit
        row[0] = max(row[0], picked[-1] if full else p["upto"])
        row[1] += len(picked)
        row[2] += sum(len(self.messages[i].body) for i in picked)
        if not full and p["counted_ms"] is not None:
            row[3] = p["counted_ms"] if row[3] is None else max(row[3], p["counted_ms"])
        self.retained[topic] = row
        return [(len(picked), row[0])]

    def _drop_retained(self, p: dict) -> int:
        topic = p["topic"]
        if topic in self.topics or topic not in self.retained or any(m.topic == topic for m in self.messages.values()):
            return 0
        del self.retained[topic]
        return 1

    def _sweep_topic(self, p: dict) -> list[tuple]:
        """One topic's messages in (``after``, ``below``), per incarnation, published before
        its retention, that no channel waits for (those at or below every channel's floor
        are among them)."""
        topic = p["topic"]
        cutoff = self._now_ms() - p["retention_s"] * 1000
        pending = {message_id for _, _, message_id in self.deliveries}
        gone: list[int] = []
        for owner in sorted({m.owner for m in self.messages.values() if m.topic == topic}):
            gone += sorted(
                m.id for m in self.messages.values()
                if m.topic == topic and m.owner == owner and p["after"] < m.id < p["below"]
                and m.published_ms < cutoff and m.id not in pending
            )[: p["limit"]]
        return self._swept(sorted(gone)[: p["limit"]])

    def _swept(self, ids: list[int]) -> list[tuple]:
        """Delete these messages; their ids, publish times and body lengths."""
        rows = []
        for message_id in ids:
            m = self.messages.pop(message_id)
            del self._pairs[(m.producer, m.session_id)]
            rows.append((m.id, m.published_ms, len(m.body)))
        return rows

    # -- delayed sends ---------------------------------------------------------------

    def _insert_delayed(self, p: dict, *, outbox: bool = False) -> list[tuple]:
        """insert_delayed; ``outbox``: insert_outbox_delayed, which records each outbox
        row's pair and stores only those recorded now."""
        items = sorted(
            zip(p["topics"], p["producers"], p["session_ids"], p["produced_ms"], p["due_ms"], p["fragments"], p["bodies"],
                *_property_columns(p)),
            key=lambda i: (i[1], i[2]),
        )
        rows = []
        for topic, producer, session_id, produced_ms, due_ms, fragment, body, message_key, priority, headers in items:
            key = (producer, session_id)
            if key in self._pairs or not self._placed_here(topic):
                continue
            if outbox and producer.startswith("outbox:"):
                if key in self.relayed:
                    continue
                self.relayed.add(key)
            if key in self._delayed_pairs:
                continue
            delay_id = next(self._ids)
            self.delayed[delay_id] = {
                "id": delay_id, "fragment": fragment, "due_ms": due_ms, "topic": topic, "producer": producer,
                "session_id": session_id, "produced_ms": produced_ms, "node_id": p["node_id"], "body": bytes(body),
                "channel": None, "replay_of": None, "created_ms": self._now_ms(), "key": message_key, "priority": priority,
                "headers": headers,
            }
            self._delayed_pairs[key] = delay_id
            rows.append((delay_id, producer, session_id, due_ms))
        return rows

    def _find_delayed(self, p: dict) -> list[tuple]:
        keys = list(zip(p["producers"], p["session_ids"]))
        rows = []
        for key in keys:
            if key in self._delayed_pairs:
                row = self.delayed[self._delayed_pairs[key]]
                rows.append((row["id"], row["producer"], row["session_id"], row["due_ms"], "delay"))
        for key in keys:
            if key in self._pairs:
                rows.append((self._pairs[key], key[0], key[1], 0, "message"))
        return rows

    # -- dead letters ------------------------------------------------------------------

    def _insert_dead_letters(self, p: dict) -> list[tuple]:
        columns = ("reasons", "details", "topics", "channels", "producers", "session_ids", "message_ids",
                   "attempts", "bodies", "published_ms", "keys", "priorities", "headers")
        rows = []
        for values in zip(*(p[c] for c in columns)):
            letter = dict(zip(("reason", "detail", "topic", "channel", "producer", "session_id", "message_id",
                               "attempts", "body", "published_ms", "key", "priority", "headers"), values))
            letter["published_ms"] = _ms_or_none(letter["published_ms"])
            letter["headers"] = None if letter["headers"] is None else _jsonb_object(letter["headers"])
            rows.append((self._add_letter(**letter),))
        return rows

    def _add_letter(self, reason: str, detail: str, topic: str, channel: str | None, producer: str,
                    session_id: int | None, body: bytes, message_id: int | None = None, attempts: int = 0,
                    published_ms: int | None = None, key: str | None = None, priority: int = 0,
                    headers: dict[str, str] | None = None) -> int:
        """A dmq_dead_letter row, dead now, with its message's properties; its id."""
        letter_id = next(self._ids)
        self.dead_letters[letter_id] = {
            "id": letter_id, "reason": reason, "detail": detail, "topic": topic, "channel": channel,
            "producer": producer, "session_id": session_id, "message_id": message_id, "attempts": attempts,
            "body": bytes(body), "published_ms": published_ms, "dead_ms": self._now_ms(), "replayed_ms": None,
            "replay_message_id": None, "key": key, "priority": priority, "headers": headers,
        }
        return letter_id

    def _sought_since(self, topic: str, channel: str, epoch: int) -> bool:
        """A proposal of ``epoch`` comes after a seek of the channel (ack_deliveries,
        exhaust_deliveries: refused)."""
        return epoch < self.channel_epochs.get((topic, channel), 0)

    def _copies(self, p: dict) -> Iterable[tuple[tuple[str, str, int], int, int]]:
        for topic, channel, owner, message_id, attempts in zip(
            p["topics"], p["channels"], p["owners"], p["message_ids"], p["attempts"]
        ):
            yield (topic, channel, message_id), owner, attempts

    def _waiting(self, key: tuple[str, str, int], owner: int) -> bool:
        topic, channel, message_id = key
        m = self.messages.get(message_id)
        return (
            m is not None and m.owner == owner and channel in self._channels_of(m)
            and not self._done(topic, channel, m)
        )

    def _record_attempts(self, p: dict) -> int:
        changed = 0
        for key, owner, attempts in self._copies(p):
            if self._waiting(key, owner):
                self.attempts[key] = max(self.attempts.get(key, 0), attempts)
                changed += 1
        return changed

    def _exhaust_deliveries(self, p: dict) -> list[tuple]:
        rows = []
        for (key, owner, attempts), epoch in zip(self._copies(p), p["epochs"]):
            if not self._waiting(key, owner) or self._sought_since(key[0], key[1], epoch):
                continue
            held = self.cursors.get((key[0], key[1], owner))
            if p["fenced"] and held is not None and held.holder != p["holder"]:
                continue  # another node's cursor now
            m = self.messages[key[2]]
            self._cursor(key[0], key[1], owner, p["holder"]).merge(0, [(m.id, m.id)])
            tries = max(self.attempts.pop(key, 0), attempts)
            self._add_letter("max_attempts", f"delivered {tries} times without acknowledgement", key[0], key[1],
                             m.producer, m.session_id, m.body, m.id, tries, m.published_ms, m.key, m.priority,
                             m.headers)
            rows.append(key)
        return rows

    # -- delayed sends: the delay workers' statements ----------------------------------

    @staticmethod
    def _in_fragments(row: _Delayed, p: dict) -> bool:
        return row["fragment"] in p["fragments"] or (p["overflow"] and row["fragment"] > p["max_fragment"])

    def _peek_delayed(self, p: dict) -> list[tuple]:
        due = sorted(r["due_ms"] for r in self.delayed.values()
                     if self._in_fragments(r, p) and r["due_ms"] <= p["until_ms"])
        return [(d,) for d in due[: p["limit"]]]

    def _move_due(self, p: dict) -> list[tuple]:
        """Due rows of the fragments become messages of ``owner`` for their channels (the
        row's own for a replay), in due order; a row whose channels are all gone becomes
        a dead letter; a pair already stored is dropped (a resend). Nothing for a retired
        owner. One row with the count taken, then one per message stored."""
        owner = self.owners.get(p["owner"])
        due = [] if owner is None or owner["retired"] else sorted(
            (r for r in self.delayed.values() if self._in_fragments(r, p) and r["due_ms"] <= p["now_ms"]),
            key=lambda r: (r["due_ms"], r["id"]),
        )[: p["limit"]]
        now = self._now_ms()
        placed: list[tuple[object, ...]] = []
        for row in due:
            del self.delayed[row["id"]]
            del self._delayed_pairs[(row["producer"], row["session_id"])]
            names = sorted(c for c in self.channels.get(row["topic"], ()) if row["channel"] in (None, c))
            if not names:
                detail = ("topic had no registered channel when the delayed message fell due" if row["channel"] is None
                          else f"channel {row['channel']} was not registered when the replay fell due")
                self._add_letter("operator", detail, row["topic"], row["channel"], row["producer"],
                                 row["session_id"], row["body"])
                continue
            message_id = next(self._ids)
            key = (row["producer"], row["session_id"])
            if key in self._pairs:
                continue  # stored before (ON CONFLICT DO NOTHING)
            self.messages[message_id] = _Message(
                message_id, row["topic"], row["producer"], row["session_id"], _ms_or_none(row["produced_ms"]) or 0,
                now, p["node_id"], row["body"], p["owner"], row["channel"], row["key"], row["priority"], row["headers"],
            )
            self._pairs[key] = message_id
            letter = self.dead_letters.get(row["replay_of"]) if row["replay_of"] is not None else None
            if letter is not None:
                letter["replay_message_id"] = message_id
            placed.append((len(due), message_id, row["topic"], row["producer"], row["session_id"], now, names,
                           row["due_ms"], row["body"], row["channel"], row["key"], row["priority"], row["headers"]))
        return placed or [(len(due),) + (None,) * 12]

    def _delay_stats(self, p: dict) -> list[tuple]:
        by: dict[int, list[int]] = {}
        for r in self.delayed.values():
            by.setdefault(r["fragment"], []).append(r["due_ms"])
        return [(f, len(d), min(d), max(d)) for f, d in sorted(by.items())]

    # -- the time to live ----------------------------------------------------------------

    def _ttl_ms(self, topic: str) -> int | None:
        row = self.topics.get(topic)
        return None if row is None else row["ttl_ms"]

    def _open_ttl_cursors(self, p: dict) -> int:
        opened = 0
        for (topic, channel), start in sorted(self.start_ids.items()):
            if self._ttl_ms(topic) is None:
                continue
            for owner, row in sorted(self.owners.items()):
                key = (topic, channel, owner)
                if key not in self.cursors and any(
                    m.topic == topic and m.owner == owner and m.id > start for m in self.messages.values()
                ):
                    self.cursors[key] = _Cursor(row["node_id"], start)
                    opened += 1
        return opened

    def _expire_deliveries(self, p: dict) -> list[tuple]:
        """Copies older than their topic's time to live -> dead letters, done for their
        channel: only those of cursors that exist (open_ttl_cursors makes them), held by
        ``holder`` if ``fenced``, and of each cursor's first ``limit`` waiting copies in id
        order, as the statement."""
        expired = []
        for (topic, channel, owner), cursor in self.cursors.items():
            ttl = self._ttl_ms(topic)
            if ttl is None or channel not in self.channels.get(topic, ()):
                continue
            if p["fenced"] and cursor.holder != p["holder"]:
                continue
            floor = max(cursor.floor, self.start_ids[(topic, channel)])
            waiting = sorted(
                m.id for m in self.messages.values()
                if m.topic == topic and m.owner == owner and m.id > floor and m.channel in (None, channel)
                and not cursor.covers(m.id)
            )[: p["limit"]]
            old = [i for i in waiting if self.messages[i].published_ms < p["now_ms"] - ttl]
            expired += [(message_id, topic, channel, owner, ttl) for message_id in old]
        expired.sort()
        rows = []
        for message_id, topic, channel, owner, ttl in expired[: p["limit"]]:
            self.cursors[(topic, channel, owner)].merge(0, [(message_id, message_id)])
            m = self.messages[message_id]
            self._add_letter("expired", f"not acknowledged within the topic's time to live of {ttl} ms", topic,
                             channel, m.producer, m.session_id, m.body, m.id,
                             self.attempts.pop((topic, channel, message_id), 0), m.published_ms, m.key, m.priority,
                             m.headers)
            rows.append((topic, channel, message_id))
        return rows

    # -- dead letters for operators ----------------------------------------------------

    def _selected(self, p: dict) -> list[_DeadLetter]:
        """The dead letters the dead_letter_filter fragment selects, in id order."""
        def match(d: _DeadLetter) -> bool:
            return (
                (p["topic"] is None or d["topic"] == p["topic"])
                and (p["channel"] is None or d["channel"] == p["channel"])
                and (p["reason"] is None or d["reason"] == p["reason"])
                and (p["since_ms"] is None or d["dead_ms"] >= p["since_ms"])
                and (p["until_ms"] is None or d["dead_ms"] < p["until_ms"])
                and (p["ids"] is None or d["id"] in p["ids"])
                and (p["message_ids"] is None or d["message_id"] in p["message_ids"])
                and (p["replayed"] is None or (d["replayed_ms"] is not None) == p["replayed"])
            )

        return [d for _, d in sorted(self.dead_letters.items()) if match(d)]

    @staticmethod
    def _letter_row(d: _DeadLetter) -> tuple[object, ...]:
        return (d["id"], d["reason"], d["detail"], d["topic"], d["channel"], d["producer"], d["session_id"],
                d["message_id"], d["attempts"], len(d["body"]), d["published_ms"], d["dead_ms"], d["replayed_ms"],
                d["replay_message_id"], d["key"], d["priority"], d["headers"])

    def _list_dead_letters(self, p: dict) -> list[tuple]:
        return [self._letter_row(d) for d in self._selected(p) if d["id"] > p["after"]][: p["limit"]]

    def _count_dead_letters(self, p: dict) -> list[tuple]:
        selected = self._selected(p)
        return [(len(selected), sum(1 for d in selected if d["replayed_ms"] is None))]

    def _show_dead_letter(self, p: dict) -> list[tuple]:
        d = self.dead_letters.get(p["id"])
        return [] if d is None else [self._letter_row(d) + (d["body"],)]

    def _replay_dead_letters(self, p: dict) -> list[tuple]:
        """Mark a batch replayed and queue each, due now, for its own channel (producer
        dmq-replay, the letter's id as session id: queued once); not the letters of a topic
        placed on another cluster."""
        picked = [
            d for d in self._selected(p)
            if d["replayed_ms"] is None and d["id"] > p["after"] and self._not_elsewhere(d["topic"])
        ][: p["limit"]]
        queued = 0
        now = self._now_ms()
        for d in picked:
            d["replayed_ms"] = now
            key = ("dmq-replay", d["id"])
            if key in self._delayed_pairs:
                continue
            delay_id = next(self._ids)
            self.delayed[delay_id] = {
                "id": delay_id, "fragment": 1 + d["id"] % p["fragments"], "due_ms": p["now_ms"], "topic": d["topic"],
                "channel": d["channel"], "producer": "dmq-replay", "session_id": d["id"], "produced_ms": 0,
                "replay_of": d["id"], "node_id": p["node_id"], "created_ms": now, "body": d["body"],
                "key": d["key"], "priority": d["priority"], "headers": d["headers"],
            }
            self._delayed_pairs[key] = delay_id
            queued += 1
        return [(max((d["id"] for d in picked), default=None), queued)]

    def _delete_dead_letters(self, p: dict) -> list[tuple]:
        gone = [d["id"] for d in self._selected(p) if d["id"] > p["after"]][: p["limit"]]
        for letter_id in gone:
            del self.dead_letters[letter_id]
        return [(i,) for i in gone]

    def _dead_letter_counts(self, p: dict) -> list[tuple]:
        by: dict[str, list[int]] = {}
        for d in self.dead_letters.values():
            counts = by.setdefault(d["reason"], [0, 0])
            counts[0] += 1
            counts[1] += d["replayed_ms"] is not None
        return [(reason, n, replayed) for reason, (n, replayed) in sorted(by.items())]

    def _log_admin_operation(self, p: dict) -> int:
        self.admin_log.append({
            "id": next(self._log_ids), "at_ms": self._now_ms(), "surface": p["surface"], "actor": p["actor"],
            "operation": p["operation"], "filters": p["filters"], "affected": p["affected"],
        })
        return 1

    # -- takeover ------------------------------------------------------------------------

    def _ordered(self, topic: str) -> bool:
        row = self.topics.get(topic)
        return row is not None and row["ordered"]

    def _takeover_candidates(self, p: dict) -> list[tuple]:
        nodes = {row["node_id"] for row in self.owners.values() if not row["retired"]}
        nodes |= {c.holder for (topic, _, _), c in self.cursors.items() if not self._ordered(topic)}
        return [
            (node, [o for o, row in sorted(self.owners.items()) if row["node_id"] == node and not row["retired"]])
            for node in sorted(nodes)
        ]

    def _claim_owners(self, p: dict) -> list[tuple]:
        """Retire the owners, open their cursors on the channels with their messages, and
        hold every cursor of theirs (or of the departed node) no live node holds; an
        ordered topic's cursors are left to its orderer."""
        owners = list(dict.fromkeys(p["owners"]))
        for o in owners:
            row = self.owners.get(o)
            if row is not None and not row["retired"]:
                row["retired"] = True
        changed: dict[tuple[str, str], int] = {}
        moved = [  # of the cursors as they were: those opened now are counted once
            key for key, c in self.cursors.items()
            if (key[2] in owners or c.holder == p["dead"]) and c.holder != p["me"] and c.holder not in p["live"]
            and not self._ordered(key[0])
        ]
        for (topic, channel), start in sorted(self.start_ids.items()):
            if self._ordered(topic):
                continue
            for o in owners:
                key = (topic, channel, o)
                if key not in self.cursors and any(
                    m.topic == topic and m.owner == o and m.id > start for m in self.messages.values()
                ):
                    self.cursors[key] = _Cursor(p["me"], start)
                    changed[(topic, channel)] = changed.get((topic, channel), 0) + 1
        for key in moved:
            self.cursors[key].holder = p["me"]
            changed[key[:2]] = changed.get(key[:2], 0) + 1
        return [(t, c, n) for (t, c), n in sorted(changed.items())]

    def _open_ordered_cursors(self, p: dict) -> int:
        """A cursor (``me``'s, at the channel's start) for each channel of the topic and
        each incarnation with messages for it, where there is none."""
        opened = 0
        for channel in sorted(self.channels.get(p["topic"], ())):
            start = self.start_ids[(p["topic"], channel)]
            for o in sorted(self.owners):
                key = (p["topic"], channel, o)
                if key not in self.cursors and any(
                    m.topic == p["topic"] and m.owner == o and m.id > start for m in self.messages.values()
                ):
                    self.cursors[key] = _Cursor(p["me"], start)
                    opened += 1
        return opened

    def _claim_ordered_cursors(self, p: dict) -> list[tuple]:
        moved = [c for (topic, _, _), c in self.cursors.items() if topic == p["topic"] and c.holder != p["me"]]
        previous = [(c.holder,) for c in moved]
        for c in moved:
            c.holder = p["me"]
        return previous

    def _release_ordered_cursors(self, p: dict) -> int:
        """``me``'s cursors of the topic go back to their live incarnations' nodes."""
        given = 0
        for (topic, _, owner), c in self.cursors.items():
            row = self.owners.get(owner)
            if topic == p["topic"] and c.holder == p["me"] and row is not None and not row["retired"] \
                    and row["node_id"] != p["me"]:
                c.holder = row["node_id"]
                given += 1
        return given

    def _holder(self, topic: str, channel: str, owner: int) -> str:
        """The node delivering a copy, as dmq_pending names it."""
        cursor = self.cursors.get((topic, channel, owner))
        return cursor.holder if cursor is not None else self.owners[owner]["node_id"]

    def _owner_depths(self, p: dict) -> list[tuple]:
        by: dict[str, int] = {}
        for topic, channel, message_id in self.deliveries:
            holder = self._holder(topic, channel, self.messages[message_id].owner)
            by[holder] = by.get(holder, 0) + 1
        return sorted(by.items())

    # -- the message trace, peeking, gauges ------------------------------------------------

    def _sweep_trace(self, p: dict) -> int:
        cutoff = self._now_ms() - p["retention_s"] * 1000
        old = sorted((r for r in self.returns if r.row.returned_ms < cutoff), key=lambda r: r.row.returned_ms)
        gone = {id(r) for r in old[: p["limit"]]}
        self.returns = [r for r in self.returns if id(r) not in gone]
        return len(gone)

    def _trace_stored(self, p: dict) -> list[tuple]:
        m = self.messages.get(p["id"])  # no archive here: dmq_message_history stays empty
        if m is None:
            return []
        return [(m.id, m.topic, m.producer, m.session_id, _ms_or_none(m.produced_ms), m.published_ms, m.node_id,
                 len(m.body), m.body[: p["preview"]], False, m.key, m.priority, m.headers)]

    def _trace_pending(self, p: dict) -> list[tuple]:
        return sorted(
            (channel, attempts, self._holder(topic, channel, self.messages[message_id].owner))
            for (topic, channel, message_id), attempts in self.deliveries.items()
            if topic == p["topic"] and message_id == p["id"]
        )

    def _trace_returns(self, p: dict) -> list[tuple]:
        found = sorted((r for r in self.returns if r.row.message_id == p["id"]), key=lambda r: (r.row.returned_ms, r.id))
        return [(r.row.channel, r.row.attempt, r.row.reason, r.row.consumer, r.node_id, r.row.delivered_ms,
                 r.row.returned_ms) for r in found]

    def _trace_acks(self, p: dict) -> list[tuple]:
        return [
            (r["topic"], r["channel"], r["attempts"], r["consumer"], r["published_ms"], r["first_ms"],
             r["delivered_ms"], r["acked_ms"])
            for _, r in sorted(
                ((r["acked_ms"], n), r) for n, r in enumerate(self.delivery_log) if r["message_id"] == p["id"]
            )
        ]

    def _trace_dead_letters(self, p: dict) -> list[tuple]:
        return [
            (d["id"], d["reason"], d["detail"], d["topic"], d["channel"], d["attempts"], d["dead_ms"],
             d["replayed_ms"], d["replay_message_id"], d["message_id"])
            for _, d in sorted(self.dead_letters.items())
            if d["message_id"] == p["id"] or d["id"] == p["replay_of"]
        ]

    def _trace_delayed(self, p: dict) -> list[tuple]:
        r = self.delayed.get(p["id"])
        if r is None:
            return []
        return [(r["id"], r["topic"], r["channel"], r["producer"], r["session_id"], r["due_ms"], r["fragment"],
                 r["node_id"], r["created_ms"], len(r["body"]), r["body"][: p["preview"]], r["replay_of"], r["key"],
                 r["priority"], r["headers"])]

    def _find_message_by_session(self, p: dict) -> list[tuple]:
        message_id = self._pairs.get((p["producer"], p["session_id"]))
        return [] if message_id is None else [(message_id,)]

    def _peek_channel(self, p: dict) -> list[tuple]:
        rows = []
        for (topic, channel, message_id), attempts in sorted(self.deliveries.items(), key=lambda kv: kv[0][2]):
            if (topic, channel) != (p["topic"], p["channel"]) or message_id <= p["after"]:
                continue
            m = self.messages[message_id]
            rows.append((m.id, attempts, self._holder(topic, channel, m.owner), m.producer, m.session_id,
                         m.published_ms, len(m.body), m.body[: p["preview"]], m.key, m.priority, m.headers))
        return rows[: p["limit"]]

    def _published_at(self, p: dict) -> list[tuple]:
        return [(i, self.messages[i].published_ms) for i in sorted(set(p["ids"])) if i in self.messages]

    def _delay_pending_by_topic(self, p: dict) -> list[tuple]:
        by: dict[str, list[int]] = {}
        for r in self.delayed.values():
            by.setdefault(r["topic"], []).append(r["due_ms"])
        return [(t, len(d), min(d)) for t, d in sorted(by.items())]

    # -- delayed sends for operators -----------------------------------------------------

    def _delay_due_histogram(self, p: dict) -> list[tuple]:
        by: dict[int, int] = {}
        for r in self.delayed.values():
            if p["topic"] is None or r["topic"] == p["topic"]:
                ahead = r["due_ms"] - p["now_ms"]
                bucket = ahead // p["width_ms"] if ahead > 0 else 0  # SQL's division truncates
                by[bucket] = by.get(bucket, 0) + 1
        return sorted(by.items())

    def _list_delayed(self, p: dict) -> list[tuple]:
        rows = sorted(
            (r for r in self.delayed.values()
             if (p["topic"] is None or r["topic"] == p["topic"]) and (r["due_ms"], r["id"]) > (p["after_due"], p["after_id"])),
            key=lambda r: (r["due_ms"], r["id"]),
        )[: p["limit"]]
        return [(r["id"], r["topic"], r["channel"], r["producer"], r["session_id"], r["due_ms"], r["fragment"],
                 len(r["body"]), r["body"][: p["preview"]], r["replay_of"], r["key"], r["priority"], r["headers"])
                for r in rows]

    def _deliver_delayed_now(self, p: dict) -> list[tuple]:
        rows = []
        for delay_id in dict.fromkeys(p["ids"]):
            r = self.delayed.get(delay_id)
            if r is not None and r["due_ms"] > p["now_ms"]:
                r["due_ms"] = p["now_ms"]
                rows.append((delay_id,))
        return rows

    def _cancel_delayed(self, p: dict) -> list[tuple]:
        rows = []
        for delay_id in dict.fromkeys(p["ids"]):
            r = self.delayed.pop(delay_id, None)
            if r is not None:
                del self._delayed_pairs[(r["producer"], r["session_id"])]
                rows.append((delay_id,))
        return rows

    def _list_admin_log(self, p: dict) -> list[tuple]:
        rows = sorted((r for r in self.admin_log if r["id"] < p["before"]), key=lambda r: -r["id"])[: p["limit"]]
        return [(r["id"], r["at_ms"], r["surface"], r["actor"], r["operation"], r["filters"], r["affected"])
                for r in rows]

    # -- several clusters ------------------------------------------------------------------

    def _list_clusters(self, p: dict) -> list[tuple]:
        return sorted(self.cluster_slots.items(), key=lambda kv: kv[1])

    def _add_cluster(self, p: dict) -> list[tuple]:
        free = sorted(set(range(32)) - set(self.cluster_slots.values()))
        if p["name"] in self.cluster_slots or not free:
            return []
        self.cluster_slots[p["name"]] = free[0]
        return [(free[0],)]

    def _claim_cluster_self(self, p: dict) -> list[tuple]:
        if self.cluster_claimed and (self.cluster, self.cluster_slot) != (p["name"], p["slot"]):
            return []
        self.cluster, self.cluster_slot, self.cluster_claimed = p["name"], p["slot"], True
        return [(p["name"],)]

    def _raise_id_sequences(self, p: dict) -> list[tuple]:
        following = next(self._ids)
        self._ids = itertools.count(max(following, p["floor"]))
        return [(p["floor"],)] * 3 if following < p["floor"] else []

    # -- seek (issue 46) ------------------------------------------------------------------

    def _seek_state(self, p: dict) -> list[tuple]:
        """Registered, ttl, what the sweep removed, now, the topic's lowest id and its time, and
        the archive's location (the double has none: it is the pipeline's)."""
        topic = p["topic"]
        row = self.topics.get(topic)
        swept_id, swept_ms = self.retention.get(topic, (None, None))
        stored = [mid for mid, m in self.messages.items() if m.topic == topic and m.owner in self.owners]
        oldest = self.messages[min(stored)] if stored else None
        return [(p["channel"] in self.channels.get(topic, ()), row["ttl_ms"] if row is not None else None, swept_id,
                 swept_ms, self._now_ms(), oldest.id if oldest else None, oldest.published_ms if oldest else None,
                 None)]

    def _seek_ends(self, p: dict) -> list[tuple]:
        return [(min(self.messages), max(self.messages))] if self.messages else [(None, None)]

    def _seek_probe(self, p: dict) -> list[tuple]:
        """Per point, the first message at or after it and its publish time in microseconds."""
        ids = sorted(self.messages)
        rows: list[tuple] = []
        for at in p["at"]:
            found = next((i for i in ids if i >= at), None)
            rows.append((at, found, None if found is None else self.messages[found].published_ms * 1000))
        return rows

    def _seek_channel(self, p: dict) -> list[tuple]:
        """Every incarnation's cursor of the channel written anew (the floors and done ids of
        the target), the epoch raised, start_id down to the lowest floor, attempts above it
        dropped; the count, top, first, epoch and previous position (sql: seek_channel)."""
        topic, channel = p["topic"], p["channel"]
        if channel not in self.channels.get(topic, ()):
            return []
        start = self.start_ids[(topic, channel)]
        stored = {o: sorted((m for m in self.messages.values() if m.topic == topic and m.owner == o),
                            key=lambda m: m.id) for o in self.owners}
        floors = {o: (rows[-1].id if rows else start) if p["latest"] else p["floor"] for o, rows in stored.items()}
        window_hi = p["window_hi"] if p["window_hi"] is not None else 2**63 - 1
        done = {o: [m.id for m in rows if p["before_ms"] is not None and floors[o] < m.id < window_hi
                    and m.published_ms < p["before_ms"]] for o, rows in stored.items()}
        top = max((rows[-1].id for rows in stored.values() if rows), default=None)
        lowest = min(floors.values(), default=start if p["latest"] else p["floor"])
        waiting = sorted(m.id for o, rows in stored.items() for m in rows
                         if top is not None and floors[o] < m.id <= top and m.channel in (None, channel)
                         and m.id not in done[o])
        previous = min((mid for t, c, mid in self.deliveries if (t, c) == (topic, channel)), default=None)
        epoch = None
        if not p["dry_run"]:
            epoch = self.channel_epochs.get((topic, channel), 0) + (0 if p.get("fresh") else 1)
            self.channel_epochs[(topic, channel)] = epoch
            self.start_ids[(topic, channel)] = min(start, lowest)
            holders = {o: self._seek_holder(topic, channel, o) for o in stored}
            for o in stored:
                cursor = self.cursors.setdefault((topic, channel, o), _Cursor(holders[o], 0))
                cursor.floor, cursor.done, cursor.epoch = floors[o], _spans(done[o]), epoch
            for key in [k for k in self.attempts if k[:2] == (topic, channel) and k[2] > lowest]:
                del self.attempts[key]
        first = waiting[0] if waiting else None
        return [(len(waiting), top, first, self.messages[first].published_ms if first is not None else None, epoch,
                 previous, self.messages[previous].published_ms if previous is not None else None)]

    def _seek_holder(self, topic: str, channel: str, owner: int) -> str:
        """A new cursor's holder: the incarnation's cursor of another channel of the topic,
        else any cursor of it, else its node."""
        others = sorted((c, k.holder) for (t, c, o), k in self.cursors.items()
                        if t == topic and o == owner and c != channel)
        anywhere = sorted((t, c, k.holder) for (t, c, o), k in self.cursors.items() if o == owner)
        if others:
            return others[0][1]
        return anywhere[0][2] if anywhere else self.owners[owner]["node_id"]

    def _topic_leftovers(self, p: dict) -> list[tuple]:
        """Placement, copies waiting, delayed; no transaction of the double outlives its
        statement (``older``: 0); the time now, as PostgreSQL's now()."""
        name = p["name"]
        row = self.topics.get(name)
        pending = sum(1 for topic, _, _ in self.deliveries if topic == name)
        delayed = sum(1 for r in self.delayed.values() if r["topic"] == name)
        now = datetime.fromtimestamp(self._now_ms() / 1000, timezone.utc)
        return [(row["cluster"] if row is not None else None, pending, delayed, 0, now)]


def _spans(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids as the inclusive spans of consecutive ones (a multirange's ranges)."""
    spans: list[tuple[int, int]] = []
    for i in ids:
        if spans and spans[-1][1] == i - 1:
            spans[-1] = (spans[-1][0], i)
        else:
            spans.append((i, i))
    return spans


def _fire(d: Deferred[T], outcome: T | Exception) -> None:
    if isinstance(outcome, BaseException):
        d.errback(outcome)
    else:
        d.callback(outcome)
