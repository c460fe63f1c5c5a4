#!/usr/bin/env python3
"""An ordered topic across two dmq nodes (issue 45, nodes plan): what one orderer costs.

    python bench/ordered_nodes.py                      # 2 pairs, then the idle poll (about 4 minutes)
    python bench/ordered_nodes.py --pairs 3 --drain    # stored first, then drained
    python bench/ordered_nodes.py --idle-seconds 0     # the pairs only
    python bench/ordered_nodes.py --send-to other --idle-seconds 0   # every send to the non-orderer
    python bench/ordered_nodes.py --pg-stat --idle-seconds 0         # and PostgreSQL's busiest statements a run

Two ``dmq-server --zk`` nodes on one private PostgreSQL and one ZooKeeper (bench/cluster.py's).
Each pair is an ordered topic's run, then the same on an unordered topic, on fresh topics of
one channel: ``--producers`` keyed producers (``--keys`` keys, each producer its own turn
round them, as in reliable.py's ordered scenario) spread over both nodes, ``--consumers``
consumers of the channel spread over both nodes, all running together (``--drain``: the
producers first, then the consumers). On the unordered topic each node delivers the copies
it stored; on the ordered one a single node, the orderer (``/dmq/orderer/<topic>``), delivers
every copy: those stored on the other node it reads every ``--ordered-poll``. Figures:
delivered+acked msgs/s, CPU a message of each node process and of PostgreSQL (its backends
and background), pushes per node (the consumers' count, and the channel's ``delivery_count``
in each node's /stats), publish->delivery p50/p99 of the copies sent to each node (the
producers tag each body with their node) and their publish->ack, and each node's channel
(/stats depth, in flight, parked, backlog pending) every 0.2 s. ``--send-to other`` (or
``orderer``) sends everything to the node that does not order the pair's ordered topic (or to
the one that does): what the loads of the other node's copies cost, or of the orderer's own.

Then the idle cost of the orderer's poll: the nodes restarted with ``--ordered-poll`` at
the run's value and at ``--idle-poll`` (1 s) in turn, ``--idle-pairs`` times, each with
a fresh ordered topic whose channel has consumers on both nodes and nothing to deliver:
CPU of each node and of PostgreSQL a second over ``--idle-seconds``.
"""

from __future__ import annotations

import argparse
import sys
import time
from array import array
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _dmq_load  # noqa: E402
from _common import fmt_int, machine_info, percentiles, print_grid  # noqa: E402
from cluster import Bench, Cluster, run_bench  # noqa: E402
from reliable import CTX, Sampler, cpu_line, run_workers, split, statement_rows  # noqa: E402
from reliable import Bench as ReliableBench  # noqa: E402

#: a channel's /stats fields the sampler follows on each node during a run
SAMPLED = ("depth", "in_flight_count", "parked_count", "backlog_pending")


def by_tag(results: list[dict]) -> dict[int, array]:
    """The consumers' latencies (seconds) by the tag of the copy's body (the node it was sent to)."""
    out: dict[int, array] = {}
    for r in results:
        lat, tags = array("d"), array("B")
        lat.frombytes(r["lat"])
        tags.frombytes(r["lat_tags"])
        for value, tag in zip(lat, tags):
            out.setdefault(tag, array("d")).append(value)
    return out


def ack_latencies(producers: list[dict], sent_to: list[int], nodes: int) -> list[array]:
    """The producers' publish->ack latencies (seconds) by node: producer i sent to node sent_to[i]."""
    out = [array("d") for _ in range(nodes)]
    for node, r in zip(sent_to, producers):
        out[node].frombytes(r["lat"])
    return out


def send_targets(send_to: str, orderer: int, nodes: int) -> list[int]:
    """The nodes the producers take in turn: ``both`` (every node), ``orderer`` or ``other``
    (the node that orders the pair's ordered topic, or the one that does not; the unordered
    run of a pair sends to the same node)."""
    if send_to == "both":
        return list(range(nodes))
    return [orderer] if send_to == "orderer" else [i for i in range(nodes) if i != orderer]


def channel_stats(stats: dict | None, topic: str, channel: str) -> dict:
    for t in (stats or {}).get("topics", []):
        if t["topic_name"] == topic:
            for c in t["channels"]:
                if c["channel_name"] == channel:
                    return c
    return {}


def orderer_of(views: list[str | None], node_ids: list[str]) -> int | None:
    """The index of the node that delivers an ordered channel, once every node agrees: its own
    ``delivered_by`` is None and every other node's names it (a node that has not served the
    channel yet says "?"); None until then."""
    for i, view in enumerate(views):
        if view is None and all(v == node_ids[i] for j, v in enumerate(views) if j != i):
            return i
    return None


def per_message_us(cpu: dict[str, float], names: list[str], messages: int) -> dict[str, float]:
    return {name: round(cpu[name] / messages * 1e6, 1) for name in names if name in cpu and messages}


class ChannelSampler(Sampler):
    """Each node's channel (``SAMPLED`` of its /stats) every ``every`` s during a run: where
    the copies wait on the way (stored and not loaded shows in ``backlog_pending``, loaded and
    not pushed in ``depth``, pushed and not acked in ``in_flight_count``)."""

    def __init__(self, nodes: list, topic: str, channel: str, every: float = 0.2):
        super().__init__(every)
        self.nodes, self.topic, self.channel = nodes, topic, channel
        self.samples: list[list[dict]] = [[] for _ in nodes]

    def _sample(self) -> None:
        for i, node in enumerate(self.nodes):
            stats = channel_stats(node.stats(), self.topic, self.channel)
            self.samples[i].append({k: stats.get(k) for k in SAMPLED})

    def summary(self) -> list[dict[str, object]]:
        """Per node: each field's mean and max (a flag: the share of samples it was set)."""
        self.halt()
        return [sample_summary(samples) for samples in self.samples]


def sample_summary(samples: list[dict]) -> dict[str, object]:
    out: dict[str, object] = {"samples": len(samples)}
    for field in SAMPLED:
        values = [float(s[field]) for s in samples if isinstance(s.get(field), (int, float, bool))]
        if values:
            out[field] = {"mean": round(sum(values) / len(values), 2), "max": max(values)}
    return out


class OrderedNodes(Bench):
    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.results = {"machine": machine_info(), "args": vars(args), "pairs": [], "idle": []}
        self.clusters = 0
        self.last_orderer = 0  # the node that ordered the pair's ordered topic (--send-to)

    # reliable.py's reading of pg_stat_statements (--pg-stat), on this bench's PostgreSQL
    pg_statements = ReliableBench.pg_statements

    def connect(self):
        from dmq_server.db.worker import connect

        return connect(self.pg.dsn, autocommit=True)

    # -- the nodes -------------------------------------------------------------------------
    def cluster(self, poll: str) -> Cluster:
        """Two fresh nodes (a ZooKeeper chroot of their own) with ``--ordered-poll poll``."""
        self.clusters += 1
        name = f"o{self.clusters}"
        cluster = Cluster(2, self.pg.dsn, f"{self.zk.address}/{name}", self.work / name, self.args.log_level,
                          extra=["--ordered-poll", poll], name=name)
        cluster.start()
        return cluster

    def probes(self, cluster: Cluster) -> dict[str, Callable[[], float]]:
        return {"node1": cluster.nodes[0].cpu, "node2": cluster.nodes[1].cpu, "PostgreSQL": self.pg_cpu}

    def topic(self, cluster: Cluster, topic: str, ordered: bool) -> str | None:
        """Register ``topic`` (channel c1) and wait until both nodes serve it; ordered: until
        one node delivers it and the other names that node. The orderer's index, or None."""
        self.register(cluster.zk, topic, ["c1"], ordered=ordered)
        self.wait_topic(cluster, topic)
        if not ordered:
            return None
        deadline = time.monotonic() + 30
        while True:
            views = [channel_stats(node.stats(), topic, "c1").get("delivered_by", "?") for node in cluster.nodes]
            orderer = orderer_of(views, cluster.node_ids)
            if orderer is not None:
                return orderer
            if time.monotonic() > deadline:
                raise RuntimeError(f"no orderer for {topic} within 30 s: {views}")
            time.sleep(0.1)

    # -- one keyed run ---------------------------------------------------------------------
    def keyed(self, cluster: Cluster, topic: str, ordered: bool) -> dict:
        a = self.args
        orderer = self.topic(cluster, topic, ordered)
        if orderer is not None:
            self.last_orderer = orderer
        nodes = cluster.nodes
        targets = send_targets(a.send_to, self.last_orderer, len(nodes))
        sent_to = [targets[i % len(targets)] for i in range(a.producers)]
        n = a.messages
        producers = []
        for i, count in enumerate(split(n, a.producers)):
            node = sent_to[i]
            producers.append((_dmq_load.producer_main, {
                "host": "127.0.0.1", "port": nodes[node].tcp_port, "topic": topic,
                "producer": f"bench-{topic}-p{i}", "n": count, "window": a.window, "body_size": a.body_size,
                "rate": 0.0, "timeout": a.timeout, "keys": a.keys, "key_offset": i, "key_stride": a.producers,
                "tag": node + 1,
            }))
        shared = CTX.Value("q", 0)
        consumers = [(_dmq_load.consumer_main, {
            "host": "127.0.0.1", "port": nodes[i % len(nodes)].tcp_port, "topic": topic, "channel": "c1",
            "credit": a.credit, "shared": shared, "expected": n, "timeout": a.timeout,
            "latency": True, "latency_tags": True,
        }) for i in range(a.consumers)]
        probes = self.probes(cluster)
        before = [channel_stats(node.stats(), topic, "c1") for node in nodes]
        sampler = ChannelSampler(nodes, topic, "c1")
        if a.pg_stat:
            self.pg_statements(reset=True)
        if a.drain:
            stored = run_workers(producers, {}, result_timeout=a.timeout + 60)
            prods = [stored["results"][i] for i in range(len(producers))]
            sampler.start()
            run = run_workers(consumers, probes, result_timeout=a.timeout + 60)
            cons = [run["results"][i] for i in range(len(consumers))]
        else:
            sampler.start()
            run = run_workers(consumers + producers, probes, result_timeout=a.timeout + 60)
            results = [run["results"][i] for i in range(len(run["results"]))]
            cons, prods = results[: len(consumers)], results[len(consumers):]
        sampled = sampler.summary()
        statements = self.pg_statements() if a.pg_stat else None
        after = [channel_stats(node.stats(), topic, "c1") for node in nodes]
        delivered = sum(r["unique"] for r in cons)
        last = max((r["t_last"] for r in cons if r["t_last"]), default=run["t0"])
        elapsed = max(0.001, last - run["t0"])
        pushes = [sum(r["received"] for j, r in enumerate(cons) if j % len(nodes) == i) for i in range(len(nodes))]
        lat = by_tag(cons)
        res: dict[str, Any] = {
            "topic": topic,
            "ordered": ordered,
            "orderer": None if orderer is None else f"node{orderer + 1}",
            "published": sum(r["acked"] for r in prods),
            "stored_per_node": [sum(r["acked"] for j, r in enumerate(prods) if sent_to[j] == i)
                                for i in range(len(nodes))],
            "delivered_acked": delivered,
            "duplicates": sum(r["duplicates"] for r in cons),
            "elapsed_s": round(elapsed, 3),
            "wall_s": round(run["wall"], 3),
            "msgs_s": round(delivered / elapsed, 1),
            "pushes_per_node": pushes,
            "delivery_count_per_node": [after[i].get("delivery_count", 0) - before[i].get("delivery_count", 0)
                                        for i in range(len(nodes))],
            "cpu_s": run["cpu"],
            "cpu_us_per_message": per_message_us(run["cpu"], list(probes), delivered),
            "channel_sampled": sampled,
            "pg_statements": statements,
            "latency_ms_by_node": {f"node{tag}": percentiles(values, (50, 99)) for tag, values in sorted(lat.items())},
            "publish_ack_ms_by_node": {f"node{i + 1}": percentiles(acks, (50, 99)) for i, acks in
                                       enumerate(ack_latencies(prods, sent_to, len(nodes)))},
        }
        lat_text = "; ".join(f"sent to {name}: p50 {p['p50']} / p99 {p['p99']} ms ({p['count']:,})"
                             for name, p in res["latency_ms_by_node"].items())
        print(f"{'ORDERED' if ordered else 'unordered'} {topic}: {fmt_int(res['msgs_s'])} delivered+acked msgs/s "
              f"({delivered:,} of {n:,} in {elapsed:.1f} s, {res['duplicates']} redelivered)", flush=True)
        print(f"  orderer {res['orderer'] or '-'}; stored per node {res['stored_per_node']}; pushes per node "
              f"{pushes} (/stats delivery_count {res['delivery_count_per_node']})", flush=True)
        print(f"  publish->delivery {lat_text}", flush=True)
        print("  publish->ack " + "; ".join(f"sent to {name}: p50 {p['p50']} / p99 {p['p99']} ms"
                                         for name, p in res["publish_ack_ms_by_node"].items()), flush=True)
        for i, summary in enumerate(sampled):
            print(f"  node{i + 1}'s channel every 0.2 s ({summary['samples']} samples), mean / max: "
                  + ", ".join(f"{k} {v['mean']} / {v['max']:g}" for k, v in summary.items() if isinstance(v, dict)),
                  flush=True)
        for name, text in statement_rows(statements):
            print(f"  {name}: {text}", flush=True)
        print(f"  CPU {cpu_line(run['cpu'], run['wall'])}; a message: "
              + ", ".join(f"{k} {v} us" for k, v in res["cpu_us_per_message"].items()), flush=True)
        return res

    # -- idle ------------------------------------------------------------------------------
    def idle(self, poll: str, index: int) -> dict:
        a = self.args
        self.reset_store()
        cluster = self.cluster(poll)
        try:
            topic = f"idle{index}"
            orderer = self.topic(cluster, topic, True)
            consumers = [(_dmq_load.consumer_main, {
                "host": "127.0.0.1", "port": cluster.nodes[i % 2].tcp_port, "topic": topic, "channel": "c1",
                "credit": a.credit, "expected": 0, "timeout": a.idle_seconds + 30, "latency": False,
                "phases": [(a.idle_seconds, True)],
            }) for i in range(a.consumers)]
            run = run_workers(consumers, self.probes(cluster), result_timeout=a.idle_seconds + 90)
            owners = self.owners()
        finally:
            cluster.stop()
        per_s = {k: round(v / run["wall"] * 1000, 1) for k, v in run["cpu"].items()}  # ms of CPU a second
        res = {"ordered_poll": poll, "orderer": f"node{orderer + 1}", "wall_s": round(run["wall"], 2),
               "cpu_s": run["cpu"], "cpu_ms_per_s": per_s, "dmq_owner_rows": owners}
        print(f"idle, --ordered-poll {poll}, orderer node{orderer + 1}, {owners} dmq_owner rows: "
              f"{cpu_line(run['cpu'], run['wall'])}", flush=True)
        return res

    def owners(self) -> int:
        import psycopg

        with psycopg.connect(self.pg.dsn, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM dmq_owner").fetchone()[0]

    # -- the whole run ---------------------------------------------------------------------
    def run(self) -> None:
        a = self.args
        cluster = self.cluster(a.ordered_poll)
        try:
            self.register(cluster.zk, "warmup", ["c1"])
            self.wait_topic(cluster, "warmup")
            run_workers(self.producers(cluster, "warmup", 4000), {})
            for i in range(1, a.pairs + 1):
                pair = {}
                for ordered in (True, False):
                    name = f"{'ordered' if ordered else 'unordered'}{i}"
                    pair["ordered" if ordered else "unordered"] = self.keyed(cluster, name, ordered)
                self.results["pairs"].append(pair)
        finally:
            cluster.stop()
        if a.idle_seconds > 0:
            for i in range(a.idle_pairs):
                for poll in (a.ordered_poll, a.idle_poll):
                    self.results["idle"].append(self.idle(poll, len(self.results["idle"]) + 1))
        self.summary()

    def summary(self) -> None:
        rows = []
        for i, pair in enumerate(self.results["pairs"], 1):
            for kind in ("ordered", "unordered"):
                r = pair[kind]
                us = r["cpu_us_per_message"]
                lat = r["latency_ms_by_node"]
                rows.append([
                    f"{i} {kind}", fmt_int(r["msgs_s"]),
                    " / ".join(f"{us.get(k, 0):.1f}" for k in ("node1", "node2", "PostgreSQL")),
                    " / ".join(f"{p:,}" for p in r["pushes_per_node"]),
                    " ; ".join(f"{lat[k]['p50']} / {lat[k]['p99']}" for k in sorted(lat)),
                    f"{r['orderer'] or '-'}",
                    f"{100 * r['cpu_s'].get('other processes', 0) / r['wall_s']:.0f}%",
                ])
        print_grid(
            f"2 nodes, {self.args.keys:,} keys, {self.args.producers} producers x window {self.args.window}, "
            f"{self.args.consumers} consumers, {self.args.messages:,} messages, sent to {self.args.send_to}"
            f"{', stored first then drained' if self.args.drain else ''}",
            ["pair", "msgs/s", "us a message node1 / node2 / PostgreSQL", "pushes node1 / node2",
             "p50 / p99 ms, sent to node1 ; node2", "orderer", "other processes"],
            rows,
        )
        if self.results["idle"]:
            print_grid(
                f"idle: an ordered topic, {self.args.consumers} consumers, nothing to deliver, {self.args.idle_seconds:g} s",
                ["--ordered-poll", "orderer", "node1 / node2 / PostgreSQL ms CPU a second", "other processes",
                 "dmq_owner rows"],
                [[r["ordered_poll"], r["orderer"],
                  " / ".join(f"{r['cpu_ms_per_s'].get(k, 0):.1f}" for k in ("node1", "node2", "PostgreSQL")),
                  f"{r['cpu_ms_per_s'].get('other processes', 0) / 10:.0f}%", str(r["dmq_owner_rows"])]
                 for r in self.results["idle"]],
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=2, help="ordered/unordered pairs, alternated (default 2)")
    p.add_argument("--messages", type=int, default=40_000, help="messages a run")
    p.add_argument("--keys", type=int, default=10_000)
    p.add_argument("--producers", type=int, default=4, help="keyed producers, round robin over the nodes")
    p.add_argument("--consumers", type=int, default=8, help="consumers of the channel, round robin over the nodes")
    p.add_argument("--window", type=int, default=256, help="unanswered sends per producer")
    p.add_argument("--body-size", type=int, default=200)
    p.add_argument("--credit", type=int, default=1000)
    p.add_argument("--send-to", choices=("both", "orderer", "other"), default="both",
                   help="the producers' nodes: both in turn, or only the orderer (other: only the node that is not)")
    p.add_argument("--drain", action="store_true", help="store every message first, then start the consumers")
    p.add_argument("--ordered-poll", default="50ms", help="the nodes' --ordered-poll (default 50ms, the server's)")
    p.add_argument("--idle-poll", default="1s", help="the idle runs' other --ordered-poll")
    p.add_argument("--idle-seconds", type=float, default=30.0, help="each idle run's length; 0: none")
    p.add_argument("--idle-pairs", type=int, default=2)
    p.add_argument("--pg-stat", action="store_true",
                   help="load pg_stat_statements and print each run's busiest statements (calls, rows, time)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--log-level", default="warn")
    args = p.parse_args(argv)
    args.pg_settings = {"shared_preload_libraries": "pg_stat_statements"} if args.pg_stat else None
    return args


def main(argv: list[str] | None = None) -> int:
    return run_bench(OrderedNodes(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
