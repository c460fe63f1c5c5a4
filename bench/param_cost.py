"""dmq-server's CPU for the hot statements' parameters: psycopg's list dumper against the
packed arrays of ``dmq_server.db.arrays``.

The group commit and the ack batch send their rows as arrays; the server's reactor thread
turns them into PostgreSQL's binary format before each statement. This builds the
parameters of ``insert_new_messages`` (a batch of sends) and ``ack_deliveries`` (a batch of
acks) as the server does, and times, per send and per ack:

- *psycopg's list dumper*: the same values as plain lists, dumped by psycopg (a dumper
  per element, in Python);
- *packed*: the lists as ``dmq_server.db.arrays`` types, dumped as the reactor does (the
  statement's parameter types set from its text, ``Transformer.set_dumper_types``).

No database is involved: it is the Python side alone, the part py-spy found to be the
largest single item of dmq-server's CPU under end-to-end load. Best of ``--rounds``.

    python bench/param_cost.py
    python bench/param_cost.py --batch 500 --rounds 9
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from psycopg.adapt import PyFormat, Transformer  # noqa: E402
from psycopg.pq import Format  # noqa: E402

from dmq_server.db.messages import (  # noqa: E402
    INSERT_NEW_MESSAGES,
    AckRow,
    CursorProgress,
    NewMessage,
    ack_deliveries_steps,
    send_columns,
)
from dmq_server.db.reactor import PreparedSql  # noqa: E402
from dmq_sql import queries  # noqa: E402


def per_row(sql: str, params: dict, rows: int, reps: int, packed: bool) -> float:
    """µs per row to dump ``params`` ``reps`` times with one transformer (psycopg's
    dumpers chosen by value and cached; the packed ones set up from the statement)."""
    parsed = PreparedSql.parse(sql)
    values = [params[n] for n in parsed.names]
    formats = [PyFormat.BINARY] * len(values)
    tx = Transformer()
    if packed:
        tx.set_dumper_types(parsed.oids, Format.BINARY)
    else:
        values = [list(v) if isinstance(v, list) else v for v in values]
    t0 = time.perf_counter()
    for _ in range(reps):
        tx.dump_sequence(values, formats)
    return 1e6 * (time.perf_counter() - t0) / (reps * rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=100, help="sends or acks per statement")
    parser.add_argument("--reps", type=int, default=300, help="statements per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.batch < 1 or args.reps < 1 or args.rounds < 1:
        parser.error("--batch, --reps and --rounds must be at least 1")
    now = 1_700_000_000_000
    sends = [NewMessage("orders", "producer-7", 1000 + i, now + i, b"x" * 200) for i in range(args.batch)]
    send_params = send_columns(sends, "node-1:4150") | {"owner": 3}
    acks = [AckRow("orders", f"c{i % 4}", 5000 + i, now, now + 3, 1, consumer=f"consumer-{i % 4}", owner=3,
                   published_ms=now - 2, delivered_ms=now + 1) for i in range(args.batch)]
    progress = [CursorProgress("orders", f"c{k}", 3, 5000 + args.batch, []) for k in range(4)]
    ack_params = next(ack_deliveries_steps(acks, progress, "node-1:4150")).params
    cases = [("send (insert_new_messages)", INSERT_NEW_MESSAGES, send_params),
             ("ack (ack_deliveries)", queries["ack_deliveries"], ack_params)]
    print(f"batches of {args.batch}, {args.reps} statements a round, best of {args.rounds} rounds")
    print(f"{'parameters of':28s} {'psycopg us/row':>15s} {'packed us/row':>14s}")
    for name, sql, params in cases:
        best = [min(per_row(sql, params, args.batch, args.reps, packed) for _ in range(args.rounds))
                for packed in (False, True)]
        print(f"{name:28s} {best[0]:15.2f} {best[1]:14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
