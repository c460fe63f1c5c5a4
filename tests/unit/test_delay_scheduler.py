"""The delay scheduler's timing on an injected clock, against an in-memory delay table.

No database and no real time: ``task.Clock`` drives polls and timers, and a
small in-memory table answers ``peek`` and ``move`` like the SQL does.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from twisted.internet import task
from twisted.internet.defer import Deferred, fail, succeed

from dmq_server.db.delays import MovedMessage, StoredDelay
from dmq_server.reliable.delay import DelayScheduler, DelayWorker
from dmq_server.core.fragment_ranges import StaticAssignment
from dmq_server.db.storage_errors import StorageError

T0 = 1_700_000_000.0  # the clock's start, in seconds


@dataclass
class Row:
    id: int
    fragment: int
    due_ms: int


class Table:
    """An in-memory dmq_delay with peek and move as the SQL defines them."""

    def __init__(self):
        self.rows: list[Row] = []
        self.moves: list[tuple[float, list[int]]] = []  # (clock time, ids moved)
        self.peeks = 0
        self.clock: task.Clock | None = None
        self._next = 1

    def add(self, fragment: int, due_ms: int) -> Row:
        row = Row(self._next, fragment, due_ms)
        self._next += 1
        self.rows.append(row)
        return row

    @staticmethod
    def _mine(row: Row, fragments, max_fragment) -> bool:
        return row.fragment in fragments or (max_fragment in fragments and row.fragment > max_fragment)

    def peek(self, fragments, max_fragment, until_ms, limit):
        self.peeks += 1
        due = sorted(r.due_ms for r in self.rows if self._mine(r, fragments, max_fragment) and r.due_ms <= until_ms)
        return due[:limit]

    def move(self, fragments, max_fragment, now_ms, limit, node_id, owner=0):
        due = sorted(
            (r for r in self.rows if self._mine(r, fragments, max_fragment) and r.due_ms <= now_ms),
            key=lambda r: (r.due_ms, r.id),
        )[:limit]
        for r in due:
            self.rows.remove(r)
        self.moves.append((self.clock.seconds() if self.clock else 0.0, [r.id for r in due]))
        moved = [MovedMessage(r.id, "t", "p", r.id, now_ms, ("c",), r.due_ms, b"") for r in due]
        return len(due), moved


class SyncDb:
    """Runs the statement at once (a DbWorker whose thread is infinitely fast)."""

    def __init__(self, fail_next: int = 0):
        self.fail_next = fail_next
        self.calls = 0

    def run_steps(self, fn, *args):
        self.calls += 1
        if self.fail_next:
            self.fail_next -= 1
            return fail(StorageError("database unreachable"))
        return succeed(fn(*args))


class HeldDb:
    """Keeps each call pending until the test releases it (a slow database)."""

    def __init__(self):
        self.pending: list[tuple[Deferred, object, tuple]] = []

    def run_steps(self, fn, *args):
        d: Deferred = Deferred()
        self.pending.append((d, fn, args))
        return d

    def release_all(self):
        while self.pending:
            d, fn, args = self.pending.pop(0)
            d.callback(fn(*args))


def make_worker(table: Table, clock: task.Clock, db=None, **kw) -> tuple[DelayWorker, list]:
    delivered: list[MovedMessage] = []
    settings = dict(max_fragment=8, poll_interval=1.0, batch_size=100, tick=0.01, node_id="n1")
    settings.update(kw)
    worker = DelayWorker(
        1, db or SyncDb(), clock, on_moved=delivered.extend, peek=table.peek, move=table.move, **settings
    )
    return worker, delivered


@pytest.fixture
def clock() -> task.Clock:
    c = task.Clock()
    c.advance(T0)
    return c


@pytest.fixture
def table(clock) -> Table:
    t = Table()
    t.clock = clock
    return t


def ms(offset_s: float) -> int:
    return int(round((T0 + offset_s) * 1000))


def test_due_message_moves_exactly_at_its_due_time(table, clock):
    """A row due 0.5 s ahead is held on a timer and moved at its due time, not before."""
    row = table.add(3, ms(0.5))
    worker, delivered = make_worker(table, clock)
    worker.set_fragments((1, 2, 3, 4))
    assert table.peeks == 1 and not delivered
    clock.advance(0.499)
    assert not delivered
    clock.advance(0.001)
    assert [m.message_id for m in delivered] == [row.id]
    assert table.moves[-1][0] == pytest.approx(T0 + 0.5)
    assert worker.max_late_ms == 0


def test_rows_beyond_the_window_wait_for_a_later_poll(table, clock):
    """A row due after the polling window is not on a timer until a poll sees it; it is then
    moved at its due time, still without waiting for the poll after."""
    row = table.add(1, ms(3.25))
    worker, delivered = make_worker(table, clock)
    worker.set_fragments((1,))
    assert worker.stats()["timers_pending"] == 0
    for _ in range(2):  # the APScheduler job polls every second
        clock.advance(1.0)
        worker.poll()
    assert worker.stats()["timers_pending"] == 1
    clock.advance(1.249)
    assert not delivered
    clock.advance(0.001)
    assert [m.message_id for m in delivered] == [row.id]


def test_other_workers_fragments_are_not_touched(table, clock):
    """A worker serving 1-4 neither peeks nor moves a row of fragment 5."""
    table.add(5, ms(0.1))
    worker, delivered = make_worker(table, clock)
    worker.set_fragments((1, 2, 3, 4))
    clock.advance(2.0)
    worker.poll()
    clock.advance(2.0)
    assert not delivered and len(table.rows) == 1


def test_highest_fragment_worker_also_serves_rows_above_the_count(table, clock):
    """Rows with a fragment above --delay-fragments (left by a larger setting) go to the
    worker holding the highest fragment, so none is stranded."""
    row = table.add(12, ms(0.2))
    low, low_delivered = make_worker(table, clock)
    high, high_delivered = make_worker(table, clock)
    low.set_fragments((1, 2, 3, 4))
    high.set_fragments((5, 6, 7, 8))
    clock.advance(0.2)
    assert not low_delivered and [m.message_id for m in high_delivered] == [row.id]


def test_notified_insert_inside_the_window_is_not_late(table, clock):
    """A row committed after the poll but due before the next one is put on a timer by
    notify, instead of waiting for that poll."""
    worker, delivered = make_worker(table, clock)
    worker.set_fragments((1,))
    clock.advance(0.1)
    row = table.add(1, ms(0.4))
    worker.notify(row.due_ms)
    clock.advance(0.31)
    assert [m.message_id for m in delivered] == [row.id]
    assert table.moves[-1][0] == pytest.approx(T0 + 0.4)


def test_notification_during_a_poll_is_kept(table, clock):
    """A due time notified while a poll is in flight survives the poll's answer."""
    db = HeldDb()
    worker, delivered = make_worker(table, clock, db=db)
    worker.set_fragments((1,))  # poll pending
    row = table.add(1, ms(0.3))  # committed after the poll's snapshot...
    table_rows, table.rows = table.rows, []  # ...so the poll does not see it
    worker.notify(row.due_ms)
    db.release_all()
    table.rows = table_rows
    clock.advance(0.3)
    db.release_all()
    assert [m.message_id for m in delivered] == [row.id]


def test_steady_stream_is_batched_by_the_tick(table, clock):
    """Rows due every millisecond are moved in batches at most one tick apart, each at most
    one tick late: 1000 rows over a second cost about 100 moves, not 1000."""
    for i in range(1000):
        table.add(1, ms(0.5 + i / 1000))
    worker, delivered = make_worker(table, clock, batch_size=5000)
    worker.set_fragments((1,))
    for _ in range(200):
        clock.advance(0.01)
    assert len(delivered) == 1000
    assert len(table.moves) <= 110
    assert worker.max_late_ms <= 10


def test_full_batch_moves_again_at_once(table, clock):
    """When more rows are due than one batch holds, the worker moves again right away."""
    for _ in range(25):
        table.add(1, ms(0.1))
    worker, delivered = make_worker(table, clock, batch_size=10)
    worker.set_fragments((1,))
    clock.advance(0.1)
    assert len(delivered) == 25
    assert [len(ids) for _, ids in table.moves[:3]] == [10, 10, 5]


def test_storage_failure_retries_with_backoff(table, clock):
    """A failing poll is retried after a pause; the row still moves once the database answers."""
    row = table.add(1, ms(0.05))
    db = SyncDb(fail_next=2)
    worker, delivered = make_worker(table, clock, db=db)
    worker.set_fragments((1,))
    assert "unreachable" in worker.last_error
    clock.advance(0.1)  # first retry fails too
    clock.advance(0.2)  # second retry polls; the row is overdue and moves at once
    clock.advance(0.01)
    assert [m.message_id for m in delivered] == [row.id]


def test_moves_wait_while_the_database_is_busy(table, clock):
    """A timer that fires during a slow poll does not start a second transaction; the move
    runs as soon as the poll answers."""
    db = HeldDb()
    row = table.add(1, ms(0.0))
    worker, delivered = make_worker(table, clock, db=db)
    worker.set_fragments((1,))
    worker.move_now()  # busy: remembered
    assert len(db.pending) == 1
    db.release_all()  # poll answers, then the remembered move runs and answers
    assert [m.message_id for m in delivered] == [row.id]


class FakeScheduler:
    def __init__(self):
        self.jobs: list[dict] = []

    def add_job(self, func, trigger, **kw):
        job = dict(func=func, trigger=trigger, **kw)
        self.jobs.append(job)
        return type("Job", (), {"remove": lambda self: None})()


def test_scheduler_splits_fragments_and_registers_poll_jobs(table, clock):
    """Eight fragments over two workers: 1-4 and 5-8, one APScheduler interval job each."""
    scheduler = FakeScheduler()
    delays = DelayScheduler(
        clock=clock,
        dbs=[SyncDb(), SyncDb()],
        assignment=StaticAssignment(8),
        fragments=8,
        poll_interval=0.5,
        batch_size=100,
        tick=0.01,
        node_id="n1",
        on_moved=lambda moved: None,
        scheduler=scheduler,
        peek=table.peek,
        move=table.move,
    )
    delays.start()
    assert [w.fragments for w in delays.workers] == [(1, 2, 3, 4), (5, 6, 7, 8)]
    assert [(j["trigger"], j["seconds"], j["id"]) for j in scheduler.jobs] == [
        ("interval", 0.5, "delay-worker-1"),
        ("interval", 0.5, "delay-worker-2"),
    ]
    assert [w["range"] for w in delays.stats()["workers"]] == ["1-4", "5-8"]


def test_scheduler_routes_notifications_and_rebalances(table, clock):
    """notify reaches the worker owning the fragment; a new assignment re-splits the runs."""
    delivered: list = []
    delays = DelayScheduler(
        clock=clock,
        dbs=[SyncDb(), SyncDb()],
        assignment=StaticAssignment(8),
        fragments=8,
        poll_interval=1.0,
        batch_size=100,
        tick=0.01,
        node_id="n1",
        on_moved=delivered.extend,
        peek=table.peek,
        move=table.move,
    )
    delays.start()
    row = table.add(6, ms(0.25))
    delays.notify([StoredDelay(row.id, row.due_ms, 6, False)])
    assert delays.workers[1].stats()["timers_pending"] == 1
    clock.advance(0.25)
    assert [m.message_id for m in delivered] == [row.id]
    delays.reassign(frozenset({2, 3, 5}))  # a cluster rebalance took the rest elsewhere
    assert [w.fragments for w in delays.workers] == [(2, 3), (5,)]
    assert 1 <= delays.pick_fragment() <= 8


def test_truncated_poll_polls_again_once_its_rows_are_moved(table, clock):
    """A poll that hits its limit (10 batches of due times) knows the window only up to its
    last row; once the timers got there the worker polls again instead of idling."""
    rows = [table.add(1, ms(0.1 + i / 100)) for i in range(30)]
    worker, delivered = make_worker(table, clock, batch_size=2)  # peek limit 20
    worker.set_fragments((1,))
    assert worker.stats()["timers_pending"] == 20
    for _ in range(60):
        clock.advance(0.01)
    assert sorted(m.message_id for m in delivered) == [r.id for r in rows]
    assert table.peeks >= 2
