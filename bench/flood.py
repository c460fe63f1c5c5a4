#!/usr/bin/env python3
"""Floods that do not read: does the server's memory stay bounded?

Starts a private PostgreSQL and a dmq-server (as bench/reliable.py does), then runs,
one after the other, and prints the server's RSS before and its peak during each:

* ``pipeline``: P producers (threads, one TCP connection each) pipeline
  ``UP_PRODUCER_SEND`` frames (1 KiB bodies) without ever reading a reply, until each
  has written ``--pipeline-mb`` or has been blocked by TCP for ``--blocked-seconds``.
  Meanwhile a well-behaved producer sends 1,000 messages and the time it takes is
  printed (is everyone else still served?). At the end the floods are closed.
* ``frames``: C connections (half dmq, half NSQ) each send all but the last byte of
  a frame of ``--frame-kb`` (dmq: ``UP_PRODUCER_SEND``; NSQ: ``PUB``) and then hold
  it. Printed: peak RSS, and how many the server had closed after ``--hold-seconds``
  (the read timeout, 30 s by default, closes unfinished frames).
* ``http``: one ``POST /pub`` announcing ``--http-mb`` MB in ``Content-Length``, the
  body streamed right behind the headers (no ``Expect``): the status the client gets,
  how long until it, how many bytes it managed to send, peak RSS.

``--server-cmd`` runs another build (e.g. ``/work/main/.venv/bin/dmq-server``) to
compare; the server's ``/admin/flow`` figures are printed when it has them.

    python bench/flood.py                          # about 2 minutes
    python bench/flood.py --pipeline-mb 500 --producers 3 --connections 150 --frame-kb 1024
    python bench/flood.py --scenarios pipeline --server-cmd /work/main/.venv/bin/dmq-server
"""

from __future__ import annotations

import argparse
import json
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import memory_kb  # noqa: E402
from _pg import PrivatePostgres  # noqa: E402
from reliable import DmqServer  # noqa: E402

from dmq_client.wire import MAGIC, Command, Frame, encode  # noqa: E402

TOPIC = "flood"
NSQ_MAGIC = b"  V2"


def register_topic(dsn: str) -> None:
    import registry
    from dmq_server.db.schema import migrate
    from dmq_server.db.worker import connect

    migrate(dsn)
    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, TOPIC, msg_timeout_ms=60000)
        registry.add_channel(conn, TOPIC, "sink")


def mb(kb: int) -> float:
    return round(kb / 1024.0, 1)


def admin_flow(server: DmqServer) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/admin/flow", timeout=5) as resp:
            return json.load(resp)
    except (OSError, ValueError):
        return None


def write_until_blocked(sock: socket.socket, frames, limit: int, blocked_for: float, stop: threading.Event,
                        counters: dict) -> None:
    """Write frames from the generator until ``limit`` bytes, or until no byte could
    be written for ``blocked_for`` seconds (the server stopped reading)."""
    sock.setblocking(False)
    pending = memoryview(b"")
    last_progress = time.monotonic()
    while not stop.is_set() and counters["sent"] < limit:
        if not pending:
            try:
                pending = memoryview(next(frames))
            except StopIteration:
                break
        _, writable, _ = select.select([], [sock], [], 0.2)
        if not writable:
            if time.monotonic() - last_progress > blocked_for:
                counters["blocked"] = True
                break
            continue
        try:
            n = sock.send(pending)
        except BlockingIOError:
            continue
        except OSError as exc:
            counters["error"] = str(exc)
            break
        pending = pending[n:]
        counters["sent"] += n
        last_progress = time.monotonic()


def send_frames(producer: str, body: bytes, chunk: int = 500):
    """Endless UP_PRODUCER_SEND frames, ``chunk`` at a time, with increasing session ids."""
    session = 0
    now_ms = int(time.time() * 1000)
    while True:
        parts = []
        for _ in range(chunk):
            session += 1
            parts.append(encode(Frame(Command.UP_PRODUCER_SEND, session_id=session, topic=TOPIC,
                                      producer=producer, timestamp_ms=now_ms, body=body)))
        yield b"".join(parts)


def polite_producer(server: DmqServer, count: int) -> float:
    """Seconds a reading producer needs for ``count`` sends (window 256)."""
    from dmq_client.blocking import BlockingClient

    started = time.monotonic()
    with BlockingClient("127.0.0.1", server.tcp_port, timeout=120) as client:
        replies = client.send_many(TOPIC, [b"polite-%d" % i for i in range(count)])
    ok = sum(1 for r in replies if r.command == Command.SEND_SUCCESS_ACK)
    if ok != count:
        print(f"    polite producer: only {ok} of {count} answered SUCCESS")
    return time.monotonic() - started


def scenario_pipeline(server: DmqServer, args: argparse.Namespace) -> dict:
    before = mb(memory_kb(server.pid)[0])
    stop = threading.Event()
    socks, threads, counters = [], [], []
    body = b"p" * 1024
    for i in range(args.producers):
        sock = socket.create_connection(("127.0.0.1", server.tcp_port))
        sock.sendall(MAGIC)
        c = {"sent": 0, "blocked": False}
        t = threading.Thread(
            target=write_until_blocked,
            args=(sock, send_frames(f"flood-{i}", body), args.pipeline_mb << 20, args.blocked_seconds, stop, c),
            daemon=True,
        )
        socks.append(sock)
        threads.append(t)
        counters.append(c)
        t.start()
    time.sleep(1.0)  # let the floods get going before the polite producer measures
    polite = polite_producer(server, 1000)
    for t in threads:
        t.join(args.timeout)
    flow = admin_flow(server)
    stop.set()
    for sock in socks:
        sock.close()
    out = {
        "rss_before_mb": before,
        "written_mb": round(sum(c["sent"] for c in counters) / 2**20, 1),
        "blocked": sum(1 for c in counters if c.get("blocked")),
        "polite_1000_sends_s": round(polite, 2),
    }
    if flow is not None:
        read = sum(g["bytes_read"] for g in flow["gates"] if g["paused"])
        out["server_read_mb"] = round(read / 2**20, 1)
        out["paused_connections"] = flow["paused"]
        out["peak_held_mb"] = round(flow["peak_held_bytes"] / 2**20, 1)
    return out


def closed_by_server(sock: socket.socket) -> bool:
    """True if the server closed the connection (whatever it wrote before its FIN)."""
    sock.setblocking(True)
    sock.settimeout(0.2)
    try:
        while True:
            if sock.recv(1 << 20) == b"":
                return True
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


def scenario_frames(server: DmqServer, args: argparse.Namespace) -> dict:
    before = mb(memory_kb(server.pid)[0])
    size = args.frame_kb * 1024
    dmq_frame = encode(Frame(Command.UP_PRODUCER_SEND, session_id=1, topic=TOPIC, producer="frames",
                             timestamp_ms=1, body=b"u" * size))
    nsq_frame = b"PUB " + TOPIC.encode() + b"\n" + size.to_bytes(4, "big") + b"u" * size
    socks = []
    for i in range(args.connections):
        sock = socket.create_connection(("127.0.0.1", server.tcp_port))
        magic, frame = (MAGIC, dmq_frame) if i % 2 == 0 else (NSQ_MAGIC, nsq_frame)
        sock.setblocking(False)
        data = memoryview(magic + frame[:-1])
        deadline = time.monotonic() + 5
        while data and time.monotonic() < deadline:  # the kernel takes what it can
            try:
                data = data[sock.send(data):]
            except BlockingIOError:
                select.select([], [sock], [], 0.05)
        socks.append(sock)
    held_at = time.monotonic()
    settle = min(10.0, args.hold_seconds)
    time.sleep(settle)  # every frame is in by now; the read timeout has not struck yet
    rss_held = mb(memory_kb(server.pid)[0])
    flow_held = admin_flow(server)
    time.sleep(args.hold_seconds - settle)
    flow = admin_flow(server)
    closed = sum(1 for sock in socks if closed_by_server(sock))
    for sock in socks:
        sock.close()
    out = {
        "rss_before_mb": before,
        "connections": args.connections,
        "announced_mb": round(args.connections * size / 2**20, 1),
        f"closed_after_{args.hold_seconds:g}s": closed,
        "held_for_s": round(time.monotonic() - held_at, 1),
        f"rss_mb_after_{settle:g}s": rss_held,
    }
    if flow_held is not None:
        out[f"held_mb_after_{settle:g}s"] = round(flow_held["held_bytes"] / 2**20, 1)
        out[f"paused_after_{settle:g}s"] = flow_held["paused"]
    if flow is not None:
        out["peak_held_mb"] = round(flow["peak_held_bytes"] / 2**20, 1)
        out["held_mb_at_end"] = round(flow["held_bytes"] / 2**20, 1)
    return out


def response_complete(data: bytes) -> bool:
    """A whole HTTP response (headers and a Content-Length body) is in ``data``."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip() or 0)
    return False


def scenario_http(server: DmqServer, args: argparse.Namespace) -> dict:
    before = mb(memory_kb(server.pid)[0])
    size = args.http_mb << 20
    sock = socket.create_connection(("127.0.0.1", server.http_port))
    sock.sendall(b"POST /pub?topic=%s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (TOPIC.encode(), size))
    t0 = time.monotonic()
    sock.setblocking(False)
    block = memoryview(b"h" * (1 << 20))
    sent, answer, elapsed = 0, b"", None
    while time.monotonic() - t0 < args.timeout:
        readable, writable, _ = select.select([sock], [sock] if sent < size else [], [], 0.5)
        if readable:
            try:
                chunk = sock.recv(65536)
            except OSError:
                chunk = b""
            answer += chunk
            if elapsed is None and answer:
                elapsed = time.monotonic() - t0
            if not chunk or response_complete(answer):
                break
        if writable:
            try:
                sent += sock.send(block[: min(len(block), size - sent)])
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                sent = size  # the server closed: stop writing, read what it said
    sock.close()
    status = answer.split(b"\r\n", 1)[0].decode(errors="replace") if answer else "(no answer)"
    return {
        "rss_before_mb": before,
        "announced_mb": args.http_mb,
        "client_sent_mb": round(sent / 2**20, 1),
        "status": status,
        "answered_after_s": round(elapsed, 3) if elapsed is not None else None,
    }


SCENARIOS = {"pipeline": scenario_pipeline, "frames": scenario_frames, "http": scenario_http}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default="pipeline,frames,http", help="comma-separated: pipeline, frames, http")
    p.add_argument("--producers", type=int, default=3, help="non-reading producers (pipeline)")
    p.add_argument("--pipeline-mb", type=int, default=500, help="MB each producer tries to write (pipeline)")
    p.add_argument("--blocked-seconds", type=float, default=5.0,
                   help="a producer that could write nothing this long stops (pipeline)")
    p.add_argument("--connections", type=int, default=150, help="connections holding a frame (frames)")
    p.add_argument("--frame-kb", type=int, default=1023, help="size of each unfinished frame's body, KiB (frames)")
    p.add_argument("--hold-seconds", type=float, default=35.0,
                   help="how long the frames are held (frames; the default read timeout is 30 s)")
    p.add_argument("--http-mb", type=int, default=200, help="Content-Length of the HTTP body, MB (http)")
    p.add_argument("--timeout", type=float, default=300.0, help="longest any one scenario may take")
    p.add_argument("--server-cmd", default="", help="run the server through this command (another build)")
    p.add_argument("--server-arg", action="append", default=[], help="extra dmq-server flag, e.g. --read-timeout=5s")
    p.add_argument("--json", default="", help="also write the results to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s): {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers in `finally`
    workdir = Path(tempfile.mkdtemp(prefix="dmq-flood-"))
    pg = PrivatePostgres()
    server = None
    results: dict = {"args": vars(args)}
    try:
        print("starting PostgreSQL ...")
        dsn = pg.start()
        register_topic(dsn)
        for name in names:
            # a fresh server per scenario: RSS does not shrink, so each peak is its own
            server = DmqServer(dsn, workdir, list(args.server_arg), server_cmd=args.server_cmd)
            server.start()
            print(f"\n== {name} (dmq-server pid {server.pid}, RSS {mb(memory_kb(server.pid)[0])} MB idle)")
            out = SCENARIOS[name](server, args)
            out["peak_rss_hwm_mb"] = mb(memory_kb(server.pid)[1])  # the kernel's high-water mark
            results[name] = out
            for key, value in out.items():
                print(f"  {key:28} {value}")
            server.stop()
            server = None
        print("\npeak RSS (VmHWM) per scenario: " + ", ".join(
            f"{n} {results[n]['peak_rss_hwm_mb']} MB" for n in names))
    finally:
        if server is not None:
            server.stop()
        pg.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
