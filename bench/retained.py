#!/usr/bin/env python3
"""Long retention's cost (issue 46): the reliable path with millions of retained messages in
the store against an empty store, a seek back over a million of them, and the delivery rate
of the backlog the seek makes.

Per-topic retention (``dmq topic create --retention 7d``) keeps every acknowledged message of
a topic in ``dmq_message`` until it is older than that. The send and ack statements touch the
table's indexes and the cursors, the sweep and the depth count read it: if their cost grew
with the rows kept, a long retention would slow every topic. This script measures it.

One private PostgreSQL holds two databases, each with dmq's schema:

* ``empty``: nothing stored;
* ``retained``: ``--retained`` messages (10,000,000) of the topic ``history`` (retention 30 days,
  channel ``c1``), every one acknowledged (``c1``'s cursor is above them), published over the
  ``--span`` (24 h) before the run, written by SQL (storing them through dmq would take an hour
  here) as a retired incarnation's, then vacuumed as autovacuum would have, and counted in the
  topic's retained figures as the sweep would have while they arrived (``count_retained``).

Each round runs ``bench/reliable.py``'s ``publish`` and ``e2e1`` scenarios (P producers, W sends
unanswered each; one consumer on one channel at the same time) against a dmq-server on each
database in turn, the order alternating between rounds so that drift of the machine falls on
both. The figures are the acknowledged sends a second and the CPU a message (dmq-server and
PostgreSQL, background included), which on a shared 2-core machine is what survives noise.

Then, on ``retained`` only, ``dmq channel seek history c1`` back over the newest ``--seek-messages``
(1,000,000) of them: the dry run and the seek, to an id and to the time of that id, timed as an
operator runs them (the CLI, start-up included) and as the statements take (from the CLI's own
report); then one consumer drains the backlog the seek made: msgs/s and CPU a message.

    python bench/retained.py                         # 10 M retained, 2 rounds (~25 minutes)
    python bench/retained.py --quick                 # 1 M retained, smaller phases (~6 minutes)
    python bench/retained.py --retained 10000000 --rounds 3 --json r.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from array import array
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _dmq_load  # noqa: E402
import reliable  # noqa: E402
from _common import fmt_int, machine_info, percentiles, print_grid, print_table  # noqa: E402
from _pg import PrivatePostgres  # noqa: E402

DAY_MS = 86_400_000


def dsn_for(dsn: str, dbname: str) -> str:
    from psycopg.conninfo import make_conninfo

    return make_conninfo(dsn, dbname=dbname)


def prefill(dsn: str, count: int, span_ms: int, body_size: int, chunk: int = 1_000_000) -> dict:
    """``count`` acknowledged messages of ``history`` (channel ``c1``), as a retired
    incarnation's, published evenly over ``span_ms`` up to a minute ago; then VACUUM ANALYZE
    (the visibility map autovacuum would have set) and a CHECKPOINT."""
    import psycopg

    import registry

    t0 = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, "history", retention_ms=30 * DAY_MS)
        registry.add_channel(conn, "history", "c1")
        owner = conn.execute(
            "INSERT INTO dmq_owner (node_id, retired_at) VALUES ('prefill', now()) RETURNING id").fetchone()[0]
        end_ms = int(time.time() * 1000) - 60_000
        start_ms = end_ms - span_ms
        done = 0
        while done < count:
            n = min(chunk, count - done)
            conn.execute(
                """
                INSERT INTO dmq_message (topic, producer, session_id, published_at, node_id, owner, body)
                SELECT 'history', 'prefill', g,
                       timestamptz 'epoch' + (%(start)s + (g - 1) * %(step)s) * interval '1 millisecond',
                       'prefill', %(owner)s, %(body)s
                FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g
                """,
                {"start": start_ms, "step": span_ms / count, "owner": owner, "body": b"r" * body_size,
                 "lo": done + 1, "hi": done + n},
            )
            done += n
            print(f"    {done:,} of {count:,} stored ({time.monotonic() - t0:.0f} s)", flush=True)
        top = conn.execute("SELECT max(id) FROM dmq_message WHERE topic = 'history'").fetchone()[0]
        conn.execute(
            "INSERT INTO dmq_cursor (topic, channel, owner, holder, floor) VALUES ('history', 'c1', %s, '', %s)",
            (owner, top))
        t_vac = time.monotonic()
        conn.execute("VACUUM (ANALYZE) dmq_message")
        conn.execute("CHECKPOINT")
        size = conn.execute("SELECT pg_total_relation_size('dmq_message')").fetchone()[0]
    return {"messages": count, "top_id": top, "owner": owner, "fill_s": round(t_vac - t0, 1),
            "vacuum_s": round(time.monotonic() - t_vac, 1), "table_bytes": size}


def count_retained(dsn: str) -> float:
    """The retained figures of the rows the prefill wrote by SQL, counted to the end, as the
    retention sweep's passes count a topic's messages while they are stored (each once, in
    batches of 50,000, a minute or so after it arrived); the seconds it took. Left to the
    server, this first count of a store never counted (once, after the upgrade to schema 22)
    would run through the measured rounds."""
    import psycopg

    from dmq_server.db.retained import COUNT_BATCH, count_plan_steps, count_topic_steps
    from dmq_server.db.steps import run_steps

    t0 = time.monotonic()
    with psycopg.connect(dsn) as conn:
        point, topics = run_steps(conn, count_plan_steps())
        conn.commit()
        for topic in topics:
            while True:
                added = run_steps(conn, count_topic_steps(topic, point))
                conn.commit()
                if added is None or added < COUNT_BATCH:
                    break
    return round(time.monotonic() - t0, 1)


def settle(dsn: str) -> None:
    """The same VACUUM ANALYZE and CHECKPOINT on the empty database: both start alike."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE)")
        conn.execute("CHECKPOINT")


class RetainedBench(reliable.Bench):
    def __init__(self, args: argparse.Namespace, own: argparse.Namespace):
        super().__init__(args)
        self.own = own
        self.round_tag = ""

    def connect(self):
        """The database of the server running now (reliable.Bench's is the only one it has)."""
        from dmq_server.db.worker import connect

        return connect(self.server.dsn, autocommit=True)

    def create_topic(self, topic: str, channels: list[str], ordered: bool = False) -> None:
        """Once per database: a later round finds the topic there (its messages acknowledged)."""
        import registry

        try:
            super().create_topic(topic, channels, ordered)
        except registry.RegistryError as exc:
            if "already exists" not in str(exc):
                raise

    def producer_cfgs(self, topic: str, n: int, rate: float = 0.0, tag: str = "", **kw: Any) -> list:
        """Producers named for the round: a repeat of a round's (producer, session id) pairs
        would be answered as a resend, never stored again."""
        return super().producer_cfgs(topic, n, rate, f"{tag}-{self.round_tag}", **kw)

    def idle(self) -> dict:
        """The CPU a started server and PostgreSQL spend with no load for --idle-seconds: the
        retention sweep's passes, the depth count, the heartbeat, over the rows stored."""
        before = {name: probe() for name, probe in self.probes().items()}
        time.sleep(self.own.idle_seconds)
        cpu = {name: round(probe() - before[name], 2) for name, probe in self.probes().items()}
        print(f"  idle {self.own.idle_seconds:g} s after the start: "
              + ", ".join(f"{k} {v:.2f} s" for k, v in cpu.items()), flush=True)
        return {"seconds": self.own.idle_seconds, "cpu_s": cpu}

    def cli(self, dsn: str, *argv: str) -> tuple[float, Any]:
        """``dmq --pg-dsn DSN argv... --json``: seconds taken (start-up included) and its report."""
        script = Path(sys.executable).parent / "dmq"
        base = [str(script)] if script.exists() else [sys.executable, "-m", "dmq_server.admin.cli"]
        t0 = time.monotonic()
        out = subprocess.run(base + ["--pg-dsn", dsn, *argv, "--json"], capture_output=True, text=True, timeout=600)
        took = time.monotonic() - t0
        if out.returncode != 0:
            raise RuntimeError(f"dmq {' '.join(argv)}: exit {out.returncode}: {out.stderr.strip() or out.stdout}")
        return took, json.loads(out.stdout)

    def on(self, dsn: str, fn) -> Any:
        self.server = reliable.DmqServer(dsn, self.work, self.args.server_arg or [], self.args.server_log_level,
                                         self.args.server_cmd)
        self.start_server()
        try:
            return fn()
        finally:
            self.stop_server()
            self.server = None

    def round_on(self, label: str, dsn: str) -> dict:
        self.round_tag = label.replace(" ", "").replace(",", "-")
        def run() -> dict:
            out: dict[str, Any] = {"idle": self.idle()}
            self.warm_up()
            for name, fn in (("publish", self.scenario_publish), ("e2e1", lambda: self.scenario_e2e(1))):
                print(f"\n  -- {label}: {name}", flush=True)
                out[name] = fn()
            return out

        return self.on(dsn, run)

    def seek_and_drain(self, dsn: str, top: int) -> dict:
        own = self.own
        pivot = top - own.seek_messages + 1

        def run() -> dict:
            res: dict[str, Any] = {"messages": own.seek_messages, "pivot_id": pivot}
            import psycopg

            with psycopg.connect(dsn, autocommit=True) as conn:
                pivot_ms = conn.execute(
                    "SELECT (extract(epoch FROM published_at) * 1000)::bigint FROM dmq_message WHERE id = %s",
                    (pivot,)).fetchone()[0]
            for what, target in (("to_time", ["--to-time", str(pivot_ms)]), ("to_id", ["--to-id", str(pivot)])):
                took, report = self.cli(dsn, "channel", "seek", "history", "c1", *target, "--dry-run")
                res[f"dry_run_{what}_s"] = round(took, 2)
                res[f"dry_run_{what}_report"] = report
            took, report = self.cli(dsn, "channel", "seek", "history", "c1", "--to-time", str(pivot_ms))
            res["seek_to_time_s"] = round(took, 2)
            res["seek_report"] = report
            consumer = (_dmq_load.consumer_main, {
                "host": "127.0.0.1", "port": self.server.tcp_port, "topic": "history", "channel": "c1",
                "credit": self.args.credit, "single_acks": False, "expected": own.seek_messages,
                "timeout": self.args.timeout, "latency": False,
            })
            t_before = time.time()
            run = reliable.run_workers([consumer], self.probes(), result_timeout=self.args.timeout + 60)
            r = run["results"][0]
            elapsed = r["t_last"] - run["t0"]
            res.update({
                "delivered_acked": r["unique"], "duplicates": r["duplicates"], "elapsed_s": round(elapsed, 2),
                "msgs_s": round(r["unique"] / elapsed, 1), "cpu_s": run["cpu"],
                "cpu_us_per_message": reliable.per_message_us(run["cpu"], max(1, r["unique"])),
                "server_rss": self.sampler.window(t_before, time.time()) if self.sampler else None,
            })
            print_table("seek back over the newest messages of history, then drain c1", [
                ("messages sought back over", f"{own.seek_messages:,} (from id {pivot:,})"),
                ("dmq channel seek --dry-run, --to-time / --to-id (CLI, start-up included)",
                 f"{res['dry_run_to_time_s']:.2f} s / {res['dry_run_to_id_s']:.2f} s"),
                ("dmq channel seek --to-time (CLI, start-up included)", f"{res['seek_to_time_s']:.2f} s"),
                ("the seek's report", json.dumps(report)[:200]),
                ("replayed backlog delivered+acked", f"{r['unique']:,} in {elapsed:.1f} s, "
                                                     f"{fmt_int(res['msgs_s'])} msgs/s, {r['duplicates']} redelivered"),
                ("CPU a message", reliable.per_message_line(res["cpu_us_per_message"])),
            ])
            return res

        return self.on(dsn, run)


def summarise(rounds: list[dict]) -> dict:
    out: dict[str, Any] = {}
    for db in ("empty", "retained"):
        runs = [r[db] for r in rounds]
        out[db] = {
            "publish_msgs_s": [x["publish"]["acked_msgs_s"] for x in runs],
            "e2e_msgs_s": [x["e2e1"]["total_msgs_s"] for x in runs],
            "publish_cpu_us": [both(x["publish"]["cpu_us_per_message"]) for x in runs],
            "e2e_cpu_us": [both(x["e2e1"]["cpu_us_per_message"]) for x in runs],
            "publish_pg_cpu_us": [x["publish"]["cpu_us_per_message"].get("PostgreSQL") for x in runs],
            "e2e_pg_cpu_us": [x["e2e1"]["cpu_us_per_message"].get("PostgreSQL") for x in runs],
            "idle_cpu_s": [round(x["idle"]["cpu_s"]["dmq-server"] + x["idle"]["cpu_s"]["PostgreSQL"], 2)
                           for x in runs],
        }
    return out


def both(us: dict) -> float:
    """dmq-server's and PostgreSQL's CPU a message (PostgreSQL's background included)."""
    return round(us.get("dmq-server", 0.0) + us.get("PostgreSQL", 0.0), 1)


def median(values: list[float]) -> float:
    s = sorted(v for v in values if v is not None)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1,000,000 retained, smaller phases")
    p.add_argument("--retained", type=int, help="messages retained in the full store (default 10,000,000)")
    p.add_argument("--span", type=float, default=24.0, metavar="HOURS", help="their publish times' span (24)")
    p.add_argument("--seek-messages", type=int, help="messages the seek goes back over (default 1,000,000)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of publish+e2e1 on each database (2)")
    p.add_argument("--idle-seconds", type=float, default=20.0,
                   help="seconds each server is left idle after its start, its CPU counted (20)")
    p.add_argument("--json", metavar="PATH", help="also write all results as JSON")
    own, rest = p.parse_known_args(argv)
    own.retained = own.retained or (1_000_000 if own.quick else 10_000_000)
    own.seek_messages = own.seek_messages or (200_000 if own.quick else 1_000_000)
    if own.seek_messages > own.retained:
        p.error("--seek-messages is more than --retained")
    return own, rest


def main(argv: list[str] | None = None) -> int:
    own, rest = parse_args(argv)
    # reliable.py's own options (producers, window, body size, --messages, --e2e-messages...) pass through
    args = reliable.parse_args((["--quick"] if own.quick else []) + rest)
    bench = RetainedBench(args, own)
    results: dict[str, Any] = {"meta": {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(), "settings": {**vars(own), "messages": args.messages,
                                                 "e2e_messages": args.e2e_messages, "producers": args.producers,
                                                 "window": args.window, "body_size": args.body_size},
    }}
    print(f"dmq retention benchmark  {results['meta']['date_utc']} UTC: {own.retained:,} retained against none, "
          f"{own.rounds} rounds; seek over {own.seek_messages:,}", flush=True)
    pg = bench.pg = PrivatePostgres(str(bench.work / "pg"), dict(args.pg_setting))
    try:
        dsn = pg.start()
        import psycopg

        from dmq_server.db.schema import migrate

        with psycopg.connect(dsn, autocommit=True) as conn:
            for db in ("empty", "retained"):
                conn.execute(f"CREATE DATABASE {db}")
        dsns = {db: dsn_for(dsn, db) for db in ("empty", "retained")}
        for db in dsns.values():
            migrate(db)
        print(f"  PostgreSQL {pg.version()} ({pg.kind}); filling 'retained'", flush=True)
        results["prefill"] = fill = prefill(dsns["retained"], own.retained, int(own.span * 3_600_000), args.body_size)
        fill["count_s"] = count_retained(dsns["retained"])
        settle(dsns["empty"])
        print(f"  filled in {fill['fill_s']} s, vacuumed in {fill['vacuum_s']} s, counted (dmq_retained) in "
              f"{fill['count_s']} s; dmq_message {fill['table_bytes'] / 2**30:.2f} GiB", flush=True)
        rounds = []
        for i in range(own.rounds):
            order = ("empty", "retained") if i % 2 == 0 else ("retained", "empty")
            this = {}
            for db in order:
                print(f"\n== round {i + 1}: {db} store", flush=True)
                this[db] = bench.round_on(f"round {i + 1}, {db}", dsns[db])
            rounds.append(this)
        results["rounds"] = rounds
        s = results["summary"] = summarise(rounds)
        rows = []
        for label, key in (("publish acked msgs/s", "publish_msgs_s"), ("e2e1 delivered+acked msgs/s", "e2e_msgs_s"),
                           ("publish CPU us a message (dmq-server + PostgreSQL)", "publish_cpu_us"),
                           ("  of which PostgreSQL", "publish_pg_cpu_us"),
                           ("e2e1 CPU us a message (dmq-server + PostgreSQL)", "e2e_cpu_us"),
                           ("  of which PostgreSQL", "e2e_pg_cpu_us"),
                           ("CPU s idle after a start (dmq-server + PostgreSQL)", "idle_cpu_s")):
            e, f = median(s["empty"][key]), median(s["retained"][key])
            fmt = (lambda v: f"{v:.2f}") if key == "idle_cpu_s" else fmt_int
            rows.append((label, " / ".join(fmt(v) for v in s["empty"][key]),
                         " / ".join(fmt(v) for v in s["retained"][key]),
                         f"{(f / e - 1) * 100:+.1f} %" if e else "-"))
        print_grid(f"{own.retained:,} retained against an empty store (each round's figure; median change)",
                   ("", "empty", "retained", "retained vs empty"), rows)
        results["seek"] = bench.seek_and_drain(dsns["retained"], fill["top_id"])
    finally:
        bench.stop_server()
        pg.stop()
    if own.json:
        Path(own.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
