"""The producer journal against a real dmq-server: ``kill -9`` of a producer process loses nothing.

The producer runs as a separate process (``PRODUCER`` below, written to the test's
directory) with ``MqConfig.journal_path`` set. It accepts N sends while the server
is stopped or frozen, says so on stdout, and is killed with SIGKILL: no shutdown
code runs. A second producer process opens the same journal, replays the N
messages, and a real consumer must receive each of them exactly once, with the
database holding each once. Every wait is on a line from the child, a future, an
event or a database condition, with a deadline; never a sleep. ``AIO_PRODUCER`` is the
same for the asyncio client (``dmq_client.aio.Client``), which shares the journal.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from dmq_client import Message, MqClient, MqConfig, SendResult, Status
from dmq_client.journal import JournalSendQueue
from dmq_client.pending import PendingSend

from .support import REPO, db_rows, wait_for

pytestmark = pytest.mark.integration

WAIT = 60.0
COUNT = 200

PRODUCER = r'''
"""A producer process for tests/integration/test_client_journal.py.

send MODE N [ROUTE_WAIT]:
              open the client with the journal, print READY, wait for "go" on stdin,
              send N messages, print ACCEPTED with the session ids once every send()
              returned (with MODE=frozen: once all N are written and unanswered; with
              MODE=outage: once every message went unrouted for ROUTE_WAIT at least once,
              which used to be a SOCKET_ERROR), then wait for stdin to close (the test
              kills it first).
recover [ROUTE_WAIT [N]]:
              open the client on the same journal; the recovered messages are sent again
              and their results reach recovered_callback. With N: first print WAITING once
              N replays went unrouted for ROUTE_WAIT at least once, and wait for "go".
              Then flush, print RESULTS, close.
"""
import json
import sys
import threading
import time

from dmq_client import Message, MqClient, MqConfig

servers, journal, action = sys.argv[1], sys.argv[2], sys.argv[3]
route_wait = float(sys.argv[6] if action == "send" and len(sys.argv) > 6 else
                   sys.argv[4] if action == "recover" and len(sys.argv) > 4 else 600.0)
settings = dict(servers=servers, journal_path=journal, route_wait=route_wait, resend_interval=600.0,
                connect_timeout=5.0, reconnect_backoff=0.05, reconnect_backoff_max=0.2, close_timeout=10.0)
if "journal_retry_backoff" in MqConfig.__dataclass_fields__:  # (absent before issue 13: run against old code)
    settings.update(journal_retry_backoff=0.05, journal_retry_backoff_max=0.2)


def wait_until(predicate, what):
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline, (what, client.stats())
        threading.Event().wait(0.01)

if action == "send":
    mode, count = sys.argv[4], int(sys.argv[5])
    client = MqClient(MqConfig(**settings))
    print("READY", client.producer_id, flush=True)
    assert sys.stdin.readline().strip() == "go"
    futures = [client.send(Message("orders", f"order {i}")) for i in range(count)]
    if mode == "frozen":  # written to the frozen server's socket, none answered
        wait_until(lambda: client.stats()["in_flight"] == count, "all written")
    if mode == "outage":  # route_wait passed with no server, for every message (or all reported)
        wait_until(lambda: client.stats().get("retried", 0) >= count or client.stats()["outstanding"] == 0,
                   "route_wait over")
    assert not any(f.done() for f in futures), [f.result().status.value for f in futures if f.done()][:3]
    stats = client.stats()
    print("ACCEPTED", json.dumps({"producer": client.producer_id, "stats": stats}), flush=True)
    sys.stdin.read()
else:
    results = []
    lock = threading.Lock()

    def recovered(result):
        with lock:
            results.append(result)

    client = MqClient(MqConfig(**settings, recovered_callback=recovered))
    if len(sys.argv) > 5:  # the server stays down: every replay goes unrouted for route_wait
        wait_until(lambda: client.stats().get("retried", 0) >= int(sys.argv[5]) or client.stats()["outstanding"] == 0,
                   "route_wait over")
        print("WAITING", json.dumps(client.stats()), flush=True)
        assert sys.stdin.readline().strip() == "go"
    assert client.flush(120), client.stats()  # flush waits for the recovered messages too
    client.close()
    print("RESULTS", json.dumps({
        "producer": client.producer_id,
        "results": [[r.status.value, r.session_id, r.message.body.decode(), r.duplicate, r.message_id,
                     getattr(r, "producer", "")] for r in results],
    }), flush=True)
'''


class Child:
    """A producer subprocess whose stdout lines are read by a thread, so that waiting for
    a line has a deadline."""

    def __init__(self, script: Path, log: Path, *args: str):
        self.log = log
        with open(log, "ab") as stderr:  # the child holds its own copy
            self.proc = subprocess.Popen(
                [sys.executable, str(script), *args], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=stderr, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, word: str, timeout: float = WAIT) -> str:
        """The rest of the next line starting with ``word``."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {word} line within {timeout}s:\n{self.log.read_text()[-3000:]}") from None
        if line is None or not line.startswith(word):
            raise AssertionError(f"expected {word}, got {line!r}:\n{self.log.read_text()[-3000:]}")
        return line[len(word):].strip()

    def tell(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        assert self.proc.returncode == -signal.SIGKILL

    def finish(self, timeout: float = WAIT * 2) -> int:
        self.proc.stdin.close()  # type: ignore[union-attr]
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Kill the child if it still runs, and close the pipes to it once the reader
        thread has seen the end of its output."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.reader.join(10)
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.stdout.close()  # type: ignore[union-attr]


class Inbox:
    """A consumer handler counting every call per (producer, session id) and body."""

    def __init__(self, expected: int):
        self.expected = expected
        self.calls: Counter = Counter()
        self.bodies: Counter = Counter()
        self.lock = threading.Lock()
        self.done = threading.Event()

    def on_message(self, message) -> None:
        with self.lock:
            self.calls[(message.producer, message.session_id)] += 1
            self.bodies[message.body.decode()] += 1
            if len(self.calls) >= self.expected:
                self.done.set()


@pytest.fixture
def producer_script(tmp_path) -> Path:
    script = tmp_path / "journal_producer.py"
    script.write_text(PRODUCER)
    return script


@pytest.fixture
def children():
    made: list[Child] = []
    yield made
    for child in made:
        child.stop()


def client_config(server, **overrides) -> MqConfig:
    settings = dict(
        servers=(f"127.0.0.1:{server.tcp_port}",), resend_interval=0.5, resend_tries=20,
        resend_check_interval=0.05, route_wait=10.0, reconnect_backoff=0.05, reconnect_backoff_max=0.3,
    )
    settings.update(overrides)
    return MqConfig(**settings)


def crash_and_recover(server, producer_script, tmp_path, children, pg_dsn, *, frozen: bool) -> None:
    """The scenario both kill -9 tests share; ``frozen`` picks how the server is unavailable."""
    journal = tmp_path / "journal"
    servers = f"127.0.0.1:{server.tcp_port}"
    first = Child(producer_script, tmp_path / "producer-1.log", servers, str(journal), "send",
                  "frozen" if frozen else "stopped", str(COUNT))
    children.append(first)
    producer_id = first.expect("READY")
    if frozen:
        server.proc.send_signal(signal.SIGSTOP)
    first.tell("go")
    accepted = json.loads(first.expect("ACCEPTED"))
    assert accepted["producer"] == producer_id
    assert accepted["stats"]["outstanding"] == COUNT
    first.kill9()  # with N messages accepted and none answered

    if frozen:
        server.proc.send_signal(signal.SIGCONT)
    else:
        server.start()
    inbox = Inbox(COUNT)
    with MqClient(client_config(server)) as consumer:
        subscription = consumer.subscribe("orders", "billing", inbox)
        second = Child(producer_script, tmp_path / "producer-2.log", servers, str(journal), "recover")
        children.append(second)
        report = json.loads(second.expect("RESULTS", timeout=WAIT * 2))
        assert second.finish() == 0
        assert inbox.done.wait(WAIT), f"{len(inbox.calls)}/{COUNT} messages arrived"
        # every delivery acked: no copy of any message can still come
        wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)], timeout=WAIT)
        assert subscription.suppressed == 0  # the server pushed no duplicate either

    assert report["producer"] != producer_id  # a new instance, a new id for its own sends
    results = report["results"]
    assert Counter(status for status, *_ in results) == {Status.SUCCESS.value: COUNT}
    assert {producer for *_, producer in results} == {producer_id}  # replayed under the first identity
    assert sorted(body for _, _, body, *_ in results) == sorted(f"order {i}" for i in range(COUNT))
    assert inbox.bodies == Counter({f"order {i}": 1 for i in range(COUNT)})
    assert set(inbox.calls) == {(producer_id, sid) for _, sid, *_ in results}
    assert max(inbox.calls.values()) == 1
    stored = db_rows(pg_dsn, "SELECT producer, count(*), count(DISTINCT session_id) FROM dmq_message GROUP BY 1")
    assert stored == [(producer_id, COUNT, COUNT)]
    ids = dict(db_rows(pg_dsn, "SELECT session_id, id FROM dmq_message"))
    assert {sid: message_id for _, sid, _, _, message_id, _ in results} == ids  # duplicates name the stored row
    with JournalSendQueue(journal, ticker=False) as reopened:  # everything finished: nothing left
        assert reopened.recovered == 0


def test_kill_9_with_the_server_stopped_delivers_every_accepted_message_once(
    make_server, topic, pg_dsn, producer_script, tmp_path, children
):
    """Producer journal: the server is down, a producer process accepts N sends (each
    fsynced before send() returned) and is killed with SIGKILL. The server starts, a new
    producer process opens the same journal, sends them again under the same producer id,
    and the consumer receives each of the N messages exactly once."""
    server = make_server(start=False)
    crash_and_recover(server, producer_script, tmp_path, children, pg_dsn, frozen=False)


def test_kill_9_with_sends_written_to_a_frozen_server_delivers_each_once(
    make_server, topic, pg_dsn, producer_script, tmp_path, children
):
    """Producer journal: the server is frozen (SIGSTOP), so the N sends are written to its
    socket and unanswered when the producer is killed with SIGKILL; the server may still
    store what it had read. The new producer's replays are resends of the same
    (producer, session id) pairs, so whatever the old process got stored is answered as a
    duplicate (on Linux the server reads what was in its socket buffer, so in practice
    every replay is a duplicate): each message is stored and delivered exactly once."""
    server = make_server()
    crash_and_recover(server, producer_script, tmp_path, children, pg_dsn, frozen=True)


def test_kill_9_while_the_server_stays_down_past_route_wait_loses_nothing(
    make_server, topic, pg_dsn, producer_script, tmp_path, children
):
    """Issue 13, item 5: the server is down for much longer than ``route_wait`` (0.2 s).
    A producer with the journal accepts N sends; every one goes unrouted for route_wait
    (before the fix: SOCKET_ERROR, and the journal dropped it); it is killed with SIGKILL.
    A second producer opens the journal while the server is still down, and its replays
    go unrouted for route_wait too (before the fix: dropped with a warning). Then the
    server starts: every message send() accepted is stored exactly once, under the
    producer id and session id it was first sent with, and answered SUCCESS."""
    server = make_server(start=False)
    journal = tmp_path / "journal"
    servers = f"127.0.0.1:{server.tcp_port}"
    first = Child(producer_script, tmp_path / "producer-1.log", servers, str(journal), "send", "outage",
                  str(COUNT), "0.2")
    children.append(first)
    producer_id = first.expect("READY")
    first.tell("go")
    accepted = json.loads(first.expect("ACCEPTED"))
    assert accepted["stats"]["outstanding"] == COUNT  # accepted, none reported
    assert accepted["stats"]["retried"] >= COUNT
    first.kill9()

    second = Child(producer_script, tmp_path / "producer-2.log", servers, str(journal), "recover", "0.2",
                   str(COUNT))
    children.append(second)
    waiting = json.loads(second.expect("WAITING"))
    assert waiting["outstanding"] == COUNT and waiting["retried"] >= COUNT
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message") == [(0,)]
    server.start()
    second.tell("go")
    report = json.loads(second.expect("RESULTS", timeout=WAIT * 2))
    assert second.finish() == 0

    results = report["results"]
    assert Counter(status for status, *_ in results) == {Status.SUCCESS.value: COUNT}
    assert {producer for *_, producer in results} == {producer_id}
    stored = db_rows(pg_dsn, "SELECT producer, session_id, body, id FROM dmq_message")
    assert Counter((p, sid) for p, sid, _, _ in stored) == Counter({(producer_id, sid): 1 for _, sid, *_ in results})
    assert sorted(bytes(body).decode() for _, _, body, _ in stored) == sorted(f"order {i}" for i in range(COUNT))
    assert {sid: mid for _, sid, _, _, mid, _ in results} == {sid: mid for _, sid, _, mid in stored}
    with JournalSendQueue(journal, ticker=False) as reopened:
        assert reopened.recovered == 0


def test_a_message_journaled_with_its_resend_copy_at_a_crash_is_stored_once_and_answered_success(
    make_server, topic, pg_dsn, tmp_path
):
    """Issue 13, item 5: after a kill a message can be in the journal twice, the original
    and its own resend copy (``client.resend``), both unfinished because their finished
    marks were not synced. Half of them were even stored before the crash. The next
    client must send each message once and answer it SUCCESS (the stored half as
    duplicates with the stored message id), not INVALID_MESSAGE "already awaiting a
    reply" for the copies; PostgreSQL holds each (producer, session id) once."""
    count, producer, ts = 100, "orders-api-1", 1_700_000_000_000
    journal = tmp_path / "journal"
    server = make_server()
    with MqClient(client_config(server, producer_id=producer)) as before:  # stored before the crash
        assert all(before.send(Message("orders", f"order {i}", session_id=5000 + i)).result(WAIT).ok
                   for i in range(0, count, 2))
    q = JournalSendQueue(journal, ticker=False, producer_id=producer)
    for resend in (False, True):
        for i in range(count):
            q.put(PendingSend(Message("orders", f"order {i}"), 5000 + i, producer, ts + i, resend=resend))
    q.abandon()  # as a kill -9 leaves it

    replayed: list[SendResult] = []
    with MqClient(client_config(server, journal_path=str(journal), recovered_callback=replayed.append)) as client:
        assert client.flush(WAIT)
    assert Counter(r.status for r in replayed) == {Status.SUCCESS: count}
    assert sorted(r.session_id for r in replayed) == [5000 + i for i in range(count)]
    assert sorted(r.session_id for r in replayed if r.duplicate) == [5000 + i for i in range(0, count, 2)]
    stored = db_rows(pg_dsn, "SELECT producer, session_id, body, id FROM dmq_message")
    assert Counter((p, sid) for p, sid, _, _ in stored) == Counter({(producer, 5000 + i): 1 for i in range(count)})
    assert {sid: bytes(body).decode() for _, sid, body, _ in stored} == {5000 + i: f"order {i}" for i in range(count)}
    assert {r.session_id: r.message_id for r in replayed} == {sid: mid for _, sid, _, mid in stored}


def test_clean_close_with_the_journal_leaves_nothing_to_replay(make_server, topic, pg_dsn, tmp_path):
    """Every send answered, then close(): the journal is empty, so a new client on it sends
    nothing, its recovered_callback is never called, and the server stores each message once."""
    server = make_server()
    journal = tmp_path / "journal"
    with MqClient(client_config(server, journal_path=str(journal))) as client:
        futures = [client.send(Message("orders", f"clean {i}")) for i in range(50)]
        assert all(f.result(WAIT).ok for f in futures)
        producer_id = client.producer_id
    replayed: list[SendResult] = []
    with MqClient(client_config(server, journal_path=str(journal), recovered_callback=replayed.append)) as client:
        assert client.producer_id != producer_id
        assert client.stats()["outstanding"] == 0
        assert client.flush(WAIT)
    assert replayed == []
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message") == [(50,)]
    with JournalSendQueue(journal, ticker=False) as reopened:
        assert reopened.recovered == 0


def test_close_while_the_server_is_down_keeps_the_messages_for_the_next_client(
    make_server, topic, pg_dsn, tmp_path
):
    """A clean close that cannot get answers (server stopped) reports CLIENT_CLOSED with
    "kept in the producer journal"; the next client, with the server back, sends them and
    reports SUCCESS to recovered_callback."""
    server = make_server(start=False)
    journal = tmp_path / "journal"
    with MqClient(client_config(server, journal_path=str(journal), route_wait=600)) as client:
        futures = [client.send(Message("orders", f"kept {i}")) for i in range(5)]
        client.close(timeout=0.2)
    closed = [f.result(WAIT) for f in futures]
    assert all(r.status is Status.CLIENT_CLOSED and "kept in the producer journal" in r.description
               for r in closed)
    server.start()
    replayed: list[SendResult] = []
    all_in = threading.Event()

    def recovered(result: SendResult) -> None:
        replayed.append(result)
        if len(replayed) == 5:
            all_in.set()

    with MqClient(client_config(server, journal_path=str(journal), recovered_callback=recovered)) as client:
        assert all_in.wait(WAIT)
    assert sorted((r.session_id, r.status) for r in replayed) == sorted((r.session_id, Status.SUCCESS) for r in closed)
    assert db_rows(pg_dsn, "SELECT body FROM dmq_message ORDER BY body") == [(f"kept {i}".encode(),) for i in range(5)]


AIO_PRODUCER = r'''
"""An asyncio producer process (dmq_client.aio.Client with journal_path) for
tests/integration/test_client_journal.py.

send ACKED N:  start the client, print READY; on "go" send ACKED messages one by one and
               print ACKED with their (session id, message id); on the next "go" (the server
               is frozen now) start N concurrent sends and print ACCEPTED with their session
               ids once every one is written and unanswered; then wait (the test kills it).
recover:       start the client on the same journal: the recovered sends go out again and
               their results reach recovered_callback; flush, close, print RESULTS.
"""
import asyncio
import json
import sys
import time

from dmq_client import Message
from dmq_client.aio import Client

servers, journal, action = sys.argv[1], sys.argv[2], sys.argv[3]
settings = dict(servers=servers, journal_path=journal, resend_interval=600.0, connect_timeout=5.0,
                reconnect_backoff=0.05, reconnect_backoff_max=0.2, close_timeout=10.0,
                journal_retry_backoff=0.05, journal_retry_backoff_max=0.2)


async def line() -> str:
    return (await asyncio.to_thread(sys.stdin.readline)).strip()


async def send(acked: int, count: int) -> None:
    client = Client(**settings)
    await client.start()
    assert await client.wait_connected(30)
    print("READY", client.producer_id, flush=True)
    assert await line() == "go"
    answered = [await client.send(Message("orders", f"acked {i}")) for i in range(acked)]
    assert all(r.ok for r in answered), [r.status for r in answered]
    print("ACKED", json.dumps([[r.session_id, r.message_id] for r in answered]), flush=True)
    assert await line() == "go"
    tasks = [asyncio.ensure_future(client.send(Message("orders", f"order {i}"))) for i in range(count)]
    deadline = time.monotonic() + 60
    while not (len(client.sends.pending) == count and all(i.attempts for i in client.sends.pending.values())):
        assert time.monotonic() < deadline, len(client.sends.pending)
        await asyncio.sleep(0.01)
    assert not any(t.done() for t in tasks)
    print("ACCEPTED", json.dumps(sorted(sid for _, sid in client.sends.pending)), flush=True)
    await asyncio.to_thread(sys.stdin.read)


async def recover() -> None:
    results = []
    async with Client(**settings, recovered_callback=results.append) as client:
        assert await client.flush(120)
    print("RESULTS", json.dumps({
        "producer": client.producer_id,
        "results": [[r.status.value, r.session_id, r.message.body.decode(), r.duplicate, r.message_id, r.producer]
                    for r in results],
    }), flush=True)


asyncio.run(send(int(sys.argv[4]), int(sys.argv[5])) if action == "send" else recover())
'''


def test_kill_9_of_an_asyncio_producer_with_unanswered_journaled_sends_loses_nothing_and_stores_each_once(
    make_server, topic, pg_dsn, tmp_path, children
):
    """The asyncio client with ``journal_path``, in a process of its own: some sends are
    answered, then the server is frozen and N more are written and left unanswered, and the
    process is killed with SIGKILL. Once the server runs again a second asyncio producer
    opens the journal and sends what was unanswered again, under the first producer id and
    session ids: every unanswered send comes back SUCCESS (a duplicate where the frozen server
    had read it), an answered one only if its finish was not synced yet (then a duplicate
    of the id it was answered with), and PostgreSQL holds every message once."""
    from .test_client_aio import freeze

    acked_count = 20
    script = tmp_path / "aio_journal_producer.py"
    script.write_text(AIO_PRODUCER)
    journal = tmp_path / "journal"
    server = make_server()
    servers = f"127.0.0.1:{server.tcp_port}"
    first = Child(script, tmp_path / "producer-1.log", servers, str(journal), "send", str(acked_count), str(COUNT))
    children.append(first)
    producer_id = first.expect("READY")
    first.tell("go")
    acked = dict(json.loads(first.expect("ACKED")))
    freeze(server)
    first.tell("go")
    unanswered = set(json.loads(first.expect("ACCEPTED")))
    assert len(unanswered) == COUNT and not unanswered & set(acked)
    first.kill9()

    server.proc.send_signal(signal.SIGCONT)
    second = Child(script, tmp_path / "producer-2.log", servers, str(journal), "recover")
    children.append(second)
    report = json.loads(second.expect("RESULTS", timeout=WAIT * 2))
    assert second.finish() == 0

    results = {sid: (status, body, duplicate, message_id, producer)
               for status, sid, body, duplicate, message_id, producer in report["results"]}
    assert len(results) == len(report["results"])  # one result each
    assert report["producer"] != producer_id
    assert unanswered <= set(results) <= unanswered | set(acked)
    assert {status for status, *_ in results.values()} == {Status.SUCCESS.value}
    assert {producer for *_, producer in results.values()} == {producer_id}
    for sid in set(results) & set(acked):  # replayed: answered as the stored copy
        assert results[sid][2:4] == (True, acked[sid])
    stored = db_rows(pg_dsn, "SELECT producer, session_id, body, id FROM dmq_message")
    assert Counter((p, sid) for p, sid, _, _ in stored) == Counter(
        {(producer_id, sid): 1 for sid in unanswered | set(acked)})
    ids = {sid: message_id for _, sid, _, message_id in stored}
    assert {sid: ids[sid] for sid in acked} == acked
    assert {sid: r[3] for sid, r in results.items()} == {sid: ids[sid] for sid in results}
    assert sorted(bytes(body).decode() for *_, body, _ in stored) == sorted(
        [f"acked {i}" for i in range(acked_count)] + [f"order {i}" for i in range(COUNT)])
    with JournalSendQueue(journal, ticker=False) as reopened:
        assert reopened.recovered == 0
