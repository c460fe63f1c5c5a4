"""Where PostgreSQL's CPU per published message goes: the send statement taken apart.

The reliable path stores each message with ``insert_messages`` (sql/queries.sql):
one message row owned by the server's incarnation (no per-channel row since the cursors
of schema version 7), ``RETURNING`` the ids and the channels each is for; the
writers try it without its ``ON CONFLICT`` clause first and run it as written
only for a batch holding a resend (dmq_server/db/messages.py). This runs that statement and simpler variants of it
on a private PostgreSQL from one connection, in batches, and prints the backend's
CPU per message (from /proc, so only PostgreSQL's own work) and the client's
(psycopg building the array parameters and reading the result).

``synchronous_commit`` is off here on purpose: the figure is CPU, not fsync.

    python bench/insert_cost.py                      # 60,000 messages per variant, batches of 200
    python bench/insert_cost.py --messages 200000 --batch 100
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

from dmq_server.db.messages import INSERT_NEW_MESSAGES
from dmq_server.db.worker import connect
from dmq_sql import queries  # noqa: E402

UNNEST = (
    "unnest(%(topics)b::text[], %(producers)b::text[], %(session_ids)b::bigint[], "
    "%(produced_ms)b::bigint[], %(bodies)b::bytea[]) AS u(topic, producer, session_id, produced_ms, body)"
)
MESSAGE_COLUMNS = "INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, body) "
MESSAGE_ROWS = f"SELECT topic, producer, session_id, %(node_id)s, %(owner)s, body FROM {UNNEST}"

# for comparison: until session 12 the statement built every row's channel list by its own
# aggregate over the topic's channels, instead of once per topic and batch
_HEAD = INSERT_NEW_MESSAGES[:INSERT_NEW_MESSAGES.index("\nSELECT id, producer, session_id")]
PER_ROW_CHANNELS = _HEAD + """
SELECT ins.id, ins.producer, ins.session_id, (SELECT published_ms FROM stamp) AS published_ms,
       coalesce((SELECT array_agg(c.name ORDER BY c.name) FROM dmq_channel c
                 WHERE c.topic = ins.topic AND c.start_id < ins.id), '{}') AS channels
FROM ins"""

VARIANTS = [
    ("insert_messages without ON CONFLICT (the first try)", INSERT_NEW_MESSAGES, None),
    ("  the same, channel lists built per row (before)", PER_ROW_CHANNELS, None),
    ("insert_messages as written (after a unique violation)", queries["insert_messages"], None),
    ("message rows only", MESSAGE_COLUMNS + MESSAGE_ROWS, None),
    ("+ ON CONFLICT (producer, session_id)", MESSAGE_COLUMNS + MESSAGE_ROWS
     + " ON CONFLICT (producer, session_id) DO NOTHING", None),
    ("+ RETURNING id, producer, session_id, published_at", MESSAGE_COLUMNS + MESSAGE_ROWS
     + " ON CONFLICT (producer, session_id) DO NOTHING RETURNING id, producer, session_id, published_at", None),
    # for comparison: what one per-channel delivery row cost before the cursors (not dmq's
    # schema any more; created here)
    ("a delivery row per copy, as before version 7", "INSERT INTO bench_delivery_ids "
     f"(channel_id, message_id, owner_id) SELECT 1, session_id, 1 FROM {UNNEST}",
     "CREATE TABLE IF NOT EXISTS bench_delivery_ids (channel_id integer, message_id bigint, "
     "attempts integer NOT NULL DEFAULT 0, owner_id integer NOT NULL, PRIMARY KEY (channel_id, message_id)); "
     "CREATE INDEX IF NOT EXISTS bench_delivery_ids_owner ON bench_delivery_ids (owner_id, channel_id, message_id); "
     "TRUNCATE bench_delivery_ids"),
]


def batch_params(n: int, size: int) -> dict:
    return {
        "topics": ["bench"] * size,
        "producers": [f"producer-{n % 4}"] * size,
        "session_ids": [n * size + i for i in range(size)],
        "produced_ms": [1_700_000_000_000] * size,
        "bodies": [b"x" * 200] * size,
        "node_id": "node-1",
        "owner": 1,
        "batch_topics": ["bench"],
    }


def measure(dsn: str, sql: str, setup: str | None, messages: int, size: int) -> tuple[float, float, float]:
    with connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE dmq_message")
        # the incarnation every batch is stored as (insert_messages share-locks its row)
        conn.execute("INSERT INTO dmq_owner (id, node_id) VALUES (1, 'node-1') ON CONFLICT (id) DO NOTHING")
        if setup:
            conn.execute(setup)
        conn.execute("CHECKPOINT")
    params = [batch_params(n, size) for n in range(messages // size)]
    with connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        cpu0, client0, t0 = cpu_seconds(backend), time.process_time(), time.perf_counter()
        for p in params:
            cur = conn.execute(sql, p)
            if cur.description:
                cur.fetchall()
        elapsed = time.perf_counter() - t0
        cpu1, client1 = cpu_seconds(backend), time.process_time()
    count = len(params) * size
    return 1e6 * (cpu1 - cpu0) / count, 1e6 * (client1 - client0) / count, count / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=60_000)
    parser.add_argument("--batch", type=int, default=200)
    args = parser.parse_args()
    if args.batch < 1 or args.messages < args.batch:
        parser.error("--batch must be at least 1 and --messages at least --batch")
    pg = PrivatePostgres(tempfile.mkdtemp(prefix="dmq-bench-insert-"))
    try:
        dsn = pg.start()
        schema_with_topic(dsn)
        print(f"{args.messages:,} messages per variant, batches of {args.batch}, one connection, "
              "synchronous_commit off, 200-byte bodies, 1 channel")
        print(f"{'variant':52s} {'backend us/msg':>15s} {'client us/msg':>14s} {'msgs/s':>9s}")
        for name, sql, setup in VARIANTS:
            backend, client, rate = measure(dsn, sql, setup, args.messages, args.batch)
            print(f"{name:52s} {backend:15.1f} {client:14.1f} {rate:9,.0f}", flush=True)
    finally:
        pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
