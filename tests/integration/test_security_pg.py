"""dmq against a PostgreSQL that speaks TLS, with sslmode=verify-full (docs/operations.md):
the server starts, migrates and stores over TLS connections only; a DSN naming a host the
certificate does not carry is refused at start, although sslmode=require would have
connected to it."""

from __future__ import annotations

import os
import shutil

import psycopg
import pytest
import trustme

from dmq_client.wire import Command
from dmq_server.db.embedded import EmbeddedPostgres

from tests.conftest import _dispose, _make_pg_dir


@pytest.fixture
def pg_tls(_scrub_dmq_env, tmp_path):
    """A private PostgreSQL with ssl=on and a certificate for 127.0.0.1 only."""
    ca = trustme.CA()
    ca_file = tmp_path / "pg-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    path = _make_pg_dir()
    plain = EmbeddedPostgres(path)
    try:
        plain.start()  # initialises the cluster (and gives it to the PostgreSQL user)
        plain.stop()
        issued = ca.issue_cert("127.0.0.1")
        owner = os.stat(plain.pgdata)
        for name, blob in (("server.crt", b"".join(b.bytes() for b in issued.cert_chain_pems)),
                           ("server.key", issued.private_key_pem.bytes())):
            target = plain.pgdata / name
            target.write_bytes(blob)
            os.chown(target, owner.st_uid, owner.st_gid)
            target.chmod(0o600)
        pg = EmbeddedPostgres(path, settings={"ssl": "on", "ssl_cert_file": "server.crt", "ssl_key_file": "server.key"})
        pg.start()
        yield pg, ca_file
    finally:
        _dispose(plain, path)
        shutil.rmtree(path, ignore_errors=True)


def _dsn(pg: EmbeddedPostgres, host: str, **params: str) -> str:
    extra = " ".join(f"{k}={v}" for k, v in params.items())
    return f"host={host} hostaddr=127.0.0.1 port={pg.port} dbname=dmq user=dmq passfile={pg.secret_file} {extra}"


def test_verify_full_to_a_tls_postgresql(pg_tls, make_server, tmp_path):
    pg, ca_file = pg_tls
    good = _dsn(pg, "127.0.0.1", sslmode="verify-full", sslrootcert=str(ca_file))
    server = make_server(dsn=good)
    topic = "tls_pg"
    from dmq_server.db.worker import connect
    import registry

    with connect(good, autocommit=True) as conn:
        registry.create_topic(conn, topic, msg_timeout_ms=60000)
        registry.add_channel(conn, topic, "c")
        version = conn.execute("SELECT version FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()[0]
        assert version.startswith("TLS")
    with server.client() as client:
        assert client.send(topic, b"over tls to postgres").command == Command.SEND_SUCCESS_ACK
    with psycopg.connect(good, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) "
            "WHERE a.datname = 'dmq' AND a.backend_type = 'client backend' AND a.pid <> pg_backend_pid()"
        ).fetchall()
    assert rows and all(ssl for (ssl,) in rows)  # every connection of the server is TLS
    wrong_name = _dsn(pg, "localhost", sslmode="verify-full", sslrootcert=str(ca_file))
    with psycopg.connect(_dsn(pg, "localhost", sslmode="require"), autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)  # require would not notice
    refused = make_server(dsn=wrong_name, start=False)
    with pytest.raises(RuntimeError, match="exited with 1"):
        refused.start(timeout=60)
    assert 'does not match host name "localhost"' in refused.log()
