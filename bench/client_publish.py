#!/usr/bin/env python3
"""Publish throughput through ``MqClient`` and the asyncio client against the raw pipelined socket client.

    python bench/client_publish.py                 # 20,000 messages x 3 rounds each
    python bench/client_publish.py --messages 50000 --rounds 5 --window 256 --size 100

Starts a private PostgreSQL (the server's embedded one) and a dmq-server on
127.0.0.1, registers topic ``bench`` with channel ``c``, then alternates:

* raw: ``BlockingClient.send_many`` — one socket, frames written with at most
  ``--window`` unanswered, replies matched by session id. The ceiling a
  client can reach on one connection.
* client: ``MqClient.send`` of the same messages, with ``max_in_flight`` =
  ``--window`` (the same pipelining), timed from the first send to the last
  result delivered to its callback.
* aio, aio-uvloop: ``dmq_client.aio.Client`` on asyncio's default loop and on uvloop,
  ``--window`` tasks each awaiting its sends one after another (``max_in_flight`` =
  ``--window``: the same pipelining), timed from the first send to the last answer.

For each it prints acknowledged messages per second and the benchmark
process's CPU time per message (all its threads: for ``client`` that is the
caller, send runner, reader and notify runner). The result is the best round
of each (the machine may be shared), the client/raw ratio (target >= 0.80)
and the client's CPU microseconds per message.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dmq_client import Message, MqClient, MqConfig, SendResult  # noqa: E402
from dmq_client.blocking import BlockingClient  # noqa: E402
from dmq_client.wire import Command  # noqa: E402

TOPIC, CHANNEL = "bench", "c"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """A private PostgreSQL and one dmq-server; ``close`` stops both."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="dmq-bench-client-"))
        self.base.chmod(0o755)  # PostgreSQL runs as another user when we are root
        self.pg = None
        self.server: subprocess.Popen | None = None
        self.tcp_port = free_port()
        self.http_port = free_port()

    def start(self) -> "Stack":
        from dmq_server.db.embedded import EmbeddedPostgres
        from dmq_server.db.schema import migrate
        from dmq_server.db.worker import connect

        import registry

        self.pg = EmbeddedPostgres(self.base)
        dsn = self.pg.start()
        migrate(dsn)
        with connect(dsn, autocommit=True) as conn:
            registry.create_topic(conn, TOPIC)
            registry.add_channel(conn, TOPIC, CHANNEL)
        log = open(self.base / "dmq-server.log", "ab")
        self.server = subprocess.Popen(
            [sys.executable, "-m", "dmq_server.main", "--pg-dsn", dsn,
             "--tcp-address", f"127.0.0.1:{self.tcp_port}", "--http-address", f"127.0.0.1:{self.http_port}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        )
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise RuntimeError(f"dmq-server exited; see {self.base / 'dmq-server.log'}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/ping", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("dmq-server did not become ready")

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(30)
            except subprocess.TimeoutExpired:
                self.server.kill()
        if self.pg is not None:
            try:
                self.pg.stop(mode="immediate")
            except Exception:
                self.pg.kill()
        shutil.rmtree(self.base, ignore_errors=True)


def run_raw(port: int, count: int, body: bytes, window: int) -> tuple[float, float]:
    with BlockingClient("127.0.0.1", port, timeout=60) as client:
        client.send_many(TOPIC, [body] * 200, window=window)  # warm up: connection, topic cache
        cpu, wall = time.process_time(), time.perf_counter()
        replies = client.send_many(TOPIC, [body] * count, window=window)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    bad = sum(1 for r in replies if r.command != Command.SEND_SUCCESS_ACK)
    if bad:
        raise RuntimeError(f"raw: {bad} sends not acknowledged")
    return count / wall, cpu / count * 1e6


def run_client(port: int, count: int, body: bytes, window: int) -> tuple[float, float]:
    config = MqConfig(
        servers=(f"127.0.0.1:{port}",), max_in_flight=window, send_queue_size=count + 1, max_body_size=len(body) + 1
    )
    done = threading.Event()
    failures: list[SendResult] = []
    answered = 0

    def on_result(result: SendResult) -> None:  # runs on the notify thread only
        nonlocal answered
        answered += 1
        if not result.ok:
            failures.append(result)
        if answered == count:
            done.set()

    with MqClient(config) as client:
        for _ in range(200):  # warm up
            client.send(Message(TOPIC, body))
        client.flush(60)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(count):
            client.send(Message(TOPIC, body), on_result)
        if not done.wait(600):
            raise RuntimeError(f"client: only {answered}/{count} results")
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if failures:
        raise RuntimeError(f"client: {len(failures)} failed, e.g. {failures[0].status}: {failures[0].description}")
    return count / wall, cpu / count * 1e6


def run_aio(port: int, count: int, body: bytes, window: int, uvloop: bool = False) -> tuple[float, float]:
    import asyncio

    from dmq_client.aio import Client

    async def run() -> tuple[float, float, int]:
        async with Client(servers=(f"127.0.0.1:{port}",), max_in_flight=window,
                          max_body_size=len(body) + 1) as client:
            await client.wait_connected(10)
            for _ in range(200):  # warm up
                await client.send(Message(TOPIC, body))
            failed = 0

            async def sender(n: int) -> None:
                nonlocal failed
                for _ in range(n):
                    if not (await client.send(Message(TOPIC, body))).ok:
                        failed += 1

            shares = [count // window + (1 if i < count % window else 0) for i in range(window)]
            cpu, wall = time.process_time(), time.perf_counter()
            await asyncio.gather(*(sender(n) for n in shares))
            return time.perf_counter() - wall, time.process_time() - cpu, failed

    if uvloop:
        import uvloop as uv

        wall, cpu, failed = uv.run(run())
    else:
        wall, cpu, failed = asyncio.run(run())
    if failed:
        raise RuntimeError(f"aio: {failed} sends not acknowledged")
    return count / wall, cpu / count * 1e6


def run_aio_uvloop(port: int, count: int, body: bytes, window: int) -> tuple[float, float]:
    return run_aio(port, count, body, window, uvloop=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20000, help="messages per round (default 20000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each, alternating (default 3)")
    parser.add_argument("--window", type=int, default=256, help="unanswered sends allowed (default 256)")
    parser.add_argument("--size", type=int, default=100, help="body bytes (default 100)")
    args = parser.parse_args(argv)
    body = os.urandom(args.size // 2).hex().encode().ljust(args.size, b"x")[: args.size]
    stack = Stack()
    try:
        stack.start()
        print(f"dmq-server on 127.0.0.1:{stack.tcp_port}; {args.messages} x {args.size} B messages, "
              f"window {args.window}, {args.rounds} rounds, {os.cpu_count()} CPUs")
        print(f"{'round':>5}  {'kind':<6} {'msgs/s':>10} {'cpu us/msg':>11}")
        raw: list[tuple[float, float]] = []
        client: list[tuple[float, float]] = []
        aio: list[tuple[float, float]] = []
        aio_uv: list[tuple[float, float]] = []
        kinds = (("raw", run_raw, raw), ("client", run_client, client), ("aio", run_aio, aio),
                 ("aio-uv", run_aio_uvloop, aio_uv))
        for n in range(1, args.rounds + 1):
            for kind, fn, into in kinds:
                rate, cpu = fn(stack.tcp_port, args.messages, body, args.window)
                into.append((rate, cpu))
                print(f"{n:>5}  {kind:<6} {rate:>10,.0f} {cpu:>11.1f}")
        best_raw, best_client = max(raw), max(client)
        ratio = best_client[0] / best_raw[0]
        print()
        print(f"raw client   {best_raw[0]:>10,.0f} msgs/s  (best of {args.rounds}; {best_raw[1]:.1f} us CPU/msg)")
        print(f"MqClient     {best_client[0]:>10,.0f} msgs/s  (best of {args.rounds}; {best_client[1]:.1f} us CPU/msg)")
        for label, runs in (("aio", aio), ("aio uvloop", aio_uv)):
            best = max(runs)
            print(f"{label:<12} {best[0]:>10,.0f} msgs/s  (best of {args.rounds}; {best[1]:.1f} us CPU/msg; "
                  f"{best[0] / best_client[0]:.2f} of MqClient's)")
        print(f"ratio        {ratio:>10.2f}  (MqClient/raw, target >= 0.80: {'met' if ratio >= 0.8 else 'NOT met'})")
        for label, runs in (("MqClient", client), ("aio", aio), ("aio uvloop", aio_uv)):
            print(f"{label + ' CPU':<16} {min(c for _, c in runs):>6.1f} us per message (least of {args.rounds}; "
                  "benchmark process, all threads)")
        return 0
    finally:
        stack.close()


if __name__ == "__main__":
    sys.exit(main())
