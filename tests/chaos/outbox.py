"""The outbox under faults: transactions of an application database send through
``dmq_client.outbox.send``; the relay, dmq's PostgreSQL and the application's own
PostgreSQL are killed at random moments; then every committed send is counted.

    producer threads --psycopg--> application PostgreSQL (embedded, its own)
                                      ^ the relay (one of two nodes, --outbox chaos=...)
    consumers (both channels, both nodes) <-- dmq nodes --> Patroni (dmq's PostgreSQL)

Each producer thread loops: open a transaction, insert a business row ``orders(thread,
txn, sends)``, send 1-5 messages whose body names (thread, transaction, position), then
commit or roll back at random. Which transactions committed is read afterwards from the
business table, not from what the producers heard: a COMMIT whose answer was lost (the
application's PostgreSQL killed under it) is an unknown outcome, and a transaction that
failed before its COMMIT was never committed. A producer that *heard* its commit and finds
no row means the application's PostgreSQL lost a commit (counted apart, ``commits lost``).

Each node relays the outbox with its own database role (``relay_node1``, ``relay_node2``,
granted only what docs/client.md says a relay needs), so the holder of the relay's lock
in ``pg_locks`` names the relaying node: the fault kills that node, not a guess.

The faults, in a random order (the seed is printed), each at a random moment of the load
and held for a random 1-3 s: kill -9 of the relaying node (restarted; the other node must
take the relay over), kill -9 of dmq's PostgreSQL primary (Patroni fails over; the old
primary comes back a standby), kill -9 of the application's PostgreSQL (every process;
started again on its port) while a producer's COMMIT is on its way (``CrashAtCommit``),
so a commit's answer is lost in every run. After each heal the run waits until a transaction committed
after it is delivered on both channels; after the last, producing stops and the run waits
(bounded) until the outbox is empty and every committed send reached both channels.

The counts (``count``): per channel **lost** (committed, never delivered) and **phantom**
(delivered, never committed: rolled back, or not sent by this run); **duplicated**: a send
stored in ``dmq_message`` under more than one message id, delivered under more than one,
or delivered again after an ack of it was seen durable (the chaos checker's rule);
**out of order**: a committed transaction whose sends' message ids do not rise in send
order. Every one must be 0.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from dmq_client import outbox
from dmq_server.db.embedded import EmbeddedPostgres

from .checker import History, check
from .cluster import ChaosCluster
from .load import Load

__all__ = ["AppDatabase", "CrashAtCommit", "OutboxProducer", "OutboxRun", "Counts", "CHANNELS", "OUTBOX", "count", "format_report", "run"]

CHANNELS = ["billing", "audit"]
OUTBOX = "chaos"  # the relay's name for the outbox: producers outbox:chaos
RELAY_ROLE = "relay_node{}"


class AppDatabase:
    """The application's own PostgreSQL (embedded, under ``base``): a database ``shop`` with
    the outbox installed, the business table, and one login role per relaying node."""

    def __init__(self, base: Path, nodes: int):
        self.pg = EmbeddedPostgres(base)
        self.nodes = nodes
        self.passfile = base / "relay.pgpass"
        self._password = uuid.uuid4().hex

    def start(self) -> "AppDatabase":
        from dmq_server.db.outbox import install

        self.pg.start()
        with psycopg.connect(self.pg.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE shop")
        install(self.dsn)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE orders (thread int, txn int, sends int NOT NULL, PRIMARY KEY (thread, txn))")
            for i in range(1, self.nodes + 1):
                role = RELAY_ROLE.format(i)
                conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{self._password}'")
                # what docs/client.md ("The relay in dmq-server") says a relay's role needs
                conn.execute(f"GRANT USAGE ON SCHEMA dmq_outbox TO {role}")
                conn.execute(f"GRANT SELECT, DELETE ON dmq_outbox.outbox TO {role}")
        self.passfile.write_text("".join(f"127.0.0.1:*:shop:{RELAY_ROLE.format(i)}:{self._password}\n"
                                         for i in range(1, self.nodes + 1)))
        self.passfile.chmod(0o600)
        return self

    @property
    def dsn(self) -> str:
        """The owner's DSN (producers, checks)."""
        return self.pg.dsn_for("shop")

    def relay_dsn(self, index: int) -> str:
        """Node ``index``'s (0-based) DSN for ``--outbox``: its own role."""
        return (f"host=127.0.0.1 port={self.pg.port} dbname=shop user={RELAY_ROLE.format(index + 1)} "
                f"passfile={self.passfile} connect_timeout=3")

    def kill(self) -> None:
        """kill -9 of the postmaster and every backend (a crash)."""
        self.pg.kill()

    def restart(self) -> None:
        """Start it again on its port (the nodes' DSNs name it): crash recovery, then up."""
        self.pg.start(keep_port=True)

    def relaying_node(self) -> int | None:
        """The index of the node whose relay holds the outbox's lock now, None if none does."""
        with psycopg.connect(self.dsn, autocommit=True, connect_timeout=3) as conn:
            rows = conn.execute(
                "SELECT a.usename FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.locktype = 'advisory' AND l.granted AND a.usename LIKE 'relay_node%'").fetchall()
        if not rows:
            return None
        return int(rows[0][0].removeprefix("relay_node")) - 1

    def outbox_rows(self) -> int:
        with psycopg.connect(self.dsn, autocommit=True, connect_timeout=3) as conn:
            row = conn.execute("SELECT count(*) FROM dmq_outbox.outbox").fetchone()
        return int(row[0]) if row else -1

    def committed(self) -> dict[tuple[int, int], int]:
        """(thread, transaction) -> sends, of every transaction that committed."""
        with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
            return {(t, x): n for t, x, n in conn.execute("SELECT thread, txn, sends FROM orders")}

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.pg.log_file.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(unreadable: {exc})"

    def stop(self) -> None:
        try:
            self.pg.stop(mode="immediate")
        finally:
            if self.pg.is_running():
                self.pg.kill()


def key_of(thread: int, txn: int, pos: int) -> bytes:
    """A send's body and identity: which thread, which of its transactions, which send in it."""
    return f"{thread}/{txn}/{pos}".encode()


class CrashAtCommit:
    """The application's PostgreSQL killed with a COMMIT on its way, its answer lost. ``arm``
    readies it; the first producer to reach its COMMIT afterwards ``take``s it and sends
    the COMMIT without reading the answer, and the kill comes, at random, either before its
    backend could read it (the backend frozen first: not committed) or once the backend is
    idle again (committed). Either way the producer hears only a broken connection
    ("unknown"), and the business table decides, as it must for a real application."""

    def __init__(self, app: "AppDatabase", seed: int):
        self.app = app
        self.rng = random.Random(seed)
        self.armed = threading.Event()
        self.done = threading.Event()
        self.outcome = ""  # "before the COMMIT was read" | "after it committed"
        self._lock = threading.Lock()
        self._admin: psycopg.Connection | None = None

    def arm(self) -> None:
        self._admin = psycopg.connect(self.app.dsn, autocommit=True, connect_timeout=3)
        self.done.clear()
        self.armed.set()

    def take(self) -> bool:
        """For the producer about to COMMIT: True if it is the one to lose its answer."""
        if not self.armed.is_set():
            return False
        with self._lock:
            if not self.armed.is_set():
                return False
            self.armed.clear()
        return True

    def lose_answer(self, conn: psycopg.Connection) -> None:
        """Send COMMIT on ``conn``, kill the application's PostgreSQL, raise as a lost answer."""
        admin = self._admin
        assert admin is not None
        pid = conn.info.backend_pid
        try:
            if self.rng.random() < 0.5:
                self.outcome = "before the COMMIT was read"
                os.kill(pid, signal.SIGSTOP)
                conn.pgconn.send_query(b"COMMIT")
            else:
                self.outcome = "after it committed"
                conn.pgconn.send_query(b"COMMIT")
                _await(lambda: admin.execute("SELECT state FROM pg_stat_activity WHERE pid = %s",
                                             (pid,)).fetchone() == ("idle",), 10, "the backend done with the COMMIT")
            admin.close()
            self.app.kill()
        finally:
            self.done.set()
        raise psycopg.OperationalError("the COMMIT's answer was lost: the application's PostgreSQL was killed")


class OutboxProducer(threading.Thread):
    """One application thread: paced transactions of a business insert and 1-5 sends,
    three in four committed, the others rolled back."""

    def __init__(self, index: int, dsn: str, topic: str, history: History, *, rate: float, seed: int,
                 crash: CrashAtCommit | None = None):
        super().__init__(daemon=True, name=f"chaos-outbox-p{index}")
        self.index = index
        self.dsn = dsn
        self.topic = topic
        self.history = history
        self.rate = rate  # transactions per second
        self.rng = random.Random(seed)
        self.stopping = threading.Event()
        self.crash = crash
        self.heard: dict[int, str] = {}  # txn -> "committed" | "rolled back" | "unknown" (what it was told)
        self.committed_at: dict[int, float] = {}  # txn -> when its COMMIT was answered
        self.errors: dict[str, int] = {}
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the run, never swallowed
            self.failure = exc

    def _run(self) -> None:
        conn: psycopg.Connection | None = None
        started = time.monotonic()
        txn = 0
        while not self.stopping.is_set():
            txn += 1
            # pacing: the load's own rate, not a wait for anything
            self.stopping.wait(max(0.0, started + txn / self.rate - time.monotonic()))
            sends = self.rng.randint(1, 5)
            commit = self.rng.random() < 0.75
            for pos in range(sends):
                self.history.attempt(key_of(self.index, txn, pos))
            at_commit = False
            try:
                if conn is None:
                    conn = psycopg.connect(self.dsn, connect_timeout=3)
                conn.execute("INSERT INTO orders (thread, txn, sends) VALUES (%s, %s, %s)",
                             (self.index, txn, sends))
                for pos in range(sends):
                    outbox.send(conn, self.topic, key_of(self.index, txn, pos))
                if commit:
                    at_commit = True
                    if self.crash is not None and self.crash.take():
                        self.crash.lose_answer(conn)
                    conn.commit()
                    self.committed_at[txn] = time.monotonic()
                    self.heard[txn] = "committed"
                else:
                    conn.rollback()
                    self.heard[txn] = "rolled back"
            except psycopg.Error as exc:
                # before COMMIT was sent the transaction cannot have committed; during it, unknown
                self.heard[txn] = "unknown" if at_commit else "rolled back"
                what = type(exc).__name__
                self.errors[what] = self.errors.get(what, 0) + 1
                if conn is not None:
                    conn.close()
                conn = None
                self.stopping.wait(0.2)  # the database is down: try again shortly
        if conn is not None:
            conn.close()


@dataclass
class OutboxRun:
    """What one run did and saw, for ``count`` and the report."""

    seed: int
    topic: str
    faults: list[str] = field(default_factory=list)  # what was injected, when, how it healed
    notes: dict[str, object] = field(default_factory=dict)
    drained: bool = False
    committed: dict[tuple[int, int], int] = field(default_factory=dict)
    heard: dict[tuple[int, int], str] = field(default_factory=dict)
    stored: dict[bytes, list[int]] = field(default_factory=dict)  # body -> ids in dmq_message
    dead_letters: int = 0
    failures: list[str] = field(default_factory=list)


@dataclass
class ChannelTally:
    lost: int = 0
    phantom: int = 0
    delivered_after_durable_ack: int = 0
    delivered: int = 0  # distinct sends
    deliveries: int = 0  # pushes, repeats included
    lost_examples: list[str] = field(default_factory=list)
    phantom_examples: list[str] = field(default_factory=list)


@dataclass
class Counts:
    transactions: int = 0
    committed: int = 0
    committed_sends: int = 0
    rolled_back: int = 0
    unknown: int = 0
    unknown_committed: int = 0
    channels: dict[str, ChannelTally] = field(default_factory=dict)
    stored_twice: list[str] = field(default_factory=list)  # sends stored in dmq_message under two ids
    many_ids: list[str] = field(default_factory=list)  # sends stored or delivered under two ids
    out_of_order: list[str] = field(default_factory=list)  # transactions, with their ids in send order
    stored_phantom: list[str] = field(default_factory=list)  # in dmq_message, never committed
    commits_lost: int = 0  # heard committed, not in the business table
    rollbacks_committed: int = 0  # heard rolled back, in the business table
    dead_letters: int = 0
    ok: bool = False

    @property
    def lost(self) -> int:
        return sum(c.lost for c in self.channels.values())

    @property
    def phantom(self) -> int:
        return sum(c.phantom for c in self.channels.values())

    @property
    def duplicated(self) -> int:
        return len(self.many_ids) + sum(c.delivered_after_durable_ack for c in self.channels.values())


def count(run: OutboxRun, history: History) -> Counts:
    """The counts of the module's docstring, from what the run saw (plain values, no IO)."""
    h = history.snapshot()
    expected = {key_of(t, x, pos) for (t, x), n in run.committed.items() for pos in range(n)}
    ids: dict[bytes, set[int]] = {}
    for got in h.deliveries.values():
        for key, seen in got.items():
            ids.setdefault(key, set()).update(mid for _, mid in seen)
    for body, stored in run.stored.items():
        ids.setdefault(body, set()).update(stored)
    c = Counts(transactions=len(run.heard), committed=len(run.committed), committed_sends=len(expected),
               dead_letters=run.dead_letters)
    durable_dups = {tally.channel: tally.duplicated for tally in check(h)}
    for channel, got in h.deliveries.items():
        lost = sorted(expected - got.keys())
        phantom = sorted(got.keys() - expected)
        c.channels[channel] = ChannelTally(
            lost=len(lost), phantom=len(phantom), delivered_after_durable_ack=durable_dups[channel],
            delivered=len(got), deliveries=sum(len(v) for v in got.values()),
            lost_examples=[k.decode() for k in lost[:5]], phantom_examples=[k.decode() for k in phantom[:5]])
    c.stored_twice = sorted(body.decode() for body, stored in run.stored.items() if len(stored) > 1)
    c.many_ids = sorted(key.decode() for key, found in ids.items() if len(found) > 1)
    c.stored_phantom = sorted(body.decode(errors="replace") for body in run.stored.keys() - expected)
    for (t, x), n in sorted(run.committed.items()):
        firsts = [min(ids[key_of(t, x, pos)]) for pos in range(n) if ids.get(key_of(t, x, pos))]
        if any(a >= b for a, b in zip(firsts, firsts[1:])):
            c.out_of_order.append(f"{t}/{x}: {firsts}")
    heard = run.heard
    c.commits_lost = sum(1 for k, said in heard.items() if said == "committed" and k not in run.committed)
    c.rollbacks_committed = sum(1 for k, said in heard.items() if said == "rolled back" and k in run.committed)
    unknown = [k for k, said in heard.items() if said == "unknown"]
    c.unknown = len(unknown)
    c.unknown_committed = sum(1 for k in unknown if k in run.committed)
    c.rolled_back = sum(1 for k in heard if k not in run.committed)
    c.ok = (run.drained and not run.failures and not c.commits_lost and not c.rollbacks_committed
            and not c.duplicated and not c.out_of_order and not c.dead_letters and not c.lost and not c.phantom
            and not c.stored_phantom)
    return c


def format_report(run: OutboxRun, c: Counts) -> str:
    lines = [
        f"outbox: {'OK' if c.ok else 'FAILED'}  (seed {run.seed}, topic {run.topic})",
        f"  transactions {c.transactions}: committed {c.committed} ({c.committed_sends} sends), rolled back "
        f"{c.rolled_back}, commit outcome unknown {c.unknown} (of which committed {c.unknown_committed})",
        f"  lost {c.lost} / duplicated {c.duplicated} / phantom {c.phantom} / out-of-order {len(c.out_of_order)}",
        f"  stored under two ids {len(c.stored_twice)}, stored or delivered under two ids {len(c.many_ids)}, "
        f"stored but never committed {len(c.stored_phantom)}, "
        f"dead letters {c.dead_letters}, commits heard but not in the table {c.commits_lost}, "
        f"rollbacks heard but committed {c.rollbacks_committed}, drained {run.drained}",
    ]
    for name, t in c.channels.items():
        lines.append(f"  {name}: lost {t.lost}, phantom {t.phantom}, delivered again after a durable ack "
                     f"{t.delivered_after_durable_ack}, delivered {t.delivered} ({t.deliveries} pushes)"
                     + (f" lost e.g. {t.lost_examples}" if t.lost else "")
                     + (f" phantom e.g. {t.phantom_examples}" if t.phantom else ""))
    for what, found in (("stored twice", c.stored_twice), ("under two ids", c.many_ids),
                        ("stored, never committed", c.stored_phantom),
                        ("out of order", c.out_of_order)):
        if found:
            lines.append(f"  {what} e.g. {found[:5]}")
    lines += [f"  fault: {f}" for f in run.faults]
    if run.notes:
        lines.append(f"  notes: {run.notes}")
    if run.failures:
        lines.append(f"  failures: {run.failures}")
    return "\n".join(lines)


# -- one run ----------------------------------------------------------------------------------
def _await(condition, timeout: float, what: str) -> float:
    """Poll ``condition`` until it holds; returns the seconds it took; RuntimeError naming
    ``what`` past ``timeout``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"not within {timeout:g} s: {what}")
        time.sleep(0.05)
    return time.monotonic() - started


def _relaying(app: AppDatabase) -> int | None:
    try:
        return app.relaying_node()
    except psycopg.Error:
        return None  # the application's PostgreSQL is down or recovering


def run(cluster: ChaosCluster, app: AppDatabase, *, seed: int | None = None, producers: int = 4,
        rate: float = 15.0, drain: float = 120.0) -> tuple[OutboxRun, History]:
    """One run (see the module): load, the three faults in a random order, heal, drain."""
    seed = seed if seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    topic = f"chaos_outbox_{uuid.uuid4().hex[:6]}"
    cluster.register_topic(topic, CHANNELS)
    out = OutboxRun(seed, topic)
    load = Load(cluster.client_addresses, topic, CHANNELS, cluster.direct_dsn, producers=0, consumers=1)
    crash = CrashAtCommit(app, rng.randrange(2**32))
    threads = [OutboxProducer(i, app.dsn, topic, load.history, rate=rate, seed=rng.randrange(2**32), crash=crash)
               for i in range(producers)]
    origin = time.monotonic()
    load.start()
    for p in threads:
        p.start()

    def since(t: float) -> float:
        return round(t - origin, 2)

    def delivered_after(moment: float) -> bool:
        """A transaction committed after ``moment`` reached both channels: the system serves."""
        got = load.history.snapshot().deliveries
        for p in threads:
            for txn, at in p.committed_at.copy().items():
                if at > moment and all(key_of(p.index, txn, 0) in got[c] for c in CHANNELS):
                    return True
        return False

    def kill_relay_node() -> str:
        _await(lambda: _relaying(app) is not None, 30, "a node holding the relay's lock")
        node = _relaying(app)
        assert node is not None
        cluster.nodes[node].kill()
        killed = time.monotonic()
        taken = _await(lambda: _relaying(app) == 1 - node, 60, f"node {2 - node} taking the relay over")
        # the fault held (the node stays dead): pacing, not a wait for anything
        time.sleep(max(0.0, killed + rng.uniform(1.0, 3.0) - time.monotonic()))
        cluster.restart_node(node)
        return (f"kill -9 of node {node + 1} (relaying) at +{since(killed)} s; node {2 - node} took the "
                f"relay over {taken:.2f} s later; node {node + 1} restarted at +{since(time.monotonic())} s")

    def kill_dmq_primary() -> str:
        member = cluster.patroni.primary()
        assert member is not None, "no primary to kill"
        member.kill()
        killed = time.monotonic()
        time.sleep(rng.uniform(1.0, 3.0))  # the fault held
        member.start()
        return f"kill -9 of dmq's PostgreSQL primary {member.name} at +{since(killed)} s, started again " \
               f"(a standby) at +{since(time.monotonic())} s"

    def kill_app_pg() -> str:
        crash.arm()  # the next COMMIT to go out starts the kill
        _await(crash.done.is_set, 30, "a producer reaching its COMMIT and the kill of the application's PostgreSQL")
        killed = time.monotonic()
        time.sleep(rng.uniform(1.0, 3.0))  # the fault held
        app.restart()
        return f"kill -9 of the application's PostgreSQL at +{since(killed)} s, {crash.outcome}, " \
               f"restarted at +{since(time.monotonic())} s"

    faults = [kill_relay_node, kill_dmq_primary, kill_app_pg]
    rng.shuffle(faults)
    try:
        out.notes["first_delivery_s"] = round(_await(lambda: delivered_after(origin), 60, "a first delivery"), 2)
        first = _relaying(app)
        out.notes["relaying_at_start"] = None if first is None else f"node{first + 1}"
        for fault in faults:
            time.sleep(rng.uniform(0.5, 3.0))  # a random moment of the load
            text = fault()
            healed = time.monotonic()
            took = _await(lambda: delivered_after(healed), 90,
                          f"a transaction committed after the heal of [{text}] delivered on both channels")
            out.faults.append(f"{text}; a transaction committed after it delivered {took:.2f} s later")
        time.sleep(rng.uniform(0.5, 2.0))  # load after the last fault
        for p in threads:
            p.stopping.set()
        for p in threads:
            p.join(30)
        out.committed = app.committed()
        out.heard = {(p.index, txn): said for p in threads for txn, said in p.heard.items()}
        for key in out.committed:  # what the checker's drain waits for: committed sends
            for pos in range(out.committed[key]):
                load.history.ack(key_of(*key, pos), 0, time.monotonic())
        try:
            _await(lambda: app.outbox_rows() == 0 and not any(load.history.missing().values()), drain,
                   "the outbox emptied and every committed send delivered on both channels")
            out.drained = True
        except RuntimeError as exc:
            out.failures.append(str(exc))
        time.sleep(1.5)  # consumers stay on: a wrong redelivery has time to show
    finally:
        for p in threads:
            p.stopping.set()
        load.stop()
    out.failures += load.failures() + [f"{p.name}: {p.failure!r}" for p in threads if p.failure]
    out.notes["producer_errors"] = {p.name: p.errors for p in threads if p.errors}
    last = _relaying(app)
    out.notes["relaying_at_end"] = None if last is None else f"node{last + 1}"
    with psycopg.connect(cluster.direct_dsn, autocommit=True, connect_timeout=5) as conn:
        for body, mid in conn.execute("SELECT body, id FROM dmq_message WHERE topic = %s", (topic,)):
            out.stored.setdefault(bytes(body), []).append(mid)
        row = conn.execute("SELECT count(*) FROM dmq_dead_letter WHERE topic = %s AND producer LIKE %s",
                           (topic, f"outbox:{OUTBOX}%")).fetchone()
        out.dead_letters = int(row[0]) if row else 0
    return out, load.history
