"""A node joins a ZooKeeper that enforces SASL DIGEST-MD5 with the right password (and is
registered), fails to start with a wrong one, and kazoo without credentials is refused."""

from __future__ import annotations

from pathlib import Path

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
    try:
        server.start()
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


def test_a_node_joins_a_zookeeper_over_tls(pg_dsn, tmp_path):
    """ZooKeeper's secureClientPort (Netty, a PEM certificate from trustme): a node with
    --zk-tls-ca-file connects over TLS, verifying the server, and registers; ZooKeeper
    has no plaintext port here, so nothing but TLS could have worked."""
    from tests.integration.certs import make_certs

    certs = make_certs(tmp_path / "certs")
    keystore = tmp_path / "zk-keystore.pem"
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(certs.server_key.read_bytes(), password=None)
    pkcs8 = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    keystore.write_bytes(pkcs8 + certs.server_cert.read_bytes())  # ZooKeeper reads PKCS#8 keys only
    secure_port = zkserver.free_port()
    server = zkserver.ZooKeeperServer(
        tmp_path,
        zkserver.free_port(),
        extra_config=(
            f"secureClientPort={secure_port}",
            "secureClientPortAddress=127.0.0.1",
            "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
            f"ssl.keyStore.location={keystore}",
            "ssl.keyStore.type=PEM",
            f"ssl.trustStore.location={certs.ca_file}",
            "ssl.trustStore.type=PEM",
            "ssl.clientAuth=none",
        ),
        # Debian's zookeeper.jar lists Netty's transport but not its codec and resolver
        jars=(Path("/usr/share/java/netty-codec.jar"), Path("/usr/share/java/netty-resolver.jar")),
    )
    try:
        server.start()
        flags = dict(NODE_DEFAULTS, zk=f"127.0.0.1:{secure_port}/dmq-tls", node_id="tls-node",
                     zk_tls_ca_file=str(certs.ca_file))
        node = ServerProcess(pg_dsn, tmp_path, **flags)
        try:
            node.start()
            client = KazooClient(hosts=f"127.0.0.1:{secure_port}", use_ssl=True, verify_certs=True,
                                 ca=str(certs.ca_file))
            client.start(timeout=20)
            try:
                assert "tls-node" in client.get_children("/dmq-tls/dmq/node")
            finally:
                client.stop()
                client.close()
        finally:
            node.stop()
    finally:
        server.stop()
