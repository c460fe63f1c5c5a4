"""The registry's rows on every cluster: each database holds ``dmq_topic`` and
``dmq_channel`` of every topic, because the group commit reads a channel's
``start_id`` there and checks the topic's placement (``insert_messages``).

The registry itself is ZooKeeper (``--zk``) or, without it, the main cluster's tables;
``mirror_to`` copies a read of it into the other clusters' databases (``db.topic_steps``
``mirror_topics_steps``: idempotent, serialised between nodes). A cluster that cannot be
reached is skipped, logged once per outage: its topics' sends fail on it anyway, and
the next read mirrors again.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from twisted.internet.defer import Deferred, gatherResults
from twisted.python.failure import Failure

from registry.model import TopicSpec

from dmq_server.core.clock import Clock
from dmq_server.db.storage_errors import StorageError
from dmq_server.db.outage import Outage
from dmq_server.db.runner import StepRunner
from dmq_server.db.topic_steps import mirror_topics_steps

__all__ = ["Mirror"]


class Mirror:
    """``targets``: cluster name -> a worker on its database (``run_steps(steps_fn, ...)``)."""

    def __init__(self, targets: Mapping[str, StepRunner], clock: Clock):
        self.targets = dict(targets)
        self._outages = {name: Outage(f"registry mirror into cluster {name!r}", clock) for name in targets}

    def mirror(self, specs: Sequence[TopicSpec]) -> Deferred[Sequence[TopicSpec]]:
        """Fires with ``specs`` once every reachable cluster holds them."""
        done = [self._one(name, worker, specs) for name, worker in self.targets.items()]
        return gatherResults(done).addCallback(lambda _: specs)

    def _one(self, name: str, worker: StepRunner, specs: Sequence[TopicSpec]) -> Deferred[None]:
        outage = self._outages[name]

        def failed(failure: Failure) -> None:
            failure.trap(StorageError)
            outage.failed(str(failure.value))

        return worker.run_steps(mirror_topics_steps, list(specs)).addCallbacks(lambda _: outage.recovered(), failed)
