"""`dmq --zk ... topic update` changes a cluster topic's settings in ZooKeeper, and
the nodes mirror them into PostgreSQL (what their group commit and limits read),
without the topic or its channels going away."""

from __future__ import annotations


from registry.zk import ZkRegistry
from tests.integration.support import db_rows, run_cli, wait_for

from .helpers import register_topic



def test_topic_update_in_a_cluster_reaches_the_nodes(pg_dsn, zk, zk_address, make_node):
    register_topic(zk, "orders", "billing", rate_limit=100)
    make_node()
    wait_for(lambda: db_rows(pg_dsn, "SELECT rate_limit FROM dmq_topic WHERE name = 'orders'") == [(100,)], 20)

    out = run_cli(pg_dsn, "--zk", zk_address, "topic", "update", "orders", "--rate-limit", "7", "--max-attempts", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "updated topic orders: rate_limit 100 -> 7, max_attempts none -> 2"
    spec = ZkRegistry(zk).get_topic("orders")
    assert (spec.rate_limit, spec.max_attempts, spec.channels) == (7, 2, ("billing",))
    wait_for(
        lambda: db_rows(pg_dsn, "SELECT rate_limit, max_attempts FROM dmq_topic WHERE name = 'orders'") == [(7, 2)],
        20,
    )
    assert db_rows(pg_dsn, "SELECT topic, name FROM dmq_channel") == [("orders", "billing")]

    out = run_cli(pg_dsn, "--zk", zk_address, "topic", "update", "nosuch", "--rate-limit", "7")
    assert out.returncode == 1 and "no such topic 'nosuch'" in out.stderr
