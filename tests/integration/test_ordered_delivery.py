"""An ordered topic end to end: real dmq-server processes on real PostgreSQL, real sockets.

Per channel at most one copy of a key is out at a time, a key's messages go out in the
order they were stored, other keys flow while one waits, a redelivery keeps its key's
place, and after a restart the copies loaded from PostgreSQL obey the same rule.
Counted: every id acknowledged to the producer is delivered, none twice unless
redelivered.
"""

from __future__ import annotations

import socket

import pytest

from dmq_client.message import ReceivedMessage
from dmq_client.wire import Command

from .support import db_rows, wait_for

pytestmark = pytest.mark.integration


def _ordered_topic(dsn: str, name: str = "ledger", channels: tuple[str, ...] = ("c",)) -> str:
    from dmq_server.db.worker import connect
    import registry

    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, name, msg_timeout_ms=2000, ordered=True)
        for channel in channels:
            registry.add_channel(conn, name, channel)
    return name


def _key(push) -> str | None:
    return ReceivedMessage.properties_of(push.status).key


def _send_all(producer, topic: str, keys: list[str]) -> list[int]:
    ids = []
    for i, key in enumerate(keys):
        reply = producer.send(topic, f"{key}:{i}".encode(), key=key)
        assert reply.command == Command.SEND_SUCCESS_ACK, reply.status
        ids.append(reply.message_id)
    return ids


def test_one_copy_of_a_key_out_at_a_time_and_the_others_flow(make_server, pg_dsn):
    """Two consumers with room for everything: the first read gets the first copy of
    each key and nothing more of those keys; each ack lets exactly the next one of its
    key out, in the order stored."""
    topic = _ordered_topic(pg_dsn)
    server = make_server()
    keys = ["a", "b", "a", "c", "a", "b"]
    with server.client() as producer, server.client() as one, server.client() as two:
        for consumer in (one, two):
            assert consumer.subscribe(topic, "c", credit=10).command == Command.SUBSCRIBE_ACK
        ids = _send_all(producer, topic, keys)
        out = {}  # key -> (push, consumer) of the copy out now
        delivered: dict[str, list[int]] = {}

        def receive_some(expected: int) -> None:
            got = 0
            while got < expected:
                for consumer in (one, two):
                    push = consumer.receive(timeout=0.2)
                    if push is None:
                        continue
                    key = _key(push)
                    assert key not in out, f"a second copy of {key!r} out: {push.message_id}"
                    out[key] = (push, consumer)
                    delivered.setdefault(key, []).append(push.message_id)
                    got += 1

        receive_some(3)  # a, b, c: the first of each key
        assert sorted(out) == ["a", "b", "c"]
        for consumer in (one, two):  # nothing more goes out until an ack
            assert consumer.receive(timeout=0.5) is None
        while out:
            key = sorted(out)[0]
            push, consumer = out.pop(key)
            consumer.ack(push)
            if len(delivered[key]) < keys.count(key):
                receive_some(1)
        assert delivered == {
            "a": [ids[0], ids[2], ids[4]], "b": [ids[1], ids[5]], "c": [ids[3]],
        }
        # every ack made durable (in batches, after the acks were sent)
        wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)])


def test_a_redelivery_keeps_its_place_and_a_restart_loads_in_key_order(make_server, pg_dsn):
    """A copy not acknowledged within the topic's timeout (2 s) goes out again before the
    next of its key; after a restart the copies come from PostgreSQL, one of a key at a
    time, in the order stored."""
    topic = _ordered_topic(pg_dsn)
    server = make_server()
    with server.client() as producer, server.client() as consumer:
        assert consumer.subscribe(topic, "c", credit=10).command == Command.SUBSCRIBE_ACK
        ids = _send_all(producer, topic, ["k", "k", "j"])
        first = [consumer.receive(timeout=5) for _ in range(2)]
        assert sorted(p.message_id for p in first) == [ids[0], ids[2]]
        consumer.ack(next(p for p in first if _key(p) == "j"))  # j is done; k's first is not
        again = consumer.receive(timeout=10)  # k's first copy times out and comes back
        assert again is not None and again.message_id == ids[0] and again.attempts == 2
        consumer.ack(again)
        following = consumer.receive(timeout=5)
        assert following is not None and following.message_id == ids[1]
    # k's second copy is out, unacknowledged, when the server stops
    server.stop()
    restarted = make_server()
    with restarted.client() as producer, restarted.client() as consumer:
        later = _send_all(producer, topic, ["k", "k"])
        assert consumer.subscribe(topic, "c", credit=10).command == Command.SUBSCRIBE_ACK
        given = []
        while (push := consumer.receive(timeout=1.5)) is not None:
            given.append(push)
        # loaded from PostgreSQL in id order: k's second copy, the two after it wait for it
        assert [p.message_id for p in given] == [ids[1]]
        for expected in later:
            consumer.ack(next(p for p in given if _key(p) == "k"))
            push = consumer.receive(timeout=5)
            assert push is not None and push.message_id == expected
            given = [p for p in given if _key(p) != "k"] + [push]


def test_an_nsq_consumer_of_an_ordered_topic_gets_one_copy_of_a_key_at_a_time(make_server, pg_dsn, nsq_connect):
    """NSQ clients have no keys of their own, but a dmq producer's keys hold for them too:
    the channel's rule is the channel's, whichever protocol its consumer speaks. An NSQ
    producer's messages have no key: each goes at once."""
    topic = _ordered_topic(pg_dsn)
    server = make_server()
    with server.client() as producer:
        ids = _send_all(producer, topic, ["a", "a", "b"])
    nsq = nsq_connect(server.tcp_port)
    assert nsq.pub(topic, b"no key") == b"OK"
    nsq.sub(topic, "c", rdy=10)
    first = [nsq.message() for _ in range(3)]
    assert sorted(body for _, _, _, body in first) == [b"a:0", b"b:2", b"no key"]
    with pytest.raises(socket.timeout):  # a:1 waits behind a:0: nothing more comes
        nsq.frame(timeout=1.0)
    a0 = next(mid for _, _, mid, body in first if body == b"a:0")
    nsq.send(b"FIN " + a0 + b"\n")
    _, _, _, body = nsq.message()
    assert body == b"a:1" and len(ids) == 3


def test_a_hot_key_is_read_apart_and_the_other_keys_flow_past_it(make_server, pg_dsn):
    """200 messages of one key stored before 50 of other keys, a window of 64 (a key with
    4 waiting is read apart): the other keys all go out while the hot key is still at its
    first few, and the hot key's go out one at a time, in the order stored, read from
    PostgreSQL as they go. Counted: all 250 delivered once."""
    topic = _ordered_topic(pg_dsn)
    server = make_server(mem_queue_size="64")
    with server.client() as producer:
        hot = _send_all(producer, topic, ["hot"] * 200)
        others = _send_all(producer, topic, [f"k{i}" for i in range(50)])
    with server.client() as consumer:
        assert consumer.subscribe(topic, "c", credit=20).command == Command.SUBSCRIBE_ACK
        order: list[int] = []
        while len(order) < 250:
            push = consumer.receive(timeout=10)
            assert push is not None, f"stalled after {len(order)}"
            order.append(push.message_id)
            consumer.ack(push)
        assert sorted(order) == sorted(hot + others)
        assert [mid for mid in order if mid in set(hot)] == hot  # one at a time, in the order stored
        last_other = max(order.index(mid) for mid in others)
        hot_before = sum(1 for mid in order[:last_other] if mid in set(hot))
        assert hot_before < 20, f"the other keys waited for {hot_before} of the hot key's copies"
