"""The V2 adapter on a StringTransport with task.Clock: nsqd's replies, errors, order, timers."""

from __future__ import annotations

import json
import struct
import zlib
from types import SimpleNamespace

import pytest
from twisted.internet.defer import fail, succeed
from twisted.application.internet import TimerService
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from dmq_server.broker import Broker, Fence, TopicCache
from dmq_server.core.limits import RateLimiter
from dmq_server.reliable.store import ReliableStore
from dmq_server.core.errors import Invalid, NoChannel, NoTopic, ShuttingDown
from dmq_server.core.ids import GuidFactory
from dmq_server.core.options import Options
from dmq_server.core.publish import Published
from dmq_server.reliable.channel import ReliableChannel, ReliableMessage
from dmq_server.fast.fast_store import FastStore
from dmq_server.protocols.nsq_context import NsqContext
from dmq_server.protocols.nsq_v2 import NsqConnection
from dmq_server.core.nsq_wire import (
    FRAME_ERROR,
    FRAME_MESSAGE,
    FRAME_RESPONSE,
    FrameReader,
    decode_message,
    encode_command,
    mpub_body,
)
from tests.unit.test_nsq_store import MemoryBackend


class FakeBroker(Broker):
    """The real broker's routing (``publish``, ``route``) and fast store, over real
    reliable Channel objects; a reliable body is recorded, not written, and the test
    answers it."""

    def __init__(self, clock, fast, fence=None):
        self.clock = clock
        self._fence = fence
        self.options = Options()
        self.fast = fast
        self.limits = RateLimiter(clock)
        self._session_ids = GuidFactory(1, lambda: int(clock.seconds() * 1e9))
        self.cache = TopicCache(lambda: succeed([]), lambda specs: None, lambda why: None)
        self.reliable = SimpleNamespace(channels={})
        self.published: list = []
        self.acked: list = []
        self.ack_calls = 0  # ack_each calls (a read's FINs)
        self.ack_runs: list[int] = []  # the copies of each durable-ack run
        self.refreshes = 0
        self.runs: list[int] = []  # the sends of each call of the reliable store

    def register(self, topic, channel):
        self.cache.reliable[topic] = SimpleNamespace(name=topic, channels=(channel,), rate_limit=None)
        ch = ReliableChannel(
            topic,
            channel,
            clock=self.clock,
            msg_timeout=30.0,
            mem_queue_size=100,
            load=lambda c, after, limit: c.loaded([], limit),
            on_acks=lambda c, ds, ms, who: (self.acked.extend(d.message.message_id for d in ds),
                                            self.ack_runs.append(len(ds))),
        )
        self.channels[(topic, channel)] = ch
        return ch

    @property
    def channels(self):
        return self.reliable.channels

    def refresh_registry(self, fresh=False):
        self.refreshes += 1
        return succeed(None)

    def _publish_one(self, send, done, due_ms):
        self.published.append((send.topic, send.producer, send.session_id, send.body, done))

    def _direct_store(self, topic):
        """A registered topic's sends go to a store that records them, as ``_publish_one``."""
        if topic not in self.cache.reliable:
            return None
        def store_many(sends, answer):
            self.runs.append(len(sends))
            for i, send in enumerate(sends):
                self._publish_one(send, lambda outcome, i=i: answer(i, [outcome]), None)

        return SimpleNamespace(store_many=store_many)

    def subscribe(self, topic, channel, consumer):
        ch = self.channels.get((topic, channel))
        if ch is None:
            return fail(NoChannel(f"channel {channel!r} is not registered"))
        ch.subscribe(consumer)
        return succeed(ch)

    def unsubscribe(self, channel, consumer):
        channel.unsubscribe(consumer)

    def ack(self, topic, channel, message_id, consumer):
        return ReliableStore.ack(self.reliable, topic, channel, message_id, consumer)  # uses only .channels

    def ack_each(self, topic, channel, message_ids, consumer):
        self.ack_calls += 1
        return ReliableStore.ack_each(self.reliable, topic, channel, message_ids, consumer)


class Peer:
    """One client connection: bytes in through the adapter, frames out of the transport."""

    def __init__(self, ctx):
        self.transport = StringTransport()
        self.conn = NsqConnection(self.transport, ctx)
        self.reader = FrameReader()

    def send(self, data: bytes):
        self.conn.data_received(data)
        return self

    def frames(self):
        self.conn.clock.advance(0)  # the reactor turn ends: what it queued is written
        out = self.reader.feed(self.transport.value())
        self.transport.clear()
        return out

    def texts(self):
        return [(t, d) for t, d in self.frames()]

    @property
    def closed(self):
        return self.transport.disconnecting


@pytest.fixture
def env():
    clock = Clock()
    store = FastStore(clock, None, node_id=1, backend_factory=lambda name: MemoryBackend())
    store.start()
    store.timers.startService()  # the disk sync, as the service tree runs it
    scanner = TimerService(0.1, store.scan)  # the broker's scanner, as it calls the fast store
    scanner.clock = clock
    scanner.startService()
    gate = [True]  # the cluster node's delivery gate (a channel asks it before it pushes)
    stood = [False]  # whether the node stood still, unconfirmed (Broker.may_push asks it)
    broker = FakeBroker(clock, store, Fence("node-1", lambda: gate[0], lambda: stood[0]))
    options = SimpleNamespace(heartbeat_interval=30.0, msg_timeout=60.0, max_msg_size=1024)
    ctx = NsqContext(broker, options, clock)
    return SimpleNamespace(clock=clock, store=store, broker=broker, ctx=ctx, gate=gate, stood=stood,
                           peer=lambda: Peer(ctx))


OK = (FRAME_RESPONSE, b"OK")


def err(text: str):
    return (FRAME_ERROR, text.encode())


def identify(**fields) -> bytes:
    return encode_command(b"IDENTIFY", body=json.dumps(fields).encode())


# -- IDENTIFY / AUTH / bad commands -------------------------------------------------------
def test_identify_with_feature_negotiation_replies_json_in_nsqd_key_order(env):
    """The JSON carries every field clients read, in Go's order; TLS and snappy are declined."""
    p = env.peer().send(identify(feature_negotiation=True, snappy=True, tls_v1=True, msg_timeout=5000))
    ((kind, data),) = p.frames()
    assert kind == FRAME_RESPONSE
    reply = json.loads(data)
    assert list(reply) == [
        "max_rdy_count", "version", "max_msg_timeout", "msg_timeout", "tls_v1", "deflate",
        "deflate_level", "max_deflate_level", "snappy", "sample_rate", "auth_required",
        "output_buffer_size", "output_buffer_timeout", "topology_region", "topology_zone",
    ]
    assert reply["max_rdy_count"] == 2500 and reply["version"] == "1.3.0"
    assert reply["msg_timeout"] == 5000 and reply["max_msg_timeout"] == 900000
    assert (reply["tls_v1"], reply["snappy"], reply["deflate"], reply["auth_required"]) == (False,) * 4
    assert (reply["deflate_level"], reply["max_deflate_level"]) == (6, 6)


def test_deflate_upgrade_compresses_both_directions(env):
    """deflate: the JSON reply is plain, then everything is raw DEFLATE (sync-flushed),
    starting with an OK; the client's commands are inflated."""
    p = env.peer().send(identify(feature_negotiation=True, deflate=True, deflate_level=9))
    raw = p.transport.value()
    p.transport.clear()
    ((kind, data),) = p.reader.feed(raw[: 8 + len(raw[8:].split(b"}")[0]) + 1])
    reply = json.loads(data)
    assert reply["deflate"] is True and reply["deflate_level"] == 6  # capped at max
    inflate = zlib.decompressobj(-15)
    rest = raw[8 + len(data):]
    assert FrameReader().feed(inflate.decompress(rest)) == [OK]
    deflate = zlib.compressobj(6, zlib.DEFLATED, -15)
    p.send(deflate.compress(encode_command(b"PUB", b"z", body=b"squeezed")) + deflate.flush(zlib.Z_SYNC_FLUSH))
    env.clock.advance(0)  # the reactor turn ends: its answers are written
    assert FrameReader().feed(inflate.decompress(p.transport.value())) == [OK]
    assert [m.body for m in env.store.topics["z"].memory] == [b"squeezed"]
    assert p.conn.stats()["deflate"] is True


def test_identify_without_negotiation_is_plain_ok(env):
    """feature_negotiation false (or absent) gets a plain OK."""
    assert env.peer().send(identify(client_id="x")).frames() == [OK]


@pytest.mark.parametrize(
    "fields,text",
    [
        ({"heartbeat_interval": 999}, "E_BAD_BODY IDENTIFY heartbeat interval (999) is invalid"),
        ({"heartbeat_interval": 60001}, "E_BAD_BODY IDENTIFY heartbeat interval (60001) is invalid"),
        ({"output_buffer_timeout": 10}, "E_BAD_BODY IDENTIFY output buffer timeout (10) is invalid"),
        ({"output_buffer_size": 63}, "E_BAD_BODY IDENTIFY output buffer size (63) is invalid"),
        ({"sample_rate": 100}, "E_BAD_BODY IDENTIFY sample rate (100) is invalid"),
        ({"msg_timeout": 999}, "E_BAD_BODY IDENTIFY msg timeout (999) is invalid"),
        ({"heartbeat_interval": "30"}, "E_BAD_BODY IDENTIFY failed to decode JSON body"),
        ({"feature_negotiation": 1}, "E_BAD_BODY IDENTIFY failed to decode JSON body"),
    ],
)
def test_identify_validation_is_fatal_with_nsqd_texts(env, fields, text):
    """Each invalid IDENTIFY field gets nsqd's message and closes the connection."""
    p = env.peer().send(identify(**fields))
    assert p.frames() == [err(text)] and p.closed


def test_identify_bad_json_and_wrong_state(env):
    """Undecodable JSON is E_BAD_BODY; IDENTIFY after SUB is E_INVALID before the body."""
    p = env.peer().send(encode_command(b"IDENTIFY", body=b"{nope"))
    assert p.frames() == [err("E_BAD_BODY IDENTIFY failed to decode JSON body")]
    q = env.peer().send(b"SUB t c\nIDENTIFY\n")
    assert q.frames() == [OK, err("E_INVALID cannot IDENTIFY in current state")] and q.closed


def test_auth_is_disabled(env):
    """AUTH answers E_AUTH_DISABLED (fatal) since dmq has no auth server configured."""
    p = env.peer().send(encode_command(b"AUTH", body=b"secret"))
    assert p.frames() == [err("E_AUTH_DISABLED AUTH disabled")] and p.closed


def test_invalid_and_empty_commands_are_fatal(env):
    """Unknown verbs and empty lines get 'E_INVALID invalid command <x>' and close."""
    p = env.peer().send(b"FOO bar\n")
    assert p.frames() == [err("E_INVALID invalid command FOO")] and p.closed
    q = env.peer().send(b"\n")
    assert q.frames() == [err("E_INVALID invalid command ")]


def test_commands_after_a_fatal_error_are_ignored(env):
    """Nothing after the fatal command runs (nsqd stops reading)."""
    p = env.peer().send(b"NOP\nBAD\n" + encode_command(b"PUB", b"t", body=b"x"))
    assert p.frames() == [err("E_INVALID invalid command BAD")]
    assert "t" not in env.store.topics


def test_overlong_line_closes_without_a_frame(env):
    """A command line over 16 KiB closes the connection with no error frame."""
    p = env.peer().send(b"X" * 20000)
    assert p.frames() == [] and p.closed


# -- publishing ---------------------------------------------------------------------------
def test_pub_mpub_dpub_answer_ok_and_create_the_topic(env):
    """PUB, MPUB and DPUB each get one OK and create a fast topic on demand."""
    p = env.peer().send(
        encode_command(b"PUB", b"t", body=b"a")
        + encode_command(b"MPUB", b"t", body=mpub_body([b"b", b"c"]))
        + encode_command(b"DPUB", b"t", b"1000", body=b"d")
    )
    assert p.frames() == [OK, OK, OK]
    topic = env.store.topics["t"]
    assert topic.message_count == 4 and [m.body for m in topic.memory] == [b"a", b"b", b"c", b"d"]
    assert topic.memory[3].deferred == 1.0
    assert p.conn.stats()["pub_counts"] == [{"topic": "t", "count": 4}]


def test_a_run_of_pubs_in_one_read_is_stored_as_one_batch_and_answered_in_order(env):
    """PUBs of one read to one fast topic are stored by one call of the fast store (as an
    MPUB of them would be); a PUB to another topic, or any other command, ends the run
    first, so messages are stored, and answers given, in the order the client sent them."""
    p = env.peer().send(encode_command(b"PUB", b"t", body=b"0") + encode_command(b"PUB", b"u", body=b"0"))
    assert p.frames() == [OK, OK]  # the topics now exist: made by their first PUB
    calls = []
    publish = env.store.publish

    def counted(topic, bodies, deferred=0.0):
        calls.append((topic, len(bodies)))
        return publish(topic, bodies, deferred)

    env.store.publish = counted
    p.send(
        encode_command(b"PUB", b"t", body=b"a") + encode_command(b"PUB", b"t", body=b"b")
        + encode_command(b"PUB", b"u", body=b"c") + encode_command(b"PUB", b"t", body=b"d")
        + encode_command(b"MPUB", b"t", body=mpub_body([b"e", b"f"])) + encode_command(b"PUB", b"t", body=b"g")
        + encode_command(b"PUB", b"t", body=b"h") + b"BAD\n" + encode_command(b"PUB", b"t", body=b"never")
    )
    assert p.frames() == [OK] * 7 + [err("E_INVALID invalid command BAD")] and p.closed
    assert calls == [("t", 2), ("u", 1), ("t", 1), ("t", 2), ("t", 2)]
    assert [m.body for m in env.store.topics["t"].memory] == [b"0", b"a", b"b", b"d", b"e", b"f", b"g", b"h"]
    assert {c["topic"]: c["count"] for c in p.conn.stats()["pub_counts"]} == {"t": 8, "u": 2}


@pytest.mark.parametrize("after", [
    encode_command(b"PUB", b"other", body=b"y"),
    encode_command(b"MPUB", b"other", body=mpub_body([b"y"])),
    encode_command(b"SUB", b"other", b"c"),
    b"PUB bad!name\n",  # refused by the parser, before any command runs
])
def test_a_run_of_pubs_that_fails_answers_one_fatal_error(env, after):
    """A fast topic closing under a run of PUBs: the run's first PUB gets nsqd's fatal
    E_PUB_FAILED and the connection closes; nothing after it runs or is answered."""
    p = env.peer().send(encode_command(b"PUB", b"t", body=b"0"))
    assert p.frames() == [OK]
    env.store.topics["t"].exiting = True
    p.send(encode_command(b"PUB", b"t", body=b"x") * 3 + after)
    assert p.frames() == [err("E_PUB_FAILED PUB failed exiting")] and p.closed
    assert "other" not in env.store.topics


def test_pub_errors_have_nsqd_texts(env):
    """Bad topic names, missing params and bad DPUB timeouts are fatal with nsqd's texts."""
    cases = [
        (b"PUB bad!name\n", 'E_BAD_TOPIC PUB topic name "bad!name" is not valid'),
        (b"PUB\n", "E_INVALID PUB insufficient number of parameters"),
        (b"MPUB a*b\n", 'E_BAD_TOPIC E_BAD_TOPIC MPUB topic name "a*b" is not valid'),
        (b"DPUB t\n", "E_INVALID DPUB insufficient number of parameters"),
        (b"DPUB t -1\n", "E_INVALID DPUB could not parse timeout -1"),
        (b"DPUB t 3600001\n", "E_INVALID DPUB timeout 3600001 out of range 0-3600000"),
        (b"PUB t\n" + struct.pack(">i", 1025), "E_BAD_MESSAGE PUB message too big 1025 > 1024"),
    ]
    for data, text in cases:
        p = env.peer().send(data)
        assert p.frames() == [err(text)], data
        assert p.closed


# -- consuming ----------------------------------------------------------------------------
def test_sub_rdy_delivers_message_frames_and_fin(env):
    """SUB then RDY: messages arrive as nsqd frames with attempts 1; FIN completes them."""
    producer = env.peer().send(encode_command(b"PUB", b"t", body=b"hello"))
    assert producer.frames() == [OK]
    consumer = env.peer().send(b"SUB t c\nRDY 1\n")
    frames = consumer.frames()
    assert frames[0] == OK and frames[1][0] == FRAME_MESSAGE
    ts, attempts, mid, body = decode_message(frames[1][1])
    assert (attempts, body, len(mid)) == (1, b"hello", 16)
    assert abs(ts / 1e9 - env.clock.seconds()) < 1
    consumer.send(b"FIN " + mid + b"\n")
    assert consumer.frames() == []
    assert env.store.topics["t"].channels["c"].in_flight == {}


def test_a_reads_fins_free_their_slots_and_one_pump_fills_them(env):
    """The FINs of one read each finish their message (one refused answers its own
    non-fatal error), then the channel pumps once: the freed slots are filled after the
    read, in one go, not one message per FIN."""
    producer = env.peer().send(b"".join(encode_command(b"PUB", b"t", body=b"m%d" % i) for i in range(8)))
    consumer = env.peer().send(b"SUB t c\nRDY 3\n")
    assert producer.frames() == [OK] * 8
    first = [decode_message(d)[2] for kind, d in consumer.frames() if kind == FRAME_MESSAGE]
    assert len(first) == 3
    channel = env.store.topics["t"].channels["c"]
    pumps = []
    pump = channel.pump
    channel.pump = lambda: (pumps.append(len(channel.in_flight)), pump())
    consumer.send(b"FIN " + first[0] + b"\nFIN " + b"f" * 16 + b"\nFIN " + first[1] + b"\nFIN " + first[2] + b"\n")
    frames = consumer.frames()
    assert pumps == [0]  # once, after the read, with all three slots free
    assert frames[0] == err("E_FIN_FAILED FIN " + "f" * 16 + " failed ID not in flight")
    pushed = [decode_message(d)[3] for kind, d in frames[1:] if kind == FRAME_MESSAGE]
    assert pushed == [b"m3", b"m4", b"m5"] and len(channel.in_flight) == 3
    assert channel.finish_count == 3 and channel.depth() == 2


def test_a_run_of_fins_answers_each_refused_one_in_turn(env):
    """A read of FINs is finished in one call, but each refused FIN (an id not in flight,
    one another consumer holds) still gets its own E_FIN_FAILED, in the order sent, and a
    REQ in the run runs in its place: the FINs after it are taken after it."""
    producer = env.peer().send(b"".join(encode_command(b"PUB", b"t", body=b"m%d" % i) for i in range(6)))
    a = env.peer().send(b"SUB t c\nRDY 4\n")
    b = env.peer().send(b"SUB t c\nRDY 1\n")
    assert producer.frames() == [OK] * 6
    held = [decode_message(d)[2] for kind, d in a.frames() if kind == FRAME_MESSAGE]
    other = [decode_message(d)[2] for kind, d in b.frames() if kind == FRAME_MESSAGE]
    assert len(held) == 4 and len(other) == 1
    channel = env.store.topics["t"].channels["c"]
    a.send(b"".join([
        b"FIN " + held[0] + b"\n", b"FIN " + b"f" * 16 + b"\n", b"FIN " + other[0] + b"\n",
        b"REQ " + held[1] + b" 60000\n", b"FIN " + held[1] + b"\n", b"FIN " + held[2] + b"\n",
        b"FIN " + held[3] + b"\n", b"NOP\n",
    ]))
    frames = a.frames()
    assert [f for f in frames if f[0] != FRAME_MESSAGE] == [
        err("E_FIN_FAILED FIN " + "f" * 16 + " failed ID not in flight"),
        err("E_FIN_FAILED FIN " + other[0].decode() + " failed client does not own message"),
        err("E_FIN_FAILED FIN " + held[1].decode() + " failed ID not in flight"),  # deferred before it
    ]
    pushed = [decode_message(d) for kind, d in frames if kind == FRAME_MESSAGE]
    assert [body for _, _, _, body in pushed] == [b"m5"]
    assert channel.finish_count == 3 and channel.requeue_count == 1 and held[1] in channel.deferred
    assert channel.in_flight[other[0]].client is not None  # b's copy untouched by a's FIN
    assert set(channel.in_flight) == {other[0], pushed[0][2]} and channel.depth() == 0


def test_fins_before_a_fatal_error_in_the_same_read_are_applied(env):
    """FINs then a fatal error in one read: the connection closes with its messages
    finished (none goes back to the queue), and the channel's other consumer goes on."""
    producer = env.peer().send(b"".join(encode_command(b"PUB", b"t", body=b"m%d" % i) for i in range(4)))
    a = env.peer().send(b"SUB t c\nRDY 2\n")
    b = env.peer().send(b"SUB t c\n")
    assert producer.frames() == [OK] * 4 and b.frames() == [OK]
    held = [decode_message(d)[2] for kind, d in a.frames() if kind == FRAME_MESSAGE]
    assert len(held) == 2
    b.send(b"RDY 1\n")
    assert [decode_message(d)[3] for kind, d in b.frames() if kind == FRAME_MESSAGE] == [b"m2"]
    a.send(b"FIN " + held[0] + b"\nFIN " + held[1] + b"\nBAD\n")
    assert a.frames() == [err("E_INVALID invalid command BAD")] and a.closed
    channel = env.store.topics["t"].channels["c"]
    assert channel.finish_count == 2 and channel.depth() == 1
    b_id = next(m.id for m in channel.in_flight.values())
    b.send(b"FIN " + b_id + b"\nRDY 2\n")
    assert [decode_message(d)[3] for kind, d in b.frames() if kind == FRAME_MESSAGE] == [b"m3"]


def test_a_turns_messages_and_answers_go_out_in_one_write(env):
    """A window of PUBs is answered, and a RDY's worth of messages pushed, in one
    transport write each (NsqConnection.queue_write), in order."""
    writes = []
    producer = env.peer()
    producer.transport.write = lambda data, write=producer.transport.write: (writes.append("p"), write(data))
    producer.send(b"".join(encode_command(b"PUB", b"t", body=b"m%d" % i) for i in range(40)))
    assert producer.frames() == [OK] * 40 and writes == ["p"]
    consumer = env.peer()
    consumer.transport.write = lambda data, write=consumer.transport.write: (writes.append("c"), write(data))
    consumer.send(b"SUB t c\nRDY 40\n")
    frames = consumer.frames()
    assert frames[0] == OK and [decode_message(f[1])[3] for f in frames[1:]] == [b"m%d" % i for i in range(40)]
    assert writes == ["p", "c", "c"]  # SUB's OK goes before messages may flow, then all 40


def test_fin_failures_are_not_fatal(env):
    """E_FIN_FAILED/E_REQ_FAILED/E_TOUCH_FAILED keep the connection open."""
    p = env.peer().send(b"SUB t c\n")
    p.frames()
    p.send(b"FIN 0123456789abcdef\nREQ 0123456789abcdef 0\nTOUCH 0123456789abcdef\nNOP\n")
    assert p.frames() == [
        err("E_FIN_FAILED FIN 0123456789abcdef failed ID not in flight"),
        err("E_REQ_FAILED REQ 0123456789abcdef failed ID not in flight"),
        err("E_TOUCH_FAILED TOUCH 0123456789abcdef failed ID not in flight"),
    ]
    assert not p.closed
    p.send(encode_command(b"PUB", b"t", body=b"x"))
    assert p.frames() == [OK]


def test_state_and_parameter_errors_for_consumer_commands(env):
    """RDY/FIN/CLS before SUB, short ids and bad counts are fatal E_INVALID."""
    cases = [
        (b"RDY 1\n", "E_INVALID cannot RDY in current state"),
        (b"FIN 0123456789abcdef\n", "E_INVALID cannot FIN in current state"),
        (b"CLS\n", "E_INVALID cannot CLS in current state"),
        (b"SUB t c\nFIN abc\n", "E_INVALID invalid message ID"),
        (b"SUB t c\nFIN\n", "E_INVALID FIN insufficient number of params"),
        (b"SUB t c\nREQ 0123456789abcdef\n", "E_INVALID REQ insufficient number of params"),
        (b"SUB t c\nREQ 0123456789abcdef x\n", "E_INVALID REQ could not parse timeout x"),
        (b"SUB t c\nRDY 2501\n", "E_INVALID RDY count 2501 out of range 0-2500"),
        (b"SUB t c\nRDY -1\n", "E_INVALID RDY could not parse count -1"),
        (b"SUB t\n", "E_INVALID SUB insufficient number of parameters"),
        (b"SUB t c!\n", 'E_BAD_CHANNEL SUB channel name "c!" is not valid'),
        (b"SUB t c\nSUB t c\n", "E_INVALID cannot SUB in current state"),
    ]
    for data, text in cases:
        p = env.peer().send(data)
        frames = [f for f in p.frames() if f != OK]
        assert frames == [err(text)], data
        assert p.closed


def test_rdy_window_and_req_touch(env):
    """RDY 2 keeps two in flight; REQ redelivers with attempts+1; TOUCH keeps it alive."""
    env.peer().send(encode_command(b"MPUB", b"t", body=mpub_body([b"1", b"2", b"3"])))
    c = env.peer().send(identify(msg_timeout=10000) + b"SUB t c\nRDY 2\n")
    msgs = [decode_message(d) for t, d in c.frames() if t == FRAME_MESSAGE]
    assert [m[3] for m in msgs] == [b"1", b"2"]
    c.send(b"REQ " + msgs[0][2] + b" 0\n")
    again = [decode_message(d) for t, d in c.frames() if t == FRAME_MESSAGE]
    assert len(again) == 1  # one slot freed, one message in
    env.clock.advance(9)
    c.send(b"TOUCH " + msgs[1][2] + b"\nTOUCH " + again[0][2] + b"\n")
    env.clock.advance(9)
    assert [t for t, _ in c.frames() if t == FRAME_MESSAGE] == []  # touched: not timed out
    env.clock.advance(2)
    redelivered = [decode_message(d) for t, d in c.frames() if t == FRAME_MESSAGE]
    assert redelivered and all(m[1] == 2 for m in redelivered)


def test_req_timeout_is_clamped_not_refused(env):
    """REQ beyond --max-req-timeout is clamped to it (nsqd logs, does not fail)."""
    env.peer().send(encode_command(b"PUB", b"t", body=b"x"))
    c = env.peer().send(b"SUB t c\nRDY 1\n")
    mid = decode_message(c.frames()[1][1])[2]
    c.send(b"REQ " + mid + b" 99999999999\n")
    assert c.frames() == [] and not c.closed
    ch = env.store.topics["t"].channels["c"]
    assert ch.deferred_due.deadline(mid) == pytest.approx(env.clock.seconds() + 3600)


def test_cls_answers_close_wait_and_stops_delivery(env):
    """CLS: CLOSE_WAIT, RDY is ignored afterwards, FIN still works, socket stays open."""
    env.peer().send(encode_command(b"MPUB", b"t", body=mpub_body([b"1", b"2"])))
    c = env.peer().send(b"SUB t c\nRDY 1\n")
    mid = decode_message(c.frames()[1][1])[2]
    c.send(b"CLS\nRDY 5\nFIN " + mid + b"\n")
    assert c.frames() == [(FRAME_RESPONSE, b"CLOSE_WAIT")]
    assert not c.closed


def test_ready_count_follows_rdy_the_subs_answer_and_cls(env):
    """What a channel reads as the connection's window (``ready_count``, kept as an
    attribute): 0 before SUB, RDY once SUB is answered, 0 after CLS (a later RDY changes
    nothing); IDENTIFY's msg_timeout reaches the attribute the channel reads too."""
    c = env.peer().send(b"IDENTIFY\n" + struct.pack(">I", 20) + b'{"msg_timeout":5000}')
    assert c.conn.ready_count == 0 and c.conn.msg_timeout == 5.0
    c.send(b"SUB t c\nRDY 3\n")
    assert c.conn.ready_count == 3
    c.send(b"RDY 7\n")
    assert c.conn.ready_count == 7
    c.send(b"CLS\nRDY 5\n")
    assert c.conn.ready_count == 0


def test_ephemeral_channel_goes_with_its_last_client(env):
    """A #ephemeral channel is deleted when its last consumer disconnects."""
    c = env.peer().send(b"SUB t c#ephemeral\n")
    assert "c#ephemeral" in env.store.topics["t"].channels
    c.conn.connection_lost()
    assert "c#ephemeral" not in env.store.topics["t"].channels


def test_deleting_a_channel_closes_its_consumers(env):
    """Channel delete (HTTP admin) closes subscribed connections, as nsqd does."""
    c = env.peer().send(b"SUB t c\n")
    env.store.topics["t"].delete_channel("c")
    assert c.closed


# -- heartbeats ---------------------------------------------------------------------------
def test_heartbeats_to_producers_and_close_after_two_silent_intervals(env):
    """Every interval a _heartbeat_ goes out, also to un-SUBed connections; silence for
    two intervals closes; any command (NOP) resets the deadline."""
    p = env.peer().send(identify(heartbeat_interval=1000))
    p.frames()
    env.clock.advance(1.0)
    assert p.frames() == [(FRAME_RESPONSE, b"_heartbeat_")]
    p.send(b"NOP\n")
    env.clock.advance(1.9)
    assert not p.closed
    env.clock.advance(0.2)
    assert p.closed


def test_heartbeats_disabled_refuse_sub(env):
    """heartbeat_interval -1 disables heartbeats and deadlines; SUB is then refused."""
    p = env.peer().send(identify(heartbeat_interval=-1))
    env.clock.advance(120)
    assert p.frames() == [OK] and not p.closed
    p.send(b"SUB t c\n")
    assert p.frames() == [err("E_INVALID cannot SUB with heartbeats disabled")]


# -- response order and the reliable bridge ----------------------------------------------
def test_responses_keep_command_order_while_a_reliable_pub_commits(env):
    """An OK waiting for a PostgreSQL commit holds back later replies (even a fatal
    error's), never reorders them."""
    env.broker.register("orders", "billing")
    p = env.peer().send(
        encode_command(b"PUB", b"orders", body=b"durable")
        + encode_command(b"PUB", b"fast", body=b"quick")
        + b"BAD\n"
    )
    assert p.frames() == []
    ((topic, producer, session_id, body, done),) = env.broker.published
    assert (topic, body) == ("orders", b"durable") and producer.startswith("nsq:")
    assert session_id > 0
    assert env.store.topics["fast"].message_count == 1  # later commands did run
    assert not p.closed  # the fatal error waits its turn too
    done(Published(42, False))
    assert p.frames() == [OK, OK, err("E_INVALID invalid command BAD")]
    assert p.closed


def test_a_run_of_pubs_to_a_reliable_topic_reaches_the_store_in_one_call(env):
    """PUBs of one read to a reliable topic are one request (``Broker.publish_each``):
    one call of the store for the run, and each PUB answered on its own after its
    commit, in the order sent (a refused one with its own non-fatal error)."""
    env.broker.register("orders", "billing")
    p = env.peer().send(b"".join(encode_command(b"PUB", b"orders", body=b) for b in (b"a", b"b", b"c")))
    assert p.frames() == [] and env.broker.runs == [3]
    (_, _, _, a, done1), (_, _, _, b, done2), (_, _, _, c, done3) = env.broker.published
    assert (a, b, c) == (b"a", b"b", b"c")
    done2(Invalid("too late"))
    assert p.frames() == []  # held behind the first PUB's answer
    done1(Published(1, False))
    assert p.frames() == [OK, err("E_PUB_FAILED PUB failed E_INVALID too late")]
    done3(Published(3, False))
    assert p.frames() == [OK] and not p.closed
    assert {c["topic"]: c["count"] for c in p.conn.stats()["pub_counts"]} == {"orders": 2}


def test_reliable_publish_failure_is_a_non_fatal_error(env):
    """A refused reliable publish answers E_PUB_FAILED and the connection goes on."""
    env.broker.register("orders", "billing")
    p = env.peer().send(encode_command(b"MPUB", b"orders", body=mpub_body([b"a", b"b"])))
    (_, _, _, _, done1), (_, _, _, _, done2) = env.broker.published
    done1(Published(1, False))
    done2(NoTopic("topic 'orders' has no channel"))
    assert p.frames() == [err("E_MPUB_FAILED MPUB failed E_NO_TOPIC topic 'orders' has no channel")]
    assert not p.closed


def test_new_topic_names_refresh_the_registry_once(env):
    """A name neither store knows triggers a registry refresh; known names do not."""
    p = env.peer().send(encode_command(b"PUB", b"n", body=b"1"))
    assert env.broker.refreshes == 1
    p.send(encode_command(b"PUB", b"n", body=b"2"))
    assert env.broker.refreshes == 1 and p.frames() == [OK, OK]


def test_sub_on_reliable_channel_pushes_hex_ids_and_fin_acks(env):
    """SUB on a registered channel gets broker deliveries: 16-hex ids, ns timestamps; FIN is
    Broker.ack; REQ redelivers; another connection cannot FIN it."""
    ch = env.broker.register("orders", "billing")
    c = env.peer().send(b"SUB orders billing\nRDY 5\n")
    assert c.frames() == [OK]
    ch.add(ReliableMessage(0x1234, "orders", "p", 7, 1_700_000_000_000, b"stored"))
    ((kind, data),) = c.frames()
    ts, attempts, mid, body = decode_message(data)
    assert (kind, mid, ts, attempts, body) == (FRAME_MESSAGE, b"0000000000001234", 1_700_000_000_000 * 10**6, 1, b"stored")
    c.send(b"REQ " + mid + b" 0\n")
    ((_, again),) = c.frames()
    assert decode_message(again)[1] == 2
    other = env.peer().send(b"SUB orders billing\n")
    other.frames()
    other.send(b"FIN " + mid + b"\n")
    assert other.frames() == [err("E_FIN_FAILED FIN 0000000000001234 failed client does not own message")]
    c.send(b"FIN " + mid + b"\n")
    assert c.frames() == [] and env.broker.acked == [0x1234]


def test_a_read_of_fins_on_a_reliable_channel_acks_each_and_refuses_each_bad_one(env):
    """A read of FINs to a reliable channel: each is an ack, in order; an id that is not
    hex, one not held and one acked twice each answer their own E_FIN_FAILED, in turn."""
    ch = env.broker.register("orders", "billing")
    c = env.peer().send(b"SUB orders billing\nRDY 5\n")
    assert c.frames() == [OK]
    for i in (0x11, 0x12):
        ch.add(ReliableMessage(i, "orders", "p", i, 1_700_000_000_000, b"m"))
    first, second = (decode_message(data)[2] for _, data in c.frames())
    c.send(b"FIN " + first + b"\nFIN zzzzzzzzzzzzzzzz\nFIN " + b"0" * 16 + b"\nFIN " + second
           + b"\nFIN " + first + b"\n")
    assert c.frames() == [
        err("E_FIN_FAILED FIN zzzzzzzzzzzzzzzz failed ID not in flight"),
        err("E_FIN_FAILED FIN 0000000000000000 failed ID not in flight"),
        err("E_FIN_FAILED FIN 0000000000000011 failed ID not in flight"),
    ]
    assert env.broker.acked == [0x11, 0x12] and not c.closed


def test_a_reliable_channels_window_reaches_an_nsq_consumer_in_one_write_in_order(env):
    """A group commit's copies for a reliable channel go to an NSQ consumer as the fast
    path's do: queued for the turn and written together, after what the connection wrote
    before them (fails with a write per message, or the turn's bytes reordered)."""
    ch = env.broker.register("orders", "billing")
    c = env.peer().send(b"SUB orders billing\nRDY 3\n")
    assert c.frames() == [OK]
    writes = []
    write = c.transport.write
    c.transport.write = lambda data: (writes.append(data), write(data))
    ch.add_many([ReliableMessage(i, "orders", "p", i, 1_700_000_000_000, b"m%d" % i) for i in range(1, 6)])
    assert writes == []  # nothing before the turn ends
    frames = c.frames()
    assert len(writes) == 1
    assert [decode_message(data)[2:] for _, data in frames] == [(b"%016x" % i, b"m%d" % i) for i in (1, 2, 3)]
    assert c.conn.stats()["message_count"] == 3
    c.send(b"FIN " + b"%016x" % 2 + b"\nNOP\n")  # an ack frees one: the next copy follows
    assert [decode_message(data)[2] for _, data in c.frames()] == [b"%016x" % 4]


def test_a_read_of_fins_on_a_reliable_channel_is_one_ack_run_and_one_refill(env):
    """Four FINs in one read (one of them for a copy another consumer holds): one call to the
    broker, the three held copies one durable-ack run, and the credit they free filled by one
    pump, in one write (fails with an ack per FIN, or the other consumer's copy taken)."""
    ch = env.broker.register("orders", "billing")
    c = env.peer().send(b"SUB orders billing\nRDY 3\n")
    other = env.peer().send(b"SUB orders billing\nRDY 1\n")
    assert c.frames() == [OK] and other.frames() == [OK]
    ch.add_many([ReliableMessage(i, "orders", "p", i, 1_700_000_000_000, b"m") for i in range(1, 11)])
    mine = [decode_message(data)[2] for _, data in c.frames()]
    (theirs,) = [decode_message(data)[2] for _, data in other.frames()]
    assert len(mine) == 3
    writes = []
    write = c.transport.write
    c.transport.write = lambda data: (writes.append(data), write(data))
    c.send(b"".join(b"FIN " + mid + b"\n" for mid in [*mine, theirs]))
    frames = c.frames()
    assert env.broker.ack_calls == 1 and env.broker.ack_runs == [3]
    # the refill queued by the one pump, then the refusal
    assert [decode_message(data)[2] for _, data in frames[:-1]] == [b"%016x" % i for i in (5, 6, 7)]
    assert frames[-1] == err(f"E_FIN_FAILED FIN {theirs.decode()} failed client does not own message")
    assert len(writes) == 1  # the refill and the refusal in the turn's one write
    assert c.conn.stats()["finish_count"] == 3 and theirs in (b"%016x" % i for i in range(1, 5))


def test_reliable_req_with_delay_and_touch(env):
    """REQ with a delay holds a reliable copy back until due; TOUCH restarts its timeout."""
    ch = env.broker.register("orders", "billing")
    c = env.peer().send(b"SUB orders billing\nRDY 1\n")
    c.frames()
    ch.add(ReliableMessage(9, "orders", "p", 1, 0, b"x"))
    mid = decode_message(c.frames()[0][1])[2]
    assert c.send(b"TOUCH " + mid + b"\n").frames() == []
    c.send(b"REQ " + mid + b" 5000\n")
    ch.scan(env.clock.seconds() + 4)
    assert c.frames() == []
    ch.scan(env.clock.seconds() + 5)
    ((_, data),) = c.frames()
    assert decode_message(data)[1] == 2


def test_sub_on_unregistered_reliable_channel_is_sub_failed(env):
    """A reliable topic's unregistered channel is refused with E_SUB_FAILED (fatal)."""
    env.broker.register("orders", "billing")
    c = env.peer().send(b"SUB orders other\nRDY 1\n")
    frames = c.frames()
    assert frames == [err("E_SUB_FAILED SUB failed E_NO_CHANNEL channel 'other' is not registered")]
    assert c.closed


def test_reliable_consumer_disconnect_requeues_at_once(env):
    """dmq's broker gives a gone consumer's reliable copies back immediately (not after timeout)."""
    ch = env.broker.register("orders", "billing")
    c = env.peer().send(b"SUB orders billing\nRDY 1\n")
    ch.add(ReliableMessage(5, "orders", "p", 1, 0, b"x"))
    c.conn.connection_lost()
    assert len(ch.ready) == 1 and not ch.in_flight


def test_nsq_producer_ids_are_unique_per_server_process(env):
    """Two servers (or two runs of one) on one host draw the same snowflake session ids
    at the same instant; their producer ids differ, so a new message is never taken for
    a resend of the other's. The id stays within 64 characters, instance included."""
    other = NsqContext(env.broker, SimpleNamespace(), env.clock)
    assert env.ctx.http_producer != other.http_producer
    assert env.ctx.producer_for("127.0.0.1:5000") != other.producer_for("127.0.0.1:5000")
    longest = "[ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255]:65535"
    produced = env.ctx.producer_for(longest)
    assert len(produced) <= 64 and produced.endswith("@" + env.ctx.instance)
    assert env.ctx.producer_for("10.0.0.1:4000") == f"nsq:10.0.0.1:4000@{env.ctx.instance}"


def test_publish_failures_are_answered_by_their_family(env):
    """Told apart by type (the DmqError family), not by class name strings: a broker
    error is a non-fatal E_PUB_FAILED with its code; a fatal one (the fast store)
    closes the connection with nsqd's text."""
    from dmq_server.db.storage_errors import StorageError

    env.broker.register("orders", "billing")
    p = env.peer().send(encode_command(b"PUB", b"orders", body=b"a") * 3)
    (*_, d1), (*_, d2), (*_, d3) = env.broker.published
    d1(ShuttingDown())
    d2(StorageError("writer0: gone"))

    class ShuttingDownLookalike(Exception):
        pass

    ShuttingDownLookalike.__name__ = "ShuttingDown"
    d3(ShuttingDownLookalike())
    assert p.frames() == [
        err("E_PUB_FAILED PUB failed E_SHUTTING_DOWN server is restarting, send elsewhere"),
        err("E_PUB_FAILED PUB failed E_STORAGE writer0: gone"),
        err("E_PUB_FAILED PUB failed ShuttingDown()"),  # a bug's repr, not a shutdown
    ]
    assert not p.closed
    env.store.get_topic("fast").exiting = True
    p.send(encode_command(b"PUB", b"fast", body=b"x"))
    assert p.frames() == [err("E_PUB_FAILED PUB failed exiting")] and p.closed


def test_a_reliable_message_held_while_the_process_stood_still_is_not_written_once_the_node_may_not_push(env):
    """A message queued for the end of its reactor turn, then a stall past the node's
    ZooKeeper session with the cluster's gate closed on waking: the NSQ consumer is closed
    without it (another node may have taken the copy over) and the copy goes back."""
    ch = env.broker.register("orders", "billing")
    c = env.peer().send(b"SUB orders billing\nRDY 5\n")
    assert c.frames() == [OK]
    ch.add(ReliableMessage(5, "orders", "p", 1, 0, b"late"))  # queued for the turn's end
    env.gate[0], env.stood[0] = False, True  # on waking the node finds the gap in its time
    env.clock.advance(4.0)
    assert c.frames() == [] and c.closed
    assert len(ch.ready) == 1 and not ch.in_flight


def test_a_fast_topics_consumer_is_served_after_an_idle_spell_while_the_node_is_paused(env):
    """Paused with its ZooKeeper session in doubt (not stood still), the node still serves
    a fast topic, which no other node takes over: after an idle spell, the first push's
    turn is old by the last turn end's clock, and it goes (the consumer is not cut off)."""
    c = env.peer().send(b"SUB fast ch\nRDY 5\n")
    assert c.frames() == [OK]
    env.gate[0] = False  # the session in doubt: reliable pushes stop
    env.clock.advance(10.0)  # nothing to write meanwhile
    env.peer().send(encode_command(b"PUB", b"fast", body=b"after a quiet spell"))
    env.clock.advance(0)
    frames = c.frames()
    assert len(frames) == 1 and frames[0][1].endswith(b"after a quiet spell") and not c.closed
