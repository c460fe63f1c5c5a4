"""`dmq outbox install|uninstall|prune-inbox` on a real application database: the schema,
its version, the grants an application role needs (and that they are enough and no more),
the relay's NOTIFY, the SQL function from plain SQL."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import psycopg
import pytest

from dmq_client import inbox, outbox

from .support import db_rows, run_cli

pytestmark = pytest.mark.integration


def outbox_cli(dsn: str, *args: str):
    # run_cli passes dmq's --pg-dsn; the outbox commands ignore it and use --dsn
    return run_cli(dsn, "outbox", *args, "--dsn", dsn)


@pytest.fixture
def app_dsn(pg_empty_dsn):
    """An application's database with the outbox installed (through the CLI)."""
    done = outbox_cli(pg_empty_dsn, "install")
    assert done.returncode == 0, done.stderr
    return pg_empty_dsn


@pytest.fixture
def app_role(app_dsn):
    """A role holding exactly the grants `dmq outbox install` prints, used by SET ROLE."""
    role = f"app_{uuid.uuid4().hex[:12]}"
    printed = outbox_cli(app_dsn, "install", "--role", role).stdout
    grants = [line.strip() for line in printed.splitlines() if line.strip().startswith("GRANT")]
    assert len(grants) == 4
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} NOLOGIN")
        for grant in grants:
            conn.execute(grant)
    yield role
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute(f"DROP OWNED BY {role}")
        conn.execute(f"DROP ROLE {role}")


def install_upto(dsn: str, version: int, schema: str = "dmq_outbox") -> None:
    """The outbox as an installer of an older dmq left it: migrations 1..``version`` applied
    and recorded, as ``dmq outbox install`` records them."""
    from dmq_server.db import outbox as outbox_db

    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.schema_version (version integer PRIMARY KEY, description text NOT NULL,"
                     " applied_at timestamptz NOT NULL DEFAULT now())")
        for number, description, sql in outbox_db.migrations(schema)[:version]:
            conn.execute(sql)
            conn.execute(f"INSERT INTO {schema}.schema_version (version, description) VALUES (%s, %s)",
                         (number, description))


def test_install_twice_applies_once_and_prints_the_grants(pg_empty_dsn):
    """The first install applies versions 1 to 3 and records them; the second applies
    nothing; both print the four grants."""
    first = outbox_cli(pg_empty_dsn, "install")
    assert first.returncode == 0, first.stderr
    assert "outbox schema dmq_outbox is at version 3 (applied 1, 2, 3)" in first.stdout
    second = outbox_cli(pg_empty_dsn, "install")
    assert second.returncode == 0, second.stderr
    assert "at version 3 (already up to date)" in second.stdout
    for out in (first.stdout, second.stdout):
        assert "GRANT USAGE ON SCHEMA dmq_outbox TO APP_ROLE;" in out
        assert "GRANT INSERT ON dmq_outbox.outbox TO APP_ROLE;" in out
        assert "GRANT INSERT, SELECT ON dmq_outbox.inbox TO APP_ROLE;" in out
    assert db_rows(pg_empty_dsn, "SELECT version, description FROM dmq_outbox.schema_version ORDER BY 1") == [
        (1, "outbox"), (2, "installation"), (3, "properties")]
    tables = db_rows(pg_empty_dsn, "SELECT tablename FROM pg_tables WHERE schemaname = 'dmq_outbox' ORDER BY 1")
    assert tables == [("inbox",), ("installation",), ("outbox",), ("schema_version",)]


def test_another_schema_name_and_a_bad_one(pg_empty_dsn):
    """--schema installs under that name; a name that is not a plain identifier is refused
    with exit status 2 and the rule."""
    assert outbox_cli(pg_empty_dsn, "install", "--schema", "shop_outbox").returncode == 0
    assert db_rows(pg_empty_dsn, "SELECT count(*) FROM shop_outbox.outbox") == [(0,)]
    bad = outbox_cli(pg_empty_dsn, "install", "--schema", "Shop; DROP")
    assert bad.returncode == 2
    assert "invalid schema name 'Shop; DROP'" in bad.stderr


def test_a_foreign_schema_is_neither_installed_into_nor_dropped(pg_empty_dsn):
    """A schema of that name that the installer did not create is refused both ways."""
    with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA billing; CREATE TABLE billing.invoices (id int)")
    for action in ("install", "uninstall"):
        done = outbox_cli(pg_empty_dsn, action, "--schema", "billing")
        assert done.returncode == 1
        assert "is not a dmq outbox" in done.stderr
    assert db_rows(pg_empty_dsn, "SELECT count(*) FROM billing.invoices") == [(0,)]


def test_uninstall_refuses_unrelayed_messages_unless_forced(app_dsn):
    """An outbox holding messages is kept (they would be lost) until --force; an empty
    one, or none at all, uninstalls."""
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute("SELECT dmq_outbox.send('orders', 'created')")
    refused = outbox_cli(app_dsn, "uninstall")
    assert refused.returncode == 1
    assert "1 message(s) in dmq_outbox.outbox are not relayed yet" in refused.stderr
    forced = outbox_cli(app_dsn, "uninstall", "--force")
    assert forced.returncode == 0, forced.stderr
    assert "dropped outbox schema dmq_outbox with 1 unrelayed message(s)" in forced.stdout
    assert db_rows(app_dsn, "SELECT count(*) FROM pg_namespace WHERE nspname = 'dmq_outbox'") == [(0,)]
    assert outbox_cli(app_dsn, "uninstall").returncode == 0  # nothing there: nothing to do
    reinstalled = outbox_cli(app_dsn, "install")
    assert "(applied 1, 2, 3)" in reinstalled.stdout


def test_the_sql_function_from_plain_sql_text_and_bytes(app_dsn):
    """Any language can call send(): a bare literal is the text variant (stored as UTF-8),
    a bytea the other; delay and session id land in their columns; bad arguments fail with
    the reason and add nothing."""
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute("SELECT dmq_outbox.send('orders', 'héllo')")
        conn.execute("SELECT dmq_outbox.send('orders', '\\x00ff'::bytea, delay_ms => 5000, session_id => 7)")
        for call, reason in [
            ("SELECT dmq_outbox.send('no topic!', 'x')", "invalid topic name 'no topic!'"),
            ("SELECT dmq_outbox.send('orders', 'x', -1)", "delay_ms must be 0 or more, got -1"),
            ("SELECT dmq_outbox.send('orders', 'x', NULL, -2)", "session_id must be 0 or more, got -2"),
            ("SELECT dmq_outbox.send('orders', NULL::bytea)", "body must not be NULL"),
        ]:
            with pytest.raises(psycopg.Error, match=reason):
                conn.execute(call)
        rows = conn.execute(
            "SELECT topic, body, due_ms IS NULL, session_id,"
            " due_ms - floor(extract(epoch FROM now()) * 1000)::bigint BETWEEN 4000 AND 6000"
            " FROM dmq_outbox.outbox ORDER BY id"
        ).fetchall()
    assert rows == [("orders", "héllo".encode(), True, None, None), ("orders", b"\x00\xff", False, 7, True)]


def test_the_sql_function_stores_a_key_priority_and_headers_as_one_document(app_dsn):
    """send(..., key, priority, headers) keeps the fields a message has in the row's
    headers column (a message without any: NULL); a priority outside 0..9, an empty or
    too long key, headers that are no JSON object fail with the reason and add nothing."""
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute("SELECT dmq_outbox.send('orders', 'all', key => 'order-7', priority => 5,"
                     " headers => '{\"content-type\": \"application/json\"}')")
        conn.execute("SELECT dmq_outbox.send('orders', 'key only'::bytea, NULL, 3, 'order-8')")
        conn.execute("SELECT dmq_outbox.send('orders', 'defaults', priority => 0, headers => '{}')")
        for call, reason in [
            ("SELECT dmq_outbox.send('orders', 'x', priority => 10)", "priority must be 0 to 9, got 10"),
            ("SELECT dmq_outbox.send('orders', 'x', priority => NULL)", "priority must be 0 to 9, got NULL"),
            ("SELECT dmq_outbox.send('orders', 'x', key => '')", "key must be 1 to 255 bytes, got 0"),
            (f"SELECT dmq_outbox.send('orders', 'x', key => '{'é' * 128}')", "key must be 1 to 255 bytes, got 256"),
            ("SELECT dmq_outbox.send('orders', 'x', headers => '[1]')", "headers must be a JSON object .* got a JSON array"),
        ]:
            with pytest.raises(psycopg.Error, match=reason):
                conn.execute(call)
        rows = conn.execute("SELECT body, session_id, headers FROM dmq_outbox.outbox ORDER BY id").fetchall()
    assert rows == [
        (b"all", None, {"key": "order-7", "priority": 5, "headers": {"content-type": "application/json"}}),
        (b"key only", 3, {"key": "order-8"}),
        (b"defaults", None, None),
    ]


def test_an_upgrade_to_version_3_keeps_the_roles_grants_and_the_old_calls(pg_empty_dsn):
    """A role granted EXECUTE on version 2's send() (the grants an older install printed)
    may execute version 3's after the upgrade, in the old form and with properties; a role
    that had no grant still has none; the old functions are gone (no call is ambiguous)."""
    install_upto(pg_empty_dsn, 2)
    app, other = f"app_{uuid.uuid4().hex[:12]}", f"other_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
        for role in (app, other):
            conn.execute(f"CREATE ROLE {role} NOLOGIN")
            conn.execute(f"GRANT USAGE ON SCHEMA dmq_outbox TO {role}")
            conn.execute(f"GRANT INSERT ON dmq_outbox.outbox TO {role}")
        conn.execute(f"GRANT EXECUTE ON FUNCTION dmq_outbox.send(text, bytea, bigint, bigint),"
                     f" dmq_outbox.send(text, text, bigint, bigint) TO {app}")
    done = outbox_cli(pg_empty_dsn, "install")
    assert "at version 3 (applied 3)" in done.stdout, done.stderr
    try:
        with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
            conn.execute(f"SET ROLE {app}")
            conn.execute("SELECT dmq_outbox.send('orders', 'old form')")
            conn.execute("SELECT dmq_outbox.send('orders', 'old form'::bytea, NULL::bigint, NULL::bigint)")
            conn.execute("SELECT dmq_outbox.send('orders', 'new form', key => 'k', priority => 1)")
            conn.execute(f"SET ROLE {other}")
            for body in ("'x'", "'x'::bytea"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied for function send"):
                    conn.execute(f"SELECT dmq_outbox.send('orders', {body})")
            conn.execute("RESET ROLE")
            assert conn.execute("SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                                " WHERE n.nspname = 'dmq_outbox' AND p.proname = 'send'").fetchone() == (2,)
    finally:
        with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
            for role in (app, other):
                conn.execute(f"DROP OWNED BY {role}")
                conn.execute(f"DROP ROLE {role}")
    assert db_rows(pg_empty_dsn, "SELECT body, headers FROM dmq_outbox.outbox ORDER BY id") == [
        (b"old form", None), (b"old form", None), (b"new form", {"key": "k", "priority": 1})]


def test_the_application_role_sends_and_records_but_cannot_read_or_delete(app_dsn, app_role):
    """With only the printed grants a role can call send and use the inbox; it cannot read,
    change or delete the outbox, delete inbox records or prune them."""
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute(f"SET ROLE {app_role}")
        conn.execute("SELECT dmq_outbox.send('orders', 'as the app')")
        conn.execute("SELECT dmq_outbox.send('orders', 'as bytes'::bytea)")
        cur = conn.execute("INSERT INTO dmq_outbox.inbox (channel, message_id) VALUES ('orders/billing', '1')"
                           " ON CONFLICT DO NOTHING")
        assert cur.rowcount == 1
        assert conn.execute("SELECT count(*) FROM dmq_outbox.inbox").fetchone() == (1,)
        for forbidden in [
            "SELECT * FROM dmq_outbox.outbox",
            "DELETE FROM dmq_outbox.outbox",
            "UPDATE dmq_outbox.outbox SET topic = 'x'",
            "DELETE FROM dmq_outbox.inbox",
            "SELECT dmq_outbox.prune_inbox('1 second')",
        ]:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(forbidden)
    with psycopg.connect(app_dsn) as conn:  # and through the client's helpers
        conn.execute(f"SET ROLE {app_role}")
        conn.commit()
        with conn.transaction():
            outbox.send(conn, "orders", b"from the client", session_id=3)
        message = SimpleNamespace(topic="orders", channel="billing", message_id=2)
        acked: list = []
        for _ in range(2):
            with inbox.transaction(conn, message, ack=acked.append) as fresh:
                acked.append(fresh)
        assert acked == [True, message, False, message]
    assert db_rows(app_dsn, "SELECT body FROM dmq_outbox.outbox ORDER BY id") == [
        (b"as the app",), (b"as bytes",), (b"from the client",)
    ]


def test_a_role_without_the_execute_grant_cannot_send(app_dsn):
    """send() is not executable by PUBLIC: a role with every other grant still needs
    EXECUTE on it."""
    role = f"other_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} NOLOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA dmq_outbox TO {role}")
        conn.execute(f"GRANT INSERT ON dmq_outbox.outbox TO {role}")
        try:
            conn.execute(f"SET ROLE {role}")
            for body in ("'x'", "'x'::bytea"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied for function send"):
                    conn.execute(f"SELECT dmq_outbox.send('orders', {body})")
        finally:
            conn.execute("RESET ROLE")
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def test_one_notify_per_statement_on_the_relays_channel(app_dsn):
    """A listener on the channel named after the schema hears one notification per
    committed INSERT statement (three rows in one statement: one), with the statement's
    highest id; a rolled-back send notifies nobody."""
    with psycopg.connect(app_dsn, autocommit=True) as listener, psycopg.connect(app_dsn) as app:
        listener.execute("LISTEN dmq_outbox")
        with app.transaction():
            app.execute("INSERT INTO dmq_outbox.outbox (topic, body) VALUES ('a', 'x'), ('a', 'y'), ('a', 'z')")
            app.execute("SELECT dmq_outbox.send('a', 'one more')")
        with app.transaction(force_rollback=True):
            app.execute("SELECT dmq_outbox.send('a', 'rolled back')")
        with app.transaction():
            app.execute("SELECT dmq_outbox.send('a', 'last')")
        heard = [(n.channel, n.payload) for n in listener.notifies(timeout=1.0, stop_after=4)]
        ids = [row[0] for row in app.execute("SELECT id FROM dmq_outbox.outbox ORDER BY id")]
    assert len(ids) == 5
    assert heard == [("dmq_outbox", str(ids[2])), ("dmq_outbox", str(ids[3])), ("dmq_outbox", str(ids[4]))]


def test_prune_inbox_removes_old_records_in_batches(app_dsn):
    """prune-inbox deletes records older than the duration, in batches, and keeps newer
    ones; a non-positive duration is refused."""
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO dmq_outbox.inbox (channel, message_id, processed_at)"
            " SELECT 't/c', i::text, now() - interval '8 days' FROM generate_series(1, 25) AS i"
        )
        conn.execute("INSERT INTO dmq_outbox.inbox (channel, message_id) VALUES ('t/c', 'new')")
    done = outbox_cli(app_dsn, "prune-inbox", "--older-than", "7d", "--batch", "10")
    assert done.returncode == 0, done.stderr
    assert "pruned 25 inbox record(s) older than 604800s from dmq_outbox.inbox" in done.stdout
    assert db_rows(app_dsn, "SELECT message_id FROM dmq_outbox.inbox") == [("new",)]
    bad = outbox_cli(app_dsn, "prune-inbox", "--older-than", "0s")
    assert bad.returncode == 2
    assert "older than must be positive" in bad.stderr


def test_an_unreachable_database_exits_3_with_the_reason(pg_empty_dsn):
    """No database at --dsn: exit status 3 (as dmq's other commands) and why."""
    done = run_cli(pg_empty_dsn, "outbox", "install", "--dsn", "postgresql://nobody@127.0.0.1:1/app?connect_timeout=2")
    assert done.returncode == 3
    assert "cannot connect to PostgreSQL" in done.stderr


def _tag(dsn: str) -> str:
    [(tag,)] = db_rows(dsn, "SELECT tag FROM dmq_outbox.installation")
    return tag


def test_each_install_has_its_own_tag_and_retag_gives_a_new_one(pg_empty_dsn):
    """An install's tag (8 hex digits) outlives installing again (an upgrade), not an
    uninstall: the next install has another. `retag` gives a new one and says both; a
    schema without an outbox is refused."""
    assert outbox_cli(pg_empty_dsn, "install").returncode == 0
    first = _tag(pg_empty_dsn)
    assert len(first) == 8 and int(first, 16) >= 0
    assert outbox_cli(pg_empty_dsn, "install").returncode == 0
    assert _tag(pg_empty_dsn) == first
    assert outbox_cli(pg_empty_dsn, "uninstall").returncode == 0
    assert outbox_cli(pg_empty_dsn, "install").returncode == 0
    second = _tag(pg_empty_dsn)
    assert second != first
    done = outbox_cli(pg_empty_dsn, "retag")
    assert done.returncode == 0, done.stderr
    third = _tag(pg_empty_dsn)
    assert third not in (first, second)
    assert f"tag {second} -> {third}" in done.stdout
    missing = outbox_cli(pg_empty_dsn, "retag", "--schema", "nothing_here")
    assert missing.returncode == 1 and "no outbox schema nothing_here" in missing.stderr


def test_an_outbox_of_version_1_gets_its_tag_when_installed_again(app_dsn):
    """An outbox installed before version 2 (no installation table): the relay's read says
    to run install, retag is refused saying so, and install applies version 2 alone."""
    from dmq_server.db import outbox as relay_db
    from dmq_server.db.storage_errors import StorageError

    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE dmq_outbox.installation")
        conn.execute("DELETE FROM dmq_outbox.schema_version WHERE version = 2")
        q = relay_db.relay_queries("dmq_outbox")
        with pytest.raises(StorageError, match="run `dmq outbox install --schema dmq_outbox`"):
            relay_db.read_rows(conn, q, "dmq_outbox", 10)
    refused = outbox_cli(app_dsn, "retag")
    assert refused.returncode == 1 and "at version 1" in refused.stderr
    done = outbox_cli(app_dsn, "install")
    assert "at version 3 (applied 2)" in done.stdout
    assert len(_tag(app_dsn)) == 8
