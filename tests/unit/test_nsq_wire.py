"""The NSQ V2 codec: commands parsed with nsqd's exact errors, frames encoded byte for byte."""

from __future__ import annotations

import struct

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dmq_server.core.nsq_errors import CloseSilently, FatalClientError
from dmq_server.core.nsq_wire import (
    FRAME_ERROR,
    FRAME_MESSAGE,
    FRAME_RESPONSE,
    Command,
    CommandParser,
    FrameReader,
    decode_message,
    encode_command,
    encode_message,
    error_frame,
    go_quote,
    message_frame,
    mpub_body,
    parse_base10,
    response,
    valid_name_bytes,
)


def parse_all(data: bytes, **kw) -> list[Command]:
    parser = CommandParser(**kw)
    parser.receive_data(data)
    out = []
    while (cmd := parser.next_command()) is not None:
        out.append(cmd)
    return out


def error_of(data: bytes, **kw) -> FatalClientError:
    with pytest.raises(FatalClientError) as info:
        parse_all(data, **kw)
    return info.value


# -- frames -----------------------------------------------------------------------------
def test_response_frame_golden_bytes():
    """OK is size 6 (data + 4), frame type 0, then the data."""
    assert response(b"OK") == b"\x00\x00\x00\x06\x00\x00\x00\x00OK"


def test_error_frame_golden_bytes():
    """Error frames carry '<CODE> <description>' with frame type 1."""
    err = FatalClientError("E_INVALID", "invalid command FOO")
    data = b"E_INVALID invalid command FOO"
    assert error_frame(err) == struct.pack(">ii", len(data) + 4, FRAME_ERROR) + data


def test_message_frame_layout():
    """Message frame: size, type 2, 8-byte ns timestamp, 2-byte attempts, 16-byte id, body."""
    ts = 1_700_000_000_123_456_789
    out = message_frame(ts, 3, b"0123456789abcdef", b"hello")
    assert out[:4] == struct.pack(">i", 4 + 26 + 5)
    assert out[4:8] == struct.pack(">i", FRAME_MESSAGE)
    assert out[8:16] == struct.pack(">q", ts)
    assert out[16:18] == b"\x00\x03"
    assert out[18:34] == b"0123456789abcdef"
    assert out[34:] == b"hello"
    assert out[8:] == encode_message(ts, 3, b"0123456789abcdef", b"hello")


def test_decode_message_round_trip_and_minimum():
    """A stored record decodes back; fewer than 26 bytes is refused."""
    data = encode_message(42, 65535, b"f" * 16, b"")
    assert decode_message(data) == (42, 65535, b"f" * 16, b"")
    with pytest.raises(ValueError):
        decode_message(data[:25])


def test_frame_reader_splits_any_chunking():
    """The client-side reader reassembles frames cut at every byte boundary."""
    stream = response(b"OK") + message_frame(1, 1, b"a" * 16, b"x") + response(b"_heartbeat_")
    reader = FrameReader()
    frames = []
    for i in range(len(stream)):
        frames += reader.feed(stream[i : i + 1])
    assert [t for t, _ in frames] == [FRAME_RESPONSE, FRAME_MESSAGE, FRAME_RESPONSE]
    assert frames[2][1] == b"_heartbeat_"


# -- lines ------------------------------------------------------------------------------
def test_lines_split_on_single_spaces_and_strip_cr():
    """Params split on each space (double spaces give empty params); a trailing CR goes."""
    cmds = parse_all(b"RDY 10\r\nSUB t  c\nNOP\n")
    assert [c.params for c in cmds] == [[b"RDY", b"10"], [b"SUB", b"t", b"", b"c"], [b"NOP"]]


def test_empty_line_is_a_command_with_an_empty_name():
    """nsqd splits an empty line into [""] (and then answers 'invalid command ')."""
    assert parse_all(b"\n")[0].params == [b""]


def test_partial_line_waits_for_more():
    """Nothing comes out until the newline arrives."""
    parser = CommandParser()
    parser.receive_data(b"NO")
    assert parser.next_command() is None
    parser.receive_data(b"P\n")
    assert parser.next_command().params == [b"NOP"]


def test_overlong_line_closes_without_a_frame():
    """A line longer than nsqd's 16 KiB read buffer closes the connection silently."""
    parser = CommandParser()
    parser.receive_data(b"X" * (16 * 1024 + 1))
    with pytest.raises(CloseSilently):
        parser.next_command()
    assert parser.failed


# -- bodies -----------------------------------------------------------------------------
def test_pub_body_is_read():
    """PUB takes a length-prefixed body after its line."""
    (cmd,) = parse_all(encode_command(b"PUB", b"t", body=b"hi"))
    assert cmd.params == [b"PUB", b"t"] and cmd.body == b"hi"


def test_pub_body_size_errors():
    """Zero, negative and too-large PUB/DPUB sizes get E_BAD_MESSAGE with nsqd's text."""
    e = error_of(b"PUB t\n" + struct.pack(">i", 0))
    assert e.text == b"E_BAD_MESSAGE PUB invalid message body size 0"
    e = error_of(b"DPUB t 10\n" + struct.pack(">i", -5))
    assert e.text == b"E_BAD_MESSAGE DPUB invalid message body size -5"
    e = error_of(b"PUB t\n" + struct.pack(">i", 101), max_msg_size=100)
    assert e.text == b"E_BAD_MESSAGE PUB message too big 101 > 100"


def test_identify_and_auth_body_size_errors():
    """IDENTIFY/AUTH sizes are checked against the max body size (E_BAD_BODY)."""
    e = error_of(b"IDENTIFY\n" + struct.pack(">i", 0))
    assert e.text == b"E_BAD_BODY IDENTIFY invalid body size 0"
    e = error_of(b"AUTH\n" + struct.pack(">i", 11), max_body_size=10)
    assert e.text == b"E_BAD_BODY AUTH body too big 11 > 10"


def test_mpub_parts_and_errors():
    """MPUB reads a count and each [len][data]; every bound has nsqd's error text."""
    body = mpub_body([b"a", b"bc"])
    (cmd,) = parse_all(encode_command(b"MPUB", b"t", body=body))
    assert cmd.bodies == [b"a", b"bc"] and cmd.body is None
    e = error_of(b"MPUB t\n" + struct.pack(">i", 0))
    assert e.text == b"E_BAD_BODY MPUB invalid body size 0"
    e = error_of(b"MPUB t\n" + struct.pack(">i", 100), max_body_size=99)
    assert e.text == b"E_BAD_BODY MPUB body too big 100 > 99"
    e = error_of(b"MPUB t\n" + struct.pack(">ii", 8, 0))
    assert e.text == b"E_BAD_BODY MPUB invalid message count 0"
    e = error_of(b"MPUB t\n" + struct.pack(">ii", 20, 20), max_body_size=99)
    assert e.text == b"E_BAD_BODY MPUB invalid message count 20"  # (99-4)//5 = 19
    e = error_of(b"MPUB t\n" + struct.pack(">iii", 20, 2, 1) + b"a" + struct.pack(">i", 0))
    assert e.text == b"E_BAD_MESSAGE MPUB invalid message(1) body size 0"
    e = error_of(b"MPUB t\n" + struct.pack(">iii", 20, 1, 11), max_msg_size=10)
    assert e.text == b"E_BAD_MESSAGE MPUB message too big 11 > 10"


def test_precheck_refuses_before_the_body():
    """The precheck hook runs on the line, so a bad PUB is refused before its body arrives."""
    seen = []

    def precheck(params):
        seen.append(params)
        raise FatalClientError("E_BAD_TOPIC", "PUB topic name \"x!\" is not valid")

    parser = CommandParser(precheck=precheck)
    parser.receive_data(b"PUB x!\n")
    with pytest.raises(FatalClientError):
        parser.next_command()
    assert seen == [[b"PUB", b"x!"]]
    parser.receive_data(b"NOP\n")
    assert parser.next_command() is None  # a failed parser yields nothing more


def test_commands_come_one_at_a_time():
    """next_command parses lazily, so state changes by one command apply to the next."""
    parser = CommandParser()
    parser.receive_data(b"NOP\nNOP\n")
    assert parser.next_command().params == [b"NOP"]
    assert parser.buffered() == 4


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just(b"PUB"), st.binary(min_size=1, max_size=40)),
            st.tuples(st.just(b"MPUB"), st.lists(st.binary(min_size=1, max_size=10), min_size=1, max_size=4)),
            st.tuples(st.just(b"FIN"), st.just(b"0123456789abcdef")),
        ),
        max_size=8,
    ),
    st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=10),
)
def test_any_chunking_gives_the_same_commands(items, cuts):
    """Cutting the byte stream anywhere yields the same commands as one big chunk."""
    stream = b""
    for name, arg in items:
        if name == b"PUB":
            stream += encode_command(b"PUB", b"topic", body=arg)
        elif name == b"MPUB":
            stream += encode_command(b"MPUB", b"topic", body=mpub_body(arg))
        else:
            stream += encode_command(b"FIN", arg)
    whole = parse_all(stream)
    parser = CommandParser()
    pieces, pos, i = [], 0, 0
    while pos < len(stream):
        step = cuts[i % len(cuts)]
        parser.receive_data(stream[pos : pos + step])
        pos += step
        i += 1
        while (cmd := parser.next_command()) is not None:
            pieces.append(cmd)
    assert pieces == whole
    assert len(whole) == len(items)


# -- helpers ----------------------------------------------------------------------------
def test_parse_base10_like_nsqd():
    """Digits only, empty is 0, signs and spaces are errors."""
    assert parse_base10(b"2500") == 2500
    assert parse_base10(b"") == 0
    for bad in (b"-1", b"+5", b" 1", b"1.0", b"0x10"):
        with pytest.raises(ValueError):
            parse_base10(bad)


def test_go_quote_matches_go_percent_q():
    """Error texts quote names as Go's %q does."""
    assert go_quote(b"bad!name") == '"bad!name"'
    assert go_quote(b'a"b\\c') == '"a\\"b\\\\c"'
    assert go_quote(b"tab\there") == '"tab\\there"'
    assert go_quote(b"\x01\xff") == '"\\x01\\xff"'


def test_names_follow_nsq_rule_on_bytes():
    """Names: 1-64 chars of [.a-zA-Z0-9_-], optional #ephemeral suffix, ASCII only."""
    assert valid_name_bytes(b"orders")
    assert valid_name_bytes(b"a.b-c_d#ephemeral")
    assert valid_name_bytes(b"x" * 64)
    assert not valid_name_bytes(b"x" * 65)
    assert not valid_name_bytes(b"")
    assert not valid_name_bytes(b"caf\xc3\xa9")
    assert not valid_name_bytes(b"a#b")


def test_sans_io_modules_import_no_io():
    """The codec, IDENTIFY rules, ids, messages, heap and response queue import no
    Twisted, sockets or database driver."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import dmq_server.core.nsq_wire, dmq_server.core.nsq_identify, dmq_server.core.ids\n"
        "import dmq_server.fast.message, dmq_server.core.deadlines, dmq_server.protocols.nsq_responses\n"
        "bad = [m for m in ('twisted', 'socket', 'psycopg') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_response_queue_keeps_order_and_closes_after_a_fatal_answer():
    """Answers wait behind a reserved slot; a fatal one is written in turn, then closes."""
    from dmq_server.protocols.nsq_responses import ResponseQueue

    out, closed = [], []
    q = ResponseQueue(out.append, lambda: closed.append(True))
    q.reply(b"a")
    slot = q.reserve()
    q.reply(b"c", after=lambda: out.append(b"after-c"))
    q.reply(b"fatal", fatal=True)
    q.reply(b"never")
    assert out == [b"a"]
    q.fill(slot, b"b")
    assert out == [b"a", b"b", b"c", b"after-c", b"fatal"] and closed == [True]


# ids of 16 bytes from an alphabet where the bytes that matter are common: a space splits
# the line into more parameters, a carriage return at the end is stripped
_FIN_ID = st.lists(st.sampled_from(b"0af \r\x00\xff"), min_size=16, max_size=16).map(bytes)
_FIN_LIKE = st.one_of(
    _FIN_ID.map(lambda i: b"FIN " + i + b"\n"),  # the plain form, whatever its bytes
    st.sampled_from([b"0123456789abcdef", b"fedcba9876543210", b"0123456789abcde\r", b"01234567 9abcdef"]).map(
        lambda i: b"FIN " + i + b"\n"),
    _FIN_ID.map(lambda i: b"FIN " + i + b"\r\n"),
    st.binary(min_size=0, max_size=20).filter(lambda b: b"\n" not in b).map(lambda i: b"FIN " + i + b"\n"),
    _FIN_ID.map(lambda i: b"FIN " + i + b" extra\n"),
    st.sampled_from([b"NOP\n", b"RDY 1\n", b"FIN\n", b"FINISH 0123456789abcdef\n", b"FIX 0123456789abcdef\n",
                     b"REQ 0123456789abcdef 0\n"]),
    st.binary(min_size=1, max_size=30).map(lambda body: encode_command(b"PUB", b"t", body=body)),
)


def _commands(parser: CommandParser, take_fins: bool, out: list) -> None:
    while (cmd := parser.next_command()) is not None:
        out.append((tuple(cmd.params), cmd.body, cmd.bodies))
        if take_fins and cmd.params[0] == b"FIN":
            ids: list[bytes] = []
            parser.take_fins(ids)
            out.extend(((b"FIN", message_id), None, None) for message_id in ids)


def _commands_taking_pubs(parser: CommandParser, out: list) -> None:
    while (cmd := parser.next_command()) is not None:
        out.append((tuple(cmd.params), cmd.body, cmd.bodies))
        if cmd.params[0] == b"PUB":
            bodies: list[bytes] = []
            parser.take_pubs(bodies)
            out.extend((tuple(cmd.params), body, None) for body in bodies)


def _parse_in_pieces(stream: bytes, cuts: list[int], max_line: int, take_fins: bool,
                     take_pubs: bool = False, max_msg_size: int = 1024 * 1024) -> tuple[list, str]:
    parser = CommandParser(max_line=max_line, max_msg_size=max_msg_size)
    out: list = []
    pos = i = 0
    try:
        while pos < len(stream):
            step = cuts[i % len(cuts)]
            parser.receive_data(stream[pos : pos + step])
            pos, i = pos + step, i + 1
            if take_pubs:
                _commands_taking_pubs(parser, out)
            else:
                _commands(parser, take_fins, out)
    except (FatalClientError, CloseSilently) as exc:
        return out, f"{type(exc).__name__} {exc}"
    return out, f"{parser.buffered()} left"


@given(
    st.lists(_FIN_LIKE, max_size=20),
    st.lists(st.integers(min_value=1, max_value=500), min_size=1, max_size=6),
    st.sampled_from([20, 21, 64, 16 * 1024]),
)
@settings(max_examples=400)
def test_a_run_of_fins_taken_at_once_reads_as_the_steps_would(lines, cuts, max_line):
    """``take_fins`` after each FIN the steps read gives the same commands, in the same
    order, as the steps alone, cut anywhere: FINs with a carriage return, a space in the
    id, a short or long id, an extra parameter, a line above ``max_line`` and other
    commands stop the run and are read (or refused) by the steps."""
    stream = b"".join(lines)
    assert _parse_in_pieces(stream, cuts, max_line, True) == _parse_in_pieces(stream, cuts, max_line, False)


def test_take_fins_takes_only_whole_plain_fins():
    parser = CommandParser()
    a, b = b"0123456789abcdef", b"fedcba9876543210"
    parser.receive_data(b"FIN " + a + b"\nFIN " + b + b"\nFIN " + a + b"\r\nFIN " + b + b"\n")
    ids: list[bytes] = []
    parser.take_fins(ids)
    assert ids == [a, b] and parser.next_command().params == [b"FIN", a]
    parser.take_fins(ids)
    assert ids == [a, b, b] and parser.buffered() == 0
    parser.receive_data(b"FIN " + a[:10])  # not whole yet: left for the steps
    parser.take_fins(ids)
    assert ids == [a, b, b] and parser.buffered() == 14
    short = CommandParser(max_line=20)  # its steps refuse a FIN line: so does this
    short.receive_data(b"FIN " + a + b"\n")
    short.take_fins(ids)
    assert ids == [a, b, b] and short.buffered() == 21


_A_PUB = encode_command(b"PUB", b"t", body=b"a")
_PUB_LIKE = st.one_of(
    st.binary(min_size=1, max_size=30).map(lambda body: encode_command(b"PUB", b"t", body=body)),
    st.binary(min_size=1, max_size=30).map(lambda body: encode_command(b"PUB", b"u", body=body)),
    st.binary(min_size=1, max_size=30).map(lambda body: b"PUB t\r\n" + struct.pack(">i", len(body)) + body),
    st.binary(min_size=1, max_size=30).map(lambda body: b"PUB t extra\n" + struct.pack(">i", len(body)) + body),
    st.just(b"PUB t\n" + struct.pack(">i", 0)),
    st.just(b"PUB t\n" + struct.pack(">i", -3)),
    st.just(b"PUB t\n" + struct.pack(">i", 40) + b"x" * 40),  # above max_msg_size 32
    st.sampled_from([b"NOP\n", b"RDY 1\n", b"FIN 0123456789abcdef\n"]),
    st.binary(min_size=1, max_size=30).map(lambda body: encode_command(b"DPUB", b"t", b"10", body=body)),
    st.binary(min_size=1, max_size=30).map(lambda body: encode_command(b"MPUB", b"t", body=mpub_body([body]))),
)


@given(
    st.lists(_PUB_LIKE, max_size=20),
    st.lists(st.integers(min_value=1, max_value=200), min_size=1, max_size=6),
    st.sampled_from([32, 1024 * 1024]),
)
@example([_A_PUB, b"PUB t\n" + struct.pack(">i", 0)], [200], 32)
@example([_A_PUB, b"PUB t\n" + struct.pack(">i", 40) + b"x" * 40], [200], 32)
@example([_A_PUB, _A_PUB, b"PUB t\n" + struct.pack(">i", 2) + b"x"], [200], 32)
@settings(max_examples=400)
def test_a_run_of_pubs_taken_at_once_reads_as_the_steps_would(lines, cuts, max_msg_size):
    """``take_pubs`` after each PUB the steps read gives the same commands, bodies and
    errors, in the same order, as the steps alone, cut anywhere: another topic, the
    same topic spelt with a carriage return or an extra parameter, a size of zero,
    below zero or above ``max_msg_size``, a body not all here, and other commands stop
    the run and are read (or refused) by the steps."""
    stream = b"".join(lines)
    taking = _parse_in_pieces(stream, cuts, 16 * 1024, False, True, max_msg_size)
    assert taking == _parse_in_pieces(stream, cuts, 16 * 1024, False, False, max_msg_size)


def test_take_pubs_takes_only_whole_pubs_of_the_same_line():
    parser = CommandParser()
    parser.receive_data(encode_command(b"PUB", b"t", body=b"a") + encode_command(b"PUB", b"t", body=b"bb")
                        + encode_command(b"PUB", b"u", body=b"c") + encode_command(b"PUB", b"u", body=b"dd")[:-1])
    bodies: list[bytes] = []
    parser.take_pubs(bodies)  # nothing read yet: nothing to follow
    assert bodies == []
    first = parser.next_command()
    assert first.params == [b"PUB", b"t"] and first.body == b"a"
    parser.take_pubs(bodies)
    assert bodies == [b"bb"]
    parser.take_pubs(bodies)  # once only, right after the PUB the steps gave
    assert bodies == [b"bb"]
    second = parser.next_command()
    assert second.params == [b"PUB", b"u"] and second.body == b"c"
    parser.take_pubs(bodies)  # the next body is not all here: left for the steps
    assert bodies == [b"bb"] and parser.buffered() == len(encode_command(b"PUB", b"u", body=b"dd")) - 1
