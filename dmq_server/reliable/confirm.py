"""Confirmations of consumption: the messages producers asked to be told about.

A producer that sends with a confirmation deadline (``UP_PRODUCER_SEND``'s ``credit``,
docs/protocol.md §4.14) is answered ``SEND_SUCCESS_ACK`` as always, and later
``SEND_CONSUMED_ACK``: when every channel of the topic is done with the message (each
acknowledged it: ``CONSUMED``; some dead-lettered it: ``E_DEAD_LETTERED``), or when the
deadline came first (``E_DEADLINE``, naming the channels still waiting).

Why PostgreSQL decides, not the channels in memory: the copies may be pushed and
acknowledged on another node (a cluster's takeover, a consumer connected elsewhere), and
the cursors and dead letters are where every node's acks meet. So the node that stored
the message keeps the watch in memory and asks one statement per tick
(``db.confirm_steps``) about the watches it holds, only while it holds some: a send that
does not ask costs nothing here. The watch lives with the producer's connection: a
connection that closed (or a node that restarted) drops its watches, and the client
reports the confirmation lost.

A deadline does not wait for PostgreSQL: a tick that finds the last statement still out
(a slow or hung server, dropped after ``--pg-timeout``) reports the deadlines that passed
with the channels' last known states, so the producer hears ``E_DEADLINE`` on time and
not its client's ``LOST`` some seconds later.

Memory is bounded: at most ``limit`` watches (beyond: refused with ``E_LIMIT``), each
gone at its deadline at the latest; one statement asks about at most ``batch`` of them,
the next tick about the next ones.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_client.wire.confirm import CONSUMED, DEAD_LETTERED, DEADLINE, consumed_status

from dmq_server.core.clock import Clock, Timer
from dmq_server.db.confirm_steps import ACKED, DEAD, WAITING, consumed_states_steps
from dmq_server.db.outage import Outage
from dmq_server.db.runner import StepRunner
from dmq_server.db.storage_errors import StorageError

__all__ = ["ConfirmListener", "Confirmations", "TICK", "LIMIT", "BATCH"]

log = Logger()

TICK = 0.2  # seconds between two statements while watches are held
LIMIT = 100_000  # watches held at most (a node's memory for them: ~200 bytes each)
BATCH = 5_000  # watches one statement asks about


class ConfirmListener(Protocol):
    """Who hears a watch's outcome: the producer's connection (``protocols.dmq``)."""

    @property
    def closed(self) -> bool: ...

    def consumed(self, session_id: int, producer: str, topic: str, message_id: int, status: str) -> None: ...


@dataclass(slots=True)
class _Watch:
    message_id: int
    topic: str
    session_id: int
    producer: str
    deadline: float  # clock seconds
    listener: ConfirmListener
    # the last answer's channels by state (what a deadline reports)
    states: dict[str, list[str]] = field(default_factory=dict)


class Confirmations:
    """The watches of one store (one PostgreSQL cluster), asked about on a timer."""

    def __init__(self, db: StepRunner, clock: Clock, *, tick: float = TICK, limit: int = LIMIT, batch: int = BATCH):
        self._db = db
        self._clock = clock
        self._tick = tick
        self._limit = limit
        self._batch = batch
        self._watches: dict[int, _Watch] = {}  # by message id, oldest first
        self._timer: Timer | None = None
        self._asking = False
        self.resolved = 0  # outcomes sent, since start (stats, tests)
        self._outage = Outage("confirmations", clock)

    def __len__(self) -> int:
        return len(self._watches)

    def watch(self, topic: str, message_id: int, session_id: int, producer: str, deadline_ms: int,
              listener: ConfirmListener) -> str:
        """Watch ``message_id`` until every channel is done with it or ``deadline_ms`` (ms from
        now) passed; '' or the refusal's status (the listener is not called then). A resend of
        a watched message replaces its watch (the newest connection hears the outcome)."""
        if message_id not in self._watches and len(self._watches) >= self._limit:
            return f"E_LIMIT {self._limit} confirmations are pending on this server"
        self._watches[message_id] = _Watch(message_id, topic, session_id, producer,
                                           self._clock.seconds() + deadline_ms / 1000.0, listener)
        if self._timer is None:
            self._timer = self._clock.callLater(self._tick, self._ask)
        return ""

    def stop(self) -> None:
        """No more ticks (the store stops); the watches go with their connections."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self._watches.clear()

    def _ask(self) -> None:
        """A tick: the next statement, or, while the last one is still out (a PostgreSQL
        slow to answer, for up to ``--pg-timeout``), the deadlines that passed meanwhile:
        a deadline is reported on time whatever PostgreSQL does."""
        self._timer = None
        self._drop_closed()
        if self._asking:
            self._past_deadlines()
        elif self._watches:
            asked = list(self._watches.values())[: self._batch]
            self._asking = True
            d = self._db.run_steps(consumed_states_steps, [(w.message_id, w.topic) for w in asked])
            # a failure of the answer's handling too: the ticks go on (_next), never stuck asking
            d.addCallback(lambda rows: self._answered(asked, rows)).addErrback(self._failed)
        if self._watches and self._timer is None:
            self._timer = self._clock.callLater(self._tick, self._ask)

    def _drop_closed(self) -> None:
        for message_id in [i for i, w in self._watches.items() if w.listener.closed]:
            del self._watches[message_id]

    def _answered(self, asked: list[_Watch], rows: list[tuple[int, str, str]]) -> None:
        states: dict[int, dict[str, list[str]]] = defaultdict(lambda: {ACKED: [], DEAD: [], WAITING: []})
        self._outage.recovered()
        for message_id, channel, state in rows:
            states[message_id][state].append(channel)
        for watch in asked:
            found = states[watch.message_id]
            if self._watches.get(watch.message_id) is not watch:
                continue  # replaced by a resend's watch meanwhile: it is asked about next
            watch.states = found
            if not found[WAITING]:
                self._resolve(watch, consumed_status(DEAD_LETTERED if found[DEAD] else CONSUMED,
                                                     found[ACKED], found[DEAD]))
            else:
                # asked next after those not asked this time (a deadline is checked on every tick)
                del self._watches[watch.message_id]
                self._watches[watch.message_id] = watch
        self._next()

    def _failed(self, failure: Failure) -> None:
        if failure.check(StorageError):
            self._outage.failed(failure.getErrorMessage())  # logged once per outage
        else:
            log.failure("confirmations: the answer could not be handled", failure)
        self._next()

    def _next(self) -> None:
        """After a statement: report what passed its deadline, then the next tick if
        anything is left (none once nothing is)."""
        self._asking = False
        self._past_deadlines()
        timer = self._timer
        if self._watches and timer is None:
            self._timer = self._clock.callLater(self._tick, self._ask)
        elif not self._watches and timer is not None:
            if timer.active():
                timer.cancel()
            self._timer = None

    def _past_deadlines(self) -> None:
        now = self._clock.seconds()
        for watch in [w for w in self._watches.values() if w.deadline <= now]:
            states = watch.states
            status = consumed_status(DEADLINE, states.get(ACKED, ()), states.get(DEAD, ()), states.get(WAITING, ()))
            if not states:
                status += " PostgreSQL did not answer before the deadline"
            self._resolve(watch, status)

    def _resolve(self, watch: _Watch, status: str) -> None:
        del self._watches[watch.message_id]
        self.resolved += 1
        if not watch.listener.closed:
            watch.listener.consumed(watch.session_id, watch.producer, watch.topic, watch.message_id, status)
