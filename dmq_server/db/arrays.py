"""Array parameters of the hot statements, packed in one pass each.

The group commit sends five arrays per batch of sends and the ack batch eleven per batch
of acks, a hundred elements or more each. psycopg dumps a list element by element in
Python (``ListBinaryDumper``: about 0.55 us per element here), which py-spy found to be the
largest single item of dmq-server's CPU under end-to-end load (docs/benchmarks.md,
session 13). These list types say their element type, so their dumpers, registered with
psycopg's adapters, can write PostgreSQL's binary array format (``array_send``: a header,
one dimension, then each element's length and bytes) with ``struct`` in C loops: 0.07 us
per bigint, 0.1 us per repeated text.

They are lists, so everything that is not PostgreSQL (the in-memory double, the tests)
reads them as it did. An integer the element type cannot hold fails as PostgreSQL would
fail the cast (``NumericValueOutOfRange``, SQLSTATE 22003): the writer then splits the
batch until the bad send stands alone, as for any refused input. A value of another type
is the caller's bug and fails its run as a TypeError, as psycopg fails what it cannot send.
"""

from __future__ import annotations

import struct
from typing import Callable

from psycopg import adapters
from psycopg.adapt import Dumper
from psycopg.errors import NumericValueOutOfRange
from psycopg.pq import Format

__all__ = ["Int8Array", "Int4Array", "BoolArray", "TextArray", "TextRuns", "ByteaArray", "pack_array"]


class Int8Array(list):
    """A ``bigint[]`` parameter."""


class Int4Array(list):
    """An ``integer[]`` parameter."""


class BoolArray(list):
    """A ``boolean[]`` parameter."""


class TextArray(list):
    """A ``text[]`` parameter (UTF-8)."""


class TextRuns(TextArray):
    """A ``text[]`` parameter given as runs of one value, ``(value, count)``: a list of
    every element, as any ``TextArray``, packed a run at a time (one element's bytes
    times its count). The ack batch's topics, channels and consumers are a few runs of
    hundreds of equal values each (``db.messages.ack_deliveries_steps``), whose element
    by element packing was 6 % of dmq-server's e2e4 samples (session 23)."""

    def __init__(self, runs: list[tuple[str, int]]):
        super().__init__()
        self.runs = runs
        for value, count in runs:
            self += [value] * count


class ByteaArray(list):
    """A ``bytea[]`` parameter."""


# element and array type oids (pg_type)
_OIDS: dict[type, tuple[int, int]] = {Int8Array: (20, 1016), Int4Array: (23, 1007), BoolArray: (16, 1000), TextArray: (25, 1009),
         ByteaArray: (17, 1001)}

_HEAD = struct.Struct("!iiIii")  # dimensions (1), has NULLs, element oid, length, lower bound
_EMPTY = struct.Struct("!iiI")  # no dimensions, no NULLs, element oid
_LEN = struct.Struct("!i")
_NULL = _LEN.pack(-1)
# each fixed-size element is its length and its value: packed CHUNK pairs per struct call
# from the list with the lengths interleaved (two to three times as fast as a call per
# element from 30 elements on; docs/benchmarks.md, session 17). The struct for each count up to
# CHUNK is compiled once, when first needed: compiling costs as much as packing.
_FIXED: dict[type, tuple[str, int]] = {Int8Array: ("q", 8), Int4Array: ("i", 4), BoolArray: ("?", 1)}
CHUNK = 64
# the bound ``pack`` of each (kind, count)'s struct: ``count`` (length, value) pairs
_PAIRS: dict[tuple[type, int], Callable[..., bytes]] = {}


def _pairs(kind: type, count: int) -> Callable[..., bytes]:
    packer = _PAIRS.get((kind, count))
    if packer is None:
        code, _ = _FIXED[kind]
        packer = _PAIRS[(kind, count)] = struct.Struct("!" + ("i" + code) * count).pack
    return packer
_NAMES: dict[type, str] = {Int8Array: "bigint", Int4Array: "integer", BoolArray: "boolean"}

# encoded text elements (length and bytes) by value: topics, channels, producers and
# consumers repeat from one batch to the next; bounded, cleared when full
_TEXT_CACHE: dict[str, bytes] = {}
_TEXT_CACHE_MAX = 4096


def _text_element(value: str) -> bytes:
    data = value.encode()
    element = _LEN.pack(len(data)) + data
    if len(_TEXT_CACHE) >= _TEXT_CACHE_MAX:
        _TEXT_CACHE.clear()
    _TEXT_CACHE[value] = element
    return element


def _elements(kind: type, values: list) -> bytes:
    """Each element as length and bytes (no NULLs among ``values``)."""
    fixed = _FIXED.get(kind)
    if fixed is not None:
        n = len(values)
        pairs = [fixed[1]] * (2 * n)
        pairs[1::2] = values
        try:
            if n <= CHUNK:
                return _pairs(kind, n)(*pairs)
            whole = n - n % CHUNK
            full = _pairs(kind, CHUNK)
            parts = [full(*pairs[i : i + 2 * CHUNK]) for i in range(0, 2 * whole, 2 * CHUNK)]
            if whole < n:
                parts.append(_pairs(kind, n - whole)(*pairs[2 * whole :]))
            return b"".join(parts)
        except struct.error:
            if None in values:
                raise _HasNulls from None
            raise _refusal(kind, values) from None
    if kind is TextArray:
        cached = _TEXT_CACHE.get
        runs = getattr(values, "runs", None)
        if runs is not None:
            return b"".join([(cached(v) or _text_element(v)) * count for v, count in runs])
        return b"".join([cached(v) or _text_element(v) for v in values])
    return b"".join([_LEN.pack(len(v)) + v for v in values])  # bytea


class _HasNulls(Exception):
    """A fixed-size array with NULLs: packed element by element instead."""


def _refusal(kind: type, values: list) -> Exception:
    """Why ``values`` cannot be ``kind``'s elements: a value of another type is a bug of the
    caller (TypeError, as psycopg fails a value it cannot send); an integer too large
    is refused input, as PostgreSQL refuses it."""
    for value in values:
        if not isinstance(value, int):
            return TypeError(f"{_NAMES[kind]}[] cannot hold {type(value).__name__} {value!r}")
    return NumericValueOutOfRange(f"{_NAMES[kind]} out of range: {max(values, key=abs)}")


def pack_array(values: list, kind: type | None = None) -> bytes:
    """``values`` in PostgreSQL's binary array format, as elements of ``kind`` (one of
    the list types above; by default the type of ``values``)."""
    kind = kind or type(values)
    if kind is TextRuns:  # a TextArray given as runs: packed by TextArray's rules
        kind = TextArray
    element_oid = _OIDS[kind][0]
    if not values:
        return _EMPTY.pack(0, 0, element_oid)
    if kind in _FIXED:  # integers: a NULL is found only if struct refuses it
        try:
            return _HEAD.pack(1, 0, element_oid, len(values), 1) + _elements(kind, values)
        except _HasNulls:
            pass
    elif None not in values:
        return _HEAD.pack(1, 0, element_oid, len(values), 1) + _elements(kind, values)
    parts = [_NULL if v is None else _elements(kind, [v]) for v in values]
    return _HEAD.pack(1, 1, element_oid, len(values), 1) + b"".join(parts)


class _ArrayDumper(Dumper):
    """Registered for a list type, and so (psycopg registers a dumper by its oid too) for
    any list sent where the statement's parameter type is known to be that array type
    (``Transformer.set_dumper_types``, as ``reactor.ReactorDb`` does): it packs by its own
    element type, whatever the list's class."""

    format = Format.BINARY
    kind: type = list

    def dump(self, obj: list[object]) -> bytes:
        return pack_array(obj, self.kind)


for _kind, (_, _array_oid) in _OIDS.items():
    adapters.register_dumper(
        _kind, type(f"{_kind.__name__}Dumper", (_ArrayDumper,), {"oid": _array_oid, "kind": _kind})
    )
