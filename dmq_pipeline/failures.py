"""A failed Spark job, in one line a person can act on.

A Spark error reaches the driver as a Py4J error (or PySpark's wrapper of one) whose
first line is Py4J's frame (``An error occurred while calling
z:org.apache.spark.api.python.PythonRDD.collectAndServe.``); the cause is further
down, in a worker's Python traceback or a JVM ``Caused by:``. ``explain`` finds it and,
for the failures a cluster user meets first, says what to do: the executors have no
Python with dmq (``--ship-env``), cannot reach PostgreSQL, or write a path that only
some machines have.
"""

from __future__ import annotations

import re

__all__ = ["is_spark_error", "root_cause", "explain"]

_PYTHON_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (.*)$", re.M)
_JVM_ERROR = re.compile(
    r"(?:^|: |Caused by: )((?:java|javax|org|scala|py4j)\.[\w.$]*(?:Exception|Error)): ([^\n]*)", re.M
)
_CANNOT_RUN = re.compile(r'Cannot run program "([^"]+)"')
_NO_MODULE = re.compile(r"No module named '([\w.]+)'")

SHIP_ENV_HINT = (
    "the executors need a Python with dmq: pass --ship-env build (or --ship-env PACKED.tar.gz from "
    "`dmq-pipeline pack-env`), see docs/pipeline.md, running on a cluster"
)


def is_spark_error(exc: BaseException) -> bool:
    """An error raised by Spark or Py4J (the JVM side of a job)."""
    return type(exc).__module__.split(".")[0] in ("py4j", "pyspark")


def root_cause(exc: BaseException) -> str:
    """The first line a person needs from a failed Spark action: the Python exception a
    worker raised (a Py4J error wraps it in JVM stack traces), else the innermost JVM
    exception, else the error's first line."""
    text = str(exc)
    found = [m for m in _PYTHON_ERROR.finditer(text) if not m.group(1).startswith(("py4j", "org.", "java."))]
    if found:
        name, message = found[-1].groups()
        return f"{name}: {message} (raised in a Spark Python worker)"
    causes = [m for m in _JVM_ERROR.finditer(text) if m.group(1) != "org.apache.spark.SparkException"]
    if causes:
        name, message = causes[-1].groups()
        return f"{name}: {message.strip()}"
    lines = text.strip().splitlines()
    return lines[0] if lines else repr(exc)


def explain(exc: BaseException) -> str:
    """``root_cause``, with what to do for the failures a cluster user meets first."""
    text = str(exc)
    cannot = _CANNOT_RUN.search(text)
    if cannot:
        return f"the executors cannot start Python {cannot.group(1)!r} (no such program there): {SHIP_ENV_HINT}"
    cause = root_cause(exc)
    module = _NO_MODULE.search(cause)
    if module and module.group(1).split(".")[0] in ("dmq_pipeline", "dmq_client", "dmq_sql", "psycopg", "registry"):
        return f"{cause}: {SHIP_ENV_HINT}"
    if "PSQLException" in cause or "Connection to" in cause and "refused" in cause:
        return (f"{cause}: an executor cannot reach PostgreSQL; --pg-dsn must name a host and port the "
                "workers can connect to")
    if "FileNotFoundException" in cause or "Mkdirs failed" in cause:
        return (f"{cause}: a path the job writes is not the same on every machine; use a location all "
                "reach (hdfs://..., s3a://...) or a shared mount")
    return cause
