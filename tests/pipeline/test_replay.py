"""replay: selected dead letters reach a real consumer once, however often the job runs."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from dmq_pipeline import cli, replay
from dmq_pipeline.errors import UsageError
from dmq_pipeline.options import ReplaySettings, time_range

from .conftest import insert_dead_letter, sql

SENTINEL = b"sentinel: everything sent before me has arrived"


def insert_dead_letters(pg_dsn: str) -> dict[str, list[int]]:
    """Dead letters inserted directly: the server does not produce them yet (that is the
    delay/dead-letter issue), so the test writes rows as it will."""
    now = datetime.now(timezone.utc)
    groups = {
        "selected": [("max_attempts", "orders", "billing", None)] * 20,
        "other_reason": [("expired", "orders", "billing", None)] * 4,
        "other_topic": [("max_attempts", "audit", "archive", None)] * 3,
        "already_replayed": [("max_attempts", "orders", "billing", now)] * 2,
    }
    ids: dict[str, list[int]] = {}
    for group, rows in groups.items():
        for i, (reason, topic, channel, replayed_at) in enumerate(rows):
            ids.setdefault(group, []).append(insert_dead_letter(
                pg_dsn, reason=reason, detail="gave up", topic=topic,
                channel=channel, session_id=1000 + i, attempts=5,
                body=f"{group}-{i:03d}".encode(), dead_at=now - timedelta(minutes=10),
                replayed_at=replayed_at,
            ))
    return ids


def receive_until_sentinel(consumer, producer) -> list[bytes]:
    """Everything the channel delivers up to a sentinel sent now (acknowledging all)."""
    producer.send("orders", SENTINEL)
    bodies = []
    while True:
        push = consumer.receive(timeout=20)
        assert push is not None, f"sentinel never arrived; got {bodies}"
        consumer.ack(push)
        if push.body == SENTINEL:
            return bodies
        bodies.append(push.body)


def selected(**changes) -> ReplaySettings:
    """The 20 max_attempts dead letters of orders/billing; orders also has channel shipping,
    which the replayed sends reach too (allowed explicitly)."""
    return ReplaySettings(topic="orders", reason="max_attempts", all_channels=True, **changes)


def test_replay_delivers_each_selected_dead_letter_once(spark, make_server, topic, pg_dsn, db, opts):
    """The 20 selected dead letters are delivered to billing exactly once, recorded with the
    message id the consumer saw; other reasons, topics and replayed rows are left alone; a
    second run selects and delivers nothing."""
    server = make_server()
    ids = insert_dead_letters(pg_dsn)
    span = time_range("1d", "now")
    with server.client() as consumer, server.client() as producer:
        consumer.subscribe("orders", "billing", credit=100)
        settings = selected(server=f"127.0.0.1:{server.tcp_port}", mark_batch=7)
        progress: list[str] = []

        first = replay.run_replay(spark, db, opts, settings, span, progress.append)

        assert (first.selected, first.replayed, first.failures) == (20, 20, 0)
        assert progress[-1] == "replay: 20/20 recorded"
        got = receive_until_sentinel(consumer, producer)
        assert sorted(got) == [f"selected-{i:03d}".encode() for i in range(20)]
        rows = {r[0]: r for r in sql(pg_dsn, "dead_letters")}
        assert all(rows[i][5] is not None for i in ids["selected"])
        assert all(rows[i][5] is None for i in ids["other_reason"] + ids["other_topic"])
        assert all(rows[i][6] is None for i in ids["already_replayed"])

        second = replay.run_replay(spark, db, opts, settings, span)

        assert (second.selected, second.replayed) == (0, 0)
        assert receive_until_sentinel(consumer, producer) == []


def test_rerun_after_a_crash_before_recording_delivers_nothing_new(spark, make_server, topic, pg_dsn, db, opts):
    """If a run sent dead letters but died before recording them, the next run sends them
    again with the same (producer, session id): the server answers with the stored message,
    nothing is delivered twice, and the rows are recorded with the original message ids."""
    server = make_server()
    ids = insert_dead_letters(pg_dsn)
    span = time_range("1d", "now")
    settings = selected(server=f"127.0.0.1:{server.tcp_port}")
    with server.client() as consumer, server.client() as producer:
        consumer.subscribe("orders", "billing", credit=100)
        replay.run_replay(spark, db, opts, settings, span)
        assert len(receive_until_sentinel(consumer, producer)) == 20
        before = {r[0]: r[6] for r in sql(pg_dsn, "dead_letters")}
        lost = ids["selected"][:8]
        sql(pg_dsn, "forget_replays", ids=lost)

        again = replay.run_replay(spark, db, opts, settings, span)

        assert (again.selected, again.replayed, again.failures) == (8, 8, 0)
        assert receive_until_sentinel(consumer, producer) == []
        after = {r[0]: r[6] for r in sql(pg_dsn, "dead_letters")}
        assert after == before


def test_channel_dead_letters_are_not_fanned_out_unasked(spark, make_server, topic, pg_dsn, db, opts):
    """Dead letters of orders/billing would reach orders/shipping too (a send goes to every
    channel): without --all-channels the replay refuses, sends nothing and marks nothing."""
    server = make_server()
    insert_dead_letters(pg_dsn)
    settings = ReplaySettings(topic="orders", reason="max_attempts", server=f"127.0.0.1:{server.tcp_port}")
    with pytest.raises(UsageError, match="would also reach channel.s. shipping"):
        replay.run_replay(spark, db, opts, settings, time_range("1d", "now"))
    assert sum(1 for r in sql(pg_dsn, "dead_letters") if r[5] is not None) == 2


def test_replay_command_dry_run_and_run(spark, make_server, topic, pg_dsn, capsys):
    """`dmq-pipeline replay --dry-run` counts the selection and sends nothing; without it the
    command replays, prints the tally and exits 0."""
    server = make_server()
    insert_dead_letters(pg_dsn)
    args = ["replay", "--pg-dsn", pg_dsn, "--topic", "orders", "--reason", "max_attempts",
            "--server", f"127.0.0.1:{server.tcp_port}", "--partitions", "2", "--all-channels"]

    assert cli.main(args + ["--dry-run"]) == 0
    assert "would replay 20 dead letters" in capsys.readouterr().out
    assert sum(1 for r in sql(pg_dsn, "dead_letters") if r[5] is not None) == 2

    assert cli.main(args) == 0
    assert "replayed 20 of 20 dead letters" in capsys.readouterr().out
    assert cli.main(args) == 0
    assert "nothing to replay" in capsys.readouterr().out


def test_replaying_rate_limited_dead_letters_keeps_to_the_topic_rate(spark, make_server, topic, pg_dsn, db, opts):
    """Dead letters refused for a topic's rate limit are replayed at that rate: all of them
    delivered, none refused again, no new dead letter recorded (each used to trip the limit
    again and come back as a new dead letter, one summary line per id)."""
    import registry
    from dmq_server.db.worker import connect

    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "paced", msg_timeout_ms=60000, rate_limit=5)
        registry.add_channel(conn, "paced", "c")
    server = make_server()
    now = datetime.now(timezone.utc)
    for i in range(15):
        insert_dead_letter(pg_dsn, reason="rate_limited", detail="over the limit", topic="paced",
            channel=None, session_id=i, attempts=0, body=b"paced-%d" % i, dead_at=now, replayed_at=None)
    settings = ReplaySettings(topic="paced", reason="rate_limited", server=f"127.0.0.1:{server.tcp_port}")

    result = replay.run_replay(spark, db, opts, settings, time_range("1d", "now"))

    assert (result.selected, result.replayed, result.failures) == (15, 15, 0), result.failed
    assert len(sql(pg_dsn, "dead_letters")) == 15  # nothing refused, nothing recorded anew
    assert sorted(b for (b,) in sql(pg_dsn, "replayed_bodies")) == sorted(b"paced-%d" % i for i in range(15))


def test_the_pacer_spaces_sends_per_topic_and_slows_down_when_refused():
    now = [100.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(round(seconds, 6))
        now[0] += seconds

    pacer = replay.Pacer({"paced": 4.0}, clock=lambda: now[0], sleep=sleep)
    for _ in range(3):
        pacer.wait("paced")
        pacer.wait("free")  # no limit: never waits
    assert slept == [0.25, 0.25]
    pacer.wait("paced", slower=2.0)  # after a refusal: the next gap is doubled
    pacer.wait("paced")
    assert slept == [0.25, 0.25, 0.25, 0.5]


def test_failed_sends_are_summed_by_reply_and_code_not_by_description():
    key = replay.outcome_key
    assert key("SEND_EXCEED_LIMIT_ACK", "E_RATE_LIMITED topic 'a' accepts at most 5; recorded as dead letter 17") == (
        key("SEND_EXCEED_LIMIT_ACK", "E_RATE_LIMITED topic 'a' accepts at most 5; recorded as dead letter 18")
    ) == "SEND_EXCEED_LIMIT_ACK E_RATE_LIMITED"
    assert key("SEND_NO_TOPIC_ACK", "") == "SEND_NO_TOPIC_ACK"


PROPERTIES = [  # (key, priority, headers) of dead letters of orders/billing, by turns
    ("order-1", 7, {"content-type": "application/json", "tenant": "acme"}),
    ("order-2", 0, None),
    (None, 3, None),
    (None, 0, {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}),
    (None, 0, None),  # none: sent as before properties existed
]


def insert_dead_letters_with_properties(pg_dsn: str) -> dict[bytes, tuple]:
    """A dead letter for each of PROPERTIES; each body's properties."""
    now = datetime.now(timezone.utc)
    given = {}
    for i, (key, priority, headers) in enumerate(PROPERTIES):
        body = b"with-properties-%d" % i
        insert_dead_letter(pg_dsn, reason="max_attempts", detail="gave up", topic="orders", channel="billing",
                           session_id=i, attempts=5, body=body, dead_at=now - timedelta(minutes=1),
                           replayed_at=None, key=key, priority=priority, headers=headers)
        given[body] = (key, priority, headers)
    return given


def test_replay_sends_each_dead_letter_with_its_key_priority_and_headers(spark, make_server, topic, pg_dsn, db,
                                                                        opts):
    """A replayed dead letter reaches the consumer with the key, priority and headers it was
    sent with, and the server stores them with the new message; one without any has none.
    One whose stored properties break a rule (written around the server) is counted, not sent."""
    from dmq_client import ReceivedMessage

    server = make_server()
    given = insert_dead_letters_with_properties(pg_dsn)
    broken = insert_dead_letter(pg_dsn, reason="max_attempts", detail="", topic="orders", channel="billing",
                                session_id=99, attempts=5, body=b"broken", dead_at=datetime.now(timezone.utc),
                                replayed_at=None, headers={"Not A Token": "x"})
    with server.client() as consumer, server.client() as producer:
        consumer.subscribe("orders", "billing", credit=100)

        result = replay.run_replay(spark, db, opts, selected(server=f"127.0.0.1:{server.tcp_port}"),
                                   time_range("1d", "now"))

        assert (result.selected, result.replayed) == (6, 5)
        assert result.failed == {replay.BAD_PROPERTIES: 1}
        assert [r[5] for r in sql(pg_dsn, "dead_letters") if r[0] == broken] == [None]
        producer.send("orders", SENTINEL)
        got = {}
        while len(got) < len(given) + 1:
            push = consumer.receive(timeout=20)
            assert push is not None, f"got {sorted(got)}"
            consumer.ack(push)
            props = ReceivedMessage.properties_of(push.status)
            got[push.body] = (props.key, props.priority, dict(props.headers) or None)
    assert got.pop(SENTINEL) == (None, 0, None)
    assert got == given
    stored = sql(pg_dsn, "replayed_properties")
    assert [row[1:4] for row in stored] == [row[4:] for row in stored] == list(given.values())


def test_a_server_without_props_gets_only_the_dead_letters_without_properties(spark, topic, pg_dsn, db, opts):
    """A server older than PROPS would store a message without its properties: the replay
    sends it the dead letters without any, exactly as before (no status), and leaves those
    with properties unsent and unrecorded, counted, for a run against a newer server."""
    from dmq_client.wire import FEATURE_ACKS, FEATURE_CONFIRM, Command
    from tests.unit.test_client_fake_server import FakeServer

    given = insert_dead_letters_with_properties(pg_dsn)
    older = FakeServer(features=f"{FEATURE_ACKS} {FEATURE_CONFIRM}")
    try:
        result = replay.run_replay(spark, db, opts, selected(server=older.address), time_range("1d", "now"))
        sent = []
        while not older.received.empty():
            _, frame = older.received.get()
            if frame.command == Command.UP_PRODUCER_RESEND:
                sent.append((frame.body, frame.status))
    finally:
        older.close()
    assert sent == [(b"with-properties-4", "")]
    assert (result.selected, result.replayed) == (5, 1)
    assert result.failed == {replay.UNSUPPORTED: 4}
    assert [r[4] for r in sql(pg_dsn, "dead_letters") if r[5] is None] == [
        body for body, props in given.items() if props != (None, 0, None)
    ]
