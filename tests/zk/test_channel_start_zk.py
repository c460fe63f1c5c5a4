"""``dmq --zk ... channel add TOPIC CHANNEL --start-time TIME`` in a cluster (issue 46):
the channel's znode is created, and the CLI writes the topic's and channel's rows into
the database itself before seeking there (a node's mirror may come later, or never: no
node need run), so the start holds whichever of the two writes the rows first.

Counted: with a node running and thirty messages published an hour, half an hour and a
quarter of an hour ago, a channel added with a start 45 minutes ago has exactly the last
twenty waiting and a consumer of it on the node receives those twenty and nothing else;
with no node ever run, the CLI's own rows make the channel exist in the database with its
start; a start refused after the znode was created says the channel is registered and
starts at the latest message.
"""

from __future__ import annotations


from registry.zk import ZkRegistry
from dmq_server.admin import cli
from tests.integration.support import db_rows, run_cli
from tests.integration.test_channel_start import _ago, _pending, sweep_meanwhile
from tests.integration.test_seek import _receive, publish_aged
from dmq_client.wire import Command

from .helpers import register_topic, wait_served


def test_a_channel_started_in_the_past_on_a_running_cluster_node(pg_dsn, zk, zk_address, make_node):
    register_topic(zk, "orders", "audit", retention_ms=7_200_000)
    node = make_node(channel_state_interval="500ms")
    wait_served(node, "orders", "audit", timeout=20)
    groups = publish_aged(node, pg_dsn, (60, 30, 15))
    later = groups[1] + groups[2]

    out = run_cli(pg_dsn, "--zk", zk_address, "channel", "add", "orders", "late", "--start-time", _ago(45))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("added channel late to topic orders\n"), out.stdout
    assert f"20 messages from id {later[0]} " in out.stdout, out.stdout
    assert ZkRegistry(zk).get_topic("orders").channels == ("audit", "late")
    assert _pending(pg_dsn, "late") == later
    wait_served(node, "orders", "late", timeout=20)
    with node.client() as consumer:
        assert consumer.subscribe("orders", "late", credit=50).command == Command.SUBSCRIBE_ACK
        assert sorted(_receive(consumer, 20)) == later  # each once
        assert consumer.receive(timeout=1.5) is None  # and nothing else


def test_with_no_node_running_the_cli_writes_the_rows_it_seeks(pg_dsn, zk, zk_address):
    register_topic(zk, "orders", "audit")  # never mirrored: no node runs
    assert db_rows(pg_dsn, "SELECT name FROM dmq_topic") == []
    out = run_cli(pg_dsn, "--zk", zk_address, "channel", "add", "orders", "late", "--start-id", "1")
    assert out.returncode == 0, out.stderr
    assert "cluster main: sought orders/late to id 1: no message to deliver again, epoch 0" in out.stdout, out.stdout
    assert db_rows(pg_dsn, "SELECT topic, name, start_id FROM dmq_channel ORDER BY name") == [
        ("orders", "audit", db_rows(pg_dsn, "SELECT start_id FROM dmq_channel WHERE name = 'audit'")[0][0]),
        ("orders", "late", 0)]  # sought to id 1: from the first id on

    out = run_cli(pg_dsn, "--zk", zk_address, "channel", "add", "orders", "early", "--start-time", "2999-01-01")
    assert out.returncode == 1 and "is after now" in out.stderr and "nothing was registered" in out.stderr, out.stderr
    assert ZkRegistry(zk).get_topic("orders").channels == ("audit", "late")


def test_a_start_refused_after_the_znode_leaves_the_channel_at_the_latest_message(
        pg_dsn, zk, zk_address, monkeypatch, capsys):
    register_topic(zk, "orders")
    sweep_meanwhile(monkeypatch, pg_dsn)
    assert cli.main(["--pg-dsn", pg_dsn, "--zk", zk_address, "channel", "add", "orders", "late",
                     "--start-time", "5m"]) == 1
    err = capsys.readouterr().err
    assert "orders/late: the channel is registered, but its start was refused on cluster main" in err, err
    assert "It starts at the latest message on cluster main; move it with: dmq channel seek orders late" in err, err
    assert ZkRegistry(zk).get_topic("orders").channels == ("late",)
    [(filters,)] = db_rows(pg_dsn, "SELECT filters FROM dmq_admin_log WHERE operation = 'channel.add'")
    assert filters.startswith("orders/late from time ") and filters.endswith(
        " (start refused: from the latest message)"), filters
