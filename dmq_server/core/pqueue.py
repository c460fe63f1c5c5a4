"""An indexed min-heap of messages by deadline (nsqd ``in_flight_pqueue.go``).

Each item keeps its own position in ``index``, so removing a message that was
FINished or REQueued is O(log n) without searching, and ``peek_and_shift(now)``
pops only what is due. One queue per channel for in-flight messages and one for
deferred ones; a single scanner walks the channels (``nsqd.FastStore.scan``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PriorityQueue"]


class PriorityQueue:
    """Min-heap on ``item.pri``; ``item.index`` is maintained (-1 when not queued)."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: list[Any] = []

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self):
        return iter(list(self._items))

    def push(self, item: Any) -> None:
        items = self._items
        item.index = len(items)
        items.append(item)
        self._up(item.index)

    def peek(self) -> Any:
        return self._items[0] if self._items else None

    def pop(self) -> Any:
        return self.remove(self._items[0])

    def remove(self, item: Any) -> Any:
        items = self._items
        i = item.index
        if i < 0 or i >= len(items) or items[i] is not item:
            raise ValueError("item is not in this queue")
        last = items.pop()
        if last is not item:
            items[i] = last
            last.index = i
            self._down(i)
            self._up(last.index)
        item.index = -1
        return item

    def peek_and_shift(self, max_pri: float) -> Any:
        """Pop and return the first item if its ``pri`` <= ``max_pri``, else None."""
        items = self._items
        if not items or items[0].pri > max_pri:
            return None
        return self.remove(items[0])

    def clear(self) -> list[Any]:
        items, self._items = self._items, []
        for item in items:
            item.index = -1
        return items

    def _up(self, i: int) -> None:
        items = self._items
        item = items[i]
        while i > 0:
            parent = (i - 1) >> 1
            p = items[parent]
            if p.pri <= item.pri:
                break
            items[i] = p
            p.index = i
            i = parent
        items[i] = item
        item.index = i

    def _down(self, i: int) -> None:
        items = self._items
        n = len(items)
        item = items[i]
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            right = child + 1
            if right < n and items[right].pri < items[child].pri:
                child = right
            c = items[child]
            if item.pri <= c.pri:
                break
            items[i] = c
            c.index = i
            i = child
        items[i] = item
        item.index = i
