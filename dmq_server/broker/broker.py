"""The broker: every publish, subscribe and ack of every protocol comes here first.

Wire adapters (the dmq protocol, NSQ V2, the HTTP APIs) hold the broker as a
``interfaces.BrokerPort`` and never learn which store serves a topic. They build one
``PublishRequest`` and call ``publish`` (answered once) or ``publish_each`` (each
message as if sent alone: a read's run); the broker checks it once (``core.publish``),
applies the topic's rate limit, finds the store that serves the topic in its
registry cache (``broker.topics``) and hands each body to that store: the reliable
store (``reliable.store``, group commit in PostgreSQL) or the fast store
(``fast.fast_store``, nsqd's memory and disk queues). One countdown answers a batch once
every body has an outcome. A SUB that may meet either store (NSQ's) is ``attach``,
which returns the store's own subscription; nsqd's topic and channel actions are
``topic_admin``'s. The broker knows neither which protocol asked nor how a store keeps
its messages; the stores know nothing of each other or of the registry.

Why one long module: a publish's path (check, route, batch countdown, rate limit, the
refusal of a duplicate SEND) is read in one place; the registry cache is
``broker.topics`` and everything a store does is in the store.
"""

from __future__ import annotations

import functools
import socket
import time
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from twisted.application.internet import TimerService
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, fail, gatherResults, succeed
from twisted.logger import Logger

from dmq_client.wire import valid_name

from dmq_server.broker.interfaces import Store
from dmq_server.broker.snapshot import BrokerSnapshot, FastTopicFigures, waiting_since
from dmq_server.broker.topic_admin import TopicAdmin
from dmq_server.broker.topics import FAST, RELIABLE, TopicCache
from dmq_server.core.buckets import DELIVERY_SECONDS, LATENCY_SECONDS, Buckets
from dmq_server.core.client_memory import ClientMemory
from dmq_server.core.clock import Clock
from dmq_server.core.errors import DmqError, Invalid, NoChannel, NoTopic, RateLimited, Refused, Unavailable
from dmq_server.core.ids import GuidFactory, default_node_id
from dmq_server.core.limits import RateLimiter
from dmq_server.core.options import Options
from dmq_server.core.publish import (
    Published, PublishRequest, Send, check_request, check_send, check_sender, check_sends,
)
from dmq_server.db.dead_letter_steps import NewDeadLetter
from dmq_server.db.storage_errors import StorageError
from dmq_server.db.outage import Outage
from dmq_server.db.retained import retained_stats
from dmq_server.db.runner import StepRunner
from dmq_server.fast.fast_store import FastStore
from dmq_server.fast.message import FastClient
from dmq_server.reliable.channel import Receiver, ReliableChannel
from dmq_server.reliable.confirm import ConfirmListener
from dmq_server.reliable.nsq_subscription import ReliableSubscription
from dmq_server.reliable.store import Fence, Outcome, ReliableStore, StoreWiring
from dmq_server.db.topic_steps import list_topics_steps
from dmq_server.broker.placement import ChannelGroup, Placement
from dmq_server.db.storage_errors import Misplaced
from registry.model import TopicSpec

__all__ = ["Broker", "Fence", "RELIABLE", "FAST", "REPLAY_PRODUCER"]

log = Logger()

# both kinds of store give the broker what interfaces.Store says (mypy checks this line)
_STORE_KINDS: tuple[type[Store], ...] = (ReliableStore, FastStore)

# The producer of replayed dead letters (the pipeline's replay, and the replay SQL of
# dmq_server/reliable/dead_letters.py); its session id is the dead letter's id.
REPLAY_PRODUCER = "dmq-replay"


class _Countdown:
    """Answers a batch once every body has an outcome: Published (with the id stored
    first), or the first failure seen."""

    __slots__ = ("count", "remaining", "done", "first_id", "failure")

    def __init__(self, count: int, done: Callable[[Outcome], None]):
        self.count = self.remaining = count
        self.done = done
        self.first_id: int | None = None
        self.failure: BaseException | None = None

    def many(self, start: int, outcomes: Sequence[Outcome]) -> None:
        """The outcomes of several bodies (``ReliableStore.store_many``'s answer)."""
        for outcome in outcomes:
            self(outcome)

    def __call__(self, outcome: Outcome) -> None:
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
    """``workers`` are the database roles (``db.worker.DbWorker`` or the reactor's
    connection); ``fetch_topics`` reads the registry (PostgreSQL by default; a cluster
    passes ZooKeeper's reader, which also mirrors into PostgreSQL); ``fast`` is the fast
    store, or None for reliable topics only. ``clusters`` are the roles of every other
    PostgreSQL cluster and ``slots`` every cluster's id slot (``broker.placement``);
    ``alone``: no other server uses these databases (default: no ``fetch_topics``).
    ``memory`` is the server's budget of bytes held for clients (channel windows count
    against it); a cluster node gives its ``fence`` (what its stores may load and when
    they may push) and ``before_scan`` (run before each scan: it checks for a gap in the
    node's time, ``cluster.node``)."""

    def __init__(
        self,
        options: Options,
        clock: Clock,
        workers: Mapping[str, StepRunner],
        node_id: str,
        fetch_topics: Callable[[], Deferred] | None = None,
        fast: FastStore | None = None,
        clusters: Mapping[str, Mapping[str, StepRunner]] | None = None,
        slots: dict[str, int] | None = None,
        alone: bool | None = None,
        memory: ClientMemory | None = None,
        fence: Fence | None = None,
        before_scan: Callable[[], None] = lambda: None,
    ):
        self.options = options
        self.clock = clock
        self.node_id = node_id
        self.fast = fast
        self.healthy = True
        self.health_detail = ""
        self.health_listeners: list[Callable[[bool], None]] = []
        self.acks_refused = 0  # dmq-protocol acks for copies the acking consumer did not hold
        self.started_at = time.time()
        self._session_ids = GuidFactory(default_node_id(socket.gethostname()), lambda: int(clock.seconds() * 1e9))
        # publish -> commit of each stored send (its wait for a batch included), /metrics
        self.publish_commit_seconds = Buckets(LATENCY_SECONDS)
        # publish -> first delivery of each copy, /metrics
        self.publish_deliver_seconds = Buckets(DELIVERY_SECONDS)
        self._fence = fence
        self._before_scan = before_scan  # a cluster node's check for a gap in its time
        wiring = StoreWiring(
            misplaced=self._misplaced, memory=memory, commit_latency=self.publish_commit_seconds,
            deliver_latency=self.publish_deliver_seconds, fence=fence,
        )
        # one reliable store per PostgreSQL cluster (broker.placement); ``reliable`` is main's
        self.placement = Placement(
            options, clock, {"main": workers, **(clusters or {})}, slots or {"main": 0}, node_id, self._set_health,
            wiring,
        )
        self.stores = self.placement.stores
        self.reliable = self.stores["main"]
        self._health_outage = Outage("storage (group commit, registry)", clock)  # logged once per outage
        self.limits = RateLimiter(clock)
        fetch = fetch_topics or (lambda: workers["admin"].run_steps(list_topics_steps))
        # without a cluster's registry this is the only server on the database: its start
        # retires every earlier incarnation (ReliableStore.start)
        self._alone = fetch_topics is None if alone is None else alone
        self.cache = TopicCache(fetch, self._registry_read, lambda why: self._set_health(False, why))
        # nsqd's topic and channel actions on whichever store holds the topic (http.nsqd)
        self.topic_admin = TopicAdmin(self, fast)
        self.timers = self._timers()

    def cluster_stores(self) -> Mapping[str, ReliableStore]:
        """Each PostgreSQL cluster's reliable store by cluster name (``main`` first): what
        the assembly hands the cluster node (it fences, starts and retires them) and each
        cluster's delay scheduler (it schedules into one). Read-only: the broker owns them."""
        return MappingProxyType(self.stores)

    def count_refused_acks(self, n: int) -> None:
        """``n`` dmq-protocol acks named copies the acking consumer did not hold (/stats)."""
        self.acks_refused += n

    # -- what the adapters read ---------------------------------------------
    @property
    def topics(self) -> dict[str, TopicSpec]:
        """The registered reliable topics, by name."""
        return self.cache.reliable

    @property
    def channels(self) -> Mapping[tuple[str, str], ReliableChannel | ChannelGroup]:
        """The reliable channels in memory, by (topic, channel)."""
        return self.placement.channels()

    # -- lifecycle --------------------------------------------------------
    def _timers(self) -> MultiService:
        """The periodic jobs: the broker's own (the one scan of both stores, the registry
        refresh), one named ``TimerService`` each on the injected clock, and each reliable
        store's (``store-CLUSTER``: its sweep, channel state, heartbeat and depth count,
        ``ReliableStore.timers``). The service tree runs them while the broker's stage is
        up (each fires once when started, then every interval); nothing here starts them."""
        timers = MultiService()
        for name, fn, step in (
            ("scan", self.scan, self.options.scan_interval),
            ("registry-refresh", self._refresh_quietly, self.options.registry_refresh),
        ):
            timer = TimerService(step, fn)
            timer.clock = self.clock
            timer.setName(name)
            timer.setServiceParent(timers)
        for store in self.stores.values():
            store.timers.setServiceParent(timers)
        return timers

    def _each(self, method: str) -> Callable[[], Deferred]:
        """A timer's job over every cluster's store, done when all are."""

        def run() -> Deferred:
            return gatherResults(self.placement.each(method), consumeErrors=True)

        return run

    def start(self) -> Deferred:
        """Begin this server's incarnation on every cluster, then read the registry and
        the operators' pauses before the first push (a paused channel stays paused on
        restart)."""
        begun = [
            succeed(None) if store.incarnation else store.start(alone=self._alone)  # begun: a cluster node's lock
            for store in self.stores.values()
        ]
        d = gatherResults(begun, consumeErrors=True).addErrback(lambda f: f.value.subFailure)
        d.addCallback(lambda _: self.refresh_registry())
        return d.addCallback(lambda _: self._each("read_channel_state")())

    def stop(self) -> Deferred:
        """Stop taking sends, commit and answer what is queued, make acks durable."""
        if self.timers.running:  # stopped by the service tree first; a test may not have
            self.timers.stopService()
        return self._each("stop")()

    def scan(self) -> None:
        """The one scanner of both stores: copies whose deadline passed go back to
        their channel, deferred ones that are due become ready (``core.deadlines``)."""
        self._before_scan()
        now = self.clock.seconds()
        for store in self.stores.values():
            store.scan(now)
        if self.fast is not None:
            self.fast.scan()

    def _set_health(self, ok: bool, why: str) -> None:
        changed = ok != self.healthy
        self.healthy = ok
        self.health_detail = why
        if changed:
            if ok:
                self._health_outage.recovered()
            else:
                self._health_outage.failed(why)
            for listener in list(self.health_listeners):
                listener(ok)

    # -- registry cache ---------------------------------------------------
    def refresh_registry(self, fresh: bool = False) -> Deferred:
        """Re-read topics and channels (``TopicCache.refresh``)."""
        return self.cache.refresh(fresh)

    def _refresh_quietly(self) -> None:
        self.refresh_registry().addErrback(lambda f: f.trap(StorageError))

    def _misplaced(self) -> None:
        """A send's topic was not placed on the cluster it was sent to (moved): read the
        registry again, so that its producer's retry goes to the new cluster."""
        self._refresh_quietly()

    def _registry_read(self, specs: list[TopicSpec]) -> None:
        self.placement.apply(self.cache.reliable)
        self.limits.forget({spec.name for spec in specs if spec.rate_limit})

    # -- publishing -------------------------------------------------------
    def publish(self, request: PublishRequest, done: Callable[[Outcome], None]) -> None:
        """Route ``request`` to its topic's store; ``done`` is called once, with
        ``Published`` when every message is stored, else with the first message's
        ``DmqError`` (a batch is answered as one, as NSQ's MPUB is; messages stored
        before a failure stay stored, so a producer's retry may store them twice).

        A registered reliable topic goes to the group-commit writer; a fast topic
        (registered with ``store=fast``, or one the fast store holds) to the fast
        store, answered before this returns. A name neither knows costs one registry
        refresh, then is reliable, fast (``request.create_fast``, NSQ's rule) or
        refused with E_NO_TOPIC."""
        if request.bodies is not None:
            outcome = self._fast_now(request)
            if outcome is not None:
                done(outcome)
                return
        error = check_request(
            request,
            registered=request.topic in self.cache.reliable,
            max_msg_size=self.options.max_msg_size,
            max_delay_s=self.options.max_delay,
            now_s=self.clock.seconds() if request.due_ms is not None else 0.0,  # only a delay reads it
        )
        if error is not None:
            done(error)
            return
        store = self._store_of(request.topic, False)
        if store is not None:
            self._publish_to(store, request, done)
            return
        self.route(request.topic, request.create_fast, lambda found: self._publish_to(found, request, done))

    def publish_each(self, request: PublishRequest, answer: Callable[[int, list], None]) -> None:
        """Each message of ``request`` answered as ``publish`` would answer it alone (the
        dmq protocol's ``UP_PRODUCER_SEND``s of one read: a producer with a window of
        unanswered sends writes them together; an NSQ read's PUBs to one topic).
        ``answer(start, outcomes)`` gets the outcomes of the messages from position
        ``start`` on; every message is answered once, a refused one at once, the stored
        ones together when their commit is answered (``ReliableStore.store_many``), a
        fast topic's all before this returns.

        To a reliable topic this node has cached, with channels, no rate limit and one
        cluster (nearly every send), the topic is looked up, its store found and the
        producer checked once for the run, each send checked on its own (one refused
        fails no other), and the rest queued for the group commit in one call: the
        per-send routing ``publish`` repeats cost about an eighth of the server's CPU a
        message (bench/message_cost.py). A fast topic made on first use takes the run's
        bodies in one call (``_fast_now``). Any other topic takes ``publish``, message by
        message."""
        sends = request.sends
        if sends is None:
            count = len(request.bodies or ())
            outcome = self._fast_now(request)
            if outcome is not None:
                answer(0, [outcome] * count)
                return
        else:
            count = len(sends)
        topic = request.topic
        store = self._direct_store(topic) if request.due_ms is None else None
        if store is None:
            if request.due_ms is None and self._store_of(topic, False) != FAST:
                self._publish_run(request, answer)
                return
            alone = request.alone
            for i in range(count):
                self.publish(alone(i), functools.partial(_answer_one, answer, i))
            return
        error = check_sender(topic, request.producer, registered=True)
        if error is not None:
            answer(0, [error] * count)
            return
        if sends is None:
            sends = request.numbered(self.new_session_id)
        refused = check_sends(sends, self.options.max_msg_size)
        if not refused:
            store.store_many(sends, answer)
            return
        for i, error in refused:
            answer(i, [error])
        out = {i for i, _ in refused}
        places = [i for i in range(count) if i not in out]  # each admitted send's position in the run
        admitted = [sends[i] for i in places]
        if admitted:  # some were refused: each stored one answered at its own place

            def at_places(start: int, outcomes: list) -> None:
                for k, outcome in enumerate(outcomes, start):
                    answer(places[k], [outcome])

            store.store_many(admitted, at_places)

    def _publish_run(self, request: PublishRequest, answer: Callable[[int, list], None]) -> None:
        """``publish_each`` of a run that is not delayed, to a topic that is no known fast
        one and has no direct way (a rate limit, ``--pg-cluster``, or a name this node has
        not cached): each message checked, routed, rate limited and answered as
        ``publish`` would answer it alone, but the topic is routed once (at most one
        registry refresh) and the admitted sends of a reliable topic go to its store in one
        ``store_many``: the group commit keeps the run in one transaction, so its sends get
        ids in the run's order even with several ``--commit-writers`` (the outbox relay's
        runs; ``GroupCommitWriter``). A fast topic's or a refused topic's messages go
        through ``publish``'s way one by one."""
        topic, count = request.topic, len(request)
        error = check_sender(topic, request.producer, registered=topic in self.cache.reliable)
        if error is not None:
            answer(0, [error] * count)
            return
        max_size = self.options.max_msg_size
        sends = request.sends
        if sends is not None:
            refused = check_sends(sends, max_size)
        else:
            produced_ms = request.produced_ms
            refused = [(i, e) for i, body in enumerate(request.bodies or ())
                       if (e := check_send(None, (body,), produced_ms, max_size)) is not None]
        for i, error in refused:
            answer(i, [error])
        out = {i for i, _ in refused}
        places = [i for i in range(count) if i not in out]
        if not places:
            return

        def routed(found: str | BaseException) -> None:
            spec = self.cache.reliable.get(topic) if found == RELIABLE else None
            if spec is None or not spec.channels:  # fast, refused, or channels to look for again
                alone = request.alone
                for i in places:
                    self._publish_to(found, alone(i), functools.partial(_answer_one, answer, i))
                return
            numbered = request.numbered(self.new_session_id)
            self._store_run(spec, [(i, numbered[i]) for i in places], answer)

        found = self._store_of(topic, False)
        if found is not None:
            routed(found)
        else:
            self.route(topic, request.create_fast, routed)

    def _store_run(self, spec: TopicSpec, run: list[tuple[int, Send]], answer: Callable[[int, list], None]) -> None:
        """``_admit`` of each (position, send) of ``run``, in order, with the sends the rate
        limit lets through stored in one ``store_many`` call; each answered at its position
        (a failure of another cluster than main naming it, as ``_admit``'s)."""
        store = self.placement.store_of(spec)
        if isinstance(store, BaseException):
            for i, _ in run:
                answer(i, [store])
            return
        several = self.placement.several
        dones = [self.placement.answer(store, functools.partial(_answer_one, answer, i)) if several
                 else functools.partial(_answer_one, answer, i) for i, _ in run]
        admitted: list[Send] = []
        admitted_dones: list[Callable[[Outcome], None]] = []
        rate = spec.rate_limit
        for (_, send), done in zip(run, dones):
            if rate and not self.limits.allow(spec.name, rate):
                self._rate_limited(spec, send, done, store)
            else:
                admitted.append(send)
                admitted_dones.append(done)
        if not admitted:
            return

        def stored(start: int, outcomes: list) -> None:
            for done, outcome in zip(admitted_dones[start:], outcomes):
                done(outcome)

        store.store_many(admitted, stored)

    def _direct_store(self, topic: str) -> ReliableStore | None:
        """The store that takes sends to ``topic`` with nothing to decide per send: a
        reliable topic this node has cached, with channels, no rate limit (its count and
        dead letters are per send) and one cluster; else None (``publish``'s way)."""
        spec = self.cache.reliable.get(topic)
        if spec is None or not spec.channels or spec.rate_limit or self.placement.several:
            return None
        store = self.placement.store_of(spec)
        return None if isinstance(store, BaseException) else store

    def _fast_now(self, request: PublishRequest) -> Published | DmqError | None:
        """The outcome of ``request`` when it is bodies, not delayed, to a fast topic the
        fast store holds and the registry does not name (an NSQ topic made on first use:
        nsq.py's and most NSQ users' case), taken at once; else None (the whole way).
        The checks would find nothing here: the name is one the fast store holds, such
        bodies come from the edges that check each body's size against the same
        ``max_msg_size`` (NSQ TCP, HTTP), their producer id and time are the server's
        own, and only a registered topic has a rate limit. An NSQ PUB so skips the
        checks and the routing: 15 % of its cost from PUB to FIN (bench/nsq_cost.py)."""
        fast = self.fast
        topic = request.topic
        bodies = request.bodies
        if (fast is None or bodies is None or request.due_ms is not None or topic not in fast.topics
                or self.cache.store_of(topic) is not None):
            return None
        return fast.publish(topic, bodies)

    def _publish_to(self, store: str | BaseException, request: PublishRequest, done: Callable[[Outcome], None]) -> None:
        if store == RELIABLE:
            self._publish_reliable(request, done)
        elif store == FAST:
            self._publish_fast(request, done)
        else:  # the DmqError why no store serves the topic
            assert isinstance(store, BaseException), store
            done(store)

    def route(self, topic: str, create_fast: bool, then: Callable[[str | BaseException], None]) -> None:
        """Call ``then`` with the store serving ``topic``: ``RELIABLE``, ``FAST``, or
        the ``DmqError`` why none does. At once for a name a store knows; after one
        registry refresh for any other (a topic registered a moment ago is never
        mistaken for a fast one). ``create_fast``: an unregistered name is a fast
        topic, made on first use (NSQ's rule)."""
        store = self._store_of(topic, False)
        if store is not None:
            then(store)
            return

        def refreshed(_: object) -> None:
            found = self._store_of(topic, create_fast)
            then(found if found is not None else NoTopic(f"topic {topic!r} is not registered or has no channel"))

        self.refresh_registry().addCallbacks(refreshed, lambda failure: then(failure.value))

    def _store_of(self, topic: str, create_fast: bool) -> str | None:
        store = self.cache.store_of(topic)
        if store == RELIABLE:
            return store
        fast = self.fast
        if fast is not None and (store == FAST or create_fast or topic in fast.topics):
            return FAST
        return None

    def _fast_store(self) -> FastStore:
        """The fast store, for a topic ``route`` found ``FAST`` (it finds that only
        when there is one)."""
        if self.fast is None:
            raise Unavailable("this server has no fast store")
        return self.fast

    def new_session_id(self) -> int:
        """A session id for a body whose producer has none (NSQ): unique within this
        process (a snowflake); the producer id makes it unique across processes."""
        return self._session_ids.new() & 0x7FFFFFFFFFFFFFFF

    def _publish_fast(self, request: PublishRequest, done: Callable[[Outcome], None]) -> None:
        """Into the fast store, answered before this returns. A registered fast topic's
        rate limit refuses the whole request (the fast store keeps no dead letters)."""
        spec = self.cache.fast.get(request.topic)
        if spec is not None and spec.rate_limit and not self.limits.allow(spec.name, spec.rate_limit, len(request)):
            done(RateLimited(f"topic {spec.name!r} accepts at most {spec.rate_limit} messages per second"))
            return
        deferred = 0.0
        if request.due_ms is not None:
            deferred = max(request.due_ms - int(self.clock.seconds() * 1000), 0) / 1000.0
        done(self._fast_store().publish(request.topic, request.payloads(), deferred))

    def _publish_reliable(self, request: PublishRequest, done: Callable[[Outcome], None]) -> None:
        """Each message through the group commit; one countdown answers the request."""
        count = len(request)
        if count == 1:
            self._publish_one(request.numbered(self.new_session_id)[0], done, request.due_ms)
            return
        if not count:
            done(Published(0, False, 0))
            return
        countdown = _Countdown(count, done)
        sends = request.numbered(self.new_session_id)
        store = self._direct_store(request.topic) if request.due_ms is None else None
        if store is not None:  # an MPUB's bodies reach the group commit together
            store.store_many(sends, countdown.many)
            return
        for send in sends:
            self._publish_one(send, countdown, request.due_ms)

    def _publish_one(self, send: Send, done: Callable[[Outcome], None], due_ms: int | None) -> None:
        """One checked message of a reliable topic, without Deferreds: ``done`` gets
        Published, or the DmqError. Called once per message, so the common case
        (topic cached) is a few dict lookups and one queue append.
        A send that is not a ``resend`` must be new: if its (producer, session id) is
        already stored, it is refused rather than answered with the stored message,
        which would acknowledge a message that was never stored.
        With ``due_ms`` the message is delayed: stored in the delay table, and
        ``Published.message_id`` is the delay entry's id."""
        spec = self.cache.reliable.get(send.topic)
        if spec is not None and spec.channels:
            self._admit(spec, send, done, due_ms)
            return

        def refreshed(_: object) -> None:
            spec = self.cache.reliable.get(send.topic)
            if spec is None or not spec.channels:
                done(NoTopic(f"topic {send.topic!r} is not registered or has no channel"))
            else:
                self._admit(spec, send, done, due_ms)

        self.refresh_registry().addCallbacks(refreshed, lambda failure: done(failure.value))

    def _admit(self, spec: TopicSpec, send: Send, done: Callable[[Outcome], None], due_ms: int | None) -> None:
        """Rate limit, then store (delayed or not); a stored pair refuses a send that is
        not a ``resend``."""
        store = self.placement.store_of(spec)
        if isinstance(store, BaseException):
            done(store)
            return
        if self.placement.several:
            done = self.placement.answer(store, done)
        if spec.rate_limit and not self.limits.allow(spec.name, spec.rate_limit):
            self._rate_limited(spec, send, done, store)
        elif due_ms is None:
            store.store(send, done)
        else:
            store.store_delayed(send, due_ms, done)

    def _rate_limited(self, spec: TopicSpec, send: Send, done: Callable[[Outcome], None], store: ReliableStore) -> None:
        """Record the refused send as a dead letter, then refuse it. A replay of a dead
        letter (producer ``dmq-replay``) is refused without a new one: it already is one,
        and its replayer tries again later."""
        why = f"topic {spec.name!r} accepts at most {spec.rate_limit} messages per second"
        if send.producer == REPLAY_PRODUCER:
            done(RateLimited(f"{why}; a replay: not recorded again"))
            return

        def recorded(outcome: int | Exception) -> None:  # the dead letter's id
            if isinstance(outcome, BaseException):
                log.warn("rate-limited send not recorded as a dead letter: {why}", why=outcome)
                done(RateLimited(f"{why} (dead letter not recorded: {outcome})"))
            else:
                done(RateLimited(f"{why}; recorded as dead letter {outcome}"))

        letter = NewDeadLetter(
            "rate_limited", spec.name, send.producer, send.session_id, send.body,
            detail=f"over the topic's rate limit of {spec.rate_limit}/s",
            published_ms=send.produced_ms, properties=send.properties,
        )
        store.dead_letters.record(letter, recorded)

    # -- subscribing ------------------------------------------------------
    def may_push(self) -> bool:
        """Whether pushes decided a while ago may still leave: always alone; in a
        cluster, not after the node stood still (a gap in its time) until ZooKeeper
        confirms its session: other nodes may have taken their copies over meanwhile.
        Asked by the wire protocols before bytes that may have been decided before a
        stall leave (``protocols.turn``). A node paused with its session merely in doubt
        answers yes: it held the copies when it decided (a fast topic's consumers, which
        no other node serves, are not cut off either)."""
        fence = self._fence
        return fence is None or not fence.stood_still()

    def subscribe(self, topic: str, channel: str, consumer: Receiver) -> Deferred:
        """Deferred firing with the reliable channel once the consumer is attached."""
        for kind, name in (("topic", topic), ("channel", channel)):
            if not valid_name(name):
                code = "E_BAD_TOPIC" if kind == "topic" else "E_BAD_CHANNEL"
                return fail(Invalid(f"{kind} name {name!r} is not valid", code=code))

        def registered() -> bool:
            spec = self.cache.reliable.get(topic)
            return spec is not None and channel in spec.channels

        def attach(ok: bool) -> ReliableChannel | ChannelGroup:
            spec = self.cache.reliable.get(topic)
            if spec is None:
                if not self.healthy:
                    raise Unavailable(self.health_detail, code="E_STORAGE")
                raise NoTopic(f"topic {topic!r} is not registered")
            if not ok:
                raise NoChannel(f"channel {channel!r} is not registered on topic {topic!r}")
            return self.placement.subscribe(spec, channel, consumer)

        return self.cache.ensure(registered).addCallback(attach)

    def attach(self, topic: str, channel: str, client: FastClient, consumer: Receiver) -> Deferred:
        """A SUB of a wire protocol that may meet either store (NSQ's; an unregistered
        name is a fast topic, made on first use): Deferred firing with the subscription
        the store serving ``topic`` made (``interfaces.Subscription``), or failing with the
        ``DmqError`` why not. A fast channel takes ``client`` (nsqd's client interface),
        a registered channel ``consumer`` (the consumer interface of ``subscribe``); the
        connection offers both and never learns which the topic uses."""
        attached: Deferred = Deferred()

        def routed(store: str | BaseException) -> None:
            if isinstance(store, BaseException):
                attached.errback(store)
            elif store == FAST:
                try:
                    sub = self._fast_store().subscribe(topic, channel, client)
                except Refused as refusal:
                    attached.errback(refusal)
                else:
                    attached.callback(sub)
            else:
                d = self.subscribe(topic, channel, consumer)
                d.addCallback(lambda ch: ReliableSubscription(self, ch, consumer)).chainDeferred(attached)

        self.route(topic, True, routed)
        return attached

    def unsubscribe(self, channel: Any, consumer: Receiver) -> None:
        channel.unsubscribe(consumer)

    def cluster_of_id(self, any_id: int) -> str | None:
        """The PostgreSQL cluster that drew ``any_id`` (a message, delayed message or dead
        letter id names its cluster: ``db.clusters``), or None with one cluster: where an
        operator's look at one id goes (``admin.operations``)."""
        placement = self.placement
        if not placement.several:
            return None
        store = placement.store_of_id(any_id)
        return None if store is None else store.cluster

    def confirm_consumed(self, topic: str, message_id: int, session_id: int, producer: str, deadline_ms: int,
                         listener: ConfirmListener) -> str:
        """Tell ``listener`` when every channel of ``topic`` is done with the stored message
        ``message_id``, or ``deadline_ms`` passed (``reliable.confirm``); '' or why not. The
        store watching it is the one whose cluster drew the id."""
        if self.cache.store_of(topic) != RELIABLE:
            return f"E_UNSUPPORTED topic {topic!r} is not reliable: its consumption is not recorded"
        store = self.placement.store_of_id(message_id) if self.placement.several else self.reliable
        if store is None:
            return f"E_UNSUPPORTED message {message_id} is of no cluster this server knows"
        return store.confirmations.watch(topic, message_id, session_id, producer, deadline_ms, listener)

    def ack(self, topic: str, channel: str, message_id: int, consumer: Receiver) -> str | None:
        """Acknowledge ``consumer``'s copy; None, or why not (nsqd's FIN reasons). The
        copy's cluster is the one that drew its id."""
        if not self.placement.several:
            return self.reliable.ack(topic, channel, message_id, consumer)
        store = self.placement.store_of_id(message_id)
        if store is None:
            return "ID not in flight"
        error = store.ack(topic, channel, message_id, consumer)
        if error is None:
            self.placement.acked(topic, channel)
        return error

    def ack_each(self, topic: str, channel: str, message_ids: Sequence[int], consumer: Receiver) -> list[str | None]:
        """``ack`` of each id, in order, each with its own answer (an NSQ read's FINs). With
        one cluster, one call to its store for the whole list."""
        if not self.placement.several:
            return self.reliable.ack_each(topic, channel, message_ids, consumer)
        return [self.ack(topic, channel, mid, consumer) for mid in message_ids]

    def ack_many(self, topic: str, channel: str, message_ids: Sequence[int], consumer: Receiver) -> int:
        """``ack`` of each id (a consumer's ``UP_CONSUMER_ACKS``); returns how many were
        refused. With one cluster, one call to its store for the whole batch."""
        if not self.placement.several:
            return self.reliable.ack_many(topic, channel, message_ids, consumer)
        return sum(1 for mid in message_ids if self.ack(topic, channel, mid, consumer) is not None)

    def requeue(self, topic: str, channel: str, message_id: int, consumer: Receiver, delay: float) -> str | None:
        """Give ``consumer``'s copy back, ready again after ``delay`` seconds (a dmq
        consumer's ``UP_CONSUMER_REQUEUE``, NSQ's REQ); None, or why not. The copy's
        cluster is the one that drew its id, as for ``ack``."""
        if not self.placement.several:
            return self.reliable.requeue(topic, channel, message_id, consumer, delay)
        store = self.placement.store_of_id(message_id)
        if store is None:
            return "ID not in flight"
        error = store.requeue(topic, channel, message_id, consumer, delay)
        if error is None:
            self.placement.acked(topic, channel)  # the consumer's credit is free for the other clusters too
        return error

    # -- operators: pause, empty (nsqd's channel admin on reliable channels) ----------
    def _channel_stores(self, topic: str) -> list[ReliableStore]:
        spec = self.cache.reliable.get(topic)
        if spec is None or not self.placement.several:
            return [self.reliable]
        return self.placement.stores_of(spec)

    def pause_channel(self, topic: str, name: str, paused: bool = True) -> Deferred:
        """On every cluster holding the topic's copies."""
        done = [store.pause_channel(topic, name, paused) for store in self._channel_stores(topic)]
        return _first_error(done).addCallback(lambda _: None)

    def empty_channel(self, topic: str, name: str) -> Deferred:
        """On every cluster holding the topic's copies; fires with how many were stored."""
        done = [store.empty_channel(topic, name) for store in self._channel_stores(topic)]
        return _first_error(done).addCallback(sum)

    def read_channel_state(self) -> Deferred:
        """Every store reads its channels' state now (pauses, epochs), as its timer does:
        a seek made through this node is applied here at once (``ReliableStore.reseek``)."""
        return _first_error([store.read_channel_state() for store in self.stores.values()]).addCallback(lambda _: None)

    # -- introspection ----------------------------------------------------
    def snapshot(self) -> BrokerSnapshot:
        """What /metrics, /stats, the consoles and the stored-gauge timer show of the
        broker and its stores, copied now (on the reactor thread): see ``broker.snapshot``."""
        main = self.reliable
        fast = self.fast
        return BrokerSnapshot(
            stats=self.stats(),
            histograms={
                "dmq_publish_commit_seconds": self.publish_commit_seconds.snapshot(),
                "dmq_publish_deliver_seconds": self.publish_deliver_seconds.snapshot(),
                "dmq_group_commit_seconds": main.writer.commit_seconds.snapshot(),
                "dmq_group_commit_batch_size": main.writer.batch_sizes.snapshot(),
                "dmq_ack_batch_size": main.acker.batch_sizes.snapshot(),
            },
            fast_topics=tuple(
                FastTopicFigures(
                    name, topic.depth(), topic.stats(include_clients=False),
                    {cname: waiting_since(channel) for cname, channel in topic.channels.items()},
                )
                for name, topic in (fast.topics.items() if fast is not None else ())
            ),
            oldest_stored=self._oldest_stored(),
            started_at=self.started_at,
        )

    def _oldest_stored(self) -> dict[tuple[str, str], int | None]:
        """Each reliable channel's lowest stored id over the clusters holding its copies
        (a moving topic's channel is a group with no id of its own)."""
        lowest: dict[tuple[str, str], int | None] = {}
        for store in self.stores.values():
            for key, channel in store.channels.items():
                mine, known = channel.oldest_stored_id, lowest.get(key)
                lowest[key] = mine if known is None else known if mine is None else min(known, mine)
        return lowest

    def retained(self, topic: str) -> dict[str, int | None]:
        """What ``topic`` keeps in PostgreSQL, added up over every cluster holding its rows
        (a moved topic's old cluster too, until they are swept): ``db.retained.retained_stats``."""
        return retained_stats(store.retained.get(topic) for store in self.placement.stores.values())

    def stats(self) -> dict[str, Any]:
        """This node's counters, added up over the clusters (each alone in ``clusters``)."""
        reliable = self.reliable
        clusters = self.placement.cluster_stats()
        stores = clusters.values()
        return {
            "node_id": self.node_id,
            "health": "OK" if self.healthy else "ERROR",
            "health_detail": self.health_detail,
            "start_time": int(self.started_at),
            "published": sum(c["published"] for c in stores),
            "writer": {key: sum(c["writer"][key] for c in stores) for key in ("unknown_outcomes", "pending", "batches", "messages")},
            "acks": {
                "pending": sum(c["acks"]["pending"] for c in stores),
                "durable": sum(c["acks"]["durable"] for c in stores),
                "fenced": sum(c["acks"]["fenced"] for c in stores),
                "refused": self.acks_refused,
            },
            "delayed": sum(c["delayed"] for c in stores),
            "swept": sum(c["swept"] for c in stores),
            "rate_limited": self.limits.refused,
            "dead_letters": reliable.dead_letters.stats(),
            "trace": reliable.trace.stats(),
            "topics": [dict(topic, **self.retained(topic["topic_name"]))
                       for topic in self.placement.topic_stats(self.cache.reliable)],
            "clusters": clusters,
        }


def _answer_one(answer: Callable[[int, list[Outcome]], None], i: int, outcome: Outcome) -> None:
    """``publish_each``'s answer for its ``i``-th send when it went through ``publish``."""
    answer(i, [outcome])


def _first_error(deferreds: list[Deferred]) -> Deferred:
    """Every result, or the first failure itself (not wrapped)."""
    return gatherResults(deferreds, consumeErrors=True).addErrback(lambda f: f.value.subFailure)
