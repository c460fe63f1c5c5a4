"""Backpressure and input bounds on string transports (the real adapters, no network).

* a connection whose replies are not read, or with too many sends awaiting commit,
  is not read (``pauseProducing``) until that clears;
* the port's total of incomplete frames is capped;
* oversized HTTP bodies are refused from ``Content-Length`` before the body is read;
* NSQ deflate with bad bytes answers IDENTIFY, then a clear error, and closes;
* the admin console answers a too-long line in its turn and runs what follows,
  answers everything sent before a half-close, and stops reading a flood.
"""

from __future__ import annotations

import json
import zlib
from types import SimpleNamespace

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import formatEvent, globalLogPublisher
from twisted.web.resource import Resource

from dmq_client.wire import MAGIC, Command
from dmq_server.admin.line_console import AdminConsole
from dmq_server.core.publish import Published
from dmq_server.protocols.flow import FlowLimits
from dmq_server.http.site import BoundedSite
from dmq_server.core.nsq_wire import FRAME_ERROR, FRAME_RESPONSE, FrameReader, encode_command
from tests.unit.test_nsq_protocol import env  # noqa: F401  (fixture)
from tests.unit.test_timeouts import Port, dmq_frames, send_frame


def published(i: int) -> Published:
    return Published(message_id=i, duplicate=False)


# -- the dmq protocol -------------------------------------------------------------------------
def test_connection_is_not_read_while_its_replies_are_not():
    """The transport's write buffer passing the high-water mark pauses the producer:
    the port stops reading the connection, and reads again once the buffer drained."""
    port = Port(FlowLimits(max_output_buffer=4096))
    protocol, transport = port.connect()
    assert transport.producer is protocol.gate and transport.bufferSize == 4096
    protocol.gate.pauseProducing()  # what a TCP transport does past bufferSize
    assert transport.producerState == "paused" and protocol.gate.paused
    protocol.gate.resumeProducing()  # what it does once everything is sent
    assert transport.producerState == "producing" and not protocol.gate.paused


def test_sends_awaiting_commit_past_the_cap_stop_reading_until_half_are_answered():
    """max_pending_sends=10: the 10th send pauses reading; answering down to 5 resumes.
    Every send is answered, in full, with its own id."""
    port = Port(FlowLimits(max_pending_sends=10, max_pending_bytes=10**9))
    protocol, transport = port.connect()
    protocol.dataReceived(b"".join(send_frame(i) for i in range(12)))  # one read: all dispatched
    assert len(port.broker.sends) == 12 and transport.producerState == "paused"
    assert protocol.gate.stats()["paused"] == ["pending"]
    for i, (_, done) in enumerate(port.broker.sends[:6]):
        done(published(i))
    assert transport.producerState == "paused"  # 6 left: above half of 10
    port.broker.sends[6][1](published(6))
    assert transport.producerState == "producing"
    for i, (_, done) in enumerate(port.broker.sends[7:], 7):
        done(published(i))
    port.clock.advance(0)  # the turn ends: its replies are written (DmqConnection.queue_write)
    acks = [f for f in dmq_frames(transport) if f.command == Command.SEND_SUCCESS_ACK]
    assert [(f.session_id, f.message_id) for f in acks] == [(i, i) for i in range(12)]
    assert protocol.gate.pending_sends == 0 and port.factory.budget.held == 0


def test_bytes_awaiting_commit_past_the_cap_stop_reading():
    """max_pending_bytes counts bodies: three 1000-byte sends reach a 3000-byte cap."""
    port = Port(FlowLimits(max_pending_bytes=3000))
    protocol, transport = port.connect()
    protocol.dataReceived(send_frame(1, b"b" * 1000) + send_frame(2, b"b" * 1000))
    assert transport.producerState == "producing"
    protocol.dataReceived(send_frame(3, b"b" * 1000))
    assert transport.producerState == "paused" and protocol.gate.pending_bytes == 3000


def test_incomplete_frames_of_all_connections_are_capped_in_total():
    """Total cap 5000 (reads of 1024 bytes): connections holding incomplete frames are
    paused once the port holds more; they are read again when the total falls under
    three quarters (a connection closing, here), and a connection holding nothing is not
    paused."""
    port = Port(FlowLimits(max_buffered_bytes=5000, max_output_buffer=1024))
    peers = [port.connect() for _ in range(3)]
    big = send_frame(1, b"z" * 3000)
    for protocol, _ in peers[:2]:
        protocol.dataReceived(big[:2000])
    assert port.factory.budget.held == 4000
    assert [t.producerState for _, t in peers] == ["producing"] * 3
    peers[2][0].dataReceived(big[:1500])
    assert port.factory.budget.held == 5500
    assert peers[2][1].producerState == "paused"
    peers[0][1].loseConnection()  # its 2000 bytes are released: 3500 <= 3750
    assert port.factory.budget.held == 3500
    assert peers[2][1].producerState == "producing"
    peers[2][0].dataReceived(big[1500:])  # the frame completes, its send is pending
    assert port.factory.budget.held == 2000 + 3000


def test_over_the_port_cap_a_connection_holding_less_than_a_read_is_still_read():
    """Cap 5000, reads of 1024 bytes: the port holds 6000 in two megabyte-style frames
    (over the cap, past its hard mark of 5625); a small producer whose frame arrives in
    two reads is still read and its send goes out, while a third connection holding a
    read's worth is paused. (Before, any connection holding a byte was paused: a small
    producer waited as long as the others held their frames.)"""
    port = Port(FlowLimits(max_buffered_bytes=5000, max_output_buffer=1024))
    holders = [port.connect() for _ in range(2)]
    big = send_frame(1, b"z" * 4000)
    for protocol, _ in holders:
        protocol.dataReceived(big[:3000])
    assert port.factory.budget.held == 6000
    # the first was read under the cap; the second took the port over it
    assert [t.producerState for _, t in holders] == ["producing", "paused"]
    small, transport = port.connect()
    frame = send_frame(7, b"small")
    small.dataReceived(frame[:10])
    assert transport.producerState == "producing"
    small.dataReceived(frame[10:])
    assert transport.producerState == "producing" and [s[0] for s in port.broker.sends][-1:] == [b"small"]
    third, third_transport = port.connect()
    third.dataReceived(big[:1024])
    assert third_transport.producerState == "paused"


def test_a_closed_connection_keeps_its_pending_bodies_counted_until_answered():
    """The bodies stay in the writer until commit: the budget releases them then."""
    port = Port()
    protocol, transport = port.connect()
    protocol.dataReceived(send_frame(1, b"q" * 700))
    transport.loseConnection()
    assert port.factory.budget.held == 700
    port.broker.sends[0][1](published(1))
    assert port.factory.budget.held == 0


# -- HTTP bodies ----------------------------------------------------------------------------------
class Echo(Resource):
    isLeaf = True

    def __init__(self):
        super().__init__()
        self.bodies: list[bytes] = []

    def render(self, request):
        self.bodies.append(request.content.read())
        return b"ok"


def http(**options):
    resource = Echo()
    site = BoundedSite(resource, SimpleNamespace(max_msg_size=100, max_body_size=1000, **options), Clock())
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50002))
    transport = StringTransport()
    channel.makeConnection(transport)
    return resource, channel, transport


def test_http_body_over_the_limit_is_refused_from_content_length_before_it_is_read():
    """413 right after the headers, without 100 Continue, for /pub (max_msg_size) and
    other paths (max_body_size); the body that follows is never buffered."""
    for path, length, message in [(b"/pub?topic=t", 101, b"MSG_TOO_BIG"), (b"/mpub?topic=t", 1001, b"BODY_TOO_BIG")]:
        resource, channel, transport = http()
        channel.dataReceived(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (path, length)
        )
        answer = transport.value()
        assert answer.startswith(b"HTTP/1.1 413 Request Entity Too Large\r\n")
        assert answer.endswith(b'{"message": "%s"}' % message) and b"100 Continue" not in answer
        assert transport.disconnecting
        channel.dataReceived(b"x" * length)
        assert resource.bodies == [] and channel.requests[0].content is None  # no body buffer made


def test_http_body_at_the_limit_is_served():
    resource, channel, transport = http()
    channel.dataReceived(b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"y" * 100)
    assert resource.bodies == [b"y" * 100] and b"200 OK" in transport.value()


def test_http_chunked_body_is_cut_off_when_it_passes_the_limit():
    """No Content-Length: the chunks are counted and the request refused past the limit."""
    resource, channel, transport = http()
    channel.dataReceived(b"POST /mpub?topic=t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(3):
        channel.dataReceived(b"190\r\n" + b"c" * 400 + b"\r\n")  # 0x190 = 400 bytes
    channel.dataReceived(b"0\r\n\r\n")
    assert transport.value().startswith(b"HTTP/1.1 413 ") and resource.bodies == []


def test_head_request_with_non_ascii_bytes_in_the_url_logs_readably():
    """twisted.web warns about a body sent to HEAD with the request's repr; a URL byte
    over 0x7f used to make that event unformattable ("Unable to format event")."""
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        _, channel, transport = http()
        channel.dataReceived(b"HEAD /caf\x80\xa0 HTTP/1.1\r\nHost: x\r\n\r\n")
    finally:
        globalLogPublisher.removeObserver(events.append)
    texts = [formatEvent(e) for e in events]
    assert any("HEAD request" in t and "caf\\x80\\xa0" in t for t in texts), texts
    assert not any("Unable to format event" in t for t in texts)
    assert transport.value().startswith(b"HTTP/1.1 200 OK")


# -- NSQ deflate ------------------------------------------------------------------------------------
def test_deflate_followed_by_bad_bytes_in_the_same_packet_answers_identify_then_an_error(env):  # noqa: F811
    """IDENTIFY negotiating deflate and garbage in one packet: the IDENTIFY reply (plain),
    then, through the compressed stream, OK and a fatal E_INVALID; then the connection
    closes. It used to raise zlib.error out of the adapter (no reply, a traceback)."""
    p = env.peer()
    identify = encode_command(b"IDENTIFY", body=json.dumps({"feature_negotiation": True, "deflate": True}).encode())
    p.send(identify + b"\xff\xfe not deflate at all")
    raw = p.transport.value()
    reader = FrameReader()
    size = int.from_bytes(raw[:4], "big") + 4
    ((kind, data),) = reader.feed(raw[:size])
    assert kind == FRAME_RESPONSE and json.loads(data)["deflate"] is True
    frames = FrameReader().feed(zlib.decompressobj(-15).decompress(raw[size:]))
    assert frames[0] == (FRAME_RESPONSE, b"OK")
    assert frames[1][0] == FRAME_ERROR and frames[1][1].startswith(b"E_INVALID invalid deflate stream")
    assert p.closed


def test_a_deflate_bomb_is_inflated_in_steps_while_the_connection_is_read(env):  # noqa: F811
    """A small packet that inflates to many commands is parsed one step at a time, and
    not inflated further while the connection is paused."""
    p = env.peer()
    p.send(encode_command(b"IDENTIFY", body=json.dumps({"feature_negotiation": True, "deflate": True}).encode()))
    p.transport.clear()
    gate = SimpleNamespace(paused=False, server_paused=False, frame_completed=lambda: None,
                           sends_started=lambda n, size: None, sends_done=lambda n, size: None)
    p.conn.flow = gate
    deflate = zlib.compressobj(6, zlib.DEFLATED, -15)
    nops = b"NOP\n" * 1_000_000  # 4 MB of commands
    packet = deflate.compress(nops) + deflate.flush(zlib.Z_SYNC_FLUSH)
    assert len(packet) < 20_000
    gate.paused = True
    p.send(packet)
    assert p.conn.buffered() == len(packet)  # kept compressed, nothing inflated
    gate.paused = False
    p.conn.resume_reading()
    assert p.conn.buffered() == 0 and not p.closed


# -- the admin console ---------------------------------------------------------------------------
class Ops:
    node_id = "n1"

    def __init__(self):
        self.pending: list[Deferred] = []

    def topics(self):
        return [{"name": "orders"}]

    def stats(self):
        d: Deferred = Deferred()
        self.pending.append(d)
        return d


def console():
    ops = Ops()
    proto = AdminConsole(ops, "127.0.0.1", "", Clock(), 900.0)
    transport = StringTransport()
    proto.makeConnection(transport)
    transport.clear()
    return proto, transport, ops


def answers(transport):
    return transport.value().decode().splitlines()


def test_console_long_line_is_answered_in_turn_and_the_pipelined_commands_run():
    """A 20 KB line between two commands, all in one packet: the first command's answer,
    the E_LINE_TOO_LONG for the long line, then the last command's answer. The commands
    after the long line used to be dropped."""
    proto, transport, _ = console()
    proto.dataReceived(b"topics\n" + b"x" * 20_000 + b"\ntopics\nhelp\n")
    out = answers(transport)
    assert out[:2] == ['{"name": "orders"}', "OK 1 topics"]
    assert out[2].startswith("ERR E_LINE_TOO_LONG a command line may be at most 16384 bytes")
    assert out[3:5] == ['{"name": "orders"}', "OK 1 topics"] and out[-1].startswith("OK ")


def test_console_answers_every_command_sent_before_a_half_close():
    """``printf 'stats\\ntopics\\n' | nc -N``: the input ends while stats waits for the
    database; both are answered, then the connection closes."""
    proto, transport, ops = console()
    proto.dataReceived(b"stats\ntopics\n")
    proto.readConnectionLost()
    assert not transport.disconnecting
    ops.pending[0].callback({"messages": 3})
    assert answers(transport) == ['{"messages": 3}', "OK stats", '{"name": "orders"}', "OK 1 topics"]
    assert transport.disconnecting


def test_console_flood_of_commands_stops_reading_and_answers_wait_for_the_reader():
    """Lines queued behind a slow command pause reading at MAX_QUEUED; a full write
    buffer (the client not reading) stops running commands until it drains."""
    proto, transport, ops = console()
    proto.dataReceived(b"stats\n" + b"topics\n" * AdminConsole.MAX_QUEUED)
    assert transport.producerState == "paused"
    proto.pauseProducing()  # the client does not read our answers
    ops.pending[0].callback({})
    assert answers(transport) == ["{}", "OK stats"]  # nothing more runs meanwhile
    proto.resumeProducing()
    assert answers(transport).count("OK 1 topics") == AdminConsole.MAX_QUEUED
    assert transport.producerState == "producing"


def test_console_ok_with_succeed():
    """Sanity: synchronous answers need no pause at all."""
    proto, transport, ops = console()
    ops.stats = lambda: succeed({"a": 1})
    proto.dataReceived(b"stats\n")
    assert answers(transport) == ['{"a": 1}', "OK stats"]


assert MAGIC  # the dmq magic is what Port.connect sends by default


def test_a_connection_closed_while_its_client_reads_nothing_is_aborted_after_the_read_timeout():
    """Twisted closes a connection once its unsent bytes are out: a client that never
    reads would keep it, so the gate aborts it READ_TIMEOUT after the close."""
    port = Port()
    protocol = port.factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50003))
    transport = StringTransport()  # loseConnection only marks it: the bytes are "unsent"
    protocol.makeConnection(transport)
    protocol.dataReceived(MAGIC)
    port.clock.advance(2 * 30.0)  # silent: closed with E_TIMEOUT
    assert transport.disconnecting and not transport.disconnected
    port.clock.advance(30.0)
    assert transport.disconnected  # abortConnection


def test_inflated_steps_lose_no_command_at_a_step_boundary(env):  # noqa: F811
    """Commands straddling the 64 KiB inflate steps all run, in order, from one packet."""
    p = env.peer()
    p.send(encode_command(b"IDENTIFY", body=json.dumps({"feature_negotiation": True, "deflate": True}).encode()))
    deflate = zlib.compressobj(6, zlib.DEFLATED, -15)
    commands = b"".join(encode_command(b"PUB", b"steps", body=b"%07d" % i + b"s" * 500) for i in range(1000))
    p.send(deflate.compress(commands) + deflate.flush(zlib.Z_SYNC_FLUSH))
    env.clock.advance(0)  # the reactor turn ends: its answers are written
    raw = p.transport.value()
    compressed = raw[int.from_bytes(raw[:4], "big") + 4 :]  # after the plain IDENTIFY reply
    answers = FrameReader().feed(zlib.decompressobj(-15).decompress(compressed))
    assert answers == [(FRAME_RESPONSE, b"OK")] * 1001  # the upgrade's OK, then one per PUB
    assert [m.body[:7] for m in env.store.topics["steps"].memory] == [b"%07d" % i for i in range(1000)]


def test_flow_limits_defaults_are_the_options_defaults_and_validated():
    """FlowLimits' own defaults (used where no Options is given) match Options'; a total
    cap smaller than one frame is refused, naming the flag."""
    import pytest

    from dmq_server.core.options import ConfigError, Options

    assert vars(FlowLimits.from_options(Options())) == vars(FlowLimits())
    with pytest.raises(ConfigError, match="--max-buffered-bytes .*one whole frame must fit"):
        Options(max_buffered_bytes=1000).validate()


def test_nsq_publishes_to_a_reliable_topic_awaiting_commit_past_the_cap_stop_reading(env):  # noqa: F811
    """NSQ counts each PUB/MPUB awaiting its commit: at max_pending_sends the connection is
    not read; once half are answered it is read again, and every OK comes out in order."""
    from dmq_server.protocols.flow import BufferBudget, ReadGate

    env.broker.register("r", "c")
    p = env.peer()
    limits = FlowLimits(max_pending_sends=4)
    p.conn.flow = ReadGate(p.transport, env.clock, limits, BufferBudget(10**9), lambda why: None)
    p.send(b"".join(encode_command(b"PUB", b"r", body=b"m%d" % i) for i in range(4)))
    assert len(env.broker.published) == 4 and p.transport.producerState == "paused"
    for i, (*_, done) in enumerate(env.broker.published[:2]):
        done(published(i))
    assert p.transport.producerState == "producing"
    for i, (*_, done) in enumerate(env.broker.published[2:], 2):
        done(published(i))
    assert p.frames() == [(FRAME_RESPONSE, b"OK")] * 4
    assert p.conn.flow.pending_sends == 0 and p.conn.flow.pending_bytes == 0


def test_admin_console_line_trickled_past_the_read_timeout_is_closed():
    """Slowloris on the admin console: a line's bytes one every 2 s, never finished, close
    the session ``read_timeout`` after its first byte (idle or not); whole lines in time
    before it do not start it (injected clock)."""
    from twisted.internet.task import Clock
    from twisted.internet.testing import StringTransport

    from dmq_server.admin.line_console import AdminConsole

    clock = Clock()
    proto = AdminConsole(Ops(), "127.0.0.1", "", clock, 900.0, read_timeout=10.0)
    transport = StringTransport()
    proto.makeConnection(transport)
    clock.advance(100)
    for _ in range(4):
        proto.dataReceived(b"x")
        clock.advance(2)
    assert not transport.disconnecting  # 8 s into the line
    clock.advance(2)
    assert transport.disconnecting
    assert "ERR E_TIMEOUT line not finished within 10s" in transport.value().decode()


def test_budget_count_updates_the_port_and_the_server_memory_in_one_call_and_frees_waiters():
    """``BufferBudget.count`` is the one accounting of a gate's frames and pending bodies:
    the port's total and the server's ``ClientMemory`` move together, a zero delta
    touches nothing, and a fall under three quarters of the port's cap reads a stopped
    gate again."""
    from dmq_server.core.client_memory import FRAMES, PENDING, ClientMemory
    from dmq_server.protocols.flow import BUDGET, BufferBudget

    memory = ClientMemory(10**9)
    budget = BufferBudget(100, memory)
    released: list[str] = []

    class Gate:  # a ReadGate's part the budget calls
        release = staticmethod(released.append)

    gate = Gate()
    budget.count(PENDING, 120)
    budget.count(FRAMES, 0)
    assert (budget.held, budget.peak, memory.held[PENDING], memory.held[FRAMES], memory.total) == (
        120, 120, 120, 0, 120)
    budget.wait(gate)
    budget.count(PENDING, -40)  # 80: still over the resume mark (75)
    assert released == [] and memory.total == 80
    budget.count(PENDING, -5)  # at the resume mark
    assert released == [BUDGET] and (budget.held, budget.peak, memory.total) == (75, 120, 75)
