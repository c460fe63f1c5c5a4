"""pynsq (tornado) Writer and Reader, unchanged, against dmq: fast and reliable topics, lookupd."""

from __future__ import annotations

import asyncio


import nsq  # noqa: E402  (the dev extra installs it; a missing client is an error, not a skip)
from tornado.ioloop import IOLoop  # noqa: E402

from tests.integration.support import db_rows, wait_for  # noqa: E402



class Scenario:
    """Runs a tornado IOLoop until ``done()`` or a deadline; events, not sleeps."""

    def __init__(self, timeout: float = 20.0):
        self.aio = asyncio.new_event_loop()
        asyncio.set_event_loop(self.aio)
        self.loop = IOLoop.current()
        self.timeout = timeout
        self.timed_out = False
        self.closers: list = []

    def done(self) -> None:
        self.loop.stop()

    def _expire(self) -> None:
        self.timed_out = True
        self.loop.stop()

    def run(self) -> None:
        handle = self.loop.call_later(self.timeout, self._expire)
        self.loop.start()
        self.loop.remove_timeout(handle)
        for close in self.closers:
            close()
        self.loop.close(all_fds=True)
        asyncio.set_event_loop(None)


def publish_all(scenario: Scenario, writer, topic: str, bodies: list[bytes], results: list, then=None):
    """Publish each body with Writer.pub, retrying while the writer is still connecting."""

    def send(i: int) -> None:
        if i == len(bodies):
            if then is not None:
                then()
            return

        def answered(conn, data):
            if isinstance(data, nsq.Error):
                if "no open connections" in str(data):
                    scenario.loop.call_later(0.05, send, i)
                    return
                results.append(data)
                scenario.done()
                return
            results.append(data)
            send(i + 1)

        writer.pub(topic, bodies[i], callback=answered)

    send(0)


def consume(scenario: Scenario, server, topic: str, channel: str, want: int, got: list, **reader_kw):
    def handler(message):
        got.append((message.body, message.attempts, message.id))
        if len(got) >= want:
            scenario.loop.add_callback(scenario.done)
        return True

    kw = dict(nsqd_tcp_addresses=[f"127.0.0.1:{server.tcp_port}"])
    kw.update(reader_kw)
    reader = nsq.Reader(topic=topic, channel=channel, message_handler=handler, max_in_flight=10, **kw)
    scenario.closers.append(reader.close)
    return reader


def test_pynsq_writer_and_reader_on_a_fast_topic(nsq_server):
    """Writer.pub gets OK for each message; a Reader receives them all and FINs them."""
    s = Scenario()
    writer = nsq.Writer([f"127.0.0.1:{nsq_server.tcp_port}"])
    results: list = []
    got: list = []
    bodies = [b"fast-%d" % i for i in range(20)]
    publish_all(s, writer, "pynsq_fast", bodies, results,
                then=lambda: consume(s, nsq_server, "pynsq_fast", "c", len(bodies), got))
    s.run()
    assert not s.timed_out, (results, got)
    assert results == [b"OK"] * len(bodies)
    assert sorted(b for b, _, _ in got) == sorted(bodies)
    assert all(a == 1 for _, a, _ in got)


def test_pynsq_on_a_reliable_topic(nsq_server, topic, pg_dsn):
    """Through pynsq, a reliable topic stores before OK and a FIN is a durable ack."""
    s = Scenario()
    writer = nsq.Writer([f"127.0.0.1:{nsq_server.tcp_port}"])
    results: list = []
    got: list = []
    publish_all(s, writer, topic, [b"r1", b"r2"], results,
                then=lambda: consume(s, nsq_server, topic, "billing", 2, got))
    s.run()
    assert not s.timed_out, (results, got)
    assert results == [b"OK", b"OK"]
    stored = {r[0] for r in db_rows(pg_dsn, "SELECT id FROM dmq_message")}
    assert {int(mid, 16) for _, _, mid in got} == stored
    wait_for(lambda: not db_rows(pg_dsn, "SELECT 1 FROM dmq_pending"))


def test_pynsq_reader_finds_the_node_through_lookupd(nsq_server):
    """A Reader given only lookupd_http_addresses=[dmq's HTTP port] discovers the node."""
    s = Scenario()
    writer = nsq.Writer([f"127.0.0.1:{nsq_server.tcp_port}"])
    results: list = []
    got: list = []
    publish_all(
        s, writer, "via_lookup", [b"found"], results,
        then=lambda: consume(
            s, nsq_server, "via_lookup", "c", 1, got,
            nsqd_tcp_addresses=[], lookupd_http_addresses=[nsq_server.http], lookupd_poll_interval=1,
        ),
    )
    s.run()
    assert not s.timed_out, (results, got)
    assert [b for b, _, _ in got] == [b"found"]


def test_pynsq_requeue_increments_attempts(nsq_server):
    """A handler returning False makes pynsq REQ; the message comes back with attempts 2."""
    s = Scenario()
    writer = nsq.Writer([f"127.0.0.1:{nsq_server.tcp_port}"])
    results: list = []
    seen: list = []

    def handler(message):
        seen.append(message.attempts)
        if message.attempts >= 2:
            s.loop.add_callback(s.done)
            return True
        message.requeue(backoff=False, delay=0)
        return None

    def start_reader():
        reader = nsq.Reader(
            topic="requeue", channel="c", message_handler=handler, max_in_flight=1,
            nsqd_tcp_addresses=[f"127.0.0.1:{nsq_server.tcp_port}"],
        )
        s.closers.append(reader.close)

    publish_all(s, writer, "requeue", [b"again"], results, then=start_reader)
    s.run()
    assert not s.timed_out, seen
    assert seen == [1, 2]


def test_pynsq_with_deflate(nsq_server):
    """pynsq with deflate=True negotiates raw DEFLATE and still publishes and consumes."""
    s = Scenario()
    writer = nsq.Writer([f"127.0.0.1:{nsq_server.tcp_port}"], deflate=True, deflate_level=6)
    results: list = []
    got: list = []
    bodies = [b"compressed-%d" % i * 10 for i in range(10)]
    publish_all(
        s, writer, "deflated", bodies, results,
        then=lambda: consume(s, nsq_server, "deflated", "c", len(bodies), got, deflate=True),
    )
    s.run()
    assert not s.timed_out, (results, got)
    assert results == [b"OK"] * len(bodies)
    assert sorted(b for b, _, _ in got) == sorted(bodies)
