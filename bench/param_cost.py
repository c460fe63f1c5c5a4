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

The ack batch is timed twice: as rows whose channel changes at every ack (no two acks can
share a run), and as the acker queues a consumer's acks, ``AckRun``s of one channel each
(``--runs`` of them; the topic, channel and consumer arrays then pack a run at a time).
A last table times building the ack statement's parameters *and* packing them, per ack,
from single acks (``AckRow``s, each taken as a run of one: a consumer alternating between
channels, or the tests) against from runs: what the reactor thread does for each ack batch.

No database is involved: it is the Python side alone, the part py-spy found to be the
largest single item of dmq-server's CPU under end-to-end load. Best of ``--rounds``.

    python bench/param_cost.py
    python bench/param_cost.py --batch 500 --rounds 9
    python bench/param_cost.py --batch 1000 --runs 4
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
    AckRun,
    CursorProgress,
    NewMessage,
    ack_deliveries_steps,
    insert_params,
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


def build_and_dump(batch: list, progress: list, rows: int, reps: int) -> float:
    """µs per ack to build ``ack_deliveries``' parameters from ``batch`` (rows or runs) and
    pack them, as the acker's flush does."""
    parsed = PreparedSql.parse(queries["ack_deliveries"])
    formats = [PyFormat.BINARY] * len(parsed.names)
    tx = Transformer()
    tx.set_dumper_types(parsed.oids, Format.BINARY)
    t0 = time.perf_counter()
    for _ in range(reps):
        params = next(ack_deliveries_steps(batch, progress, "node-1:4150")).params
        tx.dump_sequence([params[n] for n in parsed.names], formats)
    return 1e6 * (time.perf_counter() - t0) / (reps * rows)


def ack_runs(acks: list[AckRow], runs: int) -> list[AckRun]:
    """``acks`` as ``runs`` runs of one channel and consumer each, in channel order."""
    out = []
    for k in range(runs):
        mine = [a for a in acks if a.channel == f"c{k}"]
        run = AckRun.of(mine[0])
        for a in mine[1:]:
            if not run.absorb(AckRun.of(a)):  # one channel and consumer: every ack joins
                raise RuntimeError(f"ack {a.message_id} did not join the run of {a.channel}")
        out.append(run)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=100, help="sends or acks per statement")
    parser.add_argument("--reps", type=int, default=300, help="statements per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=4, help="channels (runs of acks) in an ack batch")
    args = parser.parse_args()
    if args.batch < 1 or args.reps < 1 or args.rounds < 1 or not 1 <= args.runs <= args.batch:
        parser.error("--batch, --reps and --rounds must be at least 1, --runs 1..--batch")
    now = 1_700_000_000_000
    sends = [NewMessage("orders", "producer-7", 1000 + i, now + i, b"x" * 200) for i in range(args.batch)]
    send_params = insert_params(sends, "node-1:4150", 3)
    k = args.runs
    acks = [AckRow("orders", f"c{i % k}", 5000 + i, now, now + 3, 1, consumer=f"consumer-{i % k}", owner=3,
                   published_ms=now - 2, delivered_ms=now + 1) for i in range(args.batch)]
    runs = ack_runs(acks, k)
    progress = [CursorProgress("orders", f"c{j}", 3, 5000 + args.batch, []) for j in range(k)]
    ack_params = next(ack_deliveries_steps(acks, progress, "node-1:4150")).params
    run_params = next(ack_deliveries_steps(runs, progress, "node-1:4150")).params
    cases = [("send (insert_new_messages)", INSERT_NEW_MESSAGES, send_params),
             ("ack (ack_deliveries), rows", queries["ack_deliveries"], ack_params),
             (f"ack (ack_deliveries), {k} runs", queries["ack_deliveries"], run_params)]
    print(f"batches of {args.batch}, {args.reps} statements a round, best of {args.rounds} rounds")
    print(f"{'parameters of':30s} {'psycopg us/row':>15s} {'packed us/row':>14s}")
    for name, sql, params in cases:
        best = [min(per_row(sql, params, args.batch, args.reps, packed) for _ in range(args.rounds))
                for packed in (False, True)]
        print(f"{name:30s} {best[0]:15.2f} {best[1]:14.2f}")
    print(f"\nthe ack batch's parameters built and packed, us/ack (best of {args.rounds})")
    for name, batch in (("from single acks (rows)", acks), (f"from {k} runs", runs)):
        best = min(build_and_dump(batch, progress, args.batch, args.reps) for _ in range(args.rounds))
        print(f"{name:30s} {best:15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
