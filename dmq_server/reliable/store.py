"""The reliable store: the channels of registered reliable topics and what feeds them.

A send the broker has checked and routed here is committed by the group commit
(``writer.GroupCommitWriter``) with one delivery row per subscribed channel, and only
then handed to the channels in memory and answered; acknowledgements go back to
PostgreSQL in batches (``writer.AckBatcher``); a channel's older copies are loaded
from PostgreSQL as its memory window empties. Delayed sends, dead letters, an
operator's pause and empty, the expiry sweep and the re-read after a commit whose
answer was lost live here too, because each of them changes what a channel holds.

The store knows neither protocols nor the registry: the broker hands it the reliable
topics' settings (``apply_topics``) and calls it with the publish value's messages
(``core.publish.Send``, written by the group commit as they are), and a
consumer is anything ``reliable.channel`` can push to.

Why one long module: every part of it changes what a channel holds (commits add,
loads refill, acks and empties remove, a lost answer re-reads), and those must be
read together to see that no copy is lost or handed out twice.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from twisted.application.internet import TimerService
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_server.core.buckets import Buckets
from dmq_server.core.client_memory import ClientMemory
from dmq_server.core.clock import Clock, Timer
from dmq_server.core.errors import Invalid
from dmq_server.core.options import Options
from dmq_server.core.publish import Published, Send, stored_before
from dmq_server.db.delays import MovedMessage, NewDelayed, StoredDelay, insert_delayed_steps
from dmq_server.db.storage_errors import Misplaced, RefusedError, StorageError
from dmq_server.db.messages import (
    AckRun,
    BacklogRow,
    CursorProgress,
    StoredMessage,
    backends_alive_steps,
    create_owner_steps,
    empty_channel_steps,
    find_stored_steps,
    load_backlog_steps,
    load_priority_backlog_steps,
    read_channel_state_steps,
    owner_heartbeat_steps,
    retire_silent_owners_steps,
    run_query_steps,
    SweepTarget,
    prune_owners_steps,
    sweep_topic_steps,
)
from dmq_server.db.outage import Outage
from dmq_server.db.retained import COUNT_BATCH, Retained, SettlePoint, count_topic_steps, retained_figures_steps, \
    sweep_pass_plan_steps
from dmq_server.db.runner import StepRunner
from dmq_server.reliable.channel import Receiver
from dmq_server.reliable.confirm import Confirmations
from dmq_server.reliable.channel import NO_ORDERER, ReliableChannel, Delivery, ReliableMessage
from dmq_server.reliable.cursor import acks_by_cursor, split_fenced
from dmq_server.reliable.dead_letters import DeadLetterSink
from dmq_server.reliable.depths import DepthCount
from dmq_server.reliable.horizon import OwnWrites
from dmq_server.reliable.trace import TraceSink
from dmq_server.reliable.writer import AckBatcher, GroupCommitWriter
from registry.model import TopicSpec

if TYPE_CHECKING:  # the scheduler stage makes it, with this store's callbacks
    from dmq_server.reliable.delay import DelayScheduler

__all__ = ["Fence", "Outcome", "ReliableStore", "StoreWiring"]

#: what a producer hears of one send: stored (``Published``), or why not
Outcome = Published | BaseException

# sends of unknown outcome remembered at most (the oldest are forgotten beyond it)
MAX_UNRESOLVED = 100_000

#: The retention sweep deletes at most this many messages a statement (each also copied to
#: the history table by its trigger; a batch took a median 13 ms with 300,000 old messages
#: stored, docs/benchmarks.md session 15) ...
SWEEP_BATCH = 2_000
#: ... and after a full batch waits three times as long as it took before the next one.
SWEEP_DUTY = 0.25

log = Logger()

#: read_channel_state_steps' answer: the channels paused, the incarnations retired, the epochs
ChannelState = tuple[set[tuple[str, str]], set[int], dict[tuple[str, str], int]]


@dataclass(frozen=True)
class Fence:
    """A cluster node's hold on a store (``cluster.node``): load only the copies of the
    owners whose cursors ``owner`` (the node id) holds, and push only while
    ``may_deliver()`` says so (not while the node's ZooKeeper session is in doubt).
    ``stood_still()``: whether the node stood still (a gap in its time) and ZooKeeper has
    not yet confirmed its session since: pushes decided before such a gap must not leave
    (``protocols.turn``), while those decided before a pause for a session merely in doubt
    may (the node held their copies when it decided)."""

    owner: str
    may_deliver: Callable[[], bool]
    stood_still: Callable[[], bool] = lambda: False


@dataclass(frozen=True)
class StoreWiring:
    """What the server around a store gives it when it is made: its PostgreSQL
    ``cluster`` (``broker.placement``); ``misplaced``, called when a send's topic was not
    placed on this cluster (moved); the server's one budget of bytes held for clients
    (``memory``, channel windows count against it); where publish -> commit and publish
    -> first delivery are recorded for /metrics (None: not recorded); and a cluster
    node's ``fence`` (None: one node, every owner's copies are this store's to deliver)."""

    cluster: str = "main"
    misplaced: Callable[[], None] | None = None
    memory: ClientMemory | None = None
    commit_latency: Buckets | None = None
    deliver_latency: Buckets | None = None
    fence: Fence | None = None


class _Unresolved:
    """Sends of unknown outcome (their commit's answer was lost), looked for in the
    store until it shows them: a commit cut off while it waited (for its synchronous
    standby, say) becomes visible when it ends, maybe after every rescan
    (``ReliableStore._resolve_unknown``); and the topics whose channels are re-read
    after the next commit."""

    def __init__(self) -> None:
        self.sends: dict[tuple[str, int], tuple[str, float]] = {}  # (producer, session) -> (topic, seen at)
        self.topics: set[str] = set()
        self.asking = False
        self.next_at = 0.0
        self.count = 0  # writes whose outcome was unknown, since start


class _Sweep:
    """The retention sweep's pass (``ReliableStore.sweep``): the topics with something
    older than their retention, each one's batches while they come back full; then each
    topic's retained count, a batch at a time the same way."""

    def __init__(self) -> None:
        self.batch = SWEEP_BATCH
        self.swept = 0
        self.running = self.stopped = False
        self.call: Timer | None = None
        # per retention (s): no message below this id is inside that window
        self.starts: dict[float, int] = {}
        self.targets: deque[SweepTarget] = deque()  # this pass's topics still to sweep
        self.after = 0  # the first of them: the highest id its batches deleted
        # then the topics whose retained figures it counts (db.retained), up to ``point``
        self.point: SettlePoint | None = None
        self.counts: deque[str] = deque()
        # per topic, its figures on this cluster as the channel state last read them
        self.retained: dict[str, Retained] = {}


class ReliableStore:
    """Channels of reliable topics, the writers that fill them, the acker that empties
    them. ``set_health(ok, why)`` tells the broker when PostgreSQL stops or resumes
    taking writes or reads; ``wiring`` is what the server around it gives it."""

    def __init__(
        self,
        options: Options,
        clock: Clock,
        workers: Mapping[str, StepRunner],
        node_id: str,
        set_health: Callable[[bool, str], None],
        wiring: StoreWiring = StoreWiring(),
    ):
        self.options = options
        self.clock = clock
        self.node_id = node_id
        self.wiring = wiring
        self.cluster = wiring.cluster
        fence = wiring.fence
        # cluster: load only the copies of the owners whose cursors this node holds;
        # deliver nothing while paused (not registered, or the session is in doubt)
        self.load_owner = fence.owner if fence is not None else None
        self._workers = workers
        self._set_health = set_health
        self.topics: dict[str, TopicSpec] = {}  # the reliable topics, from the broker's registry cache
        self.channels: dict[tuple[str, str], ReliableChannel] = {}
        # this incarnation (dmq_owner, made by ``start``) and its writes in progress: how
        # far a channel's cursor may cover each owner's ids (reliable.horizon)
        self.writes = OwnWrites()
        self.alone = True  # no ZooKeeper (set by ``start``)
        self.paused = False
        self._held: set[tuple[str, str]] = set()  # channels an operator paused
        # pauses and unpauses made here: a state read that began before one of them
        # read the old pauses and must not undo it (``read_channel_state``)
        self._held_changes = 0
        self._checking_held = False
        # in a cluster, the ordered topics whose orderer is known (``order_here``,
        # ``order_elsewhere``): None, this node; else that node's id (or NO_ORDERER). An
        # ordered topic not listed has none yet: its channels deliver nothing here
        self._orderers: dict[str, str | None] = {}
        # per topic, the channels named by its last answer that names them all (_confirm_channels)
        self._named_last: dict[str, set[str]] = {}
        self._unresolved = _Unresolved()
        # acks not applied because another node holds their cursor now, or a seek wrote it
        # since their copies were pushed (_acks_done)
        self.acks_fenced = 0
        # the channels' epochs as last read (those above 0: sought at least once), for a
        # channel opened after the read (``channel``)
        self._epochs: dict[tuple[str, str], int] = {}
        self.publish_count = self.delayed_count = 0
        # the committed batch's new messages with their channels' names, until _hand_on
        self._arrived: list[tuple[ReliableMessage, Sequence[str]]] = []
        self._load_outage = Outage("backlog loads", clock)
        writers = [w for role, w in sorted(workers.items()) if role.startswith("writer")]
        self.writer: GroupCommitWriter[Send, StoredMessage] = GroupCommitWriter(
            writers, node_id, options.commit_batch_size, self._writer_health,
            on_unknown=self._unknown_sends, clock=clock, writes=self.writes, on_batch=self._hand_on,
            interval=options.commit_interval,
        )
        self.acker = AckBatcher(
            workers["acker"], clock, options.ack_batch_size, options.ack_flush_interval, self._acks_done,
            progress=self._ack_progress,
        )
        sink_db = workers.get("deadletter") or workers["admin"]
        self.dead_letters = DeadLetterSink(
            sink_db, clock, node_id, lambda topic, name: self.channels.get((topic, name)),
            fenced=lambda: self.load_owner is not None,
        )
        # deliveries that come back unacknowledged, for the message trace
        self.trace = TraceSink(sink_db, clock, node_id)
        delay_db = workers.get("delay-writer")
        # a delayed row of unknown outcome needs nothing here: the delay workers poll
        # their fragments and find it when it is due
        self.delay_writer: GroupCommitWriter[NewDelayed, StoredDelay] = GroupCommitWriter(
            [delay_db] if delay_db is not None else writers, node_id, options.commit_batch_size, set_health,
            insert=insert_delayed_steps,
        )
        self._delays: DelayScheduler | None = None  # the scheduler stage's (schedule_delays_with)
        # every channel's stored depth, counted a slice at a time (one of this store's timers)
        self.depths = DepthCount(workers["admin"], clock, self._apply_depths, options.channel_state_interval)
        # messages whose producers asked to hear when they are consumed (SEND_CONSUMED_ACK)
        self.confirmations = Confirmations(workers["admin"], clock)
        self._sweep = _Sweep()
        self.timers = self._timers()

    def _timers(self) -> MultiService:
        """This store's periodic jobs as its own service (``store-CLUSTER``): the retention
        sweep, the channels' state, the incarnation's heartbeat and the depth count, one
        named ``TimerService`` each on the injected clock (each fires once when started,
        then every interval). The broker adopts it under its own timers, which its stage
        runs; nothing here starts it. Stopping it (``stop``) stops this store's jobs only:
        a cluster's store that goes leaves the others' running. In a cluster, the ordered
        topics' poll too (``poll_ordered``: it reads only on a topic's orderer)."""
        options = self.options
        timers = MultiService()
        timers.setName(f"store-{self.cluster}")
        for name, job, step in (
            ("sweep", self.sweep, options.sweep_interval),
            ("channel-state", self.read_channel_state, options.channel_state_interval),
            ("heartbeat", self.heartbeat, options.owner_silence / 6),
            # in a cluster only: the orderer's reads of what other nodes stored
            *([("ordered-poll", self.poll_ordered, options.ordered_poll)] if self.load_owner is not None else []),
        ):
            timer = TimerService(step, job)
            timer.clock = self.clock
            timer.setName(name)
            timer.setServiceParent(timers)
        self.depths.setName("depth-count")
        self.depths.setServiceParent(timers)
        return timers

    @property
    def unknown_outcomes(self) -> int:
        """Writes whose outcome was unknown (their answer lost), since start."""
        return self._unresolved.count

    @property
    def swept_count(self) -> int:
        """Messages the retention sweep deleted, since start."""
        return self._sweep.swept

    @property
    def retained(self) -> dict[str, Retained]:
        """Per topic, the messages and body bytes this cluster keeps (``db.retained``), as
        the last channel-state read found them."""
        return self._sweep.retained

    @property
    def incarnation(self) -> int:
        """This server's incarnation on the store's cluster (0 before ``start``)."""
        return self.writes.owner

    def schedule_delays_with(self, delays: DelayScheduler) -> None:
        """The scheduler stage's delay scheduler: a delayed send is stored in one of its
        fragments, and it is told of each (it moves them to the channels when due)."""
        self._delays = delays

    def renew_incarnation(self, owner: int) -> None:
        """Store as ``owner`` from now on: the incarnation before it was retired (by
        another server, while this one stood still or lost its session)."""
        old = self.writes.owner
        self.writes.retired.add(old)
        self.writes.owner = owner
        log.warn("incarnation {old} of node {node} on cluster {cluster} was retired by another server: "
                 "storing as {new}", old=old, node=self.node_id, cluster=self.cluster, new=owner)

    def retire(self, owners: Iterable[int]) -> None:
        """These incarnations are over (a takeover claimed their cursors): nothing more
        of theirs is waited for (``reliable.horizon``)."""
        self.writes.retired.update(owners)

    def forget_held(self) -> None:
        """Drop every copy held in memory (a cluster node that lost its session: other
        nodes may be taking them over); each channel loads what it still owns later."""
        for channel in list(self.channels.values()):
            channel.forget()

    def rescan(self, keys: Iterable[tuple[str, str]]) -> None:
        """These channels read their copies from the store again (a takeover claimed
        stored copies for them)."""
        for key in keys:
            channel = self.channels.get(key)
            if channel is not None:
                channel.rescan()

    # -- lifecycle --------------------------------------------------------
    def start(self, alone: bool) -> Deferred:
        """Begin a new incarnation: the owner of every message this server stores from now
        on. ``alone`` (no ZooKeeper): the node's earlier incarnations are over, and so is
        any whose server stopped beating (``heartbeat``); retired, they store nothing more
        (a process still running one is fenced), and the servers deliver what they left.
        In a cluster the takeover retires departed incarnations instead."""
        self.alone = alone
        d = self._workers["admin"].run_steps(create_owner_steps, self.node_id)

        def made(owner: int) -> Deferred | None:
            self.writes.owner = owner
            log.info("storing as incarnation {owner} of node {node}", owner=owner, node=self.node_id)
            return self._retire_silent() if alone else None

        return d.addCallback(made)

    def _retire_silent(self) -> Deferred:
        d = self._workers["admin"].run_steps(
            retire_silent_owners_steps, self.writes.owner, self.node_id, self.options.owner_silence
        )

        def retired(owners: list[int]) -> None:
            if owners:
                log.info("incarnations {owners} are over: their stored messages are delivered here", owners=owners)
            self.writes.retired.update(owners)

        return d.addCallback(retired)

    def heartbeat(self) -> Deferred:
        """This incarnation is alive (``dmq_owner.seen_at``); without ZooKeeper, retire the
        incarnations whose servers stopped beating. If another server retired this one
        (it missed its heartbeats: a long stall), begin a new incarnation: what the old
        one stored is delivered by the others as well, at least once."""
        if not self.writes.owner:
            return succeed(None)
        admin = self._workers["admin"]
        d = admin.run_steps(owner_heartbeat_steps, self.writes.owner)

        def beaten(alive: bool) -> Deferred | None:
            if alive:
                return self._retire_silent() if self.alone else None
            if not self.alone:
                return None  # in a cluster a new incarnation begins under the takeover lock (cluster.node)
            return admin.run_steps(create_owner_steps, self.node_id).addCallback(self.renew_incarnation)

        d.addCallback(beaten)
        d.addErrback(lambda f: f.trap(StorageError))
        return d

    def stop(self) -> Deferred:
        """Stop this store's timers, commit and answer what is queued, make acks durable."""
        if self.timers.running:  # the broker's stage stopped them first; a test may not have
            self.timers.stopService()
        sweep = self._sweep
        sweep.stopped = True
        if sweep.call is not None and sweep.call.active():
            sweep.call.cancel()
        sweep.call = None
        self.confirmations.stop()
        d = self.writer.close()
        d.addCallback(lambda _: self.delay_writer.close())
        d.addCallback(lambda _: self.dead_letters.close())
        d.addCallback(lambda _: self.trace.close())
        d.addCallback(lambda _: self.acker.drain())
        return d

    def _writer_health(self, ok: bool, why: str) -> None:
        unresolved = self._unresolved
        if ok and unresolved.topics:
            # A write of unknown outcome may become visible only after its failure was
            # seen (a commit that finished after its connection broke): read again
            # now that a commit went through.
            topics, unresolved.topics = unresolved.topics, set()
            self._rescan_topics(topics)
        self._set_health(ok, why)

    def outcome_unknown(self, topics: set[str] | None) -> None:
        """A write that stores deliveries failed without an answer: it may have
        committed, so copies may sit in PostgreSQL that no channel was handed (a
        resend of them is answered as a duplicate and hands nothing either). Every
        channel of ``topics`` (all channels for None) reads its copies from the store
        again: now, and once more after the next successful commit."""
        self._unresolved.count += 1
        if topics is None:
            topics = {topic for topic, _ in self.channels}
        self._unresolved.topics |= topics
        self._rescan_topics(topics)

    def _unknown_sends(self, items: list[Send]) -> None:
        now = self.clock.seconds()
        unresolved = self._unresolved.sends
        for m in items:
            unresolved[(m.producer, m.session_id)] = (m.topic, now)
        while len(unresolved) > MAX_UNRESOLVED:  # memory stays bounded: the oldest go
            del unresolved[next(iter(unresolved))]
        self.outcome_unknown({m.topic for m in items})

    def _resolve_unknown(self, now: float) -> None:
        """Once a second while sends of unknown outcome remain: those the store now
        shows have their topic's channels re-read (the rows are visible, so the load
        finds them); the others are looked for again, for the message retention.

        A rescan at the failure and another after the next commit are not enough when
        the commit's transaction outlives its connection: a commit waiting for its
        synchronous standby when ``--pg-timeout`` cut it off ends when a standby
        comes back, seconds later. Its producers' resends are then answered as
        duplicates (stored), maybe by another node, and no channel would be handed
        the copies (the chaos suite's pg-primary-kill lost some so, once).
        """
        state = self._unresolved
        unresolved = state.sends
        if not unresolved or state.asking or now < state.next_at:
            return
        state.next_at = now + 1.0
        state.asking = True
        pairs = list(itertools.islice(unresolved, 1000))

        def found(stored: list[tuple[str, int]]) -> None:
            state.asking = False
            topics = {unresolved.pop(pair)[0] for pair in stored if pair in unresolved}
            horizon = now - self.options.message_retention
            for pair in [p for p in pairs if p in unresolved and unresolved[p][1] < horizon]:
                del unresolved[pair]  # never committed: its resend stored it anew, or none came
            if topics:
                self._rescan_topics(topics)

        def failed(failure: Failure) -> None:
            state.asking = False
            failure.trap(StorageError)

        self._workers["loader"].run_steps(find_stored_steps, pairs).addCallbacks(found, failed)

    def _rescan_topics(self, topics: set[str]) -> None:
        for (topic, _), channel in list(self.channels.items()):
            if topic in topics:
                channel.rescan()

    def pause_delivery(self, paused: bool) -> None:
        """The cluster's pause: no pushes and no loads while this node's registration
        is in doubt (copies keep arriving and wait)."""
        self.paused = paused
        for channel in list(self.channels.values()):
            channel.paused = paused
            if not paused:
                channel.pump()

    # -- topics and channels ----------------------------------------------
    def apply_topics(self, topics: dict[str, TopicSpec]) -> None:
        """The registry's reliable topics changed: open the channels registered since,
        close those unregistered (their consumers are told), update timeouts."""
        self.topics = topics
        for topic in [t for t in self._named_last if t not in topics]:
            del self._named_last[topic]  # bounded by the topics registered
        for topic in [t for t in self._orderers if t not in topics or not topics[t].ordered]:
            del self._orderers[topic]  # ordered again later: no orderer until one is told
        wanted = {(t.name, c) for t in topics.values() for c in t.channels}
        for key in list(self.channels):
            if key not in wanted:
                channel = self.channels.pop(key)
                log.info("channel {topic}/{channel} unregistered", topic=key[0], channel=key[1])
                for consumer in channel.close():
                    closer = getattr(consumer, "channel_closed", None)
                    if closer is not None:
                        closer(channel)
        for key in wanted:
            kept = self.channels.get(key)
            if kept is None:
                self.channel(*key)
            else:
                spec = topics[key[0]]
                kept.msg_timeout = spec.msg_timeout_ms / 1000.0
                kept.max_attempts = spec.max_attempts
                was_ordered = kept.keys is not None
                kept.set_ordered(spec.ordered)  # no longer ordered: delivered here again
                if spec.ordered and not was_ordered:
                    self._place(kept)

    def channel(self, topic: str, name: str) -> ReliableChannel:
        """The channel in memory, made on first use."""
        channel = self.channels.get((topic, name))
        if channel is None:
            spec = self.topics.get(topic)
            timeout = spec.msg_timeout_ms / 1000.0 if spec else self.options.msg_timeout
            channel = ReliableChannel(
                topic,
                name,
                clock=self.clock,
                msg_timeout=timeout,
                mem_queue_size=self.options.mem_queue_size,
                load=self._load,
                load_ahead=self._load_ahead,
                load_key=self._load_key,
                on_acks=self._on_acks,
                max_attempts=spec.max_attempts if spec else None,
                on_attempt=self.dead_letters.on_attempt,
                on_exhausted=self.dead_letters.on_exhausted,
                on_return=self.trace.returned,
                deliver_latency=self.wiring.deliver_latency,
                memory=self.wiring.memory,
                ordered=spec.ordered if spec else False,
                writes=self.writes,
                gate=fence.may_deliver if (fence := self.wiring.fence) is not None else None,
                paused=self.paused,
                held=(topic, name) in self._held,
                # opened after an answer of its topic that did not name it: _confirm_channels
                confirmed=name in self._named_last.get(topic, (name,)),
                epoch=self._epochs.get((topic, name), 0),
            )
            self.channels[(topic, name)] = channel
            if spec is not None and spec.ordered:
                self._place(channel)
        return channel

    # -- ordered topics across a cluster's nodes (cluster.orderers calls these) -----------
    def ordered_topics(self) -> set[str]:
        """The ordered topics this store knows: those a cluster node contends to deliver."""
        return {name for name, spec in self.topics.items() if spec.ordered}

    def order_elsewhere(self, topic: str, orderer: str | None) -> None:
        """Another node delivers ordered ``topic`` (``orderer``; None: no node is known
        to): its channels here drop what they hold (a later ack of it is refused) and
        keep, load and push nothing. This node still stores the topic's sends."""
        if topic not in self.ordered_topics():
            return  # no longer ordered: each node delivers its own copies again
        self._orderers[topic] = orderer if orderer is not None else NO_ORDERER
        for channel in self._topic_channels(topic):
            self._place(channel)

    def msg_timeout_of(self, topic: str) -> float:
        """Seconds a push of ``topic`` stays with its consumer before it goes out again."""
        spec = self.topics.get(topic)
        return spec.msg_timeout_ms / 1000.0 if spec is not None else self.options.msg_timeout

    def order_here(self, topic: str) -> None:
        """This node is ordered ``topic``'s orderer: its channels here deliver every
        node's copies, read from the first id (``ReliableChannel.order_here``), and learn
        of the other nodes' commits by ``poll_ordered``."""
        if topic not in self.ordered_topics():
            return
        self._orderers[topic] = None
        for channel in self._topic_channels(topic):
            self._place(channel)

    def _topic_channels(self, topic: str) -> list[ReliableChannel]:
        return [channel for (t, _), channel in self.channels.items() if t == topic]

    def _place(self, channel: ReliableChannel) -> None:
        """An ordered topic's channel in a cluster: delivered here if this node is its
        orderer, else gated (``ReliableChannel.delivered_by``). On one node (no fence)
        every ordered channel delivers here, as every other channel."""
        if self.load_owner is None:
            return
        orderer = self._orderers.get(channel.topic, NO_ORDERER)
        if orderer is None:
            channel.order_here()
        else:
            channel.order_elsewhere(orderer)

    def poll_ordered(self) -> None:
        """Every ``--ordered-poll``: the channels this node orders, with consumers and no
        load out, read what other nodes stored since (``ReliableChannel.poll``). Idle, it
        costs a walk of the topics ordered here; no read without a consumer."""
        channels = self.channels
        for topic, orderer in self._orderers.items():
            if orderer is None:
                for name in self.topics[topic].channels:  # (_orderers lists registered topics only)
                    channel = channels.get((topic, name))
                    if channel is not None:
                        channel.poll()

    # -- storing ------------------------------------------------------------
    def store(self, send: Send, done: Callable[[Outcome], None]) -> None:
        """Commit ``send`` with a delivery per subscribed channel, then hand it to those
        channels and call ``done`` with ``Published`` (or the ``DmqError``). A pair stored
        before answers a ``send.resend`` with its stored message and refuses any other
        send (``stored_before``)."""
        self.store_many([send], lambda start, outcomes: done(outcomes[0]))

    def store_many(self, sends: list[Send], answer: Callable[[int, list], None]) -> None:
        """``store`` of each send, in order, queued for the group commit in one call (a
        read's sends from one producer to one topic, ``Broker.publish_each``; an MPUB's
        bodies). The sends go to the writer as they are: their fields are its columns.
        ``answer(start, outcomes)`` gets the outcomes of the sends from position
        ``start`` on, in order: the whole run in one call, unless a batch ended inside it
        (``GroupCommitWriter.submit_run``)."""
        staged_at = self.clock.seconds()
        latency = self.wiring.commit_latency

        def committed(start: int, results: Sequence[StoredMessage | Exception]) -> None:
            arrived, owner = self._arrived, self.writes.owner  # _hand_on takes the list after each batch
            outcomes: list[Outcome] = []
            timed = stored_now = 0
            for send, stored in zip(sends[start : start + len(results)], results):
                if isinstance(stored, BaseException):
                    outcomes.append(self._refusal(stored))
                    continue
                timed += 1
                if not stored.duplicate:
                    stored_now += 1
                    message = ReliableMessage(
                        stored.message_id, send.topic, send.producer, send.session_id, stored.published_ms,
                        send.body, owner, send.status, send.properties.key, send.properties.priority,
                    )
                    arrived.append((message, stored.channels))  # to its channels: _hand_on
                elif not send.resend:
                    outcomes.append(stored_before(send.producer, send.session_id, stored.message_id))
                    continue
                outcomes.append(Published(stored.message_id, stored.duplicate))
            self.publish_count += stored_now
            if latency is not None and timed:
                latency.observe_many(self.clock.seconds() - staged_at, timed)
            answer(start, outcomes)

        # an ordered topic's sends commit one transaction at a time: a key's ids then
        # rise in the order its messages became visible (reliable.key_order)
        spec = self.topics.get(sends[0].topic) if sends else None
        self.writer.submit_run(sends, committed, serial=spec is not None and spec.ordered)

    def _hand_on(self) -> None:
        """A committed batch's new messages, to their channels. Run by the writer after
        the batch's answers and before its write is settled."""
        arrived, self._arrived = self._arrived, []
        named = self._to_channels(arrived)
        self._confirm_channels({message.topic for message, _ in arrived}, named)

    def _to_channels(
        self, arrived: list[tuple[ReliableMessage, Sequence[str]]]
    ) -> dict[tuple[str, str], list[ReliableMessage]]:
        """Each channel gets its copies of these messages in one call, in this order
        (``ReliableChannel.add_many``: one loop per channel instead of a call chain per
        copy, bench/channel_cost.py). Returns the copies by (topic, channel)."""
        copies: dict[tuple[str, str], list[ReliableMessage]] = {}
        for message, names in arrived:
            topic = message.topic
            for name in names:
                listed = copies.get((topic, name))
                if listed is None:
                    copies[(topic, name)] = [message]
                else:
                    listed.append(message)
        channels = self.channels
        for key, messages in copies.items():
            channel = channels.get(key)
            if channel is None:
                channel = self.channel(*key)
            channel.add_many(messages)
        return copies

    def _confirm_channels(self, topics: set[str], named: Mapping[tuple[str, str], object]) -> None:
        """A channel registered while a batch was being stored can miss copies: the
        statement names the channels registered in its snapshot, but a channel whose
        registration commits during the statement may have a lower start_id than the
        batch's ids, so those copies are its own (a load finds them) and no answer hands
        them over. If its in-memory channel had loaded before they were committed, it
        would never see them, and its cursor would pass them once later copies are acked
        (test_clusters_load's kill -9 test lost the first copy of a topic so, once, with
        the registry mirrored into the second cluster while producers ran).
        So an answer of its topic that does not name a channel in memory makes it
        *unconfirmed* (as does being opened after such an answer: ``channel``), and the
        first answer that names it again makes it read its copies from the store
        (``rescan``), once its registration and every batch committed before that answer
        are visible. Nothing is read again while answers name the channels in memory: a
        load reads every owner's copies when there is no ZooKeeper, and nodes sharing a
        database so would deliver each other's copies twice.
        Only answers that name every channel of the topic in their snapshot count: the
        group commit's (``_hand_on``) and a delayed send's move (``deliver_moved``), not
        a replay's move, which names its one channel."""
        last = self._named_last
        changed = set()
        for topic in topics:
            names = {name for (t, name) in named if t == topic}
            if names != last.get(topic):  # else nothing to do: each channel is as the last answer left it
                last[topic] = names
                changed.add(topic)
        if not changed:
            return
        for (topic, name), channel in self.channels.items():
            if topic not in changed:
                continue
            if (topic, name) in named:
                if not channel.confirmed:
                    channel.confirmed = True
                    channel.rescan()
            else:
                channel.confirmed = False

    def store_delayed(self, send: Send, due_ms: int, done: Callable[[Outcome], None]) -> None:
        """Commit ``send`` into the delay table; ``Published.message_id`` is the delay
        entry's id. The delay scheduler moves it to the channels when due. A stored pair
        is answered or refused as in ``store``."""
        delays = self._delays
        fragment = delays.pick_fragment() if delays is not None else 1

        def committed(stored: StoredDelay | BaseException) -> None:
            if isinstance(stored, BaseException):
                self._refused(stored, done)
                return
            if not stored.duplicate:
                self.delayed_count += 1
                if delays is not None:
                    delays.notify([stored])
            elif not send.resend:
                done(stored_before(send.producer, send.session_id, stored.message_id))
                return
            done(Published(stored.message_id, stored.duplicate))

        item = NewDelayed(send, due_ms, fragment)
        self.delay_writer.submit_cb(item, committed)

    def _refused(self, failure: BaseException, done: Callable[[Outcome], None]) -> None:
        done(self._refusal(failure))

    def _refusal(self, failure: BaseException) -> BaseException:
        """What the producer of a send that was not stored hears (``_answer_for``); a send
        this node may no longer store (``Misplaced``) is reported first."""
        misplaced = self.wiring.misplaced
        if isinstance(failure, Misplaced) and misplaced is not None:
            misplaced()
        return _answer_for(failure)

    def deliver_moved(self, messages: list[MovedMessage]) -> None:
        """Delayed (or replayed) messages now stored with their deliveries: push them.
        A delayed send's move names every channel of its topic in the move's snapshot, as
        a group commit's answer does, and confirms them the same way; a replay's names its
        own channel only and confirms nothing (``_confirm_channels``)."""
        named = self._to_channels([
            (ReliableMessage(moved.message_id, moved.topic, moved.producer, moved.session_id, moved.published_ms,
                             moved.body, moved.owner, moved.status, moved.key, moved.priority), moved.channels)
            for moved in messages
        ])
        whole = {moved.topic for moved in messages if moved.channel is None}
        if whole:
            self._confirm_channels(whole, named)

    # -- consuming ----------------------------------------------------------
    def subscribe(self, topic: str, name: str, consumer: Receiver) -> ReliableChannel:
        channel = self.channel(topic, name)
        channel.subscribe(consumer)
        return channel

    def ack(self, topic: str, name: str, message_id: int, consumer: Receiver) -> str | None:
        """Acknowledge ``consumer``'s copy; None, or why not (nsqd's FIN reasons).

        Only the consumer holding the copy may acknowledge it: an ack from anyone
        else would take the copy out of flight, and it would not come back when its
        real holder dies without acknowledging it."""
        channel = self.channels.get((topic, name))
        if channel is None:
            return "ID not in flight"
        error = channel.owner_error(message_id, consumer)
        if error is not None:
            return error
        return None if channel.ack(message_id) else "ID not in flight"

    def requeue(self, topic: str, name: str, message_id: int, consumer: Receiver, delay: float) -> str | None:
        """Give ``consumer``'s copy back after ``delay`` seconds; None, or why not (as
        ``ack``: only the holder may)."""
        channel = self.channels.get((topic, name))
        if channel is None:
            return "ID not in flight"
        return channel.requeue(message_id, consumer, delay)

    def ack_each(self, topic: str, name: str, message_ids: Sequence[int], consumer: Receiver) -> list[str | None]:
        """``ack`` of each id in order, each answered as ``ack`` answers it alone (an id
        ``consumer`` does not hold, or one acknowledged earlier in the list, refused with
        its reason), the held ones acknowledged in one ``ack_held`` (an NSQ read's FINs:
        one durable-ack run and one pump, not one each)."""
        channel = self.channels.get((topic, name))
        if channel is None:
            return ["ID not in flight"] * len(message_ids)
        errors: list[str | None] = []
        held: list[int] = []
        taken: set[int] = set()
        for mid in message_ids:
            error = "ID not in flight" if mid in taken else channel.owner_error(mid, consumer)
            if error is None:
                taken.add(mid)
                held.append(mid)
            errors.append(error)
        if held:
            channel.ack_held(held, consumer)
        return errors

    def ack_many(self, topic: str, name: str, message_ids: Iterable[int], consumer: Receiver) -> int:
        """``ack`` of each id, the channel found once; returns how many were refused."""
        channel = self.channels.get((topic, name))
        if channel is None:
            return sum(1 for _ in message_ids)
        return channel.ack_held(message_ids, consumer)

    def _on_acks(self, channel: ReliableChannel, deliveries: list[Delivery], acked_ms: int, consumer: Receiver | None) -> None:
        """The copies one ``ack_held`` call acknowledged, to the acker as one ``AckRun``:
        what they share (channel, consumer, time, whether the topic keeps attempts) once,
        the rest as columns."""
        messages = [d.message for d in deliveries]
        self.acker.add_many([AckRun(
            channel.topic, channel.name, getattr(consumer, "name", ""), acked_ms,
            # attempts were kept for a copy (dead_letters.on_attempt) only if it was
            # delivered again, or the topic counts attempts
            channel.max_attempts is not None,
            [m.message_id for m in messages],
            [m.owner for m in messages],
            [m.published_ms for m in messages],
            [d.first_delivered_ms for d in deliveries],
            [d.attempts for d in deliveries],
            [int(d.delivered_at * 1000) for d in deliveries],
            channel.epoch,
        )])

    def _ack_progress(self, batch: list[AckRun]) -> tuple[list[CursorProgress], str, bool]:
        """For each (channel, owner) of a batch of acks about to be made durable, what
        the channel in memory knows to be done (``ReliableChannel.progress``, its
        ``reliable.cursor``); in a cluster the statement moves only the cursors this node
        still holds."""
        progress = []
        epochs: dict[tuple[str, str], int] = {}  # per channel, the oldest epoch of its runs
        for run in batch:
            key = (run.topic, run.channel)
            epochs[key] = min(run.epoch, epochs.get(key, run.epoch))
        for (topic, name, owner), ids in acks_by_cursor(batch).items():
            channel = self.channels.get((topic, name))
            if channel is None:  # unregistered meanwhile: the acks alone
                floor, spans = 0, [(x, x) for x in sorted(set(ids))]
            else:
                floor, spans = channel.progress(owner, ids, self.writes.limit(owner, orderer=channel.cursor.loads_only))
            # a batch with acks of before and after a seek this node learned of (nearly
            # never: ``reseek`` drops the queued ones) proposes the older epoch: refused,
            # all of them, and the copies are delivered again (``_acks_done``)
            progress.append(CursorProgress(topic, name, owner, floor, spans, epochs[(topic, name)]))
        return progress, self.node_id, self.load_owner is not None

    def _acks_done(self, runs: list[AckRun], taken: list[tuple[str, str, int]]) -> None:
        """The batch committed: its copies are done, but for cursors another node took
        over meanwhile (this node's session was lost) or a seek wrote since the copies
        were pushed (``ack_deliveries``). Their acks were not applied and this node
        forgets them: the new holder delivers them, or this node again once it has read
        the channel's new cursors (it reads the channels' state at once to learn of a
        seek: ``reseek``). The runs of a channel sought since they were pushed are
        ignored: ``reseek`` dropped all it knew of their copies. A batch that held runs
        of before and after a seek this node knew of (a failed batch's retry) proposed
        the older epoch and was refused for the newer runs too: their copies are still
        this node's, and it reads them again (``rescan``)."""
        oldest: dict[tuple[str, str], int] = {}
        for run in runs:
            key = (run.topic, run.channel)
            oldest[key] = min(run.epoch, oldest.get(key, run.epoch))
        current = [r for r in runs if (c := self.channels.get((r.topic, r.channel))) is None or r.epoch >= c.epoch]
        by_channel, refused = split_fenced(current, taken)
        for key, ids in by_channel.items():
            channel = self.channels.get(key)
            if channel is not None:
                channel.ack_durable(ids)
        for (topic, name), ids in refused.items():
            self.acks_fenced += len(ids)
            log.warn("{n} acks on {topic}/{channel} not applied: another node holds their cursor now "
                     "(it delivers them), or a seek rewrote it", n=len(ids), topic=topic, channel=name)
            channel = self.channels.get((topic, name))
            if channel is not None:
                channel.ack_not_durable(ids)
                if oldest[(topic, name)] < channel.epoch:
                    channel.rescan()
        if refused:
            self.read_channel_state()

    def _holder(self, channel: ReliableChannel) -> str | None:
        """Whose copies a channel's loads read: in a cluster, those of this node's
        incarnation and of the cursors it holds; an ordered topic's orderer (and a node
        without a fence) reads every owner's (None)."""
        return None if channel.cursor.loads_only else self.load_owner

    def _load(self, channel: ReliableChannel, after: int, limit: int) -> None:
        d = self._workers["loader"].run_steps(
            load_backlog_steps, channel.topic, channel.name, after, limit, self._holder(channel), self.writes.owner,
            list(channel.cursor.skipped),
        )
        self._on_load(channel, d, lambda rows: channel.loaded(rows, limit))

    def _load_key(self, channel: ReliableChannel, key: str, after: int, limit: int) -> None:
        """An ordered channel's read of one key read apart (``ChannelCursor.skipped``)."""
        d = self._workers["loader"].run_steps(
            load_backlog_steps, channel.topic, channel.name, after, limit, self._holder(channel), self.writes.owner,
            (), key,
        )
        self._on_load(channel, d, lambda rows: channel.loaded_key(rows, limit, key))

    def _load_ahead(self, channel: ReliableChannel, afters: list[int], limit: int) -> None:
        """A channel's read-ahead of its copies of priority 1 to 9 (``ChannelCursor.lookahead_from``)."""
        d = self._workers["loader"].run_steps(
            load_priority_backlog_steps, channel.topic, channel.name, afters, limit, self._holder(channel),
            self.writes.owner,
        )
        self._on_load(channel, d, lambda rows: channel.loaded_ahead(rows, limit))

    def _on_load(
        self, channel: ReliableChannel, d: Deferred[list[BacklogRow]], answer: Callable[[list[BacklogRow]], None]
    ) -> None:
        """A channel's load (or read-ahead) answered: its rows to ``answer``; a storage
        error is an outage of the loads, and the channel retries later."""

        def loaded(rows: list[BacklogRow]) -> None:
            self._load_outage.recovered()
            if not channel.closed:
                if rows and rows[0].epoch > channel.epoch:
                    self._loaded_epoch(channel, rows[0].epoch)
                answer(rows)

        def failed(failure: Failure) -> None:
            failure.trap(StorageError)
            self._load_outage.failed(f"{channel.topic}/{channel.name}: {failure.value}")
            self._set_health(False, str(failure.value))
            channel.load_failed()

        d.addCallbacks(loaded, failed)

    # -- operators: pause, empty (nsqd's channel admin on reliable channels) ----------
    def _registered_channel(self, topic: str, name: str) -> ReliableChannel:
        spec = self.topics.get(topic)
        if spec is None:
            raise KeyError("TOPIC_NOT_FOUND")
        if name not in spec.channels:
            raise KeyError("CHANNEL_NOT_FOUND")
        return self.channel(topic, name)

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

        def stored(_: object) -> None:
            (self._held.add if paused else self._held.discard)((topic, name))
            self._held_changes += 1
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
        d = self._workers["admin"].run_steps(empty_channel_steps, topic, name)

        def emptied(count: int) -> int:
            # copies committed after the delete's snapshot are still stored: forget()
            # re-reads the store from the first id, so they are delivered, not lost
            channel.forget()
            channel.stored_count = channel.oldest_stored_id = None
            self.depths.restart()  # a pass in progress counted the dropped copies
            channel.pump()
            return count

        return d.addCallback(emptied)

    def read_channel_state(self) -> Deferred:
        """The operators' pauses (set on any node), the retired incarnations and the
        channels' epochs (a seek on any node raises one: the channel reads its copies
        again, ``ReliableChannel.reseek``); then the topics' retained figures (``retained``:
        counted by the sweep's passes, on whichever node). The stored depths are counted
        apart, a slice at a time (``self.depths``).

        A pause or unpause made here while the read was out (``pause_channel``) is newer
        than the pauses it read: they are left as they are until the next read."""
        changes = self._held_changes
        d = self._workers["admin"].run_steps(read_channel_state_steps)

        def figures(state: ChannelState) -> Deferred[ChannelState]:
            """Then the topics' retained figures (a small table, a row a topic)."""

            def keep(retained: dict[str, Retained]) -> ChannelState:
                self._sweep.retained = retained
                return state

            return self._workers["admin"].run_steps(retained_figures_steps).addCallback(keep)

        d.addCallback(figures)

        def apply(state: ChannelState) -> None:
            held, retired, epochs = state
            self.writes.retired.update(retired)
            if changes != self._held_changes:
                held = self._held
            self._held = held
            self._epochs = epochs
            for key, channel in self.channels.items():
                was, channel.held = channel.held, key in held
                if was and not channel.held:
                    channel.pump()
                self.reseek(channel, epochs.get(key, 0))

        d.addCallback(apply)
        d.addErrback(lambda f: f.trap(StorageError))
        return d

    def _loaded_epoch(self, channel: ReliableChannel, epoch: int) -> None:
        """A load read the channel's cursors in a newer epoch than this node knows (a seek
        it has not heard of yet). A channel that has held nothing yet (its first load: no
        position, nothing known or finishing, nothing pushed) read only the new cursors:
        it takes the epoch as its own. Any other learns of the seek now (``reseek``: this
        load's rows are stale, and the channel reads from the first id)."""
        cursor = channel.cursor
        if cursor.position == 0 and not cursor.known and not cursor.finishing and channel.delivery_count == 0:
            channel.epoch = epoch
        else:
            self.reseek(channel, epoch)

    def reseek(self, channel: ReliableChannel, epoch: int) -> None:
        """The channel learned of a seek (``epoch`` newer than its own): the acks queued
        for it go (their copies are the seek's to deliver again), and it reads its copies
        again (``ReliableChannel.reseek``)."""
        if epoch <= channel.epoch:
            return
        dropped = self.acker.discard(lambda run: (run.topic, run.channel) == (channel.topic, channel.name)
                                     and run.epoch < epoch)
        channel.reseek(epoch)
        self.depths.restart()  # a pass in progress counted the copies as they were
        log.info("{topic}/{channel} was sought (epoch {epoch}): its copies are read again from the store; "
                 "{dropped} acks of copies pushed before it dropped", topic=channel.topic, channel=channel.name,
                 epoch=epoch, dropped=dropped)

    def _apply_depths(self, depths: dict[tuple[str, str], int], lowest: dict[tuple[str, str], int]) -> None:
        """A complete pass of the depth count: every channel's stored copies and the
        lowest id among them."""
        for key, channel in self.channels.items():
            channel.stored_count = depths.get(key, 0)
            channel.oldest_stored_id = lowest.get(key)

    # -- periodic work ------------------------------------------------------
    def scan(self, now: float) -> None:
        """Requeue copies whose deadline passed; retry a backlog load that failed; look
        for sends of unknown outcome; ask whether the writes whose answer was lost are
        settled."""
        self._resolve_unknown(now)
        for channel in list(self.channels.values()):
            if channel.in_flight:
                channel.scan(now)
            elif channel.backlog and not channel.loading and channel.consumers:
                channel.pump()
        if not self._checking_held and self.writes.held_pids():
            self._check_held()

    def _check_held(self) -> None:
        """A write whose answer was lost is settled once the backend that ran it is gone;
        what it committed may have become visible only now, so every channel reads its
        copies again (``outcome_unknown``)."""
        pids = self.writes.held_pids()
        self._checking_held = True
        d = self._workers["admin"].run_steps(backends_alive_steps, sorted(pids))

        def answered(alive: set[int]) -> None:
            self._checking_held = False
            if self.writes.release(pids - alive):
                self.outcome_unknown(None)

        def failed(failure: Failure) -> None:
            self._checking_held = False
            failure.trap(StorageError)

        d.addCallbacks(answered, failed)

    def sweep(self) -> Deferred:
        """Delete messages every channel has acknowledged, past their topic's retention
        (``--retention``, else --message-retention); fires when the pass's plan and its
        first batch are done. A pass visits the topics with something stored older than
        their window (``sweep_plan_steps``), one at a time, each by its own index range,
        so a topic that keeps a week of messages costs the others nothing. While a topic's
        batches come back full the next follows after a pause (``SWEEP_DUTY``): one batch of
        10,000 every --sweep-interval removed at most 333 messages a second, fewer than a
        steady publisher adds, and one statement of 10,000 held a core for 0.4 s in the
        group commit's way. A pass still going when the timer fires again is left alone."""
        sweep = self._sweep
        if sweep.call is not None or sweep.running:
            return succeed(None)
        sweep.running = True
        d = self._workers["admin"].run_steps(sweep_pass_plan_steps, self.options.message_retention, dict(sweep.starts))

        def planned(plan: tuple[list[SweepTarget], dict[float, int], SettlePoint, list[str]]) -> Deferred:
            targets, sweep.starts, sweep.point, topics = plan
            sweep.targets, sweep.after, sweep.counts = deque(targets), 0, deque(topics)
            return self._sweep_batch()

        return d.addCallbacks(planned, self._sweep_failed)

    def _sweep_batch(self) -> Deferred:
        """The pass's next batch: of its first topic, or the pass's end (``prune_owners``)."""
        sweep = self._sweep
        sweep.call = None
        sweep.running = True
        if sweep.stopped:
            sweep.running = False
            return succeed(None)
        if not sweep.targets and sweep.counts and sweep.point is not None:
            return self._count_batch()
        if not sweep.targets:
            pruned = self._workers["admin"].run_steps(prune_owners_steps)
            return pruned.addCallbacks(lambda _: setattr(sweep, "running", False), self._sweep_failed)
        target = sweep.targets[0]
        started = self.clock.seconds()
        d = self._workers["admin"].run_steps(sweep_topic_steps, target, sweep.batch, sweep.after)

        def swept(result: tuple[int, int] | None) -> Deferred | None:
            if result is not None:  # else another node sweeps the topic now: the next one
                count, sweep.after = result
                sweep.swept += count
                if count >= sweep.batch:  # more of this topic, after a pause
                    sweep.running = False
                    if not sweep.stopped:
                        pause = (self.clock.seconds() - started) * (1 / SWEEP_DUTY - 1)
                        sweep.call = self.clock.callLater(pause, self._continue_sweep)
                    return None
            sweep.targets.popleft()
            sweep.after = 0
            return self._sweep_batch()

        return d.addCallbacks(swept, self._sweep_failed)

    def _count_batch(self) -> Deferred:
        """The next batch of the pass's count (``db.retained``): of its first topic while
        they come back full (after the sweep's pause), then the next topic's."""
        sweep = self._sweep
        assert sweep.point is not None
        started = self.clock.seconds()
        d = self._workers["admin"].run_steps(count_topic_steps, sweep.counts[0], sweep.point, COUNT_BATCH)

        def counted(count: int | None) -> Deferred | None:
            if count is not None and count >= COUNT_BATCH:  # more of this topic, after a pause
                sweep.running = False
                if not sweep.stopped:
                    pause = (self.clock.seconds() - started) * (1 / SWEEP_DUTY - 1)
                    sweep.call = self.clock.callLater(pause, self._continue_sweep)
                return None
            sweep.counts.popleft()  # done, or another node sweeps or counts it now
            return self._sweep_batch()

        return d.addCallbacks(counted, self._sweep_failed)

    def _sweep_failed(self, failure: Failure) -> None:
        sweep = self._sweep
        sweep.running = False
        sweep.targets.clear()
        sweep.counts.clear()
        failure.trap(StorageError)  # the next --sweep-interval tries again

    def _continue_sweep(self) -> None:
        self._sweep_batch().addErrback(lambda f: log.failure("the retention sweep failed", f))

    # -- introspection ------------------------------------------------------
    def topic_stats(self) -> list[dict[str, Any]]:
        topics = []
        for name in sorted(self.topics):
            spec = self.topics[name]
            channels = [self.channels[(name, c)].stats() for c in spec.channels if (name, c) in self.channels]
            topics.append(
                {"topic_name": name, "store": spec.store, "msg_timeout_ms": spec.msg_timeout_ms, "channels": channels}
            )
        return topics


def _answer_for(failure: BaseException) -> BaseException:
    """What a producer hears of a send that was not committed: PostgreSQL refusing the
    row is this send's own input (``Invalid``); anything else is the store's failure."""
    if isinstance(failure, RefusedError):
        return Invalid(str(failure))
    return failure
