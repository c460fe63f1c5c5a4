"""A message's key, priority and headers in the clients (issue 45): they travel in a
send's status only to a server that lists ``PROPS``, a broken rule is refused before
anything is written, pushes hand them to the handler, and the producer journal keeps
them (a version 2 record) so a recovered message is sent with them."""

from __future__ import annotations

import queue
import struct
import zlib

import pytest

from dmq_client import Message, MqClient, Status
from dmq_client.journal import VERSION, VERSION_PROPERTIES, decode_record, encode_record
from dmq_client.pending import PendingSend
from dmq_client.wire import FEATURE_ACKS, FEATURE_CONFIRM, SERVER_FEATURES, Command, Frame, decode_properties
from tests.unit.test_client_fake_server import WAIT, config, push, servers  # noqa: F401  (fixture)

pytestmark = pytest.mark.unit

PROPS = SERVER_FEATURES
OLDER = f"{FEATURE_ACKS} {FEATURE_CONFIRM}"  # a server before properties
HEADERS = {"content-type": "application/json", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def test_properties_ride_in_the_send_status_to_a_server_that_lists_props(servers):
    server = servers(features=PROPS)
    with MqClient(config(server)) as client:
        sent = Message("orders", b"x", key="order-7", priority=5, headers=HEADERS)
        assert client.send(sent).result(WAIT).ok
        plain = client.send(Message("orders", b"y")).result(WAIT)
        assert plain.ok
    _, frame = server.next(Command.UP_PRODUCER_SEND)
    props = decode_properties(frame.status)
    assert (props.key, props.priority, dict(props.headers)) == ("order-7", 5, HEADERS)
    _, frame = server.next(Command.UP_PRODUCER_SEND)
    assert frame.status == "" and frame.body == b"y"  # a message without them: as before


def test_a_server_that_does_not_list_props_gets_no_message_with_properties(servers):
    """An older server would store the message without them: the send fails, unsent."""
    server = servers(features=OLDER)
    with MqClient(config(server)) as client:
        result = client.send(Message("orders", b"x", key="k")).result(WAIT)
        assert result.status is Status.INVALID_MESSAGE
        assert result.description.startswith("E_UNSUPPORTED server") and "does not list PROPS" in result.description
        assert client.send(Message("orders", b"y")).result(WAIT).ok
    _, frame = server.next(Command.UP_PRODUCER_SEND)
    assert frame.body == b"y"  # the first was never written


@pytest.mark.parametrize(
    ("message", "says"),
    [
        (Message("orders", b"x", priority=12), "E_BAD_PROPERTIES priority 12 is outside 0..9"),
        (Message("orders", b"x", headers={"X-Trace": "1"}), "E_BAD_PROPERTIES header name 'X-Trace'"),
        (Message("orders", b"x", key="k" * 300), "E_BAD_PROPERTIES key is 300 bytes"),
    ],
)
def test_broken_properties_are_refused_before_anything_is_written(servers, message, says):
    server = servers(features=PROPS)
    with MqClient(config(server)) as client:
        result = client.send(message).result(WAIT)
        assert result.status is Status.INVALID_MESSAGE and result.description.startswith(says), result.description
        assert client.send(Message("orders", b"after")).result(WAIT).ok
    _, frame = server.next(Command.UP_PRODUCER_SEND)
    assert frame.body == b"after"


def test_a_push_hands_its_properties_to_the_handler(servers):
    server = servers(features=PROPS)
    got: queue.Queue = queue.Queue()
    with MqClient(config(server)) as client:
        client.subscribe("orders", "billing", got.put)
        server.next(Command.UP_SUBSCRIBE)
        with_props = push(1, 1)
        with_props.status = '{"key":"order-7","priority":3,"headers":{"content-type":"text/plain"},"later":1}'
        server.send(with_props)
        odd = push(2, 2)
        odd.status = "not properties"
        server.send(odd)
        server.send(push(3, 3))
        first, second, third = (got.get(timeout=WAIT) for _ in range(3))
    assert (first.key, first.priority, first.headers) == ("order-7", 3, {"content-type": "text/plain"})
    assert (second.key, second.priority, second.headers) == (None, 0, {})  # read as none, still handled
    assert (third.key, third.priority, third.headers, third.body) == (None, 0, {}, b"body 3")


def test_the_journal_keeps_properties_in_a_version_2_record_and_others_as_before():
    message = Message.delayed("orders", b"later", due=1_900_000_000, key="order-7", priority=2, headers=HEADERS)
    record = encode_record(5, PendingSend(message, 11, "p1", 1234, None))
    assert record[4] == VERSION_PROPERTIES
    back = decode_record(record)
    assert (back.seq, back.session_id, back.topic, back.body, back.due_ms) == (5, 11, "orders", b"later", 1_900_000_000_000)
    props = decode_properties(back.status)
    assert (props.key, props.priority, dict(props.headers)) == ("order-7", 2, HEADERS)
    plain = encode_record(6, PendingSend(Message("orders", b"now"), 12, "p1", 1234, None))
    assert plain[4] == VERSION and decode_record(plain).status == "" and decode_record(plain).body == b"now"
    cut = record[4:60]  # cut inside its status, with a checksum that matches the cut
    with pytest.raises(ValueError, match="exceed"):
        decode_record(struct.pack(">I", zlib.crc32(cut)) + cut)


def test_a_message_recovered_from_the_journal_is_sent_again_with_its_properties(tmp_path):
    from dmq_client.send_queue import Put
    from tests.unit.test_client_journal import finish, journal

    q = journal(tmp_path)
    sent = PendingSend(Message("orders", b"x", key="order-7", priority=9, headers=HEADERS), 1001, "p1", 1234)
    assert q.put(sent) is Put.ACCEPTED
    assert q.put(PendingSend(Message("orders", b"y"), 1002, "p1", 1235)) is Put.ACCEPTED
    q.abandon()  # the process died with both unanswered
    q2 = journal(tmp_path)
    try:
        first, second = q2.get_batch(10, timeout=0)
        assert (first.message.key, first.message.priority, first.message.headers) == ("order-7", 9, HEADERS)
        assert (second.message.key, second.message.priority, second.message.headers) == (None, 0, None)
        for item in (first, second):
            finish(q2, item)
    finally:
        q2.close()


def test_a_resend_carries_the_message_with_its_properties(servers):
    """``client.resend(result)`` sends the same message again: its key, priority and
    headers too, under the first send's session id (it once rebuilt the message from
    topic, body and delay only)."""
    server = servers(features=PROPS, reply=lambda f: [Frame(Command.SEND_SERVER_ERROR, session_id=f.session_id,
                                                            topic=f.topic, status="E_STORAGE down")])
    with MqClient(config(server)) as client:
        failed = client.send(Message("orders", b"x", key="order-7", priority=4, headers=HEADERS)).result(WAIT)
        assert failed.status is Status.SERVER_ERROR
        client.resend(failed).result(WAIT)
    _, first = server.next(Command.UP_PRODUCER_SEND)
    _, again = server.next(Command.UP_PRODUCER_RESEND)
    assert again.session_id == first.session_id and again.status == first.status != ""
    props = decode_properties(again.status)
    assert (props.key, props.priority, dict(props.headers)) == ("order-7", 4, HEADERS)
