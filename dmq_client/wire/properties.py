"""A message's properties: its key, its priority and its headers, as they travel.

Every broker users compare dmq with carries more than a body: Kafka and NATS headers,
AMQP properties, SQS FIFO's group id, a priority in RabbitMQ, River, Oban and pg-boss.
dmq's are three, each optional:

* ``key``: a short text (1 to 255 bytes of UTF-8, no control characters) naming what
  the message is about; an ordered topic delivers one message of a key at a time.
* ``priority``: 0 to 9, higher first; 0 (the default) is what a message without
  properties has, so an old client's messages are priority 0.
* ``headers``: at most 32 names to texts. A name is a lowercase token (a letter or digit,
  then letters, digits, ``.``, ``_``, ``-``; at most 64), so ``Content-Type`` and
  ``content-type`` cannot both be sent and mean two things; a value is at most 1,024 bytes
  of UTF-8 without control characters. Three names are reserved: ``traceparent`` and
  ``tracestate`` (W3C trace context: the trace a message belongs to, checked against the
  recommendation's shape so a consumer's tracer never meets a broken one) and
  ``content-type``.

On the dmq wire they ride in the ``status`` field of ``UP_PRODUCER_SEND``,
``UP_PRODUCER_RESEND`` and ``CONSUMER_PUSH``, which version 1 leaves unused on those
commands (receivers ignore unused fields: an old consumer reads its pushes as before), as
compact JSON with only the fields a message has: ``{"key":"order-7","priority":5,
"headers":{"content-type":"application/json"}}``. An empty status is a message without
properties, and costs nothing to read: the hot path decodes only a non-empty status. The
whole text is at most ``STATUS_MAX_LENGTH`` (4,096) bytes, refused beyond rather than cut as
other statuses are. A client sends properties only to a server that lists the feature
``PROPS`` (an older server would ignore them: the message would be stored without them).

Sans-IO and shared by the server and both clients: ``encode_properties`` checks and writes,
``decode_properties`` reads and checks (``strict`` for the server, which refuses fields it
does not know, since a client sent them to be kept; a client reading pushes ignores them,
so a newer server's fields do not break it). Every refusal is a ``PropertiesError`` whose
text names the field and the rule, the description of ``SEND_INVALID_ACK``'s
``E_BAD_PROPERTIES``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Mapping

from .frames import STATUS_MAX_LENGTH

__all__ = [
    "Properties",
    "PropertiesError",
    "NO_PROPERTIES",
    "KEY_MAX_BYTES",
    "PRIORITY_MAX",
    "HEADERS_MAX_COUNT",
    "HEADER_NAME_MAX_LENGTH",
    "HEADER_VALUE_MAX_BYTES",
    "RESERVED_HEADERS",
    "encode_properties",
    "decode_properties",
    "trace_id",
]

KEY_MAX_BYTES = 255
PRIORITY_MAX = 9
HEADERS_MAX_COUNT = 32
HEADER_NAME_MAX_LENGTH = 64
HEADER_VALUE_MAX_BYTES = 1024
TRACESTATE_MAX_LENGTH = 512  # the W3C recommendation's bound a vendor may cut at
RESERVED_HEADERS = frozenset({"traceparent", "tracestate", "content-type"})

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
# version 00-fe, trace id and parent id not all zeros (checked apart), flags
_TRACEPARENT_RE = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
_FIELDS = frozenset({"key", "priority", "headers"})


class PropertiesError(ValueError):
    """Properties that break a rule; the text says which field and which rule."""

    code = "E_BAD_PROPERTIES"

    def status(self) -> str:
        """The ``SEND_INVALID_ACK`` status that answers them."""
        return f"{self.code} {self}"


@dataclass(frozen=True, slots=True)
class Properties:
    """A message's key, priority and headers (``NO_PROPERTIES``: none of them).

    Built by callers, checked when encoded (``encode_properties``) or decoded; ``check()``
    checks without encoding."""

    key: str | None = None
    priority: int = 0
    headers: Mapping[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.key is not None or self.priority != 0 or bool(self.headers)

    def check(self) -> None:
        """Raises ``PropertiesError`` naming the first rule broken."""
        _check_key(self.key)
        _check_priority(self.priority)
        _check_headers(self.headers)


NO_PROPERTIES = Properties()


def encode_properties(props: Properties) -> str:
    """The status text carrying ``props`` (empty for none), after checking them."""
    if not props:
        return ""
    props.check()
    fields: dict[str, object] = {}
    if props.key is not None:
        fields["key"] = props.key
    if props.priority:
        fields["priority"] = props.priority
    if props.headers:
        fields["headers"] = dict(props.headers)
    text = json.dumps(fields, ensure_ascii=False, separators=(",", ":"))
    size = len(text.encode("utf-8"))
    if size > STATUS_MAX_LENGTH:
        raise PropertiesError(f"properties are {size} bytes encoded (at most {STATUS_MAX_LENGTH})")
    return text


def decode_properties(status: str, strict: bool = True) -> Properties:
    """The properties a send's or push's status carries (``NO_PROPERTIES`` when empty).
    ``strict``: refuse fields this version does not know (the server); otherwise skip
    them (a client reading a newer server's pushes)."""
    if not status:
        return NO_PROPERTIES
    if len(status) * 4 > STATUS_MAX_LENGTH:  # else at most 4 bytes a character fit: no encoding
        size = len(status.encode("utf-8"))
        if size > STATUS_MAX_LENGTH:
            raise PropertiesError(f"properties are {size} bytes encoded (at most {STATUS_MAX_LENGTH})")
    try:
        fields = json.loads(status)
    except ValueError:
        raise PropertiesError("properties are not a JSON object") from None
    if not isinstance(fields, dict):
        raise PropertiesError("properties are not a JSON object")
    if strict and not fields.keys() <= _FIELDS:
        unknown = sorted(fields.keys() - _FIELDS)
        raise PropertiesError(f"unknown property field {unknown[0]!r} (known: headers, key, priority)")
    headers = fields.get("headers", {})
    if not isinstance(headers, dict):
        raise PropertiesError("headers are not a JSON object of names to texts")
    props = Properties(fields.get("key"), fields.get("priority", 0), headers)
    props.check()
    return props


def _check_key(key: object) -> None:
    if key is None:
        return
    if not isinstance(key, str):
        raise PropertiesError("key is not a text")
    if not key:
        raise PropertiesError("key is empty (leave it out for a message without a key)")
    size = _utf8_size(key, "key")
    if size > KEY_MAX_BYTES:
        raise PropertiesError(f"key is {size} bytes (at most {KEY_MAX_BYTES})")
    if _CONTROL_RE.search(key):
        raise PropertiesError("key holds a control character")


def _utf8_size(text: str, what: str) -> int:
    """``text``'s size in UTF-8; a lone surrogate (JSON's ``\\ud800`` decodes to one) is
    no character of UTF-8, and PostgreSQL would refuse it with the whole batch."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise PropertiesError(f"{what} holds a lone surrogate (not UTF-8)") from None


def _check_priority(priority: object) -> None:
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise PropertiesError("priority is not an integer")
    if not 0 <= priority <= PRIORITY_MAX:
        raise PropertiesError(f"priority {priority} is outside 0..{PRIORITY_MAX}")


def _check_headers(headers: Mapping[str, object]) -> None:
    if len(headers) > HEADERS_MAX_COUNT:
        raise PropertiesError(f"{len(headers)} headers (at most {HEADERS_MAX_COUNT})")
    # run once per message a server stores with headers: the common case (ASCII values
    # without control characters) costs a test per header and one search for them all
    texts: list[str] = []
    for name, value in headers.items():
        if not isinstance(name, str) or len(name) > HEADER_NAME_MAX_LENGTH or not _NAME_RE.fullmatch(name):
            raise PropertiesError(
                f"header name {name!r} is not a lowercase token of at most {HEADER_NAME_MAX_LENGTH} characters "
                "(a-z, 0-9, then also . _ -)")
        if not isinstance(value, str):
            raise PropertiesError(f"header {name!r} is not a text")
        size = len(value) if value.isascii() else _utf8_size(value, f"header {name!r}")
        if size > HEADER_VALUE_MAX_BYTES:
            raise PropertiesError(f"header {name!r} is {size} bytes (at most {HEADER_VALUE_MAX_BYTES})")
        if name in RESERVED_HEADERS:
            _check_reserved(name, value)
        texts.append(value)
    if texts and _CONTROL_RE.search("".join(texts)):  # which one, only when one has
        for name, value in zip(headers, texts):
            if _CONTROL_RE.search(value):
                raise PropertiesError(f"header {name!r} holds a control character")


def trace_id(headers: Mapping[str, str] | None) -> str | None:
    """The trace id (32 lowercase hex digits) a message's ``traceparent`` names, None for
    none: what an operator looks up in the tracing backend (the trace, peek and delay views
    show it). A stored traceparent passed ``_check_reserved``; any other text gives None."""
    value = (headers or {}).get("traceparent")
    match = _TRACEPARENT_RE.fullmatch(value) if isinstance(value, str) else None
    if match is None or match.group(1) == "ff" or set(match.group(2)) == {"0"}:
        return None
    return match.group(2)


def _check_reserved(name: str, value: str) -> None:
    if name == "traceparent":
        match = _TRACEPARENT_RE.fullmatch(value)
        if (match is None or match.group(1) == "ff" or set(match.group(2)) == {"0"}
                or set(match.group(3)) == {"0"}):
            raise PropertiesError(
                "header 'traceparent' is not W3C trace context (version-traceid-parentid-flags, "
                "lowercase hex, ids not all zeros)")
    elif name == "tracestate":
        if len(value) > TRACESTATE_MAX_LENGTH:
            raise PropertiesError(f"header 'tracestate' is {len(value)} characters (at most {TRACESTATE_MAX_LENGTH})")
    elif not value:  # content-type
        raise PropertiesError("header 'content-type' is empty")
