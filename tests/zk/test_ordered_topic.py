"""An ordered topic in a cluster (issue 45 §2): `dmq --zk ... topic create --ordered` and
`topic update --no-ordered / --ordered` write the setting into the topic's znode, and the
nodes mirror it into PostgreSQL and hand it to their reliable store with the topic's other
settings (what /admin/topics shows is the broker's registry cache, the store's topics)."""

from __future__ import annotations

import json

from registry import paths
from registry.zk import ZkRegistry
from tests.integration.support import db_rows, run_cli, wait_for

from .helpers import http_get


def _ordered_on_node(node) -> dict:
    status, body = http_get(node.http + "/admin/topics")
    assert status == 200, body
    return {t["name"]: t["ordered"] for t in json.loads(body)["topics"]}


def test_an_ordered_topic_travels_through_zookeeper_to_the_nodes(pg_dsn, zk, zk_address, make_node):
    out = run_cli(pg_dsn, "--zk", zk_address, "topic", "create", "orders", "--ordered", "--max-attempts", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "created ordered topic orders"
    run_cli(pg_dsn, "--zk", zk_address, "topic", "create", "plain").check_returncode()
    data, _ = zk.get(paths.topic("orders"))
    assert json.loads(data)["ordered"] is True
    assert ZkRegistry(zk).get_topic("orders").ordered and not ZkRegistry(zk).get_topic("plain").ordered

    node = make_node()
    wait_for(lambda: db_rows(pg_dsn, "SELECT name, ordered FROM dmq_topic ORDER BY name")
             == [("orders", True), ("plain", False)], 20)
    wait_for(lambda: _ordered_on_node(node) == {"orders": True, "plain": False}, 20)

    out = run_cli(pg_dsn, "--zk", zk_address, "topic", "update", "orders", "--no-ordered")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "updated topic orders: ordered on -> off"
    spec = ZkRegistry(zk).get_topic("orders")
    assert (spec.ordered, spec.max_attempts) == (False, 2)
    run_cli(pg_dsn, "--zk", zk_address, "topic", "update", "plain", "--ordered").check_returncode()
    wait_for(lambda: db_rows(pg_dsn, "SELECT name, ordered, max_attempts FROM dmq_topic ORDER BY name")
             == [("orders", False, 2), ("plain", True, None)], 20)
    wait_for(lambda: _ordered_on_node(node) == {"orders": False, "plain": True}, 20)


def test_a_fast_topic_in_zookeeper_cannot_be_ordered(pg_dsn, zk, zk_address):
    out = run_cli(pg_dsn, "--zk", zk_address, "topic", "create", "clicks", "--store", "fast", "--ordered")
    assert out.returncode == 1 and "only a reliable topic can be ordered" in out.stderr, out
    assert zk.exists(paths.topic("clicks")) is None
    run_cli(pg_dsn, "--zk", zk_address, "topic", "create", "clicks", "--store", "fast").check_returncode()
    out = run_cli(pg_dsn, "--zk", zk_address, "topic", "update", "clicks", "--ordered")
    assert out.returncode == 2 and "only a reliable topic can be ordered" in out.stderr, out
    assert not ZkRegistry(zk).get_topic("clicks").ordered
