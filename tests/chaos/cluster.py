"""The system under test: ZooKeeper, a Patroni cluster of three, three dmq nodes, and
fault proxies on the links between them.

    clients --[n1..n3]--> dmq nodes --[pg1..pg3]--> Patroni members (one primary)
                                    --[zk]-------> ZooKeeper <-- Patroni (direct)

Every bracket is a route of one ``FaultProxy`` process. dmq's DSN lists the three
proxied members with ``target_session_attrs=read-write`` (deploy/patroni_local.py's
DSN, pointed at the proxies), so a failover is found by libpq, as in production. The
nodes run as subprocesses (``ServerProcess``), killable and pausable; one may run under
libfaketime with a clock an offset file moves.

``restore()`` undoes every fault (restarts what was killed, resumes what was paused,
puts every route back to ``pass``) and waits until the cluster is whole again, so
scenarios can run one after another on one cluster.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tests.integration.support import REPO, ServerProcess, free_port, http_get
from tests.zk.zkserver import ZooKeeperServer

from .faultproxy import FaultProxy

if TYPE_CHECKING:
    from kazoo.client import KazooClient

__all__ = ["ChaosCluster", "patroni_local", "FAKETIME_LIB"]

FAKETIME_SITE = Path(__file__).resolve().parent / "faketime_site"
# Debian's libfaketime, under the machine's multiarch directory
FAKETIME_LIB = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))),
                    Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"))
CHROOT = "/dmq-chaos"
NODE_FLAGS = {
    "zk_session_timeout": "3s",
    "node_heartbeat": "500ms",
    "zk_refresh": "2s",
    "zk_connect_timeout": "30s",
    "admin_address": "",
    "log_level": "info",
    "pg_timeout": "5s",  # a hung PostgreSQL is given up on quickly (the default is 15s)
}


def _load_patroni_local():
    spec = importlib.util.spec_from_file_location("patroni_local", REPO / "deploy" / "patroni_local.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


patroni_local = _load_patroni_local()


def available() -> list[str]:
    """What this machine lacks to run the suite (deploy/setup.sh --dev installs it all)."""
    missing = []
    if shutil.which("patroni") is None:
        missing.append("patroni")
    if shutil.which("faketime") is None or not FAKETIME_LIB.exists():
        missing.append("faketime")
    if shutil.which("java") is None or not Path("/usr/share/java/zookeeper.jar").exists():
        missing.append("zookeeper")
    if not list(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl")):
        missing.append("postgresql")
    return missing


class ChaosCluster:
    def __init__(self, base: Path | None = None, nodes: int = 3, flags: dict[str, str] | None = None):
        """``flags``: the nodes' own, over ``NODE_FLAGS`` (the scenarios' small memory window)."""
        self.base = Path(base or tempfile.mkdtemp(prefix="dmq-chaos-"))
        self.base.chmod(0o755)
        self.zk = ZooKeeperServer(self.base, free_port())
        self.patroni = patroni_local.PatroniCluster(self.base / "patroni", self.zk.address)
        self.nodes = [ServerProcess("", self.base, **{**NODE_FLAGS, **(flags or {})}) for _ in range(nodes)]
        for i, node in enumerate(self.nodes, start=1):
            node.flags["node_id"] = f"node{i}"
            node.flags["data_path"] = str(self.base / f"node{i}")
        targets = {m.name: ("127.0.0.1", m.pg_port) for m in self.patroni.members}
        targets["zk"] = ("127.0.0.1", self.zk.client_port)
        targets.update({f"n{i}": ("127.0.0.1", n.tcp_port) for i, n in enumerate(self.nodes, start=1)})
        self.targets = targets
        self.proxy: FaultProxy | None = None
        self.clock_file = self.base / "faketime"  # a node started with faketime reads its offset here

    # -- addresses ------------------------------------------------------------------
    @property
    def direct_dsn(self) -> str:
        """The store as the checker sees it: the members themselves, no proxy."""
        return self.patroni.dsn

    @property
    def node_dsn(self) -> str:
        """What the dmq nodes use: the same DSN through the proxies."""
        assert self.proxy is not None
        ports = ",".join(str(self.proxy.ports[m.name]) for m in self.patroni.members)
        hosts = ",".join("127.0.0.1" for _ in self.patroni.members)
        return (f"host={hosts} port={ports} dbname=dmq user=dmq passfile={self.patroni.passfile} "
                f"target_session_attrs=read-write connect_timeout=3")

    @property
    def zk_address(self) -> str:
        assert self.proxy is not None
        host, port = self.proxy.address("zk")
        return f"{host}:{port}{CHROOT}"

    def client_addresses(self) -> list[tuple[str, int]]:
        assert self.proxy is not None
        return [self.proxy.address(f"n{i}") for i in range(1, len(self.nodes) + 1)]

    def node_routes(self) -> list[str]:
        return [f"n{i}" for i in range(1, len(self.nodes) + 1)]

    def pg_routes(self) -> list[str]:
        return [m.name for m in self.patroni.members]

    # -- life -----------------------------------------------------------------------------
    def start(self) -> "ChaosCluster":
        from dmq_server.db.schema import migrate

        self.zk.start()
        self.patroni.start()
        migrate(self.patroni.dsn)
        self.proxy = FaultProxy(self.targets, log_path=self.base / "faultproxy.log")
        self.clock_file.write_text("+0\n")
        for node in self.nodes:
            node.dsn = self.node_dsn
            node.flags["zk"] = self.zk_address
            node.start(timeout=60)
        self.flags = [dict(node.flags) for node in self.nodes]  # what restore() puts back
        return self

    @contextmanager
    def zk_client(self) -> Iterator[KazooClient]:
        """A kazoo client of the test's own, straight to ZooKeeper (not through the fault
        proxy, so a cut ``zk`` route does not hide the registry from the test)."""
        from registry.zk import connect

        client = connect(f"{self.zk.address}{CHROOT}", timeout=30, session_timeout=10)
        try:
            yield client
        finally:
            client.stop()
            client.close()

    def register_topic(self, topic: str, channels: list[str], msg_timeout_ms: int = 5000, *,
                       ordered: bool = False, pg_cluster: str = "main") -> None:
        """Create ``topic`` with ``channels`` in ZooKeeper (``ordered``: per-key order,
        issue 45; ``pg_cluster``: the PostgreSQL cluster it is stored on, one of the
        nodes' ``--pg-cluster`` names) and wait until every node serves them."""
        from registry.zk import ZkRegistry

        with self.zk_client() as client:
            registry = ZkRegistry(client)
            registry.create_topic(topic, msg_timeout_ms=msg_timeout_ms, ordered=ordered, cluster=pg_cluster)
            for channel in channels:
                registry.add_channel(topic, channel)
        deadline = time.monotonic() + 30
        for node in self.nodes:  # each node learns of it through a watch
            while not self._serves(node, topic, channels):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{node.flags['node_id']} does not serve {topic}:\n{node.log()}")
                time.sleep(0.05)

    @staticmethod
    def _serves(node: ServerProcess, topic: str, channels: list[str]) -> bool:
        import json

        try:
            status, body = http_get(node.http + "/stats", timeout=2)
        except OSError:
            return False
        if status != 200:
            return False
        for t in json.loads(body)["topics"]:
            if t["topic_name"] == topic:
                return set(channels) <= {c["channel_name"] for c in t["channels"]}
        return False

    def set_clock(self, offset_seconds: float) -> None:
        """Move the clock of nodes started ``with_faketime`` (libfaketime reads the file
        on every call: FAKETIME_NO_CACHE)."""
        self.clock_file.write_text(f"{offset_seconds:+.0f}\n")

    def restart_node(self, index: int, *, faketime: bool = False, flags: dict[str, str] | None = None) -> None:
        """Stop (if it runs) and start node ``index``, with ``flags`` over the cluster's
        own until ``restore()``."""
        node = self.nodes[index]
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGCONT)
            node.stop()
        node.env = None
        node.flags = {**self.flags[index], **(flags or {})}
        if faketime:
            # FAKETIME_SITE replaces time.sleep, which this libfaketime breaks (its docstring)
            path = os.pathsep.join(p for p in (str(FAKETIME_SITE), os.environ.get("PYTHONPATH", "")) if p)
            node.env = dict(os.environ, LD_PRELOAD=str(FAKETIME_LIB),
                            FAKETIME_TIMESTAMP_FILE=str(self.clock_file), FAKETIME_NO_CACHE="1",
                            DONT_FAKE_MONOTONIC="1", PYTHONPATH=path)
        node.start(timeout=60)

    def restore(self, timeout: float = 120.0) -> float:
        """Undo every fault and wait until the cluster is whole; returns the seconds it took."""
        started = time.monotonic()
        assert self.proxy is not None
        for name in self.targets:
            self.proxy.set(name, "pass")
        self.set_clock(0)
        if self.zk.proc is None or self.zk.proc.poll() is not None:
            self.zk.start()
        for member in self.patroni.members:
            member.signal_postgres(signal.SIGCONT)
            member.signal_patroni(signal.SIGCONT)
            member.start()  # a member that runs is left as it is
        self.patroni.wait_healthy(timeout)
        for i, node in enumerate(self.nodes):
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)
            if (node.proc is None or node.proc.poll() is not None or node.env is not None
                    or node.flags != self.flags[i]):
                self.restart_node(i)
        return time.monotonic() - started

    def logs(self) -> str:
        out = [self.patroni.log_tails(8)]
        for node in self.nodes:
            out.append(f"--- {node.flags['node_id']}\n{node.log()[-2500:]}")
        proxy_log = self.base / "faultproxy.log"
        if proxy_log.exists():
            out.append(f"--- fault proxy\n{proxy_log.read_text(errors='replace')[-2500:]}")
        return "\n".join(out)

    def close(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)
            node.stop()
        if self.proxy is not None:
            self.proxy.close()
        self.patroni.stop()
        self.zk.kill()
        shutil.rmtree(self.base, ignore_errors=True)
