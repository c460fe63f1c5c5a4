"""Whether watched messages were consumed: the statement behind ``SEND_CONSUMED_ACK``.

``reliable.confirm.Confirmations`` holds the messages producers asked about and asks
this a few times a second while it holds any; the answer comes from the channels'
cursors and the dead letters in PostgreSQL, so it holds whichever node pushed the
copies and was acknowledged (docs/protocol.md §4.14).
"""

from __future__ import annotations

from typing import Sequence

from dmq_server.db.steps import Statement, Steps

__all__ = ["ACKED", "DEAD", "WAITING", "consumed_states_steps"]

ACKED, DEAD, WAITING = "acked", "dead", "waiting"


def consumed_states_steps(watched: Sequence[tuple[int, str]]) -> Steps[list[tuple[int, str, str]]]:
    """For each ``(message_id, topic)``, a row ``(message_id, channel, state)`` per channel
    that was to consume it, ``state`` one of ``ACKED``, ``DEAD``, ``WAITING``; ordered by
    message id, then channel."""
    rows = yield Statement("consumed_states", {"ids": [w[0] for w in watched], "topics": [w[1] for w in watched]})
    return [(int(r[0]), str(r[1]), str(r[2])) for r in rows]
