"""reliable.depths: the stored depths counted a slice at a time, on the in-memory
database whose answers take a set time on an injected clock, so that the pacing (each
slice's cost sets the pause after it, a pass at most once per period) is checked to the
millisecond. tests/integration/test_depth_count.py counts on PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.task import Clock

from dmq_server.db.memory import MemoryDb
from dmq_server.db.messages import CursorProgress, AckRow, ack_deliveries_steps, create_owner_steps, insert_messages_steps
from dmq_server.reliable.depths import DUTY, MIN_PAUSE, DepthCount
from tests.unit.test_memory_db import msg, result

OWNER = 1


class Timed:
    """A database role whose every run takes ``seconds`` on the clock, recording when
    each depth slice started and ended."""

    def __init__(self, db: MemoryDb, clock: Clock, seconds: float):
        self.db, self.clock, self.seconds = db, clock, seconds
        self.slices: list[tuple[float, float]] = []

    def run_steps(self, steps_fn: Any, *args: Any) -> Any:
        from twisted.internet.defer import Deferred

        started = self.clock.seconds()
        late: Deferred = Deferred()

        def answer(outcome: Any) -> None:
            self.slices.append((started, self.clock.seconds()))
            late.callback(outcome)

        self.db.run_steps(steps_fn, *args).addBoth(lambda r: self.clock.callLater(self.seconds, answer, r))
        return late


def recorder(applied: list, lowest: list | None = None) -> Any:
    """An ``apply`` that keeps each pass's counts (and its lowest ids)."""
    def apply(depths: dict, low: dict) -> None:
        applied.append(depths)
        if lowest is not None:
            lowest.append(low)
    return apply


def run_until(clock: Clock, done: Any, limit: float = 120.0) -> None:
    """Advance the clock from one delayed call to the next (each runs at its own time)
    until ``done()``."""
    end = clock.seconds() + limit
    while not done():
        calls = clock.getDelayedCalls()
        assert calls and clock.seconds() < end, "nothing left to run"
        clock.advance(max(0.0, min(c.getTime() for c in calls) - clock.seconds()))


@pytest.fixture
def world():
    clock = Clock()
    db = MemoryDb(clock)
    db.create_topic("orders", ["billing", "audit"])
    assert result(db.run_steps(create_owner_steps, "node-1")) == OWNER
    stored = result(db.run_steps(insert_messages_steps, [msg("p", i) for i in range(12)], "node-1", OWNER))
    ids = [s.message_id for s in stored]
    # billing has acknowledged the first four
    result(db.run_steps(ack_deliveries_steps, [AckRow("orders", "billing", i, 1, 2, 1, owner=OWNER) for i in ids[:4]],
                        [CursorProgress("orders", "billing", OWNER, ids[3], [])], "node-1"))
    return clock, db, ids


def test_a_pass_counts_every_channel_in_slices_paced_by_their_cost(world):
    clock, db, ids = world
    timed = Timed(db, clock, 0.02)  # every slice costs 20 ms
    applied: list[dict] = []
    lowest: list[dict] = []
    counter = DepthCount(timed, clock, recorder(applied, lowest), period=5.0, rows=3, min_rows=1)
    counter.startService()
    run_until(clock, lambda: applied)
    assert applied == [{("orders", "billing"): 8, ("orders", "audit"): 12}]
    assert lowest == [{("orders", "billing"): ids[4], ("orders", "audit"): ids[0]}]  # from the slices they fell in
    assert counter.passes == 1
    slices = timed.slices
    assert len(slices) >= 4  # 12 messages, 3 rows first, then fewer: 20 ms is twice the target
    for (_, ended), (next_start, _) in zip(slices, slices[1:]):
        assert next_start - ended == pytest.approx(0.02 / DUTY)  # one backend busy 5 % of the time
    assert counter.rows < 3  # scaled towards 2 ms a slice

    # the next pass starts one period after this one started, and sees what changed
    result(db.run_steps(ack_deliveries_steps, [AckRow("orders", "audit", i, 1, 2, 1, owner=OWNER) for i in ids[:6]],
                        [CursorProgress("orders", "audit", OWNER, ids[5], [])], "node-1"))
    first_pass_started = slices[0][0]
    count = len(slices)
    run_until(clock, lambda: len(applied) == 2)
    assert timed.slices[count][0] == pytest.approx(first_pass_started + 5.0)
    assert applied[1] == {("orders", "billing"): 8, ("orders", "audit"): 6}


def test_a_fast_slice_at_most_doubles_the_next(world):
    """A slice answered far under the aim (its pages cached) would scale the next one by the
    same factor, and that one could hold a core for many times the aim: the next slice's
    rows at most double."""
    clock, db, _ = world
    timed = Timed(db, clock, 0.0001)  # 20 times under the 2 ms aim
    applied: list[dict] = []
    counter = DepthCount(timed, clock, recorder(applied), period=5.0, rows=2, min_rows=1, max_rows=1000)
    counter.startService()
    clock.advance(0)
    clock.advance(0.0001)  # the first slice, 2 rows, is counted
    assert len(timed.slices) == 1 and counter.rows == 4
    run_until(clock, lambda: applied)
    assert applied == [{("orders", "billing"): 8, ("orders", "audit"): 12}]


def test_a_small_backlog_is_one_slice_a_period(world):
    clock, db, _ = world
    applied: list[dict] = []
    counter = DepthCount(db, clock, recorder(applied), period=5.0)  # answers at once
    counter.startService()
    clock.advance(0)
    assert applied == [{("orders", "billing"): 8, ("orders", "audit"): 12}]
    clock.advance(4.9)
    assert len(applied) == 1
    clock.advance(0.1)
    assert len(applied) == 2 and db.names_run().count("depth_scan_start") == 2
    counter.stopService()
    clock.advance(60)
    assert len(applied) == 2 and clock.getDelayedCalls() == []


@pytest.mark.parametrize("slice_out", [False, True], ids=["after-a-slice", "while-a-slice-is-out"])
def test_a_restart_drops_the_slices_counted_so_far(world, slice_out):
    """An operator emptied a channel during a pass: the copies its earlier slices counted
    are gone, so the pass begins again instead of adding them up (and the answer of a
    slice still out when it restarted is not added either)."""
    from dmq_server.db.messages import empty_channel_steps

    clock, db, _ = world
    timed = Timed(db, clock, 0.02)
    applied: list[dict] = []
    counter = DepthCount(timed, clock, recorder(applied), period=5.0, rows=4, min_rows=4, max_rows=4)
    counter.startService()
    clock.advance(0)  # the first slice (4 messages) is out
    if not slice_out:
        clock.advance(0.02)  # and counted
        assert timed.slices and not applied
    assert result(db.run_steps(empty_channel_steps, "orders", "audit")) == 12
    counter.restart()
    run_until(clock, lambda: applied)
    assert applied == [{("orders", "billing"): 8}]


def test_a_failed_slice_drops_the_pass_and_the_next_begins_a_period_later(world):
    clock, db, _ = world
    applied: list[dict] = []
    counter = DepthCount(db, clock, recorder(applied), period=5.0, rows=4, min_rows=4, max_rows=4)
    db.fail_next("channel_depth_slice", "lost", when=lambda p: p["low"] > 4)  # the second slice
    counter.startService()
    run_until(clock, lambda: db.names_run().count("channel_depth_slice") == 2)  # the second fails
    assert clock.seconds() == pytest.approx(MIN_PAUSE)  # one pause after the first
    assert applied == [] and db.names_run().count("depth_scan_start") == 1
    [retry] = clock.getDelayedCalls()
    assert retry.getTime() == pytest.approx(MIN_PAUSE + 5.0)  # a period later
    run_until(clock, lambda: db.names_run().count("depth_scan_start") == 2)  # from the start again
    run_until(clock, lambda: applied)
    assert applied == [{("orders", "billing"): 8, ("orders", "audit"): 12}]


def test_apply_failing_does_not_stop_the_count(world):
    clock, db, _ = world
    calls: list[dict] = []

    def apply(depths: dict, lowest: dict) -> None:
        calls.append(depths)
        raise RuntimeError("a bug in the store")

    counter = DepthCount(db, clock, apply, period=5.0)
    counter.startService()
    clock.advance(0)
    clock.advance(5.0)
    assert len(calls) == 2
