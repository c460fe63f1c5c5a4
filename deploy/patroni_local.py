"""A Patroni cluster on one machine: a primary and two standbys for dmq to use.

Three PostgreSQL servers, each run by its own ``patroni`` process (Debian's package,
installed by ``deploy/setup.sh --ha``), sharing one ZooKeeper as Patroni's DCS (kazoo,
the client dmq already uses). Each member has its own ports and data directory under
the cluster's base directory, listens on 127.0.0.1 only and asks every client for a
password (SCRAM). The cluster runs in synchronous mode with
``synchronous_mode_strict``: a commit returns only once a synchronous standby has
flushed it, so the ack dmq sends after it promises a copy on two machines, and
Patroni promotes only that standby. With no standby left, commits wait instead of
becoming single copies (docs/operations.md, "PostgreSQL high availability").

dmq reaches the cluster through a multi-host DSN with ``target_session_attrs=read-write``
(libpq tries the members in turn and keeps the one that accepts writes), with the
``dmq`` role's password in a passfile beside it, never in the DSN itself.

Used by ``deploy/ha-local.sh`` (through ``deploy/cluster-local.sh --ha``) and by the
fault-injection suite (tests/chaos, bench/chaos.py), which kill, pause and restart
members:

    python deploy/patroni_local.py start DIR ZK_HOSTS [FIRST_PORT]   # prints the DSN
    python deploy/patroni_local.py stop DIR

The settings themselves are ``member_config``'s; deploy/patroni/pg1.yml.example is
the same configuration written out for three hosts (a unit test keeps them alike).

Why one long module: it runs before anything of dmq is known to work, from the shell
script and from the tests alike, so it stands alone (standard library, psycopg for the
first database); the members, the cluster and the command line are one recipe.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from dmq_sql.ports import fresh_port

__all__ = ["PatroniCluster", "PatroniMember", "member_config", "DCS_SETTINGS"]

SCOPE = "dmq"
# The cluster-wide settings Patroni keeps in the DCS (bootstrap.dcs): synchronous and
# strict (no acknowledged commit on one copy only), one synchronous standby, pg_rewind
# so a failed primary comes back as a standby by itself. ttl is also the ZooKeeper
# session timeout Patroni asks for (the server may cap it: with tickTime 250 ms at 5 s),
# so a dead primary's leader key goes when its session expires; loop_wait 1 s lets the
# standbys notice at once. Patroni requires loop_wait + 2 * retry_timeout <= ttl.
# failsafe_mode: while ZooKeeper cannot be reached, the primary stays primary as long as
# every member answers it over the REST API; without it Patroni demotes the primary
# retry_timeout after losing the DCS, so a ZooKeeper restart stopped every write to dmq
# (chaos zk-restart: 2-7 s of SEND_SERVER_ERROR after ZooKeeper was already back).
DCS_SETTINGS: dict[str, Any] = {
    "ttl": 20,
    "loop_wait": 1,
    "retry_timeout": 5,
    "failsafe_mode": True,
    "maximum_lag_on_failover": 1048576,
    "synchronous_mode": True,
    "synchronous_mode_strict": True,
    "synchronous_node_count": 1,
    "postgresql": {
        "use_pg_rewind": True,
        "use_slots": True,
        "parameters": {
            "wal_level": "replica",
            "hot_standby": "on",
            "wal_log_hints": "on",
            "max_wal_senders": 10,
            "max_replication_slots": 10,
            "wal_keep_size": "256MB",
            "synchronous_commit": "on",
            "max_connections": 200,
        },
    },
}
USERS = ("superuser", "replication", "rewind", "dmq")
USER_NAMES = {"superuser": "postgres", "replication": "replicator", "rewind": "rewinder", "dmq": "dmq"}


def pg_bindir() -> Path:
    """The newest /usr/lib/postgresql/<version>/bin (Debian's layout)."""
    found = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "pg_ctl").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if not found:
        raise RuntimeError("no PostgreSQL server binaries under /usr/lib/postgresql (apt-get install postgresql)")
    return found[-1]


def patroni_command() -> list[str]:
    exe = shutil.which("patroni")
    if exe is None:
        raise RuntimeError("patroni is not installed (bash deploy/setup.sh --ha installs Debian's package)")
    return [exe]


def member_config(name: str, *, pg_port: int, api_port: int, data_dir: Path, run_dir: Path,
                  zk_hosts: list[str], passwords: dict[str, str], bindir: Path) -> dict[str, Any]:
    """One member's Patroni configuration (YAML is a superset of JSON, so it is written as JSON)."""
    auth = {role: {"username": USER_NAMES[role], "password": passwords[role]}
            for role in ("superuser", "replication", "rewind")}
    hba = [
        "local all all peer",
        f"host replication {USER_NAMES['replication']} 127.0.0.1/32 scram-sha-256",
        "host all all 127.0.0.1/32 scram-sha-256",
    ]
    return {
        "scope": SCOPE,
        "namespace": "/service/",
        "name": name,
        "restapi": {"listen": f"127.0.0.1:{api_port}", "connect_address": f"127.0.0.1:{api_port}"},
        "zookeeper": {"hosts": zk_hosts},
        "bootstrap": {
            "dcs": DCS_SETTINGS,
            "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, "data-checksums",
                       {"auth-host": "scram-sha-256"}, {"auth-local": "peer"}],
            "pg_hba": hba,
        },
        "postgresql": {
            "listen": f"127.0.0.1:{pg_port}",
            "connect_address": f"127.0.0.1:{pg_port}",
            "data_dir": str(data_dir),
            "bin_dir": str(bindir),
            "pgpass": str(run_dir / "pgpass"),
            "authentication": auth,
            "parameters": {"unix_socket_directories": str(run_dir), "password_encryption": "scram-sha-256"},
            "pg_hba": hba,
        },
        "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
    }


def _run_user() -> tuple[int, int] | None:
    """Root runs Patroni (and so PostgreSQL, which refuses root) as ``postgres``."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError("running as root, Patroni needs the system user postgres (Debian's postgresql package)")
    return entry.pw_uid, entry.pw_gid


def _children(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (read from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.append(int(stat.parent.name))
    return found


def _http_json(url: str, timeout: float = 1.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None


class PatroniMember:
    """One ``patroni`` process and the PostgreSQL it runs."""

    def __init__(self, cluster: "PatroniCluster", name: str, pg_port: int, api_port: int):
        self.cluster = cluster
        self.name = name
        self.pg_port = pg_port
        self.api_port = api_port
        self.dir = cluster.base / name
        self.data_dir = self.dir / "data"
        self.config_path = self.dir / "patroni.yml"
        self.log_path = self.dir / "patroni.log"
        self.proc: subprocess.Popen | None = None

    def write_config(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        config = member_config(
            self.name, pg_port=self.pg_port, api_port=self.api_port, data_dir=self.data_dir,
            run_dir=self.dir, zk_hosts=self.cluster.zk_hosts, passwords=self.cluster.passwords,
            bindir=self.cluster.bindir,
        )
        self.config_path.write_text(json.dumps(config, indent=2) + "\n")
        self.config_path.chmod(0o600)  # it holds the passwords
        user = _run_user()
        if user is not None:
            for path in (self.dir, self.config_path):
                os.chown(path, *user)
        self.dir.chmod(0o700)

    def start(self) -> "PatroniMember":
        if self.proc is not None and self.proc.poll() is None:
            return self
        if not self.config_path.exists():
            self.write_config()
        user = _run_user()
        log = open(self.log_path, "ab")
        env = dict(os.environ, HOME=str(self.dir), PGPASSFILE=str(self.dir / "pgpass"))
        self.proc = subprocess.Popen(
            patroni_command() + [str(self.config_path)], stdout=log, stderr=subprocess.STDOUT,
            cwd=self.dir, env=env, start_new_session=True,
            **({"user": user[0], "group": user[1], "extra_groups": []} if user else {}),
        )
        log.close()
        self.cluster.record_pids()
        return self

    # -- what it says about itself (its REST API) -----------------------------------
    def status(self) -> dict[str, Any]:
        """Patroni's GET /patroni (role, state, timeline), or {} while it does not answer."""
        try:
            code, body = _http_json(f"http://127.0.0.1:{self.api_port}/patroni")
        except OSError:
            return {}
        return body if isinstance(body, dict) else {}

    def is_primary(self) -> bool:
        status = self.status()
        return status.get("role") in ("master", "primary") and status.get("state") == "running"

    def is_streaming(self) -> bool:
        status = self.status()
        return status.get("role") == "replica" and status.get("state") == "running"

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    # -- faults and stops -----------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL Patroni and every PostgreSQL process of this member: the host is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.signal_postgres(signal.SIGKILL)

    def signal_postgres(self, sig: int) -> bool:
        """Send ``sig`` to this member's postmaster and every process it started (each
        backend is a session of its own, so there is no one process group to signal)."""
        pid = self.postmaster_pid()
        if pid is None:
            return False
        pids = [pid, *_children(pid)]
        for target in pids:
            try:
                os.kill(target, sig)
            except (ProcessLookupError, PermissionError):
                pass
        return True

    def signal_patroni(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM: Patroni stops PostgreSQL (fast shutdown) and exits."""
        self.signal_postgres(signal.SIGCONT)  # a paused member must be able to stop
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.postmaster_pid() is not None:
            self.signal_postgres(signal.SIGKILL)


class PatroniCluster:
    """Three members (``pg1``..``pg3``) under ``base``, on ZooKeeper ``zk_hosts``."""

    def __init__(self, base: Path, zk_hosts: str, *, first_port: int | None = None, size: int = 3):
        self.base = Path(base)
        self.base.mkdir(parents=True, exist_ok=True)
        self.base.chmod(0o755)  # the postgres user must be able to enter it when we are root
        self.zk_hosts = zk_hosts.split(",")
        self.bindir = pg_bindir()
        self.passwords = self._passwords()
        self.members: list[PatroniMember] = []
        for i in range(size):
            if first_port is None:
                # outside the ephemeral range: a member restarted on its address finds it free
                pg_port, api_port = fresh_port(), fresh_port()
            else:
                pg_port, api_port = first_port + 2 * i, first_port + 2 * i + 1
            self.members.append(PatroniMember(self, f"pg{i + 1}", pg_port, api_port))
        self.passfile = self.base / "dmq.pgpass"
        self.passfile.write_text(f"127.0.0.1:*:*:dmq:{self.passwords['dmq']}\n")
        self.passfile.chmod(0o600)

    def _passwords(self) -> dict[str, str]:
        """Random passwords, kept in ``base/passwords.json`` (mode 600) across restarts."""
        path = self.base / "passwords.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
        made = {role: secrets.token_urlsafe(18) for role in USERS}
        path.write_text(json.dumps(made))
        path.chmod(0o600)
        return made

    # -- addresses -----------------------------------------------------------------------
    @property
    def dsn(self) -> str:
        """dmq's DSN: every member, the one accepting writes chosen by libpq."""
        return self.dsn_for("dmq")

    def dsn_for(self, dbname: str) -> str:
        hosts = ",".join("127.0.0.1" for _ in self.members)
        ports = ",".join(str(m.pg_port) for m in self.members)
        return (f"host={hosts} port={ports} dbname={dbname} user=dmq passfile={self.passfile} "
                f"target_session_attrs=read-write connect_timeout=3")

    def superuser_dsn(self, member: PatroniMember, dbname: str = "postgres") -> str:
        return (f"host=127.0.0.1 port={member.pg_port} dbname={dbname} user=postgres "
                f"password={self.passwords['superuser']} connect_timeout=3")

    # -- life --------------------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> str:
        """Start every member; once a primary and a synchronous standby run, create the
        ``dmq`` role and database (first start only). Returns dmq's DSN."""
        first = not any(m.data_dir.exists() for m in self.members)
        self.members[0].start()
        if first:  # one bootstraps, the others copy it: no race for the initialize key
            self.wait_primary(timeout)
        for member in self.members[1:]:
            member.start()
        self.wait_healthy(timeout)
        self.create_database()
        return self.dsn

    def wait_primary(self, timeout: float = 60.0, exclude: str | None = None) -> PatroniMember:
        deadline = time.monotonic() + timeout
        while True:
            for member in self.members:
                if member.name != exclude and member.is_primary():
                    return member
            if time.monotonic() > deadline:
                raise RuntimeError(f"no Patroni primary after {timeout}s:\n{self.log_tails()}")
            self._check_alive()
            time.sleep(0.1)

    def cluster_state(self) -> list[dict[str, Any]]:
        """GET /cluster from any member that answers: every member's role and state."""
        for member in self.members:
            try:
                code, body = _http_json(f"http://127.0.0.1:{member.api_port}/cluster")
            except OSError:
                continue
            if code == 200 and isinstance(body, dict):
                return body.get("members", [])
        return []

    def healthy(self) -> bool:
        """Every member runs, one leads and one is its synchronous standby."""
        state = self.cluster_state()
        if len(state) != len(self.members) or any(m.get("state") not in ("running", "streaming") for m in state):
            return False
        roles = sorted(m.get("role") for m in state)
        return roles.count("leader") == 1 and "sync_standby" in roles

    def wait_healthy(self, timeout: float = 120.0) -> float:
        """Wait until ``healthy()``; returns the seconds it took."""
        started = time.monotonic()
        while not self.healthy():
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"Patroni cluster not healthy after {timeout}s: {self.cluster_state()}\n"
                                   f"{self.log_tails()}")
            self._check_alive()
            time.sleep(0.1)
        return time.monotonic() - started

    def _check_alive(self) -> None:
        for member in self.members:
            if member.proc is not None and member.proc.poll() not in (None, -signal.SIGKILL):
                raise RuntimeError(f"patroni {member.name} exited with {member.proc.returncode}:\n{self.log_tails()}")

    def primary(self) -> PatroniMember | None:
        for member in self.members:
            if member.is_primary():
                return member
        return None

    def sync_standby(self) -> PatroniMember | None:
        names = {m.get("name") for m in self.cluster_state() if m.get("role") == "sync_standby"}
        return next((m for m in self.members if m.name in names), None)

    def standbys(self) -> list[PatroniMember]:
        leader = {m.get("name") for m in self.cluster_state() if m.get("role") == "leader"}
        return [m for m in self.members if m.name not in leader]

    def create_database(self, name: str = "dmq") -> None:
        """The ``dmq`` role (password from the passfile) and a database it owns."""
        import psycopg

        primary = self.wait_primary()
        with psycopg.connect(self.superuser_dsn(primary), autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'dmq'").fetchone() is None:
                conn.execute(f"CREATE ROLE dmq LOGIN PASSWORD '{self.passwords['dmq']}'")
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                conn.execute(f'CREATE DATABASE "{name}" OWNER dmq')

    def record_pids(self) -> None:
        pids = {m.name: m.proc.pid for m in self.members if m.proc is not None}
        (self.base / "patroni.pids").write_text(json.dumps(pids))

    def stop(self) -> None:
        """Stop the standbys, then the primary (no failover on the way out)."""
        primary = self.primary()
        for member in self.members:
            if member is not primary:
                member.stop()
        if primary is not None:
            primary.stop()

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for member in self.members:
            try:
                tail = member.log_path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                tail = []
            out.append(f"--- {member.name} ({member.log_path})\n" + "\n".join(tail))
        return "\n".join(out)


def _stop_recorded(base: Path) -> None:
    """Stop the Patroni processes a ``start`` in another process recorded."""
    try:
        pids = json.loads((base / "patroni.pids").read_text())
    except (OSError, ValueError):
        return
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 60
    for pid in pids.values():
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "start":
        cluster = PatroniCluster(Path(argv[1]), argv[2], first_port=int(argv[3]) if len(argv) > 3 else None)
        try:
            dsn = cluster.start()
        except BaseException:
            cluster.stop()
            raise
        print(dsn, flush=True)
        return 0
    if len(argv) == 2 and argv[0] == "stop":
        _stop_recorded(Path(argv[1]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
