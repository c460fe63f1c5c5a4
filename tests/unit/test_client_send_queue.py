"""The send queue contract, on the in-memory implementation."""

from __future__ import annotations

import threading

from dmq_client import Message
from dmq_client.pending import PendingSend
from dmq_client.send_queue import MemorySendQueue, Put


def item(n: int) -> PendingSend:
    return PendingSend(Message("orders", b"x"), n, "p", 0)


def test_bounded_put_answers_full_at_once_and_keeps_fifo_order():
    """put() never blocks: FULL at capacity; items come out in FIFO order."""
    queue = MemorySendQueue(capacity=3)
    assert [queue.put(item(i)) for i in range(4)] == [Put.ACCEPTED] * 3 + [Put.FULL]
    assert [i.session_id for i in queue.get_batch(2, timeout=0)] == [0, 1]
    assert queue.put(item(9)) is Put.ACCEPTED
    assert [i.session_id for i in queue.get_batch(10, timeout=0)] == [2, 9]


def test_get_batch_waits_for_the_first_item():
    """The send runner sleeps in get_batch until a message arrives."""
    queue = MemorySendQueue(capacity=3)
    got = []
    taker = threading.Thread(target=lambda: got.extend(queue.get_batch(5, timeout=10)))
    taker.start()
    queue.put(item(1))
    taker.join(10)
    assert [i.session_id for i in got] == [1]


def test_close_refuses_new_items_keeps_old_ones_and_wakes_the_taker():
    """close() wakes the runner, refuses new items and leaves queued ones to drain()."""
    queue = MemorySendQueue(capacity=3)
    empty: list = []
    waiter = MemorySendQueue(capacity=1)
    taker = threading.Thread(target=lambda: empty.append(waiter.get_batch(5, timeout=None)))
    taker.start()
    waiter.close()
    taker.join(10)
    assert empty == [[]]
    queue.put(item(1))
    queue.close()
    assert queue.put(item(2)) is Put.CLOSED
    assert [i.session_id for i in queue.drain()] == [1]
    assert queue.get_batch(5, timeout=None) == [] and len(queue) == 0
