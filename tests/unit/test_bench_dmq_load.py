"""bench/_dmq_load.py's keyed sends carry the key they say, in frames the codec reads.

The ordered scenario of bench/reliable.py (issue 45 §2) compares an ordered topic with an
unordered one on messages of 10,000 keys. Its producers splice a key's status into one
encoded frame instead of encoding each message: if a splice were off by a byte, or two
keys' statuses differed in length, the server would refuse the sends or store them under
other keys and the ratio would measure something else. Its consumers find a push's status
at computed offsets to tell the hot key's messages from the rest.
"""

from __future__ import annotations

from collections import Counter

import pytest

from dmq_client.wire import Command, Frame, FrameDecoder, encode
from dmq_client.wire.properties import decode_properties
from tests.bench_modules import import_bench

_dmq_load = import_bench("_dmq_load")

KEYS = 10_000


def test_every_key_of_a_run_goes_out_in_a_frame_the_codec_decodes_with_that_key():
    names = _dmq_load.key_names(KEYS) + [_dmq_load.hot_key_name(KEYS)]
    assert len(set(names)) == KEYS + 1  # the hot key is none of the others
    template = _dmq_load.KeyedSendTemplate("t_ordered", "p0", 200, names)
    indices = list(range(len(names)))
    data = template.frames(500, indices, 1_700_000_000_123, 42)
    frames = FrameDecoder(max_frame_size=len(data)).feed(data)
    assert len(frames) == len(names)
    for index, frame in zip(indices, frames):
        assert frame.command == Command.UP_PRODUCER_SEND
        assert frame.session_id == 500 + index
        assert frame.topic == "t_ordered" and frame.producer == "p0"
        assert frame.timestamp_ms == 1_700_000_000_123
        assert decode_properties(frame.status).key == names[index]
        assert len(frame.body) == 200 and _dmq_load.I64.unpack_from(frame.body, 0)[0] == 42


def test_keys_whose_statuses_differ_in_length_are_refused():
    with pytest.raises(ValueError, match="one length"):
        _dmq_load.KeyedSendTemplate("t", "p", 200, ["k1", "k22"])


def test_a_plan_cycles_the_keys_so_consecutive_messages_differ_and_producers_share_them_evenly():
    producers, per_producer = 4, 25_000
    plans = [_dmq_load.key_plan(per_producer, KEYS, i, producers) for i in range(producers)]
    for plan in plans:
        assert all(a != b for a, b in zip(plan, plan[1:]))
    uses = Counter(k for plan in plans for k in plan)
    assert set(uses) == set(range(KEYS)) and set(uses.values()) == {producers * per_producer // KEYS}


def test_a_hot_share_gives_the_hot_key_that_share_spread_among_the_rest():
    plan = _dmq_load.key_plan(10_000, KEYS, 0, 4, hot_share=0.5)
    hot = [i for i, k in enumerate(plan) if k == KEYS]
    assert len(hot) == 5_000
    assert all(a != b for a, b in zip(plan, plan[1:]))  # every other message: never two hot in a row
    # the hot key takes its share without skipping any of the other keys' turns
    assert [k for k in plan if k != KEYS] == [(c * 4) % KEYS for c in range(5_000)]
    plan = _dmq_load.key_plan(1_000, KEYS, 0, 4, hot_share=0.1)
    assert list(plan).count(KEYS) == 100
    with pytest.raises(ValueError, match="outside 0..1"):
        _dmq_load.key_plan(10, KEYS, 0, 4, hot_share=1.5)


def test_the_consumer_finds_a_pushs_status_and_body_where_the_codec_put_them():
    hot = _dmq_load.key_status(_dmq_load.hot_key_name(KEYS))
    pushes = [
        Frame(Command.CONSUMER_PUSH, message_id=7 + i, topic="t_ordered", channel="c1", producer="p" * i,
              status=status, body=(1234 + i).to_bytes(8, "big") + b"x" * 8)
        for i, status in enumerate([hot, _dmq_load.key_status("k00001"), ""])
    ]
    data = b"".join(encode(f) for f in pushes)
    pos = 0
    found = []
    while pos < len(data):
        end = pos + 4 + _dmq_load.U32.unpack_from(data, pos)[0]
        start, body = _dmq_load.push_status_span(data, pos)
        found.append((data[start:body] == hot.encode(), data[start:body].decode(),
                      _dmq_load.I64.unpack_from(data, body)[0]))
        pos = end
    assert found == [(True, hot, 1234), (False, '{"key":"k00001"}', 1235), (False, "", 1236)]
