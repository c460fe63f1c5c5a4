"""Benchmark: delayed messages and dead-letter replay (targets in docs/benchmarks.md).

Scenarios, all on 127.0.0.1 with a private PostgreSQL and one dmq-server:

* ``due``: R messages falling due per second (default 1000/s for 10 s). They are
  sent (DELAY, pipelined) before their due times, which are spread evenly; one
  consumer receives and acknowledges. Lateness = arrival - due time, per message
  (the due time travels in the body; producer, server and consumer share a clock).
* ``pending``: reliable publish throughput and the server's RSS with an empty delay
  table, then again with 1,000,000 delayed messages pending (written by SQL, due in
  a day, random fragments) after the workers polled a few times.
* ``replay``: 100,000 dead letters (written by SQL) replayed with
  ``dmq dlq replay --all``: the CLI's rate, and the time until every one of them
  was moved into the reliable flow by the delay workers.

    python bench/delay.py                    # all three, about 3 minutes on 2 cores
    python bench/delay.py --quick            # smaller counts (about 1 minute)
    python bench/delay.py --scenarios due --rate 1000 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import psycopg  # noqa: E402
from _common import cpu_seconds, free_port, machine_info, memory_kb, percentiles, tree_cpu_seconds  # noqa: E402
from _pg import PrivatePostgres  # noqa: E402

from dmq_client.blocking import BlockingClient  # noqa: E402
from dmq_client.wire import SEND_REPLIES, Command, MessageType  # noqa: E402


class Server:
    def __init__(self, dsn: str, workdir: Path, extra: list[str], pg: PrivatePostgres | None = None):
        self.dsn = dsn
        self.pg = pg
        self.tcp = free_port()
        self.http = free_port()
        self.log = workdir / "dmq-server.log"
        self.args = [
            sys.executable, "-m", "dmq_server.main", "--pg-dsn", dsn,
            "--tcp-address", f"127.0.0.1:{self.tcp}", "--http-address", f"127.0.0.1:{self.http}",
            "--admin-address", f"127.0.0.1:{free_port()}", "--data-path", str(workdir / "data"), *extra,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        import urllib.request

        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/ping", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("dmq-server did not become ready:\n" + self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds used so far by dmq-server and by PostgreSQL (all its processes)."""
        pg = self.pg.postmaster_pid() if self.pg else None
        return cpu_seconds(self.proc.pid), (tree_cpu_seconds(pg) if pg else 0.0)

    def delay_counters(self) -> tuple[int, int]:
        """(polls, moves) of this node's delay workers so far, from GET /admin/delay."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/admin/delay", timeout=30) as r:
            workers = json.load(r).get("workers", [])
        return sum(w["polls"] for w in workers), sum(w["moves"] for w in workers)

    def rss_mb(self) -> float:
        return round(memory_kb(self.proc.pid)[0] / 1024, 1)


def setup_topic(dsn: str, topic: str) -> None:
    import registry
    from dmq_server.db.schema import migrate
    from dmq_server.db.worker import connect

    migrate(dsn)
    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, topic)
        registry.add_channel(conn, topic, "c")


def send_delayed_many(client: BlockingClient, topic: str, dues: list[int], window: int = 256) -> int:
    pending: set[int] = set()
    ok = 0
    for due in dues:
        while len(pending) >= window:
            reply = client._await_reply(lambda f: f.command in SEND_REPLIES and f.session_id in pending, 30)
            pending.discard(reply.session_id)
            ok += reply.command == Command.SEND_SUCCESS_ACK
        frame = client.send_frame(topic, struct.pack(">q", due) + b"x" * 92)
        frame.msg_type = MessageType.DELAY
        frame.due_ms = due
        pending.add(frame.session_id)
        client.write(frame)
    while pending:
        reply = client._await_reply(lambda f: f.command in SEND_REPLIES and f.session_id in pending, 30)
        pending.discard(reply.session_id)
        ok += reply.command == Command.SEND_SUCCESS_ACK
    return ok


def scenario_due(server: Server, rate: int, seconds: int) -> dict:
    topic = "due"
    setup_topic(server.dsn, topic)
    count = rate * seconds
    lateness: list[float] = []
    done = threading.Event()

    def consume() -> None:
        with BlockingClient("127.0.0.1", server.tcp, timeout=30) as consumer:
            consumer.subscribe(topic, "c", credit=2500)
            while len(lateness) < count:
                push = consumer.receive(timeout=seconds + 30)
                if push is None:
                    break
                arrived = time.time() * 1000
                lateness.append(arrived - struct.unpack(">q", push.body[:8])[0])
                consumer.ack(push)
        done.set()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    start = int(time.time() * 1000) + 4000  # sending 10,000 takes ~1-2 s; all are early
    dues = [start + int(i * 1000 / rate) for i in range(count)]
    with BlockingClient("127.0.0.1", server.tcp, timeout=30) as producer:
        sent = send_delayed_many(producer, topic, dues)
    sent_by = time.time() * 1000
    done.wait(seconds + 60)
    p = percentiles([x / 1000 for x in lateness], (50, 99, 99.9)) if lateness else {}  # takes seconds
    return {
        "rate_per_s": rate,
        "messages": count,
        "stored": sent,
        "all_sent_before_first_due": sent_by < start,
        "delivered": len(lateness),
        "early": sum(1 for x in lateness if x < 0),
        "lateness_ms": {k: round(v, 1) for k, v in p.items()},
        "max_lateness_ms": round(max(lateness), 1) if lateness else None,
        "target": "p99 <= 100 ms",
    }


def publish_rate(server: Server, topic: str, count: int, producers: int = 2) -> float:
    rate, _ = measured_publish(server, topic, count, producers)
    return rate


def measured_publish(server: Server, topic: str, count: int, producers: int = 2) -> tuple[float, dict]:
    """Publish ``count`` messages; the rate, and where the CPU went meanwhile."""

    def run(n: int) -> None:
        with BlockingClient("127.0.0.1", server.tcp, timeout=30) as client:
            replies = client.send_many(topic, [b"x" * 200] * n)
            assert all(r.command == Command.SEND_SUCCESS_ACK for r in replies)

    threads = [threading.Thread(target=run, args=(count // producers,)) for _ in range(producers)]
    polls0 = server.delay_counters()
    cpu0 = server.cpu_seconds()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    cpu1 = server.cpu_seconds()
    polls1 = server.delay_counters()
    detail = {
        "server_cpu_us_per_msg": round((cpu1[0] - cpu0[0]) * 1e6 / count, 1),
        "postgres_cpu_us_per_msg": round((cpu1[1] - cpu0[1]) * 1e6 / count, 1),
        "delay_polls": polls1[0] - polls0[0],
        "delay_moves": polls1[1] - polls0[1],
    }
    return count / elapsed, detail


def settle(dsn: str) -> None:
    """Let PostgreSQL finish what a bulk load leaves behind before measuring.

    A million rows written in one statement make autovacuum pass over the whole
    table (its insert threshold) and fill the WAL towards a checkpoint; both
    compete with the publishes for the 2 cores for a minute. That is the cost of
    the bulk load, not of having rows pending, so both measurements start after a
    VACUUM and a CHECKPOINT; the publish rate during that aftermath is reported
    separately.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE)")
        conn.execute("CHECKPOINT")


def scenario_pending(server: Server, pending: int, messages: int, runs: int = 5) -> dict:
    topic = "pend"
    setup_topic(server.dsn, topic)
    # Warm up past the channel's memory window (--mem-queue-size, 10,000): with no
    # consumer the first copies are also held in memory, later ones only in
    # PostgreSQL, so every measured run must start in the second state.
    publish_rate(server, topic, 30_000)
    settle(server.dsn)
    rss_before = server.rss_mb()
    before_runs = [measured_publish(server, topic, messages) for _ in range(runs)]
    before = [r for r, _ in before_runs]
    t0 = time.perf_counter()
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO dmq_delay (fragment, due_ms, topic, producer, session_id, body) "
            "SELECT 1 + mod(g, 8), (extract(epoch FROM now()) * 1000)::bigint + 86400000 + g, %s, 'bench-pending', g, "
            "decode(repeat('ab', 100), 'hex') FROM generate_series(1, %s) AS g",
            (topic, pending),
        )
    fill_s = time.perf_counter() - t0
    aftermath = publish_rate(server, topic, messages)  # autovacuum and checkpoint may be running
    settle(server.dsn)
    time.sleep(3)  # a few polls of every worker over the full table
    after_runs = [measured_publish(server, topic, messages) for _ in range(runs)]
    after = [r for r, _ in after_runs]
    rss_after = server.rss_mb()
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        still = conn.execute("SELECT count(*) FROM dmq_delay WHERE topic = %s", (topic,)).fetchone()[0]
    b, a = statistics.median(before), statistics.median(after)
    return {
        "pending_delayed": pending,
        "still_pending_after": still,
        "fill_seconds": round(fill_s, 1),
        "runs": runs,
        "publish_msgs_per_s_empty": [round(x) for x in before],
        "publish_msgs_per_s_pending": [round(x) for x in after],
        "median_empty": round(b),
        "median_pending": round(a),
        "throughput_change_pct": round(100 * (a - b) / b, 1),
        "publish_msgs_per_s_right_after_bulk_fill": round(aftermath),
        "cpu_and_polls_empty": [d for _, d in before_runs],
        "cpu_and_polls_pending": [d for _, d in after_runs],
        "server_rss_mb_empty": rss_before,
        "server_rss_mb_pending": rss_after,
        "target": "drop < 10%, RSS flat",
    }


def scenario_replay(server: Server, letters: int) -> dict:
    topic = "replay"
    setup_topic(server.dsn, topic)
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO dmq_dead_letter (reason, topic, channel, producer, session_id, body) "
            "SELECT 'expired', %s, 'c', 'bench', g, decode(repeat('cd', 100), 'hex') "
            "FROM generate_series(1, %s) AS g",
            (topic, letters),
        )
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "dmq_server.admin.cli", "--pg-dsn", server.dsn, "dlq", "replay", "--all", "--quiet"],
        capture_output=True, text=True, cwd=HERE.parent, timeout=600,
    )
    cli_s = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        while conn.execute("SELECT count(*) FROM dmq_delay WHERE topic = %s", (topic,)).fetchone()[0]:
            time.sleep(0.1)
        moved_s = time.perf_counter() - t0
        delivered = conn.execute("SELECT count(*) FROM dmq_pending WHERE topic = %s", (topic,)).fetchone()[0]
    return {
        "dead_letters": letters,
        "cli_output": out.stdout.strip().splitlines()[0],
        "cli_seconds_incl_startup": round(cli_s, 2),
        "cli_rate_per_s": round(letters / cli_s),
        "all_moved_seconds": round(moved_s, 2),
        "end_to_end_rate_per_s": round(letters / moved_s),
        "deliveries_created": delivered,
        "target": ">= 5000/s",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--scenarios", default="due,pending,replay")
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=int, default=None)
    parser.add_argument("--pending", type=int, default=None)
    parser.add_argument("--letters", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    seconds = args.seconds or (5 if args.quick else 10)
    pending = args.pending or (200_000 if args.quick else 1_000_000)
    letters = args.letters or (20_000 if args.quick else 100_000)
    workdir = Path(tempfile.mkdtemp(prefix="dmq-bench-delay-"))
    workdir.chmod(0o755)  # PostgreSQL runs as its own user when we are root
    pg = PrivatePostgres(str(workdir / "pg"))
    results: dict = {"machine": machine_info(), "command": " ".join(sys.argv)}
    try:
        dsn = pg.start()
        server = Server(dsn, workdir, ["--log-level", "warn"], pg)
        server.start()
        try:
            for name in args.scenarios.split(","):
                print(f"-- {name}", flush=True)
                if name == "due":
                    results[name] = scenario_due(server, args.rate, seconds)
                elif name == "pending":
                    results[name] = scenario_pending(server, pending, 20_000 if args.quick else 40_000)
                elif name == "replay":
                    results[name] = scenario_replay(server, letters)
                else:
                    raise SystemExit(f"unknown scenario {name!r}")
                print(json.dumps(results[name], indent=2), flush=True)
        finally:
            server.stop()
    finally:
        pg.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
