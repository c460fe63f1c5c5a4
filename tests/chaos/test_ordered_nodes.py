"""Per-key order across nodes (issue 45, "What must hold"): an ordered topic on three dmq
nodes (ZooKeeper, Patroni, the fault proxies: ``ChaosCluster``) with 1,000 keys, four
producers spread over the nodes, two consumers of each of two channels on every node.
Per channel and key: 0 lost, first deliveries in commit (ack) order, never two messages
of a key out at once (a node's kill ends the copies out through it only), no copy pushed
again while still held. ``tests/chaos/ordered_nodes.py`` says what each run does:

* **faults**: a consumer of the orderer killed, two paused; the orderer killed -9 (and
  started again); a node that stores but does not order killed -9; the orderer frozen
  with SIGSTOP past its ZooKeeper session, then woken. Each handover moves the lock and
  the new orderer pushes after the handover wait (the topic's message timeout,
  ``MSG_TIMEOUT``: 4 s); the woken orderer pushes nothing more.
* **move**: the topic moved from PostgreSQL cluster b (a private PostgreSQL, every node's
  ``--pg-cluster``) to main, whose ids are lower, with ``dmq topic move`` under load.

About two minutes with the cluster's start. Run alone:
``.venv/bin/python -m pytest tests/chaos/test_ordered_nodes.py``. A failure's report, the
histories of its keys and every node's log go to ``chaos-failures/``
(``DMQ_CHAOS_FAILURES`` names another folder).
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dmq_server.db.embedded import EmbeddedPostgres
from tests.integration.support import db_rows

from . import conftest, ordered, ordered_nodes
from .cluster import ChaosCluster
from .ordered_nodes import MSG_TIMEOUT, handovers
from .test_scenarios import _keep_failure

TIMING = ordered_nodes.NodesTiming()
# the move: twice the rate, so that most keys have copies on both clusters
MOVE_TIMING = ordered_nodes.NodesTiming(rate=100.0, move_at=8.0, after_move=8.0)


@pytest.fixture(scope="module")
def b_cluster() -> Iterator[str]:
    """A private PostgreSQL, the nodes' cluster ``b``: its DSN."""
    from dmq_server.db.schema import migrate

    path = Path(tempfile.mkdtemp(prefix="dmq-chaos-b-"))
    path.chmod(0o755)
    pg = EmbeddedPostgres(path)
    try:
        dsn = pg.start()
        migrate(dsn)
        yield dsn
    finally:
        try:
            pg.stop(mode="immediate")
        finally:
            if pg.is_running():
                pg.kill()
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(b_cluster: str) -> Iterator[ChaosCluster]:
    nodes = ChaosCluster(flags={"pg_cluster": f"b={b_cluster}"}).start()
    try:
        yield nodes
    finally:
        nodes.close()


def _topic(cluster: ChaosCluster, name: str, pg_cluster: str = "main") -> str:
    topic = f"chaos_ordered_nodes_{name}_{uuid.uuid4().hex[:6]}"
    cluster.register_topic(topic, ordered.CHANNELS, msg_timeout_ms=int(MSG_TIMEOUT * 1000), ordered=True,
                           pg_cluster=pg_cluster)
    return topic


class Played:
    """One run's outcome as the test reads it: the records, the counts, the report."""

    def __init__(self, out: ordered.OrderedRun, started: float):
        self.out = out
        self.orders, self.counts = ordered.count(out)
        self.sent = sum(len(v) for v in out.sends.values())
        self.text = (ordered.format_report(out, self.orders, self.counts)
                     + f"\n  took {time.monotonic() - started:.1f} s")
        conftest.REPORTS.append(self.text)
        print(self.text)

    def check_order(self) -> None:
        """Drained, and no rule of ``ordered`` broken on either channel; the rule held
        messages back behind their key."""
        assert self.out.drained and not self.out.failures, self.text
        assert ordered.broken_rules(self.orders, self.counts, self.sent) == {}, self.text
        assert all(o.waited > 100 for o in self.orders.values()), self.text
        assert ordered.ok(self.out, self.orders, self.counts), self.text


@contextmanager
def _scenario(cluster: ChaosCluster, name: str) -> Iterator[list[Played]]:
    """Around one run: a failure's whole story kept (the report, the histories of the
    keys that broke a rule, every node's log), the cluster restored after."""
    played: list[Played] = []
    try:
        yield played
    except BaseException:
        text = played[0].text + "\n" + _histories(played[0].out) if played else ""
        kept = _keep_failure(cluster, f"ordered-nodes-{name}", text)
        print(f"the whole failure is kept in {kept}")
        raise
    finally:
        cluster.restore()


def test_per_key_order_across_nodes_under_kills_and_a_frozen_orderer(cluster):
    with _scenario(cluster, "faults") as played:
        started = time.monotonic()
        out = ordered_nodes.run_faults(cluster, _topic(cluster, "faults"), TIMING)
        run = Played(out, started)
        played.append(run)
        assert run.sent > 3000 and len(out.sends) > 900, run.text  # the load ran, over (nearly) every key
        assert out.notes["held_at_consumer_kill"] > 0 and out.notes["held_at_pause"] > 1, run.text
        assert out.notes["held_across_freeze"] > 1, run.text  # copies out at the frozen orderer's consumers
        assert all(n > 0 for n in out.notes["out_at_orderer_kill"].values()), run.text
        # two handovers, each a move of the lock to another node, which then waited out
        # the topic's message timeout before its first push (the killed and the frozen
        # orderer's consumers may have held copies)
        moves = handovers(out)
        assert len(moves) == 2 and all(m["from"] != m["to"] for m in moves), run.text
        assert all(m["first_push_after_lock_s"] >= MSG_TIMEOUT - 1.5 for m in moves), run.text
        assert out.notes["pushed_by_woken_orderer"] == 0, run.text
        assert all(len(nodes) >= 2 for nodes in ordered.pushes_per_node(out.attempts).values()), run.text
        assert run.orders["billing"].redelivered_ahead > 0, run.text  # the killed consumer's copy came back first
        run.check_order()


def test_per_key_order_across_nodes_through_a_move_to_another_postgresql(cluster, b_cluster):
    with _scenario(cluster, "move") as played:
        started = time.monotonic()
        topic = _topic(cluster, "move", pg_cluster="b")
        b_slot = db_rows(cluster.direct_dsn, "SELECT slot FROM dmq_cluster WHERE name = 'b'")[0][0]
        assert b_slot > 0
        out = ordered_nodes.run_move(cluster, b_cluster, b_slot, topic, MOVE_TIMING)
        run = Played(out, started)
        played.append(run)
        assert run.sent > 4000 and len(out.sends) > 900, run.text
        assert all(n > 1000 for n in out.notes["sends_per_cluster"].values()), run.text
        assert out.notes["keys_on_both_clusters"] > 300, run.text  # keys whose later copies have lower ids
        assert any("is on cluster main" in line for line in out.notes["move_output"]), run.text
        assert db_rows(cluster.direct_dsn, "SELECT cluster, draining FROM dmq_topic WHERE name = %s",
                       topic) == [("main", [])], run.text
        run.check_order()


def _histories(out: ordered.OrderedRun) -> str:
    """Every problem found, and the whole history of each key that broke a rule (at most
    20 a channel)."""
    parts = []
    orders = ordered.check_order(out.sends, out.attempts, out.kills, ordered.CHANNELS, out.origin, out.node_kills)
    for channel, o in orders.items():
        parts.append(f"=== {channel}: every problem found\n" + "\n".join(o.problems()))
        for key in o.bad_keys[:20]:
            lines = ordered.key_history(out.sends, out.attempts, out.kills, channel, key, out.origin, out.node_kills)
            parts.append(f"=== {channel} {key} (seconds from the run's start)\n" + "\n".join(lines))
    return "\n\n".join(parts)
