"""The fast store on real go-diskqueue-compatible files (dmq_client.diskqueue), task.Clock time."""

from __future__ import annotations

from twisted.internet.task import Clock

from dmq_client.diskqueue import DiskQueue
from dmq_server.fast.message import FastMessage
from dmq_server.fast.fast_store import FastStore
from tests.unit.test_nsq_store import FakeClient


def open_store(path, clock=None, **kw):
    store = FastStore(clock or Clock(), path, node_id=3, **kw)
    store.start()
    return store


def test_overflow_files_use_nsqd_names_and_layout(tmp_path):
    """Overflow goes to <topic>:<channel>.diskqueue.000000.dat as 26-byte-header records."""
    store = open_store(tmp_path, mem_queue_size=1)
    topic = store.get_topic("orders")
    topic.get_channel("billing")
    msgs = [store.new_message(b"body-%d" % i) for i in range(3)]
    topic.put_many(msgs)
    store.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "orders:billing.diskqueue.000000.dat" in names
    assert "orders:billing.diskqueue.meta.dat" in names
    assert "nsqd.dat" in names
    dq = DiskQueue("orders:billing", tmp_path, min_msg_size=26, max_msg_size=1024 * 1024 + 26)
    records = []
    while (data := dq.read()) is not None:
        records.append(FastMessage.decode(data))
    dq.close()
    assert sorted(m.body for m in records) == [b"body-0", b"body-1", b"body-2"]
    assert {m.id for m in records} == {m.id for m in msgs}
    assert all(m.timestamp == msgs[0].timestamp for m in records)


def test_restart_recovers_every_message(tmp_path):
    """Memory, in-flight, deferred and topic messages all come back after a clean restart."""
    clock = Clock()
    store = open_store(tmp_path, clock, mem_queue_size=2)
    t = store.get_topic("t")
    ch = t.get_channel("c")
    client = FakeClient(1)
    ch.add_client(client)
    t.put_many([store.new_message(b"m%d" % i) for i in range(6)])
    t.put(store.new_message(b"deferred", 50.0))
    waiting = store.get_topic("nochannel")
    waiting.put_many([store.new_message(b"w%d" % i) for i in range(5)])
    store.close()

    again = open_store(tmp_path, Clock(), mem_queue_size=2)
    ch2 = again.topics["t"].channels["c"]
    c2 = FakeClient(100)
    ch2.add_client(c2)
    ch2.pump()
    assert sorted(m.body for m in c2.received) == sorted([b"m%d" % i for i in range(6)] + [b"deferred"])
    assert again.topics["nochannel"].depth() == 5
    late = again.topics["nochannel"].get_channel("late")
    assert late.depth() == 5
    again.close()


def test_delete_topic_removes_its_files(tmp_path):
    """Deleting a topic removes the topic's and its channels' disk-queue files."""
    clock = Clock()
    store = open_store(tmp_path, clock, mem_queue_size=0)
    t = store.get_topic("gone")
    t.get_channel("c")
    t.put(store.new_message(b"x"))
    clock.advance(0)  # the end of the reactor turn writes the buffered record
    assert any(p.name.startswith("gone:c.diskqueue") for p in tmp_path.iterdir())
    store.delete_topic("gone")
    assert not any(p.name.startswith("gone") for p in tmp_path.iterdir())
    store.close()


def test_overflow_is_written_once_per_turn_and_a_failed_write_makes_the_store_unhealthy(tmp_path, monkeypatch):
    """Records overflowing in one reactor turn reach the file together, by one write()
    at the turn's end (a read of the file writes them first); when that write
    fails, the store reports the failure in its health and the queue's depth drops the
    lost records."""
    import os

    clock = Clock()
    store = open_store(tmp_path, clock, mem_queue_size=0)
    topic = store.get_topic("spill")
    channel = topic.get_channel("c")
    data = tmp_path / "spill:c.diskqueue.000000.dat"
    writes: list[int] = []
    real_write = os.write

    def counting(fd, chunk):
        writes.append(len(chunk))
        return real_write(fd, chunk)

    monkeypatch.setattr(os, "write", counting)
    topic.put_many([store.new_message(b"m%02d" % i) for i in range(50)])
    # the queue reads one record ahead: the second put wrote the first to read it
    assert channel.depth() == 50 and writes == [4 + 26 + 3]
    clock.advance(0)
    assert writes == [4 + 26 + 3, 49 * (4 + 26 + 3)] and data.stat().st_size == 50 * (4 + 26 + 3)
    assert store.health_error is None

    def failing(fd, chunk):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", failing)
    topic.put_many([store.new_message(b"n%d" % i) for i in range(3)])
    clock.advance(0)
    assert "No space left" in store.health_error
    assert channel.depth() == 50
    monkeypatch.setattr(os, "write", real_write)
    topic.put(store.new_message(b"after"))  # a put that works clears the health again
    assert store.health_error is None
    client = FakeClient(100)
    channel.add_client(client)
    channel.pump()
    assert [m.body for m in client.received] == [b"m%02d" % i for i in range(50)] + [b"after"]
    store.close()
