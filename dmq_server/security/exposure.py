"""The loud warning at start: a listener reachable from other hosts without TLS or auth.

Listeners default to loopback; an operator who binds one to another address should hear,
once and plainly, what anyone who reaches it can do.
"""

from __future__ import annotations

from dmq_server.core.peers import is_loopback

__all__ = ["exposure_warnings"]


def exposure_warnings(listeners: list[tuple[str, str, bool, bool]]) -> list[str]:
    """One sentence per ``(name, host, tls, auth)`` listener on a non-loopback address that
    lacks TLS, authentication or both."""
    out = []
    for name, host, tls, auth in listeners:
        if is_loopback(host):
            continue
        missing = [what for what, ok in (("TLS", tls), ("authentication", auth)) if not ok]
        if missing:
            out.append(
                f"{name} listens on non-loopback address {host or '*'} without {' or '.join(missing)}: "
                "anyone who can reach it can "
                + ("read what it sends" if auth else "publish, consume and administer topics")
                + " (see docs/operations.md, Security)"
            )
    return out
