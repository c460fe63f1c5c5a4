"""The message trace (``dmq trace``, the admin API's message view) on the in-memory double.

A real ``Broker`` on ``MemoryDb`` delivers, times out, redelivers and acknowledges; the
trace's steps (``db.trace_steps``) then read the story back from what was stored: the same
statements PostgreSQL answers (tests/integration/test_memory_db_contract.py), in
milliseconds. Also a dead letter's replay, finding by session, peeking, and the gauges.
"""

from __future__ import annotations

import pytest

from dmq_server.db.admin_steps import replay_batch_steps
from dmq_server.db.dead_letter_steps import NewDeadLetter, insert_dead_letters_steps
from dmq_server.db.delays import move_due_steps
from dmq_server.db.trace_steps import (
    find_message_steps,
    peek_channel_steps,
    read_gauges_steps,
    read_trace_steps,
    sweep_trace_steps,
)
from tests.unit.test_broker import NODE, Consumer, Harness
from tests.unit.test_memory_db import result

EVERY = {"topic": None, "channel": None, "reason": None, "since_ms": None, "until_ms": None, "ids": None,
         "message_ids": None, "replayed": None}



@pytest.fixture
def h() -> Harness:
    h = Harness()
    h.db.create_topic("traced", ["c"], msg_timeout_ms=1000)
    h.broker.refresh_registry()
    h.settle()
    return h


def delivered_late(h: Harness) -> tuple[int, Consumer]:
    """One message, delivered, timed out, delivered again, acknowledged."""
    h.send("traced", "p", 1, b"hello")
    h.settle()
    consumer = Consumer(credit=1)
    h.subscribe("traced", "c", consumer)
    assert len(consumer.pushed) == 1
    for _ in range(300):  # the clock up to the message timeout: it comes back and goes out again
        if len(consumer.pushed) == 2:
            break
        h.clock.advance(0.01)
    assert len(consumer.pushed) == 2
    _, message_id = consumer.pushed[-1]
    assert h.broker.ack("traced", "c", message_id, consumer) is None
    h.settle()
    return message_id, consumer


def test_the_trace_tells_a_timed_out_delivery_and_its_ack_in_order(h):
    message_id, _ = delivered_late(h)
    trace = result(h.db.run_steps(read_trace_steps, message_id))
    assert trace["found"] and trace["topic"] == "traced" and trace["pending"] == []
    assert trace["stored"]["body"] == "hello" and trace["stored"]["producer"] == "p"
    story = [(e["event"], e.get("attempt"), e.get("reason")) for e in trace["events"]]
    assert story == [("stored", None, None), ("delivered", 1, None), ("returned", 1, "timeout"),
                     ("delivered", 2, None), ("acked", 2, None)]
    assert h.db.names_run()[-5:] == ["trace_stored", "trace_returns", "trace_acks", "trace_dead_letters",
                                     "trace_pending"]
    assert result(h.db.run_steps(find_message_steps, "p", 1)) == message_id
    assert result(h.db.run_steps(find_message_steps, "p", 2)) is None


def test_a_waiting_copy_is_pending_and_peeked_without_being_consumed(h):
    h.send("traced", "p", 1, b"x" * 10)
    h.send("traced", "p", 2, b"y")
    h.settle()
    first = h.acknowledged[("p", 1)]
    trace = result(h.db.run_steps(read_trace_steps, first))
    assert trace["pending"] == [{"channel": "c", "attempts": 0, "owner": NODE}]
    peeked = result(h.db.run_steps(peek_channel_steps, "traced", "c", 0, 10, 4))
    assert [(p["message_id"], p["body"], p["truncated"], p["size"]) for p in peeked] == [
        (first, "xxxx", True, 10), (h.acknowledged[("p", 2)], "y", False, 1)]
    assert len(result(h.db.run_steps(peek_channel_steps, "traced", "c", first, 10))) == 1
    assert len(h.db.deliveries) == 2  # nothing consumed
    gauges = result(h.db.run_steps(read_gauges_steps, {("traced", "c"): first}))
    assert gauges["oldest_unacked_ms"] == {("traced", "c"): int(h.clock.seconds() * 1000) - 1000}


def test_a_dead_letter_and_its_replay_are_in_both_traces(h):
    h.send("traced", "p", 1, b"hello")
    h.settle()
    message_id = h.acknowledged[("p", 1)]
    (letter,) = result(h.db.run_steps(insert_dead_letters_steps, [
        NewDeadLetter("max_attempts", "traced", "p", 1, b"hello", channel="c", message_id=message_id, attempts=5)]))
    assert result(h.db.run_steps(replay_batch_steps, EVERY, 0, 10, 1, int(h.clock.seconds() * 1000), NODE)) == (letter, 1)
    _, moved = result(h.db.run_steps(move_due_steps, (1,), 1, 2**62, 10, NODE, h.broker.reliable.writes.owner))
    replay = moved[0].message_id
    trace = result(h.db.run_steps(read_trace_steps, message_id))
    assert [e["event"] for e in trace["events"]] == ["stored", "dead_letter", "replayed"]
    assert trace["events"][-1]["replay_message_id"] == replay
    again = result(h.db.run_steps(read_trace_steps, replay))
    assert again["replay_of"]["dead_letter_id"] == letter and again["replay_of"]["message_id"] == message_id
    assert again["stored"]["producer"] == "dmq-replay" and again["pending"][0]["channel"] == "c"


def test_a_delay_entry_is_traced_until_it_falls_due(h):
    due = int(h.clock.seconds() * 1000) + 60_000
    h.send("traced", "d", 1, b"later", due_ms=due)
    h.settle()
    (entry,) = h.db.delayed
    trace = result(h.db.run_steps(read_trace_steps, entry))
    assert not trace["found"] and trace["delayed"]["due_ms"] == due and trace["delayed"]["body"] == "later"


def test_returns_older_than_the_retention_are_swept(h):
    delivered_late(h)
    assert len(h.db.returns) == 1
    assert result(h.db.run_steps(sweep_trace_steps, 3600, 100)) == 0
    h.clock.advance(7200)
    assert result(h.db.run_steps(sweep_trace_steps, 3600, 100)) == 1
    assert h.db.returns == []
