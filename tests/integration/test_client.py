"""``MqClient`` against a real dmq-server on real PostgreSQL.

Every ``Status`` a send callback can receive is produced here by the real
situation that causes it (except RATE_LIMIT_EXCEEDED, which the server does
not enforce yet: ``tests/unit/test_client_fake_server.py`` covers its
mapping). Times are shortened through ``MqConfig`` (resends 0.3-0.5 s apart,
checked every 50 ms) so the failure paths run in seconds. Waits are on
futures and events with deadlines, never sleeps.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter

import pytest

from dmq_client import Message, MqClient, MqConfig, SendResult, Status, SubscribeError

from .support import db_rows, wait_for

pytestmark = pytest.mark.integration

WAIT = 30.0  # generous deadline for anything that should take well under a second


def fast_config(*servers, **overrides) -> MqConfig:
    """Short timings for tests: failures surface in well under a second."""
    settings = dict(
        servers=tuple(f"127.0.0.1:{s.tcp_port}" for s in servers),
        resend_interval=0.5,
        resend_tries=20,
        resend_check_interval=0.05,
        route_wait=10.0,
        connect_timeout=5.0,
        reconnect_backoff=0.05,
        reconnect_backoff_max=0.3,
        close_timeout=10.0,
    )
    settings.update(overrides)
    return MqConfig(**settings)


class Results:
    """A callback object that records every result; ``wait`` blocks until ``expected``
    (or ``count``) results arrived."""

    def __init__(self, expected: int = 1):
        self.expected = expected
        self.results: list[SendResult] = []
        self.cond = threading.Condition()

    def on_result(self, result: SendResult) -> None:
        with self.cond:
            self.results.append(result)
            self.cond.notify_all()

    def wait(self, timeout: float = WAIT, count: int | None = None) -> list[SendResult]:
        count = self.expected if count is None else count
        with self.cond:
            arrived = self.cond.wait_for(lambda: len(self.results) >= count, timeout)
        assert arrived, f"only {len(self.results)}/{count} results"
        return self.results


class Inbox:
    """A handler recording each message and signalling when ``expected`` distinct ones arrived."""

    def __init__(self, expected: int = 1):
        self.expected = expected
        self.messages = []
        self.seen: Counter = Counter()
        self.lock = threading.Lock()
        self.done = threading.Event()

    def on_message(self, message) -> None:
        with self.lock:
            self.messages.append(message)
            self.seen[(message.producer, message.session_id)] += 1
            if len(self.seen) >= self.expected:
                self.done.set()

    def wait(self, timeout: float = WAIT) -> None:
        assert self.done.wait(timeout), f"only {len(self.seen)}/{self.expected} messages arrived"


def freeze(server) -> None:
    """SIGSTOP: the process keeps its sockets open but answers nothing (a hung server)."""
    server.proc.send_signal(signal.SIGSTOP)


def thaw(server) -> None:
    server.proc.send_signal(signal.SIGCONT)


# -- the happy path ------------------------------------------------------------------


def test_send_and_consume_with_auto_ack(make_server, topic, pg_dsn):
    """A sent message is stored (SUCCESS with its id), pushed to the handler once, and
    auto-acked, so no delivery row remains."""
    server = make_server()
    inbox = Inbox(expected=3)
    with MqClient(fast_config(server)) as client:
        client.subscribe(topic, "billing", inbox)
        futures = [client.send(Message(topic, f"hello {i}")) for i in range(3)]
        results = [f.result(WAIT) for f in futures]
        assert [r.status for r in results] == [Status.SUCCESS] * 3
        assert all(r.message_id and r.server == f"127.0.0.1:{server.tcp_port}" for r in results)
        inbox.wait()
        # the server listed the batch ack frame, so the acks went in it (docs/protocol.md §4.1)
        assert client.stats()["features"] == {f"127.0.0.1:{server.tcp_port}": ["ACKS", "CONFIRM", "PROPS", "REQUEUE"]}
        assert sorted(m.body for m in inbox.messages) == [b"hello 0", b"hello 1", b"hello 2"]
        assert {m.message_id for m in inbox.messages} == {r.message_id for r in results}
        # acks are written after on_message returns and made durable in batches
        wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)], timeout=WAIT)


def _register(dsn: str, topic: str, channel: str, msg_timeout_ms: int = 60000) -> None:
    from dmq_server.db.schema import migrate
    from dmq_server.db.worker import connect

    import registry

    migrate(dsn)
    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, topic, msg_timeout_ms=msg_timeout_ms)
        registry.add_channel(conn, topic, channel)


# -- every status from a real situation ------------------------------------------------


def test_unknown_topic_is_no_topic(make_server, topic):
    """A topic the registry does not know is answered NO_TOPIC, with the server's reason."""
    server = make_server()
    with MqClient(fast_config(server)) as client:
        result = client.send(Message("nosuch", b"x")).result(WAIT)
    assert result.status is Status.NO_TOPIC
    assert "nosuch" in result.description and result.message_id is None


def test_invalid_messages_are_reported_without_a_write(make_server, topic):
    """Oversized body, bad topic name and negative session id never reach the server:
    INVALID_MESSAGE at once, attempts 0. A valid DELAY message is stored by the server's
    delay scheduler and reported SUCCESS."""
    server = make_server()
    with MqClient(fast_config(server)) as client:
        results = Results(expected=3)
        client.send(Message(topic, b"x" * (64 * 1024 + 1)), results)
        client.send(Message("bad topic!", b"x"), results)
        client.send(Message(topic, b"x", session_id=-1), results)
        by_text = {r.description.split()[0]: r for r in results.wait()}
        assert all(r.status is Status.INVALID_MESSAGE and r.attempts == 0 for r in by_text.values())
        assert "max_body_size" in by_text["E_BAD_BODY"].description
        assert "bad topic!" in by_text["E_BAD_TOPIC"].description
        assert "-1" in by_text["E_INVALID"].description
        delayed = client.send(Message.delayed(topic, b"later", delay=60)).result(WAIT)
    assert delayed.status is Status.SUCCESS and delayed.message_id > 0


def test_stopped_server_is_socket_error(make_server, topic):
    """With the only server stopped, a send waits ``route_wait`` for a connection and is
    then reported SOCKET_ERROR: never written, so certainly not stored."""
    server = make_server()
    with MqClient(fast_config(server, route_wait=0.3)) as client:
        assert client.send(Message(topic, b"warm")).result(WAIT).ok
        server.terminate()
        started = time.monotonic()
        result = client.send(Message(topic, b"x")).result(WAIT)
        elapsed = time.monotonic() - started
    assert result.status is Status.SOCKET_ERROR and result.attempts == 0
    assert 0.3 <= elapsed < 5, elapsed


def test_storage_failure_is_server_error(make_server, pg_private):
    """PostgreSQL stopped under a running server: the server answers SEND_SERVER_ERROR
    and the callback gets SERVER_ERROR with the server's description."""
    dsn = pg_private.start()
    _register(dsn, "t", "c")
    server = make_server(dsn=dsn)
    with MqClient(fast_config(server, resend_interval=20)) as client:
        assert client.send(Message("t", b"warm")).result(WAIT).ok
        pg_private.stop(mode="immediate")
        result = client.send(Message("t", b"x")).result(WAIT)
    assert result.status is Status.SERVER_ERROR
    assert result.description.startswith("E_STORAGE"), result.description


def test_full_send_queue_answers_at_once(make_server, topic):
    """A hung server stops answering; the resend map fills (max_in_flight), the send
    runner waits, the bounded queue fills, and every further send is QUEUE_FULL at
    once, while the server is still hung. After it recovers the rest succeed: every
    send had exactly one result."""
    server = make_server()
    config = fast_config(server, max_in_flight=10, send_queue_size=10, send_batch_size=5, resend_interval=30)
    with MqClient(config) as client:
        assert client.send(Message(topic, b"warm")).result(WAIT).ok
        freeze(server)
        try:
            full = Results(expected=75)  # at most 10 in flight + 5 in hand + 10 queued
            accepted = Results(expected=1)
            futures = []
            for i in range(100):
                futures.append(client.send(Message(topic, b"%d" % i), _Split(full, accepted)))
            results = full.wait()
            assert all(r.status is Status.QUEUE_FULL for r in results)
            assert not accepted.results  # nothing else can be answered while the server hangs
        finally:
            thaw(server)
        statuses = Counter(f.result(WAIT).status for f in futures)
        # how many the runner took before the queue filled depends on thread scheduling
        assert statuses[Status.QUEUE_FULL] >= 75, statuses
        assert statuses[Status.SUCCESS] == 100 - statuses[Status.QUEUE_FULL], statuses


class _Split:
    """Routes QUEUE_FULL results to one recorder and the rest to another."""

    def __init__(self, full: Results, other: Results):
        self.full, self.other = full, other

    def on_result(self, result: SendResult) -> None:
        (self.full if result.status is Status.QUEUE_FULL else self.other).on_result(result)


def test_closed_client_reports_client_closed(make_server, topic):
    """Closing with sends the hung server never answered reports each CLIENT_CLOSED
    before close() returns; a send after close is CLIENT_CLOSED too."""
    server = make_server()
    client = MqClient(fast_config(server, resend_interval=30))
    assert client.send(Message(topic, b"warm")).result(WAIT).ok
    results = Results(expected=21)
    freeze(server)
    try:
        for i in range(20):
            client.send(Message(topic, b"%d" % i), results)
        client.close(timeout=0.2)
        assert len(results.results) == 20  # every callback ran before close returned
        assert all(r.status is Status.CLIENT_CLOSED for r in results.results)
        assert "may or may not be stored" in results.results[0].description
        late = client.send(Message(topic, b"late"), results).result(WAIT)
        assert late.status is Status.CLIENT_CLOSED and late.attempts == 0
    finally:
        thaw(server)
        client.close()


def test_unanswered_sends_run_out_of_retries_on_time(make_server, topic, pg_dsn):
    """A hung server: the message is resent ``resend_tries`` times ``resend_interval``
    apart and reported OUT_OF_RETRY one interval after the last resend. Once the server
    recovers, ``client.resend(result)`` succeeds and the message is stored once, although
    the server did receive the first writes."""
    server = make_server()
    interval, tries = 0.3, 3
    config = fast_config(server, resend_interval=interval, resend_tries=tries, resend_check_interval=0.02)
    with MqClient(config) as client:
        assert client.send(Message(topic, b"warm")).result(WAIT).ok
        freeze(server)
        try:
            started = time.monotonic()
            result = client.send(Message(topic, b"x")).result(WAIT)
            elapsed = time.monotonic() - started
        finally:
            thaw(server)
        assert result.status is Status.OUT_OF_RETRY
        assert result.attempts == tries + 1
        expected = (tries + 1) * interval
        assert expected <= elapsed < expected + 2.0, elapsed  # the injected-clock unit test is exact
        again = client.resend(result).result(WAIT)
    assert again.ok and again.session_id == result.session_id
    rows = db_rows(pg_dsn, "SELECT count(*) FROM dmq_message WHERE session_id = %s", result.session_id)
    assert rows == [(1,)]


def test_unreachable_server_runs_out_of_retries_on_time(make_server, topic):
    """The server dies (SIGKILL) after the message was written and stays away: every
    resend finds no server, yet each uses up its try, so OUT_OF_RETRY comes on schedule
    (the outage does not stretch it)."""
    server = make_server()
    interval, tries = 0.3, 3
    config = fast_config(server, resend_interval=interval, resend_tries=tries, resend_check_interval=0.02)
    with MqClient(config) as client:
        assert client.send(Message(topic, b"warm")).result(WAIT).ok
        freeze(server)  # the write reaches the socket, no reply comes back
        started = time.monotonic()
        future = client.send(Message(topic, b"x"))
        wait_for(lambda: client.stats()["in_flight"] == 1, timeout=WAIT)
        server.kill()
        result = future.result(WAIT)
        elapsed = time.monotonic() - started
    assert result.status is Status.OUT_OF_RETRY and result.attempts == tries + 1
    expected = (tries + 1) * interval
    assert expected <= elapsed < expected + 2.0, elapsed


# -- crashes, concurrency, failover ---------------------------------------------------


def _stream(client: MqClient, topic: str, count: int, results: Results, window: int) -> threading.Thread:
    """A producer thread sending ``count`` messages with at most ``window`` unanswered."""
    slots = threading.BoundedSemaphore(window)

    class Release:
        def on_result(self, result: SendResult) -> None:
            slots.release()
            results.on_result(result)

    def run() -> None:
        release = Release()
        for i in range(count):
            assert slots.acquire(timeout=WAIT)
            client.send(Message(topic, b"m-%d" % i), release)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_kill_9_mid_stream_resends_and_delivers_each_message_once(make_server, topic, pg_dsn):
    """SIGKILL the server while messages stream in, then restart it. Sends without a
    reply are resent (same session id, so the server never stores one twice), every
    send ends SUCCESS, and the consumer's handler sees every message exactly once,
    across its own reconnect and resubscribe."""
    server = make_server()
    count = 1500
    inbox = Inbox(expected=count)
    results = Results(expected=count)
    consumer = MqClient(fast_config(server))
    producer = MqClient(fast_config(server, route_wait=30, resend_tries=60))
    try:
        consumer.subscribe(topic, "billing", inbox, credit=500)
        sender = _stream(producer, topic, count, results, window=50)
        results.wait(count=count // 4)  # mid-stream: a quarter answered
        # freeze first, so that the kill certainly finds sends written and unanswered
        freeze(server)
        wait_for(lambda: producer.stats()["in_flight"] >= 25, timeout=WAIT)
        server.kill()
        server.start()
        sender.join(WAIT)
        answered = results.wait(60)
        inbox.wait(60)
    finally:
        producer.close()
        consumer.close()
    assert Counter(r.status for r in answered) == {Status.SUCCESS: count}
    assert len({r.session_id for r in answered}) == count  # one result per send
    assert sum(r.attempts > 1 for r in answered) >= 25  # the unanswered ones were resent
    assert max(inbox.seen.values()) == 1, [k for k, n in inbox.seen.items() if n > 1][:5]
    assert set(inbox.seen) == {(producer.producer_id, r.session_id) for r in answered}
    stored = db_rows(pg_dsn, "SELECT count(*), count(DISTINCT session_id) FROM dmq_message")
    assert stored == [(count, count)]


def test_many_threads_sending_get_exactly_one_result_each(make_server, topic):
    """Eight threads share one client; each of their sends gets exactly one callback and
    one completed future, and all are stored."""
    server = make_server()
    threads, per_thread = 8, 200
    results = Results(expected=threads * per_thread)
    futures: list = []
    lock = threading.Lock()
    start = threading.Barrier(threads)
    with MqClient(fast_config(server)) as client:

        def run(n: int) -> None:
            start.wait(WAIT)
            mine = [client.send(Message(topic, b"t%d-%d" % (n, i)), results) for i in range(per_thread)]
            with lock:
                futures.extend(mine)

        workers = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(WAIT)
        answered = results.wait()
        assert client.flush(WAIT)
        assert len(results.results) == threads * per_thread  # none twice
    by_session = Counter(r.session_id for r in answered)
    assert len(by_session) == threads * per_thread and max(by_session.values()) == 1
    assert all(r.status is Status.SUCCESS for r in answered)
    assert all(f.done() and f.result().ok for f in futures)


def test_two_servers_sends_fail_over_when_one_stops(make_server, topic):
    """Two servers on one store. The topic's server is stopped gracefully (SERVER_REBOOT);
    the following sends all succeed on the other one."""
    a, b = make_server(), make_server()
    with MqClient(fast_config(a, b)) as client:
        home = client.send(Message(topic, b"first")).result(WAIT)
        assert home.ok
        stopped, other = (a, b) if home.server.endswith(f":{a.tcp_port}") else (b, a)
        stopped.terminate()
        results = [client.send(Message(topic, b"after %d" % i)).result(WAIT) for i in range(50)]
    assert all(r.ok for r in results)
    assert {r.server for r in results} == {f"127.0.0.1:{other.tcp_port}"}


def test_two_servers_kill_9_fails_over_unanswered_sends_at_once(make_server, topic, pg_dsn):
    """SIGKILL the topic's server mid-stream: the sends it had not answered are written to
    the other server at once (no waiting for the 30 s resend interval), and all succeed,
    each stored once."""
    a, b = make_server(), make_server()
    count = 1000
    results = Results(expected=count)
    with MqClient(fast_config(a, b, resend_interval=30)) as client:
        home = client.send(Message(topic, b"first")).result(WAIT).server
        victim = a if home.endswith(f":{a.tcp_port}") else b
        sender = _stream(client, topic, count, results, window=50)
        results.wait(count=count // 4)
        freeze(victim)  # so that the kill certainly finds sends written and unanswered
        wait_for(lambda: client.stats()["in_flight"] >= 25, timeout=WAIT)
        started = time.monotonic()
        victim.kill()
        sender.join(WAIT)
        answered = results.wait(25)
        elapsed = time.monotonic() - started
    assert elapsed < 25  # well before the 30 s resend interval: failed over at once
    assert Counter(r.status for r in answered) == {Status.SUCCESS: count}
    assert len({r.server for r in answered}) == 2
    assert sum(r.attempts == 2 for r in answered) >= 25  # the unanswered ones, written again
    stored = db_rows(pg_dsn, "SELECT count(*), count(DISTINCT session_id) FROM dmq_message")
    assert stored == [(count + 1, count + 1)]


def test_graceful_restart_reconnects_and_resubscribes(make_server, topic):
    """A server restarted gracefully (SERVER_REBOOT, then SERVER_HEALTH on reconnect):
    the client routes to it again and the consumer's subscription is renewed, so a
    message sent after the restart reaches the handler."""
    server = make_server()
    inbox = Inbox(expected=2)
    with MqClient(fast_config(server)) as client:
        client.subscribe(topic, "billing", inbox)
        assert client.send(Message(topic, b"before")).result(WAIT).ok
        server.terminate()
        server.start()
        assert client.wait_connected(WAIT)
        assert client.send(Message(topic, b"after")).result(WAIT).ok
        inbox.wait()
    assert sorted(m.body for m in inbox.messages) == [b"after", b"before"]


# -- consuming ----------------------------------------------------------------------------


def test_manual_ack_holds_the_message_until_acked(make_server, pg_dsn):
    """With auto_ack off an unacked message is redelivered after the topic's timeout;
    the client suppresses the redelivery (the handler sees it once), and ack() removes it."""
    _register(pg_dsn, "jobs", "workers", msg_timeout_ms=200)
    server = make_server()
    inbox = Inbox(expected=1)
    with MqClient(fast_config(server)) as client:
        client.subscribe("jobs", "workers", inbox, auto_ack=False)
        assert client.send(Message("jobs", b"work")).result(WAIT).ok
        inbox.wait()
        wait_for(lambda: client.stats()["duplicates_suppressed"] >= 1, timeout=WAIT)
        assert len(inbox.messages) == 1 and db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(1,)]
        inbox.messages[0].ack()
        wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)], timeout=WAIT)
    assert len(inbox.messages) == 1


def test_a_handler_requeues_with_a_delay_and_gets_the_message_again(make_server, pg_dsn):
    """``message.requeue(delay)`` in a handler (auto-ack on): the message is not acked, comes
    back no sooner than the delay with attempts 2, and its second handling acks it."""
    _register(pg_dsn, "jobs", "workers")
    server = make_server()
    requeued_at: list[float] = []

    class Later(Inbox):
        def on_message(self, message) -> None:
            super().on_message(message)
            if message.attempts == 1:
                message.requeue(delay=0.4)
                requeued_at.append(time.monotonic())
            else:
                self.second = time.monotonic()
                self.done.set()

    inbox = Later(expected=99)
    with MqClient(fast_config(server)) as client:
        client.subscribe("jobs", "workers", inbox)
        assert client.send(Message("jobs", b"later")).result(WAIT).ok
        inbox.wait()
        assert [m.attempts for m in inbox.messages] == [1, 2]
        assert inbox.second - requeued_at[0] >= 0.35
        wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)], timeout=WAIT)


def test_handler_failure_gets_the_message_again(make_server, pg_dsn):
    """A handler that raises does not ack: the redelivery is not taken for a duplicate,
    the handler gets a second go (attempts 2), and its success acks the message."""
    _register(pg_dsn, "jobs", "workers", msg_timeout_ms=200)
    server = make_server()
    calls = []
    done = threading.Event()

    def handler(message) -> None:
        calls.append(message.attempts)
        if len(calls) == 1:
            raise RuntimeError("first try fails")
        done.set()

    with MqClient(fast_config(server)) as client:
        client.subscribe("jobs", "workers", handler)
        assert client.send(Message("jobs", b"work")).result(WAIT).ok
        assert done.wait(WAIT)
        wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)], timeout=WAIT)
    assert calls == [1, 2]


def test_subscribe_to_unregistered_channel_is_refused(make_server, topic):
    """Subscribing to a channel the topic does not have raises SubscribeError(no_channel);
    an unknown topic raises SubscribeError(no_topic)."""
    server = make_server()
    with MqClient(fast_config(server)) as client:
        with pytest.raises(SubscribeError) as refused:
            client.subscribe(topic, "nosuch", lambda m: None)
        assert refused.value.reason == "no_channel"
        with pytest.raises(SubscribeError) as refused:
            client.subscribe("nosuch", "billing", lambda m: None)
        assert refused.value.reason == "no_topic"
        assert client.stats()["subscriptions"] == []
