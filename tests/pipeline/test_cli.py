"""dmq-pipeline on the command line: help, bad arguments refused clearly and harmlessly.

Bad invocations are run as real subprocesses of the installed console script; they
fail before Spark starts, so they cost no JVM.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from .conftest import insert_dead_letter, sql

UNREACHABLE = "postgresql://dmq@127.0.0.1:1/dmq"


def run(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("dmq-pipeline")
    command = [exe] if exe else [sys.executable, "-m", "dmq_pipeline.cli"]
    # a JVM start on a shared 2-core machine can take minutes; pytest-timeout (300 s) still bounds it
    return subprocess.run(command + list(args), capture_output=True, text=True, timeout=280)


def state(pg_dsn: str) -> tuple:
    """What a refused command must leave as it was."""
    return sql(pg_dsn, "counts")[0], sql(pg_dsn, "dead_letters")


@pytest.fixture
def dead_letter(pg_dsn, topic):
    from datetime import datetime, timezone

    insert_dead_letter(pg_dsn, reason="expired", detail="", topic="orders", channel="billing",
        session_id=1, attempts=1, body=b"x", dead_at=datetime.now(timezone.utc), replayed_at=None)


def test_help_lists_the_commands():
    """`dmq-pipeline --help` and each command's help exit 0 and name the options."""
    out = run("--help")
    assert out.returncode == 0 and all(c in out.stdout for c in ("archive", "report", "replay"))
    for command, flag in (("archive", "--archive"), ("report", "--since"), ("replay", "--reason")):
        out = run(command, "--help")
        assert out.returncode == 0 and flag in out.stdout and "--pg-dsn" in out.stdout


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["report", "--topic", "nosuch"], 2, "unknown topic 'nosuch'"),
        (["replay", "--topic", "nosuch", "--dry-run"], 2, "unknown topic 'nosuch'"),
        (["report", "--topic", "orders", "--channel", "nosuch"], 2, "unknown channel 'nosuch'"),
        (["replay", "--reason", "tired", "--dry-run"], 2, "unknown reason 'tired'"),
        (["report", "--since", "2024-05-02", "--until", "2024-05-01"], 2, "empty time range"),
        (["replay", "--since", "1h", "--until", "2h", "--dry-run"], 2, "empty time range"),
        (["report", "--since", "yesterday-ish"], 2, "--since 'yesterday-ish'"),
        (["report", "--jdbc-jar", "/nonexistent/postgresql.jar"], 2, "JDBC driver jar /nonexistent/postgresql.jar not found"),
        (["archive"], 2, "archive needs a location"),
        (["replay", "--server", "127.0.0.1:1"], 2, "cannot reach a dmq server at 127.0.0.1:1"),
        (["replay", "--dry-run", "--since", "2024-05-01", "--until", "2024-05-01"], 2, "empty time range"),
    ],
    ids=["report-topic", "replay-topic", "channel", "reason", "empty-range", "empty-relative-range",
         "bad-time", "missing-jar", "no-archive-path", "no-server", "replay-empty-range"],
)
def test_bad_arguments_fail_clearly_and_change_nothing(pg_dsn, topic, dead_letter, args, code, message):
    """Each bad argument gets its own message and exit status; the database is untouched."""
    before = state(pg_dsn)
    out = run(*args, "--pg-dsn", pg_dsn)
    assert out.returncode == code, out.stderr
    assert message in out.stderr
    assert out.stderr.startswith("dmq-pipeline: error:")
    assert state(pg_dsn) == before


def test_replay_to_a_topic_with_other_channels_needs_all_channels(pg_dsn, topic, dead_letter, make_server):
    """A channel's dead letter on a topic with more channels is refused without
    --all-channels (its replay would reach the others): exit 2, nothing sent or marked."""
    server = make_server()
    before = state(pg_dsn)
    out = run("replay", "--pg-dsn", pg_dsn, "--server", f"127.0.0.1:{server.tcp_port}")
    assert out.returncode == 2 and "--all-channels" in out.stderr and "dmq dlq replay" in out.stderr
    assert state(pg_dsn) == before


@pytest.mark.parametrize("command", [["archive", "--archive", "/tmp/x"], ["report"], ["replay", "--dry-run"]])
def test_unreachable_database_is_exit_3(command):
    """No database at the DSN: exit 3 with the connection error, for every command."""
    out = run(*command, "--pg-dsn", UNREACHABLE)
    assert out.returncode == 3, out.stderr
    assert "cannot connect to PostgreSQL" in out.stderr


def test_missing_data_directory_is_exit_3(tmp_path):
    """Without --pg-dsn the embedded database is looked for under --data-path."""
    out = run("report", "--data-path", str(tmp_path / "none"))
    assert out.returncode == 3 and "no dmq data under" in out.stderr


def test_archive_runs_as_a_command(pg_dsn, topic, make_server, tmp_path):
    """The installed `dmq-pipeline archive` starts its own Spark (local[1], the Debian JDBC
    jar), archives and trims, and reports rows per second."""
    from .conftest import make_traffic

    server = make_server()
    traffic = make_traffic(server, pg_dsn, n=8)
    out = run("archive", "--pg-dsn", pg_dsn, "--master", "local[1]", "--archive", str(tmp_path / "a"),
              "--older-than", "0s")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"archived {traffic.delivered:,} delivery-log rows" in out.stdout
    assert "rows/s" in out.stdout
    assert sql(pg_dsn, "counts")[0][2] == 0


def test_archive_with_nothing_to_do_says_so_without_starting_spark(pg_dsn, topic, tmp_path):
    """Nothing is due: the command enables archiving, says there is nothing to archive, and
    never starts a JVM (``--master`` is an address nothing listens on: Spark would fail)."""
    out = run("archive", "--pg-dsn", pg_dsn, "--master", "spark://127.0.0.1:1", "--archive", str(tmp_path / "a"),
              "--archive-shared")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("nothing to archive")
