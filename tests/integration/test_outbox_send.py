"""dmq_client.outbox.send in the caller's transaction, on a real application database:
psycopg 3 and SQLAlchemy 2 (Session and Connection); a commit keeps the message with the
business row, a rollback keeps neither."""

from __future__ import annotations

import datetime

import psycopg
import pytest
import sqlalchemy
from sqlalchemy.orm import Session

from dmq_client import outbox

from .support import db_rows, run_cli

pytestmark = pytest.mark.integration


@pytest.fixture
def app_dsn(pg_empty_dsn):
    """An application's database: an orders table, and the outbox installed."""
    done = run_cli(pg_empty_dsn, "outbox", "install", "--dsn", pg_empty_dsn)
    assert done.returncode == 0, done.stderr
    with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
    return pg_empty_dsn


def outbox_rows(dsn: str) -> list[tuple]:
    return db_rows(dsn, "SELECT topic, body, session_id, due_ms IS NOT NULL FROM dmq_outbox.outbox ORDER BY id")


def engine_for(dsn: str) -> sqlalchemy.Engine:
    return sqlalchemy.create_engine(dsn.replace("postgresql://", "postgresql+psycopg://", 1))


def test_psycopg_commit_keeps_message_and_row_rollback_neither(app_dsn):
    """Committed: the order and its message; rolled back: neither. A str body is UTF-8,
    delay and session id are stored."""
    with psycopg.connect(app_dsn) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO orders VALUES (1)")
            outbox.send(conn, "orders", b"order 1", session_id=41)
            assert outbox_rows(app_dsn) == []  # not visible before the commit
        with conn.transaction(force_rollback=True):
            conn.execute("INSERT INTO orders VALUES (2)")
            outbox.send(conn, "orders", "order 2")
        outbox.send(conn, "orders", "order 3", delay=datetime.timedelta(minutes=5))  # opens a transaction
        conn.execute("INSERT INTO orders VALUES (3)")
        conn.commit()
    assert db_rows(app_dsn, "SELECT id FROM orders ORDER BY id") == [(1,), (3,)]
    assert outbox_rows(app_dsn) == [("orders", b"order 1", 41, False), ("orders", b"order 3", None, True)]


def test_psycopg_autocommit_outside_a_transaction_is_refused(app_dsn):
    """In autocommit mode a send would commit on its own: refused, nothing written; inside
    conn.transaction() it joins that transaction."""
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        with pytest.raises(ValueError, match="needs a transaction"):
            outbox.send(conn, "orders", b"alone")
        with conn.transaction(force_rollback=True):
            outbox.send(conn, "orders", b"joined")
    assert outbox_rows(app_dsn) == []


def test_sqlalchemy_session_commit_and_rollback(app_dsn):
    """A Session: the message commits with session.commit() and goes with rollback()."""
    engine = engine_for(app_dsn)
    try:
        with Session(engine) as session:
            session.execute(sqlalchemy.text("INSERT INTO orders VALUES (10)"))
            outbox.send(session, "orders", b"order 10", delay=1.5)
            session.commit()
            session.execute(sqlalchemy.text("INSERT INTO orders VALUES (11)"))
            outbox.send(session, "orders", b"order 11")
            session.rollback()
    finally:
        engine.dispose()
    assert db_rows(app_dsn, "SELECT id FROM orders") == [(10,)]
    assert outbox_rows(app_dsn) == [("orders", b"order 10", None, True)]


def test_sqlalchemy_connection_commit_and_rollback(app_dsn):
    """A Connection: engine.begin() commits the message with the row; a failing block rolls
    both back."""
    engine = engine_for(app_dsn)
    try:
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text("INSERT INTO orders VALUES (20)"))
            outbox.send(conn, "orders", "order 20", session_id=20)
        with pytest.raises(RuntimeError):
            with engine.begin() as conn:
                conn.execute(sqlalchemy.text("INSERT INTO orders VALUES (21)"))
                outbox.send(conn, "orders", "order 21")
                raise RuntimeError("the business logic failed")
    finally:
        engine.dispose()
    assert db_rows(app_dsn, "SELECT id FROM orders") == [(20,)]
    assert outbox_rows(app_dsn) == [("orders", b"order 20", 20, False)]


def test_another_schema_and_an_uninstalled_one(app_dsn):
    """schema= sends through another installed schema; one not installed fails in the
    database (the caller's transaction is then aborted, as any failed statement's)."""
    run_cli(app_dsn, "outbox", "install", "--dsn", app_dsn, "--schema", "shop_outbox")
    with psycopg.connect(app_dsn) as conn:
        with conn.transaction():
            outbox.send(conn, "orders", b"elsewhere", schema="shop_outbox")
        with pytest.raises(psycopg.errors.InvalidSchemaName):
            outbox.send(conn, "orders", b"x", schema="not_installed")
    assert db_rows(app_dsn, "SELECT body FROM shop_outbox.outbox") == [(b"elsewhere",)]
