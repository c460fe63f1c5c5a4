"""What the server's modules ask of a database connection: run a statement's steps.

``db.worker.DbWorker`` (a thread per connection), ``db.reactor.ReactorDb`` (a
connection the reactor reads) and the in-memory double (``db.memory``) each run a
``steps_fn(*args)`` generator (``db.steps``) and answer with a Deferred of its result.
The stores, the cluster node and the service hold their connections as this, so any of
the three serves them.
"""

from __future__ import annotations

from typing import Callable, Protocol, TypeVar

from twisted.internet.defer import Deferred

from dmq_server.db.steps import Steps

__all__ = ["StepRunner"]

T = TypeVar("T")


class StepRunner(Protocol):
    def run_steps(self, steps_fn: Callable[..., Steps[T]], *args: object) -> Deferred[T]:
        """A Deferred of what ``steps_fn(*args)`` returns once its statements ran, or
        failing with a ``StorageError``."""
