"""nsqd's topic and channel actions on whichever store holds the topic
(``broker.topic_admin``), on the real broker over the in-memory double and a fast store:
what the HTTP adapter gets back, without choosing a store itself."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred

from dmq_server.broker.topic_admin import RegistryOnly
from dmq_server.core.errors import NoChannel, NoTopic
from tests.unit.test_broker import Consumer, Harness


def outcome(h: Harness, d: Deferred) -> Any:
    """The action's result, or its error, once the double answered."""
    got: list[Any] = []
    d.addBoth(got.append)
    h.settle(0.1)
    [result] = got
    return result.value if hasattr(result, "value") else result


def test_a_registered_topic_is_the_registrys_to_create_and_delete_and_pauses_in_postgresql():
    h = Harness()
    admin = h.broker.topic_admin
    h.subscribe("orders", "billing", Consumer())
    for action in (admin.delete_topic("orders"), admin.create_channel("orders", "new"),
                   admin.delete_channel("orders", "billing")):
        assert isinstance(outcome(h, action), RegistryOnly)
    assert outcome(h, admin.create_topic("orders")) is None and "orders" not in h.fast.topics
    assert outcome(h, admin.pause_topic("orders", True)) is None
    assert {name for (topic, name) in h.db.pauses if topic == "orders"} == {"billing", "audit"}
    assert outcome(h, admin.pause_channel("orders", "audit", False)) is None
    assert {name for (topic, name) in h.db.pauses if topic == "orders"} == {"billing"}
    assert admin.channels_of("orders") == ["audit", "billing"]


def test_any_other_topic_is_the_fast_stores_made_on_first_use():
    h = Harness()
    admin = h.broker.topic_admin
    assert isinstance(outcome(h, admin.empty_topic("nowhere")), NoTopic)
    assert isinstance(outcome(h, admin.create_channel("nowhere", "c")), NoTopic)
    assert outcome(h, admin.create_topic("made")) is None and "made" in h.fast.topics
    assert outcome(h, admin.create_channel("made", "c")) is None
    assert isinstance(outcome(h, admin.pause_channel("made", "other", True)), NoChannel)
    assert outcome(h, admin.pause_topic("made", True)) is None and h.fast.topics["made"].paused
    assert outcome(h, admin.pause_channel("made", "c", True)) is None and h.fast.topics["made"].channels["c"].paused
    assert admin.channels_of("made") == ["c"] and admin.channels_of("nowhere") is None
    assert "made" in admin.topic_names() and "orders" in admin.topic_names()
    here, everywhere = admin.announced()
    assert here == {"made": ("c",)} and "orders" in everywhere and "made" not in everywhere
    assert [t["topic_name"] for t in admin.node_stats(None, False)] == ["made"]
    assert outcome(h, admin.delete_channel("made", "c")) is None and admin.channels_of("made") == []
    assert outcome(h, admin.delete_topic("made")) is None and "made" not in h.fast.topics
    assert outcome(h, admin.delete_topic("made")) is None  # not there: still 200 (nsqadmin sends it twice)
