"""What operators see of an outbox, without IO: the gauge's readings on a database double
and task.Clock (once a second, the next timed from the end of the last, a failure keeping
the old reading and slowing down), the relay's figures brought forward by the clock, the
JSON and /metrics shapes, and a DSN shown without its password. On real PostgreSQL and a
running server: tests/integration/test_outbox_figures.py."""

from __future__ import annotations

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from dmq_server.core.outbox_figures import (
    PENDING_BOUND, Measured, OutboxFigures, figures_json, holder_label, holder_node,
)
from dmq_server.core.outbox_rows import OutboxSource
from dmq_server.db import outbox
from dmq_server.db.storage_errors import StorageError
from dmq_server.http.metrics import DmqCollector, Snapshot
from dmq_server.protocols.outbox_gauges import RETRY, OutboxGauge
from dmq_server.protocols.outbox_relay import OutboxRelay

from .test_outbox_relay_loop import Broker, Db

pytestmark = pytest.mark.unit

SOURCE = OutboxSource("shop", "dmq_outbox", "host=db.example port=5433 dbname=app user=app password=s3cret")


def test_a_relay_names_its_node_and_a_holder_is_told_by_that_name() -> None:
    assert holder_label("node-a") == "dmq node-a"
    assert holder_node("dmq node-a") == "node-a"
    assert holder_node("psql") == "psql"  # another program holds the lock: its own name
    assert holder_node(None) is None
    long = holder_label("ü" * 40)  # PostgreSQL keeps 63 bytes: whole characters only
    assert len(long.encode()) <= 63 and long.startswith("dmq ü")


def test_a_dsn_is_shown_as_host_and_database_only() -> None:
    assert outbox.dsn_database(SOURCE.dsn) == "db.example:5433/app"
    assert outbox.dsn_database("postgresql://app:s3cret@db.example/orders") == "db.example/orders"
    assert outbox.dsn_database("not a dsn = = =") == "?"
    named = outbox.named_dsn(SOURCE.dsn, "dmq node-a")
    assert "application_name='dmq node-a'" in named and "password=s3cret" in named


def gauge_with(answer: object) -> tuple[OutboxGauge, Db, Clock]:
    clock = Clock()
    db = Db({outbox.read_figures: answer})
    return OutboxGauge(SOURCE, db, clock), db, clock


def test_the_gauge_reads_once_a_second_timed_from_the_end_of_the_last_reading() -> None:
    answers: list[Deferred[Measured]] = []

    def read(*_: object) -> Deferred[Measured]:
        answers.append(Deferred())
        return answers[-1]

    gauge, db, clock = gauge_with(read)
    gauge.start()
    assert db.started and db.count(outbox.read_figures) == 1
    assert db.calls[0][1][1:] == ("dmq_outbox", PENDING_BOUND)
    clock.advance(5)  # the database is slow: never asked twice at once
    assert db.count(outbox.read_figures) == 1 and gauge.measured is None
    answers[0].callback(Measured(3, 2.5, "dmq node-a"))
    assert gauge.measured == Measured(3, 2.5, "dmq node-a") and gauge.measured_at == 5
    clock.advance(0.9)
    assert db.count(outbox.read_figures) == 1
    clock.advance(0.1)
    assert db.count(outbox.read_figures) == 2
    stopped = gauge.stop()
    assert not stopped.called  # the reading under way ends first
    answers[1].callback(Measured(0, None, None))
    assert stopped.called and db.stopped
    clock.advance(10)
    assert db.count(outbox.read_figures) == 2


def test_a_failing_reading_keeps_the_last_one_and_tries_less_often() -> None:
    results: list[object] = [Measured(7, 1.0, None), StorageError("connection refused"), Measured(0, None, None)]
    gauge, db, clock = gauge_with(lambda *_: results.pop(0))
    gauge.start()
    clock.advance(1)
    assert db.count(outbox.read_figures) == 2
    assert gauge.measured == Measured(7, 1.0, None) and gauge.measured_at == 0
    clock.advance(RETRY - 0.5)
    assert db.count(outbox.read_figures) == 2
    clock.advance(0.5)
    assert db.count(outbox.read_figures) == 3 and gauge.measured == Measured(0, None, None)
    gauge.stop()
    assert db.stopped


def test_the_figures_bring_the_oldest_age_forward_and_say_who_relays() -> None:
    clock = Clock()
    relay = OutboxRelay(SOURCE, Broker(), clock, Db({}), Db({}))
    relay.node_id, relay.database = "node-a", "db.example:5433/app"
    unread = relay.figures(None, 0.0)
    assert (unread.pending, unread.oldest_age, unread.last_cycle_age, unread.relaying_node) == (None, None, None, None)
    clock.advance(10)
    relay._cycled_at = 8.0
    held = relay.figures(Measured(PENDING_BOUND, 4.0, "dmq node-b"), 7.0)
    assert held.oldest_age == 7.0 and held.measured_age == 3.0 and held.last_cycle_age == 2.0
    assert held.pending_at_least and not held.relaying and held.relaying_node == "node-b"
    relay._pid = 42  # this node took the lock
    relay.relayed, relay.dead = 12, 1
    mine = relay.figures(Measured(3, None, "dmq node-a"), 10.0)
    assert mine.relaying_node == "node-a" and not mine.pending_at_least and mine.oldest_age is None
    shown = figures_json(mine)
    assert shown["relayed"] == 12 and shown["dead_lettered"] == 1 and shown["database"] == "db.example:5433/app"
    assert "s3cret" not in repr(shown)


def figures(name: str, **changes: object) -> OutboxFigures:
    values: dict = dict(name=name, schema="dmq_outbox", database="h/app", node_id="node-a", relaying=False,
                        holder=None, pending=None, oldest_age=None, relayed=0, dead_lettered=0,
                        last_cycle_age=None, measured_age=None)
    values.update(changes)
    return OutboxFigures(**values)


def test_metrics_per_outbox() -> None:
    snap = Snapshot(node_id="node-a", version="1", broker={}, outboxes=[
        figures("shop", relaying=True, pending=5, oldest_age=2.5, relayed=40, dead_lettered=2, last_cycle_age=0.5),
        figures("billing", pending=0),
        figures("fresh"),  # not read yet: no pending figure rather than a false 0
    ])
    samples = {(s.name, tuple(s.labels.values())): s.value
               for family in DmqCollector(lambda: snap).collect() for s in family.samples}
    assert samples[("dmq_outbox_pending_rows", ("shop",))] == 5
    assert samples[("dmq_outbox_oldest_pending_seconds", ("shop",))] == 2.5
    assert samples[("dmq_outbox_relayed_total", ("shop",))] == 40
    assert samples[("dmq_outbox_dead_lettered_total", ("shop",))] == 2
    assert samples[("dmq_outbox_relaying", ("shop",))] == 1
    assert samples[("dmq_outbox_last_cycle_seconds", ("shop",))] == 0.5
    assert samples[("dmq_outbox_relaying", ("billing",))] == 0
    assert samples[("dmq_outbox_oldest_pending_seconds", ("billing",))] == 0
    assert ("dmq_outbox_pending_rows", ("fresh",)) not in samples
    assert ("dmq_outbox_relayed_total", ("fresh",)) in samples
    none = Snapshot(node_id="node-a", version="1", broker={})
    assert not [f for f in DmqCollector(lambda: none).collect() if f.name.startswith("dmq_outbox")]
