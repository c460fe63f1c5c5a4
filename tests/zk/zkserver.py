"""Real ZooKeeper servers for tests: standalone or a small ensemble, on free ports.

Debian's ``zookeeper`` package (3.8) provides the jars under /usr/share/java
(``deploy/setup.sh --dev`` installs it when /usr/share/zookeeper is missing). Each
server runs ``java ... QuorumPeerMain`` with its own zoo.cfg and a temporary data
directory; the admin server is disabled and only the four-letter words the harness
uses are enabled. Readiness and shutdown are observed (``ruok`` answered ``imok``,
the process exited), never slept for.

Fault helpers: ``stop()``/``start()`` (a restart keeps the data directory and port,
so sessions survive a quick restart as they would in production), ``kill()``
(SIGKILL), and ``expire_session(client)`` (the session of a kazoo client is closed
behind its back, as ZooKeeper does when it stops hearing from a client).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from dmq_sql.ports import fresh_port

JAR = Path(os.environ.get("DMQ_ZK_JAR", "/usr/share/java/zookeeper.jar"))
LOG_JARS = [Path("/usr/share/java/slf4j-simple.jar")]
MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
TICK_MS = 250  # session timeouts may be 2..60 ticks: 0.5 s .. 15 s


def available() -> bool:
    return JAR.exists() and shutil.which("java") is not None


def free_port() -> int:
    return fresh_port()


def four_letter(port: int, word: str, timeout: float = 1.0) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(word.encode())
        chunks = []
        while True:
            data = s.recv(4096)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


class ZooKeeperServer:
    """One ZooKeeper server process (standalone, or member ``myid`` of an ensemble)."""

    def __init__(
        self,
        base: Path,
        client_port: int,
        myid: int = 0,
        peers: list[tuple[int, int, int]] | None = None,
        extra_config: tuple[str, ...] = (),
        jvm_args: tuple[str, ...] = (),
        jars: tuple[Path, ...] = (),
    ):
        self.dir = base / (f"zk{myid}" if myid else "zk")
        self.data_dir = self.dir / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.client_port = client_port
        self.myid = myid
        self.proc: subprocess.Popen | None = None
        lines = [
            f"tickTime={TICK_MS}",
            f"dataDir={self.data_dir}",
            f"clientPort={client_port}",
            "clientPortAddress=127.0.0.1",
            "admin.enableServer=false",
            "4lw.commands.whitelist=ruok,srvr,stat,mntr,cons",
            "maxClientCnxns=0",
            "initLimit=20",
            "syncLimit=10",
        ]
        lines += extra_config
        self.jvm_args = jvm_args
        self.jars = jars
        if peers:
            lines.append("standaloneEnabled=false")
            for sid, quorum, election in peers:
                lines.append(f"server.{sid}=127.0.0.1:{quorum}:{election}")
            (self.data_dir / "myid").write_text(f"{myid}\n")
        self.config = self.dir / "zoo.cfg"
        self.config.write_text("\n".join(lines) + "\n")
        self.log_path = self.dir / "zookeeper.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, wait: bool = True, timeout: float = 60.0) -> "ZooKeeperServer":
        classpath = ":".join(str(p) for p in [JAR, *LOG_JARS, *self.jars] if p.exists())
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [
                "java",
                "-Xmx256m",
                "-XX:+UseSerialGC",
                "-Dzookeeper.jmx.log4j.disable=true",
                "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
                *self.jvm_args,
                "-cp",
                classpath,
                MAIN,
                str(self.config),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
        )
        log.close()
        if wait:
            self.wait_serving(timeout)
        return self

    def serving(self) -> bool:
        """Answers ``ruok`` and, in an ensemble, has a leader (``srvr`` shows a mode)."""
        try:
            if four_letter(self.client_port, "ruok") != "imok":
                return False
            return "Mode:" in four_letter(self.client_port, "srvr")
        except OSError:
            return False

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"ZooKeeper exited with {self.proc.returncode}:\n{self.log()}")
            if self.serving():
                return
            time.sleep(0.05)
        raise RuntimeError(f"ZooKeeper not serving after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM and wait for the process to exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Ensemble:
    """``size`` servers in one quorum (standalone when size is 1)."""

    def __init__(self, size: int = 1, base: Path | None = None):
        self.base = base or Path(tempfile.mkdtemp(prefix="dmq-test-zk-"))
        if size == 1:
            self.servers = [ZooKeeperServer(self.base, free_port())]
        else:
            peers = [(i, free_port(), free_port()) for i in range(1, size + 1)]
            self.servers = [ZooKeeperServer(self.base, free_port(), sid, peers) for sid, _, _ in peers]

    @property
    def address(self) -> str:
        return ",".join(s.address for s in self.servers)

    def start(self, timeout: float = 90.0) -> "Ensemble":
        for server in self.servers:
            server.start(wait=False)
        for server in self.servers:
            server.wait_serving(timeout)
        return self

    def close(self) -> None:
        for server in self.servers:
            server.kill()
        shutil.rmtree(self.base, ignore_errors=True)


def expire_session(client, timeout: float = 30.0) -> None:
    """Make ZooKeeper expire ``client``'s session: a second client attaches to the same
    session and closes it; ``client`` then sees LOST when it next talks to the server."""
    from kazoo.client import KazooClient

    session_id, password = client.client_id
    hosts = ",".join(f"{h}:{p}" for h, p in client.hosts)
    other = KazooClient(hosts=hosts, client_id=(session_id, password), timeout=client._session_timeout / 1000)
    other.start(timeout=timeout)
    other.stop()
    other.close()
