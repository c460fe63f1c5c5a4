"""A node joins a ZooKeeper that enforces SASL DIGEST-MD5 with the right password (and is
registered), fails to start with a wrong one, and kazoo without credentials is refused."""

from __future__ import annotations

import pytest
from kazoo.client import KazooClient

from tests.integration.support import ServerProcess

from . import zkserver
from .conftest import NODE_DEFAULTS


@pytest.fixture
def sasl_zk(tmp_path):
    jaas = tmp_path / "jaas.conf"
    jaas.write_text(
        "Server {\n"
        "  org.apache.zookeeper.server.auth.DigestLoginModule required\n"
        '  user_dmq="zk-s3cret";\n'
        "};\n"
    )
    server = zkserver.ZooKeeperServer(
        tmp_path,
        zkserver.free_port(),
        extra_config=(
            "authProvider.sasl=org.apache.zookeeper.server.auth.SASLAuthenticationProvider",
            "enforce.auth.enabled=true",
            "enforce.auth.schemes=sasl",
        ),
        jvm_args=(f"-Djava.security.auth.login.config={jaas}",),
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_a_node_joins_a_zookeeper_that_requires_sasl_digest(sasl_zk, pg_dsn, tmp_path):
    """With --zk-sasl-user/--zk-sasl-password the node starts, registers itself and
    serves; kazoo without credentials cannot read the registry; a node with a wrong
    password exits at start (within --zk-connect-timeout) instead of serving."""
    flags = dict(NODE_DEFAULTS, zk=f"{sasl_zk.address}/dmq-sasl", node_id="sasl-node", zk_sasl_user="dmq")
    node = ServerProcess(pg_dsn, tmp_path, zk_sasl_password="zk-s3cret", **flags)
    try:
        node.start()
        sasl = KazooClient(hosts=sasl_zk.address, sasl_options={"mechanism": "DIGEST-MD5", "username": "dmq",
                                                                "password": "zk-s3cret"})
        sasl.start(timeout=20)
        try:
            assert "sasl-node" in sasl.get_children("/dmq-sasl/dmq/node")
        finally:
            sasl.stop()
            sasl.close()
        anonymous = KazooClient(hosts=sasl_zk.address)
        anonymous.start(timeout=20)
        try:
            with pytest.raises(Exception):
                anonymous.get_children("/dmq-sasl/dmq/node")
        finally:
            anonymous.stop()
            anonymous.close()
    finally:
        node.stop()
    wrong = ServerProcess(pg_dsn, tmp_path, zk_sasl_password="wrong", **dict(flags, zk_connect_timeout="5s", node_id="bad"))
    with pytest.raises(RuntimeError, match="exited with 1") as failed:
        wrong.start(timeout=60)
    assert "refused or dropped the session" in str(failed.value), str(failed.value)
