"""How dmq's tools spell a duration, a point in time and an address: one parser each.

The server's options and config file, the admin API and console, the ``dmq`` CLI and
the Spark pipeline all accept the same spellings, so an operator learns them once:

* a **duration**: ``250ms``, ``30s``, ``5m``, ``2h``, ``7d`` or a bare number of seconds;
* a **time**: ``now``, Unix milliseconds (``1700000000000``), ISO 8601
  (``2024-05-01``, ``2024-05-01T12:00:00Z``; no offset means UTC) or a duration ago
  (``15m``: fifteen minutes before now);
* an **address**: ``HOST:PORT`` (``:PORT`` is 127.0.0.1; ``[::1]:4150`` for IPv6).

It lives in the client package because that is the standard-library-only base every
other package may import (the pipeline may not import the server). Errors are
``ValueError``s whose text names the accepted forms; each caller turns them into its
own error (a config error, ``Invalid``, a usage error).
"""

from __future__ import annotations

import math
import re
import time
from datetime import datetime, timedelta, timezone

__all__ = ["parse_duration", "format_duration", "parse_time_ms", "parse_time", "parse_address", "MAX_TIME_MS"]

#: seconds per unit, largest first (``format_duration`` tries them in this order)
_UNIT_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
#: a duration ago, in a time: digits and a unit (bare digits are Unix ms there)
_AGO = re.compile(r"^\d+(?:\.\d+)?(?:ms|s|m|h|d)$")
_DURATION_FORMS = "examples: 250ms, 30s, 5m, 2h, 7d"
#: the last millisecond of 9999-12-31, the largest time a datetime (and dmq) holds
MAX_TIME_MS = 253402300799999
_TIME_FORMS = "use now, Unix ms (1700000000000), ISO 8601 (2024-05-01T12:00:00Z) or a duration ago (15m, 2h, 7d)"


def parse_duration(text: str | float | int) -> float:
    """Seconds from ``"250ms"``, ``"30s"``, ``"5m"``, ``"2h"``, ``"7d"`` or a bare number
    of seconds (a string or a number). Negative, infinite and NaN durations are refused."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ValueError(f"invalid duration {text!r} ({_DURATION_FORMS})")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        value = text.strip().lower()
        for unit in ("ms", "s", "m", "h", "d"):
            if value.endswith(unit):
                amount = value[: -len(unit)]
                break
        else:
            amount, unit = value, "s"
        try:
            number = float(amount)
        except ValueError:
            raise ValueError(f"invalid duration {text!r} ({_DURATION_FORMS})") from None
        # dividing (not multiplying by 0.001) keeps whole milliseconds exact
        seconds = number / 1000 if unit == "ms" else number * _UNIT_SECONDS[unit]
    if not math.isfinite(seconds):
        raise ValueError(f"duration {text!r} must be finite")
    if seconds < 0:
        raise ValueError(f"duration {text!r} must not be negative")
    return seconds + 0.0  # no "-0.0"


def format_duration(seconds: float) -> str:
    """The shortest of ``"2h"``, ``"5m"``, ``"30s"``, ``"250ms"`` that parses back exactly
    (days are not used: ``24h`` reads better in a config file than ``1d``)."""
    if seconds == 0:
        return "0s"
    for unit in ("h", "m", "s"):
        count = seconds / _UNIT_SECONDS[unit]
        if count >= 1 and count.is_integer():
            candidate = f"{int(count)}{unit}"
            if parse_duration(candidate) == seconds:
                return candidate
    candidate = f"{round(seconds * 1000)}ms"
    if parse_duration(candidate) == seconds:
        return candidate
    return f"{seconds!r}s"


def parse_time_ms(text: str, now_ms: int | None = None) -> int:
    """Unix milliseconds from ``now``, digits (Unix ms), an ISO 8601 date or date-time
    (UTC unless it carries an offset) or a duration with its unit (that long before
    ``now_ms``, the wall clock by default)."""
    value = _time_text(text)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    if value == "now":
        millis = now
    elif value.isdigit():
        millis = int(value)
    elif _AGO.match(value.lower()):
        millis = now - round(parse_duration(value) * 1000)
    else:
        millis = int(_iso(text, value).timestamp() * 1000)
    if not 0 <= millis <= MAX_TIME_MS:
        raise ValueError(f"time {text!r} is out of range (1970-01-01 to 9999-12-31)")
    return millis


def parse_time(text: str, now: datetime) -> datetime:
    """``parse_time_ms`` for callers that count in datetimes (the pipeline's ranges):
    the same spellings, an aware UTC datetime, ``now`` and durations ago exact to the
    microsecond."""
    value = _time_text(text)
    try:
        if value == "now":
            return now
        if value.isdigit():
            return datetime.fromtimestamp(int(value) / 1000, tz=timezone.utc)
        if _AGO.match(value.lower()):
            return now - timedelta(seconds=parse_duration(value))
        return _iso(text, value).astimezone(timezone.utc)
    except (OverflowError, OSError):  # beyond what datetime holds
        raise ValueError(f"time {text!r} is out of range (1970-01-01 to 9999-12-31)") from None


def _time_text(text: str) -> str:
    value = text.strip()
    if not value:
        raise ValueError(f"empty time: {_TIME_FORMS}")
    return value


def _iso(text: str, value: str) -> datetime:
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"invalid time {text!r}: {_TIME_FORMS}") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def parse_address(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (``":PORT"`` means 127.0.0.1) into a host and port."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"invalid address {text!r}, expected HOST:PORT")
    return (host.strip("[]") or "127.0.0.1"), int(port)
