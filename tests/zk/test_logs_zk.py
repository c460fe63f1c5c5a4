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
