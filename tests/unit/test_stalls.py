"""core.stalls: the reactor's lateness on an injected clock, and collections timed by
the interpreter's own ``gc.callbacks`` (a fake timer for exact lengths, the real
collector for the hook itself)."""

from __future__ import annotations

import gc

import pytest
from twisted.internet.task import Clock

from dmq_server.core.stalls import GcPauses, ReactorLag


def test_a_call_on_time_is_not_late_and_a_held_up_one_is_counted_with_when_it_was_due():
    clock = Clock()
    clock.advance(1000.0)
    lag = ReactorLag(clock, interval=0.025, wall=clock.seconds)
    lag.start()
    clock.advance(0.025)
    assert (lag.buckets.count, lag.worst, list(lag.stalls)) == (1, 0.0, [])
    clock.pump([0.025, 0.025])  # on time again
    assert lag.buckets.count == 3 and lag.worst == 0.0
    # the next call was due at 1000.1; the thread was busy until 1000.25
    clock.advance(0.175)
    assert lag.buckets.count == 4
    assert lag.worst == pytest.approx(0.15)
    ((due, late),) = lag.stalls
    assert due == pytest.approx(1000.1) and late == pytest.approx(0.15)
    # one stall is one lateness: the next call is an interval after the late one ran
    clock.advance(0.025)
    assert lag.buckets.count == 5 and len(lag.stalls) == 1
    buckets, total = lag.buckets.snapshot()
    assert dict(buckets)["0.001"] == 4 and dict(buckets)["0.25"] == 5 and total == pytest.approx(0.15)


def test_lateness_under_the_stall_threshold_is_counted_but_not_kept():
    clock = Clock()
    lag = ReactorLag(clock, interval=0.025, wall=clock.seconds)
    lag.start()
    clock.advance(0.03)  # 5 ms late
    assert lag.buckets.count == 1 and lag.worst == pytest.approx(0.005)
    assert list(lag.stalls) == []
    assert lag.stats()["worst_s"] == pytest.approx(0.005)


def test_stopping_cancels_the_pending_call_and_a_restart_schedules_one():
    clock = Clock()
    lag = ReactorLag(clock, interval=0.025)
    lag.start()
    lag.start()  # idempotent
    assert len(clock.getDelayedCalls()) == 1
    lag.stop()
    assert clock.getDelayedCalls() == [] and not lag.running
    lag.stop()
    lag.start()
    assert len(clock.getDelayedCalls()) == 1


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        ReactorLag(Clock(), interval=0)


class FakeTimer:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_collection_is_timed_from_start_to_stop_and_counted_by_generation():
    timer, hooks = FakeTimer(), []
    pauses = GcPauses(timer=timer, wall=lambda: 5000.0, hooks=hooks)
    pauses.install()
    pauses.install()
    assert hooks == [pauses.callback]
    for generation, seconds in ((0, 0.0002), (0, 0.0003), (2, 0.04)):
        pauses.callback("start", {"generation": generation})
        timer.now += seconds
        pauses.callback("stop", {"generation": generation, "collected": 0, "uncollectable": 0})
    assert pauses.by_generation == [2, 0, 1]
    assert pauses.buckets.count == 3 and pauses.buckets.total == pytest.approx(0.0405)
    ((at, seconds, generation),) = pauses.stalls  # only the 40 ms one is a stall
    assert (at, generation) == (pytest.approx(5000.0 - 0.04), 2) and seconds == pytest.approx(0.04)
    pauses.uninstall()
    assert hooks == []


def test_a_stop_without_its_start_is_ignored():
    """Installed while a collection ran: the first stop has no start to measure from."""
    pauses = GcPauses(timer=FakeTimer(), hooks=[])
    pauses.callback("stop", {"generation": 2})
    assert pauses.buckets.count == 0 and pauses.by_generation == [0, 0, 0]


def test_percentiles_are_nsqds_over_the_last_256_pauses_in_microseconds():
    timer = FakeTimer()
    pauses = GcPauses(timer=timer, hooks=[])
    assert pauses.percentiles_usec() == {100: 0, 99: 0, 95: 0}
    for micros in [5000] * 100 + list(range(1, 101)):  # the first 100 fall out of the window
        pauses.callback("start", {"generation": 0})
        timer.now += micros / 1_000_000
        pauses.callback("stop", {"generation": 0})
    for micros in range(101, 257):
        pauses.callback("start", {"generation": 0})
        timer.now += micros / 1_000_000
        pauses.callback("stop", {"generation": 0})
    # the window holds 1..256 µs now (the 5 ms pauses were older than the last 256)
    got = pauses.percentiles_usec()
    assert got == {100: 256, 99: 254, 95: 244}  # nearest rank: the 256th, 254th and 244th


def test_the_hook_times_real_collections():
    pauses = GcPauses()
    pauses.install()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        pauses.uninstall()
    assert pauses.callback not in gc.callbacks
    assert pauses.by_generation[2] >= 1 and pauses.by_generation[0] >= 1
    assert pauses.buckets.count >= 2 and pauses.buckets.total > 0
    before = pauses.buckets.count
    gc.collect()
    assert pauses.buckets.count == before  # uninstalled: no longer counted
