"""Fixtures for integration tests: a real dmq-server subprocess on a real PostgreSQL."""

from __future__ import annotations

import pytest

from .support import NsqSocket, ServerProcess


@pytest.fixture
def make_server(pg_dsn, tmp_path):
    """Factory: ``make_server(**flags)`` starts a dmq-server on the test's database."""
    servers: list[ServerProcess] = []

    def make(dsn: str | None = None, start: bool = True, **flags: str) -> ServerProcess:
        server = ServerProcess(dsn or pg_dsn, tmp_path, **flags)
        servers.append(server)
        return server.start() if start else server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def nsq_connect():
    """Factory: ``nsq_connect(port, identify=None)`` opens an NSQ V2 connection that is
    closed when the test ends, whether it passed or not."""
    sockets: list[NsqSocket] = []

    def connect(port: int, identify: dict | None = None) -> NsqSocket:
        sock = NsqSocket(port, identify)
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close()


@pytest.fixture
def topic(pg_dsn):
    """A registered topic ``orders`` with channel ``billing``."""
    from dmq_server.db.worker import connect
    import registry

    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders", msg_timeout_ms=60000)
        registry.add_channel(conn, "orders", "billing")
    return "orders"


@pytest.fixture
def owner(pg_dsn):
    """An incarnation of ``node-1`` (dmq_owner) to store messages as, for tests that call
    the group commit's statement directly."""
    from dmq_server.db.messages import create_owner
    from dmq_server.db.worker import connect

    with connect(pg_dsn, autocommit=True) as conn:
        return create_owner(conn, "node-1")


@pytest.fixture
def certs(tmp_path):
    """trustme certificates (CA, server for 127.0.0.1/localhost, a client) as PEM files."""
    from .certs import make_certs

    return make_certs(tmp_path / "certs")

