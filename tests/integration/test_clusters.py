"""Topics on two PostgreSQL clusters (``--pg-cluster``): two real PostgreSQL servers, a
real dmq-server process, the real CLI.

The main cluster is the test's database on the session's server; cluster ``b`` is a
private PostgreSQL of its own, so it can be stopped while the main one serves on.
"""

from __future__ import annotations

import contextlib
import io
import json
import urllib.error
import urllib.request

import pytest

from dmq_client.wire import Command
from dmq_sql import migrations

from .support import db_rows, run_cli, wait_for

pytestmark = pytest.mark.integration


def cli(main_dsn: str, b_dsn: str, *args: str):
    return run_cli(main_dsn, "--pg-cluster", f"b={b_dsn}", *args)


def register(main_dsn: str, b_dsn: str) -> None:
    """``local`` on main and ``remote`` on b, each with channels ``c1`` and ``c2``: the
    CLI's own ``main``, run in this process (a process each was 3.5 s of every test's
    setup; the tests below run the CLI as a command)."""
    from dmq_server.admin.cli import main

    for topic, where in (("local", ()), ("remote", ("--cluster", "b"))):
        commands = [("topic", "create", topic, *where)] + [("channel", "add", topic, c) for c in ("c1", "c2")]
        for command in commands:
            err = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                code = main(["--pg-dsn", main_dsn, "--pg-cluster", f"b={b_dsn}", *command])
            assert code == 0, (command, err.getvalue())


def stats(server) -> dict:
    with urllib.request.urlopen(server.http + "/stats", timeout=5) as resp:
        return json.load(resp)


def drain(server, topic: str, channel: str, expect: int) -> list[int]:
    got: list[int] = []
    with server.client(timeout=10) as consumer:
        consumer.subscribe(topic, channel, credit=100)
        while len(got) < expect:
            push = consumer.receive(timeout=10)
            assert push is not None, f"{topic}/{channel}: {len(got)} of {expect}"
            got.append(push.message_id)
            consumer.ack(push)
    return got


@pytest.fixture
def two_clusters(pg_dsn, pg_private, make_server):
    """A server on main (the test's database) and cluster b (a private PostgreSQL), its
    topics registered."""
    b_dsn = pg_private.dsn
    server = make_server(pg_cluster=f"b={b_dsn}", metrics_db_interval="500ms")
    register(pg_dsn, b_dsn)
    # A channel reaches cluster b's database when a node mirrors the registry (its next
    # registry read), and starts at b's next id then: a send stored on b before that is
    # not for it. The CLI registers on main only, so wait for the node's mirror before
    # sending (a CI run sent between the node's read of c1 and of c2: remote/c2 got 0 of 20).
    wait_for(lambda: db_rows(b_dsn, "SELECT topic, name FROM dmq_channel ORDER BY topic, name")
             == [("local", "c1"), ("local", "c2"), ("remote", "c1"), ("remote", "c2")], timeout=30)
    return server, pg_dsn, b_dsn, pg_private


def test_topics_on_two_clusters_are_stored_and_delivered_on_their_own(two_clusters):
    """Each topic's messages are stored in its cluster's database only, with ids from that
    cluster's slot; both are delivered on every channel; the CLI, /stats and the
    registry tables of both databases name the placement."""
    server, main_dsn, b_dsn, _ = two_clusters
    with server.client() as producer:
        local = [producer.send("local", b"l%d" % i) for i in range(20)]
        remote = [producer.send("remote", b"r%d" % i) for i in range(20)]
    assert {r.command for r in local + remote} == {Command.SEND_SUCCESS_ACK}
    assert all(r.message_id >> 48 == 0 for r in local)
    assert all(r.message_id >> 48 == 1 for r in remote)  # cluster b drew them: slot 1
    assert db_rows(main_dsn, "SELECT topic, count(*) FROM dmq_message GROUP BY topic") == [("local", 20)]
    assert db_rows(b_dsn, "SELECT topic, count(*) FROM dmq_message GROUP BY topic") == [("remote", 20)]
    for topic, sent in (("local", local), ("remote", remote)):
        for channel in ("c1", "c2"):
            assert sorted(drain(server, topic, channel, 20)) == sorted(r.message_id for r in sent)
    # acks become durable in each cluster's own cursors (in batches)
    for dsn in (main_dsn, b_dsn):
        wait_for(lambda: db_rows(dsn, "SELECT count(*) FROM dmq_pending") == [(0,)])
    assert db_rows(b_dsn, "SELECT name, cluster FROM dmq_topic ORDER BY name") == [("local", "main"), ("remote", "b")]

    listed = {t["name"]: t for t in json.loads(cli(main_dsn, b_dsn, "topic", "list", "--json").stdout)}
    assert listed["remote"]["cluster"] == "b" and listed["local"]["cluster"] == "main"
    text = cli(main_dsn, b_dsn, "topic", "list").stdout
    assert "remote\treliable\tchannels: c1, c2\tcluster: b" in text
    live = stats(server)
    assert {t["topic_name"]: t["cluster"] for t in live["topics"]} == {"local": "main", "remote": "b"}
    assert live["clusters"]["b"]["published"] == 20 and live["clusters"]["main"]["published"] == 20
    assert live["clusters"]["b"]["slot"] == 1 and live["clusters"]["b"]["health"] == "OK"
    with urllib.request.urlopen(server.http + "/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    assert 'dmq_cluster_published_total{cluster="b"} 20' in metrics
    assert 'dmq_cluster_up{cluster="main"} 1' in metrics


def test_an_unknown_cluster_is_refused_by_name(two_clusters):
    """``topic create --cluster`` names the clusters there are when it refuses one."""
    _, main_dsn, b_dsn, _ = two_clusters
    out = cli(main_dsn, b_dsn, "topic", "create", "elsewhere", "--cluster", "nosuch")
    assert out.returncode == 1
    assert "unknown cluster 'nosuch': the clusters are b, main" in out.stderr
    assert db_rows(main_dsn, "SELECT count(*) FROM dmq_topic WHERE name = 'elsewhere'") == [(0,)]


def test_one_cluster_down_fails_only_its_topics(two_clusters):
    """With cluster b's PostgreSQL stopped, sends to its topic get SEND_SERVER_ERROR naming
    the cluster, while the main cluster's topic is stored and delivered as before; once b
    is back its topic is served again, and nothing acknowledged before is lost."""
    server, main_dsn, b_dsn, pg_b = two_clusters
    with server.client() as producer:
        before = producer.send("remote", b"before")
        assert before.command == Command.SEND_SUCCESS_ACK
        pg_b.stop(mode="immediate")
        failed = producer.send("remote", b"while down")
        assert failed.command == Command.SEND_SERVER_ERROR
        assert "cluster 'b'" in failed.status, failed.status
        served = [producer.send("local", b"l%d" % i) for i in range(10)]
        assert {r.command for r in served} == {Command.SEND_SUCCESS_ACK}
        assert sorted(drain(server, "local", "c1", 10)) == sorted(r.message_id for r in served)
        live = stats(server)
        assert live["health"] == "OK"  # the node serves on: main is up
        assert live["clusters"]["b"]["health"] == "ERROR"
        pg_b.start(keep_port=True)
        after = None
        for _ in range(50):  # the writer reconnects on its next batch
            after = producer.send("remote", b"after")
            if after.command == Command.SEND_SUCCESS_ACK:
                break
        assert after is not None and after.command == Command.SEND_SUCCESS_ACK
    got = drain(server, "remote", "c1", 2)
    assert sorted(got) == sorted([before.message_id, after.message_id])


def test_one_database_given_for_two_clusters_refuses_the_start(pg_dsn, make_server):
    """The main database given again as cluster b: the node does not start, and says why."""
    server = make_server(pg_cluster=f"b={pg_dsn}", start=False)
    with pytest.raises(RuntimeError) as excinfo:
        server.start()
    assert "the database of cluster 'b' is already claimed by cluster 'main' (slot 0)" in str(excinfo.value)


def test_db_migrate_migrates_every_cluster(pg_dsn, pg_empty_dsn):
    """``dmq --pg-cluster b=... db migrate`` brings cluster b's database to the schema too."""
    out = cli(pg_dsn, pg_empty_dsn, "db", "migrate")
    assert out.returncode == 0, out.stderr
    assert f"cluster b: schema is at version {migrations()[-1][0]}" in out.stdout
    assert db_rows(pg_empty_dsn, "SELECT name, slot, claimed FROM dmq_cluster_self") == [("main", 0, False)]


def test_a_move_can_be_placed_now_and_finished_later(two_clusters):
    """``topic move --no-wait`` places the topic and leaves main draining (the CLI and
    /stats say so, and a copy left on main is still delivered); the same command run
    again finishes once main is drained; an unknown cluster is refused."""
    server, main_dsn, b_dsn, _ = two_clusters
    with server.client() as producer:
        old = producer.send("local", b"before the move")
    out = cli(main_dsn, b_dsn, "topic", "move", "local", "--cluster", "nosuch")
    assert out.returncode == 1 and "unknown cluster 'nosuch'" in out.stderr
    out = cli(main_dsn, b_dsn, "topic", "move", "local", "--cluster", "b", "--no-wait")
    assert out.returncode == 0, out.stderr
    assert "new messages go to cluster b; draining main" in out.stdout
    assert "local\treliable\tchannels: c1, c2\tcluster: b (draining main)" in cli(main_dsn, b_dsn, "topic", "list").stdout
    wait_for(lambda: {t["topic_name"]: (t["cluster"], t["draining"]) for t in stats(server)["topics"]}["local"]
             == ("b", ["main"]))
    with server.client() as producer:
        new = producer.send("local", b"after the move")
    assert new.command == Command.SEND_SUCCESS_ACK and new.message_id >> 48 == 1
    for channel in ("c1", "c2"):
        assert sorted(drain(server, "local", channel, 2)) == sorted([old.message_id, new.message_id])
    wait_for(lambda: db_rows(main_dsn, "SELECT count(*) FROM dmq_pending WHERE topic = 'local'") == [(0,)])
    out = cli(main_dsn, b_dsn, "topic", "move", "local", "--cluster", "b", "--settle", "1")
    assert out.returncode == 0, out.stderr
    assert "cluster main drained" in out.stdout
    wait_for(lambda: {t["topic_name"]: t["draining"] for t in stats(server)["topics"]}["local"] == [])


def test_an_ordered_topic_moves_one_step_at_a_time(two_clusters):
    """While an ordered topic still drains a cluster, a move elsewhere is refused (the
    order of a key's copies on two draining clusters would be unknown); the same move
    run again finishes it, and then the next move is accepted."""
    server, main_dsn, b_dsn, _ = two_clusters
    out = cli(main_dsn, b_dsn, "topic", "update", "local", "--ordered")
    assert out.returncode == 0, out.stderr
    out = cli(main_dsn, b_dsn, "topic", "move", "local", "--cluster", "b", "--no-wait")
    assert out.returncode == 0, out.stderr
    out = cli(main_dsn, b_dsn, "topic", "move", "local", "--cluster", "main", "--no-wait")
    assert out.returncode == 1
    assert ("topic local is ordered and still draining main: an ordered topic moves one step at a time; "
            "finish the move first (dmq topic move local --cluster b)") in out.stderr
    assert "cluster: b (draining main)" in cli(main_dsn, b_dsn, "topic", "list").stdout
    out = cli(main_dsn, b_dsn, "topic", "move", "local", "--cluster", "b", "--settle", "1")
    assert out.returncode == 0, out.stderr
    out = cli(main_dsn, b_dsn, "topic", "move", "local", "--cluster", "main", "--no-wait")
    assert out.returncode == 0, out.stderr


def test_a_seek_of_a_moved_topic_replays_its_messages_on_both_clusters(two_clusters):
    """``local`` keeps ten messages on main, is moved to b (the move finished: main drained,
    nodes deliver the topic from b only), and stores ten more there; all acknowledged. A
    seek of c1 back over all of them moves its cursors on both clusters (the dry run counts
    ten on each and says main would drain again), and has the topic drain main again, so
    the consumer receives the twenty again, each once, c2 none; the move command finishes
    the drain as after a move."""
    server, main_dsn, b_dsn, _ = two_clusters
    with server.client() as producer:
        before = [producer.send("local", b"m%d" % i).message_id for i in range(10)]
    for channel in ("c1", "c2"):
        assert sorted(drain(server, "local", channel, 10)) == before
    wait_for(lambda: db_rows(main_dsn, "SELECT count(*) FROM dmq_pending WHERE topic = 'local'") == [(0,)])
    out = cli(main_dsn, b_dsn, "topic", "move", "local", "--cluster", "b", "--settle", "1")
    assert out.returncode == 0 and "cluster main drained" in out.stdout, (out.stdout, out.stderr)
    wait_for(lambda: {t["topic_name"]: (t["cluster"], t["draining"]) for t in stats(server)["topics"]}["local"]
             == ("b", []))
    with server.client() as producer:
        after = [producer.send("local", b"b%d" % i).message_id for i in range(10)]
    assert all(mid >> 48 == 1 for mid in after)
    for channel in ("c1", "c2"):
        assert sorted(drain(server, "local", channel, 10)) == after
    for dsn in (main_dsn, b_dsn):
        wait_for(lambda: db_rows(dsn, "SELECT count(*) FROM dmq_pending WHERE topic = 'local'") == [(0,)])

    dry = cli(main_dsn, b_dsn, "channel", "seek", "local", "c1", "--to-time", "1h", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert {c["cluster"]: c["count"] for c in json.loads(dry.stdout)} == {"main": 10, "b": 10}
    assert "topic local would drain main again (it was moved to b)" in dry.stderr, dry.stderr
    assert "cluster: b\n" in cli(main_dsn, b_dsn, "topic", "list").stdout  # a dry run changes nothing
    # a server does not change a topic's placement: its admin API refuses, writing nothing
    request = urllib.request.Request(server.http + "/admin/channels/local/c1/seek?to_time=1h", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400
    message = json.load(refused.value)["message"]
    assert message.startswith("cluster main keeps 10 messages of topic local from before its move to b, "
                              "and no node delivers the topic from main now: seek with the CLI"), message
    assert db_rows(b_dsn, "SELECT count(*) FROM dmq_pending WHERE topic = 'local'") == [(0,)]
    out = cli(main_dsn, b_dsn, "channel", "seek", "local", "c1", "--to-time", "1h")
    assert out.returncode == 0, out.stderr
    assert ("topic local drains main again for the replay (it was moved to b); `dmq topic move local --cluster b` "
            "finishes it once they are delivered") in out.stdout, out.stdout
    assert sorted(drain(server, "local", "c1", 20)) == sorted(before + after)
    with server.client(timeout=10) as consumer:
        consumer.subscribe("local", "c1", credit=100)
        assert consumer.receive(timeout=1.5) is None  # each once
    for dsn in (main_dsn, b_dsn):
        assert db_rows(dsn, "SELECT count(*) FROM dmq_pending WHERE topic = 'local' AND channel = 'c2'") == [(0,)]
    out = cli(main_dsn, b_dsn, "topic", "move", "local", "--cluster", "b", "--settle", "1")
    assert out.returncode == 0 and "cluster main drained" in out.stdout, (out.stdout, out.stderr)
