"""Reading the PostgreSQL registry as steps: every topic with its settings and channels.

``registry.pg`` holds the registry's own operations over a blocking connection (the
CLI, the cluster's mirror); the broker reads the registry through the steps here,
so a ``DbWorker``, a ``ReactorDb`` or the in-memory double can answer it.
"""

from __future__ import annotations

from registry.model import TopicSpec

from dmq_server.db.steps import Statement, Steps

__all__ = ["list_topics_steps"]


def list_topics_steps() -> Steps:
    """Every topic (``TopicSpec``, channels sorted), in name order."""
    rows = yield Statement("list_topics", {})
    return [TopicSpec(r[0], r[1], r[2], r[3], r[4], r[5], tuple(r[6]), r[7], tuple(r[8])) for r in rows]
