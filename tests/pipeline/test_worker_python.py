"""Spark's Python workers run dmq's interpreter, whatever ``python3`` PATH finds.

PySpark starts its workers with ``$PYSPARK_PYTHON`` or else ``python3`` from PATH. On
a machine whose system Python has none of dmq's packages (any fresh machine), the
replay's workers died with ``ModuleNotFoundError: No module named 'psycopg'`` and the
command printed a Py4J ``collectAndServe`` error. Here PATH's first ``python3`` is a
bare virtualenv, as on such a machine, and the replay must still work.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from datetime import datetime, timezone

import pytest

from dmq_pipeline.failures import root_cause

from .conftest import insert_dead_letter, sql


@pytest.fixture
def bare_python(tmp_path):
    """A directory whose ``python3`` has no third-party package."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    probe = subprocess.run([str(venv / "bin" / "python3"), "-c", "import psycopg"], capture_output=True)
    assert probe.returncode != 0, "the bare venv must not see dmq's packages"
    return venv / "bin"


def test_replay_works_when_paths_python3_has_no_dmq_packages(bare_python, pg_dsn, topic, make_server):
    insert_dead_letter(pg_dsn, reason="expired", detail="", topic="orders", channel="billing",
        session_id=1, attempts=1, body=b"bare", dead_at=datetime.now(timezone.utc), replayed_at=None)
    server = make_server()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env["PATH"] = f"{bare_python}:{env['PATH']}"
    exe = shutil.which("dmq-pipeline", path=os.path.dirname(sys.executable)) or "dmq-pipeline"
    out = subprocess.run(
        [exe, "replay", "--pg-dsn", pg_dsn, "--server", f"127.0.0.1:{server.tcp_port}", "--master", "local[1]", "--all-channels"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert sql(pg_dsn, "replayed_bodies") == [(b"bare",)]  # stored by the worker, recorded


def test_a_worker_failure_is_reported_by_its_python_exception():
    """What a user reads when a worker fails: the worker's exception, not Py4J's frame."""
    py4j_text = (
        "An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 3.0 failed\n"
        "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        '  File "/usr/lib/python3/dist-packages/pyspark/worker.py", line 1, in main\n'
        "ModuleNotFoundError: No module named 'psycopg'\n"
        "\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(PythonRunner.scala:1)\n"
    )
    assert root_cause(Exception(py4j_text)) == (
        "ModuleNotFoundError: No module named 'psycopg' (raised in a Spark Python worker)"
    )
    assert root_cause(Exception("cannot connect\nmore")) == "cannot connect"
