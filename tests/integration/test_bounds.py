"""Bounds on a real dmq-server over real sockets and PostgreSQL.

* A producer that pipelines sends and never reads its replies is held by TCP, not
  by the server's memory: the server stops reading it (its gate is paused for
  ``output``) while the client still has data to write, the bytes the server holds
  for it stay under the caps, other clients keep being served, and when the client
  finally reads, every send is answered and every SUCCESS id is stored (counted).
* A slow client (one byte every few seconds) is closed after the read timeout.
* An oversized HTTP body is answered 413 from its Content-Length, before the body.
* The admin console answers a command whose input was half-closed (``nc -N``).
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from dmq_client.wire import MAGIC, Command, Frame, FrameDecoder, encode

from .support import db_rows, http_get, wait_for

pytestmark = pytest.mark.integration

OUTPUT_CAP = 65536
PENDING_BYTES_CAP = 1048576


def flow(server) -> dict:
    status, body = http_get(server.http + "/admin/flow")
    assert status == 200, body
    return json.loads(body)


def _kernel_send_buffer_max() -> int:
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        return int(f.read().split()[2])


def gate_of(server, sock: socket.socket) -> dict | None:
    port = sock.getsockname()[1]
    for gate in flow(server)["gates"]:
        if gate["peer"].endswith(f":{port}"):
            return gate
    return None


def test_non_reading_producer_is_paused_and_everything_it_sent_is_answered_and_stored(make_server, topic):
    server = make_server(max_output_buffer=OUTPUT_CAP, max_pending_bytes=PENDING_BYTES_CAP)
    # The replies must be more than the server's socket takes in before its own buffer
    # holds any: the kernel queues up to tcp_wmem's maximum (4 MB by default) for a
    # client that does not read, and a reply written at once (protocols/direct.py) fills
    # it to that maximum. About 40 bytes a reply.
    count, body = max(60_000, 2 * _kernel_send_buffer_max() // 40), b"f" * 200
    blob = b"".join(
        encode(Frame(Command.UP_PRODUCER_SEND, session_id=i, topic=topic, producer="flood", timestamp_ms=1, body=body))
        for i in range(count)
    )
    sock = socket.socket()
    # a small receive buffer, so the replies fill the server's buffer, not the kernel's
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.tcp_port))
    sock.sendall(MAGIC)
    writer = threading.Thread(target=sock.sendall, args=(blob,), daemon=True)
    writer.start()

    # the unsent replies: the high-water mark, one read's worth of sends past it, and the
    # answers of the sends that were awaiting commit when reading stopped
    frame_size = len(blob) // count
    reply_size = len(encode(Frame(Command.SEND_SUCCESS_ACK, session_id=count, message_id=2**40, topic=topic,
                                  producer="flood")))
    pending_sends = PENDING_BYTES_CAP // len(body) + 65536 // frame_size + 1
    output_bound = OUTPUT_CAP + 65536 + pending_sends * reply_size

    paused = wait_for(lambda: (g := gate_of(server, sock)) is not None and "output" in g["paused"] and g, 60)
    assert writer.is_alive(), "the server read everything: no backpressure"
    assert paused["output_buffer_bytes"] <= output_bound
    assert paused["held_bytes"] <= PENDING_BYTES_CAP + 64 * 1024
    assert paused["bytes_read"] < len(blob)

    # other clients are served meanwhile
    with server.client() as other:
        replies = other.send_many(topic, [b"other-%d" % i for i in range(50)])
    assert [r.command for r in replies] == [Command.SEND_SUCCESS_ACK] * 50
    # still not read through: the kernel may take a few more replies (its buffers grow),
    # then the server reads a little more until it pauses again, but what it holds stays
    # under the caps
    still = gate_of(server, sock)
    assert still["output_buffer_bytes"] <= output_bound
    assert still["held_bytes"] <= PENDING_BYTES_CAP + 64 * 1024
    assert still["bytes_read"] < len(blob) and writer.is_alive()

    # the client reads at last: every send is answered, every SUCCESS is stored
    decoder, answers = FrameDecoder(), {}
    sock.settimeout(60)
    while len(answers) < count:
        data = sock.recv(1 << 20)
        assert data, "connection closed before every send was answered"
        for frame in decoder.feed(data):
            if frame.command in (Command.SEND_SUCCESS_ACK, Command.SEND_SERVER_ERROR):
                answers[frame.session_id] = frame
    writer.join(30)
    sock.close()
    assert sorted(answers) == list(range(count))
    acked = {s: f.message_id for s, f in answers.items() if f.command == Command.SEND_SUCCESS_ACK}
    assert len(acked) == count
    stored = dict(db_rows(server.dsn, "SELECT session_id, id FROM dmq_message WHERE producer = 'flood'"))
    assert stored == acked  # every acknowledged id is stored, under its own session id


def test_slow_client_is_closed_after_the_read_timeout(make_server):
    """One byte of a frame every 0.4 s; --read-timeout 1s closes it with E_TIMEOUT."""
    server = make_server(read_timeout="1s")
    frame = encode(Frame(Command.UP_HEARTBEAT))
    with socket.create_connection(("127.0.0.1", server.tcp_port), timeout=10) as sock:
        sock.sendall(MAGIC)
        started = time.monotonic()
        received = b""
        for byte in frame[:-1]:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.4)  # the client's pace, not synchronisation
            sock.setblocking(False)
            try:
                chunk = sock.recv(65536)
                received += chunk
                if chunk == b"":
                    break
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
        sock.settimeout(10)
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
        elapsed = time.monotonic() - started
    frames = FrameDecoder().feed(received)
    errors = [f.status for f in frames if f.command == Command.PROTOCOL_ERROR]
    assert errors and errors[0].startswith("E_TIMEOUT incomplete frame"), frames
    assert 1.0 <= elapsed < 10


def test_oversized_http_body_is_refused_before_it_is_sent(make_server):
    """Content-Length over --max-body-size: 413 BODY_TOO_BIG after the headers alone."""
    server = make_server(max_body_size=1000)
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        sock.sendall(
            b"POST /mpub?topic=big HTTP/1.1\r\nHost: x\r\nContent-Length: 200000000\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        answer = b""
        while b"}" not in answer:
            chunk = sock.recv(4096)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert answer.endswith(b'{"message": "BODY_TOO_BIG"}')


def test_admin_console_answers_before_closing_a_half_closed_session(make_server):
    """``printf 'stats\\n' | nc -N``: the answer needs the database and arrives after the
    client's FIN; the console used to close without it."""
    server = make_server()
    with socket.create_connection(("127.0.0.1", server.admin_port), timeout=10) as sock:
        sock.sendall(b"stats\ntopics\n")
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    lines = received.decode().splitlines()
    assert lines[0].startswith("# dmq admin console")
    assert "OK stats" in lines and lines[-1].startswith("OK ") and "topics" in lines[-1]


def test_admin_console_closes_a_line_trickled_past_the_read_timeout(make_server):
    """Slowloris on the admin console's real socket: a line's bytes one every 0.4 s, never
    finished; --read-timeout 1s closes the session with ERR E_TIMEOUT."""
    server = make_server(read_timeout="1s")
    with socket.create_connection(("127.0.0.1", server.admin_port), timeout=10) as sock:
        started = time.monotonic()
        received = b""
        try:
            for _ in range(20):
                sock.sendall(b"x")
                time.sleep(0.4)  # the client's pace, not synchronisation
        except OSError:
            pass
        sock.settimeout(10)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        elapsed = time.monotonic() - started
    assert b"E_TIMEOUT line not finished within 1s" in received, received
    assert 1.0 <= elapsed < 8
