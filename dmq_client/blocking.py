"""A small blocking dmq client for scripts, tests, the admin CLI and benchmarks.

One socket, no threads: calls write frames and read until the awaited reply
arrives, keeping pushes that arrive meanwhile for ``receive``. The full,
thread-safe client with resend and notify queues is ``dmq_client.MqClient``;
both drive the same sans-IO codec.

``tls=True`` (with ``ca_file``, ``cert_file``, ``key_file``) connects to a server's TLS
port; ``auth_secret`` authenticates right after the magic (``identity`` then holds the
server's answer; a refusal raises ``ClientError``).
"""

from __future__ import annotations

import itertools
import json
import socket
import time
from collections import deque
from typing import Callable, Iterable

from .confirm import confirm_deadline_ms
from .session import default_producer_id
from .tls import TlsSocket, client_context
from .wire import (
    FEATURE_CONFIRM,
    FEATURE_PROPS,
    MAGIC,
    NO_PROPERTIES,
    SEND_REPLIES,
    SUBSCRIBE_REPLIES,
    Command,
    Frame,
    FrameDecoder,
    Properties,
    encode,
    encode_properties,
    features,
    pack_ids,
)

__all__ = ["BlockingClient", "ClientError"]


class ClientError(Exception):
    """The connection failed, timed out or the server sent a PROTOCOL_ERROR."""


class BlockingClient:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 4150,
        *,
        producer: str | None = None,
        timeout: float = 10.0,
        tls: bool = False,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        server_name: str | None = None,
        auth_secret: str | None = None,
    ):
        # a new id per client, as MqClient's: id(self) is reused once an earlier client is
        # collected, and a long host name made the old form exceed the server's 64 characters
        self.producer = producer or default_producer_id()
        self.timeout = timeout
        self.identity: dict[str, object] | None = None
        self._decoder = FrameDecoder()
        self._pushes: deque[Frame] = deque()
        self._replies: deque[Frame] = deque()
        self._other: deque[Frame] = deque()
        # SEND_CONSUMED_ACKs by session id, until ``wait_consumed`` takes them
        self._consumed: dict[int, Frame] = {}
        # what the server accepts beyond v1's first set (SERVER_HEALTH's body); None before its greeting
        self.features: frozenset[str] | None = None
        self._sessions = itertools.count(int(time.time() * 1000) << 16)
        sock = socket.create_connection((host, port), timeout=timeout)
        self._sock: socket.socket | TlsSocket = sock
        # the socket is ours from here: a reset during the magic, the handshake or AUTH
        # must not leave it open for the garbage collector (the caller never got a client)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls:
                self._sock = TlsSocket(sock, client_context(ca_file, cert_file, key_file), server_name or host)
                try:
                    self._sock.handshake(timeout)
                except (OSError, ValueError) as exc:
                    raise ClientError(f"TLS handshake failed: {exc}") from exc
            self._sock.sendall(MAGIC)
            if auth_secret is not None:
                self.authenticate(auth_secret)
        except BaseException:
            sock.close()
            raise

    def authenticate(self, secret: str, timeout: float | None = None) -> dict[str, object]:
        """UP_AUTH; the server's answer (identity, identity_url, permission_count)."""
        self.write(Frame(Command.UP_AUTH, body=secret.encode()))
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            for i, frame in enumerate(self._other):
                if frame.command == Command.AUTH_ACK:
                    del self._other[i]
                    self.identity = json.loads(frame.status or "{}")
                    return self.identity
                if frame.command == Command.PROTOCOL_ERROR:
                    raise ClientError(f"server closed the connection: {frame.status}")
            if not self._read_more(deadline):
                raise ClientError("timed out waiting for AUTH_ACK")

    # -- plumbing ---------------------------------------------------------
    def write(self, *frames: Frame) -> None:
        try:
            self._sock.sendall(b"".join(encode(f) for f in frames))
        except OSError as exc:
            raise ClientError(f"send failed: {exc}") from exc

    def write_raw(self, data: bytes) -> None:
        self._sock.sendall(data)

    def _read_more(self, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._sock.settimeout(remaining)
        try:
            data = self._sock.recv(1 << 16)
        except socket.timeout:
            return False
        except OSError as exc:
            raise ClientError(f"receive failed: {exc}") from exc
        if not data:
            raise ClientError("connection closed by server")
        for frame in self._decoder.feed(data):
            if frame.command == Command.CONSUMER_PUSH:
                self._pushes.append(frame)
            elif frame.command in SEND_REPLIES or frame.command in SUBSCRIBE_REPLIES:
                self._replies.append(frame)
            elif frame.command == Command.SEND_CONSUMED_ACK:
                self._consumed[frame.session_id] = frame
            else:
                if frame.command == Command.SERVER_HEALTH:
                    self.features = (self.features or frozenset()) | features(frame.body.decode("ascii", "replace"))
                self._other.append(frame)
        return True

    def next_frame(self, timeout: float | None = None) -> Frame | None:
        """The next non-push, non-reply frame (heartbeat, health, reboot, error)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not self._other:
            if not self._read_more(deadline):
                return None
        return self._other.popleft()

    def _await_reply(self, match: Callable[[Frame], bool], timeout: float | None) -> Frame:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            for i, frame in enumerate(self._replies):
                if match(frame):
                    del self._replies[i]
                    return frame
            for frame in self._other:
                if frame.command == Command.PROTOCOL_ERROR:
                    raise ClientError(f"server closed the connection: {frame.status}")
            if not self._read_more(deadline):
                raise ClientError("timed out waiting for the server's reply")

    # -- producing --------------------------------------------------------
    def next_session_id(self) -> int:
        return next(self._sessions)

    def send_frame(self, topic: str, body: bytes, session_id: int | None = None, *, resend: bool = False,
                   confirm_ms: int = 0, properties: Properties = NO_PROPERTIES) -> Frame:
        """The frame of one send (``properties`` checked and written into its status:
        ``PropertiesError`` names a broken rule)."""
        return Frame(
            Command.UP_PRODUCER_RESEND if resend else Command.UP_PRODUCER_SEND,
            session_id=self.next_session_id() if session_id is None else session_id,
            topic=topic,
            producer=self.producer,
            timestamp_ms=int(time.time() * 1000),
            credit=confirm_ms,
            status=encode_properties(properties),
            body=body,
        )

    def server_features(self, timeout: float | None = None) -> frozenset[str]:
        """What the server listed in its SERVER_HEALTH greeting (read until it came)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while self.features is None:
            if not self._read_more(deadline):
                raise ClientError("timed out waiting for the server's SERVER_HEALTH greeting")
        return self.features

    def wait_consumed(self, session_id: int, timeout: float | None = None) -> Frame:
        """The SEND_CONSUMED_ACK of the send ``session_id`` asked to confirm (``send``'s
        ``confirm_timeout``); its status reads with ``dmq_client.wire.parse_consumed``."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while session_id not in self._consumed:
            for frame in self._other:
                if frame.command == Command.PROTOCOL_ERROR:
                    raise ClientError(f"server closed the connection: {frame.status}")
            if not self._read_more(deadline):
                raise ClientError(f"timed out waiting for SEND_CONSUMED_ACK of session {session_id}")
        return self._consumed.pop(session_id)

    def send(
        self,
        topic: str,
        body: bytes,
        session_id: int | None = None,
        *,
        resend: bool = False,
        timeout: float | None = None,
        confirm_timeout: float | None = None,
        key: str | None = None,
        priority: int = 0,
        headers: dict[str, str] | None = None,
    ) -> Frame:
        """Send one message and wait for its reply frame (any SEND_* command).

        ``confirm_timeout`` (seconds): also ask the server to report, within that time,
        when every channel is done with the message; ``wait_consumed(reply.session_id)``
        then returns its SEND_CONSUMED_ACK. Refused with ``ClientError`` (nothing sent)
        by a server whose greeting does not list CONFIRM. ``key``, ``priority`` and
        ``headers``: the message's properties (``dmq_client.wire.properties``; a broken
        rule raises ``PropertiesError``), refused the same way by a server that does not
        list PROPS; a push's read with ``ReceivedMessage.properties_of(frame.status)``."""
        properties = NO_PROPERTIES
        if key is not None or priority or headers:
            properties = Properties(key, priority, headers or {})
            properties.check()
            if FEATURE_PROPS not in self.server_features(timeout):
                raise ClientError(f"the server does not keep a message's key, priority or headers: its SERVER_HEALTH "
                                  f"does not list {FEATURE_PROPS} "
                                  f"(features: {' '.join(sorted(self.features or ())) or 'none'})")
        confirm_ms = 0
        if confirm_timeout is not None:
            confirm_ms = confirm_deadline_ms("consumed", confirm_timeout)
            if FEATURE_CONFIRM not in self.server_features(timeout):
                raise ClientError(f"the server cannot confirm consumption: its SERVER_HEALTH does not list "
                                  f"{FEATURE_CONFIRM} (features: {' '.join(sorted(self.features or ())) or 'none'})")
        frame = self.send_frame(topic, body, session_id, resend=resend, confirm_ms=confirm_ms, properties=properties)
        self.write(frame)
        return self._await_reply(
            lambda f: f.command in SEND_REPLIES and f.session_id == frame.session_id, timeout
        )

    def send_many(self, topic: str, bodies: Iterable[bytes], window: int = 256) -> list[Frame]:
        """Pipelined sends with at most ``window`` unanswered; replies in send order."""
        pending: dict[int, int] = {}
        replies: list[Frame | None] = []
        for body in bodies:
            while len(pending) >= window:
                self._collect(pending, replies)
            frame = self.send_frame(topic, body)
            pending[frame.session_id] = len(replies)
            replies.append(None)
            self.write(frame)
        while pending:
            self._collect(pending, replies)
        return [reply for reply in replies if reply is not None]  # every one is filled by now

    def next_send_reply(self, timeout: float | None = None) -> Frame:
        """The next SEND_* reply, whichever send it answers (for callers that pipeline
        sends themselves and match replies by session id)."""
        return self._await_reply(lambda f: f.command in SEND_REPLIES, timeout)

    def _collect(self, pending: dict[int, int], replies: list[Frame | None]) -> None:
        reply = self._await_reply(lambda f: f.command in SEND_REPLIES and f.session_id in pending, None)
        replies[pending.pop(reply.session_id)] = reply

    # -- consuming --------------------------------------------------------
    def subscribe(self, topic: str, channel: str, credit: int = 0, timeout: float | None = None) -> Frame:
        sid = self.next_session_id()
        self.write(Frame(Command.UP_SUBSCRIBE, session_id=sid, topic=topic, channel=channel, credit=credit))
        return self._await_reply(
            lambda f: f.command in SUBSCRIBE_REPLIES and f.session_id == sid, timeout
        )

    def credit(self, topic: str, channel: str, credit: int) -> None:
        self.write(Frame(Command.UP_CREDIT, topic=topic, channel=channel, credit=credit))

    def receive(self, timeout: float | None = None) -> Frame | None:
        """The next pushed message, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not self._pushes:
            if not self._read_more(deadline):
                return None
        return self._pushes.popleft()

    def ack(self, push: Frame) -> None:
        self.write(
            Frame(Command.UP_CONSUMER_ACK, topic=push.topic, channel=push.channel, message_id=push.message_id)
        )

    def ack_many(self, pushes: list[Frame]) -> None:
        """Acknowledge pushes in one UP_CONSUMER_ACKS frame per subscription."""
        ids: dict[tuple[str, str], list[int]] = {}
        for push in pushes:
            ids.setdefault((push.topic, push.channel), []).append(push.message_id)
        self.write(
            *(
                Frame(Command.UP_CONSUMER_ACKS, topic=topic, channel=channel, body=pack_ids(batch))
                for (topic, channel), batch in ids.items()
            )
        )

    def drain(self, timeout: float = 5.0) -> list[Frame]:
        """Read until the server closes the connection (or ``timeout``); every frame
        received and not yet consumed, in arrival order within each kind:
        replies, then pushes, then other frames."""
        deadline = time.monotonic() + timeout
        try:
            while self._read_more(deadline):
                pass
        except ClientError:
            pass  # closed by the server: what we wanted
        frames = list(self._replies) + list(self._pushes) + list(self._other) + list(self._consumed.values())
        self._consumed.clear()
        self._replies.clear()
        self._pushes.clear()
        self._other.clear()
        return frames

    def heartbeat(self) -> None:
        self.write(Frame(Command.UP_HEARTBEAT))

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "BlockingClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
