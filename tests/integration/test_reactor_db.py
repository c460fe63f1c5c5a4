"""ReactorDb against real PostgreSQL, on a real (not installed) epoll reactor.

The same steps that ``run_steps`` drives over a blocking connection must give the
same results when the reactor drives them; statement errors reach the steps (the
resend fallback); a connection PostgreSQL drops fails only the run in progress,
and the next run reconnects.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import psycopg
import pytest
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.epollreactor import EPollReactor
from twisted.python.failure import Failure

from dmq_server.db.reactor import PreparedSql, ReactorDb
from dmq_server.db.storage_errors import StorageError
from dmq_server.db.messages import HOT_STATEMENTS, NewMessage, insert_messages, insert_messages_steps, run_query_steps
from dmq_server.db.steps import STATEMENTS, Statement, add_statement
from dmq_server.db.worker import connect


@pytest.fixture(autouse=True)
def _own_statements_forgotten():
    """The statements a test here registers are its own: gone after it, so a test that
    lists every statement of the server (test_memory_db_contract's, which fails on a
    statement the double has no handler for) finds none of them, whatever the order."""
    before = dict(STATEMENTS)
    yield
    STATEMENTS.clear()
    STATEMENTS.update(before)


def _stmt(sql: str, params: dict) -> Statement:
    """A statement of these tests' own, registered under a name of its own."""
    return Statement(add_statement(f"test_reactor_{hashlib.sha1(sql.encode()).hexdigest()[:12]}", sql), params)


def on_reactor(scenario: Callable[[Any], Any], timeout: float = 30.0) -> Any:
    """Run ``await scenario(reactor)`` on a fresh reactor; return its result or raise."""
    reactor = EPollReactor()
    outcome: list[Any] = []

    def go() -> None:
        d = ensureDeferred(scenario(reactor))
        d.addBoth(outcome.append)
        d.addBoth(lambda _: reactor.stop())

    def too_late() -> None:
        outcome.append(Failure(TimeoutError(f"scenario still running after {timeout}s")))
        reactor.stop()

    reactor.callWhenRunning(go)
    reactor.callLater(timeout, too_late)
    reactor.run(installSignalHandlers=False)
    result = outcome[0]
    if isinstance(result, Failure):
        result.raiseException()
    return result


def _msg(producer: str, session_id: int, body: bytes = b"payload") -> NewMessage:
    return NewMessage("orders", producer, session_id, 1_700_000_000_123, body)


async def _result_or_error(d: Deferred) -> Any:
    try:
        return await d
    except Exception as exc:  # the scenario looks at the error
        return exc


def test_steps_give_what_a_blocking_connection_gives(pg_dsn, topic, owner):
    """insert_messages_steps on the reactor: same StoredMessages as over psycopg's
    blocking path (ids, channels, published time), resends answered from the rows."""

    async def scenario(reactor: Any) -> Any:
        db = ReactorDb(reactor, pg_dsn, "writer0", prepare=HOT_STATEMENTS)
        try:
            first = await db.run_steps(insert_messages_steps, [_msg("p", 1), _msg("p", 2)], "node-1", owner)
            # a stored pair, a new pair and the new pair again: the UniqueViolation of
            # the first try is thrown into the steps, which run the ON CONFLICT form
            mixed = await db.run_steps(insert_messages_steps, [_msg("p", 2), _msg("p", 3), _msg("p", 3)], "node-1", owner)
            return first, mixed
        finally:
            db.stop()

    first, mixed = on_reactor(scenario)
    assert [s.duplicate for s in first] == [False, False]
    assert all(s.channels == ("billing",) for s in first)
    assert [s.duplicate for s in mixed] == [True, False, True]
    assert mixed[0].message_id == first[1].message_id
    assert mixed[2].message_id == mixed[1].message_id

    with connect(pg_dsn, autocommit=True) as conn:
        again = insert_messages(conn, [_msg("p", 1), _msg("p", 4)], "node-1", owner)
        rows = conn.execute("SELECT id, (extract(epoch FROM published_at) * 1000)::bigint FROM dmq_message").fetchall()
        deliveries = conn.execute("SELECT count(*) FROM dmq_pending").fetchone()[0]
    assert again[0].message_id == first[0].message_id and again[0].duplicate
    assert {s.message_id: s.published_ms for s in first + mixed[1:2]} == {
        i: ms for i, ms in rows if i != again[1].message_id
    }
    assert deliveries == 4  # one per stored pair, none for the resends


def test_an_error_the_steps_do_not_handle_fails_only_that_run(pg_dsn, topic, owner):
    def bad_steps() -> Any:
        yield _stmt("SELECT 1 / %(zero)s::integer", {"zero": 0})

    def good_steps() -> Any:
        rows = yield _stmt("SELECT %(n)s::bigint + 1, %(names)b::text[]", {"n": 41, "names": ["a", "b"]})
        return rows

    async def scenario(reactor: Any) -> Any:
        db = ReactorDb(reactor, pg_dsn, "acker")
        try:
            error = await _result_or_error(db.run_steps(bad_steps))
            rows = await db.run_steps(good_steps)
            return error, rows
        finally:
            db.stop()

    error, rows = on_reactor(scenario)
    assert isinstance(error, StorageError) and "division by zero" in str(error)
    assert rows == [(42, ["a", "b"])]


def test_values_that_do_not_fit_fail_their_run_and_the_connection_goes_on(pg_dsn, topic, owner):
    """An integer too large for its cast is refused by PostgreSQL (not wrapped around),
    a value psycopg cannot send fails its run before anything is sent; the next run works."""

    def cast(value: Any) -> Any:
        rows = yield _stmt("SELECT %(v)b::integer[]", {"v": value})
        return rows[0][0]

    async def scenario(reactor: Any) -> Any:
        db = ReactorDb(reactor, pg_dsn, "acker")
        try:
            too_big = await _result_or_error(db.run_steps(cast, [2**40]))
            not_a_number = await _result_or_error(db.run_steps(cast, ["x"]))
            fine = await db.run_steps(cast, [2**31 - 1, -5])
            return too_big, not_a_number, fine
        finally:
            db.stop()

    too_big, not_a_number, fine = on_reactor(scenario)
    assert isinstance(too_big, StorageError) and "out of range" in str(too_big)
    assert isinstance(not_a_number, Exception) and not isinstance(not_a_number, StorageError)
    assert fine == [2**31 - 1, -5]


def test_a_count_statement_answers_with_the_rows_it_changed(pg_dsn, topic, owner):
    """``Statement(count=True)``: the reactor answers the row count, as run_steps does."""
    params = {"topic": "orders", "channel": "billing"}

    async def scenario(reactor: Any) -> Any:
        db = ReactorDb(reactor, pg_dsn, "admin")
        try:
            first = await db.run_steps(run_query_steps, "pause_channel", params)
            again = await db.run_steps(run_query_steps, "pause_channel", params)
            gone = await db.run_steps(run_query_steps, "unpause_channel", params)
            return first, again, gone
        finally:
            db.stop()

    assert on_reactor(scenario) == (1, 0, 1)


def test_stop_fails_the_run_in_progress_and_what_waits(pg_dsn, topic, owner):
    def sleeper() -> Any:
        yield _stmt("SELECT pg_sleep(%(s)s::float8)", {"s": 30.0})

    def nothing() -> Any:
        yield _stmt("SELECT 1", {})

    async def scenario(reactor: Any) -> Any:
        db = ReactorDb(reactor, pg_dsn, "writer0")
        await db.run_steps(nothing)  # connected and idle: the next run is sent at once
        running = db.run_steps(sleeper)
        queued = db.run_steps(sleeper)
        db.stop()
        after = await _result_or_error(db.run_steps(sleeper))
        return await _result_or_error(running), await _result_or_error(queued), after

    running, queued, after = on_reactor(scenario)
    assert isinstance(running, StorageError) and "in progress" in str(running)
    assert isinstance(queued, StorageError) and isinstance(after, StorageError)


def test_a_dropped_connection_fails_the_run_and_the_next_run_reconnects(pg_dsn, topic, owner):
    def backend_pid() -> Any:
        rows = yield _stmt("SELECT pg_backend_pid()", {})
        return rows[0][0]

    def sleeper() -> Any:
        yield _stmt("SELECT pg_sleep(%(s)s::float8)", {"s": 30.0})

    async def scenario(reactor: Any) -> Any:
        db = ReactorDb(reactor, pg_dsn, "writer0", prepare=HOT_STATEMENTS)
        try:
            pid = await db.run_steps(backend_pid)
            running = db.run_steps(sleeper)
            queued = db.run_steps(backend_pid)  # waits behind the sleeper
            with connect(pg_dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            error = await _result_or_error(running)
            new_pid = await queued
            stored = await db.run_steps(insert_messages_steps, [_msg("q", 1)], "node-1", owner)
            return pid, error, new_pid, stored
        finally:
            db.stop()

    pid, error, new_pid, stored = on_reactor(scenario)
    assert isinstance(error, StorageError) and "writer0" in str(error)
    assert new_pid != pid
    assert not stored[0].duplicate and stored[0].channels == ("billing",)


def test_an_unreachable_database_fails_each_run_without_hanging(pg_server):
    dsn = pg_server.dsn.replace(f":{pg_server.port}/", ":1/")

    def steps() -> Any:
        yield _stmt("SELECT 1", {})

    async def scenario(reactor: Any) -> Any:
        db = ReactorDb(reactor, dsn, "writer0")
        try:
            return [await _result_or_error(db.run_steps(steps)) for _ in range(2)]
        finally:
            db.stop()

    errors = on_reactor(scenario)
    assert all(isinstance(e, StorageError) and "cannot connect" in str(e) for e in errors), errors


# -- PreparedSql: placeholders for libpq ------------------------------------------------
def test_placeholders_become_numbered_parameters_typed_by_their_casts():
    parsed = PreparedSql.parse(
        "SELECT %(ids)b::bigint[], %(name)s, %(ids)b::bigint[], %(n)s::integer WHERE x LIKE 'a%%'"
    )
    assert parsed.query == b"SELECT $1::bigint[], $2, $1::bigint[], $3::integer WHERE x LIKE 'a%'"
    assert parsed.names == ("ids", "name", "n")
    int8, text = psycopg.adapters.types["int8"], psycopg.adapters.types["text"]
    # integers travel as int8; the statement's cast to integer checks the range
    assert parsed.oids == (int8.array_oid, text.oid, int8.oid)


@pytest.mark.parametrize(
    "sql, why",
    [
        ("SELECT %(a)s::integer, %(a)s::text", "two types"),
        ("SELECT %(a)s::nosuchtype", "unknown parameter type"),
        ("SELECT %s", "placeholder"),
    ],
)
def test_placeholders_the_reactor_cannot_send_are_refused(sql, why):
    with pytest.raises(ValueError, match=why):
        PreparedSql.parse(sql)


def test_the_hot_statements_parse():
    for sql in HOT_STATEMENTS:
        assert PreparedSql.parse(sql).names


def test_an_ack_batch_holding_a_repeat_falls_back_on_the_reactor_and_logs_each_ack_once(pg_dsn, topic, owner):
    """On the reactor's prepared connection, a batch acking a copy already done fails the
    fast ack whole (its division by zero is thrown into the steps) and the statement as
    written applies the rest: every stored id is acknowledged, each logged exactly once."""
    from dmq_server.db.messages import AckRow, CursorProgress, ack_deliveries_steps

    def acks(ids: list[int]) -> tuple[list[AckRow], list[CursorProgress]]:
        rows = [AckRow("orders", "billing", i, 1, 2, 1, "c", 1, owner, 1) for i in ids]
        return rows, [CursorProgress("orders", "billing", owner, 0, [(i, i) for i in ids])]

    with connect(pg_dsn, autocommit=True) as conn:
        ids = [s.message_id for s in insert_messages(conn, [_msg("p", n) for n in range(1, 6)], "node-1", owner)]

    async def scenario(reactor: Any) -> Any:
        db = ReactorDb(reactor, pg_dsn, "acker", prepare=HOT_STATEMENTS)
        try:
            first = await db.run_steps(ack_deliveries_steps, *acks(ids[:2]), "node-1")
            repeat = await db.run_steps(ack_deliveries_steps, *acks(ids[1:]), "node-1")  # ids[1] again
            return first, repeat
        finally:
            db.stop()

    assert on_reactor(scenario) == ([], [])
    with connect(pg_dsn, autocommit=True) as conn:
        logged = [r[0] for r in conn.execute("SELECT message_id FROM dmq_delivery_log ORDER BY 1").fetchall()]
        pending = conn.execute("SELECT count(*) FROM dmq_pending").fetchone()[0]
    assert logged == ids  # acknowledged 6 times, 5 ids: each logged once
    assert pending == 0


def test_a_connection_whose_prepares_hang_is_named_in_its_error(pg_dsn):
    """A server that accepts the connection but does not answer its prepares within the
    timeout is cut off, and the error names the connection (not a prepared statement's
    name): here the prepare waits for a table another session holds locked."""
    from dmq_server.db.reactor import _open

    with psycopg.connect(pg_dsn) as holder:
        holder.execute("CREATE TABLE IF NOT EXISTS test_reactor_locked (id int)")
        holder.commit()
        holder.execute("LOCK TABLE test_reactor_locked IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(StorageError, match=r"^writer0: no answer from PostgreSQL in 1s"):
            _open(pg_dsn, ["SELECT id FROM test_reactor_locked"], timeout=1.0, name="writer0")
        holder.rollback()
        holder.execute("DROP TABLE test_reactor_locked")
        holder.commit()
