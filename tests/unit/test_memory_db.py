"""Unit tests of ``dmq_server.db.memory.MemoryDb``, the in-memory double of the database seam.

It runs the server's own steps (``db.messages``, ``db.dead_letter_steps``, ``db.topic_steps``)
and must answer them as PostgreSQL does (the contract test on real PostgreSQL is
``tests/integration/test_memory_db_contract.py``); here: the answers that matter to
the broker, and the injected failures arriving as the runners deliver them.
"""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from dmq_client.wire.properties import NO_PROPERTIES, Properties
from dmq_server.db.dead_letter_steps import NewDeadLetter, insert_dead_letters_steps
from dmq_server.db.storage_errors import RefusedError, StorageError
from dmq_server.db.memory import MemoryDb, UnknownStatement
from dmq_server.db.messages import (
    AckRow,
    CursorProgress,
    NewMessage,
    ack_deliveries_steps,
    create_owner_steps,
    empty_channel_steps,
    retire_silent_owners_steps,
    insert_messages_steps,
    load_backlog_steps,
    load_priority_backlog_steps,
    read_channel_state_steps,
    depth_slice_steps,
    run_query_steps,
    sweep_all_steps,
)
from dmq_server.db.steps import Statement
from dmq_server.db.topic_steps import list_topics_steps


def result(d: Deferred) -> Any:
    """The outcome of an already fired Deferred: its value, or its exception."""
    out: list[Any] = []
    d.addBoth(out.append)
    assert out, "the Deferred has not fired"
    value = out[0]
    return value.value if hasattr(value, "value") and isinstance(value.value, BaseException) else value


def msg(producer: str, session_id: int, topic: str = "orders", body: bytes = b"x") -> NewMessage:
    return NewMessage(topic, producer, session_id, 0, body)


@pytest.fixture
def db() -> MemoryDb:
    clock = Clock()
    clock.advance(1_700_000_000)
    db = MemoryDb(clock)
    db.create_topic("orders", ["billing", "audit"])
    db.create_topic("empty")
    assert result(db.run_steps(create_owner_steps, "node-1")) == OWNER
    db.executed.clear()
    return db


OWNER = 1  # the incarnation every test stores as


def test_a_batch_is_stored_with_one_delivery_per_channel(db):
    stored = result(db.run_steps(insert_messages_steps, [msg("p", 1), msg("p", 2)], "node-1", OWNER))
    assert [s.duplicate for s in stored] == [False, False]
    assert all(s.channels == ("audit", "billing") for s in stored)
    assert stored[0].message_id < stored[1].message_id
    assert sorted(db.deliveries) == sorted(
        (("orders", c, s.message_id)) for c in ("audit", "billing") for s in stored
    )
    assert db.names_run() == ["insert_new_messages"]


def test_a_resent_pair_is_answered_from_the_stored_row(db):
    first = result(db.run_steps(insert_messages_steps, [msg("p", 1)], "node-1", OWNER))
    again = result(db.run_steps(insert_messages_steps, [msg("p", 1), msg("p", 2)], "node-1", OWNER))
    assert again[0].duplicate and again[0].message_id == first[0].message_id and again[0].channels == ()
    assert not again[1].duplicate
    # the fast statement met the stored pair, so the batch ran again with ON CONFLICT
    assert db.names_run() == ["insert_new_messages", "insert_new_messages", "insert_messages", "find_messages"]
    assert len(db.messages) == 2 and len(db.deliveries) == 4


def test_the_same_pair_twice_in_one_batch_is_stored_once(db):
    stored = result(db.run_steps(insert_messages_steps, [msg("p", 7), msg("p", 7)], "node-1", OWNER))
    assert [s.duplicate for s in stored] == [False, True]
    assert stored[0].message_id == stored[1].message_id
    assert len(db.messages) == 1


def test_the_priority_backlog_is_highest_first_then_id_each_level_after_its_bound(db):
    """The double's read-ahead, a level at a time (the same scenario on PostgreSQL and the double:
    tests/integration/test_priority_backlog.py); a load needs one bound a level, 1 to 9."""
    priorities = [0, 3, 9, 3, 0, 9, 1]
    batch = [NewMessage("orders", "p", n, 0, b"x", Properties(priority=p) if p else NO_PROPERTIES)
             for n, p in enumerate(priorities)]
    ids = [s.message_id for s in result(db.run_steps(insert_messages_steps, batch, "node-1", OWNER))]
    loaded = result(db.run_steps(load_priority_backlog_steps, "orders", "billing", [0] * 9, 10))
    assert [(r.message_id, r.priority) for r in loaded] == [
        (ids[2], 9), (ids[5], 9), (ids[1], 3), (ids[3], 3), (ids[6], 1)]
    after = [0] * 9
    after[9 - 1], after[3 - 1] = ids[2], ids[3]  # level 9 loaded up to its first copy, level 3 to its end
    loaded = result(db.run_steps(load_priority_backlog_steps, "orders", "billing", after, 2))
    assert [r.message_id for r in loaded] == [ids[5], ids[6]]
    assert [r.priority for r in result(db.run_steps(load_backlog_steps, "orders", "billing", 0, 10))] == priorities
    with pytest.raises(ValueError, match="8 bounds, one a priority 1 to 9 expected"):
        next(load_priority_backlog_steps("orders", "billing", [0] * 8, 10))


def test_acks_move_the_cursor_and_log_once_and_backlog_reads_what_is_left(db):
    stored = result(db.run_steps(insert_messages_steps, [msg("p", i) for i in range(1, 4)], "node-1", OWNER))
    ids = [s.message_id for s in stored]
    acks = [AckRow("orders", "billing", ids[0], 5, 6, 1, owner=OWNER), AckRow("orders", "billing", ids[0], 5, 6, 1, owner=OWNER)]
    progress = [CursorProgress("orders", "billing", OWNER, ids[0], [])]
    assert result(db.run_steps(ack_deliveries_steps, acks, progress, "node-1")) == []
    assert len(db.delivery_log) == 1  # the same copy twice in a batch is logged once
    assert result(db.run_steps(ack_deliveries_steps, acks[:1], progress, "node-1")) == []
    assert len(db.delivery_log) == 1  # an ack of a copy already done changes nothing
    backlog = result(db.run_steps(load_backlog_steps, "orders", "billing", 0, 10))
    assert [r.message_id for r in backlog] == ids[1:] and {r.owner for r in backlog} == {OWNER}
    assert [r.message_id for r in result(db.run_steps(load_backlog_steps, "orders", "billing", ids[1], 1))] == [ids[2]]
    # a cluster node loads its own incarnation's copies and those of cursors it holds
    assert [r.message_id for r in result(db.run_steps(load_backlog_steps, "orders", "audit", 0, 10, "node-2", 9))] == []
    assert len(result(db.run_steps(load_backlog_steps, "orders", "audit", 0, 10, "node-1", OWNER))) == 3
    # a span above the floor: the last copy done out of order
    result(db.run_steps(ack_deliveries_steps, [AckRow("orders", "billing", ids[2], 5, 6, 1, owner=OWNER)],
                        [CursorProgress("orders", "billing", OWNER, ids[0], [(ids[2], ids[2])])], "node-1"))
    assert [r.message_id for r in result(db.run_steps(load_backlog_steps, "orders", "billing", 0, 10))] == [ids[1]]
    held, retired, epochs = result(db.run_steps(read_channel_state_steps))
    assert held == set() and retired == set()
    # the depth count's slices: two messages, then the rest (the pass is complete)
    low, high, first, lowest = result(db.run_steps(depth_slice_steps, None, 2))
    assert (low, high) == (ids[0] - 1, ids[1]) and first == {("orders", "audit"): 2, ("orders", "billing"): 1}
    assert lowest == {("orders", "audit"): ids[0], ("orders", "billing"): ids[1]}
    assert result(db.run_steps(depth_slice_steps, high, 2)) == (ids[1], None, {("orders", "audit"): 1},
                                                                {("orders", "audit"): ids[2]})


def test_pause_empty_and_sweep_count_the_rows_they_change(db):
    result(db.run_steps(insert_messages_steps, [msg("p", 1)], "node-1", OWNER))
    params = {"topic": "orders", "channel": "billing"}
    assert result(db.run_steps(run_query_steps, "pause_channel", params)) == 1
    assert result(db.run_steps(run_query_steps, "pause_channel", params)) == 0
    assert result(db.run_steps(read_channel_state_steps))[0] == {("orders", "billing")}
    assert result(db.run_steps(empty_channel_steps, "orders", "billing")) == 1
    assert result(db.run_steps(empty_channel_steps, "orders", "billing")) == 0
    assert result(db.run_steps(sweep_all_steps, 0, 100)) == 0  # audit still holds a copy
    result(db.run_steps(empty_channel_steps, "orders", "audit"))
    assert result(db.run_steps(sweep_all_steps, 60, 100)) == 0  # younger than the retention
    db.clock.advance(61)
    assert result(db.run_steps(sweep_all_steps, 60, 100)) == 1 and not db.messages


def test_a_retired_incarnation_stores_nothing(db):
    second = result(db.run_steps(create_owner_steps, "node-1"))
    assert result(db.run_steps(retire_silent_owners_steps, second, "node-1", 3600)) == [OWNER]
    error = result(db.run_steps(insert_messages_steps, [msg("p", 1)], "node-1", OWNER))
    assert isinstance(error, StorageError) and error.code == "E_FENCED" and not db.messages
    assert not result(db.run_steps(insert_messages_steps, [msg("p", 1)], "node-1", second))[0].duplicate


def test_topics_and_dead_letters(db):
    topics = result(db.run_steps(list_topics_steps))
    assert [(t.name, t.channels) for t in topics] == [("empty", ()), ("orders", ("audit", "billing"))]
    letter = NewDeadLetter("rate_limited", "orders", "p", 1, b"body")
    ids = result(db.run_steps(insert_dead_letters_steps, [letter, letter]))
    assert len(ids) == 2 and ids[0] < ids[1] and db.dead_letters[ids[0]]["reason"] == "rate_limited"


def test_a_refused_statement_fails_the_run_with_a_refused_error_and_stores_nothing(db):
    db.fail_next("insert_new_messages", "refused")
    error = result(db.run_steps(insert_messages_steps, [msg("p", 1)], "node-1", OWNER))
    assert isinstance(error, RefusedError) and error.sqlstate.startswith("22")
    assert not db.messages
    # only once: the next run stores
    assert not result(db.run_steps(insert_messages_steps, [msg("p", 1)], "node-1", OWNER))[0].duplicate


def test_a_refusal_can_target_the_batches_holding_one_producer(db):
    db.fail_next("insert_new_messages", "refused", times=10, when=lambda p: "bad" in p["producers"])
    assert isinstance(result(db.run_steps(insert_messages_steps, [msg("bad", 1), msg("p", 1)], "n", OWNER)), RefusedError)
    assert not result(db.run_steps(insert_messages_steps, [msg("p", 1)], "n", OWNER))[0].duplicate


def test_an_unknown_outcome_is_applied_and_its_answer_lost(db):
    db.fail_next("insert_new_messages", "unknown")
    error = result(db.run_steps(insert_messages_steps, [msg("p", 1)], "node-1", OWNER))
    assert isinstance(error, StorageError) and not isinstance(error, RefusedError)
    assert len(db.messages) == 1 and len(db.deliveries) == 2  # committed all the same


def test_a_lost_statement_is_not_applied(db):
    db.fail_next("ack_new_deliveries", "lost")
    stored = result(db.run_steps(insert_messages_steps, [msg("p", 1)], "node-1", OWNER))
    error = result(db.run_steps(ack_deliveries_steps, [AckRow("orders", "audit", stored[0].message_id, 0, 1, 1, owner=OWNER)],
                                [CursorProgress("orders", "audit", OWNER, stored[0].message_id, [])], "node-1"))
    assert isinstance(error, StorageError) and not isinstance(error, RefusedError)
    assert len(db.deliveries) == 2


def test_answers_wait_for_the_clock_when_given_a_delay():
    clock = Clock()
    db = MemoryDb(clock, delay=0.5)
    db.create_topic("orders", ["billing"])
    db.owners[OWNER] = {"node_id": "node-1", "retired": False}
    d = db.run_steps(insert_messages_steps, [msg("p", 1)], "node-1", OWNER)
    assert not d.called
    clock.advance(0.5)
    assert d.called


def test_a_statement_without_a_handler_fails_loudly(db):
    def steps() -> Any:
        yield Statement("record_migration", {})  # the migrator's: the double has no tables to migrate

    assert isinstance(result(db.run_steps(steps)), UnknownStatement)
    with pytest.raises(UnknownStatement):
        db.fail_next("no_such_statement")
    with pytest.raises(ValueError, match="failure kind"):
        db.fail_next("insert_messages", "sometimes")
