"""Delayed messages: the fragmented scheduler over the delay table.

A DELAY send (or NSQ ``DPUB`` / ``/pub?defer`` to a reliable topic) is stored in
``dmq_delay`` with its due time and a random fragment 1..F, by its own group
commit (``insert_delayed``), and acknowledged once committed.

Each ``DelayWorker`` owns a contiguous run of this node's fragments
(``fragments.split_fragments``) and one database connection. It *polls* every
``--delay-poll-interval`` (an APScheduler interval job: APScheduler only wakes
it up) for the due times in its fragments up to the end of the next window,
and holds them in a heap behind **one** timer on the injected clock. When the
timer fires, one transaction (``move_due``) takes every row due by now with
``FOR UPDATE SKIP LOCKED``, deletes it and inserts the message and its
deliveries, so a due row becomes exactly one message even with several workers
or nodes on the same fragments. The delay table stays the source of truth: a
lost timer or a crash only delays a row until the next poll.

Sends stored by this node and falling due inside the current window are pushed
into the owning worker's heap as they commit (``DelayScheduler.notify``), so
they are not late by up to a window. Rows written by other nodes into this
node's fragments are found by the next poll.

The delay table's statements and values live in ``dmq_server.db.delays`` (re-exported
here for the callers that import them with the scheduler).

Why one long module: the scheduler and its workers share the fragment assignment and the
poll loop; the SQL is in dmq_sql and the values in dmq_server.db.delays.
"""

from __future__ import annotations

import heapq
import random
from typing import Callable, Protocol, Sequence

from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_server.core.clock import Clock, Timer
from dmq_server.core.fragment_ranges import FragmentAssignment, split_fragments
from dmq_server.db.delays import (
    MovedMessage,
    StoredDelay,
    move_due_steps,
    peek_delayed_steps,
)
from dmq_server.db.storage_errors import Fenced, RefusedError
from dmq_server.db.outage import Outage
from dmq_server.db.runner import StepRunner
from dmq_server.db.steps import Steps
from dmq_server.reliable.horizon import OwnWrites

# the statements and their values live in dmq_server.db.delays
__all__ = ["DelayWorker", "DelayScheduler"]

log = Logger()


# -- the scheduler ---------------------------------------------------------------

# ``peek(fragments, max_fragment, until_ms, limit)``: due times; ``move(fragments,
# max_fragment, now_ms, limit, node_id, owner)``: rows taken and messages stored
Peek = Callable[..., Steps[list[int]]]
Move = Callable[..., Steps[tuple[int, list[MovedMessage]]]]


class Job(Protocol):
    """A job of APScheduler's: removed when the scheduler stops."""

    def remove(self) -> None: ...


class JobScheduler(Protocol):
    """What the delay scheduler asks of APScheduler's scheduler: a job run by a trigger
    (``"interval"``, with its options)."""

    def add_job(self, func: Callable[[], object], trigger: str, **options: object) -> Job: ...


class DelayWorker:
    """Serves one contiguous run of fragments: poll, timers, moves. Reactor thread only.

    ``db.run_steps(steps_fn, *args)`` runs the steps in a transaction and returns a
    Deferred (a ``db.worker.DbWorker``, or the in-memory double); ``peek`` and ``move``
    are ``db.delays``' steps, injectable for tests. ``tick`` is the shortest gap between two moves, so a
    steady stream of due times costs at most 1/tick transactions a second.
    """

    def __init__(
        self,
        index: int,
        db: StepRunner,
        clock: Clock,
        *,
        max_fragment: int,
        poll_interval: float,
        batch_size: int,
        tick: float,
        node_id: str,
        on_moved: Callable[[list[MovedMessage]], None],
        peek: Peek = peek_delayed_steps,
        move: Move = move_due_steps,
        on_unknown: Callable[[], None] = lambda: None,
        writes: OwnWrites | None = None,
    ):
        self.index = index
        # this incarnation's open writes (reliable.horizon.OwnWrites): a move stores
        # messages as its owner, so each is an open write until they reach the channels
        self.writes = writes if writes is not None else OwnWrites()
        # a move whose answer was lost may have committed: its messages would sit in
        # PostgreSQL with deliveries no channel was handed (the broker re-reads them)
        self.on_unknown = on_unknown
        self.db = db
        self.clock = clock
        self.max_fragment = max_fragment
        self.poll_interval = poll_interval
        self.batch_size = batch_size
        self.tick = tick
        self.node_id = node_id
        self.on_moved = on_moved
        self._peek = peek
        self._move = move
        self.fragments: tuple[int, ...] = ()
        self._heap: list[int] = []
        self._horizon_ms = 0  # due times up to here are known (heap or moved)
        self._polling_until: int | None = None
        self._notified_while_polling: list[int] = []
        self._timer: Timer | None = None
        self._timer_at: float | None = None
        self._busy = False
        self._want_poll = False
        self._want_move = False
        self._last_move = float("-inf")
        self._retry_delay = 0.0
        self._peek_limit = 10 * batch_size
        self._repoll_at_ms: int | None = None
        self.stopped = False
        # counters for stats
        self.polls = 0
        self.moves = 0
        self.moved = 0
        self.max_late_ms = 0
        self.last_error = ""
        self._outage = Outage(f"delay worker {index}", clock)

    # -- fragments ---------------------------------------------------------------
    def set_fragments(self, fragments: Sequence[int]) -> None:
        """A new run (start or rebalance): forget what was known, poll at once."""
        self.fragments = tuple(fragments)
        self._repoll_at_ms = None
        self._heap = []
        self._horizon_ms = 0
        self._notified_while_polling = []
        self._cancel_timer()
        if self.fragments:
            self.poll()

    def owns(self, fragment: int) -> bool:
        return fragment in self.fragments or (
            fragment > self.max_fragment and self.max_fragment in self.fragments
        )

    # -- polling -----------------------------------------------------------------
    def _now_ms(self) -> int:
        return int(round(self.clock.seconds() * 1000))

    def poll(self) -> None:
        """Learn the due times of the next window (the APScheduler job calls this)."""
        if self.stopped or not self.fragments:
            return
        if self._busy:
            self._want_poll = True
            return
        self._busy = True
        self.polls += 1
        # look a little past the next poll, so windows overlap instead of leaving gaps
        until = self._now_ms() + int(self.poll_interval * 1500)
        self._polling_until = until
        self._notified_while_polling = []
        fragments = self.fragments
        d = self.db.run_steps(self._peek, fragments, self.max_fragment, until, self._peek_limit)
        d.addCallbacks(self._polled, self._failed, callbackArgs=(until, fragments))

    def _polled(self, due: list[int], until: int, fragments: tuple[int, ...]) -> None:
        self._outage.recovered()
        self._busy = False
        self._polling_until = None
        self._retry_delay = 0.0
        if fragments != self.fragments:  # rebalanced meanwhile
            self._after_db()
            return
        if len(due) >= self._peek_limit:
            # more rows wait before the horizon: known up to the last one; poll again
            # once the timers have moved that far
            until = due[-1]
            self._repoll_at_ms = until
        kept = [t for t in self._heap if t > until]
        self._heap = list(due) + kept + self._notified_while_polling
        heapq.heapify(self._heap)
        self._notified_while_polling = []
        self._horizon_ms = max(self._horizon_ms, until)
        self._after_db()

    def notify(self, due_ms: int) -> None:
        """A row due at ``due_ms`` was just committed in one of our fragments."""
        if self.stopped or not self.fragments:
            return
        if self._polling_until is not None:
            self._notified_while_polling.append(due_ms)
            return
        if due_ms <= self._horizon_ms:
            heapq.heappush(self._heap, due_ms)
            self._arm()

    # -- timers and moves --------------------------------------------------------
    def _arm(self) -> None:
        if self.stopped or self._busy or not self._heap:
            if not self._heap:
                self._cancel_timer()
            return
        fire_at = max(self._heap[0] / 1000.0, self._last_move + self.tick)
        if self._timer is not None and self._timer_at == fire_at:
            return
        self._cancel_timer()
        self._timer_at = fire_at
        self._timer = self.clock.callLater(max(0.0, fire_at - self.clock.seconds()), self._fire)

    def _cancel_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self._timer_at = None

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = None
        self.move_now()

    def move_now(self) -> None:
        """Move every row due by now (also called directly after a replay)."""
        if self.stopped or not self.fragments:
            return
        if self._busy:
            self._want_move = True
            return
        self._busy = True
        self.moves += 1
        now = self.clock.seconds()
        self._last_move = now
        now_ms = int(round(now * 1000))
        writes = self.writes
        token = writes.begin()
        d = self.db.run_steps(
            self._move, self.fragments, self.max_fragment, now_ms, self.batch_size, self.node_id, writes.owner
        )
        d.addCallbacks(self._moved, self._move_failed, callbackArgs=(now_ms, token), errbackArgs=(token,))

    def _moved(self, outcome: tuple[int, list[MovedMessage]], now_ms: int, token: int) -> None:
        self._outage.recovered()
        self._busy = False
        self._retry_delay = 0.0
        taken, messages = outcome
        heap = self._heap
        while heap and heap[0] <= now_ms:
            heapq.heappop(heap)
        if messages:
            self.moved += len(messages)
            late = self._now_ms() - min(m.due_ms for m in messages)
            self.max_late_ms = max(self.max_late_ms, late)
            try:
                self.on_moved(messages)
            except Exception:
                log.failure("delivering moved delay messages failed")
            for moved in messages:
                self.writes.seen(moved.message_id)
        self.writes.end(token)
        if taken >= self.batch_size:
            self._want_move = True  # a full batch: more are due right now
        elif self._repoll_at_ms is not None and now_ms >= self._repoll_at_ms:
            self._repoll_at_ms = None
            self._want_poll = True  # the last poll was truncated; learn what comes next
        self._after_db()

    def _move_failed(self, failure: Failure, token: int) -> None:
        error = failure.value
        if isinstance(error, (RefusedError, Fenced)):
            self.writes.end(token)  # nothing of it was committed
        else:
            self.writes.hold(token, getattr(error, "backend_pid", None))
            try:
                self.on_unknown()
            except Exception:
                log.failure("handling a move of unknown outcome failed")
        self._failed(failure)

    def _failed(self, failure: Failure) -> None:
        self._busy = False
        self._polling_until = None
        self.last_error = str(failure.value)
        self._retry_delay = min(max(self._retry_delay * 2, 0.1), self.poll_interval)
        self._outage.failed(f"fragments {_describe_run(self.fragments)}: {failure.value}")
        self._cancel_timer()
        self._timer_at = self.clock.seconds() + self._retry_delay
        self._timer = self.clock.callLater(self._retry_delay, self._retry)

    def _retry(self) -> None:
        self._timer = None
        self._timer_at = None
        self.poll()

    def _after_db(self) -> None:
        if self.stopped:
            return
        if self._want_move:
            self._want_move = False
            self.move_now()
        elif self._want_poll:
            self._want_poll = False
            self.poll()
        else:
            self._arm()

    def stop(self) -> None:
        self.stopped = True
        self._cancel_timer()

    def stats(self) -> dict:
        return {
            "worker": self.index,
            "fragments": list(self.fragments),
            "range": _describe_run(self.fragments),
            "timers_pending": len(self._heap),
            "next_due_ms": self._heap[0] if self._heap else None,
            "polls": self.polls,
            "moves": self.moves,
            "moved": self.moved,
            "max_late_ms": self.max_late_ms,
            "last_error": self.last_error,
        }


def _describe_run(fragments: Sequence[int]) -> str:
    if not fragments:
        return "-"
    if len(fragments) > 1 and list(fragments) == list(range(fragments[0], fragments[-1] + 1)):
        return f"{fragments[0]}-{fragments[-1]}"
    return ",".join(str(f) for f in fragments)


class DelayScheduler:
    """This node's delay workers, their fragment runs and their APScheduler poll jobs."""

    def __init__(
        self,
        *,
        clock: Clock,
        dbs: Sequence[StepRunner],
        assignment: FragmentAssignment,
        fragments: int,
        poll_interval: float,
        batch_size: int,
        tick: float,
        node_id: str,
        on_moved: Callable[[list[MovedMessage]], None],
        on_unknown: Callable[[], None] = lambda: None,
        scheduler: JobScheduler | None = None,
        rng: random.Random | None = None,
        peek: Peek = peek_delayed_steps,
        move: Move = move_due_steps,
        writes: OwnWrites | None = None,
    ):
        self.clock = clock
        self.assignment = assignment
        self.fragment_count = fragments
        self.poll_interval = poll_interval
        self.scheduler = scheduler
        self._rng = rng or random.Random()
        self.workers = [
            DelayWorker(
                i + 1,
                db,
                clock,
                max_fragment=fragments,
                poll_interval=poll_interval,
                batch_size=batch_size,
                tick=tick,
                node_id=node_id,
                on_moved=on_moved,
                on_unknown=on_unknown,
                peek=peek,
                move=move,
                writes=writes,
            )
            for i, db in enumerate(dbs)
        ]
        self.owned: frozenset[int] = frozenset()
        self._jobs: list[Job] = []

    def pick_fragment(self) -> int:
        """A random fragment 1..F for a new delayed message."""
        return self._rng.randint(1, self.fragment_count)

    def start(self) -> None:
        if self.scheduler is not None:
            for worker in self.workers:
                job = self.scheduler.add_job(
                    worker.poll,
                    "interval",
                    seconds=self.poll_interval,
                    id=f"delay-worker-{worker.index}",
                    name=f"delay worker {worker.index} poll",
                    max_instances=1,
                    coalesce=True,
                    misfire_grace_time=max(1, int(self.poll_interval * 10)),
                    replace_existing=True,
                )
                self._jobs.append(job)
        self.assignment.start(self.reassign)

    def reassign(self, owned: frozenset[int]) -> None:
        """The fragments this node owns changed: split them among the workers again."""
        self.owned = frozenset(owned)
        runs = split_fragments(self.owned, len(self.workers))
        log.info(
            "delay fragments {owned}: {runs}",
            owned=_describe_run(sorted(self.owned)),
            runs="; ".join(f"worker {w.index} {_describe_run(r)}" for w, r in zip(self.workers, runs)),
        )
        for worker, run in zip(self.workers, runs):
            if worker.fragments != run:
                worker.set_fragments(run)

    def notify(self, stored: Sequence[StoredDelay]) -> None:
        """Delayed rows this node just committed: hand each due time to its worker."""
        for item in stored:
            if item.duplicate:
                continue
            for worker in self.workers:
                if worker.owns(item.fragment):
                    worker.notify(item.due_ms)
                    break

    def move_now(self) -> None:
        """Every worker moves what is due (after a replay queued rows due now)."""
        for worker in self.workers:
            worker.move_now()

    def stop(self) -> object:
        """Stop the jobs and timers; returns what the assignment's stop returns (a
        Deferred for ZooKeeper, which leaves its party off the reactor thread)."""
        for job in self._jobs:
            try:
                job.remove()
            except Exception:  # the scheduler may already be shut down
                pass
        self._jobs = []
        for worker in self.workers:
            worker.stop()
        return self.assignment.stop()

    def stats(self) -> dict:
        describe = getattr(self.assignment, "describe", None)
        return {
            "fragments": self.fragment_count,
            "owned": sorted(self.owned),
            "assignment": describe() if describe else {},
            "poll_interval_ms": int(self.poll_interval * 1000),
            "workers": [w.stats() for w in self.workers],
        }
