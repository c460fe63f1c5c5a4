"""The registry's rows on every cluster: each database holds ``dmq_topic`` and
``dmq_channel`` of every topic, because the group commit reads a channel's
``start_id`` there and checks the topic's placement (``insert_messages``).

The registry itself is ZooKeeper (``--zk``) or, without it, the main cluster's tables;
``Mirror`` copies a read of it into the other clusters' databases (``db.topic_steps``
``mirror_topics_steps``: idempotent, serialised between nodes, and never replacing a
row with an older version of it). A cluster that cannot be reached is skipped, logged
once per outage: its topics' sends fail on it anyway, and the next read mirrors again.

One exception, for the order of an ordered topic's keys across ``dmq topic move``: the
old cluster refuses the topic only once its own row names the new one (the move's
fence), and that row is written by these mirrors. A node that routed sends to the new
cluster while the old one was out of its reach would not have fenced it, and another
node, with an older view, could still store a key's next message there after this one
stored the one before on the new cluster; ``dmq topic move`` sends the old cluster's
copies first, so the two would go out of order. So a node routes an ordered topic by a
placement only once it has written that placement into every cluster the topic is
drained from: until then it keeps the placement it routed by before, or with none (it
started during the outage) routes the topic to the old cluster alone. Its sends of the
topic fail while the old cluster is out of reach: an outage, not disorder.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from twisted.internet.defer import Deferred, gatherResults
from twisted.logger import Logger
from twisted.python.failure import Failure

from registry.model import TopicSpec

from dmq_server.core.clock import Clock
from dmq_server.db.storage_errors import StorageError
from dmq_server.db.outage import Outage
from dmq_server.db.runner import StepRunner
from dmq_server.db.topic_steps import Mirrored, mirror_topics_steps

__all__ = ["Mirror", "note_kept"]

log = Logger()


def note_kept(cluster: str, mirrored: Mirrored) -> None:
    """Log the topics whose row on ``cluster`` was newer than the view written."""
    for topic in mirrored.kept:
        log.info("topic {topic!r}: cluster {cluster!r} holds a newer version of it than this node read from "
                 "the registry; its row stays", topic=topic, cluster=cluster)


class Mirror:
    """``targets``: cluster name -> a worker on its database (``run_steps(steps_fn, ...)``)."""

    def __init__(self, targets: Mapping[str, StepRunner], clock: Clock):
        self.targets = dict(targets)
        self._outages = {name: Outage(f"registry mirror into cluster {name!r}", clock) for name in targets}
        self._routed: dict[str, TopicSpec] = {}  # what mirror() fired with last, by topic
        self._waiting: set[str] = set()  # ordered topics routed as before their move (logged once)

    def mirror(self, specs: Sequence[TopicSpec], removals: bool = True) -> Deferred[list[TopicSpec]]:
        """Fires, once every reachable cluster holds ``specs``, with the specs to route
        by: ``specs``, but for an ordered topic drained from a cluster not reached this
        time, the spec fired with last, or with none, the topic on that cluster alone.
        ``removals``: False for a view kept from an earlier read (``mirror_topics_steps``)."""
        names = list(self.targets)
        done = [self._one(name, self.targets[name], specs, removals) for name in names]
        return gatherResults(done).addCallback(
            lambda reached: self._routable(specs, {name for name, ok in zip(names, reached) if not ok})
        )

    def _one(self, name: str, worker: StepRunner, specs: Sequence[TopicSpec], removals: bool) -> Deferred[bool]:
        """Whether ``name`` now holds ``specs`` (or newer rows)."""
        outage = self._outages[name]

        def done(mirrored: Mirrored) -> bool:
            outage.recovered()
            note_kept(name, mirrored)
            return True

        def failed(failure: Failure) -> bool:
            failure.trap(StorageError)
            outage.failed(str(failure.value))
            return False

        return worker.run_steps(mirror_topics_steps, list(specs), removals).addCallbacks(done, failed)

    def _routable(self, specs: Sequence[TopicSpec], missed: set[str]) -> list[TopicSpec]:
        routed, waiting = [], set()
        for spec in specs:
            unfenced = [c for c in spec.draining if c in missed and c != spec.cluster] if spec.ordered else []
            if unfenced:
                last = self._routed.get(spec.name)
                if last is None:  # not routed here before the move: as it was before it
                    last = dataclasses.replace(spec, cluster=unfenced[0], draining=())
                if last != spec:
                    waiting.add(spec.name)
                    if spec.name not in self._waiting:
                        log.warn("ordered topic {topic!r} moves to cluster {to!r}; this node routes it to {now!r} "
                                 "until it reaches {old!r} to fence it", topic=spec.name, to=spec.cluster,
                                 now=last.cluster, old=unfenced[0])
                    spec = last
            elif spec.name in self._waiting:
                log.info("ordered topic {topic!r}: its old cluster is fenced; this node routes it to {to!r}",
                         topic=spec.name, to=spec.cluster)
            routed.append(spec)
        self._routed = {spec.name: spec for spec in routed}
        self._waiting = waiting
        return routed
