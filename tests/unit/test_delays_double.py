"""Delayed sends on the in-memory double: a ``DelayWorker`` running the delay table's real
steps (``db.delays``: peek, move), and the operators' statements (browse, histogram,
deliver now, cancel).

The double answers the statements as PostgreSQL does
(tests/integration/test_memory_db_contract.py), on a ``task.Clock``: a row moves into the
reliable flow exactly when the clock reaches its due time, for its topic's channels (a
replay: its own channel), once; a retired incarnation moves nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.task import Clock

from dmq_server.db.delays import (
    NewDelayed,
    cancel_delayed_steps,
    deliver_delayed_now_steps,
    due_histogram_steps,
    insert_delayed_steps,
    list_delayed_steps,
    move_due_steps,
)
from dmq_server.db.memory import MemoryDb
from dmq_server.db.messages import NewMessage, create_owner_steps, retire_silent_owners_steps
from dmq_server.reliable.delay import DelayWorker
from dmq_server.reliable.horizon import OwnWrites
from tests.unit.test_memory_db import result

T0 = 1_800_000_000.0
BASE = int(T0 * 1000)



@pytest.fixture
def clock() -> Clock:
    clock = Clock()
    clock.advance(T0)
    return clock


@pytest.fixture
def db(clock) -> MemoryDb:
    db = MemoryDb(clock)
    db.create_topic("orders", ["billing", "audit"])
    db.create_topic("lonely")  # no channel: a due row becomes a dead letter
    assert result(db.run_steps(create_owner_steps, "n1")) == 1
    return db


def store(db: MemoryDb, *items: tuple[str, int, int, int]) -> list[Any]:
    """(topic, session id, due in ms from T0, fragment) -> StoredDelay."""
    batch = [NewDelayed(NewMessage(topic, "p", sid, 0, f"b{sid}".encode()), BASE + due, fragment) for topic, sid, due, fragment in items]
    return result(db.run_steps(insert_delayed_steps, batch, "n1"))


def worker(db: MemoryDb, clock: Clock, moved: list, owner: int = 1) -> DelayWorker:
    w = DelayWorker(1, db, clock, max_fragment=8, poll_interval=1.0, batch_size=100, tick=0.01, node_id="n1",
                    on_moved=moved.extend, writes=OwnWrites(owner))
    w.set_fragments((1, 2, 3, 4))
    return w


def test_rows_move_when_the_clock_reaches_their_due_time(db, clock):
    store(db, ("orders", 1, 500, 2), ("orders", 2, 750, 3), ("orders", 3, 2600, 6))  # 6: another worker's
    moved: list = []
    worker(db, clock, moved)
    clock.advance(0.499)
    assert moved == []
    clock.advance(0.001)
    assert [(m.body, m.due_ms, m.channels) for m in moved] == [(b"b1", BASE + 500, ("audit", "billing"))]
    clock.advance(0.25)
    assert [m.body for m in moved] == [b"b1", b"b2"]
    clock.advance(5)
    assert len(moved) == 2 and [r["fragment"] for r in db.delayed.values()] == [6]
    assert sorted(m.body for m in db.messages.values()) == [b"b1", b"b2"]
    assert {m.message_id for m in moved} == set(db.messages)
    assert {(t, c) for t, c, _ in db.deliveries} == {("orders", "billing"), ("orders", "audit")}


def test_a_resent_delayed_pair_is_a_duplicate_and_moves_once(db, clock):
    (first,) = store(db, ("orders", 1, 100, 1))
    (again,) = store(db, ("orders", 1, 100, 1))
    assert not first.duplicate and again.duplicate and again.message_id == first.message_id
    moved: list = []
    worker(db, clock, moved)
    clock.advance(1)
    (message,) = moved
    (after,) = store(db, ("orders", 1, 100, 1))  # moved now: answered with the stored message
    assert after.duplicate and after.kind == "message" and after.message_id == message.message_id


def test_a_row_whose_topic_has_no_channel_becomes_a_dead_letter(db, clock):
    store(db, ("lonely", 1, 0, 1))
    taken, moved = result(db.run_steps(move_due_steps, (1,), 8, BASE, 10, "n1", 1))
    assert (taken, moved) == (1, [])
    (letter,) = db.dead_letters.values()
    assert letter["reason"] == "operator" and letter["detail"].startswith("topic had no registered channel")


def test_a_retired_incarnation_moves_nothing(db, clock):
    store(db, ("orders", 1, 0, 1))
    assert result(db.run_steps(create_owner_steps, "n1")) == 2
    assert result(db.run_steps(retire_silent_owners_steps, 2, "n1", 3600)) == [1]
    moved: list = []
    w = worker(db, clock, moved, owner=1)
    clock.advance(1)
    assert moved == [] and len(db.delayed) == 1 and "retired" in w.last_error


def test_operators_browse_bucket_deliver_now_and_cancel(db, clock):
    stored = store(db, ("orders", 1, 10_000, 1), ("orders", 2, 20_000, 2), ("lonely", 3, 90_000, 3))
    ids = [s.message_id for s in stored]
    page = result(db.run_steps(list_delayed_steps, "orders", 0, 0, 1, 1))
    assert [(r["delay_id"], r["body"], r["truncated"]) for r in page] == [(ids[0], "b", True)]
    rest = result(db.run_steps(list_delayed_steps, None, page[-1]["due_ms"], page[-1]["delay_id"], 10))
    assert [r["delay_id"] for r in rest] == ids[1:]
    assert result(db.run_steps(due_histogram_steps, None, BASE, 15_000)) == [(0, 1), (1, 1), (6, 1)]
    assert result(db.run_steps(due_histogram_steps, "lonely", BASE, 15_000)) == [(6, 1)]
    assert result(db.run_steps(deliver_delayed_now_steps, [ids[1], 999], BASE)) == [ids[1]]
    assert result(db.run_steps(deliver_delayed_now_steps, [ids[1]], BASE)) == []  # due already
    assert result(db.run_steps(cancel_delayed_steps, [ids[2], 999])) == [ids[2]]
    moved: list = []
    worker(db, clock, moved)
    clock.advance(1)
    assert [m.body for m in moved] == [b"b2"]  # made due now; the cancelled one is gone
    assert sorted(db.delayed) == [ids[0]]
