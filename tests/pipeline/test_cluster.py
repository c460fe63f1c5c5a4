"""archive, report and replay on a Spark standalone cluster whose workers have no dmq.

The cluster (``standalone.py``) is a master and two workers started with
``spark-class`` from the installed PySpark, on 127.0.0.1, with a PATH whose python3
cannot import dmq and no PYTHONPATH: the executors' Python comes only from the
environment the job ships (``--ship-env build``). Each job runs as a user runs it, the
installed ``dmq-pipeline`` with its own driver, and must give the figures the same job
gives on ``local[*]`` (or, for the jobs that change the database, the figures SQL gives,
which the local tests check the same way).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.parquet as pq

from dmq_pipeline.archive import archive_schema, dataset_path

from .conftest import make_traffic, pipeline_command, sql
from .standalone import EXECUTOR_CONF, WORKER_CORES, WORKERS
from .test_replay import insert_dead_letters, receive_until_sentinel
from .test_report import add_dead_letters


def driver_env(ship_cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env["SPARK_LOCAL_IP"] = "127.0.0.1"  # the driver too listens on loopback only
    env["XDG_CACHE_HOME"] = str(ship_cache)
    return env


def on_cluster(standalone, ship_cache, *args: str, ship: bool = True) -> subprocess.CompletedProcess:
    conf = [a for item in EXECUTOR_CONF for a in ("--conf", item)]
    shipped = ["--ship-env", "build"] if ship else []
    out = pipeline_command(*args, "--master", standalone.master, *conf, *shipped, env=driver_env(ship_cache))
    if out.returncode not in (0, 1, 2):
        raise AssertionError(f"{out.returncode}: {out.stderr[-3000:]}\n{standalone.logs()}")
    return out


def tables(out: Path) -> dict[str, list[list[str]]]:
    found = {}
    for path in sorted((out / "tables").glob("*.csv")):
        with open(path, newline="") as fh:
            found[path.stem] = list(csv.reader(fh))
    return found


def test_the_workers_have_no_dmq(standalone):
    """What makes this cluster a test of shipping: its workers' python3 cannot import dmq."""
    env = standalone.machine_env("worker1")
    probe = subprocess.run(["python3", "-c", "import dmq_pipeline"], env=env, capture_output=True,
                           cwd=standalone.base)
    assert probe.returncode != 0
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env


def test_report_on_the_cluster_equals_local(standalone, ship_cache, make_server, topic, pg_dsn, tmp_path):
    """The same report, on local[2] and on the cluster: identical tables. The Parquet
    tables are written by the driver (no Spark committer's _SUCCESS) and hold every row."""
    server = make_server()
    make_traffic(server, pg_dsn, n=24)
    add_dead_letters(pg_dsn, datetime.now(timezone.utc))
    now = datetime.now(timezone.utc)
    since, until = (now - timedelta(hours=2)).isoformat(), (now + timedelta(minutes=1)).isoformat()
    common = ("report", "--pg-dsn", pg_dsn, "--since", since, "--until", until, "--json")

    local = pipeline_command(*common, "--out", str(tmp_path / "local"), "--master", "local[2]",
                             env=driver_env(ship_cache))
    assert local.returncode == 0, local.stderr[-3000:]
    remote = on_cluster(standalone, ship_cache, *common, "--out", str(tmp_path / "cluster"))
    assert remote.returncode == 0, remote.stderr[-3000:]

    assert json.loads(remote.stdout)["summary"] == json.loads(local.stdout)["summary"]
    want = tables(tmp_path / "local")
    assert set(want) == {"summary", "throughput", "latency", "attempts", "backlog", "backlog_series",
                         "dead_letters"}
    assert tables(tmp_path / "cluster") == want
    for name, rows in want.items():
        folder = tmp_path / "cluster" / "tables" / f"{name}.parquet"
        assert not (folder / "_SUCCESS").exists()
        assert sum(pq.read_metadata(p).num_rows for p in folder.glob("*.parquet")) == len(rows) - 1


def test_archive_on_the_cluster_writes_every_row_once(standalone, ship_cache, make_server, topic, pg_dsn,
                                                      spark, tmp_path):
    """archive on the cluster, with a --conf spark.jars of the user's (the JDBC driver is
    appended, not dropped): every log row lands in the Parquet once, the log is trimmed,
    and a report over the archive on the cluster equals one on local[2]."""
    server = make_server()
    traffic = make_traffic(server, pg_dsn, n=24)
    expected = sql(pg_dsn, "log_rows")
    other_jar = next((Path(__import__("pyspark").__file__).parent / "jars").glob("commons-lang3-*.jar"))
    location = tmp_path / "archive"

    out = on_cluster(standalone, ship_cache, "archive", "--pg-dsn", pg_dsn, "--archive", str(location),
                     "--archive-shared", "--older-than", "0s", "--conf", f"spark.jars={other_jar}", "--json")

    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["rows"] == traffic.delivered
    rows = spark.read.schema(archive_schema()).parquet(dataset_path(str(location))).orderBy("id").collect()
    assert [(r.id, r.message_id, bytes(r.body)) for r in rows] == [(e[0], e[1], bytes(e[9])) for e in expected]
    assert sql(pg_dsn, "counts")[0][2] == 0, "log trimmed"

    now = datetime.now(timezone.utc)
    since, until = (now - timedelta(hours=2)).isoformat(), (now + timedelta(minutes=1)).isoformat()
    common = ("report", "--pg-dsn", pg_dsn, "--since", since, "--until", until, "--source", "archive",
              "--archive", f"file://{location}", "--json")
    local = pipeline_command(*common, "--out", str(tmp_path / "local"), "--master", "local[2]",
                             env=driver_env(ship_cache))
    remote = on_cluster(standalone, ship_cache, *common, "--archive-shared", "--out", str(tmp_path / "cluster"))
    assert local.returncode == 0 and remote.returncode == 0, local.stderr[-2000:] + remote.stderr[-2000:]
    summary = json.loads(remote.stdout)["summary"]
    assert summary == json.loads(local.stdout)["summary"]
    assert sum(r["delivered"] for r in summary) == traffic.delivered


def test_replay_on_the_cluster_runs_in_the_shipped_python(standalone, ship_cache, make_server, topic, pg_dsn):
    """Without --ship-env the workers have no dmq, and the job says so and what to do
    (not Py4J's frame); with it, every selected dead letter is delivered once and recorded."""
    server = make_server()
    ids = insert_dead_letters(pg_dsn)
    args = ("replay", "--pg-dsn", pg_dsn, "--server", f"127.0.0.1:{server.tcp_port}", "--topic", "orders",
            "--reason", "max_attempts", "--all-channels", "--since", "1d", "--json")

    bare = on_cluster(standalone, ship_cache, *args, "--conf", "spark.task.maxFailures=1", ship=False)

    assert bare.returncode == 1
    assert "No module named 'dmq_pipeline'" in bare.stderr and "--ship-env build" in bare.stderr, bare.stderr
    assert "An error occurred while calling" not in bare.stderr
    assert all(r[5] is None for r in sql(pg_dsn, "dead_letters") if r[0] in ids["selected"])

    with server.client() as consumer, server.client() as producer:
        consumer.subscribe("orders", "billing", credit=100)
        shipped = on_cluster(standalone, ship_cache, *args)
        assert shipped.returncode == 0, shipped.stderr[-3000:]
        assert json.loads(shipped.stdout)["replayed"] == 20
        got = receive_until_sentinel(consumer, producer)
    assert sorted(got) == [f"selected-{i:03d}".encode() for i in range(20)]
    rows = {r[0]: r for r in sql(pg_dsn, "dead_letters")}
    assert all(rows[i][5] is not None for i in ids["selected"])
    assert all(rows[i][5] is None for i in ids["other_reason"] + ids["other_topic"])


def test_partitions_count_every_executor_core(standalone, ship_cache):
    """--partitions 0 on a cluster: the cores of all executors, not those registered when
    the session started (Spark's defaultParallelism read at once gave half of them)."""
    probe = (
        "import sys\n"
        "from dmq_pipeline.jdbc import partition_count\n"
        "from dmq_pipeline.options import SparkOptions\n"
        "from dmq_pipeline.session import spark_session\n"
        f"opts = SparkOptions(master={standalone.master!r}, spark_conf={EXECUTOR_CONF!r})\n"
        "with spark_session(opts, 'probe') as spark:\n"
        "    print(partition_count(spark, opts))\n"
    )
    out = subprocess.run([os.sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         env=driver_env(ship_cache))
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip().splitlines()[-1]) == WORKERS * WORKER_CORES
