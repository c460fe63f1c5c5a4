"""Unit tests of ``dmq_server.reliable.writer``: group commit of sends, batched durable acks.

The database is a fake ``DbWorker`` whose ``run_steps(fn, *args)`` returns a Deferred
the test fires by hand, so each test decides exactly when a "transaction"
commits or fails and can look at what is queued in between. Time is a
``task.Clock``; nothing sleeps and nothing touches PostgreSQL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher
from twisted.python.failure import Failure

from dmq_server.db.storage_errors import RefusedError, StorageError
from dmq_server.db.messages import AckRow, AckRun, NewMessage, StoredMessage, ack_deliveries_steps, insert_messages_steps
from dmq_server.reliable.writer import AckBatcher, GroupCommitWriter, ShuttingDown


# -- fakes ----------------------------------------------------------------
@dataclass
class Call:
    """One ``run_steps`` on the fake worker: a transaction the test completes by hand."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    deferred: Deferred

    @property
    def batch(self) -> list[Any]:
        return list(self.args[0])

    def commit(self, result: Any = None) -> None:
        self.deferred.callback(result)

    def fail(self, error: BaseException) -> None:
        self.deferred.errback(Failure(error))


class FakeDbWorker:
    """Stands in for ``store.DbWorker``: records calls, never runs them."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def run_steps(self, fn: Callable[..., Any], *args: Any) -> Deferred:
        call = Call(fn, args, Deferred())
        self.calls.append(call)
        return call.deferred

    @property
    def last(self) -> Call:
        return self.calls[-1]


class Outcome:
    """Records how a Deferred fired (result or failure) without leaving errors unhandled."""

    def __init__(self, d: Deferred):
        self.fired = False
        self.result: Any = None
        self.failure: Failure | None = None
        d.addCallbacks(self._ok, self._failed)

    def _ok(self, result: Any) -> None:
        self.fired, self.result = True, result

    def _failed(self, failure: Failure) -> None:
        self.fired, self.failure = True, failure


def new_message(session_id: int) -> NewMessage:
    return NewMessage("orders", "producer-1", session_id, 0, b"body-%d" % session_id)


def stored_for(call: Call, first_id: int = 100) -> list[StoredMessage]:
    """What insert_messages_steps would return for a call's batch."""
    return [
        StoredMessage(first_id + i, 5_000, ("billing",), False) for i, _ in enumerate(call.batch)
    ]


def session_ids(call: Call) -> list[int]:
    return [m.session_id for m in call.batch]


def make_writer(max_batch: int = 100) -> tuple[GroupCommitWriter, FakeDbWorker, list[tuple[bool, str]]]:
    worker = FakeDbWorker()
    health: list[tuple[bool, str]] = []
    writer = GroupCommitWriter(worker, "node-1", max_batch, lambda ok, why: health.append((ok, why)))
    return writer, worker, health


# -- GroupCommitWriter ------------------------------------------------------
def test_first_send_starts_a_transaction_at_once() -> None:
    """An idle writer does not wait to fill a batch: one send, one transaction right away."""
    writer, worker, _ = make_writer()
    writer.submit(new_message(1))
    (call,) = worker.calls
    assert call.fn is insert_messages_steps
    assert session_ids(call) == [1]
    assert call.args[1] == "node-1"


def test_sends_queued_during_a_commit_go_together_in_the_next_batch() -> None:
    """Group commit: whatever queues while one transaction runs is stored by the next one."""
    writer, worker, _ = make_writer()
    writer.submit(new_message(1))
    for sid in (2, 3, 4):
        writer.submit(new_message(sid))
    assert len(worker.calls) == 1 and writer.pending == 3
    worker.calls[0].commit(stored_for(worker.calls[0]))
    assert len(worker.calls) == 2
    assert session_ids(worker.calls[1]) == [2, 3, 4]
    assert writer.pending == 0


def test_max_batch_size_is_respected() -> None:
    """No transaction carries more than max_batch messages; the rest follow, in order."""
    writer, worker, _ = make_writer(max_batch=3)
    for sid in range(1, 9):
        writer.submit(new_message(sid))
    while len(worker.calls) < 4:
        worker.last.commit(stored_for(worker.last))
    assert [session_ids(c) for c in worker.calls] == [[1], [2, 3, 4], [5, 6, 7], [8]]
    worker.last.commit(stored_for(worker.last))
    assert len(worker.calls) == 4  # nothing left: no empty transaction
    assert (writer.batches, writer.messages) == (4, 8)


def test_each_send_fires_only_after_its_own_batch_commits() -> None:
    """A producer hears "stored" only when the transaction holding its message committed,
    and gets that message's own StoredMessage."""
    writer, worker, _ = make_writer()
    first = Outcome(writer.submit(new_message(1)))
    second = Outcome(writer.submit(new_message(2)))
    third = Outcome(writer.submit(new_message(3)))
    assert not (first.fired or second.fired or third.fired)

    worker.calls[0].commit(stored_for(worker.calls[0], first_id=10))
    assert first.result == StoredMessage(10, 5_000, ("billing",), False)
    assert not second.fired and not third.fired

    worker.calls[1].commit(stored_for(worker.calls[1], first_id=20))
    assert second.result.message_id == 20
    assert third.result.message_id == 21


def test_failed_batch_errbacks_exactly_its_sends_and_the_next_batch_runs() -> None:
    """A StorageError fails the sends of that transaction only, with a StorageError each;
    sends queued behind it go in the next transaction, and health follows the outcome."""
    writer, worker, health = make_writer()
    first = Outcome(writer.submit(new_message(1)))
    second = Outcome(writer.submit(new_message(2)))
    third = Outcome(writer.submit(new_message(3)))
    worker.calls[0].commit(stored_for(worker.calls[0]))
    fourth = Outcome(writer.submit(new_message(4)))

    worker.calls[1].fail(StorageError("writer: disk full"))
    for failed in (second, third):
        assert failed.failure is not None
        assert failed.failure.check(StorageError)
        assert "disk full" in str(failed.failure.value)
    assert first.failure is None and first.fired
    assert not fourth.fired
    assert health == [(True, ""), (False, "writer: disk full")]

    assert session_ids(worker.last) == [4]
    worker.last.commit(stored_for(worker.last))
    assert fourth.result is not None
    assert health[-1] == (True, "")
    assert (writer.batches, writer.messages) == (2, 2)


def test_a_refused_batch_is_split_until_only_the_bad_send_fails() -> None:
    """PostgreSQL refusing a batch's input (RefusedError: nothing committed) says one row
    is bad, not which: the writer halves the batch, runs each part alone, and in the end
    fails only the bad send; every other send of the batch is stored and answered."""
    writer, worker, health = make_writer()
    writer.submit(new_message(0))  # occupies the worker so the next eight form one batch
    outcomes = {sid: Outcome(writer.submit(new_message(sid))) for sid in range(1, 9)}
    worker.last.commit(stored_for(worker.last))
    assert session_ids(worker.last) == list(range(1, 9))
    bad = 6
    while not worker.last.deferred.called:  # each part runs alone, one after the other
        call = worker.last
        if bad in session_ids(call):
            call.fail(RefusedError("writer0: timestamp out of range", "22008"))
        else:
            call.commit(stored_for(call, first_id=100 + session_ids(call)[0]))
    for sid, outcome in outcomes.items():
        assert outcome.fired
        if sid == bad:
            assert outcome.failure is not None and outcome.failure.check(RefusedError)
            assert "timestamp out of range" in str(outcome.failure.value)
        else:
            assert outcome.failure is None, sid
            assert outcome.result.message_id == 100 + sid
    # halving 8 rows, the refused part's halves first: log2(8) more runs, not 8
    assert [session_ids(c) for c in worker.calls[1:]] == [
        list(range(1, 9)), [1, 2, 3, 4], [5, 6, 7, 8], [5, 6], [5], [6], [7, 8]
    ]
    assert (False, "writer0: timestamp out of range") not in health  # not a storage outage


class RunAnswers:
    """An ``answer(start, outcomes)`` that records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[Any]]] = []

    def __call__(self, start: int, outcomes: list[Any]) -> None:
        self.calls.append((start, list(outcomes)))

    def by_place(self) -> dict[int, Any]:
        """Each position's outcome; fails if any position was answered twice."""
        places: dict[int, Any] = {}
        for start, outcomes in self.calls:
            for place, outcome in enumerate(outcomes, start):
                assert place not in places, f"position {place} answered twice"
                places[place] = outcome
        return places


def test_a_run_is_answered_in_one_call_per_batch_it_lands_in() -> None:
    """Two runs queued behind a commit, the second longer than a batch (max 4): the next
    batch ends before it, the one after inside it, so the first run is answered in one
    call, the second in two (its first four sends, then from position 4 on), each send
    once, with its own stored message."""
    writer, worker, _ = make_writer(max_batch=4)
    writer.submit(new_message(0))
    first, second = RunAnswers(), RunAnswers()
    writer.submit_run([new_message(sid) for sid in (1, 2)], first)
    writer.submit_run([new_message(sid) for sid in (3, 4, 5, 6, 7, 8)], second)
    worker.last.commit(stored_for(worker.last))
    assert session_ids(worker.last) == [1, 2]
    worker.last.commit(stored_for(worker.last, first_id=101))
    assert [(start, [m.message_id for m in out]) for start, out in first.calls] == [(0, [101, 102])]
    assert session_ids(worker.last) == [3, 4, 5, 6]
    worker.last.commit(stored_for(worker.last, first_id=103))
    assert [(start, [m.message_id for m in out]) for start, out in second.calls] == [(0, [103, 104, 105, 106])]
    assert session_ids(worker.last) == [7, 8]
    worker.last.commit(stored_for(worker.last, first_id=107))
    assert [(start, [m.message_id for m in out]) for start, out in second.calls[1:]] == [(4, [107, 108])]


def test_a_batch_ends_before_a_run_it_would_cut_unless_the_run_is_longer_than_a_batch() -> None:
    """max 4: a run of 6 is cut after 4 (it fits in no batch); its tail of 2 goes without
    the next run of 3, which would be cut; that run goes whole."""
    writer, worker, _ = make_writer(max_batch=4)
    writer.submit(new_message(0))
    writer.submit_run([new_message(sid) for sid in range(1, 7)], RunAnswers())
    writer.submit_run([new_message(sid) for sid in (7, 8, 9)], RunAnswers())
    writer.submit(new_message(10))
    while writer.pending:
        worker.last.commit(stored_for(worker.last))
    assert [session_ids(c) for c in worker.calls] == [[0], [1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]


def test_a_refused_run_is_split_and_each_part_answered_at_its_place() -> None:
    """A run of six with one bad send: the halving answers every send once, at its
    position, the bad one with the refusal (fails if a part's start is lost)."""
    writer, worker, _ = make_writer()
    writer.submit(new_message(0))
    run = RunAnswers()
    writer.submit_run([new_message(sid) for sid in range(1, 7)], run)
    worker.last.commit(stored_for(worker.last))
    bad = 4
    while not worker.last.deferred.called:
        call = worker.last
        if bad in session_ids(call):
            call.fail(RefusedError("writer0: value too long", "22001"))
        else:
            call.commit(stored_for(call, first_id=100 + session_ids(call)[0]))
    places = run.by_place()
    assert sorted(places) == list(range(6)) and len(run.calls) > 2
    for place, outcome in places.items():
        if place + 1 == bad:
            assert isinstance(outcome, RefusedError)
        else:
            assert outcome.message_id == 101 + place


def test_runs_of_unknown_outcome_and_a_failing_answer() -> None:
    """A batch of unknown outcome answers each run's sends with the error, once; an answer
    that raises fails no other run; the same answer given two runs answers each at its
    own positions (fails if runs that share an answer are merged)."""
    writer, worker, _ = make_writer()
    writer.submit(new_message(0))
    shared, other = RunAnswers(), RunAnswers()

    def raising(start: int, outcomes: list[Any]) -> None:
        raise RuntimeError("a broken connection's answer")

    writer.submit_run([new_message(1), new_message(2)], shared)
    writer.submit_run([new_message(3), new_message(4)], shared)
    writer.submit_run([new_message(5)], raising)
    writer.submit_run([new_message(6)], other)
    worker.last.commit(stored_for(worker.last))
    worker.last.fail(StorageError("writer0: server closed the connection unexpectedly"))
    assert [start for start, _ in shared.calls] == [0, 0] and [len(o) for _, o in shared.calls] == [2, 2]
    assert all(isinstance(o, StorageError) for _, out in shared.calls + other.calls for o in out)
    assert len(other.calls) == 1


def test_sends_queued_behind_a_refused_batch_wait_for_its_parts() -> None:
    """The parts of a refused batch run before newer sends, and newer sends are never mixed
    into a part (a part is the smallest set known to hold the bad row)."""
    writer, worker, _ = make_writer()
    writer.submit(new_message(0))
    first = [Outcome(writer.submit(new_message(sid))) for sid in (1, 2)]
    worker.last.commit(stored_for(worker.last))
    later = Outcome(writer.submit(new_message(3)))
    worker.last.fail(RefusedError("writer0: value too long", "22001"))
    assert session_ids(worker.last) == [1]
    worker.last.commit(stored_for(worker.last))
    assert session_ids(worker.last) == [2]
    worker.last.fail(RefusedError("writer0: value too long", "22001"))
    assert session_ids(worker.last) == [3]
    worker.last.commit(stored_for(worker.last))
    assert first[0].result is not None and first[1].failure is not None and later.result is not None


def test_a_batch_of_unknown_outcome_is_reported_with_its_messages() -> None:
    """A failure that is not a refusal (connection lost: the batch may have committed) is
    answered with the error and reported to ``on_unknown`` with every message of the
    batch, so the broker can look in the store; a refused batch is not reported."""
    worker = FakeDbWorker()
    unknown: list[list[NewMessage]] = []
    writer = GroupCommitWriter(worker, "node-1", 100, lambda ok, why: None, on_unknown=unknown.append)
    sends = [Outcome(writer.submit(new_message(sid))) for sid in (1,)]
    worker.last.fail(StorageError("writer0: server closed the connection unexpectedly"))
    assert sends[0].failure is not None and sends[0].failure.check(StorageError)
    assert [[m.session_id for m in batch] for batch in unknown] == [[1]]
    refused = Outcome(writer.submit(new_message(2)))
    worker.last.fail(RefusedError("writer0: bad input", "22000"))
    assert refused.failure is not None and len(unknown) == 1


def test_unexpected_error_becomes_a_storage_error_and_is_logged() -> None:
    """A bug below the writer (not a StorageError) still answers every send of the batch
    with a StorageError, and is logged with its traceback."""
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        writer, worker, health = make_writer()
        send = Outcome(writer.submit(new_message(1)))
        worker.last.fail(KeyError("oops"))
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert send.failure is not None and send.failure.check(StorageError)
    assert "internal error" in str(send.failure.value)
    assert health == [(False, "internal error: KeyError('oops')")]
    assert any(e.get("log_failure") is not None for e in events)


def test_close_when_idle_fires_at_once_and_refuses_new_sends() -> None:
    """close() on an idle writer is done immediately; later sends fail with ShuttingDown
    without touching the database."""
    writer, worker, _ = make_writer()
    closed = Outcome(writer.close())
    assert closed.fired and closed.failure is None
    refused = Outcome(writer.submit(new_message(1)))
    assert refused.failure is not None and refused.failure.check(ShuttingDown)
    assert worker.calls == []


def test_close_fires_once_everything_queued_is_answered() -> None:
    """close() while busy refuses new sends at once but fires only after the running
    transaction and the queued ones have all been answered, failures included."""
    writer, worker, _ = make_writer(max_batch=2)
    sends = [Outcome(writer.submit(new_message(sid))) for sid in range(1, 5)]
    closed = Outcome(writer.close())
    late = Outcome(writer.submit(new_message(99)))
    assert late.failure is not None and late.failure.check(ShuttingDown)
    assert not closed.fired

    worker.last.commit(stored_for(worker.last))  # [1]
    assert not closed.fired
    worker.last.fail(StorageError("connection lost"))  # [2, 3]
    assert not closed.fired
    worker.last.commit(stored_for(worker.last))  # [4]
    assert closed.fired and closed.failure is None
    assert [s.fired for s in sends] == [True] * 4
    assert all(session_ids(c) != [99] for c in worker.calls)


def test_next_transaction_starts_before_the_committed_batch_is_answered() -> None:
    """While the reactor writes acknowledgements for one batch, PostgreSQL already works
    on the next: the queued sends are handed to the worker before any reply goes out."""
    writer, worker, _ = make_writer()
    calls_seen_by_first: list[int] = []
    writer.submit(new_message(1)).addCallback(lambda _: calls_seen_by_first.append(len(worker.calls)))
    writer.submit(new_message(2))
    worker.calls[0].commit(stored_for(worker.calls[0]))
    assert calls_seen_by_first == [2]


def test_submit_cb_reports_the_stored_message_or_the_exception() -> None:
    """The Deferred-free hot path calls ``done`` with the StoredMessage, the StorageError,
    or ShuttingDown once closed."""
    writer, worker, _ = make_writer()
    outcomes: list[object] = []
    writer.submit_cb(new_message(1), outcomes.append)
    writer.submit_cb(new_message(2), outcomes.append)
    worker.last.commit(stored_for(worker.last, first_id=7))
    worker.last.fail(StorageError("gone"))
    writer.close()
    writer.submit_cb(new_message(3), outcomes.append)
    assert outcomes[0] == StoredMessage(7, 5_000, ("billing",), False)
    assert isinstance(outcomes[1], StorageError) and "gone" in str(outcomes[1])
    assert isinstance(outcomes[2], ShuttingDown)


def test_a_failing_completion_does_not_starve_the_rest_of_the_batch() -> None:
    """If one sender's completion raises, it is logged and the other senders of the same
    batch are still answered; the writer keeps going."""
    events: list[dict] = []
    writer, worker, _ = make_writer()
    answered: list[int] = []

    def explode(outcome: object) -> None:
        raise RuntimeError("client went away badly")

    writer.submit_cb(new_message(1), lambda o: answered.append(1))
    writer.submit_cb(new_message(2), explode)
    writer.submit_cb(new_message(3), lambda o: answered.append(3))
    globalLogPublisher.addObserver(events.append)
    try:
        worker.last.commit(stored_for(worker.last))
        worker.last.commit(stored_for(worker.last))
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert answered == [1, 3]
    assert any(e.get("log_failure") is not None for e in events)
    writer.submit_cb(new_message(4), lambda o: answered.append(4))
    worker.last.commit(stored_for(worker.last))
    assert answered == [1, 3, 4]


def test_on_batch_runs_after_the_answers_and_before_the_write_is_settled() -> None:
    """The store hands a batch's copies to its channels in ``on_batch``: after every
    send of the batch is answered (a failing answer included) and before the write is
    settled, which says the batch's messages are in the channels (horizon.OwnWrites)."""
    events: list[str] = []

    class Writes:
        owner = 3

        def begin(self) -> int:
            return 1

        def seen(self, message_id: int) -> None:
            events.append(f"seen {message_id}")

        def end(self, token: int) -> None:
            events.append("end")

    def explode(outcome: object) -> None:
        events.append("answered 2")
        raise RuntimeError("client went away badly")

    def on_batch() -> None:
        events.append("on_batch")
        raise RuntimeError("a bug in a channel")  # logged: the write is still settled

    worker = FakeDbWorker()
    writer = GroupCommitWriter(worker, "node-1", 100, writes=Writes(), on_batch=on_batch)
    writer.submit_cb(new_message(0), lambda o: None)  # a transaction at once: the next two wait for it
    writer.submit_cb(new_message(1), lambda o: events.append("answered 1"))
    writer.submit_cb(new_message(2), explode)
    logged: list[dict] = []
    globalLogPublisher.addObserver(logged.append)
    try:
        worker.last.commit(stored_for(worker.last, first_id=6))
        assert session_ids(worker.last) == [1, 2]
        events.clear()
        worker.last.commit(stored_for(worker.last, first_id=7))
    finally:
        globalLogPublisher.removeObserver(logged.append)
    assert events == ["answered 1", "answered 2", "on_batch", "seen 7", "seen 8", "end"]
    assert sum(1 for e in logged if e.get("log_failure") is not None) == 3  # on_batch twice, explode once


def make_writers(count: int, max_batch: int = 100, parallel_min: int = 1) -> tuple[GroupCommitWriter, list[FakeDbWorker]]:
    workers = [FakeDbWorker() for _ in range(count)]
    return GroupCommitWriter(workers, "node-1", max_batch, parallel_min=parallel_min), workers


def test_a_second_transaction_starts_only_for_enough_waiting_sends() -> None:
    """While one transaction is in flight, sends wait for it until ``parallel_min`` of them
    are queued; then the idle writer takes them all at once."""
    writer, (w1, w2) = make_writers(2, parallel_min=3)
    writer.submit(new_message(1))
    running = w1 if w1.calls else w2
    idle = w2 if running is w1 else w1
    writer.submit(new_message(2))
    writer.submit(new_message(3))
    assert not idle.calls and writer.pending == 2
    writer.submit(new_message(4))
    assert session_ids(idle.last) == [2, 3, 4] and writer.pending == 0


def test_sends_too_few_for_their_own_transaction_go_with_the_next_commit() -> None:
    """Below ``parallel_min`` the waiting sends are one batch as soon as the running
    transaction commits, whichever worker takes it."""
    writer, workers = make_writers(2, parallel_min=64)
    first = Outcome(writer.submit(new_message(1)))
    rest = [Outcome(writer.submit(new_message(sid))) for sid in (2, 3, 4)]
    (running,) = [w for w in workers if w.calls]
    assert writer.pending == 3
    running.last.commit(stored_for(running.last))
    assert first.fired and not any(o.fired for o in rest)
    (batch,) = [w.last for w in workers if w.calls and session_ids(w.last) != [1]]
    assert session_ids(batch) == [2, 3, 4]


def make_spaced(interval: float = 0.002, parallel_min: int = 4) -> tuple[GroupCommitWriter, list[FakeDbWorker], Clock]:
    clock = Clock()
    workers = [FakeDbWorker() for _ in range(2)]
    writer = GroupCommitWriter(workers, "node-1", 100, clock=clock, parallel_min=parallel_min, interval=interval)
    return writer, workers, clock


def calls(workers: list[FakeDbWorker]) -> list[Call]:
    return [c for w in workers for c in w.calls]


def first_committed(interval: float, after: float = 0.0, parallel_min: int = 4) -> tuple[
        GroupCommitWriter, list[FakeDbWorker], Clock, Deferred]:
    """Send 1 alone in a transaction, send 2 waiting behind it; the transaction committed
    ``after`` seconds after it started. Returns send 2's Deferred too."""
    writer, workers, clock = make_spaced(interval=interval, parallel_min=parallel_min)
    writer.submit(new_message(1))
    second = writer.submit(new_message(2))
    (call,) = calls(workers)
    clock.advance(after)
    call.commit(stored_for(call))
    return writer, workers, clock, second


def test_a_send_to_an_idle_writer_does_not_wait_for_the_interval() -> None:
    """The commit interval holds only sends that arrived during a commit: a lone send (a
    producer that waits for each answer) starts its transaction at once."""
    writer, workers, clock = make_spaced()
    first = Outcome(writer.submit(new_message(1)))
    (call,) = calls(workers)
    call.commit(stored_for(call))
    assert first.fired and clock.getDelayedCalls() == []
    writer.submit(new_message(2))
    assert [session_ids(c) for c in calls(workers)] == [[1], [2]]


def test_sends_that_arrived_during_a_commit_start_an_interval_after_it_started() -> None:
    """A commit answered 0.5 ms after its start leaves the sends that came meanwhile
    waiting until 2 ms after that start; the sends arriving then join them."""
    writer, workers, clock, _ = first_committed(interval=0.002, after=0.0005)
    assert len(calls(workers)) == 1 and writer.pending == 1
    clock.advance(0.001)
    writer.submit(new_message(3))
    assert len(calls(workers)) == 1
    clock.advance(0.0005)
    assert [session_ids(c) for c in calls(workers)] == [[1], [2, 3]] and writer.pending == 0


def test_a_commit_slower_than_the_interval_is_followed_at_once() -> None:
    """The interval only spaces fast commits: after one that took longer, the waiting
    sends start at once."""
    writer, workers, clock, _ = first_committed(interval=0.002, after=0.003)
    assert [session_ids(c) for c in calls(workers)] == [[1], [2]] and clock.getDelayedCalls() == []


def test_enough_sends_end_the_wait_at_once() -> None:
    """``parallel_min`` waiting sends are a transaction's worth: they start without waiting
    out the interval, and its timer goes."""
    writer, workers, clock, _ = first_committed(interval=0.002, parallel_min=4)
    for sid in (3, 4):
        writer.submit(new_message(sid))
    assert len(calls(workers)) == 1
    writer.submit(new_message(5))
    assert [session_ids(c) for c in calls(workers)] == [[1], [2, 3, 4, 5]]
    assert clock.getDelayedCalls() == []


def test_closing_ends_the_wait() -> None:
    """A shutdown does not wait out the interval: the held sends start at once and
    ``close`` fires when they are answered."""
    writer, workers, clock, pending = first_committed(interval=0.5)
    second = Outcome(pending)
    closed = Outcome(writer.close())
    assert [session_ids(c) for c in calls(workers)] == [[1], [2]] and clock.getDelayedCalls() == []
    calls(workers)[1].commit(stored_for(calls(workers)[1]))
    assert second.fired and closed.fired


def test_several_workers_run_batches_concurrently() -> None:
    """With two writer connections, two transactions run at once; sends arriving while
    both are busy wait and go together to whichever worker frees up first."""
    writer, (w1, w2) = make_writers(2)
    writer.submit(new_message(1))
    writer.submit(new_message(2))
    busy = [w for w in (w1, w2) if w.calls]
    assert len(busy) == 2, "the second send should start on the idle worker"
    for sid in (3, 4, 5):
        writer.submit(new_message(sid))
    assert writer.pending == 3
    first_done = w2 if session_ids(w2.calls[0]) == [2] else w1
    first_done.last.commit(stored_for(first_done.last))
    assert session_ids(first_done.last) == [3, 4, 5]
    assert writer.pending == 0


def test_out_of_order_commits_answer_only_their_own_sends() -> None:
    """The later transaction may commit first; it answers its sends and only those."""
    writer, (w1, w2) = make_writers(2)
    first = Outcome(writer.submit(new_message(1)))
    second = Outcome(writer.submit(new_message(2)))
    early, late = (w1, w2) if session_ids(w1.calls[0]) == [2] else (w2, w1)
    early.last.commit(stored_for(early.last, first_id=20))
    assert second.result.message_id == 20 and not first.fired
    late.last.fail(StorageError("serialization failure"))
    assert first.failure is not None and first.failure.check(StorageError)


def test_close_waits_for_every_worker() -> None:
    """close() fires only when no worker has a transaction left."""
    writer, (w1, w2) = make_writers(2)
    writer.submit(new_message(1))
    writer.submit(new_message(2))
    closed = Outcome(writer.close())
    w1.last.commit(stored_for(w1.last))
    assert not closed.fired
    w2.last.commit(stored_for(w2.last))
    assert closed.fired


# -- AckBatcher ---------------------------------------------------------------
def ack_row(message_id: int) -> AckRun:
    return AckRun.of(AckRow("orders", "billing", message_id, 1_000, 2_000, 1))


def ack_run(ids: list[int]) -> AckRun:
    """One consumer's acks of several copies together, as ``ReliableStore._on_acks`` makes them."""
    return AckRun("orders", "billing", "c", 2_000, False, list(ids), [7] * len(ids), [i + 10 for i in ids],
                  [1_000] * len(ids), [1] * len(ids), [1_500 + i for i in ids])


def make_acker(
    max_batch: int = 3, interval: float = 0.01
) -> tuple[AckBatcher, FakeDbWorker, Clock, list[tuple[list[int], list]]]:
    worker = FakeDbWorker()
    clock = Clock()
    done: list[tuple[list[int], list]] = []
    acker = AckBatcher(
        worker, clock, max_batch, interval, lambda runs, ok: done.append(([i for r in runs for i in r.message_ids], ok))
    )
    return acker, worker, clock, done


def run_statement(call: Call) -> dict[str, Any]:
    """The parameters of the statement the call's steps send (the batch's arrays)."""
    return dict(next(call.fn(*call.args)).params)


def ack_ids(call: Call) -> list[int]:
    return [mid for run in call.batch for mid in run.message_ids]


def test_acks_wait_for_the_flush_interval() -> None:
    """A few acks are held for the flush interval, then made durable in one transaction."""
    acker, worker, clock, done = make_acker(max_batch=10, interval=0.01)
    acker.add(ack_row(1))
    clock.advance(0.005)
    acker.add(ack_row(2))
    assert worker.calls == [] and acker.pending == 2
    clock.advance(0.005)
    (call,) = worker.calls
    assert call.fn is ack_deliveries_steps
    assert ack_ids(call) == [1, 2]
    call.commit([])
    assert done == [([1, 2], [])]
    assert acker.acked == 2 and acker.pending == 0


def test_a_full_batch_flushes_without_waiting() -> None:
    """Reaching max_batch flushes at once; the interval timer is then not needed."""
    acker, worker, clock, done = make_acker(max_batch=3)
    for mid in (1, 2, 3):
        acker.add(ack_row(mid))
    assert [ack_ids(c) for c in worker.calls] == [[1, 2, 3]]
    worker.last.commit([])
    clock.advance(1.0)
    assert len(worker.calls) == 1
    assert done == [([1, 2, 3], [])]
    assert clock.getDelayedCalls() == []


def test_acks_arriving_during_a_flush_follow_in_the_next_batch() -> None:
    """One ack transaction at a time: acks that arrive meanwhile (even a full batch's
    worth) go in later transactions, none over max_batch, none lost."""
    acker, worker, clock, done = make_acker(max_batch=2)
    for mid in range(1, 8):
        acker.add(ack_row(mid))
    assert [ack_ids(c) for c in worker.calls] == [[1, 2]]
    while True:
        calls = len(worker.calls)
        worker.last.commit(None)
        clock.advance(1.0)
        if len(worker.calls) == calls:
            break
    assert [ack_ids(c) for c in worker.calls] == [[1, 2], [3, 4], [5, 6], [7]]
    assert [ids for ids, _ in done] == [[1, 2], [3, 4], [5, 6], [7]]
    assert acker.acked == 7


def test_acks_added_together_are_batched_as_acks_added_one_by_one() -> None:
    """``add_many`` (one ack_held call's rows) waits for the interval below max_batch,
    flushes at once from max_batch on, never sends more than max_batch in one
    transaction, and queues behind a transaction in flight: the batches ``add`` makes."""
    batches = []
    for way in ("one by one", "together", "as runs"):
        acker, worker, clock, _ = make_acker(max_batch=3, interval=0.01)
        add = {
            "one by one": lambda ids: [acker.add(ack_row(mid)) for mid in ids],
            "together": lambda ids: acker.add_many([ack_row(mid) for mid in ids]),
            "as runs": lambda ids: acker.add_many([ack_run(ids)]),  # split where a batch ends
        }[way]
        for group in ([1, 2], [3, 4, 5, 6, 7], [8]):
            add(group)
        acker.add_many([])  # nothing: no flush, no timer of its own
        while worker.calls and not worker.last.deferred.called:
            worker.last.commit(None)
            clock.advance(1.0)
        batches.append([ack_ids(c) for c in worker.calls])
        assert acker.acked == 8 and acker.pending == 0
    assert batches[0] == batches[1] == batches[2] == [[1, 2, 3], [4, 5, 6], [7, 8]]


def test_a_run_split_where_a_batch_ends_keeps_each_acks_columns_together() -> None:
    """A run of 5 with room for 2 in the batch: the batch's statement gets the first 2
    acks with their own owner, times and attempts, and the next batch the other 3; an
    ack delivered twice stays counted (its attempts row is cleared) in the part it went to."""
    acker, worker, clock, done = make_acker(max_batch=4, interval=0.01)
    acker.add_many([ack_run([1, 2])])
    run = ack_run([3, 4, 5, 6, 7])
    run.attempts[3] = 2  # id 6 was delivered twice
    acker.add_many([run])
    first = worker.last
    assert ack_ids(first) == [1, 2, 3, 4] and acker.pending == 3
    params = run_statement(first)
    assert params["message_ids"] == [1, 2, 3, 4] and params["published_ms"] == [11, 12, 13, 14]
    assert params["delivered_ms"] == [1_501, 1_502, 1_503, 1_504] and params["c_ids"] == []
    assert params["g_low"] == [1] and params["g_high"] == [4] and params["g_acks"] == [4]
    first.commit([])
    clock.advance(0.01)
    params = run_statement(worker.last)
    assert params["message_ids"] == [5, 6, 7] and params["attempts"] == [1, 2, 1]
    assert params["consumers"] == ["c"] * 3 and params["owners"] == [7] * 3
    assert (params["c_ids"], params["c_owners"]) == ([6], [7])
    worker.last.commit([])
    assert [ids for ids, _ in done] == [[1, 2, 3, 4], [5, 6, 7]] and acker.acked == 7


def test_a_consumers_single_acks_queue_as_one_run() -> None:
    """Runs of one ack each (a consumer acknowledging one copy a frame) that share channel,
    consumer and time join the run queued last: the batch holds one run, its columns in
    order; a run that differs (another time) starts its own (fails without ``absorb``, or
    with it taking a run that differs)."""
    acker, worker, clock, done = make_acker(max_batch=100, interval=0.01)
    for mid in (1, 2, 3):
        acker.add_many([ack_run([mid])])
    later = ack_run([4])
    later.acked_ms += 1
    acker.add_many([later])
    assert acker.pending == 4
    clock.advance(0.01)
    batch = worker.last.batch
    assert [(run.message_ids, run.published_ms, run.acked_ms) for run in batch] == [
        ([1, 2, 3], [11, 12, 13], 2_000), ([4], [14], 2_001)]
    worker.last.commit([])
    assert [ids for ids, _ in done] == [[1, 2, 3, 4]] and acker.acked == 4


def test_failed_batch_is_retried_after_a_growing_backoff_without_losing_rows() -> None:
    """A failed ack transaction is retried after 0.1 s, then 0.2 s, ..., with its rows
    first and newer acks behind them; the consumer already moved on, so nothing is dropped."""
    acker, worker, clock, done = make_acker(max_batch=5, interval=0.01)
    for mid in (1, 2, 3):
        acker.add(ack_row(mid))
    clock.advance(0.01)
    assert ack_ids(worker.last) == [1, 2, 3]
    worker.last.fail(StorageError("acker: server closed the connection"))
    acker.add(ack_row(4))
    assert acker.pending == 4 and done == []

    clock.advance(0.099)
    assert len(worker.calls) == 1
    clock.advance(0.001)
    assert len(worker.calls) == 2 and ack_ids(worker.last) == [1, 2, 3, 4]

    worker.last.fail(StorageError("acker: still down"))
    clock.advance(0.199)
    assert len(worker.calls) == 2
    clock.advance(0.001)
    assert ack_ids(worker.last) == [1, 2, 3, 4]

    worker.last.commit([])
    assert done == [([1, 2, 3, 4], [])]
    assert acker.acked == 4 and acker.pending == 0
    assert len(worker.calls) == 3


def test_backoff_is_capped_at_five_seconds() -> None:
    """However long PostgreSQL stays down, retries come at least every 5 s."""
    acker, worker, clock, _ = make_acker(max_batch=1)
    acker.add(ack_row(1))
    for _ in range(12):
        worker.last.fail(StorageError("down"))
        calls = len(worker.calls)
        clock.advance(5.0)
        assert len(worker.calls) == calls + 1


def test_backoff_resets_after_a_success() -> None:
    """After a successful flush, the next failure waits the initial 0.1 s again."""
    acker, worker, clock, _ = make_acker(max_batch=1)
    acker.add(ack_row(1))
    worker.last.fail(StorageError("down"))
    clock.advance(0.1)
    worker.last.fail(StorageError("down"))
    clock.advance(0.2)
    worker.last.commit(1)
    acker.add(ack_row(2))
    worker.last.fail(StorageError("down again"))
    calls = len(worker.calls)
    clock.advance(0.1)
    assert len(worker.calls) == calls + 1 and ack_ids(worker.last) == [2]


def test_drain_when_idle_fires_at_once() -> None:
    """Nothing queued, nothing running: drain() is already done."""
    acker, worker, _, _ = make_acker()
    drained = Outcome(acker.drain())
    assert drained.fired and worker.calls == []


def test_drain_flushes_now_and_fires_when_all_acks_are_durable() -> None:
    """drain() does not wait for the interval, and fires only when every queued ack,
    including ones whose first attempt failed, has committed."""
    acker, worker, clock, done = make_acker(max_batch=2, interval=10.0)
    acker.add(ack_row(1))
    drained = Outcome(acker.drain())
    assert ack_ids(worker.last) == [1]
    acker.add(ack_row(2))
    acker.add(ack_row(3))
    worker.last.fail(StorageError("down"))
    assert not drained.fired
    clock.advance(0.1)
    assert ack_ids(worker.last) == [1, 2]
    worker.last.commit(2)
    assert not drained.fired
    assert ack_ids(worker.last) == [3]
    worker.last.commit(1)
    assert drained.fired
    assert [ids for ids, _ in done] == [[1, 2], [3]]


def test_new_acks_do_not_cut_the_retry_backoff_short() -> None:
    """With PostgreSQL down, acks keep arriving. The retry must still wait for its
    backoff instead of being triggered by every add() once max_batch rows are queued."""
    acker, worker, clock, _ = make_acker(max_batch=2)
    acker.add(ack_row(1))
    acker.add(ack_row(2))
    worker.last.fail(StorageError("down"))
    acker.add(ack_row(3))  # 3 queued >= max_batch
    acker.add(ack_row(4))
    assert len(worker.calls) == 1, "retried before the backoff elapsed"
    clock.advance(0.1)
    assert len(worker.calls) == 2


def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends() -> None:
    """Ten failed retries of a batch make one warning, not ten; the first commit after
    them makes one line saying how long it lasted and how many attempts failed."""
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        worker, clock = FakeDbWorker(), Clock()
        acker = AckBatcher(worker, clock, max_batch=10, flush_interval=0.05, on_done=lambda rows, ok: None)
        acker.add(ack_row(1))
        clock.advance(0.05)
        for _ in range(10):
            worker.last.fail(StorageError("acker: connection refused"))
            clock.advance(5.0)
        worker.last.commit(1)
    finally:
        globalLogPublisher.removeObserver(events.append)
    lines = [e["log_format"] for e in events if e.get("what") == "durable ack" and e["log_level"] > LogLevel.debug]
    assert lines == [
        "{dependency} outage: {what} failing ({why}); retrying quietly until it works",
        "{dependency} outage over after {seconds:.1f}s ({failures} failed attempts; {what} works again)",
    ]
    ended = [e for e in events if e.get("what") == "durable ack"][-1]
    assert ended["failures"] == 10 and ended["seconds"] == 50.0


def test_an_outage_of_several_components_is_logged_once_when_it_starts_and_once_when_it_ends() -> None:
    """Two batchers on the same database fail together: one warning at the start (the
    first to fail), one line at the end (the first to work again), however many retries;
    the second batcher's own recovery after the end adds nothing."""
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        clock = Clock()
        workers = FakeDbWorker(), FakeDbWorker()
        ackers = [AckBatcher(w, clock, max_batch=10, flush_interval=0.05, on_done=lambda rows, ok: None)
                  for w in workers]
        for acker in ackers:
            acker.add(ack_row(1))
        clock.advance(0.05)
        for _ in range(5):
            for worker in workers:
                worker.last.fail(StorageError("connection refused"))
            clock.advance(5.0)
        workers[0].last.commit(1)
        clock.advance(1.0)
        workers[1].last.commit(1)
    finally:
        globalLogPublisher.removeObserver(events.append)
    lines = [e for e in events if e.get("dependency") == "PostgreSQL" and e["log_level"] > LogLevel.debug]
    assert [(e["log_level"], e["what"]) for e in lines] == [(LogLevel.warn, "durable ack"), (LogLevel.info, "durable ack")]
    assert lines[1]["failures"] == 10 and lines[1]["seconds"] == 25.0


def test_the_ack_statement_gets_each_cursors_lowest_and_highest_id_and_count() -> None:
    """The common path of ``ack_deliveries`` reads only these per-cursor figures (g_*),
    whatever order a batch's acks come in."""
    def ack(channel: str, message_id: int, owner: int = 1) -> AckRow:
        return AckRow("orders", channel, message_id, 5, 6, 1, "c", 7, owner, 4)

    acks = [ack("a", 7), ack("b", 3), ack("a", 2), ack("a", 9), ack("b", 4), ack("a", 5, owner=2), ack("a", 8)]
    statement = next(ack_deliveries_steps(acks))
    p = statement.params
    assert list(zip(p["g_topics"], p["g_channels"], p["g_owners"], p["g_low"], p["g_high"], p["g_acks"])) == [
        ("orders", "a", 1, 2, 9, 4),
        ("orders", "b", 1, 3, 4, 2),
        ("orders", "a", 2, 5, 5, 1),
    ]
    assert (p["low_id"], p["high_id"], list(p["message_ids"])) == (2, 9, [7, 3, 2, 9, 4, 5, 8])


class HeldDbWorker:
    """A writer connection to one in-memory database (``db.memory.MemoryDb``) whose
    transaction runs when the test releases it: two of them run two batches "at once",
    and the one released first takes the lower message ids, as in PostgreSQL."""

    def __init__(self, db: Any) -> None:
        self.db = db
        self.held: list[tuple[Callable[..., Any], tuple[Any, ...], Deferred]] = []

    def run_steps(self, fn: Callable[..., Any], *args: Any) -> Deferred:
        d: Deferred = Deferred()
        self.held.append((fn, args, d))
        return d

    def release(self) -> None:
        fn, args, d = self.held.pop(0)
        self.db.run_steps(fn, *args).chainDeferred(d)


def test_with_two_writers_a_run_is_one_transactions_and_its_ids_keep_its_order() -> None:
    """Both writers busy, a run of 2 and then a run of 4 (the outbox relay's rows) queue
    behind them (max 4). The first writer to come free takes the run of 2 alone, not the
    first half of the run of 4 with it; the other writer takes the run of 4 whole. Were
    the run of 4 cut across both transactions, the one released first would give its
    second half the lower ids."""
    from dmq_server.db.memory import MemoryDb

    db = MemoryDb()
    db.create_topic("orders", ["billing"])
    db.owners[1] = {"node_id": "node-1", "retired": False, "seen_ms": 0}
    x, y = HeldDbWorker(db), HeldDbWorker(db)
    writer = GroupCommitWriter([x, y], "node-1", 4, insert=lambda batch, node: insert_messages_steps(batch, node, 1),
                               parallel_min=1)
    other, relay = RunAnswers(), RunAnswers()
    writer.submit(NewMessage("orders", "a", 1, 0, b"a"))
    writer.submit(NewMessage("orders", "b", 1, 0, b"b"))
    assert len(x.held) == len(y.held) == 1
    writer.submit_run([NewMessage("orders", "c", sid, 0, b"c") for sid in (1, 2)], other)
    writer.submit_run([NewMessage("orders", "outbox:shop:0a1b2c3d", sid, 0, b"r%d" % sid) for sid in (1, 2, 3, 4)],
                      relay)
    first, second = (x, y) if x.held[0][1][0][0].producer == "a" else (y, x)
    first.release()  # a commits: its writer takes the next batch
    second.release()  # b commits: its writer takes the rest
    batches = [[m.producer for m in held[1][0]] for held in (first.held[0], second.held[0])]
    second.release()  # the later transaction commits first
    first.release()
    ids = [m.message_id for _, outcomes in sorted(relay.calls) for m in outcomes]
    assert len(ids) == 4 and ids == sorted(ids), ids
    assert batches == [["c", "c"], ["outbox:shop:0a1b2c3d"] * 4]
    assert len(relay.calls) == 1 and len(other.calls) == 1 and writer.pending == 0


# -- serial runs: an ordered topic's sends -------------------------------------------------


def _in_flight(workers: list[FakeDbWorker]) -> list[Call]:
    return [c for w in workers for c in w.calls if not c.deferred.called]


def test_serial_runs_commit_one_transaction_at_a_time_beside_the_others() -> None:
    """With three writer connections, serial runs (an ordered topic's) never have two
    transactions under way: the next waits for the commit of the one before and then
    takes every serial send waiting; the other sends meanwhile commit side by side."""
    writer, workers = make_writers(3)
    serial = RunAnswers()
    writer.submit_run([new_message(1)], serial, serial=True)
    writer.submit_run([new_message(2), new_message(3)], serial, serial=True)
    writer.submit(new_message(10))
    running = _in_flight(workers)
    assert sorted(session_ids(c) for c in running) == [[1], [10]]  # 2 and 3 wait for 1
    first = next(c for c in running if session_ids(c) == [1])
    writer.submit(new_message(11))
    assert sorted(session_ids(c) for c in _in_flight(workers)) == [[1], [10], [11]]
    first.commit(stored_for(first))
    assert sorted(session_ids(c) for c in _in_flight(workers)) == [[2, 3], [10], [11]]
    assert writer.pending == 0


def test_a_refused_serial_batch_stays_serial_in_its_parts() -> None:
    """The halves of a refused serial batch run one after the other, never side by side
    (they would commit out of order), while another writer is free."""
    writer, workers = make_writers(2)
    writer.submit_run([new_message(i) for i in (1, 2, 3, 4)], RunAnswers(), serial=True)
    (batch,) = _in_flight(workers)
    batch.fail(RefusedError("bad row", "22008"))
    assert [session_ids(c) for c in _in_flight(workers)] == [[1, 2]]  # [3, 4] waits though a writer is free
    (half,) = _in_flight(workers)
    half.commit(stored_for(half))
    assert [session_ids(c) for c in _in_flight(workers)] == [[3, 4]]


def test_a_batcher_waiting_out_its_backoff_retries_once_another_component_reaches_postgresql() -> None:
    """The durable acks backed off to their longest wait (5 s) during an outage; when
    another component's statement works again, the acks retry in the next turn instead
    of up to 5 s later (acks held in memory, copies redelivered meanwhile). A batcher
    that stopped is not woken, and one with nothing to retry stays idle."""
    clock = Clock()
    workers = FakeDbWorker(), FakeDbWorker(), FakeDbWorker()
    waiting, other, stopped = (AckBatcher(w, clock, max_batch=10, flush_interval=0.05, on_done=lambda r, ok: None)
                               for w in workers)
    for acker in (waiting, other, stopped):
        acker.add(ack_row(1))
    clock.advance(0.05)
    for _ in range(7):  # 0.1, 0.2, ... capped at 5 s
        for worker in workers:
            worker.last.fail(StorageError("connection refused"))
        clock.advance(5.0)
    workers[0].last.fail(StorageError("connection refused"))  # waits 5 s again
    workers[2].last.fail(StorageError("connection refused"))
    stopped.stop()
    calls = [len(w.calls) for w in workers]
    workers[1].last.commit([])  # PostgreSQL answers the other batcher: the outage is over
    assert len(workers[0].calls) == calls[0], "woken inside the call that saw PostgreSQL work"
    clock.advance(0)
    assert [len(w.calls) for w in workers] == [calls[0] + 1, calls[1], calls[2]]
    assert ack_ids(workers[0].last) == [1]
    workers[0].last.commit([])
    clock.advance(10.0)  # the cancelled backoff does not retry a second time
    assert len(workers[0].calls) == calls[0] + 1 and waiting.pending == 0
