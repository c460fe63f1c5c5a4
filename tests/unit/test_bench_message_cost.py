"""bench/message_cost.py drives a message's whole path with one channel (a real
``DmqConnection``, ``Broker`` and ``ReliableStore`` between a stand-in group-commit
connection and a stand-in acker); each round checks, untimed, that every send of the
batch committed that round was answered ``SEND_SUCCESS_ACK`` with its id, pushed once to
the consumer, and made durable by the acker. A round that measured nothing, or a stand-in
that drifted from what the store runs, fails here."""

from __future__ import annotations

from tests.bench_modules import import_bench

message_cost = import_bench("message_cost")


def test_a_run_answers_pushes_and_acks_every_message_and_reports_its_cost():
    result = message_cost.child(1000, check=True)
    assert set(result) == {"publish_ns", "ack_ns"}
    assert result["publish_ns"] > 0 and result["ack_ns"] > 0
