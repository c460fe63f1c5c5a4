"""dmq_client.outbox and inbox refuse bad input before any statement, with the reason;
the installer's schema rule and grants; and the client never imports a database driver."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dmq_client import inbox, outbox
from dmq_client.wire.properties import PropertiesError
from dmq_server.db.outbox import check_schema, grants_for, migrations
from dmq_server.core.errors import Invalid


class Recorder:
    """Stands in for a psycopg connection (its class's module says psycopg): records
    statements, is never in autocommit."""

    autocommit = False

    def __init__(self) -> None:
        self.statements: list[tuple[str, dict]] = []

    def execute(self, query, params=None):
        self.statements.append((query, params))


Recorder.__module__ = "psycopg.connection"


@pytest.mark.parametrize("kwargs, error, reason", [
    ({"topic": "no spaces"}, ValueError, "invalid topic name 'no spaces'"),
    ({"topic": "x" * 65}, ValueError, "invalid topic name"),
    ({"body": 5}, TypeError, "body must be bytes or str, not int"),
    ({"delay": -1}, ValueError, "delay must be 0 or more seconds, got -1"),
    ({"delay": float("nan")}, ValueError, "delay must be 0 or more seconds"),
    ({"delay": "5s"}, TypeError, "delay must be seconds"),
    ({"session_id": -1}, ValueError, "session_id must be a whole number from 0 to 2\\*\\*63-1, got -1"),
    ({"session_id": 2**63}, ValueError, "session_id must be"),
    ({"session_id": True}, ValueError, "session_id must be"),
    ({"schema": "Outbox"}, ValueError, "invalid outbox schema name 'Outbox'"),
    ({"schema": "a;b"}, ValueError, "invalid outbox schema name"),
    ({"key": ""}, PropertiesError, "key is empty"),
    ({"key": "k" * 256}, PropertiesError, "key is 256 bytes"),
    ({"priority": 10}, PropertiesError, "priority 10 is outside 0..9"),
    ({"priority": "5"}, PropertiesError, "priority is not an integer"),
    ({"headers": {"Content-Type": "x"}}, PropertiesError, "header name 'Content-Type' is not a lowercase token"),
    ({"headers": {f"h{i}": "v" for i in range(33)}}, PropertiesError, "33 headers"),
    ({"headers": {"traceparent": "nope"}}, PropertiesError, "'traceparent' is not W3C trace context"),
    ({"headers": [("a", "b")]}, PropertiesError, "headers must be a mapping of names to texts, not list"),
    ({"headers": {f"h{i}": "v" * 1000 for i in range(5)}}, PropertiesError, "at most 4096"),
])
def test_send_refuses_bad_arguments_before_any_statement(kwargs, error, reason):
    conn = Recorder()
    args = {"topic": "orders", "body": b"x"} | kwargs
    with pytest.raises(error, match=reason):
        outbox.send(conn, args.pop("topic"), args.pop("body"), **args)
    assert conn.statements == []


def test_send_passes_one_statement_with_milliseconds_and_utf8():
    conn = Recorder()
    outbox.send(conn, "orders", "é", delay=1.5, session_id=3, schema="shop")
    ((query, params),) = conn.statements
    assert query.startswith("SELECT shop.send(")
    assert params == {"topic": "orders", "body": "é".encode(), "delay_ms": 1500, "session_id": 3}
    assert "key" not in query  # no properties: the call of every outbox version


def test_send_with_properties_passes_them_by_name():
    """A key, priority and headers go as send()'s named arguments (version 3), headers as
    JSON text; a message with a priority alone sends no key and no headers."""
    conn = Recorder()
    outbox.send(conn, "orders", b"x", key="order-7", priority=5, headers={"content-type": "application/json"})
    outbox.send(conn, "orders", b"y", priority=1)
    (query, params), (_, params2) = conn.statements
    assert query.endswith(", key => %(key)s::text, priority => %(priority)s::integer, headers => %(headers)s::jsonb)")
    assert (params["key"], params["priority"], params["headers"]) == ("order-7", 5, '{"content-type": "application/json"}')
    assert (params2["key"], params2["priority"], params2["headers"]) == (None, 1, None)


@pytest.mark.parametrize("module, name, reason", [
    ("psycopg.connection_async", "AsyncConnection", "AsyncConnection is asynchronous"),
    ("sqlalchemy.ext.asyncio.session", "AsyncSession", "AsyncSession is asynchronous"),
    ("sqlite3", "Connection", "need a psycopg 3 Connection or cursor, or a SQLAlchemy Session or Connection"),
    ("sqlalchemy.engine.base", "Engine", "got sqlalchemy.engine.base.Engine"),
])
def test_only_the_supported_connections_are_taken(module, name, reason):
    other = type(name, (), {"__module__": module, "execute": lambda self, *a: None})()
    with pytest.raises(TypeError, match=reason):
        outbox.send(other, "orders", b"x")


def test_the_inbox_key_is_topic_and_channel_and_the_id_as_text():
    class Push:
        topic, channel, message_id = "orders", "billing", 12

    class NsqMessage:
        topic, channel, id = "orders", "billing", b"0a1b2c3d4e5f6789"

    assert inbox.inbox_key(Push()) == ("orders/billing", "12")
    assert inbox.inbox_key(NsqMessage(), channel="billing-v2") == ("billing-v2", "0a1b2c3d4e5f6789")
    with pytest.raises(ValueError, match="channel must be a non-empty string"):
        inbox.inbox_key(Push(), channel="")


def test_the_installer_checks_the_schema_name_and_fills_it_in():
    assert check_schema("shop_outbox") == "shop_outbox"
    for bad in ("", "1x", "Shop", "a-b", "a" * 64):
        with pytest.raises(Invalid, match="invalid schema name"):
            check_schema(bad)
    (version, description, sql), (version2, description2, sql2), (version3, _, sql3) = migrations("shop_outbox")
    assert (version, description, version2, description2, version3) == (1, "outbox", 2, "installation", 3)
    assert "DROP FUNCTION shop_outbox.send(text, bytea, bigint, bigint);" in sql3
    assert "@schema@" not in sql + sql2 and "@channel@" not in sql + sql2
    assert "CREATE TABLE shop_outbox.outbox" in sql and "pg_notify('shop_outbox'" in sql
    assert "CREATE TABLE shop_outbox.installation" in sql2
    assert grants_for("shop_outbox", "web") == [
        "GRANT USAGE ON SCHEMA shop_outbox TO web;",
        "GRANT EXECUTE ON FUNCTION shop_outbox.send(text, bytea, bigint, bigint, text, integer, jsonb),"
        " shop_outbox.send(text, text, bigint, bigint, text, integer, jsonb) TO web;",
        "GRANT INSERT ON shop_outbox.outbox TO web;",
        "GRANT INSERT, SELECT ON shop_outbox.inbox TO web;",
    ]


def test_importing_the_client_modules_loads_no_driver():
    """dmq-client stays standard library only: neither psycopg nor SQLAlchemy is imported
    by importing outbox and inbox."""
    probe = "import sys, dmq_client.outbox, dmq_client.inbox; print(sorted({'psycopg', 'sqlalchemy'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr
