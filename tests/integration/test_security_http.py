"""The HTTP side against a real server: HTTPS /pub with and without a token, client
certificates as the credential, per-topic permissions on nsqd's API and the admin API,
TLS required on the plaintext port, and changes a page of another origin sends (told
by Fetch metadata or Origin) or a rebound Host name refused while /ping stays open."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

from .authserver import AuthServer, grant
from .support import free_port, wait_for


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


def test_changes_a_page_of_another_origin_sends_are_refused(make_server):
    """On the default loopback listener without auth, with the headers browsers add (the
    real browser is test_security_browser.py's): a change whose Sec-Fetch-Site is
    cross-site or same-site, or, without Fetch metadata, whose Origin is another's or
    opaque, is refused 403 E_CROSS_SITE with its reason, to the admin API (a form's text
    body deleting every dead letter) and to /pub alike; the dead letter survives and
    nothing is published. A request naming a foreign Host (DNS rebinding) is E_HOST. The
    same change from this listener's own page (Sec-Fetch-Site same-origin, or its Origin)
    or from no browser (neither header, a form's body type) is done."""
    server = make_server()
    report = json.dumps({"topic": "t", "producer": "p", "session_id": 1, "body": "x", "detail": "test"}).encode()
    created = call(server.http + "/admin/dead-letters", "POST", report, **{"Content-Type": "application/json"})
    assert created[0] == 200, created
    delete = server.http + "/admin/dead-letters/delete?all=true"
    form = {"Content-Type": "text/plain"}
    own = f"http://127.0.0.1:{server.http_port}"
    refusals = [
        ({"Sec-Fetch-Site": "cross-site", "Origin": "http://evil.example"},
         "a page of another site sent this change (Sec-Fetch-Site: cross-site); only this listener's own pages may"),
        ({"Sec-Fetch-Site": "same-site", "Origin": "http://127.0.0.1:8000"},
         "a page of another origin on the same site (another port or subdomain) sent this change "
         "(Sec-Fetch-Site: same-site); only this listener's own pages may"),
        ({"Origin": "http://evil.example"},
         f"a page of http://evil.example sent this change (Origin), not one of this listener's {own}"),
        ({"Origin": "null"}, "a page of an opaque origin sent this change (Origin: null: a sandboxed frame, "
                             "a local file, or a redirect from another origin)"),
    ]
    for headers, why in refusals:
        forged = call(delete, "POST", b"x=1", **form, **headers)
        assert forged[0] == 403 and payload(forged) == {"error": "E_CROSS_SITE", "message": why}, forged
        forged_pub = call(server.http + "/pub?topic=forged", "POST", b"m", **form, **headers)
        assert forged_pub[0] == 403 and payload(forged_pub) == {"message": f"E_CROSS_SITE {why}"}, forged_pub
        assert f"refused 403 E_CROSS_SITE {why}" in server.log()
    assert len(payload(call(server.http + "/admin/dead-letters"))["dead_letters"]) == 1
    assert payload(call(server.http + "/stats?format=json&topic=forged"))["topics"] is None
    rebound = call(server.http + "/admin/dead-letters", Host=f"attacker.example:{server.http_port}")
    assert rebound[0] == 403 and payload(rebound)["error"] == "E_HOST"
    for headers in ({"Sec-Fetch-Site": "same-origin", "Origin": own}, {"Origin": own}, {"Sec-Fetch-Site": "none"}, {}):
        assert call(server.http + "/pub?topic=t", "POST", b"m", **form, **headers) == (200, "OK"), headers
    assert payload(call(server.http + "/stats?format=json&topic=t"))["topics"][0]["message_count"] == 4
    assert payload(call(delete, "POST", b"x=1", **form)) == {"deleted": 1}


def curl(*args: str) -> tuple[int, str]:
    """The real curl binary (what nsqd's documentation runs): (status, body)."""
    assert shutil.which("curl"), "curl is installed by deploy/setup.sh"
    done = subprocess.run(["curl", "-sS", "-w", "\\n%{http_code}", *args], capture_output=True, text=True,
                          timeout=30, check=True)
    body, _, status = done.stdout.rpartition("\n")
    return int(status), body


def go_post(server, path: str) -> tuple[int, bytes]:
    """A POST as nsqadmin sends it (``http_api.Client.POSTV1``: Go's client, no body),
    header for header as Go writes it: no Origin, no Fetch metadata, no body type."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    try:
        conn.putrequest("POST", path, skip_host=True, skip_accept_encoding=True)
        for name, value in (("Host", f"127.0.0.1:{server.http_port}"), ("User-Agent", "Go-http-client/1.1"),
                            ("Content-Length", "0"), ("Accept", "application/vnd.nsq; version=1.0"),
                            ("Accept-Encoding", "gzip")):
            conn.putheader(name, value)
        conn.endheaders()
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def test_changes_from_programs_pass_whatever_their_body_type(make_server, tmp_path):
    """What nsqd's documentation, scripts and tools send: no Origin, no Fetch metadata.
    curl -d (a form's type: nsqd's quickstart) to /pub, /mpub and /topic/create; urllib's
    POST (a form's type too) and multipart and text bodies; nsqadmin's actions as Go's
    client sends them (a bodiless POST) to create, pause, unpause, empty and delete a
    channel and a topic. Each is answered 200 and done, as /stats shows after it."""
    server = make_server(data_path=str(tmp_path / "data"))

    def topic_stats(name: str) -> dict | None:
        topics = payload(call(server.http + f"/stats?format=json&topic={name}"))["topics"]
        return topics[0] if topics else None

    assert curl("-d", "hello world 1", server.http + "/pub?topic=test") == (200, "OK")
    assert curl("-fsS", "-d", "hello", server.http + "/pub?topic=events") == (200, "OK")
    assert curl("--data-binary", "one\ntwo\n", server.http + "/mpub?topic=test") == (200, "OK")
    assert curl("-d", "", server.http + "/topic/create?topic=made") == (200, "")
    assert curl("-F", "part=multipart", server.http + "/pub?topic=test") == (200, "OK")  # multipart/form-data
    form = urllib.request.Request(server.http + "/pub?topic=test", data=b"from urllib", method="POST")
    with urllib.request.urlopen(form, timeout=10) as resp:
        assert resp.status == 200 and form.get_header("Content-type") == "application/x-www-form-urlencoded"
    assert call(server.http + "/pub?topic=test", "POST", b"text", **{"Content-Type": "text/plain"}) == (200, "OK")
    assert topic_stats("test")["message_count"] == 6
    assert topic_stats("events")["message_count"] == 1 and topic_stats("made") is not None

    assert go_post(server, "/channel/create?topic=test&channel=c")[0] == 200
    assert go_post(server, "/channel/pause?topic=test&channel=c")[0] == 200
    assert go_post(server, "/topic/pause?topic=test")[0] == 200
    assert topic_stats("test")["paused"] is True and topic_stats("test")["channels"][0]["paused"] is True
    assert go_post(server, "/topic/unpause?topic=test")[0] == 200
    assert go_post(server, "/channel/unpause?topic=test&channel=c")[0] == 200
    assert curl("-d", "for c", server.http + "/pub?topic=test") == (200, "OK")
    wait_for(lambda: topic_stats("test")["channels"][0]["depth"] == 7)  # the 6 before the channel, and this one
    assert topic_stats("test")["paused"] is False and topic_stats("test")["channels"][0]["paused"] is False
    assert go_post(server, "/channel/empty?topic=test&channel=c")[0] == 200
    assert topic_stats("test")["channels"][0]["depth"] == 0
    assert go_post(server, "/channel/delete?topic=test&channel=c")[0] == 200
    assert topic_stats("test")["channels"] == []
    assert go_post(server, "/topic/empty?topic=events")[0] == 200 and topic_stats("events")["depth"] == 0
    assert go_post(server, "/topic/delete?topic=events")[0] == 200 and topic_stats("events") is None
    assert "E_CROSS_SITE" not in server.log()
