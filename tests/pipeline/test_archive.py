"""archive: Parquet holds every delivered row once, PostgreSQL is trimmed, crashes resume."""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest

import pyarrow.parquet as pq
from pyspark.sql import types as T

from dmq_pipeline import archive, report
from dmq_pipeline.archive import archive_schema, dataset_path
from dmq_pipeline.options import ArchiveSettings, ReportSettings, TimeRange

from .conftest import as_spark, make_traffic, sql
from tests.integration.support import wait_for


def archived(spark, location: str) -> list:
    return archive.read_archive(spark, location).orderBy("id").collect()


def give_properties(pg_dsn: str, message_ids) -> dict[int, tuple]:
    """Properties for the messages, by turns: key, priority and headers; a key alone; none
    (as the server stores a send's: the archive reads what the tables hold). What each has."""
    given = {}
    for n, message_id in enumerate(sorted(set(message_ids))):
        if n % 3 == 0:
            given[message_id] = (f"order-{n}", n % 10, {"content-type": "text/plain", "n": str(n)})
        elif n % 3 == 1:
            given[message_id] = (f"order-{n}", 0, None)
        else:
            given[message_id] = (None, 0, None)
    ids = list(given)
    changed = sql(pg_dsn, "set_message_properties", ids=ids, keys=[given[i][0] for i in ids],
                  priorities=[given[i][1] for i in ids],
                  headers=[None if given[i][2] is None else json.dumps(given[i][2]) for i in ids])
    assert changed == [(len(ids),)]
    return given


def settings(location) -> ArchiveSettings:
    return ArchiveSettings(archive=str(location), older_than=0.0)


def test_archive_writes_log_rows_with_messages_and_trims(spark, make_server, topic, pg_dsn, db, opts, tmp_path):
    """Every delivery-log row lands in Parquet once, with its message, partitioned by
    topic/day/batch; the log is emptied and pending copies are untouched."""
    server = make_server()
    traffic = make_traffic(server, pg_dsn)
    given = give_properties(pg_dsn, (e[1] for e in sql(pg_dsn, "log_rows")))
    expected = sql(pg_dsn, "log_rows")
    assert len(expected) == traffic.delivered
    assert any(e[12] for e in expected) and any(e[10] and not e[12] for e in expected)
    archived_high = sql(pg_dsn, "log_batches")[-1][0]  # the batch's range ends at the last ack batch

    result = archive.run_archive(spark, db, opts, settings(tmp_path / "arch"))

    assert result.rows == traffic.delivered and result.missing_messages == 0
    rows = archived(spark, str(tmp_path / "arch"))
    got = [(r.id, r.message_id, r.topic, r.channel, r.attempts, r.published_at, r.acked_at,
            r.producer, r.session_id, bytes(r.body), r.key, r.priority, r.headers) for r in rows]
    assert got == [tuple(as_spark(v) for v in e[:9]) + (bytes(e[9]),) + e[10:] for e in expected]
    assert [r.message_id for r in rows if r.headers and r.headers["n"] == "3"] == [
        e[1] for e in expected if given[e[1]][2] and given[e[1]][2]["n"] == "3"
    ]
    assert {r.day for r in rows} == {e[6].date() for e in expected}
    assert sorted(p.name for p in (tmp_path / "arch" / "delivery_log").iterdir() if p.is_dir()) == [
        "topic=audit", "topic=orders"
    ]
    assert Counter(r.attempts for r in rows if r.channel == "billing")[2] == 5
    counts = sql(pg_dsn, "counts")[0]
    assert counts[2] == 0, "log trimmed"
    assert counts[1] == traffic.pending, "unacknowledged copies stay"
    assert sql(pg_dsn, "batches") == [(1, 0, archived_high, "trimmed", traffic.delivered, 0)]

    again = archive.run_archive(spark, db, opts, settings(tmp_path / "arch"))
    assert again.rows == 0 and len(archived(spark, str(tmp_path / "arch"))) == traffic.delivered


def test_crash_between_write_and_trim_leaves_exactly_one_copy(spark, make_server, topic, pg_dsn, db, opts, tmp_path):
    """A run that died after writing its batch and before trimming is finished by the
    next run: the batch is trimmed, not written twice, and newer rows follow in a new batch."""
    server = make_server()
    make_traffic(server, pg_dsn, n=20)
    loc = str(tmp_path / "arch")
    prepared = archive.run_archive(spark, db, opts, ArchiveSettings(archive=loc, init_only=True))
    assert prepared.enabled_now
    # the crashed run: planned and written, never trimmed
    batch = archive.plan_batch(db, settings(loc))
    written = archive.write_batch(spark, db, opts, archive.normalize_location(loc), batch)
    assert sql(pg_dsn, "counts")[0][2] == written.rows, "nothing trimmed yet"
    before = {r.id for r in archived(spark, loc)}
    more = make_traffic(server, pg_dsn, n=8)  # history keeps arriving meanwhile

    result = archive.run_archive(spark, db, opts, settings(loc))

    ids = [r.id for r in archived(spark, loc)]
    assert len(ids) == len(set(ids)), "no row twice"
    assert before < set(ids) and len(ids) == written.rows + more.delivered
    assert [b.id for b in result.batches] == [batch.id, batch.id + 1]
    assert sql(pg_dsn, "log_ids") == []
    assert [s[3] for s in sql(pg_dsn, "batches")] == ["trimmed", "trimmed"]


def test_batch_written_but_not_recorded_is_replaced_not_appended(spark, make_server, topic, pg_dsn, db, opts, tmp_path):
    """A run that died after Spark committed the Parquet but before the batch was marked
    written: the next run writes the batch again over its own files; one copy of each row."""
    server = make_server()
    traffic = make_traffic(server, pg_dsn, n=12)
    loc = str(tmp_path / "arch")
    archive.run_archive(spark, db, opts, ArchiveSettings(archive=loc, init_only=True))
    batch = archive.plan_batch(db, settings(loc))
    archive.write_batch(spark, db, opts, archive.normalize_location(loc), batch)
    db.execute("replan_archive_batch", id=batch.id)  # as if the mark never committed

    archive.run_archive(spark, db, opts, settings(loc))

    ids = [r.id for r in archived(spark, loc)]
    assert len(ids) == len(set(ids)) == traffic.delivered
    assert sql(pg_dsn, "log_ids") == []


def test_late_commits_are_archived_once(spark, make_server, topic, pg_dsn, db, opts, tmp_path):
    """Log rows that commit late (their id taken before the batch was planned) are neither
    lost by the trim nor duplicated: inside a written batch they force a rewrite, below the
    watermark they become a straggler batch."""
    server = make_server()
    traffic = make_traffic(server, pg_dsn, n=12)
    loc = str(tmp_path / "arch")
    archive.run_archive(spark, db, opts, ArchiveSettings(archive=loc, init_only=True))
    batches = sql(pg_dsn, "log_batches")  # one row per acknowledgement batch (schema version 10)
    assert len(batches) >= 2
    (first, first_facts), (middle, middle_facts) = batches[0], batches[len(batches) // 2]
    hidden_first = sql(pg_dsn, "take_log_batch", id=first)[0]
    hidden_middle = sql(pg_dsn, "take_log_batch", id=middle)[0]
    batch = archive.plan_batch(db, settings(loc))
    assert batch.high >= middle
    written = archive.write_batch(spark, db, opts, archive.normalize_location(loc), batch)
    assert written.rows == traffic.delivered - first_facts - middle_facts
    columns = ("id", "first_fact", "acked_at", "low_id", "high_id", "topics", "channels", "message_ids",
               "published_ms", "first_ms", "acked_ms", "attempts", "consumers", "delivered_ms")
    sql(pg_dsn, "put_log_batch", **dict(zip(columns, hidden_middle)))  # commits inside the batch

    archive.run_archive(spark, db, opts, settings(loc))
    middle_ids = {hidden_middle[1] + n for n in range(middle_facts)}  # first_fact and on
    assert middle_ids <= {r.id for r in archived(spark, loc)}
    sql(pg_dsn, "put_log_batch", **dict(zip(columns, hidden_first)))  # commits below the watermark
    result = archive.run_archive(spark, db, opts, settings(loc))

    ids = [r.id for r in archived(spark, loc)]
    assert len(ids) == len(set(ids)) == traffic.delivered
    assert result.rows == first_facts
    assert sql(pg_dsn, "log_ids") == []


def test_swept_messages_keep_their_bodies_in_the_archive(spark, make_server, topic, pg_dsn, db, opts, tmp_path):
    """Once archiving is enabled, a message the server sweeps (retention over) is kept in
    dmq_message_history until archived, so its body reaches Parquet; then it is deleted."""
    loc = str(tmp_path / "arch")
    db.migrate()
    archive.run_archive(None, db, opts, ArchiveSettings(archive=loc, init_only=True))
    server = make_server(message_retention="0s", sweep_interval="100ms")
    traffic = make_traffic(server, pg_dsn, n=12)
    # everything fully acknowledged is swept; the three pending billing copies keep theirs
    wait_for(lambda: sql(pg_dsn, "counts")[0][0] == 3, timeout=20)
    assert sql(pg_dsn, "counts")[0][3] == traffic.sent - 3
    given = give_properties(pg_dsn, (i for (i,) in sql(pg_dsn, "message_ids")))

    result = archive.run_archive(spark, db, opts, settings(loc))

    assert result.rows == traffic.delivered and result.missing_messages == 0
    rows = archived(spark, loc)
    assert all(r.body is not None and r.producer for r in rows)
    assert any(r.headers for r in rows if r.topic == "audit") and any(r.key for r in rows if r.topic == "orders")
    assert all((r.key, r.priority, r.headers) == given[r.message_id] for r in rows)
    assert {bytes(r.body) for r in rows if r.topic == "audit"} == {f"audit-{i:04d}".encode() for i in range(3)}
    assert sql(pg_dsn, "counts")[0][3] == 0, "kept messages released once archived"


def test_other_archive_location_is_refused(spark, make_server, topic, pg_dsn, db, opts, tmp_path):
    """One database has one archive once a batch is written there: another location is a
    usage error that changes nothing; the same one spelled as a file: URI is the same."""
    server = make_server()
    make_traffic(server, pg_dsn, n=8)
    archive.run_archive(spark, db, opts, settings(tmp_path / "a"))
    make_traffic(server, pg_dsn, n=8)
    with pytest.raises(archive.UsageError, match="archived to"):
        archive.run_archive(spark, db, opts, settings(tmp_path / "b"))
    assert sql(pg_dsn, "counts")[0][2] > 0, "nothing archived"
    again = archive.run_archive(spark, db, opts, settings(f"file://{tmp_path / 'a'}"))
    assert again.rows > 0 and again.location == str(tmp_path / "a")


def test_location_binds_only_once_a_batch_is_written(make_server, topic, pg_dsn, db, opts, tmp_path):
    """Archiving enabled at one location (or a first run that failed before writing)
    does not bind it: a run to another location moves it there."""
    db.migrate()
    archive.run_archive(None, db, opts, ArchiveSettings(archive=str(tmp_path / "a"), init_only=True))
    moved = archive.run_archive(None, db, opts, ArchiveSettings(archive=str(tmp_path / "b"), init_only=True))
    assert moved.location == str(tmp_path / "b")
    assert db.one("archive_state")[0] == str(tmp_path / "b")


def test_archive_files_without_properties_are_read_with_the_new_ones(spark, make_server, topic, pg_dsn, db, opts,
                                                                      tmp_path):
    """Parquet written before schema version 16 has no key, priority or headers: read with
    the files written since (read_archive, the report), its messages have no properties
    (priority 0), and the report counts their rows."""
    loc = str(tmp_path / "arch")
    old_schema = T.StructType([f for f in archive_schema().fields if f.name not in ("key", "priority", "headers")])
    acked = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(minutes=5)
    old_row = (10**9, 10**9, "billing", acked, acked, acked, 1, "old-producer", 1, acked, "old-node", b"old",
               "orders", acked.date(), 0)
    (spark.createDataFrame([old_row], old_schema).write.partitionBy("topic", "day", "batch")
     .parquet(dataset_path(loc)))
    old_files = list((tmp_path / "arch").rglob("batch=0/*.parquet"))
    assert old_files and "key" not in pq.read_schema(old_files[0]).names
    server = make_server()
    traffic = make_traffic(server, pg_dsn, n=8)
    given = give_properties(pg_dsn, (e[1] for e in sql(pg_dsn, "log_rows")))

    archive.run_archive(spark, db, opts, settings(loc))

    rows = archived(spark, loc)
    assert len(rows) == traffic.delivered + 1
    assert [(r.producer, r.key, r.priority, r.headers) for r in rows if r.batch == 0] == [
        ("old-producer", None, 0, None)
    ]
    assert all((r.key, r.priority, r.headers) == given[r.message_id] for r in rows if r.batch != 0)
    span = TimeRange(acked - timedelta(hours=1), datetime.now(timezone.utc) + timedelta(minutes=1))
    result = report.run_report(spark, db, opts, ReportSettings(archive=loc, source="archive",
                                                               out=str(tmp_path / "rep")), span)
    delivered = {(r["topic"], r["channel"]): r["delivered"] for r in result.tables["summary"]}
    assert delivered[("orders", "billing")] == 8 - 3 + 1  # three left unacknowledged, one old row
