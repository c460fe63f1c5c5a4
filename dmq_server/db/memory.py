"""An in-memory double of the database seam, for unit tests of the broker and the protocols.

It has the interface the server's callers use (``run_steps(steps_fn, *args)``
returning a Deferred, like a ``DbWorker`` or a ``ReactorDb``) and answers each
``Statement`` *by its query name* with a Python handler over dicts, the way
PostgreSQL answers the SQL of ``sql/queries.sql``: topics and channels, messages
unique by (producer, session_id), one delivery per registered channel, acks and the
delivery log, pauses, depths, the sweep, delayed sends and dead letters. A statement
without a handler fails loudly (``UnknownStatement``), so a test never passes on a
statement the double silently ignored. ``tests/integration/test_memory_db_contract.py``
runs the same steps here and on a migrated PostgreSQL and compares the answers, so
the double cannot drift from the SQL unnoticed.

Failures are injected by name (``fail_next``), with the two outcomes callers must
tell apart (see ``dmq_server.db.errors``):

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

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import psycopg
from twisted.internet.defer import Deferred

from dmq_server.db.errors import StorageError, storage_error
from dmq_server.db.steps import STATEMENTS, Statement, Steps

__all__ = ["MemoryDb", "UnknownStatement", "FAILURE_KINDS"]

FAILURE_KINDS = ("refused", "unknown", "lost")


class UnknownStatement(KeyError):
    """The double has no handler for a statement name."""


@dataclass
class _Failure:
    name: str
    kind: str
    times: int
    when: Callable[[dict], bool] | None


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


@dataclass
class _Delivery:
    attempts: int
    owner: str


class MemoryDb:
    """Tables as dicts; ``run_steps`` answers named statements. One instance plays the
    whole database: pass it as every worker role the broker takes."""

    def __init__(self, clock: Any = None, *, delay: float = 0.0, name: str = "memory"):
        self.clock = clock
        self.delay = delay
        self.name = name
        # dmq_topic: name -> settings; dmq_channel: topic -> channel names
        self.topics: dict[str, dict[str, Any]] = {}
        self.channels: dict[str, set[str]] = {}
        self.messages: dict[int, _Message] = {}
        self._pairs: dict[tuple[str, int], int] = {}  # UNIQUE (producer, session_id)
        self.deliveries: dict[tuple[str, str, int], _Delivery] = {}
        self.delivery_log: list[dict[str, Any]] = []
        self.pauses: set[tuple[str, str]] = set()
        self.delayed: dict[int, dict[str, Any]] = {}
        self._delayed_pairs: dict[tuple[str, int], int] = {}
        self.dead_letters: dict[int, dict[str, Any]] = {}
        self.returns: list[dict[str, Any]] = []  # dmq_trace
        self._ids = itertools.count(1)  # one sequence is enough: ids only need to grow
        self.executed: list[tuple[str, dict[str, Any]]] = []  # every statement run, in order
        self._failures: list[_Failure] = []
        self._handlers: dict[str, Callable[[dict[str, Any]], Any]] = {
            "list_topics": self._list_topics,
            "insert_new_messages": lambda p: self._insert_messages(p, on_conflict=False),
            "insert_messages": lambda p: self._insert_messages(p, on_conflict=True),
            "find_messages": self._find_messages,
            "ack_deliveries": self._ack_deliveries,
            "load_backlog": self._load_backlog,
            "load_owned_backlog": self._load_backlog,
            "channel_depths": self._channel_depths,
            "channel_pauses": self._channel_pauses,
            "pause_channel": self._pause_channel,
            "unpause_channel": self._unpause_channel,
            "empty_channel": self._empty_channel,
            "sweep_messages": self._sweep_messages,
            "insert_delayed": self._insert_delayed,
            "find_delayed": self._find_delayed,
            "insert_dead_letters": self._insert_dead_letters,
            "record_attempts": self._record_attempts,
            "exhaust_deliveries": self._exhaust_deliveries,
            "record_returns": self._record_returns,
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
    ) -> None:
        self.topics[name] = {
            "store": store,
            "msg_timeout_ms": msg_timeout_ms,
            "rate_limit": rate_limit,
            "ttl_ms": ttl_ms,
            "max_attempts": max_attempts,
        }
        self.channels.setdefault(name, set()).update(channels)

    def add_channel(self, topic: str, name: str) -> None:
        self.channels[topic].add(name)

    def fail_next(
        self, name: str, kind: str = "refused", *, times: int = 1, when: Callable[[dict], bool] | None = None
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

    def run_steps(self, steps_fn: Callable[..., Steps], *args: Any) -> Deferred:
        """Deferred with what ``steps_fn(*args)`` returns once its statements ran, or
        the StorageError a runner would give (RefusedError for refused input)."""
        d: Deferred = Deferred()
        try:
            outcome: Any = self._drive(steps_fn(*args))
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

    def _drive(self, steps: Steps) -> Any:
        send: Callable[[], Statement] = lambda: next(steps)  # noqa: E731
        while True:
            try:
                stmt = send()
            except StopIteration as stop:
                return stop.value
            try:
                rows = self.execute(stmt)
            except psycopg.Error as exc:
                send = lambda exc=exc: steps.throw(exc)  # noqa: E731
            except StorageError:
                steps.close()
                raise
            else:
                send = lambda rows=rows: steps.send(rows)  # noqa: E731

    def execute(self, stmt: Statement) -> Any:
        """One statement: its rows (a list of tuples), or the changed row count for a
        ``count`` statement; psycopg's error for refused input."""
        handler = self._handlers.get(stmt.name)
        if handler is None:
            raise UnknownStatement(f"the in-memory database has no handler for statement {stmt.name!r}")
        self.executed.append((stmt.name, stmt.params))
        failure = self._take_failure(stmt)
        if failure == "refused":
            raise psycopg.errors.NumericValueOutOfRange(f"{stmt.name}: input refused (injected)")
        if failure == "lost":
            raise StorageError(f"{self.name}: connection lost before {stmt.name} (injected)")
        rows = handler(stmt.params)
        if failure == "unknown":
            raise StorageError(f"{self.name}: connection lost after {stmt.name} committed (injected)")
        if stmt.count:
            return rows if isinstance(rows, int) else len(rows)
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
                sorted(self.channels.get(name, ())),
            )
            for name, t in sorted(self.topics.items())
        ]

    # -- messages and deliveries ----------------------------------------------------

    def _insert_messages(self, p: dict, *, on_conflict: bool) -> list[tuple]:
        """insert_messages (resent pairs skipped) and insert_new_messages (any stored
        pair is a unique violation and nothing is inserted)."""
        items = list(zip(p["topics"], p["producers"], p["session_ids"], p["produced_ms"], p["bodies"]))
        # PostgreSQL inserts in (producer, session_id) order: the ids follow it
        items.sort(key=lambda i: (i[1], i[2]))
        seen: set[tuple[str, int]] = set()
        fresh = []
        for item in items:
            key = (item[1], item[2])
            if key in self._pairs or key in seen:
                if not on_conflict:
                    raise psycopg.errors.UniqueViolation(
                        "duplicate key value violates unique constraint \"dmq_message_producer_session_id_key\""
                    )
                continue
            seen.add(key)
            fresh.append(item)
        now = self._now_ms()
        rows = []
        for topic, producer, session_id, produced_ms, body in fresh:
            message = _Message(next(self._ids), topic, producer, session_id, produced_ms, now, p["node_id"], bytes(body))
            self.messages[message.id] = message
            self._pairs[(producer, session_id)] = message.id
            names = sorted(self.channels.get(topic, ()))
            for name in names:
                self.deliveries[(topic, name, message.id)] = _Delivery(0, p["node_id"])
            rows.append((message.id, producer, session_id, now, names))
        return rows

    def _find_messages(self, p: dict) -> list[tuple]:
        rows = []
        for key in zip(p["producers"], p["session_ids"]):
            message_id = self._pairs.get(key)
            if message_id is not None:
                m = self.messages[message_id]
                rows.append((m.id, m.producer, m.session_id, m.published_ms))
        return rows

    def _ack_deliveries(self, p: dict) -> int:
        acked = 0
        for topic, channel, message_id, first_ms, acked_ms, attempts, consumer, delivered_ms in zip(
            p["topics"], p["channels"], p["message_ids"], p["first_ms"], p["acked_ms"], p["attempts"],
            p["consumers"], p["delivered_ms"],
        ):
            delivery = self.deliveries.pop((topic, channel, message_id), None)
            if delivery is None or message_id not in self.messages:
                continue
            acked += 1
            self.delivery_log.append(
                {
                    "message_id": message_id,
                    "topic": topic,
                    "channel": channel,
                    "first_ms": first_ms if first_ms > 0 else None,
                    "acked_ms": acked_ms,
                    "attempts": max(attempts, delivery.attempts),
                    "consumer": consumer,
                    "delivered_ms": delivered_ms if delivered_ms > 0 else None,
                }
            )
        return acked

    def _record_returns(self, p: dict) -> int:
        keys = ("message_id", "topic", "channel", "attempt", "reason", "consumer", "delivered_ms", "returned_ms")
        columns = ("message_ids", "topics", "channels", "attempts", "reasons", "consumers", "delivered_ms",
                   "returned_ms")
        rows = [dict(zip(keys, values), node_id=p["node_id"]) for values in zip(*(p[c] for c in columns))]
        self.returns.extend(rows)
        return len(rows)

    def _load_backlog(self, p: dict) -> list[tuple]:
        owner = p.get("owner")
        ids = sorted(
            message_id
            for (topic, channel, message_id), d in self.deliveries.items()
            if topic == p["topic"] and channel == p["channel"] and message_id > p["after"]
            and (owner is None or d.owner == owner)
        )[: p["limit"]]
        rows = []
        for message_id in ids:
            m = self.messages[message_id]
            d = self.deliveries[(p["topic"], p["channel"], message_id)]
            rows.append((m.id, m.producer, m.session_id, m.published_ms, m.body, d.attempts))
        return rows

    def _channel_depths(self, p: dict) -> list[tuple]:
        depths: dict[tuple[str, str], int] = {}
        for topic, channel, _ in self.deliveries:
            depths[(topic, channel)] = depths.get((topic, channel), 0) + 1
        return [(t, c, n) for (t, c), n in sorted(depths.items())]

    def _channel_pauses(self, p: dict) -> list[tuple]:
        return sorted(self.pauses)

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

    def _empty_channel(self, p: dict) -> int:
        gone = [k for k in self.deliveries if k[0] == p["topic"] and k[1] == p["channel"]]
        for key in gone:
            del self.deliveries[key]
        return len(gone)

    def _sweep_messages(self, p: dict) -> int:
        """Messages older than the retention with no copy left on a registered channel."""
        cutoff = self._now_ms() - p["retention_s"] * 1000
        held = {
            message_id
            for topic, channel, message_id in self.deliveries
            if channel in self.channels.get(topic, ())
        }
        gone = sorted(
            m.id for m in self.messages.values() if m.published_ms < cutoff and m.id not in held
        )[: p["limit"]]
        for message_id in gone:
            m = self.messages.pop(message_id)
            del self._pairs[(m.producer, m.session_id)]
        return len(gone)

    # -- delayed sends ---------------------------------------------------------------

    def _insert_delayed(self, p: dict) -> list[tuple]:
        items = sorted(
            zip(p["topics"], p["producers"], p["session_ids"], p["produced_ms"], p["due_ms"], p["fragments"], p["bodies"]),
            key=lambda i: (i[1], i[2]),
        )
        rows = []
        for topic, producer, session_id, produced_ms, due_ms, fragment, body in items:
            key = (producer, session_id)
            if key in self._pairs or key in self._delayed_pairs:
                continue
            delay_id = next(self._ids)
            self.delayed[delay_id] = {
                "id": delay_id, "fragment": fragment, "due_ms": due_ms, "topic": topic, "producer": producer,
                "session_id": session_id, "produced_ms": produced_ms, "node_id": p["node_id"], "body": bytes(body),
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
                   "attempts", "bodies", "published_ms")
        rows = []
        now = self._now_ms()
        for values in zip(*(p[c] for c in columns)):
            letter = dict(zip(("reason", "detail", "topic", "channel", "producer", "session_id", "message_id",
                               "attempts", "body", "published_ms"), values))
            letter["id"] = next(self._ids)
            letter["dead_ms"] = now
            letter["body"] = bytes(letter["body"])
            self.dead_letters[letter["id"]] = letter
            rows.append((letter["id"],))
        return rows

    def _copies(self, p: dict) -> Iterable[tuple[tuple[str, str, int], int]]:
        for topic, channel, message_id, attempts in zip(p["topics"], p["channels"], p["message_ids"], p["attempts"]):
            yield (topic, channel, message_id), attempts

    def _record_attempts(self, p: dict) -> int:
        changed = 0
        for key, attempts in self._copies(p):
            delivery = self.deliveries.get(key)
            if delivery is not None:
                delivery.attempts = max(delivery.attempts, attempts)
                changed += 1
        return changed

    def _exhaust_deliveries(self, p: dict) -> list[tuple]:
        rows = []
        now = self._now_ms()
        for key, attempts in self._copies(p):
            delivery = self.deliveries.pop(key, None)
            if delivery is None:
                continue
            m = self.messages[key[2]]
            tries = max(delivery.attempts, attempts)
            letter_id = next(self._ids)
            self.dead_letters[letter_id] = {
                "id": letter_id, "reason": "max_attempts",
                "detail": f"delivered {tries} times without acknowledgement",
                "topic": key[0], "channel": key[1], "producer": m.producer, "session_id": m.session_id,
                "message_id": m.id, "attempts": tries, "body": m.body, "published_ms": m.published_ms,
                "dead_ms": now,
            }
            rows.append(key)
        return rows


def _fire(d: Deferred, outcome: Any) -> None:
    if isinstance(outcome, BaseException):
        d.errback(outcome)
    else:
        d.callback(outcome)
