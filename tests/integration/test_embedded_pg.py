"""Integration tests of dmq_server.embedded_pg against real PostgreSQL servers.

They pin down what the dmq server relies on: start() is idempotent and keeps
its DSN, data survives a clean restart and a crash (SIGKILL), the server is
reachable only on the loopback address it was given, failures name their
cause, and the pip-installed pgserver binaries work (the fallback on machines
without a system PostgreSQL, so CI must exercise it, not skip it).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from dmq_server import embedded_pg
from dmq_server.embedded_pg import (
    EmbeddedPostgres,
    EmbeddedPostgresError,
    find_pg_bindir,
    pgserver_bindir,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def pg_dir() -> Iterator[Path]:
    """A fresh mode-755 directory for a server the test creates itself; any
    server left in it is killed and the directory removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="dmq-test-pg-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        EmbeddedPostgres(path).kill()
        shutil.rmtree(path, ignore_errors=True)


def _system_identifier(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0]


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a LISTEN socket on ``port``, read from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            addr_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A = LISTEN
                continue
            if len(addr_hex) == 8:
                found.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr_hex)[::-1]))
            else:
                raw = bytes.fromhex(addr_hex)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


def test_start_then_select_1(pg_private: EmbeddedPostgres) -> None:
    """start() returns a DSN for the superuser dmq and database dmq that answers queries."""
    dsn = pg_private.start()
    assert dsn == pg_private.dsn
    assert dsn.startswith("postgresql://dmq@127.0.0.1:") and dsn.endswith("/dmq")
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT 1, current_user, current_database(), "
                           "pg_encoding_to_char(encoding) FROM pg_database "
                           "WHERE datname = current_database()").fetchone()
    assert row == (1, "dmq", "dmq", "UTF8")
    assert pg_private.is_running()


def test_start_twice_same_dsn_without_reinitialising(pg_private: EmbeddedPostgres) -> None:
    """A second start() — on the same object or a new one for the same data
    directory — returns the same DSN and neither restarts nor re-runs initdb."""
    dsn = pg_private.start()
    ident = _system_identifier(dsn)
    pid = pg_private.pid()
    version_mtime = (pg_private.pgdata / "PG_VERSION").stat().st_mtime_ns

    assert pg_private.start() == dsn
    assert EmbeddedPostgres(pg_private.data_dir).start() == dsn
    assert pg_private.pid() == pid
    assert _system_identifier(dsn) == ident
    assert (pg_private.pgdata / "PG_VERSION").stat().st_mtime_ns == version_mtime


def test_stop_then_start_keeps_data_and_dsn(pg_private: EmbeddedPostgres) -> None:
    """A clean stop and start keeps committed data and the recorded port (same DSN)."""
    dsn = pg_private.start()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (id int PRIMARY KEY, body text)")
        conn.execute("INSERT INTO kept VALUES (1, 'hello')")

    pg_private.stop()
    assert not pg_private.is_running()
    pg_private.stop()  # stopping a stopped server is not an error

    # A new object without a port must find the recorded one.
    again = EmbeddedPostgres(pg_private.data_dir)
    assert again.start() == dsn
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT id, body FROM kept").fetchall() == [(1, "hello")]


def test_kill_then_start_recovers(pg_private: EmbeddedPostgres) -> None:
    """After SIGKILL (a crash), start() runs crash recovery and committed rows survive."""
    dsn = pg_private.start()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE crash (id int)")
        conn.execute("INSERT INTO crash SELECT generate_series(1, 1000)")
    # An open connection mid-transaction at the time of the crash, like a busy server.
    busy = psycopg.connect(dsn)
    busy.execute("INSERT INTO crash VALUES (-1)")  # never committed

    pg_private.kill()
    assert not pg_private.is_running()
    busy.close()

    assert pg_private.start() == dsn
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*), min(id) FROM crash").fetchone() == (1000, 1)
    assert "not properly shut down" in pg_private.log_file.read_text()


def test_listens_only_on_loopback_tcp(pg_private: EmbeddedPostgres) -> None:
    """The server listens on 127.0.0.1 only: no wildcard or other address, no Unix socket;
    and it runs with the settings dmq's durability and latency rely on."""
    dsn = pg_private.start()
    port = pg_private.port
    assert port is not None
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SHOW listen_addresses").fetchone()[0] == "127.0.0.1"
        assert conn.execute("SHOW unix_socket_directories").fetchone()[0] == ""
        assert conn.execute("SHOW fsync").fetchone()[0] == "on"
        assert conn.execute("SHOW synchronous_commit").fetchone()[0] == "on"
        assert conn.execute("SHOW wal_init_zero").fetchone()[0] == "off"
    assert _listening_addresses(port) == {"127.0.0.1"}
    # 127.0.0.2 is another loopback address: a wildcard listener would accept there.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()


def test_bad_bindir_gives_clear_error(pg_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong bin directory, given as argument or in DMQ_PG_BINDIR, fails with
    an EmbeddedPostgresError that names the directory and the missing binaries."""
    bogus = pg_dir / "no-such-bin"
    with pytest.raises(EmbeddedPostgresError, match="no-such-bin.*does not exist.*initdb"):
        EmbeddedPostgres(pg_dir / "data", bindir=bogus).start()

    empty = pg_dir / "empty-bin"
    empty.mkdir()
    (empty / "initdb").write_text("")
    with pytest.raises(EmbeddedPostgresError, match="lacks the executables initdb, pg_ctl, postgres"):
        EmbeddedPostgres(pg_dir / "data", bindir=empty).start()

    monkeypatch.setenv("DMQ_PG_BINDIR", str(bogus))
    with pytest.raises(EmbeddedPostgresError, match="DMQ_PG_BINDIR"):
        find_pg_bindir()


def test_explicit_port_and_settings(pg_dir: Path) -> None:
    """An explicit port is used as given and extra settings override the defaults."""
    with socket.socket() as sock:  # a port that is free right now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pg = EmbeddedPostgres(pg_dir, port=port, settings={"max_connections": "42"})
    try:
        assert pg.start() == f"postgresql://dmq@127.0.0.1:{port}/dmq"
        with psycopg.connect(pg.dsn) as conn:
            assert conn.execute("SHOW max_connections").fetchone()[0] == "42"
    finally:
        pg.stop()


def test_pgserver_bundled_binaries(pg_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The binaries shipped in the pgserver PyPI package (the fallback for machines
    without PostgreSQL) run a full cluster, chosen here through DMQ_PG_BINDIR."""
    bindir = pgserver_bindir()
    if bindir is None:
        message = "pgserver is not installed; deploy/setup.sh installs it (extra 'embedded')"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    monkeypatch.setenv("DMQ_PG_BINDIR", str(bindir))
    assert find_pg_bindir() == bindir

    pg = EmbeddedPostgres(pg_dir)
    try:
        dsn = pg.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (x int)")
            conn.execute("INSERT INTO t VALUES (7)")
        pg.kill()
        assert pg.start() == dsn
        assert pg.bindir == bindir
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT x FROM t").fetchall() == [(7,)]
            server_major = conn.info.server_version // 10000
        # The cluster really was made by pgserver's PostgreSQL, whatever the system has.
        assert (pg.pgdata / "PG_VERSION").read_text().strip() == str(server_major)
        postgres_version = subprocess.run([str(bindir / "postgres"), "--version"],
                                          capture_output=True, text=True, check=True).stdout
        assert f" {server_major}." in postgres_version
    finally:
        pg.stop()


def test_find_pg_bindir_falls_back_to_pgserver(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without system PostgreSQL (no pg_config, no /usr/lib/postgresql,
    no initdb on PATH), find_pg_bindir() returns pgserver's bundled bin directory;
    without pgserver either, the error lists everything it tried."""
    bindir = pgserver_bindir()
    if bindir is None:
        message = "pgserver is not installed; deploy/setup.sh installs it (extra 'embedded')"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    monkeypatch.delenv("DMQ_PG_BINDIR", raising=False)
    monkeypatch.setattr(embedded_pg, "_pg_config_bindir", lambda: None)
    monkeypatch.setattr(embedded_pg, "_debian_bindirs", lambda: [])
    monkeypatch.setattr(embedded_pg.shutil, "which", lambda name: None)
    assert find_pg_bindir() == bindir

    monkeypatch.setattr(embedded_pg, "pgserver_bindir", lambda: None)
    with pytest.raises(EmbeddedPostgresError) as info:
        find_pg_bindir()
    for tried in ("pg_config --bindir", "/usr/lib/postgresql/<N>/bin", "initdb on PATH", "pgserver"):
        assert tried in str(info.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root has to switch users")
def test_root_runs_postgres_as_unprivileged_user(pg_private: EmbeddedPostgres) -> None:
    """As root, the postmaster and the cluster files belong to an unprivileged user."""
    pg_private.start()
    pid = pg_private.pid()
    assert pid is not None
    uids = [line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("Uid:")][0].split()[1:]
    assert all(int(uid) != 0 for uid in uids)
    assert pg_private.pgdata.stat().st_uid == int(uids[0])


@pytest.mark.skipif(os.geteuid() != 0, reason="root cannot be locked out of a directory")
def test_root_untraversable_parent_is_explained(pg_dir: Path) -> None:
    """As root, a data directory under a parent the PostgreSQL user cannot enter
    fails early with an error naming that parent, not an obscure initdb error."""
    private = pg_dir / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(EmbeddedPostgresError, match=f"cannot enter {private}"):
        EmbeddedPostgres(private / "data").start()


def test_pg_dsn_fixture_gives_empty_database(pg_dsn: str, pg_server: EmbeddedPostgres) -> None:
    """The shared-server fixture hands each test its own empty database."""
    assert pg_dsn != pg_server.dsn
    with psycopg.connect(pg_dsn) as conn:
        tables = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchone()[0]
    assert tables == 0
