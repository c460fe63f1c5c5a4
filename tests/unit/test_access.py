"""Who may read and who may change on the HTTP admin surfaces (dmq_server/http/access.py),
over twisted.web's DummyRequest: the token, the listener's address and the Origin (a
change from another origin is http.guard's to refuse, before this)."""

from __future__ import annotations

import pytest
from twisted.web.test.requesthelper import DummyRequest

from dmq_server.core.errors import Forbidden, Unauthorized
from dmq_server.http.access import authorize


def request(method: bytes = b"GET", **headers: str) -> DummyRequest:
    r = DummyRequest([b"admin", b"stats"])
    r.method = method
    r.requestHeaders.setRawHeaders(b"host", [b"127.0.0.1:4151"])
    for name, value in headers.items():
        r.requestHeaders.setRawHeaders(name.replace("_", "-").encode(), [value.encode()])
    return r


@pytest.mark.parametrize(
    "listen, token, method, headers, outcome",
    [
        # loopback, no token configured: read and change, no header asked (curl -X POST)
        ("127.0.0.1", "", b"GET", {}, "admin"),
        ("127.0.0.1", "", b"POST", {}, "admin"),
        ("127.0.0.1", "", b"POST", {"x_requested_by": "curl"}, "admin"),
        ("::1", "", b"DELETE", {"x_requested_by": "x"}, "admin"),
        # loopback with a token: read-only without it
        ("127.0.0.1", "t", b"GET", {}, "read"),
        ("127.0.0.1", "t", b"POST", {"x_requested_by": "x"}, Unauthorized),
        ("127.0.0.1", "t", b"POST", {"authorization": "Bearer t"}, "admin"),
        ("127.0.0.1", "t", b"GET", {"x_dmq_admin_token": "t"}, "admin"),
        ("127.0.0.1", "t", b"GET", {"authorization": "Bearer wrong"}, Unauthorized),
        # another address: nothing without the token
        ("0.0.0.0", "", b"GET", {}, Forbidden),
        ("0.0.0.0", "t", b"GET", {}, Unauthorized),
        ("0.0.0.0", "t", b"POST", {"authorization": "Bearer t"}, "admin"),
        # origins: the port's own passes, another site or an opaque one does not
        ("127.0.0.1", "", b"POST", {"x_requested_by": "x", "origin": "http://127.0.0.1:4151"}, "admin"),
        ("127.0.0.1", "", b"POST", {"x_requested_by": "x", "origin": "http://evil.example"}, Forbidden),
        ("127.0.0.1", "t", b"POST", {"authorization": "Bearer t", "origin": "http://127.0.0.1:9999"}, Forbidden),
        ("127.0.0.1", "", b"GET", {"origin": "null"}, Forbidden),
    ],
)
def test_rights(listen, token, method, headers, outcome) -> None:
    r = request(method, **headers)
    if isinstance(outcome, type):
        with pytest.raises(outcome):
            authorize(r, listen, token)
    else:
        access = authorize(r, listen, token)
        assert access.admin is (outcome == "admin")
