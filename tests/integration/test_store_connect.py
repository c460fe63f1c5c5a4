"""store.connect's dead-peer settings, read back from the kernel's socket options.
(What they are for, a database host that vanishes without closing its connections,
is not simulated here: the test checks the settings reach the socket.)"""

from __future__ import annotations

import os
import socket

import pytest

from dmq_server.db.worker import connect


def _socket_options(conn) -> tuple[int, int, int]:
    sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
    try:
        return (
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        )
    finally:
        sock.close()


def test_connections_carry_the_dead_peer_settings(pg_dsn):
    with connect(pg_dsn) as conn:
        assert _socket_options(conn) == (1, 10, 30_000)


def test_a_setting_in_the_dsn_wins(pg_dsn):
    separator = "&" if "?" in pg_dsn else "?"
    with connect(f"{pg_dsn}{separator}keepalives_idle=60&tcp_user_timeout=5000") as conn:
        assert _socket_options(conn) == (1, 60, 5_000)


def test_a_worker_transaction_left_idle_by_a_frozen_server_ends_and_frees_its_locks(pg_dsn):
    """A worker's connection carries idle_in_transaction_session_timeout (10 s): a server
    frozen inside a transaction (SIGSTOP, a paused VM) no longer holds its locks until it
    wakes. Shown with the same setting at 1 s on the same kind of connection: the frozen
    side holds an owner row FOR SHARE, as the group commit does until its COMMIT, and
    another node's UPDATE of that row (the takeover's claim) goes through once PostgreSQL
    has ended the idle transaction."""
    import time

    import psycopg

    from dmq_server.db.worker import WORKER_SETTINGS

    assert WORKER_SETTINGS["idle_in_transaction_session_timeout"] == "10s"
    with connect(pg_dsn, settings=WORKER_SETTINGS) as conn:
        assert conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()[0] == "10s"
    with connect(pg_dsn, autocommit=True) as admin:
        owner = admin.execute("INSERT INTO dmq_owner (node_id) VALUES ('frozen') RETURNING id").fetchone()[0]
    frozen = connect(pg_dsn, settings={**WORKER_SETTINGS, "idle_in_transaction_session_timeout": "1s"})
    frozen.execute("SELECT id FROM dmq_owner WHERE id = %s FOR SHARE", (owner,))  # then nothing more
    with connect(pg_dsn, autocommit=True) as taker:
        taker.execute("SET lock_timeout = '20s'")
        started = time.monotonic()
        taker.execute("UPDATE dmq_owner SET retired_at = now() WHERE id = %s", (owner,))
        waited = time.monotonic() - started
    assert 0.5 < waited < 15, waited  # it waited for the frozen transaction, and not for ever
    try:  # its connection was ended: its sends were never acknowledged, and are resent
        with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
            frozen.execute("SELECT 1")
    finally:
        frozen.close()
