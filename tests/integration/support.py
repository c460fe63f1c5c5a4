"""Helpers that run the real dmq server as a subprocess against real PostgreSQL.

A subprocess (not an in-process reactor) because the tests kill it with
SIGKILL, stop it with SIGTERM and restart it, exactly as an operator would.
Readiness is an event (``/ping`` answering OK), polled with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psycopg

from dmq_client.blocking import BlockingClient
from dmq_sql.ports import fresh_port
from dmq_server.core.nsq_wire import (
    FRAME_MESSAGE,
    FRAME_RESPONSE,
    FrameReader,
    decode_message,
    encode_command,
)

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port outside the kernel's ephemeral range that no earlier caller was given
    (``dmq_sql.ports``): a server restarted on its address finds it free again."""
    return fresh_port()


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def http_post(url: str, data: bytes, timeout: float = 10.0) -> tuple[int, str]:
    """POST ``data``: the status and the body, an HTTP error's too (as ``http_get``)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method="POST"), timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape_metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    """A server's ``/metrics`` as Prometheus' own parser reads it: (name, sorted labels)
    to value."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = http_get(base_url + "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered HTTP {status}")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


class ServerProcess:
    """A dmq-server subprocess with fixed ports, so a restart keeps its address."""

    def __init__(self, dsn: str, log_dir: Path, **flags: str):
        self.dsn = dsn
        self.tcp_port = free_port()
        self.http_port = free_port()
        self.admin_port = free_port()  # servers running side by side must not share 4152
        self.flags = flags
        self.log_path = log_dir / f"dmq-server-{self.tcp_port}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.env: dict[str, str] | None = None  # the process's environment (None: this one's)

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def args(self) -> list[str]:
        args = [
            sys.executable,
            "-m",
            "dmq_server.main",
            "--pg-dsn",
            self.dsn,
            "--tcp-address",
            f"127.0.0.1:{self.tcp_port}",
            "--http-address",
            f"127.0.0.1:{self.http_port}",
        ]
        if "admin_address" not in self.flags:
            args += ["--admin-address", f"127.0.0.1:{self.admin_port}"]
        if "data_path" not in self.flags:
            # its own fast-store files: servers of different tests must not share ./dmq-data
            args += ["--data-path", str(self.log_path.parent / f"data-{self.tcp_port}")]
        for name, value in self.flags.items():
            args += ["--" + name.replace("_", "-"), str(value)]
        return args

    def start(self, timeout: float = 30.0) -> "ServerProcess":
        self.starts += 1
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=self.env)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dmq-server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status, _ = http_get(self.http + "/ping", timeout=1)
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"dmq-server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, like a crash or a power cut."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def client(self, **kwargs) -> BlockingClient:
        return BlockingClient("127.0.0.1", self.tcp_port, **kwargs)


class NsqSocket:
    """A minimal blocking NSQ client over a raw socket (for tests)."""

    def __init__(self, port: int, identify: dict | None = None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.reader = FrameReader()
        self.pending: list[tuple[int, bytes]] = []
        self.sock.sendall(b"  V2")
        if identify is not None:
            self.send(encode_command(b"IDENTIFY", body=json.dumps(identify).encode()))
            self.response()

    def send(self, data: bytes) -> "NsqSocket":
        self.sock.sendall(data)
        return self

    def frame(self, timeout: float = 10.0) -> tuple[int, bytes]:
        """The next frame that is not a heartbeat (answering heartbeats with NOP)."""
        deadline = time.monotonic() + timeout
        while True:
            while self.pending:
                kind, data = self.pending.pop(0)
                if kind == FRAME_RESPONSE and data == b"_heartbeat_":
                    self.sock.sendall(b"NOP\n")
                    continue
                return kind, data
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed by server")
            self.pending += self.reader.feed(chunk)

    def response(self) -> bytes:
        kind, data = self.frame()
        assert kind == FRAME_RESPONSE, data
        return data

    def message(self) -> tuple[int, int, bytes, bytes]:
        kind, data = self.frame()
        assert kind == FRAME_MESSAGE, data
        return decode_message(data)

    def pub(self, topic: str, body: bytes) -> bytes:
        return self.send(encode_command(b"PUB", topic.encode(), body=body)).response()

    def sub(self, topic: str, channel: str, rdy: int = 1) -> None:
        self.send(f"SUB {topic} {channel}\n".encode())
        assert self.response() == b"OK"
        self.send(f"RDY {rdy}\n".encode())

    def closed(self, timeout: float = 5.0) -> bool:
        """True once the server closes the connection (frames before that are skipped)."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                if self.sock.recv(65536) == b"":
                    return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            pass
        return False

    def close(self) -> None:
        self.sock.close()


def run_cli(dsn: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dmq_server.admin.cli", "--pg-dsn", dsn, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def db_rows(dsn: str, sql: str, *params) -> list[tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Poll an observable condition with a deadline (the event has no push notification)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(interval)


