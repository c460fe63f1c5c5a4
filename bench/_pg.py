"""A private, throwaway PostgreSQL for the benchmark.

Prefers ``dmq_server.db.embedded.EmbeddedPostgres`` (the server's own embedded
PostgreSQL); if that module is missing or fails, runs initdb/pg_ctl from the
system installation itself (as the ``postgres`` user when this is root).
Either way: TCP on 127.0.0.1, fsync and synchronous_commit on, everything
under one temporary directory; the embedded one also asks for its password
(its DSN names the password file, see docs/operations.md), the fallback
trusts loopback and has no Unix socket.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from _common import free_port

SETTINGS = {
    # durability exactly as in production: the point is to measure it
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    # as dmq's embedded PostgreSQL (sql/embedded.py, dmq_sql.embedded, says why)
    "wal_init_zero": "off",
    "backend_flush_after": "256kB",
    # room for the 1,000,000-message backlog fill without checkpoint storms
    "max_wal_size": "4GB",
}


def _find_bindir() -> Path:
    root = Path("/usr/lib/postgresql")
    versions = sorted(
        (int(p.name), p / "bin") for p in root.iterdir() if p.name.isdigit() and (p / "bin" / "initdb").exists()
    ) if root.is_dir() else []
    if versions:
        return versions[-1][1]
    initdb = shutil.which("initdb")
    if initdb:
        return Path(os.path.realpath(initdb)).parent
    raise RuntimeError("no PostgreSQL binaries found (install postgresql or dmq-server[embedded])")


class PrivatePostgres:
    def __init__(self, base_dir: str | None = None, settings: dict[str, str] | None = None):
        """``settings``: server settings on top of SETTINGS (a benchmark's --pg-setting)."""
        self.settings = {**SETTINGS, **(settings or {})}
        self.base = Path(base_dir or tempfile.mkdtemp(prefix="dmq-bench-pg-"))
        self.base.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o755)  # PostgreSQL runs as another user when we are root
        self.dsn = ""
        self.kind = ""
        self._embedded = None
        self._manual_pgdata: Path | None = None
        self._manual_user: str | None = None
        self._bindir: Path | None = None

    # -- start/stop ----------------------------------------------------------
    def start(self) -> str:
        try:
            from dmq_server.db.embedded import EmbeddedPostgres
        except ImportError as exc:  # not written yet: do it by hand
            print(f"  (dmq_server.db.embedded not importable: {exc}; starting PostgreSQL by hand)")
            return self._start_manual()
        try:
            self._embedded = EmbeddedPostgres(self.base / "embedded", settings=self.settings)
            self.dsn = self._embedded.start()
            self.kind = "dmq_server.db.embedded.EmbeddedPostgres"
            return self.dsn
        except Exception as exc:  # noqa: BLE001 - fall back, but say why
            print(f"  (EmbeddedPostgres failed: {exc}; starting PostgreSQL by hand)")
            self._embedded = None
            return self._start_manual()

    def _runas(self) -> list[str]:
        return ["runuser", "-u", self._manual_user, "--"] if self._manual_user else []

    def _start_manual(self) -> str:
        self._bindir = _find_bindir()
        pgdata = self.base / "manual"
        pgdata.mkdir(mode=0o700)
        if os.geteuid() == 0:
            self._manual_user = "postgres"
            entry = pwd.getpwnam("postgres")
            os.chown(pgdata, entry.pw_uid, entry.pw_gid)
        self._manual_pgdata = pgdata
        subprocess.run(
            self._runas() + [str(self._bindir / "initdb"), "-D", str(pgdata), "-U", "dmq", "--auth=trust",
                             "--encoding=UTF8", "--locale=C"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        port = free_port()
        opts = " ".join(
            [f"-c port={port}", "-c listen_addresses=127.0.0.1", "-c unix_socket_directories=''"]
            + [f"-c {k}={v}" for k, v in self.settings.items()]
        )
        subprocess.run(
            self._runas() + [str(self._bindir / "pg_ctl"), "-D", str(pgdata), "-l", str(pgdata / "log.txt"),
                             "-o", opts, "-w", "start"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        self.dsn = f"postgresql://dmq@127.0.0.1:{port}/postgres"
        self.kind = f"initdb/pg_ctl from {self._bindir}"
        return self.dsn

    def stop(self) -> None:
        try:
            if self._embedded is not None:
                self._embedded.stop()
            elif self._manual_pgdata is not None and self._bindir is not None:
                subprocess.run(
                    self._runas() + [str(self._bindir / "pg_ctl"), "-D", str(self._manual_pgdata), "-m", "fast",
                                     "-w", "stop"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=120,
                )
        finally:
            shutil.rmtree(self.base, ignore_errors=True)

    # -- accounting ----------------------------------------------------------
    def postmaster_pid(self) -> int | None:
        if self._embedded is not None:
            return self._embedded.pid()
        if self._manual_pgdata is not None:
            try:
                return int((self._manual_pgdata / "postmaster.pid").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return None
        return None

    def version(self) -> str:
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return conn.execute("SHOW server_version").fetchone()[0]


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def schema_with_topic(dsn: str, topic: str = "bench", channels: tuple[str, ...] = ("c",), ordered: bool = False) -> None:
    """dmq's schema on a fresh database, and one reliable topic with its channels: what the
    statement benchmarks (insert_cost.py, ack_cost.py) run against."""
    import registry
    from dmq_server.db.schema import migrate
    from dmq_server.db.worker import connect

    migrate(dsn)
    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, topic, ordered=ordered)
        for channel in channels:
            registry.add_channel(conn, topic, channel)
