"""Pipeline benchmark: archive and report over 1,000,000 delivery-log rows on local[2].

    python bench/pipeline.py                    # 1,000,000 rows, local[2]
    python bench/pipeline.py --rows 200000 --partitions 4 --json out.json

Steps, on a private PostgreSQL (fsync on, as in production) in a temporary directory:

1. fill: synthetic history shaped as the server writes it (messages with 128-byte
   bodies, one log row per message and channel, some redeliveries, a backlog, dead
   letters), ``--rows`` log rows;
2. report: ``dmq-pipeline report`` over all of it, timed from process start to exit
   (JVM start included; target < 60 s);
3. ceiling: the archive's own query (log rows joined with their messages) exported
   with PostgreSQL COPY through psycopg to a file, binary and text;
4. archive: ``dmq-pipeline archive`` of all of it (Parquet written, log trimmed); its
   rows/s (job time, JVM start excluded) against the COPY ceiling (target: within 3x),
   and the wall time with JVM start;
5. archive, steady state (``--warm``, default on): the log refilled twice and archived twice
   by one SparkSession in this process, the second run reported (JIT-compiled JVM, as
   the later batches of a long archive run).

Needs the pipeline extra and the JDBC jar (see docs/pipeline.md). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dmq_server.db.embedded import EmbeddedPostgres  # noqa: E402
from dmq_server.db.schema import migrate
from dmq_server.db.worker import connect
from dmq_sql import load_queries  # noqa: E402
from dmq_pipeline.database import Database  # noqa: E402

import registry  # noqa: E402

SQL = load_queries((Path(__file__).parent / "pipeline.sql").read_text())
START = datetime(2024, 5, 1, 10, 0, tzinfo=timezone.utc)
SPAN = timedelta(hours=2)


def fill(dsn: str, rows: int) -> dict:
    messages = rows * 4 // 7 + 2  # orders has 2 channels, audit 1: 7 copies per 4 messages
    started = time.perf_counter()
    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
        registry.add_channel(conn, "orders", "billing")
        registry.add_channel(conn, "orders", "shipping")
        registry.create_topic(conn, "audit")
        registry.add_channel(conn, "audit", "archive")
        spacing = SPAN.total_seconds() * 1000 / messages
        conn.execute(SQL["fill_owner"])
        conn.execute(SQL["fill_messages"], {"messages": messages, "start": START, "spacing_ms": spacing})
        conn.execute(SQL["fill_log"], {"rows": rows})
        conn.execute(SQL["fill_pending"], {"messages": messages, "pending": 1000})
        conn.execute(SQL["fill_dead_letters"], {"start": START, "dead": 2000})
        conn.execute(SQL["analyze"])
        count, first, last = conn.execute(SQL["log_count"]).fetchone()
    return {"log_rows": count, "messages": messages, "first": first, "last": last,
            "fill_s": time.perf_counter() - started}


def copy_ceiling(dsn: str, out_dir: Path, fmt: str) -> dict:
    db = Database(dsn)
    high = 2**62  # every row
    dbtable = db.render("jdbc_archive_rows", low=0, high=high)
    path = out_dir / f"copy.{fmt}"
    started = time.perf_counter()
    size = 0
    with open(path, "wb") as fh, db.conn.cursor() as cur:
        with cur.copy(SQL["copy_out"].format(dbtable=dbtable, format=fmt)) as copy:
            for chunk in copy:
                fh.write(chunk)
                size += len(chunk)
    seconds = time.perf_counter() - started
    db.close()
    path.unlink()
    return {"format": fmt, "seconds": seconds, "bytes": size}


def run_cli(args: list[str]) -> tuple[float, dict]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dmq_pipeline.cli", *args, "--json"],
                          capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"dmq-pipeline {' '.join(args[:1])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, json.loads(proc.stdout)


def refill(dsn: str, rows: int) -> None:
    with connect(dsn, autocommit=True) as conn:
        conn.execute(SQL["fill_log"], {"rows": rows})
        conn.execute(SQL["analyze"])


def warm_archive(dsn: str, args: argparse.Namespace, base: Path, ceiling: float) -> dict:
    """Two archives of ``--rows`` log rows by one SparkSession; the second one's figures."""
    from dmq_pipeline import archive
    from dmq_pipeline.options import ArchiveSettings, SparkOptions
    from dmq_pipeline.session import spark_session

    opts = SparkOptions(pg_dsn=dsn, master=args.master, partitions=args.partitions, spark_conf=tuple(args.conf))
    settings = ArchiveSettings(archive=str(base / "archive"), older_than=0.0)
    db = Database(dsn)
    runs = []
    with spark_session(opts, "bench") as spark:
        for _ in range(2):
            refill(dsn, args.rows)
            result = archive.run_archive(spark, db, opts, settings)
            runs.append((result.rows, result.seconds))
            print(f"  in-process archive: {result.rows:,} rows in {result.seconds:.1f} s "
                  f"({result.rows_per_second:,.0f} rows/s)", flush=True)
    db.close()
    rows, seconds = runs[-1]
    return {"job_s": round(seconds, 1), "rows": rows, "rows_per_s": round(rows / seconds),
            "ceiling_ratio": round(ceiling / (rows / seconds), 2), "first_run_s": round(runs[0][1], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--no-warm", dest="warm", action="store_false", help="skip step 5")
    parser.add_argument("--no-report", dest="report", action="store_false", help="skip step 2")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="Spark setting for every job (repeatable), as dmq-pipeline --conf")
    args = parser.parse_args()
    for setting in args.conf:
        if not setting.partition("=")[0].strip() or "=" not in setting:
            parser.error(f"--conf {setting!r}: expected KEY=VALUE")

    base = Path(tempfile.mkdtemp(prefix="dmq-bench-pipeline-"))
    base.chmod(0o755)
    pg = EmbeddedPostgres(base / "data", settings={"max_wal_size": "4GB", "shared_buffers": "512MB"})
    results: dict = {"rows": args.rows, "master": args.master, "partitions": args.partitions,
                     "machine": f"{platform.node()} {os.cpu_count()} cpus, {platform.python_version()}"}
    try:
        dsn = pg.start()
        migrate(dsn)
        print(f"filling {args.rows:,} delivery-log rows ...", flush=True)
        filled = fill(dsn, args.rows)
        results["fill_s"] = round(filled["fill_s"], 1)
        common = ["--pg-dsn", dsn, "--master", args.master, "--partitions", str(args.partitions)]
        for setting in args.conf:
            common += ["--conf", setting]
        results["conf"] = list(args.conf)
        span = ["--since", (filled["first"] - timedelta(minutes=1)).isoformat(),
                "--until", (filled["last"] + timedelta(minutes=1)).isoformat()]

        if args.report:
            print("report (JVM start included) ...", flush=True)
            wall, rep = run_cli(["report", *common, *span, "--out", str(base / "report")])
            delivered = sum(r["delivered"] for r in rep["summary"])
            results["report"] = {"wall_s": round(wall, 1), "job_s": rep["seconds"], "delivered": delivered}
            print(f"  {delivered:,} rows: {wall:.1f} s wall, {rep['seconds']:.1f} s in the job", flush=True)

        for fmt in ("binary", "text"):
            ceiling = copy_ceiling(dsn, base, fmt)
            rate = filled["log_rows"] / ceiling["seconds"]
            results[f"copy_{fmt}"] = {"seconds": round(ceiling["seconds"], 2), "rows_per_s": round(rate),
                                      "mb": round(ceiling["bytes"] / 1e6, 1)}
            print(f"COPY {fmt}: {ceiling['seconds']:.2f} s, {rate:,.0f} rows/s, "
                  f"{ceiling['bytes'] / 1e6:.0f} MB", flush=True)

        print("archive ...", flush=True)
        wall, arc = run_cli(["archive", *common, "--archive", str(base / "archive"), "--older-than", "0s"])
        results["archive"] = {"wall_s": round(wall, 1), "job_s": arc["seconds"], "rows": arc["rows"],
                              "rows_per_s": arc["rows_per_second"]}
        best = max(results["copy_binary"]["rows_per_s"], results["copy_text"]["rows_per_s"])
        results["archive"]["ceiling_ratio"] = round(best / arc["rows_per_second"], 2)
        print(f"  {arc['rows']:,} rows: {arc['seconds']:.1f} s in the job ({arc['rows_per_second']:,.0f} "
              f"rows/s, {results['archive']['ceiling_ratio']}x below the COPY ceiling), {wall:.1f} s wall",
              flush=True)
        if args.warm:
            results["archive_warm"] = warm_archive(dsn, args, base, best)
    finally:
        pg.stop(mode="fast")
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
