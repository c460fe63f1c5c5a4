"""The client library with ZooKeeper discovery (MqConfig.zk) against three dmq nodes on
one PostgreSQL: producers and consumers find the nodes in the registry and follow
nodes leaving and joining."""

from __future__ import annotations

import threading


from dmq_client import Message, MqClient, MqConfig
from tests.integration.support import db_rows, wait_for

from .helpers import register_topic, wait_served, zk_client


WAIT = 30


def discovery_config(zk_address: str, **overrides) -> MqConfig:
    settings = dict(
        zk=zk_address,
        resend_interval=0.5,
        resend_tries=40,
        resend_check_interval=0.05,
        route_wait=15.0,
        connect_timeout=5.0,
        reconnect_backoff=0.05,
        reconnect_backoff_max=0.3,
        close_timeout=10.0,
        zk_session_timeout=5.0,
    )
    settings.update(overrides)
    return MqConfig(**settings)


class Received:
    """A handler recording (topic, body) per message; wait() until a set arrived."""

    def __init__(self):
        self.cond = threading.Condition()
        self.bodies: list[tuple[str, bytes]] = []

    def __call__(self, message) -> None:
        with self.cond:
            self.bodies.append((message.topic, message.body))
            self.cond.notify_all()

    def wait(self, wanted: set, timeout: float = WAIT) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: wanted <= set(self.bodies), timeout=timeout)


def test_producers_and_consumers_through_discovery(make_node, zk, zk_address, pg_dsn):
    """A client given only the ZooKeeper address connects to all three nodes, spreads
    its topics over them, subscribes on every node, and receives every message once."""
    topics = [f"t{i}" for i in range(9)]
    for topic in topics:
        register_topic(zk, topic, "workers")
    nodes = [make_node() for _ in range(3)]
    received = Received()
    with MqClient(discovery_config(zk_address)) as client:
        assert set(client.stats()["servers"]) == {f"127.0.0.1:{n.tcp_port}" for n in nodes}
        for topic in topics:
            client.subscribe(topic, "workers", received)
        futures = [client.send(Message(t, b"%s-%d" % (t.encode(), i))) for t in topics for i in range(20)]
        results = [f.result(WAIT) for f in futures]
        assert all(r.ok for r in results)
        wanted = {(t, b"%s-%d" % (t.encode(), i)) for t in topics for i in range(20)}
        assert received.wait(wanted)
        assert len(received.bodies) == len(wanted)  # once each
        # the topic watch is filled in by discovery's own thread: wait for it, with a deadline
        wait_for(lambda: client.stats()["discovery"]["topics"].get("t0") == ["workers"], timeout=WAIT)
        stats = client.stats()["discovery"]
        assert stats["nodes"] == sorted(n.flags["node_id"] for n in nodes)
    owners = db_rows(pg_dsn, "SELECT count(DISTINCT node_id) FROM dmq_message")[0][0]
    assert owners >= 2  # topics were spread over the nodes


def test_client_follows_nodes_leaving_and_joining(make_node, zk, zk_address, pg_dsn):
    """A node killed with SIGKILL: sends go on through the others, and what it had
    stored is taken over and reaches the consumer. A node that joins later is
    connected to and subscribed on without restarting the client."""
    register_topic(zk, "orders", "billing")
    a, b = make_node(), make_node()
    received = Received()
    with MqClient(discovery_config(zk_address)) as client:
        client.subscribe("orders", "billing", received)
        first = [client.send(Message("orders", b"first-%d" % i)).result(WAIT) for i in range(20)]
        assert all(r.ok for r in first)
        home = first[0].server
        victim = a if home.endswith(f":{a.tcp_port}") else b
        # let messages pile up on the victim without a consumer acking them
        victim.kill()
        after = [client.send(Message("orders", b"after-%d" % i)).result(WAIT) for i in range(20)]
        assert all(r.ok for r in after)
        wanted = {("orders", b"first-%d" % i) for i in range(20)} | {("orders", b"after-%d" % i) for i in range(20)}
        assert received.wait(wanted)
        victim_name = f"127.0.0.1:{victim.tcp_port}"
        wait_for(lambda: victim_name not in client.stats()["servers"], timeout=WAIT)

        c = make_node()
        c_name = f"127.0.0.1:{c.tcp_port}"
        wait_for(lambda: client.stats()["servers"].get(c_name) == "ready", timeout=WAIT)
        with c.client() as producer:
            reply = producer.send("orders", b"via-c")
            assert reply.command.name == "SEND_SUCCESS_ACK"
        assert received.wait({("orders", b"via-c")})


def test_client_started_while_zookeeper_is_down_finds_the_nodes_later(zk_private, make_node):
    """A client whose ZooKeeper does not answer at start does not fail: it starts with no
    server, keeps trying, and connects to the nodes once ZooKeeper is back."""
    address = f"{zk_private.address}/late"
    node = make_node(zk=address)
    with zk_client(address) as zk:
        register_topic(zk, "orders", "billing")
    wait_served(node, "orders", "billing")
    server = zk_private.servers[0]
    server.stop()
    config = discovery_config(address, connect_timeout=1.0, route_wait=30.0)
    with MqClient(config) as client:
        assert client.stats()["servers"] == {}
        assert "did not answer" in client.stats()["discovery"]["error"]
        server.start()
        name = f"127.0.0.1:{node.tcp_port}"
        wait_for(lambda: client.stats()["servers"].get(name) == "ready", timeout=WAIT)
        assert client.send(Message("orders", b"late")).result(WAIT).ok
