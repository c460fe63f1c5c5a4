"""An outbox message's key, priority and headers (issue 45 with issue 44's outbox), on real
PostgreSQL with a real dmq-server relaying: sent in the application's transaction through
dmq_client.outbox (psycopg, SQLAlchemy), they reach a dmq consumer with the message, and
dmq's store keeps them; a message without them arrives as before; a row whose stored
properties break a rule (written by hand) becomes a dead letter naming the rule, the rows
behind it arrive; bad properties in the client insert nothing; an outbox installed before
version 3 is relayed as before and, once `dmq outbox install` brings it up while the
server relays, its messages carry their properties."""

from __future__ import annotations

import datetime

import psycopg
import pytest
import sqlalchemy
from sqlalchemy.orm import Session

from dmq_client import outbox
from dmq_client.message import ReceivedMessage
from dmq_client.wire.properties import NO_PROPERTIES, Properties, PropertiesError
from dmq_server.db.messages import stored_status

from .support import db_rows, run_cli, wait_for
from .test_outbox_relay import WAIT, app_dsn, consume, outbox_empty, shop  # noqa: F401 (app_dsn: a fixture)
from .test_outbox_schema import install_upto

pytestmark = pytest.mark.integration

TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def received(pushes: list) -> dict[bytes, Properties]:
    """Each push's body and the properties its status carries, as a consumer reads them."""
    return {push.body: ReceivedMessage.properties_of(push.status) for push in pushes}


def stored(pg_dsn: str) -> dict[bytes, tuple]:
    """dmq's columns of each outbox message it stored: key, priority, headers."""
    return {bytes(body): (key, priority, headers) for body, key, priority, headers in db_rows(
        pg_dsn, "SELECT body, key, priority, headers FROM dmq_message WHERE producer LIKE 'outbox:%%'")}


def test_psycopg_a_key_priority_and_headers_reach_the_consumer(make_server, topic, pg_dsn, app_dsn):
    """In one committed transaction with the order: a message with all three properties, one
    with a key alone and one without any; a rolled-back one with properties never arrives.
    Each push carries exactly what was sent, and dmq stored it; the push's text is the one
    a load of the stored message would give."""
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
    server = make_server(outbox=f"shop={app_dsn}")
    with psycopg.connect(app_dsn) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO orders VALUES (7)")
            outbox.send(conn, "orders", b"created", key="order-7", priority=5,
                        headers={"content-type": "application/json", "traceparent": TRACE})
            outbox.send(conn, "orders", b"paid", key="order-7")
            outbox.send(conn, "orders", b"plain")
        with conn.transaction(force_rollback=True):
            outbox.send(conn, "orders", b"rolled back", key="order-8", priority=9)
    pushes = consume(server, 3)
    assert received(pushes) == {
        b"created": Properties("order-7", 5, {"content-type": "application/json", "traceparent": TRACE}),
        b"paid": Properties("order-7"),
        b"plain": NO_PROPERTIES,
    }
    assert [p.status for p in pushes if p.body == b"plain"] == [""]  # no properties: the push as before
    assert {p.producer for p in pushes} == {shop(app_dsn)}
    assert stored(pg_dsn) == {
        b"created": ("order-7", 5, {"content-type": "application/json", "traceparent": TRACE}),
        b"paid": ("order-7", 0, None),
        b"plain": (None, 0, None),
    }
    # the relayed push's text is the one a load of the stored message gives its pushes
    statuses = {p.body: p.status for p in pushes}
    assert all(statuses[body] == stored_status(*columns) for body, columns in stored(pg_dsn).items())
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)


def test_sqlalchemy_session_and_connection_with_properties_and_a_delay(make_server, topic, pg_dsn, app_dsn):
    """A SQLAlchemy Session's message with headers and priority, and a Connection's delayed
    one with a key (it goes through dmq's delay table): both arrive with them."""
    server = make_server(outbox=f"shop={app_dsn}")
    engine = sqlalchemy.create_engine(app_dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with Session(engine) as session:
            outbox.send(session, "orders", b"from a session", priority=2, headers={"tenant": "acme"})
            session.commit()
        with engine.begin() as connection:
            outbox.send(connection, "orders", b"delayed", key="order-9", delay=datetime.timedelta(seconds=1))
    finally:
        engine.dispose()
    pushes = consume(server, 2)
    assert received(pushes) == {
        b"from a session": Properties(None, 2, {"tenant": "acme"}),
        b"delayed": Properties("order-9"),
    }
    assert {p.producer for p in pushes if p.body == b"delayed"} == {shop(app_dsn) + ":delayed"}


def test_bad_properties_in_the_client_insert_nothing(app_dsn):
    """The client checks the properties before its insert: a PropertiesError naming the
    rule, no row, and the transaction goes on (the next send in it is kept)."""
    with psycopg.connect(app_dsn) as conn:
        with conn.transaction():
            with pytest.raises(PropertiesError, match="priority 10 is outside 0..9"):
                outbox.send(conn, "orders", b"bad", key="order-1", priority=10)
            with pytest.raises(PropertiesError, match="header name 'X-Tenant' is not a lowercase token"):
                outbox.send(conn, "orders", b"bad", headers={"X-Tenant": "acme"})
            outbox.send(conn, "orders", b"good", key="order-1")
    assert db_rows(app_dsn, "SELECT body, headers FROM dmq_outbox.outbox") == [(b"good", {"key": "order-1"})]


def test_a_row_with_broken_stored_properties_becomes_a_dead_letter(make_server, topic, pg_dsn, app_dsn):
    """Rows written by hand whose properties break a rule (a priority of 12, a field dmq does
    not know, headers that are no object) are dead letters whose detail names the row and the
    rule, never messages without their properties; the rows around them arrive with theirs."""
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute("SELECT dmq_outbox.send('orders', 'first', key => 'k1')")
        conn.execute("INSERT INTO dmq_outbox.outbox (topic, body, headers) VALUES"
                     " ('orders', 'too high', '{\"key\": \"k2\", \"priority\": 12}'),"
                     " ('orders', 'unknown', '{\"group\": \"g\"}'),"
                     " ('orders', 'not an object', '{\"headers\": [\"a\"]}')")
        conn.execute("SELECT dmq_outbox.send('orders', 'last', priority => 3)")
    server = make_server(outbox=f"shop={app_dsn}")
    pushes = consume(server, 2)
    assert received(pushes) == {b"first": Properties("k1"), b"last": Properties(None, 3)}
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    letters = db_rows(pg_dsn, "SELECT body, session_id, detail FROM dmq_dead_letter ORDER BY session_id")
    assert [(bytes(body), session_id) for body, session_id, *_ in letters] == [
        (b"too high", 2), (b"unknown", 3), (b"not an object", 4)]
    details = [letter[2] for letter in letters]
    assert "row 2: E_BAD_PROPERTIES priority 12 is outside 0..9" in details[0], details[0]
    assert "row 3: E_BAD_PROPERTIES unknown property field 'group'" in details[1], details[1]
    assert "row 4: E_BAD_PROPERTIES headers are not a JSON object" in details[2], details[2]
    assert stored(pg_dsn).keys() == {b"first", b"last"}


def test_an_outbox_of_version_2_relays_and_is_upgraded_under_a_running_relay(make_server, topic, pg_dsn,
                                                                              pg_empty_dsn):
    """An outbox an older dmq installed (version 2) is relayed as before (the relay reads the
    properties from a column every version has); a message with properties needs version 3
    (the client's call finds no such send()); `dmq outbox install` brings it there while the
    server relays, and the next message arrives with its properties."""
    install_upto(pg_empty_dsn, 2)
    server = make_server(outbox=f"shop={pg_empty_dsn}")
    with psycopg.connect(pg_empty_dsn) as conn:
        with conn.transaction():
            outbox.send(conn, "orders", b"old outbox")
        with pytest.raises(psycopg.errors.UndefinedFunction), conn.transaction():
            outbox.send(conn, "orders", b"needs version 3", key="k")
    [push] = consume(server, 1)
    assert (push.body, push.status) == (b"old outbox", "")
    done = run_cli(pg_empty_dsn, "outbox", "install", "--dsn", pg_empty_dsn)
    assert "at version 3 (applied 3)" in done.stdout, done.stderr
    with psycopg.connect(pg_empty_dsn) as conn, conn.transaction():
        outbox.send(conn, "orders", b"upgraded", key="k", priority=1)
        outbox.send(conn, "orders", b"upgraded, plain")
    assert received(consume(server, 2)) == {b"upgraded": Properties("k", 1), b"upgraded, plain": NO_PROPERTIES}
