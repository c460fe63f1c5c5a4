"""Delay fragments shared among live nodes through ZooKeeper (kazoo's SetPartitioner).

Every node joins the party under ``/dmq/delay/fragments`` with its node id. The
fragments 1..F are split into contiguous runs, one per live member in id order,
and each member holds its run's locks. When a node joins or leaves (a clean
shutdown leaves the party; a crashed node's session expires), every member
releases and the set is partitioned again among the survivors, so no fragment
stays unserved while any node lives. During a rebalance a node owns nothing for
a moment (``time_boundary`` plus lock handover): due rows only wait, since the
delay table is the source of truth. A partitioner that fails starts over on a new
session: kazoo's can fail still holding fragment locks, and only the end of the
session that holds them lets the other members take them.

kazoo's threads never touch reactor state: the partitioner is driven by a
thread of this class, which announces changes with ``reactor.callFromThread``.
It has its own ZooKeeper session, so the assignment follows this node's liveness
whatever the registry does with its own session.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from twisted.logger import Logger

from dmq_server.core.clock import Clock
from dmq_server.core.fragment_ranges import all_fragments, split_fragments

if TYPE_CHECKING:
    from twisted.internet.defer import Deferred

__all__ = ["ZkFragmentAssignment", "PARTITION_PATH", "PartitionerFailed", "contiguous_partition"]

log = Logger()


class PartitionerFailed(Exception):
    """kazoo's SetPartitioner gave up (a lock it could not take or release, a logic check);
    the thread starts over with a new ZooKeeper session."""


#: the partitioner's znode (party members and per-fragment locks below it)
PARTITION_PATH = "/dmq/delay/fragments"


def _quietly(fn: Callable[[], object]) -> None:
    """Call ``fn`` ignoring kazoo's errors: on the way out a lost session or a closed
    client only means ZooKeeper already forgot us."""
    try:
        fn()
    except Exception:
        pass


def contiguous_partition(identifier: str, members: Sequence[str], partitions: Sequence[int]) -> list[int]:
    """This member's contiguous run of the sorted fragments (members in sorted order)."""
    ordered = sorted(members)
    if identifier not in ordered:
        return []
    runs = split_fragments(frozenset(partitions), len(ordered))
    return list(runs[ordered.index(identifier)])


class ThreadedClock(Clock, Protocol):
    """What the assignment asks of the reactor: timers, and a call handed to the reactor
    thread from the partitioner's (``callFromThread``)."""

    def callFromThread(self, callable: Callable[..., object], *args: object, **kwargs: object) -> None: ...


class ZkFragmentAssignment:
    """A ``FragmentAssignment`` over ZooKeeper. ``connect()`` returns a started kazoo
    client (``registry.zk.connect`` for an address), called on this class's thread."""

    def __init__(
        self,
        connect: Callable[[], Any],
        count: int,
        reactor: ThreadedClock,
        node_id: str,
        *,
        time_boundary: float = 1.0,
        max_reaction_time: float = 0.5,
        leave_timeout: float = 3.0,
        stop_timeout: float = 8.0,
    ):
        self._connect = connect
        self.count = count
        self.fragments = all_fragments(count)
        self.reactor = reactor
        self.node_id = node_id
        self.time_boundary = time_boundary
        self.max_reaction_time = max_reaction_time
        #: longest wait for ZooKeeper to take our leave before the client is stopped
        self.leave_timeout = leave_timeout
        #: longest a stop takes on the reactor's side (below the server's 10 s bound on it)
        self.stop_timeout = stop_timeout
        self.owned: frozenset[int] = frozenset()
        self.members: list[str] = []
        self.state = "starting"
        self.rebalances = 0
        self._on_change: Callable[[frozenset[int]], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self._partitioner: Any = None
        #: orders "stop is set, read the client to close" against "connected, keep the
        #: client", so a client connected while stopping is closed by exactly one side
        self._client_lock = threading.Lock()

    # -- FragmentAssignment ------------------------------------------------------
    def start(self, on_change: Callable[[frozenset[int]], None]) -> None:
        self._on_change = on_change
        self._thread = threading.Thread(target=self._run, name="dmq-delay-partitioner", daemon=True)
        self._thread.start()

    def stop(self) -> Deferred[None]:
        """Leave the party (the others take our fragments at once) and close the session.

        Returns a Deferred that fires within ``stop_timeout`` seconds whatever ZooKeeper
        does. A kazoo request made just before ZooKeeper vanished (a lock release, the
        party leave) waits for it indefinitely, so the blocking work runs on a daemon
        thread of its own, never on the reactor's pool: the reactor joins its pool at
        shutdown, and one stuck thread there kept a stopped node from exiting. If we
        give up, our party node goes when the session expires, as after a crash."""
        from twisted.internet.defer import Deferred

        self._stop.set()
        self._on_change = None
        done: Deferred[None] = Deferred()

        def finished() -> None:
            if not done.called:
                timer.cancel()
                done.callback(None)

        def give_up() -> None:
            log.warn(
                "ZooKeeper did not answer within {timeout} s while leaving the delay fragment "
                "party; stopping anyway (the session's expiry hands our fragments over)",
                timeout=self.stop_timeout,
            )
            done.callback(None)

        def work() -> None:
            try:
                self._stop_blocking()
            finally:
                self.reactor.callFromThread(finished)

        timer = self.reactor.callLater(self.stop_timeout, give_up)
        threading.Thread(target=work, name="dmq-delay-partitioner-stop", daemon=True).start()
        return done

    def _stop_blocking(self) -> None:
        self._stop.set()
        with self._client_lock:
            partitioner, client = self._partitioner, self._client
        # A kazoo call made while disconnected waits until ZooKeeper is back, so only
        # leave the party when connected; otherwise the session's expiry removes our
        # party node anyway. Even when connected ZooKeeper may go the next moment, so
        # the leave is waited for only ``leave_timeout`` seconds; stopping the client
        # then fails the request it waits on.
        if partitioner is not None and client is not None and client.connected:
            leaver = threading.Thread(
                target=_quietly, args=(partitioner.finish,), name="dmq-delay-partitioner-leave", daemon=True
            )
            leaver.start()
            leaver.join(self.leave_timeout)
        if client is not None:
            _quietly(client.stop)
            _quietly(client.close)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.leave_timeout)

    def describe(self) -> dict:
        return {
            "kind": "zookeeper",
            "path": PARTITION_PATH,
            "fragments": self.count,
            "owned": sorted(self.owned),
            "state": self.state,
            "rebalances": self.rebalances,
        }

    # -- the partitioner thread ---------------------------------------------------
    def _announce(self, owned: frozenset[int]) -> None:
        if owned == self.owned:
            return
        self.owned = owned
        if owned:
            self.rebalances += 1
        if self._on_change is not None:
            self.reactor.callFromThread(self._on_change, owned)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._client is None:
                    client = self._connect()
                    with self._client_lock:
                        stopping = self._stop.is_set()
                        if not stopping:
                            self._client = client
                    if stopping:  # stop found no client to close: this one is ours to close
                        _quietly(client.stop)
                        _quietly(client.close)
                        return
                self._partition(self._client)
            except Exception as exc:  # connection or session trouble: start over
                if self._stop.is_set():
                    break
                self.state = "failed"
                self._announce(frozenset())
                log.warn("delay fragment partitioning failed, retrying: {why}", why=exc)
                client, self._client = self._client, None
                if client is not None:
                    try:
                        client.stop()
                        client.close()
                    except Exception:
                        pass
                self._stop.wait(1.0)

    def _partition(self, client: Any) -> None:
        from kazoo.recipe.partitioner import SetPartitioner

        changed = threading.Event()
        partitioner = SetPartitioner(
            client,
            PARTITION_PATH,
            sorted(self.fragments),
            partition_func=contiguous_partition,
            identifier=self.node_id,
            time_boundary=self.time_boundary,
            max_reaction_time=self.max_reaction_time,
            state_change_event=changed,
        )
        self._partitioner = partitioner
        # on stop, _stop_blocking leaves the party (bounded): this thread must not wait
        # on ZooKeeper a second time, so it simply returns
        while not self._stop.is_set():
            changed.clear()
            if partitioner.failed:
                # kazoo's partitioner can fail holding fragment locks (it leaves the party
                # without releasing them). A new partitioner on the same session waited
                # for its own predecessor's locks, and every other member for them too:
                # no node moved a delayed message again (chaos clock-jump: a node
                # restarted under faketime). Only closing the session frees every lock
                # it holds, so start over on a new one.
                raise PartitionerFailed("kazoo's partitioner failed; its session is closed to free its locks")
            if partitioner.release:
                self.state = "rebalancing"
                self._announce(frozenset())
                partitioner.release_set()
                continue
            if partitioner.acquired:
                self.state = "acquired"
                self._announce(frozenset(partitioner))
                changed.wait(1.0)
                continue
            self.state = "allocating"
            self._announce(frozenset())
            partitioner.wait_for_acquire(timeout=1.0)
