"""``SendFuture``: the small future every send returns."""

from __future__ import annotations

import threading

import pytest

from dmq_client.future import SendFuture


def test_result_waits_for_the_value_set_by_another_thread():
    """``result()`` blocks until another thread sets the result."""
    future: SendFuture[str] = SendFuture()
    assert not future.done()
    setter = threading.Timer(0.01, future.set_result, args=("ok",))
    setter.start()
    assert future.result(timeout=10) == "ok" and future.done()
    setter.join()


def test_result_times_out_with_timeout_error():
    """``result(timeout)`` raises the built-in TimeoutError, as concurrent.futures does."""
    with pytest.raises(TimeoutError):
        SendFuture().result(timeout=0.01)


def test_done_callbacks_run_once_in_order_and_late_ones_at_once():
    """Callbacks added before completion run on completion; after it, at once. A raising
    callback does not stop the others."""
    future: SendFuture[int] = SendFuture()
    calls = []
    future.add_done_callback(lambda f: calls.append(("a", f.result())))
    future.add_done_callback(lambda f: 1 / 0)
    future.add_done_callback(lambda f: calls.append(("b", f.result())))
    future.set_result(5)
    future.add_done_callback(lambda f: calls.append(("late", f.result())))
    assert calls == [("a", 5), ("b", 5), ("late", 5)]


def test_cannot_be_cancelled_or_set_twice():
    """An accepted send cannot be cancelled; a second result is a bug and raises."""
    future: SendFuture[int] = SendFuture()
    assert not future.cancel() and not future.cancelled()
    future.set_result(1)
    assert future.exception() is None
    with pytest.raises(RuntimeError):
        future.set_result(2)
