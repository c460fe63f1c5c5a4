"""A cluster node that stood still (``ClusterNode.check_gap``, ``stood_still``,
``may_deliver``): after a gap in its time longer than a third of the ZooKeeper session
timeout it pauses delivery and asks ZooKeeper whether its znode is still its session's, and
holds back bytes decided before the gap, until the answer says yes.

Unit tier: a Twisted ``Clock`` as the reactor, ZooKeeper's answers as Deferreds the test
fires, the reliable store as a stand-in that records its pauses. The chaos tier freezes
real nodes with SIGSTOP (``tests/chaos``: node-pause, the frozen orderer); these tests
hit each order of events on purpose.
"""

from __future__ import annotations

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from dmq_server.cluster.node import ClusterNode
from dmq_server.core.options import Options

pytestmark = pytest.mark.unit

TIMEOUT = 9.0  # the ZooKeeper session timeout: a gap counts past 3 s


class StandInStore:
    def __init__(self) -> None:
        self.paused = False
        self.pauses: list[bool] = []

    def pause_delivery(self, paused: bool) -> None:
        self.paused = paused
        self.pauses.append(paused)


class StandInMembership:
    def heartbeat(self) -> bool:  # asked on the bridge in a server; here the test answers
        raise AssertionError("not called: the test's _zk answers")


class Node:
    """A registered ClusterNode on a Clock, its ZooKeeper questions kept for the test."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.node = ClusterNode(Options(zk_session_timeout=TIMEOUT), self.clock, "node-1", "", admin=None)  # type: ignore[arg-type]
        self.store = StandInStore()
        self.node._stores = {"main": self.store}  # type: ignore[dict-item]
        self.node.registered = True
        self.node.membership = StandInMembership()  # type: ignore[assignment]
        self.questions: list[Deferred] = []
        self.node._zk = self._ask  # type: ignore[method-assign]

    def _ask(self, fn: object, *args: object, timeout: float | None = -1.0) -> Deferred:
        d: Deferred = Deferred()
        self.questions.append(d)
        return d

    def scan(self) -> None:
        self.node.check_gap()

    def stall(self, seconds: float = TIMEOUT) -> None:
        self.clock.advance(seconds)


def test_a_node_that_kept_time_neither_pauses_nor_asks():
    n = Node()
    for _ in range(5):
        n.scan()
        n.stall(1.0)
    assert not n.node.stood_still() and n.node.may_deliver()
    assert n.questions == [] and n.store.pauses == []


def test_a_gap_pauses_until_zookeeper_confirms_the_session():
    n = Node()
    n.scan()
    n.stall()
    # the first push after waking finds the gap before the scan does
    assert not n.node.may_deliver() and n.node.stood_still()
    assert n.store.pauses == [True] and len(n.questions) == 1
    n.scan()  # the overdue scan asks nothing more while the answer is on its way
    assert len(n.questions) == 1 and n.node.stood_still()
    n.questions[0].callback(True)
    assert n.node.may_deliver() and not n.node.stood_still() and n.store.pauses == [True, False]


def test_a_second_gap_while_the_answer_is_on_its_way_asks_again():
    """The answer to a question asked before the node stood still again says nothing of the
    session after it: it resumes nothing, and the node asks again."""
    n = Node()
    n.scan()
    n.stall()
    n.scan()
    assert len(n.questions) == 1
    n.stall()
    n.scan()  # the second gap, found while the first question is unanswered
    assert n.node.stood_still() and len(n.questions) == 1
    n.questions[0].callback(True)
    assert n.node.stood_still() and not n.node.may_deliver() and len(n.questions) == 2
    n.questions[1].callback(True)
    assert n.node.may_deliver() and not n.node.stood_still()


def test_a_gap_after_the_connection_came_back_pauses_again():
    """No answer (ZooKeeper unreachable): kazoo's CONNECTED with the same session resumes
    delivery, and the node no longer counts as stood still; a new gap then pauses again."""
    n = Node()
    n.scan()
    n.stall()
    n.scan()
    n.questions[0].errback(ConnectionError("not connected"))
    assert n.node.stood_still() and not n.node.may_deliver()
    n.node._state_changed("SUSPENDED")
    n.node._state_changed("CONNECTED")
    assert n.node.may_deliver() and not n.node.stood_still()
    n.stall()
    assert not n.node.may_deliver() and n.node.stood_still()
    assert n.store.pauses[-1] is True and len(n.questions) == 2


def test_a_znode_gone_meanwhile_is_an_eviction():
    n = Node()
    evicted: list[bool] = []
    n.node._evicted = lambda: evicted.append(True)  # type: ignore[method-assign]
    n.scan()
    n.stall()
    n.scan()
    n.questions[0].callback(False)
    assert evicted == [True] and n.store.pauses == [True]
