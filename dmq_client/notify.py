"""The notify runner: delivers each send's result to its callback and future.

DMQ's ``notifyQueue`` and ``notifyMsgRunner``. Results are produced on the I/O
threads (replies), the send runner (routing failures), the resend runner
(OUT_OF_RETRY) and the caller's thread (invalid message, queue full); none of
those should run user code, which may block or raise. One thread calls every
callback, in the order results were produced, then completes the future; so a
caller who waits on the future sees its callback's effects.

The queue is unbounded by design: each entry is a message the client has
promised to report, and the number of those is bounded by the send queue and
the resend map, plus the rejections a caller provokes itself.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Sequence

from .confirm import ConsumedNote
from .pending import PendingSend

#: what the runner delivers: a send's result, or a confirmation's (``confirm.ConsumedNote``)
Notice = PendingSend | ConsumedNote

__all__ = ["NotifyRunner", "call_callback"]

log = logging.getLogger(__name__)


def call_callback(callback: object, result: object) -> None:
    """A callback object's ``on_result(result)``, or a plain callable's call."""
    on_result = getattr(callback, "on_result", None)
    if on_result is not None:
        on_result(result)
    elif callable(callback):
        callback(result)
    else:  # what calling it would raise
        raise TypeError(f"{type(callback).__name__!r} object is not callable")


class NotifyRunner:
    def __init__(self, delivered: Callable[[Notice], None], name: str = "dmq-notify"):
        self._delivered = delivered
        self._items: deque[Notice] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._stopping = False
        self._exited = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def start(self) -> None:
        self._thread.start()

    def put(self, item: Notice) -> None:
        with self._cond:
            if not self._exited:
                self._items.append(item)
                if len(self._items) == 1:
                    self._cond.notify()
                return
        self.deliver(item)  # the runner has ended (client closed): deliver here

    def put_many(self, items: Sequence[Notice]) -> None:
        if items:
            with self._cond:
                if not self._exited:
                    self._items.extend(items)
                    self._cond.notify()
                    return
            for item in items:
                self.deliver(item)

    def __len__(self) -> int:
        return len(self._items)

    def stop(self, timeout: float | None) -> bool:
        """Deliver everything queued, then end the thread. False if a callback is
        still running after ``timeout`` (the thread is a daemon; it is left)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is self._thread:
            return True  # close() called from a callback: the loop ends after it
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._stopping:
                    self._cond.wait()
                if not self._items:
                    self._exited = True
                    return
                batch = list(self._items)
                self._items.clear()
            for item in batch:
                self.deliver(item)

    def deliver(self, item: Notice) -> None:
        result = item.result
        if item.callback is not None:
            try:
                call_callback(item.callback, result)
            except Exception:
                log.exception("send callback raised for %r", item)
        if isinstance(item, ConsumedNote):
            item.future.set_result(item.result)
        else:
            assert item.result is not None  # the producer sets it before the item comes here
            item.future.set_result(item.result)
        try:
            self._delivered(item)
        except Exception:
            log.exception("bookkeeping after delivering %r failed", item)
