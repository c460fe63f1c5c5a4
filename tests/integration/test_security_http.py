"""The HTTP side against a real server: HTTPS /pub with and without a token, client
certificates as the credential, per-topic permissions on nsqd's API and the admin API,
TLS required on the plaintext port, and requests a browser could forge cross-site
(a foreign Origin, a form's body type, a rebound Host name) refused while /ping stays
open."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

from .authserver import AuthServer, grant
from .support import free_port


def call(url: str, method: str = "GET", body: bytes | None = None, context=None, **headers: str):
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def payload(answer) -> dict:
    return json.loads(answer[1])


def _https_server(make_server, certs, **flags):
    https_port = free_port()
    server = make_server(https_address=f"127.0.0.1:{https_port}", **certs.server_flags(**flags))
    server.https = f"https://127.0.0.1:{https_port}"
    return server


def test_https_pub_with_and_without_a_token(make_server, certs):
    """Over HTTPS with an auth server: /ping needs nothing; /pub without a credential is
    401 E_AUTH_FIRST, with a refused one 401 E_AUTH_FAILED, with one that may not publish
    there 403 E_UNAUTHORIZED, and with the right one 200 OK; /stats needs an identity;
    the admin API needs the admin permission (or --admin-token). The auth server heard
    tls=true, and was asked once per credential (answers kept until their ttl)."""
    with AuthServer() as authd:
        authd.allow("pub", "publisher", [grant("^events$", permissions=["publish"])])
        authd.allow("ops", "operator", [grant(".*", permissions=["admin"])])
        server = _https_server(make_server, certs, auth_http_address=authd.address, admin_token="break-glass")
        tls = ssl.create_default_context(cafile=str(certs.ca_file))
        octets = {"Content-Type": "application/octet-stream"}
        assert call(server.https + "/ping", context=tls) == (200, "OK")
        no_token = call(server.https + "/pub?topic=events", "POST", b"m", tls, **octets)
        assert no_token[0] == 401 and payload(no_token)["message"].startswith("E_AUTH_FIRST")
        wrong = call(server.https + "/pub?topic=events", "POST", b"m", tls, Authorization="Bearer nope", **octets)
        assert wrong[0] == 401 and payload(wrong)["message"].startswith("E_AUTH_FAILED")
        elsewhere = call(server.https + "/pub?topic=other", "POST", b"m", tls, Authorization="Bearer pub", **octets)
        assert elsewhere[0] == 403 and payload(elsewhere)["message"].startswith("E_UNAUTHORIZED")
        for _ in range(3):
            assert call(server.https + "/pub?topic=events", "POST", b"m", tls, Authorization="Bearer pub", **octets) == (200, "OK")
        assert call(server.https + "/stats?format=json", context=tls)[0] == 401
        stats = call(server.https + "/stats?format=json", context=tls, Authorization="Bearer pub")
        (events,) = [t for t in payload(stats)["topics"] if t["topic_name"] == "events"]
        assert events["message_count"] == 3
        assert call(server.https + "/admin/stats", context=tls, Authorization="Bearer pub")[0] == 403
        assert call(server.https + "/admin/stats", context=tls, Authorization="Bearer ops")[0] == 200
        assert call(server.https + "/admin/stats", context=tls, Authorization="Bearer break-glass")[0] == 200
        assert authd.count("pub") == 1 and authd.count("ops") == 1
        assert {r["tls"] for r in authd.requests} == {"true"}
        assert "may not publish on 'other'" in server.log()


def test_a_client_certificate_is_a_credential_over_https(make_server, certs, tmp_path):
    """--tls-client-auth-policy verify-if-given and an auth file keyed by certificate
    names: a client presenting its (verified) certificate publishes without a token; the
    same request without a certificate is 401; a token still works."""
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({
        "secrets": {"tok": {"identity": "tok", "authorizations": [grant(".*", permissions=["publish"])]}},
        "common_names": {"billing-service": {"identity": "billing", "authorizations": [grant("^billing$")]}},
    }))
    server = _https_server(make_server, certs, auth_file=str(auth), tls_root_ca_file=str(certs.ca_file),
                           tls_client_auth_policy="verify-if-given")
    anonymous = ssl.create_default_context(cafile=str(certs.ca_file))
    with_cert = ssl.create_default_context(cafile=str(certs.ca_file))
    with_cert.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    octets = {"Content-Type": "application/octet-stream"}
    assert call(server.https + "/pub?topic=billing", "POST", b"m", with_cert, **octets) == (200, "OK")
    assert call(server.https + "/pub?topic=billing", "POST", b"m", anonymous, **octets)[0] == 401
    assert call(server.https + "/pub?topic=billing", "POST", b"m", anonymous, Authorization="Bearer tok", **octets) == (200, "OK")


def test_tls_required_refuses_plain_http_but_ping(make_server, certs):
    """--tls-required true: the plaintext HTTP port answers nsqd's 403 TLS_REQUIRED with
    the HTTPS port (what the Go tools follow), except /ping; HTTPS serves."""
    server = _https_server(make_server, certs, tls_required="true")
    refused = call(server.http + "/stats")
    https_port = int(server.https.rsplit(":", 1)[1])
    assert refused[0] == 403 and payload(refused) == {"message": "TLS_REQUIRED", "https_port": https_port}
    assert call(server.http + "/ping") == (200, "OK")
    tls = ssl.create_default_context(cafile=str(certs.ca_file))
    assert call(server.https + "/stats?format=json", context=tls)[0] == 200


def test_requests_a_browser_could_forge_are_refused(make_server):
    """On the default loopback listener without auth, the attack this replaces: a form
    post (text/plain body, foreign Origin) to delete every dead letter is refused 403
    and the dead letter survives; so is the same post without an Origin (an old
    browser), a form-typed /pub, and a request naming a foreign Host (DNS rebinding).
    A program's request passes: a JSON body, an octet-stream /pub, or any body with
    X-Requested-By; a same-origin Origin is fine."""
    server = make_server()
    report = json.dumps({"topic": "t", "producer": "p", "session_id": 1, "body": "x", "detail": "test"}).encode()
    created = call(server.http + "/admin/dead-letters", "POST", report, **{"Content-Type": "application/json", "X-Requested-By": "test"})
    assert created[0] == 200, created
    delete = server.http + "/admin/dead-letters/delete?all=true"
    forged = call(delete, "POST", b"x=1", **{"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert forged[0] == 403 and payload(forged)["error"] == "E_CROSS_SITE"
    no_origin = call(delete, "POST", b"x=1", **{"Content-Type": "text/plain"})
    assert no_origin[0] == 403 and "X-Requested-By" in payload(no_origin)["message"]
    sec_fetch = call(delete, "POST", None, **{"Sec-Fetch-Site": "cross-site"})
    assert sec_fetch[0] == 403
    assert len(payload(call(server.http + "/admin/dead-letters"))["dead_letters"]) == 1
    form_pub = call(server.http + "/pub?topic=t", "POST", b"m", **{"Content-Type": "application/x-www-form-urlencoded"})
    assert form_pub[0] == 403 and payload(form_pub)["message"].startswith("E_CROSS_SITE")
    rebound = call(server.http + "/admin/dead-letters", Host=f"attacker.example:{server.http_port}")
    assert rebound[0] == 403 and payload(rebound)["error"] == "E_HOST"
    assert call(server.http + "/pub?topic=t", "POST", b"m", **{"Content-Type": "application/octet-stream"}) == (200, "OK")
    assert call(server.http + "/pub?topic=t", "POST", b"m", **{"Content-Type": "text/plain", "X-Requested-By": "test"}) == (200, "OK")
    own = {"Origin": server.http, "X-Requested-By": "test"}
    assert payload(call(delete, "POST", None, **own)) == {"deleted": 1}
    assert "refused 403 E_CROSS_SITE cross-origin request from http://evil.example" in server.log()
