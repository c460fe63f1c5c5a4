"""A run handed to ``Broker.publish_each`` off its direct way (a rate-limited topic, a topic
this node has not cached, a topic on another ``--pg-cluster`` cluster) reaches the group
commit whole: one transaction, ids in the run's order, with two writer connections whose
transactions commit in the opposite order to the one they began in. In-memory database,
``task.Clock``; the real PostgreSQL case is tests/integration/test_slow_path_runs.py."""

from __future__ import annotations

from typing import Any, Callable

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from dmq_server.broker import Broker
from dmq_server.core.errors import Invalid, RateLimited
from dmq_server.core.options import Options
from dmq_server.core.publish import Published, PublishRequest
from dmq_server.db.memory import MemoryDb
from dmq_server.db.messages import insert_messages_steps
from dmq_server.reliable.writer import PARALLEL_MIN
from tests.unit.test_broker import NODE, one_send
from tests.unit.test_placement import two_cluster_databases

RUN = PARALLEL_MIN + 6  # enough queued sends behind a lone first one for a second transaction


Held = list[tuple[Callable[..., Any], tuple[Any, ...], Deferred]]


class HeldWriter:
    """A writer connection to a ``MemoryDb`` whose message inserts, once ``hold`` is set,
    wait in ``held`` (shared by the writers, in the order they began) until the test
    releases them: two such writers run two transactions at once, and the one released
    first takes the lower ids, as in PostgreSQL."""

    def __init__(self, db: MemoryDb, held: Held | None = None) -> None:
        self.db = db
        self.hold = False
        self.held: Held = [] if held is None else held
        self.inserts = 0

    def run_steps(self, fn: Callable[..., Any], *args: Any) -> Deferred:
        if fn is not insert_messages_steps or not self.hold:
            return self.db.run_steps(fn, *args)
        self.inserts += 1
        d: Deferred = Deferred()
        self.held.append((fn, args, d))
        return d

    def release_all(self, latest_first: bool = False) -> None:
        while self.held:
            fn, args, d = self.held.pop(-1 if latest_first else 0)
            self.db.run_steps(fn, *args).chainDeferred(d)


def two_writers(db: MemoryDb) -> list[HeldWriter]:
    held: Held = []
    return [HeldWriter(db, held), HeldWriter(db, held)]


def start(broker: Broker, clock: Clock) -> None:
    started = broker.start()
    clock.advance(0.1)
    assert started.called


def rate_limited() -> tuple[Broker, Clock, str, list[HeldWriter]]:
    clock = Clock()
    clock.advance(1_700_000_000)
    db = MemoryDb(clock)
    db.create_topic("metered", ["c"], rate_limit=100_000)
    writers = two_writers(db)
    roles = {"writer0": writers[0], "writer1": writers[1], "acker": db, "loader": db, "admin": db}
    broker = Broker(Options(), clock, roles, NODE)
    start(broker, clock)
    return broker, clock, "metered", writers


def not_cached() -> tuple[Broker, Clock, str, list[HeldWriter]]:
    clock = Clock()
    clock.advance(1_700_000_000)
    db = MemoryDb(clock)
    writers = two_writers(db)
    roles = {"writer0": writers[0], "writer1": writers[1], "acker": db, "loader": db, "admin": db}
    broker = Broker(Options(), clock, roles, NODE)
    start(broker, clock)
    db.create_topic("late", ["c"])  # registered after this node's last registry read
    assert "late" not in broker.topics
    return broker, clock, "late", writers


def other_cluster() -> tuple[Broker, Clock, str, list[HeldWriter]]:
    clock, main, b = two_cluster_databases()
    writers = two_writers(b)
    roles = {"writer0": main, "acker": main, "loader": main, "admin": main}
    b_roles = {"writer0": writers[0], "writer1": writers[1], "acker": b, "loader": b, "admin": b}
    broker = Broker(Options(), clock, roles, NODE, clusters={"b": b_roles}, slots={"main": 0, "b": 1})
    start(broker, clock)
    return broker, clock, "remote", writers


@pytest.mark.parametrize("make", [rate_limited, not_cached, other_cluster])
def test_a_run_off_the_direct_way_is_one_transaction_with_ids_in_its_order(make: Any) -> None:
    broker, clock, topic, writers = make()
    for w in writers:
        w.hold = True
    sends = [one_send(topic, "outbox:shop:0a1b2c3d", b"r%d" % sid, sid).sends[0] for sid in range(1, RUN + 1)]
    got: dict[int, Any] = {}
    broker.publish_each(PublishRequest(topic=topic, producer="outbox:shop:0a1b2c3d", sends=sends),
                        lambda start, outcomes: got.update(enumerate(outcomes, start)))
    clock.advance(0.1)  # a registry refresh, when one is needed
    writers[0].release_all(latest_first=True)  # a later transaction commits first
    clock.advance(0.1)
    assert sorted(got) == list(range(RUN))
    ids = [got[i].message_id for i in range(RUN)]
    assert all(isinstance(got[i], Published) for i in range(RUN))
    assert ids == sorted(ids) and len(set(ids)) == RUN, ids
    assert sum(w.inserts for w in writers) == 1


def test_off_the_direct_way_each_send_keeps_its_own_answer() -> None:
    """A refused send (negative session id) and the rate limit's refusals are answered at
    their places; the rest are stored in order, in one transaction."""
    clock = Clock()
    clock.advance(1_700_000_000)
    db = MemoryDb(clock)
    db.create_topic("metered", ["c"], rate_limit=3)
    writer = HeldWriter(db)
    broker = Broker(Options(), clock, {"writer0": writer, "acker": db, "loader": db, "admin": db}, NODE)
    start(broker, clock)
    writer.hold = True
    sends = [one_send("metered", "p", b"m", sid).sends[0] for sid in (1, -2, 3, 4, 5, 6)]
    got: dict[int, Any] = {}
    broker.publish_each(PublishRequest(topic="metered", producer="p", sends=sends),
                        lambda start, outcomes: got.update(enumerate(outcomes, start)))
    assert isinstance(got.pop(1), Invalid)
    writer.release_all()
    clock.advance(0.1)  # the rate-limited sends' dead letters are recorded
    assert [type(got[i]) for i in (0, 2, 3, 4, 5)] == [Published, Published, Published, RateLimited, RateLimited]
    assert "recorded as dead letter" in str(got[4])
    assert got[0].message_id < got[2].message_id < got[3].message_id
    assert writer.inserts == 1
