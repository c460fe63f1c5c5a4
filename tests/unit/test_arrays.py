"""The packed array parameters (dmq_server.db.arrays) are byte for byte what psycopg's own
list dumper writes for the same values, and refuse what the element type cannot hold as
PostgreSQL's cast would."""

from __future__ import annotations

import struct

import psycopg
import pytest
from psycopg.adapt import PyFormat, Transformer

from hypothesis import given
from hypothesis import strategies as st

from dmq_server.db.arrays import BoolArray, ByteaArray, Int4Array, Int8Array, TextArray, TextRuns, pack_array


def psycopg_dump(values: list) -> bytes:
    """What psycopg writes for a plain list of the same values (binary format)."""
    plain = list(values)
    return bytes(Transformer().get_dumper(plain, PyFormat.BINARY).dump(plain))


@pytest.mark.parametrize("values", [
    Int8Array([1_700_000_000_123, -(2**40), 2**63 - 1, 2**32]),
    Int4Array([100_000, -70_000, 2**31 - 1]),
    Int8Array([2**40, None, -(2**40)]),
    Int4Array([None, 100_000, -70_000]),
    BoolArray([True, False, True]),
    TextArray(["orders", "", "zählung", "orders"]),
    TextArray(["c1", None, "c2"]),
    ByteaArray([b"\x00body\xff", b"", b"x" * 300]),
])
def test_a_packed_array_is_what_psycopg_writes(values):
    assert pack_array(values) == psycopg_dump(values)


@pytest.mark.parametrize("count", [1, 63, 64, 65, 128, 129, 1000])
@pytest.mark.parametrize("kind", [Int8Array, Int4Array, BoolArray])
def test_fixed_size_arrays_of_any_length_are_packed_element_by_element(kind, count):
    """Packed a chunk of 64 elements per call: every split of the chunks, and the rest, is
    the array header then each element's length and value (``array_send``)."""
    code, oid = {Int8Array: ("q", 20), Int4Array: ("i", 23), BoolArray: ("?", 16)}[kind]
    values = kind([i % 2 == 0 for i in range(count)] if kind is BoolArray else
                  [(i * 7919) * (-1) ** i for i in range(count)])
    element = struct.Struct("!i" + code)
    expected = struct.pack("!iiIii", 1, 0, oid, count, 1) + b"".join(
        element.pack(element.size - 4, v) for v in values)
    assert pack_array(values) == expected


def test_an_out_of_range_value_beyond_the_first_chunk_is_still_refused():
    with pytest.raises(psycopg.errors.NumericValueOutOfRange, match="integer out of range: 2147483648"):
        pack_array(Int4Array([1] * 100 + [2**31]))


@pytest.mark.parametrize("kind, oid", [(Int8Array, 20), (TextArray, 25), (ByteaArray, 17)])
def test_an_empty_array_has_no_dimension_and_names_its_element_type(kind, oid):
    assert pack_array(kind()) == b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00" + oid.to_bytes(4, "big")


def test_a_value_beyond_bigint_is_refused_as_postgresql_refuses_it():
    with pytest.raises(psycopg.errors.NumericValueOutOfRange) as caught:
        pack_array(Int8Array([1, 2**63]))
    assert caught.value.sqlstate == "22003" and "bigint out of range" in str(caught.value)
    with pytest.raises(psycopg.errors.NumericValueOutOfRange, match="integer out of range: -2147483649"):
        pack_array(Int4Array([-(2**31) - 1]))


def test_a_value_of_another_type_is_the_callers_bug_not_refused_input():
    """As psycopg fails a value it cannot send: not a database error, so not a send to isolate."""
    with pytest.raises(TypeError, match="integer\\[\\] cannot hold str 'x'"):
        pack_array(Int4Array([1, "x"]))


def test_the_text_cache_stays_bounded():
    from dmq_server.db import arrays

    for n in range(arrays._TEXT_CACHE_MAX + 10):
        pack_array(TextArray([f"consumer-{n}"]))
    assert len(arrays._TEXT_CACHE) <= arrays._TEXT_CACHE_MAX
    assert pack_array(TextArray(["consumer-1"])) == psycopg_dump(["consumer-1"])


def test_a_plain_list_sent_where_the_array_type_is_known_is_packed_by_that_type():
    """psycopg finds a dumper by the parameter's oid too (``set_dumper_types``, as the
    reactor's connection does for its statements): a plain list then reaches these dumpers."""
    from psycopg import postgres

    tx = Transformer()
    oids = [postgres.types.get(name).array_oid for name in ("text", "int8", "bytea")]
    tx.set_dumper_types(oids, psycopg.pq.Format.BINARY)
    plain = [["a", None], [2**40, -1], [b"\x00"]]
    assert [bytes(v) for v in tx.dump_sequence(plain, [PyFormat.BINARY] * 3)] == [psycopg_dump(v) for v in plain]


@given(st.lists(st.tuples(st.sampled_from(["orders", "", "zählung", "c" * 300, "billing"]), st.integers(0, 70)),
                max_size=6))
def test_text_given_as_runs_is_packed_as_psycopg_writes_every_element(runs):
    """``TextRuns`` (the ack batch's topics, channels and consumers) packs a run as one
    element times its count: the same bytes as the elements one by one, and as psycopg
    writes the flat list (fails with a count off by one, or a run left out)."""
    values = TextRuns(runs)
    assert list(values) == [v for v, n in runs for _ in range(n)]
    assert pack_array(values) == pack_array(TextArray(values))
    if values:  # psycopg cannot tell an empty list's element type (test_an_empty_array_...)
        assert pack_array(values) == psycopg_dump(values)


def test_psycopg_picks_the_packing_dumper_for_text_runs():
    """Sent where the statement's types are not known (a DbWorker's cursor), psycopg
    chooses the dumper by the list's class: a ``TextRuns`` gets ``TextArray``'s."""
    dumper = Transformer().get_dumper(TextRuns([("a", 2)]), PyFormat.BINARY)
    assert type(dumper).__name__ == "TextArrayDumper"
    assert bytes(dumper.dump(TextRuns([("a", 2), ("bc", 1)]))) == psycopg_dump(["a", "a", "bc"])
