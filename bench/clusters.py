#!/usr/bin/env python3
"""dmq on one PostgreSQL cluster versus two (``--pg-cluster``): publish throughput and CPU
per message, on this machine.

    python bench/clusters.py                 # 200,000 messages per run
    python bench/clusters.py --quick         # 40,000
    python bench/clusters.py --json out.json

Two private PostgreSQL servers (bench/_pg.py's settings) run side by side. Each run
starts a fresh dmq-server, registers two topics and publishes the same load to them
(``--producers`` processes, half on each topic, ``--window`` unanswered sends each):

  one   both topics on the main cluster (the second PostgreSQL is idle)
  two   topic t1 on main, t2 on cluster b (``--pg-cluster b=...``): each PostgreSQL
        takes half of the group commits

It reports acknowledged messages per second, publish->ack latency, and the CPU each
process used per acknowledged message (dmq-server, each PostgreSQL, the producers), so
that where a second cluster helps, and where the dmq-server's own CPU is the limit, can
be read off. Everything it starts it stops, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import fmt_int, fmt_lat, machine_info, percentiles, print_table, tree_cpu_seconds  # noqa: E402
from _pg import PrivatePostgres  # noqa: E402
from reliable import DmqServer, cpu_line, latencies, per_message_line, per_message_us, run_workers, split  # noqa: E402

import _dmq_load  # noqa: E402


def cost_per_message(cpu: dict, messages: int) -> dict:
    """CPU microseconds per acknowledged message: dmq-server, each PostgreSQL, both together."""
    out = per_message_us(cpu, messages)
    for name in ("PostgreSQL main", "PostgreSQL b"):
        out[name] = round(cpu.get(name, 0.0) / messages * 1e6, 1) if messages else 0.0
    out["dmq + PostgreSQL"] = round(sum(out.values()), 1)
    return out


def new_database(pg: PrivatePostgres, name: str) -> str:
    import psycopg

    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    if pg._embedded is not None:
        return pg._embedded.dsn_for(name)
    return pg.dsn.rsplit("/", 1)[0] + "/" + name


def create_topics(dsn: str, placement: dict[str, str]) -> None:
    import registry

    from dmq_server.db.worker import connect

    with connect(dsn, autocommit=True) as conn:
        for topic, cluster in placement.items():
            registry.create_topic(conn, topic, cluster=cluster)
            registry.add_channel(conn, topic, "c1")


def producers(port: int, topics: list[str], args: argparse.Namespace, tag: str) -> list:
    out = []
    for i, count in enumerate(split(args.messages, args.producers)):
        topic = topics[i % len(topics)]
        out.append((_dmq_load.producer_main, {
            "host": "127.0.0.1", "port": port, "topic": topic, "producer": f"bench-{os.getpid()}-{tag}-p{i}",
            "n": count, "window": args.window, "body_size": args.body_size, "rate": 0.0, "timeout": args.timeout,
        }))
    return out


def run(name: str, pgs: dict[str, PrivatePostgres], clusters: int, args: argparse.Namespace, work: Path) -> dict:
    workdir = work / name
    workdir.mkdir()
    dsns = {key: new_database(pg, f"bench_{name}") for key, pg in pgs.items()}  # each run on fresh databases
    extra = [f"--pg-cluster=b={dsns['b']}"] if clusters == 2 else []
    server = DmqServer(dsns["main"], workdir, extra + (args.server_arg or []))
    server.start()
    try:
        placement = {"t1": "main", "t2": "b" if clusters == 2 else "main"}
        create_topics(dsns["main"], placement)
        time.sleep(args.registry_wait)  # the node reads the registry every --registry-refresh
        warm = split(min(4000, args.messages), 2)
        run_workers([(_dmq_load.producer_main, {
            "host": "127.0.0.1", "port": server.tcp_port, "topic": t, "producer": f"warm-{name}-{t}", "n": n,
            "window": args.window, "body_size": args.body_size, "rate": 0.0, "timeout": args.timeout,
        }) for t, n in zip(("t1", "t2"), warm)], {})
        probes = {
            "dmq-server": server.cpu,
            "PostgreSQL main": lambda: tree_cpu_seconds(pgs["main"].postmaster_pid()),
            "PostgreSQL b": lambda: tree_cpu_seconds(pgs["b"].postmaster_pid()),
        }
        result = run_workers(producers(server.tcp_port, ["t1", "t2"], args, name), probes,
                             result_timeout=args.timeout + 60)
        stats = server.stats() or {}
    finally:
        server.stop()
    prods = list(result["results"].values())
    acked = sum(r["acked"] for r in prods)
    failed = sum(r["failed"] for r in prods)
    elapsed = max(r["t_end"] for r in prods) - result["t0"]
    lat = percentiles(latencies(prods))
    per_cluster = {k: v.get("published", 0) for k, v in (stats.get("clusters") or {}).items()}
    res = {
        "clusters": clusters, "acked": acked, "failed": failed, "elapsed_s": round(elapsed, 3),
        "acked_msgs_s": round(acked / elapsed, 1), "publish_ack_latency_ms": lat, "cpu_s": result["cpu"],
        "cpu_us_per_message": cost_per_message(result["cpu"], acked), "published_per_cluster": per_cluster,
    }
    print_table(f"dmq publish, {clusters} PostgreSQL cluster{'s' if clusters > 1 else ''}: {args.producers} producers "
                f"x window {args.window}, {args.body_size}-byte bodies, {args.messages:,} messages on 2 topics", [
                    ("acknowledged messages", f"{acked:,} (failed replies: {failed})"),
                    ("acknowledged msgs/s", fmt_int(res["acked_msgs_s"])),
                    ("publish->ack latency p50 / p99 / p99.9 (ms)", fmt_lat(lat)),
                    ("stored per cluster (since start, warm-up included)", ", ".join(f"{k} {v:,}" for k, v in per_cluster.items())),
                    ("CPU seconds", cpu_line(result["cpu"], elapsed)),
                    ("CPU per acked message", per_message_line(res["cpu_us_per_message"])),
                ])
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="40,000 messages per run")
    p.add_argument("--messages", type=int, help="messages per run (default 200000, quick 40000)")
    p.add_argument("--producers", type=int, default=4, help="producer processes (half on each topic)")
    p.add_argument("--window", type=int, default=256, help="unanswered sends per producer")
    p.add_argument("--body-size", type=int, default=200, help="message body bytes")
    p.add_argument("--runs", default="one,two", help="which runs, in order: one, two")
    p.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    p.add_argument("--registry-wait", type=float, default=2.5, help=argparse.SUPPRESS)
    p.add_argument("--server-arg", action="append", metavar="ARG", help="extra dmq-server argument (repeatable)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.messages = args.messages or (40_000 if args.quick else 200_000)
    work = Path(tempfile.mkdtemp(prefix="dmq-bench-clusters-"))
    os.chmod(work, 0o755)
    pgs: dict[str, PrivatePostgres] = {}
    results: dict = {"machine": machine_info(), "args": vars(args)}
    try:
        for key in ("main", "b"):
            (work / f"pg-{key}").mkdir()
            os.chmod(work / f"pg-{key}", 0o755)
            pgs[key] = PrivatePostgres(str(work / f"pg-{key}"))
            pgs[key].start()
        for name in [r.strip() for r in args.runs.split(",") if r.strip()]:
            results[name] = run(name, pgs, 2 if name == "two" else 1, args, work)
    finally:
        for pg in pgs.values():
            pg.stop()
    if "one" in results and "two" in results:
        one, two = results["one"], results["two"]
        print(f"\ntwo clusters / one: throughput x{two['acked_msgs_s'] / one['acked_msgs_s']:.2f}; "
              f"CPU per message: dmq-server {one['cpu_us_per_message'].get('dmq-server')} -> "
              f"{two['cpu_us_per_message'].get('dmq-server')} us")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
