"""Failures: the server killed mid-send, PostgreSQL stopped mid-send. Nothing acknowledged is lost."""

from __future__ import annotations

import threading
import time

from dmq_client.blocking import BlockingClient, ClientError
from dmq_client.wire import Command

from .support import db_rows, http_get, run_cli, wait_for


def _producer_loop(port: int, topic: str, acked: set, errors: list, stop: threading.Event) -> None:
    """Pipelined sends until the connection dies; records every SEND_SUCCESS_ACK id."""
    try:
        client = BlockingClient("127.0.0.1", port, timeout=5)
    except OSError as exc:
        errors.append(exc)
        return
    try:
        while not stop.is_set():
            for reply in client.send_many(topic, [b"k" * 100] * 50, window=25):
                if reply.command == Command.SEND_SUCCESS_ACK:
                    acked.add(reply.message_id)
    except (ClientError, OSError) as exc:
        errors.append(exc)
    finally:
        client.close()


def test_kill_9_while_sending_loses_nothing_acknowledged(make_server, topic, pg_dsn):
    """SIGKILL during sends; after restart every acknowledged message is delivered."""
    server = make_server()
    acked: set[int] = set()
    errors: list = []
    stop = threading.Event()
    threads = [
        threading.Thread(target=_producer_loop, args=(server.tcp_port, topic, acked, errors, stop))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    wait_for(lambda: len(acked) >= 2000, timeout=60)
    server.kill()
    stop.set()
    for t in threads:
        t.join(30)
    assert len(errors) == 3  # every producer saw its connection die
    acked_before_kill = set(acked)

    server.start()
    delivered: dict[int, int] = {}
    with server.client() as consumer:
        consumer.subscribe(topic, "billing", credit=1000)
        while True:
            push = consumer.receive(timeout=3)
            if push is None:
                break
            delivered[push.message_id] = delivered.get(push.message_id, 0) + 1
            consumer.ack(push)
    lost = acked_before_kill - delivered.keys()
    assert not lost, f"{len(lost)} acknowledged messages lost"
    # anything delivered beyond the acked set was committed but its ack never reached the producer
    stored = {r[0] for r in db_rows(pg_dsn, "SELECT id FROM dmq_message")}
    assert set(delivered) <= stored
    assert all(n == 1 for n in delivered.values())


def test_postgres_stopped_while_sending_gives_errors_not_false_acks(make_server, pg_private):
    """With PostgreSQL down: SEND_SERVER_ERROR and /ping 500; it recovers without a restart."""
    dsn = pg_private.start()
    for args in (("topic", "create", "t"), ("channel", "add", "t", "c")):
        run_cli(dsn, *args).check_returncode()
    server = make_server(dsn=dsn)
    acked: set[int] = set()
    with server.client(timeout=15) as producer:
        for reply in producer.send_many("t", [b"x"] * 100):
            assert reply.command == Command.SEND_SUCCESS_ACK
            acked.add(reply.message_id)

        pg_private.stop(mode="immediate")
        outcomes = []
        for _ in range(20):
            try:
                reply = producer.send("t", b"while down", timeout=15)
            except ClientError:
                outcomes.append("no answer")
                continue
            outcomes.append(reply.command)
            if reply.command == Command.SEND_SUCCESS_ACK:
                acked.add(reply.message_id)
        assert Command.SEND_SUCCESS_ACK not in outcomes, outcomes
        assert Command.SEND_SERVER_ERROR in outcomes
        status, body = http_get(server.http + "/ping")
        assert status == 500 and "database unreachable" in body
        # an uncached topic cannot be checked either: a server error, not "no such topic"
        unknown = producer.send("not-cached", b"x", timeout=15)
        assert unknown.command == Command.SEND_SERVER_ERROR, unknown

        pg_private.start()
        wait_for(lambda: http_get(server.http + "/ping")[0] == 200, timeout=30)
        deadline = time.monotonic() + 30
        while True:
            reply = producer.send("t", b"after", timeout=15)
            if reply.command == Command.SEND_SUCCESS_ACK or time.monotonic() > deadline:
                break
        assert reply.command == Command.SEND_SUCCESS_ACK
        acked.add(reply.message_id)

    stored = {r[0] for r in db_rows(dsn, "SELECT id FROM dmq_message")}
    assert acked <= stored
    with server.client() as consumer:
        consumer.subscribe("t", "c", credit=500)
        got = set()
        while (push := consumer.receive(timeout=3)) is not None:
            got.add(push.message_id)
            consumer.ack(push)
    assert acked <= got
