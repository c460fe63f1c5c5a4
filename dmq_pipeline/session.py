"""The SparkSession a job runs in.

``--master`` picks where (``local[*]`` by default, or any cluster URL); the
JDBC driver jar goes in ``spark.jars`` so Spark ships it to every executor.
When a session is already active in this process (tests, a notebook), it is
reused as it is and left running.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from contextlib import contextmanager
from typing import Iterator

from .errors import UsageError
from .options import SparkOptions

__all__ = ["spark_session", "ensure_utc", "use_this_python", "root_cause"]

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


_PYTHON_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (.*)$", re.M)


def root_cause(exc: BaseException) -> str:
    """The first line a person needs from a failed Spark action: the Python exception a
    worker raised (a Py4J error wraps it in JVM stack traces), else the error's first line."""
    text = str(exc)
    found = [m for m in _PYTHON_ERROR.finditer(text) if not m.group(1).startswith(("py4j", "org.", "java."))]
    if found:
        name, message = found[-1].groups()
        return f"{name}: {message} (raised in a Spark Python worker)"
    lines = text.strip().splitlines()
    return lines[0] if lines else repr(exc)


@contextmanager
def spark_session(opts: SparkOptions, app: str) -> Iterator["object"]:
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise UsageError(
            "PySpark is not installed: pip install 'dmq[pipeline]' (and Java 17)"
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
        .config("spark.jars", opts.jdbc_jar)
        .config("spark.sql.session.timeZone", "UTC")
        # a progress bar for a person at a terminal; none in logs and pipes
        .config("spark.ui.showConsoleProgress", "true" if sys.stderr.isatty() else "false")
        .config("spark.sql.sources.partitionOverwriteMode", "dynamic")
        # archive: a Parquet writer per topic/day a task meets (up to 16) instead of
        # sorting the task's rows by them first; --conf overrides it
        .config("spark.sql.maxConcurrentOutputFileWriters", "16")
    )
    if opts.master.startswith("local"):
        # executors are this machine's Python workers: use this interpreter
        use_this_python()
        builder = builder.config("spark.sql.shuffle.partitions", "8")
        builder = builder.config("spark.ui.enabled", "false")  # --conf spark.ui.enabled=true to watch
    for key, value in opts.spark_settings().items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # Java missing, bad master URL, ...: py4j raises plain exceptions
        raise UsageError(f"cannot start Spark (master {opts.master}): {exc}") from exc
    spark.sparkContext.setLogLevel("WARN")
    try:
        yield spark
    finally:
        spark.stop()
