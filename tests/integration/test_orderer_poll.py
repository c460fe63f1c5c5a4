"""An ordered topic's orderer reads what the other nodes stored (issue 45 §2 across nodes,
45-nodes-design §3, §4b), on real PostgreSQL and a real reactor.

Two ``ReliableStore``s on one database, as two cluster nodes (two fences, two
incarnations): ``n1`` is the topic's orderer, ``n2`` stores its sends and delivers
nothing. ``n2``'s commits are handed to no channel of ``n1``: its copies reach ``n1``'s
consumer by ``--ordered-poll`` (the loads of the orderer read every owner). The test
waits for the pushes it counts (a Deferred fired by the consumer), never for a time.
Counted: every copy either node stored is pushed once, by the orderer, in id order, one
copy of the key at a time; every ack is durable (each owner's cursor passes everything).
"""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

import registry
from dmq_client.wire.properties import Properties, encode_properties
from dmq_server.core.options import Options
from dmq_server.core.publish import new_send
from dmq_server.db.messages import HOT_STATEMENTS
from dmq_server.db.reactor import ReactorDb
from dmq_server.db.worker import DbWorker, connect
from dmq_server.reliable.store import Fence, ReliableStore, StoreWiring
from registry.model import TopicSpec

from .support import db_rows
from .test_reactor_db import on_reactor

pytestmark = pytest.mark.integration

TOPIC = "ledger"
SPEC = TopicSpec(TOPIC, channels=("c",), ordered=True)


class Consumer:
    """Acknowledges each copy on the next reactor turn (one of the key is out at a time, so
    the next comes only then); ``until(n)`` fires once ``n`` copies were pushed."""

    def __init__(self, reactor: Any, store: ReliableStore | None = None):
        self.credit = 10
        self.in_flight = 0
        self.pushed: list[int] = []
        self._reactor, self._store = reactor, store
        self._waiting: tuple[int, Deferred[None]] | None = None

    def push_many(self, channel: Any, deliveries: Any) -> None:
        ids = [d.message.message_id for d in deliveries]
        self.pushed += ids
        if self._store is not None:
            self._reactor.callLater(0, self._store.ack_many, TOPIC, "c", ids, self)
        if self._waiting is not None and len(self.pushed) >= self._waiting[0]:
            d, self._waiting = self._waiting[1], None
            d.callback(None)

    def until(self, count: int) -> Deferred[None]:
        """Fires once ``count`` copies were pushed; a TimeoutError after 20 s (the test
        then stops its connections: ``finally``)."""
        d: Deferred[None] = Deferred()
        if len(self.pushed) >= count:
            d.callback(None)
        else:
            self._waiting = (count, d)
        return d.addTimeout(20, self._reactor)


def _node(reactor: Any, dsn: str, node_id: str) -> tuple[ReliableStore, list[ReactorDb | DbWorker]]:
    """A node's store, its connections as the server makes them (``service._db_worker``)."""
    roles: dict[str, ReactorDb | DbWorker] = {
        "writer0": ReactorDb(reactor, dsn, "writer0", prepare=HOT_STATEMENTS),
        "acker": ReactorDb(reactor, dsn, "acker", prepare=HOT_STATEMENTS),
        "loader": DbWorker(reactor, dsn, "loader"),
        "admin": DbWorker(reactor, dsn, "admin"),
    }
    for worker in roles.values():
        worker.start()
    store = ReliableStore(Options(ordered_poll=0.05), reactor, roles, node_id, lambda ok, why: None,
                          StoreWiring(fence=Fence(node_id, lambda: True)))
    return store, list(roles.values())


def _send(store: ReliableStore, session: int) -> Deferred[int]:
    """One send of key ``k`` through ``store``'s group commit; fires with its id."""
    props = Properties(key="k")
    d: Deferred[int] = Deferred()
    store.store(new_send(topic=TOPIC, producer=store.node_id, session_id=session, body=b"x", properties=props,
                         status=encode_properties(props)), lambda outcome: d.callback(outcome.message_id))
    return d.addTimeout(20, store.clock)


def test_copies_stored_on_another_node_reach_the_orderers_consumer_by_poll(pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, TOPIC, ordered=True)
        registry.add_channel(conn, TOPIC, "c")

    async def scenario(reactor: Any) -> dict[str, Any]:
        (orderer, dbs1), (other, dbs2) = _node(reactor, pg_dsn, "n1"), _node(reactor, pg_dsn, "n2")
        try:
            for store in (orderer, other):
                await store.start(alone=False)
                store.apply_topics({TOPIC: SPEC})
                store.timers.startService()
            orderer.order_here(TOPIC)
            other.order_elsewhere(TOPIC, "n1")
            consumer, idle = Consumer(reactor, orderer), Consumer(reactor)
            orderer.subscribe(TOPIC, "c", consumer)
            other.subscribe(TOPIC, "c", idle)
            # stored on n2 alone: only the poll brings them to n1
            first = [await _send(other, session) for session in range(1, 4)]
            await consumer.until(3)
            # then on both, alternately (n1's own arrivals, above n2's copies, go through loads)
            more = []
            for session in range(4, 10):
                more.append(await _send(other if session % 2 == 0 else orderer, session))
            await consumer.until(9)
            await deferLater(reactor, 0, lambda: None)  # the last ack (sent on the next turn)
            await orderer.acker.drain()
            stats = orderer.channel(TOPIC, "c").stats(), other.channel(TOPIC, "c").stats()
            owners = orderer.incarnation, other.incarnation
            return {"ids": first + more, "pushed": consumer.pushed, "idle": idle.pushed, "stats": stats,
                    "owners": owners}
        finally:
            for store in (orderer, other):
                if store.timers.running:
                    store.timers.stopService()
            for db in dbs1 + dbs2:
                db.stop()

    result = on_reactor(scenario, timeout=60)
    assert result["pushed"] == sorted(result["ids"]) and len(result["ids"]) == 9  # once each, in id order
    assert result["idle"] == []
    assert [s["delivered_by"] for s in result["stats"]] == [None, "n1"]
    # both owners' copies, each acknowledged durably, by the orderer: every cursor passes them
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending WHERE topic = %s", TOPIC) == [(0,)]
    floors = dict(db_rows(pg_dsn, "SELECT owner, floor FROM dmq_cursor WHERE topic = %s", TOPIC))
    stored = dict(db_rows(pg_dsn, "SELECT owner, max(id) FROM dmq_message WHERE topic = %s GROUP BY owner", TOPIC))
    assert set(stored) == set(result["owners"])
    assert all(floors[owner] >= stored[owner] for owner in stored), (floors, stored)
    holders = db_rows(pg_dsn, "SELECT DISTINCT holder FROM dmq_cursor WHERE topic = %s", TOPIC)
    assert holders == [("n1",)]
