"""Listening ports for the servers dmq starts by itself: the embedded PostgreSQL, the
members of a local Patroni cluster, and the servers its tests start.

Why not port 0: the kernel answers with a port from its ephemeral range, and from the
moment we learn it until the server binds it, or while the server is down for a restart
on the same address, any outgoing connection on the machine may be given that port. A
test saw exactly that: ``Couldn't listen on 127.0.0.1:51473: Address already in use``.
The kernel never gives an outgoing connection a port outside its ephemeral range, so a
port chosen there that is free now stays ours, unless another program binds it on
purpose.

Two bands keep the two kinds of caller apart: ``STABLE`` for servers whose port must not
move across restarts (derived from a seed such as a data directory, recorded by the
caller), ``FRESH`` for ports that only have to differ from every port this process was
given before (``fresh_port``).
"""

from __future__ import annotations

import os
import socket
import threading
import zlib
from pathlib import Path

__all__ = ["STABLE", "FRESH", "ephemeral_range", "port_free", "pick_port", "fresh_port"]

STABLE = (20000, 30000)
FRESH = (10000, 20000)
_TRIES = 500


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections (Linux' default when unknown)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now. SO_REUSEADDR as the servers
    set it (PostgreSQL, Twisted, Java): a TIME_WAIT leftover of an earlier server on the
    port does not stop them, so it does not count as taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def pick_port(host: str, seed: str, avoid: set[int] | frozenset[int] = frozenset(),
              band: tuple[int, int] = STABLE) -> int:
    """A free port in ``band`` outside the ephemeral range, the first free one from a
    place derived from ``seed`` (so a seed keeps its port while that port stays free).
    If none of the tried ports is free, the kernel's choice."""
    low, high = ephemeral_range()
    allowed = [p for p in range(*band) if not low <= p <= high]
    start = zlib.crc32(seed.encode()) % len(allowed) if allowed else 0
    for offset in range(min(_TRIES, len(allowed))):
        port = allowed[(start + offset) % len(allowed)]
        if port not in avoid and port_free(host, port):
            return port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


_given: set[int] = set()
_lock = threading.Lock()


def fresh_port(host: str = "127.0.0.1") -> int:
    """A free port this process has not been given before: servers started side by side
    (and restarted on their address) never race for one. The process id seeds the
    search, so two processes choosing at the same moment start far apart."""
    with _lock:
        port = pick_port(host, f"{os.getpid()}:{len(_given)}", avoid=_given, band=FRESH)
        _given.add(port)
        return port
