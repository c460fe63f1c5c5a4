"""A seek replays with the delivery rules of its topic (issue 46): a real dmq-server on real
PostgreSQL, consumers connected through the seek, the CLI straight to PostgreSQL.

Ordered topic: 60 keyed messages (six keys, interleaved), acknowledged; after a seek to the
first id a consumer with credit for many copies at once receives all 60 again, each once,
never two copies of one key out at the same time, and each key's messages in the order they
were stored. Priority: 40 messages of priorities 0 to 9, acknowledged; after a seek, with a
small memory window (``--mem-queue-size``), the replay goes out highest priority first,
then in id order, as the first delivery of a stored backlog does.
"""

from __future__ import annotations

import random

import pytest

import registry
from dmq_client.message import ReceivedMessage
from dmq_client.wire import Command
from dmq_server.db.worker import connect

from .support import db_rows, run_cli, wait_for

pytestmark = pytest.mark.integration


def _topic(dsn: str, name: str, **settings) -> None:
    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, name, retention_ms=3_600_000, **settings)
        registry.add_channel(conn, name, "c")


def _nothing_pending(dsn: str) -> bool:
    return not db_rows(dsn, "SELECT 1 FROM dmq_pending")


def _seek_to(dsn: str, topic: str, first: int, count: int) -> None:
    out = run_cli(dsn, "channel", "seek", topic, "c", "--to-id", str(first))
    assert out.returncode == 0 and f"{count} messages from id {first} " in out.stdout, (out.stdout, out.stderr)


def test_an_ordered_topic_replays_each_key_in_order_one_copy_at_a_time(make_server, pg_dsn):
    _topic(pg_dsn, "ledger", ordered=True, msg_timeout_ms=30_000)
    server = make_server(channel_state_interval="500ms")
    keys = [f"k{n % 6}" for n in range(60)]
    with server.client() as producer:
        stored = []
        for n, key in enumerate(keys):
            reply = producer.send("ledger", b"%d" % n, key=key)
            assert reply.command == Command.SEND_SUCCESS_ACK, reply.status
            stored.append((reply.message_id, key))
    by_key = {k: [mid for mid, key in stored if key == k] for k in set(keys)}

    with server.client() as consumer:
        assert consumer.subscribe("ledger", "c", credit=30).command == Command.SUBSCRIBE_ACK

        def take(count: int) -> list[tuple[int, str]]:
            """``count`` pushes, three held unacknowledged at a time (the oldest acknowledged
            as a fourth comes, or when none comes for a moment): copies of several keys out at
            once, so one of a key held would let another of it out if the rule broke."""
            out: list[tuple[int, str]] = []
            held: dict[str, object] = {}
            while len(out) < count:
                if len(held) >= 3:
                    consumer.ack(held.pop(next(iter(held))))
                push = consumer.receive(timeout=0.5 if held else 15.0)
                if push is None:
                    assert held, f"only {len(out)} of {count} pushed"
                    consumer.ack(held.pop(next(iter(held))))
                    continue
                key = ReceivedMessage.properties_of(push.status).key
                assert key not in held, f"two copies of {key} out at once: {push.message_id}"
                held[key] = push
                out.append((push.message_id, key))
            for push in held.values():
                consumer.ack(push)
            return out

        first = take(60)
        wait_for(lambda: _nothing_pending(pg_dsn), timeout=15)
        _seek_to(pg_dsn, "ledger", stored[0][0], 60)
        again = take(60)
        assert consumer.receive(timeout=1.5) is None  # each once, and nothing else
    for pushes in (first, again):
        assert sorted(mid for mid, _ in pushes) == sorted(mid for mid, _ in stored)
        for key, ids in by_key.items():
            assert [mid for mid, k in pushes if k == key] == ids, key


def test_a_seek_replays_the_highest_priority_first(make_server, pg_dsn):
    _topic(pg_dsn, "jobs", msg_timeout_ms=30_000)
    server = make_server(channel_state_interval="500ms", mem_queue_size="10")
    rng = random.Random(46)
    with server.client() as producer:
        sent = {}
        for n in range(40):
            priority = rng.randrange(10)
            reply = producer.send("jobs", b"%d" % n, priority=priority)
            assert reply.command == Command.SEND_SUCCESS_ACK, reply.status
            sent[reply.message_id] = priority
    expected = sorted(sent, key=lambda mid: (-sent[mid], mid))

    with server.client() as consumer:
        assert consumer.subscribe("jobs", "c", credit=1).command == Command.SUBSCRIBE_ACK

        def take() -> list[int]:
            got = []
            while len(got) < len(sent):
                push = consumer.receive(timeout=15)
                assert push is not None, f"only {len(got)} of {len(sent)} pushed"
                assert ReceivedMessage.properties_of(push.status).priority == sent[push.message_id]
                got.append(push.message_id)
                consumer.ack(push)
            return got

        assert take() == expected  # the stored backlog, first time
        wait_for(lambda: _nothing_pending(pg_dsn), timeout=15)
        _seek_to(pg_dsn, "jobs", min(sent), 40)
        assert take() == expected  # and again after the seek
        assert consumer.receive(timeout=1.5) is None
