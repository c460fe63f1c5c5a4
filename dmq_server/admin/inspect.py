"""Looking inside a running node without changing what it delivers: one message's trace,
a channel's waiting copies (peek), a channel's consumers, the delay table by due time,
the nodes of the cluster, the audit log; and the delay view's two actions (deliver now,
cancel), audited like every destructive admin operation.

The stored facts come from ``db.trace_steps`` (the same the ``dmq trace`` CLI prints); this
module adds what only the running node knows: which of the message's copies it holds
right now (in flight to whom, since and until when; deferred; waiting in memory). The
JSON admin API (``http.admin_inspect``) and through it the web console call these.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from twisted.internet.defer import Deferred, inlineCallbacks, succeed

from dmq_server.admin.operations import AdminOps
from dmq_server.broker.interfaces import BrokerPort
from dmq_server.core.clock import Clock
from dmq_server.core.errors import Invalid, NotFound
from dmq_server.core.gauges import GaugeSnapshot
from dmq_server.db.admin_steps import list_admin_log_steps
from dmq_server.db.delays import (
    cancel_delayed_steps, deliver_delayed_now_steps, due_histogram_steps, list_delayed_steps,
)
from dmq_server.db.trace_steps import find_message_steps, peek_channel_steps, read_trace_steps
from registry.model import NodeInfo

__all__ = ["Inspector", "live_copies", "parse_ids", "describe_event", "registry_read",
           "RETURN_TEXT", "REGISTRY_WAIT"]

MAX_PEEK = 500
MAX_HISTOGRAM_BUCKETS = 200

#: the longest a view of the channels (``/stats``, the console's overview) waits for the
#: registry read it asks for; past it, the view answers from what the node knows
REGISTRY_WAIT = 2.0


def registry_read(broker: BrokerPort, clock: Clock, wait: float = REGISTRY_WAIT) -> Deferred:
    """Fires with None once a read of the registry begun after this call has been applied
    (or failed), or after ``wait`` seconds, whichever is first.

    Why: ``dmq channel add`` registers a channel in the registry, and a node reads the
    registry every ``--registry-refresh`` (or on a ZooKeeper watch), so a view that answered
    from memory left out a channel registered a moment ago, where nsqd lists a channel at
    once. A view that reads first lists it, opened, with its depth as last counted (until
    the depth count's next pass, what waits for it in memory: 0 at first). A failed read
    leaves the node's view as it was (the broker's health says why); a slow one does not
    hold the view past ``wait``."""
    if broker is None:
        return succeed(None)
    done: Deferred = Deferred()

    def end(_: object = None) -> None:
        if not done.called:
            done.callback(None)

    timer = clock.callLater(wait, end)

    def read(_: object) -> None:
        if timer.active():
            timer.cancel()
        end()

    broker.refresh_registry(fresh=True).addBoth(read)
    return done


def _ms(seconds: object) -> int | None:
    """A channel's time (``locate``'s, in seconds; None or 0: none) in ms."""
    return int(seconds * 1000) if isinstance(seconds, (int, float)) and seconds else None


def live_copies(broker: BrokerPort, topic: str, message_id: int) -> dict[str, dict[str, Any]]:
    """This node's in-memory state of the message's copies, by channel name."""
    out = {}
    for (t, name), channel in list(broker.channels.items()):
        if t != topic:
            continue
        where = channel.locate(message_id)
        if where is not None:
            where["delivered_ms"] = _ms(where.pop("delivered_at", None))
            where["deadline_ms"] = _ms(where.pop("deadline", None))
            out[name] = where
    return out


class ClusterView(Protocol):
    """What the node list reads of a cluster node (``cluster.node.ClusterNode``)."""

    @property
    def zk_state(self) -> str: ...
    def live_nodes(self) -> list[NodeInfo]: ...


class StoredFigures(Protocol):
    """The figures a timer read from PostgreSQL (``http.sampling.StoredGauges``)."""

    def snapshot(self) -> GaugeSnapshot: ...


class ChannelHistory(Protocol):
    """Each channel's recent samples (``http.sampling.History``), as the console's JSON."""

    def export(self, topic: str | None = None) -> dict[str, object]: ...


class Inspector:
    """The read-mostly views; ``ops`` is the node's ``AdminOps`` (its database worker,
    broker, delay scheduler, clock and audit log)."""

    def __init__(self, ops: AdminOps, *, cluster: ClusterView | None = None,
                 info: Callable[[], dict[str, object]] | None = None, history: ChannelHistory | None = None,
                 channels: Callable[[], Iterable[tuple[str, str, str, Mapping[str, object]]]] | None = None,
                 gauges: StoredFigures | None = None):
        self.ops = ops
        self.cluster = cluster
        self.info = info  # () -> this node's /info
        self._history = history
        self._channels = channels  # () -> (store, topic, channel, stats) of both stores
        self._gauges = gauges

    # -- one message ---------------------------------------------------------------
    def trace(self, message_id: int) -> Deferred:
        """The message's stored facts and this node's live copies; ``NotFound`` if nothing
        stored names the id."""
        broker = self.ops.broker

        def add_live(trace: dict) -> dict:
            if not trace["found"] and trace["delayed"] is None:
                raise NotFound(f"no message {message_id}: not stored, logged or delayed (swept after "
                               "--message-retention unless the archive keeps it)")
            trace["live"] = live_copies(broker, trace["topic"], message_id) if trace["topic"] else {}
            trace["node_id"] = self.ops.node_id
            return trace

        return self.ops.db_for_id(message_id).run_steps(read_trace_steps, message_id).addCallback(add_live)

    def find(self, producer: str, session_id: int) -> Deferred:
        def found(message_id: int | None) -> dict:
            if message_id is None:
                raise NotFound(f"no message stored for producer {producer!r} and session id {session_id}")
            return {"message_id": message_id}

        return self.ops.db.run_steps(find_message_steps, producer, session_id).addCallback(found)

    # -- every channel ---------------------------------------------------------------
    def overview(self) -> Deferred:
        """Every topic of both stores with its settings and its channels' figures on this
        node (a reliable channel's depth counts what PostgreSQL holds for every node), once
        the registry has been read (``registry_read``). Each channel has ``oldest_age``: how
        long its oldest message has waited, in seconds (None: nothing waits, or not read
        yet). A reliable topic has ``retained``: the messages and body bytes PostgreSQL keeps
        of it (``retained_messages``, ``retained_bytes``, ``retained_as_of``: see
        ``db.retained``). A fast topic is listed without channels too, as nsqadmin does, with
        its ``depth``: nsqd keeps what is published to it for its first channel."""
        return registry_read(self.ops.broker, self.ops.clock).addCallback(lambda _: self._overview())

    def _overview(self) -> dict[str, Any]:
        topics: dict[tuple[str, str], dict[str, Any]] = {}
        for row in self.ops.topics():
            settings = {k: row[k] for k in ("msg_timeout_ms", "rate_limit", "ttl_ms", "max_attempts", "ordered")}
            topics[(row["store"], row["name"])] = {"topic": row["name"], "store": row["store"],
                                                   "cluster": row["cluster"], "draining": row["draining"],
                                                   "settings": settings, "channels": []}
        broker = self.ops.broker
        for (store, name), entry in topics.items():
            if store == "reliable":  # what PostgreSQL keeps of it, over every cluster (db.retained)
                entry["retained"] = broker.retained(name)
        fast_topics = {figures.name: figures for figures in broker.snapshot().fast_topics}
        stored = self._stored()
        ages = stored["oldest_unacked"] if stored is not None else {}
        now = self.ops.clock.seconds()
        for store, topic, name, stats in self._channels() if self._channels is not None else ():
            entry = topics.setdefault((store, topic), {"topic": topic, "store": store, "settings": {},
                                                       "channels": []})
            if store == "fast":
                figures = fast_topics.get(topic)
                since = figures.waiting_since.get(name) if figures is not None else None
                age = None if since is None else max(0.0, now - since / 1e9)
            else:
                age = ages.get(f"{topic}/{name}")
            entry["channels"].append(dict(stats, channel_name=name, oldest_age=age))
        for name, fast_topic in fast_topics.items():
            entry = topics.setdefault(("fast", name), {"topic": name, "store": "fast", "settings": {},
                                                      "channels": []})
            entry["depth"] = fast_topic.depth  # kept for the first channel while there is none
        return {"node_id": self.ops.node_id, "healthy": broker.healthy, "health_detail": broker.health_detail,
                "topics": [topics[k] for k in sorted(topics, key=lambda k: (k[1], k[0]))],
                "stored": stored}

    def _stored(self) -> dict[str, Any] | None:
        """The last figures the timer read from PostgreSQL, shaped for the console."""
        snap = self._gauges.snapshot() if self._gauges is not None else None
        if snap is None or not snap["values"]:
            return None
        values = snap["values"]
        now_ms = snap["now"] * 1000
        return {
            "age": snap["age"],
            "dead_letters": {reason: {"total": total, "unreplayed": total - replayed}
                             for reason, (total, replayed) in values["dead_letters"].items()},
            "delay_pending": {topic: count for topic, (count, _) in values["delay_pending"].items()},
            "oldest_unacked": {f"{t}/{c}": (None if ms is None else max(0.0, (now_ms - ms) / 1000))
                               for (t, c), ms in values["oldest_unacked_ms"].items()},
        }

    # -- a channel -----------------------------------------------------------------
    def _channel(self, topic: str, name: str) -> Any:
        row = self.ops.broker.topics.get(topic)
        if row is None:
            raise NotFound(f"no reliable topic {topic!r}")
        if name not in row.channels:
            raise NotFound(f"no channel {name!r} on topic {topic!r}")
        return self.ops.broker.channels.get((topic, name))

    def channel(self, topic: str, name: str) -> dict[str, Any]:
        """Its figures on this node and its consumers."""
        channel = self._channel(topic, name)
        if channel is None:  # registered, not yet used on this node
            return {"topic": topic, "channel": name, "stats": {"channel_name": name}, "consumers": []}
        return {"topic": topic, "channel": name, "stats": channel.stats(), "consumers": channel.consumer_stats()}

    def peek(self, topic: str, name: str, after: int = 0, limit: int = 20) -> Deferred:
        """The channel's stored, unacknowledged copies after ``after`` (oldest first), each
        with this node's live state; nothing is delivered, locked or changed."""
        channel = self._channel(topic, name)
        if not 1 <= limit <= MAX_PEEK:
            raise Invalid(f"limit: expected 1..{MAX_PEEK}, got {limit}")

        def add_live(rows: list[dict]) -> dict:
            for row in rows:
                where = channel.locate(row["message_id"]) if channel is not None else None
                if where is not None:
                    where["delivered_ms"] = _ms(where.pop("delivered_at", None))
                    where["deadline_ms"] = _ms(where.pop("deadline", None))
                row["live"] = where
            return {"topic": topic, "channel": name, "messages": rows,
                    "next_after": rows[-1]["message_id"] if len(rows) == limit else None}

        return self.ops.db_for_topic(topic).run_steps(peek_channel_steps, topic, name, after, limit).addCallback(add_live)

    # -- the delay table ------------------------------------------------------------
    def delayed(self, topic: str | None, after_due: int, after_id: int, limit: int) -> Deferred:
        def page(rows: list[dict]) -> dict:
            last = rows[-1] if len(rows) == limit else None
            return {"delayed": rows, "next": None if last is None else {"after_due": last["due_ms"],
                                                                         "after_id": last["delay_id"]}}

        return self.ops.db_for_topic(topic).run_steps(list_delayed_steps, topic, after_due, after_id, limit).addCallback(page)

    def due_histogram(self, topic: str | None, width_ms: int) -> Deferred:
        """Waiting entries by due time, in buckets of ``width_ms`` from now (the last bucket
        gathers everything later)."""
        if width_ms < 1000:
            raise Invalid("width: at least 1s")
        now_ms = int(self.ops.clock.seconds() * 1000)

        def shape(rows: list[tuple[int, int]]) -> dict:
            counts: dict[int, int] = {}
            for bucket, count in rows:
                key = min(bucket, MAX_HISTOGRAM_BUCKETS - 1)
                counts[key] = counts.get(key, 0) + count
            return {"now_ms": now_ms, "width_ms": width_ms,
                    "buckets": [{"from_ms": now_ms + b * width_ms, "count": n} for b, n in sorted(counts.items())],
                    "open_ended": MAX_HISTOGRAM_BUCKETS - 1 in counts}

        return self.ops.db_for_topic(topic).run_steps(due_histogram_steps, topic, now_ms, width_ms).addCallback(shape)

    @inlineCallbacks
    def delay_action(self, action: str, ids: Sequence[int], surface: str, actor: str) -> Any:
        """``deliver-now`` (due at once: the delay workers move them now) or ``cancel``
        (deleted); audited. Fires with the ids that changed."""
        if not ids:
            raise Invalid("give the delay entries' ids (ids=1,2,3)")
        if action not in ("deliver-now", "cancel"):
            raise NotFound(f"no delay action {action!r} (deliver-now, cancel)")
        changed: list = []
        by_db: dict[Any, list[int]] = {}
        for delay_id in ids:  # a delay id names its cluster
            by_db.setdefault(self.ops.db_for_id(delay_id), []).append(delay_id)
        for db, some in by_db.items():
            if action == "cancel":
                changed += yield db.run_steps(cancel_delayed_steps, some)
                continue
            changed += yield db.run_steps(deliver_delayed_now_steps, some, int(self.ops.clock.seconds() * 1000))
        if action == "deliver-now" and changed:
            for _, delays in self.ops.clusters.values():
                if delays is not None:
                    delays.move_now()
        yield self.ops.audit(surface, actor, f"delay.{action}", "ids=" + ",".join(map(str, ids)), len(changed))
        return changed

    # -- the cluster, the audit log -------------------------------------------------------
    def nodes(self) -> dict[str, Any]:
        """The live nodes from the registry (ZooKeeper with ``--zk``, else this node)."""
        me = self.info() if self.info is not None else {"node_id": self.ops.node_id}
        broker = self.ops.broker
        health = "OK" if broker.healthy else f"storage failing: {broker.health_detail}"
        if self.cluster is None:
            return {"cluster": False, "nodes": [dict(me, state="live", this=True, health=health)]}
        now = self.ops.clock.seconds()
        out = []
        for node in self.cluster.live_nodes():
            row = {"node_id": node.node_id, "tcp_address": node.tcp_address, "http_address": node.http_address,
                   "version": node.version, "start_time": node.start_time,
                   "heartbeat_age": round(now - node.last_heartbeat, 1) if node.last_heartbeat else None,
                   "state": "live", "this": node.node_id == self.ops.node_id}
            if row["this"]:
                row["health"] = health
            out.append(row)
        return {"cluster": True, "zk_state": self.cluster.zk_state, "nodes": out}

    def audit_log(self, before: int | None, limit: int) -> Deferred:
        return self.ops.db.run_steps(list_admin_log_steps, before or 2**62, limit)

    def history(self, topic: str | None) -> dict[str, object]:
        if self._history is None:
            raise NotFound("no history on this node")
        return self._history.export(topic)


def parse_ids(text: str | None) -> list[int]:
    """``1,2,3`` -> ids; ``Invalid`` names what is wrong."""
    parts = [p for p in (text or "").replace(" ", ",").split(",") if p]
    if not parts or not all(p.isdigit() for p in parts):
        raise Invalid(f"ids: give positive integers separated by commas, got {text!r}")
    if len(parts) > 10000:
        raise Invalid("ids: at most 10000 at once")
    return [int(p) for p in parts]



#: why a delivery came back, as the trace says it
RETURN_TEXT = {
    "timeout": "not acknowledged in time",
    "consumer_gone": "the consumer went away",
    "requeued": "the consumer gave it back (REQ)",
}


def describe_event(e: dict[str, Any]) -> str:
    """One trace event as a sentence (the CLI's; the console has the same in JavaScript)."""
    kind = e["event"]
    if kind == "stored":
        return f"stored by {e.get('node_id') or '?'} (producer {e.get('producer', '?')}, session {e.get('session_id', '?')})"
    if kind == "delivered":
        return f"delivered to {e['channel']} -> {e.get('consumer') or '?'} (attempt {e['attempt']})"
    if kind == "returned":
        return (f"came back from {e.get('consumer') or '?'} on {e['channel']}: "
                f"{RETURN_TEXT.get(e['reason'], e['reason'])}")
    if kind == "acked":
        return f"acknowledged on {e['channel']} by {e.get('consumer') or '?'} (after {e['attempt']} deliveries)"
    if kind == "dead_letter":
        return f"dead letter {e['dead_letter_id']} on {e.get('channel') or 'its topic'}: {e['reason']} ({e['detail']})"
    if kind == "replayed":
        return f"dead letter {e['dead_letter_id']} replayed as message {e.get('replay_message_id') or '(being stored)'}"
    return kind
