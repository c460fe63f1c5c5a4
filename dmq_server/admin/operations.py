"""The admin operations every admin surface offers, written once.

The ``dmq`` CLI (straight to PostgreSQL), the JSON admin API on the HTTP port
(``dmq_server.http.admin_api``) and the line-based admin console (``admin.line_console``) all call
these: stats; topics and channels; connected clients; dead letters list, show,
replay, delete (and report, for clients); delay stats.

Two layers:

* steps (``dmq_server.db.steps``: ``list_dead_letters_steps(flt, ...)``), which the CLI
  runs on its connection (``run_steps``) and the server on a ``DbWorker`` thread (or a
  unit test on the in-memory double);
* ``AdminOps``, the server's asynchronous facade: the same operations plus what
  only a running server knows (live stats, connected clients, in-memory delay
  timers), each returning a Deferred.

Replay and delete work in batches (keyset on the dead letter id, one
transaction each) and report progress after each batch. They refuse to run
without a selection unless told ``all``, and every run is written to
``dmq_admin_log`` and the server log. Input errors are ``core.errors`` ``Refused`` errors with a
stable code (``E_INVALID``, ``E_NOT_FOUND``, ...) and a message saying what to fix.

Why one long module: every admin operation once, for three surfaces (API, console, CLI);
each is short, and they share the dead-letter filter, the token policy and the audit
log.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Collection, Generator, Mapping, Protocol

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_client.spelling import parse_time_ms
from dmq_client.wire.properties import Properties, PropertiesError
from dmq_server.core.clock import Clock
from dmq_server.core.errors import Forbidden, Invalid, NotFound, Unauthorized
from dmq_server.core.options import Options
from dmq_server.core.peers import is_loopback
from dmq_server.db import admin_steps as db_admin
from dmq_server.db.admin_steps import log_operation_steps, stored_stats_steps
from dmq_server.db.dead_letter_steps import REASONS, NewDeadLetter, insert_dead_letters_steps
from dmq_server.db.delays import delay_stats_steps
from dmq_server.db.runner import StepRunner
from dmq_server.db.seek import SEEK_SKEW_MS, NoSuchChannel, SeekRefused, SeekTarget, Sought, seek_channel_steps
from dmq_server.admin.seek_request import describe_seek, report as seek_report, summary as seek_summary
from dmq_server.db.steps import Steps
from registry.interface import MIN_RETENTION_MS, ORDERED_FAST, RETENTION_FAST

if TYPE_CHECKING:  # the CLI imports this module: not the broker (and its stores) at run time
    from dmq_server.broker.interfaces import BrokerPort

__all__ = [
    "DeadLetterFilter",
    "is_loopback",
    "check_token",
    "list_dead_letters_steps",
    "count_dead_letters_steps",
    "show_dead_letter_steps",
    "replay_batch_steps",
    "delete_batch_steps",
    "log_operation_steps",
    "TOPIC_SETTINGS",
    "merge_topic_settings",
    "update_topic_steps",
    "AdminOps",
    "REPLAY_PRODUCER",
]

log = Logger()

REPLAY_PRODUCER = "dmq-replay"
DEFAULT_LIST_LIMIT = 100
MAX_LIST_LIMIT = 10000
DEFAULT_BATCH = 5000


# -- input -------------------------------------------------------------------------

def _ids(name: str, text: str) -> tuple[int, ...]:
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts:
        raise Invalid(f"{name}: give one or more ids, separated by commas")
    out = []
    for part in parts:
        if not part.isdigit():
            raise Invalid(f"{name}: {part!r} is not an id (a positive integer)")
        out.append(int(part))
    return tuple(out)


_BOOL = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


@dataclass(frozen=True)
class DeadLetterFilter:
    """A selection of dead letters; a field left None matches everything."""

    topic: str | None = None
    channel: str | None = None
    reason: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    ids: tuple[int, ...] | None = None
    message_ids: tuple[int, ...] | None = None
    replayed: bool | None = None
    cluster: str | None = None  # the PostgreSQL cluster to look in (None: every cluster)

    KEYS = ("topic", "channel", "reason", "since", "until", "ids", "message_ids", "replayed", "cluster")

    @classmethod
    def parse(cls, params: Mapping[str, str], now_ms: int | None = None) -> "DeadLetterFilter":
        """From text key/values (console words, query strings, CLI flags)."""
        values: dict[str, Any] = {}
        for key, raw in params.items():
            if raw is None:
                continue
            text = str(raw)
            if key in ("topic", "channel", "cluster"):
                if not text:
                    raise Invalid(f"{key}: empty name")
                values[key] = text
            elif key == "reason":
                if text not in REASONS:
                    raise Invalid(f"reason: unknown reason {text!r}, use one of {', '.join(REASONS)}")
                values["reason"] = text
            elif key in ("since", "until"):
                try:
                    values[f"{key}_ms"] = parse_time_ms(text, now_ms)
                except ValueError as exc:
                    raise Invalid(f"{key}: {exc}") from None
            elif key in ("ids", "id", "message_ids"):
                values["message_ids" if key == "message_ids" else "ids"] = _ids(key, text)
            elif key == "replayed":
                if text.lower() not in _BOOL:
                    raise Invalid(f"replayed: expected true or false, got {text!r}")
                values["replayed"] = _BOOL[text.lower()]
            else:
                raise Invalid(f"unknown filter {key!r}; filters are {', '.join(cls.KEYS)}")
        flt = cls(**values)
        if flt.since_ms is not None and flt.until_ms is not None and flt.since_ms >= flt.until_ms:
            raise Invalid("since must be before until")
        return flt

    def is_empty(self) -> bool:
        """Nothing selected (the cluster alone selects nothing: every dead letter there)."""
        return all(getattr(self, f.name) is None for f in fields(self) if f.name != "cluster")

    def params(self) -> dict:
        return {
            "topic": self.topic,
            "channel": self.channel,
            "reason": self.reason,
            "since_ms": self.since_ms,
            "until_ms": self.until_ms,
            "ids": list(self.ids) if self.ids else None,
            "message_ids": list(self.message_ids) if self.message_ids else None,
            "replayed": self.replayed,
        }

    def describe(self) -> str:
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                if isinstance(value, tuple):
                    value = ",".join(str(v) for v in value)
                parts.append(f"{f.name}={value}")
        return " ".join(parts) or "all"


def require_selection(flt: DeadLetterFilter, everything: bool, operation: str) -> None:
    if flt.is_empty() and not everything:
        raise Invalid(f"{operation} needs a selection: ids, or filters ({', '.join(DeadLetterFilter.KEYS)}), "
            "or 'all' for every dead letter")


def parse_limit(text: str | None, default: int = DEFAULT_LIST_LIMIT, name: str = "limit") -> int:
    if text is None or text == "":
        return default
    if not str(text).isdigit() or not 1 <= int(text) <= MAX_LIST_LIMIT:
        raise Invalid(f"{name}: expected 1..{MAX_LIST_LIMIT}, got {text!r}")
    return int(text)


# -- access ------------------------------------------------------------------------


def check_token(listen_host: str, configured: str, given: str | None) -> None:
    """Raise ``Unauthorized`` or ``Forbidden`` (E_AUTH) unless the request may proceed: with a configured
    token it must match; without one, only a loopback listener is open."""
    import hmac

    if configured:
        if not given:
            raise Unauthorized("this admin surface needs a token (auth TOKEN / Authorization: Bearer TOKEN)")
        if not hmac.compare_digest(given.encode(), configured.encode()):
            raise Unauthorized("wrong admin token")
        return
    if not is_loopback(listen_host):
        raise Forbidden(f"admin surfaces listening on non-loopback address {listen_host} need --admin-token")


# -- database operations (steps: the CLI's connection and the server's DbWorker) --------
# The statements are dmq_server.db.admin_steps's; these add the filter and the error codes.


def list_dead_letters_steps(flt: DeadLetterFilter, limit: int = DEFAULT_LIST_LIMIT, after: int = 0) -> Steps:
    return (yield from db_admin.list_dead_letters_steps(flt.params(), limit, after))


def count_dead_letters_steps(flt: DeadLetterFilter) -> Steps:
    return (yield from db_admin.count_dead_letters_steps(flt.params()))


def show_dead_letter_steps(letter_id: int) -> Steps:
    letter = yield from db_admin.show_dead_letter_steps(letter_id)
    if letter is None:
        raise NotFound(f"no dead letter {letter_id}")
    return letter


def replay_batch_steps(
    flt: DeadLetterFilter, after: int, limit: int, fragments: int, now_ms: int, node_id: str
) -> Steps:
    """Replay one batch; returns (next cursor or None when done, how many were queued)."""
    return (yield from db_admin.replay_batch_steps(flt.params(), after, limit, fragments, now_ms, node_id))


def delete_batch_steps(flt: DeadLetterFilter, after: int, limit: int) -> Steps:
    return (yield from db_admin.delete_batch_steps(flt.params(), after, limit))


#: what ``topic update`` may change; not the store, since a topic's stored messages
#: and its consumers' protocol depend on it (delete and recreate to change it)
TOPIC_SETTINGS = db_admin.TOPIC_SETTINGS

_TOPIC_SETTING_TEXT = {
    "msg_timeout_ms": "message timeout",
    "rate_limit": "rate limit",
    "ttl_ms": "TTL",
    "max_attempts": "max attempts",
    "retention_ms": "retention",
}

#: a topic setting's new value: a limit (``None`` removes it), or ``ordered``'s on/off
TopicSetting = int | bool | None


def merge_topic_settings(current: Mapping[str, object], changes: Mapping[str, TopicSetting]) -> dict:
    """A topic's settings after ``changes`` (``None`` removes a limit; the message
    timeout cannot be removed; ``ordered`` is true or false, and true only for a reliable
    topic: ``current`` may say its ``store``). ``Invalid`` for an unknown setting, a value
    below 1, or no change asked for. Turning ``ordered`` on or off on a
    topic with waiting messages is allowed: the rule applies to deliveries from then on."""
    unknown = sorted(set(changes) - set(TOPIC_SETTINGS))
    if unknown:
        raise Invalid(f"topic update: unknown settings {', '.join(unknown)}")
    if not changes:
        raise Invalid(
            "topic update: nothing to change (give a message timeout, rate limit, TTL, max attempts, retention or "
            "ordered)"
        )
    for key, value in changes.items():
        if key == "ordered":
            if not isinstance(value, bool):
                raise Invalid(f"topic update: ordered must be true or false, not {value!r}")
            if value and current.get("store", "reliable") != "reliable":
                raise Invalid(f"topic update: {ORDERED_FAST}")
            continue
        if value is None and key == "msg_timeout_ms":
            raise Invalid("topic update: the message timeout cannot be removed")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise Invalid(f"topic update: the {_TOPIC_SETTING_TEXT[key]} must be at least 1")
        if key == "retention_ms" and value is not None:
            if value < MIN_RETENTION_MS:
                raise Invalid(f"topic update: the retention must be at least {MIN_RETENTION_MS // 1000}s")
            if current.get("store", "reliable") != "reliable":
                raise Invalid(f"topic update: {RETENTION_FAST}")
    return {key: changes[key] if key in changes else current[key] for key in TOPIC_SETTINGS}


def update_topic_steps(name: str, changes: Mapping[str, TopicSetting]) -> Steps:
    """Change a topic's settings in the PostgreSQL registry (one node; a cluster's
    registry is ZooKeeper's), in one transaction (the caller's): the row is locked while
    read and written, so two updates of different settings both stick. Returns (before,
    after); running servers apply the new settings at their next registry refresh."""
    result = yield from db_admin.update_topic_settings_steps(
        name, lambda before: merge_topic_settings(before, changes)
    )
    if result is None:
        raise NotFound(f"no such topic {name!r}")
    return result


def run_batches(
    step: Callable[[int], tuple[int | None, int]],
    progress: Callable[[int], None] | None = None,
) -> int:
    """Drive a keyset batch operation to the end (synchronously, e.g. in the CLI)."""
    after, done = 0, 0
    while True:
        after_next, affected = step(after)
        done += affected
        if progress is not None and affected:
            progress(done)
        if after_next is None:
            return done
        after = after_next


def report_letter(params: Mapping[str, object]) -> NewDeadLetter:
    """A client's report of a send it could not store (``client_reported``)."""
    topic = params.get("topic")
    if not isinstance(topic, str) or not topic:
        raise Invalid("report: topic is required")
    producer = params.get("producer", "")
    if not isinstance(producer, str):
        raise Invalid("report: producer must be a string")
    session_id = params.get("session_id")
    if session_id is not None and (not isinstance(session_id, int) or isinstance(session_id, bool)):
        raise Invalid("report: session_id must be an integer")
    body = params.get("body", "")
    encoding = params.get("body_encoding", "utf-8")
    if not isinstance(body, str):
        raise Invalid("report: body must be a string (utf-8 text or base64)")
    if encoding == "base64":
        try:
            raw = base64.b64decode(body, validate=True)
        except ValueError:
            raise Invalid("report: body is not valid base64") from None
    elif encoding == "utf-8":
        raw = body.encode("utf-8")
    else:
        raise Invalid(f"report: body_encoding must be utf-8 or base64, got {encoding!r}")
    detail = params.get("detail", "")
    if not isinstance(detail, str):
        raise Invalid("report: detail must be a string")
    return NewDeadLetter(
        "client_reported", topic, producer, session_id, raw, detail=detail or "reported by the client",
        properties=_report_properties(params),
    )


def _report_properties(params: Mapping[str, object]) -> Properties:
    """A report's ``key``, ``priority`` and ``headers`` (each optional), checked by the
    rules a send's are: the letter's replay sends them again, so they must be ones a
    server accepts."""
    key = params.get("key")
    if key is not None and not isinstance(key, str):
        raise Invalid("report: key must be a string")
    priority = params.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise Invalid("report: priority must be an integer")
    headers = params.get("headers") or {}
    if not isinstance(headers, dict):
        raise Invalid("report: headers must be a JSON object of names to texts")
    props = Properties(key, priority, headers)
    try:
        props.check()
    except PropertiesError as exc:
        raise Invalid(f"report: {exc}") from None
    return props


# -- the server's facade -------------------------------------------------------------


class Delays(Protocol):
    """What the operations ask of a cluster's delay scheduler (``reliable.delay.DelayScheduler``)."""

    def stats(self) -> dict: ...

    def move_now(self) -> None: ...


class _Subscribed(Protocol):
    @property
    def credit(self) -> int: ...
    @property
    def in_flight(self) -> int: ...


class DmqClient(Protocol):
    """A dmq connection as ``clients`` lists it (``protocols.dmq.DmqConnection``)."""

    @property
    def peer(self) -> str: ...
    @property
    def subscriptions(self) -> Mapping[tuple[str, str], _Subscribed]: ...

    def security_stats(self) -> dict[str, object]: ...


class _NsqClient(Protocol):
    def stats(self) -> dict[str, object]: ...


class NsqClients(Protocol):
    """What NSQ connections share, as ``clients`` lists them (``protocols.nsq_context.NsqContext``)."""

    @property
    def connections(self) -> Collection[_NsqClient]: ...


class _Budget(Protocol):
    def stats(self) -> dict[str, object]: ...


class Port(Protocol):
    """The TCP port's factory, for its flow-control state (``protocols.listener.PortFactory``)."""

    @property
    def budget(self) -> _Budget: ...


class AdminOps:
    """The operations against a running server. Its collaborators are passed in: the
    broker, the delay scheduler (None without one), the database worker the
    operations run on, the options, the clock, this node's id, the dmq protocol's
    live connections and what NSQ connections share (for ``clients``), and the TCP
    port's factory (for its flow-control state)."""

    def __init__(
        self,
        *,
        broker: BrokerPort,
        delays: Delays | None,
        db: StepRunner,
        options: Options,
        clock: Clock,
        node_id: str,
        dmq_connections: Collection[DmqClient] = (),
        nsq: NsqClients | None = None,
        port_factory: Port | None = None,
        batch_size: int = DEFAULT_BATCH,
        clusters: Mapping[str, tuple[StepRunner, Delays | None]] | None = None,
    ):
        self.broker = broker
        self.delays = delays
        self.db = db
        # every PostgreSQL cluster's (database worker, delay scheduler), main first: the
        # dead letters and delayed messages of a topic are on its cluster
        self.clusters: dict[str, tuple[StepRunner, Delays | None]] = {"main": (db, delays), **(clusters or {})}
        self.options = options
        self.clock = clock
        self.node_id = node_id
        self.dmq_connections = dmq_connections
        self.nsq = nsq
        self.port_factory = port_factory
        self.batch_size = batch_size

    # -- read-only ------------------------------------------------------------------
    def flow(self) -> dict[str, object]:
        """The TCP port's flow-control state (buffered bytes, paused connections)."""
        if self.port_factory is None:
            raise NotFound("the TCP port is not listening")
        return self.port_factory.budget.stats()

    def stats(self) -> Deferred:
        live = self.broker.stats()
        d = self.db.run_steps(stored_stats_steps)

        def combine(stored: dict) -> dict:
            delays = self.delays
            return {
                "server": live,
                "stored": stored,
                "delay": delays.stats() if delays is not None else None,
            }

        return d.addCallback(combine)

    def topics(self) -> list[dict]:
        out = []
        for name in sorted(self.broker.topics):
            row = self.broker.topics[name]
            out.append(
                {
                    "name": row.name,
                    "store": row.store,
                    "msg_timeout_ms": row.msg_timeout_ms,
                    "rate_limit": row.rate_limit,
                    "ttl_ms": row.ttl_ms,
                    "max_attempts": row.max_attempts,
                    "ordered": row.ordered,
                    "cluster": getattr(row, "cluster", "main"),
                    "draining": list(getattr(row, "draining", ())),
                    "channels": [
                        self.broker.channels[(name, c)].stats()
                        if (name, c) in self.broker.channels
                        else {"channel_name": c}
                        for c in row.channels
                    ],
                }
            )
        return out

    def clients(self) -> list[dict]:
        out = []
        for conn in list(self.dmq_connections):
            out.append(
                {
                    "protocol": "dmq",
                    "remote_address": conn.peer,
                    "subscriptions": [
                        {
                            "topic": t,
                            "channel": c,
                            "credit": sub.credit,
                            "in_flight": sub.in_flight,
                        }
                        for (t, c), sub in sorted(conn.subscriptions.items())
                    ],
                    **getattr(conn, "security_stats", dict)(),
                }
            )
        for nsq_conn in list(self.nsq.connections if self.nsq is not None else ()):
            stats = nsq_conn.stats()
            stats["protocol"] = "nsq"
            out.append(stats)
        return out

    # -- several PostgreSQL clusters ------------------------------------------------------
    def _selected(self, cluster: str | None) -> list[tuple[str, StepRunner, Delays | None]]:
        """(name, database worker, delay scheduler) of ``cluster``, or of every cluster."""
        if cluster is None:
            return [(name, db, delays) for name, (db, delays) in self.clusters.items()]
        if cluster not in self.clusters:
            raise NotFound(f"no cluster {cluster!r}: the clusters are {', '.join(self.clusters)}")
        db, delays = self.clusters[cluster]
        return [(cluster, db, delays)]

    def db_for_id(self, any_id: int) -> StepRunner:
        """The database worker of the cluster that drew ``any_id`` (a message, delayed
        message or dead letter id names its cluster: ``db.clusters``)."""
        cluster = self.broker.cluster_of_id(any_id) if self.broker is not None else None
        if cluster is None or cluster not in self.clusters:
            return self.db
        return self.clusters[cluster][0]

    @inlineCallbacks
    def delay_stats(self) -> Any:
        """Main's scheduler and stored fragments, the pending count of every cluster,
        and each cluster's own under ``clusters``."""
        per: dict[str, dict] = {}
        for name, db, delays in self._selected(None):
            fragments = yield db.run_steps(delay_stats_steps)
            per[name] = dict(delays.stats() if delays is not None else {}, stored=fragments,
                             pending=sum(f["pending"] for f in fragments))
        live = dict(per["main"], pending=sum(c["pending"] for c in per.values()))
        if len(per) > 1:
            live["clusters"] = per
        return live

    @inlineCallbacks
    def dlq_list(self, flt: DeadLetterFilter, limit: int = DEFAULT_LIST_LIMIT, after: int = 0) -> Any:
        """The selection in id order, over the clusters looked in (each row names its own)."""
        rows: list[dict] = []
        several = len(self.clusters) > 1
        for name, db, _ in self._selected(flt.cluster):
            for row in (yield db.run_steps(list_dead_letters_steps, flt, limit, after)):
                if several:
                    row["cluster"] = name
                rows.append(row)
        rows.sort(key=lambda r: r["id"])
        return rows[:limit]

    def db_for_topic(self, topic: str | None) -> StepRunner:
        """The database worker of the cluster ``topic`` is placed on (main's if unknown)."""
        spec = getattr(self.broker, "topics", {}).get(topic) if topic is not None else None
        name = getattr(spec, "cluster", "main")
        return self.clusters[name][0] if name in self.clusters else self.db

    def dlq_show(self, letter_id: int) -> Deferred:
        return self.db_for_id(letter_id).run_steps(show_dead_letter_steps, letter_id)

    @inlineCallbacks
    def dlq_count(self, flt: DeadLetterFilter) -> Any:
        total, pending = 0, 0
        for _, db, _ in self._selected(flt.cluster):
            t, p = yield db.run_steps(count_dead_letters_steps, flt)
            total, pending = total + t, pending + p
        return total, pending

    # -- destructive ------------------------------------------------------------------
    @inlineCallbacks
    def dlq_replay(
        self,
        flt: DeadLetterFilter,
        everything: bool,
        surface: str,
        actor: str,
        progress: Callable[[int, int], None] | None = None,
    ) -> Any:
        """Replay the selection; fires with how many were queued for delivery."""
        require_selection(flt, everything, "replay")
        total = (yield self.dlq_count(flt))[1]
        options = self.options
        done = 0
        for _, db, delays in self._selected(flt.cluster):  # each cluster replays its own
            after = 0
            while True:
                now_ms = int(self.clock.seconds() * 1000)
                after_next, queued = yield db.run_steps(
                    replay_batch_steps, flt, after, self.batch_size, options.delay_fragments, now_ms,
                    self.node_id,
                )
                done += queued
                if queued and delays is not None:
                    delays.move_now()
                if progress is not None and queued:
                    progress(done, total)
                if after_next is None:
                    break
                after = after_next
        yield self.audit(surface, actor, "dlq.replay", flt, done)
        return done

    @inlineCallbacks
    def dlq_delete(
        self,
        flt: DeadLetterFilter,
        everything: bool,
        surface: str,
        actor: str,
        progress: Callable[[int, int], None] | None = None,
    ) -> Any:
        """Delete the selection; fires with how many were deleted."""
        require_selection(flt, everything, "delete")
        total = (yield self.dlq_count(flt))[0]
        done = 0
        for _, db, _ in self._selected(flt.cluster):
            after = 0
            while True:
                after_next, deleted = yield db.run_steps(delete_batch_steps, flt, after, self.batch_size)
                done += deleted
                if progress is not None and deleted:
                    progress(done, total)
                if after_next is None:
                    break
                after = after_next
        yield self.audit(surface, actor, "dlq.delete", flt, done)
        return done

    def channel_action(self, action: str, topic: str, channel: str, surface: str, actor: str) -> Deferred:
        """``pause``, ``unpause`` or ``empty`` a reliable channel (the broker's; the same as
        nsqd's HTTP API and ``dmq channel``); fires with a summary line, or fails with
        ``NotFound`` for a channel that is not registered."""
        broker = self.broker
        if action == "empty":
            d = broker.empty_channel(topic, channel)
        elif action in ("pause", "unpause"):
            d = broker.pause_channel(topic, channel, action == "pause")
        else:
            raise Invalid(f"unknown channel action {action!r} (pause, unpause, empty)")

        def done(result: object) -> str:
            log.info(
                "admin {surface} {actor}: channel {action} {topic}/{channel}",
                surface=surface, actor=actor, action=action, topic=topic, channel=channel,
            )
            return f"{action} {topic}/{channel}" + (f": {result} stored copies dropped" if action == "empty" else "")

        def missing(failure: Failure) -> None:
            failure.trap(KeyError)
            what = "topic" if failure.value.args[0] == "TOPIC_NOT_FOUND" else "channel"
            raise NotFound(f"no reliable {what} {topic if what == 'topic' else topic + '/' + channel}")

        return d.addCallbacks(done, missing)

    @inlineCallbacks
    def channel_seek(self, topic: str, channel: str, target: SeekTarget, dry_run: bool, surface: str,
                     actor: str, from_archive: bool = False) -> Generator[Deferred, object, list[dict[str, object]]]:
        """Seek a reliable channel to ``target`` (``dmq channel seek``) on every cluster, in
        turn: one transaction each (``seek_channel_steps``); fires with each cluster's
        report. Refused: ``NotFound`` for a channel not registered, ``Invalid`` for a target
        it cannot take (after now, before the topic's retained start or its time to live).
        A seek that fails on a later cluster leaves the earlier ones sought: run it again
        (a seek is absolute). Audited; this node applies it at once, the others at their
        next channel-state read. ``from_archive``: a time before the retained start seeks to it,
        each report naming the gap and its ``dmq-pipeline reinject`` command."""
        reports: list[dict[str, object]] = []
        done: list[Sought] = []
        count = 0
        yield from self._seek_strays(topic, channel, target, from_archive)
        for name, db, _ in self._selected(None):
            try:
                # (positional: a runner passes no keywords) skew, fresh, from_archive
                sought = yield db.run_steps(seek_channel_steps, topic, channel, target, dry_run, SEEK_SKEW_MS,
                                            False, from_archive)
            except NoSuchChannel as exc:
                raise NotFound(str(exc)) from None
            except SeekRefused as exc:
                raise Invalid(str(exc)) from None
            assert isinstance(sought, Sought)
            count += sought.count
            done.append(sought)
            reports.append(seek_report(name, sought, dry_run, topic, channel))
            log.info("admin {surface} {actor}: {line}", surface=surface, actor=actor,
                     line=seek_summary(topic, channel, name, sought, dry_run))
        if not dry_run:
            yield self.audit(surface, actor, "channel.seek", describe_seek(topic, channel, target, done), count)
            yield self.broker.read_channel_state()
        return reports

    def _seek_strays(self, topic: str, channel: str, target: SeekTarget,
                     from_archive: bool) -> Generator[Deferred, object, None]:
        """Refuse, before anything is written, a seek that would make messages pending on a
        cluster the topic was moved away from: nodes deliver its copies only from its cluster
        and those still draining, and a server does not change a topic's placement; the CLI
        does (it has the topic drain that cluster again, as after a move)."""
        spec = self.broker.topics.get(topic) if self.broker is not None else None
        if spec is None:
            return
        for name, db, _ in self._selected(None):
            if name in spec.clusters:
                continue
            try:
                sought = yield db.run_steps(seek_channel_steps, topic, channel, target, True, SEEK_SKEW_MS,
                                            False, from_archive)
            except SeekRefused:
                continue  # the seek itself says why
            assert isinstance(sought, Sought)
            if sought.count:
                raise Invalid(
                    f"cluster {name} keeps {sought.count} message{'s' if sought.count != 1 else ''} of topic {topic} "
                    f"from before its move to {spec.cluster}, and no node delivers the topic from {name} now: "
                    f"seek with the CLI (`dmq channel seek {topic} {channel} ...`), which has the topic drain "
                    f"{name} again for the replay")

    def dlq_report(self, params: Mapping[str, object], surface: str, actor: str) -> Deferred:
        """Record a client's report of a send it could not store; fires with the id."""
        letter = report_letter(params)
        log.info(
            "admin {surface} {actor}: dead letter reported for {topic}", surface=surface, actor=actor, topic=letter.topic
        )
        return self.db_for_topic(letter.topic).run_steps(insert_dead_letters_steps, [letter]).addCallback(lambda ids: ids[0])

    def audit(self, surface: str, actor: str, operation: str, flt: DeadLetterFilter | str, affected: int) -> Deferred:
        """Write a destructive operation to the server log and ``dmq_admin_log``; ``flt``
        is the selection (a dead-letter filter, or its text)."""
        filters = flt if isinstance(flt, str) else flt.describe()
        log.info(
            "admin {surface} {actor}: {op} {filters} -> {n}",
            surface=surface, actor=actor, op=operation, filters=filters, n=affected,
        )
        return self.db.run_steps(log_operation_steps, surface, actor, operation, filters, affected)
