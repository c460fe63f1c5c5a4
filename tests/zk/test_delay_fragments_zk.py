"""Delay fragments shared among live nodes through a real ZooKeeper.

First the assignment alone (two members, a clean leave, a death), then two real
dmq-server nodes: each due message delivered once, and a killed node's fragments
served by the survivor.
"""

from __future__ import annotations

import json
import queue
import time


from dmq_client.wire import SEND_REPLIES, Command, MessageType
from dmq_server.cluster.fragments import ZkFragmentAssignment, contiguous_partition
from registry.zk import connect
from tests.integration.support import db_rows, http_get, wait_for

from .helpers import register_topic


ALL = frozenset(range(1, 9))


class ThreadReactor:
    """Collects callFromThread calls from the partitioner thread, for the test thread."""

    def __init__(self):
        self.calls: queue.Queue = queue.Queue()

    def callFromThread(self, fn, *args):
        self.calls.put((fn, args))

    def pump(self, timeout: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fn, args = self.calls.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            fn(*args)


def member(zk_address: str, node_id: str, reactor: ThreadReactor, owned: dict) -> ZkFragmentAssignment:
    assignment = ZkFragmentAssignment(
        lambda: connect(zk_address, timeout=30, session_timeout=2), 8, reactor, node_id, time_boundary=0.5
    )
    assignment.start(lambda fragments: owned.__setitem__(node_id, fragments))
    return assignment


def settled(reactor: ThreadReactor, owned: dict, expected: dict, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while owned != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"assignment {owned} never became {expected}")
        reactor.pump()


def test_contiguous_partition_gives_each_member_one_run():
    """Members in id order take 1-4 and 5-8; a non-member gets nothing."""
    members = ["node-b", "node-a"]
    assert contiguous_partition("node-a", members, range(1, 9)) == [1, 2, 3, 4]
    assert contiguous_partition("node-b", members, range(1, 9)) == [5, 6, 7, 8]
    assert contiguous_partition("node-c", members, range(1, 9)) == []


def test_two_members_split_the_fragments_and_a_leaver_hands_them_over(zk_address):
    """Two live members own 1-4 and 5-8; when one leaves cleanly, the other owns all 8."""
    reactor, owned = ThreadReactor(), {}
    a = member(zk_address, "node-a", reactor, owned)
    b = member(zk_address, "node-b", reactor, owned)
    try:
        settled(reactor, owned, {"node-a": frozenset({1, 2, 3, 4}), "node-b": frozenset({5, 6, 7, 8})})
        b._stop_blocking()  # the blocking half of stop(), on this thread
        deadline = time.monotonic() + 30
        while owned["node-a"] != ALL and time.monotonic() < deadline:
            reactor.pump()
        assert owned["node-a"] == ALL
        assert a.describe()["state"] == "acquired"
    finally:
        a._stop_blocking()
        b._stop_blocking()  # the blocking half of stop(), on this thread


def test_a_dead_members_fragments_move_to_the_survivor(zk_address):
    """A member whose session ends without leaving (a crashed node) loses its fragments to
    the survivor once ZooKeeper expires it."""
    reactor, owned = ThreadReactor(), {}
    a = member(zk_address, "node-a", reactor, owned)
    b = member(zk_address, "node-b", reactor, owned)
    try:
        settled(reactor, owned, {"node-a": frozenset({1, 2, 3, 4}), "node-b": frozenset({5, 6, 7, 8})})
        b._stop.set()  # the thread must not rejoin: b is dead
        b._client.stop()  # the session closes without leaving the party
        deadline = time.monotonic() + 30
        while owned["node-a"] != ALL and time.monotonic() < deadline:
            reactor.pump()
        assert owned["node-a"] == ALL
    finally:
        a._stop_blocking()
        b._stop_blocking()  # the dead member's session is gone: this only frees its client


def test_a_partitioner_that_fails_holding_its_locks_lets_them_go(zk_address):
    """kazoo's partitioner can fail while it holds fragment locks: it leaves the party and
    keeps them. The member starts over on a new session, which frees them, so both members
    own their runs again; a new partitioner on the old session waited for its own old
    locks for ever, and no delayed message of those fragments moved (chaos clock-jump)."""
    reactor, owned = ThreadReactor(), {}
    a = member(zk_address, "node-a", reactor, owned)
    b = member(zk_address, "node-b", reactor, owned)
    try:
        halves = {"node-a": frozenset({1, 2, 3, 4}), "node-b": frozenset({5, 6, 7, 8})}
        settled(reactor, owned, halves)
        first_session = b._client.client_id
        b._partitioner._fail_out()  # what kazoo does on a lock it cannot release: locks kept
        deadline = time.monotonic() + 30
        while b._client is None or b._client.client_id == first_session or b.describe()["state"] != "acquired":
            if time.monotonic() > deadline:
                raise AssertionError(f"b never acquired on a new session: {b.describe()} {owned}")
            reactor.pump()
        settled(reactor, owned, halves)
        assert a.describe()["state"] == "acquired"
    finally:
        a._stop_blocking()
        b._stop_blocking()


def send_delayed(client, topic: str, body: bytes, due_ms: int):
    frame = client.send_frame(topic, body)
    frame.msg_type = MessageType.DELAY
    frame.due_ms = due_ms
    client.write(frame)
    return client._await_reply(lambda f: f.command in SEND_REPLIES and f.session_id == frame.session_id, None)


def delay_state(node) -> dict:
    status, body = http_get(node.http + "/admin/delay")
    assert status == 200, body
    return json.loads(body)


def test_cluster_nodes_share_fragments_deliver_once_and_survive_a_death(make_node, zk, pg_dsn):
    """Two nodes split the fragments; every due message is delivered once across them; after
    one is killed the survivor owns all fragments and delivers messages of the dead
    node's fragments too."""
    register_topic(zk, "orders", "billing")
    a = make_node(delay_poll_interval="100ms")
    b = make_node(delay_poll_interval="100ms")
    wait_for(
        lambda: sorted(delay_state(a)["owned"] + delay_state(b)["owned"]) == list(range(1, 9))
        and delay_state(a)["owned"] and delay_state(b)["owned"],
        timeout=30,
    )
    count = 80
    with a.client() as producer, a.client() as ca, b.client() as cb:
        for c in (ca, cb):
            wait_for(lambda: c.subscribe("orders", "billing", credit=1000).command == Command.SUBSCRIBE_ACK)
        due = int(time.time() * 1000) + 1000
        for i in range(count):
            assert send_delayed(producer, "orders", b"m%d" % i, due).command == Command.SEND_SUCCESS_ACK
        seen: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(seen) < count and time.monotonic() < deadline:
            for c in (ca, cb):
                push = c.receive(timeout=0.1)
                if push is not None:
                    seen.append(push.body)
                    c.ack(push)
        for c in (ca, cb):
            while (push := c.receive(timeout=0.5)) is not None:
                seen.append(push.body)
        assert sorted(seen) == sorted(b"m%d" % i for i in range(count))

    b.kill()
    wait_for(lambda: delay_state(a)["owned"] == list(range(1, 9)), timeout=30)
    with a.client() as producer, a.client() as consumer:
        assert consumer.subscribe("orders", "billing", credit=1000).command == Command.SUBSCRIBE_ACK
        due = int(time.time() * 1000) + 300
        for i in range(40):
            assert send_delayed(producer, "orders", b"after-%d" % i, due).command == Command.SEND_SUCCESS_ACK
        got = set()
        deadline = time.monotonic() + 20
        while len(got) < 40 and time.monotonic() < deadline:
            push = consumer.receive(timeout=1)
            if push is not None:
                got.add(push.body)
                consumer.ack(push)
        assert got == {b"after-%d" % i for i in range(40)}
    fragments = {r[0] for r in db_rows(pg_dsn, "SELECT DISTINCT fragment FROM dmq_delay")}
    assert fragments == set()
