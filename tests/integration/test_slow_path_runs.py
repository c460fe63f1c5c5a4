"""A run of the outbox relay off ``Broker.publish_each``'s direct way, on real PostgreSQL:
one application transaction of 150 rows to a topic with a rate limit, to a topic the node
has not cached yet, or to a topic on another ``--pg-cluster`` cluster, relayed by a
dmq-server with ``--commit-writers 2``. Its messages get ids in the order the transaction
sent them and are stored by one transaction (one ``xmin``): before the slow path kept a run
whole, its rows reached the group commit one by one, the first alone in a transaction of
its own, and a second writer could commit a later part of the run beside it."""

from __future__ import annotations

import pytest

from .support import db_rows, run_cli, wait_for
from .test_outbox_relay import app_dsn, outbox_empty, send_transaction, shop  # noqa: F401 (app_dsn: a fixture)

pytestmark = pytest.mark.integration

WAIT = 30.0
ROWS = 150  # more than the writer's PARALLEL_MIN (64) behind the first: room for a second transaction
FLAGS = {"commit_writers": "2", "commit_batch_size": "200"}


def relayed_in_one_commit(server_dsn: str, app_dsn: str, topic: str) -> None:  # noqa: F811 (app_dsn)
    """One transaction of ROWS rows to ``topic``, relayed: stored in ``server_dsn``'s
    database in send order, under one transaction id."""
    bodies = [b"row %03d" % k for k in range(ROWS)]
    send_transaction(app_dsn, bodies, topic=topic)
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    producer = shop(app_dsn)
    stored = db_rows(server_dsn, "SELECT session_id, body FROM dmq_message WHERE producer = %s ORDER BY id", producer)
    assert [body for _, body in stored] == bodies
    assert [sid for sid, _ in stored] == sorted(sid for sid, _ in stored)
    commits = db_rows(server_dsn, "SELECT count(DISTINCT xmin::text) FROM dmq_message WHERE producer = %s", producer)
    assert commits == [(1,)], f"the run was stored by {commits[0][0]} transactions"


def test_a_run_to_a_rate_limited_topic_is_one_commit_in_order(make_server, pg_dsn, app_dsn):  # noqa: F811
    import registry
    from dmq_server.db.worker import connect

    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "metered", rate_limit=100_000)
        registry.add_channel(conn, "metered", "billing")
    make_server(outbox=f"shop={app_dsn}", **FLAGS)
    relayed_in_one_commit(pg_dsn, app_dsn, "metered")


def test_a_run_to_a_topic_not_cached_yet_is_one_commit_in_order(make_server, pg_dsn, app_dsn):  # noqa: F811
    """The topic is registered after the server read the registry, which it reads again
    only when a send names a topic it does not know (--registry-refresh of an hour)."""
    import registry
    from dmq_server.db.worker import connect

    make_server(outbox=f"shop={app_dsn}", registry_refresh="3600", **FLAGS)
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "late")
        registry.add_channel(conn, "late", "billing")
    relayed_in_one_commit(pg_dsn, app_dsn, "late")


def test_a_run_to_a_topic_on_another_cluster_is_one_commit_in_order(make_server, pg_dsn, pg_private, app_dsn):  # noqa: F811
    b_dsn = pg_private.dsn
    setup = make_server(pg_cluster=f"b={b_dsn}")  # migrates b's database
    assert run_cli(pg_dsn, "--pg-cluster", f"b={b_dsn}", "topic", "create", "remote", "--cluster", "b").returncode == 0
    assert run_cli(pg_dsn, "--pg-cluster", f"b={b_dsn}", "channel", "add", "remote", "c1").returncode == 0
    wait_for(lambda: db_rows(b_dsn, "SELECT topic, name FROM dmq_channel") == [("remote", "c1")], timeout=WAIT)
    setup.stop()
    make_server(pg_cluster=f"b={b_dsn}", outbox=f"shop={app_dsn}", **FLAGS)
    relayed_in_one_commit(b_dsn, app_dsn, "remote")
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message") == [(0,)]
