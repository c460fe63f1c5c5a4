"""The outbox relay: committed rows of an application's outbox into dmq's topics, once.

An edge like the TCP protocols: messages come in from outside (here an outbox table that
``dmq outbox install`` created in an application's database, named by ``--outbox
NAME=APP_DSN`` or attached at run time with ``dmq outbox attach``, which ``OutboxRelays``
follows) and go to the broker as publish values. Per outbox, one relay on one node at a
time: it holds a session advisory lock in the application's database
(``db.outbox.hold_relay``); when its connection or its node dies, the lock goes with it
and another node's relay, trying every second, takes over. With ZooKeeper only the node
holding the outbox's ZooKeeper lock tries (``OutboxRelay`` says why both locks).

A cycle reads the next committed rows in id order (a batch) with the tag of the install
they belong to (the producer they go as: ``core.outbox_rows``), asks dmq's database which
of them were stored before (``db.outbox_ledger``: a relay that died after the store and
before the delete), hands the others to the broker in runs (``core.outbox_rows.runs``:
one ``PublishRequest`` of ``Send``s per run of rows to one topic, answered per message by
``Broker.publish_each``), waits for the durable answer and records the rows the broker
refused (unknown topic, body over ``--max-msg-size``, delay past ``--max-delay``) as dead
letters, with the rows whose stored properties break a rule (``core.outbox_rows.outbox_row``:
never published, so never stored without them). Each ``Send`` carries its row's key,
priority and headers. What was stored or dead-lettered is deleted from the outbox by the next read, in
the same call to the application's database (``db.outbox.delete_and_read``), and once that
delete has committed its records are forgotten in the same call to each ledger that asks
about the next batch (``db.outbox_ledger.forget_and_check``): two calls a batch besides
the store. While a full batch is stored the next one is read and checked (without the
rows being stored, which are not deleted yet): the store is the only step a batch waits
for. A row whose store failed for a passing reason (storage unavailable) stays and is
tried again in the next cycle; the rows behind it are not held. With nothing to read the
relay waits for the outbox's NOTIFY, at most ``poll`` seconds (the fallback).

Exactly once: the storing statement itself records each outbox row's (producer, session
id) and skips a row recorded before (the group commit runs ``insert_outbox_messages`` or
``insert_outbox_delayed`` for a batch that holds outbox rows: ``db.messages``, schema
versions 13 and 15), so a repeat is never
stored a second time, whatever ran or died when, and however long after. The relay asks
the ledgers only about rows that may have a record, so that it does not publish repeats
(which the store drops; the broker answers one with the message stored, or, once that
was swept past ``--message-retention``, as not stored: a passing failure, so the row is
asked about at its next try and deleted): the rows with the application's own session
ids (it may send an id again), and the install's numbered rows up to ``_recorded_upto``:
the highest id with a record when this relay took the lock (records are kept until the
row's delete has committed, so every row a relay before it stored and did not delete has
one; the ledgers are read after the lock is taken, when the relay before has stopped
reading), raised to every row whose store this relay tried without a final answer, and to
every row it handed to the broker when a cycle failed. A row above it was never handed to
a broker by any relay. One case is left to the storing statement alone: a relay whose connection to
the application's database ended while its store was on its way to dmq's database, and
that store committing after the next holder read the ledgers; the row is stored once all
the same (the next holder's store of it is such a repeat). A delete runs only
on the connection that holds the lock (``db.outbox.delete_and_read`` checks its backend):
a record is forgotten only once no relay can read its row again. A new install's rows are
no repeats of an earlier one's with the same ids: each install has its own tag.

Order: runs to different topics are published together, the runs of one topic one after
another, each once the one before was answered (committed), and a run is never longer
than the group commit's batch (``max_run``), which ``GroupCommitWriter`` then stores in one
transaction; a batch read ahead is published once every run of the one before was
answered. So the rows of one transaction get message ids in the order it sent them (they
commit together: one read sees all of them or none, and the next batch is read from the
start of the outbox, only the batch being stored left out).
What does not hold: a row kept for a passing failure is stored after rows behind it (the
rest of its topic's runs in the batch wait with it, but a full batch reads on); a run whose
batch PostgreSQL refused is split in halves that may commit side by side; and a delayed
run goes to the delay table row by row. Every other run reaches the group commit whole,
whichever way ``Broker.publish_each`` takes it (a topic with a rate limit, on another
``--pg-cluster`` cluster or not cached yet included: ``Broker._publish_run``); rows the
rate limit refuses become dead letters and the rest keep their order.

Why one long module: the cycle, the read ahead and the ledger's bookkeeping share one
relay's state (what it handed, what it has yet to delete, which rows may have a record),
and each rule of exactly once above is kept by more than one of them; split apart, that
state would be passed around; ``OutboxRelays`` is the few lines that start one per outbox.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from twisted.internet.defer import Deferred, DeferredList, ensureDeferred, gatherResults, succeed
from twisted.internet.interfaces import IReactorFromThreads
from twisted.logger import Logger

from dmq_server.broker.interfaces import BrokerPort
from dmq_server.core.clock import Clock, Timer
from dmq_server.core.errors import Refused
from dmq_server.core.options import Options
from dmq_server.core.outbox_figures import Measured, OutboxFigures, holder_label
from dmq_server.core.outbox_rows import (
    OutboxRow, OutboxSource, parse_outbox, producer_of, relay_producers, runs, session_of,
)
from dmq_server.core.publish import Published, new_request, new_send
from dmq_server.db import outbox, outbox_attached, outbox_ledger
from dmq_server.db.outbox_ledger import DeadRow, Pair
from dmq_server.db.outage import Outage
from dmq_server.db.worker import DbWorker
from dmq_server.protocols.outbox_gauges import OutboxGauge

__all__ = ["OutboxRelay", "OutboxRelays", "RelayDb", "RelayGate", "ZkOutboxes"]

log = Logger()

T = TypeVar("T")

# the longest pause between tries while a database fails (an outbox not installed, a
# database down): one warning per try, so a lasting failure does not flood the log
MAX_PAUSE = 30.0

# the records a relay taking over checks against its outbox at once (a few batches' worth
# is the most a relay that died can leave)
STALE_CHECK = 10000

# a row id above every other: all rows of the install may have a record
MAX_ID = 2**63 - 1

# with ZooKeeper: the seconds between two questions of the relaying node whether it still
# holds the outbox's ZooKeeper lock (its cycles in between ask nothing)
GATE_EVERY = 1.0
# with ZooKeeper: cycles failing in a row (1 + 2 + 4 s of them) after which the relaying
# node lets its ZooKeeper lock go, so that a node that does reach the databases may relay
GATE_FAILURES = 3


class RelayDb(Protocol):
    """What the relay asks of a database connection: ``db.worker.DbWorker``'s calls."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def run(self, fn: Callable[..., T], *args: object) -> Deferred[T]: ...


class RelayGate(Protocol):
    """Placement through ZooKeeper (``cluster.outboxes``: the outbox's kazoo Lock)."""

    def hold(self) -> Deferred[bool]: ...

    def release(self) -> Deferred[None]: ...


class ZkOutboxes(Protocol):
    """What the relays ask of a cluster node's ZooKeeper session (``cluster.outboxes``):
    a gate per outbox, and a call whenever the attached outboxes change."""

    def gate(self, name: str) -> RelayGate: ...

    def watch(self, changed: Callable[[], None]) -> None: ...


class _Batch:
    """Rows read in one call, with what the relay made of them: each row's (producer,
    session id) under the install ``tag`` read with them, and those of the pairs the
    ledgers hold (stored or dead-lettered before: not published again)."""

    __slots__ = ("tag", "rows", "pairs", "before")

    def __init__(self, tag: str, rows: list[OutboxRow], pairs: dict[int, Pair], before: set[Pair]):
        self.tag = tag
        self.rows = rows
        self.pairs = pairs
        self.before = before


class OutboxRelay:
    """One outbox's relay (see the module). ``app`` is a connection to the application's
    database, ``dmq`` one to dmq's own (each a worker thread, autocommit).

    ``gate`` (a cluster with ZooKeeper) places the relay: only the node holding the
    outbox's ZooKeeper lock tries the advisory lock, so ZooKeeper shows which node relays
    (``/dmq/outbox_relay/NAME``) and each outbox's relay goes to whichever node wins its
    own lock, so several outboxes' relays spread over the nodes rather than all going to
    the node whose tries happen to come first. Both locks, because neither alone is
    enough. The advisory lock stays the fence: a delete runs only on the connection that
    holds it (``db.outbox.delete_and_read``), and ZooKeeper's session and that connection
    fail independently: a node whose ZooKeeper session expired may still be running a
    cycle on its database connection, and a node whose database connection broke may
    still hold its ZooKeeper session; the ZooKeeper lock alone would let two relays
    delete, and the advisory lock alone says nothing to ZooKeeper. A node that finds it
    no longer holds the ZooKeeper lock deletes what it stored, then ends its connection
    (and the advisory lock with it), so the new holder takes over within a second or
    two; ZooKeeper not answering changes nothing (the fence holds either way). A node
    whose cycles keep failing (``GATE_FAILURES`` in a row: its way to a database broken
    while other nodes may reach it) lets the ZooKeeper lock go, as a node without
    ZooKeeper loses the advisory lock with its connection."""

    def __init__(
        self,
        source: OutboxSource,
        broker: BrokerPort,
        clock: Clock,
        app: RelayDb,
        dmq: RelayDb,
        *,
        clusters: Sequence[RelayDb] = (),
        batch: int = 500,
        max_run: int = 500,
        poll: float = 1.0,
        retry: float = 1.0,
        gate: RelayGate | None = None,
    ):
        self.source = source
        self.broker = broker
        self.clock = clock
        self._app = app
        self._dmq = dmq
        # dmq's databases, main first: a row's record is written where its topic is placed
        # (--pg-cluster), so each is asked and each forgets; dead letters go to main
        self._ledgers = [dmq, *clusters]
        self._q = outbox.relay_queries(source.schema)
        self._batch = batch
        self._max_run = max_run  # the group commit's batch: a longer run would be cut there
        self._poll = poll
        self._retry = retry
        self._gate = gate
        self._gated = False  # this node holds the outbox's ZooKeeper lock (as last asked)
        self._gate_asked = 0.0  # when it was last asked
        self._running = False
        self._pid = 0  # the application database's backend holding the lock, 0: not this relay
        self._tag = ""  # the install's tag (its numbered rows' producer), as last read
        # a pass over the outbox that kept rows to try again (their store failed for a passing
        # reason): the id read up to, and how many were kept
        self._after = 0
        self._again = 0
        # the rows numbered by the install with an id up to this may have a record in a
        # ledger (stored before: by a relay before this one's takeover, or by this one with
        # its answer lost or its delete failed); the rows above it are checked against none
        self._recorded_upto = 0
        self._handed = 0  # the highest row id handed to the broker
        self._done: list[tuple[int, Pair]] = []  # stored or dead-lettered, their delete not run yet
        self._ahead: _Batch | None = None  # the next batch, read while the one before was stored
        self._loop: Deferred[None] | None = None
        self._nap: tuple[Deferred[None], Timer] | None = None
        self.relayed = self.dead = 0  # rows stored, rows dead-lettered, since start

    @property
    def relaying(self) -> bool:
        """This node holds the outbox's lock (as of its last cycle)."""
        return self._pid != 0

    def start(self) -> None:
        """Start relaying in the background; an unreachable database is retried."""
        self._app.start()
        for db in self._ledgers:
            db.start()
        self._running = True
        self._loop = ensureDeferred(self._run())

    def stop(self) -> Deferred[None]:
        """Stop after the cycle under way (a wait for NOTIFY ends within ``poll``), once
        the rows it stored are deleted."""
        self._running = False
        nap = self._nap
        if nap is not None:
            self._nap = None
            nap[1].cancel()
            nap[0].callback(None)
        loop = self._loop
        if loop is None:  # never started: nothing runs
            return succeed(None)

        def stopped(_: None) -> Deferred[None]:
            self._app.stop()  # its connection, and the advisory lock, end here
            for db in self._ledgers:
                db.stop()
            gate = self._gate
            if gate is None or not self._gated:
                return succeed(None)
            self._gated = False
            released = gate.release()  # another node's next try takes both locks
            released.addErrback(lambda f: log.warn("outbox {name}: releasing its ZooKeeper lock failed "
                                                   "(it goes with the session): {why}",
                                                   name=self.source.name, why=f.getErrorMessage()))
            return released

        return loop.addCallback(stopped)

    def _sleep(self, seconds: float) -> Deferred[None]:
        woken: Deferred[None] = Deferred()

        def wake() -> None:
            self._nap = None
            woken.callback(None)

        self._nap = (woken, self.clock.callLater(seconds, wake))
        return woken

    async def _run(self) -> None:
        name = self.source.name
        failures = 0
        while self._running:
            try:
                await self._cycle()
                failures = 0
            except Exception as exc:  # the databases' failures: logged, tried again, less often each time
                # what the cycle handed to the broker may now be stored with its delete not
                # run: those rows are checked against the ledgers when read again
                self._recorded_upto = max(self._recorded_upto, self._handed)
                self._ahead = None
                pause = min(self._retry * 2 ** failures, MAX_PAUSE)
                failures += 1
                log.warn("outbox {name}: {why}; trying again in {pause:g}s", name=name, why=exc, pause=pause)
                if self._gate is not None and self._gated and failures >= GATE_FAILURES:
                    await self._step_aside(self._gate, failures)
                if self._running:
                    await self._sleep(pause)
        try:
            await self._flush()
        except Exception as exc:  # left for the next relay: its rows are recorded, never stored again
            log.warn("outbox {name}: deleting the rows relayed last failed: {why}", name=name, why=exc)

    async def _flush(self) -> None:
        """The delete and forget of the rows stored since the last read, before a pause or
        the end (they are otherwise done by the next read)."""
        if self._done and self._pid:
            await self._read(0, limit=0)

    def _lost(self) -> None:
        """The lock is gone: what this relay read ahead or has yet to delete is left to the
        next holder (the rows stored have their records: never stored again)."""
        self._done = []
        self._ahead = None

    async def _placed(self, gate: RelayGate) -> bool:
        """Whether this node holds the outbox's ZooKeeper lock, asked at most once every
        ``GATE_EVERY`` seconds while it does. A node that lost it gives the outbox up
        (``_give_up``); ZooKeeper not answering leaves things as they were."""
        now = self.clock.seconds()
        if self._gated and now - self._gate_asked < GATE_EVERY:
            return True
        self._gate_asked = now
        try:
            gated = await gate.hold()
        except Exception as exc:  # ZooKeeper away: the advisory lock fences all the same
            log.warn("outbox {name}: ZooKeeper did not say who relays it ({why})", name=self.source.name, why=exc)
            return self._gated
        if not gated and self._pid:
            await self._give_up()
        self._gated = gated
        return gated

    async def _give_up(self) -> None:
        """Another node holds the ZooKeeper lock: delete what was stored (only this
        connection may), then end the connection, and the advisory lock with it."""
        log.info("outbox {name}: this node no longer holds its ZooKeeper lock: it stops relaying",
                 name=self.source.name)
        await self._flush()
        await self._app.run(outbox.release_relay)
        self._pid = 0
        self._lost()

    async def _step_aside(self, gate: RelayGate, failures: int) -> None:
        """Cycles keep failing here (this node's way to a database, say, while other nodes
        reach it): end the connection (the advisory lock with it, when it still lives) and
        let the ZooKeeper lock go, so that another node may relay; what this one stored and
        did not delete is recorded, and the next holder deletes it without storing it again.
        This node contends again at its next cycle."""
        log.warn("outbox {name}: {failures} cycles failed in a row: this node lets its ZooKeeper lock go",
                 name=self.source.name, failures=failures)
        self._gated = False
        self._pid = 0
        self._lost()
        try:
            await self._app.run(outbox.release_relay)
        except Exception:  # the connection is broken already: the advisory lock went with it
            pass
        try:
            await gate.release()
        except Exception as exc:  # it goes with the session
            log.warn("outbox {name}: releasing its ZooKeeper lock failed: {why}", name=self.source.name, why=exc)

    async def _cycle(self) -> None:
        name, schema = self.source.name, self.source.schema
        self._cycled_at = self.clock.seconds()
        if self._gate is not None and not await self._placed(self._gate):
            await self._sleep(self._retry)
            return
        pid = await self._app.run(outbox.hold_relay, self._q, schema, self._pid)
        if not pid:
            if self._pid:
                log.warn("outbox {name}: lost the relay lock (its connection ended): another node may relay it",
                         name=name)
            self._pid = 0
            self._lost()
            await self._sleep(self._retry)
            return
        if pid != self._pid:
            self._lost()
            self._tag = await self._app.run(outbox.read_tag, self._q, schema)
            self._pid = pid
            log.info("outbox {name}: this node relays {schema} (install {tag})", name=name, schema=schema,
                     tag=self._tag)
            self._recorded_upto = max(self._recorded_upto, await self._forget_stale())
        batch, self._ahead = self._ahead, None
        if batch is None:
            batch = await self._read(self._after)
        rows = batch.rows
        if rows:
            if batch.tag != self._tag:  # installed again while this node held the lock
                log.info("outbox {name}: {schema} was installed again (install {tag})", name=name, schema=schema,
                         tag=batch.tag)
                self._tag = batch.tag
                self._recorded_upto = max(self._recorded_upto, await self._forget_stale())
            # a full batch with nothing kept: the next one is read while this one is stored
            ahead = len(rows) == self._batch and not self._after and not self._again
            again, self._ahead = await self._relay(batch, ahead)
            self._again += again
            if len(rows) == self._batch and self._again:
                # rows wait to be tried again: read on past them, so they hold no row behind
                self._after = rows[-1].id
                return
        elif not self._after:
            await self._app.run(outbox.wait_for_rows, self._poll)
            return
        # the end of a pass: the rows kept go again from the start, after a pause
        again, self._after, self._again = self._again, 0, 0
        if again and self._running:
            await self._flush()
            await self._sleep(self._retry)

    async def _read(self, after: int, exclude: Sequence[int] = (), limit: int | None = None) -> _Batch:
        """Delete the rows stored since the last read, read the next batch (after ``after``,
        without ``exclude``), then in each ledger forget the deleted rows' records and ask
        which rows of the batch were recorded before: one call to each database. Only rows
        that may have a record are asked about: the application's own session ids (it may
        send one again), and the install's numbered rows up to ``_recorded_upto``."""
        done, self._done = self._done, []
        name = self.source.name
        tag, rows = await self._app.run(outbox.delete_and_read, self._q, self.source.schema, self._pid,
                                        [row_id for row_id, _ in done], self._batch if limit is None else limit,
                                        after, exclude)
        pairs = {row.id: (producer_of(name, tag, row), session_of(row)) for row in rows}
        upto = self._recorded_upto if tag == self._tag else MAX_ID  # another install's: all asked
        check = [pairs[row.id] for row in rows if row.session_id is not None or row.id <= upto]
        forget = [pair for _, pair in done]
        before: set[Pair] = set()
        if forget or check:
            for found in await self._each(outbox_ledger.forget_and_check, forget, check):
                before |= found
        return _Batch(tag, rows, pairs, before)

    async def _read_ahead(self, exclude: list[int]) -> _Batch | Exception:
        """``_read`` of the batch after the one being stored; its failure as the answer (the
        store is awaited all the same, and the failure raised after it)."""
        try:
            return await self._read(self._after, exclude)
        except Exception as exc:  # raised by _relay once the store is answered
            return exc

    async def _relay(self, batch: _Batch, ahead: bool) -> tuple[int, _Batch | None]:
        """Relay one batch; returns how many rows are left to try again, and the next batch
        when ``ahead`` (read while this one was stored, its rows none of these; None if rows
        are kept: the pass goes on past them as before). The rows stored or dead-lettered
        are deleted by the next read."""
        name, rows, pairs = self.source.name, batch.rows, batch.pairs
        todo = [row for row in rows if pairs[row.id] not in batch.before]
        done = [row for row in rows if pairs[row.id] in batch.before]
        # stored properties that break a rule (a row written by hand): refused as the broker
        # refuses a row, never sent without them
        dead: list[tuple[OutboxRow, str]] = [(row, row.refused) for row in todo if row.refused]
        if dead:
            todo = [row for row in todo if not row.refused]
        topics: dict[str, list[list[OutboxRow]]] = {}  # each topic's runs, in id order
        for run in runs(todo, self._max_run):
            topics.setdefault(run[0].topic, []).append(run)
        self._handed = max(self._handed, rows[-1].id)
        stored = gatherResults([ensureDeferred(self._publish_runs(chain, pairs)) for chain in topics.values()],
                               consumeErrors=True)
        reading = ensureDeferred(self._read_ahead([row.id for row in rows])) if ahead else None
        try:
            chains = await stored
        finally:
            following = await reading if reading is not None else None
        again = 0
        for run, outcomes in [answered for chain in chains for answered in chain]:
            for row, outcome in zip(run, outcomes):
                if isinstance(outcome, Published):
                    done.append(row)
                elif isinstance(outcome, Refused):
                    dead.append((row, str(outcome)))
                else:
                    again += 1
                    # its commit's answer may have been lost: checked when read again
                    self._recorded_upto = max(self._recorded_upto, row.id)
        if dead:
            await self._dmq.run(outbox_ledger.dead_letter_rows, [
                DeadRow(row.topic, pairs[row.id][0], pairs[row.id][1], row.body,
                        f"outbox {name} ({self.source.schema}) row {row.id}: {why}", row.created_ms)
                for row, why in dead
            ])
            log.warn("outbox {name}: {count} row(s) refused, kept as dead letters (first: {why})",
                     name=name, count=len(dead), why=dead[0][1])
            done += [row for row, _ in dead]
        self._done += [(row.id, pairs[row.id]) for row in done]
        self.relayed += len(done) - len(dead)
        self.dead += len(dead)
        if isinstance(following, Exception):
            raise following
        return again, None if again else following

    def _each(self, fn: Callable[..., T], *args: object) -> Deferred[list[T]]:
        """``fn(*args)`` in every one of dmq's databases at once; fails if any fails."""
        return gatherResults([db.run(fn, *args) for db in self._ledgers], consumeErrors=True)

    async def _publish_runs(
        self, chain: list[list[OutboxRow]], pairs: dict[int, Pair]
    ) -> list[tuple[list[OutboxRow], Sequence[object]]]:
        """One topic's runs, each published once the one before was answered (after its
        commit): two runs of one topic never commit side by side, where the later could
        get the lower ids. After a run not wholly stored or refused (a passing failure),
        the runs behind it are kept too (outcome None: tried again), not published: they
        would overtake it. Each run with its rows' outcomes, in order."""
        answered: list[tuple[list[OutboxRow], Sequence[object]]] = []
        held = False
        for run in chain:
            outcomes: Sequence[object] = [None] * len(run)
            if not held:
                try:
                    outcomes = await self._publish(run, pairs[run[0].id][0])
                except Exception as exc:  # the broker failed the call: the rows are tried again
                    log.failure("outbox {name}: publishing a run failed", name=self.source.name)
                    outcomes = [exc] * len(run)
                held = not all(isinstance(outcome, (Published, Refused)) for outcome in outcomes)
            answered.append((run, outcomes))
        return answered

    def _publish(self, run: list[OutboxRow], producer: str) -> Deferred[list[object]]:
        """One run as one request of ``producer``; fires with each row's outcome
        (``Published`` or the error), in order, once the broker answered them all (after
        their commit)."""
        first = run[0]
        sends = [new_send(topic=row.topic, producer=producer, session_id=session_of(row), body=row.body,
                          produced_ms=row.created_ms, properties=row.properties, status=row.status) for row in run]
        request = new_request(topic=first.topic, producer=producer, sends=sends, due_ms=first.due_ms)
        answered: Deferred[list[object]] = Deferred()
        outcomes: list[object] = [None] * len(run)
        left = [len(run)]

        def answer(start: int, results: Sequence[object]) -> None:
            outcomes[start:start + len(results)] = results
            left[0] -= len(results)
            if left[0] == 0:
                answered.callback(outcomes)

        self.broker.publish_each(request, answer)
        return answered

    async def _forget_stale(self) -> int:
        """Records left by a relay that died between its delete and forgetting them: those
        of the relay's own numbering whose row is gone from the outbox (a record exists
        only for a row that was committed, so a row missing now was deleted). Returns the
        highest id of a row still here with a record (stored by a relay that died before
        its delete): the rows above it were stored by none (MAX_ID if there were more
        records than it looked at)."""
        producers = relay_producers(self.source.name, self._tag)
        upto = 0
        for db in self._ledgers:
            recorded = await db.run(outbox_ledger.recorded_rows, producers, STALE_CHECK)
            if len(recorded) >= STALE_CHECK:
                upto = MAX_ID
            if not recorded:
                continue
            present = await self._app.run(outbox.present_rows, self._q, [session for _, session in recorded])
            gone: list[Pair] = [pair for pair in recorded if pair[1] not in present]
            upto = max([upto, *present])
            if gone:
                await db.run(outbox_ledger.forget_relayed, gone)
        return upto

    # -- what operators see (core.outbox_figures) ------------------------------------------
    node_id = ""  # this node's id (OutboxRelays sets it)
    database = "?"  # the application database's host and name (never the DSN: it holds a password)
    attached = False  # attached at run time (dmq outbox attach), not given with --outbox
    _cycled_at: float | None = None  # when the last cycle began

    def figures(self, measured: Measured | None, measured_at: float) -> OutboxFigures:
        """The outbox as this node sees it now, with the last reading of its database
        (``protocols.outbox_gauges``, taken at ``measured_at``); no IO."""
        now = self.clock.seconds()
        oldest = measured.oldest_age if measured is not None else None
        return OutboxFigures(
            name=self.source.name, schema=self.source.schema, database=self.database, node_id=self.node_id,
            relaying=self.relaying, holder=measured.holder if measured is not None else None, attached=self.attached,
            pending=measured.pending if measured is not None else None,
            oldest_age=None if oldest is None else oldest + now - measured_at,
            relayed=self.relayed, dead_lettered=self.dead,
            last_cycle_age=None if self._cycled_at is None else now - self._cycled_at,
            measured_age=None if measured is None else now - measured_at,
        )


class OutboxRelays:
    """The relays of this node, one per outbox, as the service tree starts and stops them
    (after the broker, before it drains): those of ``--outbox``, and those attached at run
    time (``dmq outbox attach``: ``db.outbox_attached``), read from dmq's database every
    ``--registry-refresh`` and whenever ``refresh`` is called (ZooKeeper's ``/dmq/outbox``
    changed). An outbox attached gets a relay within that time; one detached has its relay
    stopped (``OutboxRelay.stop``: the rows it stored are deleted, then its connection,
    and the lock with it, ends). A name both on the command line and attached: the
    command line's wins on this node (its operator's explicit setting; a ``detach`` could
    not stop it either), and the attached one is ignored here, with a warning."""

    def __init__(self, options: Options, clock: Clock, threads: IReactorFromThreads):
        self.sources = [parse_outbox(entry) for entry in options.outbox]
        self._options = options
        self._clock = clock
        self._threads = threads
        self.relays: list[OutboxRelay] = []
        self.node_id = ""  # this node's id (the service sets it): who relays, for operators
        self.gauges: dict[str, OutboxGauge] = {}  # each outbox's figures, read on a connection of their own
        self._broker: BrokerPort | None = None
        self._dmq_dsn = ""
        self._registry: RelayDb | None = None  # dmq's database, where the attached outboxes are
        self._attached: dict[str, OutboxRelay] = {}
        self._shadowed: set[str] = set()  # attached names this node relays from its command line (warned once)
        self._reading: Deferred[None] | None = None
        self._again = False
        # dmq's database failing for the read of the attached outboxes: one line per outage
        self._outage = Outage("attached outboxes", clock)
        self._timer: Timer | None = None
        self._running = False
        self._zk: ZkOutboxes | None = None

    def start(self, broker: BrokerPort, dmq_dsn: str, registry: RelayDb | None = None,
              zk: ZkOutboxes | None = None) -> None:
        """Start the command line's relays and read the attached outboxes (on ``registry``,
        a connection to dmq's database: a worker of its own unless given). With ``zk`` (a
        cluster node's), each relay is placed by its ZooKeeper lock, and a change of
        ZooKeeper's ``/dmq/outbox`` reads the attached outboxes at once."""
        self._broker, self._dmq_dsn, self._running, self._zk = broker, dmq_dsn, True, zk
        for source in self.sources:
            self._start_relay(source, attached=False)
        self._registry = registry or DbWorker(self._threads, dmq_dsn, "outbox-attached", autocommit=True,
                                              timeout=self._options.pg_timeout or None)
        self._registry.start()
        self.refresh()
        if zk is not None:
            zk.watch(self.refresh)

    def _start_relay(self, source: OutboxSource, *, attached: bool) -> None:
        options = self._options
        poll = 1.0
        # a wait for NOTIFY is a call too: the watchdog allows it on top of --pg-timeout
        timeout = options.pg_timeout + poll if options.pg_timeout else None
        # the relay's session is named after its node: the lock holder, to any node's gauge
        named = outbox.named_dsn(source.dsn, holder_label(self.node_id))
        app = DbWorker(self._threads, named, f"outbox-{source.name}", autocommit=True, timeout=timeout)
        dmq, *clusters = [
            DbWorker(self._threads, dsn, f"outbox-{source.name}-{cluster}", autocommit=True,
                     timeout=options.pg_timeout or None)
            for cluster, dsn in {"main": self._dmq_dsn, **options.pg_clusters}.items()
        ]
        relay = OutboxRelay(source, _started(self._broker), self._clock, app, dmq, clusters=clusters,
                            batch=min(500, options.commit_batch_size), max_run=options.commit_batch_size,
                            poll=poll, gate=self._zk.gate(source.name) if self._zk is not None else None)
        relay.node_id, relay.database, relay.attached = self.node_id, outbox.dsn_database(source.dsn), attached
        relay.start()
        self.relays.append(relay)
        gauge = OutboxGauge(source, DbWorker(self._threads, source.dsn, f"outbox-{source.name}-figures",
                                             autocommit=True, timeout=options.pg_timeout or None), self._clock)
        gauge.start()
        self.gauges[source.name] = gauge
        if attached:
            self._attached[source.name] = relay
            log.info("outbox {name} is attached: this node starts its relay ({schema} in {database})",
                     name=source.name, schema=source.schema, database=relay.database)

    def _stop_relay(self, relay: OutboxRelay) -> Deferred[None]:
        """Stop one relay and its gauge; it no longer shows (its rows stored are deleted first)."""
        name = relay.source.name
        self.relays.remove(relay)
        self._attached.pop(name, None)
        gauge = self.gauges.pop(name)
        stopped = DeferredList([relay.stop(), gauge.stop()], consumeErrors=True)
        return stopped.addCallback(lambda _: None)

    def refresh(self) -> None:
        """Read the attached outboxes now (one read at a time: a call during a read reads
        again after it), and again every ``--registry-refresh``."""
        if not self._running:
            return
        if self._reading is not None:
            self._again = True
            return
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

        def done(_: object) -> None:
            self._reading = None
            if not self._running:
                return
            if self._again:
                self._again = False
                self.refresh()
            else:
                self._timer = self._clock.callLater(self._options.registry_refresh, self.refresh)

        self._reading = ensureDeferred(self._follow())
        self._reading.addBoth(done)

    async def _follow(self) -> None:
        """Start a relay for each outbox attached and not relayed here, stop the relay of
        each one detached (or attached again with another database or schema)."""
        try:
            attached = await _started(self._registry).run(outbox_attached.attached)
        except Exception as exc:  # dmq's database: the relays running go on, read again later
            self._outage.failed(f"cannot read the attached outboxes: {exc}")
            return
        self._outage.recovered()
        flagged = {source.name for source in self.sources}
        wanted = {source.name: source for source in attached if source.name not in flagged}
        for name in sorted({source.name for source in attached} & flagged - self._shadowed):
            log.warn("outbox {name} is attached and given with --outbox: this node relays its --outbox",
                     name=name)
        self._shadowed = {source.name for source in attached} & flagged
        stopping = [relay for name, relay in self._attached.items() if wanted.get(name) != relay.source]
        for relay in stopping:
            log.info("outbox {name} is detached: this node stops its relay", name=relay.source.name)
        await DeferredList([self._stop_relay(relay) for relay in stopping], consumeErrors=True)
        for name, source in wanted.items():
            if name not in self._attached and self._running:
                self._start_relay(source, attached=True)

    def figures(self) -> list[OutboxFigures]:
        """Every relayed outbox as this node sees it, by name (``/metrics``, ``/stats``, the admin API)."""
        figures = []
        for relay in self.relays:
            gauge = self.gauges[relay.source.name]
            figures.append(relay.figures(gauge.measured, gauge.measured_at))
        return sorted(figures, key=lambda f: f.name)

    def stop(self) -> Deferred[None]:
        self._running = False
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        reading = self._reading if self._reading is not None else succeed(None)
        registry = self._registry

        def stop_all(_: object) -> Deferred[None]:
            stopped = DeferredList([relay.stop() for relay in self.relays]
                                   + [gauge.stop() for gauge in self.gauges.values()], consumeErrors=True)
            if registry is not None:
                registry.stop()
            return stopped.addCallback(lambda _: None)

        # a read under way may be starting or stopping relays: they are all stopped after it
        waited: Deferred[object] = Deferred()
        reading.addBoth(waited.callback)
        return waited.addCallback(stop_all)


def _started(part: T | None) -> T:
    """What ``OutboxRelays.start`` made, asked for after it."""
    if part is None:
        raise RuntimeError("the outbox relays have not started")
    return part
