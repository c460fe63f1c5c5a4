"""Channels that start in the past (issue 46): ``dmq channel add TOPIC CHANNEL --start-time
TIME | --start-id N`` on a real dmq-server and real PostgreSQL.

Thirty messages of orders in three groups of ten, published an hour, half an hour and a
quarter of an hour ago (ids in publish order, as the store draws them). Counted: a channel
added with a start 45 minutes ago has exactly the last twenty waiting, and a consumer that
subscribes to it receives those twenty, each once, and nothing else; from an id, exactly
the ids from it on; without a start nothing waits; a start that cannot be honoured is
refused before anything is registered, and one refused after registering (the retention
sweep meanwhile) says the channel is registered and starts at the latest message.
"""

from __future__ import annotations

import json
import time

import pytest

import registry
from dmq_client.wire import Command
from dmq_server.admin import channel_start, cli
from dmq_server.db.worker import connect

from .support import db_rows, run_cli
from .test_admin_surfaces import admin_server
from .test_clusters import two_clusters  # noqa: F401 (a fixture)
from .test_seek import _receive, publish_aged

pytestmark = pytest.mark.integration


def _pending(dsn: str, channel: str) -> list[int]:
    return [r[0] for r in db_rows(dsn, "SELECT message_id FROM dmq_pending WHERE channel = %s ORDER BY 1", channel)]


def _channels(dsn: str) -> list[str]:
    return [r[0] for r in db_rows(dsn, "SELECT name FROM dmq_channel WHERE topic = 'orders' ORDER BY 1")]


def _ago(minutes: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - minutes * 60))


@pytest.fixture
def stored(make_server, pg_dsn):
    """orders (channel audit), retained two hours, with 30 messages in three groups of
    ten published 60, 30 and 15 minutes ago. Yields (server, [group ids])."""
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders", retention_ms=7_200_000)
        registry.add_channel(conn, "orders", "audit")
    server = admin_server(make_server, channel_state_interval="500ms")
    groups = publish_aged(server, pg_dsn, (60, 30, 15))
    yield server, groups


def test_a_channel_added_with_a_start_time_delivers_exactly_what_was_published_since(stored, pg_dsn):
    server, groups = stored
    later = groups[1] + groups[2]
    out = run_cli(pg_dsn, "channel", "add", "orders", "late", "--start-time", _ago(45))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("added channel late to topic orders\n"), out.stdout
    assert "cluster main: sought orders/late to time " in out.stdout, out.stdout
    assert f"20 messages from id {later[0]} " in out.stdout and f"to id {later[-1]}" in out.stdout, out.stdout
    assert _pending(pg_dsn, "late") == later
    assert db_rows(pg_dsn, "SELECT operation, affected FROM dmq_admin_log WHERE operation = 'channel.add'") == [
        ("channel.add", 20)]

    with server.client() as consumer:
        assert consumer.subscribe("orders", "late", credit=50).command == Command.SUBSCRIBE_ACK
        assert sorted(_receive(consumer, 20)) == later  # each once
        extra = consumer.receive(timeout=1.5)
        assert extra is None, (extra, server.log()[-6000:])  # and nothing else


def test_a_channel_added_with_a_start_id_or_without_a_start(stored, pg_dsn):
    _, groups = stored
    out = run_cli(pg_dsn, "channel", "add", "orders", "from-id", "--start-id", str(groups[2][5]), "--json")
    assert out.returncode == 0, out.stderr
    [answer] = json.loads(out.stdout)
    assert (answer["cluster"], answer["count"], answer["target_id"], answer["top"]) == (
        "main", 5, groups[2][5], groups[2][-1])
    assert _pending(pg_dsn, "from-id") == groups[2][5:]

    out = run_cli(pg_dsn, "channel", "add", "orders", "plain")
    assert out.returncode == 0 and out.stdout == "added channel plain to topic orders\n", (out.stdout, out.stderr)
    assert _pending(pg_dsn, "plain") == []
    assert db_rows(pg_dsn, "SELECT filters FROM dmq_admin_log WHERE operation = 'channel.add'") == [
        (f"orders/from-id from id {groups[2][5]}",)]


@pytest.mark.parametrize("args, code, message", [
    (("--start-time", "2999-01-01T00:00:00Z"), 1, "is after now"),
    (("--start-time", "yesterday-ish"), 2, "--start-time:"),
    (("--start-id", "0"), 2, "--start-id: '0' is not a message id"),
    (("--start-id", "5", "--start-time", "1h"), 2, "not allowed with argument"),
])
def test_a_start_it_cannot_honour_registers_nothing(pg_dsn, args, code, message):
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
    out = run_cli(pg_dsn, "channel", "add", "orders", "late", *args)
    assert out.returncode == code and message in out.stderr, (out.returncode, out.stderr)
    if code == 1:
        assert "nothing was registered" in out.stderr
    assert _channels(pg_dsn) == []


def test_a_start_before_the_retained_start_or_on_a_channel_there_is_refused(pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
        registry.add_channel(conn, "orders", "billing")
    swept_ms = int(time.time() * 1000) - 600_000
    db_rows(pg_dsn, "INSERT INTO dmq_retention (topic, swept_id, swept_ms) VALUES ('orders', 40, %s) RETURNING 1",
            swept_ms)
    out = run_cli(pg_dsn, "channel", "add", "orders", "late", "--start-time", _ago(20))
    assert out.returncode == 1, out.stderr
    assert "on cluster main: topic orders keeps nothing published at or before" in out.stderr, out.stderr
    assert "nothing was registered" in out.stderr
    out = run_cli(pg_dsn, "channel", "add", "orders", "late", "--start-id", "40")
    assert out.returncode == 1 and "keeps nothing" in out.stderr, out.stderr
    assert _channels(pg_dsn) == ["billing"]

    out = run_cli(pg_dsn, "channel", "add", "orders", "billing", "--start-time", "5m")
    assert out.returncode == 1 and "channel 'billing' already exists on topic 'orders'" in out.stderr, out.stderr
    out = run_cli(pg_dsn, "channel", "add", "nosuch", "late", "--start-time", "5m")
    assert out.returncode == 1 and "no such topic 'nosuch'" in out.stderr, out.stderr


def test_a_start_refused_by_a_race_registers_nothing_without_zookeeper(pg_dsn, monkeypatch, capsys):
    """The race the check before registering cannot close: the retention sweep removes the
    start between that check and the seek (done here, on the real database, at that moment).
    Without ZooKeeper the registration is the seek's transaction: nothing stays."""
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
    sweep_meanwhile(monkeypatch, pg_dsn)
    assert cli.main(["--pg-dsn", pg_dsn, "channel", "add", "orders", "late", "--start-time", "5m"]) == 1
    err = capsys.readouterr().err
    assert "cannot start orders/late from time " in err and "on cluster main: topic orders keeps nothing" in err, err
    assert "nothing was registered" in err, err
    assert _channels(pg_dsn) == []


def sweep_meanwhile(monkeypatch, dsn: str) -> None:
    """Make the retention sweep of orders (up to id 40, a minute ago) happen right after
    ``dmq channel add``'s check and before its seek."""
    real = channel_start.start_channel_steps

    def swept(spec, channel, target, dry_run=False):
        if not dry_run:
            db_rows(dsn, "INSERT INTO dmq_retention (topic, swept_id, swept_ms) VALUES ('orders', 40, "
                         "(extract(epoch FROM now()) * 1000)::bigint - 60000) ON CONFLICT DO NOTHING RETURNING 1")
        return real(spec, channel, target, dry_run)

    monkeypatch.setattr(channel_start, "start_channel_steps", swept)


def test_a_channel_of_a_topic_on_another_cluster_starts_there(two_clusters):
    """``remote`` is stored on cluster b: the CLI writes the channel's row into b's database
    itself (a node's mirror need not have come) and seeks it there; main holds none of its
    messages. A consumer then receives exactly the ids from the start."""
    server, main_dsn, b_dsn, _ = two_clusters
    with server.client() as producer:
        ids = [producer.send("remote", b"%d" % i).message_id for i in range(10)]
    out = run_cli(main_dsn, "--pg-cluster", f"b={b_dsn}", "channel", "add", "remote", "late", "--start-id", str(ids[4]))
    assert out.returncode == 0, out.stderr
    assert "cluster main: sought remote/late to id" in out.stdout and "no message to deliver again" in out.stdout
    assert f"cluster b: sought remote/late to id {ids[4]}: 6 messages from id {ids[4]}" in out.stdout, out.stdout
    assert _pending(b_dsn, "late") == ids[4:]
    with server.client() as consumer:
        assert consumer.subscribe("remote", "late", credit=50).command == Command.SUBSCRIBE_ACK
        assert sorted(_receive(consumer, 6)) == ids[4:]
        assert consumer.receive(timeout=1.5) is None
