"""How a connection's peer is named in logs and stats (``host:port``)."""

from __future__ import annotations

from typing import Any

__all__ = ["peer_address"]


def peer_address(transport: Any) -> str:
    """``host:port`` (``[v6]:port``) of the transport's peer, or ``?`` when it has none (a test
    transport, a connection already gone): a log line must never fail for it."""
    try:
        peer = transport.getPeer()
        host = peer.host
        return f"[{host}]:{peer.port}" if ":" in host else f"{host}:{peer.port}"
    except Exception:
        return "?"
