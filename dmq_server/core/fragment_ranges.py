"""Which delay fragments this node serves, and how its workers split them.

Every delayed message gets a random fragment 1..F (``--delay-fragments``). A
node serves the fragments its ``FragmentAssignment`` gives it; its delay workers
(``--delay-workers``) each take a contiguous run of those, in order: with 8
fragments and 2 workers, 1–4 and 5–8 (DMQ's DelayJOB threads).

``StaticAssignment`` is the single-node (PostgreSQL registry) case: this node
owns every fragment. Several static nodes on one database are still correct,
since workers take rows with ``FOR UPDATE SKIP LOCKED``; they only contend for
the same rows. A cluster shares fragments out among live nodes through
ZooKeeper (kazoo's ``SetPartitioner``); that implementation plugs in behind the
same interface (``start(on_change)``, ``stop()``, ``owned``).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

__all__ = ["FragmentAssignment", "StaticAssignment", "SharedAssignment", "split_fragments", "all_fragments"]


def all_fragments(count: int) -> frozenset[int]:
    """Fragments 1..count."""
    if count < 1:
        raise ValueError(f"fragment count must be at least 1, got {count}")
    return frozenset(range(1, count + 1))


def split_fragments(owned: Sequence[int] | frozenset[int], workers: int) -> list[tuple[int, ...]]:
    """Split ``owned`` fragments, in order, into ``workers`` contiguous runs.

    The runs differ in size by at most one, larger runs first (9 over 2: 5 and 4).
    With fewer fragments than workers, the extra workers get an empty run: they
    idle until a rebalance hands this node more fragments.
    """
    if workers < 1:
        raise ValueError(f"worker count must be at least 1, got {workers}")
    ordered = sorted(owned)
    base, extra = divmod(len(ordered), workers)
    runs: list[tuple[int, ...]] = []
    start = 0
    for i in range(workers):
        size = base + (1 if i < extra else 0)
        runs.append(tuple(ordered[start : start + size]))
        start += size
    return runs


class FragmentAssignment(Protocol):
    """The fragments this node serves; calls ``on_change(owned)`` whenever they change."""

    @property
    def owned(self) -> frozenset[int]:
        """The fragments owned now (empty while a rebalance is in progress)."""

    def start(self, on_change: Callable[[frozenset[int]], None]) -> None: ...

    # what stopping returns is passed along: a Deferred where leaving takes time (ZooKeeper)
    def stop(self) -> object: ...


class StaticAssignment:
    """This node owns all fragments (no cluster membership to share them by)."""

    def __init__(self, count: int):
        self.count = count
        self.owned = all_fragments(count)

    def start(self, on_change: Callable[[frozenset[int]], None]) -> None:
        on_change(self.owned)

    def stop(self) -> None:
        pass

    def describe(self) -> dict:
        return {"kind": "static", "fragments": self.count, "owned": sorted(self.owned)}


class SharedAssignment:
    """One node's assignment serving several delay schedulers (one per PostgreSQL
    cluster): a node serves the same fragments on every cluster, and joins the
    fragment party once. ``stop`` stops the assignment after the last scheduler's."""

    def __init__(self, inner: FragmentAssignment):
        self.inner = inner
        self._listeners: list[Callable[[frozenset[int]], None]] = []
        self._running = 0

    @property
    def owned(self) -> frozenset[int]:
        return self.inner.owned

    def start(self, on_change: Callable[[frozenset[int]], None]) -> None:
        self._listeners.append(on_change)
        self._running += 1
        if self._running == 1:
            self.inner.start(self._changed)
        else:
            on_change(self.inner.owned)

    def _changed(self, owned: frozenset[int]) -> None:
        for listener in list(self._listeners):
            listener(owned)

    def stop(self) -> object:
        self._running -= 1
        return self.inner.stop() if self._running == 0 else None

    def describe(self) -> dict:
        describe = getattr(self.inner, "describe", None)
        return describe() if describe else {}
