"""The admin surfaces with two PostgreSQL clusters: dead letters (list, show, replay,
delete), the delay view and the message trace find what is stored on another cluster
than main, from the CLI and the HTTP admin API, with a ``cluster`` filter or in every
cluster."""

from __future__ import annotations

import json
import urllib.request

import pytest

from dmq_client.wire import Command

from .test_clusters import cli, drain, two_clusters  # noqa: F401 (a fixture)
from .support import wait_for
from .test_delay_flow import now_ms, send_delayed

pytestmark = pytest.mark.integration


def admin(server, path: str, method: str = "GET") -> dict:
    request = urllib.request.Request(server.http + path, method=method)
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.load(resp)


def metrics(server) -> str:
    with urllib.request.urlopen(server.http + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def test_dead_letters_delays_and_traces_of_another_cluster(two_clusters):  # noqa: F811
    server, main_dsn, b_dsn, _ = two_clusters
    assert cli(main_dsn, b_dsn, "topic", "create", "limited", "--cluster", "b", "--rate-limit", "1").returncode == 0
    assert cli(main_dsn, b_dsn, "channel", "add", "limited", "c1").returncode == 0
    with server.client() as producer:
        replies = [producer.send("limited", b"m%d" % i) for i in range(5)]
        delayed = send_delayed(producer, "remote", b"later", now_ms() + 3_600_000)
        stored = producer.send("remote", b"now")
    refused = [r for r in replies if r.command == Command.SEND_EXCEED_LIMIT_ACK]
    assert len(refused) >= 3 and delayed.command == Command.SEND_SUCCESS_ACK
    assert delayed.message_id >> 48 == 1  # the delay entry's id: cluster b's slot

    # the CLI: every cluster given, or one
    listed = json.loads(cli(main_dsn, b_dsn, "dlq", "list", "--json").stdout)
    assert len(listed) == len(refused) and {r["cluster"] for r in listed} == {"b"}
    assert all(r["id"] >> 48 == 1 and r["reason"] == "rate_limited" for r in listed)
    assert json.loads(cli(main_dsn, b_dsn, "dlq", "list", "--cluster", "main", "--json").stdout) == []
    shown = json.loads(cli(main_dsn, b_dsn, "dlq", "show", str(listed[0]["id"])).stdout)
    assert shown["topic"] == "limited"
    out = cli(main_dsn, b_dsn, "delay", "stats", "--json")
    assert json.loads(out.stdout)["clusters"]["b"]["pending"] == 1, out.stderr
    trace = cli(main_dsn, b_dsn, "trace", str(stored.message_id))
    assert f"message {stored.message_id} on topic remote" in trace.stdout, trace.stdout + trace.stderr

    # the HTTP admin API: a cluster filter, every cluster, an id that names its cluster
    api = admin(server, "/admin/dead-letters?cluster=b")["dead_letters"]
    assert [r["id"] for r in api] == [r["id"] for r in listed]
    assert admin(server, "/admin/dead-letters?cluster=main")["dead_letters"] == []
    assert admin(server, f"/admin/dead-letters/{listed[0]['id']}")["topic"] == "limited"
    assert admin(server, f"/admin/messages/{stored.message_id}")["topic"] == "remote"
    placed = {t["name"]: t["cluster"] for t in admin(server, "/admin/topics")["topics"]}
    assert placed == {"limited": "b", "local": "main", "remote": "b"}
    overview = {t["topic"]: t.get("cluster") for t in admin(server, "/admin/overview")["topics"]}
    assert overview["remote"] == "b"  # what the console shows ("reliable on b")
    # /metrics' stored gauges are read from every cluster (on a timer: wait for a read)
    wait_for(lambda: f'dmq_dead_letters_stored{{reason="rate_limited"}} {float(len(refused))}' in metrics(server))
    assert 'dmq_delay_pending{topic="remote"} 1.0' in metrics(server)
    delays = admin(server, "/admin/delay")
    assert delays["pending"] == 1 and delays["clusters"]["b"]["pending"] == 1

    # replay (limit lifted) delivers them on b; delete removes them there
    assert cli(main_dsn, b_dsn, "topic", "update", "limited", "--rate-limit", "none").returncode == 0
    out = cli(main_dsn, b_dsn, "dlq", "replay", "--cluster", "b", "--all")
    assert f"replayed {len(refused)} dead letters" in out.stdout, out.stdout + out.stderr
    accepted = len(replies) - len(refused)
    assert len(drain(server, "limited", "c1", accepted + len(refused))) == accepted + len(refused)
    out = cli(main_dsn, b_dsn, "dlq", "delete", "--all")
    assert "cluster b:" in out.stdout and f"deleted {len(refused)} dead letters" in out.stdout, out.stdout
    assert json.loads(cli(main_dsn, b_dsn, "dlq", "list", "--json").stdout) == []
