"""The count, Jepsen's way: what producers were told, what consumers got, what went wrong.

A run records, with timestamps on one monotonic clock:

* every send a producer *attempted* (its body is its identity: ``<producer>/<session id>``,
  the pair dmq's resend idempotency keys on),
* every send *acknowledged* (``SEND_SUCCESS_ACK``) and its message id,
* every *delivery* per channel (push received) and whether the consumer acked it,
* when each ack was *confirmed*: seen durable in the store (its delivery row gone
  from the primary; the confirmer in ``load.py`` looks); after a seek made acknowledged
  ids pending again (``replay_acks_from``), the acks sent from then on are confirmed
  again, apart: a push of a replayed id after its replay's ack was durable is a duplicate.

``check`` turns that into per-channel counts:

* **lost**: acknowledged to a producer, never delivered to the channel. The bar is 0.
* **duplicated**: delivered again after an ack of an earlier delivery of it on that
  channel was confirmed durable. The bar is 0: at-least-once allows a redelivery
  only while the ack is not yet durable (a timeout, a consumer or node that died,
  an ack batch whose outcome was unknown). A delivery counts when the consumer reads
  it, not when a node decided it: a node frozen with a push still in its own buffers
  must not write it on waking if its copies may have moved (``protocols/turn.py``;
  node-pause once counted such a push as a duplicate). Only a push already in the
  kernel or the network could still arrive late, and the suite's faults that delay
  those (the fault proxy's) take no node's copies away.
* **redelivered**: the deliveries again that are allowed (before confirmation).
* **unexpected**: delivered but never sent by any producer of the run.
* **unacknowledged delivered**: sends that failed or went unanswered but were stored
  and delivered anyway (SEND_SERVER_ERROR means "outcome unknown"), counted, fine.
* **wrong priority**: pushes whose priority (read from the push's properties) is not the
  one the send carried. The bar is 0: a copy keeps its priority through takeovers, loads,
  the priority read-ahead and delayed moves.
* **by priority**: pushes per priority (0 to 9), and the median time from a send's
  acknowledgement to its first push, per priority: that the priorities flowed, and
  whether the higher ones went first while copies waited.

Pure Python on plain values (no sockets, no clock of its own), so the unit tier tests
it (tests/unit/test_chaos_checker.py) and bench/chaos.py prints the same report.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["History", "ChannelCount", "check", "throughput"]


@dataclass
class ChannelCount:
    channel: str
    delivered: int = 0  # distinct sends delivered
    deliveries: int = 0  # pushes received, repeats included
    lost: int = 0
    duplicated: int = 0
    redelivered: int = 0
    unexpected: int = 0
    unacknowledged_delivered: int = 0
    wrong_priority: int = 0
    replayed: int = 0  # pushes a seek asked for (``check``'s ``replayed``): not duplicates
    lost_examples: list[str] = field(default_factory=list)
    duplicated_examples: list[str] = field(default_factory=list)
    wrong_priority_examples: list[str] = field(default_factory=list)
    by_priority: dict[int, int] = field(default_factory=dict)  # priority -> pushes
    wait_by_priority: dict[int, float] = field(default_factory=dict)  # priority -> median s to first push

    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.unexpected == 0 and self.wrong_priority == 0


class History:
    """What one run's producers and consumers saw; safe to record into from threads."""

    def __init__(self, channels: list[str]):
        self.channels = list(channels)
        self._lock = threading.Lock()
        self.attempted: set[bytes] = set()
        self.priorities: dict[bytes, int] = {}  # key -> the priority its send carried (0 left out)
        self.acked: dict[bytes, tuple[float, int]] = {}  # key -> (when, message id)
        self.ack_times: list[float] = []
        # channel -> key -> [(received at, message id)]
        self.deliveries: dict[str, dict[bytes, list[tuple[float, int]]]] = {c: {} for c in channels}
        # channel -> key -> the priorities its pushes carried, when one differed from its send's
        self.pushed_priority: dict[str, dict[bytes, list[int]]] = {c: {} for c in channels}
        self.by_priority: dict[str, dict[int, int]] = {c: {} for c in channels}  # channel -> priority -> pushes
        self.delivery_times: list[float] = []
        self.consumer_acks: dict[tuple[str, int], float] = {}  # (channel, message id) -> when acked
        self.confirmed: dict[tuple[str, int], float] = {}  # (channel, message id) -> seen durable at
        # a seek's replay (replay_acks_from): the acks sent from ``replay_from`` on, confirmed
        # again: (channel, message id) -> seen durable at
        self.replay_from: float | None = None
        self.reconfirmed: dict[tuple[str, int], float] = {}
        # which node pushed each delivery and took each ack (the consumer's connection), for
        # the timeline of a failed run: (channel, key) -> [(when, message id, node)] and
        # (channel, message id) -> [(when, node)]
        self.pushed_by: dict[tuple[str, bytes], list[tuple[float, int, int]]] = {}
        self.acked_by: dict[tuple[str, int], list[tuple[float, int]]] = {}

    # -- recording -------------------------------------------------------------------
    def attempt(self, key: bytes, priority: int = 0) -> None:
        with self._lock:
            self.attempted.add(key)
            if priority:
                self.priorities[key] = priority

    def ack(self, key: bytes, message_id: int, now: float) -> None:
        with self._lock:
            if key not in self.acked:
                self.acked[key] = (now, message_id)
                self.ack_times.append(now)

    def deliver(self, channel: str, key: bytes, message_id: int, now: float, node: int = -1,
                priority: int = 0) -> None:
        with self._lock:
            self.deliveries[channel].setdefault(key, []).append((now, message_id))
            counts = self.by_priority[channel]
            counts[priority] = counts.get(priority, 0) + 1
            if priority != self.priorities.get(key, 0):
                self.pushed_priority[channel].setdefault(key, []).append(priority)
            self.delivery_times.append(now)
            self.pushed_by.setdefault((channel, key), []).append((now, message_id, node))

    def consumer_ack(self, channel: str, message_id: int, now: float, node: int = -1) -> None:
        with self._lock:
            self.consumer_acks.setdefault((channel, message_id), now)
            self.acked_by.setdefault((channel, message_id), []).append((now, node))

    def replay_acks_from(self, when: float) -> None:
        """A seek made ids acknowledged before pending again, and it committed before
        ``when``: acks sent from then on are confirmed again (``reconfirmed``), so that a
        push after the replay's own ack was durable counts as a duplicate. An ack sent
        earlier may be of a copy pushed before the seek, which its epoch fence refuses."""
        with self._lock:
            self.replay_from = when

    def _acked_since_replay(self, item: tuple[str, int], until: float) -> bool:
        start = self.replay_from
        return start is not None and any(start <= at <= until for at, _ in self.acked_by.get(item, ()))

    def unconfirmed(self) -> list[tuple[str, int]]:
        """Acks sent whose durability has not been seen yet (for the confirmer)."""
        with self._lock:
            return [k for k in self.consumer_acks
                    if k not in self.confirmed
                    or (k not in self.reconfirmed and self._acked_since_replay(k, float("inf")))]

    def confirm(self, items: list[tuple[str, int]], now: float, asked: float | None = None) -> None:
        """``items`` seen durable at ``now`` by a look at the store begun at ``asked``
        (after every ack it confirms was sent): only acks sent by ``asked`` count for a
        replay's confirmation."""
        with self._lock:
            for item in items:
                self.confirmed.setdefault(item, now)
                if asked is not None and item not in self.reconfirmed and self._acked_since_replay(item, asked):
                    self.reconfirmed[item] = now

    # -- reading -----------------------------------------------------------------------
    def missing(self) -> dict[str, int]:
        """Per channel, how many acknowledged sends are not delivered (yet)."""
        with self._lock:
            acked = set(self.acked)
            return {c: len(acked - got.keys()) for c, got in self.deliveries.items()}

    def delivered_ids(self, channel: str) -> set[int]:
        """The message ids pushed on ``channel`` so far."""
        with self._lock:
            return {mid for seen in self.deliveries[channel].values() for _, mid in seen}

    def snapshot(self) -> "History":
        copy = History(self.channels)
        with self._lock:
            copy.attempted = set(self.attempted)
            copy.priorities = dict(self.priorities)
            copy.pushed_priority = {c: {k: list(v) for k, v in d.items()} for c, d in self.pushed_priority.items()}
            copy.by_priority = {c: dict(d) for c, d in self.by_priority.items()}
            copy.acked = dict(self.acked)
            copy.ack_times = list(self.ack_times)
            copy.deliveries = {c: {k: list(v) for k, v in d.items()} for c, d in self.deliveries.items()}
            copy.delivery_times = list(self.delivery_times)
            copy.consumer_acks = dict(self.consumer_acks)
            copy.confirmed = dict(self.confirmed)
            copy.replay_from = self.replay_from
            copy.reconfirmed = dict(self.reconfirmed)
            copy.pushed_by = {k: list(v) for k, v in self.pushed_by.items()}
            copy.acked_by = {k: list(v) for k, v in self.acked_by.items()}
        return copy

    def timeline(self, channel: str, key: bytes, origin: float = 0.0) -> list[str]:
        """What happened to one send on one channel, in time order (seconds from
        ``origin``): each push and the node that made it, each ack and the node it went
        to, when the confirmer saw an ack durable. A duplicate's cause starts here."""
        h = self.snapshot()
        events: list[tuple[float, str]] = []
        if key in h.acked:
            when, mid = h.acked[key]
            priority = h.priorities.get(key, 0)
            events.append((when, f"send acknowledged to its producer as id {mid}"
                           + (f" (priority {priority})" if priority else "")))
        ids = set()
        for when, mid, node in h.pushed_by.get((channel, key), []):
            ids.add(mid)
            events.append((when, f"pushed id {mid} by node {node + 1}"))
        for mid in sorted(ids):
            for when, node in h.acked_by.get((channel, mid), []):
                events.append((when, f"ack of id {mid} sent to node {node + 1}"))
            if (channel, mid) in h.confirmed:
                events.append((h.confirmed[(channel, mid)], f"ack of id {mid} seen durable"))
            if (channel, mid) in h.reconfirmed:
                events.append((h.reconfirmed[(channel, mid)], f"ack of id {mid}'s replay seen durable"))
        return [f"{when - origin:+9.3f} s  {what}" for when, what in sorted(events)]


def check(history: History, examples: int = 5,
          replayed: dict[str, tuple[float, set[int]]] | None = None) -> list[ChannelCount]:
    """The per-channel counts of ``history`` (see the module's docstring). ``replayed``:
    per channel, a seek's start (monotonic) and the message ids it made the channel's to
    deliver again: their pushes received from then on are counted apart, not as duplicates,
    until an ack of the replay is seen durable (``History.reconfirmed``): a push after that
    is one."""
    h = history.snapshot()
    replayed = replayed or {}
    out = []
    for channel in h.channels:
        got = h.deliveries[channel]
        count = ChannelCount(channel)
        count.delivered = len(got)
        count.deliveries = sum(len(v) for v in got.values())
        lost = sorted(set(h.acked) - got.keys())
        count.lost = len(lost)
        count.lost_examples = [k.decode(errors="replace") for k in lost[:examples]]
        count.unexpected = len(got.keys() - h.attempted)
        count.unacknowledged_delivered = len((got.keys() & h.attempted) - h.acked.keys())
        for key, seen in got.items():
            # the moment an ack of this send on this channel was first seen durable:
            # a push received after it is a duplicate, one before it a redelivery
            confirmed = [h.confirmed[(channel, mid)] for _, mid in seen if (channel, mid) in h.confirmed]
            confirmed_at = min(confirmed) if confirmed else None
            since, again = replayed.get(channel, (float("inf"), set()))
            replay_done = min((h.reconfirmed[(channel, mid)] for _, mid in seen
                               if mid in again and (channel, mid) in h.reconfirmed), default=float("inf"))
            asked = sum(1 for received, mid in seen if since <= received <= replay_done and mid in again)
            count.replayed += asked
            dups = sum(1 for received, mid in seen if confirmed_at is not None and received > confirmed_at
                       and not (since <= received <= replay_done and mid in again))
            count.duplicated += dups
            count.redelivered += max(0, len(seen) - 1 - dups - asked)
            if dups and len(count.duplicated_examples) < examples:
                count.duplicated_examples.append(key.decode(errors="replace"))
        wrong = h.pushed_priority[channel]
        count.wrong_priority = sum(len(v) for v in wrong.values())
        count.wrong_priority_examples = [f"{k.decode(errors='replace')} {h.priorities.get(k, 0)} pushed as {v}"
                                         for k, v in sorted(wrong.items())[:examples]]
        count.by_priority = dict(sorted(h.by_priority[channel].items()))
        count.wait_by_priority = _waits(h, got)
        out.append(count)
    return out


def _waits(h: History, got: dict[bytes, list[tuple[float, int]]]) -> dict[int, float]:
    """Per priority, the median seconds from a send's acknowledgement to its first push
    on the channel (sends acknowledged and delivered)."""
    waits: dict[int, list[float]] = {}
    for key, seen in got.items():
        if key in h.acked:
            waits.setdefault(h.priorities.get(key, 0), []).append(min(t for t, _ in seen) - h.acked[key][0])
    return {p: round(sorted(w)[len(w) // 2], 3) for p, w in sorted(waits.items())}


def throughput(times: list[float], start: float, end: float) -> float:
    """Events per second in [start, end) (0 for an empty window)."""
    if end <= start:
        return 0.0
    return sum(1 for t in times if start <= t < end) / (end - start)
