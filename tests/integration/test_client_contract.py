"""One contract, three clients: ``MqClient`` (threads), ``dmq_client.aio.Client`` on
asyncio's default event loop, and the same on uvloop. Each test is written once against a
small blocking facade (``Facade``: send, receive-and-ack, close) and runs for every client,
against real dmq-servers on real PostgreSQL: what one client promises, the others keep.

The asyncio client runs on an event loop of its own thread, driven from the test's thread
with ``run_coroutine_threadsafe``: the test waits on the client's answers, never on a sleep.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from typing import Any, Callable, Coroutine

import pytest
import uvloop

from dmq_client import Message, MqClient, MqConfig, Status
from dmq_client.aio import Client
from dmq_client.journal import JournalSendQueue
from dmq_client.pending import PendingSend

from .support import db_rows, free_port
from .test_client import fast_config
from .test_client_aio import ReplyEater

pytestmark = pytest.mark.integration

WAIT = 30.0


class LoopThread:
    """An event loop (``factory``'s) running in a thread of its own."""

    def __init__(self, factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop):
        self.loop = factory()
        self.thread = threading.Thread(target=self.loop.run_forever, name="contract-loop", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = WAIT) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Cancel what still runs on the loop, wait for it, then stop the loop."""
        async def cancel_the_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.call(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT)
        self.loop.close()


class Facade:
    """What the contract asks of a client."""

    def send(self, message: Message) -> Any: ...
    def resend(self, result: Any) -> Any: ...
    def receive(self, topic: str, channel: str, count: int) -> list[bytes]: ...
    def close(self) -> None: ...


class Threaded(Facade):
    def __init__(self, config: MqConfig):
        self.client = MqClient(config)
        self.closed = False

    def send(self, message: Message) -> Any:
        return self.client.send(message).result(WAIT)

    def resend(self, result: Any) -> Any:
        return self.client.resend(result).result(WAIT)

    def receive(self, topic: str, channel: str, count: int) -> list[bytes]:
        got: list[bytes] = []
        enough = threading.Event()

        def handler(message: Any) -> None:  # acked when it returns (auto_ack)
            got.append(message.body)
            if len(got) >= count:
                enough.set()

        self.client.subscribe(topic, channel, handler)
        assert enough.wait(WAIT), f"{len(got)} of {count} received"
        return got[:count]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.client.close(WAIT)


class Asyncio(Facade):
    def __init__(self, config: MqConfig, factory: Callable[[], asyncio.AbstractEventLoop]):
        self.loop = LoopThread(factory)
        self.client = Client(config)
        self.loop.call(self.client.start())

    def send(self, message: Message) -> Any:
        return self.loop.call(self.client.send(message))

    def resend(self, result: Any) -> Any:
        return self.loop.call(self.client.resend(result))

    def receive(self, topic: str, channel: str, count: int) -> list[bytes]:
        async def take() -> list[bytes]:
            got = []
            async for message in self.client.subscribe(topic, channel, credit=100):
                await message.ack()
                got.append(message.body)
                if len(got) == count:
                    break
            return got

        return self.loop.call(take())

    def close(self) -> None:
        if self.loop.loop.is_closed():
            return
        try:
            self.loop.call(self.client.close())
        finally:
            self.loop.stop()


CLIENTS: dict[str, Callable[[MqConfig], Facade]] = {
    "MqClient": Threaded,
    "aio": lambda config: Asyncio(config, asyncio.new_event_loop),
    "aio-uvloop": lambda config: Asyncio(config, uvloop.new_event_loop),
}


@pytest.fixture(params=list(CLIENTS))
def connect(request):
    """``connect(config)``: the client under test, closed after the test."""
    made: list[Facade] = []

    def make(config: MqConfig) -> Facade:
        made.append(CLIENTS[request.param](config))
        return made[-1]

    yield make
    for client in made:
        client.close()


def test_sent_messages_are_received_once_each_and_acknowledged(make_server, topic, pg_dsn, connect):
    server = make_server()
    client = connect(fast_config(server))
    results = [client.send(Message(topic, b"m%d" % i)) for i in range(20)]
    assert all(r.ok for r in results) and len({r.message_id for r in results}) == 20
    got = client.receive(topic, "billing", 20)
    assert sorted(got) == sorted(b"m%d" % i for i in range(20))
    # each acknowledged: nothing waits for billing (acks are batched: polled with a deadline)
    from .support import wait_for

    wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending WHERE channel = 'billing'") == [(0,)],
             timeout=WAIT)


def test_a_send_whose_answer_is_lost_is_stored_once(make_server, topic, pg_dsn, connect):
    """The server stores the message, its answer is lost with the connection: the client
    sends it again under the same session id and gets the first message id back."""
    server = make_server()
    proxy_loop = LoopThread()
    proxy = ReplyEater(server.tcp_port)
    proxy_loop.call(proxy.start())
    try:
        client = connect(MqConfig(servers=(f"127.0.0.1:{proxy.listen_port}",), resend_interval=0.5,
                                  resend_check_interval=0.05, reconnect_backoff=0.05))
        result = client.send(Message(topic, b"once"))
        client.close()  # its connection through the proxy ends: the proxy's own ends with it
    finally:
        proxy_loop.call(proxy.close())
        proxy_loop.stop()
    assert result.ok and result.duplicate, result
    (eaten,) = proxy.eaten
    assert (eaten.session_id, eaten.message_id) == (result.session_id, result.message_id)
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message WHERE session_id = %s", result.session_id) == [(1,)]


def test_a_resend_of_a_stored_message_is_answered_with_its_id(make_server, topic, pg_dsn, connect):
    """``resend(result)``, the safe retry of any status: a stored message is answered as a
    duplicate with its first id and stored once; a plain second send of that session id
    is refused, naming the resend."""
    server = make_server()
    client = connect(fast_config(server))
    first = client.send(Message(topic, b"x", session_id=12345))
    again = client.resend(first)
    assert first.ok and again.ok and again.duplicate and again.message_id == first.message_id
    plain = client.send(Message(topic, b"x", session_id=12345))
    assert plain.status is Status.INVALID_MESSAGE and "UP_PRODUCER_RESEND" in plain.description
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message WHERE session_id = 12345") == [(1,)]


@pytest.mark.parametrize("how", ["kill -9", "SERVER_REBOOT"])
def test_sends_fail_over_when_a_server_goes(make_server, topic, pg_dsn, connect, how):
    """Two servers on one store: the topic's server is killed -9, or stops gracefully
    (announcing SERVER_REBOOT); every later send succeeds on the other, each stored once."""
    a, b = make_server(), make_server()
    client = connect(fast_config(a, b))
    client.send(Message(topic, b"warm"))  # both connected, the topic's server known
    home = client.send(Message(topic, b"first"))
    assert home.ok
    gone, other = (a, b) if home.server.endswith(f":{a.tcp_port}") else (b, a)
    if how == "kill -9":
        gone.kill()
    else:
        gone.terminate()
    results = [client.send(Message(topic, b"after %d" % i)) for i in range(30)]
    assert Counter(r.status for r in results) == {Status.SUCCESS: 30}
    assert {r.server for r in results} == {f"127.0.0.1:{other.tcp_port}"}
    assert db_rows(pg_dsn, "SELECT count(*), count(DISTINCT (producer, session_id)) FROM dmq_message") == [(32, 32)]


def test_tls_with_an_auth_secret_and_a_wrong_one(make_server, certs, topic, tmp_path, connect):
    auth = tmp_path / "auth.json"
    everything = {"identity": "orders-app", "ttl": 3600,
                  "authorizations": [{"topic": ".*", "channels": [".*"], "permissions": ["publish", "subscribe"]}]}
    auth.write_text(json.dumps({"secrets": {"s3cret": everything}, "common_names": {}}))
    tls_port = free_port()
    make_server(tls_address=f"127.0.0.1:{tls_port}", auth_file=str(auth), **certs.server_flags())
    base = dict(servers=(f"127.0.0.1:{tls_port}",), tls=True, tls_ca_file=str(certs.ca_file), route_wait=2.0)
    client = connect(MqConfig(auth_secret="s3cret", **base))
    assert client.send(Message(topic, b"secured")).ok
    assert client.receive(topic, "billing", 1) == [b"secured"]
    refused = connect(MqConfig(auth_secret="wrong", **base)).send(Message(topic, b"refused"))
    assert refused.status is Status.SOCKET_ERROR


def test_a_journal_left_by_a_crashed_producer_is_sent_once_and_emptied(make_server, topic, pg_dsn, connect,
                                                                      tmp_path):
    """The producer journal is one format for every client: records a crashed producer left
    (written and abandoned as ``kill -9`` leaves them) are sent first, under that producer's
    id and session ids, reported to ``recovered_callback``, and stored once; the client's own
    send goes through the journal too, and a clean close leaves nothing to replay."""
    journal = tmp_path / "journal"
    crashed = JournalSendQueue(journal, ticker=False, producer_id="crashed-1")
    for i in range(5):
        crashed.put(PendingSend(Message(topic, b"left %d" % i), 7000 + i, "crashed-1", 1_700_000_000_000))
    crashed.abandon()
    recovered: list[Any] = []
    server = make_server()
    client = connect(fast_config(server, journal_path=str(journal), recovered_callback=recovered.append))
    new = client.send(Message(topic, b"new"))
    client.close()
    assert new.ok and new.producer != "crashed-1"
    assert sorted((r.session_id, r.status, r.producer) for r in recovered) == [
        (7000 + i, Status.SUCCESS, "crashed-1") for i in range(5)]
    stored = db_rows(pg_dsn, "SELECT producer, session_id FROM dmq_message")
    assert Counter(stored) == Counter([("crashed-1", 7000 + i) for i in range(5)] + [(new.producer, new.session_id)])
    with JournalSendQueue(journal, ticker=False) as reopened:
        assert reopened.recovered == 0
