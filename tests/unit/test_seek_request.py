"""What an operator names as a seek's target (``admin.seek_request.parse_seek``): the same
words for the CLI, the admin API and the console, each mistake refused with its reason."""

from __future__ import annotations

import pytest

from dmq_server.admin.seek_request import parse_seek
from dmq_server.core.errors import Invalid
from dmq_server.db.seek import ToId, ToLatest, ToTime

NOW = 1_800_000_000_000


@pytest.mark.parametrize("params, target", [
    ({"to_time": "1700000000000"}, ToTime(1_700_000_000_000)),
    ({"to_time": "2023-11-14T22:13:20Z"}, ToTime(1_700_000_000_000)),
    ({"to_time": "90m"}, ToTime(NOW - 5_400_000)),
    ({"by": "-90m"}, ToTime(NOW - 5_400_000)),
    ({"to_id": "42"}, ToId(42)),
    ({"to_latest": "true"}, ToLatest()),
    ({"to_latest": "true", "to_id": None, "by": ""}, ToLatest()),  # empty ones are not given
])
def test_each_target_is_read(params, target):
    assert parse_seek(params, NOW) == target


@pytest.mark.parametrize("params, message", [
    ({}, "a seek needs one target, to_time or to_id or by or to_latest; got none"),
    ({"to_id": "5", "to_latest": "true"}, "got to_id, to_latest"),
    ({"to_id": "0"}, "to_id: '0' is not a message id"),
    ({"to_id": "x1"}, "to_id: 'x1' is not a message id"),
    ({"to_id": "9223372036854775808"}, "is not a message id (a positive integer below 2^63)"),
    ({"by": "1h"}, "by: '1h' does not go back"),
    ({"by": "-soon"}, "by:"),
    ({"by": "-100000d"}, "by: -100000d goes back before 1970"),
    ({"to_time": "yesterday-ish"}, "to_time:"),
    ({"to_latest": "maybe"}, "to_latest: expected true"),
    ({"to_date": "1h"}, "unknown seek target 'to_date'"),
])
def test_a_wrong_target_is_refused_with_its_reason(params, message):
    with pytest.raises(Invalid) as refused:
        parse_seek(params, NOW)
    assert message in refused.value.description
