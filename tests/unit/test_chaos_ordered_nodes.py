"""The ordered chaos harness across nodes (tests/chaos/ordered.py): a node's kill ends only
the pushes that came through that node (the other nodes' consumers keep theirs, so a push
of the key elsewhere meanwhile is still an overlap); the producers start spread over the
nodes, each on its own keys; pushes are counted per node; an orderer's node id is found
among the cluster's."""

from __future__ import annotations

import random

from tests.chaos.checker import History
from tests.chaos.ordered import (CHANNELS, KEYS, Attempt, check_order, key_history, keyed_producers, node_index,
                                 pushes_per_node)

SENDS = {"k": [(1, 0.0), (2, 0.1), (3, 0.2)]}


def _push(mid: int, at: float, end: float, how: str = "ack", *, node: str, consumer: str = "c0") -> Attempt:
    return Attempt("a", consumer, mid, "k", 1, at, end, how, node=node)


def _count(attempts: list[Attempt], node_kills: dict[str, list[float]] | None = None):
    return check_order(SENDS, attempts, [], ["a"], node_kills=node_kills)["a"]


# the orderer n1 pushed 1 and was killed at 1.2; its consumer saw the connection go at 3.0.
# n2, the next orderer, pushed 1 again at 2.0, then 2 and 3
HANDOVER = [_push(1, 1.0, 3.0, "connection lost", node="n1"), _push(1, 2.0, 2.1, node="n2", consumer="c1"),
            _push(2, 2.2, 2.3, node="n2", consumer="c1"), _push(3, 2.4, 2.5, node="n2", consumer="c1")]


def test_a_nodes_kill_ends_the_pushes_that_came_through_it():
    assert _count(HANDOVER, {"n1": [1.2]}).ok()
    # not recorded, 1's first push counts as out until 3.0: pushed again while held
    unrecorded = _count(HANDOVER)
    assert len(unrecorded.same_id_overlaps) == 1 and not unrecorded.ok()


def test_another_nodes_kill_leaves_a_push_out():
    """n2 killed at 1.2 ends nothing of n1's: its consumer held 1 until its ack at 3.0, so
    n2 pushing 2 at 2.2 (after a takeover, say) is an overlap."""
    attempts = [_push(1, 1.0, 3.0, node="n1"), _push(2, 2.2, 2.3, node="n2", consumer="c1"),
                _push(3, 3.1, 3.2, node="n2", consumer="c1")]
    c = _count(attempts, {"n2": [1.2]})
    assert len(c.overlaps) == 1 and "id 2 pushed to c1" in c.overlaps[0]
    assert _count(attempts, {"n1": [1.2]}).ok()  # n1's own kill would have ended it
    # a kill before the push ends nothing either
    assert not _count(attempts, {"n1": [0.5]}).ok()


def test_a_key_history_shows_the_node_kills():
    lines = key_history(SENDS, HANDOVER, [], "a", "k", node_kills={"n1": [1.2]})
    assert "node n1 killed (-9)" in lines[4] and lines[4].strip().startswith("+1.200 s")
    assert "id 1 pushed to c1" in lines[5]


def test_producers_start_spread_over_the_nodes_each_on_its_own_keys():
    addresses = [("127.0.0.1", 4150 + n) for n in range(3)]
    producers = keyed_producers(lambda: addresses, "t", History(CHANNELS), random.Random(0), producers=4, rate=10)
    assert [p.node for p in producers] == [0, 1, 2, 0]
    keys = [set(p._free) for p in producers]
    assert sum(len(k) for k in keys) == KEYS and len(set().union(*keys)) == KEYS
    # a failover moves it on to the next node, in turn (what Producer does with _next)
    producers[2]._next += 1
    assert producers[2].node == 0
    single = keyed_producers(lambda: addresses[:1], "t", History(CHANNELS), random.Random(0), producers=3, rate=10)
    assert [p.node for p in single] == [0, 0, 0]


def test_pushes_per_node_and_node_index():
    assert pushes_per_node(HANDOVER + [Attempt("b", "c2", 1, "k", 1, 1.0, node="n2")]) == {
        "a": {"n1": 1, "n2": 3}, "b": {"n2": 1}}
    ids = ["node1", "node2", "node3"]
    assert node_index(ids, "node2") == 1
    assert node_index(ids, None) is None and node_index(ids, "node9") is None


# an ordered topic moved from cluster b (id slot 1) to main (slot 0): the key's later
# messages have lower ids; its commit order is the order its producer was acknowledged in
B = 1 << 48
MOVED = {"k": [(B + 5, 0.0), (B + 9, 0.1), (3, 0.2), (4, 0.3)]}


def _moved(attempts: list[Attempt]):
    return check_order(MOVED, attempts, [], ["a"])["a"]


def test_across_a_move_first_deliveries_follow_the_acks_not_the_ids():
    in_order = [_push(B + 5, 1.0, 1.1, node="n1"), _push(B + 9, 1.2, 1.3, node="n1"), _push(3, 1.4, 1.5, node="n1"),
                _push(4, 1.6, 1.7, node="n1")]
    assert _moved(in_order).ok()
    # main's copy pushed before b's last one: lower id, but committed later
    early = [in_order[0], _push(3, 1.2, 1.3, node="n1"), _push(B + 9, 1.4, 1.5, node="n1"), in_order[3]]
    c = _moved(early)
    assert len(c.order_violations) == 1 and not c.ok()
    # within one cluster ids still order the commits: acks out of id order on b break the premise
    swapped = {"k": [(B + 9, 0.0), (B + 5, 0.1)]}
    assert any("not in id order" in v for v in check_order(swapped, [], [], ["a"])["a"].order_violations)


def test_across_a_move_a_copy_let_go_comes_back_before_the_next_in_commit_order():
    # b's B+9 let go unacknowledged (its consumer killed); main's 3 went first: passed
    passed = [_push(B + 5, 1.0, 1.1, node="n1"), _push(B + 9, 1.2, 1.3, "consumer killed", node="n1"),
              _push(3, 1.4, 1.5, node="n1", consumer="c1"), _push(B + 9, 1.6, 1.7, node="n1", consumer="c1"),
              _push(4, 1.8, 1.9, node="n1")]
    assert len(_moved(passed).passed) == 1
    # B+5, acked before B+9 was pushed, coming back first is an earlier message coming back (its
    # ack died with the node): allowed; and B+9 came back with later messages stored
    back = [_push(B + 5, 1.0, 1.1, node="n1"), _push(B + 9, 1.2, 1.3, "connection lost", node="n1"),
            _push(B + 5, 1.4, 1.5, node="n2"), _push(B + 9, 1.6, 1.7, node="n2"), _push(3, 1.8, 1.9, node="n2"),
            _push(4, 2.0, 2.1, node="n2")]
    c = check_order(MOVED, back, [], ["a"], node_kills={"n1": [1.25]})["a"]
    assert c.ok() and c.redelivered_ahead == 2
