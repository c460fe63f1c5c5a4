"""A reliable channel registered a moment ago is listed at once by every view of the
channels (nsqd lists a channel as soon as it is made): ``/stats`` in its three forms, the
console's overview and ``dmq stats``, with its depth as last counted (a number).

The server reads the registry every ``--registry-refresh`` and counts stored depths every
``--channel-state-interval``: both are an hour here, so neither timer can be what lists the
channel (each runs once, at the start); the views read the registry before answering."""

from __future__ import annotations

import json
import urllib.request

import pytest

from .support import http_get, run_cli, wait_for

pytestmark = pytest.mark.integration


def _post(url: str, body: bytes) -> str:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.read().decode()


def _get_json(url: str) -> dict:
    status, text = http_get(url)
    assert status == 200, text
    return json.loads(text)


def _depths(topics: list[dict], topic: str) -> dict[str, object]:
    (found,) = [t for t in topics if t.get("topic_name", t.get("topic")) == topic]
    return {c["channel_name"]: c.get("depth") for c in found["channels"]}


def test_a_channel_registered_a_moment_ago_is_listed_at_once(make_server, pg_dsn, topic):
    server = make_server(registry_refresh="1h", channel_state_interval="1h")
    assert _post(server.http + "/mpub?topic=orders", b"one\ntwo\nthree") == "OK"
    server.stop()
    server.start()  # the depth count's pass at the start counts billing's three
    wait_for(lambda: _depths(_get_json(server.http + "/stats?format=json")["topics"], "orders") == {"billing": 3})

    added = run_cli(pg_dsn, "channel", "add", "orders", "audit")
    assert added.returncode == 0, added.stderr
    # at once: audit with nothing counted yet, billing as last counted; numbers, as nsqd's
    nsqd = _get_json(server.http + "/stats?format=json")
    assert _depths(nsqd["topics"], "orders") == {"audit": 0, "billing": 3}
    status, text = http_get(server.http + "/stats?format=text")
    assert status == 200 and "[audit" in text
    assert _depths(_get_json(server.http + "/stats")["topics"], "orders") == {"audit": 0, "billing": 3}
    assert _depths(_get_json(server.http + "/admin/overview")["topics"], "orders") == {"audit": 0, "billing": 3}
    cli = run_cli(pg_dsn, "--http-address", f"127.0.0.1:{server.http_port}", "stats")
    assert cli.returncode == 0, cli.stderr
    lines = cli.stdout.splitlines()
    assert "  orders/audit: 0 waiting" in lines and "  orders/billing: 3 waiting" in lines  # stored
    assert "  orders/audit: 0 consumers, 0 in flight, 0 ready in memory" in lines  # the server's
