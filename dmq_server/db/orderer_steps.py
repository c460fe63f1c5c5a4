"""The statements of an ordered topic's orderer: claiming the topic's cursors, and
giving them back.

In a cluster one node at a time delivers an ordered topic (its orderer, placed by a
ZooKeeper lock: issue 45 §2 across nodes), whichever node stored the copies. The fence
stays in the database: ``dmq_cursor.holder`` names the node whose acks and dead letters
move a cursor (``ack_deliveries``/``exhaust_deliveries`` with ``fenced``). A node that
wins the topic claims every cursor of it before it loads anything, so from then on the
previous orderer's acks, even ones flushed after a freeze, are refused. When the topic
stops being ordered, the orderer gives each live incarnation's cursors back to that
incarnation's node, which delivers its own copies again. The takeover of a departed node
(``db.takeover_steps``) leaves ordered topics' cursors alone: their orderer claims them.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from dmq_server.db.steps import Statement, Steps, run_steps

__all__ = ["Claimed", "claim_ordered_cursors_steps", "reclaim_ordered_cursors_steps", "claim_ordered_cursors", "release_ordered_cursors_steps",
           "release_ordered_cursors"]


@dataclass(frozen=True)
class Claimed:
    """What a claim did: how many cursors it opened or moved, and the nodes it moved them
    from (empty: every cursor was new, or ``me``'s already, or let go cleanly)."""

    count: int
    taken_from: frozenset[str]


def claim_ordered_cursors_steps(topic: str, me: str) -> Steps[Claimed]:
    """Become the holder of every cursor of ``topic``: open the cursor of each (channel,
    incarnation with messages for it) that has none, then move the others held by other
    nodes.

    Two statements: the second's snapshot sees a cursor that an ack of the previous
    orderer created while the first ran (the first then waited for it and left it),
    which one statement's single snapshot would leave with that node."""
    ((opened,),) = yield Statement("open_ordered_cursors", {"topic": topic, "me": me}, count=True)
    previous = yield Statement("claim_ordered_cursors", {"topic": topic, "me": me})
    return Claimed(int(opened) + len(previous), frozenset(h for (h,) in previous if h is not None))


def reclaim_ordered_cursors_steps(topic: str, me: str) -> Steps[Claimed]:
    """The claim's second half alone, run by the orderer every round while it holds the
    topic: a late ack of the previous orderer may have opened a cursor in that node's
    name (the first half runs once, on a gain: its join of every incarnation with every
    channel is the costly part, and it waits on the cursors an ack batch holds)."""
    previous = yield Statement("claim_ordered_cursors", {"topic": topic, "me": me})
    return Claimed(len(previous), frozenset(h for (h,) in previous if h is not None))


def claim_ordered_cursors(conn: psycopg.Connection, topic: str, me: str) -> Claimed:
    """``claim_ordered_cursors_steps`` over a blocking connection (tests, tools)."""
    return run_steps(conn, claim_ordered_cursors_steps(topic, me))


def release_ordered_cursors_steps(topic: str, me: str) -> Steps[int]:
    """Give each cursor of ``topic`` that ``me`` holds back to its incarnation's node,
    when that incarnation is live (not retired); a retired one's stay with ``me``, which
    keeps delivering them. How many cursors changed hands."""
    ((given,),) = yield Statement("release_ordered_cursors", {"topic": topic, "me": me}, count=True)
    return int(given)


def release_ordered_cursors(conn: psycopg.Connection, topic: str, me: str) -> int:
    """``release_ordered_cursors_steps`` over a blocking connection (tests, tools)."""
    return run_steps(conn, release_ordered_cursors_steps(topic, me))
