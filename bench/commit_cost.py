"""What one group commit costs PostgreSQL at the steady scenario's small batches.

At 5,000 msgs/s from paced producers a group commit holds about ten sends
(``bench/reliable.py``'s steady scenario), and PostgreSQL's CPU per message there is
three times e2e1's (76-80 against 24 µs): the per-transaction part of the send
statement no longer spreads over hundreds of rows. This takes that part apart on a
private PostgreSQL, from one connection in autocommit as the writers run, with the
statements prepared as the reactor's connections prepare them:

- ``select 1``: a round trip and a transaction that writes nothing;
- ``insert_new_messages`` (the group commit's statement) with batches of 1, 10 and 100
  sends of 200 bytes;

each with ``synchronous_commit`` on (dmq's setting: the commit waits for the WAL flush)
and off (what is left without the flush). Back to back by default; with ``--interval S``
each transaction starts S after the one before started, as the group commit paces them
at a moderate rate (``--commit-interval``, 1.5 ms): a backend that sleeps between
transactions costs more a transaction than one kept busy. Printed per transaction: the backend's CPU
(from /proc, user and system: the WAL write and ``fdatasync`` run in the backend when the
commit waits for them) and the wall time of the round trip, the best of ``--rounds``
alternated rounds. Per message: the CPU divided by the batch.

    python bench/commit_cost.py
    python bench/commit_cost.py --transactions 2000 --rounds 5
    python bench/commit_cost.py --interval 0.0015      # paced as the steady scenario's commits
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import cpu_seconds  # noqa: E402
from _pg import PrivatePostgres, schema_with_topic  # noqa: E402
from insert_cost import batch_params  # noqa: E402

from dmq_server.db.messages import INSERT_NEW_MESSAGES  # noqa: E402
from dmq_server.db.worker import connect  # noqa: E402

CASES = [("select 1", "select 1", 0), *((f"insert_new_messages, {n}", INSERT_NEW_MESSAGES, n) for n in (1, 10, 100))]


def measure(dsn: str, sql: str, batch: int, transactions: int, sync: str, first: int,
            interval: float = 0.0) -> tuple[float, float]:
    """(backend CPU µs, wall µs of the round trip) per transaction of ``sql`` run
    ``transactions`` times after ten untimed ones (the statement prepared, its plan
    settled); with ``interval``, each started that long after the one before started."""
    params = [batch_params(first + i, batch) if batch else None for i in range(transactions + 10)]
    with connect(dsn, autocommit=True) as conn:
        conn.execute(f"SET synchronous_commit = {sync}")
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        for p in params[:10]:
            conn.execute(sql, p, prepare=True)
        cpu0 = cpu_seconds(backend)
        wall = 0.0
        due = time.perf_counter()
        for p in params[10:]:
            if interval:
                due += interval
            t0 = time.perf_counter()
            conn.execute(sql, p, prepare=True).fetchall()
            t1 = time.perf_counter()
            wall += t1 - t0
            if interval and due > t1:
                time.sleep(due - t1)
        cpu = cpu_seconds(backend) - cpu0
    return 1e6 * cpu / transactions, 1e6 * wall / transactions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transactions", type=int, default=1500, help="timed transactions per case and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.0, metavar="SECONDS",
                        help="start each transaction this long after the one before started (0: back to back)")
    args = parser.parse_args()
    if args.transactions < 100 or args.rounds < 1 or not 0 <= args.interval < 1:
        parser.error("--transactions must be at least 100 (the CPU is read in 10 ms ticks), --rounds at least 1, "
                     "--interval in [0, 1)")
    pg = PrivatePostgres(tempfile.mkdtemp(prefix="dmq-bench-commit-"))
    best: dict[tuple[str, str], tuple[float, float]] = {}
    try:
        dsn = pg.start()
        schema_with_topic(dsn)
        with connect(dsn, autocommit=True) as conn:
            # the incarnation every batch is stored as (insert_messages share-locks its row)
            conn.execute("INSERT INTO dmq_owner (id, node_id) VALUES (1, 'node-1') ON CONFLICT (id) DO NOTHING")
        first = 0
        for _ in range(args.rounds):  # alternated, so that a slower minute falls on every case alike
            for name, sql, batch in CASES:
                for sync in ("on", "off"):
                    cpu, wall = measure(dsn, sql, batch, args.transactions, sync, first, args.interval)
                    first += args.transactions + 10
                    old = best.get((name, sync))
                    best[(name, sync)] = (min(cpu, old[0]), min(wall, old[1])) if old else (cpu, wall)
    finally:
        pg.stop()
    report(best, args.transactions, args.rounds, args.interval)
    return 0


def report(best: dict[tuple[str, str], tuple[float, float]], transactions: int, rounds: int,
           interval: float = 0.0) -> None:
    paced = f", each started {interval * 1e3:g} ms after the one before" if interval else ", back to back"
    print(f"{transactions:,} transactions per case and round{paced}, best of {rounds} rounds, one connection")
    print(f"{'statement, sends':28s} {'sync commit':>11s} {'backend us/tx':>14s} {'us/message':>11s} {'wall us/tx':>11s}")
    for name, _, batch in CASES:
        for sync in ("on", "off"):
            cpu, wall = best[(name, sync)]
            per = f"{cpu / batch:11.1f}" if batch else f"{'-':>11s}"
            print(f"{name:28s} {sync:>11s} {cpu:14.0f} {per} {wall:11.0f}")


if __name__ == "__main__":
    sys.exit(main())
