"""One server connection: a reader thread, locked writes, heartbeats, reconnects.

Each configured server gets one ``ServerConnection`` for the life of the
client. Its thread connects, sends the magic, waits for the server's
``SERVER_HEALTH`` greeting, then reads frames until the connection fails, and
starts over after a backoff (doubling from ``reconnect_backoff`` up to
``reconnect_backoff_max``, with jitter so a fleet of clients does not
reconnect in step). The same thread sends ``UP_HEARTBEAT`` when nothing was
written for a while and drops a connection on which the server has been
silent for two of its heartbeat intervals (a frozen or partitioned server
looks exactly like that).

Any thread may ``write``; writes are serialised by a lock and a failed write
shuts the socket, so the reader notices and reports the loss once. The
connection interprets only the frames about itself (greeting, health,
reboot, heartbeat, protocol error); replies and pushes go to the listener,
on this thread, which must therefore never block.

With ``tls`` the socket is wrapped (``dmq_client.tls.TlsSocket``) and the handshake
done before the magic; with ``auth_secret`` an ``UP_AUTH`` follows the magic and the
connection is ready only once ``AUTH_ACK`` came back with the greeting (a refusal is a
``PROTOCOL_ERROR``: logged, and the connection tried again after its backoff).
"""

from __future__ import annotations

import enum
import json
import logging
import random
import selectors
import socket
import ssl
import threading
import time
from typing import Callable, Protocol

from .config import MqConfig
from .tls import TlsSocket, client_context
from .wire import MAGIC, Command, Frame, FrameDecoder, FrameError, encode, features

__all__ = ["ConnState", "ConnectionListener", "ConnectionUnavailable", "ServerConnection"]

#: what a session reads and writes: the TCP socket, or the TLS layer over it
Stream = socket.socket | TlsSocket

log = logging.getLogger(__name__)


class ConnState(enum.Enum):
    DISCONNECTED = "disconnected"
    CONNECTING = "connecting"
    READY = "ready"
    """Greeted with SERVER_HEALTH OK: sends are routed here."""
    UNHEALTHY = "unhealthy"
    """Connected, but the server reports failing storage: used only as a last resort."""
    REBOOTING = "rebooting"
    """SERVER_REBOOT received: no new sends; replies still arrive until it closes."""
    CLOSED = "closed"


#: Seconds a server marked unhealthy because of a storage-error reply is avoided.
UNHEALTHY_PROBATION = 5.0


class ConnectionUnavailable(Exception):
    """The connection cannot take a write now (not connected, or the write failed)."""


class ConnectionListener(Protocol):
    def connection_ready(self, conn: "ServerConnection") -> None: ...
    def frames_received(self, conn: "ServerConnection", frames: list[Frame]) -> None: ...
    def connection_lost(self, conn: "ServerConnection", reason: str) -> None: ...
    def state_changed(self, conn: "ServerConnection") -> None: ...


_HEARTBEAT = encode(Frame(Command.UP_HEARTBEAT))
_OWN_FRAMES = frozenset(
    {Command.SERVER_HEARTBEAT, Command.SERVER_HEALTH, Command.SERVER_REBOOT, Command.PROTOCOL_ERROR}
)


class _Lost(Exception):
    """The current socket is finished; the message says why."""


class ServerConnection:
    def __init__(
        self,
        address: tuple[str, int],
        config: MqConfig,
        listener: ConnectionListener,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.address = address
        self.name = f"{address[0]}:{address[1]}"
        self.config = config
        self.listener = listener
        self.clock = clock
        self.state = ConnState.DISCONNECTED
        self.generation = 0  # bumped per established connection
        self.server_interval: float | None = None  # from SERVER_HEARTBEAT
        self.health_detail = ""
        self.identity: dict[str, object] | None = None  # the server's AUTH_ACK (identity, permission_count)
        # what this server accepts beyond version 1's first set, as its SERVER_HEALTH
        # greeting and SUBSCRIBE_ACK listed them (wire.features); none until then, on each connection
        self.features: frozenset[str] = frozenset()
        self._tls_context = (
            client_context(config.tls_ca_file, config.tls_cert_file, config.tls_key_file) if config.tls else None
        )
        self._sock: Stream | None = None
        self._write_lock = threading.Lock()
        self._closing = threading.Event()
        self._last_write = 0.0
        self._last_heard = 0.0
        self._failures = 0
        self._probation_until = 0.0  # see mark_unhealthy
        self.first_attempt = threading.Event()  # set once the first connect attempt is decided
        self._thread = threading.Thread(target=self._run, name=f"dmq-conn-{self.name}", daemon=True)

    def __repr__(self) -> str:
        return f"ServerConnection({self.name}, {self.state.value})"

    @property
    def routable(self) -> bool:
        return self.state is ConnState.READY

    @property
    def connected(self) -> bool:
        return self.state in (ConnState.READY, ConnState.UNHEALTHY, ConnState.REBOOTING)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Stop reconnecting, shut the socket, wait for the reader to end."""
        self._closing.set()
        sock = self._sock
        if sock is not None:
            _shutdown(sock)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._set_state(ConnState.CLOSED)
        self.first_attempt.set()

    # -- writing ------------------------------------------------------------
    def write(self, data: bytes) -> None:
        """Write bytes, whole, or raise ConnectionUnavailable (the socket is then shut)."""
        with self._write_lock:
            sock = self._sock
            if sock is None:
                raise ConnectionUnavailable(f"{self.name} is not connected")
            try:
                sock.sendall(data)
            except OSError as exc:
                _shutdown(sock)
                raise ConnectionUnavailable(f"write to {self.name} failed: {exc}") from exc
            self._last_write = self.clock()

    # -- the reader thread ----------------------------------------------------
    def _run(self) -> None:
        while not self._closing.is_set():
            self._set_state(ConnState.CONNECTING)
            reason = self._session()
            self.first_attempt.set()
            if self._closing.is_set():
                break
            self._set_state(ConnState.DISCONNECTED)
            self._failures += 1
            delay = min(
                self.config.reconnect_backoff_max,
                self.config.reconnect_backoff * 2 ** min(self._failures - 1, 30),
            ) * random.uniform(0.5, 1.0)
            level = logging.WARNING if self._failures == 1 else logging.DEBUG
            log.log(level, "dmq server %s: %s; reconnecting in %.2fs", self.name, reason, delay)
            self._closing.wait(delay)
        self._set_state(ConnState.CLOSED)

    def _session(self) -> str:
        """Connect, greet, read until the connection ends; the reason it ended."""
        sock: Stream
        try:
            sock = socket.create_connection(self.address, timeout=self.config.connect_timeout)
        except OSError as exc:
            return f"connect failed: {exc}"
        was_ready = False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls_context is not None:
                tls = TlsSocket(sock, self._tls_context, self.config.tls_server_name or self.address[0])
                tls.handshake(self.config.connect_timeout)
                sock = tls
            decoder = FrameDecoder()
            pending = self._handshake(sock, decoder)
            sock.settimeout(self.config.write_timeout)
            now = self.clock()
            self._last_heard = self._last_write = now
            self.server_interval = None
            self.features = frozenset()  # maybe another server now: it says again
            self._probation_until = 0.0
            with self._write_lock:
                self._sock = sock
            if self._closing.is_set():  # close() ran before _sock was published
                return "closed"
            self.generation += 1
            self._failures = 0
            was_ready = True
            log.info("dmq server %s: connected", self.name)
            self._handle(pending)  # the greeting first: it sets READY or UNHEALTHY
            self.listener.connection_ready(self)
            self.first_attempt.set()
            self._read_loop(sock, decoder)
            return "closed"
        except _Lost as exc:
            return str(exc)
        except FrameError as exc:
            return f"undecodable data from the server: {exc}"
        except ssl.SSLError as exc:
            return f"TLS failed: {exc}"
        except OSError as exc:
            return f"socket error: {exc}"
        except Exception as exc:  # a bug in frame handling must not end reconnecting for good
            log.exception("dmq server %s: internal error in the reader", self.name)
            return f"internal error: {exc!r}"
        finally:
            with self._write_lock:
                self._sock = None
            _shutdown(sock)
            sock.close()
            if was_ready:
                self._set_state(ConnState.DISCONNECTED)
                self.listener.connection_lost(self, "connection lost")

    def _handshake(self, sock: Stream, decoder: FrameDecoder) -> list[Frame]:
        """Send the magic (and UP_AUTH); return the frames up to and including
        SERVER_HEALTH, once AUTH_ACK came too when a secret is configured."""
        deadline = self.clock() + self.config.connect_timeout
        secret = self.config.auth_secret
        greeting = MAGIC
        if secret is not None:
            greeting += encode(Frame(Command.UP_AUTH, body=secret.encode()))
        sock.sendall(greeting)
        frames: list[Frame] = []
        healthy, authed = False, secret is None
        while True:
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise _Lost("no SERVER_HEALTH greeting within connect_timeout")
            sock.settimeout(remaining)
            try:
                data = sock.recv(65536)
            except socket.timeout:
                continue
            if not data:
                raise _Lost("closed by the server during the greeting")
            for frame in decoder.feed(data):
                if frame.command == Command.PROTOCOL_ERROR:
                    raise _Lost(f"refused by the server: {frame.status}")
                if frame.command == Command.AUTH_ACK:
                    authed = True
                    self.identity = json.loads(frame.status or "{}")
                    log.info("dmq server %s: authenticated as %r", self.name, self.identity.get("identity"))
                    continue
                if frame.command == Command.SERVER_HEALTH:
                    healthy = True
                elif not healthy:
                    raise _Lost(f"unexpected {frame.command.name} before SERVER_HEALTH")
                frames.append(frame)
            if healthy and authed:
                return frames

    def _read_loop(self, sock: Stream, decoder: FrameDecoder) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            while not self._closing.is_set():
                now = self.clock()
                interval = self.server_interval
                beat = self.config.heartbeat_interval
                silence = self.config.server_silence_timeout
                if interval is not None:
                    beat = min(beat, interval / 2)
                    silence = 2 * interval
                if now - self._last_write >= beat:
                    self._heartbeat()
                if now - self._last_heard > silence:
                    raise _Lost(f"server silent for {now - self._last_heard:.1f}s")
                if self._probation_until and time.monotonic() >= self._probation_until:
                    self._probation_until = 0.0
                    if self.state is ConnState.UNHEALTHY:
                        self._set_state(ConnState.READY)
                tick = max(0.01, min(1.0, beat / 2, silence / 4))
                if not selector.select(tick):
                    continue
                data = sock.recv(262144)
                if not data:
                    raise _Lost("closed by the server")
                self._last_heard = self.clock()
                frames = decoder.feed(data)
                if frames:
                    self._handle(frames)

    def _heartbeat(self) -> None:
        """UP_HEARTBEAT, unless another thread is writing (which keeps the server
        informed anyway). Never waits for the write lock: this thread must keep
        reading, or a writer blocked on a full socket could wait for it forever."""
        if not self._write_lock.acquire(blocking=False):
            return
        try:
            sock = self._sock
            if sock is None:
                raise _Lost("not connected")
            try:
                sock.sendall(_HEARTBEAT)
            except OSError as exc:
                raise _Lost(f"heartbeat write failed: {exc}") from None
            self._last_write = self.clock()
        finally:
            self._write_lock.release()

    def _handle(self, frames: list[Frame]) -> None:
        others = None
        for frame in frames:
            command = frame.command
            if command not in _OWN_FRAMES:
                if others is None:
                    others = []
                others.append(frame)
                continue
            if command == Command.SERVER_HEARTBEAT:
                if frame.credit:
                    self.server_interval = frame.credit / 1000.0
            elif command == Command.SERVER_HEALTH:
                self._probation_until = 0.0  # the server's own word replaces a guess from a reply
                if frame.body:  # what it accepts beyond v1's first set (an old server: nothing)
                    self.features = self.features | features(frame.body.decode("ascii", "replace"))
                ok = frame.status in ("", "OK")
                self.health_detail = "" if ok else frame.status
                if not ok:
                    log.warning("dmq server %s reports unhealthy storage: %s", self.name, frame.status)
                self._set_state(ConnState.READY if ok else ConnState.UNHEALTHY)
            elif command == Command.SERVER_REBOOT:
                log.info("dmq server %s is restarting (%s): routing elsewhere", self.name, frame.status)
                self._set_state(ConnState.REBOOTING)
            else:  # PROTOCOL_ERROR: the server closes the connection after it
                if others:
                    self.listener.frames_received(self, others)
                raise _Lost(f"protocol error from the server: {frame.status}")
        if others:
            self.listener.frames_received(self, others)

    def mark_unhealthy(self, detail: str) -> None:
        """A reply said storage failed: prefer other servers for a while.

        The server announces recovery with SERVER_HEALTH only when its own
        health flag flipped, which a single failed batch may not do; so a mark
        made from a reply lapses after ``UNHEALTHY_PROBATION`` seconds, and the
        next failure, if any, renews it.
        """
        if self.state is ConnState.READY:
            self.health_detail = detail
            self._probation_until = time.monotonic() + UNHEALTHY_PROBATION
            self._set_state(ConnState.UNHEALTHY)

    def mark_rebooting(self) -> None:
        """A reply said the server is shutting down (E_SHUTTING_DOWN)."""
        if self.state in (ConnState.READY, ConnState.UNHEALTHY):
            self._set_state(ConnState.REBOOTING)

    def _set_state(self, state: ConnState) -> None:
        if self.state is ConnState.CLOSED:
            return
        if state is not self.state:
            self.state = state
            self.listener.state_changed(self)


def _shutdown(sock: Stream) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
