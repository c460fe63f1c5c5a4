"""Per-key order across nodes (issue 45, "What must hold"): an ordered topic on a cluster
of three dmq nodes (``ChaosCluster``), 1,000 keys, producers spread over the nodes,
consumers of both channels on every node, under faults. Two runs:

**faults** (``run_faults``), in this order while the load is on:

1. a billing consumer of the orderer (the node holding ``/dmq/orderer/<topic>``) is killed
   holding a copy whose key has a later message stored; another takes its place;
2. a billing and an audit consumer of the orderer are paused ``pause_for`` seconds (less
   than the message timeout) holding copies;
3. the **orderer** is killed with ``-9`` while a consumer of each channel holds a copy
   there; another node takes the lock, claims the cursors and waits out the handover
   (the topic's message timeout) before it pushes; the killed node is started again once
   the lock has moved;
4. a node that is **not** the orderer is killed with ``-9`` (it stored copies: its
   producers move on and resend; a survivor takes its incarnation over, leaving the
   ordered cursors to the orderer) and started again after ``kill_other_for`` seconds;
5. the orderer is frozen with SIGSTOP past its ZooKeeper session (its consumers keep
   their connections: a kill ends nothing of theirs), until another node holds the lock,
   then woken with SIGCONT while the new orderer waits out the handover. A consumer of
   each channel there holds copies from before the freeze (reading on, acknowledging
   nothing) until ``held_past_lock`` after the lock moved (3.5-4 s in all, within the
   message timeout): a new orderer pushing their keys without the wait is an overlap.
   Woken, the old orderer must push nothing more (its session is gone; it learns so, and
   gates the topic): no consumer of it reads a push after the SIGCONT.

**move** (``run_move``): the topic starts on PostgreSQL cluster ``b`` (a private
PostgreSQL, the nodes' ``--pg-cluster``) and is moved to ``main`` (the Patroni cluster,
id slot 0: its ids are lower than b's) with ``dmq topic move`` under load; each key's
copies stored on b go out before any stored on main (``broker.placement.move_held``).

The topic's message timeout is short (``MSG_TIMEOUT``; it is the handover wait, the
nodes' ``--msg-timeout`` stays 60 s), so each handover costs seconds. The
records and the count are ``ordered``'s (``check_order``, with the node kills recorded
per node: a kill ends only the pushes that came through that node); the report adds the
pushes per node, the handovers (when the lock moved, when the new orderer first pushed),
the fenced acks and, for the move, the keys with copies on both clusters.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from dmq_server.db.clusters import SLOT_SHIFT
from tests.integration.support import REPO, scrape_metrics

from . import ordered
from .checker import History
from .cluster import CHROOT, ChaosCluster
from .load import Confirmer
from .ordered import (Attempt, KeyedConsumer, KeyedProducer, OrderedRun, await_orderer, followed, kill_node, orderer,
                      pause_consumers, pause_node)

__all__ = ["NodesTiming", "MSG_TIMEOUT", "run_faults", "run_move", "handovers", "move"]

CHANNELS = ordered.CHANNELS
MSG_TIMEOUT = 4.0  # seconds: the topic's message timeout (the handover wait)


@dataclass(frozen=True)
class NodesTiming:
    producers: int = 4
    rate: float = 50.0  # sends per second per producer
    kill_consumer_at: float = 2.0
    pause_at: float = 4.0
    pause_for: float = 2.0  # less than MSG_TIMEOUT: no copy of a paused consumer times out
    kill_orderer_at: float = 7.0
    kill_other_for: float = 4.0  # past the nodes' 3 s ZooKeeper session: a survivor takes over
    after: float = 3.0  # load after the last fault
    move_at: float = 4.0
    after_move: float = 4.0
    handover: float = 30.0  # the longest wait for a new orderer, and for its first push
    held_past_lock: float = 0.3  # a frozen orderer's consumers hold copies this long after the lock moved
    drain: float = 60.0
    linger: float = 1.5


class _ClusterShare:
    """The acks one PostgreSQL cluster's ``Confirmer`` looks for: those of ids of its slot
    (an id names the cluster that drew it), so a copy on another cluster is never taken
    for durable because this one does not have it."""

    def __init__(self, history: History, slot: int):
        self.history, self.slot = history, slot

    def unconfirmed(self) -> list[tuple[str, int]]:
        return [(ch, mid) for ch, mid in self.history.unconfirmed() if mid >> SLOT_SHIFT == self.slot]

    def confirm(self, items: list[tuple[str, int]], now: float, asked: float | None = None) -> None:
        self.history.confirm(items, now, asked)


class Traffic:
    """The run's producers (``keyed_producers`` over every node), consumers (two of each
    channel on every node, ``consumers_on_every_node``) and confirmers (one per PostgreSQL
    cluster: ``clusters`` maps its id slot to a DSN the test reads it with)."""

    def __init__(self, cluster: ChaosCluster, topic: str, timing: NodesTiming, clusters: dict[int, str],
                 seed: int = 0):
        self.cluster, self.topic, self.timing = cluster, topic, timing
        self.rng = random.Random(seed)
        self.history = History(CHANNELS)
        self.origin = time.monotonic()
        self.ids = ordered.node_ids(cluster)
        self.producers: list[KeyedProducer] = ordered.keyed_producers(
            cluster.client_addresses, topic, self.history, self.rng, producers=timing.producers, rate=timing.rate)
        self.consumers: list[KeyedConsumer] = ordered.consumers_on_every_node(
            cluster.client_addresses, self.ids, topic, self.history, self.rng)
        self.confirmers = [Confirmer(dsn, topic, _ClusterShare(self.history, slot))
                           for slot, dsn in sorted(clusters.items())]

    def since(self, at: float) -> str:
        return f"+{at - self.origin:.2f} s"

    def start(self) -> None:
        for c in self.consumers:
            c.start()
        for c in self.consumers:
            ordered._await(c.subscribed.is_set, 30, f"{c.consumer} subscribed: {c.errors}")
        for c in self.confirmers:
            c.start()
        for p in self.producers:
            p.start()

    def at(self, offset: float) -> None:
        """The schedule: sleep until ``offset`` seconds after the start (pacing, not a
        wait for anything; a fault that took longer moves the rest on)."""
        time.sleep(max(0.0, self.origin + offset - time.monotonic()))

    def of(self, node: int, channel: str | None = None) -> list[KeyedConsumer]:
        return [c for c in self.consumers if c.node == self.ids[node] and channel in (None, c.channel)]

    def add_consumer(self, node: int, channel: str, instance: int) -> KeyedConsumer:
        c = ordered.keyed_consumer(f"{self.ids[node]}-{channel}-{instance}", ordered._nth(
            self.cluster.client_addresses, node), self.topic, channel, instance, self.history, self.rng,
            node=self.ids[node])
        self.consumers.append(c)
        c.start()
        return c

    def pushes(self) -> list[Attempt]:
        return [a for c in self.consumers for a in c.records()]

    def first_push(self, node: int, after: float) -> float | None:
        """When a consumer of ``node`` first received a push after ``after`` (None: not yet)."""
        found = [a.pushed_at for a in self.pushes() if a.node == self.ids[node] and a.pushed_at > after]
        return min(found) if found else None

    def finish(self, out: OrderedRun) -> None:
        """No new sends; wait until every acknowledged send reached both channels (or
        ``drain``), keep the consumers on ``linger`` seconds, stop everything, and fill
        ``out`` with the records."""
        for p in self.producers:
            p.stopping.set()
        for p in self.producers:
            p.join(30)
        for p in self.producers:
            p.halt.set()
        try:
            ordered._await(lambda: not any(self.history.missing().values()), self.timing.drain,
                           "every acknowledged send pushed on both channels")
            out.drained = True
        except RuntimeError as exc:
            out.failures.append(str(exc))
        time.sleep(self.timing.linger)  # consumers stay on: a wrong push has time to show
        self.stop()
        for p in self.producers:
            out.sends.update(p.acked)
        out.attempts = self.pushes()
        out.failures += [f"{t.name}: {t.failure!r}" for t in (*self.producers, *self.consumers) if t.failure]
        out.notes["producer_errors"] = {p.name: p.errors for p in self.producers if p.errors}
        out.notes["resends"] = sum(p.resends for p in self.producers)
        out.notes["acks_by_node"] = {p.name: p.acks_by_node for p in self.producers}

    def stop(self) -> None:
        for p in self.producers:
            p.stopping.set()
            p.halt.set()
        for c in self.consumers:
            c.resume()
            c.stop.set()
        for c in self.consumers:
            c.join(10)
        for c in self.confirmers:
            c.stop.set()
            c.join(10)
            conn = c.once()  # a last look, after the consumers stopped
            if conn is not None:
                conn.close()


def _holding(consumers: list[KeyedConsumer]) -> bool:
    """A consumer of each channel among ``consumers`` holds a copy 40 ms more."""
    return all(any(c.holds_past(time.monotonic() + 0.04) for c in consumers if c.channel == ch) for ch in CHANNELS)


def _acks_fenced(cluster: ChaosCluster) -> dict[str, int]:
    """Per node, the acks refused by the cursor fence since it last started."""
    out = {}
    for node in cluster.nodes:
        try:
            out[node.flags["node_id"]] = int(scrape_metrics(node.http)[("dmq_acks_fenced_total", ())])
        except (OSError, KeyError):
            out[node.flags["node_id"]] = -1
    return out


def handovers(run: OrderedRun) -> list[dict[str, object]]:
    """The run's handovers (``notes["handovers"]``)."""
    found = run.notes.get("handovers", [])
    assert isinstance(found, list)
    return found


def _handover(t: Traffic, run: OrderedRun, cause: str, old: int, fault_at: float,
              seen: tuple[int, float] | None = None) -> int:
    """Wait until a node other than ``old`` holds the lock (``seen``: found already, by
    then) and pushes; record when (from ``fault_at``). Returns the new orderer's index."""
    if seen is None:
        seen = (await_orderer(t.cluster, t.topic, t.timing.handover, other_than=old), time.monotonic())
    new, locked = seen
    ordered._await(lambda: t.first_push(new, locked) is not None, t.timing.handover,
                   f"a push of {t.ids[new]}, the new orderer, after {cause}")
    pushed = t.first_push(new, locked)
    assert pushed is not None
    handovers(run).append({"cause": cause, "from": t.ids[old], "to": t.ids[new],
                           "lock_after_s": round(locked - fault_at, 2),
                           "first_push_after_lock_s": round(pushed - locked, 2)})
    run.faults.append(f"{cause}: {t.ids[new]} held the lock {locked - fault_at:.2f} s later and pushed "
                      f"{pushed - locked:.2f} s after that")
    return new


def run_faults(cluster: ChaosCluster, topic: str, timing: NodesTiming = NodesTiming(), *, seed: int = 0
               ) -> OrderedRun:
    """The faults run (see the module) on the ordered ``topic`` (on main)."""
    first = await_orderer(cluster, topic, 30)
    t = Traffic(cluster, topic, timing, {0: cluster.direct_dsn}, seed)
    out = OrderedRun(topic, t.origin, history=t.history)
    out.notes["handovers"] = []
    out.notes["first_orderer"] = t.ids[first]
    try:
        t.start()
        # 1. a billing consumer of the orderer killed holding a copy with a later message of its key stored
        t.at(timing.kill_consumer_at)
        now = orderer(cluster, topic)
        assert now is not None, "no orderer"
        victim = next(c for c in t.of(now, "billing") if c.hold > 0)
        victim.kill_if = followed(t.producers)
        ordered._await(victim.killed.is_set, 15, f"{victim.consumer} holding a copy with a later message of "
                                                 f"its key stored, then killed")
        out.faults.append(f"{victim.consumer} killed at {t.since(time.monotonic())} holding "
                          f"{victim.held_at_kill} copies; another takes its place")
        out.notes["held_at_consumer_kill"] = victim.held_at_kill
        t.add_consumer(now, "billing", 3)  # one that holds copies too (odd), in the victim's place

        # 2. a consumer of each channel of the orderer paused holding copies
        t.at(timing.pause_at)
        paused = [next(c for c in t.of(now, ch) if c.hold > 0 and not c.killed.is_set()) for ch in CHANNELS]
        pause_consumers(paused, timing.pause_for, out, t.since)

        # 3. the orderer killed -9 while a consumer of each channel holds a copy there
        t.at(timing.kill_orderer_at)
        old = orderer(cluster, topic)
        assert old is not None, "no orderer"
        ordered._await(lambda: _holding(t.of(old)), 15, f"a consumer of each channel of {t.ids[old]} holding a "
                                                        f"copy 40 ms more")
        killed_at = time.monotonic()
        out.notes["out_at_orderer_kill"] = {ch: sum(1 for c in t.of(old, ch) for a in c.records()
                                                    if a.ended_at is None) for ch in CHANNELS}
        heal = kill_node(cluster, old, out)
        out.faults.append(f"the orderer {t.ids[old]} killed -9 at {t.since(killed_at)}")
        new = _handover(t, out, f"{t.ids[old]} killed", old, killed_at)
        heal()
        out.faults.append(f"{t.ids[old]} serving again at {t.since(time.monotonic())}")

        # 4. a node that is not the orderer (nor the one just killed) killed -9, started again past its session
        other = next(i for i in range(len(cluster.nodes)) if i not in (new, old))
        killed_at = time.monotonic()
        heal = kill_node(cluster, other, out)
        time.sleep(timing.kill_other_for)  # the fault held
        heal()
        out.faults.append(f"{t.ids[other]} (not the orderer) killed -9 at {t.since(killed_at)}, serving again at "
                          f"{t.since(time.monotonic())}")

        # 5. the orderer frozen past its ZooKeeper session, woken while the next one waits
        # out the handover; a consumer of each channel there holds copies across the
        # freeze until just after the lock moved (paused; less than the message timeout
        # in all): the new orderer must not push their keys meanwhile
        old = orderer(cluster, topic)
        assert old is not None, "no orderer"
        holders = [next(c for c in t.of(old, ch) if c.hold > 0 and not c.killed.is_set()) for ch in CHANNELS]
        for c in holders:
            c.holding.set()  # reads on (a push is recorded when it arrives), acknowledges nothing
        ordered._await(lambda: all(c.held() for c in holders), 15,
                       f"{', '.join(c.consumer for c in holders)} holding copies")
        frozen_at = time.monotonic()
        heal = pause_node(cluster, old)
        held = [c.held() for c in holders]
        try:
            new = await_orderer(cluster, topic, timing.handover, other_than=old)
            locked = time.monotonic()
        finally:
            heal()
        woke = time.monotonic()
        time.sleep(timing.held_past_lock)  # the fault held
        for c in holders:
            c.holding.clear()
        out.notes["woken_orderer"] = (t.ids[old], woke)
        out.notes["held_across_freeze"] = sum(held)
        out.faults.append(f"the orderer {t.ids[old]} frozen (SIGSTOP) at {t.since(frozen_at)} while "
                          f"{', '.join(c.consumer for c in holders)} held {held} "
                          f"copies, woken (SIGCONT) at {t.since(woke)}, once {t.ids[new]} held the lock; the "
                          f"consumers let go at {t.since(time.monotonic())}")
        _handover(t, out, f"{t.ids[old]} frozen", old, frozen_at, (new, locked))

        time.sleep(timing.after)  # the load goes on after the last fault
        t.finish(out)
    finally:
        t.stop()
    name, woke = out.notes.pop("woken_orderer")
    late = sorted((a for a in out.attempts if a.node == name and a.pushed_at > woke), key=lambda a: a.pushed_at)
    out.notes["pushed_by_woken_orderer"] = len(late)
    if late:  # which copies, to whom, how long after the wake (a failure says what to look for)
        out.notes["woken_orderer_pushes"] = [
            f"{a.channel} id {a.message_id} key {a.key} to {a.consumer} +{a.pushed_at - woke:.3f}s (attempt {a.attempts})"
            for a in late[:10]]
    out.notes["acks_fenced"] = _acks_fenced(cluster)
    return out


def move(cluster: ChaosCluster, b_dsn: str, topic: str, to: str, timeout: float = 90.0
         ) -> subprocess.CompletedProcess[str]:
    """``dmq topic move TOPIC --cluster TO`` with the real CLI, on the cluster's ZooKeeper
    (direct, not through the fault proxy) and both PostgreSQL clusters."""
    return subprocess.run(
        [sys.executable, "-m", "dmq_server.admin.cli", "--zk", f"{cluster.zk.address}{CHROOT}",
         "--pg-dsn", cluster.direct_dsn, "--pg-cluster", f"b={b_dsn}",
         "topic", "move", topic, "--cluster", to, "--settle", "3", "--timeout", f"{timeout - 15:g}"],
        capture_output=True, text=True, cwd=REPO, timeout=timeout,
    )


def run_move(cluster: ChaosCluster, b_dsn: str, b_slot: int, topic: str, timing: NodesTiming = NodesTiming(),
             *, seed: int = 1) -> OrderedRun:
    """The move run (see the module): ``topic`` (ordered, on cluster b) moved to main
    under load."""
    await_orderer(cluster, topic, 30)
    t = Traffic(cluster, topic, timing, {0: cluster.direct_dsn, b_slot: b_dsn}, seed)
    out = OrderedRun(topic, t.origin, history=t.history)
    result: list[subprocess.CompletedProcess[str] | BaseException] = []
    try:
        t.start()
        t.at(timing.move_at)
        began = time.monotonic()

        def moving() -> None:
            try:
                result.append(move(cluster, b_dsn, topic, "main"))
            except BaseException as exc:  # reported below
                result.append(exc)

        mover = threading.Thread(target=moving, daemon=True)
        mover.start()
        mover.join(120)
        done = time.monotonic()
        outcome = result[0] if result else RuntimeError("dmq topic move did not return in 120 s")
        if isinstance(outcome, BaseException):
            out.failures.append(f"dmq topic move failed: {outcome!r}")
        elif outcome.returncode != 0:
            out.failures.append(f"dmq topic move failed: {outcome.stdout}{outcome.stderr}")
        else:
            out.notes["move_output"] = outcome.stdout.strip().splitlines()
        out.faults.append(f"dmq topic move {topic} b -> main from {t.since(began)} to {t.since(done)}")
        out.notes["move_s"] = round(done - began, 2)
        time.sleep(timing.after_move)  # the load goes on on main
        t.finish(out)
    finally:
        t.stop()
    both = [k for k, sent in out.sends.items() if {mid >> SLOT_SHIFT for mid, _ in sent} == {0, b_slot}]
    out.notes["keys_on_both_clusters"] = len(both)
    out.notes["sends_per_cluster"] = {slot: sum(1 for sent in out.sends.values() for mid, _ in sent
                                                if mid >> SLOT_SHIFT == slot) for slot in (b_slot, 0)}
    out.notes["acks_fenced"] = _acks_fenced(cluster)
    return out
