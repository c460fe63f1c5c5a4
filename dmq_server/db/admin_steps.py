"""The statements of the admin surfaces: dead letters (read, replay, delete), the
admin log, stored counts, and topic settings.

The rules around them (filters, tokens, confirmations, batching, progress, error
codes) are ``dmq_server.admin.operations``; these are steps (``db.steps``): they build
the parameters, yield the named statements of ``sql/queries.sql`` and turn rows into
values, so the CLI (``run_steps`` on its connection), a ``DbWorker`` in the server and
the in-memory double (``db.memory``) run the same code.
"""

from __future__ import annotations

import base64
from datetime import datetime
from typing import Callable

from dmq_server.db.delays import delay_stats_steps
from dmq_server.db.steps import Params, Statement, Steps

__all__ = [
    "TOPIC_SETTINGS",
    "list_dead_letters_steps",
    "count_dead_letters_steps",
    "show_dead_letter_steps",
    "replay_batch_steps",
    "delete_batch_steps",
    "log_operation_steps",
    "dead_letter_counts_steps",
    "table_counts_steps",
    "topic_leftovers_steps",
    "stored_stats_steps",
    "update_topic_settings_steps",
    "list_admin_log_steps",
]

#: the topic settings an operator may change, in the column order of lock_topic_settings
#: (whose last column, the store, is not one of them)
TOPIC_SETTINGS = ("msg_timeout_ms", "rate_limit", "ttl_ms", "max_attempts", "ordered", "retention_ms")


def _letter(row: tuple, with_body: bool = False) -> dict:
    out = {
        "id": row[0],
        "reason": row[1],
        "detail": row[2],
        "topic": row[3],
        "channel": row[4],
        "producer": row[5],
        "session_id": row[6],
        "message_id": row[7],
        "attempts": row[8],
        "size": row[9],
        "published_ms": row[10],
        "dead_ms": row[11],
        "replayed_ms": row[12],
        "replay_message_id": row[13],
        # the message's properties, kept with the letter and given back by its replay
        "key": row[14],
        "priority": row[15],
        "headers": row[16],
    }
    if with_body:
        body = bytes(row[17])
        try:
            out["body"] = body.decode("utf-8")
            out["body_encoding"] = "utf-8"
        except UnicodeDecodeError:
            out["body"] = base64.b64encode(body).decode("ascii")
            out["body_encoding"] = "base64"
    return out


# ``selection``: a dead-letter filter's parameters (admin.operations.DeadLetterFilter.params)


def list_dead_letters_steps(selection: Params, limit: int, after: int) -> Steps:
    rows = yield Statement("list_dead_letters", dict(selection, limit=limit, after=after))
    return [_letter(r) for r in rows]


def count_dead_letters_steps(selection: Params) -> Steps:
    """(how many match, how many of them were not replayed yet)."""
    ((total, waiting),) = yield Statement("count_dead_letters", dict(selection))
    return total, waiting


def show_dead_letter_steps(letter_id: int) -> Steps:
    """One dead letter with its body, or None."""
    rows = yield Statement("show_dead_letter", {"id": letter_id})
    return _letter(rows[0], with_body=True) if rows else None


def replay_batch_steps(
    selection: Params, after: int, limit: int, fragments: int, now_ms: int, node_id: str
) -> Steps:
    """Replay one batch; returns (next cursor or None when done, how many were queued)."""
    params = dict(selection, after=after, limit=limit, fragments=fragments, now_ms=now_ms, node_id=node_id)
    ((last, queued),) = yield Statement("replay_dead_letters", params)
    return last, queued


def delete_batch_steps(selection: Params, after: int, limit: int) -> Steps:
    """Delete one batch; returns (next cursor or None when done, how many were deleted)."""
    rows = yield Statement("delete_dead_letters", dict(selection, after=after, limit=limit))
    ids = [r[0] for r in rows]
    return (max(ids) if ids else None), len(ids)


def log_operation_steps(surface: str, actor: str, operation: str, filters: str, affected: int) -> Steps:
    yield Statement(
        "log_admin_operation",
        {"surface": surface, "actor": actor, "operation": operation, "filters": filters, "affected": affected},
    )


def dead_letter_counts_steps() -> Steps:
    rows = yield Statement("dead_letter_counts", {})
    return {
        "total": sum(r[1] for r in rows),
        "replayed": sum(r[2] for r in rows),
        "by_reason": {r[0]: r[1] for r in rows},
    }


def table_counts_steps() -> Steps:
    """Row counts of the stored tables and the stored depth of every channel."""
    ((messages, pending, logged, letters),) = yield Statement("table_counts", {})
    depths = yield Statement("channel_depths", {})
    return {
        "messages": messages,
        "deliveries_pending": pending,
        "delivery_log": logged,
        "dead_letters": letters,
        "channels": [{"topic": t, "channel": c, "stored_depth": d} for t, c, d in depths],
    }


def topic_leftovers_steps(topic: str, fenced_at: datetime | None = None) -> Steps:
    """On this cluster: the topic's placement as its row says, its copies waiting, its
    delayed messages, the transactions begun before ``fenced_at`` still running, and the
    database's time now (``dmq topic move``)."""
    ((placed, pending, delayed, older, now),) = yield Statement(
        "topic_leftovers", {"name": topic, "fenced_at": fenced_at}
    )
    return placed, pending, delayed, older, now


def stored_stats_steps() -> Steps:
    """What the store holds, for the admin surfaces' stats (dead letters by reason,
    delayed messages waiting)."""
    counts = yield from table_counts_steps()
    fragments = yield from delay_stats_steps()
    letters = yield from dead_letter_counts_steps()
    return {
        "messages": counts["messages"],
        "deliveries_pending": counts["deliveries_pending"],
        "delivery_log": counts["delivery_log"],
        "dead_letters": letters,
        "delayed_pending": sum(f["pending"] for f in fragments),
        "channels": counts["channels"],
    }


def update_topic_settings_steps(name: str, change: Callable[[dict], dict]) -> Steps:
    """Lock the topic's row, read its settings, store ``change(before)``. Run in one
    transaction (a ``DbWorker``'s, or ``conn.transaction()`` around ``run_steps``), so
    two updates of different settings both stick. ``change`` also sees the topic's
    ``store``. Returns (before, after), or None if there is no such topic. An exception
    from ``change`` rolls the transaction back."""
    rows = yield Statement("lock_topic_settings", {"name": name})
    if not rows:
        return None
    *settings, store = rows[0]
    before = dict(zip(TOPIC_SETTINGS, settings))
    after = change({**before, "store": store})
    yield Statement("update_topic_settings", {"name": name, **after})
    return before, after


def list_admin_log_steps(before: int, limit: int) -> Steps:
    """The audit log, newest first, ids below ``before``."""
    rows = yield Statement("list_admin_log", {"before": before, "limit": limit})
    return [
        {"id": r[0], "at_ms": r[1], "surface": r[2], "actor": r[3], "operation": r[4], "filters": r[5],
         "affected": r[6]}
        for r in rows
    ]
