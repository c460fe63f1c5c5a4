"""The statements of the admin surfaces: dead letters (read, replay, delete), the
admin log, stored counts, and topic settings.

The rules around them (filters, tokens, confirmations, batching, progress, error
codes) are ``dmq_server.admin.operations``; these functions take a blocking
connection (the CLI's, or a ``DbWorker``'s in the server), build the parameters,
run the named statements of ``sql/queries.sql`` and turn rows into values.
"""

from __future__ import annotations

import base64
from typing import Any, Callable, Mapping

from dmq_server.db.delays import delay_stats
from dmq_sql import queries

__all__ = [
    "TOPIC_SETTINGS",
    "list_dead_letters",
    "count_dead_letters",
    "show_dead_letter",
    "replay_batch",
    "delete_batch",
    "log_operation",
    "dead_letter_counts",
    "table_counts",
    "topic_leftovers",
    "stored_stats",
    "update_topic_settings",
    "list_admin_log",
]

#: the topic settings an operator may change, in the column order of lock_topic_settings
TOPIC_SETTINGS = ("msg_timeout_ms", "rate_limit", "ttl_ms", "max_attempts")


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
    }
    if with_body:
        body = bytes(row[14])
        try:
            out["body"] = body.decode("utf-8")
            out["body_encoding"] = "utf-8"
        except UnicodeDecodeError:
            out["body"] = base64.b64encode(body).decode("ascii")
            out["body_encoding"] = "base64"
    return out


# ``selection``: a dead-letter filter's parameters (admin.operations.DeadLetterFilter.params)


def list_dead_letters(conn: Any, selection: Mapping[str, Any], limit: int, after: int) -> list[dict]:
    params = dict(selection, limit=limit, after=after)
    return [_letter(r) for r in conn.execute(queries["list_dead_letters"], params).fetchall()]


def count_dead_letters(conn: Any, selection: Mapping[str, Any]) -> tuple[int, int]:
    """(how many match, how many of them were not replayed yet)."""
    row = conn.execute(queries["count_dead_letters"], dict(selection)).fetchone()
    return row[0], row[1]


def show_dead_letter(conn: Any, letter_id: int) -> dict | None:
    """One dead letter with its body, or None."""
    row = conn.execute(queries["show_dead_letter"], {"id": letter_id}).fetchone()
    return None if row is None else _letter(row, with_body=True)


def replay_batch(
    conn: Any, selection: Mapping[str, Any], after: int, limit: int, fragments: int, now_ms: int, node_id: str
) -> tuple[int | None, int]:
    """Replay one batch; returns (next cursor or None when done, how many were queued)."""
    params = dict(selection, after=after, limit=limit, fragments=fragments, now_ms=now_ms, node_id=node_id)
    last, queued = conn.execute(queries["replay_dead_letters"], params).fetchone()
    return last, queued


def delete_batch(conn: Any, selection: Mapping[str, Any], after: int, limit: int) -> tuple[int | None, int]:
    """Delete one batch; returns (next cursor or None when done, how many were deleted)."""
    params = dict(selection, after=after, limit=limit)
    ids = [r[0] for r in conn.execute(queries["delete_dead_letters"], params).fetchall()]
    return (max(ids) if ids else None), len(ids)


def log_operation(conn: Any, surface: str, actor: str, operation: str, filters: str, affected: int) -> None:
    conn.execute(
        queries["log_admin_operation"],
        {"surface": surface, "actor": actor, "operation": operation, "filters": filters, "affected": affected},
    )


def dead_letter_counts(conn: Any) -> dict:
    rows = conn.execute(queries["dead_letter_counts"]).fetchall()
    return {
        "total": sum(r[1] for r in rows),
        "replayed": sum(r[2] for r in rows),
        "by_reason": {r[0]: r[1] for r in rows},
    }


def table_counts(conn: Any) -> dict:
    """Row counts of the stored tables and the stored depth of every channel."""
    counts = conn.execute(queries["table_counts"]).fetchone()
    return {
        "messages": counts[0],
        "deliveries_pending": counts[1],
        "delivery_log": counts[2],
        "dead_letters": counts[3],
        "channels": [
            {"topic": t, "channel": c, "stored_depth": d}
            for t, c, d in conn.execute(queries["channel_depths"]).fetchall()
        ],
    }


def topic_leftovers(conn: Any, topic: str, fenced_at: Any = None) -> tuple[str | None, int, int, int, Any]:
    """On this cluster: the topic's placement as its row says, its copies waiting, its
    delayed messages, the transactions begun before ``fenced_at`` still running, and the
    database's time now (``dmq topic move``)."""
    row = conn.execute(queries["topic_leftovers"], {"name": topic, "fenced_at": fenced_at}).fetchone()
    placed, pending, delayed, older, now = row
    return placed, pending, delayed, older, now


def stored_stats(conn: Any) -> dict:
    """What the store holds, for the admin surfaces' stats (dead letters by reason,
    delayed messages waiting)."""
    counts = table_counts(conn)
    fragments = delay_stats(conn)
    return {
        "messages": counts["messages"],
        "deliveries_pending": counts["deliveries_pending"],
        "delivery_log": counts["delivery_log"],
        "dead_letters": dead_letter_counts(conn),
        "delayed_pending": sum(f["pending"] for f in fragments),
        "channels": counts["channels"],
    }


def update_topic_settings(
    conn: Any, name: str, change: Callable[[dict], dict]
) -> tuple[dict, dict] | None:
    """Lock the topic's row, read its settings, store ``change(before)``: one
    transaction, so two updates of different settings both stick. Returns (before,
    after), or None if there is no such topic. An exception from ``change`` rolls back."""
    with conn.transaction():
        row = conn.execute(queries["lock_topic_settings"], {"name": name}).fetchone()
        if row is None:
            return None
        before = dict(zip(TOPIC_SETTINGS, row))
        after = change(before)
        conn.execute(queries["update_topic_settings"], {"name": name, **after})
    return before, after


def list_admin_log(conn: Any, before: int, limit: int) -> list[dict]:
    """The audit log, newest first, ids below ``before``."""
    rows = conn.execute(queries["list_admin_log"], {"before": before, "limit": limit}).fetchall()
    return [
        {"id": r[0], "at_ms": r[1], "surface": r[2], "actor": r[3], "operation": r[4], "filters": r[5],
         "affected": r[6]}
        for r in rows
    ]
