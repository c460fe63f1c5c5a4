"""Per-key order under faults (issue 45 §2): an ordered topic (``--ordered``) under load
from several producers over 1,000 keys, consumed on two channels, while a consumer is
killed, consumers are paused and the dmq server is killed with ``-9`` and restarted.

    producers (each owns a range of keys) --> one dmq node --> PostgreSQL (embedded)
    consumers: billing (3, a fourth replaces the killed one), audit (2)

**Producers** (``KeyedProducer``): each owns a disjoint range of the keys, so every key has
one producer, and sends a key's next message only after the previous one was answered
``SEND_SUCCESS_ACK``: the order of its acks for a key is the order of the key's commits
(``docs/protocol.md`` §5: that is also ``message_id`` order). To give the server something
to hold back, a producer works on up to ``window`` keys at once, each for a burst of 1-5
messages sent one after the other's ack (milliseconds apart, while the consumers hold
copies for up to 80 ms). A send not answered before its connection broke (the server's
kill) is sent again with the same (producer, session id) as ``UP_PRODUCER_RESEND``, and
nothing more of its key goes out before it is answered.

**Consumers** (``KeyedConsumer``): each records every push, as an ``Attempt`` (message id,
key, attempts, when it was read) and when it let go of it: the moment before it wrote the
ack, before it reset its connection when killed, when it found its connection gone (the
server's kill, its moment taken before the signal, caps that). Each time is taken on one
monotonic clock, read *after* the push was read and *before* the ack was written, so a
recorded interval lies inside the server's own (push sent .. ack received): an overlap of
recorded intervals is an overlap at the server. Half the consumers ack at once, the others
after a random hold of up to 80 ms. They are threads of the test: paused, one stops reading
and acking (what SIGSTOP would do to a process); holding, one reads on but acks nothing.

**Faults**, in this order while the load is on: a billing consumer is killed (its
connection reset, nothing acked) while it holds copies, one of them with a later message of
its key stored, which come back and go to the others (a new consumer takes its place); a billing and an audit consumer are paused
(they stop reading and acking) for ``pause_for`` seconds while they hold copies, so their
keys wait and the other keys must flow; the dmq server is killed with ``-9`` and started
again at once on the same port, once a consumer of each channel holds a copy (the same
node: it loads what was not acknowledged from PostgreSQL; producers resend what was
unanswered, consumers connect again).

**Across nodes** (``ordered_nodes``, the scenario ``test_ordered_nodes.py``):
``ChaosCluster.register_topic(..., ordered=True)``; ``keyed_producers`` over every node's
address, producer ``i`` starting on node ``i``, each moving to the next node when its
connection breaks or goes quiet and resending there what was unanswered
(``KeyedProducer``); ``consumers_on_every_node``, a ``KeyedConsumer`` per (node, channel,
instance), each push recorded with its node; ``orderer`` / ``await_orderer`` (the holder
of ``/dmq/orderer/<topic>``), ``kill_node`` (-9, recorded in ``OrderedRun.node_kills``:
it ends only the pushes that came through that node) and ``pause_node`` (SIGSTOP). The
checker's rules are the same; the report adds the pushes per node. Ids order a key's
commits within one PostgreSQL cluster only: a topic moved (``dmq topic move``) to a
cluster of a lower id slot stores its later messages under lower ids, so across clusters
the order is the producer's acks (``_commit_order``).

The counts (``count``), per channel and key: **lost**, an acknowledged send never pushed
on the channel; **order violations**, a key whose messages were first pushed in another
order than their producer's acks (and, within one PostgreSQL cluster, than their ids); **overlaps**, a push of a key's
message while another message of that key was still out on the channel (pushed, not
acknowledged, its consumer neither killed nor disconnected, the server not killed since);
**same-id overlaps**, a copy pushed again while the consumer still held the earlier push
(only a timeout may do that, and the topic's is longer than anything is held: 30 s here, 4 s
across nodes, where a paused consumer holds copies 2 s);
**redeliveries passed**, a copy let go unacknowledged (its consumer killed or cut off, the
server killed) whose key's next push was another message, not that copy again (a
redelivery keeps its place at the head of its key); an earlier message of the key coming
back first is allowed (its ack reached the server, which died before it was durable: it is
delivered again, and id order puts it first). Every one must be 0. To show the rule was exercised: **held back**, messages acknowledged to
their producer while the message before them of their key was out on the channel (the
rule made them wait), and redeliveries pushed while a later message of their key was
already stored (they had to keep their place at its head). Loss, duplicates after a durable ack and unknown deliveries are
also counted by the chaos checker (``checker.check``).
"""

from __future__ import annotations

import random
import signal
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dmq_client.blocking import BlockingClient, ClientError
from dmq_client.message import ReceivedMessage
from dmq_client.wire import Command, Frame
from dmq_client.wire.properties import Properties, encode_properties
from dmq_server.db.clusters import SLOT_SHIFT
from registry import paths
from registry.placement_lock import PlacementLock

from .checker import ChannelCount, History, check
from .load import Addresses, Confirmer, Producer

if TYPE_CHECKING:
    from .cluster import ChaosCluster

__all__ = ["Attempt", "KeyedProducer", "KeyedConsumer", "OrderedTiming", "OrderedRun", "OrderCount",
           "CHANNELS", "KEYS", "MSG_TIMEOUT_MS", "PROBLEMS", "check_order", "key_history", "run", "format_report",
           "keyed_producers", "keyed_consumer", "consumers_on_every_node", "pushes_per_node", "node_index",
           "node_ids", "orderer", "await_orderer", "kill_node", "pause_node", "followed", "pause_consumers",
           "broken_rules"]

CHANNELS = ["billing", "audit"]
KEYS = 1000
MSG_TIMEOUT_MS = 30_000  # longer than any copy is held: no copy comes back by a timeout
HOLD = 0.08  # the longest a holding consumer keeps a copy before its ack
Address = Callable[[], tuple[str, int]]
NodeKills = Mapping[str, list[float]]  # node id -> when it was killed (-9), taken before the signal
Heal = Callable[[], None]


def key_name(n: int) -> str:
    return f"k{n:04d}"


def identity(body: bytes) -> bytes:
    """A send's identity (``<producer>/<session id>``), the first word of its body."""
    return body.split(b" ", 1)[0]


@dataclass
class Attempt:
    """One push as its consumer saw it: read at ``pushed_at``, let go of at ``ended_at``
    (``how``: ``ack``, ``consumer killed``, ``connection lost``, ``stopped``; None while
    held), through ``node`` (the node id its consumer is connected to; "" with one node)."""

    channel: str
    consumer: str
    message_id: int
    key: str | None
    attempts: int
    pushed_at: float
    ended_at: float | None = None
    how: str = ""
    node: str = ""


class KeyedProducer(Producer):
    """Sends over its own keys, one message of a key at a time (see the module): the
    chaos load's producer (pacing, pipelining, a resend of what a broken connection left
    unanswered), choosing which key each new send is for and putting it in the status.

    ``addresses()``: the nodes it may send to (one, or every node of a cluster). It starts
    on the one at ``first`` and stays there until its connection breaks or goes quiet (5 s
    without an answer: a frozen node); then it moves to the next one (in turn, from the
    last) and first resends there what was unanswered, with the same (producer, session
    id), which PostgreSQL finds stored if the first node committed it. A key's next send
    waits for that answer, so the order of a key's acks stays the order of its commits
    across nodes. ``acks_by_node``: the acks each address (its index) answered."""

    def __init__(self, index: int, addresses: Addresses, topic: str, keys: list[str], history: History, *,
                 rate: float, window: int = 24, burst: int = 5, seed: int = 0, first: int = 0):
        super().__init__(f"ordered-p{index}", addresses, topic, history, rate=rate, window=window, delay_every=0)
        self._next = first  # the address connected to now: Producer moves it on a broken connection
        self.acks_by_node: dict[int, int] = {}
        self.burst = burst
        self.rng = random.Random(seed)
        # key -> [(message id, acked at)], in the order of its acks
        self.acked: dict[str, list[tuple[int, float]]] = {}
        self._free = deque(self.rng.sample(keys, len(keys)))  # keys not in a burst now, in turn
        self._left: dict[str, int] = {}  # key in a burst -> its sends not made yet
        self._ready: deque[str] = deque()  # keys whose next send may go (the one before it answered)
        self._key_of: dict[int, str] = {}  # session id -> its key

    @property
    def node(self) -> int:
        """The index in ``addresses()`` of the node it sends to now (or connects to next)."""
        return self._next % len(self.addresses())

    def _make(self, made: int, due: int, todo: deque[tuple[int, bool]]) -> int:
        """A new send only for a key whose previous send was answered: the next of a
        burst, or the first of a new burst while fewer than ``window`` keys are in one."""
        while made < due:
            if self._ready:
                key = self._ready.popleft()
            elif len(self._left) < self.window and self._free:
                key = self._free.popleft()
                self._left[key] = self.rng.randint(1, self.burst)
            else:
                break
            self._left[key] -= 1
            made += 1
            self._key_of[made] = key
            todo.append((made, False))
        return made

    def _frame(self, sid: int, resend: bool) -> Frame:
        key = self._key_of[sid]
        return Frame(
            Command.UP_PRODUCER_RESEND if resend else Command.UP_PRODUCER_SEND,
            session_id=sid, topic=self.topic, producer=self.producer, timestamp_ms=int(time.time() * 1000),
            status=encode_properties(Properties(key)), body=self.key(sid) + b" " + key.encode(),
        )

    def _acked(self, reply: Frame, now: float) -> None:
        super()._acked(reply, now)
        self.acks_by_node[self.node] = self.acks_by_node.get(self.node, 0) + 1
        key = self._key_of[reply.session_id]
        self.acked.setdefault(key, []).append((reply.message_id, now))
        if self._left[key] > 0:
            self._ready.append(key)
        else:
            del self._left[key]
            self._free.append(key)


class KeyedConsumer(threading.Thread):
    """One consumer of one channel: records every push and when it let go of it (see the
    module). ``kill_if`` (a test of the pushes it holds) and ``pause()`` ask it to be killed
    at its first step at which what it holds passes the test / to pause at its first step
    at which it holds a copy; it does so itself, so that what it held at that moment is
    exact (``killed`` / ``paused`` are set then)."""

    def __init__(self, name: str, address: Address, topic: str, channel: str, history: History, *,
                 credit: int = 20, hold: float = 0.0, batch: bool = False, seed: int = 0, node: str = ""):
        super().__init__(daemon=True, name=f"chaos-{name}")
        self.consumer = name
        self.address = address
        self.node = node  # the node id behind ``address`` (its Attempts carry it; "" with one node)
        self.topic = topic
        self.channel = channel
        self.history = history
        self.credit = credit
        self.hold = hold  # acks after a random 0..hold seconds
        self.batch = batch  # reads every push waiting and acks in UP_CONSUMER_ACKS frames
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.subscribed = threading.Event()
        self.kill_if: Callable[[list[Attempt]], bool] | None = None
        self.killed = threading.Event()
        self.pause_wanted = threading.Event()
        # while set, it reads on (every push recorded when it arrives) but acknowledges
        # nothing: a slow consumer, not a stopped one
        self.holding = threading.Event()
        self.paused = threading.Event()
        self.resumed = threading.Event()
        self.held_at_kill = 0
        self.held_at_pause = 0
        self.attempts: list[Attempt] = []
        self.errors: dict[str, int] = {}
        self.failure: BaseException | None = None
        self._open: dict[int, Attempt] = {}  # message id -> its push held now
        self._acks_due: list[float] = []  # when the pushes held now are due to be acknowledged
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            self.failure = exc

    def pause(self) -> None:
        self.resumed.clear()
        self.pause_wanted.set()

    def resume(self) -> None:
        self.pause_wanted.clear()
        self.resumed.set()

    def held(self) -> int:
        """How many pushes it holds now."""
        with self._lock:
            return len(self._open)

    def holds_past(self, moment: float) -> bool:
        """Whether it holds a push it will not acknowledge before ``moment``."""
        return any(at > moment for at in self._acks_due)

    def records(self) -> list[Attempt]:
        with self._lock:
            return list(self.attempts)

    def _let_go(self, how: str) -> float:
        """Every push held ends now (``how``); returns the moment."""
        with self._lock:
            now = time.monotonic()
            for attempt in self._open.values():
                attempt.ended_at, attempt.how = now, how
            self._open.clear()
            self._acks_due = []
        return now

    def _run(self) -> None:
        while not self.stop.is_set() and not self.killed.is_set():
            try:
                client = BlockingClient(*self.address(), timeout=5)
                with client:
                    reply = client.subscribe(self.topic, self.channel, credit=self.credit)
                    if reply.command != Command.SUBSCRIBE_ACK:
                        raise ClientError(f"subscribe: {reply.command.name} {reply.status}")
                    self.subscribed.set()
                    self._consume(client)
            except (ClientError, OSError) as exc:
                self._let_go("connection lost")
                what = str(exc).split(":")[0]
                self.errors[what] = self.errors.get(what, 0) + 1
                self.stop.wait(0.2)  # the server is down or starting: a reconnect's pause
        self._let_go("killed" if self.killed.is_set() else "stopped")

    def _kill(self, client: BlockingClient) -> None:
        """Reset the connection with a RST, acking nothing: what it holds is out at the
        server until the server sees the reset (after the moment recorded)."""
        self.held_at_kill = len(self._open)
        self._let_go("consumer killed")
        sock = client._sock
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        except OSError:
            pass
        self.killed.set()

    def _consume(self, client: BlockingClient) -> None:
        held: list[tuple[float, Frame]] = []  # (ack due at, push)
        while not self.stop.is_set():
            if self._open and self.kill_if is not None and self.kill_if(list(self._open.values())):
                self._kill(client)
                return
            if self._open and self.pause_wanted.is_set():
                self.held_at_pause = len(self._open)
                self.paused.set()
                while not self.resumed.wait(0.2):  # nothing read, nothing acked
                    if self.stop.is_set():
                        return
            push = client.receive(timeout=0.02 if held else 0.2)
            while push is not None:
                now = time.monotonic()
                key = ReceivedMessage.properties_of(push.status).key
                with self._lock:
                    attempt = Attempt(self.channel, self.consumer, push.message_id, key, push.attempts, now,
                                      node=self.node)
                    self.attempts.append(attempt)
                    self._open[push.message_id] = attempt
                self.history.deliver(self.channel, identity(push.body), push.message_id, now)
                held.append((now + self.rng.uniform(0, self.hold), push))
                push = client.receive(timeout=0) if self.batch else None
            self._acks_due = [at for at, _ in held]
            if self.kill_if is not None or self.pause_wanted.is_set() or self.holding.is_set():
                continue  # killed, paused or holding what it holds now
            now = time.monotonic()
            due = [push for at, push in held if at <= now]
            if not due:
                continue
            held = [(at, push) for at, push in held if at > now]
            self._acks_due = [at for at, _ in held]
            with self._lock:  # let go before the ack is written: never later than the server
                at = time.monotonic()
                for push in due:
                    attempt = self._open.pop(push.message_id, None)
                    if attempt is not None:
                        attempt.ended_at, attempt.how = at, "ack"
            for push in due:
                self.history.consumer_ack(self.channel, push.message_id, at)
            if self.batch:
                client.ack_many(due)
            else:
                for push in due:
                    client.ack(push)


# -- the run's threads, and across nodes ------------------------------------------------
def keyed_producers(addresses: Addresses, topic: str, history: History, rng: random.Random, *, producers: int,
                    rate: float) -> list[KeyedProducer]:
    """``producers`` producers (not started) sharing the ``KEYS`` keys, each its own range;
    producer ``i`` starts on address ``i`` (in turn), so with several nodes each one stores
    some of every channel's keys."""
    keys = [key_name(n) for n in range(KEYS)]
    share = -(-KEYS // producers)
    nodes = len(addresses())
    return [KeyedProducer(i, addresses, topic, keys[i * share:(i + 1) * share], history, rate=rate,
                          seed=rng.randrange(2**32), first=i % nodes) for i in range(producers)]


def keyed_consumer(name: str, address: Address, topic: str, channel: str, instance: int, history: History,
                   rng: random.Random, *, node: str = "") -> KeyedConsumer:
    """The run's consumer ``instance`` of ``channel`` (not started): even instances ack at
    once, odd ones after a random hold of up to ``HOLD``; every third reads what waits and
    acks in batches."""
    return KeyedConsumer(name, address, topic, channel, history, hold=0.0 if instance % 2 == 0 else HOLD,
                         batch=instance % 3 == 2, seed=rng.randrange(2**32), node=node)


def consumers_on_every_node(addresses: Addresses, node_ids: list[str], topic: str, history: History,
                            rng: random.Random, *, channels: list[str] = CHANNELS,
                            instances: int = 2) -> list[KeyedConsumer]:
    """A consumer per (node, channel, instance), not started, each connected to its node
    only (``addresses()[n]`` is node ``node_ids[n]``; it connects again there after a
    break), named ``<node id>-<channel>-<instance>``: an ordered topic's copies come from
    whichever node delivers them, so every node has consumers of every channel, as NSQ's
    readers and MqClient with ``zk`` do. Every push is recorded on the test's one clock with
    its node, so an overlap across nodes is seen."""
    return [keyed_consumer(f"{node}-{channel}-{instance}", _nth(addresses, n), topic, channel, instance, history,
                           rng, node=node)
            for n, node in enumerate(node_ids) for channel in channels for instance in range(instances)]


def _nth(addresses: Addresses, n: int) -> Address:
    return lambda: addresses()[n]


def pushes_per_node(attempts: list[Attempt]) -> dict[str, dict[str, int]]:
    """channel -> node id -> pushes its consumers received there (the report's line: which
    node delivered an ordered topic, and how much after a handover)."""
    out: dict[str, dict[str, int]] = {}
    for a in attempts:
        per_node = out.setdefault(a.channel, {})
        per_node[a.node] = per_node.get(a.node, 0) + 1
    return out


def node_index(node_ids: list[str], node_id: str | None) -> int | None:
    """Where ``node_id`` is in ``node_ids`` (a ``ChaosCluster``'s nodes, in order); None
    for None or an id not among them."""
    return node_ids.index(node_id) if node_id in node_ids else None


def node_ids(cluster: ChaosCluster) -> list[str]:
    return [node.flags["node_id"] for node in cluster.nodes]


def orderer(cluster: ChaosCluster, topic: str) -> int | None:
    """The index of the node that holds the ordered ``topic``'s lock (``/dmq/orderer/<topic>``,
    ``PlacementLock.holder()``, read straight from ZooKeeper); None while no node holds it."""
    with cluster.zk_client() as client:
        holder = PlacementLock(client, paths.orderer(topic), "chaos-test").holder()
    return node_index(node_ids(cluster), holder)


def await_orderer(cluster: ChaosCluster, topic: str, timeout: float, *, other_than: int | None = None) -> int:
    """Wait until a node (not ``other_than``: the one just killed or frozen) holds the
    ordered ``topic``'s lock; its index. One ZooKeeper session for the whole wait."""
    ids = node_ids(cluster)
    found: list[int] = []
    with cluster.zk_client() as client:
        lock = PlacementLock(client, paths.orderer(topic), "chaos-test")

        def held() -> bool:
            index = node_index(ids, lock.holder())
            if index is None or index == other_than:
                return False
            found.append(index)
            return True

        _await(held, timeout, f"a node{' other than ' + ids[other_than] if other_than is not None else ''} "
                              f"holding {paths.orderer(topic)}")
    return found[-1]


def kill_node(cluster: ChaosCluster, index: int, run: OrderedRun) -> Heal:
    """kill -9 of node ``index`` (the orderer, or a node that stores), its moment taken
    before the signal into ``run.node_kills`` (the copies out through it end then); the
    heal starts it again (on its port, with the cluster's flags)."""
    node = cluster.nodes[index]
    run.node_kills.setdefault(node.flags["node_id"], []).append(time.monotonic())
    node.kill()
    return lambda: cluster.restart_node(index)


def pause_node(cluster: ChaosCluster, index: int) -> Heal:
    """SIGSTOP of node ``index``: its connections stay open and its consumers keep what it
    pushed them (it is no kill: their copies stay out, so a new orderer's push of their
    keys meanwhile is an overlap); held past its ZooKeeper session, it loses its locks. The
    heal is SIGCONT."""
    proc = cluster.nodes[index].proc
    assert proc is not None and proc.poll() is None, f"node {index} does not run"
    proc.send_signal(signal.SIGSTOP)
    return lambda: proc.send_signal(signal.SIGCONT)


# -- the count --------------------------------------------------------------------------
@dataclass
class OrderCount:
    channel: str
    sent: int = 0  # sends acknowledged to producers (with a key)
    keys: int = 0  # keys with a message pushed on the channel
    delivered: int = 0  # distinct message ids pushed
    pushes: int = 0
    redelivered: int = 0  # pushes of an id already pushed
    lost: int = 0
    waited: int = 0  # held back behind their key (see the module)
    # redeliveries pushed while a later message of their key was already stored: the copies
    # that had to keep their place at the head of their key
    redelivered_ahead: int = 0
    # what broke a rule, a line each (PROBLEMS), and the keys concerned, for their histories
    lost_examples: list[str] = field(default_factory=list)
    order_violations: list[str] = field(default_factory=list)
    overlaps: list[str] = field(default_factory=list)
    same_id_overlaps: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    bad_keys: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        return [line for kind in PROBLEMS for line in getattr(self, kind)]

    def ok(self) -> bool:
        return not self.lost and not self.problems()


PROBLEMS = ("lost_examples", "order_violations", "overlaps", "same_id_overlaps", "passed")


def _ends(tries: list[Attempt], kills: list[float], node_kills: NodeKills) -> tuple[list[float], list[int]]:
    """When each push (sorted by push time) stopped being out, as the rule sees it: its
    end as recorded, capped by a kill of the server (``kills``) or of the node it came
    through (``node_kills``) after its push and by the next push of the same id (the
    server took it back); and the indices of pushes whose next push of the same id came
    while it was still held (a same-id overlap)."""
    ends: list[float] = []
    early: list[int] = []
    for i, a in enumerate(tries):
        end = a.ended_at if a.ended_at is not None else float("inf")
        end = min([end] + [k for k in (*kills, *node_kills.get(a.node, ())) if k > a.pushed_at])
        following = next((b for b in tries[i + 1:] if b.message_id == a.message_id), None)
        if following is not None and following.pushed_at < end:
            early.append(i)
            end = following.pushed_at
        ends.append(end)
    return ends, early


def _cluster_of(message_id: int) -> int:
    """The id slot of the PostgreSQL cluster that drew ``message_id`` (``db.clusters``)."""
    return message_id >> SLOT_SHIFT


def _rising_per_cluster(ids: list[int]) -> bool:
    """Whether the ids of each PostgreSQL cluster among ``ids`` come in rising order. Ids
    order a key's commits within a cluster only: an ordered topic moved to a cluster of a
    lower slot (``dmq topic move``) stores its later messages under lower ids."""
    last: dict[int, int] = {}
    for mid in ids:
        cluster = _cluster_of(mid)
        if mid <= last.get(cluster, -1):
            return False
        last[cluster] = mid
    return True


def _commit_order(expected: list[int]) -> Callable[[int, int], bool]:
    """``before(x, y)``: whether message ``x`` of a key was committed before ``y``: by the
    order its producer was acknowledged in (``expected``) when both are known, else by id
    (a message stored whose answer was lost; ids order commits within one cluster)."""
    rank = {mid: i for i, mid in enumerate(expected)}

    def before(x: int, y: int) -> bool:
        if x in rank and y in rank:
            return rank[x] < rank[y]
        return x < y

    return before


def _check_key(c: OrderCount, channel: str, key: str, sent: list[tuple[int, float]], pushes: list[Attempt],
               kills: list[float], t: Callable[[float], str], node_kills: NodeKills) -> dict[str, list[str]]:
    """One key on one channel: adds its counts to ``c``; returns what it broke."""
    expected = [mid for mid, _ in sent]
    problems: dict[str, list[str]] = {kind: [] for kind in PROBLEMS}
    c.sent += len(expected)
    if not _rising_per_cluster(expected):
        problems["order_violations"].append(f"{key}: its producer's acks {expected} are not in id order")
    before = _commit_order(expected)
    tries = sorted(pushes, key=lambda a: (a.pushed_at, a.message_id))
    first: dict[int, float] = {}
    for a in tries:
        first.setdefault(a.message_id, a.pushed_at)
    c.keys += 1 if tries else 0
    c.delivered += len(first)
    c.pushes += len(tries)
    c.redelivered += len(tries) - len(first)
    missing = [mid for mid in expected if mid not in first]
    if missing:
        c.lost += len(missing)
        problems["lost_examples"].append(f"{channel} {key}: ids {missing} acknowledged to its producer, never pushed")
    order = list(first)  # ids in the order first pushed
    known = set(expected)
    if not _rising_per_cluster(order) or [m for m in order if m in known] != [m for m in expected if m in first]:
        problems["order_violations"].append(f"{channel} {key}: first pushed {order}, acknowledged to its "
                                            f"producer in the order {expected}")
    ends, early = _ends(tries, kills, node_kills)
    for i in early:
        a = tries[i]
        problems["same_id_overlaps"].append(f"{channel} {key}: id {a.message_id} pushed again at {t(ends[i])} "
                                            f"while {a.consumer} held its push of {t(a.pushed_at)}")
    for i, a in enumerate(tries):
        for b in tries[i + 1:]:
            if b.pushed_at >= ends[i]:
                break  # sorted by push time: the rest come later still
            if b.message_id != a.message_id:
                problems["overlaps"].append(
                    f"{channel} {key}: id {b.message_id} pushed to {b.consumer} at {t(b.pushed_at)} while id "
                    f"{a.message_id} was out to {a.consumer} ({t(a.pushed_at)} .. {t(ends[i])}, "
                    f"{a.how or 'never let go'})")
    # a copy let go unacknowledged (its consumer killed or cut off, the server killed) comes
    # back at the head of its key: the key's next push is that copy again, or an earlier
    # message of the key coming back too (its ack received, not yet durable, when the server
    # died: at-least-once, and id order puts it first). An ack recorded after a kill of the
    # server is left out: it may have reached the server before it died
    for i, a in enumerate(tries):
        if a.how == "ack" or a.how == "stopped" or i in early:
            continue
        for j in range(i + 1, len(tries)):
            b = tries[j]
            if b.pushed_at < ends[i] or (before(b.message_id, a.message_id)
                                         and any(p.message_id == b.message_id for p in tries[:j])):
                continue
            if b.message_id != a.message_id:
                problems["passed"].append(
                    f"{channel} {key}: id {b.message_id} pushed to {b.consumer} at {t(b.pushed_at)} before id "
                    f"{a.message_id}, let go unacknowledged by {a.consumer} at {t(ends[i])} ({a.how}), went "
                    f"out again")
            break
    # held back by the rule: acknowledged to its producer while the one before it was out here
    last_end = {a.message_id: ends[i] for i, a in enumerate(tries)}
    acked_at = dict(sent)
    c.waited += sum(1 for before, after in zip(expected, expected[1:])
                    if before in last_end and acked_at[after] < last_end[before])
    seen: set[int] = set()
    for a in tries:
        if a.message_id in seen and any(before(a.message_id, mid) and at < a.pushed_at for mid, at in sent):
            c.redelivered_ahead += 1
        seen.add(a.message_id)
    return problems


def check_order(sends: dict[str, list[tuple[int, float]]], attempts: list[Attempt], kills: list[float],
                channels: list[str], origin: float = 0.0, node_kills: NodeKills | None = None
                ) -> dict[str, OrderCount]:
    """Per channel, over every key: the counts of the module's docstring.

    ``sends``: key -> [(message id, acked at)] in the order its producer was acked;
    ``attempts``: every push of every consumer; ``kills``: when the server was killed
    (taken before the signal: every node of it, with one node); ``node_kills``: node id ->
    when that node alone was killed, which ends only the pushes that came through it (a
    cluster's other nodes, and their consumers' copies, live on). Plain values in, no IO:
    the unit tier tests it."""
    node_kills = node_kills or {}
    out = {}
    by_pair: dict[tuple[str, str], list[Attempt]] = {}
    for a in attempts:
        if a.key is not None:
            by_pair.setdefault((a.channel, a.key), []).append(a)

    def t(x: float) -> str:
        return f"{x - origin:+.3f} s"

    for channel in channels:
        c = out[channel] = OrderCount(channel)
        for key in sorted(set(sends) | {k for ch, k in by_pair if ch == channel}):
            problems = _check_key(c, channel, key, sends.get(key, []), by_pair.get((channel, key), []), kills, t,
                                  node_kills)
            for kind, lines in problems.items():
                getattr(c, kind).extend(lines)
            if any(problems.values()):
                c.bad_keys.append(key)
    return out


def key_history(sends: dict[str, list[tuple[int, float]]], attempts: list[Attempt], kills: list[float],
                channel: str, key: str, origin: float = 0.0, node_kills: NodeKills | None = None) -> list[str]:
    """What happened to one key on one channel, in time order (seconds from ``origin``):
    each ack to its producer, each push (consumer, id, attempts) and its end, each kill
    of the server or of a node. An order violation's or overlap's story starts here."""
    events: list[tuple[float, str]] = [(at, f"id {mid} acknowledged to its producer") for mid, at in sends.get(key, [])]
    events += [(k, "the dmq server killed (-9)") for k in kills]
    events += [(k, f"node {node} killed (-9)") for node, at in (node_kills or {}).items() for k in at]
    for a in attempts:
        if a.channel == channel and a.key == key:
            events.append((a.pushed_at, f"id {a.message_id} pushed to {a.consumer} (attempts {a.attempts})"))
            if a.ended_at is not None:
                events.append((a.ended_at, f"id {a.message_id} let go by {a.consumer}: {a.how}"))
    return [f"{when - origin:+9.3f} s  {what}" for when, what in sorted(events)]


# -- one run ----------------------------------------------------------------------------
@dataclass(frozen=True)
class OrderedTiming:
    load: float = 20.0  # seconds of sends
    kill_consumer_at: float = 3.0
    pause_at: float = 7.0
    pause_for: float = 3.0
    kill_server_at: float = 12.0
    drain: float = 60.0
    linger: float = 1.5
    rate: float = 80.0  # sends per second per producer
    producers: int = 3


@dataclass
class OrderedRun:
    topic: str
    origin: float
    sends: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    node_kills: dict[str, list[float]] = field(default_factory=dict)  # a cluster's: ``kill_node``
    faults: list[str] = field(default_factory=list)
    notes: dict[str, object] = field(default_factory=dict)
    drained: bool = False
    failures: list[str] = field(default_factory=list)
    history: History | None = None


def followed(producers: list[KeyedProducer]) -> Callable[[list[Attempt]], bool]:
    """A consumer's ``kill_if``: it holds a copy whose key has a later message stored
    (acknowledged to its producer), which must not go out before that copy comes back."""
    def test(held: list[Attempt]) -> bool:
        return any(mid > a.message_id for a in held if a.key is not None
                   for p in producers for mid, _ in list(p.acked.get(a.key, ())))
    return test


def pause_consumers(paused: list[KeyedConsumer], pause_for: float, run: OrderedRun, since: Callable[[float], str]
                    ) -> None:
    """Pause ``paused``, each once it holds a copy, for ``pause_for`` seconds, then resume
    them; recorded in ``run`` (``since``: a moment as the report writes it)."""
    for c in paused:
        c.pause()
    for c in paused:
        _await(c.paused.is_set, 15, f"{c.consumer} holding a copy, then paused")
    paused_at = time.monotonic()
    time.sleep(pause_for)  # the fault held
    for c in paused:
        c.resume()
    run.faults.append(f"{', '.join(c.consumer for c in paused)} paused at {since(paused_at)} holding "
                      f"{[c.held_at_pause for c in paused]} copies, resumed at {since(time.monotonic())}")
    run.notes["held_at_pause"] = sum(c.held_at_pause for c in paused)


def broken_rules(orders: dict[str, OrderCount], counts: list[ChannelCount], sent: int) -> dict[str, int]:
    """Per channel and rule, how often a run broke it (only the rules broken): every
    acknowledged send counted, none lost, none out of order, no overlap of a key, no copy
    pushed again while held, no redelivery passed by its key, none delivered again after
    a durable ack, none unknown."""
    out: dict[str, int] = {}
    for o in orders.values():
        found = {"counted": int(o.sent != sent), "lost": o.lost, "order violations": len(o.order_violations),
                 "overlaps": len(o.overlaps), "same-id overlaps": len(o.same_id_overlaps),
                 "redeliveries passed": len(o.passed)}
        out.update({f"{o.channel} {rule}": n for rule, n in found.items() if n})
    for c in counts:
        found = {"lost (checker)": c.lost, "duplicated": c.duplicated, "unexpected": c.unexpected}
        out.update({f"{c.channel} {rule}": n for rule, n in found.items() if n})
    return out


def _await(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``condition`` (records of the run) until it holds; the seconds it took; a
    RuntimeError naming ``what`` past ``timeout``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"not within {timeout:g} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - started


def run(server, dsn: str, topic: str, timing: OrderedTiming = OrderedTiming(), *, seed: int = 0) -> OrderedRun:
    """One run on ``server`` (a ``ServerProcess`` serving the ordered ``topic`` with
    ``CHANNELS``): load, the faults of the module, drain, and the records for ``count``."""
    rng = random.Random(seed)
    history = History(CHANNELS)
    origin = time.monotonic()
    out = OrderedRun(topic, origin, history=history)

    def address() -> tuple[str, int]:
        return ("127.0.0.1", server.tcp_port)

    def since(at: float) -> str:
        return f"+{at - origin:.2f} s"

    producers = keyed_producers(lambda: [address()], topic, history, rng, producers=timing.producers,
                                rate=timing.rate)
    consumers: list[KeyedConsumer] = []

    def consumer(channel: str, instance: int) -> KeyedConsumer:
        c = keyed_consumer(f"{channel}-{instance}", address, topic, channel, instance, history, rng)
        consumers.append(c)
        c.start()
        return c

    billing = [consumer("billing", i) for i in range(3)]
    audit = [consumer("audit", i) for i in range(2)]
    confirmer = Confirmer(dsn, topic, history)
    try:
        for c in consumers:
            _await(c.subscribed.is_set, 30, f"{c.consumer} subscribed: {c.errors}")
        confirmer.start()
        for p in producers:
            p.start()

        def at(offset: float) -> None:  # the load's schedule: pacing, not a wait for anything
            time.sleep(max(0.0, origin + offset - time.monotonic()))

        # a billing consumer killed (a holding one: instance 1) holding a copy whose key has
        # a later message stored: that copy must come back before it
        at(timing.kill_consumer_at)
        victim = billing[1]
        victim.kill_if = followed(producers)
        _await(victim.killed.is_set, 10, f"{victim.consumer} holding a copy with a later message of its key stored, "
                                         f"then killed")
        killed_at = time.monotonic()
        out.faults.append(f"{victim.consumer} killed at {since(killed_at)} holding {victim.held_at_kill} copies; "
                          f"billing-3 takes its place")
        out.notes["held_at_consumer_kill"] = victim.held_at_kill
        consumer("billing", 3)

        # a consumer of each channel paused holding copies
        at(timing.pause_at)
        pause_consumers([billing[2], audit[1]], timing.pause_for, out, since)

        # the dmq server killed -9 and started again, while copies are out on each channel
        at(timing.kill_server_at)
        _await(lambda: all(any(c.holds_past(time.monotonic() + 0.04) for c in consumers if c.channel == ch)
                           for ch in CHANNELS), 10, "a consumer of each channel holding a copy 40 ms more")
        acks_before = sum(len(p.ack_times) for p in producers)
        kill = time.monotonic()
        out.kills.append(kill)  # taken before the signal: every copy out then is out no longer
        server.kill()
        server.start(timeout=60)
        restarted = time.monotonic()
        took = _await(lambda: any(t > restarted for p in producers for t in p.ack_times), 30,
                      "a send acknowledged after the server's restart")
        out.faults.append(f"the dmq server killed -9 at {since(kill)} ({acks_before} sends acknowledged "
                          f"before), serving again at {since(restarted)}; a send acknowledged "
                          f"{took:.2f} s after")

        at(timing.load)
        for p in producers:
            p.stopping.set()
        for p in producers:
            p.join(30)
        for p in producers:
            p.halt.set()
        try:
            _await(lambda: not any(history.missing().values()), timing.drain,
                   "every acknowledged send pushed on both channels")
            out.drained = True
        except RuntimeError as exc:
            out.failures.append(str(exc))
        time.sleep(timing.linger)  # consumers stay on: a wrong push has time to show
    finally:
        for p in producers:
            p.stopping.set()
            p.halt.set()
        for c in consumers:
            c.resume()
            c.stop.set()
        for c in consumers:
            c.join(10)
        confirmer.stop.set()
        confirmer.join(10)
        conn = confirmer.once()  # a last look, after the consumers stopped
        if conn is not None:
            conn.close()
    for p in producers:
        out.sends.update(p.acked)
    out.attempts = [a for c in consumers for a in c.records()]
    for kill in out.kills:  # copies out when the server died: they come back from PostgreSQL
        out.notes["out_at_server_kill"] = {ch: sum(1 for a in out.attempts if a.channel == ch and a.pushed_at < kill
                                                    and (a.ended_at is None or a.ended_at > kill)) for ch in CHANNELS}
    out.failures += [f"{t.name}: {t.failure!r}" for t in (*producers, *consumers) if t.failure]
    out.notes["producer_errors"] = {p.name: p.errors for p in producers if p.errors}
    out.notes["resends"] = sum(p.resends for p in producers)
    out.notes["consumer_errors"] = {c.consumer: c.errors for c in consumers if c.errors}
    return out


def count(run: OrderedRun) -> tuple[dict[str, OrderCount], list[ChannelCount]]:
    """The per-key counts (``check_order``) and the chaos checker's per-channel ones."""
    assert run.history is not None
    return (check_order(run.sends, run.attempts, run.kills, CHANNELS, run.origin, run.node_kills),
            check(run.history))


def ok(run: OrderedRun, orders: dict[str, OrderCount], counts: list[ChannelCount]) -> bool:
    return (run.drained and not run.failures and all(c.ok() for c in orders.values())
            and all(c.ok() for c in counts))


def format_report(run: OrderedRun, orders: dict[str, OrderCount], counts: list[ChannelCount]) -> str:
    sent = sum(len(v) for v in run.sends.values())
    lines = [f"ordered: {'OK' if ok(run, orders, counts) else 'FAILED'}  (topic {run.topic}, {KEYS} keys, "
             f"{sent} sends acknowledged, {len(run.sends)} keys sent, resends {run.notes.get('resends')})"]
    for c in counts:
        o = orders[c.channel]
        lines.append(
            f"  {c.channel}: sent {o.sent}, delivered {o.delivered} ({o.pushes} pushes, {o.keys} keys), "
            f"redelivered {o.redelivered} ({o.redelivered_ahead} with a later message of their key waiting), "
            f"lost {o.lost}, order violations {len(o.order_violations)}, "
            f"overlaps {len(o.overlaps)}, same-id overlaps {len(o.same_id_overlaps)}, "
            f"redeliveries passed by their key {len(o.passed)}, "
            f"held back behind their key {o.waited}; duplicated after a durable ack {c.duplicated}, "
            f"unexpected {c.unexpected}")
        for what in PROBLEMS:
            found = getattr(o, what)
            lines += [f"    {example}" for example in found[:5]]
            if len(found) > 5:
                lines.append(f"    ... {len(found) - 5} more {what.replace('_', ' ')}")
    if any(a.node for a in run.attempts):
        lines.append(f"  pushes per node: {pushes_per_node(run.attempts)}")
    lines += [f"  fault: {f}" for f in run.faults]
    lines.append(f"  drained {run.drained}; notes: {run.notes}")
    if run.failures:
        lines.append(f"  failures: {run.failures}")
    return "\n".join(lines)
