"""The memory a server holds for its clients, bounded in bytes (``--max-client-memory``).

On a real dmq-server process over real sockets and PostgreSQL, with the default budget:

* 300 pipelined 1 MB dmq-protocol sends whose replies are not read, 300 NSQ PUBs of
  1 MB on another connection (to a fast topic whose channel has a consumer that is not
  ready), and 150 connections each holding all but the last byte of a 1 MB frame;
* once the server has taken in what it will take of the floods (every flood frame read,
  every send committed, every holder's bytes held: observed on ``/metrics`` and ``/admin/flow``, not guessed
  from a quiet period, since how long 600 MB take to reach PostgreSQL and the disk queue
  depends on the machine; the holders' past the port's ``--max-buffered-bytes`` are not
  read), a small producer and a consumer on other topics (one of each
  store) are answered within a few seconds while the floods are still held, and so is a
  small send whose frame arrives in two reads while the port is over its budget (it once
  waited for as long as the holders held their frames);
* the server's peak RSS (VmHWM) stays at most 400 MB;
* the floods then read their replies: every send answered SEND_SUCCESS_ACK is in
  PostgreSQL, every PUB answered OK is delivered, and both reach a consumer (counted);
* after the clients close, RSS is back under 150 MB within 60 s (polled).

With a budget the floods pass (``test_over_the_budget_...``), the connections holding
the most are not read, the log says so once per episode, ``/metrics`` counts the pauses,
and small clients are still served.

The figures are printed (``pytest -s``) so the same test run against an older tree
measures it (docs/operations.md, "Memory").
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from dmq_client.wire import MAGIC, Command, Frame, FrameDecoder, encode
from dmq_server.core.nsq_wire import FRAME_MESSAGE, FRAME_RESPONSE, FrameReader, decode_message, encode_command

from .support import NsqSocket, db_rows, http_get, http_post, scrape_metrics, wait_for

pytestmark = pytest.mark.integration

BODY = 1_000_000
FLOOD = 300
HOLDERS = 150
MB = 1024 * 1024


def memory_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of the process, in kB."""
    rss = hwm = 0
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
    except OSError:  # the process is gone
        pass
    return rss, hwm


def body(tag: bytes, i: int) -> bytes:
    head = b"%s-%06d-" % (tag, i)
    return head + b"x" * (BODY - len(head))


class Writer:
    """Writes every chunk on a thread, blocking while the server does not read."""

    def __init__(self, sock: socket.socket, chunks):
        self.sent = 0
        self.last = time.monotonic()
        self._sock, self._chunks = sock, chunks
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for chunk in self._chunks:
                self._sock.sendall(chunk)
                self.sent += 1
                self.last = time.monotonic()
        except OSError:
            pass

    def settled(self, quiet: float = 2.0) -> bool:
        """Done, or blocked for ``quiet`` seconds (the server stopped reading)."""
        return not self.thread.is_alive() or time.monotonic() - self.last > quiet


def register(dsn: str, topic: str, channel: str) -> None:
    import registry
    from dmq_server.db.worker import connect

    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, topic, msg_timeout_ms=60000)
        registry.add_channel(conn, topic, channel)


def dmq_replies(sock: socket.socket, count: int, timeout: float = 120.0) -> dict[int, Frame]:
    """Reads until ``count`` send replies arrived: session id -> reply."""
    decoder, answers = FrameDecoder(), {}
    deadline = time.monotonic() + timeout
    while len(answers) < count:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        data = sock.recv(1 << 20)
        assert data, f"closed after {len(answers)} replies"
        for frame in decoder.feed(data):
            if frame.command.name.startswith("SEND_"):
                answers[frame.session_id] = frame
    return answers


def nsq_responses(sock: socket.socket, count: int, timeout: float = 120.0) -> list[bytes]:
    """Reads until ``count`` responses or errors to PUBs arrived (heartbeats skipped)."""
    reader, answers = FrameReader(), []
    deadline = time.monotonic() + timeout
    while len(answers) < count:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        data = sock.recv(1 << 20)
        assert data, f"closed after {len(answers)} answers"
        for kind, payload in reader.feed(data):
            if kind == FRAME_RESPONSE and payload == b"_heartbeat_":
                sock.sendall(b"NOP\n")
            else:
                answers.append(payload)
    return answers


class RssPeak:
    """Samples the server's VmRSS every 50 ms on a thread (VmHWM is the kernel's peak)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, memory_kb(self.pid)[0])

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def test_floods_are_held_within_the_budget_and_their_memory_goes_back(make_server, pg_dsn, capsys):
    register(pg_dsn, "flood", "sink")
    register(pg_dsn, "other", "sink")
    server = make_server(read_timeout="5m", heartbeat_interval="5m")
    pid = server.proc.pid
    idle_kb = memory_kb(pid)[0]
    sampler = RssPeak(pid)
    figures: dict[str, float] = {"idle_mb": idle_kb / 1024}
    sockets: list[socket.socket] = []  # the floods' and holders', closed once their replies are read
    owned: list[socket.socket] = []  # the consumers' and small producers', closed at the end
    try:
        check_floods(server, pid, sampler, figures, sockets, owned)
    finally:
        for sock in sockets + owned:
            sock.close()
        with capsys.disabled():
            print("\nmemory budget figures: " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()))


def check_floods(server, pid: int, sampler: RssPeak, figures: dict, sockets: list, owned: list) -> None:
    pg_dsn = server.dsn
    idle_kb = figures["idle_mb"] * 1024

    def connect(magic: bytes) -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # replies stay on the server
        sock.connect(("127.0.0.1", server.tcp_port))
        sock.sendall(magic)
        sockets.append(sock)
        return sock

    def taken_in(writer: Writer) -> bool:
        """The writer wrote everything, and the server read it: no incomplete frame is
        held and no send waits for its commit."""
        if writer.thread.is_alive():
            return False
        metrics = scrape_metrics(server.http)
        return (metrics[("dmq_client_memory_bytes", (("kind", "frames"),))] == 0
                and metrics[("dmq_client_memory_bytes", (("kind", "pending"),))] == 0)

    def gates() -> dict[str, dict]:
        """The server's read gates (/admin/flow) by peer address."""
        flow = json.loads(http_get(server.http + "/admin/flow")[1])
        return {gate["peer"]: gate for gate in flow["gates"]}

    def gate_of(sock: socket.socket) -> dict:
        return gates().get("127.0.0.1:%d" % sock.getsockname()[1], {})

    def holders_taken_in(holders: list[socket.socket], size: int) -> bool:
        """Every holder's connection either holds its whole frame on the server or is not
        read by it (the port's or the server's budget stopped it): what it holds stays."""
        now = gates()
        for sock in holders:
            gate = now.get("127.0.0.1:%d" % sock.getsockname()[1])
            if gate is None or not (gate["paused"] or gate["incomplete_frame_bytes"] == size):
                return False
        return True

    try:
        # a fast channel whose consumer is not ready: the PUBs wait on the server
        nsq_consumer = NsqSocket(server.tcp_port)
        owned.append(nsq_consumer.sock)
        nsq_consumer.sub("nsqflood", "sink", rdy=0)
        # a fast consumer subscribed before the floods (a SUB names a topic the registry is
        # asked about, and the floods' commits keep PostgreSQL busy: not this test's subject)
        fast_consumer = NsqSocket(server.tcp_port)
        owned.append(fast_consumer.sock)
        fast_consumer.sub("small-fast", "sink", rdy=1)

        dmq_flood = connect(MAGIC)
        dmq_writer = Writer(dmq_flood, (
            encode(Frame(Command.UP_PRODUCER_SEND, session_id=i, topic="flood", producer="flood",
                         timestamp_ms=1, body=body(b"dmq", i)))
            for i in range(FLOOD)
        ))
        wait_for(lambda: taken_in(dmq_writer), 300, 0.2)
        figures["dmq_flood_mb"] = memory_kb(pid)[1] / 1024
        nsq_flood = connect(b"  V2")
        nsq_writer = Writer(nsq_flood, (encode_command(b"PUB", b"nsqflood", body=body(b"nsq", i)) for i in range(FLOOD)))
        wait_for(lambda: taken_in(nsq_writer), 300, 0.2)
        figures["nsq_flood_mb"] = memory_kb(pid)[1] / 1024
        holder_frame = encode(Frame(Command.UP_PRODUCER_SEND, session_id=1, topic="flood", producer="holder",
                                    timestamp_ms=1, body=body(b"held", 0)))[:-1]
        holders = [connect(MAGIC) for _ in range(HOLDERS)]
        holder_writers = [Writer(sock, (holder_frame,)) for sock in holders]
        wait_for(lambda: holders_taken_in(holders, len(holder_frame)), 300, 0.2)
        figures["holders_mb"] = memory_kb(pid)[1] / 1024

        started = time.monotonic()
        # a small send split across two reads: the server holds its first half while the
        # port is over its --max-buffered-bytes, and must go on reading it
        split = connect(MAGIC)
        small = encode(Frame(Command.UP_PRODUCER_SEND, session_id=7, topic="other", producer="split",
                             timestamp_ms=1, body=b"split in two"))
        split.sendall(small[:20])
        wait_for(lambda: gate_of(split)["incomplete_frame_bytes"] == 20, 30, 0.1)
        split.sendall(small[20:])
        split.settimeout(10)
        decoder, replies = FrameDecoder(), []
        while not replies:  # (after the server's greeting)
            data = split.recv(4096)
            assert data, "the split send's connection closed"
            replies = [f for f in decoder.feed(data) if f.command.name.startswith("SEND_")]
        assert (replies[0].command, replies[0].session_id) == (Command.SEND_SUCCESS_ACK, 7), replies
        with server.client() as producer, server.client() as consumer:
            replies = producer.send_many("other", [b"small-%d" % i for i in range(20)])
            assert [r.command for r in replies] == [Command.SEND_SUCCESS_ACK] * 20
            consumer.subscribe("other", "sink", credit=100)
            got = []
            while len(got) < 20:
                push = consumer.receive(timeout=10)
                assert push is not None, f"the consumer got {len(got)} of 20"
                consumer.ack(push)
                got.append(push.body)
        fast_producer = NsqSocket(server.tcp_port)
        owned.append(fast_producer.sock)
        for i in range(20):
            assert fast_producer.pub("small-fast", b"hello-%d" % i) == b"OK"
            _, _, message_id, received = fast_consumer.message()
            assert received == b"hello-%d" % i
            fast_consumer.send(b"FIN " + message_id + b"\n")
        fast_producer.close()
        fast_consumer.close()
        figures["other_clients_s"] = time.monotonic() - started
        assert figures["other_clients_s"] < 15, figures

        metrics = scrape_metrics(server.http)
        figures["held_mb"] = sum(v for (name, _), v in metrics.items() if name == "dmq_client_memory_bytes") / MB
        figures["pauses"] = sum(v for (name, _), v in metrics.items() if name == "dmq_client_memory_pauses_total")
        figures["flood_peak_mb"] = memory_kb(pid)[1] / 1024

        # the floods read their replies: every answer counted
        answers = dmq_replies(dmq_flood, FLOOD)
        acked = {s: f.message_id for s, f in answers.items() if f.command == Command.SEND_SUCCESS_ACK}
        oks = nsq_responses(nsq_flood, FLOOD)
        dmq_writer.thread.join(60)
        nsq_writer.thread.join(60)
        figures["acked"], figures["nsq_ok"] = len(acked), oks.count(b"OK")
    finally:
        for sock in sockets:
            sock.close()
    closed_at = time.monotonic()
    figures["peak_mb"] = max(sampler.stop(), memory_kb(pid)[1]) / 1024

    def back() -> bool:
        return memory_kb(pid)[0] < 150 * 1024

    try:
        wait_for(back, 60, 0.5)
        figures["back_s"] = time.monotonic() - closed_at
    except AssertionError:
        figures["back_s"] = -1
    figures["after_mb"] = memory_kb(pid)[0] / 1024
    figures["flow"] = str(json.loads(http_get(server.http + "/admin/flow")[1])["client_memory"])

    # every acknowledged send is stored, and a consumer gets each once
    stored = dict(db_rows(pg_dsn, "SELECT session_id, id FROM dmq_message WHERE producer = 'flood'"))
    figures["stored"] = len(stored)
    with server.client() as consumer:
        consumer.subscribe("flood", "sink", credit=10)
        delivered = set()
        while len(delivered) < len(acked):
            push = consumer.receive(timeout=30)
            assert push is not None, f"{len(delivered)} of {len(acked)} delivered"
            consumer.ack(push)
            delivered.add(push.message_id)
    nsq_consumer.send(b"RDY 10\n")
    bodies = set()
    while len(bodies) < figures["nsq_ok"]:
        kind, data = nsq_consumer.frame(timeout=30)
        assert kind == FRAME_MESSAGE, data
        _, _, message_id, received = decode_message(data)
        nsq_consumer.send(b"FIN " + message_id + b"\n")
        bodies.add(received[:11])
    nsq_consumer.close()
    figures["final_peak_mb"] = memory_kb(pid)[1] / 1024

    assert len(acked) == FLOOD and figures["nsq_ok"] == FLOOD, figures
    assert stored == acked
    assert delivered == set(acked.values())
    assert figures["final_peak_mb"] <= 400, figures
    assert 0 <= figures["back_s"] <= 60, figures


def test_over_the_budget_the_largest_holders_wait_and_small_clients_are_served(make_server, pg_dsn):
    """--max-client-memory 32 MiB and 40 connections each sending all but the last byte
    of a 1 MB frame: they pass the budget and are stopped (each holds more than a 256th
    of it), once logged; a producer and a consumer of small messages are answered; when
    the holders close, the held bytes go back to nothing and the end is logged once."""
    register(pg_dsn, "other", "sink")
    budget = 32 * MB
    server = make_server(max_client_memory=str(budget), read_timeout="5m", heartbeat_interval="5m")
    frame = encode(Frame(Command.UP_PRODUCER_SEND, session_id=1, topic="other", producer="holder",
                         timestamp_ms=1, body=body(b"held", 0)))[:-1]
    holders = []
    try:
        for _ in range(40):
            sock = socket.create_connection(("127.0.0.1", server.tcp_port))
            sock.sendall(MAGIC)
            holders.append(Writer(sock, (frame,)))

        def stopped() -> dict:
            metrics = scrape_metrics(server.http)
            return metrics[("dmq_client_memory_stopped_connections", ())] >= 1 and metrics

        metrics = wait_for(stopped, 60, 0.2)
        assert metrics[("dmq_client_memory_pauses_total", ())] >= 1
        assert metrics[("dmq_client_memory_limit_bytes", ())] == budget
        held = metrics[("dmq_client_memory_bytes", (("kind", "frames"),))]
        assert budget < held <= budget + budget // 8, held  # over the limit, under the hard mark
        with server.client() as producer, server.client() as consumer:
            replies = producer.send_many("other", [b"small-%d" % i for i in range(20)])
            assert [r.command for r in replies] == [Command.SEND_SUCCESS_ACK] * 20
            consumer.subscribe("other", "sink", credit=100)
            for _ in range(20):
                push = consumer.receive(timeout=10)
                assert push is not None
                consumer.ack(push)
        assert scrape_metrics(server.http)[("dmq_client_memory_stopped_connections", ())] >= 1  # still held
    finally:
        for writer in holders:
            writer._sock.close()
    wait_for(lambda: scrape_metrics(server.http)[("dmq_client_memory_bytes", (("kind", "frames"),))] == 0, 30, 0.2)
    wait_for(lambda: "client memory back under its budget" in server.log(), 10)
    log = server.log()
    assert log.count("client memory over its budget") == 1, log
    assert log.count("client memory back under its budget") == 1, log


def test_deferred_publishes_are_held_within_the_budget_and_past_it_refused_not_dropped(make_server):
    """DPUBs of 1 MB to a fast topic with two channels, deferred a minute, over TCP and
    HTTP, with --max-client-memory 32 MiB: deferred messages have nowhere to wait but
    memory, so they take at most what the channel windows may (half the budget, each
    channel's copy counted) and the next DPUB is refused, non-fatally on TCP
    (``E_DPUB_FAILED ... E_MEMORY``) and with HTTP 503 on /pub?defer=; the connection keeps
    working (a PUB is answered OK), the server's RSS stays bounded, and every DPUB
    answered OK is delivered to both channels when due (counted)."""
    budget = 32 * MB
    server = make_server(max_client_memory=str(budget), msg_timeout="60s")
    pid = server.proc.pid
    consumers = []
    try:
        for channel in ("one", "two"):
            consumer = NsqSocket(server.tcp_port)
            consumer.sub("deferred", channel, rdy=0)
            consumers.append(consumer)
        producer = NsqSocket(server.tcp_port)
        consumers.append(producer)
        accepted, refusal = [], None
        for i in range(40):
            producer.send(encode_command(b"DPUB", b"deferred", b"2000", body=body(b"dpub", i)))
            kind, data = producer.frame()
            if kind == FRAME_RESPONSE:
                assert data == b"OK"
                accepted.append(i)
            else:
                refusal = data
                break
        assert refusal is not None and refusal.startswith(b"E_DPUB_FAILED DPUB failed E_MEMORY "), refusal
        # two copies of each: at most half the budget, and nearly all of it taken
        assert budget // 2 // (2 * BODY) - 1 <= len(accepted) <= budget // 2 // (2 * BODY), accepted
        status, text = http_post(server.http + "/pub?topic=deferred&defer=2000", body(b"http", 0))
        assert status == 503 and "E_MEMORY" in text, (status, text)
        assert producer.pub("deferred", b"still served") == b"OK"
        metrics = scrape_metrics(server.http)
        assert metrics[("dmq_client_memory_bytes", (("kind", "fast_window"),))] <= budget // 2
        assert memory_kb(pid)[1] < 400 * 1024
        for consumer in consumers[:2]:
            consumer.send(b"RDY 100\n")
            got = set()
            while len(got) < len(accepted) + 1:
                _, _, message_id, received = consumer.message()
                consumer.send(b"FIN " + message_id + b"\n")
                got.add(received[:11])
            assert got == {b"dpub-%06d" % i for i in accepted} | {b"still serve"}
        wait_for(lambda: scrape_metrics(server.http)[("dmq_client_memory_bytes", (("kind", "fast_window"),))] == 0,
                 10, 0.1)
    finally:
        for sock in consumers:
            sock.close()
