"""The statements of takeover: which incarnations may have left copies, and claiming them.

The copies of a channel are a cursor per owner (an incarnation, migration 0007), and
each cursor names the node delivering it (``holder``). A takeover retires a departed
node's incarnations (nothing more is stored for them) and becomes the holder of their
cursors. The protocol around it (ZooKeeper locks, liveness checks, rescans) is
``dmq_server.cluster.takeover``.
"""

from __future__ import annotations

from typing import Sequence

import psycopg

from dmq_server.db.steps import Statement, Steps, run_steps

__all__ = ["takeover_candidates_steps", "claim_owners_steps", "claim_owners", "owner_depths_steps"]


def takeover_candidates_steps() -> Steps:
    """Every node that still has an incarnation storing messages, or holds a cursor:
    ``{node_id: [its incarnations not retired]}``."""
    rows = yield Statement("takeover_candidates", {})
    return {row[0]: [int(i) for i in row[1]] for row in rows}


def claim_owners_steps(dead: str, owners: Sequence[int], me: str, live: Sequence[str]) -> Steps:
    """Retire ``owners`` (incarnations of ``dead`` that are not live) and hold every
    cursor of theirs, or held by ``dead``, that no node in ``live`` holds. The channels
    whose cursors changed hands: [(topic, channel, cursors)]."""
    rows = yield Statement("claim_owners", {"dead": dead, "owners": list(owners), "me": me, "live": list(live)})
    return [(r[0], r[1], int(r[2])) for r in rows]


def claim_owners(conn: psycopg.Connection, dead: str, owners: Sequence[int], me: str, live: Sequence[str]) -> list[tuple[str, str, int]]:
    """``claim_owners_steps`` over a blocking connection (tests, tools)."""
    return run_steps(conn, claim_owners_steps(dead, owners, me, live))


def owner_depths_steps() -> Steps:
    """Unacknowledged copies per node delivering them."""
    return {row[0]: int(row[1]) for row in (yield Statement("owner_depths", {}))}
