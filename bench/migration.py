"""How long the schema migrations after a version take on a database holding messages.

Every server migrates at start, in one transaction, and a migration that rebuilds an index
of ``dmq_message`` holds the writes to it until it commits: an operator plans the stop by
this figure. The database is migrated to ``--from``, given ``--messages`` stored messages of
200 bytes over ``--topics`` topics and four producers, all of one incarnation, vacuumed and
analyzed; then the server's ``dmq_server.db.schema.migrate`` applies the later ones, timed
(one migration when ``--from`` is the version before the latest).

    python bench/migration.py --from 11 --messages 1000000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def run(start: int, messages: int, topics: int) -> dict:
    """{"fill_s": ..., "applied": [versions], "migrate_s": ...}: the migrations after ``start``, timed."""
    import psycopg

    from _pg import PrivatePostgres
    from dmq_server.db.schema import migrate

    pg = PrivatePostgres(tempfile.mkdtemp(prefix="dmq-bench-migration-"))
    dsn = pg.start()
    try:
        migrate(dsn, up_to=start)
        with psycopg.connect(dsn, autocommit=True) as conn:
            owner = conn.execute("INSERT INTO dmq_owner (node_id) VALUES ('node-1') RETURNING id").fetchone()[0]
            began = time.monotonic()
            conn.execute(
                "INSERT INTO dmq_message (topic, producer, session_id, node_id, owner, body) "
                "SELECT 'topic-' || (i %% %s), 'producer-' || (i %% 4), i, 'node-1', %s, repeat('x', 200)::bytea "
                "FROM generate_series(1, %s) AS i", (topics, owner, messages))
            conn.execute("VACUUM ANALYZE dmq_message")
            fill = time.monotonic() - began
        began = time.monotonic()
        applied = migrate(dsn)
        took = time.monotonic() - began
        with psycopg.connect(dsn, autocommit=True) as conn:
            (after,) = conn.execute("SELECT count(*) FROM dmq_message").fetchone()
        return {"fill_s": round(fill, 2), "applied": applied, "migrate_s": round(took, 3), "messages_after": after}
    finally:
        pg.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="start", type=int, required=True, help="the version the database starts at")
    parser.add_argument("--messages", type=int, default=1_000_000, help="messages stored before migrating")
    parser.add_argument("--topics", type=int, default=10, help="topics the messages are spread over")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args()
    result = run(args.start, args.messages, args.topics)
    print(f"{args.messages:,} messages stored and analyzed in {result['fill_s']:.1f} s")
    print(f"migrations {', '.join(map(str, result['applied']))}: {result['migrate_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
