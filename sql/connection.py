"""Connecting to dmq's PostgreSQL with the session settings dmq relies on.

Shared by the server (``dmq_server.db.worker``, which turns a failure into a
``StorageError``) and the pipeline (``dmq_pipeline.database``): psycopg and the
standard library only, so neither has to import the other. Failures leave as
psycopg's own errors; each caller says what they mean to it.
"""

from __future__ import annotations

import psycopg
import psycopg.conninfo

__all__ = ["DEAD_PEER_SETTINGS", "connect", "describe_error"]

# A database host that vanishes without closing its connections (power, network
# partition) would otherwise hold a batch until the kernel gives up on TCP, many
# minutes later: keepalives find an idle connection dead in about 25 s, and
# tcp_user_timeout a connection whose sent statement stays unacknowledged for 30 s.
# A setting the DSN names itself wins.
DEAD_PEER_SETTINGS = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}


def connect(dsn: str, *, autocommit: bool = False, connect_timeout: int = 5,
            application_name: str = "dmq", settings: dict[str, str] | None = None) -> psycopg.Connection:
    """A connection with durable commits, UTC and dead peers noticed; psycopg.Error if not.
    ``settings``: more session settings (``name: value``) for this caller's connections."""
    given = psycopg.conninfo.conninfo_to_dict(dsn)
    options = {"synchronous_commit": "on", "TimeZone": "UTC", **(settings or {})}
    # the dead-peer settings the DSN leaves out join it as conninfo keywords
    dead_peer = {k: v for k, v in DEAD_PEER_SETTINGS.items() if k not in given}
    return psycopg.connect(
        psycopg.conninfo.make_conninfo(dsn, **dead_peer),
        autocommit=autocommit,
        connect_timeout=connect_timeout,
        options=" ".join(f"-c {name}={value}" for name, value in options.items()),
        application_name=application_name,
    )


def describe_error(exc: BaseException) -> str:
    """The first line of an error's text (psycopg's carry a context and hints after it)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else exc.__class__.__name__
