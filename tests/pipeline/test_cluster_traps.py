"""The multi-machine traps of issue 20, each refused before Spark starts, with the fix.

Every command here names a cluster master on another machine (``spark-master.invalid``
is never looked up: the checks resolve no names) and must exit 2 without starting a
JVM or touching the database.
"""

from __future__ import annotations

import pytest

from .conftest import pipeline_command, sql

MASTER = "spark://spark-master.invalid:7077"


@pytest.fixture
def state(pg_dsn, topic):
    return lambda: (sql(pg_dsn, "counts")[0], sql(pg_dsn, "dead_letters"))


def refused(*args: str) -> str:
    out = pipeline_command(*args, "--master", MASTER, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr and "SparkContext" not in out.stderr
    return out.stderr


@pytest.mark.parametrize("location", ["/srv/dmq-archive", "file:///srv/dmq-archive", "file:/srv/dmq-archive",
                                      "relative/archive"])
def test_archive_to_a_path_of_this_machine_is_refused_on_a_cluster(pg_dsn, state, location):
    before = state()
    err = refused("archive", "--pg-dsn", pg_dsn.replace("127.0.0.1", "db.invalid"), "--archive", location)
    assert "is a directory on this machine's disk" in err and "hdfs://" in err and "--archive-shared" in err
    assert state() == before


def test_report_from_an_archive_on_this_machine_is_refused_on_a_cluster(pg_dsn):
    err = refused("report", "--pg-dsn", pg_dsn.replace("127.0.0.1", "db.invalid"), "--source", "archive",
                  "--archive", "/srv/dmq-archive")
    assert "is a directory on this machine's disk" in err


def test_a_loopback_database_is_refused_on_a_cluster(pg_dsn, state):
    before = state()
    err = refused("archive", "--pg-dsn", pg_dsn, "--archive", "hdfs:///dmq/archive")
    assert "--pg-dsn names 127.0.0.1" in err and "workers reach" in err
    err = refused("report", "--pg-dsn", pg_dsn.replace("127.0.0.1", "localhost"))
    assert "--pg-dsn names localhost" in err
    assert state() == before


def test_the_embedded_database_is_refused_on_a_cluster(tmp_path):
    err = refused("report", "--data-path", str(tmp_path))
    assert "embedded PostgreSQL" in err and "listens on 127.0.0.1 only" in err and "--pg-dsn" in err


def test_a_loopback_server_is_refused_for_replay_on_a_cluster(pg_dsn, state):
    before = state()
    err = refused("replay", "--pg-dsn", pg_dsn.replace("127.0.0.1", "db.invalid"), "--server", "127.0.0.1:4150")
    assert "--server 127.0.0.1:4150 is a loopback address" in err
    assert state() == before


def test_a_missing_packed_environment_is_refused(pg_dsn):
    err = refused("report", "--pg-dsn", pg_dsn.replace("127.0.0.1", "db.invalid"), "--ship-env", "/nowhere/env.tar.gz")
    assert "--ship-env /nowhere/env.tar.gz: no such file" in err and "pack-env" in err


def test_pack_env_writes_an_environment_that_runs_dmq_without_this_venv(tmp_path):
    """What --ship-env ships, as `pack-env` writes it: its bin/python imports dmq's
    executor code with an environment that has none of this checkout."""
    import subprocess
    import tarfile

    out = pipeline_command("pack-env", "--out", str(tmp_path / "env.tar.gz"), "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    with tarfile.open(tmp_path / "env.tar.gz") as tar:
        tar.extractall(tmp_path / "env", filter="tar")
    ran = subprocess.run(
        [str(tmp_path / "env" / "bin" / "python"), "-c",
         "import dmq_pipeline.replay, dmq_client.blocking, psycopg, sys; print(dmq_pipeline.replay.__file__)"],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path, timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith(str(tmp_path / "env"))
