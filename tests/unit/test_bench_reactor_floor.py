"""bench/reactor_floor.py answers each send a read completes: TCP may split one write over
two reads or join two writes in one, and the count of answers must still be the count of
sends (the integration test asserts them equal over real sockets)."""

from __future__ import annotations

from tests.bench_modules import import_bench

floor = import_bench("reactor_floor")


def test_a_read_owes_an_answer_for_each_send_it_completes():
    size = len(floor.SEND)
    sends = floor.WholeSends()
    assert sends.completed(b"x" * (size // 2)) == 0  # half a send: nothing yet
    assert sends.completed(b"x" * (size - size // 2)) == 1  # its rest
    assert sends.completed(b"x" * (2 * size + 10)) == 2  # two joined, and a part of the third
    assert sends.completed(b"x" * (size - 10)) == 1
    assert sends.partial == 0
