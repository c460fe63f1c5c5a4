"""An ordered topic moved between two PostgreSQL clusters keeps each key's order
(``broker.placement.move_held``): per key, every copy stored on the old cluster goes out
before any copy stored on the new one, though the new cluster's ids are lower. The
broker with a reliable store per cluster on in-memory databases (ids in each cluster's
slot) and a ``task.Clock``; tests/integration/test_ordered_move.py does the same on two
real PostgreSQL servers with ``dmq topic move`` under load."""

from __future__ import annotations

from dmq_client.wire.properties import Properties, encode_properties
from dmq_server.broker.placement import move_held
from dmq_server.core.publish import Published, PublishRequest, Send
from registry.model import TopicSpec
from tests.unit.test_broker import Consumer
from tests.unit.test_placement import TwoClusters

TOPIC = "ledger"


def test_the_rule_holds_the_new_cluster_of_an_ordered_topic_while_an_older_one_drains():
    assert move_held(TopicSpec(TOPIC, cluster="b", draining=("main",), ordered=True)) == "b"
    assert move_held(TopicSpec(TOPIC, cluster="b", draining=("a", "main"), ordered=True)) == "b"
    assert move_held(TopicSpec(TOPIC, cluster="b", draining=(), ordered=True)) is None  # drained
    assert move_held(TopicSpec(TOPIC, cluster="b", draining=("b",), ordered=True)) is None  # itself only
    assert move_held(TopicSpec(TOPIC, cluster="b", draining=("main",))) is None  # unordered: unchanged


class OrderedMove(TwoClusters):
    """``ledger``, ordered, on cluster b with channel ``c``, to be moved to main, whose ids
    are lower (slot 0): in id order the new copies would go first. Keyed sends, each key's
    next one only after the previous one is answered (as a producer of an ordered topic
    sends)."""

    def __init__(self, ordered: bool = True) -> None:
        super().__init__()
        for db in (self.db, self.b):
            db.create_topic(TOPIC, ["c"], cluster="b", ordered=ordered)
        self.broker.refresh_registry()
        self.settle()
        self.keys: dict[int, str | None] = {}  # message id -> key

    def send_keyed(self, session_id: int, key: str | None) -> int:
        props = Properties(key) if key is not None else Properties()
        send = Send(topic=TOPIC, producer="p", session_id=session_id, body=b"%d" % session_id,
                    properties=props, status=encode_properties(props))
        answers: list[object] = []
        self.broker.publish(PublishRequest(topic=TOPIC, producer="p", sends=[send]), answers.append)
        self.settle(0.05)
        assert answers and isinstance(answers[0], Published), answers
        self.keys[answers[0].message_id] = key
        return answers[0].message_id

    def ack_pushed(self, consumer: Consumer, done: int) -> int:
        """Ack every copy pushed from ``done`` on; how many were pushed by then."""
        new = consumer.pushed[done:]
        for _, message_id in new:
            assert self.broker.ack(TOPIC, "c", message_id, consumer) is None
        self.settle(0.2)
        return done + len(new)


def test_keyed_copies_of_the_new_cluster_wait_until_the_old_one_is_drained():
    """Keys a and b have copies on b, then on main (lower ids): while b drains, main's
    channel pushes nothing, not even once b's copies are all acknowledged; once b leaves
    ``draining`` main's copies go out, so per key b's come first. Nothing is lost."""
    h = OrderedMove()
    consumer = Consumer(credit=100)
    h.subscribe(TOPIC, "c", consumer)
    old = [h.send_keyed(i, k) for i, k in enumerate(["a", "b", "a", "b"])]
    h.place(TOPIC, "main", ("b",))
    new = [h.send_keyed(10 + i, k) for i, k in enumerate(["a", "b", "a", None])]
    assert all(m >> 48 == 1 for m in old) and all(m >> 48 == 0 for m in new)
    done = 0
    for _ in range(6):  # b's copies drain, one of a key at a time
        done = h.ack_pushed(consumer, done)
    pushed = [mid for _, mid in consumer.pushed]
    assert sorted(pushed) == sorted(old)  # main holds everything while b drains
    assert not h.b.deliveries  # b is drained: only the move's last step is left
    assert list(h.broker.placement.move_holds) == [(TOPIC, "c")]
    h.place(TOPIC, "main", ())
    for _ in range(6):
        done = h.ack_pushed(consumer, done)
    pushed = [mid for _, mid in consumer.pushed]
    assert sorted(pushed) == sorted(old + new)  # none lost, none twice
    assert not h.db.deliveries and not h.broker.placement.move_holds
    for key in ("a", "b"):
        of_key = [m for m in pushed if h.keys[m] == key]
        assert of_key == [m for m in old if h.keys[m] == key] + [m for m in new if h.keys[m] == key], key


def test_an_unordered_topic_delivers_both_clusters_at_once():
    """The same move of a topic that is not ordered: main's copies go out while b drains
    (as before the rule)."""
    h = OrderedMove(ordered=False)
    consumer = Consumer(credit=100)
    h.subscribe(TOPIC, "c", consumer)
    old = [h.send_keyed(i, "a") for i in range(3)]
    h.place(TOPIC, "main", ("b",))
    new = [h.send_keyed(10 + i, "a") for i in range(3)]
    h.settle()
    assert sorted(mid for _, mid in consumer.pushed) == sorted(old + new)
    assert not h.broker.placement.move_holds


def test_a_channel_subscribed_during_the_move_is_held_too():
    """A consumer that attaches while b drains (the group made only then) gets b's copies
    first and main's once b leaves ``draining``."""
    h = OrderedMove()
    old = [h.send_keyed(i, "a") for i in range(2)]
    h.place(TOPIC, "main", ("b",))
    new = [h.send_keyed(10 + i, "a") for i in range(2)]
    consumer = Consumer(credit=100)
    h.subscribe(TOPIC, "c", consumer)
    done = 0
    for _ in range(4):
        done = h.ack_pushed(consumer, done)
    assert [mid for _, mid in consumer.pushed] == old
    h.place(TOPIC, "main", ())
    for _ in range(4):
        done = h.ack_pushed(consumer, done)
    assert [mid for _, mid in consumer.pushed] == old + new
