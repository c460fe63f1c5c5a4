"""Outboxes attached at run time on real PostgreSQL: `dmq outbox attach` records an outbox in
dmq's database, a running dmq-server (started without --outbox) relays its committed rows
within --registry-refresh, `dmq outbox detach` stops the relay (its connection, and the lock
with it, ends) and a re-attach relays what was sent meanwhile: every row delivered once. The
CLI refuses an outbox not installed, a name attached twice and a detach of a name not
attached; no output shows the DSN's password. A name both on a server's command line and
attached: the command line's outbox is relayed there."""

from __future__ import annotations

import json

import psycopg
import pytest

from ..conftest import _database
from .support import db_rows, http_get, run_cli, wait_for
from .test_outbox_figures import cli_list, password_of, shop_line, with_password
from .test_outbox_relay import app_dsn, consume, outbox_empty, send_transaction  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

WAIT = 30.0
REFRESH = "300ms"  # --registry-refresh: how soon a server sees an attach or a detach


def relay_sessions(app_dsn: str) -> int:
    """Sessions a relay opened in the application's database (named 'dmq NODE_ID'): none
    once the relay stopped, and with it its lock and its LISTEN."""
    return db_rows(app_dsn, "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'dmq %%'")[0][0]


def admin_outboxes(server) -> list[dict]:
    status, text = http_get(server.http + "/admin/outboxes")
    assert status == 200, text
    return json.loads(text)["outboxes"]


def execute(dsn: str, sql: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql)


def attach(pg_dsn: str, name: str, dsn: str, *extra: str):
    return run_cli(pg_dsn, "outbox", "attach", name, "--dsn", dsn, *extra)


def test_attached_outbox_is_relayed_without_a_restart_and_stops_after_detach(make_server, topic, pg_dsn, app_dsn):
    """A server started without --outbox relays an outbox once it is attached (rows sent
    before and after), stops after detach (no relay session left in the application's
    database, so rows sent then stay), and relays them once attached again: each row
    arrives once under one id; no listing shows the password."""
    dsn = with_password(app_dsn)
    password = password_of(dsn)
    server = make_server(registry_refresh=REFRESH)
    send_transaction(app_dsn, [b"before-1", b"before-2"])
    done = attach(pg_dsn, "shop", dsn)
    assert done.returncode == 0, done.stderr
    assert "attached outbox shop (dmq_outbox at version 3 in " in done.stdout
    assert password not in done.stdout + done.stderr
    assert db_rows(pg_dsn, "SELECT name, schema_name FROM dmq_outbox_attached") == [("shop", "dmq_outbox")]
    send_transaction(app_dsn, [b"after-1"])
    first = consume(server, 3)
    assert sorted(p.body for p in first) == [b"after-1", b"before-1", b"before-2"]
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    line = shop_line(cli_list(server, pg_dsn, password=password))
    assert line.split()[1] == "attached" and "(this node)" in line
    [shown] = admin_outboxes(server)
    assert shown["attached"] and shown["relaying"]
    assert "attached: this node starts its relay" in server.log()

    done = run_cli(pg_dsn, "outbox", "detach", "shop")
    assert done.returncode == 0, done.stderr
    assert password not in done.stdout + done.stderr
    wait_for(lambda: admin_outboxes(server) == [] and relay_sessions(app_dsn) == 0, timeout=WAIT)
    assert "outbox shop is detached: this node stops its relay" in server.log()
    send_transaction(app_dsn, [b"detached-1", b"detached-2"])
    assert db_rows(app_dsn, "SELECT count(*) FROM dmq_outbox.outbox") == [(2,)]

    assert attach(pg_dsn, "shop", dsn).returncode == 0
    second = consume(server, 2)
    assert sorted(p.body for p in second) == [b"detached-1", b"detached-2"]
    ids = [p.message_id for p in first + second]
    assert len(set(ids)) == 5
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message WHERE producer LIKE 'outbox:shop:%%'") == [(5,)]


@pytest.fixture
def bare_dsn(pg_server):
    """An application database without the outbox."""
    with _database(pg_server, None) as dsn:
        yield dsn


def test_attach_refuses_an_outbox_not_installed_a_name_twice_and_detach_an_unknown_name(pg_dsn, bare_dsn, app_dsn):
    """attach checks the application database (the schema at a version a relay reads) before it
    records anything, and says what to run; a name is attached once; detach of a name not
    attached is refused. The password is in no message."""
    dsn = with_password(bare_dsn)
    done = attach(pg_dsn, "shop", dsn)
    assert done.returncode == 1
    assert "outbox schema dmq_outbox is not installed in that database: run `dmq outbox install" in done.stderr
    assert password_of(dsn) not in done.stdout + done.stderr
    with_old = with_password(app_dsn)
    execute(app_dsn, "DELETE FROM dmq_outbox.schema_version WHERE version >= 2")
    done = attach(pg_dsn, "shop", with_old)
    assert done.returncode == 1 and "is at version 1, this dmq relays version 2 or later" in done.stderr
    execute(app_dsn, "INSERT INTO dmq_outbox.schema_version (version, description) VALUES (2, 'installation')")
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_outbox_attached") == [(0,)]
    done = attach(pg_dsn, "shop", with_old)  # version 2 (no properties yet) is relayed as it is
    assert done.returncode == 0 and "(dmq_outbox at version 2 in " in done.stdout, done.stderr
    done = attach(pg_dsn, "shop", with_old)
    assert done.returncode == 1 and "outbox 'shop' is attached already" in done.stderr
    done = run_cli(pg_dsn, "outbox", "detach", "nothing")
    assert done.returncode == 1 and "no outbox 'nothing' is attached" in done.stderr
    done = attach(pg_dsn, "bad/name", with_old)
    assert done.returncode == 2 and "outbox name 'bad/name'" in done.stderr


@pytest.fixture
def other_app_dsn(pg_server):
    """A second application database with the outbox installed."""
    with _database(pg_server, None) as dsn:
        done = run_cli(dsn, "outbox", "install", "--dsn", dsn)
        assert done.returncode == 0, done.stderr
        yield dsn


def test_the_command_line_wins_over_an_outbox_attached_under_its_name(make_server, topic, pg_dsn, app_dsn,
                                                                      other_app_dsn):
    """A server started with --outbox shop=A, and shop attached with database B: the server
    relays A (not attached, in its listing), warns, and never opens a relay on B, whose
    rows stay; attached under another name, B is relayed too."""
    server = make_server(registry_refresh=REFRESH, outbox=f"shop={app_dsn}")
    assert attach(pg_dsn, "shop", other_app_dsn).returncode == 0
    wait_for(lambda: "outbox shop is attached and given with --outbox: this node relays its --outbox"
             in server.log(), timeout=WAIT)
    send_transaction(app_dsn, [b"from A"])
    send_transaction(other_app_dsn, [b"from B"])
    [push] = consume(server, 1)
    assert push.body == b"from A"
    [shown] = admin_outboxes(server)
    assert not shown["attached"] and shown["database"].endswith(db_rows(app_dsn, "SELECT current_database()")[0][0])
    assert relay_sessions(other_app_dsn) == 0
    assert db_rows(other_app_dsn, "SELECT count(*) FROM dmq_outbox.outbox") == [(1,)]
    assert attach(pg_dsn, "stock", other_app_dsn).returncode == 0
    [push] = consume(server, 1)
    assert push.body == b"from B" and push.producer.startswith("outbox:stock:")
