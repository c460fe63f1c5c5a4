"""The HTTP guard's decisions without a server: what a request needs (classify), which
requests a browser could have forged (cross_site_refusal), the start-up warning for
exposed listeners, and the security options' rules."""

from __future__ import annotations

import pytest

from dmq_server.core.auth import ADMIN, PUBLISH
from dmq_server.core.options import ConfigError, Options
from dmq_server.http.guard import OPEN, READ, classify, cross_site_refusal
from dmq_server.security.exposure import exposure_warnings

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "method, path, query, needs",
    [
        (b"GET", b"/ping", "", (OPEN, "", "")),
        (b"POST", b"/ping", "", (OPEN, "", "")),
        (b"GET", b"/stats", "format=json", (READ, "", "")),
        (b"GET", b"/lookup", "topic=t", (READ, "", "")),
        (b"POST", b"/pub", "topic=orders", (PUBLISH, "orders", "")),
        (b"POST", b"/mpub", "topic=orders&binary=true", (PUBLISH, "orders", "")),
        (b"POST", b"/channel/empty", "topic=orders&channel=billing", (ADMIN, "orders", "billing")),
        (b"POST", b"/topic/delete", "topic=orders", (ADMIN, "orders", "")),
        (b"GET", b"/admin/stats", "", (ADMIN, "", "")),
        (b"GET", b"/admin/dead-letters", "topic=orders", (ADMIN, "orders", "")),
        (b"POST", b"/admin/channels/orders/billing/pause", "", (ADMIN, "orders", "billing")),
        (b"DELETE", b"/something/else", "", (ADMIN, "", "")),
    ],
)
def test_what_each_request_needs(method, path, query, needs):
    assert classify(method, path, query) == needs


OWN = ("http://127.0.0.1:4151",)


@pytest.mark.parametrize(
    "method, origin, fetch_site, content_type, credential, header, refused",
    [
        (b"GET", "http://evil.example", "cross-site", "text/plain", False, False, None),  # reads are not guarded here
        (b"POST", "http://evil.example", None, "application/json", True, True, "cross-origin request"),
        (b"POST", "null", None, None, False, False, "cross-origin request"),
        (b"POST", None, "cross-site", None, False, False, "Sec-Fetch-Site"),
        (b"POST", None, "same-site", None, True, False, "Sec-Fetch-Site"),
        (b"POST", "http://127.0.0.1:4151", "same-origin", "text/plain", False, False, "X-Requested-By"),
        (b"POST", None, None, "application/x-www-form-urlencoded; charset=utf-8", False, False, "X-Requested-By"),
        (b"POST", None, None, "multipart/form-data; boundary=x", False, False, "X-Requested-By"),
        (b"POST", None, None, "text/plain", False, True, None),
        (b"POST", None, None, "text/plain", True, False, None),
        (b"POST", None, None, "application/octet-stream", False, False, None),
        (b"POST", None, None, None, False, False, None),
        (b"DELETE", "HTTP://127.0.0.1:4151", None, None, False, False, None),
    ],
)
def test_cross_site_requests(method, origin, fetch_site, content_type, credential, header, refused):
    why = cross_site_refusal(method, origin, OWN, fetch_site, content_type, credential, header)
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why


def test_exposed_listeners_are_named_once_each():
    lines = exposure_warnings([
        ("the TCP port", "0.0.0.0", False, False),
        ("the HTTP port", "127.0.0.1", False, False),
        ("the TLS port", "10.1.2.3", True, False),
        ("the admin console", "10.1.2.3", True, True),
    ])
    assert len(lines) == 2
    assert lines[0].startswith("the TCP port listens on non-loopback address 0.0.0.0 without TLS or authentication")
    assert "without authentication" in lines[1] and "the TLS port" in lines[1]
    assert exposure_warnings([("the TLS port", "::", True, True)]) == []


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"tls_cert": "c.pem"}, "--tls-cert and --tls-key go together"),
        ({"tls_address": "127.0.0.1:4153"}, "needed by --tls-address"),
        ({"tls_required": "true"}, "needed by"),
        ({"tls_cert": "c", "tls_key": "k", "tls_client_auth_policy": "maybe"}, "must be empty or one of"),
        ({"tls_cert": "c", "tls_key": "k", "tls_client_auth_policy": "require-verify"}, "needs --tls-root-ca-file"),
        ({"tls_cert": "c", "tls_key": "k", "tls_min_version": "ssl3"}, "tls1.0, tls1.1, tls1.2, tls1.3"),
        ({"auth_file": "a.json", "auth_http_address": "127.0.0.1:4181"}, "not both"),
        ({"auth_http_request_method": "put"}, "get or post"),
        ({"zk_sasl_password": "x"}, "needs --zk-sasl-user"),
    ],
)
def test_security_options_that_cannot_work_are_refused_at_start(settings, message):
    with pytest.raises(ConfigError, match=message):
        Options(**settings).validate()


def test_a_client_certificate_policy_implies_tls_required():
    options = Options(tls_cert="c", tls_key="k", tls_root_ca_file="ca", tls_client_auth_policy="require-verify").validate()
    assert options.tls_required_mode == "true"
    assert Options(tls_cert="c", tls_key="k").validate().tls_required_mode == "false"
    assert Options(zk_sasl_user="u", zk_sasl_password="p").zk_security == {
        "sasl_options": {"mechanism": "DIGEST-MD5", "username": "u", "password": "p"}}
