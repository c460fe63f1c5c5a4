"""The `dmq` admin CLI against a real PostgreSQL: topics, channels, stats, migrations."""

from __future__ import annotations

import json

from .support import db_rows, run_cli


def test_topic_and_channel_lifecycle(pg_dsn):
    """create → add channels → list/show → remove → delete, each printed and stored."""
    out = run_cli(pg_dsn, "topic", "create", "orders", "--msg-timeout", "90s")
    assert out.returncode == 0, out.stderr
    assert "created topic orders" in out.stdout
    for channel in ("billing", "audit"):
        assert run_cli(pg_dsn, "channel", "add", "orders", channel).returncode == 0
    listed = json.loads(run_cli(pg_dsn, "topic", "list", "--json").stdout)
    assert listed == [
        {
            "name": "orders",
            "store": "reliable",
            "msg_timeout_ms": 90000,
            "rate_limit": None,
            "ttl_ms": None,
            "max_attempts": None,
            "ordered": False,
            "retention_ms": None,
            "channels": ["audit", "billing"],
            "cluster": "main",
            "draining": [],
        }
    ]
    shown = json.loads(run_cli(pg_dsn, "topic", "show", "orders").stdout)
    assert shown["channels"] == ["audit", "billing"]

    assert run_cli(pg_dsn, "channel", "remove", "orders", "audit").returncode == 0
    assert db_rows(pg_dsn, "SELECT name FROM dmq_channel") == [("billing",)]
    assert run_cli(pg_dsn, "topic", "delete", "orders").returncode == 0
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_topic") == [(0,)]
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_channel") == [(0,)]


def test_refused_operations_say_why_and_exit_1(pg_dsn):
    """Duplicates, unknown names and invalid names are refused with a specific message."""
    run_cli(pg_dsn, "topic", "create", "orders").check_returncode()
    run_cli(pg_dsn, "channel", "add", "orders", "billing").check_returncode()
    cases = [
        (("topic", "create", "orders"), "already exists"),
        (("topic", "create", "bad name"), "invalid topic name"),
        (("topic", "create", "x" * 65), "invalid topic name"),
        (("topic", "delete", "nosuch"), "no such topic"),
        (("topic", "show", "nosuch"), "no such topic"),
        (("channel", "add", "orders", "billing"), "already exists"),
        (("channel", "add", "nosuch", "billing"), "no such topic"),
        (("channel", "add", "orders", "bad/chan"), "invalid channel name"),
        (("channel", "remove", "orders", "nobody"), "no channel 'nobody'"),
    ]
    for args, message in cases:
        out = run_cli(pg_dsn, *args)
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        assert message in out.stderr, (args, out.stderr)
    assert db_rows(pg_dsn, "SELECT name FROM dmq_topic") == [("orders",)]


def test_bad_duration_is_a_usage_error(pg_dsn):
    """An unparseable --msg-timeout exits 2 and creates nothing."""
    out = run_cli(pg_dsn, "topic", "create", "orders", "--msg-timeout", "soon")
    assert out.returncode == 2 and "invalid duration" in out.stderr
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_topic") == [(0,)]


def test_unreachable_database_exits_3():
    """A DSN nobody answers gives a clear error and exit code 3."""
    out = run_cli("postgresql://dmq@127.0.0.1:1/dmq", "topic", "list")
    assert out.returncode == 3
    assert "cannot connect to PostgreSQL" in out.stderr


def test_migrations_are_recorded_and_idempotent(pg_empty_dsn):
    """`dmq db migrate` records every migration once, however often it runs."""
    from dmq_sql import migrations

    expected = [(version, description) for version, description, _ in migrations()]
    latest = expected[-1][0]
    for _ in range(2):
        out = run_cli(pg_empty_dsn, "db", "migrate")
        assert out.returncode == 0 and f"schema is at version {latest}" in out.stdout
    assert (
        db_rows(pg_empty_dsn, "SELECT version, description FROM dmq_schema_version ORDER BY version")
        == expected
    )
    assert expected[0] == (1, "initial")
    assert run_cli(pg_empty_dsn, "db", "version").stdout.strip() == str(latest)


def test_stats_counts_stored_backlog(make_server, topic, pg_dsn):
    """`dmq stats` shows the stored backlog per channel and the live server."""
    server = make_server()
    with server.client() as producer:
        producer.send_many(topic, [b"a", b"b", b"c"])
    out = run_cli(pg_dsn, "--http-address", f"127.0.0.1:{server.http_port}", "stats", "--json")
    stats = json.loads(out.stdout)
    assert stats["stored"]["channels"] == [
        {"topic": "orders", "channel": "billing", "stored_depth": 3}
    ]
    assert stats["server"]["health"] == "OK"
    text = run_cli(pg_dsn, "--http-address", f"127.0.0.1:{server.http_port}", "stats").stdout
    assert "orders/billing: 3 waiting" in text
