"""The shared TCP port: the first four bytes choose the protocol.

``DMQ1`` hands the connection to the dmq protocol. NSQ's ``"  V2"`` will be
routed here too once the NSQ protocol lands; until then it, like any other
magic, gets a PROTOCOL_ERROR frame naming the problem and the connection
closes. The per-protocol handlers are plain objects fed by this adapter.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

from dmq_client.wire import MAGIC, Command, Frame, encode

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

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True) if hasattr(self.transport, "setTcpNoDelay") else None
        self._magic_timer = self.factory.clock.callLater(MAGIC_TIMEOUT, self._no_magic)

    def _no_magic(self) -> None:
        self._magic_timer = None
        self.transport.loseConnection()

    def dataReceived(self, data: bytes) -> None:
        if self._handler is not None:
            self._handler.data_received(data)
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
        if rest:
            self._handler.data_received(rest)

    def connectionLost(self, reason: Any = None) -> None:
        if self._magic_timer is not None and self._magic_timer.active():
            self._magic_timer.cancel()
        if self._handler is not None:
            self._handler.connection_lost()


class PortFactory(Factory):
    """``protocols`` maps a 4-byte magic to ``handler(transport)``."""

    def __init__(self, clock: Any, protocols: dict[bytes, Callable[[Any], Any]]):
        self.clock = clock
        self.protocols = protocols

    def buildProtocol(self, addr: Any) -> PortProtocol:
        return PortProtocol(self)
