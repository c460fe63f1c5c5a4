"""The server's log: one line per event, as text or JSON (``--log-format``), from every source.

dmq logs through Twisted's ``Logger`` with named fields (``log.info("channel {topic}/
{channel} unregistered", topic=..., channel=...)``). Libraries that use the standard
library's ``logging`` (kazoo, psycopg, APScheduler) are routed into the same publisher
by ``StdlibBridge``, so one observer writes everything, in one format:

* ``text``: Twisted's classic line (``2026-01-02T03:04:05+0000 [namespace#info] text``);
* ``json``: one JSON object per line: ``time`` (UTC, ISO 8601 with milliseconds),
  ``level``, ``logger`` (the namespace), ``message`` (the text), ``node_id`` (this node),
  and the event's own fields where they apply: ``topic``, ``channel``, ``node`` (another
  node), ``message_id``, ``peer``, ``why``...; a failure adds ``traceback``.

Which events exist at all is decided where they happen: an outage is logged once when it
starts and once when it ends (``db.outage``), and the HTTP port writes no line per
``/ping`` or scrape (``http.site``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import IO, Any

from twisted.logger import (
    ILogObserver,
    LogLevel,
    Logger,
    formatEvent,
    formatEventAsClassicLogText,
    globalLogBeginner,
)
from zope.interface import implementer

__all__ = ["LineObserver", "StdlibBridge", "start_logging", "LEVELS"]

LEVELS = {"debug": LogLevel.debug, "info": LogLevel.info, "warn": LogLevel.warn, "error": LogLevel.error}

#: Twisted's own keys and the old logging system's, never copied as fields
_RESERVED = {"format", "message", "isError", "system", "time", "failure", "why_failure", "text"}
#: the longest field value written as is (others are cut, with an ellipsis)
_MAX_FIELD = 1000

#: standard-library loggers and the least level each sends on (APScheduler logs every job
#: run at info: a line per second for the expiry sweep)
_STDLIB_LEVELS = {"kazoo": logging.INFO, "psycopg": logging.INFO, "apscheduler": logging.WARNING}
_FROM_STDLIB = {
    logging.DEBUG: LogLevel.debug,
    logging.INFO: LogLevel.info,
    logging.WARNING: LogLevel.warn,
    logging.ERROR: LogLevel.error,
    logging.CRITICAL: LogLevel.critical,
}


def _field(value: object) -> object:
    if value is None or isinstance(value, (bool, int, float)):
        return value
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= _MAX_FIELD else text[: _MAX_FIELD - 1] + "…"


@implementer(ILogObserver)
class LineObserver:
    """Writes events at ``level`` or above to ``stream``, one line each. Thread-safe:
    kazoo's and the database workers' threads log too."""

    def __init__(self, stream: IO[str], fmt: str = "text", node_id: str = "", level: LogLevel = LogLevel.info):
        if fmt not in ("text", "json"):
            raise ValueError(f"log format must be text or json, not {fmt!r}")
        self.stream = stream
        self.json = fmt == "json"
        self.node_id = node_id
        self.level = level
        self._lock = threading.Lock()

    def __call__(self, event: dict[str, Any]) -> None:
        level = event.get("log_level", LogLevel.info)
        if level < self.level:
            return
        line = self.as_json(event) if self.json else formatEventAsClassicLogText(event)
        if not line:
            return
        with self._lock:
            self.stream.write(line if line.endswith("\n") else line + "\n")
            self.stream.flush()

    def as_json(self, event: dict[str, Any]) -> str:
        stamp = event.get("log_time") or time.time()
        out: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(stamp)) + f".{int(stamp % 1 * 1000):03d}Z",
            "level": event.get("log_level", LogLevel.info).name,
            "logger": event.get("log_namespace") or "-",
            "message": formatEvent(event),
        }
        if self.node_id:
            out["node_id"] = self.node_id
        for key, value in event.items():
            if key.startswith("log_") or key in _RESERVED or key in out:
                continue
            out[key] = _field(value)
        failure = event.get("log_failure")
        if failure is not None:
            out["traceback"] = failure.getTraceback()
        elif event.get("traceback"):
            out["traceback"] = event["traceback"]
        return json.dumps(out, ensure_ascii=False, default=str)


class StdlibBridge(logging.Handler):
    """A ``logging`` handler that hands each record to Twisted's logger, under the
    record's logger name: kazoo's and psycopg's lines get dmq's format and node id."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields: dict[str, str] = {"text": record.getMessage()}
            if record.exc_info:
                fields["traceback"] = "".join(logging.Formatter().formatException(record.exc_info))
            Logger(namespace=record.name).emit(_FROM_STDLIB.get(record.levelno, LogLevel.info), "{text}", **fields)
        except Exception:  # a log line must never break its caller
            self.handleError(record)


def start_logging(stream: IO[str], fmt: str, level: str, node_id: str = "") -> LineObserver:
    """Route every source to one ``LineObserver`` (the server's log, from start to exit)."""
    observer = LineObserver(stream, fmt, node_id, LEVELS.get(level, LogLevel.info))
    # @implementer(ILogObserver) is invisible to mypy (no zope plugin)
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)  # type: ignore[list-item]
    root = logging.getLogger()
    root.handlers = [StdlibBridge()]
    root.setLevel(logging.WARNING)
    for name, least in _STDLIB_LEVELS.items():  # the same with --log-level debug: theirs is per packet
        logging.getLogger(name).setLevel(least)
    return observer
