"""OpenTelemetry through messages: a send carries its trace, a consumer continues it.

With the ``otel`` extra installed (``pip install dmq-client[otel]``: opentelemetry-api)
and a tracer provider configured by the application, each send is a PRODUCER span
``send <topic>`` whose context goes into the message's headers as W3C trace context
(``traceparent``, ``tracestate``), and each message a handler processes is a CONSUMER span
``process <topic>`` whose parent is that context: one trace from the producer's request to
the consumer's work, across the broker. The attributes follow OpenTelemetry's messaging
semantic conventions (``messaging.system``, ``messaging.destination.name``,
``messaging.operation.type``/``.name``, ``messaging.message.id``,
``messaging.consumer.group.name`` for the channel, ``messaging.message.body.size``).

Why headers: they are the one part of a message that every hop keeps as it was (the
broker stores them with the message, a dead letter and its replay keep them, NSQ
clients never see them), and W3C trace context is what every tracer reads. A message
that already carries ``traceparent`` (a resend, a relay of another system's message)
keeps it: the send span is then the current trace's, the message stays in its own.

No cost when the extra is absent: ``ENABLED`` is False, the clients test it once per
message and call nothing here. Installed but with no tracer provider set (neither given
nor the global one: opentelemetry-api often comes with other packages), a send makes no
span (``sending``: about a microsecond and a half, where a span that records nothing cost
several), unless a trace is current (a handler continuing a consumed message's trace:
its sends carry that context on, as W3C trace context asks of a hop that does not
trace); a message is processed in its trace only when it carries one (``processing_of``).
A message gains no headers then, so it needs no ``PROPS`` server.

The functions take and return the client's own types; both clients (``MqClient`` and
``dmq_client.aio``) call them, so the conventions live in one place.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

try:  # the otel extra
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind, Status as SpanStatus, StatusCode
except ImportError:  # pragma: no cover - exercised by the packaging test's bare install
    ENABLED = False
else:
    ENABLED = True

if TYPE_CHECKING:
    from contextvars import Token

    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from .message import Message, ReceivedMessage, SendResult

__all__ = ["ENABLED", "SYSTEM", "TRACE_HEADERS", "sending", "processing_of", "start_send", "end_send",
           "start_process", "end_process", "processing"]

#: ``messaging.system``: dmq is not one of the conventions' listed systems; its own name
SYSTEM = "dmq"
#: the headers W3C trace context uses (lowercase: dmq's header names are)
TRACE_HEADERS = ("traceparent", "tracestate")
_TRACER = "dmq_client"


def _tracer(provider: TracerProvider | None) -> Tracer:
    return trace.get_tracer(_TRACER, tracer_provider=provider)


def _tracing(provider: TracerProvider | None) -> bool:
    """A provider is given, or the application set the global one (the API's default is
    a proxy that makes spans recording nothing)."""
    if provider is not None:
        return True
    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def sending(provider: TracerProvider | None) -> bool:
    """Whether a send makes its span (``start_send``): with the extra, when something
    traces or a trace is current to carry on."""
    return ENABLED and (_tracing(provider) or trace.get_current_span().get_span_context().is_valid)


def processing_of(message: "ReceivedMessage", provider: TracerProvider | None) -> bool:
    """Whether processing ``message`` makes its span (``start_process``): with the extra,
    when something traces or the message carries a trace to continue."""
    return ENABLED and (_tracing(provider) or "traceparent" in message.headers)


def start_send(message: "Message", provider: TracerProvider | None = None) -> tuple["Message", Span]:
    """The send span of ``message`` (started, not current; ``provider`` None: the global
    tracer provider, ``MqConfig.tracer_provider``) and the message to send: the
    same one with the span's context in its headers, or unchanged when it already carries
    ``traceparent`` or the span records nothing."""
    span = _tracer(provider).start_span(
        f"send {message.topic}", kind=SpanKind.PRODUCER,
        attributes={"messaging.system": SYSTEM, "messaging.destination.name": message.topic,
                    "messaging.operation.type": "send", "messaging.operation.name": "send",
                    "messaging.message.body.size": len(message.body)})
    headers = message.headers or {}
    if "traceparent" in headers or not span.get_span_context().is_valid:
        return message, span
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    added = {name: value for name, value in carrier.items() if name in TRACE_HEADERS}
    if not added:
        return message, span
    return dataclasses.replace(message, headers={**headers, **added}), span


def end_send(span: Span, result: "SendResult | None", error: BaseException | None = None) -> None:
    """End the send span with the send's outcome: its message id when stored, an error
    status with the reason otherwise."""
    if result is not None:
        if result.message_id:
            span.set_attribute("messaging.message.id", str(result.message_id))
        if not result.ok:
            span.set_status(SpanStatus(StatusCode.ERROR, f"{result.status.value}: {result.description}"[:200]))
    elif error is not None:
        span.record_exception(error)
        span.set_status(SpanStatus(StatusCode.ERROR, type(error).__name__))
    span.end()


def start_process(message: "ReceivedMessage", provider: TracerProvider | None = None) -> tuple[Span, Token[Context]]:
    """The process span of a received message, made current, and the token that
    ``end_process`` detaches: its parent is the trace context the message's headers
    carry (none: a new trace)."""
    parent = propagate.extract({name: message.headers[name] for name in TRACE_HEADERS if name in message.headers})
    span = _tracer(provider).start_span(
        f"process {message.topic}", context=parent, kind=SpanKind.CONSUMER,
        attributes={"messaging.system": SYSTEM, "messaging.destination.name": message.topic,
                    "messaging.consumer.group.name": message.channel,
                    "messaging.operation.type": "process", "messaging.operation.name": "process",
                    "messaging.message.id": str(message.message_id),
                    "messaging.message.body.size": len(message.body)})
    token = otel_context.attach(trace.set_span_in_context(span))
    return span, token


def end_process(span: Span, token: Token[Context], error: BaseException | None = None) -> None:
    """End the process span (an error status when the handler raised) and restore the
    context that was current before it."""
    if error is not None:
        span.record_exception(error)
        span.set_status(SpanStatus(StatusCode.ERROR, type(error).__name__))
    span.end()
    otel_context.detach(token)


@contextmanager
def processing(message: "ReceivedMessage", provider: TracerProvider | None = None) -> Iterator[Span | None]:
    """The process span of ``message`` as a ``with`` block, current inside it (an error
    status when the block raises): for consumers that are not handlers, such as
    ``dmq_client.aio``'s ``async for``, where the client cannot wrap the work. Without the
    extra, or with nothing to trace or continue (``processing_of``), an empty block (None)."""
    if not processing_of(message, provider):
        yield None
        return
    span, token = start_process(message, provider)
    try:
        yield span
    except BaseException as exc:
        end_process(span, token, exc)
        raise
    end_process(span, token)
