"""The broker's cache of the registry: which topics are reliable, which are fast.

Every publish and subscribe asks it which store serves a topic, so it is a dict
lookup; it is refreshed on a timer, when a registry watch fires (with ``--zk``), and
once when a name is not in it, because a topic registered a moment ago must never be
mistaken for an unknown one (or for NSQ's fast topic made on first use). Concurrent
refreshes share one read of the registry.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from registry.model import TopicSpec

__all__ = ["TopicCache", "RELIABLE", "FAST"]

# The stores a topic can live in (``TopicSpec.store``).
RELIABLE = "reliable"
FAST = "fast"


class TopicCache:
    """``fetch()`` reads the registry (a Deferred of ``TopicSpec``s); ``applied(specs)``
    hears each read that succeeded, ``failed(why)`` each that did not."""

    def __init__(
        self,
        fetch: Callable[[], Deferred],
        applied: Callable[[list[TopicSpec]], None],
        failed: Callable[[str], None],
    ):
        self._fetch = fetch
        self._applied = applied
        self._failed = failed
        self.reliable: dict[str, TopicSpec] = {}
        self.fast: dict[str, TopicSpec] = {}  # registered with store=fast
        self._waiters: list[Deferred] | None = None  # callers of the read under way
        self._next: list[Deferred] = []  # callers who need a read that starts later

    def store_of(self, topic: str) -> str | None:
        if topic in self.reliable:
            return RELIABLE
        if topic in self.fast:
            return FAST
        return None

    def spec(self, topic: str) -> TopicSpec | None:
        return self.reliable.get(topic) or self.fast.get(topic)

    def refresh(self, fresh: bool = False) -> Deferred:
        """Re-read the registry; fails with StorageError if PostgreSQL does.

        Concurrent callers share one read: each gets its own Deferred with the shared
        outcome. A ``fresh`` caller (a registry watch fired) needs a read that starts
        after its call, so it waits for the next read, not one under way.
        """
        waiter: Deferred = Deferred()
        if self._waiters is not None:
            (self._next if fresh else self._waiters).append(waiter)
            return waiter
        self._waiters = [waiter]
        self._fetch().addBoth(self._finish)
        return waiter

    def _finish(self, outcome: Any) -> None:
        waiters, self._waiters = self._waiters or [], None
        if isinstance(outcome, Failure):
            self._failed(str(outcome.value))
        else:
            self.reliable = {spec.name: spec for spec in outcome if spec.store == RELIABLE}
            self.fast = {spec.name: spec for spec in outcome if spec.store == FAST}
            self._applied(outcome)
        _fire_all(waiters, outcome)
        following, self._next = self._next, []
        if following:
            self.refresh().addBoth(lambda result: _fire_all(following, result))

    def ensure(self, check: Callable[[], bool]) -> Deferred:
        """True at once if ``check`` passes on the cache, else after one refresh."""
        if check():
            return succeed(True)
        return self.refresh().addCallback(lambda _: check())


def _fire_all(waiters: list[Deferred], outcome: Any) -> None:
    for w in waiters:
        if isinstance(outcome, Failure):
            w.errback(outcome)
        else:
            w.callback(None)
