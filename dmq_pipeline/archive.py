"""``archive``: delivered history to Parquet, then trimmed from PostgreSQL.

What is archived: delivery-log rows (one per acknowledged copy: topic,
channel, published, first delivered and acknowledged times, attempts) with
the message each refers to (producer, session id, produced time, node, body,
and its properties: key, priority, headers), read from ``dmq_message`` or, for
messages the server has swept since archiving was enabled, from
``dmq_message_history`` (see migrations 0002 and 0016).

Layout: ``<archive>/delivery_log/topic=<topic>/day=<YYYY-MM-DD>/batch=<n>/``
holding Parquet files; ``day`` is the UTC day of the acknowledgement,
``batch`` the archive batch that wrote the rows.

Batches make it idempotent and resumable. A batch is the range ``(low_id,
high_id]`` of the log's acknowledgement batches (``dmq_delivery_batch`` ids, schema
version 10; log row ids before it) after the watermark and is recorded in
``dmq_archive_batch`` before anything is written:

1. *planned*: Spark reads the range and writes it with dynamic partition
   overwrite, so writing the batch again replaces its own files and nothing
   else. The rows the committed write job put in the batch's Parquet are
   counted (as they pass to the writers) and the batch becomes
2. *written*: one transaction deletes the range from the log, checks that it
   deleted exactly the rows the Parquet holds (otherwise a late commit changed
   the range: roll back, write it again), deletes kept messages no log row
   needs any more and marks the batch
3. *trimmed*.

A crash at any point leaves one unfinished batch, which the next run
finishes first: rewritten if it was planned, trimmed if it was written. No
row is lost (the log is trimmed only after its Parquet is committed and
counted) or duplicated (a batch's files are replaced, never appended to).
Log rows that commit into an already archived range are archived by a later
run as a straggler batch.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterator

from .cluster import local_path
from .database import Database
from .errors import JobFailed, UsageError
from .jdbc import IdRange, read_query
from .options import ArchiveSettings, SparkOptions
from .session import ensure_utc

__all__ = [
    "DATASET",
    "Batch",
    "ArchiveResult",
    "archive_schema",
    "read_archive",
    "dataset_path",
    "normalize_location",
    "prepare",
    "run_archive",
    "plan_batch",
    "write_batch",
    "trim_batch",
]

log = logging.getLogger(__name__)

DATASET = "delivery_log"
PIPELINE_SCHEMA_VERSION = 2
_TRIM_ATTEMPTS = 3


def archive_schema():
    """The archived rows' schema, partition columns last (never inferred from paths).

    A message's properties (schema version 16) are ``key`` (string, NULL for none),
    ``priority`` (short, as PostgreSQL's smallint: 0 to 9) and ``headers``, a
    ``map<string,string>`` (NULL for none, as in the store), not the JSON text PostgreSQL
    holds: headers are flat names to texts by their rules (``dmq_client.wire.properties``),
    so a map loses nothing, and a Spark user queries it as it is (``headers['content-type']``,
    ``map_keys(headers)``, ``explode(headers)``) where a JSON column would need
    ``from_json`` or ``get_json_object`` and a parse of every row in every query. Parquet
    stores it as its MAP type, which Trino, DuckDB and pyarrow read as a map too.
    Files archived before these columns existed have none: ``read_archive`` reads an
    archive through this schema and gives their messages no properties."""
    from pyspark.sql import types as T

    return T.StructType([
        T.StructField("id", T.LongType()),
        T.StructField("message_id", T.LongType()),
        T.StructField("channel", T.StringType()),
        T.StructField("published_at", T.TimestampType()),
        T.StructField("first_delivered_at", T.TimestampType()),
        T.StructField("acked_at", T.TimestampType()),
        T.StructField("attempts", T.IntegerType()),
        T.StructField("producer", T.StringType()),
        T.StructField("session_id", T.LongType()),
        T.StructField("produced_at", T.TimestampType()),
        T.StructField("node_id", T.StringType()),
        T.StructField("body", T.BinaryType()),
        T.StructField("key", T.StringType()),
        T.StructField("priority", T.ShortType()),
        T.StructField("headers", T.MapType(T.StringType(), T.StringType())),
        T.StructField("topic", T.StringType()),
        T.StructField("day", T.DateType()),
        T.StructField("batch", T.LongType()),
    ])


def read_archive(spark, location: str):
    """The archived rows of ``location`` as a DataFrame of ``archive_schema()``.

    The schema is given, not taken from a file's footer: an archive begun before schema
    version 16 mixes files without ``key``, ``priority`` and ``headers`` with files that
    have them, and a schema read from one old file would leave the columns out of every
    row. A message of an old file reads as one without properties (no key, no headers,
    priority 0: all there was before version 16); a row archived without its message
    (``producer`` NULL) has NULL there as in its other message columns. Raises pyspark's
    ``AnalysisException`` when nothing was archived there yet."""
    from pyspark.sql import functions as F

    rows = spark.read.schema(archive_schema()).parquet(dataset_path(location))
    known = F.coalesce(F.col("priority"), F.lit(0).cast(rows.schema["priority"].dataType))
    return rows.withColumn("priority", F.when(F.col("producer").isNotNull(), known))


def normalize_location(text: str) -> str:
    """The one spelling of a location: a local one (a plain path, ``file:/x``,
    ``file:///x``) as its absolute path, so ``file:///x`` and ``/x`` are the same
    archive; other URIs (``hdfs://``, ``s3a://``) as given, without a trailing slash."""
    text = text.strip()
    path = local_path(text)
    if path is not None:
        return os.path.abspath(path)
    return text.rstrip("/")


def dataset_path(location: str) -> str:
    """Where Spark reads and writes the dataset: a local location as a ``file:`` URI,
    so a cluster whose default file system is HDFS still writes the disk meant."""
    location = normalize_location(location)
    if location.startswith("/"):
        location = "file://" + location
    return f"{location.rstrip('/')}/{DATASET}"


@dataclass
class Batch:
    id: int
    low: int
    high: int
    state: str
    planned_rows: int
    rows: int | None = None
    missing: int = 0


@dataclass
class ArchiveResult:
    location: str
    enabled_now: bool = False
    batches: list[Batch] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def rows(self) -> int:
        return sum(b.rows or 0 for b in self.batches)

    @property
    def missing_messages(self) -> int:
        return sum(b.missing for b in self.batches)

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


class RangeChanged(Exception):
    """The batch's log range holds other rows than its Parquet (a late commit)."""


# -- checks (change nothing) ------------------------------------------------------


def prepare(db: Database, settings: ArchiveSettings) -> str:
    """Validate the archive location against the database's; returns it normalised.

    The database's location binds once a batch has been written there: before that
    (archiving only enabled, or a first run that failed before its first batch was
    written, say to a path the executors could not write) another location is taken."""
    location = normalize_location(settings.archive)
    if db.schema_version() >= PIPELINE_SCHEMA_VERSION:
        row = db.one("archive_state")
        if row is not None and normalize_location(row[0]) != location and db.one("archive_written_batches")[0]:
            raise UsageError(
                f"this database is archived to {row[0]}, not {location}: pass --archive {row[0]} "
                "(one database has one archive, or its watermark would skip rows)"
            )
    return location


# -- steps ------------------------------------------------------------------------


@contextmanager
def _archive_lock(db: Database) -> Iterator[None]:
    if not db.one("archive_lock")[0]:
        raise JobFailed("another dmq-pipeline archive is running against this database")
    try:
        yield
    finally:
        db.one("archive_unlock")


def unfinished_batch(db: Database) -> Batch | None:
    row = db.one("unfinished_archive_batch")
    if row is None:
        return None
    return Batch(id=row[0], low=row[1], high=row[2], state=row[3], planned_rows=row[4], rows=row[5])


def anything_due(db: Database, settings: ArchiveSettings, now: datetime | None = None) -> bool:
    """Whether a run would archive anything (reads only): so that a run with nothing to
    do says so without starting Spark's JVM."""
    if unfinished_batch(db) is not None:
        return True
    watermark = db.one("archive_watermark")[0]
    if watermark > 0 and db.one("archive_stragglers", watermark=watermark)[0]:
        return True
    cutoff = (now or datetime.now(timezone.utc)) - timedelta(seconds=settings.older_than)
    return bool(db.one("next_archive_range", low=watermark, cutoff=cutoff, max_rows=settings.batch_rows)[0])


def plan_batch(db: Database, settings: ArchiveSettings, now: datetime | None = None) -> Batch | None:
    """Record the next batch (stragglers first); None when nothing is due."""
    watermark = db.one("archive_watermark")[0]
    low = watermark
    count = 0
    high = None
    if watermark > 0:
        count = db.one("archive_stragglers", watermark=watermark)[0]
        if count:
            low, high = 0, watermark
            log.warning("archiving %d log rows that committed after their range was archived", count)
    if not count:
        now = now or datetime.now(timezone.utc)
        cutoff = now - timedelta(seconds=settings.older_than)
        count, high = db.one(
            "next_archive_range", low=watermark, cutoff=cutoff, max_rows=settings.batch_rows
        )
        if not count:
            return None
    batch_id = db.one("plan_archive_batch", low=low, high=high, rows=count)[0]
    return Batch(id=batch_id, low=low, high=high, state="planned", planned_rows=count)


def write_batch(spark, db: Database, opts: SparkOptions, location: str, batch: Batch) -> Batch:
    """Write the batch's rows (replacing any earlier attempt), count them, mark it written.

    The rows are counted as the write job passes them to the Parquet writers (an
    ``Observation``: metrics of the successful tasks of the committed job, so
    exactly the rows in the batch's files) instead of reading the files back.
    The session lets each task keep a writer open per (topic, day) it meets
    (``spark.sql.maxConcurrentOutputFileWriters``, see ``session.py``) rather than
    sort its rows by them first; past that many it falls back to sorting.
    """
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    ensure_utc(spark)
    rows = read_query(
        spark, db, opts, "jdbc_archive_rows", {"low": batch.low, "high": batch.high},
        ids=IdRange(batch.low + 1, batch.high), column="ack_batch",
    ).drop("ack_batch")
    properties = archive_schema()
    seen = Observation(f"archive batch {batch.id}")
    (
        rows.withColumn("priority", F.col("priority").cast(properties["priority"].dataType))
        .withColumn("headers", F.from_json("headers", properties["headers"].dataType))
        .withColumn("day", F.to_date("acked_at"))
        .withColumn("batch", F.lit(batch.id).cast("long"))
        .observe(
            seen,
            F.count(F.lit(1)).alias("rows"),
            F.sum(F.when(F.col("producer").isNull(), 1).otherwise(0)).alias("missing"),
        )
        .write.mode("overwrite")
        .option("partitionOverwriteMode", "dynamic")
        .partitionBy("topic", "day", "batch")
        .parquet(dataset_path(location))
    )
    metrics = seen.get
    written, missing = int(metrics["rows"]), int(metrics["missing"] or 0)
    db.execute("mark_archive_written", id=batch.id, rows=written, missing=missing)
    return replace(batch, state="written", rows=written, missing=missing)


def trim_batch(db: Database, batch: Batch) -> Batch:
    """Delete the batch's log rows if they are exactly its Parquet's; mark it trimmed."""
    with db.transaction():
        deleted = db.one("trim_delivery_log", low=batch.low, high=batch.high)[0]
        if deleted != batch.rows:
            raise RangeChanged(
                f"batch {batch.id}: log ids ({batch.low}, {batch.high}] hold {deleted} rows, "
                f"its Parquet {batch.rows}"
            )
        db.execute("trim_message_history")
        db.execute("mark_archive_trimmed", id=batch.id)
    return replace(batch, state="trimmed")


def finish_batch(spark, db: Database, opts: SparkOptions, location: str, batch: Batch) -> Batch:
    for _ in range(_TRIM_ATTEMPTS):
        if batch.state == "planned":
            batch = write_batch(spark, db, opts, location, batch)
        try:
            return trim_batch(db, batch)
        except RangeChanged as exc:
            log.warning("%s; writing the batch again", exc)
            db.execute("replan_archive_batch", id=batch.id)
            batch = replace(batch, state="planned", rows=None)
    raise JobFailed(
        f"archive batch {batch.id} kept changing while it was written; it stays planned and "
        "the next run writes it again"
    )


# -- the job ----------------------------------------------------------------------


def run_archive(
    spark,
    db: Database,
    opts: SparkOptions,
    settings: ArchiveSettings,
    progress: Callable[[str], None] = lambda text: None,
) -> ArchiveResult:
    """Enable archiving, finish an interrupted batch, then archive every due batch."""
    location = prepare(db, settings)
    result = ArchiveResult(location=location)
    with _archive_lock(db):
        state = db.one("archive_state")
        if state is None:
            db.execute("enable_archive", location=location)
            result.enabled_now = True
            progress(f"archiving enabled at {location}: swept messages are kept until archived")
        elif normalize_location(state[0]) != location:  # prepare() saw nothing written there
            db.execute("move_archive", location=location)
            progress(f"archive location {state[0]} had no batch written: now {location}")
        if settings.init_only:
            return result
        started = time.perf_counter()
        batch = unfinished_batch(db)
        if batch is not None:
            progress(f"resuming batch {batch.id} ({batch.state}): log ids ({batch.low}, {batch.high}]")
        while True:
            if batch is None:
                batch = plan_batch(db, settings)
                if batch is None:
                    break
                progress(f"batch {batch.id}: {batch.planned_rows} log rows, ids ({batch.low}, {batch.high}]")
            done = finish_batch(spark, db, opts, location, batch)
            result.batches.append(done)
            progress(f"batch {done.id}: {done.rows} rows archived and trimmed")
            batch = None
        result.seconds = time.perf_counter() - started
    return result
