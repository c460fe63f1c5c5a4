"""What the memory windows of a scenario's channels did: how full they were, and the
copies seen set aside (issue 45 §3: a copy of a higher priority committed while a
channel's window is full takes the place of the newest waiting copy of a lower one,
which leaves memory and is read from PostgreSQL again later).

``WindowWatch`` looks, every ``interval`` seconds, while the load runs:

* at every node's ``/stats`` (JSON, the scenario's topic): per channel, the copies waiting
  in memory (``depth - backend_depth``: ready, of a priority, parked) and in PostgreSQL
  only (``backend_depth``). A sample is **full** when the copies in memory reach the
  window (``--mem-queue-size``);
* at the first node's peek of the stalled channel (``/admin/channels/T/C/peek``: the
  stored unacknowledged copies, each with that node's live state): a copy seen ready in
  memory, then still stored, not live on the node and never pushed, was **set aside**. A
  ready copy leaves memory otherwise only by a push (then it is in flight, or acknowledged
  and pushed in the history) or when the node forgets the channel's copies (its
  ZooKeeper session lost: only under the faults of every node). The first node is the one
  no scenario kills, pauses or restarts alone.

Everything it reads is the nodes' own answer for operators; it changes nothing, and a
node that does not answer (killed, paused) is skipped for that look.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TypedDict

from tests.integration.support import ServerProcess, http_get

from .checker import History

__all__ = ["WindowWatch", "WindowFigures"]

PEEK_PAGES = 3  # of 500 copies: a stalled channel's copies in every node's memory, and more


class WindowFigures(TypedDict):
    samples: int  # node looks that answered
    full: int  # of them with the window full
    full_during_fault: int  # of those between the fault and its heal
    max_in_memory: int
    max_in_store_only: int


class WindowWatch(threading.Thread):
    def __init__(self, nodes: list[ServerProcess], topic: str, channels: list[str], window: int,
                 history: History, stalled: str | None, filled: threading.Event, interval: float = 0.25):
        super().__init__(daemon=True, name="chaos-window-watch")
        self.nodes = nodes
        self.topic = topic
        self.window = window
        self.history = history
        self.stalled = stalled
        self.interval = interval
        self.stop = threading.Event()
        self.filled = filled  # set at the first look that finds the stalled channel's window full
        self.samples: list[tuple[float, str, int, int]] = []  # (when, channel, in memory, in store only)
        self.channels = list(channels)
        self.set_aside: dict[int, int] = {}  # message id -> its priority
        self._ready: dict[int, int] = {}  # last look: ids ready on the first node -> priority

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            for node in self.nodes:
                self._stats(node)
            if self.stalled is not None:
                self._peek(self.nodes[0], self.stalled)

    def _stats(self, node: ServerProcess) -> None:
        try:
            status, body = http_get(f"{node.http}/stats?format=json&topic={self.topic}"
                                    "&include_clients=false&include_mem=false", timeout=1)
        except OSError:
            return
        if status != 200:
            return
        now = time.monotonic()
        for topic in json.loads(body)["topics"] or []:
            for c in topic["channels"]:
                in_memory = c["depth"] - c["backend_depth"]
                self.samples.append((now, c["channel_name"], in_memory, c["backend_depth"]))
                if c["channel_name"] == self.stalled and in_memory >= self.window:
                    self.filled.set()

    def _peek(self, node: ServerProcess, channel: str) -> None:
        ready: dict[int, int] = {}
        stored_only: set[int] = set()
        after = 0
        for _ in range(PEEK_PAGES):
            try:
                status, body = http_get(f"{node.http}/admin/channels/{self.topic}/{channel}/peek"
                                        f"?after={after}&limit=500", timeout=2)
            except OSError:
                return
            if status != 200:
                return
            page = json.loads(body)
            for row in page["messages"]:
                live = row["live"]
                if live is None:
                    stored_only.add(row["message_id"])
                elif live["state"] == "ready":
                    ready[row["message_id"]] = row["priority"]
            if page["next_after"] is None:
                break
            after = page["next_after"]
        gone = (self._ready.keys() & stored_only) - self.history.delivered_ids(channel)
        for mid in gone:
            self.set_aside.setdefault(mid, self._ready[mid])
        self._ready = ready

    def figures(self, fault: float, heal: float) -> dict[str, object]:
        """Per channel, the window's figures (``WindowFigures``); the copies seen set aside
        on the first node, by priority."""
        out: dict[str, object] = {}
        for channel in self.channels:
            mine = [(t, m, s) for t, c, m, s in self.samples if c == channel]
            full = [t for t, m, _ in mine if m >= self.window]
            out[channel] = WindowFigures(
                samples=len(mine), full=len(full), full_during_fault=sum(1 for t in full if fault <= t <= heal),
                max_in_memory=max((m for _, m, _ in mine), default=0),
                max_in_store_only=max((s for _, _, s in mine), default=0),
            )
        by_priority: dict[int, int] = {}
        for priority in self.set_aside.values():
            by_priority[priority] = by_priority.get(priority, 0) + 1
        out["set_aside_seen_on_node1"] = dict(sorted(by_priority.items()))
        return out
