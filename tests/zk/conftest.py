"""Fixtures for the cluster tests: a real ZooKeeper, real dmq-server processes, real PostgreSQL.

* ``zk_ensemble``: one standalone ZooKeeper per session (the JVM starts once).
* ``zk_address``: that server with a chroot of the test's own (``/dmqtest-<uuid>``),
  so tests never see each other's registry.
* ``zk``: a started kazoo client on that chroot, stopped afterwards.
* ``make_node(**flags)``: a dmq-server subprocess on the test's database with
  ``--zk`` set (short session timeout and heartbeat unless given), stopped afterwards.
* ``zk_private``: a standalone ZooKeeper of the test's own, for tests that stop it.

Tests that need ZooKeeper are skipped with a clear reason when its jars are missing
(``bash deploy/setup.sh --dev`` installs Debian's package).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import os

import pytest

from tests.integration.support import ServerProcess

from . import zkserver


def pytest_collection_modifyitems(items):
    """Without ZooKeeper these tests cannot run. In CI that is a failure (setup must
    install it); on a developer's machine they are skipped with the fix named."""
    if zkserver.available():
        return
    reason = "ZooKeeper is not installed (bash deploy/setup.sh --dev installs it)"
    if os.environ.get("CI"):
        raise pytest.UsageError(reason)
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "tests/zk/" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def zk_ensemble() -> Iterator[zkserver.Ensemble]:
    """One standalone ZooKeeper for the whole session."""
    ensemble = zkserver.Ensemble(1)
    try:
        ensemble.start()
        yield ensemble
    finally:
        ensemble.close()


@pytest.fixture
def zk_address(zk_ensemble: zkserver.Ensemble) -> str:
    """The session's ZooKeeper, chrooted to a path of this test's own."""
    return f"{zk_ensemble.address}/dmqtest-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def zk(zk_address: str) -> Iterator:
    """A started kazoo client on the test's chroot (base paths created)."""
    from registry.zk import connect

    client = connect(zk_address, timeout=30, session_timeout=5)
    try:
        yield client
    finally:
        client.stop()
        client.close()


@pytest.fixture
def zk_private() -> Iterator[zkserver.Ensemble]:
    """A standalone ZooKeeper of this test's own (it may be stopped and restarted)."""
    ensemble = zkserver.Ensemble(1)
    try:
        ensemble.start()
        yield ensemble
    finally:
        ensemble.close()


NODE_DEFAULTS = {
    "zk_session_timeout": "2s",
    "node_heartbeat": "500ms",
    "zk_refresh": "2s",
    "zk_connect_timeout": "20s",
    "admin_address": "",
}


@pytest.fixture
def make_node(pg_dsn, tmp_path, zk_address):
    """Factory: ``make_node(zk=..., **flags)`` starts a dmq-server cluster node."""
    nodes: list[ServerProcess] = []

    def make(start: bool = True, dsn: str | None = None, **flags: str) -> ServerProcess:
        settings = dict(NODE_DEFAULTS, zk=zk_address)
        settings.update(flags)
        node = ServerProcess(dsn or pg_dsn, tmp_path, **settings)
        if "node_id" not in settings:
            node.flags["node_id"] = f"node-{node.tcp_port}"
        if "data_path" not in settings:  # each node its own fast-store files
            node.flags["data_path"] = str(tmp_path / f"data-{node.tcp_port}")
        nodes.append(node)
        return node.start() if start else node

    yield make
    for node in nodes:
        if node.proc is not None and node.proc.poll() is None:
            try:
                node.proc.send_signal(18)  # SIGCONT: a frozen node must be able to stop
            except ProcessLookupError:
                pass
        node.stop()
