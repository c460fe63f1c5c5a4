"""Tests of the sans-IO dmq codec (``dmq_client.wire``).

Property tests (hypothesis) pin the invariants a peer in any language relies on:
every valid frame round-trips, chunking never matters, garbage only ever yields
FrameError. Example tests pin each specific error code and the exact byte layout,
so the layout in ``docs/protocol.md`` cannot drift silently.
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dmq_client.wire import Command, Frame, MessageType, valid_name
from dmq_client.wire.codec import (
    MAX_ACK_IDS,
    pack_ids,
    unpack_ids,
    DEFAULT_MAX_FRAME_SIZE,
    HEADER_SIZE,
    MIN_FRAME_SIZE,
    FrameDecoder,
    FrameError,
    PushEncoder,
    SendReplyEncoder,
    encode,
    frame_overhead,
)
from dmq_client.wire.frames import (
    DOWNSTREAM,
    FEATURE_REQUEUE,
    NAME_MAX_LENGTH,
    REQUEUE_MAX_MS,
    SERVER_FEATURES,
    STATUS_MAX_LENGTH,
    UPSTREAM,
    features,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

I64_MIN = -(2**63)
I64_MAX = 2**63 - 1
U32_MAX = 2**32 - 1

# Offsets inside an encoded frame (size prefix included), per the layout table.
OFF_CMD = 4
OFF_TYPE = 5
OFF_TOPIC_LEN = HEADER_SIZE  # 44: first byte after the fixed part

#: Small bound for decoders fed garbage, so random size fields often fit and the
#: payload checks get exercised, not only E_FRAME_TOO_LARGE.
SMALL_MAX = MIN_FRAME_SIZE + 600

# Hypothesis budgets sized for a 2-core CI machine; no deadlines (timing noise).
FAST = settings(max_examples=150, deadline=None)
SLOW = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------- strategies

i64 = st.integers(I64_MIN, I64_MAX)
#: Any ASCII text up to the 255 bytes the layout allows (control characters included:
#: the codec carries them, name rules are the server's business).
ascii_names = st.text(alphabet=st.characters(max_codepoint=127), max_size=255)
#: UTF-8 text of at most 1024 code points, hence at most 4096 bytes.
statuses = st.text(max_size=1024)
bodies = st.binary(max_size=4096)


@st.composite
def frames(draw, body=bodies):
    """Any frame the layout can hold, with every field drawn independently."""
    return Frame(
        command=draw(st.sampled_from(Command)),
        session_id=draw(i64),
        message_id=draw(i64),
        topic=draw(ascii_names),
        channel=draw(ascii_names),
        producer=draw(ascii_names),
        msg_type=draw(st.sampled_from(MessageType)),
        due_ms=draw(i64),
        timestamp_ms=draw(i64),
        attempts=draw(st.integers(0, 0xFFFF)),
        credit=draw(st.integers(0, U32_MAX)),
        status=draw(statuses),
        body=draw(body),
    )


small_frames = frames(body=st.binary(max_size=256))


def split(data: bytes, cuts) -> list[bytes]:
    """Cut ``data`` at the given offsets (duplicates and ends allowed)."""
    points = sorted({0, len(data), *(c for c in cuts if 0 <= c <= len(data))})
    return [data[a:b] for a, b in zip(points, points[1:])]


@st.composite
def chunked(draw, data: bytes) -> list[bytes]:
    """``data`` split at hypothesis-chosen points; sometimes one byte at a time."""
    if draw(st.booleans()):
        return [data[i : i + 1] for i in range(len(data))]
    cuts = draw(st.lists(st.integers(0, len(data)), max_size=20))
    return split(data, cuts)


def with_size(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def patched(frame_bytes: bytes, offset: int, value: int) -> bytes:
    out = bytearray(frame_bytes)
    out[offset] = value
    return bytes(out)


def decode_error(data: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> FrameError:
    with pytest.raises(FrameError) as info:
        FrameDecoder(max_frame_size).feed(data)
    return info.value


# --------------------------------------------------------------------------- round trips


@FAST
@given(frames())
def test_every_valid_frame_round_trips(frame):
    """Any frame the layout can hold decodes back to an equal frame, consuming all bytes."""
    decoder = FrameDecoder()
    assert decoder.feed(encode(frame)) == [frame]
    assert decoder.buffered == 0


@FAST
@given(frames())
def test_frame_overhead_is_encoded_length_minus_body(frame):
    """frame_overhead() reports exactly the non-body bytes encode() produces."""
    assert frame_overhead(frame) == len(encode(frame)) - len(frame.body)


@SLOW
@given(st.data())
def test_frame_stream_round_trips_however_it_is_chunked(data):
    """A sequence of frames decodes in order whatever the chunking of the stream,
    including one byte at a time; the buffer never holds more than one partial frame."""
    sequence = data.draw(st.lists(small_frames, min_size=1, max_size=5))
    encoded = [encode(f) for f in sequence]
    stream = b"".join(encoded)
    longest = max(len(e) for e in encoded)
    decoder = FrameDecoder()
    out = []
    for chunk in data.draw(chunked(stream)):
        out.extend(decoder.feed(chunk))
        assert decoder.buffered < longest
    assert out == sequence
    assert decoder.buffered == 0


@FAST
@given(small_frames, st.integers(0, 3))
def test_frames_read_into_any_buffer_type_have_bytes_bodies(frame, kind):
    """Whatever a reader hands over (bytes, a bytearray, a memoryview, or a read that
    completes a buffered frame), a frame's body is bytes, equal to the one sent."""
    encoded = encode(frame)
    decoder = FrameDecoder()
    if kind == 3:
        assert decoder.feed(encoded[:3]) == []
        (got,) = decoder.feed(bytearray(encoded[3:]))
    else:
        (got,) = decoder.feed((bytes, bytearray, memoryview)[kind](encoded))
    assert type(got.body) is bytes and got == frame


@FAST
@given(small_frames, st.data())
def test_truncated_stream_waits_then_completes(frame, data):
    """A frame missing its tail yields nothing and buffers exactly what arrived;
    the rest of the bytes then produce the frame."""
    encoded = encode(frame)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    decoder = FrameDecoder()
    for chunk in data.draw(chunked(encoded[:cut])):
        assert decoder.feed(chunk) == []
    assert decoder.buffered == cut
    assert decoder.feed(encoded[cut:]) == [frame]
    assert decoder.buffered == 0


def test_empty_feed_is_a_no_op():
    """Feeding no bytes returns no frames and changes nothing."""
    decoder = FrameDecoder()
    assert decoder.feed(b"") == []
    assert decoder.buffered == 0


def test_frame_of_maximum_default_size_round_trips():
    """The default bound admits a 1 MiB body with every string at its layout maximum."""
    frame = Frame(
        Command.UP_PRODUCER_SEND,
        topic="t" * 255,
        channel="c" * 255,
        producer="p" * 255,
        status="s" * STATUS_MAX_LENGTH,
        body=b"\xab" * (1024 * 1024),
    )
    encoded = encode(frame)
    assert len(encoded) == 4 + DEFAULT_MAX_FRAME_SIZE
    assert FrameDecoder().feed(encoded) == [frame]


# --------------------------------------------------------------------------- garbage


@st.composite
def garbage(draw):
    """Hostile input: raw bytes, random payloads behind a plausible size field, or a
    valid stream with a few bytes overwritten."""
    kind = draw(st.sampled_from(["raw", "sized", "mutated"]))
    if kind == "raw":
        return draw(st.binary(max_size=2048))
    if kind == "sized":
        parts = draw(st.lists(st.binary(max_size=SMALL_MAX + 8), min_size=1, max_size=4))
        return b"".join(with_size(p) for p in parts)
    stream = bytearray(b"".join(encode(f) for f in draw(st.lists(small_frames, min_size=1, max_size=3))))
    for _ in range(draw(st.integers(1, 4))):
        stream[draw(st.integers(0, len(stream) - 1))] = draw(st.integers(0, 255))
    return bytes(stream)


@SLOW
@given(st.data())
def test_garbage_only_ever_raises_frame_error_and_then_stays_failed(data):
    """Arbitrary bytes, arbitrarily chunked, either decode or raise FrameError, nothing
    else; whatever decodes re-encodes to exactly the bytes consumed (the encoding is
    canonical); after a FrameError every further feed raises FrameError too."""
    stream = data.draw(garbage())
    decoder = FrameDecoder(SMALL_MAX)
    decoded: list[Frame] = []
    fed = 0
    error = None
    for chunk in data.draw(chunked(stream)):
        try:
            decoded.extend(decoder.feed(chunk))
        except FrameError as exc:
            error = exc
            break
        fed += len(chunk)
        assert decoder.buffered < 4 + SMALL_MAX
    consumed = b"".join(encode(f) for f in decoded)
    assert stream.startswith(consumed)
    if error is None:
        assert decoder.buffered == fed - len(consumed)
        return
    assert error.code in {
        "E_BAD_FRAME",
        "E_FRAME_TOO_LARGE",
        "E_BAD_COMMAND",
        "E_BAD_MSG_TYPE",
        "E_BAD_ENCODING",
    }
    assert str(error).startswith(error.code + " ")
    assert decoder.buffered == 0
    for more in (b"", encode(Frame(Command.UP_HEARTBEAT)), data.draw(st.binary(max_size=64))):
        with pytest.raises(FrameError) as again:
            decoder.feed(more)
        assert again.value.code == error.code


# --------------------------------------------------------------------------- size field


@FAST
@given(st.integers(MIN_FRAME_SIZE, 100_000), st.data())
def test_oversized_frame_is_refused_as_soon_as_its_size_arrives(limit, data):
    """A size above max_frame_size raises E_FRAME_TOO_LARGE on the feed that completes
    the 4 size bytes, before any body is buffered."""
    size = data.draw(st.integers(limit + 1, U32_MAX))
    prefix = struct.pack(">I", size)
    decoder = FrameDecoder(limit)
    assert decoder.feed(prefix[:3]) == []
    assert decoder.buffered == 3
    with pytest.raises(FrameError) as info:
        decoder.feed(prefix[3:])
    assert info.value.code == "E_FRAME_TOO_LARGE"
    assert decoder.buffered == 0


def test_size_equal_to_the_limit_is_accepted():
    """max_frame_size is inclusive: a frame of exactly that size decodes."""
    frame = Frame(Command.CONSUMER_PUSH, body=b"x" * 100)
    encoded = encode(frame)
    assert FrameDecoder(len(encoded) - 4).feed(encoded) == [frame]
    assert decode_error(encoded, len(encoded) - 5).code == "E_FRAME_TOO_LARGE"


def test_decoder_refuses_a_limit_below_the_minimum_frame():
    """A decoder that could accept no frame at all is a configuration error."""
    with pytest.raises(ValueError):
        FrameDecoder(MIN_FRAME_SIZE - 1)


@pytest.mark.parametrize("size", [0, 1, MIN_FRAME_SIZE // 2, MIN_FRAME_SIZE - 1])
def test_size_below_minimum_is_bad_frame(size):
    """A size that cannot hold the fixed part and four length fields is E_BAD_FRAME,
    raised as soon as the size is read."""
    assert decode_error(struct.pack(">I", size)).code == "E_BAD_FRAME"


# --------------------------------------------------------------------------- payload errors

PLAIN = encode(Frame(Command.UP_HEARTBEAT))  # all strings empty, no body


def test_plain_frame_is_minimal():
    """A frame with no strings and no body is exactly the minimum size."""
    assert len(PLAIN) == 4 + MIN_FRAME_SIZE


@FAST
@given(st.integers(0, 255).filter(lambda c: c not in set(Command)))
def test_unknown_command_is_bad_command(code):
    """A command byte that names no Command is E_BAD_COMMAND."""
    assert decode_error(patched(PLAIN, OFF_CMD, code)).code == "E_BAD_COMMAND"


@FAST
@given(st.integers(0, 255).filter(lambda t: t not in set(MessageType)))
def test_unknown_message_type_is_bad_msg_type(mtype):
    """A message type byte that names no MessageType is E_BAD_MSG_TYPE."""
    assert decode_error(patched(PLAIN, OFF_TYPE, mtype)).code == "E_BAD_MSG_TYPE"


@pytest.mark.parametrize("field", ["topic", "channel", "producer", "status"])
@pytest.mark.parametrize("excess", [1, 200])
def test_string_length_past_frame_end_is_bad_frame(field, excess):
    """A string length larger than what remains of the frame is E_BAD_FRAME (the
    frame size, not the string length, bounds what is read)."""
    frame = Frame(Command.UP_PRODUCER_SEND, topic="t", channel="c", producer="p", status="s")
    encoded = bytearray(encode(frame))
    # strings follow the fixed part: each name is 1 length byte + 1 char, status has 2
    offset = OFF_TOPIC_LEN + {"topic": 0, "channel": 2, "producer": 4, "status": 6}[field]
    remaining = len(encoded) - offset - (2 if field == "status" else 1)
    if field == "status":
        struct.pack_into(">H", encoded, offset, remaining + excess)
    else:
        encoded[offset] = min(255, remaining + excess)
    error = decode_error(bytes(encoded))
    assert error.code == "E_BAD_FRAME"
    assert field in error.message


def test_frame_ending_inside_a_length_field_is_bad_frame():
    """A topic that eats the bytes meant for the later length fields is E_BAD_FRAME."""
    # minimum-size frame: 5 length bytes after the fixed part; topic_len=3 consumes
    # channel_len, producer_len and half of status_len as topic text
    error = decode_error(patched(PLAIN, OFF_TOPIC_LEN, 3))
    assert error.code == "E_BAD_FRAME"


@pytest.mark.parametrize("field", ["topic", "channel", "producer"])
@pytest.mark.parametrize("byte", [0x80, 0xC3, 0xFF])
def test_non_ascii_name_bytes_are_bad_encoding(field, byte):
    """Names are ASCII on the wire: any byte >= 0x80 in them is E_BAD_ENCODING."""
    frame = Frame(Command.UP_SUBSCRIBE, topic="t", channel="c", producer="p")
    offset = OFF_TOPIC_LEN + 1 + {"topic": 0, "channel": 2, "producer": 4}[field]
    error = decode_error(patched(encode(frame), offset, byte))
    assert error.code == "E_BAD_ENCODING"
    assert field in error.message


@pytest.mark.parametrize("raw", [b"\xff", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80"])
def test_invalid_utf8_status_is_bad_encoding(raw):
    """The status must be strict UTF-8 (no stray, truncated, overlong or surrogate forms)."""
    payload = encode(Frame(Command.PROTOCOL_ERROR))[4:-2]  # drop size and status_len
    payload += struct.pack(">H", len(raw)) + raw
    assert decode_error(with_size(payload)).code == "E_BAD_ENCODING"


def test_valid_frames_before_an_error_are_not_returned_by_the_failing_feed():
    """A feed that hits an error raises; frames earlier in the same chunk are dropped
    with it, since the connection is closed anyway."""
    decoder = FrameDecoder()
    with pytest.raises(FrameError):
        decoder.feed(PLAIN + patched(PLAIN, OFF_CMD, 0))


# --------------------------------------------------------------------------- send replies

send_replies = st.sampled_from(sorted(c for c in Command if c.name.startswith("SEND_")))


@SLOW
@given(st.lists(st.tuples(send_replies, i64, i64, ascii_names, ascii_names, statuses), max_size=20))
def test_send_replies_are_what_encode_makes_of_the_frame(replies):
    """The server's shortcut for SEND_* answers gives encode's bytes exactly, whether
    its cached tail is fresh or reused (the same encoder answers the whole list)."""
    reply = SendReplyEncoder()
    for command, session_id, message_id, topic, producer, status in replies + replies:
        expected = encode(
            Frame(command, session_id=session_id, message_id=message_id, topic=topic, producer=producer,
                  status=status)
        )
        assert reply(command, session_id, message_id, topic, producer, status) == expected


@pytest.mark.parametrize(
    "args",
    [
        (Command.SEND_SUCCESS_ACK, I64_MAX + 1, 1, "t", "p", ""),
        (Command.SEND_SUCCESS_ACK, 1, I64_MIN - 1, "t", "p", ""),
        (Command.SEND_SUCCESS_ACK, 1, 1, "t" * 256, "p", ""),
        (Command.SEND_SUCCESS_ACK, 1, 1, "t", "prodüct", ""),
        (250, 1, 1, "t", "p", ""),
    ],
    ids=["session-id", "message-id", "long-topic", "non-ascii", "unknown-command"],
)
def test_send_replies_refuse_what_encode_refuses(args):
    reply = SendReplyEncoder()
    reply(Command.SEND_SUCCESS_ACK, 1, 1, "t", "p", "")  # a cached tail must not let a bad value through
    with pytest.raises(FrameError) as info:
        reply(*args)
    assert info.value.code == "E_INVALID"


# --------------------------------------------------------------------------- encode refusals


@pytest.mark.parametrize("field", ["session_id", "message_id", "timestamp_ms", "due_ms"])
@FAST
@given(value=st.one_of(st.integers(max_value=I64_MIN - 1), st.integers(min_value=I64_MAX + 1)))
def test_encode_refuses_int64_out_of_range(field, value):
    """int64 fields outside int64 are E_INVALID, not a struct error."""
    with pytest.raises(FrameError) as info:
        encode(Frame(Command.UP_PRODUCER_SEND, **{field: value}))
    assert info.value.code == "E_INVALID"


@FAST
@given(
    st.one_of(
        st.tuples(st.just("attempts"), st.integers(max_value=-1)),
        st.tuples(st.just("attempts"), st.integers(min_value=0x10000)),
        st.tuples(st.just("credit"), st.integers(max_value=-1)),
        st.tuples(st.just("credit"), st.integers(min_value=U32_MAX + 1)),
    )
)
def test_encode_refuses_unsigned_fields_out_of_range(field_value):
    """attempts (u16) and credit (u32) outside their ranges are E_INVALID."""
    field, value = field_value
    with pytest.raises(FrameError) as info:
        encode(Frame(Command.UP_CREDIT, **{field: value}))
    assert info.value.code == "E_INVALID"


@pytest.mark.parametrize("field", ["session_id", "credit", "attempts"])
@pytest.mark.parametrize("value", [1.0, "1", None])
def test_encode_refuses_non_integers(field, value):
    """Integer fields holding something else are E_INVALID, not a struct error."""
    with pytest.raises(FrameError) as info:
        encode(Frame(Command.UP_CREDIT, **{field: value}))
    assert info.value.code == "E_INVALID"


@pytest.mark.parametrize("field", ["topic", "channel", "producer"])
@FAST
@given(name=st.text(min_size=1, max_size=20).filter(lambda s: not s.isascii()))
def test_encode_refuses_non_ascii_names(field, name):
    """Non-ASCII topic, channel or producer is E_INVALID."""
    with pytest.raises(FrameError) as info:
        encode(Frame(Command.UP_SUBSCRIBE, **{field: name}))
    assert info.value.code == "E_INVALID"


@pytest.mark.parametrize("field", ["topic", "channel", "producer"])
def test_encode_refuses_names_longer_than_the_layout(field):
    """255 ASCII bytes fit the u8 length; 256 are E_INVALID."""
    encode(Frame(Command.UP_SUBSCRIBE, **{field: "n" * 255}))
    with pytest.raises(FrameError) as info:
        encode(Frame(Command.UP_SUBSCRIBE, **{field: "n" * 256}))
    assert info.value.code == "E_INVALID"


@pytest.mark.parametrize("command", [0, 10, 31, 50, 255, 256, -1])
def test_encode_refuses_unknown_commands(command):
    """encode only emits command codes the decoder accepts."""
    with pytest.raises(FrameError) as info:
        encode(Frame(command))
    assert info.value.code == "E_INVALID"


@pytest.mark.parametrize("msg_type", [2, 255, 256, -1])
def test_encode_refuses_unknown_message_types(msg_type):
    """encode only emits message types the decoder accepts."""
    with pytest.raises(FrameError) as info:
        encode(Frame(Command.UP_PRODUCER_SEND, msg_type=msg_type))
    assert info.value.code == "E_INVALID"


def test_encode_refuses_status_with_lone_surrogates():
    """A status that has no UTF-8 form is E_INVALID, not a UnicodeEncodeError."""
    with pytest.raises(FrameError) as info:
        encode(Frame(Command.PROTOCOL_ERROR, status="E_BAD_FRAME \udcff"))
    assert info.value.code == "E_INVALID"


def test_status_at_limit_is_kept_and_longer_status_is_truncated_on_a_char_boundary():
    """A 4096-byte status travels whole; a longer one is cut to at most 4096 bytes
    without splitting a UTF-8 sequence, so the receiver can still decode it."""
    exact = "é" * (STATUS_MAX_LENGTH // 2)  # 2 bytes each: exactly 4096
    assert FrameDecoder().feed(encode(Frame(Command.PROTOCOL_ERROR, status=exact)))[0].status == exact
    long = "ab" + "€" * 2000  # 2 + 3 * 2000 bytes; byte 4096 falls inside a "€"
    (decoded,) = FrameDecoder().feed(encode(Frame(Command.PROTOCOL_ERROR, status=long)))
    assert long.startswith(decoded.status)
    assert len(decoded.status.encode("utf-8")) == 2 + 3 * 1364  # 4094: the split "€" is dropped
    assert len(decoded.status) == 2 + 1364


# --------------------------------------------------------------------------- golden bytes


def test_golden_bytes_every_field():
    """One frame with every field set to a distinct value has exactly this encoding;
    any change to field order, width, signedness or endianness breaks it."""
    frame = Frame(
        command=Command.CONSUMER_PUSH,
        msg_type=MessageType.DELAY,
        attempts=0x0102,
        credit=0x03040506,
        session_id=-2,
        message_id=0x0708090A0B0C0D0E,
        timestamp_ms=1_700_000_000_000,
        due_ms=1_700_000_060_000,
        topic="orders",
        channel="billing",
        producer="shop-1",
        status="ok é",
        body=b"\x00hi\xff",
    )
    expected = bytes.fromhex(
        "00000049"  # size: 73 bytes follow (40 fixed + 7 + 8 + 7 + 7 + 4)
        "28"  # cmd 40 CONSUMER_PUSH
        "01"  # msg_type DELAY
        "0102"  # attempts
        "03040506"  # credit
        "fffffffffffffffe"  # session_id -2
        "0708090a0b0c0d0e"  # message_id
        "0000018bcfe56800"  # timestamp_ms 1700000000000
        "0000018bcfe65260"  # due_ms 1700000060000
        "06" + b"orders".hex()
        + "07" + b"billing".hex()
        + "06" + b"shop-1".hex()
        + "0005" + "ok é".encode().hex()
        + "006869ff"  # body
    )
    assert encode(frame) == expected
    assert FrameDecoder().feed(expected) == [frame]


#: The worked example in docs/protocol.md; kept identical here.
DOC_SEND = Frame(
    Command.UP_PRODUCER_SEND,
    session_id=42,
    topic="orders",
    producer="billing-1",
    timestamp_ms=1_700_000_000_000,
    body=b"hello",
)
DOC_SEND_HEX = (
    "00000041 02 00 0000 00000000 000000000000002a 0000000000000000 0000018bcfe56800"
    " 0000000000000000 06 6f7264657273 00 09 62696c6c696e672d31 0000 68656c6c6f"
)
DOC_ACK = Frame(Command.SEND_SUCCESS_ACK, session_id=42, message_id=7, topic="orders")
DOC_ACK_HEX = (
    "00000033 21 00 0000 00000000 000000000000002a 0000000000000007 0000000000000000"
    " 0000000000000000 06 6f7264657273 00 00 0000"
)


@pytest.mark.parametrize("frame,hexdump", [(DOC_SEND, DOC_SEND_HEX), (DOC_ACK, DOC_ACK_HEX)])
def test_golden_bytes_of_the_documented_example(frame, hexdump):
    """The send and SEND_SUCCESS_ACK shown in docs/protocol.md encode exactly as shown."""
    assert encode(frame) == bytes.fromhex(hexdump.replace(" ", ""))


def test_protocol_doc_shows_the_golden_example():
    """docs/protocol.md carries the same hex as the golden test, so doc and code agree."""
    doc = (REPO_ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    flat = re.sub(r"\s+", "", doc)
    for hexdump in (DOC_SEND_HEX, DOC_ACK_HEX):
        assert hexdump.replace(" ", "") in flat


# --------------------------------------------------------------------------- name rule

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def reference_valid_name(name: str) -> bool:
    """NSQ's rule, restated without a regex: ``^[.a-zA-Z0-9_-]+(#ephemeral)?$``, 1..64."""
    if not 1 <= len(name) <= NAME_MAX_LENGTH:
        return False
    stem = name[: -len("#ephemeral")] if name.endswith("#ephemeral") else name
    return len(stem) >= 1 and all(c in _NAME_CHARS for c in stem)


@pytest.mark.parametrize(
    "name",
    [
        "a",
        "orders",
        "Orders.v2_eu-west",
        "...",
        "-",
        "a" * 64,
        "x#ephemeral",
        "a" * 54 + "#ephemeral",
        "0123456789",
    ],
)
def test_valid_names(name):
    """Names matching NSQ's rule, up to 64 characters including the suffix, are valid."""
    assert valid_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a" * 65,
        "a" * 55 + "#ephemeral",
        "#ephemeral",
        "a#ephemeral#ephemeral",
        "a#Ephemeral",
        "a#",
        "a b",
        "a/b",
        "a:b",
        "orders\n",
        "orders#ephemeral\n",
        "\norders",
        "ordér",
        "٣",  # a non-ASCII digit
    ],
)
def test_invalid_names(name):
    """Anything else is invalid, including a trailing newline (Python's ``$`` trap)."""
    assert not valid_name(name)


@FAST
@given(
    st.one_of(
        st.text(alphabet=st.sampled_from(sorted(_NAME_CHARS) + ["#", " ", "\n", "é"]), max_size=70),
        st.text(alphabet=st.sampled_from(sorted(_NAME_CHARS)), max_size=60).map(
            lambda s: s + "#ephemeral"
        ),
        st.text(max_size=70),
    )
)
def test_valid_name_agrees_with_reference_rule(name):
    """valid_name matches the rule restated independently, for arbitrary text."""
    assert valid_name(name) == reference_valid_name(name)


# --------------------------------------------------------------------------- no IO imports


def test_importing_wire_pulls_in_no_io_libraries():
    """The codec is sans-IO: a clean interpreter importing dmq_client.wire loads no
    Twisted, psycopg, socket or kazoo module."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "import dmq_client.wire\n"
        "banned = ('twisted', 'psycopg', 'psycopg2', 'socket', '_socket', 'kazoo')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in banned))\n"
    )
    # -S: no site module, so nothing but the import under test can load these
    result = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --------------------------------------------------------------------------- pushes


@SLOW
@given(st.lists(st.tuples(i64, i64, ascii_names, ascii_names, ascii_names, i64, st.integers(0, 0xFFFF),
                          st.binary(max_size=300), st.sampled_from(["", "", '{"key":"k"}', '{"key":"é","priority":9}'])),
                max_size=20))
def test_pushes_are_what_encode_makes_of_the_frame(pushes):
    """The server's shortcut for CONSUMER_PUSH gives encode's bytes exactly, whether its
    cached names are fresh or reused (the same encoder makes the whole list twice), with a
    message's properties in the status or none."""
    push = PushEncoder()
    for message_id, session_id, producer, topic, channel, timestamp_ms, attempts, body, status in pushes + pushes:
        expected = encode(
            Frame(Command.CONSUMER_PUSH, session_id=session_id, message_id=message_id, topic=topic,
                  channel=channel, producer=producer, timestamp_ms=timestamp_ms, attempts=attempts, status=status,
                  body=body)
        )
        assert push(message_id, session_id, producer, topic, channel, timestamp_ms, attempts, body, status) == expected
        (decoded,) = FrameDecoder().feed(expected)
        assert decoded.status == status


def test_a_push_refuses_properties_past_the_bound_instead_of_cutting_them():
    push = PushEncoder()
    with pytest.raises(FrameError) as info:
        push(1, 1, "p", "t", "c", 0, 1, b"x", "k" * (STATUS_MAX_LENGTH + 1))
    assert info.value.code == "E_INVALID" and "over 4096 bytes" in info.value.message


@pytest.mark.parametrize(
    "args",
    [
        (I64_MAX + 1, 1, "p", "t", "c", 0, 1, b""),
        (1, I64_MIN - 1, "p", "t", "c", 0, 1, b""),
        (1, 1, "p", "t", "c", I64_MAX + 1, 1, b""),
        (1, 1, "p", "t", "c", 0, 0x10000, b""),
        (1, 1, "p", "t" * 256, "c", 0, 1, b""),
        (1, 1, "prodüct", "t", "c", 0, 1, b""),
    ],
    ids=["message-id", "session-id", "timestamp", "attempts", "long-topic", "non-ascii"],
)
def test_pushes_refuse_what_encode_refuses(args):
    push = PushEncoder()
    push(1, 1, "p", "t", "c", 0, 1, b"x")  # a cached tail must not let a bad value through
    with pytest.raises(FrameError) as info:
        push(*args)
    assert info.value.code == "E_INVALID"


# -- UP_CONSUMER_ACKS bodies -------------------------------------------------------


@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=300))
def test_ack_ids_round_trip_in_order_as_big_endian_i64(ids):
    body = pack_ids(ids)
    assert body == b"".join(struct.pack(">q", i) for i in ids)
    assert list(unpack_ids(body)) == ids


@pytest.mark.parametrize(
    "ids", [[], [2**63], [5, -(2**63) - 1], [1.5], ["7"], list(range(1, MAX_ACK_IDS + 2))]
)
def test_pack_ids_refuses_what_is_not_a_batch_of_i64_ids(ids):
    with pytest.raises(FrameError) as caught:
        pack_ids(ids)
    assert caught.value.code == "E_INVALID"


@pytest.mark.parametrize("size", [0, 1, 7, 9, 8 * (MAX_ACK_IDS + 1)])
def test_unpack_ids_refuses_a_body_that_is_not_whole_ids(size):
    with pytest.raises(FrameError) as caught:
        unpack_ids(b"\x01" * size)
    assert caught.value.code == "E_BAD_FRAME" and str(size) in caught.value.message


# --------------------------------------------------------------------------- requeue (§4.16)


def test_requeue_frame_has_these_bytes_and_round_trips():
    """UP_CONSUMER_REQUEUE is command 9 and carries its delay in ``credit`` (u32 ms);
    REQUEUE_ACK is 49 and echoes the request with a status. Pinned byte for byte so
    docs/protocol.md §4.16 cannot drift."""
    frame = Frame(Command.UP_CONSUMER_REQUEUE, message_id=7, topic="t", channel="c", credit=1500)
    raw = encode(frame)
    assert raw[4] == 9 and Command.UP_CONSUMER_REQUEUE in UPSTREAM
    assert raw[8:12] == (1500).to_bytes(4, "big")
    assert raw[20:28] == (7).to_bytes(8, "big")
    assert FrameDecoder().feed(raw) == [frame]
    ack = Frame(Command.REQUEUE_ACK, message_id=7, topic="t", channel="c", credit=1500,
                status="E_REQUEUE_FAILED ID not in flight")
    assert encode(ack)[4] == 49 and Command.REQUEUE_ACK in DOWNSTREAM
    assert FrameDecoder().feed(encode(ack)) == [ack]


@pytest.mark.parametrize("delay_ms", [-1, REQUEUE_MAX_MS + 1, 1.5])
def test_requeue_delay_outside_the_field_is_refused_by_encode(delay_ms):
    """A delay the u32 field cannot hold (negative, above 2**32-1 ms, not an integer)
    is E_INVALID naming the field, never a wrapped or truncated delay."""
    with pytest.raises(FrameError) as info:
        encode(Frame(Command.UP_CONSUMER_REQUEUE, message_id=1, topic="t", channel="c", credit=delay_ms))
    assert info.value.code == "E_INVALID" and "credit" in info.value.message


def test_servers_list_the_requeue_feature():
    """A client uses UP_CONSUMER_REQUEUE only where the server listed REQUEUE (§4.1)."""
    assert FEATURE_REQUEUE in features(SERVER_FEATURES)
