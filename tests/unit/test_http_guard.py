"""The HTTP guard's decisions without a server: what a request needs (classify), which
changes a page of another origin sent (cross_origin_refusal: Fetch metadata, then Origin;
a request with neither is no browser's, whatever its body's type), the start-up warning
for exposed listeners, and the security options' rules."""

from __future__ import annotations

import pytest

from dmq_server.core.auth import ADMIN, PUBLISH
from dmq_server.core.options import ConfigError, Options
from dmq_server.http.guard import OPEN, READ, classify, cross_origin_refusal
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


OWN = "http://127.0.0.1:4151"


@pytest.mark.parametrize(
    "method, fetch_site, origin, refused",
    [
        # reads are not this rule's
        (b"GET", "cross-site", "http://evil.example", None),
        (b"OPTIONS", "cross-site", "http://evil.example", None),
        # Fetch metadata first: a page of this origin, or the user, passes ...
        (b"POST", "same-origin", OWN, None),
        (b"POST", "none", None, None),
        (b"POST", "Same-Origin", None, None),
        # ... and decides even where the Origin would not (a proxy that rewrote the Host)
        (b"POST", "same-origin", "https://dmq.example", None),
        # another site, another port of this host, or a value no browser sends
        (b"POST", "cross-site", "http://evil.example",
         "a page of another site sent this change (Sec-Fetch-Site: cross-site)"),
        (b"POST", "same-site", "http://127.0.0.1:8000", "another origin on the same site (another port or subdomain)"),
        (b"DELETE", "cross-site", None, "Sec-Fetch-Site: cross-site"),
        (b"PUT", "nested-document", OWN, "Sec-Fetch-Site: nested-document: a browser's request neither same-origin"),
        # no Fetch metadata (an older browser, a plain-HTTP origin that is not loopback): the Origin
        (b"POST", None, OWN, None),
        (b"POST", None, "HTTP://127.0.0.1:4151", None),
        (b"POST", None, "http://evil.example", "a page of http://evil.example sent this change (Origin), not one of "
                                               "this listener's http://127.0.0.1:4151"),
        (b"POST", None, "https://127.0.0.1:4151", "not one of this listener's http://127.0.0.1:4151"),
        (b"POST", None, "http://127.0.0.1:4152", "not one of this listener's"),
        (b"POST", None, "null", "a page of an opaque origin sent this change (Origin: null"),
        # neither: no browser sent it
        (b"POST", None, None, None),
        (b"PATCH", None, None, None),
    ],
)
def test_requests_from_another_origin(method, fetch_site, origin, refused):
    why = cross_origin_refusal(method, fetch_site, origin, OWN)
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why


def test_an_origin_without_a_host_to_compare_it_with_is_refused():
    assert cross_origin_refusal(b"POST", None, OWN, None) == (
        "Origin http://127.0.0.1:4151 came without a Host header to compare it with")
    assert cross_origin_refusal(b"POST", None, None, None) is None


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
