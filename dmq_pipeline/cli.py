"""``dmq-pipeline``: the data pipeline's command line (archive, report, replay, reinject).

Every command checks its arguments, the JDBC jar and the database before it
changes anything or starts Spark, so a bad invocation costs no JVM start and
leaves the database as it was. Exit status: 0 done; 1 the job failed or some
dead letters could not be replayed (a re-run resumes); 2 bad arguments or a
missing prerequisite; 3 the database cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from contextlib import ExitStack
from typing import Sequence

from dmq_client.pipes import quiet_broken_pipe

from . import archive, reinject, report, replay, ship
from .cluster import check_location, check_reachable
from .database import Database, dsn_host, locate
from .errors import PipelineError, UsageError
from .failures import explain, is_spark_error
from .options import (
    ArchiveSettings,
    ReinjectSettings,
    ReplaySettings,
    ReportSettings,
    SparkOptions,
    add_arguments,
    from_args,
    time_range,
)
from .session import spark_session

__all__ = ["main", "build_parser"]

PROG = "dmq-pipeline"


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def _check_cluster(opts: SparkOptions, server: str | None = None) -> None:
    """Refuse, before anything runs, addresses the executors of a cluster cannot use."""
    check_reachable(opts.master, db_host=dsn_host(opts.pg_dsn) if opts.pg_dsn else None,
                    embedded=not opts.pg_dsn, server=server)


def _open_database(stack: ExitStack, opts: SparkOptions) -> Database:
    db = stack.enter_context(locate(opts.pg_dsn, opts.data_path))
    if db.schema_version() < 1:
        raise UsageError("the database has no dmq schema: start dmq-server on it or run `dmq db migrate`")
    return db


def cmd_archive(args: argparse.Namespace) -> int:
    opts = from_args(SparkOptions, args).validate()
    settings = from_args(ArchiveSettings, args).validate()
    if not settings.init_only:  # --init-only starts no Spark
        check_location(opts.master, settings.archive, settings.archive_shared, "--archive")
        _check_cluster(opts)
    with ExitStack() as stack:
        db = _open_database(stack, opts)
        location = archive.prepare(db, settings)
        db.migrate()
        if settings.init_only or not archive.anything_due(db, settings):
            result = archive.run_archive(None, db, opts, settings, _say)  # no JVM needed
        else:
            spark = stack.enter_context(spark_session(opts, "archive", _say))
            result = archive.run_archive(spark, db, opts, settings, _say)
    if args.json:
        print(json.dumps({
            "location": location, "enabled_now": result.enabled_now, "rows": result.rows,
            "missing_messages": result.missing_messages, "seconds": round(result.seconds, 3),
            "rows_per_second": round(result.rows_per_second, 1),
            "batches": [{"id": b.id, "low_id": b.low, "high_id": b.high, "rows": b.rows} for b in result.batches],
        }, indent=2))
    elif settings.init_only:
        print(f"archiving enabled at {location}" if result.enabled_now else f"archiving was already enabled at {location}")
    elif not result.batches:
        print(f"nothing to archive (archive at {location})")
    else:
        print(
            f"archived {result.rows:,} delivery-log rows in {len(result.batches)} batch(es) to "
            f"{location} in {result.seconds:.1f} s ({result.rows_per_second:,.0f} rows/s)"
        )
        if result.missing_messages:
            print(
                f"note: {result.missing_messages:,} rows were archived without their message "
                "(swept before archiving was enabled); their body columns are empty"
            )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    opts = from_args(SparkOptions, args).validate()
    settings = from_args(ReportSettings, args).validate()
    span = time_range(settings.since, settings.until)
    if settings.resolved_source() in ("archive", "both"):
        check_location(opts.master, settings.archive, settings.archive_shared, "--archive")
    _check_cluster(opts)
    with ExitStack() as stack:
        db = _open_database(stack, opts)
        report.validate(db, settings)
        db.migrate()
        spark = stack.enter_context(spark_session(opts, "report", _say))
        result = report.run_report(spark, db, opts, settings, span, _say)
    summary = result.tables["summary"]
    if args.json:
        print(json.dumps({"out": result.out, "range": [span.since.isoformat(), span.until.isoformat()],
                          "source": result.source, "seconds": round(result.seconds, 3),
                          "summary": summary}, indent=2, default=str))
        return 0
    print(f"report {span} from {result.source}, {result.seconds:.1f} s")
    print(f"{'topic / channel':<32} {'delivered':>10} {'p50 ms':>9} {'p95 ms':>9} {'p99 ms':>9} "
          f"{'backlog':>8} {'dead':>6}")
    for r in summary:
        name = f"{r['topic']} / {r['channel'] or '(no channel)'}"
        pct = [f"{r[k]:9.1f}" if r[k] is not None else f"{'-':>9}" for k in ("p50_ms", "p95_ms", "p99_ms")]
        print(f"{name:<32} {r['delivered']:>10,} {' '.join(pct)} {r['backlog_at_end'] or 0:>8,} "
              f"{r['dead_letters']:>6,}")
    print(f"wrote {result.out}/report.html (tables/, charts/)")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    opts = from_args(SparkOptions, args).validate()
    settings = from_args(ReplaySettings, args).validate()
    span = time_range(settings.since, settings.until)
    if not settings.dry_run:  # a dry run starts no Spark
        _check_cluster(opts, settings.server)
    with ExitStack() as stack:
        db = _open_database(stack, opts)
        replay.validate(db, settings)
        db.migrate()
        count, _, _ = replay.selection(db, settings, span)
        if count and not settings.dry_run:
            replay.check_fan_out(db, settings, span)
        if settings.dry_run or not count:
            result = replay.run_replay(None, db, opts, settings, span, _say)
        else:
            spark = stack.enter_context(spark_session(opts, "replay", _say))
            result = replay.run_replay(spark, db, opts, settings, span, _say)
    if args.json:
        print(json.dumps({"selected": result.selected, "replayed": result.replayed,
                          "already_recorded": result.already_recorded, "failed": dict(result.failed),
                          "seconds": round(result.seconds, 3),
                          "selection": [list(r) for r in result.summary]}, indent=2))
    elif settings.dry_run:
        print(f"would replay {result.selected:,} dead letters")
        for topic, channel, reason, n in result.summary:
            print(f"  {topic} / {channel or '(no channel)'} {reason}: {n:,}")
    elif not result.selected:
        print("nothing to replay: no dead letter in the selection is waiting")
    else:
        print(f"replayed {result.replayed:,} of {result.selected:,} dead letters in {result.seconds:.1f} s"
              + (f" ({result.already_recorded:,} recorded by another run)" if result.already_recorded else ""))
        for status, n in sorted(result.failed.items()):
            print(f"  not replayed, {status}: {n:,}")
    return 1 if result.failures else 0


def cmd_reinject(args: argparse.Namespace) -> int:
    opts = from_args(SparkOptions, args).validate()
    settings = from_args(ReinjectSettings, args).validate()
    location = archive.normalize_location(settings.archive)
    check_location(opts.master, settings.archive, settings.archive_shared, "--archive")
    _check_cluster(opts)
    with ExitStack() as stack:
        db = _open_database(stack, opts)
        reinject.validate(db, settings)
        span = reinject.gap(db, settings)
        spark = stack.enter_context(spark_session(opts, "reinject", _say))
        result = reinject.run_reinject(spark, db, location, settings, span, _say)
    where = f"{settings.topic}/{settings.channel}"
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
    elif settings.dry_run:
        print(f"would re-inject {result.selected:,} archived messages of {settings.topic} published in {span} "
              f"into {where} (dry run: nothing queued)")
    else:
        print(f"re-injected {result.queued:,} archived messages of {settings.topic} published in {span} "
              f"into {where} in {result.seconds:.1f} s"
              + (f" ({result.already:,} queued by an earlier run)" if result.already else ""))
    if result.missing:
        print(f"note: {result.missing:,} messages of the range were archived without their body (swept "
              "before archiving was enabled) and cannot be re-injected")
    return 0


def cmd_pack_env(args: argparse.Namespace) -> int:
    out = ship.build_env(args.out)
    if args.json:
        print(json.dumps({"archive": str(out), "bytes": out.stat().st_size, "python": ship.PYTHON}))
    else:
        print(f"packed dmq's executor environment into {out} ({out.stat().st_size / 1e6:.1f} MB); "
              f"ship it with --ship-env {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add_arguments(common, SparkOptions)
    common.add_argument("--json", action="store_true", help="print the result as JSON")
    common.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                        help="Python log level [default: warning]")
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="dmq's data pipeline on PySpark: archive delivered history to Parquet, report on "
        "deliveries, replay dead letters, re-inject archived messages into a channel. Runs on local[*] by default, on a cluster with --master.",
        epilog="Exit status: 0 done, 1 job failed (re-run resumes), 2 bad arguments or missing "
        "prerequisite, 3 database unreachable. See docs/pipeline.md.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cls, func, text in (
        ("archive", ArchiveSettings, cmd_archive,
         "write delivered history (log rows + messages) to Parquet by topic and day, then trim it"),
        ("report", ReportSettings, cmd_report,
         "throughput, latency percentiles, attempts, backlog and dead letters per topic and channel"),
        ("replay", ReplaySettings, cmd_replay,
         "republish selected dead letters through a dmq server, once each"),
        ("reinject", ReinjectSettings, cmd_reinject,
         "queue a topic's archived messages of a time range again for one channel only (the gap "
         "of `dmq channel seek --from-archive`), once each"),
    ):
        p = sub.add_parser(name, parents=[common], help=text, description=text)
        add_arguments(p, cls)
        p.set_defaults(func=func)
    text = ("pack the executors' Python (a virtualenv with dmq's client, pipeline and psycopg, as "
            "installed here) into a .tar.gz for --ship-env; run it on a machine like the workers")
    p = sub.add_parser("pack-env", help=text, description=text)
    p.add_argument("--out", required=True, help="the archive to write (.tar.gz)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="Python log level [default: warning]")
    p.set_defaults(func=cmd_pack_env)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    with quiet_broken_pipe() as closed:  # `dmq-pipeline ... | head`: no traceback
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=args.log_level.upper(), format=f"{PROG}: %(levelname)s %(name)s: %(message)s")
        try:
            return args.func(args)
        except PipelineError as exc:
            _say(f"error: {exc}")
            return exc.code
        except Exception as exc:
            if not is_spark_error(exc):
                raise
            # a job Spark could not finish: the cause, not Py4J's frame (what was done is recorded)
            _say(f"error: the Spark job failed: {explain(exc)}")
            return 1
        except KeyboardInterrupt:
            _say("interrupted; a re-run resumes where this one stopped")
            return 130
    return closed.code


if __name__ == "__main__":
    sys.exit(main())
