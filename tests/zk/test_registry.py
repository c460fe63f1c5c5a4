"""The registry package against a real ZooKeeper (and PostgreSQL for the mirror):
ZkRegistry operations, the watcher, membership and takeover-lock recipes."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from registry import paths
from registry.membership import NodeMembership
from registry.model import NodeInfo, RegistryError, TopicSpec
from registry.takeover_lock import TakeoverLock
from registry.watcher import RegistryWatcher
from registry.zk import ZkRegistry, connect
from tests.integration.support import wait_for

from . import zkserver
from .helpers import zk_client



def info(node_id: str = "n1", **changes) -> NodeInfo:
    base = NodeInfo(node_id, "127.0.0.1", 4150, 4151, "0.1.0", time.time(), time.time(), "host", "inst-1")
    return NodeInfo(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **changes})


def test_topics_and_channels_round_trip(zk):
    """Topics keep their settings, channels are children, list is sorted; refusals are
    the PostgreSQL registry's messages."""
    registry = ZkRegistry(zk)
    assert registry.topics() == []  # nothing registered yet: no /dmq/topic
    registry.create_topic("orders", msg_timeout_ms=5000, rate_limit=10, ttl_ms=60000, max_attempts=3)
    registry.create_topic("audit", store="fast")
    registry.add_channel("orders", "billing")
    registry.add_channel("orders", "analytics")
    assert registry.topics() == [
        TopicSpec("audit", "fast", 60000, None, None, None, ()),
        TopicSpec("orders", "reliable", 5000, 10, 60000, 3, ("analytics", "billing")),
    ]
    for call, message in (
        (lambda: registry.create_topic("orders"), "topic 'orders' already exists"),
        (lambda: registry.add_channel("orders", "billing"), "channel 'billing' already exists"),
        (lambda: registry.add_channel("nope", "x"), "no such topic 'nope'"),
        (lambda: registry.remove_channel("orders", "nope"), "no channel 'nope' on topic 'orders'"),
        (lambda: registry.delete_topic("nope"), "no such topic 'nope'"),
        (lambda: registry.create_topic("a b"), "invalid topic name"),
        (lambda: registry.create_topic(".."), "cannot be stored in ZooKeeper"),
        (lambda: registry.create_topic("x", store="disk"), "invalid store"),
    ):
        with pytest.raises(RegistryError, match=message):
            call()
    registry.remove_channel("orders", "analytics")
    registry.delete_topic("audit")
    assert [(t.name, t.channels) for t in registry.topics()] == [("orders", ("billing",))]
    registry.delete_topic("orders")  # with its channel
    assert registry.topics() == []


def test_a_topics_version_grows_with_each_change_of_its_znode(zk):
    """``TopicSpec.version`` (schema 19): the registry's epoch (when /dmq/topic was created),
    then ZooKeeper's last change of the topic's znode; a channel added changes the children,
    not the settings; a topic deleted and created again is newer than before."""
    registry = ZkRegistry(zk)
    registry.add_cluster("b")
    registry.create_topic("orders", ordered=True)
    created = registry.get_topic("orders").version
    epoch = zk.exists(paths.TOPICS).ctime
    assert created[0] == epoch and epoch > 1_700_000_000_000 and created[1] > 0
    registry.add_channel("orders", "billing")
    assert registry.get_topic("orders").version == created
    registry.place_topic("orders", "b", ["main"])
    placed = registry.get_topic("orders").version
    assert placed > created
    registry.update_topic(dataclasses.replace(registry.get_topic("orders"), msg_timeout_ms=9000))
    updated = registry.get_topic("orders").version
    assert updated > placed and [t.version for t in registry.topics()] == [updated]
    registry.delete_topic("orders")
    registry.create_topic("orders")
    assert registry.get_topic("orders").version > updated


def test_a_settings_update_keeps_a_move_made_since_its_read(zk):
    """``dmq topic update`` reads the topic, then writes its settings: a ``dmq topic move``
    in between is kept (a compare-and-set on the znode), not written back over."""
    registry = ZkRegistry(zk)
    registry.add_cluster("b")
    registry.create_topic("orders", msg_timeout_ms=5000)
    read = registry.get_topic("orders")
    registry.place_topic("orders", "b", ["main"])
    registry.update_topic(dataclasses.replace(read, msg_timeout_ms=9000, ordered=True))
    now = registry.get_topic("orders")
    assert (now.cluster, now.draining, now.msg_timeout_ms, now.ordered) == ("b", ("main",), 9000, True)


def test_seed_only_creates_a_missing_registry(zk):
    """The first node seeds ZooKeeper from its PostgreSQL registry; once /dmq/topic
    exists (even empty: all topics deleted) nothing is seeded again."""
    registry = ZkRegistry(zk)
    specs = [TopicSpec("orders", channels=("billing",)), TopicSpec("audit", "fast")]
    assert registry.seed(specs) is True
    assert [(t.name, t.channels) for t in registry.topics()] == [("audit", ()), ("orders", ("billing",))]
    registry.delete_topic("orders")
    registry.delete_topic("audit")
    assert registry.seed(specs) is False
    assert registry.topics() == []


def test_watcher_reports_topic_and_node_changes(zk):
    """A read arms watches: a new channel, changed topic settings, a node joining and a
    node's data changing each call on_change once with the right kind."""
    events: list[str] = []
    changed = threading.Condition()

    def on_change(kind: str) -> None:
        with changed:
            events.append(kind)
            changed.notify_all()

    def wait_event(kind: str) -> None:
        with changed:
            assert changed.wait_for(lambda: kind in events, timeout=10), events
            events.clear()

    registry = ZkRegistry(zk)
    registry.create_topic("orders")
    watcher = RegistryWatcher(zk, on_change)
    assert [t.name for t in watcher.read_topics()] == ["orders"]
    assert watcher.read_topics()[0].version == registry.get_topic("orders").version  # the same epoch and change
    registry.add_channel("orders", "billing")
    wait_event("topics")
    assert watcher.read_topics()[0].channels == ("billing",)
    registry.update_topic(TopicSpec("orders", msg_timeout_ms=1000))
    wait_event("topics")
    assert watcher.read_nodes() == []
    zk.create(paths.node("n1"), info().encode(), ephemeral=True)
    wait_event("nodes")
    assert [n.node_id for n in watcher.read_nodes()] == ["n1"]
    zk.set(paths.node("n1"), info(last_heartbeat=1.0).encode())
    wait_event("nodes")


def test_membership_registers_heartbeats_and_returns_after_expiry(zk_address):
    """register() creates the ephemeral znode; heartbeat() rewrites last_heartbeat; after
    the session expires heartbeat() reports the znode gone, and register() under the
    new session brings it back; leave() deletes it."""
    with zk_client(zk_address, session_timeout=2) as client, zk_client(zk_address) as observer:
        member = NodeMembership(client, info("n1"), stale_wait=5)
        member.register()
        member.register()  # idempotent
        first = NodeInfo.decode("n1", observer.get(paths.node("n1"))[0])
        assert first.tcp_port == 4150
        assert member.heartbeat() is True
        assert NodeInfo.decode("n1", observer.get(paths.node("n1"))[0]).last_heartbeat >= first.last_heartbeat

        lost = threading.Event()
        client.add_listener(lambda state: lost.set() if state == "LOST" else None)
        zkserver.expire_session(client)
        assert lost.wait(10)
        wait_for(lambda: client.connected, timeout=10)
        assert member.heartbeat() is False
        member.register()
        assert observer.exists(paths.node("n1")).ephemeralOwner == client.client_id[0]
        member.leave()
        assert observer.exists(paths.node("n1")) is None


def test_membership_waits_out_a_stale_registration(zk_address):
    """A znode left by an earlier process with the same id is waited for: registration
    succeeds once that session ends, and fails with a clear error if it does not."""
    with zk_client(zk_address) as old, zk_client(zk_address) as new:
        old.create(paths.node("n1"), info("n1", instance="old").encode(), ephemeral=True)
        member = NodeMembership(new, info("n1", instance="new"), stale_wait=1)
        with pytest.raises(RegistryError, match="registered by another live process"):
            member.register()
        member.stale_wait = 20
        done = threading.Event()
        errors: list = []

        def register() -> None:
            try:
                member.register()
            except Exception as exc:  # reported below
                errors.append(exc)
            done.set()

        thread = threading.Thread(target=register)
        thread.start()
        old.stop()  # the old process's session ends
        assert done.wait(20) and not errors
        thread.join()
        data, stat = new.get(paths.node("n1"))
        assert NodeInfo.decode("n1", data).instance == "new"
        assert stat.ephemeralOwner == new.client_id[0]


def test_takeover_lock_is_exclusive_and_respects_live_nodes(zk_address):
    """Only one claimer holds a departed node's lock; nobody keeps it while the node is
    registered; a registering node waits for a claimer to finish."""
    with zk_client(zk_address) as one, zk_client(zk_address) as two:
        a = TakeoverLock(one, "dead", "one")
        b = TakeoverLock(two, "dead", "two")
        assert a.try_acquire_absent() is True
        assert b.try_acquire_absent() is False
        assert a.still_valid() is True

        registered = threading.Event()

        def come_back() -> None:
            NodeMembership(two, info("dead"), lock_wait=20).register()
            registered.set()

        thread = threading.Thread(target=come_back)
        thread.start()
        wait_for(lambda: len(one.get_children(paths.takeover_lock("dead"))) == 2, timeout=10)
        assert not registered.is_set()  # waits for the claimer
        a.release()
        assert registered.wait(10)
        thread.join()
        assert a.try_acquire_absent() is False  # the node is back
        assert TakeoverLock(one, "dead", "one").still_valid() is False


def test_connect_gives_up_after_the_timeout():
    """connect() to an address nobody serves fails with RegistryError in about the
    timeout, naming the address."""
    port = zkserver.free_port()
    started = time.monotonic()
    with pytest.raises(RegistryError, match=f"cannot reach ZooKeeper at 127.0.0.1:{port}/x within 1s"):
        connect(f"127.0.0.1:{port}/x", timeout=1)
    assert time.monotonic() - started < 10


def test_mirror_copies_zookeeper_view_into_postgresql(pg_dsn):
    """mirror_topics makes dmq_topic/dmq_channel equal to the given specs, idempotently,
    removing what ZooKeeper no longer has (with its undelivered copies)."""
    import registry as pg_registry
    from registry.pg import mirror_topics
    from dmq_server.db.schema import migrate
    from dmq_server.db.worker import connect as pg_connect

    migrate(pg_dsn)
    with pg_connect(pg_dsn, autocommit=True) as conn:
        pg_registry.create_topic(conn, "old")
        pg_registry.add_channel(conn, "old", "gone")
        specs = [TopicSpec("orders", msg_timeout_ms=5000, channels=("a", "b"))]
        with conn.transaction():
            assert mirror_topics(conn, specs) is True
        with conn.transaction():
            assert mirror_topics(conn, specs) is False
        assert [(t.name, t.msg_timeout_ms, t.channels) for t in pg_registry.topics(conn)] == [
            ("orders", 5000, ("a", "b"))
        ]
        with conn.transaction():
            assert mirror_topics(conn, [TopicSpec("orders", msg_timeout_ms=7000, channels=("b",))])
        assert [(t.msg_timeout_ms, t.channels) for t in pg_registry.topics(conn)] == [(7000, ("b",))]
