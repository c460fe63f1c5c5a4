"""``reinject``: a topic's archived messages of a time range, queued again for one channel.

A channel sought before its topic's retained start (``dmq channel seek --from-archive``)
is sought to that start; what the retention sweep removed before it (the *gap*) exists
only in the archive. This job reads the topic's archived rows with Spark (every channel's:
the channel gets every message of the topic published in the gap, not only those it had
acknowledged), keeps one row per message id published in ``[since, until)`` and queues
them, in id order, into ``dmq_delay`` for that channel only and due at once, as a
dead-letter replay of the channel queues its letters. A server's delay workers then move
them into the reliable flow as messages of that channel (``move_due``), with the body,
key, priority and headers they were sent with. No server needs to be reachable from here.

``until`` defaults to the topic's retained start read as the seek reads it
(``dmq_retention``: swept_ms + 1 ms), so the gap and what the seek delivers meet exactly.

Idempotent: each row is queued with producer ``dmq-archive:<channel>`` and the original
message id as session id. While a run's rows wait in ``dmq_delay`` (UNIQUE (producer,
session_id)) or are stored as messages (``dmq_message``'s own key), a second run queues
none of them; once the channel acknowledged them and the sweep removed them, a new run
delivers the gap again, which is what a second seek back wants. Rows the archive holds of
such re-injected copies (that producer) are never a source: they are channel-only.

One delay fragment (1, which a server always serves): one worker moves the rows, batch after
batch in due order, rather than a worker per fragment racing the others, so the messages of a
key reach an ordered topic in their order across batches (within one move the server draws
the new ids in no set order).

Bounded: the rows reach the driver a partition at a time (``toLocalIterator``), sorted by
id, and are queued ``--batch`` at a time, one statement (its own transaction) each.
"""

from __future__ import annotations

import getpass
import json
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterable, Iterator

from .archive import read_archive
from .database import Database
from .errors import UsageError
from .options import ReinjectSettings, TimeRange, parse_time
from .session import ensure_utc

__all__ = ["PRODUCER_PREFIX", "producer_for", "ReinjectResult", "validate", "gap", "gap_rows", "run_reinject"]

#: re-injected copies are produced by ``dmq-archive:<channel>``: one per channel, so two
#: channels can be given the same gap, and each once
PRODUCER_PREFIX = "dmq-archive:"

#: dmq_retention (where the retained start is noted) came with this schema version
RETENTION_SCHEMA = 20


def producer_for(channel: str) -> str:
    return PRODUCER_PREFIX + channel


@dataclass
class ReinjectResult:
    topic: str
    channel: str
    span: TimeRange
    selected: int = 0  # distinct archived messages of the topic in the range
    queued: int = 0  # of them queued by this run
    missing: int = 0  # archived without their message (no body to send): not queued
    dry_run: bool = False
    seconds: float = 0.0

    @property
    def already(self) -> int:
        """Selected but not queued: queued or stored by an earlier run."""
        return 0 if self.dry_run else self.selected - self.queued

    def as_json(self) -> dict[str, object]:
        return {"topic": self.topic, "channel": self.channel, "since": self.span.since.isoformat(),
                "until": self.span.until.isoformat(), "selected": self.selected, "queued": self.queued,
                "already_queued": self.already, "missing_messages": self.missing,
                "dry_run": self.dry_run, "seconds": round(self.seconds, 3)}


def validate(db: Database, settings: ReinjectSettings) -> None:
    """A schema without the retention table, or an unknown topic or channel: usage errors."""
    if db.schema_version() < RETENTION_SCHEMA:
        raise UsageError(f"the database's dmq schema is older than version {RETENTION_SCHEMA}: "
                         "start a current dmq-server on it or run `dmq db migrate`")
    db.check_topic_channel(settings.topic, settings.channel)


def gap(db: Database, settings: ReinjectSettings, now: datetime | None = None) -> TimeRange:
    """``[--since, --until)``; ``--until`` empty: the topic's retained start."""
    now = now or datetime.now(timezone.utc)
    since = parse_time(settings.since, now, "--since")
    if settings.until:
        until = parse_time(settings.until, now, "--until")
    else:
        row = db.one("retained_start", topic=settings.topic)
        if row is None:
            raise UsageError(f"the retention sweep removed nothing of topic {settings.topic}: the store "
                             "holds all of it (seek the channel with `dmq channel seek`), or pass --until")
        until = datetime.fromtimestamp(0, timezone.utc) + timedelta(milliseconds=row[1] + 1)
    if since >= until:
        raise UsageError(f"empty range: --since {since.isoformat()} is not before "
                         f"{'--until' if settings.until else 'the retained start'} {until.isoformat()}")
    return TimeRange(since, until)


def gap_rows(spark, location: str, topic: str, span: TimeRange):
    """The topic's archived rows published in ``span`` (every channel's, re-injected copies
    left out), as ``(rows with their message, rows archived without it)``: the first with one
    row per message id and the columns a queued row needs, sorted by id."""
    from pyspark.sql import functions as F
    from pyspark.sql.utils import AnalysisException

    try:
        rows = read_archive(spark, location)
    except AnalysisException:
        raise UsageError(f"nothing is archived at {location}") from None
    in_gap = rows.where(
        (F.col("topic") == topic)
        # a copy is acknowledged after it is published: older days hold none of the range
        & (F.col("day") >= F.lit(span.since.date()))
        & (F.col("published_at") >= F.lit(span.since)) & (F.col("published_at") < F.lit(span.until))
        & ~F.coalesce(F.col("producer").startswith(PRODUCER_PREFIX), F.lit(False))
    )
    kept = (in_gap.where(F.col("producer").isNotNull())
            .dropDuplicates(["message_id"])
            .select("message_id", F.coalesce(F.expr("unix_millis(produced_at)"), F.lit(0)).alias("produced_ms"),
                    "body", "key", "priority", "headers")
            .orderBy("message_id"))
    missing = in_gap.where(F.col("producer").isNull()).select("message_id").distinct()
    return kept, missing


def _batches(rows: Iterable, size: int) -> Iterator[list]:
    batch: list = []
    for row in rows:
        batch.append(row)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def queue_batch(db: Database, settings: ReinjectSettings, rows: list) -> int:
    """Queue one batch of archived rows for the channel; how many were new."""
    return db.one(
        "reinject_messages", topic=settings.topic, channel=settings.channel,
        producer=producer_for(settings.channel),
        session_ids=[r.message_id for r in rows], produced_ms=[r.produced_ms for r in rows],
        bodies=[bytes(r.body) for r in rows], keys=[r.key for r in rows],
        priorities=[int(r.priority or 0) for r in rows],
        headers=[None if r.headers is None else json.dumps(dict(r.headers), sort_keys=True) for r in rows],
    )[0]


def _actor() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""


def run_reinject(spark, db: Database, location: str, settings: ReinjectSettings, span: TimeRange,
                 progress: Callable[[str], None] = lambda text: None) -> ReinjectResult:
    started = time.perf_counter()
    ensure_utc(spark)
    result = ReinjectResult(settings.topic, settings.channel, span, dry_run=settings.dry_run)
    kept, missing = gap_rows(spark, location, settings.topic, span)
    result.missing = missing.count()
    if settings.dry_run:
        result.selected = kept.count()
    else:
        for batch in _batches(kept.toLocalIterator(), settings.batch):
            result.selected += len(batch)
            result.queued += queue_batch(db, settings, batch)
            progress(f"reinject: {result.queued} queued of {result.selected} read")
        db.execute("log_reinject", actor=_actor(), affected=result.queued,
                   filters=f"{settings.topic}/{settings.channel} published in {span} from {location}")
    result.seconds = time.perf_counter() - started
    return result
