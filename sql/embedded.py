"""A private PostgreSQL server that lives under one data directory.

Why this exists: dmq keeps every message in PostgreSQL, but asking an operator to
install, configure and secure a database before the first ``dmq-server`` run makes
the quick start slow and error prone.  This module runs a *private* PostgreSQL
cluster in ``<data_dir>/pg`` that is reachable over TCP on one address
(``127.0.0.1`` by default) and a Unix socket in a private directory, only with a
password that is generated for the data directory, and owned by the dmq data
directory: stopping dmq stops nothing else, deleting the data directory deletes
the database.

Design decisions, and why:

* **Binaries** come from wherever PostgreSQL is installed (see
  :func:`find_pg_bindir`); on a machine without PostgreSQL the PyPI package
  ``pgserver`` (the ``embedded`` extra) ships relocatable binaries, so
  ``pip install`` is the only installation step.
* **Password, never trust**: the superuser ``dmq`` has a random password (the
  *secret*), stored only in ``<data_dir>/pg/dmq.pgpass`` (mode 0600, libpq's
  password-file format) and in PostgreSQL as a SCRAM-SHA-256 verifier computed
  here (the plain secret never reaches PostgreSQL or its logs).  ``pg_hba.conf``
  accepts ``scram-sha-256`` only, on the Unix socket and on loopback TCP:
  loopback is shared by every local user (an OS user ``nobody`` could log in as
  the superuser under ``trust``), so knowing the address must not be enough.
* **One DSN form** (:meth:`EmbeddedPostgres.dsn_for`, the only place that
  builds it): ``postgresql://dmq@127.0.0.1:PORT/DB?passfile=<the secret file>``.
  libpq reads the password from the file, so the DSN itself is no secret: it can
  be printed in the ready banner, logged and passed on a command line.  TCP
  rather than the socket because Spark's JDBC driver (``dmq_pipeline``) speaks
  TCP only; libpq refuses a password file readable by group or others, which
  keeps the 0600 mode honest.
* **Unix socket in a private directory** (``<data_dir>/pg-socket``, mode 0700,
  owned by the PostgreSQL user; or ``$TMPDIR/dmq-pg-<uid>-<hash>`` when that path
  is too long for a socket address): for local administration
  (``psql "host=<dir> user=dmq dbname=dmq passfile=<secret file>"``); only the
  PostgreSQL user and root can even reach it, and it asks for the password too.
* **Stable port**: the port is recorded in ``<data_dir>/pg/dmq.port`` so that a
  restart keeps the same DSN; a new cluster picks a free port derived from the
  data directory's path, outside the kernel's ephemeral range so that outgoing
  connections do not steal it while the server is down.  A supervised restart
  (``start(keep_port=True)``) never moves: a running dmq holds the DSN.
* **Upgrade in place**: a data directory made before passwords (``trust`` in
  ``pg_hba.conf``, no secret file) is converted by the next ``start()``: the
  secret is generated, the password set in single-user mode (no connection, so
  no window in which the old ``trust`` rules accept anyone) and ``pg_hba.conf``
  rewritten; a server of such a directory that is still running is stopped
  first, because its rules are in force as long as it runs.
* **Durability first**: ``fsync=on`` and ``synchronous_commit=on`` because an
  acknowledged message must survive a crash (see ``tests/integration``).
* **Root**: ``initdb`` and ``postgres`` refuse to run as root.  When this process
  is root, PostgreSQL runs as an unprivileged system user (``postgres`` if it
  exists, else a dedicated ``dmq-pg`` user created on demand).  That user must
  be able to reach the data directory and the binaries; when it cannot, a clear
  :class:`EmbeddedPostgresError` says which directory is in the way instead of
  PostgreSQL failing obscurely.
* **Crash tests**: :meth:`EmbeddedPostgres.kill` SIGKILLs the postmaster and its
  children, like a power cut for the database, and :meth:`EmbeddedPostgres.start`
  then runs PostgreSQL's crash recovery.  A running dmq-server restarts a
  postmaster that died by itself (``dmq_server.db.supervisor``).
* **Shared**: psycopg and the standard library only, so the server (through
  ``dmq_server.db.embedded``, its database seam) and the pipeline
  (``dmq_pipeline.database``) use the same private server without the pipeline
  importing the server.

Layout of ``<data_dir>/pg`` (a normal PGDATA plus these files):
``dmq.conf`` (our settings, included from ``postgresql.conf``), ``dmq.port``
(the recorded port), ``dmq.pgpass`` (the secret, mode 0600, owned by the dmq
user) and ``log/postgres.log`` (server log, rotated once at start when it
exceeds 10 MB).  Next to it, ``<data_dir>/pg-socket`` holds the Unix socket.

Why one long module: it is one concept, the private server's whole life (find the
binaries, initdb, choose and lock a port, start, wait, stop, kill, recover from a stale
pid or a changed password); split up, its steps would be one class's private methods
spread over files.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import hmac
import importlib.util
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from dmq_sql.ports import pick_port, port_free

__all__ = [
    "EmbeddedPostgres",
    "EmbeddedPostgresError",
    "find_pg_bindir",
    "pgserver_bindir",
]

_log = logging.getLogger(__name__)

#: The binaries a usable bin directory must contain.
REQUIRED_BINARIES = ("initdb", "pg_ctl", "postgres")
#: The PostgreSQL superuser created by initdb; also the user in the DSN.
SUPERUSER = "dmq"
#: The database created on first start; the DSN points at it.
DATABASE = "dmq"
#: The unprivileged OS user created when running as root and no ``postgres`` user exists.
DEDICATED_OS_USER = "dmq-pg"
#: Where root copies pgserver's binaries when the run user cannot reach them in place.
BINARY_CACHE_DIR = Path("/var/cache/dmq/pg-binaries")

#: The secret file in PGDATA: libpq's password-file format, mode 0600.
SECRET_FILE = "dmq.pgpass"
#: The private directory (under the data directory) that holds the Unix socket.
SOCKET_DIR = "pg-socket"
#: What pg_hba.conf says: a password (SCRAM) on every way in, nothing else.
#: Compared byte for byte by ``auth_is_current``, so its text (which still names the
#: module's first home) stays as data directories already have it.
HBA_CONF = (
    "# Written by dmq_server.db.embedded: the superuser's password (SCRAM-SHA-256) on the\n"
    "# private Unix socket and the loopback interface; nothing is trusted.\n"
    "# TYPE  DATABASE     USER  ADDRESS       METHOD\n"
    "local   all          all                 scram-sha-256\n"
    "host    all          all   127.0.0.1/32  scram-sha-256\n"
    "host    all          all   ::1/128       scram-sha-256\n"
    "local   replication  all                 scram-sha-256\n"
    "host    replication  all   127.0.0.1/32  scram-sha-256\n"
    "host    replication  all   ::1/128       scram-sha-256\n"
)
#: PBKDF2 rounds of the stored verifier (PostgreSQL's own default, scram_iterations).
_SCRAM_ITERATIONS = 4096
#: sun_path holds 108 bytes with the terminating NUL; PostgreSQL adds "/.s.PGSQL.<port>".
_SOCKET_PATH_MAX = 107

_LOG_ROTATE_BYTES = 10 * 1024 * 1024
_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_STOP_MODES = ("smart", "fast", "immediate")


class EmbeddedPostgresError(Exception):
    """The embedded PostgreSQL could not be found, initialised, started or stopped.

    The message always says what was attempted and, where PostgreSQL produced
    output (initdb, pg_ctl, the server log), ends with the tail of that output,
    because the operator needs it to fix the problem.
    """


# --------------------------------------------------------------------------- binaries


def _missing_binaries(bindir: Path) -> list[str]:
    return [name for name in REQUIRED_BINARIES if not os.access(bindir / name, os.X_OK)]


def pgserver_bindir() -> Path | None:
    """Return the bin directory bundled in the installed ``pgserver`` package, or None.

    The package is located with :func:`importlib.util.find_spec` and *not*
    imported: importing ``pgserver`` pulls in psutil/fasteners and registers
    atexit handlers, none of which we need to run its binaries.
    """
    try:
        spec = importlib.util.find_spec("pgserver")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "pginstall" / "bin"
        if candidate.is_dir():
            return candidate
    return None


def _pg_config_bindir() -> Path | None:
    pg_config = shutil.which("pg_config")
    if not pg_config:
        return None
    try:
        out = subprocess.run(
            [pg_config, "--bindir"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(out) if out else None


def _debian_bindirs() -> list[Path]:
    """``/usr/lib/postgresql/<N>/bin`` directories, highest major version first."""
    root = Path("/usr/lib/postgresql")
    found = []
    if root.is_dir():
        for child in root.iterdir():
            if child.name.isdigit() and (child / "bin").is_dir():
                found.append((int(child.name), child / "bin"))
    return [path for _, path in sorted(found, reverse=True)]


def _candidate_bindirs() -> Iterator[tuple[str, Path | None]]:
    """Yield ``(how it was found, bindir or None)`` in :func:`find_pg_bindir` order."""
    yield "pg_config --bindir", _pg_config_bindir()
    debian = _debian_bindirs()
    if debian:
        for path in debian:
            yield "/usr/lib/postgresql/<N>/bin", path
    else:
        yield "/usr/lib/postgresql/<N>/bin", None
    initdb = shutil.which("initdb")
    # Resolve symlinks: /usr/local/bin/initdb may point into the real bin dir.
    yield "initdb on PATH", Path(os.path.realpath(initdb)).parent if initdb else None
    yield "the pgserver package (pip install 'dmq-server[embedded]')", pgserver_bindir()


def _usable_bindirs() -> list[Path]:
    seen: list[Path] = []
    for _, path in _candidate_bindirs():
        if path is not None and not _missing_binaries(path) and path not in seen:
            seen.append(path)
    return seen


def find_pg_bindir() -> Path:
    """Return a directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    Search order (first match wins), chosen so that an explicit choice beats a
    system installation, which beats the pip-installed fallback:

    1. the environment variable ``DMQ_PG_BINDIR`` (an error if it is set but wrong);
    2. ``pg_config --bindir``, if that directory has the server binaries
       (Debian's ``pg_config`` may come from libpq-dev without a server);
    3. the highest ``/usr/lib/postgresql/<N>/bin`` (Debian/Ubuntu packages);
    4. the directory of ``initdb`` found on ``PATH``;
    5. the bin directory bundled in the ``pgserver`` PyPI package.

    Raises :class:`EmbeddedPostgresError` naming everything that was tried.
    """
    env = os.environ.get("DMQ_PG_BINDIR")
    if env:
        path = Path(env)
        missing = _missing_binaries(path)
        if missing:
            raise EmbeddedPostgresError(
                f"DMQ_PG_BINDIR={env!r} does not contain the executable PostgreSQL "
                f"binaries {', '.join(missing)}; point it at a PostgreSQL bin "
                "directory or unset it"
            )
        return path
    tried = []
    for how, candidate in _candidate_bindirs():
        if candidate is None:
            tried.append(f"{how}: not found")
            continue
        missing = _missing_binaries(candidate)
        if not missing:
            return candidate
        tried.append(f"{how}: {candidate} lacks {', '.join(missing)}")
    raise EmbeddedPostgresError(
        "no PostgreSQL server binaries found; install them with "
        "`pip install 'dmq-server[embedded]'` (PyPI package pgserver) or your system's "
        "postgresql package, or set DMQ_PG_BINDIR. Tried:\n  - " + "\n  - ".join(tried)
    )


def _major_version(bindir: Path) -> str:
    """The major version of the server binaries, e.g. ``"15"``, as PG_VERSION spells it."""
    try:
        out = subprocess.run(
            [str(bindir / "postgres"), "--version"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise EmbeddedPostgresError(f"cannot run {bindir / 'postgres'} --version: {exc}") from exc
    match = re.search(r"(\d+)(?:\.(\d+))?", out)
    if not match:
        raise EmbeddedPostgresError(f"unexpected output from {bindir / 'postgres'} --version: {out!r}")
    major = int(match.group(1))
    # Before PostgreSQL 10 the major version had two parts (9.6).
    return match.group(1) if major >= 10 else f"{match.group(1)}.{match.group(2)}"


# --------------------------------------------------------------------------- OS user (root)


class _RunAs:
    """The OS identity PostgreSQL runs under; ``None`` fields mean "this process"."""

    def __init__(self, name: str | None = None):
        self.name = name
        if name is None:
            self.uid: int = os.geteuid()
            self.gid: int = os.getegid()
            self.groups: list[int] = os.getgroups()
        else:
            entry = pwd.getpwnam(name)
            self.uid, self.gid = entry.pw_uid, entry.pw_gid
            self.groups = os.getgrouplist(name, entry.pw_gid)

    @property
    def switches(self) -> bool:
        return self.name is not None

    def popen_kwargs(self) -> dict:
        if not self.switches:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": self.groups}

    def chown(self, path: Path) -> None:
        if self.switches:
            os.chown(path, self.uid, self.gid)

    def can(self, st: os.stat_result, bits: int) -> bool:
        """Whether this identity has all permission ``bits`` (rwx as 4/2/1) on ``st``."""
        if self.uid == 0:
            return True
        if st.st_uid == self.uid:
            mode = (st.st_mode >> 6) & 7
        elif st.st_gid == self.gid or st.st_gid in self.groups:
            mode = (st.st_mode >> 3) & 7
        else:
            mode = st.st_mode & 7
        return mode & bits == bits

    def first_untraversable(self, path: Path) -> Path | None:
        """The first directory on the way to ``path`` (inclusive) this identity cannot enter."""
        path = Path(os.path.abspath(path))
        for directory in [*reversed(path.parents), path]:
            try:
                st = os.stat(directory)
            except FileNotFoundError:
                return None  # will be created by us, with a traversable mode
            if not self.can(st, 1):
                return directory
        return None


def _ensure_os_user() -> str:
    """Return the name of the unprivileged OS user that runs PostgreSQL for root.

    Uses ``postgres`` when it exists (distribution packages create it), else
    creates the system user :data:`DEDICATED_OS_USER` (idempotent).
    """
    for name in ("postgres", DEDICATED_OS_USER):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            pass
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    cmd = [useradd, "--system", "--user-group", "--no-create-home",
           "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
           "--comment", "dmq embedded PostgreSQL", DEDICATED_OS_USER]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise EmbeddedPostgresError(
            f"running as root, PostgreSQL needs an unprivileged user, and creating "
            f"{DEDICATED_OS_USER!r} failed: {exc}"
        ) from exc
    try:  # a concurrent creator may have won the race: the user exists either way
        pwd.getpwnam(DEDICATED_OS_USER)
    except KeyError:
        raise EmbeddedPostgresError(
            f"running as root, PostgreSQL needs an unprivileged user; `{' '.join(cmd)}` "
            f"failed with exit code {proc.returncode}: {proc.stderr.strip()}"
        ) from None
    _log.info("created system user %s to run the embedded PostgreSQL", DEDICATED_OS_USER)
    return DEDICATED_OS_USER


# --------------------------------------------------------------------------- processes


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _proc_state(pid: int) -> str | None:
    """The ``/proc/<pid>/stat`` state letter, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return "?"
    return data.rsplit(")", 1)[1].split()[0]


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process.

    Zombies count as dead: a killed postmaster is re-parented to PID 1, which in
    a container may never reap it, and it holds nothing any more.
    """
    if pid <= 0:
        return False
    if os.path.isdir("/proc"):
        state = _proc_state(pid)
        return state is not None and state not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_postgres(pid: int) -> bool:
    """Whether ``pid`` is alive and runs a PostgreSQL binary (guards against PID reuse)."""
    if not _pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return True  # no /proc: trust the pid file
    return comm.startswith("postgres") or comm.startswith("postmaster")


def _children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (PostgreSQL's backends and auxiliary processes)."""
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = data.rsplit(")", 1)[1].split()
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry))
    return found


def _conf_value(value: object) -> str:
    """Quote a setting for postgresql.conf (every type accepts a quoted value)."""
    if isinstance(value, bool):
        value = "on" if value else "off"
    return "'" + str(value).replace("\\", "\\\\").replace("'", "''") + "'"


def _trusts(hba: Path) -> bool:
    """Whether a pg_hba.conf has a ``trust`` rule (a directory made before passwords)."""
    try:
        lines = hba.read_text().splitlines()
    except OSError:
        return False
    return any(line.split()[-1:] == ["trust"] for line in lines if not line.lstrip().startswith("#"))


def scram_verifier(password: str, salt: bytes | None = None, iterations: int = _SCRAM_ITERATIONS) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802/7677).

    Computed here so that ``ALTER ROLE ... PASSWORD`` carries only the verifier:
    the plain secret never reaches PostgreSQL, its output or its logs.  The
    secrets this module generates are ASCII, for which SASLprep changes nothing.
    """
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def _read_secret(path: Path) -> str | None:
    """The password in a secret file written by this module, or None if there is none."""
    try:
        line = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise EmbeddedPostgresError(f"cannot read the embedded PostgreSQL's secret {path}: {exc}") from exc
    fields = line.split(":")
    if len(fields) != 5 or fields[3] != SUPERUSER or not fields[4]:
        return None  # damaged: a new secret replaces it
    return fields[4]


def _write_secret(path: Path, secret: str) -> None:
    """Write ``*:*:*:dmq:<secret>`` (libpq's password file) created with mode 0600.

    Created 0600 from the first byte (O_EXCL on a fresh temporary name, then an
    atomic rename), never written with a wider mode and narrowed afterwards.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, f"*:*:*:{SUPERUSER}:{secret}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the server


class EmbeddedPostgres:
    """One private PostgreSQL cluster in ``<data_dir>/pg``, listening only on ``host``.

    ``start()`` is idempotent (initialises on first use, returns the DSN of an
    already running server), ``stop()`` is a no-op when nothing runs, and
    ``kill()`` simulates a crash.  Several objects, even in several processes,
    may manage the same data directory: an exclusive lock on the directory
    serialises their start/stop.
    """

    def __init__(
        self,
        data_dir: Path | str,
        port: int | None = None,
        host: str = "127.0.0.1",
        bindir: Path | None = None,
        settings: dict[str, str] | None = None,
    ):
        self.data_dir = Path(os.path.abspath(data_dir))
        self.pgdata = self.data_dir / "pg"
        self.host = host
        self._explicit_port = port
        self.port: int | None = port
        self._bindir = Path(bindir) if bindir is not None else None
        self._extra_settings = dict(settings or {})
        for name in self._extra_settings:
            if not _SETTING_NAME.match(name):
                raise EmbeddedPostgresError(f"invalid PostgreSQL setting name {name!r}")
        self._run_as: _RunAs | None = None

    # ------------------------------------------------------------------ paths & state

    @property
    def log_file(self) -> Path:
        """The server log (stdout/stderr of the postmaster)."""
        return self.pgdata / "log" / "postgres.log"

    @property
    def port_file(self) -> Path:
        return self.pgdata / "dmq.port"

    @property
    def secret_file(self) -> Path:
        """The superuser's password in libpq's password-file format (mode 0600).

        Every DSN names it (``passfile=``); whoever can read it is the superuser.
        """
        return self.pgdata / SECRET_FILE

    @property
    def socket_dir(self) -> Path:
        """The private directory (mode 0700) of the Unix socket.

        ``<data_dir>/pg-socket`` unless that path is too long for a socket address
        (about 100 bytes), then ``$TMPDIR/dmq-pg-<uid>-<hash of the data dir>``.
        """
        preferred = self.data_dir / SOCKET_DIR
        if len(os.fsencode(preferred / ".s.PGSQL.65535")) <= _SOCKET_PATH_MAX:
            return preferred
        digest = zlib.crc32(str(self.data_dir).encode())
        return Path(tempfile.gettempdir()) / f"dmq-pg-{os.geteuid()}-{digest:08x}"

    @property
    def bindir(self) -> Path:
        """The PostgreSQL bin directory in use (searched for on first use)."""
        if self._bindir is None:
            self._bindir = self._choose_bindir()
        return self._bindir

    def settings(self) -> dict[str, str]:
        """The server settings written to ``dmq.conf``: defaults, then overrides."""
        values: dict[str, object] = {
            "listen_addresses": self.host,
            "unix_socket_directories": str(self.socket_dir),
            "unix_socket_permissions": "0700",
            "password_encryption": "scram-sha-256",
            "max_connections": 100,
            "shared_buffers": "128MB",
            "fsync": "on",
            "synchronous_commit": "on",
            "full_page_writes": "on",
            # A new WAL segment is created, not zero-filled: filling 16 MB (and its fsync)
            # happens under the WAL write lock, so every commit waited about 20 ms each time
            # the WAL crossed a segment (every 3.6 s at 5,000 msgs/s; a fresh cluster has no
            # recycled segments). The last byte is still written, so the size is fixed.
            "wal_init_zero": "off",
            # A backend that writes data pages out of shared_buffers asks the kernel to
            # write them back every 256 kB, instead of leaving them dirty in the page cache:
            # the kernel wrote 130-310 MB of them back at once 30 s later, and the WAL
            # fdatasync of every commit waited behind it (stalls of 120-200 ms in the steady
            # scenario, 55-85 ms with this setting; docs/benchmarks.md, session 16). The
            # rest is the kernel's to fix (docs/operations.md: vm.dirty_background_bytes).
            "backend_flush_after": "256kB",
            "logging_collector": "off",
            "log_timezone": "UTC",
            "timezone": "UTC",
        }
        values.update(self._extra_settings)
        return {k: str(v) for k, v in values.items()}

    @property
    def dsn(self) -> str:
        """``postgresql://dmq@HOST:PORT/dmq?passfile=...`` for the current or recorded port."""
        return self.dsn_for(DATABASE)

    def dsn_for(self, database: str) -> str:
        """The DSN of a database on this server; the one place that builds a DSN for it.

        The password is not in the DSN: ``passfile`` names :attr:`secret_file`, from
        which libpq reads it, so the DSN may be printed and passed on command lines.
        The server itself, ``dmq --data-path``, ``dmq-pipeline --data-path`` (psycopg,
        and Spark's JDBC through the password the connection used), the bench and
        deploy scripts and the tests' fixtures all connect with what this returns.
        """
        port = self.port
        if port is None:
            port = self._running_port() or self._recorded_port()
        if port is None:
            raise EmbeddedPostgresError(
                f"the embedded PostgreSQL in {self.pgdata} has no port yet; call start() first"
            )
        host = f"[{self.host}]" if ":" in self.host else self.host
        passfile = urllib.parse.quote(str(self.secret_file), safe="/")
        return f"postgresql://{SUPERUSER}@{host}:{port}/{database}?passfile={passfile}"

    def _read_pidfile(self) -> list[str] | None:
        try:
            return (self.pgdata / "postmaster.pid").read_text().splitlines()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except PermissionError as exc:
            raise EmbeddedPostgresError(f"cannot read {self.pgdata / 'postmaster.pid'}: {exc}") from exc

    def pid(self) -> int | None:
        """The postmaster's PID if it is running, else None."""
        lines = self._read_pidfile()
        if not lines:
            return None
        try:
            pid = int(lines[0])
        except ValueError:
            return None
        return pid if _is_postgres(pid) else None

    def is_running(self) -> bool:
        """Whether a postmaster for this data directory is alive."""
        return self.pid() is not None

    def _running_port(self) -> int | None:
        lines = self._read_pidfile()
        if lines and len(lines) >= 4 and self.pid() is not None:
            try:
                return int(lines[3])
            except ValueError:
                return None
        return None

    def _recorded_port(self) -> int | None:
        try:
            return int(self.port_file.read_text().strip())
        except (OSError, ValueError):
            return None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialise start/stop on this data directory across processes (flock on the dir)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.data_dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    # ------------------------------------------------------------------ identity & binaries

    def _identity(self) -> _RunAs:
        if self._run_as is None:
            self._run_as = _RunAs(_ensure_os_user()) if os.geteuid() == 0 else _RunAs()
        return self._run_as

    def _choose_bindir(self) -> Path:
        """Pick binaries, preferring ones that match an existing cluster's major version.

        A cluster initialised by PostgreSQL 16 (pgserver) cannot be opened by 15
        (Debian), so when ``PG_VERSION`` exists we take the first candidate of
        that version instead of failing on the first candidate found.
        """
        first = find_pg_bindir()
        try:
            wanted = (self.pgdata / "PG_VERSION").read_text().strip()
        except OSError:
            return first
        if os.environ.get("DMQ_PG_BINDIR") or _major_version(first) == wanted:
            return first
        for candidate in _usable_bindirs():
            if _major_version(candidate) == wanted:
                return candidate
        return first  # start() reports the version mismatch clearly

    def _runnable_bindir(self, ident: _RunAs) -> Path:
        """The bin directory, made reachable for the (unprivileged) run user.

        When root runs PostgreSQL as another user, that user must be able to
        reach the binaries. pgserver's binaries live in a virtualenv that may sit
        under a private directory such as /root; they are relocatable, so we copy
        their install tree once to :data:`BINARY_CACHE_DIR`.
        """
        bindir = self.bindir
        missing = _missing_binaries(bindir)
        if missing:
            what = "does not exist" if not bindir.is_dir() else f"lacks the executables {', '.join(missing)}"
            raise EmbeddedPostgresError(
                f"PostgreSQL bin directory {bindir} {what}; it needs {', '.join(REQUIRED_BINARIES)} "
                "(pass another bindir, set DMQ_PG_BINDIR, or leave both unset to search)"
            )
        if not ident.switches:
            return bindir
        blocked = ident.first_untraversable(bindir)
        if blocked is None and all(ident.can(os.stat(bindir / b), 1) for b in REQUIRED_BINARIES):
            return bindir
        prefix = bindir.parent
        if not all((prefix / d).is_dir() for d in ("lib", "share")):
            raise EmbeddedPostgresError(
                f"PostgreSQL runs as user {ident.name!r}, which cannot reach the binaries in "
                f"{bindir} (directory {blocked} is not searchable by it); "
                f"`chmod o+x {blocked}` or use binaries elsewhere (DMQ_PG_BINDIR)"
            )
        # pgserver's wheel keeps shared libraries in site-packages/pgserver.libs and
        # finds them through RPATH $ORIGIN/../../../pgserver.libs: keep that shape.
        package = prefix.parent
        libs = package.parent / f"{package.name}.libs"
        st = os.stat(bindir / "postgres")
        key = f"{zlib.crc32(str(prefix).encode()):08x}-{st.st_size}-{int(st.st_mtime)}"
        target = BINARY_CACHE_DIR / key
        new_bindir = target / package.name / prefix.name / "bin"
        if not (new_bindir / "postgres").exists():
            BINARY_CACHE_DIR.mkdir(parents=True, exist_ok=True)
            for directory in [*reversed(BINARY_CACHE_DIR.parents), BINARY_CACHE_DIR]:
                if not ident.can(os.stat(directory), 1):
                    raise EmbeddedPostgresError(
                        f"cannot make the PostgreSQL binaries reachable for user {ident.name!r}: "
                        f"{directory} is not searchable by it"
                    )
            staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=BINARY_CACHE_DIR))
            try:
                for part in ("bin", "lib", "share"):
                    shutil.copytree(prefix / part, staging / package.name / prefix.name / part,
                                    symlinks=True)
                if libs.is_dir():
                    shutil.copytree(libs, staging / libs.name, symlinks=True)
                for directory in (staging, staging / package.name, staging / package.name / prefix.name):
                    os.chmod(directory, 0o755)
                os.rename(staging, target)
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)
                if not (new_bindir / "postgres").exists():
                    raise
            _log.info("copied PostgreSQL binaries from %s to %s for user %s", prefix, target, ident.name)
        return new_bindir

    def _prepare_data_dir(self, ident: _RunAs) -> None:
        """Create ``data_dir`` and ``pg/`` so that the run user can use them."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not ident.switches:
            return
        st = os.stat(self.data_dir)
        if not ident.can(st, 1) and st.st_uid == os.geteuid():
            # Our own data directory: allow the PostgreSQL user to pass through it
            # (search only: it still cannot list or read dmq's other files).
            os.chmod(self.data_dir, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
        blocked = ident.first_untraversable(self.data_dir)
        if blocked is not None:
            raise EmbeddedPostgresError(
                f"PostgreSQL must run as the unprivileged user {ident.name!r} because this "
                f"process is root, but that user cannot enter {blocked} (mode "
                f"{stat.S_IMODE(os.stat(blocked).st_mode):o}) on the way to {self.pgdata}. "
                f"Put the data directory elsewhere (e.g. under /var/lib or /tmp) or "
                f"`chmod o+x {blocked}`."
            )
        if not self.pgdata.exists():
            self.pgdata.mkdir(mode=0o700)
        st = os.stat(self.pgdata)
        if st.st_uid != ident.uid:
            # The cluster was made by another user (e.g. postgres vs dmq-pg):
            # PostgreSQL insists on owning every file of its data directory.
            for root, dirs, files in os.walk(self.pgdata):
                for name in [*dirs, *files]:
                    os.lchown(os.path.join(root, name), ident.uid, ident.gid)
            os.chown(self.pgdata, ident.uid, ident.gid)

    def _run(
        self, ident: _RunAs, args: list[str], timeout: float, stdin: str | None = None
    ) -> subprocess.CompletedProcess:
        """Run a PostgreSQL tool as the run user, output captured via temp files.

        Temp files rather than pipes: a postmaster started by pg_ctl must never
        inherit a pipe we wait on, or we would wait for it forever.  ``stdin``
        (single-user mode's commands) goes through an unlinked temp file too.
        """
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as given:
            if stdin is not None:
                given.write(stdin)
                given.flush()
                given.seek(0)
            try:
                proc = subprocess.run(
                    args, stdin=given if stdin is not None else subprocess.DEVNULL,
                    stdout=out, stderr=subprocess.STDOUT,
                    env=env, cwd="/", timeout=timeout, **ident.popen_kwargs(),
                )
            except subprocess.TimeoutExpired as exc:
                out.seek(0)
                raise EmbeddedPostgresError(
                    f"`{' '.join(args)}` did not finish within {timeout:.0f}s:\n{_tail(out.read())}"
                ) from exc
            except OSError as exc:
                raise EmbeddedPostgresError(f"cannot run `{' '.join(args)}`: {exc}") from exc
            out.seek(0)
            return subprocess.CompletedProcess(args, proc.returncode, out.read(), None)

    def _write(self, ident: _RunAs, path: Path, text: str, mode: int = 0o600) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.chmod(tmp, mode)
        ident.chown(tmp)
        os.replace(tmp, path)

    # ------------------------------------------------------------------ lifecycle

    def _initdb(self, ident: _RunAs, bindir: Path, timeout: float) -> None:
        args = [
            str(bindir / "initdb"), "-D", str(self.pgdata), "-U", SUPERUSER,
            # "reject" until _ensure_auth sets the password and writes HBA_CONF (before the
            # first start): at no moment does this cluster trust anyone.
            "--encoding=UTF8", "--locale=C", "--auth-local=reject", "--auth-host=reject",
            "--no-instructions",
        ]
        result = self._run(ident, args, timeout)
        if result.returncode != 0:
            raise EmbeddedPostgresError(
                f"initdb failed (exit code {result.returncode}) for {self.pgdata}:\n"
                f"{_tail(result.stdout)}"
            )
        conf = self.pgdata / "postgresql.conf"
        with conf.open("a") as f:
            f.write("\n# dmq: settings managed by dmq_sql.embedded\ninclude_if_exists = 'dmq.conf'\n")

    def auth_is_current(self) -> bool:
        """Whether the cluster asks for the password this data directory's secret holds.

        False for a directory made before passwords (``trust``, no secret file), or
        one whose secret file or ``pg_hba.conf`` was removed or edited: ``start()``
        then (re)sets the password and rewrites ``pg_hba.conf``.
        """
        try:
            hba = (self.pgdata / "pg_hba.conf").read_text()
        except OSError:
            return False
        return hba == HBA_CONF and _read_secret(self.secret_file) is not None

    def _ensure_auth(self, ident: _RunAs, bindir: Path, timeout: float) -> None:
        """Make password authentication with this directory's secret the only way in.

        Runs while no postmaster does (inside ``start()``'s lock).  In order, so that
        an interruption at any point is repaired by the next start: the secret file
        (kept if it is valid), the password in single-user mode (no sockets open, so
        the old rules never admit anyone meanwhile), then ``pg_hba.conf``.
        """
        secret = _read_secret(self.secret_file)
        if secret is not None:
            mode = stat.S_IMODE(os.stat(self.secret_file).st_mode)
            if mode != 0o600:
                # libpq ignores a password file that group or others may read
                _log.warning("%s had mode %o; set to 600", self.secret_file, mode)
                os.chmod(self.secret_file, 0o600)
        if self.auth_is_current():
            return
        upgrade = _trusts(self.pgdata / "pg_hba.conf")
        if secret is None:
            secret = secrets.token_urlsafe(32)  # letters, digits, - and _: no ':' to escape
            _write_secret(self.secret_file, secret)
        verifier = scram_verifier(secret)
        result = self._run(ident, [
            str(bindir / "postgres"), "--single", "-D", str(self.pgdata),
            "-c", "exit_on_error=on", "-c", "log_statement=none", "postgres",
        ], timeout, stdin=f'ALTER ROLE "{SUPERUSER}" PASSWORD \'{verifier}\';\n')
        if result.returncode != 0 or "ERROR:" in result.stdout or "FATAL:" in result.stdout:
            raise EmbeddedPostgresError(
                f"setting the password of {SUPERUSER!r} in single-user mode failed (exit code "
                f"{result.returncode}) for {self.pgdata}:\n{_tail(result.stdout)}"
            )
        self._write(ident, self.pgdata / "pg_hba.conf", HBA_CONF)
        if upgrade:
            _log.warning(
                "embedded PostgreSQL in %s trusted local connections; it now requires the "
                "password in %s (SCRAM-SHA-256)", self.pgdata, self.secret_file,
            )

    def _prepare_socket_dir(self, ident: _RunAs) -> None:
        """Create the socket directory: a real directory, owned by the run user, mode 0700.

        In the shared temporary directory (long data paths) someone else may have
        created the name first: anything but our own private directory is refused.
        """
        path = self.socket_dir
        try:
            path.mkdir(mode=0o700)
            ident.chown(path)
        except FileExistsError:
            pass
        st = os.lstat(path)
        ours = path.parent == self.data_dir
        if not stat.S_ISDIR(st.st_mode):
            raise EmbeddedPostgresError(f"the socket directory {path} exists but is not a directory")
        if st.st_uid != ident.uid:
            if not ours:
                raise EmbeddedPostgresError(
                    f"the socket directory {path} belongs to uid {st.st_uid}, not to the "
                    f"PostgreSQL user (uid {ident.uid}); remove it or use a shorter --data-path"
                )
            os.chown(path, ident.uid, ident.gid)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(path, 0o700)

    def _version_check(self, bindir: Path) -> None:
        try:
            have = (self.pgdata / "PG_VERSION").read_text().strip()
        except OSError:
            return
        binaries = _major_version(bindir)
        if have != binaries:
            raise EmbeddedPostgresError(
                f"the cluster in {self.pgdata} was created by PostgreSQL {have}, but the "
                f"binaries in {bindir} are PostgreSQL {binaries}; set DMQ_PG_BINDIR to a "
                f"PostgreSQL {have} bin directory (or dump and recreate the data directory)"
            )

    def _rotate_log(self, ident: _RunAs) -> None:
        logdir = self.log_file.parent
        if not logdir.exists():
            logdir.mkdir(mode=0o700)
            ident.chown(logdir)
        try:
            if self.log_file.stat().st_size > _LOG_ROTATE_BYTES:
                os.replace(self.log_file, self.log_file.with_name("postgres.log.1"))
        except FileNotFoundError:
            pass

    def _log_tail(self) -> str:
        try:
            return _tail(self.log_file.read_text(errors="replace"))
        except OSError:
            return "(no server log)"

    def _clear_stale_pidfile(self) -> None:
        """Remove a postmaster.pid (and socket lock files) whose process is certainly gone.

        PostgreSQL treats a pid file as live when ``kill(pid, 0)`` succeeds, which
        is also true for an unreaped zombie or an unrelated process that reused
        the PID; then it would refuse to start after a crash.
        """
        lines = self._read_pidfile()
        if lines is not None and self.pid() is None:
            try:
                (self.pgdata / "postmaster.pid").unlink()
            except FileNotFoundError:
                pass
        # The socket's lock file has the same check and the same problem: after a
        # SIGKILL, "lock file .s.PGSQL.<port>.lock already exists" would block the
        # restart. The directory is this cluster's alone and its postmaster is not
        # running (we hold the start lock), so whatever is left in it is stale.
        if self.pid() is None:
            try:
                stale = list(self.socket_dir.glob(".s.PGSQL.*"))
            except OSError:
                stale = []
            for path in stale:
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass

    def _connect_admin(self, port: int, deadline: float) -> psycopg.Connection:
        host = self.host
        last: Exception | None = None
        while True:
            try:
                return psycopg.connect(
                    self.dsn_for("postgres"), port=port, autocommit=True, connect_timeout=5,
                )
            except psycopg.OperationalError as exc:
                last = exc
            if time.monotonic() > deadline or not self.is_running():
                raise EmbeddedPostgresError(
                    f"PostgreSQL in {self.pgdata} does not accept connections on "
                    f"{host}:{port}: {last}\nserver log tail:\n{self._log_tail()}"
                )
            time.sleep(0.1)

    def _ensure_database(self, port: int, deadline: float) -> None:
        with self._connect_admin(port, deadline) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)
            ).fetchone()
            if not exists:
                try:
                    conn.execute(f'CREATE DATABASE "{DATABASE}"')
                except psycopg.errors.DuplicateDatabase:
                    pass

    def start(self, timeout: float = 60, keep_port: bool = False) -> str:
        """Initialise (first time), start, wait until it accepts connections; return the DSN.

        If a server for this data directory is already running, its DSN is
        returned and nothing is restarted, unless it still runs with the rules of
        a directory made before passwords: then it is stopped and started again
        with password authentication (see :meth:`_ensure_auth`).  ``keep_port``:
        fail rather than move to another port when the recorded one is taken (a
        running dmq holds the DSN; its supervisor retries later).  Raises
        :class:`EmbeddedPostgresError` with initdb/pg_ctl output and the server log
        tail on failure.
        """
        deadline = time.monotonic() + timeout
        with self._locked():
            running = self._running_port()
            if running is not None and self.auth_is_current():
                self.port = running
                self._ensure_database(running, deadline)
                return self.dsn
            if running is not None:
                _log.warning("stopping the embedded PostgreSQL in %s to require a password", self.pgdata)
                self._stop_locked("fast", max(deadline - time.monotonic(), 5))
            ident = self._identity()
            self._prepare_data_dir(ident)
            bindir = self._runnable_bindir(ident)
            if not (self.pgdata / "PG_VERSION").exists():
                self._initdb(ident, bindir, max(deadline - time.monotonic(), 30))
            self._version_check(bindir)
            self._clear_stale_pidfile()
            self._rotate_log(ident)
            self._prepare_socket_dir(ident)
            self._ensure_auth(ident, bindir, max(deadline - time.monotonic(), 30))

            recorded = self._recorded_port()
            port = self._explicit_port or recorded
            auto = self._explicit_port is None and not (keep_port and recorded is not None)
            if port is None or (auto and not port_free(self.host, port)):
                if port is not None:
                    _log.warning("recorded port %s for %s is taken; choosing another", port, self.pgdata)
                port = pick_port(self.host, str(self.data_dir), avoid={port} if port else set())
            tried: set[int] = set()
            while True:
                self._write_config(ident, port)
                result = self._run(ident, [
                    str(bindir / "pg_ctl"), "-D", str(self.pgdata), "-l", str(self.log_file),
                    "-w", "-t", str(max(int(deadline - time.monotonic()), 5)), "start",
                ], max(deadline - time.monotonic(), 5) + 30)
                if result.returncode == 0:
                    break
                tried.add(port)
                log = self._log_tail()
                if auto and "could not bind" in log and len(tried) < 5 and not self.is_running():
                    # Someone took the port between our check and the bind: pick again.
                    port = pick_port(self.host, str(self.data_dir), avoid=tried)
                    continue
                raise EmbeddedPostgresError(
                    f"pg_ctl start failed (exit code {result.returncode}) for {self.pgdata} on "
                    f"{self.host}:{port}:\n{_tail(result.stdout)}\nserver log tail "
                    f"({self.log_file}):\n{log}"
                )
            self.port = self._running_port() or port
            if recorded != self.port:
                self._write(ident, self.port_file, f"{self.port}\n", 0o644)
            self._ensure_database(self.port, deadline)
            return self.dsn

    def _write_config(self, ident: _RunAs, port: int) -> None:
        values = {**self.settings(), "port": str(port)}
        lines = ["# Written by dmq_sql.embedded at every start; edits are overwritten.",
                 "# Pass settings={...} to EmbeddedPostgres to change them."]
        lines += [f"{name} = {_conf_value(value)}" for name, value in values.items()]
        self._write(ident, self.pgdata / "dmq.conf", "\n".join(lines) + "\n")

    def stop(self, mode: str = "fast", timeout: float = 60) -> None:
        """Stop the server with ``pg_ctl stop -m mode``; do nothing if it is not running.

        ``fast`` (default) rolls back open transactions and checkpoints;
        ``smart`` waits for clients to leave; ``immediate`` is crash-like.
        """
        if mode not in _STOP_MODES:
            raise ValueError(f"stop mode must be one of {_STOP_MODES}, not {mode!r}")
        if not self.pgdata.is_dir():
            return
        with self._locked():
            self._stop_locked(mode, timeout)

    def _stop_locked(self, mode: str, timeout: float) -> None:
        if not self.is_running():
            return
        ident = self._identity()
        bindir = self._runnable_bindir(ident)
        result = self._run(ident, [
            str(bindir / "pg_ctl"), "-D", str(self.pgdata), "-m", mode,
            "-w", "-t", str(max(int(timeout), 1)), "stop",
        ], timeout + 30)
        if result.returncode != 0 and self.is_running():
            raise EmbeddedPostgresError(
                f"pg_ctl stop -m {mode} failed (exit code {result.returncode}) for "
                f"{self.pgdata}:\n{_tail(result.stdout)}"
            )

    def kill(self, timeout: float = 30) -> None:
        """SIGKILL the postmaster and its children, like a crash; wait until all are gone.

        The children are killed too because a backend orphaned by its postmaster
        can linger and keep the shared memory in use, which would make the next
        ``start()`` fail instead of running crash recovery.
        """
        pid = self.pid()
        if pid is None:
            return
        try:
            # Freeze the postmaster first so that it cannot fork while we list its children.
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
        victims = [pid, *_children(pid)]
        for victim in victims:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while any(_pid_alive(v) for v in victims):
            if time.monotonic() > deadline:
                raise EmbeddedPostgresError(f"PostgreSQL processes {victims} survived SIGKILL")
            time.sleep(0.02)

    def __repr__(self) -> str:
        return f"EmbeddedPostgres({str(self.data_dir)!r}, host={self.host!r}, port={self.port!r})"
