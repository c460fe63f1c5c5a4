"""The outbox relay on real PostgreSQL: transactions of an application database send through
dmq_client.outbox.send, a dmq-server subprocess started with --outbox relays what they
committed, and the real client consumes it. Every committed row arrives once under one
message id, no rolled-back row arrives, a row stored before the server was killed (before
its delete) is never stored again, a bad row becomes a dead letter without holding the
rows behind it, and of two servers relaying one outbox one relays and the other takes over
after kill -9."""

from __future__ import annotations

import threading
import urllib.request

import psycopg
import pytest

from dmq_client import outbox
from dmq_client.wire import Command

from ..conftest import _database
from .support import db_rows, run_cli, wait_for

pytestmark = pytest.mark.integration

WAIT = 30.0
OUTBOX_PRODUCERS = "producer LIKE 'outbox:%%'"


@pytest.fixture
def app_dsn(pg_empty_dsn):
    """An application's database with the outbox schema installed."""
    done = run_cli(pg_empty_dsn, "outbox", "install", "--dsn", pg_empty_dsn)
    assert done.returncode == 0, done.stderr
    return pg_empty_dsn


def send_transaction(app_dsn: str, bodies: list[bytes], *, commit: bool = True, topic: str = "orders",
                     delay: float | None = None, session_id: int | None = None) -> None:
    """One application transaction sending ``bodies`` through the outbox, committed or
    rolled back."""
    with psycopg.connect(app_dsn) as conn:
        conn.execute("SELECT 1")  # a transaction is open from here
        for body in bodies:
            outbox.send(conn, topic, body, delay=delay, session_id=session_id)
        if commit:
            conn.commit()
        else:
            conn.rollback()


def consume(server, count: int, topic: str = "orders", channel: str = "billing") -> list:
    """``count`` pushes from the channel, each acked; then nothing more for half a second."""
    with server.client() as consumer:
        assert consumer.subscribe(topic, channel, credit=100).command == Command.SUBSCRIBE_ACK
        pushes = []
        while len(pushes) < count:
            push = consumer.receive(timeout=WAIT)
            assert push is not None, f"{len(pushes)} of {count} pushes arrived"
            consumer.ack(push)
            pushes.append(push)
        assert consumer.receive(timeout=0.5) is None
    return pushes


def shop(app_dsn: str) -> str:
    """The producer of the install's numbered rows: outbox:shop:TAG."""
    [(tag,)] = db_rows(app_dsn, "SELECT tag FROM dmq_outbox.installation")
    return f"outbox:shop:{tag}"


def outbox_empty(app_dsn: str) -> bool:
    return db_rows(app_dsn, "SELECT count(*) FROM dmq_outbox.outbox") == [(0,)]


def test_committed_rows_arrive_once_in_order_and_rolled_back_ones_never(make_server, topic, pg_dsn, app_dsn):
    """Committed transactions' rows each arrive once with one id, in each transaction's
    order; rolled-back ones never; the outbox and dmq's record of relayed rows are emptied."""
    server = make_server(outbox=f"shop={app_dsn}")
    sent = []
    for t in range(6):
        bodies = [f"t{t}-{k}".encode() for k in range(3)]
        send_transaction(app_dsn, bodies, commit=t % 3 != 2)
        if t % 3 != 2:
            sent += bodies
    pushes = consume(server, len(sent))
    assert sorted(p.body for p in pushes) == sorted(sent)
    assert len({p.message_id for p in pushes}) == len(sent)
    ids = {p.body: p.message_id for p in pushes}
    for t in (0, 1, 3, 4):
        assert [ids[f"t{t}-{k}".encode()] for k in range(3)] == sorted(ids[f"t{t}-{k}".encode()] for k in range(3))
    assert {p.producer for p in pushes} == {shop(app_dsn)}
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_outbox_relayed") == [(0,)], timeout=WAIT)
    assert db_rows(pg_dsn, f"SELECT count(*), count(DISTINCT session_id) FROM dmq_message WHERE {OUTBOX_PRODUCERS}") \
        == [(len(sent), len(sent))]


def test_an_own_session_id_is_stored_once_and_never_meets_a_row_id(make_server, topic, pg_dsn, app_dsn):
    """Rows the application numbered itself go as producer outbox:shop:own under its number:
    two rows with one number (a transaction retried after an unknown commit outcome) are
    stored once; a row numbered 1 and the relay's row 1 are two messages."""
    server = make_server(outbox=f"shop={app_dsn}")
    send_transaction(app_dsn, [b"numbered by the relay"])  # row 1
    send_transaction(app_dsn, [b"order 1"], session_id=1)  # row 2
    send_transaction(app_dsn, [b"order 1, again"], session_id=1)  # row 3: the retry
    pushes = consume(server, 2)
    assert sorted((p.producer, p.session_id, p.body) for p in pushes) == [
        (shop(app_dsn), 1, b"numbered by the relay"), ("outbox:shop:own", 1, b"order 1")]
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)


def test_a_delayed_row_arrives_when_due(make_server, topic, pg_dsn, app_dsn):
    """A row sent with a delay is stored as a delayed message and pushed once it is due;
    its record goes with the row's delete."""
    server = make_server(outbox=f"shop={app_dsn}")
    send_transaction(app_dsn, [b"later"], delay=1.0)
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    assert db_rows(pg_dsn, "SELECT producer, body FROM dmq_delay") == [(shop(app_dsn) + ":delayed", b"later")]
    [push] = consume(server, 1)
    assert push.body == b"later" and push.producer == shop(app_dsn) + ":delayed"
    # its move into the topic is not a relay: it leaves no record behind
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_outbox_relayed") == [(0,)]


def _hold_rows(app_dsn: str) -> psycopg.Connection:
    """A transaction holding every outbox row's lock: the relay reads them (a plain read
    takes no lock) and stores them, and its DELETE waits for this transaction."""
    conn = psycopg.connect(app_dsn)
    conn.execute("SELECT id FROM dmq_outbox.outbox FOR UPDATE").fetchall()
    return conn


WAITING_DELETE = "wait_event_type = 'Lock' AND query LIKE '%%DELETE FROM dmq_outbox.outbox%%'"


def _relay_waits_to_delete(app_dsn: str) -> bool:
    return bool(db_rows(app_dsn, f"SELECT 1 FROM pg_stat_activity WHERE {WAITING_DELETE}"))


@pytest.mark.parametrize("swept", [False, True], ids=["within-retention", "after-retention"])
def test_killed_between_store_and_delete_stores_nothing_twice(make_server, topic, pg_dsn, app_dsn, swept):
    """The server is killed (-9) after its store committed and before its delete: its DELETE
    is held on the rows' locks, so the kill comes exactly there. Restarted, it finds the rows
    recorded and deletes them without storing them again: within --message-retention the
    consumer gets each once under its first id (a delayed one once it is due); after it (the
    messages gone from dmq_message and dmq_delay, as the retention sweep leaves them) nothing
    is stored a second time."""
    send_transaction(app_dsn, [b"a", b"b", b"c"])
    send_transaction(app_dsn, [b"later"], delay=0.5)
    blocker = _hold_rows(app_dsn)
    try:
        server = make_server(outbox=f"shop={app_dsn}")
        wait_for(lambda: _relay_waits_to_delete(app_dsn), timeout=WAIT)
        stored = db_rows(pg_dsn, f"SELECT id, body FROM dmq_message WHERE producer = '{shop(app_dsn)}' ORDER BY id")
        assert [body for _, body in stored] == [b"a", b"b", b"c"]
        # the delayed one waits, or was moved when due
        assert db_rows(pg_dsn, "SELECT (SELECT count(*) FROM dmq_delay) + (SELECT count(*) FROM dmq_message)") == [(4,)]
        producer = shop(app_dsn)
        assert db_rows(pg_dsn, "SELECT producer, session_id FROM dmq_outbox_relayed ORDER BY 2") == [
            (producer, 1), (producer, 2), (producer, 3), (producer + ":delayed", 4)]
        server.kill()
        # the killed server's backend would end once it noticed its client gone; its DELETE,
        # still waiting for the lock, must not run after all
        db_rows(app_dsn, f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {WAITING_DELETE}")
    finally:
        blocker.rollback()
        blocker.close()
    assert db_rows(app_dsn, "SELECT count(*) FROM dmq_outbox.outbox") == [(4,)]
    if swept:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"DELETE FROM dmq_delay WHERE {OUTBOX_PRODUCERS}")
            conn.execute(f"DELETE FROM dmq_message WHERE {OUTBOX_PRODUCERS}")
    server.start()
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_outbox_relayed") == [(0,)], timeout=WAIT)
    if swept:
        assert db_rows(pg_dsn, f"SELECT count(*) FROM dmq_delay WHERE {OUTBOX_PRODUCERS}") == [(0,)]
    else:
        pushes = consume(server, 4)
        assert sorted(p.body for p in pushes) == [b"a", b"b", b"c", b"later"]
        assert sorted((p.message_id, p.body) for p in pushes if p.body != b"later") == stored
    assert db_rows(pg_dsn, f"SELECT count(*) FROM dmq_message WHERE {OUTBOX_PRODUCERS}") == [(0 if swept else 4,)]


@pytest.mark.parametrize("swept", [False, True], ids=["within-retention", "after-retention"])
def test_killed_with_a_batch_stored_and_the_next_read_in_flight_stores_nothing_twice(
    make_server, topic, pg_dsn, app_dsn, swept
):
    """Batches of 2 (--commit-batch-size 2): while a full batch is stored the relay reads
    the next, deleting the one before in the same call. Rows 1-2's delete is held on their
    locks, so the kill (-9) comes with batches 1-2 and 3-4 stored and the read after them
    on its way. Restarted, the relay finds rows 1-4 recorded (not only the batch whose
    delete it last sent), deletes them without storing any again, and stores row 5: within
    --message-retention each arrives once under its first id; after it (the messages
    swept) none of rows 1-4 is stored a second time."""
    for bodies in ([b"a", b"b"], [b"c", b"d"], [b"e"]):
        send_transaction(app_dsn, bodies)
    blocker = psycopg.connect(app_dsn)
    blocker.execute("SELECT id FROM dmq_outbox.outbox WHERE id <= 2 FOR UPDATE").fetchall()
    try:
        server = make_server(outbox=f"shop={app_dsn}", commit_batch_size="2")
        wait_for(lambda: _relay_waits_to_delete(app_dsn), timeout=WAIT)
        stored = db_rows(pg_dsn, f"SELECT id, body FROM dmq_message WHERE {OUTBOX_PRODUCERS} ORDER BY id")
        assert [body for _, body in stored] == [b"a", b"b", b"c", b"d"]
        assert db_rows(pg_dsn, "SELECT session_id FROM dmq_outbox_relayed ORDER BY 1") == [(1,), (2,), (3,), (4,)]
        server.kill()
        db_rows(app_dsn, f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {WAITING_DELETE}")
    finally:
        blocker.rollback()
        blocker.close()
    assert db_rows(app_dsn, "SELECT count(*) FROM dmq_outbox.outbox") == [(5,)]
    if swept:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"DELETE FROM dmq_message WHERE {OUTBOX_PRODUCERS}")
    server.start()
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_outbox_relayed") == [(0,)], timeout=WAIT)
    after = db_rows(pg_dsn, f"SELECT id, body FROM dmq_message WHERE {OUTBOX_PRODUCERS} ORDER BY id")
    assert [body for _, body in after] == ([b"e"] if swept else [b"a", b"b", b"c", b"d", b"e"])
    if not swept:
        assert after[:4] == stored
        pushes = consume(server, 5)
        assert sorted(p.body for p in pushes) == [b"a", b"b", b"c", b"d", b"e"]
    assert "kept as dead letters" not in server.log()  # no row was taken for a bad one


def test_the_relay_deletes_only_on_the_connection_holding_its_lock_and_reads_past_a_batch(app_dsn):
    """delete_and_read on a connection that is not the lock's (a worker that reconnected)
    deletes nothing; on the lock's, it deletes, then reads the rows not left out, in id
    order: those below the batch left out too."""
    from dmq_server.db import outbox as relay_db
    from dmq_server.db.storage_errors import StorageError

    for k in range(6):
        send_transaction(app_dsn, [f"row {k + 1}".encode()])
    q = relay_db.relay_queries("dmq_outbox")
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        pid = relay_db.hold_relay(conn, q, "dmq_outbox", 0)
        with pytest.raises(StorageError, match="relay's lock ended"):
            relay_db.delete_and_read(conn, q, "dmq_outbox", pid + 1, [1], 10)
        assert db_rows(app_dsn, "SELECT count(*) FROM dmq_outbox.outbox") == [(6,)]
        _, rows = relay_db.delete_and_read(conn, q, "dmq_outbox", pid, [1], 3, 0, [3, 4])
        assert [r.id for r in rows] == [2, 5, 6]
        assert db_rows(app_dsn, "SELECT id FROM dmq_outbox.outbox ORDER BY id") == [(k,) for k in range(2, 7)]
        assert relay_db.delete_and_read(conn, q, "dmq_outbox", pid, [2], 0) == ("", [])
        assert db_rows(app_dsn, "SELECT count(*) FROM dmq_outbox.outbox") == [(4,)]


def test_a_bad_row_becomes_a_dead_letter_and_the_rows_behind_it_arrive(make_server, topic, pg_dsn, app_dsn):
    """A row to a topic dmq does not know and a body over --max-msg-size are dead letters
    with the reason and the row named; the rows after them arrive; once the topic is
    registered, a replay delivers the first."""
    server = make_server(outbox=f"shop={app_dsn}", max_msg_size="100")
    send_transaction(app_dsn, [b"first"])
    send_transaction(app_dsn, [b"lost"], topic="nosuch")
    send_transaction(app_dsn, [b"x" * 101, b"second"])
    pushes = consume(server, 2)
    assert [p.body for p in pushes] == [b"first", b"second"]
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    letters = db_rows(pg_dsn, "SELECT topic, producer, session_id, length(body), detail FROM dmq_dead_letter ORDER BY id")
    assert [letter[:4] for letter in letters] == [("nosuch", shop(app_dsn), 2, 4), ("orders", shop(app_dsn), 3, 101)]
    assert "row 2" in letters[0][4] and "not registered" in letters[0][4], letters[0][4]
    assert "row 3" in letters[1][4] and "too big" in letters[1][4], letters[1][4]
    # registered afterwards, the topic gets the dead letter by a replay, as any other
    import registry
    from dmq_server.db.worker import connect

    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "nosuch", msg_timeout_ms=60000)
        registry.add_channel(conn, "nosuch", "audit")
    [(letter_id,)] = db_rows(pg_dsn, "SELECT id FROM dmq_dead_letter WHERE topic = 'nosuch'")
    done = run_cli(pg_dsn, "dlq", "replay", str(letter_id))
    assert done.returncode == 0, done.stderr
    [push] = consume(server, 1, topic="nosuch", channel="audit")
    assert push.body == b"lost"


@pytest.fixture
def second_dmq_dsn(pg_server, pg_template):
    """Another dmq database (a second, separate dmq installation)."""
    with _database(pg_server, pg_template) as dsn:
        yield dsn


def _stored(dsn: str) -> int:
    return db_rows(dsn, f"SELECT count(*) FROM dmq_message WHERE {OUTBOX_PRODUCERS}")[0][0]


def test_one_relay_per_outbox_and_another_takes_over_after_kill(make_server, topic, pg_dsn, second_dmq_dsn, app_dsn):
    """Two servers (each with its own dmq database) relay one outbox: one holds the lock
    and relays every row; killed with -9, its lock goes with its connection and the other
    relays the rows sent after."""
    import registry
    from dmq_server.db.worker import connect

    with connect(second_dmq_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders", msg_timeout_ms=60000)
        registry.add_channel(conn, "orders", "billing")
    first = make_server(outbox=f"shop={app_dsn}")
    second = make_server(dsn=second_dmq_dsn, outbox=f"shop={app_dsn}")
    send_transaction(app_dsn, [b"one", b"two", b"three"])
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    counts = {pg_dsn: _stored(pg_dsn), second_dmq_dsn: _stored(second_dmq_dsn)}
    assert sorted(counts.values()) == [0, 3], counts
    leader, other = (first, second) if counts[pg_dsn] == 3 else (second, first)
    assert "this node relays dmq_outbox" in leader.log() and "this node relays" not in other.log()
    leader.kill()
    send_transaction(app_dsn, [b"four", b"five"])
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    assert _stored(other.dsn) == 2 and _stored(leader.dsn) == 3
    assert "this node relays dmq_outbox" in other.log()



def test_a_relay_taking_over_drops_the_records_of_rows_gone_and_skips_rows_recorded(
    make_server, topic, pg_dsn, app_dsn
):
    """What a relay killed between its delete and dropping the records leaves (records of
    rows no longer in the outbox), and what one killed between its store and its delete
    leaves (a row still in the outbox whose record says it was stored): the next relay to
    take the outbox drops the first and deletes the second without storing it again."""
    send_transaction(app_dsn, [b"stored before the kill"])  # row 1, still in the outbox
    producer = shop(app_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO dmq_outbox_relayed (session_id, producer) VALUES "
                     "(1, %s), (7, %s), (8, %s), (9, 'outbox:other')", (producer, producer, producer + ":delayed"))
    server = make_server(outbox=f"shop={app_dsn}")
    send_transaction(app_dsn, [b"new"])  # row 2
    [push] = consume(server, 1)
    assert push.body == b"new"
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    wait_for(lambda: db_rows(pg_dsn, "SELECT producer, session_id FROM dmq_outbox_relayed") == [("outbox:other", 9)],
             timeout=WAIT)


def test_reading_the_outbox_takes_the_notifications_received_so_far(app_dsn):
    """psycopg keeps the NOTIFYs that arrive while other statements run until they are
    taken; a relay that always finds rows never waits for one, so each read takes them
    (memory stays bounded): none are left after it, and one sent after it still wakes the
    wait."""
    from dmq_server.db import outbox as relay_db

    q = relay_db.relay_queries("dmq_outbox")
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        assert relay_db.hold_relay(conn, q, "dmq_outbox", 0) == conn.info.backend_pid
        for _ in range(50):
            send_transaction(app_dsn, [b"x"])
            conn.execute("SELECT 1")  # busy: the notification is kept for later
        tag, rows = relay_db.read_rows(conn, q, "dmq_outbox", 100)
        assert [r.id for r in rows] == list(range(1, 51)) and shop(app_dsn) == f"outbox:shop:{tag}"
        assert list(conn.notifies(timeout=0)) == []
        send_transaction(app_dsn, [b"y"])
        assert relay_db.wait_for_rows(conn, 5.0) is True


def test_with_two_clusters_a_row_stored_on_the_other_is_not_stored_again(make_server, pg_dsn, pg_private, app_dsn):
    """A topic placed on cluster b (--pg-cluster): its rows' records are written in b's
    database. Killed between store and delete, then the message swept there: restarted,
    the relay finds the record in b and stores nothing again."""
    b_dsn = pg_private.dsn
    setup = make_server(pg_cluster=f"b={b_dsn}")
    assert run_cli(pg_dsn, "--pg-cluster", f"b={b_dsn}", "topic", "create", "remote", "--cluster", "b").returncode == 0
    assert run_cli(pg_dsn, "--pg-cluster", f"b={b_dsn}", "channel", "add", "remote", "c1").returncode == 0
    wait_for(lambda: db_rows(b_dsn, "SELECT topic, name FROM dmq_channel") == [("remote", "c1")], timeout=WAIT)
    setup.stop()
    send_transaction(app_dsn, [b"far"], topic="remote")
    blocker = _hold_rows(app_dsn)
    try:
        server = make_server(pg_cluster=f"b={b_dsn}", outbox=f"shop={app_dsn}")
        wait_for(lambda: _relay_waits_to_delete(app_dsn), timeout=WAIT)
        assert db_rows(b_dsn, "SELECT producer, session_id FROM dmq_outbox_relayed") == [(shop(app_dsn), 1)]
        assert db_rows(b_dsn, "SELECT body FROM dmq_message") == [(b"far",)]
        server.kill()
        db_rows(app_dsn, f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {WAITING_DELETE}")
    finally:
        blocker.rollback()
        blocker.close()
    with psycopg.connect(b_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM dmq_message")  # swept, as after --message-retention
    server.start()
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    wait_for(lambda: db_rows(b_dsn, "SELECT count(*) FROM dmq_outbox_relayed") == [(0,)], timeout=WAIT)
    assert db_rows(b_dsn, "SELECT count(*) FROM dmq_message") == [(0,)]
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message") == [(0,)]


def test_installed_again_rows_with_the_same_ids_are_new_messages(make_server, topic, pg_dsn, app_dsn):
    """Uninstalled and installed again, the outbox numbers its rows from 1 again while the
    messages relayed before are still stored (within --message-retention). Each install
    relays under its own tag, so the new rows 1-3 are delivered, none taken for a repeat
    of the old rows 1-3 (the relay holds its lock throughout: it sees the new install in
    the rows it reads)."""
    server = make_server(outbox=f"shop={app_dsn}")
    send_transaction(app_dsn, [b"old 1", b"old 2", b"old 3"])
    before = consume(server, 3)
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    old = shop(app_dsn)
    for action in ("uninstall", "install"):
        done = run_cli(app_dsn, "outbox", action, "--dsn", app_dsn)
        assert done.returncode == 0, done.stderr
    new = shop(app_dsn)
    assert new != old
    send_transaction(app_dsn, [b"new 1", b"new 2", b"new 3"])
    after = consume(server, 3)
    assert [(p.producer, p.session_id, p.body) for p in before + after] == [
        (old, 1, b"old 1"), (old, 2, b"old 2"), (old, 3, b"old 3"),
        (new, 1, b"new 1"), (new, 2, b"new 2"), (new, 3, b"new 3")]
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    assert db_rows(pg_dsn, f"SELECT count(DISTINCT id) FROM dmq_message WHERE {OUTBOX_PRODUCERS}") == [(6,)]
    assert "was installed again" in server.log()


def _mpub_until(server, stop: threading.Event, sent: list[int]) -> None:
    """Another producer's load on the same group commit: MPUBs of 30 to orders."""
    body = b"\n".join(b"load %d" % i for i in range(30))
    while not stop.is_set():
        request = urllib.request.Request(server.http + "/mpub?topic=orders", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=WAIT) as answer:
            assert answer.status == 200
        sent[0] += 30


def test_order_holds_with_two_commit_writers_under_other_producers_load(make_server, topic, pg_dsn, app_dsn):
    """--commit-writers 2, a group commit of 20, two other producers sending MPUBs of 30 to
    the same topic all along: transactions whose rows alternate between two topics (runs
    of one row each, two runs per topic in a batch and more) and transactions longer than
    a batch. Every transaction's rows get message ids in the order it sent them, in each
    topic; none is lost or doubled."""
    import registry
    from dmq_server.db.worker import connect

    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "refunds", msg_timeout_ms=60000)
        registry.add_channel(conn, "refunds", "billing")
    server = make_server(outbox=f"shop={app_dsn}", commit_writers="2", commit_batch_size="20")
    stop, sent = threading.Event(), [0]
    loads = [threading.Thread(target=_mpub_until, args=(server, stop, sent)) for _ in range(2)]
    for load in loads:
        load.start()
    try:
        wait_for(lambda: sent[0] >= 300, timeout=WAIT)
        expected: dict[str, list[bytes]] = {}
        for t in range(30):
            with psycopg.connect(app_dsn) as conn:
                count = 25 if t % 3 == 0 else 12
                for k in range(count):
                    name = "orders" if t % 3 == 0 or k % 2 == 0 else "refunds"
                    body = f"t{t}-{k}".encode()
                    outbox.send(conn, name, body)
                    expected.setdefault(f"t{t}/{name}", []).append(body)
                conn.commit()
        wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    finally:
        stop.set()
        for load in loads:
            load.join()
    stored = db_rows(pg_dsn, f"SELECT topic, body FROM dmq_message WHERE producer = '{shop(app_dsn)}' ORDER BY id")
    assert len(stored) == sum(len(bodies) for bodies in expected.values()) == len(set(stored))
    got: dict[str, list[bytes]] = {}
    for name, body in stored:
        got.setdefault(f"{body.decode().split('-')[0]}/{name}", []).append(body)
    assert got == expected
    others = db_rows(pg_dsn, "SELECT count(*) FROM dmq_message WHERE producer NOT LIKE 'outbox:%%'")[0][0]
    assert sent[0] >= 300 and others >= sent[0]
