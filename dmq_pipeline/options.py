"""Every pipeline setting, in dataclasses with documented defaults.

``SparkOptions`` holds what every job shares (where the database is, how Spark
runs and reads); ``ArchiveSettings``, ``ReportSettings``, ``ReplaySettings`` and
``ReinjectSettings`` hold each job's own. The ``dmq-pipeline`` flags, their ``DMQ_*`` environment
variables and their help text are generated from the fields' metadata
(precedence: flag > environment > default), so a setting cannot exist in one
place and not the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

from dmq_client import spelling
from dmq_client.spelling import parse_address, parse_duration

from .errors import UsageError

__all__ = [
    "DEFAULT_JDBC_JAR",
    "SparkOptions",
    "ArchiveSettings",
    "ReportSettings",
    "ReplaySettings",
    "ReinjectSettings",
    "TimeRange",
    "add_arguments",
    "from_args",
    "parse_time",
    "time_range",
]

#: Where Debian's libpostgresql-jdbc-java puts the driver.
DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _opt(default: Any, help: str, *, kind: str = "str", env: str | None = None,
         flag: str | None = None, choices: tuple[str, ...] | None = None) -> Any:
    meta = {"help": help, "kind": kind, "env": env, "flag": flag, "choices": choices}
    if isinstance(default, tuple):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


_ARCHIVE_SHARED = (
    "the --archive path (or file: URI) is a mount that this machine and every Spark worker see at "
    "that path; without it a local path is refused on a cluster master"
)


@dataclass(frozen=True)
class SparkOptions:
    """Where dmq's PostgreSQL is and how Spark reads it; shared by every job."""

    pg_dsn: str = _opt(
        "",
        "PostgreSQL DSN with a TCP host that the Spark executors can reach; empty uses the "
        "embedded PostgreSQL under --data-path",
        env="DMQ_PG_DSN",
    )
    data_path: str = _opt(
        "./dmq-data", "data directory of an embedded-PostgreSQL dmq", env="DMQ_DATA_PATH"
    )
    master: str = _opt("local[*]", "Spark master URL (local[N], spark://..., yarn, k8s://...)",
                       env="DMQ_SPARK_MASTER")
    jdbc_jar: str = _opt(DEFAULT_JDBC_JAR, "PostgreSQL JDBC driver jar (Debian: libpostgresql-jdbc-java)",
                         env="DMQ_JDBC_JAR")
    partitions: int = _opt(
        0, "parallel JDBC reads per table, over id ranges; 0 = Spark's default parallelism",
        kind="int",
    )
    fetch_size: int = _opt(10000, "rows per JDBC round trip", kind="int")
    spark_conf: tuple[str, ...] = _opt(
        (), "extra Spark setting KEY=VALUE (repeatable)", kind="list", flag="--conf"
    )
    ship_env: str = _opt(
        "", "the executors' Python on a cluster: `build` packs this installation's dmq and psycopg "
        "into a virtualenv shipped with the job (cached); or a .tar.gz from `dmq-pipeline pack-env` "
        "(a path or a URI); empty: the workers' own python3. Ignored on local[...]",
        env="DMQ_SHIP_ENV",
    )

    def spark_settings(self) -> dict[str, str]:
        settings = {}
        for item in self.spark_conf:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise UsageError(f"--conf {item!r}: expected KEY=VALUE")
            settings[key.strip()] = value
        return settings

    def validate(self) -> "SparkOptions":
        if self.partitions < 0:
            raise UsageError(f"--partitions {self.partitions}: must be 0 (automatic) or more")
        if self.fetch_size < 1:
            raise UsageError(f"--fetch-size {self.fetch_size}: must be at least 1")
        if not os.path.isfile(self.jdbc_jar):
            raise UsageError(
                f"JDBC driver jar {self.jdbc_jar} not found: install Debian's "
                "libpostgresql-jdbc-java (apt-get install -y libpostgresql-jdbc-java) "
                "or pass --jdbc-jar PATH"
            )
        if self.ship_env not in ("", "build") and "://" not in self.ship_env and not os.path.isfile(
                os.path.expanduser(self.ship_env)):
            raise UsageError(
                f"--ship-env {self.ship_env}: no such file; pass `build`, or a .tar.gz made by "
                "`dmq-pipeline pack-env --out FILE`"
            )
        self.spark_settings()
        return self


@dataclass(frozen=True)
class ArchiveSettings:
    """``archive``: delivered history to Parquet, then trimmed from PostgreSQL."""

    archive: str = _opt(
        "", "archive location: a directory, or a Hadoop URI such as hdfs:///dmq/archive",
        env="DMQ_ARCHIVE",
    )
    older_than: float = _opt(
        60.0, "archive only log rows acknowledged at least this long ago", kind="duration"
    )
    batch_rows: int = _opt(5_000_000, "most log rows per archive batch", kind="int")
    init_only: bool = _opt(
        False, "only enable archiving (swept messages are kept from now on); archive nothing",
        kind="flag",
    )
    archive_shared: bool = _opt(False, _ARCHIVE_SHARED, kind="flag")

    def validate(self) -> "ArchiveSettings":
        if not self.archive:
            raise UsageError("archive needs a location: --archive PATH (or DMQ_ARCHIVE)")
        if self.batch_rows < 1:
            raise UsageError(f"--batch-rows {self.batch_rows}: must be at least 1")
        return self


@dataclass(frozen=True)
class ReportSettings:
    """``report``: delivery figures per topic and channel over a time range."""

    since: str = _opt("24h", "start of the range: ISO date/time (UTC unless it says), or a "
                      "duration meaning that long ago (24h, 30m)")
    until: str = _opt("now", "end of the range (exclusive), same forms as --since")
    topic: str = _opt("", "only this topic")
    channel: str = _opt("", "only this channel")
    source: str = _opt(
        "auto", "where history is read: pg, archive or both; auto = both when --archive is "
        "given, else pg", choices=("auto", "pg", "archive", "both"),
    )
    archive: str = _opt("", "archive location written by `archive`", env="DMQ_ARCHIVE")
    archive_shared: bool = _opt(False, _ARCHIVE_SHARED, kind="flag")
    out: str = _opt("./dmq-report", "output directory (tables/, charts/, report.html)")

    def resolved_source(self) -> str:
        if self.source == "auto":
            return "both" if self.archive else "pg"
        return self.source

    def validate(self) -> "ReportSettings":
        if self.resolved_source() in ("archive", "both") and not self.archive:
            raise UsageError(f"--source {self.source} needs --archive PATH")
        if not self.out:
            raise UsageError("--out must name a directory")
        return self


@dataclass(frozen=True)
class ReplaySettings:
    """``replay``: republish selected dead letters through a dmq server."""

    topic: str = _opt("", "only dead letters of this topic")
    channel: str = _opt("", "only dead letters of this channel")
    reason: str = _opt("", "only dead letters with this reason (rate_limited, expired, ...)")
    since: str = _opt("1970-01-01", "only dead letters that died at or after this time")
    until: str = _opt("now", "only dead letters that died before this time")
    server: str = _opt("127.0.0.1:4150", "HOST:PORT of a dmq server (TCP)", env="DMQ_SERVER")
    mark_batch: int = _opt(100, "replays recorded in PostgreSQL per round trip", kind="int")
    send_timeout: float = _opt(10.0, "longest wait for the server's reply to one send", kind="duration")
    all_channels: bool = _opt(
        False, "allow replaying a channel's dead letters to every channel of its topic (a send "
        "reaches them all)", kind="flag",
    )
    dry_run: bool = _opt(False, "count what would be replayed, send nothing", kind="flag")

    def address(self) -> tuple[str, int]:
        try:
            return parse_address(self.server)
        except ValueError as exc:
            raise UsageError(f"--server: {exc}") from None

    def validate(self) -> "ReplaySettings":
        self.address()
        if self.mark_batch < 1:
            raise UsageError(f"--mark-batch {self.mark_batch}: must be at least 1")
        return self


@dataclass(frozen=True)
class ReinjectSettings:
    """``reinject``: a topic's archived messages of a time range, queued again for one channel."""

    archive: str = _opt("", "archive location written by `archive`", env="DMQ_ARCHIVE")
    topic: str = _opt("", "the topic whose archived messages are re-injected (required)")
    channel: str = _opt("", "the one channel that receives them (required)")
    since: str = _opt("", "first publish time re-injected (required): ISO date/time (UTC unless it "
                      "says), Unix ms, or a duration ago (24h)")
    until: str = _opt("", "end of the range (exclusive), same forms as --since; empty: the topic's "
                      "retained start (the retention sweep's newest removed publish time + 1 ms), "
                      "so exactly what the store no longer holds")
    batch: int = _opt(1000, "messages queued per transaction", kind="int")
    archive_shared: bool = _opt(False, _ARCHIVE_SHARED, kind="flag")
    dry_run: bool = _opt(False, "count what would be re-injected, queue nothing", kind="flag")

    def validate(self) -> "ReinjectSettings":
        for flag, value in (("--archive", self.archive), ("--topic", self.topic),
                            ("--channel", self.channel), ("--since", self.since)):
            if not value:
                raise UsageError(f"reinject needs {flag}")
        if self.batch < 1:
            raise UsageError(f"--batch {self.batch}: must be at least 1")
        return self


# -- time ---------------------------------------------------------------------


@dataclass(frozen=True)
class TimeRange:
    """``[since, until)`` in UTC."""

    since: datetime
    until: datetime

    def __str__(self) -> str:
        return f"[{self.since.isoformat()}, {self.until.isoformat()})"


def parse_time(text: str, now: datetime, flag: str) -> datetime:
    """``now``, a duration ago (``24h``, ``7d``), Unix ms or an ISO date/time (naive
    means UTC): ``dmq_client.spelling``'s spellings, as every dmq tool takes them."""
    try:
        return spelling.parse_time(text, now)
    except ValueError:
        raise UsageError(
            f"{flag} {text!r}: expected now, a duration ago (24h, 30m, 7d), Unix ms or an ISO "
            "date/time (2024-05-01, 2024-05-01T12:00:00Z)"
        ) from None


def time_range(since: str, until: str, now: datetime | None = None) -> TimeRange:
    """The range named by ``--since``/``--until``; an empty range is a usage error."""
    now = now or datetime.now(timezone.utc)
    start = parse_time(since, now, "--since")
    end = parse_time(until, now, "--until")
    if start >= end:
        raise UsageError(
            f"empty time range: --since {since} ({start.isoformat()}) is not before "
            f"--until {until} ({end.isoformat()})"
        )
    return TimeRange(start, end)


# -- command line ---------------------------------------------------------------

T = TypeVar("T")


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of ``cls``; defaults come from the environment, then the field."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        kind = meta["kind"]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        env = meta.get("env")
        help_text = meta["help"]
        if env:
            help_text += f" (env {env})"
        if kind == "flag":
            parser.add_argument(_flag(f), dest=f.name, action="store_true", help=help_text)
            continue
        if kind == "list":
            parser.add_argument(_flag(f), dest=f.name, action="append", default=[],
                                metavar="KEY=VALUE", help=help_text)
            continue
        if env and os.environ.get(env):
            default = os.environ[env]
        shown = f"{default:g}s" if isinstance(default, float) else (default if default != "" else "none")
        parser.add_argument(
            _flag(f), dest=f.name, default=default, choices=meta.get("choices"),
            help=f"{help_text} [default: {shown}]",
        )


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build ``cls`` from parsed arguments, converting and naming bad values."""
    values = {}
    for f in dataclasses.fields(cls):
        raw = getattr(args, f.name)
        kind = f.metadata["kind"]
        try:
            if kind == "int":
                values[f.name] = int(raw)
            elif kind == "duration":
                values[f.name] = parse_duration(raw)
            elif kind == "list":
                values[f.name] = tuple(raw)
            else:
                values[f.name] = raw
        except ValueError as exc:
            raise UsageError(f"{_flag(f)} {raw!r}: {exc}") from None
    return cls(**values)
