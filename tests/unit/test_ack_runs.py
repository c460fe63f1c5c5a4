"""``db.messages.AckRun``: the durable-ack batch as runs of columns.

The server hands the acker one ``AckRun`` per ``ack_held`` call; the statement's arrays
must be what a row per ack gave: each ack's own values in order, the shared ones
repeated, the cursors' groups (lowest, highest, count) in first-seen order, the counted
acks (attempts kept) picked out. The reference here builds them from rows, one ack at a
time, as the statement did before runs.
"""

from __future__ import annotations

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmq_server.db.messages import AckRow, AckRun, ack_deliveries_steps


def params(acks: list) -> dict:
    return dict(next(ack_deliveries_steps(acks)).params)


def expected(rows: list[AckRow]) -> dict:
    groups: dict[tuple[str, str, int], list[int]] = {}
    for r in rows:
        g = groups.setdefault((r.topic, r.channel, r.owner), [r.message_id, r.message_id, 0])
        g[0], g[1], g[2] = min(g[0], r.message_id), max(g[1], r.message_id), g[2] + 1
    counted = [r for r in rows if r.counted]
    return {
        "topics": [r.topic for r in rows], "channels": [r.channel for r in rows],
        "owners": [r.owner for r in rows], "message_ids": [r.message_id for r in rows],
        "published_ms": [r.published_ms for r in rows], "first_ms": [r.first_ms for r in rows],
        "acked_ms": [r.acked_ms for r in rows], "attempts": [r.attempts for r in rows],
        "consumers": [r.consumer for r in rows], "delivered_ms": [r.delivered_ms for r in rows],
        "c_topics": [r.topic for r in counted], "c_channels": [r.channel for r in counted],
        "c_owners": [r.owner for r in counted], "c_ids": [r.message_id for r in counted],
        "g_topics": [k[0] for k in groups], "g_channels": [k[1] for k in groups],
        "g_owners": [k[2] for k in groups], "g_low": [g[0] for g in groups.values()],
        "g_high": [g[1] for g in groups.values()], "g_acks": [g[2] for g in groups.values()],
        "last_acked_ms": max((r.acked_ms for r in rows), default=0),
        "low_id": min((r.message_id for r in rows), default=0),
        "high_id": max((r.message_id for r in rows), default=0),
    }


@st.composite
def runs_and_rows(draw: st.DrawFn) -> tuple[list[AckRun], list[AckRow]]:
    """Runs as ``_on_acks`` makes them (one channel, consumer and time each; owners
    mostly one per run, sometimes mixed), and the same acks as rows."""
    ids = iter(draw(st.permutations(range(1, 200))))
    runs, rows = [], []
    for _ in range(draw(st.integers(0, 6))):
        topic, channel = draw(st.sampled_from(["t1", "t2"])), draw(st.sampled_from(["a", "b"]))
        consumer, acked_ms = draw(st.sampled_from(["c1", "c2"])), draw(st.integers(1, 5))
        counts_all = draw(st.booleans())
        n = draw(st.integers(1, 8))
        mixed = draw(st.booleans())
        columns = [[next(ids) for _ in range(n)],
                   [draw(st.sampled_from([1, 2])) for _ in range(n)] if mixed else [3] * n,
                   [draw(st.integers(0, 9)) for _ in range(n)], [draw(st.integers(0, 9)) for _ in range(n)],
                   [draw(st.integers(1, 3)) for _ in range(n)], [draw(st.integers(0, 9)) for _ in range(n)]]
        run = AckRun(topic, channel, consumer, acked_ms, counts_all, *columns)
        runs.append(run)
        for mid, owner, published, first, attempts, delivered in zip(*columns):
            rows.append(AckRow(topic, channel, mid, first, acked_ms, attempts, consumer, delivered, owner, published,
                               counts_all or attempts > 1))
    return runs, rows


@settings(max_examples=300, deadline=None)
@given(runs_and_rows(), st.data())
def test_a_batch_of_runs_sends_the_arrays_a_row_per_ack_sends(case, data) -> None:
    """Also for the same runs split anywhere (a batch's limit), and for the rows themselves
    (each a run of one). Fails with a shared value not repeated, a column out of line,
    a mixed-owner run taken as one cursor, or a counted ack missed."""
    runs, rows = case
    want = expected(rows)
    split = []
    for run in runs:
        at = data.draw(st.integers(0, len(run)))
        split += [part for part in run.split(at) if len(part)]
    for acks in (runs, split, rows):
        got = params(acks)
        assert {k: got[k] for k in want} == want


def test_a_split_keeps_the_shared_values_and_each_acks_own() -> None:
    run = AckRun("t", "c", "who", 9, True, [5, 6, 7], [1, 1, 2], [50, 60, 70], [51, 61, 71], [1, 2, 1], [52, 62, 72])
    head, tail = run.split(1)
    assert (head.topic, head.channel, head.consumer, head.acked_ms, head.counts_all) == ("t", "c", "who", 9, True)
    assert head.columns() == ([5], [1], [50], [51], [1], [52])
    assert tail.columns() == ([6, 7], [1, 2], [60, 70], [61, 71], [2, 1], [62, 72])
    assert (head.single_owner(), tail.single_owner()) == (1, None)
    assert tail.counted() == [0, 1]
    # a run of one counts what its row counts: delivered again, or the topic keeps attempts
    assert AckRun.of(AckRow("t", "c", 8, 0, 9, 1)).counted() == []
    assert AckRun.of(AckRow("t", "c", 8, 0, 9, 2, counted=True)).counted() == [0]
    assert AckRun.of(AckRow("t", "c", 8, 0, 9, 1, counted=True)).counted() == [0]


def test_a_failed_ack_statement_runs_again_as_written_then_fails_the_batch():
    """The first try leaves out the rebuild of the log's row and fails on a repeat among
    the acks, or on a cursor row the sweep opened after the statement began (both by a
    division by zero, nothing applied); the statement as written runs then, with a new
    snapshot. Failing again (another cursor opened in between), it runs once more, and a
    third failure is the batch's, which the acker sends again."""
    def steps():
        return ack_deliveries_steps([AckRow("t", "c", 7, 0, 1, 1, owner=1)], [], "node-1")

    once = steps()
    assert next(once).name == "ack_new_deliveries"
    retry = once.throw(psycopg.errors.DivisionByZero("division by zero"))
    assert (retry.name, retry.may_fail) == ("ack_deliveries", True)
    with pytest.raises(StopIteration) as stop:
        once.send([("t", "other", 1)])
    assert stop.value.value == [("t", "other", 1)]

    twice = steps()
    next(twice)
    twice.throw(psycopg.errors.DivisionByZero("division by zero"))
    last = twice.throw(psycopg.errors.DivisionByZero("division by zero"))
    assert (last.name, last.may_fail) == ("ack_deliveries", False)
    with pytest.raises(psycopg.errors.DivisionByZero):
        twice.throw(psycopg.errors.DivisionByZero("division by zero"))
