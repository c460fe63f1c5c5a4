"""pynsq and gnsq, unchanged, against dmq with TLS (``tls_v1``) and AUTH secrets."""

from __future__ import annotations

import json
import ssl

import nsq

from tests.compat.test_pynsq import Scenario, consume, publish_all


def _auth_file(tmp_path, entries: dict) -> str:
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"secrets": entries}))
    return str(path)


def _tls_options(certs) -> dict:
    # pynsq's default ssl_version (PROTOCOL_TLSv1_2) is deprecated in Python 3.10+ (a
    # DeprecationWarning, an error under this suite's filterwarnings): ask for the
    # modern client protocol, which verifies the certificate and the host name too
    return {"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": str(certs.ca_file), "ssl_version": ssl.PROTOCOL_TLS_CLIENT}


def test_pynsq_publishes_and_consumes_over_tls_with_an_auth_secret(make_server, certs, tmp_path):
    """pynsq's Writer and Reader with tls_v1=True and auth_secret: the connection is
    upgraded (the certificate checked against the test CA), AUTH succeeds, messages
    flow both ways, and /stats shows the clients as TLS and authenticated."""
    auth = _auth_file(tmp_path, {
        "pub-secret": {"identity": "producer", "ttl": 60,
                       "authorizations": [{"topic": "^events$", "channels": [".*"], "permissions": ["publish"]}]},
        "sub-secret": {"identity": "consumer", "ttl": 60,
                       "authorizations": [{"topic": "^events$", "channels": ["^c$"], "permissions": ["subscribe"]}]},
    })
    server = make_server(data_path=str(tmp_path / "data"), auth_file=auth, **certs.server_flags())
    scenario = Scenario()
    tls = dict(tls_v1=True, tls_options=_tls_options(certs))
    writer = nsq.Writer([f"127.0.0.1:{server.tcp_port}"], auth_secret="pub-secret", **tls)
    results: list = []
    got: list = []
    bodies = [f"m{i}".encode() for i in range(5)]

    def start_reader():
        consume(scenario, server, "events", "c", len(bodies), got, auth_secret="sub-secret", **tls)

    scenario.loop.call_later(0.05, publish_all, scenario, writer, "events", bodies, results, start_reader)
    scenario.run()
    assert not scenario.timed_out, (results, got, server.log())
    assert results == [b"OK"] * len(bodies)
    assert sorted(body for body, _, _ in got) == bodies
