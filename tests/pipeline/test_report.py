"""report: its figures equal the same figures computed independently in SQL."""

from __future__ import annotations

import csv
from datetime import datetime, timedelta, timezone

import pytest

from dmq_pipeline import archive, cli, report
from dmq_pipeline.options import ArchiveSettings, ReportSettings, time_range

from .conftest import insert_dead_letter, make_traffic, sql


def add_dead_letters(pg_dsn: str, now: datetime) -> None:
    """Dead letters inserted directly (the server does not produce them yet)."""
    rows = [("max_attempts", "orders", "billing")] * 4 + [("expired", "orders", "shipping")] * 2 + [
        ("rate_limited", "orders", None)
    ] * 3
    for i, (reason, topic, channel) in enumerate(rows):
        insert_dead_letter(pg_dsn, reason=reason, detail="test", topic=topic, channel=channel,
            session_id=i, attempts=3, body=b"x", dead_at=now - timedelta(minutes=1),
            replayed_at=now if i == 0 else None)
    # outside the range: must not be counted
    insert_dead_letter(pg_dsn, reason="expired", detail="old", topic="orders", channel="billing",
        session_id=99, attempts=1, body=b"x", dead_at=now - timedelta(days=3), replayed_at=None)


def expected_figures(pg_dsn: str, since: datetime, until: datetime) -> dict:
    r = {"since": since, "until": until}
    return {
        "throughput": [tuple(x) for x in sql(pg_dsn, "expected_throughput", **r)],
        "latency": sql(pg_dsn, "expected_latency", **r),
        "attempts": [tuple(x) for x in sql(pg_dsn, "expected_attempts", **r)],
        "backlog_series": [tuple(x) for x in sql(pg_dsn, "expected_backlog_series", **r)],
        "pending": sql(pg_dsn, "expected_pending"),
        "dead_letters": [tuple(x) for x in sql(pg_dsn, "expected_dead_letters", **r)],
    }


def assert_matches(result, want: dict) -> None:
    t = result.tables
    assert [(r["topic"], r["channel"], r["minute"], r["acked"]) for r in t["throughput"]] == want["throughput"]
    assert [(r["topic"], r["channel"], r["attempts"], r["deliveries"]) for r in t["attempts"]] == want["attempts"]
    latency = {(r["topic"], r["channel"]): r for r in t["latency"]}
    assert sorted(latency) == [(w[0], w[1]) for w in want["latency"]]
    for topic, channel, delivered, pct, max_ms in want["latency"]:
        got = latency[(topic, channel)]
        assert got["delivered"] == delivered
        assert [got["p50_ms"], got["p95_ms"], got["p99_ms"]] == pytest.approx(pct, rel=1e-9)
        assert got["max_ms"] == pytest.approx(max_ms, rel=1e-9)
    series = [(r["topic"], r["channel"], r["minute"], r["backlog"]) for r in t["backlog_series"]]
    assert series == want["backlog_series"]
    pending = {(r["topic"], r["channel"]): r["pending_now"] for r in t["backlog"]}
    assert {k: v for k, v in pending.items() if v} == {(a, b): n for a, b, n in want["pending"]}
    assert [(r["topic"], r["channel"], r["reason"], r["dead_letters"], r["replayed"])
            for r in t["dead_letters"]] == want["dead_letters"]


def test_report_figures_equal_sql(spark, make_server, topic, pg_dsn, db, opts, tmp_path):
    """Throughput per minute, latency p50/p95/p99, attempts, backlog and dead letters by
    reason, read from PostgreSQL with partitioned JDBC reads, equal SQL's own answers; the
    summary adds them up and the outputs (Parquet, CSV, PNG, HTML) are written."""
    server = make_server()
    traffic = make_traffic(server, pg_dsn)
    now = datetime.now(timezone.utc)
    add_dead_letters(pg_dsn, now)
    span = time_range("1h", (now + timedelta(minutes=1)).isoformat(), now)
    want = expected_figures(pg_dsn, span.since, span.until)
    settings = ReportSettings(out=str(tmp_path / "rep"))

    result = report.run_report(spark, db, opts, settings, span)

    assert_matches(result, want)
    summary = {(r["topic"], r["channel"]): r for r in result.tables["summary"]}
    assert sum(r["delivered"] for r in summary.values()) == traffic.delivered
    assert summary[("orders", "billing")]["redelivered"] == 5
    assert summary[("orders", "billing")]["backlog_at_end"] == traffic.pending
    assert summary[("orders", "")]["dead_letters"] == 3
    out = tmp_path / "rep"
    for name in report.TABLES:
        assert (out / "tables" / f"{name}.parquet").is_dir()
        with open(out / "tables" / f"{name}.csv", newline="") as fh:
            assert len(list(csv.reader(fh))) == len(result.tables[name]) + 1
    assert spark.read.parquet(str(out / "tables" / "latency.parquet")).count() == 3
    charts = sorted(p.name for p in (out / "charts").iterdir())
    assert charts == ["attempts.png", "backlog.png", "dead_letters.png", "latency.png", "throughput.png"]
    assert all((out / "charts" / c).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for c in charts)
    page = (out / "report.html").read_text()
    assert "charts/latency.png" in page and "orders" in page and "billing" in page


def test_report_over_archive_and_database_equals_sql(spark, make_server, topic, pg_dsn, db, opts, tmp_path):
    """With the older part of the history archived and trimmed and the rest still in
    PostgreSQL, a report over both equals SQL's figures over the untrimmed database;
    topic and channel filters narrow it to one channel."""
    server = make_server()
    traffic = make_traffic(server, pg_dsn, n=24)
    now = datetime.now(timezone.utc)
    span = time_range("1h", (now + timedelta(minutes=1)).isoformat(), now)
    want = expected_figures(pg_dsn, span.since, span.until)
    loc = str(tmp_path / "arch")
    first_part = ArchiveSettings(archive=loc, older_than=0.0, batch_rows=30)
    archive.run_archive(None, db, opts, ArchiveSettings(archive=loc, init_only=True))
    batch = archive.plan_batch(db, first_part)
    batch = archive.write_batch(spark, db, opts, archive.normalize_location(loc), batch)
    archive.trim_batch(db, batch)
    # whole acknowledgement batches, as many as begin within 30 rows: billing's 21, shipping's 24
    assert 30 <= batch.rows < traffic.delivered
    assert sql(pg_dsn, "counts")[0][2] == traffic.delivered - batch.rows

    both = report.run_report(spark, db, opts, ReportSettings(archive=loc, out=str(tmp_path / "r1")), span)

    assert both.source == "both"
    assert_matches(both, want)
    only = report.run_report(
        spark, db, opts,
        ReportSettings(archive=loc, topic="orders", channel="billing", out=str(tmp_path / "r2")), span,
    )
    assert [(r["topic"], r["channel"]) for r in only.tables["summary"]] == [("orders", "billing")]
    billing = next(r for r in both.tables["summary"] if r["channel"] == "billing")
    assert only.tables["summary"][0]["delivered"] == billing["delivered"]


def test_report_after_everything_is_archived_equals_sql(spark, make_server, topic, pg_dsn, db, opts, tmp_path):
    """With every delivered row archived and trimmed, figures computed from the archive equal SQL's figures over the same rows
    computed before they were trimmed from PostgreSQL."""
    server = make_server()
    make_traffic(server, pg_dsn, n=30)
    now = datetime.now(timezone.utc)
    span = time_range("1h", (now + timedelta(minutes=1)).isoformat(), now)
    want = expected_figures(pg_dsn, span.since, span.until)
    loc = str(tmp_path / "arch")
    archive.run_archive(spark, db, opts, ArchiveSettings(archive=loc, older_than=0.0))
    assert sql(pg_dsn, "counts")[0][2] == 0

    result = report.run_report(
        spark, db, opts, ReportSettings(archive=loc, source="both", out=str(tmp_path / "rep")), span
    )

    t = result.tables
    assert [(r["topic"], r["channel"], r["minute"], r["acked"]) for r in t["throughput"]] == want["throughput"]
    assert [(r["topic"], r["channel"], r["attempts"], r["deliveries"]) for r in t["attempts"]] == want["attempts"]
    for topic_, channel, delivered, pct, _ in want["latency"]:
        got = next(r for r in t["latency"] if (r["topic"], r["channel"]) == (topic_, channel))
        assert got["delivered"] == delivered
        assert [got["p50_ms"], got["p95_ms"], got["p99_ms"]] == pytest.approx(pct, rel=1e-9)
    series = [(r["topic"], r["channel"], r["minute"], r["backlog"]) for r in t["backlog_series"]]
    assert series == want["backlog_series"]


def test_report_command_writes_the_report(spark, make_server, topic, pg_dsn, tmp_path, capsys):
    """`dmq-pipeline report` (in this process, reusing the session) prints the summary and
    writes report.html with its charts and tables."""
    server = make_server()
    make_traffic(server, pg_dsn, n=12)
    until = (datetime.now(timezone.utc) + timedelta(minutes=1)).isoformat()
    code = cli.main(["report", "--pg-dsn", pg_dsn, "--since", "2h", "--until", until,
                     "--out", str(tmp_path / "rep"), "--partitions", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "orders / billing" in out and "report.html" in out
    assert (tmp_path / "rep" / "report.html").is_file()
    assert (tmp_path / "rep" / "charts" / "throughput.png").is_file()
