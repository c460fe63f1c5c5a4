"""What an expiry pass costs PostgreSQL with a backlog on a topic with a time to live.

The server runs ``expire_deliveries`` every ``--expiry-interval`` (1 s) while any topic has
a time to live. Here one such topic holds ``--waiting`` copies of one channel, none past the
time to live yet, beside another topic's as many (their ids interleaved); each pass runs as
the server runs it (``open_ttl_cursors_steps`` then ``expire_deliveries_steps``, a batch of
5,000, each in a transaction) and is timed, with statistics taken after the fill (``fresh``)
or before it (``stale``: a topic newer than autovacuum's last ANALYZE). Then the first 5,000
waiting copies are made older than the time to live and one pass, timed the same way,
expires them: a batch's work.

    python bench/expiry.py                            # this tree
    python bench/expiry.py --tree /tmp/old --tree .   # two builds, alternated

A tree's figures: the median and the largest of ``--passes`` passes that found nothing to
expire, in ms, and the pass that expired a batch. ``--done-ranges R``: the channel's cursor
holds R done ranges first (every other one of its first 2R copies acknowledged, as consumers
acking out of order leave it), stored out of line as a large multirange is.

    python bench/expiry.py --waiting 40000 --done-ranges 20000 --passes 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _cost as cost

HERE = Path(__file__).resolve().parent
BATCH = 5000  # the server's batch (reliable.dead_letters.DeadLetterSink.expiry_batch)


def child(waiting: int) -> dict:
    """With the tree under test first on the path: the passes' times, in ms, for each
    kind of statistics."""
    import registry
    from _pg import PrivatePostgres
    from dmq_server.db import dead_letter_steps
    from dmq_server.db.dead_letter_steps import expire_deliveries_steps
    from dmq_server.db.schema import migrate
    from dmq_server.db.steps import run_steps
    from dmq_server.db.worker import connect

    passes = int(os.environ.get("DMQ_BENCH_EXPIRY_PASSES", "10"))
    done_ranges = int(os.environ.get("DMQ_BENCH_EXPIRY_DONE_RANGES", "0"))
    # a transaction of its own since 3199285; before, the expiry's steps opened the cursors
    opening = getattr(dead_letter_steps, "open_ttl_cursors_steps", None)
    out: dict = {}
    for analyzed in ("fresh", "stale"):
        pg = PrivatePostgres(tempfile.mkdtemp(prefix="dmq-bench-expiry-"))
        try:
            dsn = pg.start()
            migrate(dsn)
            with connect(dsn, autocommit=True) as conn:
                owner = conn.execute("INSERT INTO dmq_owner (node_id) VALUES ('node-1') RETURNING id").fetchone()[0]
                registry.create_topic(conn, "short", ttl_ms=3_600_000)
                registry.create_topic(conn, "other")
                for topic in ("short", "other"):
                    registry.add_channel(conn, topic, "c")
                fill = ("INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, body) "
                        "SELECT CASE WHEN i %% 2 = 0 THEN 'short' ELSE 'other' END, 'p', i, 'node-1', %s, "
                        "repeat('x', 200)::bytea FROM generate_series(%s::int, %s::int) AS i")
                if analyzed == "stale":  # the other topic's copies known to the statistics, these not
                    conn.execute(fill.replace("CASE WHEN i %% 2 = 0 THEN 'short' ELSE 'other' END", "'other'"),
                                 (owner, 1, waiting))
                    conn.execute("VACUUM ANALYZE")
                    conn.execute(fill.replace("CASE WHEN i %% 2 = 0 THEN 'short' ELSE 'other' END", "'short'"),
                                 (owner, waiting + 1, 2 * waiting))
                else:
                    conn.execute(fill, (owner, 1, 2 * waiting))
                    conn.execute("VACUUM ANALYZE")
                if done_ranges:  # every other one of the first copies acknowledged: that many ranges
                    conn.execute(
                        "INSERT INTO dmq_cursor (topic, channel, owner, holder, floor, done) "
                        "SELECT 'short', 'c', %s, 'node-1', 0, range_agg(int8range(id, id, '[]')) "
                        "FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM dmq_message "
                        "      WHERE topic = 'short' ORDER BY id LIMIT %s) f WHERE n %% 2 = 1",
                        (owner, 2 * done_ranges))
                (now_ms,) = conn.execute("SELECT (extract(epoch FROM now()) * 1000)::bigint").fetchone()
            with connect(dsn) as conn:  # as the server's worker: each pass a transaction
                times = []
                for _ in range(passes):
                    started = time.perf_counter()
                    if opening is not None:
                        with conn.transaction():
                            run_steps(conn, opening())
                    with conn.transaction():
                        found = run_steps(conn, expire_deliveries_steps(now_ms, BATCH))
                    times.append((time.perf_counter() - started) * 1000)
                    assert not found, "nothing is past the time to live yet"
                with conn.transaction():
                    conn.execute("UPDATE dmq_message SET published_at = now() - interval '2 hours' WHERE id IN "
                                 "(SELECT m.id FROM dmq_message m LEFT JOIN dmq_cursor k ON k.topic = m.topic "
                                 " WHERE m.topic = 'short' AND NOT coalesce(k.done @> m.id, false) "
                                 " ORDER BY m.id LIMIT %s)", (BATCH,))
                started = time.perf_counter()
                if opening is not None:
                    with conn.transaction():
                        run_steps(conn, opening())
                with conn.transaction():
                    found = run_steps(conn, expire_deliveries_steps(now_ms, BATCH))
                batch_ms = (time.perf_counter() - started) * 1000
                assert len(found) == BATCH, len(found)
            out[analyzed] = {"median": statistics.median(times), "max": max(times), "batch": batch_ms}
        finally:
            pg.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", help="a source tree to measure (repeat to compare; default: this one)")
    parser.add_argument("--waiting", type=int, default=200_000, help="copies waiting on the topic with a time to live")
    parser.add_argument("--passes", type=int, default=10, help="passes that find nothing, timed")
    parser.add_argument("--rounds", type=int, default=1, help="runs per tree, alternated")
    parser.add_argument("--done-ranges", type=int, default=0,
                        help="the channel's cursor holds this many done ranges (acks out of order) before the passes")
    args = parser.parse_args()
    if args.passes < 1 or args.rounds < 1 or args.done_ranges < 0:
        parser.error("--passes and --rounds must be at least 1, --done-ranges at least 0")
    if 2 * args.done_ranges > args.waiting or args.waiting - args.done_ranges < BATCH:
        parser.error(f"--done-ranges R takes every other one of the first 2R waiting copies, and the batch pass "
                     f"needs {BATCH:,} left: --waiting must be at least 2R and at least R + {BATCH:,}")
    os.environ["DMQ_BENCH_EXPIRY_PASSES"] = str(args.passes)
    os.environ["DMQ_BENCH_EXPIRY_DONE_RANGES"] = str(args.done_ranges)
    trees = [str(Path(t).resolve()) for t in (args.tree or [HERE.parent])]
    print(f"expiry passes, {args.waiting:,} copies waiting, none past the time to live; a batch of {BATCH:,}; "
          f"{args.done_ranges:,} done ranges", flush=True)
    for _ in range(args.rounds):
        for tree in trees:
            result = cost.run_child("expiry", tree, args.waiting)
            for analyzed, r in result.items():  # type: ignore[union-attr]
                print(f"{tree}: statistics {analyzed:5}: a pass that finds nothing {r['median']:7.1f} ms "
                      f"(largest {r['max']:7.1f}); a pass that expires {BATCH:,}: {r['batch']:7.1f} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())
