"""``reliable.cursor.ChannelCursor`` alone: the ack orders and the crash points of
``tests/integration/test_cursor_crash.py``, each checked by what a restart would load.

The stored side is a model of one ``dmq_cursor`` row merged as ``ack_deliveries`` merges
(a floor only rises, done ranges only grow). A restart loads the owner's stored ids above
the floor that no done range covers: an acknowledged copy whose ack was durable must not
be among them (delivered again after a durable ack), and every other stored copy must
(lost otherwise). A copy whose ack was not durable at the kill may come again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from dmq_server.db.messages import AckRun, BacklogRow
from dmq_server.reliable.channel import Delivery, ReliableMessage
from dmq_server.reliable.cursor import ChannelCursor, acks_by_cursor, split_fenced
from dmq_server.reliable.horizon import OwnWrites

pytestmark = pytest.mark.unit

OWNER = 7


@dataclass
class StoredCursor:
    """The ``dmq_cursor`` row of (channel, OWNER), merged as the ack statement does."""

    floor: int = 0
    done: list[tuple[int, int]] = field(default_factory=list)

    def merge(self, proposal: tuple[int, list[tuple[int, int]]]) -> None:
        floor, spans = proposal
        self.floor = max(self.floor, floor)
        self.done = [(lo, hi) for lo, hi in self.done + spans if hi > self.floor]

    def restart_loads(self, stored: list[int]) -> list[int]:
        return [x for x in stored if x > self.floor and not any(lo <= x <= hi for lo, hi in self.done)]


def delivery(mid: int, owner: int = OWNER) -> Delivery:
    return Delivery(ReliableMessage(mid, "orders", "p", mid, 0, b"x", owner))


def row(mid: int) -> BacklogRow:
    return BacklogRow(mid, "p", mid, 0, b"x", 0, OWNER)


class Node:
    """What a channel does around its cursor: a load's rows go straight out to a consumer
    (in flight), acks take them out of flight, durable-ack batches propose and commit."""

    def __init__(self, stored: list[int], writes: OwnWrites | None = None):
        self.stored = stored  # the owner's ids in PostgreSQL, in id order
        self.cursor = ChannelCursor()
        self.in_flight: dict[int, Delivery] = {}
        self.writes = writes or OwnWrites(OWNER)
        self.row = StoredCursor()

    def push(self, d: Delivery) -> None:
        self.cursor.known.add(d.message.message_id)
        self.in_flight[d.message.message_id] = d

    def load(self, limit: int, rows: list[int] | None = None) -> bool:
        """A load after the position; ``rows``: what its snapshot read (default: the
        stored ids after the position)."""
        after = self.cursor.load_from()
        if rows is None:
            rows = [x for x in self.stored if x > after][:limit]
        return self.cursor.loaded([row(x) for x in rows], limit, lambda r: self.push(delivery(r.message_id)),
                                  self.push, lambda d: True)

    def ack(self, *ids: int) -> list[int]:
        acked = [self.in_flight.pop(mid) for mid in ids]
        self.cursor.acknowledged(acked)
        return list(ids)

    def propose(self, ids: list[int]) -> tuple[int, list[tuple[int, int]]]:
        return self.cursor.progress(OWNER, ids, self.writes.limit(OWNER), self.in_flight, None)

    def commit(self, ids: list[int]) -> None:
        """A durable-ack batch of ``ids``: proposed, merged, confirmed."""
        self.row.merge(self.propose(ids))
        self.cursor.durable(ids, self.in_flight)

    def restart_loads(self) -> list[int]:
        return self.row.restart_loads(self.stored)


# -- ack orders ---------------------------------------------------------------------------


def test_acks_out_of_order_leave_the_copies_between_them_to_a_restart():
    node = Node(list(range(1, 7)))
    node.load(limit=10)
    assert sorted(node.in_flight) == [1, 2, 3, 4, 5, 6] and not node.cursor.backlog
    node.commit(node.ack(4, 2))
    assert (node.row.floor, node.row.done) == (0, [(2, 2), (4, 4)])
    assert node.restart_loads() == [1, 3, 5, 6]
    node.commit(node.ack(3, 1))  # the holes below 4 close: the floor passes them
    assert node.row.floor == 4 and node.restart_loads() == [5, 6]
    node.commit(node.ack(6))
    assert node.restart_loads() == [5]


def test_an_ack_made_durable_while_a_load_is_out_is_kept_out_of_its_rows():
    node = Node([1, 2, 3, 4])
    node.load(limit=10)
    acked = node.ack(2)
    assert node.cursor.rescan()  # a takeover: read again from the first id
    node.cursor.load_from()
    node.commit(acked)  # committed after the load's snapshot read 2
    assert 2 in node.cursor.dropped and 2 not in node.cursor.known
    node.cursor.loaded([row(x) for x in (1, 2, 3, 4)], 10, lambda r: node.push(delivery(r.message_id)),
                       node.push, lambda d: True)
    assert sorted(node.in_flight) == [1, 3, 4]  # 2 is not delivered again after its durable ack
    assert node.restart_loads() == [1, 3, 4]


def test_a_copy_committed_while_a_load_is_out_is_a_hole_until_it_is_placed():
    node = Node([1, 2, 3])
    node.load(limit=10)
    node.stored.append(5)
    node.cursor.position = 6  # a later copy was pushed at once (position past it)
    node.stored.append(6)
    node.push(delivery(6))
    node.cursor.backlog = True
    node.cursor.load_from()
    late = delivery(5)  # committed out of order, below the position, during the load
    node.cursor.arrived.append(late)
    node.commit(node.ack(1, 2, 3, 6))
    assert node.row.floor == 4 and node.restart_loads() == [5]
    node.cursor.loaded([], 10, lambda r: None, node.push, lambda d: False)  # the window is full
    assert 5 in node.in_flight  # at or below the position: kept, no later load would find it


def test_a_takeover_during_a_load_proposes_the_acks_alone_then_reads_from_the_first_id():
    node = Node([1, 2, 3])
    node.load(limit=2)  # 1, 2; 3 waits in PostgreSQL
    node.cursor.load_from()
    assert not node.cursor.rescan()  # pending: the load's answer restarts the read
    assert node.propose(node.ack(1)) == (0, [(1, 1)])
    node.cursor.loaded([row(3)], 2, lambda r: node.push(delivery(r.message_id)), node.push, lambda d: True)
    assert node.cursor.position == 0 and node.cursor.backlog and not node.cursor.rescan_pending


def test_a_repeated_ack_or_a_retried_batch_changes_nothing():
    node = Node([1, 2, 3, 4])
    node.load(limit=10)
    node.ack(2)
    once = node.propose([2, 2])  # one consumer's acks listed the id twice
    assert once == node.propose([2]) == (0, [(2, 2)])  # 1 is in flight
    node.row.merge(once)
    node.row.merge(once)  # the batch again: its answer was lost and it was retried
    node.row.merge((0, []))  # a stale proposal from before: never takes anything back
    assert node.restart_loads() == [1, 3, 4]


def test_an_ack_whose_durable_ack_failed_stays_a_hole_until_its_retry_commits():
    node = Node([1, 2, 3])
    node.load(limit=10)
    failed = node.ack(1)  # its batch failed: the acker keeps it queued, nothing merged
    node.commit(node.ack(2))  # a later batch must not cover 1 while its ack is not durable
    assert node.row.floor == 0 and node.restart_loads() == [1, 3]  # a kill now: 1 comes again
    node.commit(failed)  # the retry
    assert node.row.floor == 2 and node.restart_loads() == [3]


def test_a_copy_handed_to_its_dead_letter_is_a_hole_until_that_commits():
    node = Node([1, 2, 3])
    node.load(limit=10)
    node.in_flight.pop(1)
    node.cursor.exhausted(1, OWNER)  # out of ready to its dead letter, not to a consumer
    node.commit(node.ack(2, 3))
    assert node.row.floor == 0 and node.restart_loads() == [1]  # a kill now: 1 is still stored
    node.cursor.durable([1], node.in_flight)  # the dead letter committed (its cursor marked)
    node.commit([])
    assert node.row.floor == 3 and node.restart_loads() == []


def test_acks_refused_by_the_fence_are_forgotten_and_move_no_cursor():
    node = Node([1, 2, 3])
    node.load(limit=10)
    runs = [AckRun("orders", "billing", "c", 0, False, [1, 2], [OWNER, 3], [0, 0], [0, 0], [1, 1], [0, 0])]
    node.ack(1, 2)
    applied, refused = split_fenced(runs, [("orders", "billing", OWNER)])
    assert applied == {("orders", "billing"): [2]} and refused == {("orders", "billing"): [1]}
    node.cursor.refused(refused["orders", "billing"], node.in_flight)
    assert 1 not in node.cursor.known and 1 not in node.cursor.finishing  # a load may bring it back
    assert node.restart_loads() == [1, 2, 3]  # the row (another node's now) did not move
    assert split_fenced(runs, []) == ({("orders", "billing"): [1, 2]}, {})


def test_a_batch_is_grouped_by_the_cursor_each_ack_moves():
    runs = [
        AckRun("orders", "billing", "c", 0, False, [5, 6], [OWNER, OWNER], [0, 0], [0, 0], [1, 1], [0, 0]),
        AckRun("orders", "billing", "c", 1, False, [7, 8], [3, OWNER], [0, 0], [0, 0], [1, 1], [0, 0]),
    ]
    assert acks_by_cursor(runs) == {("orders", "billing", OWNER): [5, 6, 8], ("orders", "billing", 3): [7]}


def test_a_lost_session_drops_what_is_held_and_makes_a_load_out_stale():
    node = Node([1, 2, 3, 4])
    node.load(limit=10)
    node.ack(2)  # its durable ack is on its way
    node.cursor.load_from()
    node.cursor.forget(set(node.in_flight))
    node.in_flight.clear()
    assert node.cursor.known == {2} and node.cursor.load_stale
    assert node.propose([]) == (0, [])  # nothing is known below a stale read
    assert not node.load(limit=10, rows=[1, 3, 4])  # the stale answer: dropped
    assert not node.in_flight and node.cursor.position == 0 and node.cursor.backlog
    node.load(limit=10)
    assert sorted(node.in_flight) == [1, 3, 4]  # read again; 2 stays out until its outcome


# -- the crash points of tests/integration/test_cursor_crash.py ------------------------------


def _run_until(point: str) -> Node:
    """Copies 1..12 stored; a load of 8 pushes 1..8 (9..12 wait in PostgreSQL); consumers
    acknowledge out of order; an ack batch of at most 3 (``--ack-batch-size``) splits a
    consumer's run of acks across two transactions. Stops at ``point``: the kill."""
    node = Node(list(range(1, 13)))
    node.load(limit=8)
    if point == "in flight":
        return node
    run = node.ack(1, 2, 3, 5, 6)
    if point == "acked, not durable":
        return node
    node.commit(run[:3])
    if point == "half of a run durable":
        return node
    node.commit(run[3:])
    if point == "the run durable":
        return node
    node.load(limit=8)  # nothing: 9..12 are after the position, next load
    node.commit(node.ack(4, 7, 8))
    return node


@pytest.mark.parametrize("point,loads", [
    ("in flight", list(range(1, 13))),
    ("acked, not durable", list(range(1, 13))),  # at least once: they come again
    ("half of a run durable", [4, 5, 6, 7, 8, 9, 10, 11, 12]),
    ("the run durable", [4, 7, 8, 9, 10, 11, 12]),
    ("all loaded copies durable", [9, 10, 11, 12]),
])
def test_a_kill_at_each_point_restarts_with_what_was_not_durably_acknowledged(point, loads):
    node = _run_until(point)
    assert node.restart_loads() == loads


def test_a_kill_while_a_group_commit_is_open_loses_none_of_its_messages():
    """Writers commit out of order: a batch sent when 12 was the highest id seen may still
    commit 13 and 14 after a later batch's 15 reached the channel. A kill before they
    reach it must find them stored and uncovered."""
    writes = OwnWrites(OWNER)
    writes.seen(12)
    open_write = writes.begin()  # will store 13 and 14
    node = Node(list(range(9, 13)), writes)
    node.cursor.position = 8
    node.load(limit=10)
    node.stored += [13, 14, 15]  # committed; 15 handed over (the later batch), 13 and 14 not yet
    node.push(delivery(15))
    node.cursor.position = 15
    node.commit(node.ack(9, 10, 11, 12, 15))
    assert node.row.floor == 12 and node.restart_loads() == [13, 14]
    writes.end(open_write)  # 13 and 14 reach the channel: ids up to 15 are settled
    node.push(delivery(13))
    node.push(delivery(14))
    node.commit(node.ack(13, 14))
    assert node.row.floor == 15 and node.restart_loads() == []
