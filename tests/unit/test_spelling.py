"""The spellings every dmq tool shares (dmq_client/spelling.py): durations, times,
addresses."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmq_client.spelling import format_duration, parse_address, parse_duration, parse_time, parse_time_ms

pytestmark = pytest.mark.unit

NOW = 1_700_000_000_000


# -- durations ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("250ms", 0.25),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("7d", 604800.0),
        ("1.5s", 1.5),
        ("0.5m", 30.0),
        ("90", 90.0),
        (" 2M ", 120.0),
        ("0", 0.0),
        ("1ms", 0.001),
        (12, 12.0),
        (0.25, 0.25),
    ],
)
def test_parse_duration_accepts_units_and_bare_seconds(text: str | float, seconds: float) -> None:
    """ms, s, m, h and d suffixes (any case, surrounding blanks ignored), or plain seconds."""
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "bad", ["", "abc", "5 minutes", "10us", "-1s", "-0.5", -3, "inf", "nan", float("inf"), True, None]
)
def test_parse_duration_rejects_garbage_negative_and_infinite(bad: object) -> None:
    """Anything but a finite, non-negative amount with a known unit is a ValueError."""
    with pytest.raises(ValueError):
        parse_duration(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.01, "10ms"), (0.1, "100ms"), (1.5, "1500ms"), (30, "30s"), (60, "1m"),
     (90, "90s"), (600, "10m"), (7200, "2h")],
)
def test_format_duration_picks_the_largest_exact_unit(seconds: float, text: str) -> None:
    """Defaults are shown the way an operator would write them."""
    assert format_duration(seconds) == text


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False))
def test_format_duration_round_trips(seconds: float) -> None:
    """Whatever a duration is, its rendering parses back to exactly the same float."""
    assert parse_duration(format_duration(seconds)) == seconds


@given(st.integers(min_value=0, max_value=10**9))
def test_whole_milliseconds_are_exact(millis: int) -> None:
    """"Nms" means exactly N/1000 s (no 0.001 multiplication rounding)."""
    assert parse_duration(f"{millis}ms") == millis / 1000


# -- addresses ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("127.0.0.1:4150", ("127.0.0.1", 4150)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        (":4151", ("127.0.0.1", 4151)),
        ("[::1]:4150", ("::1", 4150)),
        ("dmq.example.com:65535", ("dmq.example.com", 65535)),
    ],
)
def test_parse_address(text: str, address: tuple[str, int]) -> None:
    """HOST:PORT, with an empty host meaning loopback and brackets around IPv6."""
    assert parse_address(text) == address


@pytest.mark.parametrize("bad", ["4150", "host:", "host:port", "host:65536", "host:-1", ""])
def test_parse_address_rejects_bad_addresses(bad: str) -> None:
    """A missing or out-of-range port is a ValueError that quotes the input."""
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        parse_address(bad)


# -- times -------------------------------------------------------------------
def test_times_accept_now_unix_ms_iso_and_durations_ago():
    """Four spellings of a time; ISO without an offset is UTC; a date alone is its midnight."""
    assert parse_time_ms("now", now_ms=NOW) == NOW
    assert parse_time_ms("1700000000000") == NOW
    assert parse_time_ms("2023-11-14T22:13:20Z") == NOW
    assert parse_time_ms("2023-11-14T22:13:20") == NOW
    assert parse_time_ms("2023-11-15T00:13:20+02:00") == NOW
    assert parse_time_ms("2023-11-14") == NOW - (22 * 3600 + 13 * 60 + 20) * 1000
    assert parse_time_ms("15m", now_ms=NOW) == NOW - 15 * 60_000
    assert parse_time_ms("2d", now_ms=NOW) == NOW - 2 * 86_400_000
    assert parse_time_ms("250ms", now_ms=NOW) == NOW - 250
    assert parse_time_ms("15", now_ms=NOW) == 15  # bare digits are Unix ms, never seconds ago


@pytest.mark.parametrize("text", ["", "yesterday", "15 minutes", "-5m"])
def test_bad_times_name_the_accepted_forms(text):
    """A time that is none of the forms says which forms are accepted."""
    with pytest.raises(ValueError, match="Unix ms"):
        parse_time_ms(text)


def test_datetime_times_are_exact_and_aware():
    """The pipeline's ranges count in datetimes: now and durations ago keep microseconds."""
    now = datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=timezone.utc)
    assert parse_time("now", now) is now
    assert parse_time("24h", now) == now - timedelta(hours=24)
    assert parse_time("7d", now) == now - timedelta(days=7)
    assert parse_time("2024-05-01", now) == datetime(2024, 5, 1, tzinfo=timezone.utc)
    assert parse_time("2024-05-01T14:00:00+02:00", now) == datetime(2024, 5, 1, 12, tzinfo=timezone.utc)
    assert parse_time("1700000000000", now) == datetime.fromtimestamp(1_700_000_000, tz=timezone.utc)
    with pytest.raises(ValueError, match="Unix ms"):
        parse_time("last tuesday", now)


@pytest.mark.parametrize("text", ["9" * 30, "10000000d", "99999999999999999999"])
def test_times_out_of_range_are_a_clear_error(text):
    """Digits or durations beyond what a datetime (or a bigint column) holds are refused
    with the range, never an OverflowError or a database error."""
    now = datetime(2024, 5, 1, tzinfo=timezone.utc)
    with pytest.raises(ValueError, match="out of range"):
        parse_time_ms(text, now_ms=NOW)
    with pytest.raises(ValueError, match="out of range"):
        parse_time(text, now)
