"""bench/steady_cost.py drives the steady scenario's shape (four producers, a send a
read, group commits of ten) through real ``DmqConnection``s, ``Broker`` and
``ReliableStore`` against the stand-in group-commit connection; its checked run decodes
every producer's answers. A run that measured nothing, answered a send twice or left
one unanswered, or a stand-in that drifted from what the store runs, fails here."""

from __future__ import annotations

from tests.bench_modules import import_bench

steady_cost = import_bench("steady_cost")


def test_a_run_answers_every_send_once_and_reports_its_cost():
    result = steady_cost.child(400, check=True)
    assert set(result) == {"message_ns"}
    assert result["message_ns"] > 0
