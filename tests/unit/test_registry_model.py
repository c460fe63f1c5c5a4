"""Unit tests of the registry's pure parts: znode layout, addresses, data encoding, and
the bridge's rule that kazoo threads only ever schedule work on the reactor."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from registry import paths
from dmq_server.cluster.bridge import KazooBridge
from registry.interface import check_settings
from registry.model import NodeInfo, RegistryError, TopicSpec, decode_topic, encode_topic


@pytest.mark.parametrize(
    "text, expected",
    [
        ("zk1:2181", ("zk1:2181", "")),
        ("zk1:2181,zk2:2182/prod", ("zk1:2181,zk2:2182", "/prod")),
        (" 127.0.0.1:2181/a/b/ ", ("127.0.0.1:2181", "/a/b")),
        ("[::1]:2181", ("[::1]:2181", "")),
    ],
)
def test_parse_address(text, expected):
    """Hosts with ports, an optional chroot (trailing slash dropped)."""
    assert paths.parse_address(text) == expected


@pytest.mark.parametrize("text", ["", "zk1", "zk1:", ":2181", "zk1:99999", "zk1:2181,zk2", "zk:1/a/../b", "zk:1//x"])
def test_parse_address_refuses(text):
    """Bad addresses are refused with the expected shape in the message."""
    with pytest.raises(ValueError):
        paths.parse_address(text)


def test_layout():
    """Znode paths of topics, channels, nodes and takeover locks; node ids that contain
    a slash are encoded so they stay one path element."""
    assert paths.topic("orders") == "/dmq/topic/orders"
    assert paths.channel("orders", "billing") == "/dmq/topic/orders/billing"
    assert paths.node("host:4150") == "/dmq/node/host:4150"
    assert paths.node("a/b") == "/dmq/node/a%2Fb"
    assert paths.node_id_of("a%2Fb") == "a/b"
    assert paths.takeover_lock("host:4150") == "/dmq/takeover/host:4150"


def test_topic_data_round_trip_and_defaults():
    """Settings survive encoding; a hand-made znode without data is a reliable topic."""
    spec = TopicSpec("orders", "reliable", 5000, 10, 60000, 3, ("a", "b"))
    assert decode_topic("orders", encode_topic(spec), ["b", "a"]) == spec
    assert decode_topic("x", b"", []) == TopicSpec("x")
    assert decode_topic("x", b"not json", []) == TopicSpec("x")
    assert decode_topic("x", b'{"store": "disk", "msg_timeout_ms": -1}', []) == TopicSpec("x")


def test_an_ordered_topic_round_trips_and_an_older_znode_is_not_ordered():
    """``ordered`` (issue 45 §2) is kept in the znode's JSON; a znode written before the
    setting existed, or one whose value is not a JSON true, reads as not ordered."""
    spec = TopicSpec("orders", "reliable", 5000, None, None, 3, ("a",), "main", (), True)
    data = encode_topic(spec)
    assert json.loads(data)["ordered"] is True
    assert decode_topic("orders", data, ["a"]) == spec and decode_topic("orders", data, ["a"]).ordered
    unordered = TopicSpec("orders", max_attempts=3)
    assert json.loads(encode_topic(unordered))["ordered"] is False
    assert decode_topic("orders", encode_topic(unordered), []) == unordered
    older = (b'{"cluster": "main", "draining": [], "max_attempts": 3, "msg_timeout_ms": 5000, '
             b'"rate_limit": null, "store": "reliable", "ttl_ms": null}')
    assert decode_topic("orders", older, ["a"]) == TopicSpec("orders", "reliable", 5000, None, None, 3, ("a",))
    assert not decode_topic("orders", older, []).ordered
    for odd in (b'"yes"', b"1", b'"true"', b"null"):
        assert not decode_topic("orders", b'{"ordered": ' + odd + b"}", []).ordered


def test_a_topics_retention_round_trips_and_is_checked():
    """``retention_ms`` (issue 46) is kept in the znode's JSON (absent or not a positive
    whole number: the server's); a fast topic keeps none, and none is shorter than 1 s."""
    spec = TopicSpec("orders", retention_ms=604_800_000)
    data = encode_topic(spec)
    assert json.loads(data)["retention_ms"] == 604_800_000
    assert decode_topic("orders", data, []).retention_ms == 604_800_000
    for odd in (b"null", b"0", b"-5", b'"7d"', b"true"):
        assert decode_topic("orders", b'{"retention_ms": ' + odd + b"}", []).retention_ms is None
    check_settings("reliable", 1000, retention_ms=1000)
    with pytest.raises(RegistryError, match="at least 1s, not 999ms"):
        check_settings("reliable", 1000, retention_ms=999)
    with pytest.raises(RegistryError, match="only a reliable topic keeps its messages"):
        check_settings("fast", 1000, retention_ms=60_000)


def test_only_a_reliable_topic_can_be_ordered():
    """Both registries check a topic's settings with check_settings: a fast topic
    delivers as nsqd does, so ordered is refused for it with the reason."""
    check_settings("reliable", 1000, True)
    check_settings("fast", 1000, False)
    with pytest.raises(RegistryError, match="only a reliable topic can be ordered"):
        check_settings("fast", 1000, True)


def test_node_data_round_trip():
    """A node's registration decodes to what was encoded; garbage decodes to None."""
    node = NodeInfo("n1", "10.0.0.1", 4150, 4151, "0.1.0", 1.5, 2.5, "h", "i", {"clicks": ("stats",)})
    assert NodeInfo.decode("n1", node.encode()) == node
    assert node.tcp_address == "10.0.0.1:4150" and node.http_address == "10.0.0.1:4151"
    assert NodeInfo.decode("n1", b"{}") is None
    assert NodeInfo.decode("n1", b"\xff") is None


class RecordingReactor:
    def __init__(self):
        self.scheduled: list = []

    def callFromThread(self, fn, *args):
        self.scheduled.append((threading.current_thread().name, fn, args))


def test_bridge_relay_only_schedules_on_the_reactor():
    """A relayed callback called from a kazoo thread does not run there: it is handed to
    reactor.callFromThread, and nothing is scheduled once the bridge stopped."""
    reactor = RecordingReactor()
    bridge = KazooBridge(reactor)
    ran: list = []
    relayed = bridge.relay(lambda *a: ran.append(a))
    thread = threading.Thread(target=relayed, args=("CONNECTED",), name="kazoo-event")
    thread.start()
    thread.join()
    assert ran == []
    assert [(name, args) for name, _, args in reactor.scheduled] == [("kazoo-event", ("CONNECTED",))]
    bridge.stop()
    relayed("LOST")
    assert len(reactor.scheduled) == 1


def test_layout_and_model_import_nothing_heavy():
    """The client library reads registry.paths and registry.model: they must not pull in
    kazoo, Twisted or psycopg."""
    code = (
        "import sys, registry.paths, registry.model; "
        "print([m for m in ('kazoo', 'twisted', 'psycopg') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_client_without_zookeeper_does_not_import_kazoo():
    """dmq_client imports kazoo only for a config with ``zk`` (discovery): the package,
    the client class and a plain config leave it out."""
    code = (
        "import sys, dmq_client; from dmq_client import MqClient, MqConfig; MqConfig(); "
        "import dmq_client.client; print('kazoo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
