"""A channel registered while the group commit stores a batch, on real PostgreSQL.

The send statement names the channels registered in its snapshot. A channel whose
registration commits while the statement runs can start below the batch's ids: those
copies are its own, but the answer does not hand them over, and its in-memory channel
may have loaded before they were committed (ReliableStore._confirm_channels). The unit
tests model that snapshot with the in-memory database; here PostgreSQL makes it. The
statement is held on the owner row's share lock (another transaction holds it FOR
UPDATE) while the channel is registered and subscribed to, so the batch's ids are above
the channel's start and its snapshot is older than the registration.
"""

from __future__ import annotations

import threading

import psycopg
import pytest

from dmq_client.wire import Command

from .support import db_rows, run_cli, wait_for

pytestmark = pytest.mark.integration


def _waits_for(dsn: str, holder: int) -> bool:
    """Whether a backend waits for a lock ``holder`` (a backend's pid) holds."""
    return bool(db_rows(dsn, "SELECT 1 FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", holder))


def _pushes(client, count: int) -> list:
    got = []
    while len(got) < count:
        push = client.receive(timeout=15)
        assert push is not None, f"only {len(got)} of {count} pushes: {[p.body for p in got]}"
        if push.command == Command.CONSUMER_PUSH:
            got.append(push)
            client.ack(push)
    return got


def test_a_channel_registered_during_a_commit_gets_the_copies_its_answer_did_not_name(make_server, topic, pg_dsn):
    server = make_server(registry_refresh="0.1s")
    with server.client() as producer, server.client() as billing, server.client() as late:
        first = producer.send(topic, b"before")
        assert first.command == Command.SEND_SUCCESS_ACK

        holder = psycopg.connect(pg_dsn)  # the owner row held: the next batch waits in its statement
        holder.execute("SELECT id FROM dmq_owner WHERE retired_at IS NULL FOR UPDATE")
        replies: list = []
        sender = threading.Thread(target=lambda: replies.append(producer.send(topic, b"during")))
        sender.start()
        try:
            wait_for(lambda: _waits_for(pg_dsn, holder.info.backend_pid))
            run_cli(pg_dsn, "channel", "add", topic, "late").check_returncode()
            # the server knows the channel and has loaded it: nothing of it is committed yet
            wait_for(lambda: late.subscribe(topic, "late").command == Command.SUBSCRIBE_ACK, timeout=15)
            assert late.receive(timeout=0.5) is None
            assert _waits_for(pg_dsn, holder.info.backend_pid)  # still before the commit
        finally:
            holder.rollback()
            holder.close()
        sender.join(15)
        (during,) = replies
        assert during.command == Command.SEND_SUCCESS_ACK
        (start_id,) = db_rows(pg_dsn, "SELECT start_id FROM dmq_channel WHERE topic = %s AND name = 'late'", topic)[0]
        assert first.message_id < start_id < during.message_id  # the late channel's own copy

        after = producer.send(topic, b"after")  # its answer names the late channel
        assert after.command == Command.SEND_SUCCESS_ACK
        got = _pushes(late, 2)
        assert sorted(p.body for p in got) == [b"after", b"during"]
        assert billing.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
        assert sorted(p.body for p in _pushes(billing, 3)) == [b"after", b"before", b"during"]
        assert late.receive(timeout=0.5) is None  # each copy once
        wait_for(lambda: not db_rows(pg_dsn, "SELECT 1 FROM dmq_pending WHERE topic = %s", topic))
