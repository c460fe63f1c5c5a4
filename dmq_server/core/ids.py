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
_U64 = 0xFFFFFFFFFFFFFFFF
_SEQUENCE_HEX = [b"%03x" % n for n in range(1 << SEQUENCE_BITS)]


def default_node_id(hostname: str) -> int:
    """nsqd's default ``--node-id``: ``crc32(md5(hostname)) % 1024``."""
    return zlib.crc32(hashlib.md5(hostname.encode()).digest()) % 1024


def hex_id(n: int) -> bytes:
    """The 16-character wire form of an int64 id."""
    return b"%016x" % (n & _U64)


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

    def new_hex_many(self, count: int) -> list[bytes]:
        """``count`` ids in wire form, exactly what as many calls of ``new_hex`` would
        give, with one clock read: an NSQ ``MPUB`` of 100 spent a sixth of its CPU
        making its ids one by one.

        (tick, sequence) counts up as one number, tick * 4096 + sequence, so a batch is
        a run of consecutive numbers; a sequence running out moves to the next tick,
        as ``new`` borrows it. The sequence is the last three hex digits, so the ids
        of one tick share their first thirteen and are a prefix plus a table entry."""
        if count == 1:  # a PUB: the plain way is quicker for one
            return [hex_id(self.new())]
        ts = self._time_ns() >> 20
        if ts <= self._last_ts:
            first = (self._last_ts << SEQUENCE_BITS) + self._sequence + 1
        else:
            first = ts << SEQUENCE_BITS
        if count <= 0:
            return []
        last = first + count - 1
        self._last_ts = last >> SEQUENCE_BITS
        self._sequence = last & SEQUENCE_MASK
        node = self.node_id << NODE_ID_SHIFT
        out: list[bytes] = []
        k = first
        while k <= last:
            tick, sequence = k >> SEQUENCE_BITS, k & SEQUENCE_MASK
            upto = min(SEQUENCE_MASK, sequence + last - k)
            prefix = b"%013x" % ((((tick - TWEPOCH) << TIMESTAMP_SHIFT | node) & _U64) >> SEQUENCE_BITS)
            out += [prefix + suffix for suffix in _SEQUENCE_HEX[sequence : upto + 1]]
            k += upto - sequence + 1
        return out
