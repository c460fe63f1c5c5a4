"""Unit tests of the server's assembly (``service.DmqServer``) with a cluster node:
the broker's stage as the service runs it, on in-memory databases (one per PostgreSQL
cluster) and a ``task.Clock``, with a stand-in for the node (no ZooKeeper: it answers
the calls the assembly makes of a ``cluster.node.ClusterNode``).

The bug this pins: with --pg-cluster and --zk only the last cluster's store had the
node's delivery gate (the node set it after its loop over the stores), so every other
cluster's store pushed while the node's session was in doubt."""

from __future__ import annotations

from typing import Callable, Generator, Mapping

from twisted.internet import defer

from dmq_server.cluster.takeover import ClusterStore
from dmq_server.core.options import Options
from dmq_server.db.memory import MemoryDb
from dmq_server.service import DmqServer
from tests.unit.test_broker import Consumer, Harness
from tests.unit.test_placement import two_cluster_databases

NODE = "node-1"


class StandInNode:
    """What the assembly asks of a cluster node: the registry's reader, its delivery gate
    (``open``), the gap check before each scan, and the stores it fences and starts."""

    def __init__(self, db: MemoryDb) -> None:
        self.db = db
        self.open = False
        self.attached: Mapping[str, ClusterStore] = {}
        self.started: list[str] = []

    def fetch_topics(self) -> defer.Deferred:
        from dmq_server.db.topic_steps import list_topics_steps

        return self.db.run_steps(list_topics_steps)

    def may_deliver(self) -> bool:
        return self.open

    def check_gap(self) -> None:
        pass

    def stood_still(self) -> bool:
        return False

    def attach(self, stores: Mapping[str, ClusterStore], refresh: Callable[[bool], defer.Deferred],
               fast_topics: Callable[[], dict[str, tuple[str, ...]]]) -> None:
        self.attached = stores

    @defer.inlineCallbacks
    def begin_incarnation(self, stores: Mapping[str, ClusterStore]) -> Generator[defer.Deferred, object, None]:
        for name, store in stores.items():
            self.started.append(name)
            yield store.start(alone=False)


class AssembledOnTwoClusters(Harness):
    """``local`` on main and ``remote`` on b, channel ``c`` each; the broker made and
    started by ``DmqServer._start_broker`` as with --zk and --pg-cluster b=..."""

    def __init__(self) -> None:
        self.clock, self.db, self.b = two_cluster_databases()
        server = self.server = DmqServer(Options(node_id=NODE), self.clock)
        server.workers = {"writer0": self.db, "acker": self.db, "loader": self.db, "admin": self.db}
        server.cluster_workers = {"b": {"writer0": self.b, "acker": self.b, "loader": self.b, "admin": self.b}}
        server.slots = {"main": 0, "b": 1}
        self.node = StandInNode(self.db)
        server.cluster = self.node
        self.acknowledged: dict[tuple[str, int], int] = {}
        self.answers: dict[tuple[str, int], object] = {}
        started = server._start_broker()
        self.settle()
        assert started.called
        assert server.broker is not None
        self.broker = server.broker
        self.broker.timers.startService()
        self.settle()


def test_every_clusters_store_built_by_the_service_is_fenced_by_the_node():
    h = AssembledOnTwoClusters()
    assert h.node.started == ["main", "b"] and set(h.node.attached) == {"main", "b"}
    local, remote = Consumer(), Consumer()
    h.subscribe("local", "c", local)
    h.subscribe("remote", "c", remote)
    for i in range(5):
        h.send("local", "p", i)
        h.send("remote", "p", 100 + i)
    h.settle()
    assert len(h.acknowledged) == 10  # stored on both clusters
    assert local.pushed == [] and remote.pushed == []  # the gate is shut on every store
    h.node.open = True
    h.send("local", "p", 5)  # a new copy pumps its channel: what waited goes with it
    h.send("remote", "p", 105)
    h.settle()
    assert len(local.pushed) == 6 and len(remote.pushed) == 6
    # each store loads only the copies of the owners this node's cursors hold
    assert {name: store.load_owner for name, store in h.broker.cluster_stores().items()} == {"main": NODE, "b": NODE}
