"""`dmq` operations users asked for (issue 14), against a real PostgreSQL:
``topic update`` in place, one "not found" answer for named dead letters, and a
closed output pipe that ends a command quietly."""

from __future__ import annotations

import json
import subprocess
import sys

from dmq_server.db.dead_letter_steps import NewDeadLetter, insert_dead_letters
from dmq_server.db.schema import migrate
from dmq_server.db.worker import connect

from .support import REPO, db_rows, run_cli


def _settings(dsn: str, name: str) -> dict:
    shown = run_cli(dsn, "topic", "show", name)
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def test_topic_update_changes_settings_in_place(pg_dsn):
    """Every setting can be changed or removed; its channels stay, and
    settings not given are left alone."""
    run_cli(pg_dsn, "topic", "create", "orders", "--rate-limit", "100", "--ttl", "1h").check_returncode()
    run_cli(pg_dsn, "channel", "add", "orders", "billing").check_returncode()

    out = run_cli(pg_dsn, "topic", "update", "orders", "--rate-limit", "50", "--max-attempts", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "updated topic orders: rate_limit 100 -> 50, max_attempts none -> 3"
    shown = _settings(pg_dsn, "orders")
    assert (shown["rate_limit"], shown["ttl_ms"], shown["max_attempts"]) == (50, 3600000, 3)
    assert shown["channels"] == ["billing"] and shown["msg_timeout_ms"] == 60000

    out = run_cli(pg_dsn, "topic", "update", "orders", "--ttl", "none", "--rate-limit", "none", "--msg-timeout", "30s")
    assert out.returncode == 0, out.stderr
    shown = _settings(pg_dsn, "orders")
    assert (shown["rate_limit"], shown["ttl_ms"], shown["max_attempts"], shown["msg_timeout_ms"]) == (
        None, None, 3, 30000,
    )
    assert shown["channels"] == ["billing"]

    out = run_cli(pg_dsn, "topic", "update", "orders", "--retention", "7d")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "updated topic orders: retention_ms none -> 604800000"
    assert _settings(pg_dsn, "orders")["retention_ms"] == 604_800_000
    run_cli(pg_dsn, "topic", "update", "orders", "--retention", "none").check_returncode()
    assert _settings(pg_dsn, "orders")["retention_ms"] is None
    run_cli(pg_dsn, "topic", "create", "kept", "--retention", "1h").check_returncode()
    assert _settings(pg_dsn, "kept")["retention_ms"] == 3_600_000


def test_topic_update_refuses_with_a_reason(pg_dsn):
    """Nothing to change, out-of-range values and bad syntax are usage errors (2); an
    unknown topic is a refused operation (1). Nothing is written."""
    run_cli(pg_dsn, "topic", "create", "orders", "--rate-limit", "100").check_returncode()
    cases = [
        (("orders",), 2, "nothing to change"),
        (("orders", "--rate-limit", "0"), 2, "rate limit must be at least 1"),
        (("orders", "--max-attempts", "many"), 2, "not a whole number"),
        (("orders", "--ttl", "soon"), 2, "--ttl"),
        (("orders", "--msg-timeout", "none"), 2, "message timeout cannot be removed"),
        (("orders", "--retention", "500ms"), 2, "retention must be at least 1s"),
        (("nosuch", "--rate-limit", "5"), 1, "no such topic 'nosuch'"),
        (("bad name", "--rate-limit", "5"), 1, "invalid topic name"),
    ]
    for args, code, message in cases:
        out = run_cli(pg_dsn, "topic", "update", *args)
        assert out.returncode == code, (args, out.stdout, out.stderr)
        assert message in out.stderr, (args, out.stderr)
    assert _settings(pg_dsn, "orders")["rate_limit"] == 100


def _dead_letters(dsn: str, count: int) -> list[int]:
    migrate(dsn)
    with connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            return insert_dead_letters(
                conn,
                [
                    NewDeadLetter("operator", "orders", "p", 1, b"body %d" % i, detail="test", channel="billing")
                    for i in range(count)
                ],
            )


def test_dlq_delete_or_replay_of_a_missing_id_says_not_found_and_exits_1(pg_dsn):
    """`dmq dlq delete 999` answers like `DELETE /admin/dead-letters/999` (404): not
    found, exit 1, nothing done; a filter that matches nothing is still `deleted 0`."""
    (present,) = _dead_letters(pg_dsn, 1)
    missing = present + 1000
    for action in ("delete", "replay"):
        out = run_cli(pg_dsn, "dlq", action, str(missing), "--quiet")
        assert out.returncode == 1, (action, out.stdout, out.stderr)
        assert out.stderr.strip() == f"dmq: no dead letter {missing}", out.stderr
    out = run_cli(pg_dsn, "dlq", "delete", str(missing), str(missing + 1), "--quiet")
    assert out.returncode == 1 and f"no dead letters {missing}, {missing + 1}" in out.stderr
    out = run_cli(pg_dsn, "dlq", "delete", str(present), "--topic", "other", "--quiet")
    assert out.returncode == 1 and "matching the other filters" in out.stderr
    assert db_rows(pg_dsn, "SELECT id FROM dmq_dead_letter") == [(present,)]

    out = run_cli(pg_dsn, "dlq", "delete", "--topic", "nosuch", "--quiet")
    assert out.returncode == 0 and out.stdout.startswith("deleted 0 dead letters"), out.stderr
    out = run_cli(pg_dsn, "dlq", "delete", str(present), "--quiet")
    assert out.returncode == 0 and out.stdout.startswith("deleted 1 dead letters"), out.stderr


def test_dlq_list_into_a_closed_pipe_ends_quietly(pg_dsn):
    """`dmq dlq list --json | head`: the reader leaves after a few bytes of a listing
    far larger than a pipe holds; the command exits 141 (as if SIGPIPE ended it) and
    prints no traceback."""
    _dead_letters(pg_dsn, 3000)
    with subprocess.Popen(
        [sys.executable, "-m", "dmq_server.admin.cli", "--pg-dsn", pg_dsn, "dlq", "list", "--json", "--limit", "3000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    ) as proc:
        assert proc.stdout.read(100).startswith(b"[")
        proc.stdout.close()  # like `head` exiting
        stderr = proc.stderr.read().decode()
        assert proc.wait(60) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
