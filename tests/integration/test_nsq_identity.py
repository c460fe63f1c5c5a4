"""NSQ publishers on several nodes never collide in resend dedup.

Before: HTTP ``/pub`` and ``/mpub`` on every node stored as producer ``nsq-http`` with
session ids from a snowflake whose node bits come from the host name, so two nodes on
one host made the same pairs, and a fifth of the bodies answered OK were never stored.
"""

from __future__ import annotations

import threading

import pytest

from .support import db_rows
from .test_nsq_http import call

pytestmark = pytest.mark.integration


def test_two_nodes_on_one_host_store_every_http_publish(make_server, topic, pg_dsn):
    servers = [make_server(), make_server()]
    answers: list[int] = []
    lock = threading.Lock()

    def publish(server, node: int) -> None:
        for batch in range(20):
            body = b"\n".join(b"n%d-b%d-m%d" % (node, batch, i) for i in range(50))
            status, _, _ = call(server, "POST", f"/mpub?topic={topic}", body)
            with lock:
                answers.append(status)

    threads = [threading.Thread(target=publish, args=(s, n)) for n, s in enumerate(servers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers == [200] * 40
    bodies = {bytes(r[0]) for r in db_rows(pg_dsn, "SELECT body FROM dmq_message")}
    assert len(bodies) == 2 * 20 * 50  # every body answered OK is stored
    producers = {r[0] for r in db_rows(pg_dsn, "SELECT DISTINCT producer FROM dmq_message")}
    assert len(producers) == 2 and all(p.startswith("nsq-http@") for p in producers)
