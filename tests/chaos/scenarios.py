"""The faults, and how one scenario runs: load, fault, heal, drain, count.

A scenario is a name and a ``fault(cluster, load)`` that injects the fault and
returns what heals it. ``run`` puts the cluster under mixed load (``Load``: paced
producers on every node, two channels with two consumers each), waits ``before``
seconds, injects, holds the fault ``hold`` seconds, heals, keeps the load on for
``after`` seconds, then stops producing and waits (at most ``drain`` seconds) until
every acknowledged send reached both channels, keeps the consumers on ``linger``
seconds more so a wrong redelivery has time to show, and counts (``checker.check``).

Two sends in three carry a priority (``load.priority_of``), and the consumers of one
channel (``STALLS``: audit) stop acknowledging for 2.5 s of every 4, with a credit of 25,
on nodes whose memory window is ``WINDOW`` copies (``NODE_FLAGS``): that channel's window
fills on every node in every stall (the first stall lasts until ``window.WindowWatch`` saw
it full, and the fault waits for that), so copies of a higher priority take the places of
lower ones (issue 45 §3) while the faults happen. ``window.WindowWatch`` records how full
the windows were and the copies it saw set aside (the report's ``window`` note).

The report gives, besides the counts: the **outage** (the longest time a producer went
without an acknowledgement, among the gaps that began between a second before the fault
and a second after its heal) and when it ended after the fault (**recovered**), and
acknowledged sends per second before, during (fault to recovery) and after (the
``after`` seconds from when every producer was acknowledged again after the heal). Everything is bounded in time and stops by itself.
"""

from __future__ import annotations

import signal
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from .checker import check, throughput
from .cluster import ChaosCluster
from .load import Load, Stalls
from .window import WindowWatch

__all__ = ["Timing", "SCENARIOS", "NODE_FLAGS", "WINDOW", "run", "format_report", "diagnose"]

CHANNELS = ["billing", "audit"]
WINDOW = 100  # copies of a channel a node keeps in memory: a stalled channel fills it in a second
NODE_FLAGS = {"mem_queue_size": str(WINDOW)}
STALLS = Stalls(channel="audit")
Heal = Callable[[], None]
Fault = Callable[[ChaosCluster, Load], Heal]


@dataclass(frozen=True)
class Timing:
    before: float = 3.0
    hold: float = 4.0
    after: float = 4.0
    drain: float = 60.0
    linger: float = 2.0
    rate: float = 120.0  # sends per second per producer
    producers: int = 3


# -- the faults ------------------------------------------------------------------------
def kill_node(cluster: ChaosCluster, load: Load) -> Heal:
    """kill -9 of one dmq node: its producers fail over and resend, a survivor takes
    over the copies it stored."""
    cluster.nodes[1].kill()
    return lambda: cluster.restart_node(1)


def pause_node(cluster: ChaosCluster, load: Load) -> Heal:
    """SIGSTOP of one dmq node for longer than its ZooKeeper session: the others take
    over its copies while it is frozen; on SIGCONT it finds its session lost, with
    acks of its consumers (who hold each copy half a second) waiting unread"""
    node = cluster.nodes[1]
    load.notes["acks_fenced_on_paused_node"] = -_fenced_count(node)  # the node outlives scenarios
    node.proc.send_signal(signal.SIGSTOP)
    return lambda: node.proc.send_signal(signal.SIGCONT)


def _fenced_count(node: Any) -> int:
    from tests.integration.support import scrape_metrics

    return int(scrape_metrics(node.http)[("dmq_acks_fenced_total", ())])


def _acks_fenced(cluster: ChaosCluster, load: Load) -> None:
    """How many acks the paused node read on waking for cursors taken over meanwhile
    (not applied: the taker delivered those copies again)."""
    load.notes["acks_fenced_on_paused_node"] += _fenced_count(cluster.nodes[1])


class SlowTaker:
    """node-pause with the race the ack fence exists for, set up on purpose rather than
    left to timing. Every consumer stops acknowledging until it holds its full credit,
    so no node can push another copy; then node 1 is frozen past its ZooKeeper session
    and another node claims its cursors and loads its copies, which wait there unpushed.
    While node 1 is still frozen its consumers acknowledge the copies they hold: the
    acks wait unread in its sockets, for copies the taker holds ready. On SIGCONT node 1
    reads them at once (learning that its session is gone takes a round trip to
    ZooKeeper) and its acker flushes them; only once every one of them is counted
    (durable, fenced or refused, on node 1's metrics) and the confirmer has looked may
    the consumers acknowledge again, and the taker push.

    With the fence, the statement refuses those acks (the taker holds the cursors), so
    the taker's push is a redelivery of a copy not yet done. Without it, the acks move
    the cursors the taker now holds: the confirmer sees the copies done, then the taker
    pushes them from memory, a delivery after a durable ack on every one (the checker's
    **duplicated**). The topic's message timeout is a minute so that nothing held comes
    back by itself while the consumers stall (10-20 s)."""

    MSG_TIMEOUT_MS = 60_000
    PAUSED = 1  # the index of the frozen node
    # The taker loads the frozen node's copies only while its own window has room: with
    # every consumer stalled, the suite's small window (``WINDOW``) would be full of its
    # own copies, and the race would never be set up. The load runs without ``STALLS``.
    FLAGS = {"mem_queue_size": "10000"}

    def prepare(self, cluster: ChaosCluster) -> None:
        for i in range(len(cluster.nodes)):
            cluster.restart_node(i, flags=self.FLAGS)

    def fault(self, cluster: ChaosCluster, load: Load) -> Heal:
        """every consumer stops acknowledging until each holds its full credit, then SIGSTOP
        of one dmq node past its ZooKeeper session; its consumers acknowledge what they hold
        while it is frozen and the others go on only once it has read those acks on waking"""
        node = cluster.nodes[self.PAUSED]
        frozen = [c for c in load.consumers if c.node == self.PAUSED]
        for c in load.consumers:
            c.stalled.set()
        _await(lambda: all(len(c.in_flight) >= c.credit for c in load.consumers), 60,
               "every consumer holding its full credit")
        before = _ack_counts(node)  # its consumers acknowledged nothing since they began to fill
        node.proc.send_signal(signal.SIGSTOP)

        def heal() -> None:
            # the copies node 1's consumers hold are ready, unpushed, on the node that took
            # its cursors over: the highest of each channel, as a load goes in id order
            highest = {ch: max(mid for c in frozen if c.channel == ch for mid in c.held_ids())
                       for ch in load.channels}
            others = [n for i, n in enumerate(cluster.nodes) if i != self.PAUSED]
            try:
                _await(lambda: all(any(_held_ready(n, load.topic, ch, mid) for n in others)
                                   for ch, mid in highest.items()), 60,
                       f"another node holding {highest} ready (node {self.PAUSED + 1}'s copies claimed and loaded)")
            except RuntimeError as exc:  # what held the claim up, if PostgreSQL knows
                raise RuntimeError(f"{exc}\n{_lock_waits(cluster)}") from None
            stale = [(c.channel, mid) for c in frozen for mid in c.held_ids()]
            sent = sum(c.acks_sent for c in frozen)
            for c in frozen:
                c.stalled.clear()
            _await(lambda: sum(c.acks_sent for c in frozen) - sent >= len(stale), 10,
                   f"node {self.PAUSED + 1}'s consumers acknowledging the {len(stale)} copies they hold")
            for c in frozen:  # nothing more from them until the taker has pushed
                c.stalled.set()
            load.notes["stale_acks_on_paused_node"] = len(stale)
            node.proc.send_signal(signal.SIGCONT)
            _await(lambda: sum(_ack_counts(node).values()) >= sum(before.values()) + len(stale), 30,
                   f"node {self.PAUSED + 1} counting the {len(stale)} acks it read on waking")
            after = _ack_counts(node)
            load.notes["stale_acks_on_waking"] = {what: after[what] - n for what, n in before.items()}
            load.confirm_now()
            confirmed = load.history.snapshot().confirmed
            load.notes["stale_acks_durable_before_taker_pushed"] = sum(1 for key in stale if key in confirmed)
            for c in load.consumers:
                c.stalled.clear()

        return heal


def _lock_waits(cluster: ChaosCluster) -> str:
    """The primary's sessions waiting for a lock, and those holding them up (state, how
    long in their transaction, the statement): a takeover's claim waits for the owner row
    that a group commit of a node frozen between its statement and its COMMIT keeps
    share-locked (seen once, final-5 of /work/notes/chaos-priority-10: every claim of node
    2's copies timed out for a minute)."""
    import psycopg

    query = """
        SELECT a.pid, a.application_name, a.client_port, a.state, a.wait_event_type, a.wait_event,
               round(extract(epoch FROM now() - a.xact_start)::numeric, 1) AS in_transaction_s,
               pg_blocking_pids(a.pid) AS blocked_by, left(a.query, 160)
        FROM pg_stat_activity a
        WHERE cardinality(pg_blocking_pids(a.pid)) > 0
           OR a.pid IN (SELECT unnest(pg_blocking_pids(b.pid)) FROM pg_stat_activity b)
        ORDER BY a.pid"""
    try:
        with psycopg.connect(cluster.direct_dsn, autocommit=True, connect_timeout=5) as conn:
            rows = conn.execute(query).fetchall()
    except Exception as exc:  # the store may be the thing that failed
        return f"(lock waits unreadable: {exc})"
    if not rows:
        return "no session of the primary waits for a lock"
    return "lock waits on the primary (pid, application, client port, state, wait, wait event, " \
        "seconds in its transaction, blocked by, statement):\n" + "\n".join(f"  {row}" for row in rows)


def _ack_counts(node: Any) -> dict[str, int]:
    """The acks a node has made durable, seen fenced, and refused, since it started."""
    from tests.integration.support import scrape_metrics

    metrics = scrape_metrics(node.http)
    return {what: int(metrics[(f"dmq_acks_{what}_total", ())]) for what in ("durable", "fenced", "refused")}


def _held_ready(node: Any, topic: str, channel: str, message_id: int) -> bool:
    """Whether ``node`` holds the channel's copy of the message in memory, waiting for a
    consumer with credit (``/admin/messages/ID``: the trace's live copies)."""
    import json

    from tests.integration.support import http_get

    status, body = http_get(f"{node.http}/admin/messages/{message_id}", timeout=3)
    if status != 200:
        raise RuntimeError(f"/admin/messages/{message_id} answered HTTP {status}: {body[:200]}")
    trace = json.loads(body)
    return trace["topic"] == topic and trace["live"].get(channel, {}).get("state") == "ready"


def _await(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` (records of the load or of the nodes) until it holds; a
    RuntimeError naming ``what`` past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout:g} s: {what}")
        time.sleep(0.05)


def kill_primary(cluster: ChaosCluster, load: Load) -> Heal:
    """kill -9 of the PostgreSQL primary's host (Patroni and every PostgreSQL process):
    Patroni promotes the synchronous standby; the old primary comes back a standby."""
    member = cluster.patroni.primary()
    assert member is not None, "no primary to kill"
    member.kill()
    return member.start


def kill_standby(cluster: ChaosCluster, load: Load) -> Heal:
    """kill -9 of the synchronous standby: commits wait until Patroni makes the other
    standby synchronous (strict mode never commits on one copy)."""
    member = cluster.patroni.sync_standby()
    assert member is not None, "no synchronous standby to kill"
    member.kill()
    return member.start


def pause_primary(cluster: ChaosCluster, load: Load) -> Heal:
    """SIGSTOP of every process of the primary PostgreSQL (Patroni keeps its lock)."""
    member = cluster.patroni.primary()
    assert member is not None
    member.signal_postgres(signal.SIGSTOP)
    return lambda: member.signal_postgres(signal.SIGCONT)


def _route_fault(kind: str, mode: str, arg: float | None = None) -> Fault:
    def fault(cluster: ChaosCluster, load: Load) -> Heal:
        assert cluster.proxy is not None
        routes = {"pg": cluster.pg_routes(), "zk": ["zk"], "clients": cluster.node_routes()}[kind]
        cluster.proxy.set_all(routes, mode, arg)
        return lambda: cluster.proxy.set_all(routes, "pass")  # type: ignore[union-attr]

    fault.__doc__ = f"{mode} {arg or ''} on every link between {kind} and dmq"
    return fault


def restart_zookeeper(cluster: ChaosCluster, load: Load) -> Heal:
    """kill -9 of ZooKeeper, started again after the hold: dmq's and Patroni's sessions
    survive a short outage (the server keeps them), longer ones expire."""
    cluster.zk.kill()
    return lambda: cluster.zk.start()


def kill_consumers(cluster: ChaosCluster, load: Load) -> Heal:
    """One consumer of each channel dies (RST) holding unacknowledged copies: they go to
    the channel's other consumer. A new consumer replaces each at the heal."""
    held = 0
    for c in load.consumers:
        if c.instance == 0:  # the first consumer of each channel: all its connections
            held += c.kill()
    load.notes["in_flight_at_kill"] = held

    def heal() -> None:
        load.add_consumers(1)

    return heal


def jump_clock(cluster: ChaosCluster, load: Load) -> Heal:
    """The wall clock of one node (started under libfaketime) jumps 30 s ahead, then 5 s
    back at the heal: its message timeouts and timers see time move by steps."""
    cluster.set_clock(30)
    return lambda: cluster.set_clock(25)


def _prepare_faketime(cluster: ChaosCluster) -> None:
    cluster.restart_node(2, faketime=True)


def _delay_moved(node: Any) -> int:
    """Delayed messages the node's delay workers moved since it started."""
    return sum(w["moved"] for state in _delay_clusters(node).values() for w in state.get("workers", []))


def _delay_clusters(node: Any) -> dict[str, Any]:
    """The node's ``/admin/delay`` per PostgreSQL cluster (one node's answer has no
    ``clusters`` key when it has only main)."""
    import json

    from tests.integration.support import http_get

    status, body = http_get(node.http + "/admin/delay", timeout=3)
    if status != 200:
        raise RuntimeError(f"/admin/delay answered HTTP {status}")
    data = json.loads(body)
    return data.get("clusters", {"main": data})


class RetentionSweep:
    """The retention sweep under a node's kill -9 and a channel left behind. The nodes
    keep a fully acknowledged message ``RETENTION`` seconds (not 600) and sweep every
    250 ms (``FLAGS``), so every node sweeps all through the run: what both channels finished
    goes within seconds, while what the stalled channel holds grows older than the
    retention and must stay. The held copies are counted in the store at the heal, before
    any of them can be acknowledged (a row swept too early could still be delivered from
    a node's memory, so zero lost alone would not prove it), and again at the end, when
    they must have gone."""

    RETENTION = 2.0
    FLAGS = {"message_retention": f"{RETENTION:g}s", "sweep_interval": "250ms"}

    def __init__(self) -> None:
        self.held: list[int] = []

    def prepare(self, cluster: ChaosCluster) -> None:
        for i in range(len(cluster.nodes)):
            cluster.restart_node(i, flags=self.FLAGS)

    def fault(self, cluster: ChaosCluster, load: Load) -> Heal:
        """every consumer of the audit channel dies (RST) and one dmq node is killed -9,
        on nodes keeping an acknowledged message 2 s and sweeping every 250 ms"""
        for c in load.consumers:
            if c.channel == "audit":
                c.kill()
        cluster.nodes[1].kill()

        def heal() -> None:
            # audit's copies acknowledged to producers longer than the retention ago (a
            # margin for the clocks): old, and not done, so in the store still (delayed
            # sends are left out: their acknowledged id is not their message's)
            h = load.history.snapshot()
            old = time.monotonic() - self.RETENTION - 0.5
            self.held = [mid for key, (at, mid) in h.acked.items()
                         if at < old and key not in h.deliveries["audit"] and load.immediate(key)]
            load.notes["audit_old_held_at_heal"] = len(self.held)
            load.notes["audit_old_held_missing_at_heal"] = len(self.held) - _stored(cluster, load.topic, self.held)
            cluster.restart_node(1, flags=self.FLAGS)
            load.add_consumers(1, channels=["audit"])

        return heal

    def after(self, cluster: ChaosCluster, load: Load) -> None:
        load.notes["audit_old_held_stored_at_end"] = _stored(cluster, load.topic, self.held)
        load.notes["swept_by_nodes"] = sum(_swept(node) for node in cluster.nodes)


def _stored(cluster: ChaosCluster, topic: str, ids: list[int]) -> int:
    """How many of the messages ``ids`` of ``topic`` are stored (read from the primary)."""
    import psycopg

    with psycopg.connect(cluster.direct_dsn, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT count(*) FROM dmq_message WHERE topic = %s AND id = ANY(%s)",
                           (topic, ids)).fetchone()
    return int(row[0])


def _swept(node: Any) -> int:
    """The node's ``dmq_swept_messages_total`` since it started."""
    from tests.integration.support import scrape_metrics

    return int(scrape_metrics(node.http)[("dmq_swept_messages_total", ())])


class SeekUnderLoad:
    """``dmq channel seek`` of one channel (billing) back to a message acknowledged a second
    and a half before, under load, with a dmq node killed -9 at the same instant (its copies
    are taken over, it comes back as a new incarnation). Every message the seek made
    billing's to deliver again (``REPLAYED``: its ids from the target to the highest the
    seek read, read from the primary) must be pushed again after the seek began, and
    billing must end with nothing pending; audit is not touched (its counts as ever).
    Pushes of those ids from the seek on are counted as asked for, not as duplicates, until
    an ack of the replayed copy is seen durable; any other push after a durable ack still is
    one."""

    CHANNEL = "billing"

    def __init__(self) -> None:
        self.started = 0.0
        self.pivot = self.top = self.count = 0
        self.replayed: set[int] = set()

    def fault(self, cluster: ChaosCluster, load: Load) -> Heal:
        """a seek of one channel (billing) back to a message acknowledged 1.5 s before, and a
        dmq node killed -9 at the same instant; heal: the node restarted"""
        import json
        import subprocess
        import sys

        from tests.integration.support import REPO

        h = load.history.snapshot()
        now = time.monotonic()
        acked = sorted((at, mid) for key, (at, mid) in h.acked.items() if at <= now - 1.5 and load.immediate(key))
        self.pivot = acked[-1][1]
        self.started = time.monotonic()
        seek = subprocess.Popen(
            [sys.executable, "-m", "dmq_server.admin.cli", "--pg-dsn", cluster.direct_dsn, "channel", "seek",
             load.topic, self.CHANNEL, "--to-id", str(self.pivot), "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        )
        cluster.nodes[1].kill()
        out, err = seek.communicate(timeout=60)
        if seek.returncode != 0:
            raise RuntimeError(f"dmq channel seek failed ({seek.returncode}): {err}")
        [report] = json.loads(out)
        load.history.replay_acks_from(time.monotonic())  # the seek has committed
        self.top, self.count = report["top"], report["count"]
        load.notes["seek"] = {"pivot": self.pivot, "top": self.top, "count": self.count,
                              "cli_s": round(time.monotonic() - self.started, 2)}

        def heal() -> None:
            cluster.restart_node(1)

        return heal

    def after(self, cluster: ChaosCluster, load: Load) -> None:
        import psycopg

        with psycopg.connect(cluster.direct_dsn, autocommit=True, connect_timeout=5) as conn:
            self.replayed = {r[0] for r in conn.execute(
                "SELECT id FROM dmq_message WHERE topic = %s AND id BETWEEN %s AND %s "
                "AND (channel IS NULL OR channel = %s)", (load.topic, self.pivot, self.top, self.CHANNEL))}

            def pending() -> int:
                return int(conn.execute("SELECT count(*) FROM dmq_pending WHERE topic = %s AND channel = %s",
                                        (load.topic, self.CHANNEL)).fetchone()[0])

            deadline = time.monotonic() + 30
            left = pending()
            while left and time.monotonic() < deadline:
                time.sleep(0.2)  # the consumers' own pace: polling the store's answer
                left = pending()
        h = load.history.snapshot()
        again = {mid for seen in h.deliveries[self.CHANNEL].values() for at, mid in seen if at >= self.started}
        # ids of the range that may have committed after the seek's snapshot (a send in flight
        # below its top: the seek did not count it, billing gets it as a new message): those
        # acknowledged to their producer only after the seek began, or never
        acked_at = {mid: at for at, mid in h.acked.values()}
        late = {mid for mid in self.replayed if acked_at.get(mid, self.started) >= self.started}
        seek = load.notes["seek"]
        assert isinstance(seek, dict)
        # (a late one acknowledged before the seek wrote its cursor keeps its ack: not again)
        seek.update(replayed=len(self.replayed), late=len(late),
                    replayed_not_pushed_again=len(self.replayed - late - again),
                    billing_pending_at_end=left)

    def expected(self) -> dict[str, tuple[float, set[int]]]:
        return {self.CHANNEL: (self.started, self.replayed)}


_retention_sweep = RetentionSweep()
_slow_taker = SlowTaker()
_seek = SeekUnderLoad()

SCENARIOS: dict[str, tuple[Fault, Callable[[ChaosCluster], None] | None, dict[str, Any]]] = {
    "node-kill": (kill_node, None, {}),
    "node-pause": (pause_node, None, {"hold_acks": 0.5, "after": _acks_fenced}),
    "node-pause-slow-taker": (_slow_taker.fault, _slow_taker.prepare,
                              {"topic": {"msg_timeout_ms": SlowTaker.MSG_TIMEOUT_MS}, "stalls": None}),
    "pg-primary-kill": (kill_primary, None, {}),
    "pg-standby-kill": (kill_standby, None, {}),
    "pg-primary-pause": (pause_primary, None, {}),
    "net-pg-latency": (_route_fault("pg", "latency", 150), None, {}),
    "net-pg-blackhole": (_route_fault("pg", "blackhole"), None, {}),
    "net-pg-reset": (_route_fault("pg", "reset"), None, {}),
    "net-pg-trickle": (_route_fault("pg", "trickle", 20000), None, {}),
    "net-zk-blackhole": (_route_fault("zk", "blackhole"), None, {}),
    "zk-restart": (restart_zookeeper, None, {}),
    "net-clients-reset": (_route_fault("clients", "reset"), None, {}),
    "net-clients-trickle": (_route_fault("clients", "trickle", 5000), None, {}),
    "consumer-kill": (kill_consumers, None, {"hold_acks": 0.5}),
    "clock-jump": (jump_clock, _prepare_faketime, {}),
    "retention-sweep": (_retention_sweep.fault, _retention_sweep.prepare, {"after": _retention_sweep.after}),
    "seek-node-kill": (_seek.fault, None, {"after": _seek.after, "replayed": _seek.expected}),
}


# -- one run ----------------------------------------------------------------------------
def run(cluster: ChaosCluster, name: str, timing: Timing = Timing(), *,
        make_load: Callable[..., Load] = Load, topic: str | None = None) -> dict[str, Any]:
    """``make_load``: ``Load`` or a load of its interface (``aio_load.AioLoad``: asyncio
    clients); ``topic``: the topic's name (a fresh one by default)."""
    fault, prepare, extra = SCENARIOS[name]
    if prepare is not None:
        prepare(cluster)
    topic = topic or f"chaos_{name.replace('-', '_')}_{uuid.uuid4().hex[:6]}"
    cluster.register_topic(topic, CHANNELS, **extra.get("topic", {}))
    stalls = extra.get("stalls", STALLS)
    load = make_load(cluster.client_addresses, topic, CHANNELS, cluster.direct_dsn,
                     producers=timing.producers, rate=timing.rate, hold=extra.get("hold_acks", 0.0),
                     priorities=True, stalls=stalls)
    window = int(cluster.nodes[0].flags.get("mem_queue_size", "10000"))
    watch = WindowWatch(cluster.nodes, topic, CHANNELS, window, load.history, stalls.channel if stalls else None,
                        load.window_filled)
    load.start()
    watch.start()
    injected = healed = time.monotonic()
    try:
        time.sleep(timing.before)  # the load's own pace: measured, not waited for
        if stalls is not None:  # the fault meets a full window: the first stall lasts until it is
            load.window_filled.wait(stalls.fill_within)
        injected = time.monotonic()
        heal = fault(cluster, load)
        time.sleep(timing.hold)
        healed = time.monotonic()
        heal()
        healed_done = time.monotonic()
        served_again = _await_acks_since(load, healed_done, timing.drain)
        time.sleep(timing.after)
        load_end = time.monotonic()
        load.stop_producing(timeout=timing.drain)
        delivered = load.wait_delivered(timing.drain)
        time.sleep(timing.linger)
        if prepare is _prepare_faketime:  # the jumped node took part in delay moves too
            load.notes["delay_moved_by_jumped_node"] = _delay_moved(cluster.nodes[2])
        if "after" in extra:  # what the scenario reads of the cluster before the load stops
            extra["after"](cluster, load)
    finally:
        watch.stop.set()
        watch.join(10)
        load.stop()
    load.notes["window"] = {"size": window, **watch.figures(injected, healed)}
    counts = check(load.history, replayed=extra["replayed"]() if "replayed" in extra else None)
    h = load.history
    gap, gap_end = _longest_gap([p.ack_times for p in load.producers], injected - 1.0, healed_done, load_end)
    recovered = max(injected, gap_end)
    return {
        "scenario": name,
        "fault": " ".join((fault.__doc__ or "").split()),
        "topic": topic,
        "attempted": len(h.attempted),
        "acked": len(h.acked),
        "all_delivered": delivered,
        "channels": [c.__dict__ for c in counts],
        "ok": delivered and all(c.ok() for c in counts) and not load.failures(),
        "failures": load.failures(),
        "outage_s": round(gap, 2),
        "recovered_after_fault_s": round(recovered - injected, 2),
        "recovered_after_heal_s": round(max(0.0, recovered - healed_done), 2),
        "heal_took_s": round(healed_done - healed, 2),
        "acks_per_s": {
            "before": round(throughput(h.ack_times, injected - timing.before, injected), 1),
            "during": round(throughput(h.ack_times, injected, max(recovered, injected + 0.5)), 1),
            # the ``after`` seconds once every producer was served again since the heal; not
            # from the end of the longest gap, which can be the end of the load itself when
            # one producer stalls again after the heal (that left no window at all)
            "after": round(throughput(h.ack_times, served_again, load_end), 1),
        },
        "producer_errors": _merge(p.errors for p in load.producers),
        "resends": sum(p.resends for p in load.producers),
        "notes": dict(load.notes),
        # for a failed run: each example's history, in seconds from the fault (healed at
        # ``heal_at_s``), the pushes and acks with the nodes that made and took them
        "heal_at_s": round(healed - injected, 3),
        "timelines": {f"{c.channel} {key}": h.timeline(c.channel, key.encode(), injected)
                      for c in counts for key in (*c.duplicated_examples, *c.lost_examples)[:5]},
    }


def _await_acks_since(load: Load, since: float, timeout: float) -> float:
    """Keep the load on until every producer was acknowledged after ``since`` (bounded),
    and say when: throughput after the fault is measured from then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.ack_times and p.ack_times[-1] > since for p in load.producers):
            break
        time.sleep(0.05)  # polling the producers' own records; they run at their own pace
    return time.monotonic()


def _longest_gap(series: list[list[float]], start: float, fault_end: float, end: float) -> tuple[float, float]:
    """The longest time a producer went without an ack, among the gaps that began while
    the fault could be the cause (from ``start`` to a second after ``fault_end``), and
    when it ended (no later than ``end``)."""
    best, best_end = 0.0, start
    for times in series:
        last = start
        for t in [x for x in times if start <= x <= end] + [end]:
            if last <= fault_end + 1.0 and t - last > best:
                best, best_end = t - last, t
            last = t
    return best, best_end


def _merge(dicts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"{report['scenario']}: {'OK' if report['ok'] else 'FAILED'}  ({report['fault']})",
        f"  sends attempted {report['attempted']}, acknowledged {report['acked']}, resends {report['resends']}, "
        f"producer errors {report['producer_errors']}",
        f"  outage {report['outage_s']} s, "
        + (f"recovered {report['recovered_after_fault_s']} s after the fault "
           f"({report['recovered_after_heal_s']} s after the heal)" if report["outage_s"] >= 1.0 else "no stall"),
        f"  acks/s before {report['acks_per_s']['before']}, during {report['acks_per_s']['during']}, "
        f"after {report['acks_per_s']['after']}",
    ]
    for c in report["channels"]:
        lines.append(
            f"  {c['channel']}: lost {c['lost']}, duplicated {c['duplicated']}, unexpected {c['unexpected']}, "
            f"redelivered {c['redelivered']}, " + (f"replayed by a seek {c['replayed']}, " if c["replayed"] else "")
            + f"delivered {c['delivered']} "
            f"(+{c['unacknowledged_delivered']} unacknowledged sends delivered)"
            + (f" lost e.g. {c['lost_examples']}" if c["lost"] else "")
            + (f" duplicated e.g. {c['duplicated_examples']}" if c["duplicated"] else "")
            + (f", wrong priority {c['wrong_priority']} e.g. {c['wrong_priority_examples']}"
               if c["wrong_priority"] else "")
        )
        lines.append(f"    {c['channel']} pushes by priority {c['by_priority']}, "
                     f"median s from ack to first push {c['wait_by_priority']}")
    if report["failures"]:
        lines.append(f"  load failures: {report['failures']}")
    if report["notes"]:
        lines.append(f"  notes: {report['notes']}")
    return "\n".join(lines)


def diagnose(cluster: ChaosCluster, report: dict[str, Any]) -> str:
    """For a failed scenario: where its lost sends are in the store (message, delivery and
    delay rows, read from the primary), the timeline of each lost or duplicated example,
    and the warnings the nodes logged, to start from."""
    import psycopg

    lines = []
    queries = {
        "message": "SELECT id, node_id, published_at, priority FROM dmq_message"
                   " WHERE producer = %s AND session_id = %s",
        "pending": "SELECT d.channel, d.holder, d.attempts FROM dmq_pending d JOIN dmq_message m"
                   " ON m.id = d.message_id WHERE m.producer = %s AND m.session_id = %s",
        "delay": "SELECT id, node_id, due_ms, fragment FROM dmq_delay WHERE producer = %s AND session_id = %s",
    }
    try:
        with psycopg.connect(cluster.direct_dsn, autocommit=True, connect_timeout=5) as conn:
            for channel in report["channels"]:
                for key in channel["lost_examples"][:3]:
                    producer, sid = key.rsplit("/", 1)
                    found = {name: conn.execute(q, (producer, int(sid))).fetchall() for name, q in queries.items()}
                    lines.append(f"lost on {channel['channel']}: {key}: {found}")
    except Exception as exc:  # the store may be the thing that failed
        lines.append(f"(the store could not be read: {exc})")
    for example, events in report.get("timelines", {}).items():
        lines.append(f"timeline of {example} (the fault at +0, healed at +{report.get('heal_at_s')} s):")
        lines.extend(f"  {event}" for event in events)
    for node in cluster.nodes:
        noted = [line[:300] for line in node.log().splitlines() if "#warn" in line or "#error" in line]
        lines.append(f"--- {node.flags['node_id']}: last warnings\n" + "\n".join(noted[-15:]))
        lines.append(f"    delay scheduler: {_delay_state(node)}")
    return "\n".join(lines)


def _delay_state(node: Any) -> str:
    """Which delay fragments a node holds and what its workers did (``/admin/delay``):
    a delayed send lost is a row in a fragment nobody served."""
    try:
        out = []
        for cluster, state in _delay_clusters(node).items():
            assignment = state.get("assignment") or {}
            workers = [(w["range"], w["polls"], w["moves"], w["moved"], w["timers_pending"], w["last_error"])
                       for w in state.get("workers", [])]
            out.append(f"{cluster}: owned {len(state.get('owned', []))} of {state.get('fragments')}, "
                       f"assignment {assignment.get('state')} (rebalances {assignment.get('rebalances')}), "
                       f"workers (range, polls, moves, moved, timers, last error) {workers}")
        return "; ".join(out)
    except Exception as exc:  # the node may be the thing that failed
        return f"unreadable: {exc}"
