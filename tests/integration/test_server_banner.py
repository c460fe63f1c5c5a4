"""The ready banner of dmq-server names every listener, the admin console included."""

from __future__ import annotations

import pytest

from .support import wait_for

pytestmark = pytest.mark.integration


def _banner(server) -> list[str]:
    wait_for(lambda: "dmq is ready" in server.log(), timeout=10)
    lines = server.log().splitlines()
    start = lines.index("dmq is ready")
    return lines[start : start + 10]


def test_banner_lists_tcp_http_and_the_admin_console(make_server):
    server = make_server()
    banner = "\n".join(_banner(server))
    assert f"TCP          127.0.0.1:{server.tcp_port}  " in banner
    assert f"HTTP         http://127.0.0.1:{server.http_port}/" in banner
    assert f"console      http://127.0.0.1:{server.http_port}/console/  (the web console)" in banner
    assert f"admin        127.0.0.1:{server.admin_port}  (admin console" in banner


def test_banner_says_when_the_admin_console_is_off(make_server):
    server = make_server(admin_address="")
    assert "  admin        console off (--admin-address is empty)" in _banner(server)
