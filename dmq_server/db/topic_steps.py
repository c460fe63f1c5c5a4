"""Reading the PostgreSQL registry as steps, and mirroring ZooKeeper's into it.

``registry.pg`` holds the registry's own operations over a blocking connection (the
CLI); the broker reads the registry through the steps here, and a cluster's node
mirrors ZooKeeper's topics into every database with them, so a ``DbWorker``, a
``ReactorDb`` or the in-memory double can answer both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from registry.model import TopicSpec
from registry.pg import mirror_changes, topic_of_row

from dmq_server.db.steps import Statement, Steps

__all__ = ["list_topics_steps", "mirror_topics_steps", "Mirrored"]


@dataclass(frozen=True, slots=True)
class Mirrored:
    """What a mirror did: whether anything changed, and the topics whose row was newer
    than the view and stayed (``TopicSpec.version``: the node's read was stale)."""

    changed: bool
    kept: tuple[str, ...] = ()
    #: the channels (topic, channel) whose row this mirror inserted (none was there)
    added: tuple[tuple[str, str], ...] = ()


def list_topics_steps() -> Steps:
    """Every topic (``TopicSpec``, channels sorted), in name order."""
    rows = yield Statement("list_topics", {})
    return [topic_of_row(r) for r in rows]


def mirror_topics_steps(specs: Sequence[TopicSpec], removals: bool = True) -> Steps[Mirrored]:
    """Make ``dmq_topic``/``dmq_channel`` equal to ``specs`` (ZooKeeper's view), serialised
    between nodes by an advisory lock (run in a transaction: a ``DbWorker``'s); whether
    anything changed. A topic or channel that disappears takes its undelivered copies with
    it, as ``dmq topic delete`` does on one node (``registry.pg.mirror_changes``). A topic
    whose row is newer than the view (``TopicSpec.version``: this node's read is stale)
    keeps its row (``upsert_topic`` refuses it). Without ``removals`` (a view kept while
    the registry cannot be read) nothing is deleted."""
    yield Statement("lock_registry_mirror", {})
    current = yield from list_topics_steps()
    changes = mirror_changes(current, specs, removals)
    kept, added = [], []
    for name, params in changes:
        rows = yield Statement(name, params)
        if name == "upsert_topic" and not rows:
            kept.append(params["name"])
        elif name == "add_channel" and rows:
            added.append((params["topic"], params["name"]))
    return Mirrored(bool(changes), tuple(kept), tuple(added))
