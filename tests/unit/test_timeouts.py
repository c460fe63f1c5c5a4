"""Timeouts on every port, driven by ``twisted.internet.task.Clock`` (no sleeping).

* the dmq protocol closes a silent client exactly two heartbeat intervals after the
  last byte (it used to check on the heartbeat tick: between two and three);
* an incomplete frame (dmq, NSQ) or HTTP request must be finished within the read
  timeout, so a client trickling a byte every 5 s is closed;
* an admin console session without a command is closed after its idle timeout,
  never while a command runs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport, StringTransportWithDisconnection
from twisted.web.resource import Resource

from dmq_client.wire import MAGIC, Command, Frame, FrameDecoder, encode
from dmq_server.admin.line_console import AdminConsole
from dmq_server.protocols.dmq import DmqConnection
from dmq_server.protocols.flow import FlowLimits
from dmq_server.http.site import BoundedSite
from dmq_server.protocols.listener import NSQ_MAGIC, PortFactory
from dmq_server.protocols.nsq_context import NsqContext
from dmq_server.fast.fast_store import FastStore
from dmq_server.protocols.nsq_v2 import NsqConnection
from dmq_server.core.nsq_wire import FRAME_ERROR, FrameReader, encode_command
from dmq_server.core.options import Options
from tests.unit.test_nsq_protocol import MemoryBackend

HEARTBEAT = 30.0
READ_TIMEOUT = 30.0


class FakeBroker:
    """What DmqConnection asks of the broker; sends wait until the test answers them."""

    def __init__(self, options: Options):
        self.options = options
        self.healthy = True
        self.health_detail = ""
        self.sends: list[tuple[bytes, Any]] = []

    def publish(self, request, done):
        self.sends.append((request.payloads()[0], done))

    def publish_each(self, request, answer):
        self.sends.extend((body, lambda outcome, i=i: answer(i, [outcome])) for i, body in enumerate(request.payloads()))

    def unsubscribe(self, channel, sub):
        pass


class Port:
    """The shared TCP port with the real dmq and NSQ handlers on string transports."""

    def __init__(self, limits: FlowLimits | None = None, **options: Any):
        self.clock = Clock()
        self.options = Options(heartbeat_interval=HEARTBEAT, **options)
        self.broker = FakeBroker(self.options)
        self.registry: set = set()
        store = FastStore(self.clock, None, node_id=1, backend_factory=lambda name: MemoryBackend())
        store.start()
        self.nsq = NsqContext(self.broker, self.options, self.clock)
        self.factory = PortFactory(
            self.clock,
            {
                MAGIC: lambda t: DmqConnection(t, self.broker, self.clock, self.registry),
                NSQ_MAGIC: lambda t: NsqConnection(t, self.nsq),
            },
            limits or FlowLimits(read_timeout=READ_TIMEOUT),
        )

    def connect(self, magic: bytes = MAGIC) -> tuple[Any, StringTransportWithDisconnection]:
        protocol = self.factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
        transport = StringTransportWithDisconnection()
        transport.protocol = protocol
        protocol.makeConnection(transport)
        protocol.dataReceived(magic)
        return protocol, transport


def dmq_frames(transport: StringTransport) -> list[Frame]:
    return FrameDecoder().feed(transport.value())


def send_frame(session_id: int, body: bytes = b"x" * 100) -> bytes:
    return encode(
        Frame(Command.UP_PRODUCER_SEND, session_id=session_id, topic="t", producer="p", timestamp_ms=1, body=body)
    )


# -- the dmq protocol's silence deadline ---------------------------------------------------
def test_dmq_silent_client_is_closed_exactly_two_heartbeat_intervals_after_its_last_byte():
    """Last byte at t=10: open at 69.9, closed at 70 with E_TIMEOUT (the old check on the
    30 s heartbeat tick closed it only at t=90)."""
    port = Port()
    _, transport = port.connect()
    port.clock.advance(10)
    transport.protocol.dataReceived(encode(Frame(Command.UP_HEARTBEAT)))
    port.clock.advance(59.9)
    assert transport.connected
    port.clock.advance(0.1)
    assert not transport.connected
    assert dmq_frames(transport)[-1].status == "E_TIMEOUT no data received for two heartbeat intervals"


def test_dmq_client_sending_heartbeats_stays_connected():
    """A client heard at least once per interval is never closed for silence."""
    port = Port()
    _, transport = port.connect()
    for _ in range(20):
        port.clock.advance(HEARTBEAT)
        transport.protocol.dataReceived(encode(Frame(Command.UP_HEARTBEAT)))
    assert transport.connected


def test_nsq_silent_client_is_closed_after_two_heartbeat_intervals():
    """NSQ's read deadline is the same two intervals, to the second."""
    port = Port()
    _, transport = port.connect(NSQ_MAGIC)
    port.clock.advance(2 * HEARTBEAT - 0.1)
    assert transport.connected
    port.clock.advance(0.1)
    assert not transport.connected


# -- incomplete frames ----------------------------------------------------------------------
def test_dmq_incomplete_frame_is_closed_after_the_read_timeout_despite_a_byte_every_5s():
    """A slow-loris client: every 5 s one more byte of a frame. Heartbeats would keep it
    (it is not silent); the read timeout closes it READ_TIMEOUT after the frame began."""
    port = Port()
    _, transport = port.connect()
    frame = send_frame(1)
    sent = 0
    while transport.connected and sent < len(frame):
        transport.protocol.dataReceived(frame[sent : sent + 1])
        sent += 1
        port.clock.advance(5)
    assert not transport.connected
    assert sent == READ_TIMEOUT / 5  # 6 bytes: closed at t=30 after the first
    (error,) = [f for f in dmq_frames(transport) if f.command == Command.PROTOCOL_ERROR]
    assert error.status.startswith("E_TIMEOUT incomplete frame (6 bytes) not finished within 30s")


def test_dmq_whole_frames_restart_the_read_timer():
    """Complete frames every 20 s, each sent in two halves 10 s apart, never time out."""
    port = Port()
    _, transport = port.connect()
    frame = encode(Frame(Command.UP_HEARTBEAT))
    for _ in range(10):
        transport.protocol.dataReceived(frame[:20])
        port.clock.advance(10)
        transport.protocol.dataReceived(frame[20:])
        port.clock.advance(10)
    assert transport.connected


def test_nsq_incomplete_body_is_closed_after_the_read_timeout():
    """A PUB whose body never finishes gets E_TIMEOUT, then the connection closes."""
    port = Port()
    _, transport = port.connect(NSQ_MAGIC)
    transport.protocol.dataReceived(encode_command(b"PUB", b"t", body=b"y" * 50)[:-10])
    port.clock.advance(READ_TIMEOUT - 0.1)
    assert transport.connected
    port.clock.advance(0.1)
    assert not transport.connected
    (text,) = [data for kind, data in FrameReader().feed(transport.value()) if kind == FRAME_ERROR]
    assert text.startswith(b"E_TIMEOUT incomplete frame")


# -- HTTP ---------------------------------------------------------------------------------------
class Hello(Resource):
    isLeaf = True

    def render(self, request):
        return b"hello"


def http_connection(**options: Any) -> tuple[Clock, Any, StringTransport]:
    clock = Clock()
    site = BoundedSite(Hello(), SimpleNamespace(read_timeout=READ_TIMEOUT, http_idle_timeout=300.0, **options), clock)
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50001))
    transport = StringTransport()
    channel.makeConnection(transport)
    return clock, channel, transport


def test_http_request_trickled_slowly_is_answered_408_and_closed():
    """One byte every 5 s of a request: 408 at READ_TIMEOUT, not 12 hours later."""
    clock, channel, transport = http_connection()
    request = b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"
    for i in range(len(request)):
        if transport.disconnecting:
            break
        channel.dataReceived(request[i : i + 1])
        clock.advance(5)
    assert transport.disconnecting
    assert transport.value().startswith(b"HTTP/1.1 408 Request Timeout\r\n")


def test_http_requests_on_a_keep_alive_connection_each_get_the_full_read_timeout():
    """The timer covers one request; between requests only the idle timeout applies."""
    clock, channel, transport = http_connection()
    for _ in range(5):
        channel.dataReceived(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        clock.advance(READ_TIMEOUT + 1)
    assert not transport.disconnecting
    assert transport.value().count(b"hello") == 5
    clock.advance(300)
    assert transport.disconnecting  # idle


# -- the admin console --------------------------------------------------------------------
class SlowOps:
    node_id = "n1"

    def __init__(self):
        self.pending: list[Deferred] = []

    def stats(self):
        d: Deferred = Deferred()
        self.pending.append(d)
        return d


def console(idle: float = 900.0) -> tuple[Clock, AdminConsole, StringTransport, SlowOps]:
    clock, ops = Clock(), SlowOps()
    proto = AdminConsole(ops, "127.0.0.1", "", clock, idle)
    transport = StringTransport()
    proto.makeConnection(transport)
    return clock, proto, transport, ops


def test_admin_console_session_without_a_command_is_closed_after_the_idle_timeout():
    """Bytes that never make a command (a byte every 5 s, no newline) do not keep it open."""
    clock, proto, transport, _ = console()
    clock.advance(500)
    proto.dataReceived(b"help\n")
    for _ in range(int(899 / 5)):
        proto.dataReceived(b"x")
        clock.advance(5)
    assert not transport.disconnecting
    clock.advance(900 - 5 * int(899 / 5))
    assert transport.disconnecting
    assert transport.value().decode().splitlines()[-1] == "# no command for 900s; closing the session"


def test_admin_console_is_not_closed_while_a_command_runs():
    """A long command (a deferred stats) is not cut by the idle timer; the timer starts
    again when it is answered."""
    clock, proto, transport, ops = console(idle=60)
    proto.dataReceived(b"stats\n")
    clock.advance(600)
    assert not transport.disconnecting
    ops.pending[0].callback({"ok": True})
    assert transport.value().decode().splitlines()[-1] == "OK stats"
    clock.advance(59)
    assert not transport.disconnecting
    clock.advance(1)
    assert transport.disconnecting
