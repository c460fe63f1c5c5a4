"""Producer ids and session ids.

The server makes resends idempotent by ``(producer, session_id)``: a resend of
a pair it has stored is answered with the original message id. So a session
id must never repeat for a producer id, also not after the process restarts
with the same (stable) producer id, or a new message would be taken for an old
one and silently not stored.

Generated ids therefore come from the wall clock: ``milliseconds << 20`` plus a
counter, and never below the previous id. That gives 2**20 (about a million)
ids per millisecond before the sequence runs ahead of the clock, stays below
2**63 until the year 2248, and survives restarts without any state on disk.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import socket
import threading
import time
from typing import Callable

__all__ = ["SessionIdGenerator", "default_producer_id", "SESSION_ID_MAX"]

SESSION_ID_MAX = 2**63 - 1
_SHIFT = 20


class SessionIdGenerator:
    """Monotonic 64-bit session ids for one producer; thread-safe.

    ``wall_clock`` returns epoch seconds (injectable for tests).
    """

    def __init__(self, wall_clock: Callable[[], float] = time.time):
        self._wall_clock = wall_clock
        self._last = -1
        self._lock = threading.Lock()

    def __call__(self) -> int:
        floor = int(self._wall_clock() * 1000) << _SHIFT
        with self._lock:
            value = self._last + 1
            if value < floor:
                value = floor
            self._last = value
        return value

    @property
    def last(self) -> int:
        return self._last


_instances = itertools.count(1)  # producer ids made by this process so far


def default_producer_id() -> str:
    """``py-<host>-<pid>-<n>-<random>``: a new id for every producer instance.

    The server takes a send whose ``(producer, session_id)`` it has stored for a
    resend of that message, and session ids are only unique per generator. So
    two producers must never share an id: two clients in one process (same host
    and pid, and counters seeded from the same millisecond) would otherwise
    collide, and the second message of a pair would be answered as a duplicate
    of the first without being stored. ``n`` (a counter in this process) makes
    the id unique within the process, host and pid between the processes alive
    on a host, and 32 random bits against a recycled pid or a host name cut to
    32 characters. At most 64 characters, the server's limit.

    Each call returns a new id: a client takes one at construction and keeps it
    for its life. Set ``MqConfig.producer_id`` yourself (for example
    ``billing-api-3``, unique among the clients alive at a time) when the id
    should survive restarts; the producer journal stores the id it made.
    """
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:32] or "host"
    return f"py-{host}-{os.getpid()}-{next(_instances)}-{secrets.token_hex(4)}"
