"""The asyncio client (``dmq_client.aio``) against real dmq-servers on real PostgreSQL.

Each test runs its coroutine with ``asyncio.run`` (the project has no pytest asyncio
plugin). Waits are on the client's own futures and results, or ``until`` (a condition
polled with a deadline, as ``support.wait_for``), never a sleep standing in for an event.
Times are shortened through the settings (resends a fraction of a second apart) so the
failure paths run in seconds. What both clients must do alike (failover on kill -9 and
SERVER_REBOOT, TLS with authentication, the journal) is in ``test_client_contract.py``.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from dmq_client import Message, Status, SubscribeError
from dmq_client.aio import Client, RequeueError
from dmq_client.wire import MAGIC, Command, Frame, FrameDecoder, encode

from .support import db_rows, free_port
from .test_client import fast_config

pytestmark = pytest.mark.integration

WAIT = 30.0  # a deadline for what should take well under a second


async def until(predicate, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def freeze(server) -> None:
    """SIGSTOP, returning once the process is stopped (the signal is delivered
    asynchronously: a send written just after ``kill`` could still be answered)."""
    server.proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + WAIT
    stat = Path(f"/proc/{server.proc.pid}/stat")
    while stat.read_text().rpartition(")")[2].split()[0] != "T":
        assert time.monotonic() < deadline, "the server did not stop"
        time.sleep(0.001)


def stored(dsn: str, session_id: int) -> int:
    return db_rows(dsn, "SELECT count(*) FROM dmq_message WHERE session_id = %s", session_id)[0][0]


# -- the happy path ---------------------------------------------------------------------------


def test_send_receive_ack_and_requeue_with_a_delay(make_server, topic, pg_dsn):
    """Sent messages are stored (SUCCESS with their ids) and come out of ``async for``;
    a message requeued with a delay comes back no sooner than the delay, with attempts 2;
    acked, nothing stays pending. A requeue the server refuses raises RequeueError with the
    server's code, and the message stays with the consumer."""
    server = make_server()

    async def run():
        async with Client(fast_config(server)) as client:
            results = [await client.send(Message(topic, f"hello {i}")) for i in range(3)]
            assert [r.status for r in results] == [Status.SUCCESS] * 3
            assert all(r.message_id and r.server == f"127.0.0.1:{server.tcp_port}" for r in results)
            seen = []
            requeued_at = None
            async for message in client.subscribe(topic, "billing", credit=10):
                seen.append((message.body, message.attempts))
                if message.body == b"hello 1" and message.attempts == 1:
                    with pytest.raises(RequeueError) as refused:
                        await message.requeue(delay=7200)  # above --max-req-timeout (an hour)
                    assert refused.value.code == "E_INVALID"
                    await message.requeue(delay=0.5)
                    requeued_at = time.monotonic()
                    with pytest.raises(RequeueError):  # once given back it is no longer ours
                        await message.requeue(delay=0)
                    continue
                if message.body == b"hello 1":
                    assert time.monotonic() - requeued_at >= 0.45
                await message.ack()
                if len(seen) == 4:
                    break
            assert sorted(seen) == [(b"hello 0", 1), (b"hello 1", 1), (b"hello 1", 2), (b"hello 2", 1)]
            return {r.message_id for r in results}

    asyncio.run(run())
    deadline = time.monotonic() + WAIT
    while db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") != [(0,)]:
        assert time.monotonic() < deadline, "acks were not made durable"
        time.sleep(0.05)


def test_the_requeue_frame_on_the_wire(make_server, topic):
    """UP_CONSUMER_REQUEUE through the plain blocking client: an unknown id, a delay over
    the server's bound and a requeue on a channel not subscribed are each answered
    REQUEUE_ACK with their specific error, and the connection goes on serving; a good one
    is answered with an empty status and the copy is pushed again, attempts 2."""
    server = make_server()
    with server.client() as producer:
        assert producer.send(topic, b"again").command == Command.SEND_SUCCESS_ACK
    with server.client() as consumer:
        assert "REQUEUE" in consumer.subscribe(topic, "billing", credit=5).status.split()
        push = consumer.receive(timeout=10)
        assert push is not None and push.attempts == 1

        def requeue(message_id: int, delay_ms: int, channel: str = "billing") -> Frame:
            consumer.write(Frame(Command.UP_CONSUMER_REQUEUE, topic=topic, channel=channel,
                                 message_id=message_id, credit=delay_ms))
            answer = consumer.next_frame(timeout=10)  # pushes are kept apart, for receive()
            while answer is not None and answer.command in (Command.SERVER_HEARTBEAT, Command.SERVER_HEALTH):
                answer = consumer.next_frame(timeout=10)
            assert answer is not None and answer.command == Command.REQUEUE_ACK
            assert (answer.topic, answer.channel, answer.credit) == (topic, channel, delay_ms)
            return answer

        assert requeue(push.message_id + 1000, 0).status == "E_REQUEUE_FAILED ID not in flight"
        assert requeue(push.message_id, 3_600_001).status == "E_INVALID requeue delay 3600001 ms is above 3600000"
        assert requeue(push.message_id, 0, channel="other").status.startswith("E_REQUEUE_FAILED no subscription")
        assert requeue(push.message_id, 0).status == ""
        again = consumer.receive(timeout=10)
        assert again is not None and (again.message_id, again.attempts) == (push.message_id, 2)
        consumer.ack(again)


# -- resends, failover, reboots ---------------------------------------------------------------------


class ReplyEater:
    """A TCP proxy in front of a server whose first connection swallows the first
    SEND_SUCCESS_ACK and then drops, as a network failure after the server stored the
    message; later connections pass everything."""

    def __init__(self, port: int):
        self.port = port
        self.listen_port = free_port()
        self.connections = 0
        self.eaten: list[Frame] = []

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.listen_port)

    async def _serve(self, client_reader, client_writer) -> None:
        self.connections += 1
        first = self.connections == 1
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.port)

        async def upstream():
            while data := await client_reader.read(65536):
                server_writer.write(data)

        async def downstream():
            decoder = FrameDecoder()
            while data := await server_reader.read(65536):
                if not first:
                    client_writer.write(data)
                    continue
                for frame in decoder.feed(data):
                    if frame.command == Command.SEND_SUCCESS_ACK:
                        self.eaten.append(frame)
                        client_writer.transport.abort()
                        return
                    client_writer.write(encode(frame))

        tasks = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:  # cancelled too (the loop ending under it): no socket left open
            for task in tasks:
                task.cancel()
            server_writer.close()
            client_writer.close()

    async def close(self) -> None:
        self.server.close()


def test_a_send_whose_answer_is_lost_is_resent_and_stored_once(make_server, topic, pg_dsn):
    """The server stores the message but its answer is lost with the connection: the client
    writes it again on the next connection under the same session id, the server answers
    it as a duplicate with the same message id, and it is stored once."""
    server = make_server()

    async def run():
        proxy = ReplyEater(server.tcp_port)
        await proxy.start()
        try:
            async with Client(servers=f"127.0.0.1:{proxy.listen_port}", resend_interval=30.0,
                              reconnect_backoff=0.05) as client:
                result = await client.send(Message(topic, b"once"))
        finally:
            await proxy.close()
        return result, proxy

    result, proxy = asyncio.run(run())
    assert result.ok and result.duplicate and result.attempts == 2, result
    (eaten,) = proxy.eaten
    assert (eaten.session_id, eaten.message_id) == (result.session_id, result.message_id)
    assert stored(pg_dsn, result.session_id) == 1


async def hang_home_server(client: Client, servers, topic: str, count: int):
    """Send one message to learn the topic's server (both connected first, so it is the one
    the topic keeps: ``routing.affinity``), freeze that server, and start ``count`` sends
    that are written to it and stay unanswered. Returns the frozen server and the sends."""
    await until(lambda: all(link.routable for link in client.links.values()))
    home = (await client.send(Message(topic, b"first"))).server
    (victim,) = [s for s in servers if home.endswith(f":{s.tcp_port}")]
    freeze(victim)
    sends = [asyncio.ensure_future(client.send(Message(topic, b"m %d" % i))) for i in range(count)]
    await until(lambda: len(client.sends.pending) == count)
    return victim, sends


def test_unanswered_sends_move_at_once_when_their_server_dies(make_server, topic, pg_dsn):
    """The topic's server hangs with sends written and unanswered, then is killed: they are
    written to the other server at once (the resend interval is 30 s) and each is stored
    once."""
    a, b = make_server(), make_server()

    async def run():
        async with Client(fast_config(a, b, resend_interval=30.0)) as client:
            victim, sends = await hang_home_server(client, (a, b), topic, 50)
            started = time.monotonic()
            await asyncio.to_thread(victim.kill)
            results = await asyncio.gather(*sends)
            return results, time.monotonic() - started

    results, elapsed = asyncio.run(run())
    assert elapsed < 20
    assert Counter(r.status for r in results) == {Status.SUCCESS: 50}
    assert Counter(r.attempts for r in results) == {2: 50}
    assert db_rows(pg_dsn, "SELECT count(*), count(DISTINCT session_id) FROM dmq_message") == [(51, 51)]


def test_sends_written_to_a_server_that_then_shuts_down_are_each_stored_once(make_server, topic, pg_dsn):
    """The topic's server hangs with sends written, then is asked to stop (SIGTERM) and
    resumes: it announces SERVER_REBOOT, answers what it had begun and refuses the rest
    E_SHUTTING_DOWN; the client moves those to the other server at once (the resend
    interval is 30 s). Every send succeeds and each message is stored once."""
    a, b = make_server(), make_server()

    async def run():
        async with Client(fast_config(a, b, resend_interval=30.0)) as client:
            victim, sends = await hang_home_server(client, (a, b), topic, 200)
            victim.proc.send_signal(signal.SIGTERM)
            victim.proc.send_signal(signal.SIGCONT)
            results = await asyncio.wait_for(asyncio.gather(*sends), WAIT)
            await asyncio.to_thread(victim.proc.wait, WAIT)
            return results

    results = asyncio.run(run())
    assert Counter(r.status for r in results) == {Status.SUCCESS: 200}
    # at most the first write and the one at SERVER_REBOOT (or E_SHUTTING_DOWN): no 30 s resend
    assert max(r.attempts for r in results) <= 2
    assert db_rows(pg_dsn, "SELECT count(*), count(DISTINCT session_id) FROM dmq_message") == [(201, 201)]


def test_a_restarted_server_is_used_again_and_the_subscription_renewed(make_server, topic):
    """A graceful restart (SERVER_REBOOT, then a new greeting): the client reconnects,
    subscribes again, and a message sent after the restart arrives."""
    server = make_server()

    async def run():
        async with Client(fast_config(server)) as client:
            messages = client.subscribe(topic, "billing", credit=5)
            assert (await client.send(Message(topic, b"before"))).ok
            first = await asyncio.wait_for(messages.__anext__(), WAIT)
            await first.ack()
            await asyncio.to_thread(server.terminate)
            await asyncio.to_thread(server.start)
            assert await client.wait_connected(WAIT)
            assert (await client.send(Message(topic, b"after"))).ok
            second = await asyncio.wait_for(messages.__anext__(), WAIT)
            await second.ack()
            return [first.body, second.body]

    assert asyncio.run(run()) == [b"before", b"after"]


def test_heartbeats_while_idle_and_a_silent_server_is_dropped_and_reconnected():
    """A fake server (real sockets, no dmq-server) greets, announces a 200 ms heartbeat
    interval and then says nothing: the idle client sends UP_HEARTBEAT (every
    ``heartbeat_interval``, at most half the server's), drops the connection after two of
    the server's intervals of silence, and connects again."""
    connections: list[float] = []
    heartbeats: list[float] = []

    async def run():
        second = asyncio.Event()

        async def serve(reader, writer):
            connections.append(time.monotonic())
            if len(connections) == 2:
                second.set()
            assert await reader.readexactly(4) == MAGIC
            writer.write(encode(Frame(Command.SERVER_HEALTH, status="OK"))
                         + encode(Frame(Command.SERVER_HEARTBEAT, credit=200)))
            decoder = FrameDecoder()
            while data := await reader.read(65536):
                heartbeats.extend(time.monotonic() for f in decoder.feed(data) if f.command == Command.UP_HEARTBEAT)
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with Client(servers=f"127.0.0.1:{port}", heartbeat_interval=0.05, reconnect_backoff=0.05,
                          close_timeout=0):
            await asyncio.wait_for(second.wait(), WAIT)
        server.close()
        await server.wait_closed()

    asyncio.run(run())
    assert 0.4 <= connections[1] - connections[0] < 5  # 2 x 200 ms of silence, then a reconnect
    assert len([t for t in heartbeats if t < connections[1]]) >= 3  # about every 50 ms while idle


def test_a_refused_subscription_is_raised_from_the_iteration(make_server, topic):
    """A channel not registered on the topic: the server's refusal comes out of ``async for``
    as SubscribeError (reason no_channel); an invalid name is a ValueError at once."""
    server = make_server()

    async def run():
        async with Client(fast_config(server)) as client:
            with pytest.raises(ValueError):  # refused at once, nothing written
                client.subscribe(topic, "bad name")
            with pytest.raises(SubscribeError) as refused:
                async for _ in client.subscribe(topic, "nobody"):
                    pass
            return refused.value

    assert asyncio.run(run()).reason == "no_channel"


# -- TLS and authentication ---------------------------------------------------------------------


# -- backpressure, cancellation, closing ----------------------------------------------------------


def test_send_waits_while_max_in_flight_sends_are_unanswered(make_server, topic):
    """With the server hung, at most ``max_in_flight`` sends are written; the others wait in
    ``send`` (not written, not queued); once the server answers, every send succeeds."""
    server = make_server()

    async def run():
        async with Client(fast_config(server, max_in_flight=4, resend_interval=30.0)) as client:
            assert (await client.send(Message(topic, b"warm"))).ok
            freeze(server)
            try:
                sends = [asyncio.ensure_future(client.send(Message(topic, b"b %d" % i))) for i in range(10)]
                await until(lambda: len(client.sends.pending) == 4)
                for _ in range(20):  # the loop turns; nothing more is written
                    await asyncio.sleep(0)
                assert len(client.sends.pending) == 4 and not any(s.done() for s in sends)
            finally:
                server.proc.send_signal(signal.SIGCONT)
            results = await asyncio.gather(*sends)
            return results

    results = asyncio.run(run())
    assert [r.status for r in results] == [Status.SUCCESS] * 10


def test_cancelled_sends_are_stored_once_or_reported_not_sent(make_server, topic, pg_dsn):
    """Sends cancelled at random points (waiting for room, just written, awaiting the
    answer, answered): each gets exactly one report through ``on_cancelled``; one reported
    CANCELLED is not stored, one reported SUCCESS is stored once, and no message is stored
    twice. Sends not cancelled all succeed."""
    server = make_server()
    rng = random.Random(47)
    reports: Counter = Counter()
    outcomes: dict[int, Status] = {}

    def on_cancelled(result):
        reports[result.session_id] += 1
        outcomes[result.session_id] = result.status

    async def run():
        cancelled, finished = [], []
        async with Client(fast_config(server, max_in_flight=16), on_cancelled=on_cancelled) as client:
            assert (await client.send(Message(topic, b"warm", session_id=1))).ok
            loop = asyncio.get_running_loop()
            tasks = {}
            for sid in range(100, 400):
                tasks[sid] = task = asyncio.ensure_future(client.send(Message(topic, b"c", session_id=sid)))
                if rng.random() < 0.6:  # at a random point of its life: waiting for room, written, answered
                    loop.call_later(rng.uniform(0, 0.05), task.cancel)
                    cancelled.append(sid)
            for sid, task in tasks.items():
                try:
                    finished.append((sid, await task))
                except asyncio.CancelledError:
                    pass
        return cancelled, finished

    cancelled, finished = asyncio.run(run())
    counts = dict(db_rows(pg_dsn, "SELECT session_id, count(*) FROM dmq_message GROUP BY session_id"))
    assert max(counts.values()) == 1  # none twice
    for sid, result in finished:
        if sid not in reports:  # its caller got the result (cancelled too late to matter)
            assert result.ok and counts.get(sid) == 1
    answered = dict(finished)
    for sid in cancelled:  # cancelled before its coroutine ever ran: nothing was done
        if sid not in reports and sid not in answered:
            assert counts.get(sid, 0) == 0, sid
    really_cancelled = [sid for sid in cancelled if sid in reports]
    assert len(really_cancelled) > 20
    assert all(reports[sid] == 1 for sid in reports)
    statuses = Counter(outcomes[sid] for sid in really_cancelled)
    assert set(statuses) <= {Status.CANCELLED, Status.SUCCESS}, statuses
    assert statuses[Status.CANCELLED] and statuses[Status.SUCCESS], statuses  # both kinds happened
    for sid in really_cancelled:
        assert counts.get(sid, 0) == (1 if outcomes[sid] is Status.SUCCESS else 0), sid


def test_closing_reports_every_unanswered_send(make_server, topic, pg_dsn):
    """Leaving ``async with`` while the server is hung: every unanswered send is answered
    CLIENT_CLOSED after ``close_timeout``, and a send after close is CLIENT_CLOSED at once."""
    server = make_server()

    async def run():
        client = Client(fast_config(server, close_timeout=0.3, resend_interval=30.0))
        async with client:
            assert (await client.send(Message(topic, b"warm"))).ok
            freeze(server)
            sends = [asyncio.ensure_future(client.send(Message(topic, b"x"))) for _ in range(5)]
            await until(lambda: len(client.sends.pending) == 5)
        late = await client.send(Message(topic, b"late"))
        return await asyncio.gather(*sends), late

    try:
        results, late = asyncio.run(run())
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert [r.status for r in results] == [Status.CLIENT_CLOSED] * 5
    assert all("may or may not be stored" in r.description for r in results)
    assert late.status is Status.CLIENT_CLOSED
