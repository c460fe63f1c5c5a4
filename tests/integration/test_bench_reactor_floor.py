"""bench/reactor_floor.py's figure is the floor under dmq-server's steady CPU a message
(docs/benchmarks.md): it means that only if every loop answered every message it was
sent, on the schedule the round claims. A short round of each loop, on real sockets,
counts both ends."""

from __future__ import annotations

import pytest

from tests.bench_modules import import_bench

floor = import_bench("reactor_floor")


@pytest.mark.parametrize("loop", floor.LOOPS)
def test_a_round_answers_every_message_sent_on_its_schedule(loop):
    result = floor.one_round(loop, rate=400.0, seconds=1.0, interval=0.0015)
    # four clients at 100 msgs/s for 1 s: messages 0..99 of each fall due before the end
    assert result["sent"] == 400
    assert result["answered"] == 400  # the gathered loops owe counts, not bytes: none dropped
    assert result["user_us"] + result["sys_us"] > 0
