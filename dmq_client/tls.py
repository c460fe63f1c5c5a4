"""TLS for the client: the context built from ``MqConfig``, and a socket whose reads and
writes may come from different threads.

``ServerConnection`` reads on its own thread while any thread writes. OpenSSL does not
allow one connection to be used by two threads at once, and Python's ``SSLSocket`` does
not lock, so ``TlsSocket`` drives an ``ssl.SSLObject`` over memory buffers: encrypting
and decrypting happen under one lock, while the socket's own reads and writes stay
outside it (a writer blocked on a full socket never stops the reader, which is what keeps
the server from waiting on us, see ``connection``). Bytes the reader's decryption produces
for the server (rare in TLS 1.2 and 1.3 without renegotiation) are sent, in order, by the
next write or heartbeat.

A ``recv`` returns everything decrypted so far, so nothing stays buffered where a
``select`` on the socket would not see it.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time

__all__ = ["client_context", "TlsSocket"]


def client_context(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None) -> ssl.SSLContext:
    """A client context that verifies the server (``ca_file``, else the system's CAs) and
    its name, and presents ``cert_file``/``key_file`` when the server asks for one."""
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    return context


class TlsSocket:
    """The parts of a socket ``ServerConnection`` uses, over TLS."""

    def __init__(self, raw: socket.socket, context: ssl.SSLContext, server_name: str):
        self.raw = raw
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_hostname=server_name)
        self._lock = threading.Lock()
        self._unsent = b""  # produced while decrypting; the next write sends it first

    def handshake(self, timeout: float) -> None:
        """Run the client side of the handshake (before any other thread uses this)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush_handshake()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise socket.timeout("TLS handshake timed out")
                self.raw.settimeout(remaining)
                data = self.raw.recv(65536)
                if not data:
                    raise ConnectionError("closed by the server during the TLS handshake")
                self._incoming.write(data)
        self._flush_handshake()

    def _flush_handshake(self) -> None:
        out = self._outgoing.read()
        if out:
            self.raw.sendall(out)

    @property
    def version(self) -> str | None:
        return self._tls.version()

    def sendall(self, data: bytes) -> None:
        with self._lock:
            view = memoryview(data)
            while view:
                written = self._tls.write(view)
                view = view[written:]
            out = self._unsent + self._outgoing.read()
            self._unsent = b""
        self.raw.sendall(out)

    def recv(self, size: int = 65536) -> bytes:
        """Decrypted bytes (all there are), waiting for more while a record is incomplete;
        b"" when the server closed."""
        while True:
            data = self.raw.recv(max(size, 16384))
            if not data:
                return b""
            chunks: list[bytes] = []
            with self._lock:
                self._incoming.write(data)
                while True:
                    try:
                        chunk = self._tls.read(65536)
                    except ssl.SSLWantReadError:
                        break
                    except ssl.SSLZeroReturnError:  # close_notify
                        return b"".join(chunks)
                    if not chunk:
                        break
                    chunks.append(chunk)
                self._unsent += self._outgoing.read()
            if chunks:
                return b"".join(chunks)

    # -- what else ServerConnection and BlockingClient call on a socket ----------------
    def settimeout(self, timeout: float | None) -> None:
        self.raw.settimeout(timeout)

    def setsockopt(self, level: int, option: int, value: int, /) -> None:
        self.raw.setsockopt(level, option, value)

    def fileno(self) -> int:
        return self.raw.fileno()

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()
