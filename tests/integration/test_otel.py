"""OpenTelemetry through messages (dmq_client.otel): a real dmq-server on real PostgreSQL,
MqClient with the OpenTelemetry SDK's tracer provider (``MqConfig.tracer_provider``: no
global state, so the rest of the suite sends without trace context), spans kept in memory.

One trace crosses the broker: the application's span, the send span (PRODUCER) under it,
its context in the stored message's ``traceparent``, the process span (CONSUMER) under the
send span on the consumer's side, and the handler's own work under that. The server's
trace view (``GET /admin/messages/ID``, ``dmq trace``) names the trace id."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, format_span_id, format_trace_id, get_current_span

from dmq_client import Message, MqClient
from dmq_client.wire.properties import trace_id

from .support import REPO
from .test_admin_surfaces import http
from .test_client import WAIT, fast_config

pytestmark = pytest.mark.integration


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def test_a_trace_crosses_the_broker_from_the_senders_span_to_the_handlers_work(make_server, topic, traced):
    provider, exporter = traced
    server = make_server()
    tracer = provider.get_tracer("app")
    seen: dict[str, object] = {}
    done = threading.Event()

    def handler(message):
        current = get_current_span().get_span_context()
        seen.update(headers=dict(message.headers), message_id=message.message_id,
                    trace_id=current.trace_id, span_id=current.span_id)
        with tracer.start_as_current_span("handle order"):
            pass
        done.set()

    config = fast_config(server, tracer_provider=provider)
    with MqClient(config) as client:
        client.subscribe(topic, "billing", handler)
        with tracer.start_as_current_span("POST /orders") as request:
            result = client.send(Message(topic, b"order-1", headers={"tenant": "acme"})).result(WAIT)
        assert result.ok
        assert done.wait(WAIT)
        client.flush(WAIT)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    send, process, handle = spans[f"send {topic}"], spans[f"process {topic}"], spans["handle order"]
    root = request.get_span_context()
    # one trace: request -> send -> process -> the handler's work
    assert {s.context.trace_id for s in spans.values()} == {root.trace_id}
    assert send.parent.span_id == root.span_id and send.kind is SpanKind.PRODUCER
    assert process.parent.span_id == send.context.span_id and process.kind is SpanKind.CONSUMER
    assert handle.parent.span_id == process.context.span_id
    assert (seen["trace_id"], seen["span_id"]) == (process.context.trace_id, process.context.span_id)
    # the message carried the send span's context next to its own headers
    assert seen["headers"] == {"tenant": "acme", "traceparent":
                               f"00-{format_trace_id(root.trace_id)}-{format_span_id(send.context.span_id)}-"
                               f"{int(send.context.trace_flags):02x}"}
    # the messaging conventions' attributes
    assert dict(send.attributes) == {
        "messaging.system": "dmq", "messaging.destination.name": topic, "messaging.operation.type": "send",
        "messaging.operation.name": "send", "messaging.message.body.size": 7,
        "messaging.message.id": str(result.message_id)}
    assert dict(process.attributes) == {
        "messaging.system": "dmq", "messaging.destination.name": topic, "messaging.consumer.group.name": "billing",
        "messaging.operation.type": "process", "messaging.operation.name": "process",
        "messaging.message.id": str(result.message_id), "messaging.message.body.size": 7}
    assert seen["message_id"] == result.message_id

    # the server's trace view names the trace, in the admin API and the CLI
    status, view = http(server, "GET", f"/admin/messages/{result.message_id}")
    assert status == 200 and view["stored"]["trace_id"] == format_trace_id(root.trace_id)
    out = subprocess.run([sys.executable, "-m", "dmq_server.admin.cli", "--pg-dsn", server.dsn, "trace",
                          str(result.message_id)], capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    assert f"trace id {format_trace_id(root.trace_id)}" in out.stdout


def test_a_failed_send_and_a_raising_handler_end_their_spans_as_errors(make_server, topic, traced):
    provider, exporter = traced
    server = make_server()
    raised = threading.Event()

    def handler(message):
        raised.set()
        raise RuntimeError("no stock")

    with MqClient(fast_config(server, tracer_provider=provider)) as client:
        bad = client.send(Message("no/such topic", b"x")).result(WAIT)
        assert not bad.ok
        client.subscribe(topic, "billing", handler)
        assert client.send(Message(topic, b"x")).result(WAIT).ok
        assert raised.wait(WAIT)
    finished = exporter.get_finished_spans()
    [failed] = [s for s in finished if s.name == "send no/such topic"]
    assert failed.status.status_code is StatusCode.ERROR and "E_BAD_TOPIC" in failed.status.description
    assert "messaging.message.id" not in failed.attributes
    processed = [s for s in finished if s.name == f"process {topic}"]
    assert processed and all(s.status.status_code is StatusCode.ERROR for s in processed)
    assert processed[0].events[0].name == "exception"


def test_a_resend_keeps_the_first_sends_trace_context(make_server, topic, traced, pg_dsn):
    """A resend carries the message as first sent: its traceparent is the first send span's,
    whatever trace the resend is made in, and the stored row is the first one."""
    provider, exporter = traced
    server = make_server()
    with MqClient(fast_config(server, tracer_provider=provider)) as client:
        first = client.send(Message(topic, b"x")).result(WAIT)
        again = client.resend(first).result(WAIT)
    assert first.ok and again.ok and again.message_id == first.message_id and again.duplicate
    sends = [s for s in exporter.get_finished_spans() if s.name == f"send {topic}"]
    assert len(sends) == 2 and sends[0].context.trace_id != sends[1].context.trace_id
    assert again.message.headers == first.message.headers
    assert trace_id(first.message.headers) == format_trace_id(sends[0].context.trace_id)


def test_without_a_configured_provider_a_message_gains_no_headers(make_server, topic):
    """opentelemetry-api installed, no SDK provider set (the global one is the API's
    no-op): the spans record nothing, nothing is injected, a message stays without
    properties (so it needs no PROPS server and costs nothing more on the wire)."""
    server = make_server()
    with MqClient(fast_config(server)) as client:
        result = client.send(Message(topic, b"x")).result(WAIT)
    assert result.ok and result.message.headers is None


def test_the_client_imports_and_sends_without_opentelemetry(make_server, topic):
    """The otel extra absent (its import blocked in a fresh interpreter): ``ENABLED`` is
    False and MqClient sends as before."""
    server = make_server()
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "from dmq_client import Message, MqClient, MqConfig, otel\n"
        "assert not otel.ENABLED\n"
        f"with MqClient(MqConfig(servers=('127.0.0.1:{server.tcp_port}',))) as c:\n"
        f"    r = c.send(Message({topic!r}, b'x')).result(30)\n"
        "print(r.status.value, r.message.headers)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["success", "None"]


def test_the_asyncio_client_traces_its_sends_and_a_consumers_processing(make_server, topic, traced):
    """dmq_client.aio: ``await client.send`` is the send span (its context in the message),
    ``with message.processing():`` inside ``async for`` the process span under it, current
    for the work done there; a block that raises ends it as an error."""
    import asyncio

    from dmq_client.aio import Client

    provider, exporter = traced
    server = make_server()
    tracer = provider.get_tracer("app")

    async def main() -> tuple[object, list[bytes]]:
        async with Client(servers=(f"127.0.0.1:{server.tcp_port}",), tracer_provider=provider) as client:
            sub = client.subscribe(topic, "billing", credit=10)
            with tracer.start_as_current_span("POST /orders") as request:
                for body in (b"good", b"bad"):
                    assert (await client.send(Message(topic, body))).ok
            seen = []
            async for message in sub:
                try:
                    with message.processing():
                        with tracer.start_as_current_span("bill order"):
                            if message.body == b"bad":
                                raise ValueError("no stock")
                except ValueError:
                    pass
                await message.ack()
                seen.append(message.body)
                if len(seen) == 2:
                    break
            return request.get_span_context(), seen

    root, seen = asyncio.run(main())
    assert sorted(seen) == [b"bad", b"good"]
    spans = exporter.get_finished_spans()
    sends = [s for s in spans if s.name == f"send {topic}"]
    processed = [s for s in spans if s.name == f"process {topic}"]
    bills = [s for s in spans if s.name == "bill order"]
    assert len(sends) == len(processed) == len(bills) == 2
    assert {s.context.trace_id for s in spans} == {root.trace_id}
    assert all(s.parent.span_id == root.span_id and s.kind is SpanKind.PRODUCER for s in sends)
    assert {p.parent.span_id for p in processed} == {s.context.span_id for s in sends}
    assert {b.parent.span_id for b in bills} == {p.context.span_id for p in processed}
    assert sorted(p.status.status_code.name for p in processed) == ["ERROR", "UNSET"]
