"""bench/nsq_cost.py drives the NSQ fast path in one process (a real ``NsqConnection``,
``Broker`` and ``FastStore`` with disk queues in a temporary directory); each round
checks, untimed, that every PUB was answered OK, every message pushed once, and nothing
left in flight after the FINs. A round that measured nothing fails here."""

from __future__ import annotations

from tests.bench_modules import import_bench

nsq_cost = import_bench("nsq_cost")


def test_a_run_answers_pushes_and_finishes_every_message_and_reports_its_cost():
    result = nsq_cost.child(1000, check=True)
    assert set(result) == {"publish_ns", "consume_ns"}
    assert result["publish_ns"] > 0 and result["consume_ns"] > 0


def test_a_backlog_run_answers_pushes_and_finishes_every_message_once():
    """bench/nsq_backlog_cost.py: 1,200 PUBs to a channel without consumers (1,000 in its
    memory window, the rest on disk), then one consumer takes and finishes each once."""
    nsq_backlog_cost = import_bench("nsq_backlog_cost")

    result = nsq_backlog_cost.child(1200, check=True)
    assert set(result) == {"publish_ns", "consume_ns"}
    assert result["publish_ns"] > 0 and result["consume_ns"] > 0
