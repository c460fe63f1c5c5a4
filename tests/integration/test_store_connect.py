"""store.connect's dead-peer settings, read back from the kernel's socket options.
(What they are for, a database host that vanishes without closing its connections,
is not simulated here: the test checks the settings reach the socket.)"""

from __future__ import annotations

import os
import socket

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
