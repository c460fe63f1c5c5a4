"""The statements of takeover: which incarnations may have left copies, and claiming them.

The copies of a channel are a cursor per owner (an incarnation, migration 0007), and
each cursor names the node delivering it (``holder``). A takeover retires a departed
node's incarnations (nothing more is stored for them) and becomes the holder of their
cursors. The protocol around it (ZooKeeper locks, liveness checks, rescans) is
``dmq_server.cluster.takeover``.
"""

from __future__ import annotations

from typing import Any, Sequence

from dmq_sql import queries

__all__ = ["takeover_candidates", "claim_owners", "owner_depths"]


def takeover_candidates(conn: Any) -> dict[str, list[int]]:
    """Every node that still has an incarnation storing messages, or holds a cursor:
    ``{node_id: [its incarnations not retired]}``."""
    return {row[0]: [int(i) for i in row[1]] for row in conn.execute(queries["takeover_candidates"])}


def claim_owners(
    conn: Any, dead: str, owners: Sequence[int], me: str, live: Sequence[str]
) -> list[tuple[str, str, int]]:
    """Retire ``owners`` (incarnations of ``dead`` that are not live) and hold every
    cursor of theirs, or held by ``dead``, that no node in ``live`` holds. The channels
    whose cursors changed hands: [(topic, channel, cursors)]."""
    rows = conn.execute(
        queries["claim_owners"], {"dead": dead, "owners": list(owners), "me": me, "live": list(live)}
    ).fetchall()
    return [(r[0], r[1], int(r[2])) for r in rows]


def owner_depths(conn: Any) -> dict[str, int]:
    """Unacknowledged copies per node delivering them."""
    return {row[0]: int(row[1]) for row in conn.execute(queries["owner_depths"])}
