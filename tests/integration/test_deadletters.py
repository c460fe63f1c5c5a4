"""Rate limits, expiry, max attempts and dead-letter replay/delete/filters, end to end.

Real dmq-server processes on real PostgreSQL; the dead-letter operations through
the ``dmq`` CLI as an operator runs them.
"""

from __future__ import annotations

import json

import pytest

import registry
from dmq_client.wire import Command
from dmq_server.db.schema import migrate
from dmq_server.db.worker import connect

from .support import db_rows, http_get, run_cli, wait_for


def make_topic(dsn: str, name: str, channels=("c",), **settings) -> str:
    migrate(dsn)
    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, name, **settings)
        for channel in channels:
            registry.add_channel(conn, name, channel)
    return name


def add_dead_letter(dsn: str, **fields) -> int:
    row = {
        "reason": "expired",
        "detail": "",
        "topic": "orders",
        "channel": "billing",
        "producer": "p",
        "session_id": 1,
        "message_id": None,
        "attempts": 0,
        "body": b"body",
        "dead_at": None,
    }
    row.update(fields)
    return db_rows(
        dsn,
        "INSERT INTO dmq_dead_letter (reason, detail, topic, channel, producer, session_id, message_id,"
        " attempts, body, dead_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, coalesce(%s, now()))"
        " RETURNING id",
        *row.values(),
    )[0][0]


def test_rate_limit_refuses_with_exceed_limit_and_records_dead_letters(make_server, pg_dsn):
    """Over a topic's rate limit the producer hears SEND_EXCEED_LIMIT_ACK, and each refused
    send is a rate_limited dead letter with its producer, session id and body."""
    topic = make_topic(pg_dsn, "limited", rate_limit=5)
    server = make_server()
    with server.client() as producer:
        replies = producer.send_many(topic, [b"m%d" % i for i in range(30)])
    accepted = [r for r in replies if r.command == Command.SEND_SUCCESS_ACK]
    refused = [r for r in replies if r.command == Command.SEND_EXCEED_LIMIT_ACK]
    assert len(accepted) + len(refused) == 30
    assert 5 <= len(accepted) <= 8  # a full bucket of 5, plus what refilled meanwhile
    assert all("E_RATE_LIMITED" in r.status and "dead letter" in r.status for r in refused)
    rows = db_rows(
        pg_dsn,
        "SELECT reason, topic, channel, producer, session_id, body FROM dmq_dead_letter ORDER BY id",
    )
    assert len(rows) == len(refused)
    assert {r[4] for r in rows} == {r.session_id for r in refused}
    assert all(r[0] == "rate_limited" and r[1] == topic and r[2] is None for r in rows)
    assert all(r[3] == producer.producer for r in rows)
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message") == [(len(accepted),)]


def test_expired_copies_become_dead_letters_and_leave_memory(make_server, pg_dsn):
    """Copies not acknowledged within the topic's TTL move to dead letters (reason expired,
    with channel and message id); the in-memory channel drops them (ready and in flight), so
    nothing more is pushed once they expired."""
    topic = make_topic(pg_dsn, "short", ttl_ms=400)
    server = make_server(expiry_interval="100ms")
    with server.client() as producer, server.client() as consumer:
        assert consumer.subscribe(topic, "c", credit=1).command == Command.SUBSCRIBE_ACK
        replies = producer.send_many(topic, [b"a", b"b", b"c"])
        first = consumer.receive(timeout=5)
        assert first is not None  # credit 1: the other two wait in the channel's memory
        rows = wait_for(
            lambda: (r := db_rows(pg_dsn, "SELECT reason, channel, message_id, detail FROM dmq_dead_letter"))
            and len(r) == 3 and r
        )
        assert {r[2] for r in rows} == {r.message_id for r in replies}
        assert all(r[0] == "expired" and r[1] == "c" and "400 ms" in r[3] for r in rows)
        assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)]
        # a copy pushed before its own expiry (the sweep may take them one by one) is fine;
        # once all expired, the channel holds nothing and pushes nothing
        while (late := consumer.receive(timeout=0.3)) is not None:
            assert late.message_id in {r.message_id for r in replies}
        status, body = http_get(server.http + "/stats")
        channel = json.loads(body)["topics"][0]["channels"][0]
        assert (channel["depth"], channel["in_flight_count"]) == (0, 0)
        consumer.ack(first)  # an ack of an expired copy is ignored
        assert consumer.receive(timeout=1.0) is None


def test_max_attempts_turns_the_last_timeout_into_a_dead_letter(make_server, pg_dsn):
    """With max_attempts 2, a copy is delivered twice (attempts 1 and 2); when the second
    times out too it becomes a max_attempts dead letter and is not pushed again."""
    topic = make_topic(pg_dsn, "retry", max_attempts=2, msg_timeout_ms=300)
    server = make_server()
    with server.client() as producer, server.client() as consumer:
        assert consumer.subscribe(topic, "c").command == Command.SUBSCRIBE_ACK
        reply = producer.send(topic, b"poison")
        pushes = [consumer.receive(timeout=5), consumer.receive(timeout=5)]
        assert [p.attempts for p in pushes] == [1, 2]
        rows = wait_for(
            lambda: db_rows(
                pg_dsn, "SELECT reason, channel, message_id, attempts, body, detail FROM dmq_dead_letter"
            )
        )
        assert rows == [("max_attempts", "c", reply.message_id, 2, b"poison", rows[0][5])]
        assert "2 times" in rows[0][5]
        assert consumer.receive(timeout=1.0) is None
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)]


def test_attempts_survive_a_restart(make_server, pg_dsn):
    """Redelivery attempts are written back, so after a restart the count goes on from
    where it was and max_attempts still holds."""
    topic = make_topic(pg_dsn, "retry", max_attempts=3, msg_timeout_ms=300)
    server = make_server()
    with server.client() as producer, server.client() as consumer:
        assert consumer.subscribe(topic, "c").command == Command.SUBSCRIBE_ACK
        producer.send(topic, b"x")
        assert [consumer.receive(timeout=5).attempts for _ in range(2)] == [1, 2]
        wait_for(lambda: db_rows(pg_dsn, "SELECT attempts FROM dmq_pending") == [(2,)])
    server.kill()
    server.start()
    with server.client() as consumer:
        assert consumer.subscribe(topic, "c").command == Command.SUBSCRIBE_ACK
        push = consumer.receive(timeout=5)
        assert push.attempts == 3
        wait_for(lambda: db_rows(pg_dsn, "SELECT reason, attempts FROM dmq_dead_letter") == [("max_attempts", 3)])


def test_replay_goes_to_its_channel_only_and_twice_delivers_once(make_server, topic, pg_dsn):
    """Replaying a dead letter of channel billing delivers it to billing, not to audit; a
    second replay does nothing; the dead letter records when and as which message."""
    assert run_cli(pg_dsn, "channel", "add", topic, "audit").returncode == 0
    letter = add_dead_letter(pg_dsn, topic=topic, channel="billing", body=b"again")
    server = make_server(delay_poll_interval="100ms")
    with server.client() as billing, server.client() as audit:
        for c, ch in ((billing, "billing"), (audit, "audit")):
            assert c.subscribe(topic, ch).command == Command.SUBSCRIBE_ACK
        first = run_cli(pg_dsn, "dlq", "replay", str(letter))
        assert first.returncode == 0, first.stderr
        assert "replayed 1 dead letters" in first.stdout
        second = run_cli(pg_dsn, "dlq", "replay", str(letter))
        assert second.returncode == 0 and "replayed 0 dead letters" in second.stdout
        push = billing.receive(timeout=10)
        assert push is not None and push.body == b"again"
        assert (push.producer, push.session_id) == ("dmq-replay", letter)
        billing.ack(push)
        assert billing.receive(timeout=1.0) is None
        assert audit.receive(timeout=0.2) is None
    replayed = wait_for(
        lambda: db_rows(
            pg_dsn, "SELECT replayed_at IS NOT NULL, replay_message_id FROM dmq_dead_letter WHERE id = %s", letter
        )[0][1]
        and db_rows(pg_dsn, "SELECT replay_message_id FROM dmq_dead_letter WHERE id = %s", letter)
    )
    assert replayed == [(push.message_id,)]
    log = db_rows(pg_dsn, "SELECT surface, operation, affected FROM dmq_admin_log ORDER BY id")
    assert log == [("cli", "dlq.replay", 1), ("cli", "dlq.replay", 0)]


def test_replay_of_a_dead_letter_without_channel_reaches_every_channel(make_server, topic, pg_dsn):
    """A rate-limited dead letter has no channel (refused before fan-out): replay sends it to
    every channel of its topic."""
    assert run_cli(pg_dsn, "channel", "add", topic, "audit").returncode == 0
    letter = add_dead_letter(pg_dsn, reason="rate_limited", channel=None, body=b"fan")
    server = make_server(delay_poll_interval="100ms")
    with server.client() as billing, server.client() as audit:
        for c, ch in ((billing, "billing"), (audit, "audit")):
            assert c.subscribe(topic, ch).command == Command.SUBSCRIBE_ACK
        assert run_cli(pg_dsn, "dlq", "replay", "--ids", str(letter)).returncode == 0
        assert billing.receive(timeout=10).body == b"fan"
        assert audit.receive(timeout=10).body == b"fan"


def test_filters_list_show_and_delete(pg_dsn, topic):
    """Filters by topic, channel, reason, time range and ids select the right dead letters;
    show prints one with its body; delete removes the selection and is audited; a delete
    without any selection is refused."""
    migrate(pg_dsn)
    a = add_dead_letter(pg_dsn, reason="expired", channel="billing", dead_at="2024-01-01T00:00:00Z")
    b = add_dead_letter(pg_dsn, reason="max_attempts", channel="billing", dead_at="2024-02-01T00:00:00Z")
    c = add_dead_letter(pg_dsn, reason="rate_limited", channel=None, dead_at="2024-03-01T00:00:00Z")
    d = add_dead_letter(pg_dsn, reason="expired", topic="other", channel="x", body=b"\xff\x00")

    def listed(*args: str) -> list[int]:
        result = run_cli(pg_dsn, "dlq", "list", "--json", *args)
        assert result.returncode == 0, result.stderr
        return [row["id"] for row in json.loads(result.stdout)]

    assert listed() == [a, b, c, d]
    assert listed("--reason", "expired") == [a, d]
    assert listed("--topic", "orders", "--channel", "billing") == [a, b]
    assert listed("--since", "2024-01-15T00:00:00Z", "--until", "2024-02-15T00:00:00Z") == [b]
    assert listed("--since", "1h") == [d]
    assert listed("--ids", f"{a},{c}") == [a, c]
    assert listed("--limit", "2") == [a, b]
    assert listed("--after", str(b)) == [c, d]
    bad = run_cli(pg_dsn, "dlq", "list", "--reason", "bored")
    assert bad.returncode == 2 and "unknown reason 'bored'" in bad.stderr
    bad_time = run_cli(pg_dsn, "dlq", "list", "--since", "yesterday")
    assert bad_time.returncode == 2 and "invalid time 'yesterday'" in bad_time.stderr

    shown = json.loads(run_cli(pg_dsn, "dlq", "show", str(d)).stdout)
    assert shown["body_encoding"] == "base64" and shown["body"] == "/wA="
    missing = run_cli(pg_dsn, "dlq", "show", "999999")
    assert missing.returncode == 1 and "no dead letter 999999" in missing.stderr

    refused = run_cli(pg_dsn, "dlq", "delete")
    assert refused.returncode == 2 and "needs a selection" in refused.stderr
    deleted = run_cli(pg_dsn, "dlq", "delete", "--reason", "expired")
    assert deleted.returncode == 0 and "deleted 2 dead letters" in deleted.stdout
    assert "deleted 2/2" in deleted.stderr  # progress
    assert listed() == [b, c]
    assert run_cli(pg_dsn, "dlq", "delete", "--all", "--quiet").stdout.startswith("deleted 2 ")
    assert listed() == []
    log = db_rows(pg_dsn, "SELECT surface, operation, filters, affected FROM dmq_admin_log ORDER BY id")
    assert log == [("cli", "dlq.delete", "reason=expired", 2), ("cli", "dlq.delete", "all", 2)]


@pytest.mark.parametrize("flag, value", [("--rate-limit", "0"), ("--max-attempts", "0"), ("--ttl", "0s")])
def test_topic_limits_from_the_cli_are_validated(pg_dsn, flag, value):
    """`dmq topic create` refuses a zero limit with a message naming the flag."""
    result = run_cli(pg_dsn, "topic", "create", "t", flag, value)
    assert result.returncode == 2 and flag in result.stderr


def test_topic_limits_from_the_cli_are_stored(pg_dsn):
    """`dmq topic create --rate-limit --ttl --max-attempts` stores the three settings."""
    result = run_cli(pg_dsn, "topic", "create", "t", "--rate-limit", "100", "--ttl", "5m", "--max-attempts", "3")
    assert result.returncode == 0, result.stderr
    shown = json.loads(run_cli(pg_dsn, "topic", "show", "t").stdout)
    assert (shown["rate_limit"], shown["ttl_ms"], shown["max_attempts"]) == (100, 300000, 3)


#: a message's properties (issue 45): a key, a priority, headers (jsonb lists the shorter name first)
HEADERS = {"content-type": "application/json", "tenant": "caf\u00e9"}


def test_exhausted_and_expired_messages_keep_their_properties_in_dead_letters(make_server, pg_dsn):
    """A message with a key, a priority and headers that uses up its max attempts, and one
    whose time to live passes, become dead letters with the same three; ``dmq dlq list``
    (table and JSON) and ``show`` give them; a replay queues its delayed row with them
    (move_due stores them with the message it makes)."""
    retry = make_topic(pg_dsn, "retry", max_attempts=1, msg_timeout_ms=300)
    short = make_topic(pg_dsn, "short", ttl_ms=400)
    server = make_server(expiry_interval="100ms")
    with server.client() as producer, server.client() as consumer:
        poison, old = producer.send(retry, b"poison"), producer.send(short, b"old")
        # the stored properties, written here so that this test needs no client sending them
        # (test_replayed_dead_letters_deliver_their_properties sends them)
        for reply, props in ((poison, ("order-7", 5, json.dumps(HEADERS))), (old, ("k-old", 9, None))):
            assert db_rows(pg_dsn, "UPDATE dmq_message SET key = %s, priority = %s, headers = %s::jsonb"
                           " WHERE id = %s RETURNING id", *props, reply.message_id) == [(reply.message_id,)]
        assert consumer.subscribe(retry, "c").command == Command.SUBSCRIBE_ACK
        assert consumer.receive(timeout=5).body == b"poison"  # never acknowledged: its one attempt
        rows = wait_for(lambda: (r := db_rows(
            pg_dsn, "SELECT reason, message_id, key, priority, headers, id FROM dmq_dead_letter ORDER BY reason"))
            and len(r) == 2 and r)
    assert [r[:5] for r in rows] == [("expired", old.message_id, "k-old", 9, None),
                                     ("max_attempts", poison.message_id, "order-7", 5, HEADERS)]
    expired_id, exhausted_id = rows[0][5], rows[1][5]
    server.stop()  # the replay's delayed row stays for this test to read

    listed = run_cli(pg_dsn, "dlq", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    # the two letters are made by two sweeps whose order is the machine's: compared by id
    assert sorted((r["id"], r["key"], r["priority"], r["headers"]) for r in json.loads(listed.stdout)) == sorted(
        [(expired_id, "k-old", 9, None), (exhausted_id, "order-7", 5, HEADERS)], key=lambda letter: letter[0])
    table = run_cli(pg_dsn, "dlq", "list").stdout.splitlines()
    assert table[0].endswith("\tkey\tpriority\theaders")
    assert len(table) == 3  # the header line, one line per letter
    by_id = {int(line.split("\t")[0]): line.split("\t")[-3:] for line in table[1:]}
    assert by_id == {expired_id: ["k-old", "9", "-"],
                     exhausted_id: ["order-7", "5", '{"tenant":"caf\u00e9","content-type":"application/json"}']}
    shown = json.loads(run_cli(pg_dsn, "dlq", "show", str(exhausted_id)).stdout)
    assert (shown["key"], shown["priority"], shown["headers"], shown["body"]) == ("order-7", 5, HEADERS, "poison")

    replayed = run_cli(pg_dsn, "dlq", "replay", "--all")
    assert replayed.returncode == 0 and "replayed 2 dead letters" in replayed.stdout, replayed.stderr
    assert db_rows(pg_dsn, "SELECT session_id, body, key, priority, headers FROM dmq_delay ORDER BY session_id") == sorted(
        [(expired_id, b"old", "k-old", 9, None), (exhausted_id, b"poison", "order-7", 5, HEADERS)],
        key=lambda row: row[0])


def test_replayed_dead_letters_deliver_their_properties(make_server, pg_dsn):
    """End to end with the blocking client: a message sent with a key, a priority and
    headers that uses up its attempts is listed by the HTTP API with them, and its replay
    (``dmq dlq replay`` while the server runs) is pushed with them again; a rate-limited
    send's dead letter keeps its own; a client's report carries them, and a report whose
    properties a send could not have is refused."""
    from dmq_client.message import ReceivedMessage
    from dmq_client.wire.properties import Properties

    from .test_admin_surfaces import http

    props = Properties("order-7", 5, HEADERS)
    retry = make_topic(pg_dsn, "retry", max_attempts=1, msg_timeout_ms=300)
    limited = make_topic(pg_dsn, "limited", rate_limit=1)
    server = make_server(delay_poll_interval="100ms")
    with server.client() as producer, server.client() as consumer:
        assert "PROPS" in producer.server_features()
        sent = producer.send(retry, b"poison", key=props.key, priority=props.priority, headers=HEADERS)
        assert sent.command == Command.SEND_SUCCESS_ACK, sent.status
        assert consumer.subscribe(retry, "c").command == Command.SUBSCRIBE_ACK
        first = consumer.receive(timeout=5)  # never acknowledged: its one attempt
        assert ReceivedMessage.properties_of(first.status) == props
        wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_dead_letter") == [(1,)])
        status, listed = http(server, "GET", "/admin/dead-letters")
        (letter,) = listed["dead_letters"]
        assert (status, letter["message_id"], letter["key"], letter["priority"], letter["headers"]) == (
            200, sent.message_id, "order-7", 5, HEADERS)

        replayed = run_cli(pg_dsn, "dlq", "replay", str(letter["id"]))
        assert replayed.returncode == 0 and "replayed 1 dead letters" in replayed.stdout, replayed.stderr
        again = consumer.receive(timeout=10)
        assert (again.producer, again.session_id, again.body) == ("dmq-replay", letter["id"], b"poison")
        assert ReceivedMessage.properties_of(again.status) == props
        consumer.ack(again)

        replies = [producer.send(limited, b"r%d" % n, key=f"k-{n}", priority=n, headers={"n": str(n)})
                   for n in (1, 2)]
        assert [r.command for r in replies] == [Command.SEND_SUCCESS_ACK, Command.SEND_EXCEED_LIMIT_ACK]
    assert db_rows(pg_dsn, "SELECT key, priority, headers, session_id FROM dmq_dead_letter WHERE reason = 'rate_limited'") == [
        ("k-2", 2, {"n": "2"}, replies[1].session_id)]

    report = {"topic": retry, "producer": "p", "session_id": 9, "body": "lost", "key": "order-9", "headers": HEADERS}
    status, created = http(server, "POST", "/admin/dead-letters", body=json.dumps(report).encode())
    assert status == 200, created
    assert http(server, "GET", f"/admin/dead-letters/{created['id']}")[1]["headers"] == HEADERS
    status, refused = http(server, "POST", "/admin/dead-letters", body=json.dumps(dict(report, priority=10)).encode())
    assert (status, refused["error"]) == (400, "E_INVALID") and "priority 10 is outside 0..9" in refused["message"], refused
