"""The console's "Oldest" of a fast channel (broker.snapshot.waiting_since) on real
go-diskqueue files: the publish time of the longest-waiting message, wherever it waits
(the memory queue, the records read ahead from the disk queue, the disk queue's file),
checked after every delivery against the messages not delivered yet. task.Clock time."""

from __future__ import annotations

from twisted.internet.task import Clock

from dmq_server.broker.snapshot import waiting_since
from dmq_server.fast.fast_store import FastStore
from tests.unit.test_nsq_store import FakeClient


def test_the_oldest_waiting_message_of_a_fast_channel(tmp_path):
    clock = Clock()
    clock.advance(1_000)
    store = FastStore(clock, tmp_path, node_id=3, mem_queue_size=2)  # 2 in memory, the rest on disk
    store.start()
    topic = store.get_topic("events")
    channel = topic.get_channel("tail")
    published: dict[bytes, int] = {}

    def publish(count: int) -> None:
        for _ in range(count):
            clock.advance(10)  # each message 10 s after the one before
            message = store.new_message(b"m%d" % len(published))
            published[message.id] = message.timestamp
            topic.put(message)

    def waiting() -> int | None:
        left = [ts for mid, ts in published.items() if mid not in delivered]
        return min(left) if left else None

    publish(6)
    delivered: set[bytes] = set()
    assert channel.backend.depth() == 4 and waiting_since(channel) == waiting()
    client = FakeClient(1)  # one at a time: memory and disk take turns, the disk read two ahead
    channel.add_client(client)
    channel.pump()
    for step in range(7):
        if step == 4:
            publish(1)  # room in memory again: a newer message there, older ones on disk
        message = client.received[step]
        delivered.add(message.id)
        assert waiting_since(channel) == waiting(), step
        channel.finish(client, message.id)
    assert len(client.received) == 7 and delivered == set(published)
    assert waiting_since(channel) is None
    store.close()
