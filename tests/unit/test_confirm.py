"""Confirmation when consumed, without IO: the server's watches on the in-memory double and
a task clock, and the client against a fake server that does not list CONFIRM.

The end-to-end behaviour on a real server and PostgreSQL is
tests/integration/test_confirm_consumed.py; here are the parts a real server cannot be
made to show on demand: a server older than the feature, a statement's cost while
nothing is watched, the bound on watches.
"""

from __future__ import annotations

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from dmq_client import ConsumeStatus, Message, MqClient, MqConfig, Status
from dmq_client.blocking import BlockingClient, ClientError
from dmq_client.wire import Command, consumed_status, parse_consumed
from dmq_server.db.dead_letter_steps import NewDeadLetter, insert_dead_letters_steps
from dmq_server.db.memory import MemoryDb
from dmq_server.reliable.confirm import Confirmations

from .test_client_fake_server import WAIT, FakeServer

OWNER = 1


class Listener:
    def __init__(self) -> None:
        self.closed = False
        self.heard: list[tuple[int, str, str, int, str]] = []

    def consumed(self, session_id: int, producer: str, topic: str, message_id: int, status: str) -> None:
        self.heard.append((session_id, producer, topic, message_id, status))


def stored(db: MemoryDb, session_id: int) -> int:
    return db.store_moved("orders", "p", session_id, b"x", OWNER)


def done(db: MemoryDb, channel: str, message_id: int) -> None:
    db._cursor("orders", channel, OWNER, "n1").merge(0, [(message_id, message_id)])


@pytest.fixture
def world() -> tuple[MemoryDb, Clock, Confirmations]:
    db = MemoryDb()
    db.create_topic("orders", ["a", "b"])
    db.owners[OWNER] = {"node_id": "n1", "retired": False, "seen_ms": 0}
    clock = Clock()
    return db, clock, Confirmations(db, clock, tick=0.2)


def asked(db: MemoryDb) -> int:
    return sum(1 for name, _ in db.executed if name == "consumed_states")


def test_resolves_only_when_every_channel_acked(world) -> None:
    db, clock, confirmations = world
    listener = Listener()
    message_id = stored(db, 1)
    assert confirmations.watch("orders", message_id, 1, "p", 60_000, listener) == ""
    clock.advance(0.2)
    done(db, "a", message_id)
    clock.advance(0.2)
    assert asked(db) == 2 and listener.heard == [] and len(confirmations) == 1
    done(db, "b", message_id)
    clock.advance(0.2)
    assert listener.heard == [(1, "p", "orders", message_id, "CONSUMED acked=a,b")]
    assert len(confirmations) == 0 and clock.getDelayedCalls() == []  # no more ticks


def test_a_dead_letter_and_a_deadline(world) -> None:
    db, clock, confirmations = world
    listener = Listener()
    dead, late = stored(db, 1), stored(db, 2)
    confirmations.watch("orders", dead, 1, "p", 60_000, listener)
    confirmations.watch("orders", late, 2, "p", 500, listener)
    done(db, "a", dead)
    done(db, "b", dead)
    db.run_steps(insert_dead_letters_steps, [NewDeadLetter("expired", "orders", "p", 1, b"x", channel="b",
                                                           message_id=dead)])
    done(db, "a", late)
    clock.advance(0.2)
    assert [h[4] for h in listener.heard] == ["E_DEAD_LETTERED acked=a dead=b"]
    clock.advance(0.2)
    clock.advance(0.2)
    assert [h[4] for h in listener.heard][1:] == ["E_DEADLINE acked=a waiting=b"]
    report = parse_consumed(listener.heard[1][4])
    assert (report.acked, report.dead, report.waiting) == (("a",), (), ("b",))


def test_costs_nothing_unwatched_and_drops_closed_connections(world) -> None:
    db, clock, confirmations = world
    clock.advance(5)
    assert asked(db) == 0 and clock.getDelayedCalls() == []
    listener = Listener()
    confirmations.watch("orders", stored(db, 1), 1, "p", 60_000, listener)
    listener.closed = True  # the producer's connection went
    clock.advance(0.2)
    assert asked(db) == 0 and len(confirmations) == 0 and listener.heard == []


def test_bounded(world) -> None:
    db, clock, _ = world
    confirmations = Confirmations(db, clock, limit=1)
    assert confirmations.watch("orders", stored(db, 1), 1, "p", 1000, Listener()) == ""
    assert confirmations.watch("orders", stored(db, 2), 2, "p", 1000, Listener()).startswith("E_LIMIT ")


def test_status_round_trip() -> None:
    status = consumed_status("E_DEADLINE", ["b", "a"], ["c"], ["d"])
    assert status == "E_DEADLINE acked=a,b dead=c waiting=d"
    report = parse_consumed(status)
    assert (report.code, report.acked, report.dead, report.waiting) == ("E_DEADLINE", ("a", "b"), ("c",), ("d",))
    assert parse_consumed("E_INVALID deadline too long").description == "deadline too long"


def test_a_server_without_the_feature_is_not_asked() -> None:
    """A server whose greeting lists no CONFIRM (older than it): the send is refused with
    E_UNSUPPORTED and never written, the consumed future says NOT_SENT; a plain send on the
    same client goes; the blocking client raises."""
    server = FakeServer()
    try:
        config = MqConfig(servers=(server.address,), route_wait=WAIT, connect_timeout=WAIT)
        with MqClient(config) as client:
            future = client.send(Message("orders", b"x"), confirm="consumed", confirm_timeout=5)
            result = future.result(WAIT)
            assert result.status is Status.INVALID_MESSAGE and result.description.startswith("E_UNSUPPORTED ")
            assert "CONFIRM" in result.description
            consumed = future.consumed.result(WAIT)
            assert consumed.status is ConsumeStatus.NOT_SENT and consumed.description == result.description
            assert client.send(Message("orders", b"plain")).result(WAIT).status is Status.SUCCESS
            _, frame = server.next(Command.UP_PRODUCER_SEND)
            assert frame.body == b"plain" and frame.credit == 0
        with BlockingClient("127.0.0.1", server.port, timeout=WAIT) as blocking:
            with pytest.raises(ClientError, match="cannot confirm consumption.*CONFIRM"):
                blocking.send("orders", b"x", confirm_timeout=5)
    finally:
        server.close()


def test_a_callers_mistake_raises() -> None:
    server = FakeServer()
    try:
        with MqClient(MqConfig(servers=(server.address,), connect_timeout=WAIT)) as client:
            with pytest.raises(ValueError, match="confirm must be"):
                client.send(Message("orders", b"x"), confirm="acked")
            with pytest.raises(ValueError, match="confirm_timeout"):
                client.send(Message("orders", b"x"), confirm="consumed", confirm_timeout=86_401)
    finally:
        server.close()


class Unanswered:
    """A database whose statements stay out (a hung PostgreSQL, until ``--pg-timeout``)."""

    def __init__(self) -> None:
        self.out: list[Deferred] = []

    def run_steps(self, fn: object, *args: object) -> Deferred:
        d: Deferred = Deferred()
        self.out.append(d)
        return d


def test_a_deadline_is_reported_on_time_while_postgres_does_not_answer(world) -> None:
    """The first statement never answers: the watch's deadline (0.5 s) is reported by the
    tick after it all the same, saying PostgreSQL did not answer; no second statement goes
    out while the first is still out, and the late answer changes nothing."""
    db, clock, _ = world
    hung = Unanswered()
    confirmations = Confirmations(hung, clock, tick=0.2)
    listener = Listener()
    message_id = stored(db, 1)
    confirmations.watch("orders", message_id, 1, "p", 500, listener)
    clock.advance(0.2)
    assert len(hung.out) == 1 and listener.heard == []
    for _ in range(3):
        clock.advance(0.2)
    assert len(hung.out) == 1
    assert [h[4] for h in listener.heard] == ["E_DEADLINE PostgreSQL did not answer before the deadline"]
    assert len(confirmations) == 0 and clock.getDelayedCalls() == []
    hung.out[0].callback([(message_id, "a", "acked"), (message_id, "b", "acked")])
    assert len(listener.heard) == 1 and clock.getDelayedCalls() == []
