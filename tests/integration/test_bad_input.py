"""One bad message never fails another: fields checked at the edge, bad rows isolated.

A send whose timestamp is nanoseconds (``2**62``), or whose producer id holds a NUL,
used to join a group-commit batch and fail the whole batch in PostgreSQL
(``timestamp out of range``, ``invalid byte sequence``): every other send of the batch
was answered SEND_SERVER_ERROR, and a delayed one made a delay worker retry forever.
"""

from __future__ import annotations

import time
from typing import Any

from twisted.internet.defer import ensureDeferred

from dmq_client.blocking import BlockingClient
from dmq_client.wire import Command, Frame, MessageType
from dmq_server.db.reactor import ReactorDb
from dmq_server.db.storage_errors import RefusedError
from dmq_server.db.messages import HOT_STATEMENTS, NewMessage, create_owner, insert_messages_steps
from dmq_server.db.schema import migrate
from dmq_server.db.worker import connect
from dmq_server.reliable.horizon import OwnWrites
from dmq_server.reliable.writer import GroupCommitWriter
import registry

from .support import db_rows
from .test_reactor_db import on_reactor

NANOSECONDS = 2**62


def _frame(producer: str, sid: int, body: bytes, *, timestamp_ms: int, due_ms: int = 0) -> Frame:
    return Frame(
        Command.UP_PRODUCER_SEND,
        session_id=sid,
        topic="orders",
        producer=producer,
        timestamp_ms=timestamp_ms,
        msg_type=MessageType.DELAY if due_ms else MessageType.RELIABLE,
        due_ms=due_ms,
        body=body,
    )


def _replies(client: BlockingClient, n: int) -> dict[int, Frame]:
    out = {}
    while len(out) < n:
        reply = client.next_send_reply(timeout=15)
        out[reply.session_id] = reply
    return out


def _consume(server: Any, topic: str, n: int) -> list[Frame]:
    """Up to ``n`` pushes of channel billing, each acknowledged (fewer if none comes for 15 s)."""
    pushes: list[Frame] = []
    with server.client() as consumer:
        consumer.subscribe(topic, "billing", credit=1000)
        while len(pushes) < n and (push := consumer.receive(timeout=15)) is not None:
            pushes.append(push)
            consumer.ack(push)
    return pushes


def test_bad_timestamps_are_refused_alone_and_fail_no_other_send(make_server, topic, pg_dsn):
    """30 sends stamped in nanoseconds, pipelined between 600 good sends of two other
    producers (so they share group-commit batches): each bad one is answered
    SEND_INVALID_ACK naming the field; every good one is stored and delivered."""
    server = make_server()
    now_ms = int(time.time() * 1000)
    bad = BlockingClient("127.0.0.1", server.tcp_port, producer="nanos")
    goods = [BlockingClient("127.0.0.1", server.tcp_port, producer=f"good-{i}") for i in range(2)]
    for i in range(300):
        for g, client in enumerate(goods):
            client.write(_frame(client.producer, i + 1, b"good-%d-%d" % (g, i), timestamp_ms=now_ms))
        if i % 10 == 0:
            bad.write(_frame("nanos", i + 1, b"bad-%d" % i, timestamp_ms=NANOSECONDS))
    bad_replies = _replies(bad, 30)
    good_replies = [_replies(client, 300) for client in goods]
    for reply in bad_replies.values():
        assert reply.command == Command.SEND_INVALID_ACK, reply
        assert reply.status.startswith("E_INVALID timestamp_ms 4611686018427387904"), reply.status
    acked = {}
    for replies in good_replies:
        assert {r.command for r in replies.values()} == {Command.SEND_SUCCESS_ACK}
        acked.update({r.message_id: r for r in replies.values()})
    assert len(acked) == 600
    stored = {r[0] for r in db_rows(pg_dsn, "SELECT id FROM dmq_message")}
    assert stored == set(acked)
    assert {push.message_id for push in _consume(server, topic, 600)} == set(acked)
    for client in (bad, *goods):
        client.close()


def test_a_bad_delayed_send_is_refused_and_other_delayed_messages_arrive(make_server, topic, pg_dsn):
    """A DELAY send stamped in nanoseconds is refused at once; the delayed sends around it
    are stored, moved when due and delivered (the delay worker never sees the bad row)."""
    server = make_server(delay_poll_interval="0.5")
    now_ms = int(time.time() * 1000)
    with server.client(producer="delays") as producer:
        for i in range(64):
            producer.write(_frame("delays", i + 1, b"later-%d" % i, timestamp_ms=now_ms, due_ms=now_ms + 500))
        producer.write(_frame("delays", 100, b"bad", timestamp_ms=NANOSECONDS, due_ms=now_ms + 500))
        replies = _replies(producer, 65)
    assert replies.pop(100).command == Command.SEND_INVALID_ACK
    assert {r.command for r in replies.values()} == {Command.SEND_SUCCESS_ACK}
    assert {push.body for push in _consume(server, topic, 64)} == {b"later-%d" % i for i in range(64)}
    assert not db_rows(pg_dsn, "SELECT 1 FROM dmq_delay")


def test_a_producer_id_with_a_nul_is_refused_at_the_edge(make_server, topic):
    server = make_server()
    with server.client(producer="ok") as client:
        client.write(_frame("bad\x00id", 1, b"x", timestamp_ms=0))
        reply = client.next_send_reply(timeout=10)
    assert reply.command == Command.SEND_INVALID_ACK
    assert "control character" in reply.status


def test_the_writer_isolates_a_row_postgresql_refuses(pg_dsn):
    """Below the edge: a batch holding one row PostgreSQL refuses (a NUL in a text column)
    is split on a real ReactorDb until that row stands alone; the other 19 are stored."""
    migrate(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders", msg_timeout_ms=60000)
        registry.add_channel(conn, "orders", "billing")
        owner = create_owner(conn, "node-1")

    async def scenario(reactor: Any) -> list[Any]:
        db = ReactorDb(reactor, pg_dsn, "writer0", prepare=HOT_STATEMENTS)
        writer = GroupCommitWriter([db], "node-1", 100, insert=insert_messages_steps, writes=OwnWrites(owner))
        outcomes: list[Any] = [None] * 20
        for i in range(20):
            producer = "bad\x00" if i == 13 else "p"
            writer.submit_cb(
                NewMessage("orders", producer, i, 0, b"m%d" % i),
                lambda outcome, i=i: outcomes.__setitem__(i, outcome),
            )
        await ensureDeferred(_idle(writer))
        db.stop()
        return outcomes

    outcomes = on_reactor(scenario)
    refused = [i for i, o in enumerate(outcomes) if isinstance(o, RefusedError)]
    assert refused == [13]
    assert outcomes[13].sqlstate == "22021"  # invalid byte sequence: a data exception
    stored = {bytes(r[0]) for r in db_rows(pg_dsn, "SELECT body FROM dmq_message")}
    assert stored == {b"m%d" % i for i in range(20) if i != 13}


async def _idle(writer: GroupCommitWriter) -> None:
    await writer.close()


def test_a_plain_send_reusing_a_stored_pair_is_refused_not_acknowledged(make_server, topic, pg_dsn):
    """Two messages that share a (producer, session id) by mistake: the second, sent as a
    new message, must not hear SUCCESS for a message that holds another body. A resend
    (UP_PRODUCER_RESEND) of the first is answered from the stored row, as always."""
    server = make_server()
    with server.client(producer="reuser") as client:
        first = client.send(topic, b"first", session_id=42)
        second = client.send(topic, b"second", session_id=42)
        again = client.send(topic, b"first", session_id=42, resend=True)
    assert first.command == Command.SEND_SUCCESS_ACK
    assert second.command == Command.SEND_INVALID_ACK
    assert f"already stored (message {first.message_id})" in second.status
    assert (again.command, again.message_id, again.status) == (Command.SEND_SUCCESS_ACK, first.message_id, "duplicate")
    assert db_rows(pg_dsn, "SELECT body FROM dmq_message") == [(b"first",)]
