"""The examples in docs/client.md, run against a real server.

Each block marked ``<!-- example: NAME -->`` is executed as a module (its
``if __name__ == "__main__"`` part does not run) with ``DMQ_CLIENT_SERVERS``
pointing at a test server, and then driven the way a user would: a WSGI
request into the web example, messages into the worker, results into the
error-handling callback. So the documentation cannot rot.
"""

from __future__ import annotations

import io
import json
import re
import threading
from pathlib import Path

import pytest

from dmq_client import Message, MqClient, MqConfig, Status
from dmq_client.journal import JournalSendQueue

from .support import db_rows, wait_for

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "client.md"
WAIT = 30.0


def examples() -> dict[str, str]:
    text = DOC.read_text()
    return dict(re.findall(r"<!-- example: (\S+) -->\n```python\n(.*?)```", text, flags=re.S))


def load(name: str) -> dict:
    namespace: dict = {"__name__": f"docs_example_{name.removesuffix('.py')}"}
    exec(compile(examples()[name], f"docs/client.md:{name}", "exec"), namespace)
    return namespace


@pytest.fixture
def served(make_server, topic, monkeypatch):
    server = make_server()
    monkeypatch.setenv("DMQ_CLIENT_SERVERS", f"127.0.0.1:{server.tcp_port}")
    return server


def test_every_marked_example_is_covered():
    """Every marked example on the page has a test here (a new one needs one too)."""
    assert set(examples()) == {"quickstart.py", "publisher_app.py", "worker.py", "callbacks.py",
                               "journal_producer.py", "confirm_consumed.py", "confirm_blocking.py", "properties.py",
                               "tracing.py", "asyncio_quickstart.py", "asyncio_confirm.py",
                               "fastapi_app.py", "asyncio_journal.py"}


def test_the_fastapi_app_answers_202_once_the_message_is_stored(served, pg_dsn):
    """A request through FastAPI's own test client (the app's lifespan runs, so the asyncio
    client starts and closes with it): 202 with the stored message's id and key."""
    from fastapi.testclient import TestClient

    module = load("fastapi_app.py")
    with TestClient(module["app"]) as http:
        reply = http.post("/orders/7")
    assert reply.status_code == 202
    assert db_rows(pg_dsn, "SELECT id, key, body FROM dmq_message") == [
        (reply.json()["message_id"], "order-7", b'{"id": 7}')]


def test_asyncio_quickstart_sends_then_receives_and_acks(served, pg_dsn):
    """The asyncio example sends with the asyncio client, receives the message through
    ``async for`` and acks it, so nothing stays pending."""
    import asyncio

    module = load("asyncio_quickstart.py")
    assert asyncio.run(module["main"]()) == [b'{"id": 1}']
    wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)], timeout=WAIT)


def test_the_asyncio_journal_example_publishes_through_the_journal(served, pg_dsn, tmp_path, monkeypatch):
    """The asyncio journal example stores every order and leaves nothing in the journal; a
    record a crashed predecessor left there is sent first and reported to ``recovered``."""
    import asyncio

    from dmq_client.pending import PendingSend

    journal = tmp_path / "journal"
    monkeypatch.setenv("ORDERS_JOURNAL", str(journal))
    crashed = JournalSendQueue(journal, ticker=False, producer_id="crashed-1")
    crashed.put(PendingSend(Message("orders", b"left over"), 4242, "crashed-1", 1_700_000_000_000))
    crashed.abandon()  # as kill -9 leaves it
    module = load("asyncio_journal.py")
    reported = []
    module["recovered"] = reported.append
    ids = asyncio.run(module["publish"]([b"a", b"b"]))
    assert [r.session_id for r in reported] == [4242] and reported[0].ok
    assert sorted(db_rows(pg_dsn, "SELECT id FROM dmq_message")) == sorted([(i,) for i in ids + [reported[0].message_id]])
    with JournalSendQueue(journal, ticker=False) as reopened:
        assert reopened.recovered == 0


def test_the_asyncio_confirmation_resolves_consumed_once_acked(served, pg_dsn):
    """The asyncio confirmation example: stored, then acked by its own subscription, and
    the awaited outcome is CONSUMED by the one channel."""
    import asyncio

    module = load("asyncio_confirm.py")
    assert asyncio.run(module["main"]()) == "acknowledged by ('billing',)"
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)]


def test_quickstart_sends_and_prints_success(served, capsys):
    """The quick start sends a message and prints a SUCCESS status."""
    load("quickstart.py")
    assert "SUCCESS" in capsys.readouterr().out.upper()


def test_web_handler_answers_202_once_stored_and_400_for_a_bad_message(served, pg_dsn):
    """A request is answered 202 with the message id only after the commit; an
    oversized body is a 400 with the reason."""
    module = load("publisher_app.py")
    app, client = module["app"], module["client"]
    try:
        statuses = []

        def request(body: bytes) -> bytes:
            environ = {"wsgi.input": io.BytesIO(body), "CONTENT_LENGTH": str(len(body))}
            return b"".join(app(environ, lambda status, headers: statuses.append(status)))

        answer = json.loads(request(b'{"id": 1}'))
        assert statuses == ["202 Accepted"]
        assert db_rows(pg_dsn, "SELECT body FROM dmq_message WHERE id = %s", answer["message_id"]) == [(b'{"id": 1}',)]
        assert request(b"x" * 70000).startswith(b"invalid_message")
        assert statuses[-1] == "400 Bad Request"
    finally:
        client.close()


def test_worker_acks_what_it_charged_and_leaves_failures_unacked(served, pg_dsn):
    """The worker acks an order it charged; one whose charge fails stays unacked."""
    module = load("worker.py")
    charged = []

    def charge(order):
        if order.get("fail"):
            raise RuntimeError("card declined")
        charged.append(order["id"])

    module["charge"] = charge
    stop = threading.Event()
    worker = threading.Thread(target=module["run"], args=(stop,))
    worker.start()
    try:
        with MqClient(MqConfig(servers=f"127.0.0.1:{served.tcp_port}")) as producer:
            assert producer.send(Message("orders", b'{"id": 1}')).result(WAIT).ok
            assert producer.send(Message("orders", b'{"id": 2, "fail": true}')).result(WAIT).ok
        wait_for(lambda: charged == [1], timeout=WAIT)
        # the failed order's delivery stays; the charged one is acked
        wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(1,)], timeout=WAIT)
    finally:
        stop.set()
        worker.join(WAIT)
    assert not worker.is_alive()


def test_error_handling_callback_sorts_results(served):
    """Stored results are counted; a message to an unknown topic is dropped as unfixable;
    a send after close is dropped as CLIENT_CLOSED."""
    module = load("callbacks.py")
    client = MqClient(MqConfig(servers=f"127.0.0.1:{served.tcp_port}"))
    callback = module["OrderCallback"](client)
    client.send(Message("orders", b"1"), callback)
    client.send(Message("nosuch", b"2"), callback)
    client.flush(WAIT)
    client.close()
    client.send(Message("orders", b"3"), callback).result(WAIT)
    assert callback.stored == 1
    assert [r.status for r in callback.dropped] == [Status.NO_TOPIC, Status.CLIENT_CLOSED]


def test_journal_example_stores_every_message_and_leaves_the_journal_empty(served, pg_dsn, tmp_path, monkeypatch):
    """The journal example publishes through a journaled client: every body is stored once,
    on_result sees only SUCCESS, and the journal holds nothing afterwards."""
    monkeypatch.setenv("ORDERS_JOURNAL", str(tmp_path / "journal"))
    module = load("journal_producer.py")
    seen = []
    original = module["on_result"]

    def on_result(result):
        seen.append(result.status)
        original(result)

    module["on_result"] = on_result
    bodies = [f'{{"id": {i}}}'.encode() for i in range(20)]
    module["publish"](bodies)
    assert seen == [Status.SUCCESS] * 20
    assert sorted(bytes(b) for (b,) in db_rows(pg_dsn, "SELECT body FROM dmq_message")) == sorted(bodies)
    with JournalSendQueue(tmp_path / "journal", ticker=False) as reopened:
        assert reopened.recovered == 0


def test_the_properties_example_gets_its_key_priority_and_headers_back(served, capsys, pg_dsn):
    """The example sends a message with properties and its handler prints them as the
    consumer got them; the stored row holds them."""
    load("properties.py")
    out = capsys.readouterr().out
    assert "Status.SUCCESS" in out and "order-7 5 application/json" in out
    assert db_rows(pg_dsn, "SELECT key, priority, headers FROM dmq_message") == [
        ("order-7", 5, {"content-type": "application/json", "tenant": "acme"})]


def test_the_tracing_example_makes_one_trace_across_the_broker(served, capsys, pg_dsn):
    """The spans the example prints are one trace: the request's, the send's, the
    handler's process span and its own work; the stored message carries the trace."""
    module = load("tracing.py")
    out = capsys.readouterr().out
    assert "['POST /orders', 'bill order', 'process orders', 'send orders']" in out
    spans = module["exporter"].get_finished_spans()
    assert len({span.context.trace_id for span in spans}) == 1
    ((headers,),) = db_rows(pg_dsn, "SELECT headers FROM dmq_message")
    assert headers["traceparent"].split("-")[1] == f"{spans[0].context.trace_id:032x}"


def test_confirmation_examples_report_the_channel_that_consumed(served, capsys):
    """With a consumer acking on the topic's one channel (billing), both confirmation
    examples print that billing acknowledged their message; with none, the first reports
    the channel still waiting (its deadline shortened so the test does not wait 30 s)."""
    acked = []

    class Acker:
        def on_message(self, message):
            acked.append(message.body)
            message.ack()

    with MqClient(MqConfig(servers=f"127.0.0.1:{served.tcp_port}")) as consumer:
        consumer.subscribe("orders", "billing", Acker(), auto_ack=False)
        load("confirm_consumed.py")
        assert "acknowledged by ('billing',)" in capsys.readouterr().out
        load("confirm_blocking.py")
        assert "CONSUMED ('billing',) () ()" in capsys.readouterr().out
    assert sorted(acked) == [b'{"id": 1}', b'{"id": 2}']
    source = examples()["confirm_consumed.py"].replace("confirm_timeout=30", "confirm_timeout=1")
    exec(compile(source, "docs/client.md:confirm_consumed.py", "exec"), {"__name__": "docs_example_deadline"})
    assert "DEADLINE ('billing',)" in capsys.readouterr().out
