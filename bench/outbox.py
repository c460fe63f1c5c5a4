#!/usr/bin/env python3
"""The outbox relay's figures (issue 44): relayed messages per second against direct
publish, commit-to-stored latency, and what sending costs the application's transaction.

    python bench/outbox.py              # full run (about 3 minutes)
    python bench/outbox.py --quick      # smaller counts
    python bench/outbox.py --json out.json

One dmq-server (``--outbox bench=APP_DSN``) on its own PostgreSQL, and the application's
database on another (both ``EmbeddedPostgres`` through bench/_pg.py, fsync on), with the
outbox installed (``dmq_server.db.outbox.install``, what ``dmq outbox install`` runs).

Parts (docs/benchmarks.md, "The outbox relay"):
  drain    the outbox filled with N rows while the bench holds the relay's lock, then let go:
           rows relayed per second with nothing else running (the relay alone)
  single   P producer processes, one ``dmq_client.outbox.send`` per transaction, N in all;
           relayed/s measured from dmq's side (the stored messages' published_at)
  batch    the same with 100 sends per transaction
  direct   the same N published straight to dmq by P producers (bench/_dmq_load.py, the
           reliable bench's generator: pipelined sends, each acked after its commit)
  latency  paced single-send transactions (--rate msgs/s): commit (answered to the
           application) to stored (the message's published_at: the storing transaction's
           now()) and to delivered (a consumer's receive), p50/p99
  cost     one connection, transactions of one business INSERT against the same plus
           ``outbox.send``, into an outbox no relay reads and into the relayed one,
           interleaved in blocks: wall time p50/p99 and the CPU of the application's
           PostgreSQL (the sender's backend, and all of it: with the relay's reads and deletes)

CPU microseconds per message of dmq-server and of both PostgreSQLs stand next to each rate.
Everything it starts it stops, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _dmq_load  # noqa: E402
from _common import (  # noqa: E402
    cpu_seconds,
    machine_busy_seconds,
    machine_info,
    percentiles,
    reference_loop_ns,
    run_worker,
    tree_cpu_seconds,
)
from _pg import PrivatePostgres, schema_with_topic  # noqa: E402
from reliable import DmqServer, run_workers, split  # noqa: E402

CORES = os.cpu_count() or 1
OUTBOX = "bench"
SCHEMA = "dmq_outbox"
UNRELAYED = "bench_unrelayed"  # an outbox installed beside it that no relay reads (the cost part)


# -- the application's side: producer processes -----------------------------------------------
def outbox_producer_main(cfg: dict, index: int, ready_q: Any, start_evt: Any, result_q: Any) -> None:
    """One application process: ``cfg["n"]`` sends in transactions of ``cfg["batch"]``,
    paced to ``cfg["rate"]`` transactions a second (0: as fast as it can)."""
    run_worker("producer", _outbox_producer, cfg, index, ready_q, start_evt, result_q)


def _outbox_producer(cfg: dict, index: int, ready_q: Any, start_evt: Any, result: dict) -> None:
    import psycopg

    from dmq_client import outbox

    n, batch, rate = cfg["n"], cfg["batch"], float(cfg.get("rate") or 0.0)
    pad = b"." * max(0, cfg["body_size"] - 24)
    conn = psycopg.connect(cfg["dsn"])
    ready_q.put(("ready", index, None))
    if not start_evt.wait(120):
        raise RuntimeError("start signal never came")
    committed: dict[bytes, float] = {}  # body's name -> when its COMMIT was answered (time.time())
    t_start = time.time()
    start = time.monotonic()
    sent = txns = 0
    while sent < n:
        if rate:
            due = start + txns / rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # pacing: the offered rate
        names = [f"{index}/{sent + k}".encode() for k in range(min(batch, n - sent))]
        with conn.transaction():
            for name in names:
                outbox.send(conn, cfg["topic"], name + b" " + pad)
        now = time.time()
        if cfg.get("record"):
            for name in names:
                committed[name] = now
        sent += len(names)
        txns += 1
    result.update(sent=sent, txns=txns, t_start=t_start, t_end=time.time(), committed=committed)
    conn.close()


def producer_cfgs(dsn: str, topic: str, n: int, producers: int, batch: int, body_size: int,
                  rate: float = 0.0, record: bool = False) -> list[tuple[Callable, dict]]:
    return [(outbox_producer_main, {"dsn": dsn, "topic": topic, "n": count, "batch": batch, "body_size": body_size,
                                    "rate": rate / producers if rate else 0.0, "record": record})
            for count in split(n, producers)]


# -- the bench ------------------------------------------------------------------------------------
class OutboxBench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="dmq-bench-outbox-"))
        self.work.chmod(0o755)
        self.dmq_pg = PrivatePostgres(str(self.work / "dmq-pg"))
        self.app_pg = PrivatePostgres(str(self.work / "app-pg"))
        self.server: DmqServer | None = None
        self._dmq_conn: Any = None  # psycopg.Connection, opened on first use
        self.results: dict[str, Any] = {"meta": machine_info()}

    # setup
    def start(self) -> None:
        from dmq_server.db.outbox import install

        dmq_dsn = self.dmq_pg.start()
        app_dsn = self.app_pg.start()
        topics = ("outbox_drain", "outbox_single", "outbox_batch", "direct", "outbox_latency", "outbox_cost")
        schema_with_topic(dmq_dsn, topics[0], ("c1",))
        import registry
        from dmq_server.db.worker import connect

        with connect(dmq_dsn, autocommit=True) as conn:
            for topic in topics[1:]:
                registry.create_topic(conn, topic)
                registry.add_channel(conn, topic, "c1")
        install(app_dsn)
        install(app_dsn, UNRELAYED)
        with connect(app_dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, note text)")
        self.server = DmqServer(dmq_dsn, self.work, ["--outbox", f"{OUTBOX}={app_dsn}"])
        self.results["meta"].update(dmq_pg=self.dmq_pg.version(), app_pg=self.app_pg.version())

    def stop(self) -> None:
        try:
            if self._dmq_conn is not None:
                self._dmq_conn.close()
            if self.server is not None:
                self.server.stop()
        finally:
            self.app_pg.stop()
            self.dmq_pg.stop()

    # measuring
    def probes(self) -> dict[str, Callable[[], float]]:
        server = self.server
        assert server is not None

        def pg(p: PrivatePostgres) -> Callable[[], float]:
            return lambda: tree_cpu_seconds(p.postmaster_pid() or 0)

        return {"dmq-server": server.cpu, "dmq's PostgreSQL": pg(self.dmq_pg), "application's PostgreSQL": pg(self.app_pg)}

    def cpu_before(self) -> dict[str, float]:
        return {name: probe() for name, probe in self.probes().items()}

    def cpu_us(self, before: dict[str, float], messages: int) -> dict[str, float]:
        """CPU microseconds per message since ``before``, per process tree."""
        return {name: round((probe() - before[name]) / max(1, messages) * 1e6, 1)
                for name, probe in self.probes().items()}

    def stored(self, topic: str) -> tuple[int, float, float]:
        """(count, first and last published_at as Unix seconds) of the topic's messages, on
        one connection kept for the run (a count on the topic's index, a few a second)."""
        import psycopg

        if self._dmq_conn is None:
            self._dmq_conn = psycopg.connect(self.dmq_pg.dsn, autocommit=True)
        row = self._dmq_conn.execute(
            "SELECT count(*), extract(epoch FROM min(published_at)), extract(epoch FROM max(published_at))"
            " FROM dmq_message WHERE topic = %s", (topic,)).fetchone()
        assert row is not None
        return int(row[0]), float(row[1] or 0), float(row[2] or 0)

    def wait_stored(self, topic: str, n: int, timeout: float = 600) -> tuple[int, float, float]:
        """Until ``n`` messages of ``topic`` are stored (the rates come from their
        published_at, not from when this saw them)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.stored(topic)
            if found[0] >= n:
                return found
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {found[0]} of {n} messages of {topic} stored in {timeout:g} s")
            time.sleep(0.25)  # polling dmq's database for the count

    # parts
    def part_drain(self, start_server: Callable[[], None]) -> dict:
        """Fill the outbox while the bench holds the relay's lock (before dmq-server starts:
        a running relay holds it for good), start the server, then let the lock go."""
        import psycopg

        from dmq_client import outbox
        from dmq_server.db.outbox import relay_queries

        a = self.args
        topic = "outbox_drain"
        holder = psycopg.connect(self.app_pg.dsn, autocommit=True)
        try:
            row = holder.execute(relay_queries(SCHEMA)["relay_lock"], {"schema": SCHEMA}).fetchone()
            if not row or not row[0]:
                raise RuntimeError("the relay's lock is taken: is another dmq-server relaying this outbox?")
            with psycopg.connect(self.app_pg.dsn) as conn:
                body = b"." * a.body_size
                for start in range(0, a.messages, 1000):
                    with conn.transaction():
                        for _ in range(min(1000, a.messages - start)):
                            outbox.send(conn, topic, body)
            start_server()
            before = self.cpu_before()
            released = time.time()
        finally:
            holder.close()  # the lock goes with the session
        count, first, last = self.wait_stored(topic, a.messages)
        cpu = self.cpu_us(before, count)
        rate = count / max(1e-6, last - first)
        return {"messages": count, "relayed_per_s": round(rate),
                "first_stored_after_release_s": round(first - released, 2), "cpu_us_per_msg": cpu}

    def part_relay(self, topic: str, batch: int) -> dict:
        a = self.args
        before = self.cpu_before()
        run = run_workers(producer_cfgs(self.app_pg.dsn, topic, a.messages, a.producers, batch, a.body_size), {},
                          result_timeout=a.timeout)
        results = list(run["results"].values())
        count, first, last = self.wait_stored(topic, a.messages)
        cpu = self.cpu_us(before, count)
        t_end = max(r["t_end"] for r in results)
        return {"messages": count, "batch": batch, "producers": a.producers,
                "committed_per_s": round(count / (t_end - run["t0"])),
                "relayed_per_s": round(count / (last - run["t0"])),
                "last_stored_after_last_commit_s": round(last - t_end, 3),
                "cpu_us_per_msg": cpu}

    def part_direct(self) -> dict:
        a = self.args
        cfgs = [(_dmq_load.producer_main, {"host": "127.0.0.1", "port": self.server.tcp_port, "topic": "direct",
                                            "producer": f"bench-direct-p{i}", "n": count, "window": a.window,
                                            "body_size": a.body_size, "rate": 0.0, "timeout": a.timeout})
                for i, count in enumerate(split(a.messages, a.producers))]
        before = self.cpu_before()
        run = run_workers(cfgs, {}, result_timeout=a.timeout + 60)
        results = list(run["results"].values())
        acked = sum(r["acked"] for r in results)
        elapsed = max(r["t_end"] for r in results) - run["t0"]
        return {"messages": acked, "producers": a.producers, "window": a.window,
                "acked_per_s": round(acked / elapsed), "cpu_us_per_msg": self.cpu_us(before, acked)}

    def part_latency(self) -> dict:
        """Paced single-send transactions; a consumer in this process records receive times."""
        from dmq_client.blocking import BlockingClient
        from dmq_client.wire import Command

        a = self.args
        topic = "outbox_latency"
        n = int(a.rate * a.latency_seconds)
        received: dict[bytes, float] = {}
        stop = threading.Event()
        client = BlockingClient("127.0.0.1", self.server.tcp_port, timeout=10)
        reply = client.subscribe(topic, "c1", credit=500)
        if reply.command != Command.SUBSCRIBE_ACK:
            raise RuntimeError(f"subscribe: {reply.command.name}")

        def consume() -> None:
            while not stop.is_set():
                push = client.receive(timeout=0.2)
                while push is not None:
                    received[push.body.split(b" ", 1)[0]] = time.time()
                    client.ack(push)
                    push = client.receive(timeout=0)

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        before = self.cpu_before()
        try:
            run = run_workers(producer_cfgs(self.app_pg.dsn, topic, n, 2, 1, a.body_size, rate=a.rate, record=True),
                              {}, result_timeout=a.timeout)
            self.wait_stored(topic, n)
            deadline = time.monotonic() + 60
            while len(received) < n and time.monotonic() < deadline:
                time.sleep(0.05)  # the consumer thread fills ``received``
        finally:
            stop.set()
            reader.join(5)
            client.close()
        cpu = self.cpu_us(before, n)
        committed: dict[bytes, float] = {}
        for r in run["results"].values():
            committed.update(r["committed"])
        import psycopg

        stored_at: dict[bytes, float] = {}
        with psycopg.connect(self.dmq_pg.dsn, autocommit=True) as conn:
            for body, at in conn.execute("SELECT body, extract(epoch FROM published_at) FROM dmq_message "
                                         "WHERE topic = %s", (topic,)):
                stored_at[bytes(body).split(b" ", 1)[0]] = float(at)
        to_stored = [stored_at[k] - t for k, t in committed.items() if k in stored_at]
        to_delivered = [received[k] - t for k, t in committed.items() if k in received]
        return {"offered_per_s": a.rate, "messages": n, "stored": len(to_stored), "delivered": len(to_delivered),
                "commit_to_stored_ms": _ms(percentiles(to_stored, (50, 99))),
                "commit_to_delivered_ms": _ms(percentiles(to_delivered, (50, 99))),
                "cpu_us_per_msg": cpu}

    def part_cost(self) -> dict:
        """Interleaved blocks of plain and sending transactions on one connection: sending into
        an outbox no relay reads (the insert and its NOTIFY alone) and into the relayed one
        (what the application sees while the relay reads and deletes beside it)."""
        import psycopg

        from dmq_client import outbox

        a = self.args
        blocks, size = a.cost_blocks, 200
        kinds = {"insert": None, "insert + send, no relay": UNRELAYED, "insert + send, relayed": SCHEMA}
        walls: dict[str, list[float]] = {kind: [] for kind in kinds}
        backend = dict.fromkeys(kinds, 0.0)
        app_pg = dict.fromkeys(kinds, 0.0)
        app_probe = self.probes()["application's PostgreSQL"]
        body = b"." * a.body_size
        with psycopg.connect(self.app_pg.dsn) as conn:
            pid = conn.info.backend_pid
            for b in range(len(kinds) * blocks):
                kind = list(kinds)[b % len(kinds)]
                schema = kinds[kind]
                cpu0, all0 = cpu_seconds(pid), app_probe()
                for _ in range(size):
                    t0 = time.perf_counter()
                    with conn.transaction():
                        conn.execute("INSERT INTO orders (note) VALUES (%s)", ("an order",))
                        if schema is not None:
                            outbox.send(conn, "outbox_cost", body, schema=schema)
                    walls[kind].append(time.perf_counter() - t0)
                backend[kind] += cpu_seconds(pid) - cpu0
                app_pg[kind] += app_probe() - all0
        n = blocks * size
        self.wait_stored("outbox_cost", n)
        out: dict[str, Any] = {"transactions_each": n}
        for kind in kinds:
            p = percentiles(walls[kind], (50, 99))
            out[kind] = {"p50_ms": p["p50"], "p99_ms": p["p99"],
                         "sender_backend_cpu_us": round(backend[kind] / n * 1e6, 1),
                         "app_pg_cpu_us": round(app_pg[kind] / n * 1e6, 1)}
        return out


def _ms(p: dict) -> dict:
    """percentiles()'s milliseconds, rounded to 0.1 ms."""
    return {k: (round(v, 1) if v is not None else None) for k, v in p.items() if k in ("p50", "p99", "max", "count")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller counts")
    ap.add_argument("--messages", type=int, default=0, help="messages of each throughput part (default 40,000)")
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--window", type=int, default=256, help="direct producers' unanswered sends (as reliable.py)")
    ap.add_argument("--body-size", type=int, default=200, help="message body bytes (as reliable.py)")
    ap.add_argument("--rate", type=float, default=500.0, help="the latency part's offered msgs/s")
    ap.add_argument("--latency-seconds", type=float, default=0.0, help="default 20 (quick 8)")
    ap.add_argument("--cost-blocks", type=int, default=0, help="blocks of 200 transactions each kind (default 10)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--parts", default="drain,single,batch,direct,latency,cost",
                    help="which parts, in this order (drain first if at all: it starts the server)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    args.messages = args.messages or (8000 if args.quick else 40000)
    args.latency_seconds = args.latency_seconds or (8.0 if args.quick else 20.0)
    args.cost_blocks = args.cost_blocks or (4 if args.quick else 10)
    bench = OutboxBench(args)
    parts: dict[str, Callable[[], dict]] = {
        "drain": lambda: bench.part_drain(start_server),
        "single": lambda: bench.part_relay("outbox_single", 1),
        "batch": lambda: bench.part_relay("outbox_batch", 100),
        "direct": bench.part_direct,
        "latency": bench.part_latency,
        "cost": bench.part_cost,
    }
    def start_server() -> None:
        assert bench.server is not None
        bench.server.start()

    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    bench.results["meta"].update(commit=commit, reference_loop_ns_before=round(reference_loop_ns()))
    busy0 = machine_busy_seconds()
    wall0 = time.monotonic()
    try:
        bench.start()
        if "drain" not in args.parts.split(","):
            start_server()
        print(f"dmq-server --outbox {OUTBOX}=...; dmq's PostgreSQL and the application's each an EmbeddedPostgres "
              f"in {bench.work}", flush=True)
        for name in args.parts.split(","):
            print(f"== {name}", flush=True)
            result = parts[name]()
            bench.results[name] = result
            print(json.dumps(result, indent=2), flush=True)
    finally:
        bench.stop()
    busy1 = machine_busy_seconds()
    r = bench.results
    r["meta"].update(reference_loop_ns_after=round(reference_loop_ns()),
                     machine_busy_share=round((busy1[0] - busy0[0]) / (time.monotonic() - wall0) / CORES, 2),
                     stolen_share=round((busy1[2] - busy0[2]) / (time.monotonic() - wall0) / CORES, 2))
    print(f"commit {commit}; reference loop {r['meta']['reference_loop_ns_before']} -> "
          f"{r['meta']['reference_loop_ns_after']} ns; machine busy {r['meta']['machine_busy_share']:.0%} "
          f"of {CORES} cores during the run, stolen {r['meta']['stolen_share']:.0%}")
    if "direct" in r:
        for name in ("drain", "single", "batch"):
            if name in r:
                share = r[name]["relayed_per_s"] / max(1, r["direct"]["acked_per_s"])
                print(f"{name}: relayed {r[name]['relayed_per_s']:,}/s = {share:.0%} of direct "
                      f"{r['direct']['acked_per_s']:,}/s (goal: at least 50%)")
    if "latency" in r:
        print(f"commit->stored p50 {r['latency']['commit_to_stored_ms']['p50']} ms "
              f"(goal: under 20 ms), p99 {r['latency']['commit_to_stored_ms']['p99']} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
