"""The outbox relay's IO-free rules (dmq_server/core/outbox_rows.py): --outbox parsed with
specific errors, the producer and session id a row is stored under, runs in id order, a
row's stored properties checked by the rules of a SEND."""

from __future__ import annotations

import json

import pytest

from dmq_client.wire.properties import NO_PROPERTIES, Properties, decode_properties
from dmq_server.core.options import options_from_args
from dmq_server.db.messages import stored_status
from dmq_server.core.outbox_rows import (
    OutboxRow, check_tag, outbox_row, parse_outbox, producer_of, relay_producers, runs, session_of,
)

pytestmark = pytest.mark.unit


def row(id: int, topic: str = "orders", *, due_ms: int | None = None, session_id: int | None = None) -> OutboxRow:
    return OutboxRow(id, topic, b"x", due_ms, session_id, 0)


def test_an_outbox_is_a_name_an_optional_schema_and_a_dsn() -> None:
    source = parse_outbox("shop=host=db dbname=shop user=app")
    assert (source.name, source.schema, source.dsn) == ("shop", "dmq_outbox", "host=db dbname=shop user=app")
    assert parse_outbox("shop:billing_box=postgresql://db/shop").schema == "billing_box"
    assert "postgresql" not in repr(parse_outbox("shop=postgresql://u:secret@db/shop"))


@pytest.mark.parametrize("entry, says", [
    ("shop", "give NAME=APP_DSN"),
    ("shop=  ", "give NAME=APP_DSN"),
    ("=postgresql://db/shop", "outbox name ''"),
    ("sh op=postgresql://db/shop", "outbox name 'sh op'"),
    ("x" * 41 + "=postgresql://db/shop", "1-40 characters"),
    ("shop:Box=postgresql://db/shop", "schema 'Box'"),
    ("shop:1box=postgresql://db/shop", "not starting with a digit"),
])
def test_a_bad_outbox_is_refused_saying_what_is_wrong(entry: str, says: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_outbox(entry)
    assert says in str(refused.value)


def test_the_server_options_check_every_outbox_once() -> None:
    assert options_from_args(["--outbox", "a=dbname=a", "--outbox", "b:box=dbname=b"]).outbox == (
        "a=dbname=a", "b:box=dbname=b")
    with pytest.raises(SystemExit, match="--outbox.*outbox 'a' is given twice"):
        options_from_args(["--outbox", "a=dbname=a", "--outbox", "a=dbname=b"])
    with pytest.raises(SystemExit, match="--outbox.*give NAME=APP_DSN"):
        options_from_args(["--outbox", "a"])


def test_row_ids_and_own_session_ids_never_share_a_producer() -> None:
    numbered, own = row(7), row(8, session_id=7)
    assert (producer_of("shop", "0a1b2c3d", numbered), session_of(numbered)) == ("outbox:shop:0a1b2c3d", 7)
    assert (producer_of("shop", "0a1b2c3d", own), session_of(own)) == ("outbox:shop:own", 7)
    assert producer_of("shop", "0a1b2c3d", row(9, due_ms=5)) == "outbox:shop:0a1b2c3d:delayed"
    assert producer_of("shop", "0a1b2c3d", row(9, due_ms=5, session_id=1)) == "outbox:shop:own:delayed"
    assert relay_producers("shop", "0a1b2c3d") == ["outbox:shop:0a1b2c3d", "outbox:shop:0a1b2c3d:delayed"]
    longest = [producer_of("x" * 40, "f" * 8, row(1, due_ms=5, session_id=s)) for s in (None, 1)]
    assert max(len(p) for p in longest) == 64


def test_each_install_numbers_its_rows_under_its_own_producer() -> None:
    """Row 7 of one install and row 7 of the next are two messages (ids restart at 1)."""
    assert producer_of("shop", "0a1b2c3d", row(7)) != producer_of("shop", "99999999", row(7))
    # the application's own ids are its own across installs
    assert producer_of("shop", "0a1b2c3d", row(7, session_id=3)) == producer_of("shop", "99999999", row(8, session_id=3))


@pytest.mark.parametrize("tag", [None, "", "0A1B2C3D", "0a1b2c3", "0a1b2c3d4", "own", 12345678])
def test_a_tag_that_is_not_an_installs_is_refused(tag: object) -> None:
    with pytest.raises(ValueError, match="dmq_outbox.installation holds .*not an install tag"):
        check_tag("dmq_outbox", tag)
    assert check_tag("dmq_outbox", "0a1b2c3d") == "0a1b2c3d"


def test_runs_keep_the_id_order_and_cut_at_a_topic_a_producer_or_a_delay() -> None:
    rows = [row(1), row(2), row(3, "refunds"), row(4, due_ms=9), row(5), row(6, session_id=1), row(7, session_id=2),
            row(8, due_ms=9), row(9, due_ms=9)]
    assert [[r.id for r in run] for run in runs(rows, 100)] == [[1, 2], [3], [4], [5], [6, 7], [8], [9]]
    assert runs([], 100) == []
    # a delayed row after immediate ones of its topic and producer, and the row after it
    assert [[r.id for r in run] for run in runs([row(1), row(2, due_ms=9), row(3)], 100)] == [[1], [2], [3]]


def test_a_run_is_never_longer_than_the_group_commits_batch() -> None:
    """The writer keeps a run in one transaction only when it fits in one."""
    rows = [row(i) for i in range(1, 8)] + [row(8, "refunds")]
    assert [[r.id for r in run] for run in runs(rows, 3)] == [[1, 2, 3], [4, 5, 6], [7], [8]]


def test_a_rows_properties_document_becomes_the_sends_properties_and_wire_text() -> None:
    """The document as jsonb gives it (names in jsonb's order, spaces in its text) becomes
    the properties and the compact status a load of the stored message gives (headers in
    name order); no document: none. A
    document near the wire's 4,096-byte bound is measured compact, as sent."""
    plain = outbox_row(1, "orders", b"x", None, None, 5, None)
    assert (plain.properties, plain.status, plain.refused) == (NO_PROPERTIES, "", "")
    full = outbox_row(2, "orders", b"x", None, None, 5,  # jsonb's order: shorter names first
                      {"key": "order-7", "headers": {"tenant": "acme", "content-type": "application/json"},
                       "priority": 5})
    assert full.properties == Properties("order-7", 5, {"content-type": "application/json", "tenant": "acme"})
    # the text a load of the stored message gives its pushes: headers in name order
    assert full.status == stored_status("order-7", 5, {"tenant": "acme", "content-type": "application/json"}) \
        == '{"key":"order-7","priority":5,"headers":{"content-type":"application/json","tenant":"acme"}}'
    assert decode_properties(full.status) == full.properties and not full.refused
    near = {"headers": {f"h{i}": "v" * 1000 for i in range(4)}, "key": "k" * 40}  # 4,094 bytes compact
    assert len(json.dumps(near)) > 4096 and not outbox_row(3, "orders", b"x", None, None, 5, near).refused


@pytest.mark.parametrize("document, says", [
    ({"priority": 12}, "E_BAD_PROPERTIES priority 12 is outside 0..9"),
    ({"priority": 5.0}, "E_BAD_PROPERTIES priority is not an integer"),
    ({"key": ""}, "E_BAD_PROPERTIES key is empty"),
    ({"kee": "x"}, "E_BAD_PROPERTIES unknown property field 'kee'"),
    ({"headers": ["a"]}, "E_BAD_PROPERTIES headers are not a JSON object"),
    ({"headers": {"A": "b"}}, "E_BAD_PROPERTIES header name 'A'"),
    (["key", "x"], "E_BAD_PROPERTIES properties are not a JSON object"),
    ("order-7", "E_BAD_PROPERTIES properties are not a JSON object"),
    ({"headers": {f"h{i}": "v" * 1000 for i in range(5)}}, "E_BAD_PROPERTIES properties are 5"),
])
def test_a_document_that_breaks_a_rule_refuses_the_row_saying_which(document: object, says: str) -> None:
    refused = outbox_row(1, "orders", b"x", None, None, 5, document)
    assert refused.refused.startswith(says)
    assert (refused.properties, refused.status) == (NO_PROPERTIES, "")
