"""The shared TCP port: the first four bytes choose the protocol.

``DMQ1`` hands the connection to the dmq protocol and NSQ's ``"  V2"`` to the NSQ
protocol (each registered by the service); any other magic gets a PROTOCOL_ERROR
frame naming the problem and the connection closes. The per-protocol handlers are
plain objects fed by this adapter.

Every connection gets a ``flow.ReadGate`` (its handler's ``flow``): the port stops
reading a connection whose replies are not read, whose sends awaiting commit pass
their cap, or while the port's buffered bytes are over theirs, and closes one whose
incomplete frame is not finished within the read timeout (see ``dmq_server.protocols.flow``).
A handler offers ``buffered()`` (bytes of an incomplete frame it holds),
``timed_out(description)`` and, optionally, ``resume_reading()`` (called before the
port reads again, to drain input the handler kept while paused).
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

from dmq_client.wire import MAGIC, Command, Frame, encode

from dmq_server.protocols.flow import BufferBudget, FlowLimits, ReadGate
from dmq_server.core.peers import peer_address

__all__ = ["PortProtocol", "PortFactory"]

log = Logger()

NSQ_MAGIC = b"  V2"
MAGIC_TIMEOUT = 10.0


class PortProtocol(Protocol):
    def __init__(self, factory: "PortFactory"):
        self.factory = factory
        self._head = b""
        self._handler: Any = None
        self._magic_timer: Any = None
        self.gate: ReadGate | None = None

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True) if hasattr(self.transport, "setTcpNoDelay") else None
        factory = self.factory
        self._magic_timer = factory.clock.callLater(MAGIC_TIMEOUT, self._no_magic)
        self.gate = ReadGate(
            self.transport,
            factory.clock,
            factory.limits,
            factory.budget,
            self._timed_out,
            peer_address(self.transport),
        )

    def _no_magic(self) -> None:
        self._magic_timer = None
        self.transport.loseConnection()

    def dataReceived(self, data: bytes) -> None:
        self.gate.received(len(data))
        if self._handler is not None:
            self._handler.data_received(data)
            self._account()
            return
        self._head += data
        if len(self._head) < 4:
            return
        magic, rest = self._head[:4], self._head[4:]
        self._head = b""
        if self._magic_timer is not None and self._magic_timer.active():
            self._magic_timer.cancel()
        self._magic_timer = None
        make = self.factory.protocols.get(magic)
        if make is None:
            if magic == NSQ_MAGIC:
                why = "E_BAD_PROTOCOL the NSQ protocol is not enabled on this server"
            else:
                why = f"E_BAD_PROTOCOL unknown protocol magic {magic!r} (expected {MAGIC!r})"
            log.info("{peer}: {why}", peer=self.transport.getPeer(), why=why)
            self.transport.write(encode(Frame(Command.PROTOCOL_ERROR, status=why)))
            self.transport.loseConnection()
            return
        self._handler = make(self.transport)
        self._handler.flow = self.gate
        self.gate.on_resume = getattr(self._handler, "resume_reading", None)
        if rest:
            self._handler.data_received(rest)
        self._account()

    def _account(self) -> None:
        """Tell the gate what the handler still holds of an incomplete frame."""
        buffered = getattr(self._handler, "buffered", None)
        self.gate.input_held(buffered() if buffered is not None else 0)

    def _timed_out(self, description: str) -> None:
        log.info("{peer}: {why}, closing", peer=self.gate.peer, why=description)
        timed_out = getattr(self._handler, "timed_out", None)
        if timed_out is not None:
            timed_out(description)
        else:
            self.transport.loseConnection()

    def connectionLost(self, reason: Any = None) -> None:
        if self._magic_timer is not None and self._magic_timer.active():
            self._magic_timer.cancel()
        if self.gate is not None:
            self.gate.close()
        if self._handler is not None:
            self._handler.connection_lost()


class PortFactory(Factory):
    """``protocols`` maps a 4-byte magic to ``handler(transport)``; ``limits`` are the
    flow-control bounds (``FlowLimits.from_options``), shared by every connection."""

    def __init__(
        self, clock: Any, protocols: dict[bytes, Callable[[Any], Any]], limits: FlowLimits | None = None
    ):
        self.clock = clock
        self.protocols = protocols
        self.limits = limits or FlowLimits()
        self.budget = BufferBudget(self.limits.max_buffered_bytes)

    def buildProtocol(self, addr: Any) -> PortProtocol:
        return PortProtocol(self)
