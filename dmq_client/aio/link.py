"""One server connection of the asyncio client: connect, greet, read, heartbeat, reconnect.

The asyncio twin of ``dmq_client.connection.ServerConnection``, with a task where that one
has a thread. Its task connects (TLS when configured: the handshake is asyncio's), sends the
magic and, with a secret, ``UP_AUTH`` right after it, and is ready once ``SERVER_HEALTH``
(and ``AUTH_ACK``) came back; then it reads frames until the connection fails and starts
over after a backoff (doubling from ``reconnect_backoff`` to ``reconnect_backoff_max``, with
jitter so a fleet of clients does not reconnect in step). A second task sends
``UP_HEARTBEAT`` when nothing was written for a while and drops a connection on which the
server has been silent for two of its heartbeat intervals (a frozen or partitioned server
looks exactly like that).

**Writes of one loop turn go together.** ``write`` keeps the bytes and the first write of a
turn asks the loop (``call_soon``) to hand them to the transport as one ``bytes`` when the
turn's other callbacks ran: a window of concurrent sends (each task writing its frame in
the same turn, as the answers of one read wake them) costs one ``send`` system call, not
one each (it was the largest single cost of the asyncio client's publish,
bench/client_publish.py). Bytes kept for a connection that is lost before the turn ends
are dropped, as bytes written to it would have been; they are never written to the next
connection (the owner moves what was unanswered: ``link_lost``).

The link interprets only the frames about itself (greeting, health, reboot, heartbeat,
protocol error); every other frame goes to its owner (``LinkOwner``), in the order read, on
the event loop. Bytes become frames through ``dmq_client.wire``'s ``FrameDecoder`` and frames
bytes through its ``encode``: the client has no protocol code of its own.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import ssl
import time
from typing import Protocol

from ..config import MqConfig, parse_server
from ..tls import client_context
from ..wire import MAGIC, Command, Frame, FrameDecoder, FrameError, encode, features

__all__ = ["LinkOwner", "LinkState", "ServerLink"]

log = logging.getLogger(__name__)

#: seconds close() waits for the socket to close (a TLS goodbye) before cutting it
CLOSE_WAIT = 1.0
_HEARTBEAT = encode(Frame(Command.UP_HEARTBEAT))
_OWN = frozenset({Command.SERVER_HEARTBEAT, Command.SERVER_HEALTH, Command.SERVER_REBOOT, Command.PROTOCOL_ERROR})


class LinkState(enum.Enum):
    DOWN = "down"
    """Not connected (connecting, or waiting to reconnect)."""
    READY = "ready"
    """Greeted with SERVER_HEALTH OK: sends are routed here."""
    UNHEALTHY = "unhealthy"
    """Connected, but the server reports failing storage: used only when no server is READY."""
    REBOOTING = "rebooting"
    """SERVER_REBOOT received: no new sends; replies still arrive until the server closes."""
    CLOSED = "closed"


class LinkOwner(Protocol):
    """What a link tells the client (every call on the event loop, none may block)."""

    def link_ready(self, link: "ServerLink") -> None: ...
    def link_frames(self, link: "ServerLink", frames: list[Frame]) -> None: ...
    def link_leaving(self, link: "ServerLink") -> None: ...
    def link_lost(self, link: "ServerLink", reason: str) -> None: ...


class _Lost(Exception):
    """The connection is unusable; the message says why."""


class ServerLink:
    """One configured server, connected and reconnected for the life of the client.

    ``generation`` counts the connections made: a pushed message remembers the one it came
    on, and an ack or requeue for an older one is not written (the server gave that copy
    back when the connection closed)."""

    def __init__(self, name: str, config: MqConfig, owner: LinkOwner):
        self.name = name
        self.host, self.port = parse_server(name)
        self.config = config
        self.owner = owner
        self.state = LinkState.DOWN
        self.generation = 0
        self.features: frozenset[str] = frozenset()
        self.server_interval: float | None = None  # from SERVER_HEARTBEAT
        self.last_error = ""
        self._closed = False
        self._dropped = ""  # why the heartbeat task dropped the connection
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_read = 0.0
        self._last_write = 0.0
        # this turn's bytes, for the connection ``_writer`` was when they were written
        self._out: list[bytes] = []
        self._out_for: asyncio.StreamWriter | None = None
        self._decoder = FrameDecoder()
        self._context: ssl.SSLContext | None = None
        if config.tls:
            self._context = client_context(config.tls_ca_file, config.tls_cert_file, config.tls_key_file)

    def __repr__(self) -> str:
        return f"<ServerLink {self.name} {self.state.value}>"

    @property
    def routable(self) -> bool:
        return self.state in (LinkState.READY, LinkState.UNHEALTHY)

    @property
    def connected(self) -> bool:
        return self._writer is not None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"dmq-link-{self.name}")

    async def close(self) -> None:
        """End the connection for good: the socket is closed when this returns (a TLS
        connection's goodbye gets a second; a peer that does not answer it is cut), so
        a loop closed next leaves no transport behind."""
        self._closed = True
        self.state = LinkState.CLOSED
        self._flush()  # what this turn wrote goes before the goodbye
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            try:
                async with asyncio.timeout(CLOSE_WAIT):
                    await writer.wait_closed()
            except (TimeoutError, OSError, ConnectionError, ssl.SSLError):
                writer.transport.abort()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def write(self, data: bytes) -> bool:
        """Queue ``data`` on the connection, written with the rest of this loop turn's
        bytes when the turn ends (see the module); False when there is no connection. A
        write to a connection that then fails is not an error here: the reader notices
        the loss and the owner moves what was unanswered (``link_lost``)."""
        writer = self._writer
        if writer is None or writer.is_closing():
            return False
        out = self._out
        if not out or self._out_for is not writer:
            if out:  # kept for a connection since replaced: never written to this one
                out.clear()
            self._out_for = writer
            asyncio.get_running_loop().call_soon(self._flush)
        out.append(data)
        return True

    def _flush(self) -> None:
        """Hand this turn's bytes to the connection they were written for, if it is still
        the link's (and open)."""
        out, writer = self._out, self._out_for
        if not out:
            return
        self._out, self._out_for = [], None
        if writer is not self._writer or writer is None or writer.is_closing():
            return
        writer.write(out[0] if len(out) == 1 else b"".join(out))
        self._last_write = time.monotonic()

    async def drain(self) -> None:
        """Wait while the server is not reading (TCP flow control); never raises: a
        failed connection is the reader's to report. This turn's bytes are handed to the
        connection first, so that the wait counts them."""
        self._flush()
        writer = self._writer
        if writer is not None:
            try:
                await writer.drain()
            except (ConnectionError, OSError, RuntimeError):
                pass

    def mark_unhealthy(self, detail: str) -> None:
        """A send was answered with a storage failure: prefer other servers until this one
        greets again with SERVER_HEALTH OK."""
        if self.state is LinkState.READY:
            self.state = LinkState.UNHEALTHY
            self.last_error = detail

    def mark_rebooting(self) -> None:
        if self.state in (LinkState.READY, LinkState.UNHEALTHY):
            self.state = LinkState.REBOOTING
            self.owner.link_leaving(self)

    # -- the connection's life ----------------------------------------------------
    async def _run(self) -> None:
        backoff = self.config.reconnect_backoff
        while not self._closed:
            try:
                # asyncio.timeout, not wait_for: wait_for of 3.11 can swallow a cancellation
                # that comes as the connection completes, and close() would wait for ever
                async with asyncio.timeout(self.config.connect_timeout):
                    reader, frames = await self._connect()
                backoff = self.config.reconnect_backoff
                reason = await self._serve(reader, frames)
            except TimeoutError:
                reason = "no SERVER_HEALTH greeting within connect_timeout"
            except (OSError, EOFError, _Lost, FrameError) as exc:
                reason = str(exc) or type(exc).__name__
            except Exception as exc:  # a bug must not end the reconnecting for the client's life
                log.exception("dmq server %s: connection failed", self.name)
                reason = f"{type(exc).__name__}: {exc}"
            finally:
                writer, self._writer = self._writer, None
                if writer is not None:
                    writer.close()
            if self._closed:
                break
            was = self.state
            self.state = LinkState.DOWN
            self.last_error = reason
            self.owner.link_lost(self, reason)
            if was is not LinkState.DOWN:
                log.info("dmq server %s: connection lost: %s", self.name, reason)
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, self.config.reconnect_backoff_max)

    async def _connect(self) -> tuple[asyncio.StreamReader, list[Frame]]:
        """Connect, send the magic (and UP_AUTH), and read up to the greeting; return the
        reader and the frames that came after the greeting in the same reads."""
        if self._context is not None:
            reader, writer = await asyncio.open_connection(
                self.host, self.port, ssl=self._context,
                server_hostname=self.config.tls_server_name or self.host,
            )
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        self._writer = writer
        self._decoder = FrameDecoder()
        greeting = MAGIC
        secret = self.config.auth_secret
        if secret is not None:
            greeting += encode(Frame(Command.UP_AUTH, body=secret.encode()))
        writer.write(greeting)
        health: Frame | None = None
        authed = secret is None
        while True:
            data = await reader.read(65536)
            if not data:
                raise _Lost("closed by the server during the greeting")
            frames = self._decoder.feed(data)
            for i, frame in enumerate(frames):
                if frame.command == Command.PROTOCOL_ERROR:
                    raise _Lost(f"refused by the server: {frame.status}")
                if frame.command == Command.AUTH_ACK:
                    authed = True
                elif frame.command == Command.SERVER_HEALTH:
                    health = frame
                else:
                    raise _Lost(f"unexpected {frame.command.name} before SERVER_HEALTH")
                if health is not None and authed:
                    self._greeted(health)
                    return reader, frames[i + 1:]

    def _greeted(self, health: Frame) -> None:
        if self._closed:
            raise _Lost("the client is closing")
        self.generation += 1
        self._dropped = ""
        self.server_interval = None
        self.features = features(health.body.decode("ascii", "replace"))
        now = time.monotonic()
        self._last_read = self._last_write = now
        self.state = LinkState.READY if health.status == "OK" else LinkState.UNHEALTHY
        self.last_error = "" if health.status == "OK" else health.status
        log.info("dmq server %s: connected (%s)", self.name, health.status)
        self.owner.link_ready(self)

    async def _serve(self, reader: asyncio.StreamReader, first: list[Frame]) -> str:
        beating = asyncio.get_running_loop().create_task(self._heartbeat(), name=f"dmq-heartbeat-{self.name}")
        try:
            if first:
                self._handle(first)
            while True:
                data = await reader.read(65536)
                if not data:
                    return self._dropped or "closed by the server"
                self._last_read = time.monotonic()
                self._handle(self._decoder.feed(data))
        finally:
            beating.cancel()

    def _handle(self, frames: list[Frame]) -> None:
        others = []
        for frame in frames:
            command = frame.command
            if command not in _OWN:
                others.append(frame)
                continue
            if others:  # keep the order: a reply before a reboot notice is handled before it
                self.owner.link_frames(self, others)
                others = []
            if command == Command.SERVER_HEARTBEAT:
                if frame.credit > 0:
                    self.server_interval = frame.credit / 1000.0
            elif command == Command.SERVER_HEALTH:
                if self.state in (LinkState.READY, LinkState.UNHEALTHY):
                    ok = frame.status == "OK"
                    self.state = LinkState.READY if ok else LinkState.UNHEALTHY
                    self.last_error = "" if ok else frame.status
                    if ok:
                        self.owner.link_ready(self)
            elif command == Command.SERVER_REBOOT:
                log.info("dmq server %s: shutting down (%s)", self.name, frame.status)
                self.mark_rebooting()
            elif command == Command.PROTOCOL_ERROR:
                raise _Lost(f"protocol error from the server: {frame.status}")
        if others:
            self.owner.link_frames(self, others)

    async def _heartbeat(self) -> None:
        """UP_HEARTBEAT when nothing was written for the interval (at most half the
        server's); drop the connection after two of the server's intervals of silence."""
        config = self.config
        while True:
            interval = config.heartbeat_interval
            silence = config.server_silence_timeout
            if self.server_interval is not None:
                interval = min(interval, self.server_interval / 2)
                silence = 2 * self.server_interval
            await asyncio.sleep(max(0.01, min(interval, silence) / 4))
            now = time.monotonic()
            writer = self._writer
            if writer is None:
                return
            if now - self._last_read > silence:
                self._dropped = f"the server was silent for {now - self._last_read:.1f}s"
                log.warning("dmq server %s: %s, dropping the connection", self.name, self._dropped)
                writer.transport.abort()
                return
            if now - self._last_write >= interval:
                self.write(_HEARTBEAT)
