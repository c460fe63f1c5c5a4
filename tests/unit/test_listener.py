"""Unit tests of ``dmq_server.protocols.listener``: the shared TCP port sniffs the first four bytes.

Network-free: each connection is a ``StringTransportWithDisconnection`` and time is
a ``MemoryReactorClock``. The registered "protocol" is a recording handler, so these
tests pin only what the port adapter does: route by magic, pass every byte after
the magic on unchanged, refuse unknown magics with a PROTOCOL_ERROR frame, and
close connections that never say which protocol they speak.
"""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock, StringTransportWithDisconnection

from dmq_client.wire import MAGIC, Command, Frame
from dmq_client.wire.codec import FrameDecoder
from dmq_server.protocols.listener import MAGIC_TIMEOUT, NSQ_MAGIC, PortFactory, PortProtocol


class RecordingHandler:
    """Stands in for a per-protocol handler (e.g. DmqConnection)."""

    def __init__(self, transport: Any):
        self.transport = transport
        self.received: list[bytes] = []
        self.lost = 0

    def data_received(self, data: bytes) -> None:
        self.received.append(data)

    def connection_lost(self) -> None:
        self.lost += 1

    def buffered(self) -> int:
        return 0

    def timed_out(self, description: str) -> None:
        self.transport.loseConnection()

    @property
    def data(self) -> bytes:
        return b"".join(self.received)


class Port:
    """A PortFactory with a recording handler registered under some magics."""

    def __init__(self, *magics: bytes):
        self.clock = MemoryReactorClock()
        self.handlers: list[RecordingHandler] = []
        self.factory = PortFactory(self.clock, {magic: self._make for magic in magics or (MAGIC,)})

    def _make(self, transport: Any) -> RecordingHandler:
        handler = RecordingHandler(transport)
        self.handlers.append(handler)
        return handler

    def connect(self) -> tuple[PortProtocol, StringTransportWithDisconnection]:
        protocol = self.factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
        transport = StringTransportWithDisconnection()
        transport.protocol = protocol
        protocol.makeConnection(transport)
        return protocol, transport


def written_frames(transport: StringTransportWithDisconnection) -> list[Frame]:
    return FrameDecoder().feed(transport.value())


# -- routing by magic --------------------------------------------------------
def test_dmq_magic_hands_the_connection_and_following_bytes_to_the_handler() -> None:
    """Bytes after the magic in the same chunk reach the handler, which gets the transport."""
    port = Port()
    protocol, transport = port.connect()
    protocol.dataReceived(MAGIC + b"first frame bytes")
    (handler,) = port.handlers
    assert handler.transport is transport
    assert handler.data == b"first frame bytes"
    assert transport.connected and transport.value() == b""


def test_magic_alone_creates_the_handler_without_feeding_it_empty_data() -> None:
    """A chunk holding exactly the magic opens the handler; nothing is fed yet."""
    port = Port()
    protocol, _ = port.connect()
    protocol.dataReceived(MAGIC)
    (handler,) = port.handlers
    assert handler.received == []


@pytest.mark.parametrize(
    "chunks",
    [
        [b"D", b"MQ1", b"xyz"],
        [b"DM", b"Q1x", b"yz"],
        [b"DMQ", b"1xyz"],
        [b"D", b"M", b"Q", b"1", b"x", b"y", b"z"],
    ],
    ids=["1+3", "2+2", "3+1", "byte-by-byte"],
)
def test_magic_split_across_chunks_is_recognised(chunks: list[bytes]) -> None:
    """TCP may cut anywhere: a magic arriving in pieces still selects the protocol and
    the bytes after it arrive whole and in order."""
    port = Port()
    protocol, transport = port.connect()
    for chunk in chunks:
        protocol.dataReceived(chunk)
    (handler,) = port.handlers
    assert handler.data == b"xyz"
    assert transport.connected


def test_after_the_magic_every_chunk_goes_to_the_handler_verbatim() -> None:
    """Once chosen, the protocol is fixed: later chunks, even ones that look like a
    magic, are the handler's data and no second handler is made."""
    port = Port()
    protocol, _ = port.connect()
    protocol.dataReceived(MAGIC)
    protocol.dataReceived(b"  V2")
    protocol.dataReceived(MAGIC + b"abc")
    (handler,) = port.handlers
    assert handler.received == [b"  V2", MAGIC + b"abc"]


def test_the_protocol_table_decides_so_nsq_magic_routes_when_registered() -> None:
    """The port has no built-in protocol list: registering NSQ's magic routes it."""
    port = Port(MAGIC, NSQ_MAGIC)
    protocol, _ = port.connect()
    protocol.dataReceived(NSQ_MAGIC + b"SUB orders billing\n")
    (handler,) = port.handlers
    assert handler.data == b"SUB orders billing\n"


# -- refusing unknown magics ---------------------------------------------------
def test_unknown_magic_gets_a_protocol_error_frame_and_the_connection_closes() -> None:
    """A client speaking something else is told why, in a frame a dmq client can read,
    and disconnected; no handler is created."""
    port = Port()
    protocol, transport = port.connect()
    protocol.dataReceived(b"GET / HTTP/1.1\r\n\r\n")
    (frame,) = written_frames(transport)
    assert frame.command == Command.PROTOCOL_ERROR
    assert frame.status.startswith("E_BAD_PROTOCOL")
    assert "b'GET '" in frame.status and repr(MAGIC) in frame.status
    assert not transport.connected
    assert port.handlers == []


def test_unknown_magic_split_across_chunks_is_refused_once_four_bytes_are_in() -> None:
    """Fewer than four bytes decide nothing; the fourth byte triggers the refusal."""
    port = Port()
    protocol, transport = port.connect()
    protocol.dataReceived(b"XY")
    assert transport.connected and transport.value() == b""
    protocol.dataReceived(b"Z!")
    (frame,) = written_frames(transport)
    assert frame.status.startswith("E_BAD_PROTOCOL")
    assert not transport.connected


def test_nsq_magic_says_nsq_is_not_enabled() -> None:
    """An NSQ client reaching a server without the NSQ protocol gets a specific reason."""
    port = Port()
    protocol, transport = port.connect()
    protocol.dataReceived(NSQ_MAGIC + b"IDENTIFY\n")
    (frame,) = written_frames(transport)
    assert frame.command == Command.PROTOCOL_ERROR
    assert frame.status.startswith("E_BAD_PROTOCOL")
    assert "NSQ" in frame.status and "not enabled" in frame.status
    assert not transport.connected
    assert port.handlers == []


# -- the magic timeout -----------------------------------------------------------
def test_no_magic_within_the_timeout_closes_the_connection() -> None:
    """A peer that connects and says nothing (or too little) is dropped after MAGIC_TIMEOUT."""
    port = Port()
    protocol, transport = port.connect()
    protocol.dataReceived(b"DM")
    port.clock.advance(MAGIC_TIMEOUT - 0.001)
    assert transport.connected
    port.clock.advance(0.001)
    assert not transport.connected
    assert port.handlers == []
    assert port.clock.getDelayedCalls() == []


def test_magic_in_time_cancels_the_timeout() -> None:
    """After the magic, the port's timer is gone; idleness is the protocol's business."""
    port = Port()
    protocol, transport = port.connect()
    port.clock.advance(MAGIC_TIMEOUT / 2)
    protocol.dataReceived(MAGIC)
    assert port.clock.getDelayedCalls() == []
    port.clock.advance(MAGIC_TIMEOUT * 10)
    assert transport.connected


def test_disconnect_before_the_magic_cancels_the_timeout() -> None:
    """A peer that leaves early leaves no timer behind."""
    port = Port()
    _, transport = port.connect()
    transport.loseConnection()
    assert port.clock.getDelayedCalls() == []


def test_connection_lost_is_passed_to_the_handler_once() -> None:
    """The handler learns that its connection is gone, exactly once."""
    port = Port()
    protocol, transport = port.connect()
    protocol.dataReceived(MAGIC)
    transport.loseConnection()
    (handler,) = port.handlers
    assert handler.lost == 1
