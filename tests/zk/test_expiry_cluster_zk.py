"""Expiry on a cluster: two dmq-server ``--zk`` nodes on one PostgreSQL, a topic whose
copies expire after a second.

The node that holds a channel's copies in memory (the holder of their cursor) is the one
that must expire them: it drops what it expired from its memory. Were another node's sweep
to take them, the holder would go on pushing copies that are dead letters already. Five
bursts of eight messages go through node A, 300 ms apart; A's consumer holds one copy in
flight (credit 1, never acknowledging; the topic's message timeout 400 ms, so the copy in
flight comes back and goes out again) while both nodes sweep every 100 ms. Once all forty
are dead letters, each once, A holds nothing for the channel and pushes nothing more.
"""

from __future__ import annotations

import json

from dmq_client.wire import Command
from tests.integration.support import db_rows, http_get, wait_for

from .helpers import register_topic, send_many, wait_served

WAIT = 30.0


def _channel_figures(node) -> tuple[int, int]:
    """(depth, in flight) of channel c of topic short on ``node``."""
    status, body = http_get(node.http + "/stats")
    assert status == 200
    topic = next(t for t in json.loads(body)["topics"] if t["topic_name"] == "short")
    channel = next(c for c in topic["channels"] if c["channel_name"] == "c")
    return channel["depth"], channel["in_flight_count"]


def test_each_node_expires_the_copies_it_holds_and_pushes_no_dead_letter(pg_dsn, zk, make_node):
    register_topic(zk, "short", "c", ttl_ms=1000, msg_timeout_ms=400)
    a = make_node(expiry_interval="100ms")
    b = make_node(expiry_interval="100ms")
    for node in (a, b):
        wait_served(node, "short", "c", timeout=20)
    sent: list[int] = []
    pushed: list[int] = []
    with a.client() as producer, a.client() as consumer:
        assert consumer.subscribe("short", "c", credit=1).command == Command.SUBSCRIBE_ACK
        for _ in range(5):
            sent += send_many(producer, "short", 8, b"burst")
            # the 300 ms between bursts: receiving (a push each, or nothing for 0.3 s)
            while (push := consumer.receive(timeout=0.3)) is not None:
                pushed.append(push.message_id)

        def all_expired() -> bool:
            while (push := consumer.receive(timeout=0.05)) is not None:
                pushed.append(push.message_id)
            return db_rows(pg_dsn, "SELECT count(*) FROM dmq_dead_letter")[0][0] >= len(sent)

        wait_for(all_expired, timeout=WAIT)
        # A dropped every copy it held: none is left for it to push
        wait_for(lambda: _channel_figures(a) == (0, 0), timeout=WAIT)
        assert consumer.receive(timeout=1.0) is None
    letters = db_rows(pg_dsn, "SELECT message_id, reason, channel FROM dmq_dead_letter")
    assert sorted(m for m, _, _ in letters) == sorted(sent)  # each once
    assert {(reason, channel) for _, reason, channel in letters} == {("expired", "c")}
    assert pushed and set(pushed) <= set(sent)
    assert _channel_figures(b) == (0, 0)
