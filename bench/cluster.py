#!/usr/bin/env python3
"""dmq cluster benchmark: throughput with 1, 2 and 3 nodes on one PostgreSQL.

    python bench/cluster.py                 # nodes 1,2,3; publish and end to end
    python bench/cluster.py --quick         # smaller counts
    python bench/cluster.py --nodes 1,3 --json out.json

For each node count it starts a fresh set of ``dmq-server --zk`` nodes (one shared
private PostgreSQL and one standalone ZooKeeper for the whole run), registers a fresh
topic in ZooKeeper, and runs:

  publish  P producer connections in all (``--producers``), spread round robin over
           the nodes, W unanswered sends each, N messages: acknowledged msgs/s and
           publish->ack latency; every node stores what it receives (owner = itself);
  e2e      the same producers plus one consumer connection per node on one channel
           (each node delivers the copies it stored), running together: delivered+acked
           msgs/s and publish->delivery latency.

The load generators are bench/_dmq_load.py's (raw sockets, templated frames);
server processes and worker orchestration are bench/reliable.py's. CPU seconds of
every node, PostgreSQL, ZooKeeper and the generators are printed, so the figures
can be read against what the machine had. docs/benchmarks.md records results.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any, Callable, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import _dmq_load  # noqa: E402
from _common import (  # noqa: E402
    cpu_seconds,
    fmt_int,
    fmt_lat,
    machine_info,
    percentiles,
    print_grid,
    tree_cpu_seconds,
)
from _pg import PrivatePostgres  # noqa: E402
from reliable import DmqServer, run_workers, split  # noqa: E402


def latencies(results: list[dict]) -> array:
    out = array("d")
    for r in results:
        out.frombytes(r["lat"])
    return out


class Cluster:
    """``count`` dmq nodes on one PostgreSQL and one ZooKeeper chroot."""

    def __init__(self, count: int, dsn: str, zk: str, workdir: Path, log_level: str,
                 extra: Sequence[str] = (), name: str = ""):
        self.zk = zk
        self.nodes: list[DmqServer] = []
        self.node_ids = [f"bench-{name or count}-node{i + 1}" for i in range(count)]
        for i in range(count):
            node_dir = workdir / f"node{i + 1}"
            node_dir.mkdir(parents=True, exist_ok=True)
            self.nodes.append(
                DmqServer(
                    dsn,
                    node_dir,
                    [
                        "--zk", zk,
                        "--node-id", self.node_ids[i],
                        "--admin-address", "",
                        "--zk-session-timeout", "10s",
                        *extra,
                    ],
                    log_level=log_level,
                )
            )

    def start(self) -> None:
        for node in self.nodes:
            node.start()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def cpu(self) -> float:
        return sum(node.cpu() for node in self.nodes)


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="dmq-bench-cluster-"))
        self.work.chmod(0o755)
        self.pg: PrivatePostgres | None = None
        self.zk: Any = None
        self.results: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "runs": []}

    # -- infrastructure ------------------------------------------------------------------
    def start(self) -> None:
        from tests.zk.zkserver import Ensemble

        print("starting PostgreSQL and ZooKeeper...", flush=True)
        self.pg = PrivatePostgres(str(self.work / "pg"), settings=getattr(self.args, "pg_settings", None))
        self.pg.start()
        self.zk = Ensemble(1, base=self.work / "zk").start()

    def stop(self) -> None:
        if self.zk is not None:
            for server in self.zk.servers:
                server.stop()
        if self.pg is not None:
            self.pg.stop()
        if not self.args.keep_logs:
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            print(f"logs kept in {self.work}")

    def pg_cpu(self) -> float:
        pid = self.pg.postmaster_pid() if self.pg else None
        return tree_cpu_seconds(pid) if pid else 0.0

    def zk_cpu(self) -> float:
        proc = self.zk.servers[0].proc if self.zk else None
        return cpu_seconds(proc.pid) if proc is not None else 0.0

    def reset_store(self) -> None:
        """Every run starts from empty message tables: rows left by an earlier run would
        be taken over (their nodes are gone) and bloat the tables the run writes to."""
        import psycopg

        with psycopg.connect(self.pg.dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE dmq_cursor, dmq_attempts, dmq_delivery_batch, dmq_message")
            conn.execute("VACUUM ANALYZE")

    def register(self, zk_address: str, topic: str, channels: list[str], ordered: bool = False) -> None:
        from registry.zk import ZkRegistry, connect

        client = connect(zk_address, timeout=30)
        try:
            registry = ZkRegistry(client)
            registry.create_topic(topic, **({"ordered": True} if ordered else {}))
            for channel in channels:
                registry.add_channel(topic, channel)
        finally:
            client.stop()
            client.close()

    # -- one node count ------------------------------------------------------------------
    def run_nodes(self, count: int) -> dict:
        a = self.args
        zk_address = f"{self.zk.address}/bench{count}"
        cluster = Cluster(count, self.pg.dsn, zk_address, self.work / f"cluster{count}", a.log_level)
        print(f"\n== {count} node(s) ==", flush=True)
        if self.results["runs"]:
            self.reset_store()
        cluster.start()
        try:
            probes: dict[str, Callable[[], float]] = {
                "dmq nodes": cluster.cpu,
                "PostgreSQL": self.pg_cpu,
                "ZooKeeper": self.zk_cpu,
            }
            # topics of earlier runs come along: the first node seeds an empty registry
            # from PostgreSQL's, so every run uses topic names of its own
            warmup = f"warmup{count}"
            self.register(zk_address, warmup, ["c1"])
            self.wait_topic(cluster, warmup)
            run_workers(self.producers(cluster, warmup, min(4000 * count, a.messages)), {})
            out = {"nodes": count, "publish": self.publish(cluster, probes)}
            if not a.skip_e2e:
                out["e2e"] = self.e2e(cluster, probes)
            return out
        finally:
            cluster.stop()

    def wait_topic(self, cluster: Cluster, topic: str, timeout: float = 30) -> None:
        """Every node serves the topic (its registry watch fired and was mirrored)."""
        deadline = time.monotonic() + timeout
        for node in cluster.nodes:
            while True:
                stats = node.stats() or {}
                if any(t["topic_name"] == topic for t in stats.get("topics", [])):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"topic {topic} did not reach node {node.tcp_port}")
                time.sleep(0.05)

    def producers(self, cluster: Cluster, topic: str, n: int) -> list:
        a = self.args
        out = []
        for i, count in enumerate(split(n, a.producers)):
            node = cluster.nodes[i % len(cluster.nodes)]
            out.append(
                (
                    _dmq_load.producer_main,
                    {
                        "host": "127.0.0.1",
                        "port": node.tcp_port,
                        "topic": topic,
                        "producer": f"bench-cluster-{topic}-p{i}",
                        "n": count,
                        "window": a.window,
                        "body_size": a.body_size,
                        "rate": 0.0,
                        "timeout": a.timeout,
                    },
                )
            )
        return out

    def publish(self, cluster: Cluster, probes: dict) -> dict:
        a = self.args
        topic = f"pub{len(cluster.nodes)}"
        self.register(cluster.zk, topic, ["c1"])
        self.wait_topic(cluster, topic)
        run = run_workers(self.producers(cluster, topic, a.messages), probes, result_timeout=a.timeout + 60)
        prods = list(run["results"].values())
        acked = sum(r["acked"] for r in prods)
        failed = sum(r["failed"] for r in prods)
        elapsed = max(r["t_end"] for r in prods) - run["t0"]
        lat = percentiles(latencies(prods))
        res = {
            "messages": a.messages,
            "acked": acked,
            "failed": failed,
            "elapsed_s": round(elapsed, 3),
            "acked_msgs_s": round(acked / elapsed, 1),
            "publish_ack_latency_ms": lat,
            "cpu_s": run["cpu"],
        }
        print(
            f"publish: {fmt_int(res['acked_msgs_s'])} acked msgs/s ({acked:,} of {a.messages:,}, failed {failed}); "
            f"publish->ack p50/p99/p99.9 {fmt_lat(lat)} ms; CPU {cpu_text(run['cpu'], elapsed)}",
            flush=True,
        )
        return res

    def e2e(self, cluster: Cluster, probes: dict) -> dict:
        a = self.args
        topic = f"e2e{len(cluster.nodes)}"
        self.register(cluster.zk, topic, ["c1"])
        self.wait_topic(cluster, topic)
        n = a.e2e_messages
        producers = self.producers(cluster, topic, n)
        per_node = [0] * len(cluster.nodes)
        for i, (_, cfg) in enumerate(producers):
            per_node[i % len(cluster.nodes)] += cfg["n"]
        consumers = [
            (
                _dmq_load.consumer_main,
                {
                    "host": "127.0.0.1",
                    "port": node.tcp_port,
                    "topic": topic,
                    "channel": "c1",
                    "credit": a.credit,
                    "expected": per_node[i],
                    "timeout": a.timeout,
                    "latency": True,
                },
            )
            for i, node in enumerate(cluster.nodes)
        ]
        run = run_workers(consumers + producers, probes, result_timeout=a.timeout + 60)
        results = [run["results"][i] for i in range(len(run["results"]))]
        cons, prods = results[: len(consumers)], results[len(consumers) :]
        delivered = sum(r["unique"] for r in cons)
        elapsed = max(r["t_last"] for r in cons) - run["t0"]
        lat = percentiles(latencies(cons))
        res = {
            "messages": n,
            "published": sum(r["acked"] for r in prods),
            "delivered_acked": delivered,
            "duplicates": sum(r["duplicates"] for r in cons),
            "elapsed_s": round(elapsed, 3),
            "delivered_msgs_s": round(delivered / elapsed, 1),
            "publish_delivery_latency_ms": lat,
            "cpu_s": run["cpu"],
        }
        print(
            f"e2e: {fmt_int(res['delivered_msgs_s'])} delivered+acked msgs/s ({delivered:,} of {n:,}); "
            f"publish->delivery p50/p99/p99.9 {fmt_lat(lat)} ms; CPU {cpu_text(run['cpu'], elapsed)}",
            flush=True,
        )
        return res

    def run(self) -> None:
        for count in self.args.nodes:
            self.results["runs"].append(self.run_nodes(count))
        self.summary()

    def summary(self) -> None:
        rows = []
        for run in self.results["runs"]:
            pub = run["publish"]
            e2e = run.get("e2e")
            rows.append(
                [
                    str(run["nodes"]),
                    fmt_int(pub["acked_msgs_s"]),
                    fmt_lat(pub["publish_ack_latency_ms"]),
                    fmt_int(e2e["delivered_msgs_s"]) if e2e else "-",
                    fmt_lat(e2e["publish_delivery_latency_ms"]) if e2e else "-",
                    cpu_text(pub["cpu_s"], pub["elapsed_s"]),
                ]
            )
        print_grid(
            f"dmq cluster on one PostgreSQL: {self.args.producers} producers x window {self.args.window}, "
            f"{self.args.body_size}-byte bodies",
            [
                "nodes",
                "publish acked msgs/s",
                "publish->ack p50/p99/p99.9 ms",
                "e2e delivered msgs/s",
                "publish->delivery p50/p99/p99.9 ms",
                "CPU during publish",
            ],
            rows,
        )


def cpu_text(cpu: dict, wall: float) -> str:
    return ", ".join(f"{k} {v:.1f} s ({v / wall * 100:.0f}%)" for k, v in cpu.items() if wall > 0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="1,2,3", help="node counts to run (default 1,2,3)")
    p.add_argument("--messages", type=int, default=100_000, help="messages per publish run")
    p.add_argument("--e2e-messages", type=int, default=60_000, help="messages per end-to-end run")
    p.add_argument("--producers", type=int, default=6, help="producer connections in all (default 6)")
    p.add_argument("--window", type=int, default=256, help="unanswered sends per producer")
    p.add_argument("--body-size", type=int, default=200)
    p.add_argument("--credit", type=int, default=1000, help="consumer credit per node")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="30,000 / 20,000 messages")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--log-level", default="warn")
    args = p.parse_args(argv)
    args.nodes = [int(x) for x in str(args.nodes).split(",") if x.strip()]
    if args.quick:
        args.messages, args.e2e_messages = 30_000, 20_000
    return args


def run_bench(bench: Bench) -> int:
    """Start PostgreSQL and ZooKeeper, run ``bench``, stop them (also on errors), write --json."""
    try:
        bench.start()
        bench.run()
    finally:
        bench.stop()
    if bench.args.json:
        Path(bench.args.json).write_text(json.dumps(bench.results, indent=2, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_bench(Bench(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
