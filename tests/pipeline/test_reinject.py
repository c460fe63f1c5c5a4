"""reinject: a seek --from-archive's gap reaches the one channel from the archive, once.

A real dmq-server stores three groups of messages of ``orders`` (billing, shipping): an early
group, then the gap's group (with keys, priorities and headers), both acknowledged on both
channels, archived and swept out of the store; then a third group, kept. ``dmq channel seek
orders billing --to-time <the gap's first publish time> --from-archive`` seeks billing to the
retained start and names the ``dmq-pipeline reinject`` command; run as named, it queues the
gap for billing, the server's delay workers move it, and billing receives exactly the gap's
messages (by body, with their properties) and the kept group again; shipping nothing. A
second run queues nothing.
"""

from __future__ import annotations

import json
import shlex

from dmq_client import ReceivedMessage
from dmq_client.wire import Command
from dmq_server.db.messages import MAX_ID, SweepTarget, sweep_topic_steps
from dmq_server.db.steps import run_steps
from dmq_server.db.worker import connect
from dmq_pipeline import archive, cli, reinject
from dmq_pipeline.options import ArchiveSettings

from .conftest import consume
from tests.integration.support import db_rows, http_get, run_cli, wait_for


def _db_now_ms(dsn: str) -> int:
    return db_rows(dsn, "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")[0][0]


def _send(server, dsn: str, bodies: dict[bytes, tuple]) -> list[int]:
    """Send each body with its (key, priority, headers); their ids. Returns once the
    database's clock is past the last one's publish time, so the next group's times differ."""
    ids = []
    with server.client() as producer:
        for body, (key, priority, headers) in bodies.items():
            props = {k: v for k, v in (("key", key), ("priority", priority), ("headers", headers)) if v}
            reply = producer.send("orders", body, **props)
            assert reply.command == Command.SEND_SUCCESS_ACK, reply.status
            ids.append(reply.message_id)
    last = db_rows(dsn, "SELECT (extract(epoch FROM max(published_at)) * 1000)::bigint FROM dmq_message "
                        "WHERE id = ANY(%s)", ids)[0][0]
    wait_for(lambda: _db_now_ms(dsn) > last + 2, timeout=5)
    return ids


def _acked_on_both(server, dsn: str, count: int, logged_before: int) -> None:
    for channel in ("billing", "shipping"):
        consume(server, "orders", channel, count)
    wait_for(lambda: db_rows(dsn, "SELECT count(*) FROM dmq_delivery_log")[0][0] == logged_before + 2 * count,
             timeout=20)


def _pending(dsn: str, channel: str) -> int:
    return db_rows(dsn, "SELECT count(*) FROM dmq_pending WHERE channel = %s", channel)[0][0]


def _epoch(server, channel: str) -> int:
    stats = json.loads(http_get(server.http + "/stats?format=json&topic=orders")[1])
    (topic,) = stats["topics"]
    return next(c["epoch"] for c in topic["channels"] if c["channel_name"] == channel)


def test_a_seeks_gap_is_reinjected_from_the_archive_into_that_channel_only(
        spark, make_server, topic, pg_dsn, db, opts, tmp_path, capsys):
    # the node learns of the CLI's seek at its next channel state read: a copy it pushes
    # before that is pushed again after it (the seek's epoch fences its ack), which the
    # count below would take for a duplicate (a CI run: the default 5 s read came after
    # billing subscribed). So billing subscribes once /stats shows the seek's epoch.
    server = make_server(channel_state_interval="0.2s")
    early = {b"early-%d" % i: (None, 0, None) for i in range(4)}
    gap = {b"gap-0": ("k-0", 7, {"content-type": "text/plain", "n": "0"}),
           b"gap-1": ("k-1", 0, None),
           b"gap-2": (None, 3, {"n": "2"}),
           b"gap-3": (None, 0, None),
           b"gap-4": ("k-0", 9, {"n": "4"})}
    early_ids = _send(server, pg_dsn, early)
    gap_ids = _send(server, pg_dsn, gap)
    _acked_on_both(server, pg_dsn, len(early) + len(gap), 0)
    location = str(tmp_path / "arch")
    archived = archive.run_archive(spark, db, opts, ArchiveSettings(archive=location, older_than=0.0))
    assert archived.rows == 2 * (len(early) + len(gap))

    # the retention sweep removes both groups (every channel is done with them)
    swept = []

    def sweep() -> bool:
        with connect(pg_dsn) as conn, conn.transaction():
            done = run_steps(conn, sweep_topic_steps(SweepTarget("orders", 0.0, MAX_ID), 1000))
        swept.append(done[0] if done else 0)
        return sum(swept) == len(early) + len(gap)

    wait_for(sweep, timeout=20)
    assert db_rows(pg_dsn, "SELECT swept_id FROM dmq_retention WHERE topic = 'orders'") == [(max(gap_ids),)]
    kept_ids = _send(server, pg_dsn, {b"kept-%d" % i: (None, 0, None) for i in range(3)})
    _acked_on_both(server, pg_dsn, 3, 0)
    since_ms = db_rows(pg_dsn, "SELECT (extract(epoch FROM min(published_at)) * 1000)::bigint FROM dmq_message "
                               "WHERE id = ANY(%s)", gap_ids)
    assert since_ms == [(None,)]  # swept: the store no longer has the gap
    first_gap_ms = min(r.published_at for r in archive.read_archive(spark, location)
                       .where(f"message_id = {gap_ids[0]}").collect())

    # without --from-archive: refused; with it, a dry run says both parts and changes nothing
    refused = run_cli(pg_dsn, "channel", "seek", "orders", "billing", "--to-time", _utc(first_gap_ms))
    assert refused.returncode == 1 and "--from-archive" in refused.stderr, refused.stderr
    dry = run_cli(pg_dsn, "channel", "seek", "orders", "billing", "--to-time", _utc(first_gap_ms),
                  "--from-archive", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would deliver 3 messages" in dry.stdout and "dmq-pipeline reinject --archive" in dry.stdout, dry.stdout
    assert _pending(pg_dsn, "billing") == 0

    out = run_cli(pg_dsn, "channel", "seek", "orders", "billing", "--to-time", _utc(first_gap_ms),
                  "--from-archive", "--json")
    assert out.returncode == 0, out.stderr
    [answer] = json.loads(out.stdout)
    named = answer["from_archive"]
    assert answer["count"] == 3 and answer["target_id"] == kept_ids[0]
    assert named["archive"] == archive.normalize_location(location)
    command = shlex.split(named["reinject"])
    assert command[:2] == ["dmq-pipeline", "reinject"] and _utc(first_gap_ms) in command
    audit = db_rows(pg_dsn, "SELECT filters, affected FROM dmq_admin_log WHERE operation = 'channel.seek'")
    assert len(audit) == 1 and "from archive" in audit[0][0] and audit[0][1] == 3

    run = command[1:] + ["--pg-dsn", pg_dsn, "--partitions", "2", "--batch", "2", "--json"]
    assert cli.main(run) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["selected"], first["queued"], first["missing_messages"]) == (len(gap), len(gap), 0)
    assert cli.main(run) == 0  # a second run: nothing new (queued, or already moved and stored)
    second = json.loads(capsys.readouterr().out)
    assert (second["selected"], second["queued"], second["already_queued"]) == (len(gap), 0, len(gap))
    assert db_rows(pg_dsn, "SELECT operation, affected FROM dmq_admin_log WHERE operation = 'channel.reinject' "
                           "ORDER BY id") == [("channel.reinject", len(gap)), ("channel.reinject", 0)]

    wait_for(lambda: _epoch(server, "billing") == 1, timeout=20)  # this node applied the seek

    # the server's delay workers move the gap into billing; billing receives it and the kept group
    got = {}
    with server.client() as billing:
        billing.subscribe("orders", "billing", credit=50)
        while len(got) < len(gap) + 3:
            push = billing.receive(timeout=20)
            assert push is not None, f"billing got {sorted(got)}"
            billing.ack(push)
            props = ReceivedMessage.properties_of(push.status)
            got[push.body] = (props.key, props.priority, dict(props.headers) or None)
        assert billing.receive(timeout=1.5) is None
    assert got == {**gap, **{b"kept-%d" % i: (None, 0, None) for i in range(3)}}
    assert not set(got) & set(early)
    stored = db_rows(pg_dsn, "SELECT producer, session_id, channel FROM dmq_message "
                             "WHERE producer LIKE 'dmq-archive:%%' ORDER BY session_id")
    assert stored == [(reinject.producer_for("billing"), i, "billing") for i in gap_ids]
    assert _pending(pg_dsn, "shipping") == 0
    with server.client() as shipping:
        shipping.subscribe("orders", "shipping", credit=50)
        assert shipping.receive(timeout=1.5) is None
    assert early_ids and db_rows(pg_dsn, "SELECT count(*) FROM dmq_delay") == [(0,)]


def _utc(naive_local) -> str:
    """A naive local time from Spark's collect() as ISO 8601 UTC with milliseconds."""
    from datetime import timezone

    return naive_local.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
