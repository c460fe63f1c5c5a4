"""Seeking a channel end to end (issue 46): a real dmq-server on real PostgreSQL, consumers
connected through the seek, the CLI (straight to PostgreSQL) and the admin API.

Thirty messages in three groups published an hour, half an hour and a quarter of an hour
ago (ids in publish order, as the store draws them), all acknowledged on both channels.
Counted: a seek of billing to 45 minutes ago makes exactly the last twenty its to deliver
again; the connected consumer receives those twenty again, each once, and no other; audit
receives nothing; the dry run's count is the seek's; the seek is audited. Then a seek to
an id, to the latest message, and the refusals, each with its specific message.
"""

from __future__ import annotations

import json
import time

import pytest

import registry
from dmq_client.wire import Command
from dmq_server.db.worker import connect

from .support import db_rows, run_cli, wait_for
from .test_admin_surfaces import admin_server, http

pytestmark = pytest.mark.integration


def _pending(dsn: str, channel: str) -> list[int]:
    return [r[0] for r in db_rows(dsn, "SELECT message_id FROM dmq_pending WHERE channel = %s ORDER BY 1", channel)]


def _receive(consumer, count: int) -> list[int]:
    """The next ``count`` pushes' ids, each acknowledged; then nothing more for a while."""
    ids = []
    while len(ids) < count:
        push = consumer.receive(timeout=15)
        assert push is not None, f"only {len(ids)} of {count} pushed: {ids}"
        ids.append(push.message_id)
        consumer.ack(push)
    return ids


def publish_aged(server, dsn: str, ages_min: tuple[int, ...]) -> list[list[int]]:
    """Ten messages of orders per age (minutes ago, as their publish time), in that order:
    their ids, a list per age."""
    groups = []
    with server.client() as producer:
        for n, age in enumerate(ages_min):
            ids = []
            for i in range(10):
                reply = producer.send("orders", b"%d-%d" % (n, i))
                assert reply.command == Command.SEND_SUCCESS_ACK, reply.status
                ids.append(reply.message_id)
            db_rows(dsn, "UPDATE dmq_message SET published_at = now() - make_interval(mins => %s) "
                         "WHERE id = ANY(%s) RETURNING id", age, ids)
            groups.append(ids)
    return groups


@pytest.fixture
def published(make_server, pg_dsn):
    """orders (billing, audit) with 30 messages in three groups of ten, published 60, 30
    and 15 minutes ago and acknowledged on both channels; a consumer of billing still
    connected. Yields (server, consumer, [group ids])."""
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders", retention_ms=7_200_000)
        registry.add_channel(conn, "orders", "billing")
        registry.add_channel(conn, "orders", "audit")
    server = admin_server(make_server, channel_state_interval="500ms")
    groups = publish_aged(server, pg_dsn, (60, 30, 15))
    everything = [i for g in groups for i in g]
    with server.client() as audit:
        assert audit.subscribe("orders", "audit", credit=50).command == Command.SUBSCRIBE_ACK
        assert sorted(_receive(audit, 30)) == everything
    with server.client() as billing:
        assert billing.subscribe("orders", "billing", credit=50).command == Command.SUBSCRIBE_ACK
        assert sorted(_receive(billing, 30)) == everything
        wait_for(lambda: not _pending(pg_dsn, "billing") and not _pending(pg_dsn, "audit"), timeout=15)
        yield server, billing, groups


def test_a_seek_to_a_time_delivers_again_exactly_what_was_published_since(published, pg_dsn):
    server, billing, groups = published
    later = groups[1] + groups[2]
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 45 * 60))

    dry = run_cli(pg_dsn, "channel", "seek", "orders", "billing", "--by", "-45m", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    [report] = json.loads(dry.stdout)
    assert (report["count"], report["target_id"], report["top"], report["epoch"]) == (20, later[0], later[-1], None)
    assert _pending(pg_dsn, "billing") == []  # a dry run changes nothing

    out = run_cli(pg_dsn, "channel", "seek", "orders", "billing", "--to-time", when)
    assert out.returncode == 0, out.stderr
    assert f"20 messages from id {later[0]}" in out.stdout and "epoch 1" in out.stdout, out.stdout
    assert _pending(pg_dsn, "billing") == later
    assert _pending(pg_dsn, "audit") == []

    again = _receive(billing, 20)  # the running node learns at its channel-state read
    assert sorted(again) == later  # each once
    assert billing.receive(timeout=1.5) is None  # and nothing else
    wait_for(lambda: not _pending(pg_dsn, "billing"), timeout=15)
    assert db_rows(pg_dsn, "SELECT operation, affected FROM dmq_admin_log WHERE operation = 'channel.seek'") == [
        ("channel.seek", 20)]
    assert "was sought (epoch 1)" in server.log()


def test_a_seek_through_the_admin_api_to_an_id_and_to_the_latest(published, pg_dsn):
    server, billing, groups = published
    status, answer = http(server, "POST", f"/admin/channels/orders/billing/seek?to_id={groups[2][5]}&dry_run=true")
    assert status == 200 and [c["count"] for c in answer["clusters"]] == [5]
    status, answer = http(server, "POST", f"/admin/channels/orders/billing/seek?to_id={groups[2][5]}")
    assert status == 200 and answer["clusters"][0]["epoch"] == 1
    assert sorted(_receive(billing, 5)) == groups[2][5:]  # this node applied it at once

    # the latest: what waits is skipped
    wait_for(lambda: not _pending(pg_dsn, "billing"), timeout=15)
    assert run_cli(pg_dsn, "channel", "seek", "orders", "billing", "--to-time", "2h").returncode == 0
    wait_for(lambda: len(_pending(pg_dsn, "billing")) == 30, timeout=15)
    out = run_cli(pg_dsn, "channel", "seek", "orders", "billing", "--to-latest")
    assert out.returncode == 0 and "no message" in out.stdout, out.stdout
    assert _pending(pg_dsn, "billing") == []


@pytest.mark.parametrize("args, code, message", [
    (("orders", "nope", "--to-latest"), 1, "no such channel: orders/nope is not registered"),
    (("orders", "billing", "--to-time", "2999-01-01T00:00:00Z"), 1, "it is after now"),
    (("orders", "billing", "--to-time", "yesterday-ish"), 2, "to_time:"),
    (("orders", "billing", "--to-id", "0"), 2, "is not a message id"),
    (("orders", "billing", "--by", "1h"), 2, "does not go back"),
    (("orders", "billing", "--to-id", "5", "--to-latest"), 2, "not allowed with argument"),
])
def test_a_seek_it_cannot_do_is_refused_with_its_reason(pg_dsn, args, code, message):
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
        registry.add_channel(conn, "orders", "billing")
    out = run_cli(pg_dsn, "channel", "seek", *args)
    assert out.returncode == code and message in out.stderr, (out.returncode, out.stderr)


def test_a_seek_from_archive_through_the_admin_api_seeks_to_the_retained_start(published, pg_dsn):
    """The admin API's from_archive=true: a time before what the sweep removed (noted as the sweep
    notes it: everything up to the first group's last message) seeks to the retained start and
    names the gap's reinject command; without an archive it is refused (400)."""
    server, billing, groups = published
    swept_ms = db_rows(pg_dsn, "SELECT (extract(epoch FROM published_at) * 1000)::bigint FROM dmq_message "
                               "WHERE id = %s", groups[0][-1])[0][0]
    db_rows(pg_dsn, "INSERT INTO dmq_retention VALUES ('orders', %s, %s) RETURNING topic", groups[0][-1], swept_ms)
    status, answer = http(server, "POST", "/admin/channels/orders/billing/seek?by=-2h&from_archive=true")
    assert status == 400 and "no archive to re-inject it from" in answer["message"], answer
    db_rows(pg_dsn, "INSERT INTO dmq_archive_state (location) VALUES ('/srv/dmq-archive') RETURNING location")
    status, answer = http(server, "POST", "/admin/channels/orders/billing/seek?by=-2h&from_archive=true")
    assert status == 200, answer
    [report] = answer["clusters"]
    assert (report["count"], report["target_id"]) == (20, groups[1][0])
    assert report["from_archive"]["until_ms"] == swept_ms + 1
    assert report["from_archive"]["reinject"].startswith(
        "dmq-pipeline reinject --archive /srv/dmq-archive --topic orders --channel billing --since ")
    assert sorted(_receive(billing, 20)) == groups[1] + groups[2]
    [(filters,)] = db_rows(pg_dsn, "SELECT filters FROM dmq_admin_log WHERE operation = 'channel.seek'")
    assert "from archive" in filters
