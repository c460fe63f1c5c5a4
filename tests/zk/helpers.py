"""Small helpers shared by the cluster tests (no fixtures here)."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from typing import Iterator

from kazoo.exceptions import NoNodeError

from dmq_client.blocking import BlockingClient
from dmq_client.wire import Command
from registry import paths
from registry.model import NodeInfo
from registry.zk import ZkRegistry, connect
from tests.integration.support import http_get, wait_for


def node_info(zk, node_id: str) -> NodeInfo | None:
    """The node's registration as ZooKeeper holds it now, or None."""
    try:
        data, _ = zk.get(paths.node(node_id))
    except NoNodeError:
        return None
    return NodeInfo.decode(node_id, data)


def register_topic(zk, topic: str, *channels: str, **settings) -> None:
    registry = ZkRegistry(zk)
    registry.create_topic(topic, **settings)
    for channel in channels:
        registry.add_channel(topic, channel)


def wait_served(node, topic: str, channel: str, timeout: float = 10.0) -> None:
    """Wait until the node serves ``channel`` of ``topic`` (its /stats): a topic written to
    ZooKeeper reaches a node through a watch, and its channels may arrive one at a time,
    so a registered node may still answer SEND_NO_TOPIC_ACK for a moment."""

    def served() -> bool:
        status, body = http_get(node.http + "/stats")
        if status != 200:
            return False
        return any(
            t["topic_name"] == topic and any(c["channel_name"] == channel for c in t["channels"])
            for t in json.loads(body)["topics"]
        )

    wait_for(served, timeout=timeout)


@contextmanager
def zk_client(address: str, session_timeout: float = 5.0) -> Iterator:
    client = connect(address, timeout=30, session_timeout=session_timeout)
    try:
        yield client
    finally:
        client.stop()
        client.close()


def send_many(client: BlockingClient, topic: str, count: int, prefix: bytes = b"m") -> list[int]:
    """Send ``count`` messages; every one must be stored. Returns their message ids."""
    replies = client.send_many(topic, [prefix + b"-%d" % i for i in range(count)])
    bad = [r for r in replies if r.command != Command.SEND_SUCCESS_ACK]
    assert not bad, f"sends refused: {bad[:3]}"
    return [r.message_id for r in replies]


def deliver_all(
    consumer: BlockingClient,
    topic: str,
    channel: str,
    expected: set[int],
    timeout: float = 30.0,
    credit: int = 100,
) -> set[int]:
    """Subscribe, receive and ack until every id in ``expected`` arrived (or the
    deadline passes); returns the ids received."""
    reply = consumer.subscribe(topic, channel, credit=credit)
    assert reply.command == Command.SUBSCRIBE_ACK, reply
    got: set[int] = set()
    deadline = time.monotonic() + timeout
    while not expected <= got and time.monotonic() < deadline:
        push = consumer.receive(timeout=max(0.0, deadline - time.monotonic()))
        if push is None:
            break
        got.add(push.message_id)
        consumer.ack(push)
    return got
