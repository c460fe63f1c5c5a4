"""The statements of takeover: who owns stored copies, and moving them to a live node.

The protocol around them (ZooKeeper locks, liveness checks, batching, rescans) is
``dmq_server.cluster.takeover``.
"""

from __future__ import annotations

from typing import Any

from dmq_sql import queries

__all__ = ["delivery_owners", "claim_deliveries", "owner_depths"]


def delivery_owners(conn: Any) -> list[str]:
    """Every node that owns at least one stored copy."""
    return [row[0] for row in conn.execute(queries["delivery_owners"])]


def claim_deliveries(conn: Any, dead: str, owner: str, limit: int) -> list[tuple[str, str, int]]:
    """Move up to ``limit`` of ``dead``'s copies to ``owner``: [(topic, channel, count)]."""
    rows = conn.execute(
        queries["claim_deliveries"], {"dead": dead, "owner": owner, "limit": limit}
    ).fetchall()
    return [(r[0], r[1], int(r[2])) for r in rows]


def owner_depths(conn: Any) -> dict[str, int]:
    """Unacknowledged copies per owning node."""
    return {row[0]: int(row[1]) for row in conn.execute(queries["owner_depths"])}
