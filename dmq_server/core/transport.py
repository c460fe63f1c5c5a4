"""What the server's adapters ask of a connection's transport: write, close, the peer,
and the producer calls of flow control.

Twisted's transports (TCP, its TLS layer) answer it in production and
``twisted.internet.testing.StringTransport`` in tests. Stated here as a ``typing.Protocol``
(standard library only, like the rest of ``core/``) rather than as Twisted's
``ITransport``: that is a zope interface, which the type checker matches by name and
whose methods it reads without ``self``, so a Twisted protocol of the server declares its
``transport`` as this ``Transport`` instead (on that one line an ignore says so).
"""

from __future__ import annotations

from typing import Iterable, Protocol

__all__ = ["Address", "Receiver", "Transport", "TlsTransport"]


class Address(Protocol):
    """A TCP peer's address (``IPv4Address``/``IPv6Address``)."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


class Transport(Protocol):
    """A connection's transport, as the adapters use it."""

    # the write buffer's high-water mark: past it Twisted pauses the registered producer
    bufferSize: int

    def write(self, data: bytes) -> None: ...

    def writeSequence(self, data: Iterable[bytes]) -> None: ...

    def loseConnection(self) -> None: ...

    def abortConnection(self) -> None: ...

    def getPeer(self) -> object: ...

    def getHost(self) -> object: ...

    def registerProducer(self, producer: object, streaming: bool) -> None: ...

    def unregisterProducer(self) -> None: ...

    def pauseProducing(self) -> None: ...

    def resumeProducing(self) -> None: ...


class Receiver(Protocol):
    """The protocol a transport feeds (Twisted's ``IProtocol.dataReceived``)."""

    def dataReceived(self, data: bytes) -> None: ...


class TlsTransport(Transport, Protocol):
    """A plaintext TCP transport that can turn into TLS in band (NSQ's ``tls_v1``)."""

    @property
    def protocol(self) -> Receiver:
        """What the transport feeds: after ``startTLS``, the TLS layer."""

    def startTLS(self, contextFactory: object) -> None: ...

    def setTcpNoDelay(self, enabled: bool) -> None: ...
