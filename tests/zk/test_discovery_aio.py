"""The asyncio client (``dmq_client.aio``) with ZooKeeper discovery (``zk``) against dmq
nodes on one PostgreSQL: it finds the nodes in the registry, lets go of a node whose
registration ends (its unanswered sends go to the other node), and uses a node that joins
later. Waits are on the client's results or ``until`` (a condition polled with a
deadline), never a sleep."""

from __future__ import annotations

import asyncio

from dmq_client import Message, Status
from dmq_client.aio import Client
from dmq_client.aio.link import LinkState
from dmq_client.routing import affinity
from tests.integration.support import db_rows
from tests.integration.test_client_aio import freeze, until

from .helpers import register_topic, wait_served
from .test_discovery import discovery_config


def test_the_asyncio_client_follows_the_nodes_registered_in_zookeeper(make_node, zk, zk_address, pg_dsn):
    """Two nodes found through ZooKeeper (``servers`` given too, and ignored); a node frozen
    with sends written to it and unanswered: once its registration expires the client drops
    it, and those sends are answered by the other node (failed over, not resent on a timer:
    ``resend_interval`` is a minute). A node started later is connected to and takes the
    topics it scores best for. PostgreSQL holds every message once."""
    register_topic(zk, "orders", "billing")
    a, b = make_node(), make_node()
    name = {node: f"127.0.0.1:{node.tcp_port}" for node in (a, b)}

    async def run():
        config = discovery_config(zk_address, servers="127.0.0.1:1", resend_interval=60.0)
        async with Client(config) as client:
            assert set(client.links) == set(name.values())
            await until(lambda: all(link.state is LinkState.READY for link in client.links.values()))
            first = [await client.send(Message("orders", b"first-%d" % i)) for i in range(10)]
            assert [r.status for r in first] == [Status.SUCCESS] * 10
            victim = a if first[0].server == name[a] else b
            other = b if victim is a else a
            await asyncio.to_thread(freeze, victim)
            sends = [asyncio.ensure_future(client.send(Message("orders", b"after-%d" % i))) for i in range(10)]
            await until(lambda: len(client.sends.pending) == 10)
            assert {item.server for item in client.sends.pending.values()} == {name[victim]}
            after = await asyncio.gather(*sends)
            assert [(r.status, r.server, r.attempts) for r in after] == [(Status.SUCCESS, name[other], 2)] * 10
            assert set(client.links) == {name[other]}  # its registration expired
            await asyncio.to_thread(victim.kill)

            late = await asyncio.to_thread(make_node)
            name[late] = f"127.0.0.1:{late.tcp_port}"
            await until(lambda: name[late] in client.links and client.links[name[late]].state is LinkState.READY)
            topic = next(t for t in (f"late{i}" for i in range(100))
                         if affinity(t, name[late]) > affinity(t, name[other]))
            register_topic(zk, topic, "billing")
            await asyncio.to_thread(wait_served, late, topic, "billing")
            via_late = await client.send(Message(topic, b"via-late"))
            assert (via_late.status, via_late.server) == (Status.SUCCESS, name[late])

    asyncio.run(run())
    assert db_rows(pg_dsn, "SELECT count(*), count(DISTINCT session_id) FROM dmq_message") == [(21, 21)]
