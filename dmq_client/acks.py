"""Acknowledgements on their way to the servers, sent in batches.

An ``UP_CONSUMER_ACK`` per message costs a write system call here and a frame decode
and dispatch at the server, for eight bytes of news. So acks wait here, grouped by
server and subscription, and go out as one ``UP_CONSUMER_ACKS`` frame per group
(``docs/protocol.md`` §4.13), one write per server. A server that did not list that
frame in its ``SUBSCRIBE_ACK`` (one older than it, §4.1) gets an ``UP_CONSUMER_ACK``
per id instead, still in one write: it would close the connection on a command it
does not know.

When they go is the consumer's choice (``dmq_client.consumer``): at once for an ack
made outside the handler threads, and from the handler threads when the receive
queue runs dry or ``max_ids`` wait. Whatever else is held goes at the latest
``max_wait`` seconds after it was made, from this module's own thread, so a slow
handler never holds back the acks of the messages handled before it.

An ack held here is not yet an ack: until it is written the server counts the copy in
flight and redelivers it after its timeout, as for an ack lost with its connection;
the dedup window answers such a redelivery with another ack.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

from .connection import ConnectionUnavailable
from .wire import FEATURE_ACKS, Command, Frame, FrameError, encode, pack_ids

__all__ = ["AckSender", "ack_frames"]

log = logging.getLogger(__name__)

#: What the server accepts in one frame is larger (codec.MAX_ACK_IDS); this keeps a
#: frame small and a batch short-lived.
MAX_IDS = 256
#: Seconds the oldest held ack may wait while handlers are still busy.
MAX_WAIT = 0.005

Key = tuple[str, str, str]  # server, topic, channel


def ack_frames(topic: str, channel: str, ids: list[int], batched: bool, max_ids: int = MAX_IDS) -> list[bytes]:
    """The frames acknowledging ``ids`` on one channel: ``UP_CONSUMER_ACKS`` of up to
    ``max_ids`` each, or (``batched`` False: the server did not list ``ACKS``) an
    ``UP_CONSUMER_ACK`` per id. Raises ``FrameError`` for a name or id the codec refuses.
    The asyncio client (``dmq_client.aio.subscribe``) writes the same frames."""
    if batched:
        return [
            encode(Frame(Command.UP_CONSUMER_ACKS, topic=topic, channel=channel,
                         body=pack_ids(ids[start : start + max_ids])))
            for start in range(0, len(ids), max_ids)
        ]
    return [encode(Frame(Command.UP_CONSUMER_ACK, topic=topic, channel=channel, message_id=mid)) for mid in ids]


class AckConnection(Protocol):
    """What the sender needs of a server's connection (``ServerConnection``): a
    ``write`` that raises ``ConnectionUnavailable`` when the connection is gone. Its
    ``features``, when it has them, say whether the server takes a batch frame."""

    def write(self, data: bytes) -> None: ...


class AckSender:
    """Held acks by (server, topic, channel). Thread-safe: handlers add, any thread
    flushes; ``start`` runs the thread that sends what waited ``max_wait``."""

    def __init__(self, connection_of: Callable[[str], AckConnection | None], clock: Callable[[], float],
                 max_ids: int = MAX_IDS, max_wait: float = MAX_WAIT):
        """``connection_of(server)`` is the live connection to a server (or None);
        ``clock`` (monotonic seconds) dates the oldest held ack."""
        self._connection_of = connection_of
        self._clock = clock
        self.max_ids = max_ids
        self.max_wait = max_wait
        self._cond = threading.Condition()
        self._held: dict[Key, list[int]] = {}
        self._count = 0
        self._since = 0.0  # when the oldest held ack was added
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.frames_sent = 0

    def __len__(self) -> int:
        return self._count

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dmq-acks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Send what is held and end the thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(5.0)
        self.flush()

    def add(self, server: str, topic: str, channel: str, message_id: int) -> None:
        with self._cond:
            if not self._count:
                self._since = self._clock()
                self._cond.notify()
            self._held.setdefault((server, topic, channel), []).append(message_id)
            self._count += 1

    def full(self) -> bool:
        return self._count >= self.max_ids

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not self._count:
                    self._cond.wait()
                if self._stopped:
                    return
                wait = self._since + self.max_wait - self._clock()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
            self.flush()

    def flush(self) -> int:
        """Write every held ack; returns how many were written. One not written (its
        server's connection is gone) is dropped: the server redelivers that copy."""
        with self._cond:
            if not self._count:
                return 0
            held, self._held, self._count = self._held, {}, 0
        by_server: dict[str, list[tuple[str, str, list[int]]]] = {}
        for (server, topic, channel), ids in held.items():
            by_server.setdefault(server, []).append((topic, channel, ids))
        written = 0
        for server, groups in by_server.items():
            conn = self._connection_of(server)
            try:
                if conn is None:
                    raise ConnectionUnavailable(f"{server} is not in the pool")
                # a server that did not list the batch frame (an older one) gets a frame per ack
                batched = FEATURE_ACKS in getattr(conn, "features", ())
                encoded, count = self._encode(server, groups, batched)
                if encoded:
                    conn.write(b"".join(encoded))
            except ConnectionUnavailable as exc:
                log.debug("acks to %s not sent (%s); the server will redeliver those copies", server, exc)
                continue
            self.frames_sent += len(encoded)
            written += count
        return written

    def _encode(self, server: str, groups: list[tuple[str, str, list[int]]], batched: bool) -> tuple[list[bytes], int]:
        """The frames for one server's held acks, and how many acks they carry."""
        encoded: list[bytes] = []
        count = 0
        for topic, channel, ids in groups:
            try:
                frames = ack_frames(topic, channel, ids, batched, self.max_ids)
            except FrameError as exc:  # not from a decoded push; never kills a handler thread
                log.error("acks for %s/%s on %s not sent: %s", topic, channel, server, exc)
                continue
            encoded += frames
            count += len(ids)
        return encoded, count
