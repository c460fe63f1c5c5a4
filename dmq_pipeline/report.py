"""``report``: what dmq delivered, per topic and channel, over ``[since, until)``.

Inputs (read once, cached):

* *history*: delivery-log rows acknowledged at or after ``since`` and
  published before ``until``, from PostgreSQL (a partitioned JDBC read), from
  the archive's Parquet (``day`` partitions pruned), or both (deduplicated by
  log id, since a batch is in both between its write and its trim);
* *pending*: copies not yet acknowledged (PostgreSQL only);
* *dead letters* that died in the range (PostgreSQL only).

Tables (every one keyed by topic and channel):

=============== ==================================================================
``summary``      delivered, latency percentiles, attempts, backlog, dead letters
``throughput``   acknowledged deliveries per minute (UTC minute of ``acked_at``)
``latency``      publish -> acknowledge latency in ms: p50, p95, p99 (exact,
                 interpolated like PostgreSQL's ``percentile_cont``), mean, max
``attempts``     deliveries by the attempts they took
``backlog``      published but unacknowledged copies at the end of each minute
                 with a change; the end of the range; the maximum; pending now
``dead_letters`` dead letters by reason, and how many were replayed
=============== ==================================================================

Delivered figures count copies acknowledged in the range; latency is
``acked_at - published_at``. Backlog at minute *m* is the copies published at
or before *m* and not acknowledged by then.
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import datetime, timezone
from dataclasses import dataclass, field
from typing import Callable

from .archive import read_archive
from .database import Database
from .jdbc import IdRange, read_query
from .options import ReportSettings, SparkOptions, TimeRange
from .session import ensure_utc

__all__ = ["TABLES", "ReportResult", "validate", "load_inputs", "aggregate", "build_tables", "run_report"]

TABLES = ("summary", "throughput", "latency", "attempts", "backlog", "dead_letters")
PERCENTILES = (0.5, 0.95, 0.99)
NO_CHANNEL = ""  # dead letters that died before fan-out have no channel


@dataclass
class ReportResult:
    out: str
    range: TimeRange
    source: str
    tables: dict[str, list[dict]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0


def validate(db: Database, settings: ReportSettings) -> None:
    """Unknown topic or channel: a usage error before anything runs."""
    db.check_topic_channel(settings.topic, settings.channel)


@dataclass
class Inputs:
    history: object
    pending: object | None
    dead_letters: object | None


def _filters(settings: ReportSettings, span: TimeRange) -> dict:
    return {
        "since": span.since,
        "until": span.until,
        "topic": settings.topic or None,
        "channel": settings.channel or None,
    }


def load_inputs(spark, db: Database, opts: SparkOptions, settings: ReportSettings, span: TimeRange) -> Inputs:
    from pyspark.sql import functions as F

    params = _filters(settings, span)
    source = settings.resolved_source()
    columns = ["id", "topic", "channel", "published_at", "acked_at", "attempts"]
    parts = []
    if source in ("pg", "both"):
        count, low, high = db.one("report_log_bounds", **params)
        if count:
            parts.append(read_query(spark, db, opts, "jdbc_report_log", params, ids=IdRange(low, high),
                                    column="ack_batch"))
    if source in ("archive", "both"):
        archived = _read_archive(spark, settings.archive)
        if archived is not None:
            archived = archived.where(
                (F.col("day") >= F.lit(span.since.date()))
                & (F.col("acked_at") >= F.lit(span.since))
                & (F.col("published_at") < F.lit(span.until))
            )
            if settings.topic:
                archived = archived.where(F.col("topic") == settings.topic)
            if settings.channel:
                archived = archived.where(F.col("channel") == settings.channel)
            parts.append(archived.select(*columns))
    if not parts:
        history = spark.createDataFrame([], _history_schema())
    else:
        history = parts[0].select(*columns)
        for part in parts[1:]:
            history = history.unionByName(part.select(*columns))
        if len(parts) > 1:
            history = history.dropDuplicates(["id"])
    pending = None
    dead = None
    if source != "archive":
        pending = read_query(spark, db, opts, "jdbc_report_pending", params, partitions=1)
        dead = read_query(spark, db, opts, "jdbc_report_dead_letters", params, partitions=1)
    return Inputs(history=history, pending=pending, dead_letters=dead)


def _history_schema():
    from pyspark.sql import types as T

    return T.StructType([
        T.StructField("id", T.LongType()),
        T.StructField("topic", T.StringType()),
        T.StructField("channel", T.StringType()),
        T.StructField("published_at", T.TimestampType()),
        T.StructField("acked_at", T.TimestampType()),
        T.StructField("attempts", T.IntegerType()),
    ])


def _read_archive(spark, location: str):
    from pyspark.errors import AnalysisException

    try:
        return read_archive(spark, location)
    except AnalysisException:
        return None  # nothing archived yet


def aggregate(inputs: Inputs, span: TimeRange) -> dict[str, list[dict]]:
    """The Spark side: a few small aggregates, collected (one pass over the history
    for the per-minute counts, one for the latency percentiles)."""
    from pyspark.sql import functions as F

    key = ["topic", "channel"]
    history = inputs.history
    in_range = F.col("acked_at") < F.lit(span.until)
    minute = lambda col: F.date_trunc("minute", col)  # noqa: E731
    # every copy is published once and, if acknowledged in the range, acknowledged once
    events = (
        history.select(*key, F.explode(F.array(
            F.struct(F.lit("published").alias("kind"), minute("published_at").alias("minute"),
                     F.lit(0).alias("attempts")),
            F.struct(F.lit("acked").alias("kind"),
                     F.when(in_range, minute("acked_at")).alias("minute"),
                     F.col("attempts").alias("attempts")),
        )).alias("e"))
        .where(F.col("e.minute").isNotNull())
        .groupBy(*key, "e.kind", "e.minute", "e.attempts")
        .agg(F.count(F.lit(1)).alias("n"))
    )
    latency_ms = (F.unix_micros("acked_at") - F.unix_micros("published_at")) / F.lit(1000.0)
    pct = F.expr(f"percentile(latency_ms, array({', '.join(map(str, PERCENTILES))}))")
    latency = (
        history.where(in_range).withColumn("latency_ms", latency_ms)
        .groupBy(*key)
        .agg(F.count(F.lit(1)).alias("delivered"), pct.alias("p"), F.avg("latency_ms").alias("mean_ms"),
             F.max("latency_ms").alias("max_ms"))
        .select(*key, "delivered", F.col("p")[0].alias("p50_ms"), F.col("p")[1].alias("p95_ms"),
                F.col("p")[2].alias("p99_ms"), "mean_ms", "max_ms")
    )
    frames = {"events": events, "latency": latency}
    if inputs.pending is not None:
        frames["pending"] = inputs.pending.groupBy(*key, minute("published_at").alias("minute")).agg(
            F.count(F.lit(1)).alias("n"), F.min("published_at").alias("oldest")
        )
    if inputs.dead_letters is not None:
        frames["dead_letters"] = inputs.dead_letters.groupBy(*key, "reason").agg(
            F.count(F.lit(1)).alias("dead_letters"), F.count("replayed_at").alias("replayed")
        )
    return {name: [_utc(r.asDict()) for r in frame.collect()] for name, frame in frames.items()}


def build_tables(parts: dict[str, list[dict]], span: TimeRange) -> dict[str, list[dict]]:
    """The driver side: the report's tables from the collected aggregates."""
    throughput: dict[tuple, int] = defaultdict(int)
    attempts: dict[tuple, int] = defaultdict(int)
    deltas: dict[tuple, dict] = defaultdict(lambda: defaultdict(int))
    for e in parts["events"]:
        k = (e["topic"], e["channel"])
        if e["kind"] == "published":
            deltas[k][e["minute"]] += e["n"]
        else:
            deltas[k][e["minute"]] -= e["n"]
            throughput[k + (e["minute"],)] += e["n"]
            attempts[k + (e["attempts"],)] += e["n"]
    pending: dict[tuple, list] = {}
    for p in parts.get("pending", []):
        k = (p["topic"], p["channel"])
        deltas[k][p["minute"]] += p["n"]
        count, oldest = pending.get(k, (0, None))
        pending[k] = (count + p["n"], p["oldest"] if oldest is None else min(oldest, p["oldest"]))

    start = span.since.replace(second=0, microsecond=0)
    series, backlog = [], []
    for k in sorted(deltas):
        by_minute = deltas[k]
        by_minute[start] += 0  # every series starts at the range's first minute
        level, points = 0, []
        for m in sorted(by_minute):
            level += by_minute[m]
            if m >= start:
                points.append(level)
                series.append({"topic": k[0], "channel": k[1], "minute": m, "backlog": level})
        count, oldest = pending.get(k, (0, None))
        backlog.append({
            "topic": k[0], "channel": k[1], "backlog_at_end": points[-1], "max_backlog": max(points),
            "pending_now": count, "oldest_pending_published_at": oldest,
        })
    tables = {
        "throughput": [{"topic": k[0], "channel": k[1], "minute": k[2], "acked": n}
                       for k, n in sorted(throughput.items())],
        "latency": sorted(parts["latency"], key=lambda r: (r["topic"], r["channel"])),
        "attempts": [{"topic": k[0], "channel": k[1], "attempts": k[2], "deliveries": n}
                     for k, n in sorted(attempts.items())],
        "backlog": backlog,
        "backlog_series": series,
    }
    if "dead_letters" in parts:
        tables["dead_letters"] = sorted(
            parts["dead_letters"], key=lambda r: (r["topic"], r["channel"], r["reason"])
        )
    return tables


def _utc(row: dict) -> dict:
    """Spark hands timestamps back naive in the process's zone; make them aware UTC."""
    for key, value in row.items():
        if isinstance(value, datetime) and value.tzinfo is None:
            row[key] = datetime.fromtimestamp(value.timestamp(), timezone.utc)
    return row


def _summary(tables: dict[str, list[dict]]) -> list[dict]:
    """One row per topic and channel, joined on the driver from the collected tables."""
    rows: dict[tuple, dict] = {}

    def row(r: dict) -> dict:
        return rows.setdefault((r["topic"], r["channel"]), {
            "topic": r["topic"], "channel": r["channel"], "delivered": 0, "p50_ms": None,
            "p95_ms": None, "p99_ms": None, "mean_attempts": None, "redelivered": 0,
            "backlog_at_end": None, "max_backlog": None, "dead_letters": 0,
        })

    for r in tables["latency"]:
        row(r).update({k: r[k] for k in ("delivered", "p50_ms", "p95_ms", "p99_ms")})
    totals: dict[tuple, list[int]] = {}
    for r in tables["attempts"]:
        t = totals.setdefault((r["topic"], r["channel"]), [0, 0, 0])
        t[0] += r["deliveries"]
        t[1] += r["attempts"] * r["deliveries"]
        t[2] += r["deliveries"] if r["attempts"] > 1 else 0
    for k, (n, total, again) in totals.items():
        row({"topic": k[0], "channel": k[1]}).update(
            mean_attempts=total / n if n else None, redelivered=again
        )
    for r in tables["backlog"]:
        row(r).update(backlog_at_end=r["backlog_at_end"], max_backlog=r["max_backlog"])
    for r in tables.get("dead_letters", []):
        row(r)["dead_letters"] += r["dead_letters"]
    return [rows[k] for k in sorted(rows)]


def run_report(
    spark,
    db: Database,
    opts: SparkOptions,
    settings: ReportSettings,
    span: TimeRange,
    progress: Callable[[str], None] = lambda text: None,
) -> ReportResult:
    """Compute every table, write Parquet, CSV, charts and ``report.html`` under ``--out``."""
    from pyspark import StorageLevel

    from . import report_output

    started = time.perf_counter()
    ensure_utc(spark)
    inputs = load_inputs(spark, db, opts, settings, span)
    inputs.history = inputs.history.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        parts = aggregate(inputs, span)
    finally:
        inputs.history.unpersist()
    tables = build_tables(parts, span)
    tables["summary"] = _summary(tables)
    progress(f"figures computed in {time.perf_counter() - started:.1f} s")
    result = ReportResult(out=settings.out, range=span, source=settings.resolved_source(), tables=tables)
    result.files = report_output.write_all(result)
    result.seconds = time.perf_counter() - started
    progress(f"report written in {result.seconds:.1f} s")
    return result
