"""A channel registered while a statement stores its topic's messages, on real PostgreSQL.

The group commit's statement, and a delayed send's move, name the channels registered in
their snapshot. A channel whose registration commits while the statement runs can start
below the ids it stores: those copies are the channel's own, but the answer does not hand
them over, and its in-memory channel may have loaded before they were committed
(ReliableStore._confirm_channels). The unit tests model that snapshot with the in-memory
database; here PostgreSQL makes it. The statement is held on the owner row's share lock
(another transaction holds the row FOR UPDATE) while the channel is registered and
subscribed to, so its ids are above the channel's start and its snapshot is older than the
registration. Then a later send's answer names the channel, and it must read the copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest

from dmq_client.wire import Command

from .support import db_rows, run_cli, wait_for
from .test_delay_flow import now_ms, send_delayed

pytestmark = pytest.mark.integration

SEND_STATEMENT = "%Group commit: store a batch%"  # insert_messages' first comment line
MOVE_STATEMENT = "%Move due rows of a worker's fragments%"  # move_due's


def _waits(dsn: str, holder: int, statement: str) -> bool:
    """Whether ``statement`` (a LIKE pattern of its text) waits for a lock of ``holder``
    (a backend's pid); the heartbeat's update of the owner row waits too."""
    return bool(db_rows(
        dsn, "SELECT 1 FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid)) AND query LIKE %s",
        holder, statement,
    ))


@contextmanager
def _owner_held(dsn: str, statement: str) -> Iterator[Callable[[], bool]]:
    """Hold this server's owner row until the block ends; yields a check that
    ``statement`` is still waiting for it."""
    holder = psycopg.connect(dsn)
    try:
        holder.execute("SELECT id FROM dmq_owner WHERE retired_at IS NULL FOR UPDATE")
        pid = holder.info.backend_pid
        yield lambda: _waits(dsn, pid, statement)
    finally:
        holder.rollback()
        holder.close()


def _register_and_load(pg_dsn: str, topic: str, late, waiting: Callable[[], bool]) -> None:
    """With the statement waiting: register channel ``late`` and subscribe to it (the
    server loads it: nothing of the held statement is visible yet)."""
    wait_for(waiting, timeout=15)
    run_cli(pg_dsn, "channel", "add", topic, "late").check_returncode()
    wait_for(lambda: late.subscribe(topic, "late").command == Command.SUBSCRIBE_ACK, timeout=15)
    assert late.receive(timeout=0.5) is None
    assert waiting()  # still before its commit


def _pushes(client, count: int) -> list:
    got = []
    while len(got) < count:
        push = client.receive(timeout=15)
        assert push is not None, f"only {len(got)} of {count} pushes: {[p.body for p in got]}"
        if push.command == Command.CONSUMER_PUSH:
            got.append(push)
            client.ack(push)
    return got


def _start_id(pg_dsn: str, topic: str) -> int:
    return db_rows(pg_dsn, "SELECT start_id FROM dmq_channel WHERE topic = %s AND name = 'late'", topic)[0][0]


def _each_channel_gets_its_copies(pg_dsn: str, topic: str, producer, billing, late, held: bytes) -> None:
    """A send whose answer names ``late``; then each channel reads each of its copies once."""
    assert producer.send(topic, b"after").command == Command.SEND_SUCCESS_ACK
    assert sorted(p.body for p in _pushes(late, 2)) == sorted([b"after", held])
    assert billing.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
    assert sorted(p.body for p in _pushes(billing, 3)) == sorted([b"after", b"before", held])
    assert late.receive(timeout=0.5) is None  # each copy once
    wait_for(lambda: not db_rows(pg_dsn, "SELECT 1 FROM dmq_pending WHERE topic = %s", topic))


def test_a_channel_registered_during_a_commit_gets_the_copies_its_answer_did_not_name(make_server, topic, pg_dsn):
    server = make_server(registry_refresh="0.1s")
    with server.client() as producer, server.client() as billing, server.client() as late:
        first = producer.send(topic, b"before")
        assert first.command == Command.SEND_SUCCESS_ACK
        replies: list = []
        with _owner_held(pg_dsn, SEND_STATEMENT) as waiting:
            sender = threading.Thread(target=lambda: replies.append(producer.send(topic, b"during")))
            sender.start()
            _register_and_load(pg_dsn, topic, late, waiting)
        sender.join(15)
        (during,) = replies
        assert during.command == Command.SEND_SUCCESS_ACK
        assert first.message_id < _start_id(pg_dsn, topic) < during.message_id  # the late channel's own copy
        _each_channel_gets_its_copies(pg_dsn, topic, producer, billing, late, b"during")


def test_a_channel_registered_during_a_delay_move_gets_the_copy_its_answer_did_not_name(make_server, topic, pg_dsn):
    """The same with a delayed send's move. On PostgreSQL the move and the sends wait for
    the same owner lock, so no send's answer can name the channel between the move's
    snapshot and its answer; the channel is unconfirmed from its opening, and the next
    answer that names it makes it read the moved copy. (A channel a send's answer named
    before a move's answer that missed it: the unit test
    test_broker.py::test_a_channel_registered_during_a_delay_move_reads_the_copy_its_answer_missed;
    held on the resend key instead, the move has drawn its ids before it waits.)"""
    server = make_server(registry_refresh="0.1s", delay_poll_interval="100ms")
    with server.client() as producer, server.client() as billing, server.client() as late:
        assert producer.send(topic, b"before").command == Command.SEND_SUCCESS_ACK
        with _owner_held(pg_dsn, MOVE_STATEMENT) as waiting:
            # the delay table's insert takes no lock on the owner row; its move, when due, does
            assert send_delayed(producer, topic, b"delayed", now_ms() + 300).command == Command.SEND_SUCCESS_ACK
            _register_and_load(pg_dsn, topic, late, waiting)
        wait_for(lambda: not db_rows(pg_dsn, "SELECT 1 FROM dmq_delay"))
        (moved,) = db_rows(pg_dsn, "SELECT id FROM dmq_message WHERE topic = %s AND body = 'delayed'", topic)[0]
        assert _start_id(pg_dsn, topic) < moved  # the late channel's own copy
        _each_channel_gets_its_copies(pg_dsn, topic, producer, billing, late, b"delayed")
