"""The server's log on a real server: ``--log-format json`` gives one JSON object per
line with the node and the event's topic and channel; ``/ping`` writes nothing; a
PostgreSQL outage is one line when it starts and one when it ends, however many
components retry meanwhile."""

from __future__ import annotations

import json
import socket
import time

import pytest

from dmq_client.wire import Command

from .support import db_rows, http_get, run_cli, wait_for

pytestmark = pytest.mark.integration


def json_lines(server) -> list[dict]:
    lines = server.log_path.read_text().splitlines()
    records = []
    for line in lines:
        if line.startswith("dmq is ready") or line.startswith("  "):  # the banner on stdout
            continue
        records.append(json.loads(line))  # every other line is one JSON object
    return records


def test_json_lines_carry_node_topic_and_channel_and_ping_is_quiet(make_server, topic, pg_dsn):
    server = make_server(log_format="json", registry_refresh="0.2s")
    for _ in range(5):
        assert http_get(server.http + "/ping")[0] == 200
    assert http_get(server.http + "/metrics")[0] == 200
    assert run_cli(pg_dsn, "channel", "remove", topic, "billing").returncode == 0
    unregistered = wait_for(lambda: [r for r in json_lines(server) if r["message"].startswith("channel orders/")])
    (event,) = unregistered
    assert event["topic"] == topic and event["channel"] == "billing"
    assert event["logger"] == "dmq_server.reliable.store" and event["level"] == "info"
    assert event["node_id"] == f"{socket.gethostname()}:{server.tcp_port}"
    records = json_lines(server)
    assert all(r["node_id"] == event["node_id"] and r["time"].endswith("Z") for r in records)
    assert any(r["message"].startswith("dmq node") and r["message"].endswith("ready") for r in records)
    assert not [r for r in records if "/ping" in r["message"] or "/metrics" in r["message"]]


def test_a_postgresql_outage_is_logged_once_when_it_starts_and_once_when_it_ends(make_server, pg_private):
    """PostgreSQL stops under a node with producers and consumers at work (writers, acker,
    loader, delay workers, sweeps all fail and retry) and comes back: the log says so
    twice."""
    import registry
    from dmq_server.db.worker import connect

    from dmq_server.db.schema import migrate

    dsn = pg_private.start()
    migrate(dsn)
    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
        registry.add_channel(conn, "orders", "billing")
    server = make_server(dsn=dsn, log_format="json", expiry_interval="0.2s", channel_state_interval="0.2s")
    with server.client(timeout=10) as producer, server.client(timeout=10) as consumer:
        consumer.subscribe("orders", "billing", credit=10)
        assert producer.send("orders", b"before").command == Command.SEND_SUCCESS_ACK
        consumer.ack(consumer.receive(timeout=5))
        pg_private.stop(mode="immediate")
        deadline = time.monotonic() + 3  # the outage: sends fail, every timer's query fails
        while time.monotonic() < deadline:
            assert producer.send("orders", b"during").command == Command.SEND_SERVER_ERROR
            time.sleep(0.2)
        pg_private.start(keep_port=True)
        wait_for(lambda: producer.send("orders", b"after").command == Command.SEND_SUCCESS_ACK, timeout=30)
        push = wait_for(lambda: consumer.receive(timeout=1), timeout=30)
        consumer.ack(push)
    # every ack is made durable once PostgreSQL is back (the acker retries with a pause
    # of up to 5 s), each component retries once more after the end and stays quiet
    wait_for(lambda: db_rows(dsn, "SELECT count(*) FROM dmq_pending") == [(0,)], timeout=30)
    time.sleep(1.0)
    server.stop()  # while PostgreSQL is up: nothing is left to make durable
    records = json_lines(server)
    outage = [r for r in records if r.get("dependency") == "PostgreSQL" and r["level"] != "debug"]
    assert [r["level"] for r in outage] == ["warn", "info"], [r["message"] for r in records]
    assert outage[0]["message"].startswith("PostgreSQL outage: ")
    assert outage[1]["message"].startswith("PostgreSQL outage over after ")
    assert 2.5 < outage[1]["seconds"] < 60 and outage[1]["failures"] >= 2
    # nothing else warned about the database while it was down
    assert not [r for r in records if r["level"] in ("warn", "error", "critical") and r not in outage], records
