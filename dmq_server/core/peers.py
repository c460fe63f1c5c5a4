"""How a connection's peer is named in logs and stats (``host:port``), and which hosts are
this machine only (loopback)."""

from __future__ import annotations

import ipaddress
from typing import Any

__all__ = ["peer_address", "peer_host", "is_loopback"]


def peer_address(transport: Any) -> str:
    """``host:port`` (``[v6]:port``) of the transport's peer, or ``?`` when it has none (a test
    transport, a connection already gone): a log line must never fail for it."""
    try:
        peer = transport.getPeer()
        host = peer.host
        return f"[{host}]:{peer.port}" if ":" in host else f"{host}:{peer.port}"
    except Exception:
        return "?"


def peer_host(peer: str) -> str:
    """The host of a ``peer_address`` (``[v6]:port`` gives ``v6``): nsqd's ``remote_ip``."""
    return peer.rsplit(":", 1)[0].strip("[]") if ":" in peer else peer


def is_loopback(host: str) -> bool:
    """True for a loopback address or ``localhost``; False for anything else, including
    the empty host (every interface)."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
