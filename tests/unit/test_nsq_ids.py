"""Message ids (nsqd's snowflake) and the indexed priority queue behind in-flight and deferred."""

from __future__ import annotations

import random

from dmq_server.core.ids import TWEPOCH, GuidFactory, default_node_id, hex_id, parse_hex_id
from dmq_server.core.pqueue import PriorityQueue


class Item:
    def __init__(self, pri):
        self.pri = pri
        self.index = -1


def test_guid_layout_matches_nsqd():
    """id = ((ns>>20) - twepoch) << 22 | node << 12 | sequence."""
    now = 1_700_000_000_000_000_000
    f = GuidFactory(5, lambda: now)
    first, second = f.new(), f.new()
    assert first == (((now >> 20) - TWEPOCH) << 22) | (5 << 12)
    assert second == first + 1


def test_guid_never_repeats_when_sequence_runs_out_or_clock_goes_back():
    """4096 ids in one tick borrow the next tick; a clock going back never repeats an id."""
    times = [1_700_000_000_000_000_000]
    f = GuidFactory(1, lambda: times[0])
    ids = [f.new() for _ in range(5000)]
    times[0] -= 10**9
    ids += [f.new() for _ in range(10)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)


def test_hex_ids_round_trip():
    """Wire ids are 16 lowercase hex chars; parsing refuses anything else."""
    assert hex_id(255) == b"00000000000000ff"
    assert parse_hex_id(hex_id(123456789)) == 123456789
    assert parse_hex_id(b"zz00000000000000") is None
    assert parse_hex_id(b"ff") is None


def test_default_node_id_in_range():
    """The default node id is crc32(md5(hostname)) % 1024."""
    assert 0 <= default_node_id("example-host") < 1024
    assert default_node_id("a") == default_node_id("a")


def test_pqueue_pops_in_priority_order_and_removes_by_index():
    """Pops come out sorted; remove() of any item keeps the heap valid."""
    rng = random.Random(7)
    q = PriorityQueue()
    items = [Item(rng.random()) for _ in range(300)]
    for it in items:
        q.push(it)
    removed = rng.sample(items, 100)
    for it in removed:
        q.remove(it)
        assert it.index == -1
    out = []
    while q:
        out.append(q.pop().pri)
    assert out == sorted(it.pri for it in items if it not in removed)


def test_peek_and_shift_only_pops_due_items():
    """peek_and_shift(now) returns items with pri <= now, one at a time, else None."""
    q = PriorityQueue()
    for p in (5.0, 1.0, 3.0):
        q.push(Item(p))
    assert q.peek_and_shift(0.5) is None
    assert q.peek_and_shift(3.0).pri == 1.0
    assert q.peek_and_shift(3.0).pri == 3.0
    assert q.peek_and_shift(3.0) is None
    assert len(q) == 1
