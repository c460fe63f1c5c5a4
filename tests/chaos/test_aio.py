"""node-kill with asyncio producers and consumers (issue 47): every send acknowledged to an
``await client.send`` reaches both channels, nothing is pushed again once its ack was durable.

The scenario is ``node-kill`` of ``test_scenarios.py`` (its fault, timing, stalls, report
and failure file) with ``aio_load.AioLoad``: three producers and two consumers per channel,
each a ``dmq_client.aio.Client`` on one event loop, given every node's address. The topic is
one the clients send to the node that is killed (``aio_load.topic_served_by``), so every
producer's client fails over with sends unanswered, and the copies that node stored are
taken over by the others while the consumers' acks to it are lost. Run alone:
``.venv/bin/python -m pytest tests/chaos/test_aio.py -q -rA`` (its own cluster, about a minute).
"""

from __future__ import annotations

import uuid

from . import conftest, scenarios
from .aio_load import AioLoad, topic_served_by
from .test_scenarios import SHORT, failure_kept

KILLED = 1  # the node scenarios.kill_node kills


def test_asyncio_clients_lose_no_acknowledged_message_under_node_kill(chaos_cluster):
    """Under kill -9 of the node the asyncio producers send to, every acknowledged send
    reaches both channels, none is pushed again after its ack was durable, nothing unknown
    appears, the producers fail over to the other nodes and come back to the restarted one
    while the load is on; every copy a consumer gave back (``requeue`` with a delay), on the
    killed node too, comes back."""
    name = "node-kill-aio"
    with failure_kept(chaos_cluster, name) as story:
        topic = topic_served_by(chaos_cluster.client_addresses(), KILLED, f"chaos_node_kill_aio_{uuid.uuid4().hex[:6]}")
        report = scenarios.run(chaos_cluster, "node-kill", SHORT, make_load=AioLoad, topic=topic)
        report["scenario"] = name
        story.text = text = scenarios.format_report(report)
        conftest.REPORTS.append(text)
        if not report["ok"]:
            story.text = text = text + "\n" + scenarios.diagnose(chaos_cluster, report)
        assert report["acked"] > 500, text  # the load ran: there was something to lose
        for channel in report["channels"]:
            assert channel["lost"] == 0, text
            assert channel["duplicated"] == 0, text
            assert channel["unexpected"] == 0, text
            assert channel["wrong_priority"] == 0, text
            assert all(channel["by_priority"].get(p) for p in range(10)), text  # every priority flowed
        assert report["all_delivered"] and not report["failures"], text
        assert report["acks_per_s"]["after"] > 0, text  # served again while the load was on
        by_node = report["notes"]["aio"]["by_node"]
        killed = by_node[f"node{KILLED + 1}"]
        # the killed node served the producers, others did while it was down (they failed over),
        # and it did again once restarted (they came back: it is the topic's server)
        assert killed["acked"] > 100 and sum(n["acked"] for n in by_node.values()) > killed["acked"], text
        assert killed["longest_gap_s"] >= SHORT.hold and killed["acked_after_it"] > 100, text
        assert report["notes"]["window"][scenarios.STALLS.channel]["full"] > 0, text  # the stalls filled a window
        aio = report["notes"]["aio"]
        # copies given back (REQUEUE with a delay) came back, kill -9 or not
        assert aio["requeued"] > 20 and aio["requeued_not_back"] == [], text
