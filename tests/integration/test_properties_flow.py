"""A message's properties (key, priority, headers) end to end: real dmq-server processes on
real PostgreSQL, real sockets, the two Python clients.

Each surface the issue names is crossed once here: the dmq protocol's send and push (from
memory, and loaded back from PostgreSQL by a channel that was not subscribed when the
message came), the stored row, a delayed message, and the old client's frames, which
must read exactly as before.
"""

from __future__ import annotations

import json
import time

import pytest

from dmq_client import Message, MqClient
from dmq_client.message import ReceivedMessage
from dmq_client.wire import Command, MessageType
from dmq_client.wire.properties import Properties

from .support import db_rows
from .test_client import WAIT, Inbox, fast_config

pytestmark = pytest.mark.integration

PROPS = Properties(key="order-7", priority=5,
                   headers={"content-type": "application/json", "traceparent":
                            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tenant": "été"})


def _add_channel(dsn: str, topic: str, channel: str) -> None:
    from dmq_server.db.worker import connect
    import registry

    with connect(dsn, autocommit=True) as conn:
        registry.add_channel(conn, topic, channel)


def _props_of(push) -> Properties:
    return ReceivedMessage.properties_of(push.status)


def test_properties_are_stored_and_pushed_from_memory_and_from_the_store(make_server, topic, pg_dsn):
    """The blocking client sends a key, a priority and headers; a subscribed channel gets
    them in its push (the copy held in memory); after a restart another channel's copies
    come from its load of PostgreSQL, with them too; the row holds them in its columns."""
    _add_channel(pg_dsn, topic, "late")  # nobody subscribes before the restart: its copies wait
    server = make_server()
    with server.client() as producer, server.client() as live:
        assert "PROPS" in producer.server_features()
        assert live.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
        reply = producer.send(topic, b"{}", key=PROPS.key, priority=PROPS.priority, headers=dict(PROPS.headers))
        assert reply.command == Command.SEND_SUCCESS_ACK, reply.status
        plain = producer.send(topic, b"plain")
        assert plain.command == Command.SEND_SUCCESS_ACK, plain.status
        pushes = [live.receive(timeout=10) for _ in range(2)]
        assert [p.body for p in pushes] == [b"{}", b"plain"]
        assert _props_of(pushes[0]) == PROPS
        assert pushes[1].status == ""  # none: the push is what it was before properties
    rows = db_rows(pg_dsn, "SELECT id, key, priority, headers FROM dmq_message ORDER BY id")
    assert rows == [(reply.message_id, "order-7", 5, dict(PROPS.headers)), (plain.message_id, None, 0, None)]
    server.stop()
    restarted = make_server()  # nothing in memory: the channel loads its copies from PostgreSQL
    with restarted.client() as late:
        assert late.subscribe(topic, "late").command == Command.SUBSCRIBE_ACK
        pushes = [late.receive(timeout=10) for _ in range(2)]
        assert [p.body for p in pushes] == [b"{}", b"plain"]
        assert _props_of(pushes[0]) == PROPS and pushes[1].status == ""


def test_a_send_with_bad_properties_is_refused_alone(make_server, topic, pg_dsn):
    """Three sends in one write, the middle one's status not valid properties: it is
    refused with E_BAD_PROPERTIES naming the rule, its neighbours are stored."""
    server = make_server()
    with server.client() as producer:
        frames = [producer.send_frame(topic, b"first", properties=Properties(key="a")),
                  producer.send_frame(topic, b"bad"),
                  producer.send_frame(topic, b"third", properties=Properties(priority=9))]
        frames[1].status = json.dumps({"priority": 10})
        producer.write(*frames)
        replies = {}
        while len(replies) < 3:
            reply = producer.next_send_reply(timeout=10)
            replies[reply.session_id] = reply
        first, bad, third = (replies[f.session_id] for f in frames)
        assert first.command == third.command == Command.SEND_SUCCESS_ACK
        assert bad.command == Command.SEND_INVALID_ACK
        assert bad.status == "E_BAD_PROPERTIES priority 10 is outside 0..9"
    assert db_rows(pg_dsn, "SELECT body, key, priority FROM dmq_message ORDER BY id") == [
        (b"first", "a", 0), (b"third", None, 9)]


def test_an_old_clients_frames_read_as_before(make_server, topic, pg_dsn):
    """A send without a status (every client before properties) is stored with none
    (NULL, 0, NULL) and pushed with an empty status, as before."""
    server = make_server()
    with server.client() as producer, server.client() as consumer:
        assert consumer.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
        frame = producer.send_frame(topic, b"old")
        assert frame.status == ""
        producer.write(frame)
        assert producer.next_send_reply(timeout=10).command == Command.SEND_SUCCESS_ACK
        push = consumer.receive(timeout=10)
        assert push is not None and push.body == b"old" and push.status == ""
    assert db_rows(pg_dsn, "SELECT key, priority, headers FROM dmq_message") == [(None, 0, None)]


def test_a_delayed_message_keeps_its_properties(make_server, topic, pg_dsn):
    """A delayed send's properties wait with it in dmq_delay and come with its push once
    it falls due (the move into the reliable flow keeps them)."""
    server = make_server(delay_poll_interval="200ms")
    with server.client() as producer, server.client() as consumer:
        assert consumer.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
        frame = producer.send_frame(topic, b"later", properties=PROPS)
        frame.msg_type = MessageType.DELAY
        frame.due_ms = int(time.time() * 1000) + 500
        producer.write(frame)
        assert producer.next_send_reply(timeout=10).command == Command.SEND_SUCCESS_ACK
        assert db_rows(pg_dsn, "SELECT key, priority, headers FROM dmq_delay") == [
            ("order-7", 5, dict(PROPS.headers))]
        push = consumer.receive(timeout=10)
        assert push is not None and push.body == b"later"
        assert _props_of(push) == PROPS
    assert db_rows(pg_dsn, "SELECT key, priority FROM dmq_message") == [("order-7", 5)]


def test_mqclient_sends_and_receives_properties(make_server, topic):
    """MqClient's Message(key=, priority=, headers=) reaches the handler's message as
    .key, .priority and .headers; a message without them reads as none."""
    server = make_server()
    inbox = Inbox(expected=2)
    with MqClient(fast_config(server)) as client:
        client.subscribe(topic, "billing", inbox)
        sent = client.send(Message(topic, b"with", key="user-1", priority=2, headers={"x-trace": "abc"})).result(WAIT)
        plain = client.send(Message(topic, b"without")).result(WAIT)
        assert sent.ok and plain.ok
        inbox.wait()
    by_body = {m.body: m for m in inbox.messages}
    assert (by_body[b"with"].key, by_body[b"with"].priority, by_body[b"with"].headers) == (
        "user-1", 2, {"x-trace": "abc"})
    assert (by_body[b"without"].key, by_body[b"without"].priority, by_body[b"without"].headers) == (None, 0, {})


def test_a_resend_with_properties_is_answered_from_the_stored_row(make_server, topic, pg_dsn):
    """The same pair resent (a retry whose first answer was lost) is a duplicate, stored
    once with the properties of the first."""
    server = make_server()
    with server.client() as producer:
        first = producer.send(topic, b"x", session_id=41, key="k")
        again = producer.send(topic, b"x", session_id=41, resend=True, key="k")
        assert first.command == again.command == Command.SEND_SUCCESS_ACK
        assert again.status == "duplicate" and again.message_id == first.message_id
    assert db_rows(pg_dsn, "SELECT key FROM dmq_message") == [("k",)]
