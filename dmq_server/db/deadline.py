"""Deadlines for PostgreSQL's answers: a server that stops answering is cut off.

TCP keepalives and ``tcp_user_timeout`` (``dmq_sql.connection``) notice a peer
whose *kernel* went silent. A PostgreSQL that is paused (SIGSTOP), hung, or behind a
link that swallows packets after acknowledging them leaves a healthy TCP connection
that never answers, and a blocking call on it would wait forever: a delay worker
stuck so held its delayed messages back for good (tests/chaos, net-pg-blackhole).
A ``Watchdog`` gives each call a deadline; when it passes, the connection's socket is
shut down under the blocked call, which then fails as on a broken connection (its
outcome unknown), and the caller connects again, maybe to another Patroni member.

Cutting a connection never turns a commit into a false ack: the client only stops
listening. A commit waiting for its synchronous standby stays invisible and keeps
waiting on the server (PostgreSQL does not cancel it for a closed client), so a
resend of its sends waits for it too and is answered from the stored row.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import psycopg

from dmq_server.db.storage_errors import StorageError

__all__ = ["Watchdog", "cut", "hung_error"]


class Watchdog:
    """Cuts the connection of a call that PostgreSQL has not answered in ``timeout`` s.

    One thread per watchdog, started on first use, waiting on a condition: a call arms
    it with its connection and disarms it when done (no thread or timer per call). When
    the deadline passes first, the socket is shut down under the blocked call, which
    then fails as on a broken connection; ``disarm`` says whether that happened.
    """

    def __init__(self, timeout: float | None, name: str):
        self.timeout = timeout if timeout and timeout > 0 else None
        self.name = name
        self._cond = threading.Condition()
        self._conn: psycopg.Connection | None = None
        self._deadline = 0.0
        self._fired = False
        self._thread: threading.Thread | None = None
        self._closed = False

    def arm(self, conn: psycopg.Connection) -> None:
        if self.timeout is None:
            return
        with self._cond:
            self._conn, self._deadline, self._fired = conn, time.monotonic() + self.timeout, False
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, daemon=True, name=f"dmq-db-watch-{self.name}")
                self._thread.start()
            self._cond.notify()

    def disarm(self) -> bool:
        """Stop watching; True if the deadline passed and the connection was cut."""
        with self._cond:
            self._conn = None
            fired, self._fired = self._fired, False
            return fired

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._conn = None
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if self._conn is None:
                    self._cond.wait()
                    continue
                remaining = self._deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                cut(self._conn)
                self._fired = True
                self._conn = None


def cut(conn: psycopg.Connection) -> None:
    """Shut the connection's socket down: a call blocked on it sees the connection broken."""
    try:
        fd = conn.pgconn.socket
    except psycopg.Error:  # already closed
        return
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def hung_error(name: str, timeout: float | None) -> StorageError:
    return StorageError(f"{name}: no answer from PostgreSQL in {timeout:g}s; connection dropped (outcome unknown)")
