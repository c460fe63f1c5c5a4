"""When the clients make spans (``dmq_client.otel.sending`` / ``processing_of``): with the
API installed but nothing tracing, a send makes none (it cost several microseconds a
message for spans that record nothing), yet a trace that is current is carried on, and
a consumed message's trace is continued, as a hop that does not trace must."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from dmq_client import Message, otel
from dmq_client.message import ReceivedMessage
from dmq_client.wire.properties import Properties


def _received(headers: dict[str, str]) -> ReceivedMessage:
    return ReceivedMessage(topic="orders", channel="billing", message_id=7, session_id=1, producer="p", body=b"b",
                           timestamp_ms=0, attempts=1, server="127.0.0.1:4150", acker=lambda m: None,
                           properties=Properties(headers=headers))


def test_nothing_tracing_and_no_current_trace_makes_no_send_span():
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # the API's default
    assert otel.sending(None) is False


def test_a_given_provider_makes_send_spans_and_injects_the_context():
    provider = TracerProvider()
    assert otel.sending(provider) is True
    message, span = otel.start_send(Message("orders", b"b"), provider)
    span.end()
    assert message.headers is not None and message.headers["traceparent"].startswith("00-")


def test_a_current_trace_is_carried_on_without_a_provider():
    context = SpanContext(trace_id=0x1234, span_id=0x99, is_remote=True, trace_flags=TraceFlags(1))
    with trace.use_span(NonRecordingSpan(context)):
        assert otel.sending(None) is True
        message, span = otel.start_send(Message("orders", b"b"), None)
        span.end()
    assert message.headers is not None and f"{0x1234:032x}" in message.headers["traceparent"]


def test_a_message_is_processed_in_its_trace_only_when_it_carries_one():
    assert otel.processing_of(_received({}), None) is False
    carrying = _received({"traceparent": f"00-{0x1234:032x}-{0x99:016x}-01"})
    assert otel.processing_of(carrying, None) is True
    with otel.processing(carrying) as span:
        assert span is not None and span.get_span_context().trace_id == 0x1234
    with otel.processing(_received({})) as nothing:
        assert nothing is None
    assert otel.processing_of(_received({}), TracerProvider()) is True
