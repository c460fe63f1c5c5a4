"""protocols/turn.py: a connection's bytes of one reactor turn go out in one write, when
the turn ends, and one timer call serves every connection's buffer."""

from __future__ import annotations

import gc
import weakref

from twisted.internet.task import Clock

from dmq_server.protocols import turn
from dmq_server.protocols.turn import TurnBuffer


def test_a_turns_bytes_are_written_once_joined_when_it_ends():
    clock, written = Clock(), []
    buffer = TurnBuffer(clock, written.append)
    buffer.add(b"a")
    buffer.add(b"bc")
    assert written == [] and buffer
    clock.advance(0)
    assert written == [b"abc"] and not buffer
    clock.advance(0)
    assert written == [b"abc"]


def test_one_timer_call_serves_every_buffer_of_a_turn():
    clock, written = Clock(), []
    buffers = [TurnBuffer(clock, lambda data, i=i: written.append((i, data))) for i in range(4)]
    for i, buffer in enumerate(buffers):
        buffer.add(b"x%d" % i)
        buffer.add(b"y")
    assert len(clock.getDelayedCalls()) == 1
    clock.advance(0)
    assert sorted(written) == [(i, b"x%dy" % i) for i in range(4)]


def test_a_flush_before_the_turn_ends_writes_at_once_and_nothing_twice():
    clock, written = Clock(), []
    buffer = TurnBuffer(clock, written.append)
    buffer.add(b"a")
    buffer.flush()
    buffer.add(b"b")  # after a direct write: held again, for the same turn's end
    clock.advance(0)
    assert written == [b"a", b"b"]


def test_a_clock_gone_takes_its_turn_end_with_it():
    clock = Clock()
    TurnBuffer(clock, lambda data: None).add(b"x")
    clock.advance(0)
    end = weakref.ref(turn._TURN_ENDS[clock])
    del clock
    gc.collect()
    assert end() is None


def test_one_connection_failing_to_write_does_not_hold_back_the_others():
    clock, written = Clock(), []

    def broken(data: bytes) -> None:
        raise OSError("transport gone")

    first, second = TurnBuffer(clock, broken), TurnBuffer(clock, written.append)
    first.add(b"lost")
    second.add(b"kept")
    clock.advance(0)
    assert written == [b"kept"] and not first and not second
    second.add(b"again")  # held again and written at the next turn's end
    clock.advance(0)
    assert written == [b"kept", b"again"]


def _guarded(clock, may_push, holds_copies=True):
    written, stale = [], []

    def on_stale() -> bool:
        stale.append(clock.seconds())
        return holds_copies

    return TurnBuffer(clock, written.append, lambda: may_push[0], on_stale), written, stale


def test_bytes_held_while_the_process_stood_still_do_not_leave_once_the_node_may_not_push():
    """A push decided before a stall (SIGSTOP) past the node's ZooKeeper session may be a
    copy another node took over and saw acknowledged: it must not reach its consumer."""
    clock, may_push = Clock(), [True]
    buffer, written, stale = _guarded(clock, may_push)
    buffer.add(b"push")
    may_push[0] = False  # what the gate answers after a gap: ZooKeeper has not confirmed yet
    clock.advance(4.0)  # frozen before the turn ended
    assert written == [] and stale == [4.0] and not buffer
    buffer.add(b"next")  # decided after the stall: the gate was asked then
    clock.advance(0)
    assert written == [b"next"]


def test_a_stalled_turn_still_writes_when_the_node_may_push_or_holds_no_copies():
    clock, may_push = Clock(), [True]
    buffer, written, stale = _guarded(clock, may_push)
    buffer.add(b"confirmed")
    clock.advance(4.0)  # a long stall, but ZooKeeper confirmed the session meanwhile
    clock.advance(0)
    assert written == [b"confirmed"] and stale == []
    may_push[0] = False
    producer, answers, asked = _guarded(clock, may_push, holds_copies=False)
    producer.add(b"SEND_SUCCESS_ACK")  # a producer's answers: true whoever holds the copies
    clock.advance(4.0)
    clock.advance(0)
    assert answers == [b"SEND_SUCCESS_ACK"] and len(asked) == 1


def test_a_turn_of_normal_length_does_not_ask_the_gate():
    clock, may_push = Clock(), [False]
    buffer, written, stale = _guarded(clock, may_push)
    buffer.add(b"push")
    clock.advance(turn.STALL / 2)
    clock.advance(0)
    assert written == [b"push"] and stale == []


def test_a_push_decided_before_a_stall_and_held_after_it_does_not_leave():
    """The stop may fall between a channel's gate check and its copies reaching the
    buffer: the bytes arrive after the stall but were decided before it (the woken
    orderer of the ordered-nodes chaos test pushed one copy 10 ms after SIGCONT). Their
    age counts from the last turn end."""
    clock, may_push = Clock(), [True]
    buffer, written, stale = _guarded(clock, may_push)
    buffer.add(b"earlier")
    clock.advance(0)  # a turn ends
    assert written == [b"earlier"]
    clock.advance(4.0)  # frozen after the gate said yes, before the push was held
    may_push[0] = False  # the gate, asked now, finds the gap
    buffer.add(b"decided before the stall")
    clock.advance(0)
    assert written == [b"earlier"] and stale == [4.0]


def test_after_an_idle_spell_the_gate_is_asked_once_and_a_yes_sends():
    clock, asked = Clock(), []

    def may_push() -> bool:
        asked.append(clock.seconds())
        return True

    written: list[bytes] = []
    buffer = TurnBuffer(clock, written.append, may_push, lambda: True)
    clock.advance(30.0)  # nothing to write for a while
    buffer.add(b"one")
    clock.advance(0)
    buffer.add(b"two")  # the next turn: its last turn end is recent
    clock.advance(0)
    assert written == [b"one", b"two"] and asked == [30.0]
