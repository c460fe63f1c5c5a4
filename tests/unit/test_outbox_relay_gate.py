"""The outbox relay placed through ZooKeeper (OutboxRelay's ``gate``), on the doubles of
test_outbox_relay_loop: only while the gate says this node holds the outbox's ZooKeeper
lock does the relay try the advisory lock; when it no longer does, the relay deletes the
rows it stored (only its lock's connection may), ends that connection (the advisory lock
goes with it) and tries nothing more until the gate is its own again; a gate that does not
answer changes nothing; stop releases the gate. The real thing: tests/zk/test_outbox_zk.py."""

from __future__ import annotations

import pytest
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock, deferLater

from dmq_server.core.outbox_rows import OutboxSource
from dmq_server.core.publish import Published
from dmq_server.db import outbox, outbox_ledger
from dmq_server.db.storage_errors import StorageError
from dmq_server.protocols.outbox_relay import GATE_EVERY, GATE_FAILURES, OutboxRelay

from .test_outbox_relay_loop import TAG, Db, HeldBroker, Outbox, row

pytestmark = pytest.mark.unit


class Gate:
    """A ZooKeeper lock as the relay asks it: ``held`` answers hold(); ``down`` fails it."""

    def __init__(self) -> None:
        self.held = True
        self.down = False
        self.asked = self.released = 0

    def hold(self) -> Deferred[bool]:
        self.asked += 1
        if self.down:
            return fail(ConnectionError("not connected to ZooKeeper"))
        return succeed(self.held)

    def release(self) -> Deferred[None]:
        self.released += 1
        self.held = False
        return succeed(None)


def test_only_the_gate_holder_relays_and_one_that_loses_it_deletes_then_lets_the_lock_go() -> None:
    clock, gate, broker, table = Clock(), Gate(), HeldBroker(), Outbox([row(1), row(2)])
    gate.held = False
    # a wait for NOTIFY ends after a second without one
    app = Db({outbox.hold_relay: 42, outbox.wait_for_rows: lambda *_: deferLater(clock, 1.0, lambda: False),
              outbox.present_rows: table.present, outbox.delete_and_read: table.delete_and_read,
              outbox.read_tag: TAG, outbox.release_relay: None})
    dmq = Db({outbox_ledger.forget_and_check: set(), outbox_ledger.recorded_rows: [],
              outbox_ledger.forget_relayed: 0, outbox_ledger.dead_letter_rows: 0})
    relay = OutboxRelay(OutboxSource("shop", "dmq_outbox", "dbname=app"), broker, clock, app, dmq, gate=gate)
    relay.start()
    clock.pump([1, 1, 1])  # another node holds the ZooKeeper lock: the advisory lock is never tried
    assert gate.asked == 4 and app.count(outbox.hold_relay) == 0 and not relay.relaying

    gate.held = True
    clock.advance(1)
    assert relay.relaying and broker.sent() == [[1, 2]]
    clock.advance(2 * GATE_EVERY)  # while the store is under way
    gate.held = False  # ... another node took the ZooKeeper lock
    broker.answer(0, Published(1))
    assert table.deleted() == [1, 2], "the rows stored are deleted on the lock's connection first"
    assert app.count(outbox.release_relay) == 1 and not relay.relaying
    assert [fn for fn, _ in app.calls][-2:] == [outbox.delete_and_read, outbox.release_relay]
    tries = app.count(outbox.hold_relay)
    clock.pump([1] * 5)
    assert app.count(outbox.hold_relay) == tries

    gate.held = True
    clock.advance(1)
    assert relay.relaying and app.count(outbox.hold_relay) == tries + 1
    gate.down = True  # ZooKeeper away: the relay goes on (the advisory lock fences)
    asked = gate.asked
    table.rows[5] = row(5)
    clock.pump([1] * 5)
    assert gate.asked > asked and relay.relaying and app.count(outbox.release_relay) == 1
    assert broker.sent()[-1] == [5]
    broker.answer(len(broker.held) - 1, Published(2))

    stopped = relay.stop()
    clock.advance(1)
    assert stopped.called and gate.released == 1 and app.stopped


def test_a_node_whose_cycles_keep_failing_lets_the_zookeeper_lock_go() -> None:
    """Placed by ZooKeeper, a relay that cannot do its work (here its reads fail: this
    node's way to the application's database) would hold the outbox for nobody: after
    GATE_FAILURES cycles failed in a row it ends its connection and lets the ZooKeeper lock
    go, and tries no more while another node holds it."""
    clock, gate = Clock(), Gate()
    app = Db({outbox.hold_relay: 42, outbox.read_tag: TAG, outbox.present_rows: set(), outbox.release_relay: None,
              outbox.delete_and_read: StorageError("connection to the application's database lost")})
    dmq = Db({outbox_ledger.recorded_rows: []})
    relay = OutboxRelay(OutboxSource("shop", "dmq_outbox", "dbname=app"), HeldBroker(), clock, app, dmq, gate=gate)
    relay.start()
    clock.pump([1])  # failed at 0 and 1 s (the next try at 3 s)
    assert app.count(outbox.delete_and_read) == 2 and gate.released == 0 and relay.relaying
    clock.pump([1, 1])
    assert app.count(outbox.delete_and_read) == GATE_FAILURES and gate.released == 1
    assert app.count(outbox.release_relay) == 1 and not relay.relaying
    tries = app.count(outbox.hold_relay)
    clock.pump([1] * 10)  # another node holds it now
    assert app.count(outbox.hold_relay) == tries
