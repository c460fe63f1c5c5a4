"""bench/_nsq_load.py reads frames the way the NSQ codec writes them.

The benchmark's consumer takes a message's id and send time from fixed offsets and
its producer counts ``OK`` responses, scanning a buffer that TCP fills in arbitrary
pieces: if either drifted from the wire format, bench/nsq.py would count wrong. The
frames here come from dmq's own codec (``dmq_server.core.nsq_wire``), which the NSQ
compatibility tests hold to nsqd's bytes.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dmq_server.core.nsq_wire import FRAME_MESSAGE, FRAME_RESPONSE, message_frame, response
from tests.bench_modules import import_bench

_nsq_load = import_bench("_nsq_load")


def _stream(count: int) -> tuple[bytes, list[tuple[bytes, int]]]:
    frames, expected = [], []
    for i in range(count):
        mid = b"%016x" % (0xABC000 + i)
        sent_ns = 1_700_000_000_000_000_000 + i
        frames.append(message_frame(123, 1, mid, sent_ns.to_bytes(8, "big") + b"\x00" * 192))
        frames.append(response(b"_heartbeat_") if i % 5 == 4 else b"")
        expected.append((mid, sent_ns))
    return b"".join(frames), expected


@given(cuts=st.lists(st.integers(min_value=0, max_value=2500), max_size=12), count=st.integers(1, 10))
def test_frames_split_anywhere_are_found_whole_once_with_their_ids_and_send_times(cuts, count):
    data, expected = _stream(count)
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    scanner = _nsq_load.Frames()
    seen, heartbeats = [], 0
    for start, end in zip(bounds, bounds[1:]):
        for kind, lo, hi in scanner.feed(data[start:end]):
            buf = scanner.buf
            if kind == FRAME_MESSAGE:
                # the consumer's offsets: id at 10..26, the body's first 8 bytes at 26
                seen.append((bytes(buf[lo + 10 : lo + 26]), _nsq_load.I64.unpack_from(buf, lo + 26)[0]))
            else:
                assert kind == FRAME_RESPONSE and bytes(buf[lo:hi]) == _nsq_load.HEARTBEAT
                heartbeats += 1
        scanner.consumed()
    assert seen == expected
    assert heartbeats == count // 5
    assert scanner.buf == bytearray()  # nothing left over, nothing half-read


def test_an_ok_answer_is_two_bytes_of_response_data_which_the_producer_counts_by_length():
    scanner = _nsq_load.Frames()
    found = scanner.feed(response(b"OK") + response(b"_heartbeat_") + response(b"OK")[:5])
    assert [(kind, hi - lo) for kind, lo, hi in found] == [(FRAME_RESPONSE, 2), (FRAME_RESPONSE, 11)]
    scanner.consumed()
    assert scanner.feed(response(b"OK")[5:]) == [(FRAME_RESPONSE, 8, 10)]
