"""Admin input without IO: filters, times, console lines, token policy, client reports,
and the console protocol on a StringTransport."""

from __future__ import annotations

import pytest
from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from dmq_server.admin.line_console import AdminConsole, parse_line
from dmq_server.core.errors import Forbidden, Invalid, Refused, Unauthorized
from dmq_server.admin.operations import (
    DeadLetterFilter,
    check_token,
    is_loopback,
    report_letter,
)

NOW = 1_700_000_000_000


@pytest.mark.parametrize("text", ["", "yesterday", "15 minutes", "-5m"])
def test_a_bad_time_in_a_filter_is_invalid_and_names_the_accepted_forms(text):
    """The filter takes dmq_client.spelling's times; what it cannot read is E_INVALID."""
    with pytest.raises(Invalid) as info:
        DeadLetterFilter.parse({"since": text})
    assert info.value.code == "E_INVALID"
    assert info.value.description.startswith("since: ") and "Unix ms" in info.value.description


def test_filter_parses_every_key():
    """topic, channel, reason, since, until, ids, message_ids, replayed."""
    flt = DeadLetterFilter.parse(
        {
            "topic": "orders",
            "channel": "billing",
            "reason": "expired",
            "since": "1000",
            "until": "2000",
            "ids": "1, 2,3",
            "message_ids": "7",
            "replayed": "false",
        }
    )
    assert flt == DeadLetterFilter("orders", "billing", "expired", 1000, 2000, (1, 2, 3), (7,), False)
    assert flt.params()["ids"] == [1, 2, 3]
    assert "reason=expired" in flt.describe()
    assert DeadLetterFilter.parse({}).is_empty() and DeadLetterFilter().describe() == "all"


@pytest.mark.parametrize(
    "params, message",
    [
        ({"reason": "bored"}, "unknown reason 'bored'"),
        ({"colour": "red"}, "unknown filter 'colour'"),
        ({"ids": "1,x"}, "'x' is not an id"),
        ({"ids": ""}, "give one or more ids"),
        ({"replayed": "maybe"}, "expected true or false"),
        ({"since": "2000", "until": "1000"}, "since must be before until"),
        ({"topic": ""}, "empty name"),
    ],
)
def test_filter_errors_are_specific(params, message):
    """Each bad filter is E_INVALID with a message naming the problem."""
    with pytest.raises(Refused, match=message) as info:
        DeadLetterFilter.parse(params)
    assert info.value.code == "E_INVALID"


def test_console_line_splits_words_options_ids_and_all():
    """Words (lowercased verbs), key=value options (quotes allowed), bare ids, 'all'."""
    parsed = parse_line('DLQ replay 4 5 topic="my topic"')
    assert (parsed.words, parsed.options, parsed.ids, parsed.everything) == (
        ["dlq", "replay"],
        {"topic": "my topic"},
        [4, 5],
        False,
    )
    assert parse_line("dlq delete all").everything
    for bad, message in [
        ('dlq list topic="x', "cannot parse"),
        ("dlq list =x", "no name before"),
        ("dlq list topic=a topic=b", "given twice"),
        ("dlq show 4 now", "unexpected word 'now'"),
    ]:
        with pytest.raises(Refused, match=message):
            parse_line(bad)


def test_token_policy():
    """A configured token is always required and must match; without one only loopback is open."""
    check_token("127.0.0.1", "", None)
    check_token("::1", "", None)
    check_token("localhost", "", None)
    check_token("0.0.0.0", "t", "t")
    for host, token, given, family in [
        ("127.0.0.1", "t", None, Unauthorized),  # 401 on the admin API
        ("127.0.0.1", "t", "u", Unauthorized),
        ("0.0.0.0", "", None, Forbidden),  # 403: no token helps
        ("10.1.2.3", "", "anything", Forbidden),
    ]:
        with pytest.raises(family) as info:
            check_token(host, token, given)
        assert info.value.code == "E_AUTH"
    assert is_loopback("127.0.0.2") and not is_loopback("0.0.0.0") and not is_loopback("example")


def test_client_report_is_validated():
    """A client report needs a topic; bodies are UTF-8 or base64; reason is client_reported."""
    letter = report_letter({"topic": "t", "producer": "p", "session_id": 5, "body": "/wA=", "body_encoding": "base64"})
    assert (letter.reason, letter.body, letter.session_id) == ("client_reported", b"\xff\x00", 5)
    for bad, message in [
        ({}, "topic is required"),
        ({"topic": "t", "session_id": "5"}, "session_id must be an integer"),
        ({"topic": "t", "body": "!!", "body_encoding": "base64"}, "not valid base64"),
        ({"topic": "t", "body_encoding": "rot13"}, "body_encoding must be"),
    ]:
        with pytest.raises(Refused, match=message):
            report_letter(bad)


class FakeOps:
    node_id = "n1"

    def topics(self):
        return [{"name": "orders"}]

    def stats(self):
        return succeed({"ok": True})


def console(token: str = "") -> tuple[AdminConsole, StringTransport]:
    proto = AdminConsole(FakeOps(), "127.0.0.1", token, Clock())
    transport = StringTransport()
    proto.makeConnection(transport)
    return proto, transport


def lines(transport: StringTransport) -> list[str]:
    out = transport.value().decode().splitlines()
    transport.clear()
    return out


def test_console_answers_each_line_with_one_status_line():
    """Data lines then one OK; an error is one ERR line; blank lines get no answer."""
    proto, transport = console()
    assert lines(transport)[0].startswith("# dmq admin console, node n1")
    proto.dataReceived(b"topics\r\n\r\nstats\nbogus\n")
    assert lines(transport) == [
        '{"name": "orders"}',
        "OK 1 topics",
        '{"ok": true}',
        "OK stats",
        "ERR E_UNKNOWN_COMMAND unknown command 'bogus'; type help for the commands",
    ]


def test_console_overlong_line_is_refused_and_the_session_goes_on():
    """A line over the limit gets ERR E_LINE_TOO_LONG; its tail is dropped, not executed."""
    proto, transport = console()
    lines(transport)
    proto.dataReceived(b"x" * (AdminConsole.MAX_LENGTH + 10))
    proto.dataReceived(b"stats\ntopics\n")  # "…xxxstats" ends the long line
    assert lines(transport) == [
        f"ERR E_LINE_TOO_LONG a command line may be at most {AdminConsole.MAX_LENGTH} bytes; line dropped",
        '{"name": "orders"}',
        "OK 1 topics",
    ]


def test_console_with_token_needs_auth_first():
    """Before auth only help and quit work; the token is compared verbatim."""
    proto, transport = console(token="CaseSensitive=1")
    assert "auth TOKEN" in lines(transport)[0]
    proto.dataReceived(b"topics\nauth casesensitive=1\nauth CaseSensitive=1\ntopics\n")
    out = lines(transport)
    assert out[0].startswith("ERR E_AUTH") and "not authenticated" in out[0]
    assert out[1:] == ["ERR E_AUTH wrong admin token", "OK authenticated", '{"name": "orders"}', "OK 1 topics"]
