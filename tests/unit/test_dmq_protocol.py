"""Unit tests of the dmq protocol adapter (``DmqConnection``) at the frame level.

A real ``Broker`` with its writers on the in-memory database (``dmq_server.db.memory``),
a ``task.Clock`` and Twisted's ``StringTransport``: encoded frames go in, the bytes
written are decoded and compared. Only frames are used, so the tests hold whatever
the broker's Python API looks like.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from dmq_client.spelling import MAX_TIME_MS
from dmq_client.wire import Command, Frame, FrameDecoder, MessageType, encode, features, pack_ids
from twisted.internet.defer import succeed

from dmq_server.broker import Broker, Fence
from dmq_server.core.auth import PUBLISH, AuthState, Grant
from dmq_server.core.options import Options
from dmq_server.db.memory import MemoryDb
from dmq_server.protocols.dmq import DmqConnection
from dmq_server.reliable.channel import ReliableMessage


class Server:
    def __init__(self, fence: Fence | None = None, **options: Any) -> None:
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.db = MemoryDb(self.clock)
        self.db.create_topic("orders", ["billing"])
        self.db.create_topic("other", ["billing"])
        roles = {"writer0": self.db, "acker": self.db, "loader": self.db, "admin": self.db}
        self.broker = Broker(Options(**options), self.clock, roles, "node-1", fence=fence)
        self.broker.start()
        self.registry: set = set()

    def connect(self, authorizer: Any = None) -> Client:
        transport = StringTransport()
        conn = DmqConnection(transport, self.broker, self.clock, self.registry, authorizer=authorizer)
        return Client(self, transport, conn)

    def settle(self) -> None:
        for _ in range(50):  # the ack batcher's flush interval, the scan timer
            self.clock.advance(0.01)


class Client:
    def __init__(self, server: Server, transport: StringTransport, conn: DmqConnection):
        self.server = server
        self.transport = transport
        self.conn = conn
        self._decoder = FrameDecoder()

    def send(self, *frames: Frame) -> None:
        self.conn.data_received(b"".join(encode(f) for f in frames))

    def received(self) -> list[Frame]:
        """Frames written since the last call."""
        data = self.transport.value()
        self.transport.clear()
        return self._decoder.feed(data)


def send_frame(session_id: int, body: bytes = b"hello", topic: str = "orders", producer: str = "p") -> Frame:
    return Frame(Command.UP_PRODUCER_SEND, session_id=session_id, topic=topic, producer=producer, body=body)


@pytest.fixture
def server() -> Server:
    return Server()


def test_a_connection_opens_with_the_servers_health(server):
    client = server.connect()
    [hello] = client.received()
    assert hello.command == Command.SERVER_HEALTH and hello.status == "OK"


def test_a_send_is_answered_with_its_stored_id(server):
    client = server.connect()
    client.received()
    client.send(send_frame(1), send_frame(2))
    server.settle()
    replies = client.received()
    assert [(f.command, f.session_id) for f in replies] == [
        (Command.SEND_SUCCESS_ACK, 1),
        (Command.SEND_SUCCESS_ACK, 2),
    ]
    stored = {(m.session_id, m.id) for m in server.db.messages.values()}
    assert {(f.session_id, f.message_id) for f in replies} == stored


def test_a_resend_is_a_duplicate_and_a_plain_send_of_a_stored_pair_is_invalid(server):
    client = server.connect()
    client.received()
    client.send(send_frame(1))
    server.settle()
    [first] = client.received()
    client.send(Frame(Command.UP_PRODUCER_RESEND, session_id=1, topic="orders", producer="p", body=b"hello"))
    server.settle()
    [again] = client.received()
    assert again.command == Command.SEND_SUCCESS_ACK and again.message_id == first.message_id
    assert again.status == "duplicate"
    client.send(send_frame(1))
    server.settle()
    [refused] = client.received()
    assert refused.command == Command.SEND_INVALID_ACK and "UP_PRODUCER_RESEND" in refused.status


def test_a_reads_sends_to_one_topic_join_the_group_commit_together(server):
    """Sends of one read from one producer to one topic reach the writer in one call: the
    first does not start a transaction alone, so the read is one commit, not two."""
    client = server.connect()
    client.received()
    client.send(*(send_frame(i) for i in range(1, 51)))
    server.settle()
    replies = client.received()
    assert [(f.command, f.session_id) for f in replies] == [(Command.SEND_SUCCESS_ACK, i) for i in range(1, 51)]
    assert server.broker.reliable.writer.batches == 1


class Authorizer:
    """Answers every secret at once: publish on ``orders`` for ``ttl`` seconds."""

    def __init__(self, clock: Clock, ttl: int):
        self.clock, self.ttl, self.asked = clock, ttl, 0

    def query(self, secret: str, remote_ip: str, tls: bool, common_name: str) -> Any:
        self.asked += 1
        grant = Grant(re.compile("^orders$"), (re.compile(""),), frozenset({PUBLISH}))
        return succeed(AuthState("app", "", self.ttl, self.clock.seconds() + self.ttl, (grant,)))


def test_with_an_authorizer_a_run_it_allows_is_one_commit_and_an_expired_answer_asks_once(server):
    """With an authorizer, a read's sends the answer in hand allows reach the group commit
    together; once the answer's ttl has run out, the first send of the next read asks
    again, the others wait for it, and all are stored (the authorizer asked once more)."""
    authorizer = Authorizer(server.clock, ttl=2)
    client = server.connect(authorizer)
    client.send(Frame(Command.UP_AUTH, body=b"secret"))
    assert [f.command for f in client.received()][-1] == Command.AUTH_ACK
    client.send(*(send_frame(i) for i in range(1, 21)))
    server.settle()
    assert [f.command for f in client.received()] == [Command.SEND_SUCCESS_ACK] * 20
    assert server.broker.reliable.writer.batches == 1 and authorizer.asked == 1
    server.clock.advance(2)  # the answer's ttl runs out (well within the heartbeat interval)
    client.send(*(send_frame(i) for i in range(21, 41)))
    server.settle()
    assert [(f.command, f.session_id) for f in client.received()] == [
        (Command.SEND_SUCCESS_ACK, i) for i in range(21, 41)]
    assert authorizer.asked == 2 and len(server.db.messages) == 40


# a send of a read, by what it is: valid or bad in each of the ways a send can be refused,
# to one of two topics (or none), from one of two producers (or an invalid one)
_SEND = st.tuples(
    st.sampled_from(["ok", "ok", "ok", "big", "time", "resend", "delay", "bad-delay"]),
    st.sampled_from(["orders", "orders", "other", "nowhere"]),
    st.sampled_from(["p", "p", "q", "bad\x01"]),
    st.integers(1, 6),
)


def _frame(kind: str, topic: str, producer: str, session_id: int) -> Frame:
    body, stamp, command = b"b%d" % session_id, 1_700_000_000_000, Command.UP_PRODUCER_SEND
    msg_type, due = MessageType.RELIABLE, 0
    if kind == "big":
        body = b"x" * 65
    elif kind == "time":
        stamp = MAX_TIME_MS + 1
    elif kind == "resend":
        command = Command.UP_PRODUCER_RESEND
    elif kind in ("delay", "bad-delay"):
        msg_type, due = MessageType.DELAY, (1_700_000_060_000 if kind == "delay" else 0)
    return Frame(command, session_id=session_id, topic=topic, producer=producer, body=body,
                 timestamp_ms=stamp, msg_type=msg_type, due_ms=due)


def _outcome(frames: list[Frame], one_read: bool) -> tuple[list, set]:
    """The answers and stored messages of ``frames`` sent in one read, or (the reference)
    one read each through the send-by-send path (``_dispatch``: ``Broker.publish``), which
    a lone send no longer takes on its own."""
    server = Server(max_msg_size=64)
    client = server.connect()
    client.received()
    if one_read:
        client.send(*frames)
    else:
        conn = client.conn

        def one_by_one(run: list[Frame]) -> None:
            for frame in run:
                conn._dispatch(frame)

        conn._send_run = one_by_one  # type: ignore[method-assign]
        for frame in frames:
            client.send(frame)
    server.settle()
    # the ids a batch draws follow its sort order, so a refusal naming the stored message
    # may name another id: the id is left out
    replies = [(f.session_id, f.command, re.sub(r"\(message \d+\)", "(message)", f.status))
               for f in client.received()]
    stored = {(m.topic, m.producer, m.session_id, m.body) for m in server.db.messages.values()}
    return replies, stored


@settings(max_examples=60, deadline=None)
@given(st.lists(_SEND, min_size=1, max_size=12))
def test_sends_in_one_read_are_answered_and_stored_as_sent_one_by_one(sends):
    """A read of sends, whatever they are, gets the answers and stores the messages that
    the same sends read one at a time would: each refused send (too big, a bad time, an
    unknown topic, an invalid producer, a stored pair sent again without RESEND) its own
    refusal, each stored one its id, in the same order among those a commit answers."""
    frames = [_frame(*send) for send in sends]
    together, stored_together = _outcome(frames, True)
    apart, stored_apart = _outcome(frames, False)
    assert stored_together == stored_apart
    assert sorted(together) == sorted(apart) and len(together) == len(frames)
    committed = [r for r in together if r[1] == Command.SEND_SUCCESS_ACK]
    assert committed == [r for r in apart if r[1] == Command.SEND_SUCCESS_ACK]


@pytest.mark.parametrize(
    "frame, command, status",
    [
        (send_frame(1, topic="nowhere"), Command.SEND_NO_TOPIC_ACK, "E_NO_TOPIC"),
        (send_frame(1, topic="bad topic"), Command.SEND_INVALID_ACK, "E_BAD_TOPIC"),
        (send_frame(1, producer=""), Command.SEND_INVALID_ACK, "E_INVALID producer id"),
    ],
)
def test_a_bad_send_gets_its_own_reply_and_the_connection_goes_on(server, frame, command, status):
    client = server.connect()
    client.received()
    client.send(frame, send_frame(2))
    server.settle()
    first, second = client.received()
    assert first.command == command and first.session_id == frame.session_id and status in first.status
    assert second.command == Command.SEND_SUCCESS_ACK and second.session_id == 2


def test_a_send_whose_store_fails_gets_a_storage_error(server):
    client = server.connect()
    client.received()
    server.db.fail_next("insert_new_messages", "lost")
    client.send(send_frame(1))
    server.settle()
    [reply] = client.received()
    assert reply.command == Command.SEND_SERVER_ERROR and reply.status.startswith("E_STORAGE")


def test_subscribe_push_ack(server):
    producer, consumer = server.connect(), server.connect()
    producer.received(), consumer.received()
    consumer.send(Frame(Command.UP_SUBSCRIBE, session_id=9, topic="orders", channel="billing", credit=10))
    server.settle()
    [ack] = consumer.received()
    assert ack.command == Command.SUBSCRIBE_ACK and ack.session_id == 9
    assert "ACKS" in features(ack.status)  # UP_CONSUMER_ACKS is accepted: the client may batch
    producer.send(*(send_frame(i, b"m%d" % i) for i in range(3)))
    server.settle()
    acknowledged = {f.message_id for f in producer.received() if f.command == Command.SEND_SUCCESS_ACK}
    pushes = consumer.received()
    assert [f.command for f in pushes] == [Command.CONSUMER_PUSH] * 3
    assert {f.message_id for f in pushes} == acknowledged  # none lost
    assert [(f.session_id, f.body, f.producer, f.channel) for f in pushes] == [
        (i, b"m%d" % i, "p", "billing") for i in range(3)
    ]
    consumer.send(*(Frame(Command.UP_CONSUMER_ACK, topic="orders", channel="billing", message_id=f.message_id) for f in pushes))
    server.settle()
    assert consumer.received() == []  # acks have no reply
    assert not server.db.deliveries and len(server.db.delivery_log) == 3


def test_the_subscribe_reply_precedes_the_first_push(server):
    producer = server.connect()
    producer.send(send_frame(1))
    server.settle()
    consumer = server.connect()
    consumer.received()
    consumer.send(Frame(Command.UP_SUBSCRIBE, session_id=9, topic="orders", channel="billing", credit=10))
    server.settle()
    assert [f.command for f in consumer.received()] == [Command.SUBSCRIBE_ACK, Command.CONSUMER_PUSH]


def test_an_ack_by_a_stranger_is_refused(server):
    producer, holder, stranger = server.connect(), server.connect(), server.connect()
    holder.send(Frame(Command.UP_SUBSCRIBE, topic="orders", channel="billing", credit=10))
    server.settle()
    producer.send(send_frame(1))
    server.settle()
    [push] = [f for f in holder.received() if f.command == Command.CONSUMER_PUSH]
    # a connection without a subscription, then one subscribed without holding the copy
    stranger.send(Frame(Command.UP_CONSUMER_ACK, topic="orders", channel="billing", message_id=push.message_id))
    stranger.send(Frame(Command.UP_SUBSCRIBE, topic="orders", channel="billing", credit=1))
    server.settle()
    stranger.send(Frame(Command.UP_CONSUMER_ACK, topic="orders", channel="billing", message_id=push.message_id))
    server.settle()
    assert server.broker.acks_refused == 2
    assert ("orders", "billing", push.message_id) in server.db.deliveries
    holder.send(Frame(Command.UP_CONSUMER_ACK, topic="orders", channel="billing", message_id=push.message_id))
    server.settle()
    assert not server.db.deliveries and server.broker.acks_refused == 2


class CountingTransport(StringTransport):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        super().write(data)


def test_a_turns_pushes_and_send_replies_go_out_in_one_write_each_connection(server):
    producer = Client(server, CountingTransport(), None)  # type: ignore[arg-type]
    producer.conn = DmqConnection(producer.transport, server.broker, server.clock, server.registry)
    consumer = Client(server, CountingTransport(), None)  # type: ignore[arg-type]
    consumer.conn = DmqConnection(consumer.transport, server.broker, server.clock, server.registry)
    producer.received(), consumer.received()
    consumer.send(Frame(Command.UP_SUBSCRIBE, topic="orders", channel="billing", credit=100))
    server.settle()
    consumer.received()
    before = producer.transport.writes, consumer.transport.writes
    producer.send(*(send_frame(i) for i in range(50)))  # one read: one group commit
    server.settle()
    replies, pushes = producer.received(), consumer.received()
    assert [f.session_id for f in replies] == list(range(50))
    assert [f.session_id for f in pushes] == list(range(50))
    assert producer.transport.writes - before[0] <= 2 and consumer.transport.writes - before[1] <= 2


def test_what_the_turn_queued_goes_before_a_frame_written_at_once_and_before_closing(server):
    client = server.connect()
    client.received()
    queued = Frame(Command.SERVER_HEARTBEAT, credit=7)
    client.conn.queue_write(encode(queued))
    client.conn.protocol_error("E_INVALID", "a test's reason")  # written now, then closed
    assert [f.command for f in client.received()] == [Command.SERVER_HEARTBEAT, Command.PROTOCOL_ERROR]
    server.settle()
    assert client.received() == []  # nothing twice


def acks(ids: list[int], channel: str = "billing") -> Frame:
    return Frame(Command.UP_CONSUMER_ACKS, topic="orders", channel=channel, body=pack_ids(ids))


def test_one_acks_frame_acknowledges_each_id_and_a_refused_id_fails_no_other(server):
    producer, holder, rival = server.connect(), server.connect(), server.connect()
    holder.send(Frame(Command.UP_SUBSCRIBE, topic="orders", channel="billing", credit=10))
    rival.send(Frame(Command.UP_SUBSCRIBE, topic="orders", channel="billing", credit=10))
    server.settle()
    producer.send(*(send_frame(i) for i in range(8)))
    server.settle()
    mine = [f.message_id for f in holder.received() if f.command == Command.CONSUMER_PUSH]
    theirs = [f.message_id for f in rival.received() if f.command == Command.CONSUMER_PUSH]
    assert len(mine) + len(theirs) == 8 and mine and theirs
    # the rival's copies, an unknown id, and the holder's first copy twice more
    holder.send(acks(mine[:1] + theirs + [10**12] + mine + mine[:1]))
    server.settle()
    assert holder.received() == [] and not holder.transport.disconnecting
    assert server.broker.acks_refused == len(theirs) + 3
    assert {mid for (_, _, mid) in server.db.deliveries} == set(theirs)  # the rival's still held
    rival.send(acks(theirs))
    server.settle()
    assert not server.db.deliveries and server.broker.acks_refused == len(theirs) + 3
    assert len(server.db.delivery_log) == 8


def test_acks_for_a_subscription_the_connection_lacks_are_all_refused(server):
    producer, holder, stranger = server.connect(), server.connect(), server.connect()
    holder.send(Frame(Command.UP_SUBSCRIBE, topic="orders", channel="billing", credit=10))
    server.settle()
    producer.send(send_frame(1), send_frame(2))
    server.settle()
    ids = [f.message_id for f in holder.received() if f.command == Command.CONSUMER_PUSH]
    stranger.send(acks(ids))
    server.settle()
    assert server.broker.acks_refused == 2 and len(server.db.deliveries) == 2


@pytest.mark.parametrize("body", [b"", b"\x00" * 7, b"\x00" * 12, b"\x00" * 8 * 65537])
def test_an_acks_body_that_is_not_whole_ids_is_a_protocol_error_and_acks_nothing(server, body):
    producer, holder = server.connect(), server.connect()
    holder.send(Frame(Command.UP_SUBSCRIBE, topic="orders", channel="billing", credit=10))
    server.settle()
    producer.send(send_frame(1))
    server.settle()
    [push] = [f for f in holder.received() if f.command == Command.CONSUMER_PUSH]
    good = encode(acks([push.message_id]))
    bad = encode(Frame(Command.UP_CONSUMER_ACKS, topic="orders", channel="billing", body=body))
    holder.conn.data_received(bad + good)
    [error] = holder.received()
    assert error.command == Command.PROTOCOL_ERROR and error.status.startswith("E_BAD_FRAME ")
    assert holder.conn.closed
    server.settle()
    assert len(server.db.delivery_log) == 0  # the good frame after it was not read


@pytest.mark.parametrize(
    "frame, command",
    [
        (Frame(Command.UP_SUBSCRIBE, topic="nowhere", channel="c"), Command.SUBSCRIBE_NO_TOPIC_ACK),
        (Frame(Command.UP_SUBSCRIBE, topic="orders", channel="unknown"), Command.SUBSCRIBE_NO_CLIENT_ID_ACK),
        (Frame(Command.UP_SUBSCRIBE, topic="orders", channel="bad channel"), Command.SUBSCRIBE_INVALID_ACK),
        (Frame(Command.UP_SUBSCRIBE, topic="orders", channel="billing", credit=10**6), Command.SUBSCRIBE_INVALID_ACK),
    ],
)
def test_a_subscribe_that_cannot_be_served_gets_its_reason(server, frame, command):
    client = server.connect()
    client.received()
    client.send(frame)
    server.settle()
    [reply] = client.received()
    assert reply.command == command
    assert not client.transport.disconnecting


def malformed_command() -> bytes:
    data = bytearray(encode(send_frame(1)))
    data[4] = 31  # an upstream code no command has
    return bytes(data)


@pytest.mark.parametrize(
    "data, code",
    [
        (b"\x00\x00\x00\x01x", "E_BAD_FRAME"),  # shorter than any frame
        (b"\xff\xff\xff\xff", "E_FRAME_TOO_LARGE"),
        (malformed_command(), "E_BAD_COMMAND"),
        (encode(Frame(Command.SERVER_HEARTBEAT)), "E_INVALID"),  # a server command from a client
        (encode(Frame(Command.UP_CREDIT, topic="orders", channel="billing", credit=5)), "E_INVALID"),
    ],
)
def test_a_malformed_or_misplaced_frame_is_a_protocol_error_that_closes(server, data, code):
    client = server.connect()
    client.received()
    client.conn.data_received(data)
    [error] = client.received()
    assert error.command == Command.PROTOCOL_ERROR and error.status.startswith(code + " ")
    assert client.transport.disconnecting and client.conn.closed
    client.conn.data_received(encode(send_frame(1)))  # nothing more is read
    assert client.received() == []


def test_frames_split_anywhere_are_read_whole(server):
    client = server.connect()
    client.received()
    data = encode(send_frame(1)) + encode(send_frame(2))
    for i in range(len(data)):
        client.conn.data_received(data[i : i + 1])
    server.settle()
    assert [f.session_id for f in client.received()] == [1, 2]


def test_a_copy_that_cannot_be_pushed_fails_no_other_of_its_run() -> None:
    """``DmqSubscription.push_many``: a copy whose push frame cannot be encoded (a
    producer name longer than the frame's 255 bytes: the server never stores one, but a
    run must not depend on it) is left out and logged; the copies around it go out."""
    from types import SimpleNamespace

    from dmq_client.wire.codec import PushEncoder
    from dmq_server.protocols.dmq import DmqSubscription
    from dmq_server.reliable.channel import Delivery, ReliableMessage

    out: list[bytes] = []
    connection = SimpleNamespace(closed=False, peer="127.0.0.1:1", push_frame=PushEncoder(),
                                 queue_parts=out.extend)
    subscription = DmqSubscription(connection, credit=10)
    copies = [Delivery(ReliableMessage(mid, "orders", producer, mid, 1_000, b"body", 1), attempts=1)
              for mid, producer in ((1, "p"), (2, "p" * 300), (3, "p"))]
    subscription.push_many(SimpleNamespace(name="billing"), copies)
    frames = FrameDecoder().feed(b"".join(out))
    assert [(f.command, f.message_id, f.channel) for f in frames] == [
        (Command.CONSUMER_PUSH, 1, "billing"), (Command.CONSUMER_PUSH, 3, "billing")]


def _a_copy_out_on_a_cluster_node():
    """A server fenced as a cluster node's (its delivery gate ``gate[0]``, whether it stood
    still ``stood[0]``), a producer, and a consumer holding the one copy it was pushed."""
    gate, stood = [True], [False]
    server = Server(fence=Fence("node-1", lambda: gate[0], lambda: stood[0]))
    producer, consumer = server.connect(), server.connect()
    producer.received(), consumer.received()
    consumer.send(Frame(Command.UP_SUBSCRIBE, session_id=9, topic="orders", channel="billing", credit=10))
    server.settle()
    consumer.received()
    producer.send(send_frame(1))
    server.settle()
    assert [f.command for f in consumer.received()] == [Command.CONSUMER_PUSH]  # held, not acked
    producer.received()
    return server, producer, consumer, gate, stood


def test_pushes_held_while_the_process_stood_still_are_not_written_once_the_node_may_not_push():
    """A push queued for the end of its reactor turn, then a stall (SIGSTOP) past the node's
    ZooKeeper session: the woken node's gate is closed (another node may hold the copy and
    have seen it acknowledged), so the consumer's connection closes without the push and
    the copy goes back; a producer's answers in such a turn still go out."""
    server, producer, consumer, gate, stood = _a_copy_out_on_a_cluster_node()
    channel = server.broker.channels[("orders", "billing")]
    channel.add(ReliableMessage(77, "orders", "p", 2, 1_700_000_000_000, b"late"))  # queued for the turn's end
    producer.conn.queue_write(b"answer")  # a producer's bytes of the same turn
    gate[0], stood[0] = False, True  # on waking the node finds the gap: ZooKeeper has not confirmed it
    server.clock.advance(4.0)
    assert consumer.received() == [] and consumer.conn.closed and consumer.transport.disconnecting
    assert producer.transport.value() == b"answer" and not producer.conn.closed
    assert 77 in channel.known and 77 not in channel.in_flight  # back, for whoever holds it


def test_a_turn_after_an_idle_spell_is_written_while_the_node_is_merely_paused():
    """A turn's bytes are aged from the last turn end (a stop may fall between a push's
    decision and its bytes), so after an idle spell they look old. A node paused with its
    session in doubt, that did not stand still, writes them: a consumer holding a copy is
    not cut off for it."""
    server, producer, consumer, gate, stood = _a_copy_out_on_a_cluster_node()
    gate[0] = False  # ZooKeeper's connection lost: the session in doubt, nothing new pushed
    server.clock.advance(10.0)  # quiet
    consumer.conn.queue_write(b"bytes of this turn")
    server.clock.advance(0)
    assert consumer.transport.value() == b"bytes of this turn" and not consumer.conn.closed
    stood[0] = True  # had it stood still, the same bytes would not leave
    server.clock.advance(10.0)
    consumer.conn.queue_write(b"after a stall")
    server.clock.advance(0)
    assert consumer.conn.closed and consumer.transport.value() == b"bytes of this turn"
