"""Topic routing: which server connection a topic's messages are written to.

A topic goes to the same server while that server is usable (so one topic's
messages keep their order on one connection), chosen by rendezvous hashing:
each (server, topic) pair gets a stable score and the best-scoring usable
server wins. When a server goes away only its topics move, and they come back
when it does. ``READY`` servers are preferred; a server reporting unhealthy
storage is used only when no other is connected (it then answers
SERVER_ERROR, which at least says what is wrong). Disconnected and rebooting
servers are never chosen (DMQ: SERVER_REBOOT removes the server from routing,
SERVER_HEALTH restores it).

Servers are added and removed at run time, which is how registry discovery
will feed the same pool.
"""

from __future__ import annotations

import threading
import time
import zlib
from typing import Iterable, Iterator

from .connection import ConnState, ServerConnection

__all__ = ["ServerPool", "affinity"]


def affinity(topic: str, server: str) -> int:
    """The rendezvous score of ``server`` for ``topic``: the usable server with the highest
    wins the topic. Both clients use it, so a process running ``MqClient`` and the asyncio
    client sends one topic to the same server."""
    return zlib.crc32(topic.encode(), zlib.crc32(server.encode()))


class ServerPool:
    def __init__(self) -> None:
        self._conns: dict[str, ServerConnection] = {}
        self._cond = threading.Condition(threading.Lock())
        self._version = 0
        self._cache: dict[str, tuple[int, ServerConnection | None]] = {}
        self._closed = False

    def __iter__(self) -> Iterator[ServerConnection]:
        return iter(list(self._conns.values()))

    def __len__(self) -> int:
        return len(self._conns)

    def get(self, name: str) -> ServerConnection | None:
        return self._conns.get(name)

    def add(self, conn: ServerConnection) -> None:
        with self._cond:
            self._conns[conn.name] = conn
            self._changed()

    def remove(self, name: str) -> ServerConnection | None:
        with self._cond:
            conn = self._conns.pop(name, None)
            self._changed()
            return conn

    def changed(self) -> None:
        """A connection's state changed: forget cached routes, wake waiters."""
        with self._cond:
            self._changed()

    def close(self) -> None:
        """Wake every waiter for good (the client is closing)."""
        with self._cond:
            self._closed = True
            self._changed()

    def _changed(self) -> None:
        self._version += 1
        self._cond.notify_all()

    def pick(self, topic: str, exclude: Iterable[str] = ()) -> ServerConnection | None:
        """The server for ``topic`` now, or None if no server is usable."""
        if not exclude:
            cached = self._cache.get(topic)
            if cached is not None and cached[0] == self._version:
                conn = cached[1]
                if conn is not None and conn.state is ConnState.READY:
                    return conn
        version = self._version
        best = self._best(topic, ConnState.READY, exclude)
        if best is None:
            best = self._best(topic, ConnState.UNHEALTHY, exclude)
        if not exclude:
            if len(self._cache) > 10000:
                self._cache.clear()
            self._cache[topic] = (version, best)
        return best

    def _best(self, topic: str, state: ConnState, exclude: Iterable[str]) -> ServerConnection | None:
        best = None
        best_score = -1
        for conn in list(self._conns.values()):
            if conn.state is not state or conn.name in exclude:
                continue
            score = affinity(topic, conn.name)
            if score > best_score:
                best, best_score = conn, score
        return best

    def wait_pick(
        self, topic: str, timeout: float, stop: threading.Event | None = None
    ) -> ServerConnection | None:
        """``pick``, waiting up to ``timeout`` for a usable server to appear."""
        conn = self.pick(topic)
        if conn is not None or timeout <= 0:
            return conn
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                conn = self.pick(topic)
                if conn is not None or self._closed or (stop is not None and stop.is_set()):
                    return conn
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(min(remaining, 0.5))

    def wait_connected(self, timeout: float) -> bool:
        """True once any server is READY (or False after ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(c.state is ConnState.READY for c in self._conns.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._cond.wait(min(remaining, 0.5))
            return True
