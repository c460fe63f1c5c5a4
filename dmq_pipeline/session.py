"""The SparkSession a job runs in.

``--master`` picks where (``local[*]`` by default, or any cluster URL); the
JDBC driver jar is appended to ``spark.jars`` so Spark ships it to every executor,
and ``--ship-env`` appends dmq's packed Python environment to ``spark.archives``
(``ship.py``). When a session is already active in this process (tests, a notebook),
it is reused as it is and left running.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from .cluster import executor_cores, is_local
from .errors import UsageError
from .failures import explain
from .options import SparkOptions
from .ship import ENV_NAME, PYTHON, shipped_archive

__all__ = ["spark_session", "session_settings", "ensure_utc", "use_this_python"]

log = logging.getLogger(__name__)


def ensure_utc(spark) -> None:
    """Days, minutes and CSV timestamps are UTC whatever the machine's zone."""
    spark.conf.set("spark.sql.session.timeZone", "UTC")


def use_this_python() -> None:
    """Make Spark's Python workers on this machine run this interpreter.

    PySpark starts its workers with ``$PYSPARK_PYTHON``, else ``python3`` from PATH: the
    ``spark.pyspark.python`` setting is not read when the driver is a plain Python
    process. That ``python3`` is usually the system's, without dmq's dependencies, and a
    replay's workers died with ``No module named 'psycopg'``. A PYSPARK_PYTHON the user
    set is kept."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def _join(*lists: str | None) -> str:
    """Comma-separated lists (spark.jars, spark.archives) joined, each item once."""
    items: list[str] = []
    for text in lists:
        for item in (text or "").split(","):
            if item.strip() and item.strip() not in items:
                items.append(item.strip())
    return ",".join(items)


def session_settings(opts: SparkOptions, shipped: str | None = None) -> dict[str, str]:
    """``--conf`` settings with the JDBC jar appended to ``spark.jars`` (a ``--conf
    spark.jars=...`` of the user's keeps its jars and gains the driver) and a shipped
    environment appended to ``spark.archives``."""
    settings = opts.spark_settings()
    settings["spark.jars"] = _join(settings.get("spark.jars"), opts.jdbc_jar)
    if shipped:
        settings["spark.archives"] = _join(settings.get("spark.archives"), f"{shipped}#{ENV_NAME}")
    return settings


def _ship(opts: SparkOptions, progress: Callable[[str], None]) -> str | None:
    """The packed environment to ship (``--ship-env``), with PYSPARK_PYTHON pointing at it."""
    if not opts.ship_env:
        return None
    if is_local(opts.master):
        log.info("--ship-env: ignored on %s, whose workers run this interpreter", opts.master)
        return None
    shipped = shipped_archive(opts.ship_env, progress)
    given = os.environ.get("PYSPARK_PYTHON")
    if given and given != PYTHON:
        progress(f"--ship-env: the executors run {PYTHON} from the shipped environment, not PYSPARK_PYTHON={given}")
    # read by PySpark when the SparkContext starts; sent to the executors with every task
    os.environ["PYSPARK_PYTHON"] = PYTHON
    return shipped


@contextmanager
def spark_session(opts: SparkOptions, app: str,
                  progress: Callable[[str], None] = lambda text: None) -> Iterator["object"]:
    """The job's SparkSession. On a cluster, it waits for the executors to join
    (``cluster.executor_cores``), so a job never starts on none and ``--partitions 0``
    counts them all."""
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise UsageError(
            "PySpark is not installed: pip install 'dmq-server[pipeline]' (and Java 17)"
        ) from exc

    active = SparkSession.getActiveSession()
    if active is not None:
        log.info("reusing the active SparkSession (master %s)", active.sparkContext.master)
        ensure_utc(active)
        yield active
        return

    builder = (
        SparkSession.builder.appName(f"dmq-pipeline {app}")
        .master(opts.master)
        .config("spark.sql.session.timeZone", "UTC")
        # a progress bar for a person at a terminal; none in logs and pipes
        .config("spark.ui.showConsoleProgress", "true" if sys.stderr.isatty() else "false")
        .config("spark.sql.sources.partitionOverwriteMode", "dynamic")
        # archive: a Parquet writer per topic/day a task meets (up to 16) instead of
        # sorting the task's rows by them first; --conf overrides it
        .config("spark.sql.maxConcurrentOutputFileWriters", "16")
    )
    if is_local(opts.master):
        # executors are this machine's Python workers: use this interpreter
        use_this_python()
        builder = builder.config("spark.sql.shuffle.partitions", "8")
        builder = builder.config("spark.ui.enabled", "false")  # --conf spark.ui.enabled=true to watch
    for key, value in session_settings(opts, _ship(opts, progress)).items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # Java missing, bad master URL, ...: py4j raises plain exceptions
        raise UsageError(f"cannot start Spark (master {opts.master}): {explain(exc)}") from exc
    spark.sparkContext.setLogLevel("WARN")
    try:
        if not is_local(opts.master):
            spark.sparkContext._dmq_executor_cores = executor_cores(spark, progress)
        yield spark
    finally:
        spark.stop()
