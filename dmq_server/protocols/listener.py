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
port reads again, to drain input the handler kept while paused) and
``output_blocked(blocked)`` (its client stopped or started reading what it was sent:
no pushes meanwhile). Every byte those connections hold counts against the server's
``--max-client-memory`` (``core.client_memory.ClientMemory``, the factory's ``budget.memory``).

TLS (``dmq_server.security.tls``): on the TLS-only port (``--tls-address``) the factory is
wrapped in Twisted's TLS layer, so the magic is read after the handshake; a handler may
upgrade a plaintext connection in band (NSQ's ``tls_v1``) through ``start_tls``, which
the port hands it. Either way a handshake not finished within ``--tls-handshake-timeout``
closes the connection (nsqd allows five seconds), and the handler's ``tls_ready()`` is
called once it is done. ``refused`` maps a magic to the error that refuses it on this
port (the dmq protocol on the plaintext port while TLS is required).
"""

from __future__ import annotations

from typing import Callable, Protocol as TypingProtocol

from twisted.internet.interfaces import IHandshakeListener
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from dmq_client.wire import MAGIC, Command, Frame, encode

from dmq_server.core.clock import Clock, Timer
from dmq_server.protocols.flow import BufferBudget, FlowLimits, NoGate, ReadGate
from dmq_server.core.client_memory import ClientMemory
from dmq_server.core.peers import peer_address
from dmq_server.core.transport import TlsTransport
from dmq_server.security.tls import ServerTls

__all__ = ["Handler", "PortProtocol", "PortFactory"]

log = Logger()

NSQ_MAGIC = b"  V2"
MAGIC_TIMEOUT = 10.0


class Handler(TypingProtocol):
    """What the port asks of a protocol's connection (the dmq and NSQ protocols'): it is
    fed the bytes after the magic and told when the connection is gone; ``flow`` is the
    port's gate, set once. The optional calls (``resume_reading``, ``output_blocked``,
    ``tls_ready``, and the ``start_tls`` the port offers) are looked up by name: a handler
    without them is fine."""

    flow: ReadGate | NoGate

    def data_received(self, data: bytes) -> None: ...

    def connection_lost(self) -> None: ...

    def buffered(self) -> int:
        """Bytes of an incomplete frame the handler holds."""

    def timed_out(self, description: str) -> None: ...


@implementer(IHandshakeListener)
class PortProtocol(Protocol):
    # ITransport is a zope interface, nominal to mypy and read without self; Twisted's TCP
    # and TLS transports have this shape (dmq_server.core.transport)
    transport: TlsTransport  # type: ignore[assignment]
    # set by connectionMade, which Twisted calls before any other of the calls below
    gate: ReadGate

    def __init__(self, factory: "PortFactory"):
        self.factory = factory
        self._head = b""
        self._handler: Handler | None = None
        self._magic_timer: Timer | None = None
        self._handshake_timer: Timer | None = None
        self._regate = False  # the gate is registered again once the in-band handshake is done

    def connectionMade(self) -> None:
        if hasattr(self.transport, "setTcpNoDelay"):  # not on the TLS port's transport
            self.transport.setTcpNoDelay(True)
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
        if factory.tls_port:
            self._arm_handshake_timer()

    # -- TLS --------------------------------------------------------------------------
    def _arm_handshake_timer(self) -> None:
        self._handshake_timer = self.factory.clock.callLater(self.factory.handshake_timeout, self._handshake_late)

    def _handshake_late(self) -> None:
        self._handshake_timer = None
        log.info("{peer}: TLS handshake not finished within {t}s, closing",
                 peer=self.gate.peer, t=self.factory.handshake_timeout)
        self.transport.abortConnection()

    def handshakeCompleted(self) -> None:
        if self._handshake_timer is not None and self._handshake_timer.active():
            self._handshake_timer.cancel()
        self._handshake_timer = None
        if self._regate and not self.gate.closed:
            self._regate = False
            self.transport.registerProducer(self.gate, True)
        ready = getattr(self._handler, "tls_ready", None)
        if ready is not None:
            ready()

    def start_tls(self, leftover: bytes = b"") -> None:
        """Turn this plaintext connection into a TLS server connection now (what was
        written before goes out in plaintext first); ``leftover``, bytes already read
        that came after the command asking for it, is the start of the handshake."""
        # Twisted's TLS layer pauses a registered producer while it buffers writes made
        # before the handshake is done; the gate would then stop reading the socket and
        # the handshake could never finish. So the gate waits for the handshake.
        self.transport.unregisterProducer()
        self._regate = True
        self.transport.startTLS(self.factory.tls)
        self._arm_handshake_timer()
        if leftover:
            self.transport.protocol.dataReceived(leftover)

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
        refused = self.factory.refused.get(magic)
        if make is None or refused is not None:
            if refused is not None:
                why = refused
            elif magic == NSQ_MAGIC:
                why = "E_BAD_PROTOCOL the NSQ protocol is not enabled on this server"
            else:
                why = f"E_BAD_PROTOCOL unknown protocol magic {magic!r} (expected {MAGIC!r})"
            log.info("{peer}: {why}", peer=self.transport.getPeer(), why=why)
            self.transport.write(encode(Frame(Command.PROTOCOL_ERROR, status=why)))
            self.transport.loseConnection()
            return
        handler = self._handler = make(self.transport)
        handler.flow = self.gate
        if self.factory.tls is not None and not self.factory.tls_port and hasattr(handler, "start_tls"):
            handler.start_tls = self.start_tls
        self.gate.on_resume = getattr(handler, "resume_reading", None)
        self.gate.on_output = getattr(handler, "output_blocked", None)
        if rest:
            handler.data_received(rest)
        self._account()

    def _account(self) -> None:
        """Tell the gate what the handler still holds of an incomplete frame."""
        self.gate.input_held(self._handler.buffered() if self._handler is not None else 0)

    def _timed_out(self, description: str) -> None:
        log.info("{peer}: {why}, closing", peer=self.gate.peer, why=description)
        if self._handler is not None:
            self._handler.timed_out(description)
        else:
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._magic_timer is not None and self._magic_timer.active():
            self._magic_timer.cancel()
        if self._handshake_timer is not None and self._handshake_timer.active():
            self._handshake_timer.cancel()
        if hasattr(self, "gate"):  # the connection was made
            self.gate.close()
        if self._handler is not None:
            self._handler.connection_lost()


class PortFactory(Factory):
    """``protocols`` maps a 4-byte magic to ``handler(transport)``; ``limits`` are the
    flow-control bounds (``FlowLimits.from_options``), shared by every connection (and
    by the TLS port's factory: ``budget`` may be shared). ``tls`` is the server's
    ``ServerTls`` (None: no TLS); ``tls_port`` says TLS starts with the connection.
    ``memory``: the server's one ``ClientMemory`` (a budget of its own when not given:
    a port alone in a test)."""

    def __init__(
        self,
        clock: Clock,
        protocols: dict[bytes, Callable[[TlsTransport], Handler]],
        limits: FlowLimits | None = None,
        *,
        tls: ServerTls | None = None,
        tls_port: bool = False,
        handshake_timeout: float = 5.0,
        refused: dict[bytes, str] | None = None,
        budget: BufferBudget | None = None,
        memory: ClientMemory | None = None,
    ):
        self.clock = clock
        self.protocols = protocols
        self.limits = limits or FlowLimits()
        read_size = self.limits.max_output_buffer
        self.budget = budget or BufferBudget(
            self.limits.max_buffered_bytes,
            memory or ClientMemory(self.limits.max_client_memory, read_size=read_size),
            read_size=read_size,
        )
        self.tls = tls
        self.tls_port = tls_port
        self.handshake_timeout = handshake_timeout
        self.refused = refused or {}

    def buildProtocol(self, addr: object) -> PortProtocol:
        return PortProtocol(self)
