"""bench/ordered_nodes.py: what it reads off the nodes and the consumers.

The bench reports publish->delivery latency per node a copy was sent to (an ordered topic's
copies stored on the non-orderer wait for its --ordered-poll): the producers tag each body
with their node, the consumers record each latency's tag. A tag in the wrong byte would
overwrite the send time (every latency wrong) or read as node 0; the orderer must be the node
every other one names, or the pushes per node would be read against the wrong node.
"""

from __future__ import annotations

from array import array

import pytest

from dmq_client.wire import Command, FrameDecoder
from tests.bench_modules import import_bench

_dmq_load = import_bench("_dmq_load")
ordered_nodes = import_bench("ordered_nodes")


@pytest.mark.parametrize("keyed", [False, True])
def test_a_tagged_body_keeps_its_send_time_and_carries_the_tag_in_its_ninth_byte(keyed):
    if keyed:
        template = _dmq_load.KeyedSendTemplate("t", "p", 200, _dmq_load.key_names(3), tag=2)
        data = template.frames(7, [0, 1, 2], 1_700_000_000_000, 123)
    else:
        template = _dmq_load.SendTemplate("t", "p", 200, tag=2)
        data = template.frame(7, 1_700_000_000_000, 123)
    frames = FrameDecoder(max_frame_size=len(data)).feed(data)
    assert frames and all(f.command == Command.UP_PRODUCER_SEND for f in frames)
    for frame in frames:
        assert len(frame.body) == 200
        assert _dmq_load.I64.unpack_from(frame.body, 0)[0] == 123
        assert frame.body[8] == 2 and frame.body[9:] == bytes(191)


def test_an_untagged_body_is_as_before_and_a_tag_needs_a_ninth_byte():
    assert _dmq_load.SendTemplate("t", "p", 8).body_rest == b""
    with pytest.raises(ValueError, match="tag byte"):
        _dmq_load.SendTemplate("t", "p", 8, tag=1)


def test_latencies_are_split_by_the_tag_recorded_beside_each():
    results = [
        {"lat": array("d", [0.1, 0.2]).tobytes(), "lat_tags": array("B", [1, 2]).tobytes()},
        {"lat": array("d", [0.3]).tobytes(), "lat_tags": array("B", [2]).tobytes()},
    ]
    split = ordered_nodes.by_tag(results)
    assert {tag: list(values) for tag, values in split.items()} == {1: [0.1], 2: [0.2, 0.3]}


def test_the_orderer_is_the_node_every_other_names():
    ids = ["n1", "n2"]
    assert ordered_nodes.orderer_of([None, "n1"], ids) == 0
    assert ordered_nodes.orderer_of(["n2", None], ids) == 1
    assert ordered_nodes.orderer_of([None, None], ids) is None  # unordered, or not agreed yet
    assert ordered_nodes.orderer_of([None, "?"], ids) is None  # node 2 does not serve it yet
    assert ordered_nodes.orderer_of(["no orderer", "no orderer"], ids) is None


def test_a_channel_is_found_in_a_nodes_stats():
    stats = {"topics": [{"topic_name": "a", "channels": [{"channel_name": "c1", "delivered_by": "n2"}]}]}
    assert ordered_nodes.channel_stats(stats, "a", "c1")["delivered_by"] == "n2"
    assert ordered_nodes.channel_stats(stats, "b", "c1") == {}
    assert ordered_nodes.channel_stats(None, "a", "c1") == {}


def test_publish_acks_are_split_by_the_node_each_producer_sent_to():
    producers = [{"lat": array("d", [float(i)]).tobytes()} for i in range(4)]
    split = ordered_nodes.ack_latencies(producers, [0, 1, 0, 1], 2)
    assert [list(a) for a in split] == [[0.0, 2.0], [1.0, 3.0]]
    assert [list(a) for a in ordered_nodes.ack_latencies(producers, [1, 1, 1, 1], 2)] == [[], [0.0, 1.0, 2.0, 3.0]]


def test_producers_go_to_both_nodes_or_to_the_orderer_or_to_the_other():
    assert ordered_nodes.send_targets("both", 1, 2) == [0, 1]
    assert ordered_nodes.send_targets("orderer", 1, 2) == [1]
    assert ordered_nodes.send_targets("other", 1, 2) == [0]
    assert ordered_nodes.send_targets("other", 0, 2) == [1]


def test_channel_samples_are_summed_up_per_field_and_flags_count_as_shares():
    samples = [
        {"depth": 10, "in_flight_count": 4000, "parked_count": 0, "backlog_pending": True},
        {"depth": 30, "in_flight_count": 2000, "parked_count": 2, "backlog_pending": False},
        {"depth": None, "in_flight_count": None, "parked_count": None, "backlog_pending": None},  # not served yet
    ]
    summary = ordered_nodes.sample_summary(samples)
    assert summary["samples"] == 3
    assert summary["depth"] == {"mean": 20.0, "max": 30.0}
    assert summary["in_flight_count"] == {"mean": 3000.0, "max": 4000.0}
    assert summary["backlog_pending"] == {"mean": 0.5, "max": 1.0}
