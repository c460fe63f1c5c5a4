#!/usr/bin/env python3
"""dmq's NSQ fast path against nsqd: the same Python load generator, alternating rounds.

    python bench/nsq.py --nsqd /path/to/nsqd                  # 3 rounds, 50,000 messages each
    python bench/nsq.py --nsqd PATH --rounds 5 --json out.json --markdown out.md
    python bench/nsq.py --nsqd PATH --profile /tmp/nsqprof     # then py-spy on dmq-server, one more round

Both servers run at the same time on 127.0.0.1 (dmq-server with a private PostgreSQL
that the fast path does not use; nsqd with its data path in the same temporary
directory). Each round runs every scenario against one server, then the other, and
the next round starts with the other server, so a drift in the machine's load falls on
both. Topics are new in every round and deleted after it (``/topic/delete``, nsqd's
HTTP API, which dmq serves too).

Scenarios (bench/_nsq_load.py, raw sockets; N messages of --body-size bytes):
  pub      P producers, PUB, at most --window unanswered each, to a topic with one channel
           (created first, no consumer): acknowledged (OK) msgs/s
  mpub     the same with MPUB of --mpub-batch messages, as many in flight as cover the window
  consume  one consumer drains the mpub topic's channel: SUB, RDY --rdy, FIN each message
  e2e      the consumer (RDY --rdy, FIN) and the PUB producers at once on a new topic

For each: msgs/s per round, the median, CPU seconds of each server per message (from
/proc), and the ratios dmq/nsqd. ``other processes`` (the machine's busy time outside
the benchmark) is printed per scenario: on a shared machine it explains outliers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _nsq_load  # noqa: E402
from _common import (  # noqa: E402
    StartedServer, fmt_int, fmt_lat, free_port, log_tail, machine_info, percentiles, print_grid, stop_process,
)
from _pg import PrivatePostgres  # noqa: E402
from reliable import DmqServer, Profiler, latencies, print_profile, run_workers, split  # noqa: E402

SCENARIOS = ("pub", "mpub", "consume", "e2e")
TARGET_RATIO = 0.8  # issue 18: the fast path at >= 0.8x nsqd in each scenario


class Nsqd(StartedServer):
    """An nsqd binary on free 127.0.0.1 ports, its data path under ``workdir``."""

    def __init__(self, binary: str, workdir: Path, extra: list[str]):
        self.binary = binary
        self.workdir = workdir / "nsqd"
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.tcp_port = self.http_port = 0
        self.log_path = workdir / "nsqd.log"

    def start(self, timeout: float = 30) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tcp_port, self.http_port = free_port(), free_port()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [self.binary, f"--tcp-address=127.0.0.1:{self.tcp_port}", f"--http-address=127.0.0.1:{self.http_port}",
             f"--data-path={self.workdir}", "--log-level=warn", *self.extra],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nsqd exited with {self.proc.returncode}:\n{log_tail(self.log_path)}")
            if http_ok(self.http_port, "/ping"):
                return
            time.sleep(0.1)
        raise RuntimeError(f"nsqd did not answer /ping within {timeout}s:\n{log_tail(self.log_path)}")

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


def http_ok(port: int, path: str, method: str = "GET") -> bool:
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                     data=b"" if method == "POST" else None)
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def http_post(port: int, path: str) -> None:
    if not http_ok(port, path, "POST"):
        raise RuntimeError(f"POST {path} on 127.0.0.1:{port} failed")


class Side:
    """One server as the scenarios see it: its ports, its CPU probe, its name."""

    def __init__(self, name: str, server: Any):
        self.name = name
        self.server = server

    @property
    def tcp_port(self) -> int:
        return self.server.tcp_port

    @property
    def http_port(self) -> int:
        return self.server.http_port


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="dmq-bench-nsq-"))
        os.chmod(self.work, 0o755)  # PostgreSQL's own user must reach its data directory below
        self.pg: PrivatePostgres | None = None
        self.sides: list[Side] = []
        self.rounds: list[dict] = []

    def start(self) -> None:
        a = self.args
        self.pg = PrivatePostgres(str(self.work / "pg"))
        dsn = self.pg.start()
        from dmq_server.db.schema import migrate

        migrate(dsn)
        dmq = DmqServer(dsn, self.work, a.server_arg or [], "warn", a.server_cmd)
        dmq.start()
        nsqd = Nsqd(a.nsqd, self.work, a.nsqd_arg or [])
        nsqd.start()
        self.sides = [Side("dmq", dmq), Side("nsqd", nsqd)]
        version = subprocess.run([a.nsqd, "--version"], capture_output=True, text=True).stdout.strip()
        print(f"  dmq-server pid {dmq.pid} on 127.0.0.1:{dmq.tcp_port}; {version} pid {nsqd.pid} on "
              f"127.0.0.1:{nsqd.tcp_port}", flush=True)
        self.nsqd_version = version

    def stop(self) -> None:
        for side in self.sides:
            try:
                side.server.stop()
            except Exception as exc:  # noqa: BLE001 - stop the others too
                print(f"  stopping {side.name}: {exc}")
        if self.pg is not None:
            self.pg.stop()
        if self.args.keep_logs:
            print(f"  logs kept in {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    # -- one scenario against one server --------------------------------------
    def producers(self, side: Side, topic: str, batch: int) -> list:
        a = self.args
        return [(_nsq_load.producer_main, {"host": "127.0.0.1", "port": side.tcp_port, "topic": topic, "n": count,
                                           "window": a.window, "batch": batch, "body_size": a.body_size,
                                           "timeout": a.timeout})
                for count in split(a.messages, a.producers)]

    def consumer(self, side: Side, topic: str) -> tuple:
        a = self.args
        return (_nsq_load.consumer_main, {"host": "127.0.0.1", "port": side.tcp_port, "topic": topic,
                                          "channel": "c1", "rdy": a.rdy, "expected": a.messages,
                                          "timeout": a.timeout})

    def measure(self, side: Side, scenario: str, topic: str) -> dict:
        a = self.args
        n = a.messages
        if scenario in ("pub", "mpub"):
            http_post(side.http_port, f"/topic/create?topic={topic}")  # /channel/create wants the topic (nsqd too)
            http_post(side.http_port, f"/channel/create?topic={topic}&channel=c1")
            workers = self.producers(side, topic, 1 if scenario == "pub" else a.mpub_batch)
        elif scenario == "consume":
            workers = [self.consumer(side, topic)]
        else:
            workers = [self.consumer(side, topic)] + self.producers(side, topic, 1)
        run = run_workers(workers, {side.name: side.server.cpu}, result_timeout=a.timeout + 60)
        results = [run["results"][i] for i in range(len(run["results"]))]
        prods = [r for r in results if r["role"] == "producer"]
        cons = [r for r in results if r["role"] == "consumer"]
        if cons:
            done = cons[0]["t_last"]
            count = cons[0]["unique"]
            # consume: the messages waited since the mpub scenario; only e2e's delivery latency means something
            lat = percentiles(latencies(cons) if prods else [])
        else:
            done = max(r["t_end"] for r in prods)
            count = sum(r["acked"] for r in prods)
            lat = percentiles(latencies(prods))
        elapsed = done - run["t0"]
        if count != n:
            raise RuntimeError(f"{scenario} on {side.name}: {count} of {n} messages")
        cpu = run["cpu"]
        return {
            "msgs_s": round(n / elapsed, 1),
            "elapsed_s": round(elapsed, 3),
            "wall_s": round(run["wall"], 3),  # the span of the CPU probes (start to every worker's result)
            "latency_ms": lat,  # pub/mpub: write -> OK per command; consume/e2e: publish -> delivery
            "redelivered": sum(r.get("duplicates", 0) for r in cons),
            "server_us_per_message": round(cpu[side.name] / n * 1e6, 1),
            "cpu_s": cpu,
        }

    def round(self, index: int, order: list[Side]) -> dict:
        out: dict = {"round": index + 1, "order": [s.name for s in order]}
        for side in order:
            for scenario in self.args.scenarios:
                source = "mpub" if scenario == "consume" else scenario
                topic = f"bench_{source}_r{index + 1}_{side.name}"
                res = self.measure(side, scenario, topic)
                out.setdefault(scenario, {})[side.name] = res
                cpu = res["cpu_s"]
                gens = sum(v for k, v in cpu.items() if k in ("producer", "producers", "consumer"))
                print(f"  round {index + 1} {side.name:4s} {scenario:7s} {fmt_int(res['msgs_s']):>8s} msgs/s  "
                      f"{side.name} {res['server_us_per_message']:5.1f} us/msg  load generators "
                      f"{gens / self.args.messages * 1e6:5.1f} us/msg  other processes "
                      f"{100 * cpu.get('other processes', 0) / max(res['wall_s'], 1e-9):4.0f}% of a core  "
                      f"latency p50/p99/p99.9 {fmt_lat(res['latency_ms'])} ms", flush=True)
            for scenario in ("pub", "mpub", "e2e"):
                if scenario in self.args.scenarios:
                    http_post(side.http_port, f"/topic/delete?topic=bench_{scenario}_r{index + 1}_{side.name}")
        return out

    def profile(self) -> dict:
        """One more round on dmq alone under py-spy (not counted: sampling slows the server)."""
        a = self.args
        dmq = self.sides[0]
        profiler = Profiler(Path(a.profile), gil=False, native=a.profile_native)
        out = {}
        saved, a.messages = a.messages, a.profile_messages  # enough samples for the short scenarios
        for scenario in a.scenarios:
            source = "mpub" if scenario == "consume" else scenario
            topic = f"bench_{source}_profile"
            profiler.start(dmq.server.pid, f"nsq-{scenario}")
            try:
                res = self.measure(dmq, scenario, topic)
            finally:
                prof = profiler.stop()
            print(f"  profile round: dmq {scenario}, {a.messages:,} messages, {fmt_int(res['msgs_s'])} msgs/s "
                  "under py-spy "
                  f"({res['server_us_per_message']:.1f} us/msg)")
            print_profile(f"NSQ {scenario}", prof)
            files = self_by_file(prof["file"]) if prof else []
            print("  self time by source file, share of busy samples:")
            for name, pct in files:
                print(f"    {pct:5.1f}%  {name}")
            print(flush=True)
            out[scenario] = {"run": res, "profile": prof, "self_by_file": files}
        a.messages = saved
        return out

    def run(self) -> int:
        a = self.args
        info = machine_info()
        meta = {
            "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": info,
            "python": sys.version.split()[0],
            "settings": {k: v for k, v in vars(a).items() if k not in ("json", "markdown")},
        }
        print(f"dmq NSQ fast path against nsqd  {meta['date_utc']} UTC")
        print(f"  machine: {info['nproc']} cores, {info['cpu_model']}, {info['mem_total_gb']} GB RAM, "
              f"Linux {info['kernel']}, Python {meta['python']}")
        print(f"  {a.rounds} rounds of {', '.join(a.scenarios)}; {a.messages:,} messages of {a.body_size} bytes; "
              f"{a.producers} producers, window {a.window}, MPUB of {a.mpub_batch}, RDY {a.rdy}", flush=True)
        self.results: dict = {"meta": meta}
        try:
            self.start()
            meta["nsqd_version"] = self.nsqd_version
            self.warm_up()
            for i in range(a.rounds):
                order = self.sides if i % 2 == 0 else self.sides[::-1]
                self.rounds.append(self.round(i, order))
            if a.profile:
                self.results["profile"] = self.profile()
        finally:
            self.stop()
        self.results["rounds"] = self.rounds
        self.results["summary"] = summarise(self.rounds, a.scenarios) if self.rounds else []
        if self.rounds:
            print_summary(self.results["summary"], a.messages)
        if a.json:
            Path(a.json).write_text(json.dumps(self.results, indent=2, default=str) + "\n")
            print(f"results written to {a.json}")
        if a.markdown:
            Path(a.markdown).write_text(markdown(self.results))
            print(f"markdown written to {a.markdown}")
        return 0

    def warm_up(self) -> None:
        """A few thousand messages through each server (not measured)."""
        a = self.args
        saved = a.messages
        a.messages = min(5000, saved)
        try:
            for side in self.sides:
                self.measure(side, "e2e", "bench_warmup")
                http_post(side.http_port, "/topic/delete?topic=bench_warmup")
        finally:
            a.messages = saved


def self_by_file(path: str, top: int = 12) -> list[tuple[str, float]]:
    """py-spy's folded stacks summed by the source file of the innermost frame (busy samples only).

    Which module the server's time goes to says more than single frames do when the
    work is spread over many small functions (the NSQ fast path's is).
    """
    from reliable import IDLE_LEAVES, PG_WAIT_LEAF

    counts: dict[str, int] = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        if any(leaf.startswith(w) for w in IDLE_LEAVES) or leaf.startswith(PG_WAIT_LEAF):
            continue
        source = leaf.rpartition("(")[2].rstrip(")").rpartition(":")[0] or leaf
        counts[source] = counts.get(source, 0) + int(count)
    total = max(1, sum(counts.values()))
    return [(name, round(100.0 * c / total, 1)) for name, c in sorted(counts.items(), key=lambda kv: -kv[1])[:top]]


def summarise(rounds: list[dict], scenarios: list[str]) -> list[dict]:
    out = []
    for scenario in scenarios:
        row: dict = {"scenario": scenario}
        for name in ("dmq", "nsqd"):
            runs = [r[scenario][name] for r in rounds if scenario in r]
            row[name] = {
                "msgs_s_median": round(statistics.median(x["msgs_s"] for x in runs), 1),
                "msgs_s_rounds": [x["msgs_s"] for x in runs],
                "us_per_message_median": round(statistics.median(x["server_us_per_message"] for x in runs), 1),
                "latency_p99_ms_median": round(statistics.median(x["latency_ms"]["p99"] or 0 for x in runs), 2),
                "other_processes_pct": round(statistics.mean(
                    100 * x["cpu_s"].get("other processes", 0) / max(x["wall_s"], 1e-9) for x in runs)),
            }
        row["throughput_ratio"] = round(row["dmq"]["msgs_s_median"] / row["nsqd"]["msgs_s_median"], 2)
        nsqd_us = max(row["nsqd"]["us_per_message_median"], 0.1)
        row["cpu_ratio"] = round(row["dmq"]["us_per_message_median"] / nsqd_us, 2)
        row["verdict"] = "MET" if row["throughput_ratio"] >= TARGET_RATIO else "MISSED"
        out.append(row)
    return out


LABELS = {
    "pub": "PUB, window {window}",
    "mpub": "MPUB of {mpub_batch}",
    "consume": "consume, RDY {rdy} + FIN",
    "e2e": "end to end (PUB + RDY {rdy}/FIN at once)",
}


def print_summary(summary: list[dict], messages: int) -> None:
    rows = []
    for row in summary:
        d, q = row["dmq"], row["nsqd"]
        rows.append([row["scenario"], fmt_int(d["msgs_s_median"]), fmt_int(q["msgs_s_median"]),
                     f"{row['throughput_ratio']:.2f}", f"{d['us_per_message_median']:.1f}",
                     f"{q['us_per_message_median']:.1f}", f"{row['cpu_ratio']:.1f}",
                     f"{d['other_processes_pct']} / {q['other_processes_pct']}",
                     f">= {TARGET_RATIO}: {row['verdict']}"])
    print_grid(f"summary: medians over the rounds, {messages:,} messages per scenario",
               ["scenario", "dmq msgs/s", "nsqd msgs/s", "dmq/nsqd", "dmq-server us/msg", "nsqd us/msg",
                "CPU dmq/nsqd", "other processes % (dmq / nsqd runs)", "target"], rows)


def markdown(results: dict) -> str:
    meta = results["meta"]
    m = meta["machine"]
    s = meta["settings"]
    lines = [
        f"Run of {meta['date_utc']} UTC: `{meta['command']}`  ",
        f"Machine: {m['nproc']} cores ({m['cpu_model']}), {m['mem_total_gb']} GB RAM, Linux {m['kernel']}, "
        f"Python {meta['python']}; {meta.get('nsqd_version', 'nsqd ?')}; {s['rounds']} rounds of "
        f"{s['messages']:,} messages ({s['body_size']} bytes), {s['producers']} producers.",
        "",
        "| scenario | dmq msgs/s (median; rounds) | nsqd msgs/s (median; rounds) | dmq/nsqd | dmq-server µs/msg | "
        "nsqd µs/msg | CPU dmq/nsqd | other processes, % of a core (dmq / nsqd runs) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["summary"]:
        d, q = row["dmq"], row["nsqd"]
        label = LABELS[row["scenario"]].format(**s)
        lines.append(
            f"| {label} | {d['msgs_s_median']:,.0f} ({', '.join(f'{x:,.0f}' for x in d['msgs_s_rounds'])}) | "
            f"{q['msgs_s_median']:,.0f} ({', '.join(f'{x:,.0f}' for x in q['msgs_s_rounds'])}) | "
            f"{row['throughput_ratio']:.2f} | {d['us_per_message_median']:.1f} | {q['us_per_message_median']:.1f} | "
            f"{row['cpu_ratio']:.1f} | {d['other_processes_pct']} / {q['other_processes_pct']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="dmq's NSQ fast path against nsqd, the same load generator, "
                                            "alternating rounds.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nsqd", required=True, metavar="PATH", help="the nsqd binary (bench/build_nsqd.sh builds one)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every scenario on both servers "
                                                           "(0 with --profile: the profiled round alone)")
    p.add_argument("--messages", type=int, default=50_000, help="messages per scenario")
    p.add_argument("--producers", type=int, default=4, help="producer processes, one connection each")
    p.add_argument("--window", type=int, default=256, help="unanswered messages per producer")
    p.add_argument("--mpub-batch", type=int, default=100, help="messages per MPUB")
    p.add_argument("--rdy", type=int, default=256, help="the consumer's RDY count")
    p.add_argument("--body-size", type=int, default=200, help="message body bytes")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="comma-separated subset of: " + ", ".join(SCENARIOS))
    p.add_argument("--timeout", type=float, default=300, help="seconds a scenario may take")
    p.add_argument("--server-cmd", default="", metavar="CMD", help="start dmq through this command (see reliable.py)")
    p.add_argument("--server-arg", action="append", metavar="ARG", help="extra dmq-server argument (repeatable)")
    p.add_argument("--nsqd-arg", action="append", metavar="ARG", help="extra nsqd argument (repeatable)")
    p.add_argument("--profile", metavar="DIR", help="after the rounds, one more dmq round under py-spy; folded "
                                                     "stacks to DIR, top frames printed")
    p.add_argument("--profile-messages", type=int, default=200_000, help="messages per scenario of the profiled "
                                                                          "round")
    p.add_argument("--profile-native", action="store_true", help="with --profile: include native (C) frames")
    p.add_argument("--json", metavar="PATH", help="also write all results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the summary as a markdown table")
    p.add_argument("--keep-logs", action="store_true", help="keep the temporary directory with the logs")
    a = p.parse_args(argv)
    a.scenarios = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    unknown = [s for s in a.scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    if "consume" in a.scenarios and "mpub" not in a.scenarios:
        p.error("consume drains the mpub scenario's topic: keep mpub in --scenarios")
    if not os.access(a.nsqd, os.X_OK):
        p.error(f"--nsqd {a.nsqd}: not an executable file (bench/build_nsqd.sh builds one)")
    if a.body_size < 8:
        p.error("--body-size must be at least 8 (the body carries the send time)")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        return Bench(args).run()
    except KeyboardInterrupt:
        print("\ninterrupted; everything started has been stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
