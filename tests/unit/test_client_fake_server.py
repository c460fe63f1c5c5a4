"""``MqClient`` against a scripted fake server: replies, routing, heartbeats, pushes.

The fake server is a few dozen lines on a loopback socket, built on the same
sans-IO codec: it greets, records every frame the client sends, and answers
with whatever the test scripts. That makes the situations the real server
cannot produce yet (rate limiting) or produces only by accident (a reply
racing a reboot) exact and quick. The resend schedule runs on an injected
clock: the tests move time, not wait for it.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Callable

import pytest

from dmq_client import Message, MqClient, MqConfig, SendResult, Status
from dmq_client.connection import ConnState
from dmq_client.wire import MAGIC, SERVER_FEATURES, Command, Frame, FrameDecoder, encode, unpack_ids

WAIT = 10.0

Reply = Callable[[Frame], list[Frame]]


def success(frame: Frame, message_id: int = 7, status: str = "") -> list[Frame]:
    return [
        Frame(Command.SEND_SUCCESS_ACK, session_id=frame.session_id, message_id=message_id,
              topic=frame.topic, producer=frame.producer, status=status)
    ]


def default_reply(frame: Frame) -> list[Frame]:
    if frame.command in (Command.UP_PRODUCER_SEND, Command.UP_PRODUCER_RESEND):
        return success(frame)
    if frame.command == Command.UP_SUBSCRIBE:
        return [subscribed(frame)]
    return []


def subscribed(frame: Frame, status: str = SERVER_FEATURES) -> Frame:
    """A SUBSCRIBE_ACK listing what this version's server accepts, or ``status``."""
    return Frame(Command.SUBSCRIBE_ACK, session_id=frame.session_id, topic=frame.topic, channel=frame.channel,
                 status=status)


class FakeServer:
    """Accepts dmq connections on 127.0.0.1; ``reply(frame)`` scripts the answers."""

    def __init__(self, reply: Reply = default_reply, greeting: str = "OK", port: int = 0, features: str = ""):
        self.reply = reply
        self.greeting = greeting
        self.features = features  # what the greeting's body lists (SERVER_HEALTH, docs/protocol.md §4.9)
        self.received: queue.Queue[tuple[int, Frame]] = queue.Queue()
        self.connections: list[socket.socket] = []
        self.connected = threading.Semaphore(0)
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.connections.append(sock)
            threading.Thread(target=self._serve, args=(sock, len(self.connections)), daemon=True).start()

    def _serve(self, sock: socket.socket, number: int) -> None:
        try:
            magic = b""
            while len(magic) < 4:
                chunk = sock.recv(4 - len(magic))
                if not chunk:
                    return
                magic += chunk
            assert magic == MAGIC
            sock.sendall(encode(Frame(Command.SERVER_HEALTH, status=self.greeting, body=self.features.encode())))
            self.connected.release()
            decoder = FrameDecoder()
            while True:
                data = sock.recv(65536)
                if not data:
                    return
                for frame in decoder.feed(data):
                    answers = self.reply(frame)
                    if answers:  # before a test sees the frame: what it sends next comes after
                        sock.sendall(b"".join(encode(f) for f in answers))
                    self.received.put((number, frame))
        except OSError:
            return

    def send(self, frame: Frame, connection: int = -1) -> None:
        """Send a frame on a connection (the latest by default)."""
        self.connections[connection].sendall(encode(frame))

    def drop(self) -> None:
        """Close every client connection (the server stays up)."""
        for sock in self.connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def next(self, command: Command, timeout: float = WAIT) -> tuple[int, Frame]:
        """The next received frame with ``command`` (others are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {command.name} before the deadline")
            try:
                number, frame = self.received.get(timeout=remaining)
            except queue.Empty:
                continue
            if frame.command == command:
                return number, frame

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.drop()
        for sock in self.connections:  # shut down is not closed: left to the GC, each warned
            sock.close()


@pytest.fixture
def servers():
    made: list[FakeServer] = []

    def make(**kwargs) -> FakeServer:
        server = FakeServer(**kwargs)
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


class FakeClock:
    """Monotonic time the test moves by hand."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def config(*servers: FakeServer, **overrides) -> MqConfig:
    settings = dict(
        servers=tuple(s.address for s in servers),
        connect_timeout=5.0,
        route_wait=5.0,
        reconnect_backoff=0.01,
        reconnect_backoff_max=0.05,
        close_timeout=2.0,
    )
    settings.update(overrides)
    return MqConfig(**settings)


def never_answer(frame: Frame) -> list[Frame]:
    return default_reply(frame) if frame.command == Command.UP_SUBSCRIBE else []


# -- reply mapping -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "command, status",
    [
        (Command.SEND_NO_TOPIC_ACK, Status.NO_TOPIC),
        (Command.SEND_SERVER_ERROR, Status.SERVER_ERROR),
        (Command.SEND_EXCEED_LIMIT_ACK, Status.RATE_LIMIT_EXCEEDED),
        (Command.SEND_INVALID_ACK, Status.INVALID_MESSAGE),
    ],
)
def test_error_replies_map_to_statuses_with_the_servers_description(servers, command, status):
    """Each SEND_* error reply becomes its Status, carrying the server's status text."""
    server = servers(reply=lambda f: [Frame(command, session_id=f.session_id, topic=f.topic, status="E_X why")])
    with MqClient(config(server)) as client:
        result = client.send(Message("orders", b"x")).result(WAIT)
    assert result.status is status
    assert result.description == "E_X why" and result.message_id is None and result.server == server.address


def test_success_reply_carries_message_id_and_duplicate_flag(servers):
    """SEND_SUCCESS_ACK gives the message id; status "duplicate" (a resend the server had
    stored) sets ``duplicate``."""
    server = servers(reply=lambda f: success(f, 42, "duplicate"))
    with MqClient(config(server)) as client:
        result = client.send(Message("orders", b"x", session_id=5)).result(WAIT)
    assert result.ok and result.message_id == 42 and result.duplicate and result.session_id == 5


def test_send_frame_carries_producer_session_and_delay(servers):
    """The wire frame has the producer id, the caller's session id, and for DELAY the
    message type and due time."""
    server = servers()
    with MqClient(config(server, producer_id="billing-1")) as client:
        client.send(Message.delayed("orders", b"later", due=1_900_000_000.5, session_id=9)).result(WAIT)
    _, frame = server.next(Command.UP_PRODUCER_SEND)
    assert (frame.producer, frame.session_id, frame.topic, frame.body) == ("billing-1", 9, "orders", b"later")
    assert frame.msg_type == 1 and frame.due_ms == 1_900_000_000_500


def test_callbacks_run_on_the_notify_thread_and_survive_exceptions(servers):
    """Callbacks run off the caller's and the I/O threads; one that raises does not stop
    the next callback or the future."""
    server = servers()
    threads = []

    def bad(result: SendResult) -> None:
        threads.append(threading.current_thread().name)
        raise RuntimeError("callback bug")

    with MqClient(config(server)) as client:
        first = client.send(Message("orders", b"1"), bad)
        second = client.send(Message("orders", b"2"), lambda r: threads.append(threading.current_thread().name))
        assert first.result(WAIT).ok and second.result(WAIT).ok
    assert threads == ["dmq-notify", "dmq-notify"]


def test_caller_session_id_already_in_flight_is_invalid(servers):
    """Two sends with one caller-chosen session id while the first awaits its reply: the
    second is INVALID_MESSAGE (the server would take it for a resend of the first)."""
    server = servers(reply=never_answer)
    with MqClient(config(server, resend_interval=60)) as client:
        client.send(Message("orders", b"a", session_id=3))
        server.next(Command.UP_PRODUCER_SEND)
        second = client.send(Message("orders", b"b", session_id=3)).result(WAIT)
        assert second.status is Status.INVALID_MESSAGE and "already awaiting" in second.description
        client.close(timeout=0)


def test_a_resend_of_a_message_in_flight_gets_the_first_copys_answer(servers):
    """``client.resend`` of a message still awaiting its reply (the same producer and
    session id) is the same message: it is not written again, and when the server answers
    the first copy both get that answer (the copy marked duplicate), not INVALID_MESSAGE
    "already awaiting a reply" (issue 13, item 5)."""
    answer = threading.Event()
    held: list[Frame] = []

    def reply(frame: Frame) -> list[Frame]:
        if frame.command == Command.UP_PRODUCER_SEND:
            held.append(frame)
            answer.set()
            return []
        return never_answer(frame)

    server = servers(reply=reply)
    with MqClient(config(server, resend_interval=60)) as client:
        first = client.send(Message("orders", b"a", session_id=3))
        _, sent = server.next(Command.UP_PRODUCER_SEND)
        assert answer.wait(WAIT)
        copy = client.resend(SendResult(Status.OUT_OF_RETRY, Message("orders", b"a"), session_id=3,
                                        producer=client.producer_id))
        leader = client._producer.resends.get((client.producer_id, 3))
        deadline = time.monotonic() + WAIT
        while not leader.followers and time.monotonic() < deadline:  # the send runner took the copy
            time.sleep(0.001)
        assert leader.followers and not copy.done() and server.received.empty()  # not written again
        server.send(success(sent, 41)[0])
        a, b = first.result(WAIT), copy.result(WAIT)
    assert (a.status, a.message_id, a.duplicate) == (Status.SUCCESS, 41, False)
    assert (b.status, b.message_id, b.duplicate, b.session_id) == (Status.SUCCESS, 41, True, 3)


def test_resend_of_a_result_reuses_its_session_id_as_up_producer_resend(servers):
    """``client.resend(result)`` retries idempotently: same session id, UP_PRODUCER_RESEND."""
    server = servers(reply=lambda f: [Frame(Command.SEND_SERVER_ERROR, session_id=f.session_id, status="E_STORAGE x")]
                     if f.command == Command.UP_PRODUCER_SEND else success(f))
    with MqClient(config(server)) as client:
        failed = client.send(Message("orders", b"x")).result(WAIT)
        assert failed.status is Status.SERVER_ERROR
        again = client.resend(failed).result(WAIT)
    _, frame = server.next(Command.UP_PRODUCER_RESEND)
    assert again.ok and frame.session_id == failed.session_id == again.session_id and frame.body == b"x"


# -- resends on an injected clock -----------------------------------------------------------


def test_resends_follow_the_schedule_then_out_of_retry(servers):
    """No reply: UP_PRODUCER_RESEND with the same session id at +30, +60 and +90 s, then
    OUT_OF_RETRY at +120 s, on the injected clock (the runner's own tick is disabled)."""
    server = servers(reply=never_answer)
    clock = FakeClock()
    client = MqClient(config(server, resend_check_interval=3600), clock=clock)
    try:
        future = client.send(Message("orders", b"x"))
        _, sent = server.next(Command.UP_PRODUCER_SEND)
        producer = client._producer
        for n in range(1, 4):
            clock.advance(29.9)
            producer.check_resends()
            assert server.received.empty() and not future.done()
            clock.advance(0.1)
            producer.check_resends()
            _, resent = server.next(Command.UP_PRODUCER_RESEND)
            assert resent.session_id == sent.session_id and resent.body == b"x"
        clock.advance(29.9)
        producer.check_resends()
        assert not future.done()
        clock.advance(0.1)
        producer.check_resends()
        result = future.result(WAIT)
        assert result.status is Status.OUT_OF_RETRY and result.attempts == 4
    finally:
        client.close(timeout=0)


def test_reply_to_a_resend_ends_the_retries(servers):
    """A reply arriving after a resend completes the send once; later ticks resend nothing."""
    answer = threading.Event()

    def reply(frame: Frame) -> list[Frame]:
        return success(frame) if answer.is_set() else never_answer(frame)

    server = servers(reply=reply)
    clock = FakeClock()
    client = MqClient(config(server, resend_check_interval=3600), clock=clock)
    try:
        future = client.send(Message("orders", b"x"))
        server.next(Command.UP_PRODUCER_SEND)
        answer.set()
        clock.advance(30)
        client._producer.check_resends()
        assert future.result(WAIT).ok and future.result().attempts == 2
        clock.advance(300)
        client._producer.check_resends()
        server.next(Command.UP_PRODUCER_RESEND)  # the one resend that was answered
        assert server.received.empty()
    finally:
        client.close(timeout=0)


# -- routing and failover ---------------------------------------------------------------------


def _home(client: MqClient, topic: str = "orders") -> str:
    return client.send(Message(topic, b"probe")).result(WAIT).server


def test_shutting_down_reply_is_failed_over_not_reported(servers):
    """A server answering E_SHUTTING_DOWN (mid graceful shutdown) is taken out of
    routing and the message is written to the other server; the caller sees SUCCESS."""
    shutting = threading.Event()

    def refusing(frame: Frame) -> list[Frame]:
        if shutting.is_set() and frame.command in (Command.UP_PRODUCER_SEND, Command.UP_PRODUCER_RESEND):
            return [Frame(Command.SEND_SERVER_ERROR, session_id=frame.session_id, topic=frame.topic,
                          status="E_SHUTTING_DOWN server is restarting, send elsewhere")]
        return default_reply(frame)

    a, b = servers(reply=refusing), servers(reply=refusing)
    with MqClient(config(a, b)) as client:
        home = _home(client)
        first, other = (a, b) if home == a.address else (b, a)
        # only the home server refuses; the other keeps answering
        other.reply = default_reply
        shutting.set()
        result = client.send(Message("orders", b"x")).result(WAIT)
        assert result.ok and result.server == other.address and result.attempts == 2
        assert client.pool.get(first.address).state is ConnState.REBOOTING


def test_reboot_removes_a_server_from_routing_and_health_restores_it(servers):
    """SERVER_REBOOT moves the topic to the other server; SERVER_HEALTH brings it back."""
    a, b = servers(), servers()
    with MqClient(config(a, b)) as client:
        home = _home(client)
        first, other = (a, b) if home == a.address else (b, a)
        first.send(Frame(Command.SERVER_REBOOT, status="server is shutting down"))
        _wait_state(client, first.address, ConnState.REBOOTING)
        assert _home(client) == other.address
        first.send(Frame(Command.SERVER_HEALTH, status="OK"))
        _wait_state(client, first.address, ConnState.READY)
        assert _home(client) == first.address


def test_unhealthy_server_is_a_last_resort(servers):
    """A server greeting with a storage failure is used only while no healthy server is
    connected."""
    sick, well = servers(greeting="E_STORAGE database unreachable"), servers()
    with MqClient(config(sick, well)) as client:
        assert {_home(client, t) for t in ("a", "b", "c", "d", "e", "f")} == {well.address}
        well.close()
        _wait_state(client, well.address, ConnState.DISCONNECTED, ConnState.CONNECTING)
        assert _home(client, "a") == sick.address


def test_storage_error_reply_avoids_the_server_for_a_probation(servers, monkeypatch):
    """A SERVER_ERROR E_STORAGE reply is reported, and the topic moves to the other
    server until the probation lapses (or the server says SERVER_HEALTH OK)."""
    import dmq_client.connection

    monkeypatch.setattr(dmq_client.connection, "UNHEALTHY_PROBATION", 0.2)
    failing = threading.Event()

    def reply(frame: Frame) -> list[Frame]:
        if failing.is_set() and frame.command == Command.UP_PRODUCER_SEND:
            return [Frame(Command.SEND_SERVER_ERROR, session_id=frame.session_id, status="E_STORAGE db down")]
        return default_reply(frame)

    a, b = servers(reply=reply), servers(reply=reply)
    with MqClient(config(a, b)) as client:
        home = _home(client)
        other = b.address if home == a.address else a.address
        failing.set()
        failed = client.send(Message("orders", b"x")).result(WAIT)
        assert failed.status is Status.SERVER_ERROR and failed.server == home
        failing.clear()
        assert client.pool.get(home).state is ConnState.UNHEALTHY
        assert _home(client) == other
        _wait_state(client, home, ConnState.READY)
        assert _home(client) == home


def test_lost_connection_fails_over_unanswered_sends_at_once(servers):
    """When a connection drops, the sends it had not answered are resent to the other
    server right away, not after the resend interval; no try is used up."""
    a, b = servers(reply=never_answer), servers()
    with MqClient(config(a, b, resend_interval=3600)) as client:
        # make sure the topic lives on the silent server
        topic = next(t for t in (f"t{i}" for i in range(100)) if client.pool.pick(t).name == a.address)
        future = client.send(Message(topic, b"x"))
        a.next(Command.UP_PRODUCER_SEND)
        a.drop()
        result = future.result(WAIT)
    assert result.ok and result.server == b.address and result.attempts == 2
    _, frame = b.next(Command.UP_PRODUCER_RESEND)
    assert frame.session_id == result.session_id


def _wait_state(client: MqClient, name: str, *states: ConnState) -> None:
    deadline = time.monotonic() + WAIT
    conn = client.pool.get(name)
    with client.pool._cond:
        while conn.state not in states:
            assert time.monotonic() < deadline, f"{name} stayed {conn.state}"
            client.pool._cond.wait(0.1)


# -- connection keeping ---------------------------------------------------------------------------


def test_client_heartbeats_at_half_the_servers_interval(servers):
    """Told the server's heartbeat interval, the client writes UP_HEARTBEAT when idle, so
    the server never drops it for silence."""
    server = servers()
    with MqClient(config(server)) as client:
        server.send(Frame(Command.SERVER_HEARTBEAT, credit=200))
        for _ in range(3):
            server.next(Command.UP_HEARTBEAT, timeout=WAIT)
        assert client.pool.get(server.address).server_interval == 0.2


def test_silent_server_is_dropped_and_reconnected(servers):
    """A server that announced a 100 ms heartbeat and then says nothing is taken for dead:
    the client drops the connection and connects again."""
    server = servers()
    with MqClient(config(server)):
        assert server.connected.acquire(timeout=WAIT)
        server.send(Frame(Command.SERVER_HEARTBEAT, credit=100))
        assert server.connected.acquire(timeout=WAIT)  # a second connection
    assert len(server.connections) >= 2


def test_protocol_error_closes_and_reconnects(servers):
    """A PROTOCOL_ERROR from the server ends the connection; the client reconnects."""
    server = servers()
    with MqClient(config(server)):
        assert server.connected.acquire(timeout=WAIT)
        server.send(Frame(Command.PROTOCOL_ERROR, status="E_INVALID test"))
        assert server.connected.acquire(timeout=WAIT)


def test_consumer_resubscribes_after_reconnect(servers):
    """After the connection drops, the new connection carries the same subscription."""
    server = servers()
    with MqClient(config(server)) as client:
        client.subscribe("orders", "billing", lambda m: None, credit=7)
        number, first = server.next(Command.UP_SUBSCRIBE)
        server.drop()
        again_number, again = server.next(Command.UP_SUBSCRIBE)
    assert again_number > number
    assert (again.topic, again.channel, again.credit) == ("orders", "billing", 7)


# -- pushes and duplicates -------------------------------------------------------------------------


def push(session_id: int, message_id: int, producer: str = "p1", channel: str = "billing") -> Frame:
    return Frame(Command.CONSUMER_PUSH, session_id=session_id, message_id=message_id, topic="orders",
                 channel=channel, producer=producer, attempts=1, body=b"body %d" % session_id)


def test_duplicate_push_is_suppressed_and_a_duplicate_of_an_acked_one_is_acked(servers):
    """A redelivered copy of a message being handled is dropped; a copy of one already
    acked is acked again (else the server would keep redelivering it) and dropped.
    The same session id from another producer, or on another channel, is a new message."""
    server = servers()
    got: queue.Queue = queue.Queue()
    release = threading.Event()

    def handler(message) -> None:
        got.put(message)
        release.wait(WAIT)

    with MqClient(config(server, handler_threads=1)) as client:
        client.subscribe("orders", "billing", handler)
        client.subscribe("orders", "audit", lambda m: got.put(m))
        server.next(Command.UP_SUBSCRIBE)
        server.send(push(1, 100))
        first = got.get(timeout=WAIT)
        server.send(push(1, 100))  # redelivered while the handler still runs
        deadline = time.monotonic() + WAIT
        while client.stats()["duplicates_suppressed"] < 1:  # read before the handler returns
            assert time.monotonic() < deadline, "the redelivered copy was not suppressed"
            time.sleep(0.005)
        release.set()
        _, ack = server.next(Command.UP_CONSUMER_ACKS)
        assert (list(unpack_ids(ack.body)), ack.channel) == ([100], "billing")
        server.send(push(1, 100))  # redelivered after the ack was lost
        _, ack = server.next(Command.UP_CONSUMER_ACKS)
        assert list(unpack_ids(ack.body)) == [100]
        server.send(push(1, 101, producer="p2"))
        server.send(push(1, 100, channel="audit"))
        others = {(m.producer, m.channel) for m in (got.get(timeout=WAIT), got.get(timeout=WAIT))}
        assert client.stats()["duplicates_suppressed"] == 2
    assert first.session_id == 1 and first.body == b"body 1"
    assert others == {("p2", "billing"), ("p1", "audit")}
    assert got.empty()


class FirstWaits:
    """A handler that holds message 1 until ``release``: the others queue behind it."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, message) -> None:
        if message.message_id == 1:
            self.release.wait(WAIT)


def push_backlog(server: FakeServer, client: MqClient, count: int) -> None:
    """Push messages 1..count in one write; return once all but the first are queued."""
    server.connections[-1].sendall(b"".join(encode(push(i, i)) for i in range(1, count + 1)))
    deadline = time.monotonic() + WAIT
    while client._consumer._queue.qsize() < count - 1:
        assert time.monotonic() < deadline, "the pushes were not all queued"
        time.sleep(0.005)


def test_acks_of_a_backlog_go_out_in_batches_of_256_in_order(servers):
    """While received messages wait for a handler, the acks of those handled are held
    and go in one UP_CONSUMER_ACKS frame per 256, the rest when the queue runs dry."""
    server = servers()
    handler = FirstWaits()
    with MqClient(config(server, handler_threads=1, ack_wait=30.0)) as client:
        client.subscribe("orders", "billing", handler)
        server.next(Command.UP_SUBSCRIBE)
        push_backlog(server, client, 300)
        handler.release.set()
        batches = [list(unpack_ids(server.next(Command.UP_CONSUMER_ACKS)[1].body)) for _ in range(2)]
    assert batches == [list(range(1, 257)), list(range(257, 301))]


def test_a_slow_handler_does_not_hold_back_the_acks_made_before_it(servers):
    """The ack of a message handled before a slow one goes within ``ack_wait``, not when
    the slow handler returns: a held ack is an ack the server does not have."""
    server = servers()
    slow_done = threading.Event()

    def handler(message) -> None:
        if message.message_id == 2:
            slow_done.wait(WAIT)

    with MqClient(config(server, handler_threads=1, ack_wait=0.05)) as client:
        client.subscribe("orders", "billing", handler)
        server.next(Command.UP_SUBSCRIBE)
        server.connections[-1].sendall(encode(push(1, 1)) + encode(push(2, 2)))
        _, first = server.next(Command.UP_CONSUMER_ACKS)  # while message 2's handler still runs
        assert not slow_done.is_set() and list(unpack_ids(first.body)) == [1]
        slow_done.set()
        _, second = server.next(Command.UP_CONSUMER_ACKS)
    assert list(unpack_ids(second.body)) == [2]


def test_a_push_with_an_id_no_server_draws_is_acked_and_the_handler_thread_goes_on(servers):
    """A server's mistake (id 0, a negative id) is acked like any push, for the server to
    refuse; it never kills the handler thread that acks it."""
    server = servers()
    got: queue.Queue = queue.Queue()
    with MqClient(config(server, handler_threads=1)) as client:
        client.subscribe("orders", "billing", lambda m: got.put(m.message_id))
        server.next(Command.UP_SUBSCRIBE)
        acked = []
        for session_id, message_id in ((1, 0), (2, -5), (3, 42)):
            server.send(push(session_id, message_id))
            assert got.get(timeout=WAIT) == message_id
            acked += list(unpack_ids(server.next(Command.UP_CONSUMER_ACKS)[1].body))
    assert acked == [0, -5, 42]


def test_a_server_that_does_not_list_the_batch_frame_gets_an_ack_frame_per_message(servers):
    """A server older than UP_CONSUMER_ACKS answers SUBSCRIBE_ACK with an empty status
    and would close the connection on that frame: it gets an UP_CONSUMER_ACK per id.
    After a reconnect the client asks again: the
    same address may now be a newer server (a rolling upgrade), or an older one."""
    old = {"server": True}

    def reply(frame: Frame) -> list[Frame]:
        if frame.command == Command.UP_SUBSCRIBE:
            return [subscribed(frame, "" if old["server"] else "ACKS SOMETHING-NEWER")]
        return default_reply(frame)

    server = servers(reply=reply)
    handler = FirstWaits()
    with MqClient(config(server, handler_threads=1, ack_wait=30.0)) as client:
        client.subscribe("orders", "billing", handler)
        server.next(Command.UP_SUBSCRIBE)
        push_backlog(server, client, 5)  # the acks of 2..5 are held while 1's handler waits
        handler.release.set()
        acks = [server.next(Command.UP_CONSUMER_ACK)[1] for _ in range(5)]
        assert [(a.message_id, a.topic, a.channel) for a in acks] == [(i, "orders", "billing") for i in range(1, 6)]

        old["server"] = False  # upgraded behind the same address
        server.drop()
        server.next(Command.UP_SUBSCRIBE)  # resubscribed on the new connection
        server.send(push(6, 6))
        _, batch = server.next(Command.UP_CONSUMER_ACKS)
        assert list(unpack_ids(batch.body)) == [6]

        old["server"] = True  # and rolled back
        server.drop()
        server.next(Command.UP_SUBSCRIBE)
        server.send(push(7, 7))
        assert server.next(Command.UP_CONSUMER_ACK)[1].message_id == 7


def test_manual_ack_is_sent_only_when_called(servers):
    """With auto_ack off nothing is acked until ``message.ack()``; a second ack is a no-op."""
    server = servers()
    got: queue.Queue = queue.Queue()
    with MqClient(config(server)) as client:
        client.subscribe("orders", "billing", got.put, auto_ack=False)
        server.next(Command.UP_SUBSCRIBE)
        server.send(push(5, 500))
        message = got.get(timeout=WAIT)
        assert not message.acked
        message.ack()
        message.ack()
        _, ack = server.next(Command.UP_CONSUMER_ACKS)
        assert list(unpack_ids(ack.body)) == [500] and ack.topic == "orders" and ack.channel == "billing"
    assert all(f.command != Command.UP_CONSUMER_ACKS for _, f in list(server.received.queue))


# -- closing ---------------------------------------------------------------------------------------------


def test_close_reports_every_pending_send(servers):
    """Queued and unanswered sends are all reported CLIENT_CLOSED by the time close()
    returns; none is left without a result."""
    server = servers(reply=never_answer)
    client = MqClient(config(server, route_wait=0.1))
    seen: list[SendResult] = []
    futures = [client.send(Message("orders", b"%d" % i), seen.append) for i in range(50)]
    client.close(timeout=0.1)
    assert len(seen) == 50 and all(r.status is Status.CLIENT_CLOSED for r in seen)
    assert all(f.done() for f in futures)
    assert client.send(Message("orders", b"late")).result(WAIT).status is Status.CLIENT_CLOSED


def test_close_from_a_callback_does_not_deadlock(servers):
    """A callback may close the client (on the notify thread) without hanging it."""
    server = servers()
    client = MqClient(config(server))
    closed = threading.Event()

    def close_me(result: SendResult) -> None:
        client.close(timeout=1)
        closed.set()

    client.send(Message("orders", b"x"), close_me)
    assert closed.wait(WAIT)
    assert client.closed


def test_send_of_something_not_a_message_is_a_type_error(servers):
    """A programming error fails loudly at the call, unlike a bad message, which is a result."""
    server = servers()
    with MqClient(config(server)) as client:
        with pytest.raises(TypeError):
            client.send(b"not a Message")  # type: ignore[arg-type]
        assert client.flush(WAIT)
