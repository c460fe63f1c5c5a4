"""Fixtures for the pipeline tests: one local SparkSession, real PostgreSQL, the real server.

The SparkSession is session-scoped (local[2], the JDBC jar from Debian's
libpostgresql-jdbc-java) so the JVM starts once. History is made the way
production makes it: a real dmq-server stores the messages and real consumers
acknowledge them, so the delivery log holds what the server writes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psycopg
import pytest

from dmq_sql import load_queries
from dmq_pipeline.database import Database
from dmq_pipeline.options import DEFAULT_JDBC_JAR, SparkOptions
from dmq_pipeline.session import use_this_python
from tests.integration.support import ServerProcess, wait_for

HERE = Path(__file__).parent
EXPECTED = load_queries((HERE / "expected.sql").read_text())
FIXTURES = load_queries((HERE / "fixtures.sql").read_text())


# pyspark 4.0's DataFrame.collect() reads the rows over a loopback socket that it leaves
# to the garbage collector (pyspark.util._load_from_socket: "closed when
# garbage-collected"); Spark 4.2 closes it (SPARK-54247). Nothing on our side holds that
# socket, so in this tier only that one ResourceWarning is not an error: a socket left
# unclosed behind a makefile() and finalized from the module socket's SocketIO.close.
PYSPARK_COLLECT_SOCKET = r"ignore:unclosed <socket\.socket:ResourceWarning:socket"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.filterwarnings(PYSPARK_COLLECT_SOCKET))


def as_spark(value):
    """A timestamp as Spark's collect() returns it (naive, the process's local time)."""
    return datetime.fromtimestamp(value.timestamp()) if isinstance(value, datetime) else value


def sql(dsn: str, name: str, **params) -> list[tuple]:
    """Run a test query from fixtures.sql or expected.sql; rows if it returns any."""
    text = FIXTURES.get(name) or EXPECTED[name]
    with psycopg.connect(dsn, autocommit=True, options="-c TimeZone=UTC") as conn:
        cur = conn.execute(text, params or None)
        return cur.fetchall() if cur.description else []


def insert_dead_letter(dsn: str, *, key: str | None = None, priority: int = 0,
                       headers: dict[str, str] | None = None, **columns) -> int:
    """A dead letter as the server writes one (fixtures.sql's insert_dead_letter), its
    message's properties none unless given; its id."""
    return sql(dsn, "insert_dead_letter", key=key, priority=priority,
               headers=None if headers is None else json.dumps(headers), **columns)[0][0]


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession for the whole run (the JVM starts once)."""
    if not os.path.isfile(DEFAULT_JDBC_JAR):
        pytest.fail(f"{DEFAULT_JDBC_JAR} missing: apt-get install -y libpostgresql-jdbc-java")
    from pyspark.sql import SparkSession

    use_this_python()  # as the jobs do: workers run this interpreter, not PATH's python3
    session = (
        SparkSession.builder.master("local[2]")
        .appName("dmq-pipeline tests")
        .config("spark.jars", DEFAULT_JDBC_JAR)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def make_server(pg_dsn):
    """Factory: ``make_server(**flags)`` starts a dmq-server on the test's database."""
    servers: list[ServerProcess] = []
    log_dir = Path(tempfile.mkdtemp(prefix="dmq-pipeline-test-"))

    def make(**flags: str) -> ServerProcess:
        server = ServerProcess(pg_dsn, log_dir, **flags)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()
    shutil.rmtree(log_dir, ignore_errors=True)


@pytest.fixture
def topic(pg_dsn) -> str:
    """Topic ``orders`` with channels ``billing`` and ``shipping``, topic ``audit`` with ``archive``."""
    from dmq_server.db.worker import connect
    import registry

    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders", msg_timeout_ms=60000)
        registry.add_channel(conn, "orders", "billing")
        registry.add_channel(conn, "orders", "shipping")
        registry.create_topic(conn, "audit", msg_timeout_ms=60000)
        registry.add_channel(conn, "audit", "archive")
    return "orders"


@pytest.fixture
def db(pg_dsn) -> Iterator[Database]:
    """The pipeline's driver-side connection to the test database."""
    database = Database(pg_dsn)
    yield database
    database.close()


@pytest.fixture
def opts(pg_dsn) -> SparkOptions:
    return SparkOptions(pg_dsn=pg_dsn, partitions=2)


@dataclass
class Traffic:
    sent: int
    delivered: int
    pending: int


def consume(server: ServerProcess, topic: str, channel: str, count: int, *,
            leave_unacked: int = 0, abandon: int = 0) -> list:
    """Take ``count`` distinct messages from a channel and acknowledge all but the last
    ``leave_unacked``. ``abandon`` first pushes that many to a consumer that disconnects
    without acknowledging, so they are delivered again (attempts 2)."""
    if abandon:
        with server.client() as quitter:
            quitter.subscribe(topic, channel, credit=abandon)
            for _ in range(abandon):
                assert quitter.receive(timeout=10) is not None
    seen: dict[int, object] = {}
    with server.client() as consumer:
        consumer.subscribe(topic, channel, credit=count)
        while len(seen) < count:
            push = consumer.receive(timeout=10)
            assert push is not None, f"{channel}: got {len(seen)} of {count}"
            if push.message_id in seen:
                continue
            seen[push.message_id] = push
            if len(seen) <= count - leave_unacked:
                consumer.ack(push)
        # the acks are flushed in batches: wait until the log shows them
    return list(seen.values())


def make_traffic(server: ServerProcess, pg_dsn: str, n: int = 40) -> Traffic:
    """``n`` messages to orders (billing + shipping) and n/4 to audit; some redelivered,
    three left unacknowledged on billing."""
    logged_before = sql(pg_dsn, "counts")[0][2]
    with server.client() as producer:
        replies = producer.send_many("orders", [f"order-{i:04d}".encode() for i in range(n)])
        replies += producer.send_many("audit", [f"audit-{i:04d}".encode() for i in range(n // 4)])
    assert all(r.command.name == "SEND_SUCCESS_ACK" for r in replies)
    delivered = 0
    # one channel after the other, each logged before the next starts: the log then holds
    # several acknowledgement batches (schema version 10), which the archive's ranges take whole
    for (topic, channel, acked, count, extra) in (("orders", "billing", n - 3, n, {"leave_unacked": 3, "abandon": 5}),
                                                  ("orders", "shipping", n, n, {"abandon": 2}),
                                                  ("audit", "archive", n // 4, n // 4, {})):
        consume(server, topic, channel, count, **extra)
        delivered += acked
        wait_for(lambda: sql(pg_dsn, "counts")[0][2] == logged_before + delivered, timeout=20)
    return Traffic(sent=n + n // 4, delivered=delivered, pending=3)


@pytest.fixture(scope="session")
def standalone(tmp_path_factory):
    """A Spark standalone cluster (master + 2 workers of 2 cores) on 127.0.0.1 whose
    workers have no dmq (``tests/pipeline/standalone.py``), for the whole run."""
    from .standalone import StandaloneCluster

    cluster = StandaloneCluster(tmp_path_factory.mktemp("spark-standalone"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def ship_cache(tmp_path_factory) -> Path:
    """Where ``--ship-env build`` caches the packed environment in tests (XDG_CACHE_HOME)."""
    return tmp_path_factory.mktemp("xdg-cache")


def pipeline_command(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """The installed ``dmq-pipeline`` as a user runs it (its own driver JVM)."""
    exe = shutil.which("dmq-pipeline", path=os.path.dirname(sys.executable)) or shutil.which("dmq-pipeline")
    command = [exe] if exe else [sys.executable, "-m", "dmq_pipeline.cli"]
    return subprocess.run(command + list(args), capture_output=True, text=True, timeout=timeout, env=env)
