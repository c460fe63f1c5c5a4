"""bench/reliable.py's priority scenario (issue 45 §3) sends each message with its priority
and judges the order the pushes came in.

Its producers send from a template per priority instead of encoding each message, and its
consumers read a push's priority from the status bytes without decoding the frame: if a
template were off by a byte the server would refuse the sends or store other priorities,
and if the consumer misread a status the order figures (the ones that would say a message
came out of priority order) would judge something else. The order check itself must count
a push that came after one of lower priority, and only that, as out of priority order.
"""

from __future__ import annotations

from array import array

import pytest

from dmq_client.wire import Command, Frame, FrameDecoder, encode
from dmq_client.wire.properties import Properties, decode_properties, encode_properties
from tests.bench_modules import import_bench

_dmq_load = import_bench("_dmq_load")
reliable = import_bench("reliable")


def test_each_send_goes_out_with_the_priority_its_plan_gives_in_a_frame_the_codec_decodes():
    templates = _dmq_load.PrioritySendTemplates("t_prio", "p0", 200)
    plan = [9, 0, 5, 0, 1, 9, 3]
    data = templates.frames(41, plan, 1_700_000_000_123, 42)
    frames = FrameDecoder(max_frame_size=len(data)).feed(data)
    assert [decode_properties(f.status).priority if f.status else 0 for f in frames] == plan
    assert [f.session_id for f in frames] == list(range(41, 41 + len(plan)))
    for frame in frames:
        assert frame.command == Command.UP_PRODUCER_SEND and frame.topic == "t_prio" and frame.producer == "p0"
        assert frame.timestamp_ms == 1_700_000_000_123
        assert len(frame.body) == 200 and _dmq_load.I64.unpack_from(frame.body, 0)[0] == 42
    assert frames[1].status == ""  # priority 0 as an old client sends it: no properties


def test_the_consumer_reads_each_pushs_priority_where_the_codec_put_its_status():
    pushes = [Frame(Command.CONSUMER_PUSH, message_id=100 + p, topic="t_prio", channel="c1", producer="p" * p,
                    status=encode_properties(Properties(key="k" * p or None, priority=p,
                                                       headers={"x-a": "b"} if p % 2 else {})),
                    body=b"\x00" * 16)
              for p in range(10)]
    data = b"".join(encode(f) for f in pushes)
    pos, found = 0, []
    while pos < len(data):
        start, body = _dmq_load.push_status_span(data, pos)
        found.append(_dmq_load.status_priority(data[start:body]) if body > start else 0)
        pos += 4 + _dmq_load.U32.unpack_from(data, pos)[0]
    assert found == list(range(10))


def test_a_mixed_plan_draws_every_priority_alike_and_the_same_in_every_run():
    plans = [_dmq_load.priority_plan(25_000, True, seed=i) for i in range(4)]
    counts = [sum(plan.count(p) for plan in plans) for p in range(10)]
    assert all(9_500 <= c <= 10_500 for c in counts), counts
    assert plans[0] == _dmq_load.priority_plan(25_000, True, seed=0)
    assert plans[0] != plans[1]
    assert _dmq_load.priority_plan(1_000, False, seed=0) == array("b", bytes(1_000))


def test_pushes_in_priority_then_id_order_are_all_in_order():
    order = reliable.priority_order([5, 9, 2, 7, 1, 3], [9, 9, 5, 5, 0, 0])
    assert order == {"out_of_priority_order": 0, "out_of_rank_order": 0, "examples": []}


def test_a_push_after_one_of_lower_priority_is_out_of_priority_order():
    # 8 came after a 5 was pushed: the one push out of priority order, and out of rank
    order = reliable.priority_order([1, 2, 3, 4], [9, 5, 8, 5])
    assert order["out_of_priority_order"] == 1
    assert order["out_of_rank_order"] == 1
    assert order["examples"] == [{"at": 2, "id": 3, "priority": 8, "after_id": 2, "after_priority": 5}]


def test_a_lower_id_after_a_higher_one_of_its_priority_is_out_of_rank_order_only():
    order = reliable.priority_order([10, 4, 11, 2], [9, 9, 9, 3])
    assert order["out_of_priority_order"] == 0
    assert order["out_of_rank_order"] == 1 and order["examples"][0]["id"] == 4


def test_the_drains_rate_per_tenth_comes_from_the_consumers_reads():
    # two consumers, 100 messages: 10 a read, one read every 0.1 s in all
    reads = [array("d"), array("d")]
    for i in range(10):
        reads[i % 2].extend((1000.0 + 0.1 * (i + 1), 10 * (i // 2 + 1)))
    tenths = reliable.drain_tenths([{"order_times": r.tobytes()} for r in reads], 100, 1000.0)
    assert tenths == [100.0] * 10


def test_the_priority_scenario_and_its_options_parse():
    a = reliable.parse_args(["--scenarios", "priority", "--priority-consumers", "1,8,2"])
    assert a.scenarios == ["priority"] and a.priority_consumers == (1, 8, 2)
    assert (a.priority_messages, a.priority_pairs, a.priority_live_seconds, a.priority_cold) == (100_000, 2, 10.0, False)
    q = reliable.parse_args(["--quick", "--priority-live-seconds", "0", "--priority-cold"])
    assert (q.priority_messages, q.priority_live_seconds, q.priority_cold) == (20_000, 0.0, True)
    assert "priority" in q.scenarios


@pytest.mark.parametrize("argv", [["--priority-consumers", "0"], ["--priority-consumers", "1,x"],
                                  ["--priority-pairs", "0"], ["--priority-live-seconds", "-1"]])
def test_bad_priority_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        reliable.parse_args(argv)
    assert "priority" in capsys.readouterr().err
