"""kill -9 while the expiry sweeps a topic with a time to live and a backlog, counted.

Three producers publish to a topic whose copies expire after 1.5 s; channel ``a`` has two
consumers that hold up to 40 copies and acknowledge a random half of them at a time (the
rest later, or never if a kill comes first), channel ``b`` none, so
its backlog grows and its copies expire in batches while the server is killed with SIGKILL
at a random moment, three times. Each copy a pass reads is its channel's oldest waiting
(issue 48: a pass reads at most a batch of a channel's copies, and tests the time to live
on those). At the end, every id acknowledged to a producer is, on each channel, durably
acknowledged (the delivery log) or an ``expired`` dead letter: never lost, never both,
never two dead letters, and none dead-lettered before its time to live.
"""

from __future__ import annotations

import random
import time

import pytest

import registry
from dmq_server.db.worker import connect

from .support import db_rows, wait_for
from .test_cursor_crash import Consumer, Producer, kill_under_load

pytestmark = pytest.mark.integration

TTL_MS = 1500
CHANNELS = ("a", "b")


def test_kill_9_during_expiry_loses_nothing_and_expires_each_copy_once(make_server, pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "expiring", ttl_ms=TTL_MS, msg_timeout_ms=60000)
        for channel in CHANNELS:
            registry.add_channel(conn, "expiring", channel)
    rng = random.Random(48)
    server = make_server(expiry_interval="100ms")
    acked: set[int] = set()
    for round_ in range(3):
        producers = [Producer(server.tcp_port, "expiring", f"p{round_}-{i}") for i in range(3)]
        consumers = [Consumer(server.tcp_port, "expiring", "a", rng.random()) for _ in range(2)]
        for t in producers + consumers:
            t.start()
        target = len(acked) + rng.randint(1500, 3000)
        wait_for(lambda: len(acked | set().union(*(p.acked for p in producers))) >= target, timeout=90)
        # a random moment after some of this round's copies are past their time to live
        wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_dead_letter")[0][0] > 0, timeout=30)
        time.sleep(rng.random() * 1.0)
        acked |= kill_under_load(server, producers, consumers)
        server.start()

    # nothing consumes now: whatever was not durably acknowledged expires
    wait_for(lambda: not db_rows(pg_dsn, "SELECT 1 FROM dmq_pending LIMIT 1"), timeout=60)
    durable = {c: {m for (m,) in db_rows(pg_dsn, "SELECT message_id FROM dmq_delivery_log WHERE channel = %s", c)}
               for c in CHANNELS}
    letters = db_rows(pg_dsn, "SELECT channel, message_id, reason, "
                      "(extract(epoch FROM dead_at - published_at) * 1000)::bigint FROM dmq_dead_letter")
    assert {reason for _, _, reason, _ in letters} == {"expired"}
    early = [(c, m, age) for c, m, _, age in letters if age < TTL_MS]
    assert not early, f"dead-lettered before the time to live: {early[:20]}"
    assert len(acked) > 4500
    for channel in CHANNELS:
        expired = [m for c, m, _, _ in letters if c == channel]
        assert len(expired) == len(set(expired)), f"{channel}: a copy dead-lettered twice"
        both = durable[channel] & set(expired)
        assert not both, f"{channel}: {len(both)} copies both acknowledged and expired: {sorted(both)[:20]}"
        lost = acked - durable[channel] - set(expired)
        assert not lost, f"{channel}: {len(lost)} acknowledged ids neither acknowledged nor expired: {sorted(lost)[:20]}"
        print(f"{channel}: {len(acked)} acknowledged to producers, {len(durable[channel] & acked)} acknowledged "
              f"by consumers, {len(set(expired))} expired")
    assert durable["a"] and not durable["b"]
