"""An ordered topic's commits are serialised across nodes (issue 45, PostgreSQL).

Two nodes store copies of one ordered topic side by side. Were their commits free to
overlap, a snapshot could show node A's id 101 while node B's id 100 is still being
committed: the topic's orderer, loading every node's copies, would move its position to
101 and never read 100. So ``insert_messages`` (and its variants: with properties, with
outbox rows, the retry after a resend) and ``move_due`` take a transaction advisory lock
per ordered topic of the batch (key ``(7361004, hashtext(topic))``) before they draw an
id, and hold it until their commit is visible: the visible ids of an ordered topic are a
prefix. Batches of unordered topics take no lock and wait for nobody.

Each test uses real connections to one database, as two nodes' writers would: the first
holds its transaction open, the second runs on a thread, and ``pg_locks`` shows whether
it waits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

import psycopg
import pytest

import registry
from dmq_client.wire.properties import NO_PROPERTIES, Properties
from dmq_server.db.delays import NewDelayed, insert_delayed_steps, move_due_steps
from dmq_server.db.messages import NewMessage, StoredMessage, create_owner_steps, insert_messages_steps, insert_params
from dmq_server.db.steps import STATEMENTS, run_steps
from dmq_server.db.worker import connect

from .support import db_rows, wait_for

T = TypeVar("T")

#: the advisory lock class of an ordered topic's commits (sql/queries.sql, insert_messages)
ORDERED_COMMITS = 7361004
ORDERED, OTHER_ORDERED, UNORDERED = "ledger", "journal", "events"
LONG_AGO = 1_000  # a due time in 1970


@pytest.fixture
def nodes(pg_dsn: str) -> Iterator[tuple[int, int]]:
    """Two ordered topics and an unordered one, a channel each; an incarnation of
    node-1 and one of node-2."""
    with connect(pg_dsn, autocommit=True) as conn:
        for name, ordered in ((ORDERED, True), (OTHER_ORDERED, True), (UNORDERED, False)):
            registry.create_topic(conn, name, ordered=ordered)
            registry.add_channel(conn, name, "c")
        yield run_steps(conn, create_owner_steps("node-1")), run_steps(conn, create_owner_steps("node-2"))


def _batch(topic: str, producer: str, count: int, props: Properties = NO_PROPERTIES) -> list[NewMessage]:
    return [NewMessage(topic, producer, n, 0, b"x", props) for n in range(1, count + 1)]


def _ids(stored: list) -> list[int]:
    assert all(isinstance(s, StoredMessage) for s in stored), stored
    return [s.message_id for s in stored]


@contextmanager
def _open(dsn: str) -> Iterator[psycopg.Connection]:
    """A connection with a transaction open (a node's statement not committed yet); it
    commits when the block ends."""
    with connect(dsn, autocommit=True) as conn, conn.transaction():
        yield conn


def _in_thread(pool: ThreadPoolExecutor, dsn: str, work: Callable[[psycopg.Connection], T],
               transaction: bool = True) -> tuple[int, Future[T]]:
    """``work`` on a connection of its own, in a transaction (or in autocommit, as the
    group commit runs), on a thread: the backend's pid (to look it up in pg_locks) and
    the future of its answer."""
    conn = connect(dsn, autocommit=True)

    def run() -> T:
        with conn:
            if not transaction:
                return work(conn)
            with conn.transaction():
                return work(conn)

    return conn.info.backend_pid, pool.submit(run)


def _waits_for(dsn: str, pid: int, topic: str) -> bool:
    """Whether backend ``pid`` waits for the lock of ``topic``'s commits."""
    return bool(db_rows(
        dsn, "SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted AND locktype = 'advisory' "
             "AND classid = %s AND objid = hashtext(%s)::oid AND objsubid = 2", pid, ORDERED_COMMITS, topic))


def _held(dsn: str, pid: int) -> list[int]:
    """The keys (hashtext of a topic) of the ordered-commit locks backend ``pid`` holds."""
    return sorted(r[0] for r in db_rows(
        dsn, "SELECT objid FROM pg_locks WHERE pid = %s AND granted AND locktype = 'advisory' "
             "AND classid = %s AND objsubid = 2", pid, ORDERED_COMMITS))


def _hash_keys(dsn: str, *topics: str) -> list[int]:
    return sorted(r[0] for r in db_rows(dsn, "SELECT hashtext(t)::oid::bigint FROM unnest(%s::text[]) AS t", list(topics)))


def _no_lock_waits(conn: psycopg.Connection) -> None:
    """A statement that would wait for a lock fails at once instead (the tests that say a
    batch waits for nobody)."""
    conn.execute("SET lock_timeout = '3s'")


#: the statements a group commit may run (db.messages derives all but the first from
#: insert_messages: the first try without ON CONFLICT, with outbox rows, with properties)
STORING = ("insert_messages", "insert_new_messages", "insert_outbox_messages", "insert_new_outbox_messages",
           "insert_messages_props", "insert_new_messages_props", "insert_outbox_messages_props",
           "insert_new_outbox_messages_props")


def _store_with(conn: psycopg.Connection, name: str, topic: str, producer: str, count: int, node: str,
                owner: int) -> list[int]:
    """``count`` sends of ``topic`` stored by the statement ``name`` alone, with the
    batch that statement is for (outbox producers, properties): the ids stored."""
    producer = f"outbox:shop:{producer}" if "outbox" in name else producer
    props = Properties(key="k") if name.endswith("_props") else NO_PROPERTIES
    rows = conn.execute(STATEMENTS[name], insert_params(_batch(topic, producer, count, props), node, owner)).fetchall()
    return [r[0] for r in rows if r[0] is not None]


@dataclass
class Waiting(Generic[T]):
    """A statement of node-2 waiting for the ordered topic's lock behind node-1's batch."""

    pid: int  # its backend
    answer: Future[T]
    first: list[int]  # the ids of node-1's batch


@contextmanager
def _behind_node_one(dsn: str, one: int, work: Callable[[psycopg.Connection], T],
                     transaction: bool = True) -> Iterator[Waiting[T]]:
    """Node-1's batch of the ordered topic stored and not committed, and ``work`` started
    on a connection of its own and seen waiting (pg_locks) for the topic's lock; node-1
    commits when the block ends, and ``answer`` is there once it has."""
    with ThreadPoolExecutor(1) as pool:
        with _open(dsn) as conn:
            first = _ids(run_steps(conn, insert_messages_steps(_batch(ORDERED, "a", 5), "node-1", one)))
            pid, answer = _in_thread(pool, dsn, work, transaction)
            wait_for(lambda: _waits_for(dsn, pid, ORDERED))
            assert not answer.done()
            yield Waiting(pid, answer, first)


@pytest.mark.parametrize("name", STORING)
def test_a_second_ordered_batch_waits_until_the_first_commits(pg_dsn, nodes, name):
    """Node-2's batch of the ordered topic waits (pg_locks) while node-1's is not
    committed, then stores with ids above all of node-1's: whichever statement stores it."""
    one, two = nodes
    with _behind_node_one(pg_dsn, one, lambda c: _store_with(c, name, ORDERED, "b", 5, "node-2", two)) as second:
        pass
    stored = second.answer.result()
    assert len(stored) == 5 and min(stored) > max(second.first)


def test_a_resent_batch_waits_too(pg_dsn, nodes):
    """A batch holding a stored pair, as the group commit runs it (autocommit: the fast
    insert fails, insert_messages runs), waits and then stores its new sends above
    node-1's ids and answers the stored pair as a resend."""
    one, two = nodes
    with connect(pg_dsn, autocommit=True) as conn:
        stored = _ids(run_steps(conn, insert_messages_steps(_batch(ORDERED, "b", 1), "node-2", two)))
    with _behind_node_one(pg_dsn, one, lambda c: run_steps(
            c, insert_messages_steps(_batch(ORDERED, "b", 3), "node-2", two)), transaction=False) as second:
        pass
    resent, *fresh = second.answer.result()
    assert resent.duplicate and resent.message_id == stored[0]
    assert min(_ids(fresh)) > max(second.first)


def test_the_lock_is_taken_before_any_id_is_drawn(pg_dsn, nodes):
    """While node-2's ordered batch waits, a third writer stores an unordered message
    (and draws an id): node-2's ids, drawn once it has the lock, are above it. Drawn
    before the lock, they would be below it, and below node-1's: not a prefix."""
    one, two = nodes
    # the batch's unordered sends too: the whole insert waits
    batch = _batch(UNORDERED, "a-first", 2) + _batch(ORDERED, "b", 2)
    with _behind_node_one(pg_dsn, one, lambda c: _ids(run_steps(c, insert_messages_steps(batch, "node-2", two)))) as second:
        with connect(pg_dsn, autocommit=True) as third:
            between = _ids(run_steps(third, insert_messages_steps(_batch(UNORDERED, "c", 1), "node-1", one)))
    assert min(second.answer.result()) > between[0] > max(second.first)


def test_a_batch_locks_its_ordered_topics_in_name_order(pg_dsn, nodes):
    """Node-2's batch of two ordered topics (sent ledger first) takes journal's lock,
    then waits for ledger's, which node-1's open batch holds: every statement locks in
    name order, so two batches of the same topics never hold one each."""
    one, two = nodes
    batch = _batch(ORDERED, "b", 2) + _batch(OTHER_ORDERED, "c", 2)
    with _behind_node_one(pg_dsn, one, lambda c: _ids(run_steps(c, insert_messages_steps(batch, "node-2", two)))) as second:
        assert _held(pg_dsn, second.pid) == _hash_keys(pg_dsn, OTHER_ORDERED)
    assert min(second.answer.result()) > max(second.first)


def test_unordered_batches_and_other_ordered_topics_do_not_wait(pg_dsn, nodes):
    """While node-1's batch of an ordered and an unordered topic is open, node-2 stores
    unordered messages at once, taking no lock, and a batch of another ordered topic at
    once, taking that topic's lock alone."""
    one, two = nodes
    with _open(pg_dsn) as conn:
        run_steps(conn, insert_messages_steps(_batch(ORDERED, "a", 2) + _batch(UNORDERED, "u", 2), "node-1", one))
        assert _held(pg_dsn, conn.info.backend_pid) == _hash_keys(pg_dsn, ORDERED)
        with _open(pg_dsn) as other:
            _no_lock_waits(other)
            for name in STORING:
                assert len(_store_with(other, name, UNORDERED, f"b-{name}", 3, "node-2", two)) == 3
            assert _held(pg_dsn, other.info.backend_pid) == []
            assert _ids(run_steps(other, insert_messages_steps(_batch(OTHER_ORDERED, "b", 2), "node-2", two)))
            assert _held(pg_dsn, other.info.backend_pid) == _hash_keys(pg_dsn, OTHER_ORDERED)


def test_a_batch_holds_the_lock_of_each_ordered_topic(pg_dsn, nodes):
    """A batch of two ordered topics and an unordered one holds the two ordered topics'
    locks until it commits, and none once committed."""
    one, _ = nodes
    with _open(pg_dsn) as conn:
        batch = _batch(ORDERED, "a", 2) + _batch(UNORDERED, "u", 2) + _batch(OTHER_ORDERED, "j", 2)
        run_steps(conn, insert_messages_steps(batch, "node-1", one))
        pid = conn.info.backend_pid
        assert _held(pg_dsn, pid) == _hash_keys(pg_dsn, ORDERED, OTHER_ORDERED)
    assert _held(pg_dsn, pid) == []


def _delay(dsn: str, topic: str, fragment: int) -> None:
    with connect(dsn, autocommit=True) as conn:
        run_steps(conn, insert_delayed_steps([NewDelayed(NewMessage(topic, f"d-{topic}", 1, 0, b"late"), LONG_AGO, fragment)],
                                             "node-2"))


def test_moving_an_ordered_topics_due_rows_waits_until_its_batch_commits(pg_dsn, nodes):
    """node-2 moving a due delayed row of the ordered topic (a delayed send, or a
    replay) waits while node-1's batch of the topic is open, and its message's id is
    above the batch's; a due row of an unordered topic moves at once meanwhile, taking
    no lock."""
    one, two = nodes
    _delay(pg_dsn, ORDERED, 1)
    _delay(pg_dsn, UNORDERED, 2)
    with _behind_node_one(pg_dsn, one, lambda c: run_steps(c, move_due_steps((1,), 2, 2_000, 10, "node-2", two))) as second:
        with _open(pg_dsn) as other:
            _no_lock_waits(other)
            taken, moved = run_steps(other, move_due_steps((2,), 2, 2_000, 10, "node-2", two))
            assert (taken, [m.topic for m in moved]) == (1, [UNORDERED])
            assert _held(pg_dsn, other.info.backend_pid) == []
    taken, moved = second.answer.result()
    assert taken == 1 and moved[0].topic == ORDERED and moved[0].message_id > max(second.first)
