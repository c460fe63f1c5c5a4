"""``ClusterOrderers``'s rules with every part it talks to played in memory: a lock that
answers as told, stores that record what they are told, claims that succeed or fail,
and Twisted's test clock. (tests/zk/test_orderer.py plays them with two real nodes.)

The rules: a node delivers an ordered topic only after it holds the topic's lock and has
claimed its cursors; after taking cursors from a node that left no note, it waits the
topic's message timeout; a lost lock or session stops delivery at once; claims failing
round after round make it step aside for a while; a clean stop leaves a note; a topic
that is no longer ordered gives its cursors back."""

from __future__ import annotations

from dataclasses import dataclass, field

from twisted.internet import defer
from twisted.internet.task import Clock

from dmq_server.cluster.orderers import BENCHED_FOR, STEP_ASIDE_AFTER, ClusterOrderers
from dmq_server.db.orderer_steps import Claimed

ME, OTHER = "n1", "n2"


@dataclass
class FakeLock:
    free: bool = True
    held: bool = False
    holder_id: str | None = None
    text: str = ""
    holds: int = 0

    def hold(self) -> bool:
        self.holds += 1
        if self.held:
            return True
        if self.free:
            self.held, self.free, self.holder_id = True, False, ME
        return self.held

    def release(self) -> None:
        if self.held:
            self.held, self.free, self.holder_id = False, True, None

    def holder(self) -> str | None:
        return self.holder_id

    def leave_note(self, text: str) -> None:
        self.text = text

    def note(self) -> str:
        return self.text

    def taken_by(self, node: str) -> None:
        """Another node holds it now (this node's session ended meanwhile)."""
        self.held, self.free, self.holder_id = False, False, node


@dataclass
class FakeStore:
    ordered: set[str] = field(default_factory=lambda: {"ledger"})
    timeout: float = 4.0
    calls: list[tuple] = field(default_factory=list)

    def ordered_topics(self) -> set[str]:
        return set(self.ordered)

    def order_here(self, topic: str) -> None:
        self.calls.append(("here", topic))

    def order_elsewhere(self, topic: str, orderer: str | None) -> None:
        self.calls.append(("elsewhere", topic, orderer))

    def msg_timeout_of(self, topic: str) -> float:
        return self.timeout


@dataclass
class FakeWorker:
    taken_from: frozenset[str] = frozenset()
    failing: bool = False
    ran: list[str] = field(default_factory=list)

    def run_steps(self, steps_fn, *args) -> defer.Deferred:
        self.ran.append(steps_fn.__name__)
        if self.failing:
            return defer.fail(RuntimeError("connection refused"))
        if steps_fn.__name__ in ("claim_ordered_cursors_steps", "reclaim_ordered_cursors_steps"):
            taken, self.taken_from = self.taken_from, frozenset()
            return defer.succeed(Claimed(len(taken), taken))
        return defer.succeed(0)


def zk_call(fn, *args, timeout=-1.0) -> defer.Deferred:
    try:
        return defer.succeed(fn(*args))
    except Exception as exc:
        return defer.fail(exc)


class Orderers(ClusterOrderers):
    def __init__(self, lock: FakeLock, store: FakeStore, worker: FakeWorker, clock: Clock):
        self.registered = True
        super().__init__(zk_call, None, ME, {"main": store}, {"main": worker},
                         can_order=lambda: self.registered, clock=clock)
        self.lock = lock

    def _new_lock(self, topic):
        return self.lock


def made(**worker) -> tuple[Orderers, FakeLock, FakeStore, FakeWorker, Clock]:
    lock, store, db, clock = FakeLock(), FakeStore(), FakeWorker(**worker), Clock()
    return Orderers(lock, store, db, clock), lock, store, db, clock


def test_a_free_lock_claimed_first_then_delivered_at_once():
    orderers, lock, store, db, _ = made()
    orderers.tick()
    assert lock.held and db.ran == ["claim_ordered_cursors_steps"]
    assert store.calls == [("here", "ledger")]
    assert orderers.stats()["here"] == ["ledger"]


def test_cursors_taken_from_a_node_without_a_note_wait_the_topics_message_timeout():
    orderers, lock, store, db, clock = made(taken_from=frozenset({OTHER}))
    orderers.tick()
    assert store.calls == [] and orderers.stats()["waiting"] == ["ledger"]
    clock.advance(store.timeout - 0.1)
    assert store.calls == []
    clock.advance(0.1)
    assert store.calls == [("here", "ledger")]


def test_a_note_of_the_node_that_let_go_cleanly_means_no_wait_and_is_cleared():
    orderers, lock, store, db, _ = made(taken_from=frozenset({OTHER}))
    lock.text = OTHER
    orderers.tick()
    assert store.calls == [("here", "ledger")]
    assert lock.text == ""


def test_a_note_of_another_node_does_not_excuse_the_one_it_took_from():
    orderers, lock, store, db, _ = made(taken_from=frozenset({OTHER}))
    lock.text = "n3"
    orderers.tick()
    assert store.calls == []


def test_another_node_holding_the_lock_is_named_to_the_stores_once():
    orderers, lock, store, db, _ = made()
    lock.taken_by(OTHER)
    orderers.tick()
    orderers.tick()
    assert store.calls == [("elsewhere", "ledger", OTHER)]
    assert db.ran == []


def test_a_lock_lost_stops_delivery_and_names_the_new_holder():
    orderers, lock, store, db, _ = made()
    orderers.tick()
    lock.taken_by(OTHER)
    orderers.tick()
    assert store.calls == [("here", "ledger"), ("elsewhere", "ledger", None), ("elsewhere", "ledger", OTHER)]
    assert orderers.stats()["here"] == [] and orderers.stats()["lost"] == 1


def test_a_lost_session_stops_delivery_at_once_and_cancels_a_wait():
    orderers, lock, store, db, clock = made(taken_from=frozenset({OTHER}))
    orderers.tick()
    orderers.session_lost()
    clock.advance(60)
    assert store.calls == [("elsewhere", "ledger", None)]


def test_claims_again_every_round_and_steps_aside_after_failing_rounds():
    orderers, lock, store, db, clock = made()
    orderers.tick()
    orderers.tick()
    # the first half (opening cursors) on the gain only
    assert db.ran == ["claim_ordered_cursors_steps", "reclaim_ordered_cursors_steps"]
    db.failing = True
    for _ in range(STEP_ASIDE_AFTER - 1):
        orderers.tick()
        assert lock.held
    orderers.tick()
    assert not lock.held and store.calls[-1] == ("elsewhere", "ledger", None)
    holds = lock.holds
    clock.advance(BENCHED_FOR - 1)
    orderers.tick()
    assert lock.holds == holds  # benched: it leaves the topic to the others
    db.failing = False
    clock.advance(1)
    orderers.tick()
    assert lock.held and store.calls[-1] == ("here", "ledger")


def test_a_failed_first_claim_lets_the_lock_go():
    orderers, lock, store, db, clock = made(failing=True)
    orderers.tick()
    assert not lock.held and store.calls == []
    assert orderers.stats()["here"] == []


def test_a_clean_stop_leaves_a_note_and_releases():
    orderers, lock, store, db, _ = made()
    orderers.tick()
    done = defer.ensureDeferred(orderers.stop())
    assert done.called
    assert lock.text == ME and not lock.held
    assert store.calls[-1] == ("elsewhere", "ledger", None)


def test_a_topic_no_longer_ordered_gives_its_cursors_back():
    orderers, lock, store, db, _ = made()
    orderers.tick()
    store.ordered.clear()
    orderers.tick()
    assert db.ran[-1] == "release_ordered_cursors_steps"
    assert not lock.held and orderers.stats()["here"] == []


def test_nothing_is_contended_while_the_node_may_not_order():
    orderers, lock, store, db, _ = made()
    orderers.registered = False
    orderers.tick()
    assert lock.holds == 0 and store.calls == []
