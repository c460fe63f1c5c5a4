"""``ClusterOrderers`` when an ordered topic reaches another PostgreSQL cluster while a
node orders it (``dmq topic move`` to that cluster): the new cluster's store is claimed
at the next round and then told to deliver, by the orderer; the other nodes tell it who
orders. (Seen in the chaos tier, tests/chaos/test_ordered_nodes.py: told only at the
gain, the moved topic's new cluster stayed gated on every node and nothing stored there
was ever pushed.)"""

from __future__ import annotations

from twisted.internet.task import Clock

from .test_cluster_orderers import ME, OTHER, FakeLock, FakeStore, FakeWorker, Orderers


def _two_clusters(**worker) -> tuple[Orderers, FakeLock, FakeStore, FakeStore, FakeWorker]:
    """The topic on cluster b only; main's store does not have it yet."""
    lock, b, main, db, clock = FakeLock(), FakeStore(), FakeStore(ordered=set()), FakeWorker(**worker), Clock()
    orderers = Orderers(lock, b, db, clock)
    orderers._stores = {"b": b, "main": main}
    orderers._workers = {"b": db, "main": db}
    return orderers, lock, b, main, db


def test_the_orderer_claims_and_delivers_a_cluster_the_topic_was_moved_to():
    orderers, lock, b, main, db = _two_clusters()
    orderers.tick()
    assert b.calls == [("here", "ledger")] and main.calls == [] and db.ran == ["claim_ordered_cursors_steps"]
    main.ordered.add("ledger")  # the move placed it on main: main's store has it, gated
    db.ran.clear()
    orderers.tick()
    # claimed on both clusters before main is told to deliver (its first load comes after):
    # main in full, b's second half again
    assert db.ran == ["reclaim_ordered_cursors_steps", "claim_ordered_cursors_steps"]
    assert main.calls == [("here", "ledger")] and b.calls == [("here", "ledger")]
    orderers.tick()
    assert main.calls == [("here", "ledger")]  # told once
    b.ordered.clear()  # the drain finished: b's store no longer has it
    orderers.tick()
    b.ordered.add("ledger")  # moved back: b is told again
    orderers.tick()
    assert b.calls == [("here", "ledger")] * 2


def test_a_moved_topic_waits_out_the_handover_on_every_cluster():
    orderers, lock, b, main, db = _two_clusters(taken_from=frozenset({OTHER}))
    orderers.tick()
    main.ordered.add("ledger")
    orderers.tick()  # still waiting out the handover: neither cluster delivers
    assert b.calls == main.calls == [] and orderers.stats()["waiting"] == ["ledger"]
    orderers._clock.advance(b.timeout)
    assert b.calls == main.calls == [("here", "ledger")]


def test_another_node_names_the_orderer_to_a_cluster_the_topic_was_moved_to():
    orderers, lock, b, main, db = _two_clusters()
    lock.taken_by(OTHER)
    orderers.tick()
    assert b.calls == [("elsewhere", "ledger", OTHER)] and main.calls == []
    main.ordered.add("ledger")
    orderers.tick()
    orderers.tick()
    assert main.calls == [("elsewhere", "ledger", OTHER)]
    assert b.calls == [("elsewhere", "ledger", OTHER)] and ME not in {c[-1] for c in main.calls}
