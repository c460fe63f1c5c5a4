"""A dead letter keeps its message's key, priority and headers (issue 45 §1), on the
in-memory double, fast: a rate-limited send's, a client report's, and what the admin
surfaces list and show. The double answers as PostgreSQL does
(tests/integration/test_memory_db_contract.py); tests/integration/test_deadletters.py
runs the same on PostgreSQL with the server, the CLI and the HTTP API."""

from __future__ import annotations

import pytest

from dmq_client.wire.properties import Properties, encode_properties
from dmq_server.admin.operations import AdminOps, DeadLetterFilter, report_letter
from dmq_server.core.errors import Invalid
from dmq_server.core.options import Options
from dmq_server.core.publish import PublishRequest, Send
from tests.unit.test_broker import NODE, Harness
from tests.unit.test_memory_db import result

PROPS = Properties("order-7", 5, {"content-type": "application/json", "tenant": "caf\u00e9"})
#: the headers as jsonb (and the double) give them back: shorter names first
STORED_HEADERS = ["tenant", "content-type"]


@pytest.fixture
def h() -> Harness:
    return Harness()


@pytest.fixture
def ops(h: Harness) -> AdminOps:
    return AdminOps(broker=h.broker, delays=None, db=h.db, options=Options(), clock=h.clock, node_id=NODE)


def _send(h: Harness, topic: str, session_id: int, props: Properties) -> None:
    send = Send(topic=topic, producer="p", session_id=session_id, body=b"b%d" % session_id,
                properties=props, status=encode_properties(props))
    h.broker.publish(PublishRequest(topic=topic, producer="p", sends=[send]), lambda outcome: None)


def test_a_rate_limited_send_keeps_its_properties(h, ops):
    """Over the rate limit, the refused send's dead letter holds the send's key, priority
    and headers; one without properties has none (NULL, 0, NULL)."""
    _send(h, "limited", 1, PROPS)  # the bucket's one
    _send(h, "limited", 2, PROPS)
    _send(h, "limited", 3, Properties())
    h.settle()
    rows = result(ops.dlq_list(DeadLetterFilter(reason="rate_limited")))
    assert [(r["session_id"], r["key"], r["priority"], r["headers"]) for r in rows] == [
        (2, "order-7", 5, dict(PROPS.headers)), (3, None, 0, None)]
    assert list(rows[0]["headers"]) == STORED_HEADERS


def test_a_client_report_keeps_its_properties_and_show_gives_them(h, ops):
    """A client's report may carry the send's key, priority and headers: the letter keeps
    them, and show (the CLI's, the API's, the console's) gives them with the body."""
    letter_id = result(ops.dlq_report({"topic": "orders", "producer": "p", "session_id": 4, "body": "hi",
                                       "key": "order-7", "priority": 5, "headers": dict(PROPS.headers)}, "http", "me"))
    shown = result(ops.dlq_show(letter_id))
    assert (shown["key"], shown["priority"], shown["headers"], shown["body"]) == ("order-7", 5, dict(PROPS.headers), "hi")
    plain = result(ops.dlq_report({"topic": "orders", "body": "x"}, "http", "me"))
    assert [(r["id"], r["key"], r["priority"], r["headers"]) for r in result(ops.dlq_list(DeadLetterFilter()))] == [
        (letter_id, "order-7", 5, dict(PROPS.headers)), (plain, None, 0, None)]


@pytest.mark.parametrize("fields, message", [
    ({"key": 7}, "report: key must be a string"),
    ({"key": ""}, "report: key is empty"),
    ({"priority": 10}, r"report: priority 10 is outside 0\.\.9"),
    ({"priority": "5"}, "report: priority must be an integer"),
    ({"priority": True}, "report: priority must be an integer"),
    ({"headers": ["a", "b"]}, "report: headers must be a JSON object"),
    ({"headers": {"Content-Type": "x"}}, "report: header name 'Content-Type' is not a lowercase token"),
    ({"headers": {"traceparent": "nope"}}, "report: header 'traceparent' is not W3C trace context"),
])
def test_a_report_with_properties_a_server_would_refuse_is_refused(fields, message):
    """A report's properties follow a send's rules (its replay sends them again): each
    broken rule is an E_INVALID naming the field."""
    with pytest.raises(Invalid, match=message):
        report_letter({"topic": "orders", **fields})
