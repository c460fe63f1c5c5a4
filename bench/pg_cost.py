"""PostgreSQL's instructions per message for the two statements on the reliable path, counted
by valgrind: the send statement (``insert_messages`` as the writers first try it) and the
ack statement (``ack_deliveries``), each as a source tree builds it.

``insert_cost.py`` and ``ack_cost.py`` time the backend's CPU, and on this shared 2-core
machine that time spreads by a quarter from one run to the next, which hides a change of
a few per cent (session 19: a variant's six runs spread from 12 to 19 us a row). Here the
postmaster runs under valgrind's cachegrind (Debian's ``valgrind``; each backend it forks
writes its own count when it exits), so the figure is the instructions the backend ran:
repeated runs of one tree agree within about 1 %. Each statement runs on two connections,
one for a few batches and one for more; the difference, divided by the extra rows, leaves
out connecting and planning. Both connections prepare the statements at once, as the
server's do (``db/reactor.py``), and the first connection's batches are as many as
PostgreSQL plans one by one before it settles on a generic plan (5 custom plans, then a
generic one from the 6th execution on: ``pg_prepared_statements`` shows 25 generic and 5
custom after 30), so the difference counts only the generic plan's executions, which is
what a server's long-lived connection runs. Until session 20 the first connection ran
unprepared and the difference held 5 custom plans: the ack statement's figure was 14,951
where its generic executions cost 10,634 (a custom plan cost 26,964).

The database is dmq's schema as the tree migrates it, with 200,000 messages stored first
(so that the indexes are as deep as under a retention window's worth of rows). A batch is
200 sends (`--batch`) from 4 producers interleaved, each counting its own session ids, as
``bench/reliable.py``'s producers send them; an ack batch is 200 acks of one channel in
id order, the cursor moving with them.

    python bench/pg_cost.py                           # this tree
    python bench/pg_cost.py --tree /tmp/old --tree .  # two builds, the same workload
    python bench/pg_cost.py --batch 20                # small statements: their fixed cost shows
    python bench/pg_cost.py --priority 5              # every message of priority 5 (schema 18's index)
    python bench/pg_cost.py --ordered --batch 1       # an ordered topic: its commit lock a statement

``--ordered`` makes the topic ordered, so every send statement takes the topic's cross-node
commit lock (``pg_advisory_xact_lock``, issue 45 across nodes); the ack statement is the same.

``--priority P`` (1 to 9) gives every send the priority P, so the group commit runs its
statement for sends with properties, and stores the prefilled messages with it too (the
partial index dmq_message_priority_idx then holds them all, as deep as it gets); 0, the
default, sends without properties as before.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _cost as cost  # noqa: E402

BATCH = int(os.environ.get("DMQ_BENCH_PG_BATCH", "200"))  # --batch, handed to the child
PRIORITY = int(os.environ.get("DMQ_BENCH_PG_PRIORITY", "0"))  # --priority, handed to the child
ORDERED = os.environ.get("DMQ_BENCH_PG_ORDERED") == "1"  # --ordered, handed to the child
PRODUCERS = 4
PREFILL = 200_000
SMALL = 10  # batches on the first connection of each statement: PostgreSQL's 5 custom plans and more


def child(batches: int) -> dict:
    """Run with the tree under test first on the path: the instructions a send and an ack
    cost PostgreSQL over ``batches`` batches beyond the first connection's."""
    import psycopg

    from _pg import PrivatePostgres, schema_with_topic
    from dmq_client.wire.properties import NO_PROPERTIES, Properties
    from dmq_server.db.messages import AckRow, CursorProgress, NewMessage, ack_deliveries_steps, insert_messages_steps
    from dmq_server.db.worker import connect

    pg = PrivatePostgres(tempfile.mkdtemp(prefix="dmq-bench-pgcost-"))
    counts = Path(tempfile.mkdtemp(prefix="dmq-bench-pgcost-cg-"))
    os.chmod(counts, 0o777)  # the postmaster's user writes its counts here
    postmaster = None
    try:
        dsn = pg.start()
        schema_with_topic(dsn, ordered=ORDERED)
        with connect(dsn, autocommit=True) as conn:
            owner = conn.execute("INSERT INTO dmq_owner (node_id) VALUES ('node-1') RETURNING id").fetchone()[0]
            conn.execute(
                "INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, body, priority) "
                "SELECT 'bench', 'prefill-' || (i %% 4), i, 'node-1', %s, repeat('x', 200)::bytea, %s "
                "FROM generate_series(1, %s) AS i", (owner, PRIORITY, PREFILL))
            conn.execute("VACUUM ANALYZE")
        embedded = pg._embedded
        if embedded is None:
            raise RuntimeError("pg_cost.py needs dmq's embedded PostgreSQL (dmq_server.db.embedded)")
        pgdata, ident = embedded.pgdata, embedded._identity()
        postgres = embedded._choose_bindir() / "postgres"
        embedded.stop()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        postmaster = subprocess.Popen(
            ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={counts}/cg.%p",
             str(postgres), "-D", str(pgdata)],
            env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **ident.popen_kwargs())
        deadline = time.monotonic() + 120
        while True:
            try:
                psycopg.connect(dsn).close()
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline or postmaster.poll() is not None:
                    raise
                time.sleep(0.5)

        def instructions(statements: list) -> int:
            """Run ``statements`` on a new connection; the instructions its backend ran."""
            with connect(dsn, autocommit=True) as conn:
                conn.prepare_threshold = 0  # prepared at the first execution, as the server's
                conn.execute("SET synchronous_commit = off")  # CPU, not the fsync
                pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
                for stmt in statements:
                    cur = conn.execute(stmt.sql, stmt.params)
                    if cur.description:
                        cur.fetchall()
            path = counts / f"cg.{pid}"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # written when the backend exits
                text = path.read_text() if path.exists() else ""
                if "summary:" in text:
                    return int(text.split("summary:")[1].split()[0])
                time.sleep(0.1)
            raise RuntimeError(f"no instruction count from backend {pid}")

        session = iter(range(1, 10**9))
        stored: list[int] = []

        properties = Properties(priority=PRIORITY) if PRIORITY else NO_PROPERTIES

        def sends(count: int) -> list:
            out = []
            for _ in range(count):
                batch = [NewMessage("bench", f"producer-{i % PRODUCERS}", 0, 1_700_000_000_000, b"x" * 200, properties)
                         for i in range(BATCH)]
                for i in range(0, BATCH, PRODUCERS):  # each producer's next session ids
                    number = next(session)
                    for m in batch[i:i + PRODUCERS]:
                        m.session_id = number
                out.append(next(insert_messages_steps(batch, "node-1", owner)))
            return out

        def acks(count: int) -> list:
            out = []
            now = int(time.time() * 1000)
            for _ in range(count):
                chunk, stored[:BATCH] = stored[:BATCH], []
                rows = [AckRow("bench", "c", i, now, now, 1, "dmq 127.0.0.1:40000", now, owner, now) for i in chunk]
                out.append(next(ack_deliveries_steps(rows, [CursorProgress("bench", "c", owner, chunk[-1], [])])))
            return out

        def store_ids(statements: list) -> None:
            with connect(dsn, autocommit=True) as conn:
                for stmt in statements:
                    stored.extend(r[0] for r in conn.execute(stmt.sql, stmt.params).fetchall() if r[0] is not None)

        small = instructions(sends(SMALL))
        large = instructions(sends(SMALL + batches))
        send = (large - small) / (batches * BATCH)
        store_ids(sends(2 * SMALL + batches))  # the messages the acks acknowledge, in id order
        stored.sort()
        small = instructions(acks(SMALL))
        large = instructions(acks(SMALL + batches))
        ack = (large - small) / (batches * BATCH)
        return {"send": send, "ack": ack}
    finally:
        if postmaster is not None:
            postmaster.terminate()
            try:
                postmaster.wait(120)
            except subprocess.TimeoutExpired:
                postmaster.kill()
        pg.stop()
        shutil.rmtree(counts, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", help="a source tree to measure (repeat to compare; default: this one)")
    parser.add_argument("--batches", type=int, default=20, help="batches (of --batch) beyond the first connection's")
    parser.add_argument("--rounds", type=int, default=1, help="runs per tree, alternated")
    parser.add_argument("--batch", type=int, default=BATCH,
                        help="sends and acks a statement (two sizes tell a statement's fixed cost from a row's)")
    parser.add_argument("--priority", type=int, default=PRIORITY, choices=range(10), metavar="0-9",
                        help="every message's priority (0: sends without properties)")
    parser.add_argument("--ordered", action="store_true", help="an ordered topic (its sends take the commit lock)")
    args = parser.parse_args()
    os.environ["DMQ_BENCH_PG_BATCH"] = str(args.batch)
    os.environ["DMQ_BENCH_PG_ORDERED"] = "1" if args.ordered else "0"
    os.environ["DMQ_BENCH_PG_PRIORITY"] = str(args.priority)
    if shutil.which("valgrind") is None:
        sys.exit("pg_cost.py needs valgrind (apt-get install valgrind, or bash deploy/setup.sh --bench)")
    trees = [str(Path(t).resolve()) for t in (args.tree or [HERE.parent])]
    for _ in range(args.rounds):
        for tree in trees:
            result = cost.run_child("pg_cost", tree, args.batches)
            print(f"{tree}: PostgreSQL instructions per message (batches of {args.batch}, priority {args.priority}"
                  f"{', ordered' if args.ordered else ''}): "
                  f"send statement {result['send']:,.0f}, "  # type: ignore[index]
                  f"ack statement {result['ack']:,.0f}", flush=True)


if __name__ == "__main__":
    main()
