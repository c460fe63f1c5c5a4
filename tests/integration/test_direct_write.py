"""``direct_writer`` on a real epoll reactor and real TCP sockets.

It must send at once only where that changes nothing a client can see: every byte
arrives, in the order written, also when the client stops reading and Twisted has to
hold the rest; a registered producer is paused over the transport's buffer size as
with ``transport.write``; a write to a connection the client reset raises nothing and
the loss is reported as usual. (A connection turned to TLS in band is covered by
``test_security_tls.py``'s NSQ ``tls_v1`` tests, whose answers after the handshake take
this path.)
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from zope.interface import implementer

from dmq_server.protocols.direct import direct_writer

from tests.integration.test_reactor_db import on_reactor


class _Server(Protocol):
    def __init__(self, made: Deferred, lost: Deferred):
        self._made, self._lost = made, lost

    def connectionMade(self) -> None:
        self._made.callback(self.transport)

    def connectionLost(self, reason: Any) -> None:
        self._lost.callback(reason.type)  # the class: a Failure would fire it as an error


async def _accepted(reactor: Any) -> tuple[Any, socket.socket, Deferred, Any]:
    """A listening port, a blocking client socket connected to it, the server side's
    transport, and a Deferred firing when the server side is lost."""
    made, lost = Deferred(), Deferred()
    factory = Factory.forProtocol(lambda: _Server(made, lost))
    port = reactor.listenTCP(0, factory, interface="127.0.0.1")
    client = socket.create_connection(("127.0.0.1", port.getHost().port))
    transport = await made
    return transport, client, lost, port


async def _turns(reactor: Any, n: int = 3) -> None:
    """Let the reactor run ``n`` passes (its I/O included)."""
    for _ in range(n):
        d: Deferred = Deferred()
        reactor.callLater(0, d.callback, None)
        await d


async def _closed(reactor: Any, transport: Any, port: Any) -> None:
    """The server side's socket and the listening one closed before the reactor stops."""
    transport.abortConnection()
    stopped = port.stopListening()
    if stopped is not None:
        await stopped
    await _turns(reactor)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        chunk = sock.recv(size - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {size} bytes")
        out += chunk
    return bytes(out)


def test_a_write_with_nothing_held_goes_out_without_registering_for_writing():
    """The bytes are in the client's socket before the reactor runs again, and the
    connection was never registered for writing (``transport.write`` would have)."""

    async def scenario(reactor: Any) -> Any:
        transport, client, lost, port = await _accepted(reactor)
        try:
            write = direct_writer(transport)
            write(b"hello")
            registered = transport in reactor.getWriters()
            held = transport.dataBuffer + b"".join(transport._tempDataBuffer)
            client.settimeout(5)
            got = _read_exactly(client, 5)
            return registered, held, got
        finally:
            client.close()
            await _closed(reactor, transport, port)

    registered, held, got = on_reactor(scenario)
    assert (registered, held, got) == (False, b"", b"hello")


@implementer(IPushProducer)
class _Producer:
    def __init__(self, held: Any) -> None:
        self._held = held
        self.held_at_first_pause: int | None = None
        self.paused = 0
        self.resumed = 0

    def pauseProducing(self) -> None:
        if self.held_at_first_pause is None:
            self.held_at_first_pause = self._held()
        self.paused += 1

    def resumeProducing(self) -> None:
        self.resumed += 1

    def stopProducing(self) -> None:
        pass


def test_a_client_that_stops_reading_gets_every_byte_in_order_and_the_producer_is_paused():
    """Numbered records written while the client does not read: the first go to the
    socket at once until the kernel's buffers are full, the rest are held by Twisted.
    The client then reads a part, which frees room in the socket before the reactor
    has run, and more records are written: they must queue behind the held ones, not
    take that room. The client reads them all, in order; the registered producer was
    paused once the held bytes passed the buffer size and resumed once they were
    written."""
    record = 1024
    count = 2000  # 2 MB: far more than the two sockets' buffers hold, made small here

    async def scenario(reactor: Any) -> Any:
        transport, client, lost, port = await _accepted(reactor)
        try:
            producer = _Producer(lambda: len(transport.dataBuffer) + transport._tempDataLen)
            transport.registerProducer(producer, True)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)
            transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32768)
            write = direct_writer(transport)
            direct_before_full = 0
            for i in range(count):
                if not (transport.dataBuffer or transport._tempDataBuffer):
                    direct_before_full += 1
                write(struct.pack(">I", i) * (record // 4))
            held_after = len(transport.dataBuffer) + transport._tempDataLen
            first_pause = producer.held_at_first_pause
            client.settimeout(5)
            got = bytearray(_read_exactly(client, 16 * record))  # room in the socket, the reactor not run
            for i in range(count, 2 * count):
                write(struct.pack(">I", i) * (record // 4))
            client.setblocking(False)
            while len(got) < 2 * record * count:  # read as the reactor drains what it holds
                try:
                    chunk = client.recv(1 << 20)
                except BlockingIOError:
                    await _turns(reactor, 1)
                    continue
                if not chunk:
                    break
                got += chunk
            await _turns(reactor)
            return direct_before_full, held_after, first_pause, producer.resumed, bytes(got)
        finally:
            client.close()
            await _closed(reactor, transport, port)

    direct, held, first_pause, resumed, got = on_reactor(scenario)
    assert direct > 1  # some went to the socket at once ...
    assert held > 64 * 1024  # ... and the rest waited in Twisted, past its buffer size
    assert first_pause is not None and first_pause > 64 * 1024  # paused once past it, not before
    assert resumed >= 1
    expected = b"".join(struct.pack(">I", i) * (record // 4) for i in range(2 * count))
    assert len(got) == len(expected)
    assert got == expected


def test_a_write_to_a_connection_the_client_reset_raises_nothing_and_the_loss_is_reported():
    """Writes after the client's reset: none raises, and the server side is told the
    connection is gone (the scenario times out if it is not)."""

    async def scenario(reactor: Any) -> Any:
        transport, client, lost, port = await _accepted(reactor)
        try:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # a reset, not a FIN
            write = direct_writer(transport)
            for _ in range(3):  # the first may still be taken by the kernel; a later one meets the reset
                write(b"x" * 1000)
                await _turns(reactor, 1)
            return (await lost).__name__
        finally:
            await _closed(reactor, transport, port)

    # a reset read before the writes meet it is reported as the end of the stream
    assert on_reactor(scenario) in ("ConnectionLost", "ConnectionDone")


def test_a_transport_that_is_not_a_plain_tcp_connection_keeps_its_own_write():
    """The TLS-only port's handlers get Twisted's TLS wrapper, a string transport in the
    unit tests: both keep ``transport.write``."""
    from twisted.internet.testing import StringTransport

    transport = StringTransport()
    writes = []
    transport.write = lambda data, write=transport.write: (writes.append(data), write(data))
    direct_writer(transport)(b"abc")
    assert writes == [b"abc"] and transport.value() == b"abc"


def test_the_write_cost_bench_runs_its_round_trips_both_ways():
    """bench/write_cost.py (the figures in docs/benchmarks.md, session 28): each way
    completes its round trips on a fresh reactor and reports a cost per round trip."""
    from tests.bench_modules import import_bench

    write_cost = import_bench("write_cost")
    for direct in (False, True):
        cpu_us, wall_us = write_cost.round_trips(direct, 200)
        assert 0 < cpu_us and 0 < wall_us < 100_000
