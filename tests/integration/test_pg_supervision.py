"""A dmq-server on its embedded PostgreSQL restarts the postmaster when it dies.

The real thing end to end: ``dmq-server --data-path DIR`` (no ``--pg-dsn``), the
``dmq`` CLI on the same directory, the postmaster SIGKILLed while the server runs
(as the OOM killer would). Counted: every id acknowledged to the producer before
the kill and during/after the recovery is delivered to a consumer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dmq_client.blocking import BlockingClient, ClientError
from dmq_client.wire import Command
from dmq_server.db.embedded import EmbeddedPostgres

from .support import REPO, ServerProcess, http_get, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def data_dir(scratch_dir: Path) -> Path:
    return scratch_dir


def _cli(data_dir: Path, *args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dmq_server.admin.cli", "--data-path", str(data_dir), *args],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert result.returncode == 0, result.stderr


class _RetryingProducer:
    """Sends each body until it is acknowledged, as a producer riding out an outage:
    again after ``SEND_SERVER_ERROR``, on a new connection after a dead one. Failures
    are counted in ``outcomes``.

    Every connection gets its own producer id: BlockingClient's default one ends with
    ``id(self)``, which a new client can inherit from a freed one, and its session ids
    start at the current millisecond, so two clients in a row could be taken for one
    producer resending (dedup, issue 13 item 2) and a new body answered with an old id.
    """

    def __init__(self, port: int):
        self.port = port
        self.client: BlockingClient | None = None
        self.outcomes: dict[str, int] = {}

    def _count(self, what: str) -> None:
        self.outcomes[what] = self.outcomes.get(what, 0) + 1

    def send(self, body: bytes, deadline: float) -> int:
        while True:
            assert time.monotonic() < deadline, f"not acknowledged before the deadline: {self.outcomes}"
            try:
                if self.client is None:
                    self.client = BlockingClient("127.0.0.1", self.port, timeout=10,
                                                 producer=f"supervision-test-{uuid.uuid4().hex}")
                reply = self.client.send("orders", body, timeout=10)
            except (ClientError, OSError) as exc:
                self._count(type(exc).__name__)
                self.close()
                continue
            if reply.command == Command.SEND_SUCCESS_ACK:
                return reply.message_id
            assert reply.command == Command.SEND_SERVER_ERROR, reply
            self._count(reply.command.name)
            time.sleep(0.05)  # a retrying producer's pacing, not synchronisation

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def test_killed_postmaster_is_restarted_and_nothing_acknowledged_is_lost(data_dir: Path, tmp_path: Path) -> None:
    server = ServerProcess("", tmp_path, data_path=str(data_dir))
    try:
        server.start(timeout=120)  # initdb and the first start are part of it
        pg = EmbeddedPostgres(data_dir)
        old_pid = pg.pid()
        assert old_pid is not None
        _cli(data_dir, "topic", "create", "orders")
        _cli(data_dir, "channel", "add", "orders", "billing")

        acked: dict[int, bytes] = {}
        with server.client(timeout=15) as producer:
            bodies = [f"before:{i}".encode() for i in range(500)]
            for body, reply in zip(bodies, producer.send_many("orders", bodies)):
                assert reply.command == Command.SEND_SUCCESS_ACK, reply
                acked[reply.message_id] = body

        os.kill(old_pid, signal.SIGKILL)  # the postmaster only, as the OOM killer does
        killed_at = time.monotonic()

        # Sends go on from the moment of the kill: refused while PostgreSQL is down,
        # acknowledged again once the server restarted it (nobody else does).
        producer = _RetryingProducer(server.tcp_port)
        outcomes = producer.outcomes
        deadline = killed_at + 120
        try:
            for i in range(300):
                body = f"during:{i}".encode()
                acked[producer.send(body, deadline)] = body
        finally:
            producer.close()

        new_pid = wait_for(lambda: pg.pid(), timeout=60)
        assert new_pid != old_pid
        wait_for(lambda: http_get(server.http + "/ping")[0] == 200, timeout=60)
        assert server.proc.poll() is None and server.starts == 1  # the same dmq-server process
        log = server.log()
        assert log.count("embedded PostgreSQL (postmaster pid") == 1, log  # the death, once
        assert log.count("embedded PostgreSQL restarted") == 1, log  # the recovery, once
        assert f"pid {old_pid}) exited" in log and f"restarted (postmaster pid {new_pid})" in log
        # the ready banner shows the DSN, which names the secret file but not the secret
        secret = pg.secret_file.read_text().strip().split(":")[-1]
        assert f"PostgreSQL   {pg.dsn}  (embedded)" in server.log_path.read_text()
        assert secret not in server.log_path.read_text()

        delivered: dict[int, bytes] = {}
        with server.client(timeout=15) as consumer:
            consumer.subscribe("orders", "billing", credit=1000)
            while (push := consumer.receive(timeout=5)) is not None:
                delivered[push.message_id] = push.body
                consumer.ack(push)
                if acked.keys() <= delivered.keys():
                    break
        lost = acked.keys() - delivered.keys()
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged messages lost; sends saw {outcomes}"
        assert all(delivered[i] == body for i, body in acked.items())
        assert len(acked) == 800
    finally:
        server.stop()
