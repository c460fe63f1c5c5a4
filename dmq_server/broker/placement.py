"""Topics placed on several PostgreSQL clusters: one reliable store per cluster.

Each cluster (``main``, and every ``--pg-cluster NAME=DSN``) has its own
``ReliableStore``: its incarnation on that cluster's database, its group-commit
writers, acker, loader, delay scheduler and dead letters. A topic's settings name its
cluster (``TopicSpec.cluster``) and the clusters it was moved away from whose copies are
still being delivered (``TopicSpec.draining``), so:

* a publish goes to the store of the topic's cluster;
* a channel of a topic on one cluster is that store's channel; while a topic is moving
  a consumer is attached to the channel in every cluster holding copies, through one
  ``ChannelGroup`` (its credit is the consumer's, shared by them);
* an ack, a requeue and a touch go to the store whose cluster drew the message id
  (``db.clusters.slot_of_id``: every cluster draws ids from its own slot);
* an ordered topic keeps its keys' order across a move (``move_held``): its channels on
  the new cluster push nothing until no older cluster drains.

A cluster's outage fails its topics only: the node's health (what clients are told,
and what refuses subscriptions) is the main cluster's, which holds the registry without
ZooKeeper; another cluster's is in ``health`` per cluster, in ``/stats`` and
``/metrics``, and in the error its topics' producers get.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping

from twisted.logger import Logger

from dmq_server.core.clock import Clock
from dmq_server.core.errors import Unavailable
from dmq_server.core.options import Options
from dmq_server.db.clusters import slot_of_id
from dmq_server.db.outage import Outage
from dmq_server.db.runner import StepRunner
from dmq_server.reliable.channel import Delivery, Receiver, ReliableChannel
from dmq_server.reliable.store import Outcome, ReliableStore, StoreWiring
from registry.model import TopicSpec

__all__ = ["Placement", "ChannelGroup", "merge_channel_stats", "move_held"]

log = Logger()


def move_held(spec: TopicSpec) -> str | None:
    """The cluster whose channels of ``spec``'s topic hold their pushes while it moves:
    an ordered topic's own cluster while ``draining`` lists another (None: nothing held).

    Ids do not order across clusters (each draws from its own slot), so a key's order
    across a move rests on this: per key, every copy stored on the old cluster goes out
    before any copy stored on the new one. That is commit order (docs/protocol.md §5): a
    producer sends a key's next message only after the previous one's ack, and once the
    old cluster's row names the new one it stores the topic no more (``E_MOVED``). Across
    nodes, a node routes the topic to the new cluster only once it wrote that row itself
    (``db.mirror``), and no older view can write it back (the row's version, schema 19).
    The new cluster is the newer; the draining ones deliver freely, so the move still finishes
    (it waits for them to hold nothing, and they wait for nobody).

    Older and newer are known only between the topic's cluster and the draining ones:
    ``draining`` is a set (the CLI keeps it sorted by name), so of two draining clusters
    neither is known to be the older, and a topic moved back to a cluster it still drains
    holds copies there both older and newer than the other's. Neither keeps a key's order,
    so ``dmq topic move`` refuses either while a move drains (admin/cli_clusters.py).
    Unordered topics hold nothing."""
    if spec.ordered and any(c != spec.cluster for c in spec.draining):
        return spec.cluster
    return None


class ChannelGroup:
    """One (topic, channel) over the clusters holding its copies: what an adapter holds
    as its subscription's channel when there is more than one cluster. Its members are
    the clusters' ``ReliableChannel``s, changed by the broker as the topic moves; every
    consumer subscribed to the group is subscribed to each member. Of an ordered topic,
    the member of the new cluster pushes nothing while an older one drains
    (``move_held``; ``Placement`` holds it, since a node may have that member alone)."""

    def __init__(self, topic: str, name: str):
        self.topic = topic
        self.name = name
        self.members: dict[int, ReliableChannel] = {}  # by id slot
        self.consumers: list[Receiver] = []

    def set_members(self, members: dict[int, ReliableChannel]) -> None:
        for slot, channel in list(self.members.items()):
            if members.get(slot) is not channel:
                for consumer in self.consumers:  # quietly: the group goes on
                    channel.unsubscribe(consumer)
        for slot, channel in members.items():
            if self.members.get(slot) is not channel:
                for consumer in self.consumers:
                    channel.subscribe(consumer)
        self.members = dict(members)

    def _member(self, message_id: int) -> ReliableChannel | None:
        return self.members.get(slot_of_id(message_id))

    # -- what the adapters call on a channel -------------------------------------------
    def subscribe(self, consumer: Receiver) -> None:
        if consumer not in self.consumers:
            self.consumers.append(consumer)
        for channel in self.members.values():
            channel.subscribe(consumer)

    def unsubscribe(self, consumer: Receiver) -> None:
        if consumer in self.consumers:
            self.consumers.remove(consumer)
        for channel in self.members.values():
            channel.unsubscribe(consumer)

    def pump(self) -> None:
        for channel in list(self.members.values()):
            channel.pump()

    def requeue(self, message_id: int, consumer: Receiver, delay: float = 0.0) -> str | None:
        channel = self._member(message_id)
        if channel is None:
            return "ID not in flight"
        error = channel.requeue(message_id, consumer, delay)
        self.pump()  # the consumer's credit is free for the other clusters' copies too
        return error

    def touch(self, message_id: int, consumer: Receiver) -> str | None:
        channel = self._member(message_id)
        return "ID not in flight" if channel is None else channel.touch(message_id, consumer)

    def stats(self) -> dict[str, Any]:
        return merge_channel_stats([c.stats() for c in self.members.values()])

    def locate(self, message_id: int) -> dict[str, object] | None:
        channel = self._member(message_id)
        return None if channel is None else channel.locate(message_id)

    # -- what /stats and the console read of a channel: added up over its members -------
    def _total(self, attribute: str) -> int:
        return sum(getattr(c, attribute) for c in self.members.values())

    depth = property(lambda self: self._total("depth"))
    message_count = property(lambda self: self._total("message_count"))
    requeue_count = property(lambda self: self._total("requeue_count"))
    timeout_count = property(lambda self: self._total("timeout_count"))
    waiting = property(lambda self: self._total("waiting"))
    held = property(lambda self: any(c.held for c in self.members.values()))
    epoch = property(lambda self: min((c.epoch for c in self.members.values()), default=0))  # every member's

    @property
    def in_flight(self) -> dict[int, Delivery]:
        return {k: v for c in self.members.values() for k, v in c.in_flight.items()}

    @property
    def deferred(self) -> set[int]:
        return {k for c in self.members.values() for k in c.deferred}


def merge_channel_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One channel's stats from its copies on several clusters: counts added up."""
    merged = dict(parts[0])
    for part in parts[1:]:
        for key, value in part.items():
            if isinstance(value, bool):
                merged[key] = merged[key] or value
            elif isinstance(value, int) and key != "clients":
                merged[key] = merged.get(key, 0) + value
    return merged


class Placement:
    """The stores by cluster and id slot, and the channel groups of moving topics.

    ``workers`` maps each cluster to its database roles (``main`` first); ``slots``
    each cluster to its id slot (``db.clusters.place_clusters``). ``set_health`` is the
    broker's (the node's health: the main cluster's); ``wiring`` what every store is
    given (each with its own cluster's name)."""

    def __init__(
        self,
        options: Options,
        clock: Clock,
        workers: Mapping[str, Mapping[str, StepRunner]],
        slots: dict[str, int],
        node_id: str,
        set_health: Callable[[bool, str], None],
        wiring: StoreWiring = StoreWiring(),
    ):
        self.clock = clock
        self.stores: dict[str, ReliableStore] = {}
        self.health: dict[str, tuple[bool, str]] = {}
        self._outages: dict[str, Outage] = {}
        for name, roles in workers.items():
            health = self._main_health(set_health) if name == "main" else self._health_of(name)
            self.stores[name] = ReliableStore(options, clock, roles, node_id, health, replace(wiring, cluster=name))
            self.health[name] = (True, "")
        self.by_slot = {slots[name]: store for name, store in self.stores.items()}
        self.slot_of = dict(slots)
        self.groups: dict[tuple[str, str], ChannelGroup] = {}
        # the channels held for an ordered topic's move (``move_held``)
        self.move_holds: dict[tuple[str, str], ReliableChannel] = {}
        self._unknown_warned: set[str] = set()

    @property
    def several(self) -> bool:
        return len(self.stores) > 1

    def _main_health(self, set_health: Callable[[bool, str], None]) -> Callable[[bool, str], None]:
        def main_health(ok: bool, why: str) -> None:
            self.health["main"] = (ok, why)
            set_health(ok, why)

        return main_health

    def _health_of(self, name: str) -> Callable[[bool, str], None]:
        outage = self._outages[name] = Outage(f"cluster {name!r} (group commit, acks, loads)", self.clock)

        def set_health(ok: bool, why: str) -> None:
            was, _ = self.health[name]
            self.health[name] = (ok, why)
            if ok and not was:
                outage.recovered()
            elif not ok and was:
                outage.failed(why)

        return set_health

    # -- routing --------------------------------------------------------------------
    def store_of(self, spec: TopicSpec) -> ReliableStore | Unavailable:
        store = self.stores.get(spec.cluster)
        if store is None:
            return Unavailable(
                f"topic {spec.name!r} is placed on cluster {spec.cluster!r}, which this node is not "
                f"connected to (start it with --pg-cluster {spec.cluster}=DSN)",
                code="E_NO_CLUSTER",
            )
        return store

    def store_of_id(self, message_id: int) -> ReliableStore | None:
        return self.by_slot.get(slot_of_id(message_id))

    def answer(self, store: ReliableStore, done: Callable[[Outcome], None]) -> Callable[[Outcome], None]:
        """``done``, with a store failure of another cluster than main naming it."""
        if store.cluster == "main":
            return done
        cluster = store.cluster

        def answered(outcome: Outcome) -> None:
            if isinstance(outcome, Unavailable):
                outcome = type(outcome)(f"cluster {cluster!r}: {outcome.description}")
            done(outcome)

        return answered

    def stores_of(self, spec: TopicSpec) -> list[ReliableStore]:
        """The stores holding copies of ``spec``'s topic that this node is connected to."""
        return [self.stores[c] for c in spec.clusters if c in self.stores]

    # -- the registry -----------------------------------------------------------------
    def apply(self, reliable: dict[str, TopicSpec]) -> None:
        """Each store gets the topics with copies on its cluster; groups follow."""
        for spec in reliable.values():
            missing = [c for c in spec.clusters if c not in self.stores]
            for cluster in missing:
                if cluster not in self._unknown_warned:
                    self._unknown_warned.add(cluster)
                    log.warn("topic {topic} is on cluster {cluster}, which this node is not connected to "
                             "(--pg-cluster): its sends fail here", topic=spec.name, cluster=cluster)
        # consumers leave the channels of clusters a topic no longer has before they close
        for key, group in list(self.groups.items()):
            current = reliable.get(key[0])
            if current is None or key[1] not in current.channels:
                del self.groups[key]  # unregistered: the store tells its consumers
                continue
            keep = {self.slot_of[s.cluster]: group.members.get(self.slot_of[s.cluster]) for s in self.stores_of(current)}
            group.set_members({slot: ch for slot, ch in keep.items() if ch is not None})
        for name, store in self.stores.items():
            store.apply_topics({n: s for n, s in reliable.items() if name in s.clusters})
        for key, group in self.groups.items():
            self._fill(group, reliable[key[0]])
        self._hold_moves(reliable)

    def _hold_moves(self, reliable: dict[str, TopicSpec]) -> None:
        """Hold the channels ``move_held`` names, and let go of the others: a channel let
        go pushes what it has at once (a key's next copy first, in id order)."""
        wanted = {(spec.name, name): channel for spec in reliable.values() for name in spec.channels
                  if (channel := self._move_held_channel(spec, name)) is not None}
        for key, channel in list(self.move_holds.items()):
            if wanted.get(key) is not channel:
                del self.move_holds[key]
                log.info("channel {topic}/{channel}: no older cluster drains any more, its pushes go on",
                         topic=key[0], channel=key[1])
                channel.hold_for_move(False)
        for key, channel in wanted.items():
            self._hold(key, channel)

    def _move_held_channel(self, spec: TopicSpec, name: str) -> ReliableChannel | None:
        cluster = move_held(spec)
        store = self.stores.get(cluster) if cluster is not None else None
        return None if store is None else store.channels.get((spec.name, name))

    def _hold(self, key: tuple[str, str], channel: ReliableChannel) -> None:
        if self.move_holds.get(key) is channel:
            return
        self.move_holds[key] = channel
        channel.hold_for_move(True)
        log.info("channel {topic}/{channel} holds its pushes until the older cluster is drained "
                 "(an ordered topic's move)", topic=key[0], channel=key[1])

    def _fill(self, group: ChannelGroup, spec: TopicSpec) -> None:
        group.set_members({self.slot_of[s.cluster]: s.channel(group.topic, group.name) for s in self.stores_of(spec)})

    def subscribe(self, spec: TopicSpec, name: str, consumer: Receiver) -> ReliableChannel | ChannelGroup:
        """The channel a consumer of ``spec``'s channel ``name`` is attached to: the
        store's own with one cluster, else the (topic, channel)'s group."""
        cluster = move_held(spec)
        if cluster is not None and cluster in self.stores:  # held before its first consumer, if made now
            self._hold((spec.name, name), self.stores[cluster].channel(spec.name, name))
        if not self.several:
            return self.stores["main"].subscribe(spec.name, name, consumer)
        key = (spec.name, name)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = ChannelGroup(spec.name, name)
            self._fill(group, spec)
        group.subscribe(consumer)
        return group

    def acked(self, topic: str, channel: str) -> None:
        """An ack freed a consumer's credit: a moving topic's other cluster may have
        copies ready for it (a member pumps only itself)."""
        group = self.groups.get((topic, channel))
        if group is not None and len(group.members) > 1:
            group.pump()

    def channels(self) -> Mapping[tuple[str, str], ReliableChannel | ChannelGroup]:
        """Every reliable channel in memory by (topic, channel): a group's where a
        consumer made one, else the first store's that has it."""
        if not self.several:
            return self.stores["main"].channels
        found: dict[tuple[str, str], ReliableChannel | ChannelGroup] = {}
        for store in self.stores.values():
            for key, channel in store.channels.items():
                found.setdefault(key, channel)
        found.update(self.groups)
        return found

    def each(self, method: str) -> Iterable[Any]:
        """Call ``method`` on every store; their results."""
        return [getattr(store, method)() for store in self.stores.values()]

    # -- introspection ------------------------------------------------------------------
    def topic_stats(self, reliable: dict[str, TopicSpec]) -> list[dict[str, Any]]:
        """Every reliable topic once, with its cluster, channels added up over clusters."""
        if not self.several:
            return [dict(t, cluster="main", draining=[]) for t in self.stores["main"].topic_stats()]
        per_store = {name: {t["topic_name"]: t for t in store.topic_stats()} for name, store in self.stores.items()}
        topics = []
        for name in sorted(reliable):
            spec = reliable[name]
            parts = [per_store[c][name] for c in spec.clusters if c in per_store and name in per_store[c]]
            if not parts:
                parts = [{"topic_name": name, "store": spec.store, "msg_timeout_ms": spec.msg_timeout_ms, "channels": []}]
            by_channel: dict[str, list[dict[str, Any]]] = {}
            for part in parts:
                for channel in part["channels"]:
                    by_channel.setdefault(channel["channel_name"], []).append(channel)
            topic = dict(parts[0], cluster=spec.cluster, draining=list(spec.draining))
            topic["channels"] = [merge_channel_stats(by_channel[c]) for c in sorted(by_channel)]
            topics.append(topic)
        return topics

    def cluster_stats(self) -> dict[str, dict[str, Any]]:
        """Per cluster: its health and what its writers, acker and stores did."""
        out = {}
        for name, store in self.stores.items():
            ok, why = self.health[name]
            out[name] = {
                "slot": self.slot_of[name],
                "health": "OK" if ok else "ERROR",
                "health_detail": why,
                "incarnation": store.writes.owner,
                "published": store.publish_count,
                "delayed": store.delayed_count,
                "swept": store.swept_count,
                "writer": {
                    "unknown_outcomes": store.unknown_outcomes,
                    "pending": store.writer.pending,
                    "batches": store.writer.batches,
                    "messages": store.writer.messages,
                },
                "acks": {"pending": store.acker.pending, "durable": store.acker.acked - store.acks_fenced,
                         "fenced": store.acks_fenced},
                "dead_letters": store.dead_letters.stats(),
            }
        return out
