"""nsqlookupd's API answered for the whole cluster, and an unchanged pynsq consumer
that finds every node through one node's HTTP port."""

from __future__ import annotations

import asyncio
import json
import urllib.request


from tests.integration.support import db_rows, http_get, wait_for

from .helpers import register_topic

import nsq  # noqa: E402  (the dev extra installs it; a missing client is an error, not a skip)
from tornado.ioloop import IOLoop  # noqa: E402



def get_json(url: str) -> tuple[int, dict]:
    status, body = http_get(url)
    return status, json.loads(body)


def http_pub(node, topic: str, body: bytes) -> str:
    request = urllib.request.Request(
        f"{node.http}/pub?topic={topic}", data=body, method="POST", headers={"Content-Type": "application/octet-stream"}
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        return resp.read().decode()


def ports(producers: list[dict]) -> set[int]:
    return {p["tcp_port"] for p in producers}


def test_lookup_answers_for_the_whole_cluster(make_node, zk):
    """Any node's /lookup lists every live node for a reliable topic, and only the
    nodes that have it for a fast (NSQ) topic; /topics, /channels and /nodes cover the
    cluster; a node that stops disappears from the answers."""
    register_topic(zk, "orders", "billing")
    nodes = [make_node() for _ in range(3)]
    everyone = {n.tcp_port for n in nodes}
    for node in nodes:
        # a node learns of the ones started after it through a ZooKeeper watch, a moment later

        def sees_everyone(node=node):
            status, answer = get_json(node.http + "/lookup?topic=orders")
            return status == 200 and ports(answer["producers"]) == everyone and answer

        answer = wait_for(sees_everyone, timeout=10)
        assert answer["channels"] == ["billing"]

    assert http_pub(nodes[1], "clicks", b"x") == "OK"  # a fast topic, on node 1 only
    urllib.request.urlopen(
        urllib.request.Request(f"{nodes[1].http}/channel/create?topic=clicks&channel=stats", method="POST"),
        timeout=10,
    ).read()

    def fast_lookup():
        status, answer = get_json(nodes[0].http + "/lookup?topic=clicks")
        return status == 200 and answer

    answer = wait_for(fast_lookup, timeout=10)
    assert ports(answer["producers"]) == {nodes[1].tcp_port}
    wait_for(lambda: get_json(nodes[2].http + "/channels?topic=clicks")[1]["channels"] == ["stats"], timeout=10)
    assert get_json(nodes[2].http + "/topics")[1]["topics"] == ["clicks", "orders"]
    listed = get_json(nodes[0].http + "/nodes")[1]["producers"]
    assert {p["tcp_port"] for p in listed} == everyone
    by_port = {p["tcp_port"]: p for p in listed}
    assert by_port[nodes[1].tcp_port]["topics"] == ["clicks", "orders"]
    assert by_port[nodes[2].tcp_port]["topics"] == ["orders"]
    assert get_json(nodes[0].http + "/lookup?topic=nothing")[0] == 404

    nodes[2].terminate()
    wait_for(
        lambda: ports(get_json(nodes[0].http + "/lookup?topic=orders")[1]["producers"])
        == {nodes[0].tcp_port, nodes[1].tcp_port},
        timeout=10,
    )


def test_pynsq_reader_via_one_node_receives_from_every_node(make_node, zk, pg_dsn):
    """Messages published (nsqd's /pub) to each of three nodes, on a reliable topic: a
    pynsq Reader whose only lookupd address is node 0's HTTP port connects to all three
    nodes and receives every message; every FIN is a durable acknowledgement."""
    register_topic(zk, "orders", "billing")
    nodes = [make_node() for _ in range(3)]
    sent = set()
    for i, node in enumerate(nodes):
        for j in range(10):
            body = b"from-%d-%d" % (i, j)
            assert http_pub(node, "orders", body) == "OK"
            sent.add(body)
    by_node = db_rows(pg_dsn, "SELECT holder, count(*) FROM dmq_pending GROUP BY holder")
    assert sorted(count for _, count in by_node) == [10, 10, 10]  # each node owns its own

    aio = asyncio.new_event_loop()
    asyncio.set_event_loop(aio)
    loop = IOLoop.current()
    got: set[bytes] = set()
    timed_out = []

    def handler(message):
        got.add(message.body)
        if sent <= got:
            loop.add_callback(loop.stop)
        return True

    reader = nsq.Reader(
        topic="orders",
        channel="billing",
        message_handler=handler,
        max_in_flight=30,
        lookupd_http_addresses=[nodes[0].http],
        lookupd_poll_interval=1,
    )

    def expire():
        timed_out.append(True)
        loop.stop()

    handle = loop.call_later(30, expire)
    loop.start()
    loop.remove_timeout(handle)
    connected = {conn.port for conn in reader.conns.values()}
    reader.close()
    loop.close(all_fds=True)
    asyncio.set_event_loop(None)
    assert not timed_out, f"received {len(got)} of {len(sent)}"
    assert got == sent
    assert connected == {n.tcp_port for n in nodes}
    wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)], timeout=10)
