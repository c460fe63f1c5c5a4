"""Producer identities against a real dmq-server: two clients never share one.

The server takes a send whose ``(producer, session_id)`` it has stored for a resend
of that message and answers it SUCCESS (duplicate) without storing it. Issue 13,
item 2: two ``MqClient``s in one process both got the default producer id
``py-<host>-<pid>`` and session ids seeded from the same millisecond, so one
client's new messages were swallowed as "resends" of the other's and acknowledged
with the other's message id. Each client now gets its own producer id.
"""

from __future__ import annotations

import threading

import pytest

from dmq_client import MqClient, MqConfig, Message, Status

from .support import db_rows

pytestmark = pytest.mark.integration

WAIT = 60.0
PER_CLIENT = 1000


def test_two_clients_in_one_process_sending_concurrently_store_every_acknowledged_body(
    make_server, topic, pg_dsn
):
    """Two clients with the default producer id send concurrently from two threads. Both
    read the same wall clock, frozen at one instant (injected): the exact coincidence of
    two clients seeding their session ids in the same millisecond, every time, so before
    the fix every send of the second client collided with one of the first. Every SUCCESS
    must name a stored row holding that very body, none may be a duplicate, and every
    body is stored once under its own client's producer id."""
    server = make_server()
    config = MqConfig(servers=(f"127.0.0.1:{server.tcp_port}",))
    frozen = lambda: 1_700_000_000.0  # noqa: E731
    results: dict[str, list] = {}
    start = threading.Barrier(2)

    def produce(client: MqClient, name: str) -> None:
        start.wait()
        futures = [(f"{name}:{i}", client.send(Message("orders", f"{name}:{i}"))) for i in range(PER_CLIENT)]
        results[name] = [(body, future.result(WAIT)) for body, future in futures]

    with MqClient(config, wall_clock=frozen) as a, MqClient(config, wall_clock=frozen) as b:
        threads = [threading.Thread(target=produce, args=(c, n)) for c, n in ((a, "A0"), (b, "A1"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT * 2)
        producers = {"A0": a.producer_id, "A1": b.producer_id}

    acknowledged = [(name, body, r) for name, pairs in results.items() for body, r in pairs]
    assert len(acknowledged) == 2 * PER_CLIENT
    assert {r.status for _, _, r in acknowledged} == {Status.SUCCESS}
    stored = {mid: (producer, bytes(body).decode())
              for mid, producer, body in db_rows(pg_dsn, "SELECT id, producer, body FROM dmq_message")}
    wrong = [(body, r.message_id, stored.get(r.message_id)) for name, body, r in acknowledged
             if stored.get(r.message_id) != (producers[name], body)]
    assert wrong == [], f"{len(wrong)} acknowledged bodies not stored as acknowledged, e.g. {wrong[:3]}"
    assert not [body for _, body, r in acknowledged if r.duplicate]
    assert len(stored) == 2 * PER_CLIENT
    assert producers["A0"] != producers["A1"]
