"""kazoo's own log lines (Python ``logging``) come out of a cluster node in dmq's log
format: ``--log-format json`` makes them JSON objects with the node id, like dmq's."""

from __future__ import annotations

import json

import pytest

from tests.integration.support import wait_for

pytestmark = pytest.mark.zk


def test_kazoo_lines_are_json_with_the_node_id(make_node):
    node = make_node(log_format="json")

    def kazoo_lines() -> list[dict]:
        records = [json.loads(line) for line in node.log_path.read_text().splitlines()
                   if line.startswith("{")]
        return [r for r in records if r["logger"].startswith("kazoo")]

    lines = wait_for(kazoo_lines)
    assert all(r["node_id"] == node.flags["node_id"] for r in lines)
    assert any("connect" in r["message"].lower() for r in lines), lines
    # every line of the log is JSON but the ready banner (stdout)
    others = [line for line in node.log_path.read_text().splitlines() if not line.startswith("{")]
    assert others[0] == "dmq is ready" and all(line.startswith("  ") for line in others[1:]), others


def test_any_node_lists_every_live_node_from_the_registry(make_node):
    """The console's nodes page (GET /admin/nodes) on either node of a cluster shows both,
    from ZooKeeper, with heartbeats; and a node that stops leaves the list."""
    import urllib.request

    first, second = make_node(), make_node()

    def nodes(node) -> dict:
        with urllib.request.urlopen(node.http + "/admin/nodes", timeout=5) as reply:
            return json.load(reply)

    listed = wait_for(lambda: (n := nodes(first)) and len(n["nodes"]) == 2 and n)
    assert listed["cluster"] is True and listed["zk_state"] == "CONNECTED"
    by_id = {n["node_id"]: n for n in listed["nodes"]}
    assert set(by_id) == {first.flags["node_id"], second.flags["node_id"]}
    assert by_id[first.flags["node_id"]]["this"] and by_id[first.flags["node_id"]]["health"] == "OK"
    assert by_id[second.flags["node_id"]]["tcp_address"].endswith(f":{second.tcp_port}")
    assert all(n["heartbeat_age"] is not None and n["heartbeat_age"] < 60 for n in listed["nodes"])
    assert {n["node_id"] for n in nodes(second)["nodes"]} == set(by_id)
    second.stop()
    wait_for(lambda: [n["node_id"] for n in nodes(first)["nodes"]] == [first.flags["node_id"]], timeout=30)
