"""Fault injection and id counting for the tests of dmq's promise.

``PgProxy`` sits between dmq and PostgreSQL and can lose the answer to one statement
after PostgreSQL finished it (the commit happened; dmq hears only a broken
connection): the *unknown outcome* that a real network or a dying server produces
at random, made to happen exactly once, at a chosen message.

``ResendingProducer`` and ``CountingConsumer`` are the two ends of the count: every
id acknowledged to a producer, every id delivered to each channel. A producer does
what the client library does: a send answered with an error, or not answered before
its connection broke, is resent with the same (producer, session id) until it is
answered ``SEND_SUCCESS_ACK``.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections import deque

import psycopg

from dmq_client.blocking import BlockingClient, ClientError
from dmq_client.wire import Command
from dmq_server.core.nsq_wire import FRAME_RESPONSE, HEARTBEAT, MAGIC_V2, FrameReader, encode_command, mpub_body

__all__ = ["PgProxy", "ResendingProducer", "CountingConsumer"]

# PostgreSQL's ReadyForQuery with "idle" status: the statement finished, and in
# autocommit its transaction committed (or failed) before these bytes were sent.
_READY_IDLE = b"Z\x00\x00\x00\x05I"


class PgProxy:
    """A TCP proxy to PostgreSQL; ``dsn_for(dsn)`` routes a DSN through it."""

    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._marker: bytes | None = None
        self.replies_lost = 0
        self.lost = threading.Event()
        self._closed = False
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        threading.Thread(target=self._accept, daemon=True, name="pg-proxy").start()

    @classmethod
    def for_dsn(cls, dsn: str) -> "PgProxy":
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        return cls(str(info.get("host") or "127.0.0.1"), int(info.get("port") or 5432))

    def dsn_for(self, dsn: str) -> str:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        info.update(host="127.0.0.1", port=str(self.port), sslmode="disable")
        return psycopg.conninfo.make_conninfo(**info)

    def lose_reply_once(self, marker: bytes) -> None:
        """The next statement whose bytes contain ``marker`` runs to completion, then
        its connection is cut before dmq reads a byte of the answer."""
        with self._lock:
            self._marker = marker
            self.lost.clear()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for a, b in self._pairs:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            self._pairs.append((client, server))
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        doomed = False  # this connection carried the marked statement: swallow its answer
        answer = b""
        try:
            while True:
                readable, _, _ = select.select([client, server], [], [], 1.0)
                if self._closed:
                    return
                for sock in readable:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    if sock is client:
                        with self._lock:
                            if self._marker is not None and self._marker in data:
                                self._marker = None
                                doomed = True
                        server.sendall(data)
                    elif doomed:
                        answer = (answer + data)[-64:]
                        if _READY_IDLE in answer:
                            self.replies_lost += 1
                            self.lost.set()
                            return  # the statement is done; dmq never hears how
                    else:
                        client.sendall(data)
        except OSError:
            return
        finally:
            for sock in (client, server):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()


class _FaultProducer(threading.Thread):
    """A producer of a fault test: what it met is kept (errors, resends), and an exception
    is kept for the test to report, never swallowed."""

    def __init__(self, name: str, deadline: float):
        super().__init__(daemon=True, name=name)
        self.deadline = deadline
        self.errors: list[str] = []
        self.resends = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            self.failure = exc

    def _run(self) -> None:
        raise NotImplementedError


class ResendingProducer(_FaultProducer):
    """Sends ``bodies`` to ``topic`` with up to ``window`` unanswered, resending (same
    producer and session id, ``UP_PRODUCER_RESEND``) whatever was answered with an
    error or not answered before the connection broke, until every body is
    acknowledged or ``deadline`` (monotonic) passes. ``acked`` maps message id to body.
    ``burst``: the window is refilled only once empty, all of it in one write, so the
    server reads runs of sends (``Broker.publish_each``) rather than one at a time."""

    def __init__(self, port: int, topic: str, bodies: list[bytes], *, window: int = 32, deadline: float,
                 burst: bool = False):
        super().__init__(f"producer-{topic}", deadline)
        self.port = port
        self.topic = topic
        self.bodies = bodies
        self.window = window
        self.burst = burst
        self.producer = f"fault-test-{id(self):x}"
        self.acked: dict[int, bytes] = {}

    def _run(self) -> None:
        todo: deque[tuple[int, bytes, bool]] = deque(
            (sid, body, False) for sid, body in enumerate(self.bodies, start=1)
        )
        outstanding: dict[int, bytes] = {}
        client: BlockingClient | None = None
        while (todo or outstanding) and time.monotonic() < self.deadline:
            try:
                if client is None:
                    client = BlockingClient("127.0.0.1", self.port, producer=self.producer, timeout=5)
                frames = []
                while todo and len(outstanding) < self.window and not (self.burst and outstanding and not frames):
                    sid, body, resend = todo.popleft()
                    outstanding[sid] = body
                    frames.append(client.send_frame(self.topic, body, sid, resend=resend))
                if frames:
                    client.write(*frames)
                reply = client.next_send_reply(timeout=10)
            except (ClientError, OSError) as exc:
                self.errors.append(f"connection: {exc}")
                if client is not None:
                    client.close()
                client = None
                # unanswered: the outcome is unknown, so resend every one of them
                todo.extendleft((sid, body, True) for sid, body in reversed(list(outstanding.items())))
                self.resends += len(outstanding)
                outstanding.clear()
                time.sleep(0.1)  # a retry pause, as a client's; not synchronisation
                continue
            body = outstanding.pop(reply.session_id, None)
            if body is None:
                continue  # the answer to a copy already answered
            if reply.command == Command.SEND_SUCCESS_ACK:
                self.acked[reply.message_id] = body
            elif reply.command == Command.SEND_SERVER_ERROR:
                self.errors.append(reply.status)
                self.resends += 1
                todo.append((reply.session_id, body, True))
            else:
                raise AssertionError(f"unexpected reply {reply.command.name}: {reply.status}")
        if client is not None:
            client.close()


class NsqMpubProducer(_FaultProducer):
    """Publishes ``bodies`` to ``topic`` over NSQ, ``MPUB``s of ``batch`` bodies, one
    unanswered at a time, until each ``MPUB`` is answered ``OK`` or ``deadline``
    (monotonic) passes: one answered with an error, or unanswered when the connection
    broke, is sent again (NSQ has no ids: a retry of a commit whose answer was lost stores
    its bodies twice, as nsqd's would). ``acked``: the bodies of the ``MPUB``s answered OK."""

    def __init__(self, port: int, topic: str, bodies: list[bytes], *, batch: int = 50, deadline: float):
        super().__init__(f"nsq-mpub-{topic}", deadline)
        self.port = port
        self.topic = topic.encode()
        self.batches = [bodies[i:i + batch] for i in range(0, len(bodies), batch)]
        self.acked: list[bytes] = []

    def _run(self) -> None:
        sock: socket.socket | None = None
        reader, frames = FrameReader(), deque()
        while self.batches and time.monotonic() < self.deadline:
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                    sock.sendall(MAGIC_V2)
                    reader, frames = FrameReader(), deque()
                sock.sendall(encode_command(b"MPUB", self.topic, body=mpub_body(self.batches[0])))
                kind, data = self._answer(sock, reader, frames)
            except OSError as exc:
                self.errors.append(f"connection: {exc}")
                if sock is not None:
                    sock.close()
                sock = None
                self.resends += 1
                time.sleep(0.1)  # a retry pause, as a client's; not synchronisation
                continue
            if kind == FRAME_RESPONSE and data == b"OK":
                self.acked.extend(self.batches.pop(0))
            else:
                self.errors.append(data.decode("utf-8", "replace"))
                self.resends += 1
        if sock is not None:
            sock.close()

    @staticmethod
    def _answer(sock: socket.socket, reader: FrameReader, frames: deque) -> tuple[int, bytes]:
        """The next frame that is not a heartbeat (answered with NOP); frames read past it
        wait in ``frames`` for the next call."""
        while True:
            while frames:
                kind, frame = frames.popleft()
                if kind == FRAME_RESPONSE and frame == HEARTBEAT:
                    sock.sendall(b"NOP\n")
                    continue
                return kind, frame
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionError("closed by the server")
            frames.extend(reader.feed(data))


class CountingConsumer(threading.Thread):
    """Subscribes to ``channels`` of ``topic`` on one connection and acknowledges
    everything, recording each delivery per channel, until ``stop`` is set."""

    def __init__(self, port: int, topic: str, channels: list[str], *, credit: int = 500):
        super().__init__(daemon=True, name=f"consumer-{topic}")
        self.port = port
        self.topic = topic
        self.channels = channels
        self.credit = credit
        self.delivered: dict[str, dict[int, bytes]] = {c: {} for c in channels}
        self._lock = threading.Lock()
        self.subscribed = threading.Event()
        self.stop = threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with BlockingClient("127.0.0.1", self.port, timeout=10) as client:
                for channel in self.channels:
                    reply = client.subscribe(self.topic, channel, credit=self.credit)
                    assert reply.command == Command.SUBSCRIBE_ACK, reply
                self.subscribed.set()
                while not self.stop.is_set():
                    push = client.receive(timeout=0.2)
                    if push is None:
                        continue
                    with self._lock:
                        self.delivered[push.channel][push.message_id] = push.body
                    client.ack(push)
        except BaseException as exc:
            self.failure = exc
            self.subscribed.set()

    def missing_bodies(self, bodies: list[bytes]) -> dict[str, int]:
        """Per channel, how many of ``bodies`` were not delivered (yet): for publishers
        that learn no ids (NSQ's ``MPUB``)."""
        with self._lock:
            return {c: len(set(bodies) - set(got.values())) for c, got in self.delivered.items()}

    def missing(self, acked: dict[int, bytes]) -> dict[str, set[int]]:
        """Per channel, the acknowledged ids not delivered (yet)."""
        with self._lock:
            return {c: set(acked) - set(got) for c, got in self.delivered.items()}
