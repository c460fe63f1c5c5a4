"""Takeover on the in-memory double: which incarnations a departed node left, claiming
them (``claim_owners``), and ``cluster.takeover.Takeover`` driving it.

The statements are answered as PostgreSQL answers them
(tests/integration/test_memory_db_contract.py); ZooKeeper's takeover lock is a stand-in
that records what was asked of it (the lock itself is tested against ZooKeeper in
tests/zk/). What a claim must do: retire the departed node's incarnations (they store
nothing more), make this node the holder of their cursors and of those the departed
node held, leave live nodes' cursors alone, and have the channels read what changed hands.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from twisted.internet.defer import succeed

import registry.takeover_lock
from dmq_server.cluster.takeover import Takeover
from dmq_server.db.storage_errors import Fenced
from dmq_server.db.memory import MemoryDb
from dmq_server.db.messages import (
    CursorProgress,
    NewMessage,
    ack_deliveries_steps,
    create_owner_steps,
    insert_messages_steps,
    load_backlog_steps,
)
from dmq_server.db.takeover_steps import claim_owners_steps, owner_depths_steps, takeover_candidates_steps
from tests.unit.test_memory_db import result



@pytest.fixture
def db() -> MemoryDb:
    """Two nodes' incarnations (1: node-1, 2: node-2), each with two messages stored."""
    db = MemoryDb()
    db.create_topic("orders", ["billing", "audit"])
    for node in ("node-1", "node-2"):
        owner = result(db.run_steps(create_owner_steps, node))
        batch = [NewMessage("orders", node, n, 0, b"x") for n in (1, 2)]
        result(db.run_steps(insert_messages_steps, batch, node, owner))
    return db


def test_candidates_and_depths_name_every_node_with_an_incarnation_or_a_cursor(db):
    assert result(db.run_steps(takeover_candidates_steps)) == {"node-1": [1], "node-2": [2]}
    assert result(db.run_steps(owner_depths_steps)) == {"node-1": 4, "node-2": 4}  # 2 messages x 2 channels


def test_a_claim_retires_the_departed_incarnation_and_moves_its_copies(db):
    claimed = result(db.run_steps(claim_owners_steps, "node-2", [2], "node-1", ["node-1"]))
    assert claimed == [("orders", "audit", 1), ("orders", "billing", 1)]  # one cursor per channel opened
    assert db.owners[2]["retired"] and not db.owners[1]["retired"]
    assert result(db.run_steps(owner_depths_steps)) == {"node-1": 8}
    assert result(db.run_steps(takeover_candidates_steps)) == {"node-1": [1]}
    # node-2, if it still runs, stores nothing more
    fenced = result(db.run_steps(insert_messages_steps, [NewMessage("orders", "node-2", 9, 0, b"y")], "node-2", 2))
    assert isinstance(fenced, Fenced)
    # node-1 loads node-2's copies with its own: it holds their cursors
    backlog = result(db.run_steps(load_backlog_steps, "orders", "billing", 0, 10, "node-1", 1))
    assert sorted(r.producer for r in backlog) == ["node-1", "node-1", "node-2", "node-2"]
    assert result(db.run_steps(claim_owners_steps, "node-2", [2], "node-1", ["node-1"])) == []  # once


def test_a_cursor_a_live_node_holds_is_not_taken(db):
    """node-3 took node-2's billing cursor earlier and is alive: node-1's claim leaves it."""
    result(db.run_steps(ack_deliveries_steps, [], [CursorProgress("orders", "billing", 2, 0, [])], "node-3"))
    claimed = result(db.run_steps(claim_owners_steps, "node-2", [2], "node-1", ["node-1", "node-3"]))
    assert claimed == [("orders", "audit", 1)]
    assert db.cursors[("orders", "billing", 2)].holder == "node-3"
    assert result(db.run_steps(owner_depths_steps)) == {"node-1": 6, "node-3": 2}


class FakeLock:
    """ZooKeeper's takeover lock as a takeover uses it: every call recorded."""

    calls: list[tuple[str, Any]] = []
    valid = True

    def __init__(self, client: Any, node_id: str, holder: str, cluster: str = "main"):
        self.node_id = node_id

    def try_acquire_for(self, incarnations: Any) -> list[int]:
        self.calls.append(("acquire", (self.node_id, list(incarnations))))
        return list(incarnations)

    def try_acquire_absent(self) -> bool:
        self.calls.append(("acquire absent", self.node_id))
        return True

    def still_valid(self, owners: Any = ()) -> bool:
        return self.valid

    def release(self) -> None:
        self.calls.append(("release", self.node_id))


@pytest.fixture
def takeover(db, monkeypatch) -> tuple[Takeover, Any]:
    FakeLock.calls = []
    FakeLock.valid = True
    monkeypatch.setattr(registry.takeover_lock, "TakeoverLock", FakeLock)
    store = HeldStore()
    take = Takeover(lambda fn, *args, timeout=-1.0: succeed(fn(*args)), None, db, store, "node-1", 100, lambda: True)
    return take, SimpleNamespace(store=store, rescanned=store.rescanned)


class HeldStore:
    """What a takeover asks of its reliable store (``cluster.takeover.ClusterStore``):
    incarnation 1 of node-1, the incarnations retired, the channels told to re-read."""

    incarnation = 1
    paused = False

    def __init__(self) -> None:
        self.retired: set[int] = set()
        self.rescanned: list[tuple[str, str]] = []

    def retire(self, owners):
        self.retired.update(owners)

    def rescan(self, keys):
        self.rescanned += keys


def test_a_departed_node_is_claimed_under_its_lock_and_the_channels_read_again(db, takeover):
    take, seen = takeover
    take.check({"node-1": 1})  # node-2 is gone from ZooKeeper
    assert result(take.idle()) is None
    assert take.claimed == 2 and take.claims == {"node-2": 2}
    assert seen.store.retired == {2}
    assert sorted(seen.rescanned) == [("orders", "audit"), ("orders", "billing")]
    assert FakeLock.calls == [("acquire", ("node-2", [2])), ("release", "node-2")]
    assert db.owners[2]["retired"]


def test_live_nodes_are_left_alone(db, takeover):
    take, seen = takeover
    take.check({"node-1": 1, "node-2": 2})
    assert take.claimed == 0 and FakeLock.calls == [] and not db.owners[2]["retired"]


def test_a_lock_no_longer_valid_claims_nothing(db, takeover):
    take, seen = takeover
    FakeLock.valid = False
    take.check({"node-1": 1})
    assert take.claimed == 0 and not db.owners[2]["retired"]
    assert FakeLock.calls[-1] == ("release", "node-2")


def test_a_claim_the_database_fails_releases_the_lock_and_claims_nothing(db, takeover):
    take, seen = takeover
    db.fail_next("claim_owners", "lost")
    take.check({"node-1": 1})
    assert take.claimed == 0 and seen.store.retired == set() and seen.rescanned == []
    assert FakeLock.calls[-1] == ("release", "node-2")
    take.check({"node-1": 1})  # the next check tries again
    assert take.claimed == 2


def test_a_dead_node_that_only_held_cursors_is_claimed_without_an_incarnation(db, takeover):
    take, seen = takeover
    result(db.run_steps(claim_owners_steps, "node-2", [2], "node-3", ["node-3"]))  # node-3 took node-2's
    take.check({"node-1": 1})  # and is gone too
    assert ("acquire absent", "node-3") in FakeLock.calls
    assert take.claims == {"node-3": 2}
    assert {c.holder for c in db.cursors.values()} == {"node-1"}
