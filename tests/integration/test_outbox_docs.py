"""The "Transactional messages" examples of docs/client.md, run as a user would run them:
the install and prune commands in a shell with $APP_DSN set, the grants in the application
database, each Python example executed as a module and its function called, against the
suite's PostgreSQL and a real dmq-server.

They are marked ``<!-- outbox example: NAME -->`` (not test_client_docs.py's ``example:``)
because they need the application database these fixtures make."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading

import psycopg
import pytest

from .support import REPO, db_rows, wait_for

pytestmark = pytest.mark.integration

DOC = REPO / "docs" / "client.md"
WAIT = 30.0


def examples() -> dict[str, str]:
    return dict(re.findall(r"<!-- outbox example: (\S+) -->\n```\w+\n(.*?)```", DOC.read_text(), flags=re.S))


def load(name: str) -> dict:
    namespace: dict = {"__name__": f"docs_outbox_{name.removesuffix('.py')}"}
    exec(compile(examples()[name], f"docs/client.md:{name}", "exec"), namespace)
    return namespace


def shell(name: str, app_dsn: str) -> str:
    env = dict(os.environ, APP_DSN=app_dsn, PATH=f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}")
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", examples()[name]], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{name}: {done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture
def app_dsn(pg_empty_dsn, monkeypatch):
    """The application database the page assumes, with the page's install run in it."""
    with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY); CREATE TABLE payments (order_id int NOT NULL)")
    out = shell("install.sh", pg_empty_dsn)
    assert "GRANT INSERT ON dmq_outbox.outbox TO orders_app;" in out
    monkeypatch.setenv("APP_DSN", pg_empty_dsn)
    return pg_empty_dsn


def test_every_marked_example_is_covered():
    assert set(examples()) == {"install.sh", "grants.sql", "send_psycopg.py", "send_sqlalchemy.py",
                               "inbox_worker.py", "inbox_blocking.py", "inbox_asyncio.py", "prune.sh"}


def test_the_grants_on_the_page_are_the_ones_install_prints_and_suffice(app_dsn):
    """The page's GRANTs equal the printed ones; a role holding them runs the psycopg
    example's function (SET ROLE: the grants, not the superuser, decide)."""
    printed = shell("install.sh", app_dsn)
    page = [line for line in examples()["grants.sql"].splitlines() if line]
    assert page == [line.strip() for line in printed.splitlines() if line.strip().startswith("GRANT")]
    role = "orders_app"
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} NOLOGIN")
        try:
            conn.execute(examples()["grants.sql"])
            conn.execute(f"GRANT INSERT ON orders TO {role}")
            conn.execute(f"SET ROLE {role}")
            conn.autocommit = False
            load("send_psycopg.py")["place_order"](conn, 5)
            conn.autocommit = True
        finally:
            conn.execute("RESET ROLE")
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")
    assert db_rows(app_dsn, "SELECT topic, body, headers FROM dmq_outbox.outbox") == [
        ("orders", json.dumps({"id": 5, "event": "created"}).encode(),
         {"key": "order-5", "headers": {"content-type": "application/json"}})
    ]


def test_the_send_examples_commit_the_order_with_its_message(app_dsn):
    """psycopg's place_order and SQLAlchemy's, as their __main__ parts run them: each order
    row has its message in the outbox with the key (and headers, priority) the page gives
    it; the SQLAlchemy one is delayed."""
    for name in ("send_psycopg.py", "send_sqlalchemy.py"):
        done = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", examples()[name]], cwd=REPO,
                              env=dict(os.environ, APP_DSN=app_dsn), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert db_rows(app_dsn, "SELECT id FROM orders ORDER BY id") == [(1,), (2,)]
    assert db_rows(app_dsn, "SELECT topic, due_ms IS NOT NULL, headers FROM dmq_outbox.outbox ORDER BY id") == [
        ("orders", False, {"key": "order-1", "headers": {"content-type": "application/json"}}),
        ("orders", True, {"key": "order-2", "priority": 5}),
    ]


@pytest.fixture
def served(make_server, topic, monkeypatch):
    server = make_server()
    monkeypatch.setenv("DMQ_CLIENT_SERVERS", f"127.0.0.1:{server.tcp_port}")
    return server


def two_orders_the_first_handled_before(server, app_dsn: str, first: int, second: int) -> None:
    """Send two orders; record the first in the inbox as a consumer whose ack was lost would
    have left it."""
    with server.client() as producer:
        handled = producer.send("orders", json.dumps({"id": first}).encode()).message_id
        producer.send("orders", json.dumps({"id": second}).encode())
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO dmq_outbox.inbox (channel, message_id) VALUES ('orders/billing', %s)",
                     (str(handled),))


def test_the_inbox_worker_pays_once_and_acks(app_dsn, served, pg_dsn):
    """The MqClient worker pays a new order and records it; an order whose record exists
    already (handled, its ack lost) is only acked; nothing is left unacked."""
    two_orders_the_first_handled_before(served, app_dsn, 1, 2)
    stop = threading.Event()
    worker = threading.Thread(target=load("inbox_worker.py")["run"], args=(stop,))
    worker.start()
    try:
        wait_for(lambda: db_rows(app_dsn, "SELECT count(*) FROM dmq_outbox.inbox") == [(2,)], timeout=WAIT)
        wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)], timeout=WAIT)
    finally:
        stop.set()
        worker.join(WAIT)
    assert db_rows(app_dsn, "SELECT order_id FROM payments ORDER BY 1") == [(2,)]


def test_the_blocking_consumer_skips_a_message_already_recorded(app_dsn, served, pg_dsn):
    """The blocking example pays a new order, and for one whose record exists (its ack was
    lost) only acks."""
    two_orders_the_first_handled_before(served, app_dsn, 7, 8)
    load("inbox_blocking.py")["consume"](2)
    wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)], timeout=WAIT)
    assert db_rows(app_dsn, "SELECT order_id FROM payments") == [(8,)]


def test_the_asyncio_consumer_skips_a_message_already_recorded(app_dsn, served, pg_dsn):
    """The asyncio example (``inbox.atransaction``) pays a new order, and for one whose
    record exists (its ack was lost) only acks, after the commit."""
    import asyncio

    two_orders_the_first_handled_before(served, app_dsn, 5, 6)
    asyncio.run(load("inbox_asyncio.py")["consume"](2))
    wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)], timeout=WAIT)
    assert db_rows(app_dsn, "SELECT order_id FROM payments") == [(6,)]


def test_prune_keeps_recent_records(app_dsn):
    """The page's prune command removes week-old records and keeps today's."""
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO dmq_outbox.inbox VALUES ('orders/billing', '1', now() - interval '8 days'),"
                     " ('orders/billing', '2', now())")
    assert "pruned 1 inbox record(s)" in shell("prune.sh", app_dsn)
    assert db_rows(app_dsn, "SELECT message_id FROM dmq_outbox.inbox") == [("2",)]
