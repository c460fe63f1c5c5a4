"""``replay``: republish selected dead letters, in parallel, exactly once.

The selection (topic, channel, reason, time of death; never a dead letter
already replayed) is read with a partitioned JDBC read. Each Spark partition
then runs :func:`replay_partition` on an executor: one connection to a dmq
server, each dead letter sent as a reliable message to its topic, and the
server's message id recorded in ``dmq_dead_letter.replayed_at`` /
``replay_message_id`` every ``--mark-batch`` sends.

A dead letter is sent with the properties it was sent with (key, priority, headers:
schema version 16), so the replayed message is the one that died. One without any is
sent exactly as before, with no properties, so a server older than the PROPS feature
takes it; one with properties is not sent to such a server (it would store the message
without them) and is counted as not replayed, to be replayed once the server is newer.

Why it is idempotent. Every replay is sent as ``UP_PRODUCER_RESEND`` with
producer ``dmq-replay`` and the dead letter's id as session id. The server
stores a ``(producer, session_id)`` pair once and answers a repeat with the
same message id, so a dead letter sent by a run that died before recording it
is not stored again when the next run sends it (as long as that run comes
within the server's ``--message-retention``). Once recorded, a dead letter is
no longer selected at all. Recording only sets rows still unrecorded, so
overlapping runs agree on the first message id.

Progress: the driver counts recorded replays in PostgreSQL every few seconds
while the executors work, so it sees them as they happen, on any cluster.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Callable, Iterable, Iterator, TypedDict

from .database import Database
from .errors import JobFailed, UsageError
from .jdbc import IdRange, read_query
from .options import ReplaySettings, SparkOptions, TimeRange
from .failures import explain

__all__ = ["PRODUCER", "ReplayResult", "send_properties", "validate", "check_fan_out", "selection", "run_replay", "replay_partition"]

log = logging.getLogger(__name__)

#: The producer id of every replayed message; the session id is the dead letter's id.
PRODUCER = "dmq-replay"
_SEND_TRIES = 3
_PROGRESS_EVERY = 2.0


@dataclass
class ReplayResult:
    selected: int = 0
    replayed: int = 0
    already_recorded: int = 0
    failed: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    summary: list[tuple] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return sum(self.failed.values())


def _params(settings: ReplaySettings, span: TimeRange) -> dict:
    return {
        "since": span.since,
        "until": span.until,
        "topic": settings.topic or None,
        "channel": settings.channel or None,
        "reason": settings.reason or None,
    }


def validate(db: Database, settings: ReplaySettings) -> None:
    """Unknown topic, channel or reason, or no server to send to: a usage error."""
    db.check_topic_channel(settings.topic, settings.channel)
    if settings.reason:
        reasons = set()
        for (definition,) in db.all("dead_letter_reasons"):
            reasons.update(re.findall(r"'([a-z_]+)'", definition))
        if reasons and settings.reason not in reasons:
            raise UsageError(
                f"unknown reason {settings.reason!r} (one of: {', '.join(sorted(reasons))})"
            )
    if not settings.dry_run:
        host, port = settings.address()
        try:
            socket.create_connection((host, port), timeout=5).close()
        except OSError as exc:
            raise UsageError(
                f"cannot reach a dmq server at {host}:{port} ({exc}): pass --server HOST:PORT"
            ) from None


def check_fan_out(db: Database, settings: ReplaySettings, span: TimeRange) -> None:
    """Refuse to send a channel's dead letters to a topic with other channels, unless asked.

    A send reaches every channel of its topic: a dead letter of ``orders/billing``
    replayed this way is delivered to ``orders/shipping`` too, which had already
    processed it. ``dmq dlq replay`` replays for the dead letter's own channel.
    """
    if settings.all_channels:
        return
    topics = db.topics()
    for topic, channel, _reason, count in db.all("replay_selection_summary", **_params(settings, span)):
        others = [c for c in topics.get(topic, ()) if c != channel]
        if channel and others:
            raise UsageError(
                f"{count} dead letters of {topic}/{channel} would also reach channel(s) "
                f"{', '.join(others)}: a replayed send goes to every channel of its topic. Replay "
                f"them for their own channel with `dmq dlq replay`, or pass --all-channels"
            )


def selection(db: Database, settings: ReplaySettings, span: TimeRange) -> tuple[int, int, int]:
    """``(count, first id, last id)`` of the dead letters this replay would send."""
    count, low, high = db.one("replay_selection", **_params(settings, span))
    return count, low or 0, high or 0


# -- executors ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    dsn: str
    host: str
    port: int
    mark_batch: int
    send_timeout: float
    # (topic, messages per second) this partition may send: the topic's rate limit
    # shared among the partitions, with a margin for the topic's other producers
    rates: tuple[tuple[str, float], ...] = ()


#: The part of a topic's rate limit a replay takes (its producers go on meanwhile).
RATE_SHARE = 0.8
#: Sends refused for the rate limit are tried again this many times, paced.
_RATE_TRIES = 5


class Pacer:
    """Spaces one partition's sends to each topic ``1/rate`` seconds apart, so a replay
    never trips the rate limit it is replaying for. ``clock`` and ``sleep`` are
    injectable; the sleeps are the pacing itself."""

    def __init__(self, rates: dict[str, float], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.gaps = {topic: 1.0 / rate for topic, rate in rates.items() if rate > 0}
        self.clock, self.sleep = clock, sleep
        self._next: dict[str, float] = {}

    def wait(self, topic: str, slower: float = 1.0) -> None:
        gap = self.gaps.get(topic)
        if gap is None:
            return
        now = self.clock()
        at = self._next.get(topic, now)
        if at > now:
            self.sleep(at - now)
            now = at
        self._next[topic] = now + gap * slower


def outcome_key(command_name: str, status: str) -> str:
    """A failed send's line in the summary: the reply and its error code, never the
    description (which names ids, so would make one line per message)."""
    code = status.split(" ", 1)[0] if status else ""
    return f"{command_name} {code}".strip()


#: Summary lines of dead letters whose properties were not sent (no reply to name).
UNSUPPORTED = "not sent E_UNSUPPORTED (the server does not list PROPS: it would drop key, priority, headers)"
BAD_PROPERTIES = "not sent E_BAD_PROPERTIES (the stored key, priority or headers break a rule)"


class SendProperties(TypedDict, total=False):
    """``BlockingClient.send``'s keywords for a message's properties."""

    key: str
    priority: int
    headers: dict[str, str]


def send_properties(row) -> SendProperties:
    """The ``BlockingClient.send`` keywords of a dead letter's properties: only those it
    has, none at all for a message without any (sent as before properties existed)."""
    props: SendProperties = {}
    if row.key is not None:
        props["key"] = row.key
    if row.priority:
        props["priority"] = int(row.priority)
    if row.headers is not None:
        props["headers"] = json.loads(row.headers)
    return props


def replay_partition(job: _Job, rows: Iterable) -> Iterator[dict]:
    """Send one partition's dead letters and record them; yields one tally."""
    from dmq_client.blocking import BlockingClient, ClientError
    from dmq_client.wire import FEATURE_PROPS, Command, PropertiesError

    from .database import executor_connection, mark_replayed

    tally = {"sent": 0, "recorded": 0, "failed": Counter()}
    pacer = Pacer(dict(job.rates))
    client = None
    conn = executor_connection(job.dsn)
    ids: list[int] = []
    message_ids: list[int] = []

    def record() -> None:
        if ids:
            tally["recorded"] += mark_replayed(conn, ids, message_ids)
            ids.clear()
            message_ids.clear()

    try:
        for row in rows:
            reply = None
            refused = None
            props = send_properties(row)
            errors = limited = 0
            while errors < _SEND_TRIES and limited < _RATE_TRIES:
                pacer.wait(row.topic, slower=2.0**limited)
                try:
                    if client is None:
                        client = BlockingClient(job.host, job.port, producer=PRODUCER, timeout=job.send_timeout)
                    if props and FEATURE_PROPS not in client.server_features():
                        refused = UNSUPPORTED
                        break
                    reply = client.send(row.topic, bytes(row.body), session_id=row.id, resend=True, **props)
                except PropertiesError:
                    refused = BAD_PROPERTIES
                    break
                except (ClientError, OSError) as exc:
                    if client is not None:
                        client.close()
                        client = None
                    reply = exc
                    errors += 1
                    continue
                if reply.command == Command.SEND_SERVER_ERROR:
                    errors += 1
                elif reply.command == Command.SEND_EXCEED_LIMIT_ACK:
                    limited += 1  # the topic's other producers took the room: slower
                else:
                    break
            if refused is not None:
                tally["failed"][refused] += 1
            elif not hasattr(reply, "command"):
                tally["failed"][f"connection failed: {type(reply).__name__}"] += 1
            elif reply.command == Command.SEND_SUCCESS_ACK:
                tally["sent"] += 1
                ids.append(row.id)
                message_ids.append(reply.message_id)
                if len(ids) >= job.mark_batch:
                    record()
            else:
                tally["failed"][outcome_key(reply.command.name, reply.status)] += 1
        record()
    finally:
        if client is not None:
            client.close()
        conn.close()
    tally["failed"] = dict(tally["failed"])
    yield tally


# -- driver -------------------------------------------------------------------------


class _Progress(threading.Thread):
    """Counts recorded replays in PostgreSQL while the executors work."""

    def __init__(self, dsn: str, ids: IdRange, started: datetime, total: int, report: Callable[[str], None]):
        super().__init__(name="dmq-replay-progress", daemon=True)
        self.dsn, self.ids, self.since, self.total, self.report = dsn, ids, started, total, report
        self.finished = threading.Event()

    def run(self) -> None:
        db = Database(self.dsn)
        last = -1
        try:
            while True:
                finished = self.finished.wait(_PROGRESS_EVERY)
                done = db.one("replay_progress", low=self.ids.first, high=self.ids.last,
                              started=self.since)[0]
                if done != last or finished:
                    self.report(f"replay: {done}/{self.total} recorded")
                    last = done
                if finished:
                    return
        except Exception as exc:  # progress is informational; the job goes on
            log.warning("replay progress stopped: %s", exc)
        finally:
            db.close()

    def stop(self) -> None:
        self.finished.set()
        self.join(10)


def run_replay(
    spark,
    db: Database,
    opts: SparkOptions,
    settings: ReplaySettings,
    span: TimeRange,
    progress: Callable[[str], None] = lambda text: None,
) -> ReplayResult:
    started_clock = time.perf_counter()
    params = _params(settings, span)
    result = ReplayResult()
    result.selected, low, high = selection(db, settings, span)
    if settings.dry_run:
        result.summary = db.all("replay_selection_summary", **params)
        return result
    if not result.selected:
        return result
    check_fan_out(db, settings, span)
    host, port = settings.address()
    ids = IdRange(low, high)
    started = db.one("database_time")[0]
    rows = read_query(spark, db, opts, "jdbc_replay_dead_letters", {**params, "low": low, "high": high}, ids=ids)
    partitions = max(rows.rdd.getNumPartitions(), 1)
    rates = tuple(
        (topic, RATE_SHARE * rate / partitions) for topic, rate in db.rate_limits().items() if rate
    )
    job = _Job(db.dsn, host, port, settings.mark_batch, settings.send_timeout, rates)
    watcher = _Progress(db.dsn, ids, started, result.selected, progress)
    watcher.start()
    try:
        tallies = rows.sortWithinPartitions("id").rdd.mapPartitions(partial(replay_partition, job)).collect()
    except Exception as exc:
        raise JobFailed(
            f"replay stopped: {explain(exc)}; what was sent is recorded, re-run to send the rest"
        ) from exc
    finally:
        watcher.stop()
    for tally in tallies:
        result.replayed += tally["recorded"]
        result.already_recorded += tally["sent"] - tally["recorded"]
        result.failed.update(tally["failed"])
    result.seconds = time.perf_counter() - started_clock
    return result
