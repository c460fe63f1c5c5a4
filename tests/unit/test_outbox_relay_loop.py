"""The outbox relay's loop (dmq_server/protocols/outbox_relay.py) on doubles, in
milliseconds: the databases as functions answered by a table, the broker as a recorder,
time as task.Clock. What a cycle does with each answer, how it backs off while a database
fails, and that stop ends it at once. The real thing runs in
tests/integration/test_outbox_relay.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock

from dmq_client.wire.properties import NO_PROPERTIES, Properties
from dmq_server.core.errors import NoTopic, Unavailable
from dmq_server.core.outbox_rows import OutboxRow, OutboxSource, outbox_row
from dmq_server.core.publish import PublishRequest, Published
from dmq_server.db import outbox, outbox_ledger
from dmq_server.db.storage_errors import StorageError
from dmq_server.protocols.outbox_relay import MAX_PAUSE, OutboxRelay

pytestmark = pytest.mark.unit


class Db:
    """A database as the relay calls it: each function answered by ``answers[fn]`` (a
    value, an exception, a Deferred, or a callable of the call's arguments giving one of
    those); every call recorded."""

    def __init__(self, answers: dict[Callable[..., object], object]) -> None:
        self.answers = answers
        self.calls: list[tuple[Callable[..., object], tuple[object, ...]]] = []
        self.started = self.stopped = False

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True

    def run(self, fn: Callable[..., object], *args: object) -> Deferred[object]:
        self.calls.append((fn, args))
        answer = self.answers[fn]
        if callable(answer):
            answer = answer(*args)
        if isinstance(answer, Deferred):
            return answer
        if isinstance(answer, BaseException):
            return fail(answer)
        return succeed(answer)

    def count(self, fn: Callable[..., object]) -> int:
        return sum(1 for called, _ in self.calls if called is fn)


class Broker:
    """Answers each publish at once: NoTopic for topic 'nosuch', Unavailable for 'down',
    else Published."""

    def __init__(self) -> None:
        self.requests: list[PublishRequest] = []

    def publish_each(self, request: PublishRequest, answer: Callable[[int, list[object]], None]) -> None:
        self.requests.append(request)
        outcome: object = Published(1)
        if request.topic == "nosuch":
            outcome = NoTopic("topic 'nosuch' is not registered or has no channel")
        elif request.topic == "down":
            outcome = Unavailable("storage unavailable")
        answer(0, [outcome] * len(request.sends or ()))


TAG = "0a1b2c3d"  # the install's tag, as read_tag answers
SHOP = f"outbox:shop:{TAG}"


def row(id: int, topic: str = "orders", session_id: int | None = None) -> OutboxRow:
    return OutboxRow(id, topic, b"body", None, session_id, 1000)


class Outbox:
    """The outbox table as ``delete_and_read`` and ``present_rows`` see it: rows by id,
    each call recorded as (ids deleted, after, exclude)."""

    def __init__(self, rows: list[OutboxRow], tag: str = TAG) -> None:
        self.rows = {r.id: r for r in rows}
        self.tag = tag
        self.reads: list[tuple[list[int], int, list[int]]] = []

    def delete_and_read(self, _q: object, _schema: str, _pid: int, ids: list[int], limit: int, after: int,
                        exclude: list[int]) -> tuple[str, list[OutboxRow]]:
        self.reads.append((sorted(ids), after, list(exclude)))
        for i in ids:
            del self.rows[i]
        found = [self.rows[i] for i in sorted(self.rows) if i > after and i not in exclude][:limit]
        return (self.tag if found else ""), found

    def present(self, _q: object, ids: list[int]) -> set[int]:
        return {i for i in ids if i in self.rows}

    def deleted(self) -> list[int]:
        return sorted(i for ids, _, _ in self.reads for i in ids)


def relay_with(table: Outbox, dmq_answers: dict | None = None, broker: Broker | HeldBroker | None = None,
               max_run: int = 500, batch: int = 500, app_answers: dict | None = None,
               ) -> tuple[OutboxRelay, Db, Db, Broker, Clock]:
    clock = Clock()
    # a wait for NOTIFY never ends here: the loop rests in it
    app = Db({outbox.hold_relay: 42, outbox.wait_for_rows: lambda *_: Deferred(), outbox.present_rows: table.present,
              outbox.delete_and_read: table.delete_and_read, outbox.read_tag: TAG, **(app_answers or {})})
    dmq = Db({outbox_ledger.forget_and_check: set(), outbox_ledger.recorded_rows: [],
              outbox_ledger.forget_relayed: 0, outbox_ledger.dead_letter_rows: 0, **(dmq_answers or {})})
    relay = OutboxRelay(OutboxSource("shop", "dmq_outbox", "dbname=app"), broker or Broker(), clock, app, dmq,
                        max_run=max_run, batch=batch)
    return relay, app, dmq, relay.broker, clock


def asked(db: Db) -> list[list[tuple[str, int]]]:
    """The pairs each forget_and_check asked about (its second list), the empty asks left out."""
    return [sorted(args[1]) for fn, args in db.calls if fn is outbox_ledger.forget_and_check and args[1]]


def forgotten(db: Db) -> list[tuple[str, int]]:
    return sorted(pair for fn, args in db.calls if fn is outbox_ledger.forget_and_check for pair in args[0])


def test_a_batch_is_published_in_runs_refused_rows_dead_lettered_and_passing_failures_kept() -> None:
    table = Outbox([row(1), row(2), row(3, "nosuch"), row(4, "down"), row(5)])
    # a relay before this one stored row 2 and died before its delete
    relay, app, dmq, broker, clock = relay_with(table, {outbox_ledger.forget_and_check: {(SHOP, 2)},
                                                        outbox_ledger.recorded_rows: [(SHOP, 2)]})
    relay.start()
    # a topic's runs one after another (answered at once here), the topics side by side
    assert [[s.session_id for s in r.sends or ()] for r in broker.requests] == [[1], [5], [3], [4]]
    [(_, (letters,))] = [call for call in dmq.calls if call[0] is outbox_ledger.dead_letter_rows]
    assert [(d.session_id, d.topic) for d in letters] == [(3, "nosuch")]
    assert "outbox shop (dmq_outbox) row 3: topic 'nosuch' is not registered" in letters[0].detail
    # deleted (and then forgotten) before the pause that precedes row 4's next try
    assert table.deleted() == [1, 2, 3, 5] and sorted(table.rows) == [4]
    assert forgotten(dmq) == [(SHOP, s) for s in (1, 2, 3, 5)]
    assert (relay.relayed, relay.dead) == (3, 1)
    clock.advance(1)
    assert [[s.session_id for s in r.sends or ()] for r in broker.requests][4:] == [[4]]
    relay.stop()


def test_only_rows_that_may_have_a_record_are_asked_about() -> None:
    """Taking the lock, the relay finds records up to row 3 (a relay before it stored rows
    2 and 3 and died before its delete): rows up to 3 are asked about, and rows with the
    application's own session id always (it may send an id again); the rows above, which
    no relay ever handed to a broker, are not."""
    table = Outbox([row(1), row(2), row(3), row(4), row(5, session_id=77), row(6)])
    relay, _, dmq, broker, _ = relay_with(table, {outbox_ledger.recorded_rows: [(SHOP, 2), (SHOP, 3), (SHOP, 9)],
                                                  outbox_ledger.forget_and_check: {(SHOP, 2), (SHOP, 3)}})
    relay.start()
    assert asked(dmq) == [[(SHOP, 1), (SHOP, 2), (SHOP, 3), ("outbox:shop:own", 77)]]
    assert [[s.session_id for s in r.sends or ()] for r in broker.requests] == [[1, 4], [77], [6]]
    assert [fn for fn, args in dmq.calls if fn is outbox_ledger.forget_relayed] == [outbox_ledger.forget_relayed]
    relay.stop()


def test_a_row_tried_without_a_final_answer_is_asked_about_when_read_again() -> None:
    """A store that failed for a passing reason may have committed all the same (its
    answer lost): the row is asked about before it is published again."""
    table = Outbox([row(1, "down"), row(2)])
    relay, _, dmq, broker, clock = relay_with(table)
    relay.start()
    assert asked(dmq) == []
    clock.advance(1)
    assert asked(dmq) == [[(SHOP, 1)]]
    assert [[s.session_id for s in r.sends or ()] for r in broker.requests] == [[1], [2], [1]]
    relay.stop()


def test_after_a_failed_cycle_the_rows_handed_to_the_broker_are_asked_about() -> None:
    """Stored, then the delete failed (the cycle with it): the rows are read again, and
    asked about, so they are deleted, not published again."""
    table = Outbox([row(1), row(2)])
    failing = [True]

    def delete_and_read(q: object, schema: str, pid: int, ids: list[int], limit: int, after: int,
                        exclude: list[int]) -> object:
        if ids and failing[0]:  # the delete of rows 1 and 2
            failing[0] = False
            return StorageError("connection lost")
        return table.delete_and_read(q, schema, pid, ids, limit, after, exclude)

    relay, _, dmq, broker, clock = relay_with(table, {outbox_ledger.forget_and_check: {(SHOP, 1), (SHOP, 2)}},
                                              app_answers={outbox.delete_and_read: delete_and_read})
    relay.start()
    assert asked(dmq) == []
    clock.advance(1)
    assert asked(dmq) == [[(SHOP, 1), (SHOP, 2)]]
    assert len(broker.requests) == 1 and table.rows == {}
    relay.stop()


def test_a_failing_database_is_tried_again_less_often_and_stop_ends_the_wait() -> None:
    relay, app, _, _, clock = relay_with(Outbox([]), app_answers={
        outbox.delete_and_read: StorageError("relation dmq_outbox.outbox does not exist")})
    relay.start()
    tries = [app.count(outbox.delete_and_read)]
    for _ in range(8):
        clock.advance(MAX_PAUSE)
        tries.append(app.count(outbox.delete_and_read))
    # pauses of 1, 2, 4, 8, 16, then 30 s: within 30 s of each other after the fifth
    assert tries == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    clock.advance(MAX_PAUSE - 1)
    assert app.count(outbox.delete_and_read) == 9
    stopped = relay.stop()
    assert stopped.called and app.stopped
    clock.advance(MAX_PAUSE)
    assert app.count(outbox.delete_and_read) == 9


def test_without_the_lock_nothing_is_read_and_the_lock_is_tried_every_second() -> None:
    relay, app, _, broker, clock = relay_with(Outbox([row(1)]), app_answers={outbox.hold_relay: 0})
    relay.start()
    clock.advance(1)
    clock.advance(1)
    assert app.count(outbox.hold_relay) == 3 and app.count(outbox.delete_and_read) == 0 and not relay.relaying
    relay.stop()
    assert broker.requests == []


def test_rows_kept_to_try_again_hold_no_row_behind_them() -> None:
    """A full batch of rows whose store failed for a passing reason: the next read goes on
    past them, so the rows behind are relayed now; at the end of the pass they are tried
    again from the start, after a pause."""
    table = Outbox([row(1, "down"), row(2, "down"), row(3), row(4), row(5)])
    relay, _, _, broker, clock = relay_with(table, batch=2)
    relay.start()
    assert [[s.session_id for s in r.sends or ()] for r in broker.requests] == [[1, 2], [3, 4], [5]]
    assert sorted(table.rows) == [1, 2]
    clock.advance(0.5)
    assert len(broker.requests) == 3  # pausing
    clock.advance(0.5)
    assert [[s.session_id for s in r.sends or ()] for r in broker.requests][3:] == [[1, 2]]
    # (after, left out) of each read: a full batch's next read ahead (dropped: rows kept),
    # then past the kept rows, the delete of 5 before the pause, and again from the start
    assert [(after, exclude) for _, after, exclude in table.reads] == [
        (0, []), (0, [1, 2]), (2, []), (4, []), (0, []), (0, []), (0, [1, 2]), (2, [])]
    relay.stop()


def test_with_several_clusters_each_database_is_asked_and_forgets() -> None:
    """A row's record is written in the database of the cluster its topic is placed on:
    the relay asks every one whether a row was stored, and each forgets what it holds."""
    clock = Clock()
    table = Outbox([row(1), row(2), row(3)])
    app = Db({outbox.hold_relay: 42, outbox.wait_for_rows: lambda *_: Deferred(), outbox.present_rows: table.present,
              outbox.delete_and_read: table.delete_and_read, outbox.read_tag: TAG})
    main = Db({outbox_ledger.forget_and_check: set(), outbox_ledger.recorded_rows: [],
               outbox_ledger.forget_relayed: 0})
    other = Db({outbox_ledger.forget_and_check: {(SHOP, 2)}, outbox_ledger.recorded_rows: [(SHOP, 2), (SHOP, 9)],
                outbox_ledger.forget_relayed: 0})
    broker = Broker()
    relay = OutboxRelay(OutboxSource("shop", "dmq_outbox", "dbname=app"), broker, clock, app, main, clusters=[other])
    relay.start()
    assert [[s.session_id for s in r.sends or ()] for r in broker.requests] == [[1, 3]]
    assert [sorted(args[0]) for fn, args in other.calls if fn is outbox_ledger.forget_relayed] == [[(SHOP, 9)]]
    assert forgotten(other) == forgotten(main) == [(SHOP, s) for s in (1, 2, 3)]
    assert asked(main) == asked(other) == [[(SHOP, 1), (SHOP, 2)]]
    assert main.started and other.started
    relay.stop()


class HeldBroker:
    """Answers nothing until the test does: each publish's answer kept with its request."""

    def __init__(self) -> None:
        self.held: list[tuple[PublishRequest, Callable[[int, list[object]], None]]] = []

    def publish_each(self, request: PublishRequest, answer: Callable[[int, list[object]], None]) -> None:
        self.held.append((request, answer))

    def sent(self) -> list[list[int]]:
        return [[s.session_id for s in request.sends or ()] for request, _ in self.held]

    def answer(self, index: int, outcome: object) -> None:
        request, answer = self.held[index]
        answer(0, [outcome] * len(request.sends or ()))


def test_a_topics_runs_go_one_after_another_and_other_topics_side_by_side() -> None:
    """Two runs to one topic published together could commit in two transactions at once
    (--commit-writers) and the later one get the lower ids: the second is published only
    once the first was answered (its commit); a run to another topic does not wait. A run
    is never longer than the group commit's batch."""
    rows = [row(1), row(2), row(3), row(4, "refunds"), row(5), row(6, "refunds")]
    broker = HeldBroker()
    table = Outbox(rows)
    relay, _, _, _, _ = relay_with(table, broker=broker, max_run=2)
    relay.start()
    assert broker.sent() == [[1, 2], [4]]
    broker.answer(1, Published(1))  # refunds' first run: its next waits for nothing else
    assert broker.sent() == [[1, 2], [4], [6]]
    broker.answer(0, Published(1))
    assert broker.sent() == [[1, 2], [4], [6], [3]]
    broker.answer(3, Published(1))
    assert broker.sent() == [[1, 2], [4], [6], [3], [5]]
    assert table.deleted() == []  # the batch is not done before every run is
    broker.answer(2, Published(1))
    broker.answer(4, Published(1))
    assert table.deleted() == [1, 2, 3, 4, 5, 6] and relay.relayed == 6
    relay.stop()


def test_after_a_passing_failure_the_rest_of_the_topics_runs_wait_with_it() -> None:
    """Stored now, the runs behind a run whose store failed for a passing reason would
    overtake it: they are kept to be tried again with it, not published."""
    rows = [row(1), row(2), row(3, "refunds"), row(4), row(5, "refunds")]
    broker = HeldBroker()
    table = Outbox(rows)
    relay, _, _, _, _ = relay_with(table, broker=broker, max_run=1)
    relay.start()
    assert broker.sent() == [[1], [3]]
    broker.answer(0, Unavailable("storage unavailable"))
    broker.answer(1, Published(1))
    broker.answer(2, Published(1))
    assert broker.sent() == [[1], [3], [5]]  # 2 and 4 kept with 1
    assert table.deleted() == [3, 5]
    relay.stop()


def test_rows_go_under_the_tag_read_with_them() -> None:
    """Installed again while this node held the lock: the rows read with the new install's
    tag are stored and checked under its producer, not the one read with the lock."""
    relay, _, dmq, broker, _ = relay_with(Outbox([row(1)], tag="99999999"))
    relay.start()
    assert [r.producer for r in broker.requests] == ["outbox:shop:99999999"]
    # another install's rows: each one asked about, whatever this relay knew of the first
    assert asked(dmq) == [[("outbox:shop:99999999", 1)]]
    relay.stop()


def test_the_next_batch_is_read_while_a_full_one_is_stored_and_published_after_it() -> None:
    """While a full batch is stored the next one is read (the batch being stored left out,
    the one before it deleted, their records forgotten in the same call to the ledger);
    it is published only once every run of the one before was answered."""
    table = Outbox([row(1), row(2), row(3), row(4), row(5)])
    broker = HeldBroker()
    relay, _, dmq, _, _ = relay_with(table, broker=broker, batch=2)
    relay.start()
    assert broker.sent() == [[1, 2]]
    assert table.reads == [([], 0, []), ([], 0, [1, 2])]
    broker.answer(0, Published(1))
    assert broker.sent() == [[1, 2], [3, 4]]
    assert table.reads[2:] == [([1, 2], 0, [3, 4])] and forgotten(dmq) == [(SHOP, 1), (SHOP, 2)]
    broker.answer(1, Published(1))
    assert broker.sent() == [[1, 2], [3, 4], [5]]
    assert len(table.reads) == 3  # a batch that is not full: nothing read ahead of it
    broker.answer(2, Published(1))
    assert table.rows == {} and relay.relayed == 5 and asked(dmq) == []
    relay.stop()


def test_a_failed_read_ahead_fails_the_cycle_once_the_store_is_answered() -> None:
    """The application's database fails while a batch is stored: the store is waited for
    (its rows stay this relay's to delete: the next read deletes them), then the cycle
    fails and is tried again after a pause."""
    table = Outbox([row(1), row(2), row(3), row(4)])
    failing = [True]

    def delete_and_read(q: object, schema: str, pid: int, ids: list[int], limit: int, after: int,
                        exclude: list[int]) -> object:
        if exclude and failing[0]:
            failing[0] = False
            return StorageError("connection lost")
        return table.delete_and_read(q, schema, pid, ids, limit, after, exclude)

    broker = HeldBroker()
    relay, _, dmq, _, clock = relay_with(table, broker=broker, batch=2,
                                         app_answers={outbox.delete_and_read: delete_and_read})
    relay.start()
    assert broker.sent() == [[1, 2]]
    broker.answer(0, Published(1))
    assert relay.relayed == 2 and broker.sent() == [[1, 2]]  # pausing
    clock.advance(1)
    assert table.reads[0] == ([], 0, []) and table.reads[1] == ([1, 2], 0, [])
    assert broker.sent() == [[1, 2], [3, 4]] and asked(dmq) == []
    relay.stop()


def test_a_rows_properties_ride_its_send_and_a_row_breaking_a_rule_is_a_dead_letter() -> None:
    """Each Send carries its row's key, priority and headers and their wire text (a row
    without any: none, as before); a row whose stored document breaks a rule is never
    published: a dead letter naming the row and the rule, deleted with the others, and the
    rows around it keep one run."""
    table = Outbox([outbox_row(1, "orders", b"a", None, None, 1000, {"key": "order-7", "priority": 5}),
                    outbox_row(2, "orders", b"b", None, None, 1000, {"priority": 12}),
                    outbox_row(3, "orders", b"c", None, None, 1000, None)])
    relay, app, dmq, broker, clock = relay_with(table)
    relay.start()
    [request] = broker.requests
    assert [(s.session_id, s.properties, s.status) for s in request.sends or ()] == [
        (1, Properties("order-7", 5), '{"key":"order-7","priority":5}'), (3, NO_PROPERTIES, "")]
    [(_, (letters,))] = [call for call in dmq.calls if call[0] is outbox_ledger.dead_letter_rows]
    assert [(d.session_id, d.body) for d in letters] == [(2, b"b")]
    assert "outbox shop (dmq_outbox) row 2: E_BAD_PROPERTIES priority 12 is outside 0..9" in letters[0].detail
    assert table.deleted() == [1, 2, 3] and (relay.relayed, relay.dead) == (2, 1)
    relay.stop()
