"""Per-topic retention end to end (issue 46): a real dmq-server on real PostgreSQL, the
blocking client, the CLI.

The server keeps acknowledged messages --message-retention (1 s here) and sweeps every
0.2 s; topic ``kept`` keeps its own for an hour (``dmq topic create --retention 1h``).
Counted: every id acknowledged to a producer is delivered; once acknowledged, brief's
messages leave the store and kept's stay, each one; a channel that has not acknowledged
keeps its copies whatever the retention; ``dmq topic update --retention`` takes effect
at the next sweep, on a running server.
"""

from __future__ import annotations

import pytest

from dmq_client.wire import Command

from .support import db_rows, run_cli, wait_for

pytestmark = pytest.mark.integration

COUNT = 40


def _stored(dsn: str, topic: str) -> set[int]:
    return {r[0] for r in db_rows(dsn, "SELECT id FROM dmq_message WHERE topic = %s", topic)}


def _send_and_consume(server, topic: str, channel: str | None) -> set[int]:
    """COUNT messages sent and acknowledged to the producer; delivered on ``channel`` and
    acknowledged there (each id once) unless it is None."""
    with server.client() as producer:
        sent = set()
        for n in range(COUNT):
            reply = producer.send(topic, b"%d" % n)
            assert reply.command == Command.SEND_SUCCESS_ACK, reply.status
            sent.add(reply.message_id)
    if channel is not None:
        delivered: set[int] = set()
        with server.client() as consumer:
            assert consumer.subscribe(topic, channel, credit=50).command == Command.SUBSCRIBE_ACK
            while delivered != sent:
                push = consumer.receive(timeout=10)
                assert push is not None, f"lost on {topic}/{channel}: {sorted(sent - delivered)[:5]}"
                assert push.message_id in sent and push.message_id not in delivered
                delivered.add(push.message_id)
                consumer.ack(push)
    return sent


def test_each_topic_keeps_acknowledged_messages_for_its_own_retention(make_server, pg_dsn):
    for args in (("kept", "--retention", "1h"), ("brief",), ("waiting",)):
        run_cli(pg_dsn, "topic", "create", *args).check_returncode()
    for topic in ("kept", "brief", "waiting"):
        run_cli(pg_dsn, "channel", "add", topic, "c").check_returncode()
    server = make_server(message_retention="1", sweep_interval="0.2")
    kept = _send_and_consume(server, "kept", "c")
    brief = _send_and_consume(server, "brief", "c")
    waiting = _send_and_consume(server, "waiting", None)  # nobody reads channel c

    wait_for(lambda: not _stored(pg_dsn, "brief"), timeout=20)
    assert _stored(pg_dsn, "kept") == kept  # each one, past the server's retention
    assert _stored(pg_dsn, "waiting") == waiting  # unacknowledged: kept whatever the retention
    # what went is noted for the topic: its highest id (the start of what a seek can reach)
    assert db_rows(pg_dsn, "SELECT topic, swept_id FROM dmq_retention") == [("brief", max(brief))]

    out = run_cli(pg_dsn, "topic", "update", "kept", "--retention", "1s")
    assert out.returncode == 0, out.stderr
    wait_for(lambda: not _stored(pg_dsn, "kept"), timeout=20)  # the running server's next pass
    assert _stored(pg_dsn, "waiting") == waiting
    assert "the retention sweep failed" not in server.log()
