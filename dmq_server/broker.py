"""The broker core: topics, channels, publishing and subscribing, protocol-agnostic.

Wire adapters call ``publish``/``subscribe``/``ack``; the broker validates,
hands sends to the group-commit writer, fans committed messages out to their
channels and keeps the registry cache fresh. It does not know which protocol a
consumer speaks.

Still too long (issue 15): one class holds the registry cache, validation, rate limits,
delay staging, fan-out, subscribe, acks, backlog, scan, sweep and stats. Moving the
registry cache and the fan-out into modules of their own is listed in
docs/architecture.md (Not there yet).
"""

from __future__ import annotations

import itertools
import socket
import time
from typing import Any, Callable

from twisted.internet.defer import Deferred, fail, succeed
from twisted.application.internet import TimerService
from twisted.application.service import MultiService
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_client.spelling import MAX_TIME_MS
from dmq_client.wire import valid_name

from dmq_server.core.buckets import LATENCY_SECONDS, Buckets
from dmq_server.core.errors import DmqError, Exiting, Invalid, NoChannel, NoTopic, QueueFailed, RateLimited, Unavailable
from dmq_server.core.ids import GuidFactory, default_node_id
from dmq_server.core.publish import Published, PublishRequest
from dmq_server.reliable.channel import Channel, Delivery, Message
from dmq_server.db.dead_letters import NewDeadLetter
from dmq_server.db.delays import MovedMessage, NewDelayed, insert_delayed_steps
from dmq_server.reliable.dead_letters import DeadLetterSink
from dmq_server.core.limits import RateLimiter
from dmq_server.core.options import Options
from dmq_server.db.outage import Outage
from dmq_server.db.errors import RefusedError, StorageError
from dmq_server.db.messages import (
    AckRow, NewMessage, find_stored_steps, load_backlog_steps, read_channel_state_steps, run_query_steps,
    sweep_messages_steps,
)
from dmq_server.db.topics import list_topics_steps
from dmq_server.db.worker import DbWorker
from registry.model import TopicSpec
from dmq_server.reliable.writer import AckBatcher, GroupCommitWriter

__all__ = ["Broker", "RELIABLE", "FAST", "MAX_TIMESTAMP_MS"]

# sends of unknown outcome remembered at most (the oldest are forgotten beyond it)
MAX_UNRESOLVED = 100_000

log = Logger()

# The producer of replayed dead letters (the pipeline's replay, and the replay SQL of
# dmq_server/reliable/dead_letters.py); its session id is the dead letter's id.
REPLAY_PRODUCER = "dmq-replay"

# The last millisecond of 9999-12-31 UTC (dmq_client.spelling's bound for any time): the
# largest producer timestamp accepted. A client sending nanoseconds or microseconds (a
# common mistake) lands above it.
MAX_TIMESTAMP_MS = MAX_TIME_MS


# The stores a topic can live in (``TopicSpec.store``).
RELIABLE = "reliable"
FAST = "fast"


class _Countdown:
    """Answers a batch once every body has an outcome: Published (with the id stored
    first), or the first failure seen."""

    __slots__ = ("count", "remaining", "done", "first_id", "failure")

    def __init__(self, count: int, done: Callable[[Any], None]):
        self.count = self.remaining = count
        self.done = done
        self.first_id: int | None = None
        self.failure: BaseException | None = None

    def __call__(self, outcome: Any) -> None:
        if isinstance(outcome, Published):
            if self.first_id is None:
                self.first_id = outcome.message_id
        elif self.failure is None:
            self.failure = outcome
        self.remaining -= 1
        if self.remaining == 0:
            if self.failure is not None:
                self.done(self.failure)
            else:
                self.done(Published(self.first_id or 0, False, self.count))


class Broker:
    def __init__(
        self,
        options: Options,
        clock: Any,
        workers: dict[str, DbWorker],
        node_id: str,
        fetch_topics: Callable[[], Deferred] | None = None,
        fast: Any = None,
    ):
        self.options = options
        self.clock = clock
        self.node_id = node_id
        # the fast store (dmq_server.fast.store.FastStore): topics registered with
        # store=fast, and NSQ's topics made on first use; None: reliable topics only
        self.fast = fast
        self.fast_topics: set[str] = set()  # registered with store=fast
        self.fast_publish_count = 0
        self._session_ids = GuidFactory(
            default_node_id(socket.gethostname()), lambda: int(clock.seconds() * 1e9)
        )
        # where topics come from: PostgreSQL by default; a cluster passes ZooKeeper's
        # reader (dmq_server.cluster.node), which also mirrors them into PostgreSQL
        self._fetch_topics = fetch_topics or (lambda: self._workers["admin"].run_steps(list_topics_steps))
        # cluster: load only the copies this node owns; deliver nothing while paused
        # (not registered, or the registry session is in doubt); see dmq_server.cluster.node
        self.load_owner: str | None = None
        self.paused = False
        self._refresh_next: list[Deferred] = []
        self._workers = workers
        self.topics: dict[str, TopicSpec] = {}
        self.channels: dict[tuple[str, str], Channel] = {}
        self.healthy = True
        self.health_detail = ""
        self.health_listeners: list[Callable[[bool], None]] = []
        writers = [w for role, w in sorted(workers.items()) if role.startswith("writer")]
        # topics with a write whose outcome is unknown (its answer was lost): their
        # channels are re-read from the store now and again after the next commit
        self._unknown_topics: set[str] = set()
        self.unknown_outcomes = 0
        # the sends of those writes, looked for in the store until it shows them: a
        # commit cut off while it waited (for its synchronous standby, say) becomes
        # visible when it ends, maybe after every rescan (see _resolve_unknown)
        self._unresolved: dict[tuple[str, int], tuple[str, float]] = {}
        self._resolving = False
        self._resolve_after = 0.0
        self.acks_refused = 0  # dmq-protocol acks for copies the acking consumer did not hold
        self._held: set[tuple[str, str]] = set()  # channels an operator paused
        self._load_outage = Outage("backlog loads", clock)
        self.writer = GroupCommitWriter(
            writers,
            node_id,
            options.commit_batch_size,
            self._writer_health,
            on_unknown=self._unknown_sends,
            clock=clock,
        )
        self.acker = AckBatcher(
            workers["acker"],
            clock,
            options.ack_batch_size,
            options.ack_flush_interval,
            self._acks_done,
        )
        # delayed sends, rate limits, dead letters (delay/limits/deadletters modules)
        self.limits = RateLimiter(clock)
        self.dead_letters = DeadLetterSink(
            workers.get("deadletter") or workers["admin"],
            clock,
            node_id,
            lambda topic, name: self.channels.get((topic, name)),
        )
        delay_db = workers.get("delay-writer")
        # a delayed row of unknown outcome needs nothing here: the delay workers poll
        # their fragments and find it when it is due
        self.delay_writer = GroupCommitWriter(
            [delay_db] if delay_db is not None else writers,
            node_id,
            options.commit_batch_size,
            self._set_health,
            insert=insert_delayed_steps,
        )
        self.delays: Any = None  # the DelayScheduler, attached by the service
        self.delayed_count = 0
        self._refresh_waiters: list[Deferred] | None = None
        self.timers = self._timers()
        self.started_at = time.time()
        self.publish_count = 0
        # publish -> commit of each stored send (its wait for a batch included), /metrics
        self.publish_commit_seconds = Buckets(LATENCY_SECONDS)

    # -- lifecycle --------------------------------------------------------
    def _timers(self) -> MultiService:
        """The periodic jobs, one named ``TimerService`` each on the injected clock.
        The service tree runs them while the broker's stage is up (each fires once
        when started, then every interval); nothing here starts them."""
        timers = MultiService()
        for name, fn, step in (
            ("scan", self._scan, self.options.scan_interval),
            ("registry-refresh", self._refresh_quietly, self.options.registry_refresh),
            ("sweep", self._sweep, self.options.sweep_interval),
            ("channel-state", self._read_channel_state, self.options.channel_state_interval),
        ):
            timer = TimerService(step, fn)
            timer.clock = self.clock
            timer.setName(name)
            timer.setServiceParent(timers)
        return timers

    def start(self) -> Deferred:
        """Read the registry and the operators' pauses before the first push (a paused
        channel stays paused on restart)."""
        d = self.refresh_registry()
        return d.addCallback(lambda _: self._read_channel_state())

    def stop(self) -> Deferred:
        """Stop taking sends, commit and answer what is queued, make acks durable."""
        if self.timers.running:  # stopped by the service tree first; a test may not have
            self.timers.stopService()
        d = self.writer.close()
        d.addCallback(lambda _: self.delay_writer.close())
        d.addCallback(lambda _: self.dead_letters.close())
        d.addCallback(lambda _: self.acker.drain())
        return d

    def _writer_health(self, ok: bool, why: str) -> None:
        if ok and self._unknown_topics:
            # A write of unknown outcome may become visible only after its failure was
            # seen (a commit that finished after its connection broke): read again
            # now that a commit went through.
            topics, self._unknown_topics = self._unknown_topics, set()
            self._rescan_topics(topics)
        self._set_health(ok, why)

    def outcome_unknown(self, topics: set[str] | None) -> None:
        """A write that stores deliveries failed without an answer: it may have
        committed, so copies may sit in PostgreSQL that no channel was handed (a
        resend of them is answered as a duplicate and hands nothing either). Every
        channel of ``topics`` (all channels for None) reads its copies from the store
        again: now, and once more after the next successful commit."""
        self.unknown_outcomes += 1
        if topics is None:
            topics = {topic for topic, _ in self.channels}
        self._unknown_topics |= topics
        self._rescan_topics(topics)

    def _unknown_sends(self, items: list[NewMessage]) -> None:
        now = self.clock.seconds()
        for m in items:
            self._unresolved[(m.producer, m.session_id)] = (m.topic, now)
        while len(self._unresolved) > MAX_UNRESOLVED:  # memory stays bounded: the oldest go
            del self._unresolved[next(iter(self._unresolved))]
        self.outcome_unknown({m.topic for m in items})

    def _resolve_unknown(self) -> None:
        """Once a second while sends of unknown outcome remain: those the store now
        shows have their topic's channels re-read (the rows are visible, so the load
        finds them); the others are looked for again, for the message retention.

        A rescan at the failure and another after the next commit are not enough when
        the commit's transaction outlives its connection: a commit waiting for its
        synchronous standby when ``--pg-timeout`` cut it off ends when a standby
        comes back, seconds later. Its producers' resends are then answered as
        duplicates (stored), and no channel would be handed the copies.
        """
        now = self.clock.seconds()
        if not self._unresolved or self._resolving or now < self._resolve_after:
            return
        self._resolve_after = now + 1.0
        self._resolving = True
        pairs = list(itertools.islice(self._unresolved, 1000))

        def found(stored: list[tuple[str, int]]) -> None:
            self._resolving = False
            topics = {self._unresolved.pop(pair)[0] for pair in stored if pair in self._unresolved}
            horizon = now - self.options.message_retention
            for pair in [p for p in pairs if p in self._unresolved and self._unresolved[p][1] < horizon]:
                del self._unresolved[pair]  # never committed: its resend stored it anew, or none came
            if topics:
                self._rescan_topics(topics)

        def failed(failure: Any) -> None:
            self._resolving = False
            failure.trap(StorageError)

        self._workers["loader"].run_steps(find_stored_steps, pairs).addCallbacks(found, failed)

    def _rescan_topics(self, topics: set[str]) -> None:
        for (topic, _), channel in list(self.channels.items()):
            if topic in topics:
                channel.rescan()

    def _set_health(self, ok: bool, why: str) -> None:
        changed = ok != self.healthy
        self.healthy = ok
        self.health_detail = why
        if changed:
            if ok:
                log.info("storage healthy again")
            else:
                log.error("storage failing: {why}", why=why)
            for listener in list(self.health_listeners):
                listener(ok)

    # -- registry cache ---------------------------------------------------
    def refresh_registry(self, fresh: bool = False) -> Deferred:
        """Re-read topics and channels; fails with StorageError if PostgreSQL does.

        Concurrent callers share one query: each gets its own Deferred with the
        shared outcome. A ``fresh`` caller (a registry watch fired) needs a read that
        starts after its call, so it waits for the next query, not one under way.
        """
        waiter: Deferred = Deferred()
        if self._refresh_waiters is not None:
            (self._refresh_next if fresh else self._refresh_waiters).append(waiter)
            return waiter
        self._refresh_waiters = [waiter]
        d = self._fetch_topics()

        def finish(outcome: Any) -> None:
            waiters, self._refresh_waiters = self._refresh_waiters or [], None
            if isinstance(outcome, Failure):
                self._set_health(False, str(outcome.value))
            else:
                self._apply_registry(outcome)
            for w in waiters:
                if isinstance(outcome, Failure):
                    w.errback(outcome)
                else:
                    w.callback(None)
            following, self._refresh_next = self._refresh_next, []
            if following:
                self.refresh_registry().addBoth(lambda result: _fire_all(following, result))

        d.addBoth(finish)
        return waiter

    def _refresh_quietly(self) -> None:
        self.refresh_registry().addErrback(lambda f: f.trap(StorageError))

    def _apply_registry(self, rows: list[TopicSpec]) -> None:
        self.topics = {row.name: row for row in rows if row.store == RELIABLE}
        self.fast_topics = {row.name for row in rows if row.store == FAST}
        wanted = {(t.name, c) for t in self.topics.values() for c in t.channels}
        for key in list(self.channels):
            if key not in wanted:
                channel = self.channels.pop(key)
                log.info("channel {t}/{c} unregistered", t=key[0], c=key[1])
                for consumer in channel.close():
                    closer = getattr(consumer, "channel_closed", None)
                    if closer is not None:
                        closer(channel)
        for key in wanted:
            if key not in self.channels:
                self._channel(*key)
            else:
                self.channels[key].msg_timeout = self.topics[key[0]].msg_timeout_ms / 1000.0
                self.channels[key].max_attempts = self.topics[key[0]].max_attempts
        self.limits.forget({t.name for t in self.topics.values() if t.rate_limit})

    def _channel(self, topic: str, name: str) -> Channel:
        channel = self.channels.get((topic, name))
        if channel is None:
            row = self.topics.get(topic)
            timeout = row.msg_timeout_ms / 1000.0 if row else self.options.msg_timeout
            channel = Channel(
                topic,
                name,
                clock=self.clock,
                msg_timeout=timeout,
                mem_queue_size=self.options.mem_queue_size,
                load=self._load,
                on_ack=self._on_ack,
                max_attempts=row.max_attempts if row else None,
                on_attempt=self.dead_letters.on_attempt,
                on_exhausted=self.dead_letters.on_exhausted,
            )
            channel.paused = self.paused
            channel.held = (topic, name) in self._held
            self.channels[(topic, name)] = channel
        return channel

    def _with_fresh_registry(self, check: Callable[[], bool]) -> Deferred:
        """True at once if ``check`` passes on the cache, else after one refresh."""
        if check():
            return succeed(True)
        return self.refresh_registry().addCallback(lambda _: check())

    # -- publishing -------------------------------------------------------
    def publish(self, request: PublishRequest, done: Callable[[Any], None]) -> None:
        """Route ``request`` to its topic's store; ``done`` is called once, with
        ``Published`` when every body is stored, else with the first body's
        ``DmqError`` (a batch is answered as one, as NSQ's MPUB is; bodies stored
        before a failure stay stored, so a producer's retry may store them twice).

        A registered reliable topic goes to the group-commit writer; a fast topic
        (registered with ``store=fast``, or one the fast store holds) to the fast
        store, answered before this returns. A name neither knows costs one registry
        refresh, then is reliable, fast (``request.create_fast``, NSQ's rule) or
        refused with E_NO_TOPIC."""
        error = self._check(request)
        if error is not None:
            done(error)
            return
        topic = request.topic
        if topic in self.topics:
            self._publish_reliable(request, done)
            return
        fast = self.fast
        if fast is not None and (topic in fast.topics or topic in self.fast_topics):
            self._publish_fast(request, done)
            return

        def routed(store: Any) -> None:
            if store == RELIABLE:
                self._publish_reliable(request, done)
            elif store == FAST:
                self._publish_fast(request, done)
            else:
                done(store)

        self.route(topic, request.create_fast, routed)

    def route(self, topic: str, create_fast: bool, then: Callable[[Any], None]) -> None:
        """Call ``then`` with the store serving ``topic``: ``RELIABLE``, ``FAST``, or
        the ``DmqError`` why none does. At once for a name a store knows; after one
        registry refresh for any other (a topic registered a moment ago is never
        mistaken for a fast one). ``create_fast``: an unregistered name is a fast
        topic, made on first use (NSQ's rule)."""
        store = self._store_of(topic, False)
        if store is not None:
            then(store)
            return

        def refreshed(_: Any) -> None:
            found = self._store_of(topic, create_fast)
            then(found if found is not None else NoTopic(f"topic {topic!r} is not registered or has no channel"))

        self.refresh_registry().addCallbacks(refreshed, lambda failure: then(failure.value))

    def _store_of(self, topic: str, create_fast: bool) -> str | None:
        if topic in self.topics:
            return RELIABLE
        fast = self.fast
        if fast is not None and (create_fast or topic in fast.topics or topic in self.fast_topics):
            return FAST
        return None

    def new_session_id(self) -> int:
        """A session id for a body whose producer has none (NSQ): unique within this
        process (a snowflake); the producer id makes it unique across processes."""
        return self._session_ids.new() & 0x7FFFFFFFFFFFFFFF

    def _check(self, request: PublishRequest) -> DmqError | None:
        """The rules every send obeys, checked before it joins a group-commit batch:
        a value PostgreSQL would refuse must fail its own send, not the batch."""
        topic, producer = request.topic, request.producer
        if topic not in self.topics and not valid_name(topic):  # registered names are valid
            return Invalid(f"topic name {topic!r} is not valid", code="E_BAD_TOPIC")
        if not producer or len(producer) > 64:
            return Invalid("producer id must be 1..64 characters")
        if not producer.isprintable():
            # PostgreSQL text cannot hold NUL; control characters are never meant
            return Invalid(f"producer id {producer!r} holds a control character")
        session_id = request.session_id
        if session_id is not None and session_id < 0:
            return Invalid(f"session id {session_id} is negative")
        limit = self.options.max_msg_size
        for body in request.bodies:
            if len(body) > limit:
                return Invalid(f"message too big {len(body)} > {limit}", code="E_BAD_BODY")
        produced_ms = request.produced_ms
        if not 0 <= produced_ms <= MAX_TIMESTAMP_MS:
            return Invalid(
                f"timestamp_ms {produced_ms} is not Unix milliseconds "
                f"(0 for none, or up to {MAX_TIMESTAMP_MS} = 9999-12-31)"
            )
        if request.due_ms is not None:
            return self._check_delay(request.due_ms)
        return None

    def _check_delay(self, due_ms: int) -> DmqError | None:
        if due_ms <= 0:
            return Invalid("a DELAY message needs due_ms (Unix ms) above 0")
        limit_ms = int((self.clock.seconds() + self.options.max_delay) * 1000)
        if due_ms > limit_ms:
            return Invalid(f"due_ms {due_ms} is more than --max-delay ({self.options.max_delay:g}s) ahead")
        return None

    def _publish_fast(self, request: PublishRequest, done: Callable[[Any], None]) -> None:
        """Into the fast store (nsqd's semantics: in memory, then its disk queue);
        answered before this returns."""
        fast = self.fast
        deferred = 0.0
        if request.due_ms is not None:
            deferred = max(request.due_ms - int(self.clock.seconds() * 1000), 0) / 1000.0
        try:
            messages = [fast.new_message(body, deferred) for body in request.bodies]
            fast.get_topic(request.topic).put_many(messages)
        except Exiting as exc:
            done(exc)
            return
        except Exception as exc:  # the topic's disk queue failed
            fast.set_health(exc)
            done(QueueFailed(str(exc)))
            return
        self.fast_publish_count += len(messages)
        done(Published(int(messages[0].id, 16) if messages else 0, False, len(messages)))

    def _publish_reliable(self, request: PublishRequest, done: Callable[[Any], None]) -> None:
        """Each body through the group commit; one countdown answers the request."""
        bodies = request.bodies
        topic, producer, produced_ms = request.topic, request.producer, request.produced_ms
        due_ms, resend = request.due_ms, request.resend
        if len(bodies) == 1:
            session_id = request.session_id
            if session_id is None:
                session_id = self.new_session_id()
            self._publish_one(topic, producer, session_id, bodies[0], produced_ms, done, due_ms, resend)
            return
        if not bodies:
            done(Published(0, False, 0))
            return
        countdown = _Countdown(len(bodies), done)
        for body in bodies:
            self._publish_one(topic, producer, self.new_session_id(), body, produced_ms, countdown, due_ms, resend)

    def _publish_one(
        self,
        topic: str,
        producer: str,
        session_id: int,
        body: bytes,
        produced_ms: int,
        done: Callable[[Any], None],
        due_ms: int | None,
        resend: bool,
    ) -> None:
        """One checked body of a reliable topic, without Deferreds: ``done`` gets
        Published, or the DmqError. Called once per message, so the common case
        (topic cached) is a few dict lookups and one queue append.
        A send that is not a ``resend`` must be new: if its (producer, session id) is
        already stored, it is refused rather than answered with the stored message,
        which would acknowledge a message that was never stored.
        With ``due_ms`` the message is delayed: stored in the delay table, and
        ``Published.message_id`` is the delay entry's id."""
        if not resend:
            done = _refusing_duplicates(done, producer, session_id)
        row = self.topics.get(topic)
        if row is not None and row.channels:
            self._admit(row, producer, session_id, body, produced_ms, done, due_ms)
            return

        def refreshed(_: Any) -> None:
            row = self.topics.get(topic)
            if row is None or not row.channels:
                done(NoTopic(f"topic {topic!r} is not registered or has no channel"))
            else:
                self._admit(row, producer, session_id, body, produced_ms, done, due_ms)

        self.refresh_registry().addCallbacks(refreshed, lambda failure: done(failure.value))

    def _admit(
        self,
        row: TopicSpec,
        producer: str,
        session_id: int,
        body: bytes,
        produced_ms: int,
        done: Callable[[Any], None],
        due_ms: int | None,
    ) -> None:
        """Rate limit, then store (delayed or not)."""
        if row.rate_limit and not self.limits.allow(row.name, row.rate_limit):
            self._rate_limited(row, producer, session_id, body, produced_ms, done)
        elif due_ms is None:
            self._stage(row.name, producer, session_id, body, produced_ms, done)
        else:
            self._stage_delayed(row.name, producer, session_id, body, produced_ms, due_ms, done)

    def _rate_limited(
        self, row: TopicSpec, producer: str, session_id: int, body: bytes, produced_ms: int, done: Callable
    ) -> None:
        """Record the refused send as a dead letter, then refuse it. A replay of a dead
        letter (producer ``dmq-replay``) is refused without a new one: it already is one,
        and its replayer tries again later."""
        why = f"topic {row.name!r} accepts at most {row.rate_limit} messages per second"
        if producer == REPLAY_PRODUCER:
            done(RateLimited(f"{why}; a replay: not recorded again"))
            return

        def recorded(outcome: Any) -> None:
            if isinstance(outcome, BaseException):
                log.warn("rate-limited send not recorded as a dead letter: {why}", why=outcome)
                done(RateLimited(f"{why} (dead letter not recorded: {outcome})"))
            else:
                done(RateLimited(f"{why}; recorded as dead letter {outcome}"))

        letter = NewDeadLetter(
            "rate_limited", row.name, producer, session_id, body,
            detail=f"over the topic's rate limit of {row.rate_limit}/s",
            published_ms=produced_ms,
        )
        self.dead_letters.record(letter, recorded)

    def _stage_delayed(
        self,
        topic: str,
        producer: str,
        session_id: int,
        body: bytes,
        produced_ms: int,
        due_ms: int,
        done: Callable[[Any], None],
    ) -> None:
        delays = self.delays
        fragment = delays.pick_fragment() if delays is not None else 1

        def committed(stored: Any) -> None:
            if isinstance(stored, BaseException):
                if isinstance(stored, RefusedError):  # this message's own input: not stored
                    stored = Invalid(str(stored))
                done(stored)
                return
            if not stored.duplicate:
                self.delayed_count += 1
                if delays is not None:
                    delays.notify([stored])
            done(Published(stored.message_id, stored.duplicate))

        item = NewDelayed(topic, producer, session_id, produced_ms, due_ms, fragment, body)
        self.delay_writer.submit_cb(item, committed)

    def deliver_moved(self, messages: list[MovedMessage]) -> None:
        """Delayed (or replayed) messages now stored with their deliveries: push them."""
        channels = self.channels
        for moved in messages:
            message = Message(
                moved.message_id, moved.topic, moved.producer, moved.session_id,
                moved.published_ms, moved.body,
            )
            for name in moved.channels:
                channel = channels.get((moved.topic, name))
                if channel is None:
                    channel = self._channel(moved.topic, name)
                channel.add(message)

    def _stage(
        self,
        topic: str,
        producer: str,
        session_id: int,
        body: bytes,
        produced_ms: int,
        done: Callable[[Any], None],
    ) -> None:
        staged_at = self.clock.seconds()

        def committed(stored: Any) -> None:
            if isinstance(stored, BaseException):
                if isinstance(stored, RefusedError):  # this message's own input: not stored
                    stored = Invalid(str(stored))
                done(stored)
                return
            self.publish_commit_seconds.observe(self.clock.seconds() - staged_at)
            if not stored.duplicate:
                self.publish_count += 1
                message = Message(
                    stored.message_id, topic, producer, session_id, stored.published_ms, body
                )
                channels = self.channels
                for name in stored.channels:
                    channel = channels.get((topic, name))
                    if channel is None:
                        channel = self._channel(topic, name)
                    channel.add(message)
            done(Published(stored.message_id, stored.duplicate))

        self.writer.submit_cb(NewMessage(topic, producer, session_id, produced_ms, body), committed)

    # -- subscribing ------------------------------------------------------
    def subscribe(self, topic: str, channel: str, consumer: Any) -> Deferred:
        """Deferred firing with the Channel once the consumer is attached."""
        for kind, name in (("topic", topic), ("channel", channel)):
            if not valid_name(name):
                code = "E_BAD_TOPIC" if kind == "topic" else "E_BAD_CHANNEL"
                return fail(Invalid(f"{kind} name {name!r} is not valid", code=code))

        def registered() -> bool:
            row = self.topics.get(topic)
            return row is not None and channel in row.channels

        def attach(ok: bool) -> Channel:
            row = self.topics.get(topic)
            if row is None:
                if not self.healthy:
                    raise Unavailable(self.health_detail, code="E_STORAGE")
                raise NoTopic(f"topic {topic!r} is not registered")
            if not ok:
                raise NoChannel(f"channel {channel!r} is not registered on topic {topic!r}")
            ch = self._channel(topic, channel)
            ch.subscribe(consumer)
            return ch

        return self._with_fresh_registry(registered).addCallback(attach)

    def unsubscribe(self, channel: Channel, consumer: Any) -> None:
        channel.unsubscribe(consumer)

    def ack(self, topic: str, channel: str, message_id: int, consumer: Any) -> str | None:
        """Acknowledge ``consumer``'s copy; None, or why not (nsqd's FIN reasons).

        Only the consumer holding the copy may acknowledge it: an ack from anyone
        else would take the copy out of flight, and it would not come back when its
        real holder dies without acknowledging it."""
        ch = self.channels.get((topic, channel))
        if ch is None:
            return "ID not in flight"
        error = ch.owner_error(message_id, consumer)
        if error is not None:
            return error
        return None if ch.ack(message_id) else "ID not in flight"

    def _on_ack(self, channel: Channel, delivery: Delivery, acked_ms: int) -> None:
        self.acker.add(
            AckRow(
                channel.topic,
                channel.name,
                delivery.message.message_id,
                delivery.first_delivered_ms,
                acked_ms,
                delivery.attempts,
            )
        )

    def _acks_done(self, rows: list[AckRow], ok: bool) -> None:
        by_channel: dict[tuple[str, str], list[int]] = {}
        for row in rows:
            by_channel.setdefault((row.topic, row.channel), []).append(row.message_id)
        for key, ids in by_channel.items():
            ch = self.channels.get(key)
            if ch is not None:
                ch.ack_durable(ids)

    # -- backlog ----------------------------------------------------------
    def _load(self, channel: Channel, after: int, limit: int) -> None:
        d = self._workers["loader"].run_steps(
            load_backlog_steps, channel.topic, channel.name, after, limit, self.load_owner
        )

        def loaded(rows: list) -> None:
            self._load_outage.recovered()
            if not channel.closed:
                channel.loaded(rows, limit)

        def failed(failure: Any) -> None:
            failure.trap(StorageError)
            self._load_outage.failed(f"{channel.topic}/{channel.name}: {failure.value}")
            self._set_health(False, str(failure.value))
            channel.load_failed()

        d.addCallbacks(loaded, failed)

    # -- operators: pause, empty (nsqd's channel admin on reliable channels) ----------
    def _registered_channel(self, topic: str, name: str) -> Channel:
        row = self.topics.get(topic)
        if row is None:
            raise KeyError("TOPIC_NOT_FOUND")
        if name not in row.channels:
            raise KeyError("CHANNEL_NOT_FOUND")
        return self._channel(topic, name)

    def pause_channel(self, topic: str, name: str, paused: bool = True) -> Deferred:
        """Stop (or resume) pushing the channel's copies, on every node: the pause is
        stored in PostgreSQL, applied here at once and by other nodes at their next
        ``channel_state_interval``. Copies keep arriving and wait. KeyError names what
        is not registered; StorageError if PostgreSQL fails."""
        try:
            channel = self._registered_channel(topic, name)
        except KeyError as exc:
            return fail(exc)
        query = "pause_channel" if paused else "unpause_channel"
        d = self._workers["admin"].run_steps(run_query_steps, query, {"topic": topic, "channel": name})

        def stored(_: Any) -> None:
            (self._held.add if paused else self._held.discard)((topic, name))
            channel.held = paused
            if not paused:
                channel.pump()

        return d.addCallback(stored)

    def empty_channel(self, topic: str, name: str) -> Deferred:
        """Drop every unacknowledged copy of the channel (nsqd's channel empty), stored
        and in memory; fires with how many were stored. Copies in flight are dropped
        too: their acks are then refused, as nsqd's FIN of an emptied channel is."""
        try:
            channel = self._registered_channel(topic, name)
        except KeyError as exc:
            return fail(exc)
        d = self._workers["admin"].run_steps(run_query_steps, "empty_channel", {"topic": topic, "channel": name})

        def emptied(count: int) -> int:
            # copies committed after the delete's snapshot are still stored: forget()
            # re-reads the store from the first id, so they are delivered, not lost
            channel.forget()
            channel.stored_count = None
            channel.pump()
            return count

        return d.addCallback(emptied)

    def _read_channel_state(self) -> Deferred:
        d = self._workers["admin"].run_steps(read_channel_state_steps)

        def apply(state: tuple[dict[tuple[str, str], int], set[tuple[str, str]]]) -> None:
            depths, held = state
            self._held = held
            for key, channel in self.channels.items():
                channel.stored_count = depths.get(key, 0)
                was, channel.held = channel.held, key in held
                if was and not channel.held:
                    channel.pump()

        d.addCallback(apply)
        d.addErrback(lambda f: f.trap(StorageError))
        return d

    # -- periodic work ----------------------------------------------------
    def _scan(self) -> None:
        self._resolve_unknown()
        now = self.clock.seconds()
        for channel in list(self.channels.values()):
            if channel.in_flight:
                channel.scan(now)
            elif channel.backlog and not channel.loading and channel.consumers:
                channel.pump()  # retries a load that failed earlier

    def _sweep(self) -> Deferred:
        d = self._workers["admin"].run_steps(sweep_messages_steps, self.options.message_retention, 10000)
        d.addErrback(lambda f: f.trap(StorageError))
        return d

    # -- introspection ----------------------------------------------------
    def stats(self) -> dict[str, Any]:
        topics = []
        for name in sorted(self.topics):
            row = self.topics[name]
            channels = [
                self.channels[(name, c)].stats() for c in row.channels if (name, c) in self.channels
            ]
            topics.append(
                {
                    "topic_name": name,
                    "store": row.store,
                    "msg_timeout_ms": row.msg_timeout_ms,
                    "channels": channels,
                }
            )
        return {
            "node_id": self.node_id,
            "health": "OK" if self.healthy else "ERROR",
            "health_detail": self.health_detail,
            "start_time": int(self.started_at),
            "published": self.publish_count,
            "writer": {
                "unknown_outcomes": self.unknown_outcomes,
                "pending": self.writer.pending,
                "batches": self.writer.batches,
                "messages": self.writer.messages,
            },
            "acks": {
                "pending": self.acker.pending,
                "durable": self.acker.acked,
                "refused": self.acks_refused,
            },
            "delayed": self.delayed_count,
            "rate_limited": self.limits.refused,
            "dead_letters": self.dead_letters.stats(),
            "topics": topics,
        }


def _refusing_duplicates(done: Callable[[Any], None], producer: str, session_id: int) -> Callable[[Any], None]:
    def answer(outcome: Any) -> None:
        if isinstance(outcome, Published) and outcome.duplicate:
            outcome = Invalid(
                f"session id {session_id} of producer {producer!r} is already stored "
                f"(message {outcome.message_id}): a new message needs a new session id, a retry "
                "of this one must be sent as UP_PRODUCER_RESEND",
            )
        done(outcome)

    return answer


def _fire_all(waiters: list[Deferred], outcome: Any) -> None:
    for w in waiters:
        if isinstance(outcome, Failure):
            w.errback(outcome)
        else:
            w.callback(None)
