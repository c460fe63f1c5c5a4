"""Unit tests of topics placed on two PostgreSQL clusters (``broker.placement``): the
broker with a reliable store per cluster, each on its own in-memory database whose ids
start in its slot, driven by a ``task.Clock``. Counted: every id acknowledged to a
producer is pushed on the topic's channel, across a cluster's failure and a move."""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock

from dmq_server.broker import Broker
from dmq_server.broker.placement import ChannelGroup
from dmq_server.core.errors import Unavailable
from dmq_server.core.options import Options
from dmq_server.core.publish import Published, Send
from dmq_server.db.clusters import first_id
from dmq_server.db.storage_errors import Misplaced
from dmq_server.db.memory import MemoryDb
from tests.unit.test_broker import Consumer, Harness

NODE = "node-1"


def two_cluster_databases() -> tuple[Clock, MemoryDb, MemoryDb]:
    """A clock and the in-memory databases of main and cluster b, both holding the rows of
    ``local`` (on main) and ``remote`` (on b), channel ``c`` each, as the registry mirror
    makes them."""
    clock = Clock()
    clock.advance(1_700_000_000)
    main, b = MemoryDb(clock), MemoryDb(clock, cluster="b", first_id=first_id(1))
    for db in (main, b):
        db.create_topic("local", ["c"])
        db.create_topic("remote", ["c"], cluster="b")
    return clock, main, b


class TwoClusters(Harness):
    """``local`` on main, ``remote`` on b, channel ``c`` each; both databases hold both
    topics' rows, as the registry mirror makes them."""

    def __init__(self) -> None:
        self.clock, self.db, self.b = two_cluster_databases()
        roles = {"writer0": self.db, "acker": self.db, "loader": self.db, "admin": self.db}
        b_roles = {"writer0": self.b, "acker": self.b, "loader": self.b, "admin": self.b}
        self.broker = Broker(Options(), self.clock, roles, NODE, clusters={"b": b_roles}, slots={"main": 0, "b": 1})
        self.acknowledged: dict[tuple[str, int], int] = {}
        self.answers: dict[tuple[str, int], Any] = {}
        started = self.broker.start()
        self.settle()
        assert started.called
        self.broker.timers.startService()
        self.settle()

    def place(self, topic: str, cluster: str, draining: tuple[str, ...]) -> None:
        """The registry's change, mirrored into both databases, then read by the broker."""
        for db in (self.db, self.b):
            db.topics[topic].update(cluster=cluster, draining=list(draining))
        self.broker.refresh_registry()
        self.settle()


def test_each_topic_is_stored_on_its_cluster_and_acked_there():
    h = TwoClusters()
    local, remote = Consumer(), Consumer()
    assert isinstance(h.subscribe("local", "c", local).result, ChannelGroup)
    h.subscribe("remote", "c", remote)
    for i in range(20):
        h.send("local", "p", i)
        h.send("remote", "p", 100 + i)
    h.settle()
    ids = h.acknowledged
    assert {m >> 48 for (p, s), m in ids.items() if s < 100} == {0}
    assert {m >> 48 for (p, s), m in ids.items() if s >= 100} == {1}
    assert {m.topic for m in h.db.messages.values()} == {"local"}
    assert {m.topic for m in h.b.messages.values()} == {"remote"}
    h.ack_all("local", local)
    h.ack_all("remote", remote)
    h.settle()
    assert not h.db.deliveries and not h.b.deliveries  # each ack durable on its own cluster
    assert len(h.db.delivery_log) == 20 and len(h.b.delivery_log) == 20
    stats = h.broker.stats()
    assert stats["published"] == 40
    assert {c: s["published"] for c, s in stats["clusters"].items()} == {"main": 20, "b": 20}
    assert {t["topic_name"]: t["cluster"] for t in stats["topics"]} == {"local": "main", "remote": "b"}
    # an operator's look at one id goes to the cluster that drew it (admin.operations)
    assert {h.broker.cluster_of_id(m) for (p, sid), m in ids.items()} == {"main", "b"}
    assert all(h.broker.cluster_of_id(m) == ("b" if sid >= 100 else "main") for (p, sid), m in ids.items())
    assert Harness().broker.cluster_of_id(next(iter(ids.values()))) is None  # one cluster: no choice


def test_a_cluster_that_fails_fails_only_its_topics():
    h = TwoClusters()
    h.b.fail_next("insert_new_messages", "lost")
    h.send("remote", "p", 1)
    h.send("local", "p", 2)
    h.settle()
    failed = h.answers[("p", 1)]
    assert isinstance(failed, Unavailable) and "cluster 'b'" in failed.description
    assert isinstance(h.answers[("p", 2)], Published)
    assert h.broker.healthy  # the node's health is main's
    assert h.broker.stats()["clusters"]["b"]["health"] == "ERROR"
    h.send("remote", "p", 3)  # b is back: its writer's next batch goes through
    h.settle()
    assert isinstance(h.answers[("p", 3)], Published)
    assert h.broker.stats()["clusters"]["b"]["health"] == "OK"


def test_a_move_delivers_both_clusters_copies_then_leaves_the_old_one():
    """A consumer attached before the move gets the copies left on main and the new ones
    stored on b; a send that reaches main after the move is refused there (Misplaced) and
    stores nothing; once main is drained the group has b's channel only."""
    h = TwoClusters()
    consumer = Consumer(credit=5)
    group = h.subscribe("local", "c", consumer).result
    for i in range(10):
        h.send("local", "p", i)
    h.settle()
    h.place("local", "b", ("main",))
    assert sorted(group.members) == [0, 1]
    for i in range(10, 20):
        h.send("local", "p", i)
    h.settle()
    stale: list[Any] = []
    h.broker.stores["main"].store(Send(topic="local", producer="stale", session_id=1, body=b"x"), stale.append)
    h.settle()
    assert isinstance(stale[0], Misplaced) and not any(m.producer == "stale" for m in h.db.messages.values())
    done = 0
    for _ in range(10):  # credit 5: ack what arrived, let the rest come
        new, done = consumer.pushed[done:], len(consumer.pushed)  # acks push more at once
        for channel, message_id in new:
            assert h.broker.ack("local", channel, message_id, consumer) is None
        h.settle()
    pushed = [mid for _, mid in consumer.pushed]
    assert sorted(pushed) == sorted(h.acknowledged.values()) and len(pushed) == 20  # none lost, none twice
    assert {mid >> 48 for (p, s), mid in h.acknowledged.items() if s >= 10} == {1}
    assert not h.db.deliveries and not h.b.deliveries
    h.place("local", "b", ())
    assert sorted(group.members) == [1] and ("local", "c") not in h.broker.stores["main"].channels
    h.send("local", "p", 99)
    h.settle()
    assert consumer.pushed[-1][1] == h.acknowledged[("p", 99)]


def test_stored_gauges_of_two_clusters_add_up():
    """/metrics' figures read from each cluster: a moving channel's oldest copy is the
    older of the two, delayed messages and dead letters are added."""
    from dmq_server.http.sampling import merge_gauges

    main = {"oldest_unacked_ms": {("t", "c"): 2000, ("u", "c"): None}, "delay_pending": {"t": (2, 500)},
            "dead_letters": {"expired": (3, 1)}}
    b = {"oldest_unacked_ms": {("t", "c"): 1000, ("v", "c"): 7}, "delay_pending": {"t": (1, 400), "v": (4, None)},
         "dead_letters": {"expired": (1, 0), "rate_limited": (2, 2)}}
    assert merge_gauges(main, b) == {
        "oldest_unacked_ms": {("t", "c"): 1000, ("u", "c"): None, ("v", "c"): 7},
        "delay_pending": {"t": (3, 400), "v": (4, None)},
        "dead_letters": {"expired": (4, 1), "rate_limited": (2, 2)},
    }


def test_a_read_of_acks_during_a_move_is_answered_id_by_id_on_each_copys_cluster():
    """While a move leaves copies on both clusters, an NSQ read's FINs (``ack_each``) and a
    consumer's ``UP_CONSUMER_ACKS`` (``ack_many``) mixing main's and b's copies are each
    acked on the cluster that drew the id, answered as ``ack`` answers it alone (an id
    never pushed, one already acked, one repeated in the read refused), and made durable
    on both: nothing is pushed again."""
    h = TwoClusters()
    consumer = Consumer(credit=100)
    h.subscribe("local", "c", consumer)
    for i in range(6):
        h.send("local", "p", i)
    h.settle()
    h.place("local", "b", ("main",))
    for i in range(6, 12):
        h.send("local", "p", i)
    h.settle()
    pushed = [mid for _, mid in consumer.pushed]
    assert sorted(pushed) == sorted(h.acknowledged.values())
    mains = [m for m in pushed if m >> 48 == 0]
    bs = [m for m in pushed if m >> 48 == 1]
    assert len(mains) == 6 and len(bs) == 6
    unknown = (1 << 48) + 999_999
    fins = [mains[0], bs[0], mains[0], unknown, bs[1], mains[1]]
    assert h.broker.ack_each("local", "c", fins, consumer) == [
        None, None, "ID not in flight", "ID not in flight", None, None]
    assert h.broker.ack_each("local", "c", [bs[0]], consumer) == ["ID not in flight"]  # acked before
    rest = mains[2:] + bs[2:]
    assert h.broker.ack_many("local", "c", [*rest, mains[1], unknown], consumer) == 2
    h.settle(5)
    assert not h.db.deliveries and not h.b.deliveries  # every ack durable on its own cluster
    assert len(h.db.delivery_log) == 6 and len(h.b.delivery_log) == 6
    h.clock.advance(120)  # past the message timeout: an ack that was lost would push again
    h.settle()
    assert sorted(mid for _, mid in consumer.pushed) == sorted(pushed)


def test_each_clusters_store_runs_its_own_timers_and_stopping_one_stops_only_its_own():
    """A store's sweep, channel state, heartbeat and depth count are its own service under
    the broker's timers: a store that goes (its cluster detached) takes its jobs with it,
    the other cluster's store and the broker's scan go on."""
    h = TwoClusters()
    assert [t.name for t in h.broker.timers] == ["scan", "registry-refresh", "store-main", "store-b"]
    stores = h.broker.cluster_stores()
    stopped = stores["b"].stop()
    h.settle()
    assert stopped.called and not stores["b"].timers.running and stores["main"].timers.running

    def counts() -> tuple[int, int, int, int]:
        main, b = h.db.names_run(), h.b.names_run()
        return (main.count("owner_heartbeat"), b.count("owner_heartbeat"),
                main.count("depth_slice_end"), b.count("depth_slice_end"))

    before = counts()
    scans = []
    stores["main"].scan = lambda now: scans.append(now)  # the broker's one scan still reaches main
    h.settle(2 * Options().owner_silence / 6 + 2 * Options().channel_state_interval)
    after = counts()
    assert after[0] > before[0] and after[2] > before[2]  # main's heartbeat and depth count go on
    assert after[1] == before[1] and after[3] == before[3]  # b's stopped with its store
    assert scans
