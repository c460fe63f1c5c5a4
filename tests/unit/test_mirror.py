"""The registry's mirror into the other clusters (``dmq_server.db.mirror``), over the
in-memory double: what a node routes by while a cluster an ordered topic moves away from
is out of reach, and the version that keeps a stale view from undoing a move's fence.

The same over real PostgreSQL and ZooKeeper: tests/zk/test_clusters_zk.py (a node cut
from ZooKeeper, a cluster out of reach, during ``dmq topic move``)."""

from __future__ import annotations

import dataclasses

import pytest
from twisted.internet.task import Clock

from dmq_server.db.memory import MemoryDb
from dmq_server.db.mirror import Mirror
from dmq_server.db.topic_steps import Mirrored, list_topics_steps, mirror_topics_steps
from registry.model import TopicSpec

pytestmark = pytest.mark.unit

EPOCH = 1_764_000_000_000  # a ZooKeeper registry's (/dmq/topic's ctime, ms)
ON_A = TopicSpec("orders", channels=("billing",), cluster="a", ordered=True, version=(EPOCH, 100))
MOVING = dataclasses.replace(ON_A, cluster="b", draining=("a",), version=(EPOCH, 107))
PLAIN_ON_A = TopicSpec("events", cluster="a", version=(EPOCH, 100))
PLAIN_MOVING = dataclasses.replace(PLAIN_ON_A, cluster="b", draining=("a",), version=(EPOCH, 108))


def _result(d):
    out = []
    d.addBoth(out.append)
    assert out, "the double answers at once"
    return out[0]


def _rows(db: MemoryDb) -> dict[str, TopicSpec]:
    return {spec.name: spec for spec in _result(db.run_steps(list_topics_steps))}


@pytest.fixture
def clusters():
    a, b = MemoryDb(name="a", cluster="a"), MemoryDb(name="b", cluster="b")
    return a, b, Mirror({"a": a, "b": b}, Clock())


def test_an_ordered_topic_is_routed_by_its_move_once_the_old_cluster_is_fenced(clusters):
    a, b, mirror = clusters
    assert _result(mirror.mirror([ON_A, PLAIN_ON_A])) == [ON_A, PLAIN_ON_A]
    assert _result(mirror.mirror([MOVING, PLAIN_MOVING])) == [MOVING, PLAIN_MOVING]
    assert _rows(a)["orders"].cluster == "b" and _rows(a)["orders"].version == (EPOCH, 107)  # the fence


def test_a_move_away_from_a_cluster_out_of_reach_waits_for_an_ordered_topic_only(clusters):
    a, b, mirror = clusters
    _result(mirror.mirror([ON_A, PLAIN_ON_A]))
    a.fail_next("lock_registry_mirror", "lost")
    routed = _result(mirror.mirror([MOVING, PLAIN_MOVING]))
    # the ordered topic keeps routing to a, not fenced; the other moves (its order is not promised)
    assert [(s.name, s.cluster) for s in routed] == [("orders", "a"), ("events", "b")]
    assert _rows(a)["orders"].cluster == "a" and _rows(b)["orders"].cluster == "b"
    assert _result(mirror.mirror([MOVING, PLAIN_MOVING])) == [MOVING, PLAIN_MOVING]  # a reached: fenced
    a.fail_next("lock_registry_mirror", "lost")
    assert _result(mirror.mirror([MOVING, PLAIN_MOVING])) == [MOVING, PLAIN_MOVING]  # fenced once is enough


def test_with_no_placement_routed_before_the_topic_stays_on_the_old_cluster(clusters):
    """A node that starts while the old cluster is out of reach: the topic is routed there
    alone (its sends fail until it is reached), not to the new one."""
    a, _, mirror = clusters
    a.fail_next("lock_registry_mirror", "lost")
    [routed] = _result(mirror.mirror([MOVING]))
    assert (routed.cluster, routed.draining, routed.ordered) == ("a", (), True)
    assert _result(mirror.mirror([MOVING])) == [MOVING]


def test_a_stale_view_does_not_put_back_the_placement_a_move_fenced():
    a = MemoryDb(name="a", cluster="a")
    assert _result(a.run_steps(mirror_topics_steps, [MOVING])) == Mirrored(True, added=(("orders", "billing"),))  # its channel row inserted
    assert _result(a.run_steps(mirror_topics_steps, [ON_A])) == Mirrored(True, ("orders",))
    row = _rows(a)["orders"]
    assert (row.cluster, row.draining, row.version) == ("b", ("a",), (EPOCH, 107))
    assert _result(a.run_steps(mirror_topics_steps, [MOVING])) == Mirrored(False)  # the same version: nothing to do


def test_a_registry_rebuilt_from_scratch_is_newer_than_the_one_it_replaces():
    """A ZooKeeper rebuilt and seeded again counts its transactions from 0, so its topics'
    mzxids are below the old ones; its epoch (the later creation of /dmq/topic) makes
    them newer, and a move made there reaches the rows."""
    a = MemoryDb(name="a", cluster="a")
    _result(a.run_steps(mirror_topics_steps, [MOVING]))
    rebuilt = dataclasses.replace(ON_A, cluster="c", draining=("a",), version=(EPOCH + 3_600_000, 5))
    assert _result(a.run_steps(mirror_topics_steps, [rebuilt])) == Mirrored(True)
    assert _rows(a)["orders"].cluster == "c"
    registry_less = dataclasses.replace(ON_A, version=(0, 10**6))  # the tables' own counter: older than any ZooKeeper's
    assert _result(a.run_steps(mirror_topics_steps, [registry_less])) == Mirrored(True, ("orders",))


def test_a_view_kept_while_the_registry_cannot_be_read_removes_nothing():
    """A node that cannot read ZooKeeper writes its last view again: a topic and a channel
    created since are not in it, and stay (removed, their cursors would go, and the
    channel registered again would start after its stored messages)."""
    a = MemoryDb(name="a", cluster="a")
    later = TopicSpec("later", channels=("c1",), version=(EPOCH, 200))
    grown = dataclasses.replace(ON_A, channels=("billing", "new"))
    _result(a.run_steps(mirror_topics_steps, [grown, later]))
    assert _result(a.run_steps(mirror_topics_steps, [ON_A], False)) == Mirrored(False)
    assert {name: spec.channels for name, spec in _rows(a).items()} == {"later": ("c1",), "orders": ("billing", "new")}
    _result(a.run_steps(mirror_topics_steps, [ON_A]))  # a fresh read removes
    assert {name: spec.channels for name, spec in _rows(a).items()} == {"orders": ("billing",)}
