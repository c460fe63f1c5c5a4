"""Message ids: nsqd's 64-bit snowflake, shown as 16 lowercase hex characters.

``id = ((ts - twepoch) << 22) | (node_id << 12) | sequence`` where ``ts`` is the
time in nanoseconds shifted right by 20 (about a millisecond), ``node_id`` has 10
bits and ``sequence`` 12 (nsqd ``guid.go``). nsqd sleeps a millisecond when the
sequence runs out and fails when the clock goes backwards; on the reactor we may
not sleep, so the factory borrows the next tick instead and never repeats an id.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Callable

__all__ = ["GuidFactory", "hex_id", "parse_hex_id", "default_node_id"]

TWEPOCH = 1288834974288
NODE_ID_BITS = 10
SEQUENCE_BITS = 12
NODE_ID_SHIFT = SEQUENCE_BITS
TIMESTAMP_SHIFT = SEQUENCE_BITS + NODE_ID_BITS
SEQUENCE_MASK = (1 << SEQUENCE_BITS) - 1
_HEX = frozenset(b"0123456789abcdefABCDEF")


def default_node_id(hostname: str) -> int:
    """nsqd's default ``--node-id``: ``crc32(md5(hostname)) % 1024``."""
    return zlib.crc32(hashlib.md5(hostname.encode()).digest()) % 1024


def hex_id(n: int) -> bytes:
    """The 16-character wire form of an int64 id."""
    return b"%016x" % (n & 0xFFFFFFFFFFFFFFFF)


def parse_hex_id(data: bytes) -> int | None:
    """The int64 behind a 16-character hex id, or None if it is not one."""
    if len(data) != 16 or not _HEX.issuperset(data):
        return None
    n = int(data, 16)
    return n - (1 << 64) if n >= 1 << 63 else n


class GuidFactory:
    """Unique, increasing int64 ids for one node."""

    def __init__(self, node_id: int, time_ns: Callable[[], int]):
        if not 0 <= node_id < 1 << NODE_ID_BITS:
            raise ValueError(f"node id {node_id} out of range 0-1023")
        self.node_id = node_id
        self._time_ns = time_ns
        self._last_ts = -1
        self._sequence = 0

    def new(self) -> int:
        ts = self._time_ns() >> 20
        if ts <= self._last_ts:
            # same tick, or the clock went back: stay on the last tick, borrow the next
            ts = self._last_ts
            self._sequence = (self._sequence + 1) & SEQUENCE_MASK
            if self._sequence == 0:
                ts += 1
        else:
            self._sequence = 0
        self._last_ts = ts
        return ((ts - TWEPOCH) << TIMESTAMP_SHIFT) | (self.node_id << NODE_ID_SHIFT) | self._sequence

    def new_hex(self) -> bytes:
        return hex_id(self.new())
