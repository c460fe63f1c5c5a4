"""Integration tests of dmq_sql.embedded against real PostgreSQL servers.

They pin down what the dmq server relies on: start() is idempotent and keeps
its DSN, data survives a clean restart and a crash (SIGKILL), the server is
reachable only on the loopback address it was given and a private Unix socket,
only with the password in the data directory's secret file (a directory made
before passwords is upgraded in place), failures name their cause, and the
pip-installed pgserver binaries work (the fallback on machines without a system
PostgreSQL, so CI must exercise it, not skip it).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import tempfile
from pathlib import Path

import psycopg
import pytest

from dmq_sql import embedded as embedded_pg
from dmq_sql.embedded import (
    EmbeddedPostgres,
    EmbeddedPostgresError,
    find_pg_bindir,
    pgserver_bindir,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def pg_dir(scratch_dir: Path) -> Path:
    return scratch_dir


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
    assert dsn.startswith("postgresql://dmq@127.0.0.1:")
    assert dsn.endswith(f"/dmq?passfile={pg_private.secret_file}")
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
    """The server listens on 127.0.0.1 only (no wildcard or other address) and on a Unix
    socket in its private directory; and it runs with the settings dmq's durability and
    latency rely on."""
    dsn = pg_private.start()
    port = pg_private.port
    assert port is not None
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SHOW listen_addresses").fetchone()[0] == "127.0.0.1"
        assert conn.execute("SHOW unix_socket_directories").fetchone()[0] == str(pg_private.socket_dir)
        assert conn.execute("SHOW password_encryption").fetchone()[0] == "scram-sha-256"
        assert conn.execute("SHOW fsync").fetchone()[0] == "on"
        assert conn.execute("SHOW synchronous_commit").fetchone()[0] == "on"
        assert conn.execute("SHOW wal_init_zero").fetchone()[0] == "off"
        assert conn.execute("SHOW backend_flush_after").fetchone()[0] == "256kB"
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
        assert pg.start() == f"postgresql://dmq@127.0.0.1:{port}/dmq?passfile={pg.secret_file}"
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


def test_each_test_gets_its_own_migrated_copy_or_an_empty_database(
    pg_dsn: str, pg_empty_dsn: str, pg_server: EmbeddedPostgres
) -> None:
    """The shared-server fixtures hand each test its own database: ``pg_dsn`` a copy of
    the session's migrated template (the schema at the latest version, no rows),
    ``pg_empty_dsn`` one without tables."""
    from dmq_sql import migrations

    def public_tables(dsn: str) -> int:
        with psycopg.connect(dsn) as conn:
            return conn.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
            ).fetchone()[0]

    assert len({pg_dsn, pg_empty_dsn, pg_server.dsn}) == 3
    assert public_tables(pg_empty_dsn) == 0
    with psycopg.connect(pg_dsn) as conn:
        latest = conn.execute("SELECT max(version) FROM dmq_schema_version").fetchone()[0]
        assert latest == [version for version, _, _ in migrations()][-1]
        assert conn.execute("SELECT count(*) FROM dmq_message").fetchone()[0] == 0


# --------------------------------------------------------------------------- authentication

#: pg_hba.conf as the code before passwords wrote it (dmq up to 128accb).
OLD_TRUST_HBA = (
    "# Written by dmq_server.db.embedded: trust the loopback interface only.\n"
    "# TYPE  DATABASE     USER  ADDRESS       METHOD\n"
    "host    all          all   127.0.0.1/32  trust\n"
    "host    all          all   ::1/128       trust\n"
    "host    replication  all   127.0.0.1/32  trust\n"
    "host    replication  all   ::1/128       trust\n"
)


def _refusal(**params: object) -> str:
    """The error of a connection that must fail (never a password from the environment)."""
    params.setdefault("passfile", os.devnull)
    with pytest.raises(psycopg.OperationalError) as info:
        psycopg.connect(connect_timeout=5, **params).close()
    return str(info.value)


def _secret(pg: EmbeddedPostgres) -> str:
    return pg.secret_file.read_text().strip().split(":")[-1]


def test_password_required_secret_file_and_socket_dir_private(pg_private: EmbeddedPostgres) -> None:
    """Knowing the address is not enough: without the password (TCP or the socket) the
    server refuses; the secret file is 0600 and the socket directory 0700; the DSN, which
    the ready banner prints, names the secret file but does not contain the secret."""
    dsn = pg_private.start()
    port = pg_private.port
    sock_dir = pg_private.socket_dir
    tcp = {"host": "127.0.0.1", "port": port, "user": "dmq", "dbname": "dmq"}
    assert "no password supplied" in _refusal(**tcp)  # the server asked for one
    assert 'password authentication failed for user "dmq"' in _refusal(**tcp, password="guess")
    assert 'password authentication failed for user "dmq"' in _refusal(
        **{**tcp, "host": str(sock_dir)}, password="guess")

    with psycopg.connect(dsn) as conn:  # the DSN's password file opens both ways in
        assert conn.execute("SELECT current_user").fetchone()[0] == "dmq"
        verifier = conn.execute("SELECT rolpassword FROM pg_authid WHERE rolname = 'dmq'").fetchone()[0]
    with psycopg.connect(dsn, host=str(sock_dir)) as conn:
        assert conn.execute("SELECT inet_server_addr() IS NULL").fetchone()[0]  # a Unix socket
    assert verifier.startswith("SCRAM-SHA-256$4096:")  # stored as a SCRAM verifier only

    assert stat.S_IMODE(pg_private.secret_file.stat().st_mode) == 0o600
    assert pg_private.secret_file.stat().st_uid == os.geteuid()
    assert stat.S_IMODE(sock_dir.stat().st_mode) == 0o700
    assert stat.S_ISSOCK((sock_dir / f".s.PGSQL.{port}").stat().st_mode)
    assert sock_dir.stat().st_uid == pg_private.pgdata.stat().st_uid  # the PostgreSQL user's
    assert _secret(pg_private) not in dsn and len(_secret(pg_private)) >= 40
    assert not embedded_pg._trusts(pg_private.pgdata / "pg_hba.conf")
    assert _secret(pg_private) not in pg_private.log_file.read_text()

    # A restart keeps the secret (the DSN of running clients stays valid).
    before = _secret(pg_private)
    pg_private.stop()
    assert EmbeddedPostgres(pg_private.data_dir).start() == dsn
    assert _secret(pg_private) == before


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runuser"), reason="needs root and runuser")
def test_other_os_users_cannot_read_the_secret_or_reach_the_socket(pg_private: EmbeddedPostgres) -> None:
    """The OS user nobody (who logged in as superuser dmq under trust) can read neither
    the secret nor the socket directory."""
    pg_private.start()
    for argv in (["cat", str(pg_private.secret_file)], ["ls", str(pg_private.socket_dir)]):
        result = subprocess.run(["runuser", "-u", "nobody", "--", *argv],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode != 0 and "Permission denied" in result.stderr, result


def _make_pre_password(pg: EmbeddedPostgres, running: bool) -> int | None:
    """Turn ``pg``'s cluster into one the code before passwords left behind: pg_hba.conf
    trusting loopback, no secret file, no password on the role, no socket, a table with
    a row to keep; started by pg_ctl as that code did when ``running``. Returns its pid."""
    dsn = pg.start()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (id int PRIMARY KEY)")
        conn.execute("INSERT INTO kept VALUES (42)")
        conn.execute("ALTER ROLE dmq PASSWORD NULL")
    pg.stop()
    (pg.pgdata / "pg_hba.conf").write_text(OLD_TRUST_HBA)
    conf = pg.pgdata / "dmq.conf"
    conf.write_text("\n".join(
        "unix_socket_directories = ''" if line.startswith("unix_socket_directories") else line
        for line in conf.read_text().splitlines()
        if not line.startswith(("unix_socket_permissions", "password_encryption"))
    ) + "\n")
    pg.secret_file.unlink()
    pg.socket_dir.rmdir()
    if not running:
        return None
    ident = pg._identity()
    result = pg._run(ident, [str(pg.bindir / "pg_ctl"), "-D", str(pg.pgdata), "-l", str(pg.log_file),
                             "-w", "start"], 90)
    assert result.returncode == 0, result.stdout
    # the hole this fixes: anyone on the machine logs in as the superuser without a password
    with psycopg.connect(host="127.0.0.1", port=pg.port, user="dmq", dbname="dmq", passfile=os.devnull) as conn:
        assert conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0]
    return pg.pid()


@pytest.mark.parametrize("running", [False, True], ids=["stopped", "still-running"])
def test_directory_made_before_passwords_is_upgraded_in_place(pg_private: EmbeddedPostgres,
                                                              running: bool) -> None:
    """A data directory of the trusting code (stopped, or its server still running) is
    upgraded by the next start(): secret generated (0600), password set, pg_hba.conf
    rewritten, the old server restarted under the new rules; the data is kept."""
    old_pid = _make_pre_password(pg_private, running)

    upgraded = EmbeddedPostgres(pg_private.data_dir)  # a new dmq version starting on it
    dsn = upgraded.start()

    assert upgraded.pid() is not None and upgraded.pid() != old_pid
    assert stat.S_IMODE(upgraded.secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(upgraded.socket_dir.stat().st_mode) == 0o700
    assert (upgraded.pgdata / "pg_hba.conf").read_text() == embedded_pg.HBA_CONF
    assert "no password supplied" in _refusal(host="127.0.0.1", port=upgraded.port, user="dmq", dbname="dmq")
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT id FROM kept").fetchall() == [(42,)]
    assert upgraded.auth_is_current()


def test_long_data_path_gets_a_private_socket_dir_in_tmp(pg_dir: Path) -> None:
    """A data path too long for a socket address puts the socket directory under the
    temporary directory, one per data directory and user, private (0700) like the other."""
    deep = pg_dir / ("d" * 60) / ("e" * 40)
    assert EmbeddedPostgres(pg_dir / "short").socket_dir == pg_dir / "short" / "pg-socket"
    pg = EmbeddedPostgres(deep)
    socket_dir = pg.socket_dir
    assert socket_dir.parent == Path(tempfile.gettempdir())
    assert socket_dir.name.startswith(f"dmq-pg-{os.geteuid()}-")
    assert socket_dir != EmbeddedPostgres(deep / "other").socket_dir
    try:
        dsn = pg.start()
        assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o700
        with psycopg.connect(dsn, host=str(socket_dir)) as conn:
            assert conn.execute("SELECT inet_server_addr() IS NULL").fetchone()[0]
    finally:
        pg.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)
