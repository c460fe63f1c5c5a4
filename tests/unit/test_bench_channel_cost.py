"""bench/channel_cost.py drives the reliable channel's push and ack path through a
stand-in connection; the stand-in must keep up with ``DmqConnection``'s hot-path API,
and each round checks, untimed, that every copy left as its CONSUMER_PUSH frame and
every ack became a row. A round that measured nothing would fail here."""

from __future__ import annotations

from tests.bench_modules import import_bench

channel_cost = import_bench("channel_cost")


def test_a_run_pushes_and_acks_every_copy_and_reports_its_cost():
    result = channel_cost.child(300, check=True)
    assert set(result) == {"push_ns", "ack_ns"}
    assert result["push_ns"] > 0 and result["ack_ns"] > 0
