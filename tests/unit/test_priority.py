"""Priority on a reliable channel (issue 45 §3), on the channel itself: no IO, a test clock,
consumers that record what they were pushed.

What must hold: the copies waiting are pushed highest priority first, then in id order;
a redelivery goes back to the front of its priority; a copy of a higher priority takes
the place of a lower one in a full window (the lower one waits in PostgreSQL and the
reads come back to it); the read-ahead brings the priorities in PostgreSQL before the id
order of the rest; an ordered topic keeps each key's order over priority. The property
test of the cursor (tests/unit/test_cursor.py) plays all of it at random and counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from twisted.internet.task import Clock

from dmq_server.db.messages import BacklogRow
from dmq_server.reliable.channel import ReliableChannel, ReliableMessage
from dmq_server.reliable.cursor import NOTHING_AHEAD

from .test_channel_cluster import Consumer  # records the ids pushed to it

pytestmark = pytest.mark.unit

TIMEOUT = 10.0


@dataclass
class Prioritised:
    """A channel whose loads and read-aheads are recorded, answered by the test."""

    mem_queue_size: int = 100
    max_attempts: int | None = None
    ordered: bool = False
    clock: Clock = field(default_factory=Clock)
    loads: list[tuple[int, int]] = field(default_factory=list)
    aheads: list[tuple[list[int], int]] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    channel: ReliableChannel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = ReliableChannel(
            "jobs", "workers", clock=self.clock, msg_timeout=TIMEOUT, mem_queue_size=self.mem_queue_size,
            load=lambda channel, after, limit: self.loads.append((after, limit)),
            load_ahead=lambda channel, afters, limit: self.aheads.append((afters, limit)),
            on_acks=lambda *a: None, max_attempts=self.max_attempts, ordered=self.ordered,
            on_exhausted=lambda channel, delivery: self.dead.append(delivery.message.message_id),
        )

    def empty(self) -> None:
        """Nothing stored before: the first read-ahead and load find nothing."""
        consumer = Consumer(credit=0)
        self.channel.subscribe(consumer)
        if self.aheads:  # an ordered channel has no read-ahead
            self.answer_ahead([])
        self.answer_load([])
        self.channel.unsubscribe(consumer)

    def load_out(self, stored: int, credit: int) -> Consumer:
        """Copies 1 to ``stored`` of priority 0 (those past the window wait in PostgreSQL),
        then a consumer with ``credit``: a load goes out for the window's free half."""
        self.empty()
        for mid in range(1, stored + 1):
            self.add(mid, 0)
        consumer = Consumer(credit=credit)
        self.channel.subscribe(consumer)
        assert consumer.ids == list(range(1, credit + 1)) and len(self.loads) == 1
        return consumer

    def add(self, mid: int, priority: int = 0, key: str | None = None) -> None:
        self.channel.add(ReliableMessage(mid, "jobs", "p", mid, 0, b"x", priority=priority, key=key))

    def answer_ahead(self, rows: list[tuple[int, int]]) -> None:
        _, limit = self.aheads.pop(0)
        self.channel.loaded_ahead([row(mid, p) for mid, p in rows], limit)

    def answer_load(self, rows: list[tuple[int, int]]) -> None:
        _, limit = self.loads.pop(0)
        self.channel.loaded([row(mid, p) for mid, p in rows], limit)


def row(mid: int, priority: int) -> BacklogRow:
    return BacklogRow(mid, "p", mid, 0, b"x", 0, 0, "", None, priority)


def test_waiting_copies_go_highest_priority_first_then_by_id():
    h = Prioritised()
    h.empty()
    for mid, priority in [(1, 0), (2, 5), (3, 9), (4, 0), (5, 5), (6, 1), (7, 9)]:
        h.add(mid, priority)
    assert h.channel.prioritised_count == 5 and len(h.channel.ready) == 2 and h.channel.depth == 7
    assert h.channel.locate(6) == {"state": "ready", "attempts": 0}
    lone = Consumer()
    h.channel.subscribe(lone)
    assert lone.ids == [3, 7, 2, 5, 6, 1, 4]
    assert h.channel.prioritised_count == 0 and h.channel.ready_bytes == 0


def test_several_consumers_take_turns_in_priority_order():
    h = Prioritised()
    h.empty()
    for mid, priority in [(1, 0), (2, 3), (3, 8), (4, 3)]:
        h.add(mid, priority)
    first, second = Consumer(credit=2), Consumer(credit=2)
    h.channel.consumers.extend([first, second])
    h.channel.pump()
    assert first.ids == [3, 4] and second.ids == [2, 1]  # 3, 2, 4, 1 in turns


def test_a_redelivery_goes_back_to_the_front_of_its_priority():
    h = Prioritised()
    h.empty()
    c = Consumer(credit=1)
    h.channel.subscribe(c)
    h.add(1, 5)  # out at once
    for mid, priority in [(2, 5), (3, 9), (4, 0)]:
        h.add(mid, priority)
    h.clock.advance(TIMEOUT + 1)
    h.channel.scan(h.clock.seconds())  # 1 comes back: behind 3, before 2
    assert c.ids == [1, 3]
    for _ in range(3):
        assert h.channel.ack_held([c.ids[-1]], c) == 0
    assert c.ids == [1, 3, 1, 2, 4]


def test_a_higher_priority_takes_the_place_of_the_newest_lower_one_in_a_full_window():
    h = Prioritised(mem_queue_size=3)
    h.empty()
    for mid in (1, 2, 3):
        h.add(mid, 0)  # the window is full
    h.add(4, 0)  # no room: it waits in PostgreSQL
    assert h.channel.backlog and h.channel.cursor.position == 3
    h.add(5, 7)
    # 3, the newest of the lowest priority, left memory for it; the reads come back to 3
    assert 3 not in h.channel.known and 5 in h.channel.known
    assert h.channel.cursor.position == 2 and h.channel.waiting == 3
    c = Consumer()
    h.channel.subscribe(c)
    assert c.ids == [5, 1, 2]
    assert h.loads == [(2, 3)]  # the load reads again from under the copy set aside
    h.answer_load([(3, 0), (4, 0), (5, 7)])
    assert c.ids == [5, 1, 2, 3, 4]  # 5 is known: not pushed twice


def test_a_higher_priority_committed_during_a_load_takes_the_place_of_a_lower_one():
    """A copy of a priority committed while a load is out and the window is full waits
    for the load's answer, then takes the place of the newest lower copies, as it would
    have had no load been out (a CI run saw it wait behind a window of them)."""
    h = Prioritised(mem_queue_size=4)
    c = h.load_out(6, credit=2)  # 5 and 6 wait in PostgreSQL
    assert h.loads == [(4, 2)]  # half the window free: a load reads 5, 6
    h.add(7, 9)
    h.add(8, 9)  # while the load is out: the window has room for both
    h.add(9, 7)  # not for this one: it waits for the answer
    assert {7, 8} <= h.channel.known and 9 not in h.channel.known
    h.answer_load([(5, 0), (6, 0)])
    assert 9 in h.channel.known and not {4, 5, 6} & h.channel.known  # set aside, newest first
    assert h.channel.cursor.position == 3 and h.channel.cursor.ahead[7] == 9
    for mid in (1, 2, 7, 8, 9):
        assert h.channel.ack_held([mid], c) == 0
    assert c.ids == [1, 2, 7, 8, 9, 3]
    assert [after for after, _ in h.loads] == [3]  # the load reads again from under them
    h.answer_load([(4, 0), (5, 0), (6, 0), (7, 9)])
    assert c.ids == [1, 2, 7, 8, 9, 3, 4]  # 7 is known: not pushed twice
    for mid in (3, 4, 5):
        assert h.channel.ack_held([mid], c) == 0
    assert c.ids == [1, 2, 7, 8, 9, 3, 4, 5, 6]


def test_a_higher_priority_committed_during_a_load_goes_out_before_it_answers():
    """While a load is out the consumers keep taking the lower copies in memory; a copy of
    a priority committed then, with room in the window, waits in memory at once and goes
    out next, not after the load's answer."""
    h = Prioritised(mem_queue_size=6)
    c = h.load_out(8, credit=3)  # 7 and 8 wait in PostgreSQL
    assert h.loads == [(6, 3)]
    h.add(9, 9)  # committed while the load is out: there is room
    assert h.channel.ack_held([1], c) == 0
    assert c.ids == [1, 2, 3, 9]
    h.answer_load([(7, 0), (8, 0), (9, 9)])  # 9 is known: not pushed twice
    for mid in (2, 3, 9, 4, 5):
        assert h.channel.ack_held([mid], c) == 0
    assert c.ids == [1, 2, 3, 9, 4, 5, 6, 7, 8]


def test_a_copy_of_a_priority_still_waiting_in_postgresql_waits_behind_it():
    """A copy must not pass an older one of its priority: while its level is to be read
    ahead again, it stays stored too, and the read-ahead brings both in id order."""
    h = Prioritised(mem_queue_size=2)
    h.empty()
    h.add(1, 0)
    h.add(2, 0)
    h.add(3, 4)  # takes 2's place
    h.add(4, 4)  # 1 is the only lower copy left: takes its place
    h.add(5, 4)  # nothing lower left: level 4 waits in PostgreSQL from here
    assert h.channel.cursor.urgent == {4} and h.channel.cursor.ahead[4] == 4
    h.add(6, 4)
    assert 6 not in h.channel.known
    c = Consumer()
    h.channel.subscribe(c)
    assert c.ids == [3, 4]
    afters, limit = h.aheads[0]
    assert afters[3] == 4 and afters[0] == NOTHING_AHEAD  # level 4 after 4; nothing else to read ahead
    h.answer_ahead([(5, 4), (6, 4)])
    assert c.ids == [3, 4, 5, 6]
    h.answer_ahead([])  # a full answer: level 4 is read again until it has nothing more
    assert h.loads == [(0, 2)]  # then the load, from under the copies set aside
    h.answer_load([(1, 0), (2, 0)])
    assert c.ids == [3, 4, 5, 6, 1, 2]


def test_the_read_ahead_brings_the_priorities_before_the_id_order_of_the_rest():
    h = Prioritised(mem_queue_size=4)
    c = Consumer()
    h.channel.subscribe(c)
    assert h.aheads == [([0] * 9, 4)] and h.loads == []  # after a start: read ahead first
    h.answer_ahead([(90, 9), (40, 2), (60, 2), (10, 1)])  # full: levels above 1 are read to their end
    assert c.ids == [90, 40, 60, 10]
    assert h.channel.cursor.urgent == {1} and h.channel.cursor.position == 0
    afters, _ = h.aheads.pop(0)
    assert afters[0] == 10 and afters[1] == NOTHING_AHEAD and afters[8] == NOTHING_AHEAD
    h.channel.loaded_ahead([], 4)  # level 1 has nothing more
    assert h.channel.cursor.urgent == set()
    h.answer_load([(5, 0), (10, 1), (20, 0), (30, 0)])  # full: 10 is known, not pushed twice
    assert c.ids == [90, 40, 60, 10, 5, 20, 30]
    h.answer_load([(40, 2), (50, 0)])  # the end: the position passes what was read ahead
    assert c.ids == [90, 40, 60, 10, 5, 20, 30, 50]
    assert not h.channel.backlog and h.channel.cursor.position == 90


def test_a_full_window_of_higher_priorities_leaves_a_lower_copy_stored():
    h = Prioritised(mem_queue_size=2)
    h.empty()
    h.add(1, 9)
    h.add(2, 9)
    h.add(3, 2)
    assert 3 not in h.channel.known and h.channel.cursor.urgent == {2}
    assert h.channel.waiting == 2


def test_the_window_in_bytes_counts_the_copies_of_a_priority():
    h = Prioritised()
    h.empty()
    h.add(1, 3)
    h.add(2, 0)
    assert h.channel.ready_bytes == 2
    h.channel.drop([1])
    assert h.channel.prioritised_count == 0 and h.channel.ready_bytes == 1 and h.channel.waiting == 1
    h.add(3, 6)
    h.channel.forget()
    assert h.channel.waiting == 0 and h.channel.ready_bytes == 0 and not h.channel.known
    assert h.channel.cursor.urgent == set(range(1, 10))  # everything is read again, priorities first


def test_a_copy_of_a_priority_that_had_its_attempts_goes_to_its_dead_letter():
    h = Prioritised(max_attempts=1)
    h.empty()
    c = Consumer(credit=1)
    h.channel.subscribe(c)
    h.add(1, 5)
    h.add(2, 5)
    h.clock.advance(TIMEOUT + 1)
    h.channel.scan(h.clock.seconds())  # 1 had its one attempt
    assert h.dead == [1] and c.ids == [1, 2]


def test_an_ordered_topic_keeps_each_key_in_order_over_priority():
    h = Prioritised(ordered=True)
    h.empty()
    h.add(1, 0, key="a")
    h.add(2, 9, key="a")
    h.add(3, 9, key="b")
    assert h.channel.prioritised_count == 0  # one queue, in id order
    c = Consumer()
    h.channel.subscribe(c)
    assert c.ids == [1, 3]
    assert h.channel.ack_held([1], c) == 0
    assert c.ids == [1, 3, 2]
    assert h.aheads == []  # an ordered channel reads in id order only


def test_a_topic_made_ordered_puts_its_waiting_copies_in_id_order():
    h = Prioritised()
    h.empty()
    h.add(1, 0, key="a")
    h.add(2, 9, key="a")
    h.channel.set_ordered(True)
    assert list(d.message.message_id for d in h.channel.ready) == [1, 2] and h.channel.prioritised_count == 0
    h.channel.set_ordered(False)
    assert h.channel.prioritised_count == 1 and [d.message.message_id for d in h.channel.ready] == [1]


def test_the_rows_read_ahead_size_the_next_read():
    """A channel under a byte budget sizes each read by the bodies seen so far (at first
    ``LOAD_PROBE`` rows): the read-ahead's rows count too, else a channel draining a stored
    backlog of priorities would read 16 rows at a time (bench/reliable.py priority)."""
    from dmq_server.core.client_memory import ClientMemory
    from dmq_server.reliable.channel import LOAD_PROBE

    aheads: list[int] = []
    channel = ReliableChannel(
        "jobs", "workers", clock=Clock(), msg_timeout=TIMEOUT, mem_queue_size=10_000,
        load=lambda c, after, limit: None, load_ahead=lambda c, afters, limit: aheads.append(limit),
        on_acks=lambda *a: None, memory=ClientMemory(64 * 1024 * 1024),
    )
    c = Consumer(credit=LOAD_PROBE)
    channel.subscribe(c)
    assert aheads == [LOAD_PROBE]
    rows = [BacklogRow(mid, "p", mid, 0, b"x" * 100, 0, 0, "", None, 9) for mid in range(1, LOAD_PROBE + 1)]
    channel.loaded_ahead(rows, LOAD_PROBE)  # full: level 9 is read on, once these are out
    assert c.ids == list(range(1, LOAD_PROBE + 1))
    assert len(aheads) == 2 and aheads[1] > 1000, aheads  # sized by 100-byte bodies, not 16 rows
