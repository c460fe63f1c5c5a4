"""A message's properties as they travel (``dmq_client.wire.properties``): every rule's
refusal names the field, what round-trips, and what an empty status means."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmq_client.wire.frames import STATUS_MAX_LENGTH
from dmq_client.wire.properties import (
    HEADER_VALUE_MAX_BYTES,
    HEADERS_MAX_COUNT,
    KEY_MAX_BYTES,
    NO_PROPERTIES,
    Properties,
    PropertiesError,
    decode_properties,
    encode_properties,
    trace_id,
)

pytestmark = pytest.mark.unit

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

texts = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=40)
names = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True).filter(
    lambda n: n not in ("traceparent", "tracestate", "content-type"))
props_strategy = st.builds(
    Properties,
    key=st.none() | texts,
    priority=st.integers(0, 9),
    headers=st.dictionaries(names, st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=40),
                            max_size=8),
)


@given(props_strategy)
def test_properties_round_trip_through_the_status(props):
    status = encode_properties(props)
    assert decode_properties(status) == props
    assert (status == "") == (not props)


def test_no_properties_is_an_empty_status_and_back():
    assert encode_properties(NO_PROPERTIES) == "" and encode_properties(Properties(priority=0)) == ""
    assert decode_properties("") is NO_PROPERTIES and not NO_PROPERTIES


def test_only_the_fields_a_message_has_are_written_compactly():
    status = encode_properties(Properties(key="order-7", headers={"content-type": "application/json"}))
    assert status == '{"key":"order-7","headers":{"content-type":"application/json"}}'
    assert encode_properties(Properties(priority=5)) == '{"priority":5}'
    assert encode_properties(Properties(key="clé")) == '{"key":"clé"}'  # UTF-8 as is, not escaped


@pytest.mark.parametrize(
    ("props", "says"),
    [
        (Properties(key=""), "key is empty"),
        (Properties(key="k" * (KEY_MAX_BYTES + 1)), "key is 256 bytes (at most 255)"),
        (Properties(key="é" * 128), "key is 256 bytes"),
        (Properties(key="a\nb"), "key holds a control character"),
        (Properties(priority=10), "priority 10 is outside 0..9"),
        (Properties(priority=-1), "priority -1 is outside 0..9"),
        (Properties(priority=True), "priority is not an integer"),
        (Properties(headers={f"h{i}": "v" for i in range(HEADERS_MAX_COUNT + 1)}), "33 headers (at most 32)"),
        (Properties(headers={"Content-Type": "x"}), "header name 'Content-Type' is not a lowercase token"),
        (Properties(headers={"-x": "x"}), "header name '-x'"),
        (Properties(headers={"h" * 65: "x"}), "at most 64 characters"),
        (Properties(headers={"x": "v" * (HEADER_VALUE_MAX_BYTES + 1)}), "header 'x' is 1025 bytes (at most 1024)"),
        (Properties(headers={"x": "a\x00b"}), "header 'x' holds a control character"),
        (Properties(headers={"traceparent": "00-abc"}), "header 'traceparent' is not W3C trace context"),
        (Properties(headers={"traceparent": TRACEPARENT.upper()}), "not W3C trace context"),
        (Properties(headers={"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"}), "not all zeros"),
        (Properties(headers={"traceparent": "ff" + TRACEPARENT[2:]}), "not W3C trace context"),
        (Properties(headers={"tracestate": "a=" + "b" * 600}), "header 'tracestate' is 602 characters"),
        (Properties(headers={"content-type": ""}), "header 'content-type' is empty"),
        (Properties(headers={f"h{i}": "v" * 200 for i in range(30)}), "bytes encoded (at most 4096)"),
    ],
)
def test_each_rule_is_refused_with_a_text_naming_it(props, says):
    with pytest.raises(PropertiesError, match=None) as caught:
        encode_properties(props)
    assert says in str(caught.value)
    assert caught.value.status().startswith("E_BAD_PROPERTIES ")


def test_reserved_headers_that_keep_their_shape_pass():
    props = Properties(headers={"traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE", "content-type": "text/plain"})
    assert decode_properties(encode_properties(props)) == props


@pytest.mark.parametrize(
    ("status", "says"),
    [
        ("not json", "not a JSON object"),
        ("[1, 2]", "not a JSON object"),
        ('{"key": 7}', "key is not a text"),
        ('{"priority": "high"}', "priority is not an integer"),
        ('{"priority": 2.0}', "priority is not an integer"),
        ('{"headers": ["a"]}', "headers are not a JSON object"),
        ('{"headers": {"a": 1}}', "header 'a' is not a text"),
        ('{"ttl": 5}', "unknown property field 'ttl'"),
        # JSON escapes a lone surrogate, which no UTF-8 (nor PostgreSQL) holds
        ('{"key": "\\ud800"}', "key holds a lone surrogate"),
        ('{"headers": {"a": "x\\udc00"}}', "header 'a' holds a lone surrogate"),
        ('{"priority": true}', "priority is not an integer"),
        ('{"key": "' + "k" * STATUS_MAX_LENGTH + '"}', "bytes encoded (at most 4096)"),
    ],
)
def test_a_bad_status_is_refused_when_decoded(status, says):
    with pytest.raises(PropertiesError) as caught:
        decode_properties(status)
    assert says in str(caught.value)


def test_a_client_skips_fields_a_newer_server_sends_and_the_server_refuses_them():
    status = json.dumps({"key": "k", "expires": 5})
    assert decode_properties(status, strict=False) == Properties(key="k")
    with pytest.raises(PropertiesError, match="unknown property field 'expires'"):
        decode_properties(status)


@pytest.mark.parametrize("headers, expected", [
    ({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}, "4bf92f3577b34da6a3ce929d0e0e4736"),
    ({"traceparent": "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", "x": "y"},
     "4bf92f3577b34da6a3ce929d0e0e4736"),
    ({"traceparent": "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}, None),  # version ff: invalid
    ({"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"}, None),  # all-zero trace id
    ({"traceparent": "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"}, None),  # upper case
    ({"traceparent": "garbage"}, None),
    ({"tenant": "acme"}, None),
    ({}, None),
    (None, None),
])
def test_the_trace_id_a_traceparent_names(headers, expected):
    assert trace_id(headers) == expected
