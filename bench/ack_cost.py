"""Where PostgreSQL's CPU per acknowledgement goes: the ack statement taken apart.

The reliable path makes acks durable with ``ack_deliveries`` (sql/queries.sql): the
channel's cursor moves (one row per channel and storing incarnation), and the
acknowledged copies that were not done before are logged, the facts the message trace
and the data pipeline's report read: since schema version 10 one ``dmq_delivery_batch``
row of arrays per statement, before it a ``dmq_delivery_log`` row per copy. This runs that statement and
variants of it on a private PostgreSQL from one connection, in batches of acks of one
channel, and prints the backend's CPU per ack (from /proc: PostgreSQL's own work only)
and the WAL it wrote per ack (what a synchronous standby receives and every commit flushes).
The variants run in turns, a fresh slice of stored messages each, so that a machine
busy with something else shifts them all alike.

``synchronous_commit`` is off here on purpose: the figure is CPU, not fsync.

    python bench/ack_cost.py                         # 40,000 acks per variant and round, 2 rounds
    python bench/ack_cost.py --acks 100000 --batch 200 --rounds 3
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

from dmq_server.db.messages import (  # noqa: E402
    INSERT_NEW_MESSAGES,
    AckRow,
    CursorProgress,
    ack_deliveries_steps,
)
from dmq_server.db.worker import connect  # noqa: E402
from dmq_sql import queries  # noqa: E402

AS_WRITTEN = queries["ack_deliveries"]
_FACTS = AS_WRITTEN.index(", batch AS MATERIALIZED")
# for comparison: the statement up to schema version 9 wrote a row per acknowledged copy
ROW_LOG = """CREATE TABLE IF NOT EXISTS bench_row_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, message_id bigint NOT NULL, topic text NOT NULL,
    channel text NOT NULL, published_at timestamptz NOT NULL, first_delivered_at timestamptz,
    acked_at timestamptz NOT NULL, attempts integer NOT NULL, consumer text, delivered_at timestamptz);
CREATE INDEX IF NOT EXISTS bench_row_log_message_brin ON bench_row_log USING brin (message_id);
CREATE INDEX IF NOT EXISTS bench_row_log_acked_brin ON bench_row_log USING brin (acked_at)"""
ROW_PER_ACK = AS_WRITTEN[:_FACTS] + """
INSERT INTO bench_row_log (message_id, topic, channel, published_at, first_delivered_at,
                           acked_at, attempts, consumer, delivered_at)
SELECT u.message_id, u.topic, u.channel, to_timestamp(u.published_ms / 1000.0),
       CASE WHEN u.first_ms > 0 THEN to_timestamp(u.first_ms / 1000.0) END,
       to_timestamp(u.acked_ms / 1000.0), u.attempts, u.consumer,
       CASE WHEN u.delivered_ms > 0 THEN to_timestamp(u.delivered_ms / 1000.0) END
FROM unnest(%(topics)b::text[], %(channels)b::text[], %(owners)b::integer[],
            %(message_ids)b::bigint[], %(published_ms)b::bigint[], %(first_ms)b::bigint[],
            %(acked_ms)b::bigint[], %(attempts)b::integer[], %(consumers)b::text[], %(delivered_ms)b::bigint[])
     AS u(topic, channel, owner, message_id, published_ms, first_ms, acked_ms, attempts, consumer, delivered_ms)
JOIN before b ON b.topic = u.topic AND b.channel = u.channel AND b.owner = u.owner
WHERE u.message_id > b.floor AND NOT coalesce(b.done @> u.message_id, false)"""
NOTHING = "SELECT 1"
# the batch row's arrays: compressed with lz4 since schema version 11, pglz before
_ARRAYS = ("topics", "channels", "message_ids", "published_ms", "first_ms", "acked_ms", "attempts",
           "consumers", "delivered_ms")


def _compression(method: str) -> str:
    return "ALTER TABLE dmq_delivery_batch " + ", ".join(f"ALTER COLUMN {c} SET COMPRESSION {method}" for c in _ARRAYS)


VARIANTS = [
    ("ack_deliveries as written (schema 11, lz4)", AS_WRITTEN, _compression("lz4")),
    ("  the same, arrays compressed with pglz (10)", AS_WRITTEN, _compression("pglz")),
    ("the cursor alone (no delivery facts)", AS_WRITTEN[:_FACTS] + "\nSELECT 1", NOTHING),
    ("a log row per ack (schema 9)", ROW_PER_ACK, ROW_LOG),
]


def store(dsn: str, count: int) -> tuple[int, list[int]]:
    """``count`` messages of topic bench, stored by one incarnation; their ids in order."""
    ids: list[int] = []
    with connect(dsn, autocommit=True) as conn:
        owner = conn.execute("INSERT INTO dmq_owner (node_id) VALUES ('node-1') RETURNING id").fetchone()[0]
        for start in range(0, count, 1000):
            size = min(1000, count - start)
            rows = conn.execute(INSERT_NEW_MESSAGES, {
                "topics": ["bench"] * size, "producers": ["producer"] * size,
                "session_ids": list(range(start + 1, start + size + 1)), "produced_ms": [1_700_000_000_000] * size,
                "bodies": [b"x" * 200] * size, "node_id": "node-1", "owner": owner, "batch_topics": ["bench"],
            }).fetchall()
            ids += [r[0] for r in rows if r[0] is not None]  # not the topic's row
        conn.execute("VACUUM ANALYZE")
    return owner, sorted(ids)


def ack_params(owner: int, chunk: list[int]) -> dict:
    """The statement's parameters for acks of ``chunk``, acknowledged in order (the
    cursor's floor moves to the last of them), as the server builds them."""
    now = int(time.time() * 1000)
    acks = [AckRow("bench", "c", i, now, now, 1, "consumer-1", now, owner, now) for i in chunk]
    return next(ack_deliveries_steps(acks, [CursorProgress("bench", "c", owner, chunk[-1], [])])).params


def measure(dsn: str, sql: str, setup: str, owner: int, ids: list[int], batch: int) -> tuple[float, float, float]:
    with connect(dsn, autocommit=True) as conn:
        conn.execute(setup)
        conn.execute("CHECKPOINT")
    params = [ack_params(owner, ids[k:k + batch]) for k in range(0, len(ids), batch)]
    with connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        wal0 = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
        cpu0, t0 = cpu_seconds(backend), time.perf_counter()
        for p in params:
            conn.execute(sql, p)
        elapsed = time.perf_counter() - t0
        cpu1 = cpu_seconds(backend)
        wal = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", (wal0,)).fetchone()[0]
    return 1e6 * (cpu1 - cpu0) / len(ids), float(wal) / len(ids), len(ids) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--acks", type=int, default=40_000, help="acks per variant and round")
    parser.add_argument("--batch", type=int, default=100, help="acks per statement")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.batch < 1 or args.acks < args.batch or args.rounds < 1:
        parser.error("--batch must be at least 1, --acks at least --batch, --rounds at least 1")
    pg = PrivatePostgres(tempfile.mkdtemp(prefix="dmq-bench-ack-"))
    try:
        dsn = pg.start()
        schema_with_topic(dsn)
        owner, ids = store(dsn, args.acks * len(VARIANTS) * args.rounds)
        print(f"{args.acks:,} acks per variant and round, {args.rounds} rounds, batches of {args.batch}, "
              "one channel, one connection, synchronous_commit off")
        print(f"{'variant':48s} {'backend us/ack':>15s} {'WAL bytes/ack':>14s} {'acks/s':>9s}")
        results: dict[str, list[float]] = {name: [] for name, _, _ in VARIANTS}
        for _ in range(args.rounds):
            for name, sql, setup in VARIANTS:
                part, ids = ids[:args.acks], ids[args.acks:]
                backend, wal, rate = measure(dsn, sql, setup, owner, part, args.batch)
                results[name].append(backend)
                print(f"{name:48s} {backend:15.1f} {wal:14.0f} {rate:9,.0f}", flush=True)
        print("median backend us/ack:")
        for name, values in results.items():
            print(f"  {name:46s} {sorted(values)[len(values) // 2]:6.1f}")
    finally:
        pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
