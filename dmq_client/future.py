"""``SendFuture``: the future-like result ``MqClient.send`` returns.

A send is cheap, so its future must be too. ``concurrent.futures.Future``
builds a condition variable with its lock for every instance (about 1.6 KB
and several microseconds), which made it the largest cost of a send and of
each entry in the resend map. ``SendFuture`` holds the result and nothing
else until someone actually waits or registers a callback; only then is an
``Event`` or a callback list made. The class-wide lock guards those rare
transitions and is held for a few instructions.

It offers the parts of the ``concurrent.futures.Future`` API that make sense
for a result that always arrives and cannot be cancelled: ``result``,
``done``, ``add_done_callback``, ``exception``, ``cancel`` (always False).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Generic, TypeVar

__all__ = ["SendFuture"]

T = TypeVar("T")

log = logging.getLogger(__name__)

_lock = threading.Lock()


class SendFuture(Generic[T]):
    __slots__ = ("_result", "_waiter", "_callbacks")

    def __init__(self) -> None:
        self._result: T | None = None
        self._waiter: threading.Event | None = None
        self._callbacks: list[Callable[["SendFuture[T]"], object]] | None = None

    def done(self) -> bool:
        return self._result is not None

    def running(self) -> bool:
        return self._result is None

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        """A send cannot be taken back once accepted: always False."""
        return False

    def result(self, timeout: float | None = None) -> T:
        """The result, waiting up to ``timeout`` seconds; raises ``TimeoutError``."""
        result = self._result
        if result is not None:
            return result
        with _lock:
            if self._result is not None:
                return self._result
            if self._waiter is None:
                self._waiter = threading.Event()
            waiter = self._waiter
        if not waiter.wait(timeout):
            raise TimeoutError(f"no result within {timeout}s")
        result = self._result
        assert result is not None  # set before the waiter is
        return result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Always None once done: failures are results with a status, not exceptions."""
        self.result(timeout)
        return None

    def add_done_callback(self, fn: Callable[["SendFuture[T]"], object]) -> None:
        """Call ``fn(future)`` when done (at once, in this thread, if it already is)."""
        with _lock:
            if self._result is None:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def set_result(self, result: T) -> None:
        """Complete the future (the client does this, once)."""
        with _lock:
            if self._result is not None:
                raise RuntimeError("SendFuture already has a result")
            self._result = result
            waiter, callbacks = self._waiter, self._callbacks
            self._callbacks = None
        if waiter is not None:
            waiter.set()
        if callbacks:
            for fn in callbacks:
                try:
                    fn(self)
                except Exception:  # like concurrent.futures: a bad callback must not stop the rest
                    log.exception("SendFuture done-callback raised")

    def __repr__(self) -> str:
        return f"<SendFuture {'done: ' + repr(self._result) if self._result is not None else 'pending'}>"
