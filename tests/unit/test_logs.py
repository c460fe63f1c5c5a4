"""The log observer (dmq_server/logs.py): one JSON object per line with the node, the
event's fields and a failure's traceback; standard-library records arrive through the
bridge under their logger's name; levels below the threshold write nothing."""

from __future__ import annotations

import io
import json
import logging

from twisted.logger import LogLevel, LogPublisher, Logger
from twisted.python.failure import Failure

from dmq_server.logs import LineObserver, StdlibBridge


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_the_node_the_fields_and_the_text() -> None:
    stream = io.StringIO()
    publisher = LogPublisher(LineObserver(stream, "json", node_id="vm:4150"))
    log = Logger(namespace="dmq_server.broker", observer=publisher)
    log.info("channel {topic}/{channel} unregistered", topic="orders", channel="billing")
    log.debug("not written at info")
    log.warn("{what} failed", what=object.__new__(type("Weird", (), {"__str__": lambda self: "x" * 5000})))
    (event, warned) = lines(stream)
    assert event["message"] == "channel orders/billing unregistered"
    assert (event["topic"], event["channel"], event["node_id"]) == ("orders", "billing", "vm:4150")
    assert event["logger"] == "dmq_server.broker" and event["level"] == "info"
    assert event["time"].endswith("Z") and len(event["time"]) == len("2026-01-02T03:04:05.678Z")
    assert len(warned["what"]) == 1000 and warned["what"].endswith("…")  # long values are cut


def test_a_failure_adds_its_traceback_and_text_lines_stay_twisteds() -> None:
    stream, text = io.StringIO(), io.StringIO()
    publisher = LogPublisher(LineObserver(stream, "json"), LineObserver(text, "text"))
    log = Logger(namespace="x", observer=publisher)
    try:
        1 / 0
    except ZeroDivisionError:
        log.failure("it broke", Failure())
    (event,) = lines(stream)
    assert event["level"] == "critical" and "ZeroDivisionError" in event["traceback"]
    assert "[x#critical] it broke" in text.getvalue() and "ZeroDivisionError" in text.getvalue()


def test_standard_library_records_go_through_the_bridge(monkeypatch) -> None:
    stream = io.StringIO()
    publisher = LogPublisher(LineObserver(stream, "json", node_id="n1"))
    import dmq_server.logs as logs

    real = logs.Logger
    monkeypatch.setattr(logs, "Logger", lambda namespace: real(namespace=namespace, observer=publisher))
    record = logging.LogRecord("kazoo.client", logging.WARNING, __file__, 1, "Connection dropped: %s", ("x",), None)
    StdlibBridge().emit(record)
    (event,) = lines(stream)
    assert (event["logger"], event["level"], event["message"], event["node_id"]) == (
        "kazoo.client", "warn", "Connection dropped: x", "n1")


def test_unknown_formats_are_refused() -> None:
    import pytest

    with pytest.raises(ValueError):
        LineObserver(io.StringIO(), "xml")
    assert LineObserver(io.StringIO(), "text", level=LogLevel.warn).level == LogLevel.warn
