"""A connection's write that goes to the socket at once when nothing waits before it.

Twisted's ``transport.write`` only queues: it registers the connection for writing
(an ``epoll_ctl``), the reactor's next poll reports it writable, ``doWrite`` sends and
unregisters it (another ``epoll_ctl``). A paced producer's every send is answered by a
write of its own, so at bench/reliable.py's steady 5,000 msgs/s that round is paid once
a message, and the answer leaves one reactor pass later than it could.

``direct_writer(transport)`` sends the bytes with the transport's own ``writeSomeData``
(its send limit and its reading of ``EWOULDBLOCK``) when the transport holds nothing
unsent, and hands Twisted whatever the socket did not take, so the order of the bytes
and Twisted's flow control (a registered producer paused over ``bufferSize``) stay as
they were: the kernel's buffer fills first either way. Anything else takes
``transport.write`` as it is: a transport that is not a plain TCP connection (the
TLS-only port's wrapper), a connection turned to TLS in band (NSQ's ``tls_v1``, whose
writes must go through the TLS layer), one closing or closed, or a send that failed
(Twisted then finds the loss on its own write and reports it as usual).

``queued``, when given, is called after a write left bytes in Twisted's buffer: the
port's flow control counts them against the server's memory budget
(``protocols.flow.ReadGate.output_queued``); a write the socket took whole costs nothing more.
"""

from __future__ import annotations

from typing import Callable

from twisted.internet.tcp import Connection

from dmq_server.core.transport import Transport

__all__ = ["direct_writer"]


def direct_writer(transport: Transport, queued: Callable[[], None] | None = None) -> Callable[[bytes], None]:
    """``transport.write``, sending at once where that cannot reorder or lose a byte."""
    if not isinstance(transport, Connection):
        if queued is None:
            # looked up at each write: the unit tests wrap a string transport's write to count writes
            return lambda data: transport.write(data)

        def write_counted(data: bytes) -> None:
            transport.write(data)
            queued()

        return write_counted
    if queued is None:
        queue = transport.write
    else:
        def queue(data: bytes) -> None:
            transport.write(data)
            queued()
    send = transport.writeSomeData

    def write(data: bytes) -> None:
        t = transport
        if (t.TLS or t.dataBuffer or t._tempDataBuffer or not t.connected or t.disconnecting
                or t._writeDisconnected):
            queue(data)
            return
        sent = send(data)
        if sent.__class__ is not int:  # the connection is lost: Twisted's write finds it out
            queue(data)
        elif sent < len(data):
            queue(data[sent:])

    return write
