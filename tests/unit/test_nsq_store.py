"""The fast store's nsqd semantics, driven by task.Clock with in-memory backend queues."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.application.internet import TimerService
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher

from dmq_server.fast import metadata
from dmq_server.fast.fast_store import FastStore


class MemoryBackend:
    """A BackendQueue test double: a FIFO of records that outlives the store using it."""

    def __init__(self):
        self.items: deque[bytes] = deque()
        self.closed = False
        self.destroyed = False

    def put(self, data):
        self.items.append(bytes(data))

    def put_many(self, records):
        self.items.extend(bytes(data) for data in records)

    def read(self):
        return self.items.popleft() if self.items else None

    def read_many(self, limit):
        return [self.items.popleft() for _ in range(min(limit, len(self.items)))]

    def depth(self):
        return len(self.items)

    def empty(self):
        self.items.clear()

    def tick(self):
        pass

    def close(self):
        self.closed = True

    def destroy(self):
        self.items.clear()
        self.destroyed = True


class FakeClient:
    def __init__(self, ready=0, msg_timeout=60.0):
        self.ready_count = ready
        self.in_flight_count = 0
        self.message_count = self.finish_count = self.requeue_count = 0
        self.sample_rate = 0
        self.msg_timeout = msg_timeout
        self.received = []
        self.closed = False

    def send_messages(self, channel, msgs):
        self.received.extend(msgs)

    def channel_closed(self, channel):
        self.closed = True

    def stats(self):
        return {"client_id": "fake"}


def make_store(clock=None, backends=None, data_dir=None, **kw):
    clock = clock or Clock()
    backends = {} if backends is None else backends
    store = FastStore(
        clock,
        data_dir,
        node_id=1,
        backend_factory=lambda name: backends.setdefault(name, MemoryBackend()),
        **kw,
    )
    store.start()
    store.timers.startService()  # the disk sync, as the service tree runs it
    scanner = TimerService(0.1, store.scan)  # the broker's scanner, as it calls the fast store
    scanner.clock = clock
    scanner.startService()
    return store, clock, backends


def publish(store, topic, *bodies, deferred=0.0):
    t = store.get_topic(topic)
    t.put_many([store.new_message(b, deferred) for b in bodies])
    return t


def test_topic_copies_to_every_channel_and_channel_to_one_client():
    """Each channel gets every message; within a channel each goes to exactly one client."""
    store, clock, _ = make_store()
    topic = store.get_topic("t")
    a, b = topic.get_channel("a"), topic.get_channel("b")
    a1, a2, b1 = FakeClient(100), FakeClient(100), FakeClient(100)
    a.add_client(a1), a.add_client(a2), b.add_client(b1)
    publish(store, "t", *[b"%d" % i for i in range(10)])
    got_a = sorted(m.body for m in a1.received + a2.received)
    assert got_a == sorted(b"%d" % i for i in range(10))
    assert a1.received and a2.received  # both compete
    assert [m.body for m in b1.received] == [b"%d" % i for i in range(10)]
    assert {m.id for m in b1.received} == {m.id for m in a1.received + a2.received}
    assert all(m.attempts == 1 for m in b1.received)


def test_messages_wait_for_the_first_channel():
    """Published before any channel exists, messages all go to the first channel created."""
    store, clock, _ = make_store()
    publish(store, "t", b"early1", b"early2")
    assert store.topics["t"].depth() == 2
    ch = store.topics["t"].get_channel("c")
    assert store.topics["t"].depth() == 0 and ch.depth() == 2
    late = store.topics["t"].get_channel("late")
    assert late.depth() == 0


def test_memory_overflow_goes_to_the_backend_and_comes_back():
    """Past --mem-queue-size, messages go to the disk queue; all are delivered."""
    store, clock, backends = make_store(mem_queue_size=2)
    ch = store.get_topic("t").get_channel("c")
    publish(store, "t", *[b"m%d" % i for i in range(5)])
    assert len(ch.memory) == 2 and backends["t:c"].depth() == 3 and ch.depth() == 5
    client = FakeClient(10)
    ch.add_client(client)
    ch.pump()
    assert sorted(m.body for m in client.received) == [b"m%d" % i for i in range(5)]


@pytest.mark.parametrize("in_memory", [0, 2])
def test_a_record_on_disk_that_does_not_decode_is_logged_and_skipped(in_memory):
    """A torn or foreign record in a channel's disk queue is logged and passed over; the
    records after it are delivered, in order, whether the memory queue is empty (a RDY
    window taken from disk in one loop) or memory and disk take turns."""
    store, clock, backends = make_store(mem_queue_size=in_memory)
    ch = store.get_topic("t").get_channel("c")
    publish(store, "t", *[b"m%d" % i for i in range(in_memory)], b"d0", b"d1", b"d2")
    backend = backends["t:c"]
    assert len(backend.items) == 3 and len(ch.memory) == in_memory
    backend.items.insert(1, b"short")  # below the 26-byte header
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        client = FakeClient(10)
        ch.add_client(client)
        ch.pump()
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert sorted(m.body for m in client.received if m.body.startswith(b"m")) == [b"m%d" % i for i in range(in_memory)]
    assert [m.body for m in client.received if m.body.startswith(b"d")] == [b"d0", b"d1", b"d2"]
    assert [str(e["why"]) for e in events if "failed to decode" in e.get("log_format", "")] == [
        "invalid message buffer size (5)"]
    assert ch.depth() == 0 and not backend.items


def test_topic_overflow_before_a_channel_exists():
    """A topic without channels spills to its own disk queue; the first channel gets all."""
    store, clock, backends = make_store(mem_queue_size=3)
    publish(store, "t", *[b"x%d" % i for i in range(10)])
    assert backends["t"].depth() == 7
    ch = store.topics["t"].get_channel("c")
    assert ch.depth() == 10 and store.topics["t"].depth() == 0


class CountingBackend(MemoryBackend):
    """Counts the calls the store makes, to see a batch taken in one."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def put(self, data):
        self.calls.append(("put", 1))
        super().put(data)

    def put_many(self, records):
        self.calls.append(("put_many", len(records)))
        super().put_many(records)

    def read(self):
        self.calls.append(("read", 1))
        return super().read()

    def read_many(self, limit):
        self.calls.append(("read_many", limit))
        return super().read_many(limit)


def test_a_backlog_moves_to_a_new_channel_in_batches_and_keeps_its_order():
    """A topic's backlog (memory, then disk) moves to its first channel a batch at a
    time: one read of the topic's disk queue and one write to the channel's per batch;
    the consumer then gets every message once, in publish order, the channel's disk
    read ahead a few records at a time (counted in its backend depth meanwhile)."""
    backends: dict = {}
    store, clock, _ = make_store(backends=backends, mem_queue_size=100)
    for name in ("t", "t:c"):
        backends[name] = CountingBackend()
    bodies = [b"m%04d" % i for i in range(1000)]
    for body in bodies:  # PUBs: 100 in the topic's memory, 900 on its disk
        publish(store, "t", body)
    topic = store.topics["t"]
    assert len(topic.memory) == 100 and backends["t"].depth() == 900
    backends["t"].calls.clear()
    ch = topic.get_channel("c")  # drains DRAIN_BATCH (2000) at once: all of it
    assert backends["t"].calls == [("read_many", 1900)] + [("read_many", 1000)]
    assert backends["t:c"].calls == [("put_many", 900)]
    assert ch.depth() == 1000 and len(ch.memory) == 100
    client = FakeClient(1)
    ch.add_client(client)
    ch.pump()
    assert ch.stats()["backend_depth"] == 900 and ch.depth() == 999
    got = [client.received[-1]]
    for _ in range(999):
        ch.finish(client, got[-1].id)
        got.append(client.received[-1])
    assert sorted(m.body for m in got) == bodies and len({m.id for m in got}) == 1000
    # memory and disk take turns, each in order
    from_disk = [m.body for m in got if m.body >= b"m0100"]
    assert from_disk == bodies[100:]
    reads = [n for call, n in backends["t:c"].calls if call == "read_many"]
    assert reads and set(reads) == {64} and len(reads) <= 900 // 64 + 2


def test_read_ahead_never_holds_more_than_the_memory_window():
    """With --mem-queue-size 1 (fast topics kept on disk) the channel reads its disk
    one record at a time, so no more than before waits in memory."""
    backends: dict = {}
    store, clock, _ = make_store(backends=backends, mem_queue_size=1)
    ch = store.get_topic("t").get_channel("c")
    backends["t:c"] = ch.backend = CountingBackend()
    publish(store, "t", *[b"d%d" % i for i in range(6)])
    client = FakeClient(2)
    ch.add_client(client)
    ch.pump()
    assert {n for call, n in ch.backend.calls if call == "read_many"} == {1}
    assert len(client.received) == 2 and ch.depth() == 4


def test_an_mpub_goes_to_each_channel_in_one_batch():
    """An MPUB with nothing waiting before it reaches each channel in one call: what
    overflows a channel's memory is one disk write; each channel holds its own copies."""
    backends: dict = {}
    store, clock, _ = make_store(backends=backends, mem_queue_size=3)
    topic = store.get_topic("t")
    a, b = topic.get_channel("a"), topic.get_channel("b")
    backends["t:a"] = a.backend = CountingBackend()
    publish(store, "t", *[b"x%d" % i for i in range(10)])
    assert a.backend.calls == [("put_many", 7)]
    assert len(a.memory) == 3 and a.depth() == 10 and b.depth() == 10
    assert {id(m) for m in a.memory}.isdisjoint(id(m) for m in b.memory)
    assert topic.message_count == 10 and topic.message_bytes == 20
    client = FakeClient(100)
    a.add_client(client)
    a.pump()
    assert sorted(m.body for m in client.received) == sorted(b"x%d" % i for i in range(10))


def test_rdy_is_a_window_on_messages_in_flight():
    """RDY n allows n in flight; FIN frees a slot; RDY 0 stops delivery."""
    store, clock, _ = make_store()
    ch = store.get_topic("t").get_channel("c")
    client = FakeClient(2)
    ch.add_client(client)
    publish(store, "t", b"1", b"2", b"3", b"4")
    assert len(client.received) == 2 and client.in_flight_count == 2
    assert ch.finish(client, client.received[0].id) is None
    assert len(client.received) == 3
    client.ready_count = 0
    ch.finish(client, client.received[1].id)
    assert len(client.received) == 3


def test_in_flight_times_out_and_is_redelivered_with_more_attempts():
    """An unFINished message comes back after msg_timeout via the queue scanner."""
    store, clock, _ = make_store()
    ch = store.get_topic("t").get_channel("c")
    client = FakeClient(1, msg_timeout=5.0)
    ch.add_client(client)
    publish(store, "t", b"x")
    first = client.received[0]
    clock.advance(4.9)
    assert len(client.received) == 1
    clock.advance(0.2)
    # the scanner requeued it; the window had room again, so it was redelivered
    assert len(client.received) == 2 and client.received[1].attempts == 2
    assert client.received[1].id == first.id
    assert ch.timeout_count == 1


def test_fin_errors_name_the_reason():
    """FIN of an unknown id or another client's message fails with nsqd's texts."""
    store, clock, _ = make_store()
    ch = store.get_topic("t").get_channel("c")
    owner, other = FakeClient(1), FakeClient(0)
    ch.add_client(owner), ch.add_client(other)
    publish(store, "t", b"x")
    mid = owner.received[0].id
    assert ch.finish(other, mid) == "client does not own message"
    assert ch.finish(owner, b"0" * 16) == "ID not in flight"
    assert ch.finish(owner, mid) is None
    assert ch.finish(owner, mid) == "ID not in flight"


def test_req_now_and_req_with_delay():
    """REQ 0 puts the message back at once; REQ with a timeout defers it."""
    store, clock, _ = make_store()
    ch = store.get_topic("t").get_channel("c")
    client = FakeClient(1)
    ch.add_client(client)
    publish(store, "t", b"x")
    assert ch.requeue(client, client.received[0].id, 0) is None
    assert len(client.received) == 2 and client.received[1].attempts == 2
    assert ch.requeue(client, client.received[1].id, 3.0) is None
    assert len(client.received) == 2 and len(ch.deferred) == 1
    clock.advance(2.9)
    assert len(client.received) == 2
    clock.advance(0.2)
    assert len(client.received) == 3 and client.received[2].attempts == 3
    assert ch.requeue_count == 2


def test_touch_extends_the_deadline_up_to_max_msg_timeout():
    """TOUCH resets the deadline to now + timeout, never past delivery + max-msg-timeout."""
    store, clock, _ = make_store(max_msg_timeout=8.0)
    ch = store.get_topic("t").get_channel("c")
    client = FakeClient(1, msg_timeout=5.0)
    ch.add_client(client)
    publish(store, "t", b"x")
    mid = client.received[0].id
    clock.advance(4.0)
    assert ch.touch(client, mid, 5.0) is None
    clock.advance(3.9)  # without the cap the deadline would be 9.0; capped at 0 + 8
    assert len(client.received) == 1
    clock.advance(0.2)
    assert len(client.received) == 2
    assert ch.touch(FakeClient(), b"f" * 16, 5.0) == "ID not in flight"


def test_dpub_is_deferred_per_channel():
    """A deferred publish reaches each channel's deferred queue and is delivered when due."""
    store, clock, _ = make_store()
    ch = store.get_topic("t").get_channel("c")
    client = FakeClient(5)
    ch.add_client(client)
    publish(store, "t", b"later", deferred=2.0)
    assert client.received == [] and ch.stats()["deferred_count"] == 1
    clock.advance(2.1)
    assert [m.body for m in client.received] == [b"later"]


def test_deferred_publish_waits_in_topic_memory_without_channels():
    """DPUB before any channel keeps its deferral (never written to disk)."""
    store, clock, backends = make_store(mem_queue_size=0)
    publish(store, "t", b"d", deferred=1.0)
    assert backends["t"].depth() == 0
    ch = store.topics["t"].get_channel("c")
    assert len(ch.deferred) == 1


def test_pause_channel_and_topic():
    """A paused channel delivers nothing; a paused topic holds messages until unpaused."""
    store, clock, _ = make_store()
    topic = store.get_topic("t")
    ch = topic.get_channel("c")
    client = FakeClient(10)
    ch.add_client(client)
    ch.pause()
    publish(store, "t", b"1")
    assert client.received == []
    ch.unpause()
    assert len(client.received) == 1
    topic.pause()
    publish(store, "t", b"2")
    assert topic.depth() == 1 and len(client.received) == 1
    topic.unpause()
    assert len(client.received) == 2


def test_empty_channel_and_topic():
    """Empty drops waiting, in-flight and deferred messages and resets clients' in-flight."""
    store, clock, _ = make_store()
    topic = store.get_topic("t")
    ch = topic.get_channel("c")
    client = FakeClient(1)
    ch.add_client(client)
    publish(store, "t", b"1", b"2", b"3")
    ch.empty()
    assert ch.depth() == 0 and not ch.in_flight and client.in_flight_count == 0
    topic.pause()
    publish(store, "t", b"4")
    topic.empty()
    assert topic.depth() == 0


def test_delete_channel_closes_its_clients():
    """Deleting a channel closes its clients and destroys its disk queue."""
    store, clock, backends = make_store()
    topic = store.get_topic("t")
    ch = topic.get_channel("c")
    client = FakeClient(1)
    ch.add_client(client)
    assert topic.delete_channel("c")
    assert client.closed and backends["t:c"].destroyed
    assert not topic.delete_channel("c")


def test_delete_topic_deletes_channels_and_files():
    """Deleting a topic deletes every channel and the topic's disk queue."""
    store, clock, backends = make_store()
    topic = store.get_topic("t")
    client = FakeClient(1)
    topic.get_channel("c").add_client(client)
    assert store.delete_topic("t")
    assert "t" not in store.topics and client.closed
    assert backends["t"].destroyed and backends["t:c"].destroyed


def test_ephemeral_channel_and_topic_vanish_and_drop_overflow():
    """#ephemeral: overflow is dropped; the channel goes with its last client, the topic
    with its last channel."""
    store, clock, backends = make_store(mem_queue_size=2)
    topic = store.get_topic("t#ephemeral")
    ch = topic.get_channel("c#ephemeral")
    publish(store, "t#ephemeral", b"1", b"2", b"3", b"4")
    assert ch.depth() == 2 and not backends
    client = FakeClient(1)
    ch.add_client(client)
    ch.remove_client(client)
    assert "t#ephemeral" not in store.topics


def test_disconnected_client_in_flight_waits_for_timeout():
    """As in nsqd, a client that goes away leaves its in-flight messages until they time out."""
    store, clock, _ = make_store()
    ch = store.get_topic("t").get_channel("c")
    gone, stays = FakeClient(1, msg_timeout=3.0), FakeClient(0)
    ch.add_client(gone), ch.add_client(stays)
    publish(store, "t", b"x")
    ch.remove_client(gone)
    stays.ready_count = 1
    ch.pump()
    assert stays.received == []
    clock.advance(3.1)
    assert [m.attempts for m in stays.received] == [2]
    assert gone.in_flight_count == 1  # not touched once detached


def test_max_channel_consumers():
    """A full channel refuses another client with nsqd's text."""
    store, clock, _ = make_store(max_channel_consumers=1)
    ch = store.get_topic("t").get_channel("c")
    assert ch.add_client(FakeClient()) is None
    assert ch.add_client(FakeClient()) == "consumers for t:c exceeds limit of 1"


def test_scanner_visits_only_channels_with_pending_work():
    """The one queue scanner walks only channels with in-flight or deferred messages."""
    store, clock, _ = make_store()
    idle = store.get_topic("idle").get_channel("c")
    busy = store.get_topic("busy").get_channel("c")
    client = FakeClient(1)
    busy.add_client(client)
    publish(store, "busy", b"x")
    assert store._armed == {busy}
    busy.finish(client, client.received[0].id)
    clock.advance(0.1)
    assert store._armed == set()
    assert idle not in store._armed


def test_metadata_survives_a_restart(tmp_path):
    """nsqd.dat records topics, channels and pause flags (not ephemeral ones)."""
    backends = {}
    store, clock, _ = make_store(backends=backends, data_dir=tmp_path)
    t = store.get_topic("t")
    t.get_channel("c").pause()
    t.get_channel("d")
    t.pause()
    store.get_topic("e#ephemeral").get_channel("x")
    store.close()
    assert [x.name for x in metadata.load(tmp_path)] == ["t"]
    again, _, _ = make_store(backends=backends, data_dir=tmp_path)
    t2 = again.topics["t"]
    assert t2.paused and sorted(t2.channels) == ["c", "d"]
    assert t2.channels["c"].paused and not t2.channels["d"].paused
    assert "e#ephemeral" not in again.topics


def test_metadata_file_is_nsqd_json(tmp_path):
    """The file has nsqd's keys and version and no temporary files remain."""
    store, clock, _ = make_store(data_dir=tmp_path)
    store.get_topic("t").get_channel("c")
    text = (tmp_path / "nsqd.dat").read_text()
    assert text == '{"topics":[{"channels":[{"name":"c","paused":false}],"name":"t","paused":false}],"version":"1.3.0"}'
    assert [p.name for p in tmp_path.iterdir()] == ["nsqd.dat"]


def test_clean_shutdown_flushes_memory_in_flight_and_deferred():
    """On close, memory, in-flight and deferred messages go to disk, attempts kept."""
    backends = {}
    store, clock, _ = make_store(backends=backends)
    ch = store.get_topic("t").get_channel("c")
    client = FakeClient(1)
    ch.add_client(client)
    publish(store, "t", b"inflight", b"waiting")
    publish(store, "t", b"deferred", deferred=100.0)
    store.get_topic("t2")
    publish(store, "t2", b"topic-memory")
    store.close()
    assert client.closed
    assert backends["t:c"].depth() == 3 and backends["t2"].depth() == 1
    again, _, _ = make_store(backends=backends)
    ch2 = again.get_topic("t").get_channel("c")
    c2 = FakeClient(10)
    ch2.add_client(c2)
    ch2.pump()
    got = {m.body: m.attempts for m in c2.received}
    assert got == {b"inflight": 2, b"waiting": 1, b"deferred": 1}


def test_clean_shutdown_writes_back_what_was_read_ahead_from_disk():
    """Records a channel read ahead from its disk queue and had not delivered go back to
    disk on close: after a restart every message not finished is delivered, none twice."""
    backends: dict = {}
    store, clock, _ = make_store(backends=backends, mem_queue_size=10)
    ch = store.get_topic("t").get_channel("c")
    publish(store, "t", *[b"r%02d" % i for i in range(40)])  # 10 in memory, 30 on disk
    client = FakeClient(1)
    ch.add_client(client)
    ch.pump()
    finished = set()
    for _ in range(9):  # memory and disk in turn: the disk's reads take 10 ahead
        finished.add(client.received[-1].body)
        ch.finish(client, client.received[-1].id)
    assert ch._ahead and ch.stats()["backend_depth"] == len(ch._ahead) + backends["t:c"].depth()
    assert ch.depth() == 40 - 9 - 1  # the one in flight aside, all still wait
    in_flight = client.received[-1].body
    store.close()
    again, _, _ = make_store(backends=backends, mem_queue_size=10)
    ch2 = again.get_topic("t").get_channel("c")
    assert ch2.depth() == 40 - len(finished)
    c2 = FakeClient(100)
    ch2.add_client(c2)
    ch2.pump()
    rest = [m.body for m in c2.received]
    assert len(rest) == len(set(rest)) and set(rest) | finished == {b"r%02d" % i for i in range(40)}
    assert in_flight in rest and not finished & set(rest)


def test_sample_rate_drops_messages():
    """sample_rate keeps about (rate+1)% of messages; the others are consumed, not requeued."""
    store, clock, _ = make_store()
    ch = store.get_topic("t").get_channel("c")
    client = FakeClient(100000)
    client.sample_rate = 10
    ch.add_client(client)
    publish(store, "t", *[b"x"] * 2000)
    assert 100 < len(client.received) < 400
    assert ch.depth() == 0


@pytest.mark.parametrize("n", [1, 3])
def test_message_ids_and_timestamps_shared_by_channel_copies(n):
    """Copies share id, body and timestamp; each channel counts its own attempts."""
    store, clock, _ = make_store()
    topic = store.get_topic("t")
    clients = []
    for i in range(n):
        c = FakeClient(1)
        topic.get_channel(f"c{i}").add_client(c)
        clients.append(c)
    publish(store, "t", b"body")
    msgs = [c.received[0] for c in clients]
    assert len({(m.id, m.body, m.timestamp) for m in msgs}) == 1
    assert len({id(m) for m in msgs}) == n


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pub", "rdy", "fin"]), st.integers(1, 12)), max_size=25))
def test_a_lone_consumer_is_filled_as_the_round_robin_would_fill_it(steps):
    """One consumer without sampling takes its whole RDY room in one call
    (``FastChannel._fill``); a twin channel whose consumer has ``sample_rate`` 100 (never
    sampled out) goes the round robin, message by message. Through publishes (past the
    memory window, so memory and disk take turns), RDY changes and FINs, both consumers
    get the same messages in the same order, with the same attempts and in flight."""
    store, clock, _ = make_store(mem_queue_size=5)
    topic = store.get_topic("t")
    batched, stepped = topic.get_channel("batched"), topic.get_channel("stepped")
    one, two = FakeClient(0), FakeClient(0)
    two.sample_rate = 100
    batched.add_client(one), stepped.add_client(two)
    sent = 0
    for op, n in steps:
        if op == "pub":
            publish(store, "t", *[b"m%d" % (sent + i) for i in range(n)])
            sent += n
        elif op == "rdy":
            for client, channel in ((one, batched), (two, stepped)):
                client.ready_count = n
                channel.pump()
        else:
            for client, channel in ((one, batched), (two, stepped)):
                ids = [m.id for m in client.received[-n:] if m.id in channel.in_flight]
                failed = channel.finish_many(client, ids)
                assert failed == []
                channel.pump()
        assert [(m.body, m.attempts) for m in one.received] == [(m.body, m.attempts) for m in two.received]
        assert one.in_flight_count == two.in_flight_count == len(batched.in_flight) == len(stepped.in_flight)
        assert batched.depth() == stepped.depth()


def test_a_channel_window_counts_bytes_in_and_out_and_overflows_past_its_share():
    """A fast channel's memory queue is counted in the server's client memory as it
    fills and as its messages go out (a client's RDY taking several at once counts them
    out together), and a publish whose bytes would pass the channel's share of the
    budget sends the rest to the disk queue."""
    from dmq_server.core.client_memory import FAST_WINDOW, ClientMemory

    memory = ClientMemory(16 * 1024)  # a channel's window: 1024 bytes
    store, clock, backends = make_store(client_memory=memory)
    ch = store.get_topic("t").get_channel("c")
    publish(store, "t", *[bytes([65 + i]) * 300 for i in range(3)])  # 900 bytes: all fit
    assert len(ch.memory) == 3 and ch.window.held == 900 and memory.held[FAST_WINDOW] == 900
    client = FakeClient(2)
    ch.add_client(client)
    ch.pump()
    assert [m.body[:1] for m in client.received] == [b"A", b"B"]
    assert ch.window.held == 300 and memory.held[FAST_WINDOW] == 300
    publish(store, "t", *[bytes([68 + i]) * 300 for i in range(3)])  # 300 + 900 bytes: 2 fit
    assert len(ch.memory) == 3 and backends["t:c"].depth() == 1 and ch.window.held == 900
    client.ready_count = 10
    ch.pump()  # memory and the disk queue take turns
    assert sorted(m.body[:1] for m in client.received) == [b"A", b"B", b"C", b"D", b"E", b"F"]
    assert ch.window.held == 0 and memory.held[FAST_WINDOW] == 0 and memory.total == 0


def test_deferred_messages_count_in_client_memory_and_a_dpub_past_its_room_is_refused():
    """Deferred messages have no disk to wait on, so they count in the server's client
    memory (once per channel: each holds a copy) from DPUB until due, and a DPUB whose
    bodies do not fit what all windows may hold is refused with ``E_MEMORY``, not held
    past the budget; nothing of it is taken, a PUB still is, and once the deferred are
    due and delivered their bytes are back."""
    from dmq_server.core.client_memory import FAST_WINDOW, ClientMemory
    from dmq_server.core.errors import OverBudget
    from dmq_server.core.publish import Published

    memory = ClientMemory(16 * 1024)  # all windows together: 8,192 bytes
    store, clock, _ = make_store(client_memory=memory)
    topic = store.get_topic("t")
    a, b = topic.get_channel("a"), topic.get_channel("b")
    for i in range(4):
        assert isinstance(store.publish("t", [bytes([65 + i]) * 1000], deferred=60.0), Published)
    assert len(a.deferred) == len(b.deferred) == 4
    assert a.deferred_bytes.held == b.deferred_bytes.held == 4000 and memory.held[FAST_WINDOW] == 8000
    refused = store.publish("t", [b"E" * 1000], deferred=60.0)  # two copies: 2,000 > 192 left
    assert isinstance(refused, OverBudget) and not refused.fatal
    assert refused.status.startswith("E_MEMORY deferred messages fill the server's memory budget")
    assert len(a.deferred) == 4 and topic.message_count == 4
    assert isinstance(store.publish("t", [b"now"]), Published)  # a PUB's body may go to disk
    client = FakeClient(10)
    a.add_client(client)
    clock.advance(61)
    assert sorted(m.body[:1] for m in client.received) == [b"A", b"B", b"C", b"D", b"n"]
    assert a.deferred_bytes.held == 0 and len(b.deferred) == 0 and b.deferred_bytes.held == 0
    for msg in client.received:
        a.finish(client, msg.id)
    b.empty()
    assert memory.held[FAST_WINDOW] == 0 and memory.total == 0
    assert isinstance(store.publish("t", [b"F" * 1000], deferred=60.0), Published)  # room again
