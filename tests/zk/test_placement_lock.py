"""``PlacementLock`` on a real ZooKeeper, each node its own kazoo client (its own session):
one holder at a time, ``holder()`` naming it, a handover when the holder's session ends
(closed, or expired while its client lives on: its next ``hold`` finds out), and the
ordered topics' path (``paths.orderer``). ``RelayLock`` is the same lock at the outbox's
path (tests/zk/test_outbox_zk.py plays it with two dmq nodes)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState

from registry import paths
from registry.outboxes import RelayLock
from registry.placement_lock import PlacementLock
from registry.zk import connect
from tests.integration.support import wait_for

WAIT = 30.0


@pytest.fixture
def clients(zk_address: str) -> Iterator[list[KazooClient]]:
    """Two started clients on the test's chroot: two nodes' sessions."""
    made: list[KazooClient] = []
    try:
        for _ in range(2):
            made.append(connect(zk_address, timeout=30, session_timeout=5))
        yield made
    finally:
        for client in made:
            client.stop()
            client.close()


def expire(client: KazooClient, zk_address: str) -> None:
    """End ``client``'s session as ZooKeeper does when it expires: another connection
    takes the session over (its id and password) and closes it. The client itself lives
    on, finds its session expired when it reconnects and starts a new one; this returns
    once it is connected on that new session."""
    session = client.client_id
    hosts, chroot = paths.parse_address(zk_address)
    lost, again = threading.Event(), threading.Event()

    def listener(state: KazooState) -> bool:
        if state == KazooState.LOST:
            lost.set()
        elif state == KazooState.CONNECTED and lost.is_set():
            again.set()
            return True  # done: kazoo drops a listener that returns True
        return False

    client.add_listener(listener)
    thief = KazooClient(hosts=hosts + chroot, client_id=session)
    thief.start(timeout=WAIT)
    thief.stop()  # closes the session: its ephemeral znodes go
    thief.close()
    assert again.wait(WAIT), f"the client did not start a new session (lost: {lost.is_set()})"
    assert client.client_id is not None and client.client_id[0] != session[0]


def test_one_holder_at_a_time_and_holder_names_it(clients):
    a, b = (PlacementLock(c, paths.orderer("orders"), node) for c, node in zip(clients, ("node-a", "node-b")))
    assert a.holder() is None
    assert a.hold() is True
    assert b.hold() is False
    assert a.holder() == b.holder() == "node-a"
    # b's refused try left no contender behind (else it would queue as the next holder)
    assert clients[0].get_children(paths.orderer("orders")) == clients[1].get_children(paths.orderer("orders"))
    assert len(clients[0].get_children(paths.orderer("orders"))) == 1
    for _ in range(3):  # asked again and again (once a second by each node): nothing changes
        assert a.hold() is True and b.hold() is False
    assert len(clients[0].get_children(paths.orderer("orders"))) == 1
    # another topic is another lock
    other = PlacementLock(clients[1], paths.orderer("payments"), "node-b")
    assert other.hold() is True and other.holder() == "node-b" and a.holder() == "node-a"


def test_release_hands_it_to_the_next_hold(clients):
    a, b = (PlacementLock(c, paths.orderer("orders"), node) for c, node in zip(clients, ("node-a", "node-b")))
    b.release()  # not held: no error
    assert a.hold() and not b.hold()
    a.release()
    assert a.holder() is None
    assert b.hold() is True
    assert a.hold() is False and a.holder() == "node-b"


def test_the_holders_session_closing_hands_it_over(clients):
    """The holder's client stops (a node killed: its session ends): the other's next hold
    takes the lock."""
    a, b = (PlacementLock(c, paths.orderer("orders"), node) for c, node in zip(clients, ("node-a", "node-b")))
    assert a.hold() and not b.hold()
    clients[0].stop()
    wait_for(b.hold, timeout=WAIT)
    assert b.holder() == "node-b"


def test_a_holder_whose_session_expired_finds_out_at_its_next_hold(clients, zk_address):
    """A frozen node's session expires while its client object lives on: the other node
    takes the lock, and the first one's next ``hold`` answers False (one ``exists`` finds
    its znode gone) instead of trusting the lock it took on the old session. Once the
    other lets go, it contends again and wins."""
    a, b = (PlacementLock(c, paths.orderer("orders"), node) for c, node in zip(clients, ("node-a", "node-b")))
    assert a.hold() and not b.hold()
    expire(clients[0], zk_address)
    assert b.hold() is True  # a's znode went with its session
    assert a.hold() is False
    assert a.holder() == "node-b"
    b.release()
    assert a.hold() is True and b.holder() == "node-a"


def test_the_relay_lock_is_a_placement_lock_at_the_outbox_path(clients):
    relay = RelayLock(clients[0], "shop", "node-a")
    assert relay.path == paths.outbox_relay("shop") == "/dmq/outbox_relay/shop"
    assert relay.hold() and PlacementLock(clients[1], paths.outbox_relay("shop"), "x").holder() == "node-a"
    with pytest.raises(ValueError, match="outbox name '..' cannot be stored in ZooKeeper"):
        RelayLock(clients[0], "..", "node-a")


def test_the_orderer_path():
    assert paths.orderer("orders") == "/dmq/orderer/orders"
    assert paths.orderer("orders#ephemeral") == "/dmq/orderer/orders#ephemeral"
    for name in (".", ".."):
        with pytest.raises(ValueError, match=f"topic name '{name}' cannot be stored in ZooKeeper"):
            paths.orderer(name)


def test_a_note_left_by_the_holder_is_read_by_the_next(clients):
    """An orderer letting go cleanly leaves a note; the next holder reads it, and clears it."""
    first, second = (PlacementLock(c, paths.orderer("ledger"), f"n{i}") for i, c in enumerate(clients))
    assert second.note() == ""  # none yet (the path is made on the way)
    assert first.hold()
    first.leave_note("n0")
    first.release()
    assert second.hold()
    assert second.note() == "n0"
    second.leave_note("")
    assert first.note() == ""
    assert second.holder() == "n1"  # the note is not a contender
