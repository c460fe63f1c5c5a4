#!/usr/bin/env python3
"""What TLS costs: the reliable path and NSQ PUB, plaintext and TLS, in the same run.

    python bench/tls.py                  # full counts (a few minutes)
    python bench/tls.py --quick          # smaller counts
    python bench/tls.py --json out.json

One private PostgreSQL and one ``dmq-server`` with a trustme certificate, its plaintext
TCP port and its TLS port (``--tls-address``). Each scenario runs its plaintext and TLS
variants alternately (``--rounds`` times each, after one short warm-up round of each,
so drift of the machine hits both), and
prints, per variant, the median round: acknowledged msgs/s, publish->ack latency p50 and
p99, and CPU microseconds per message of dmq-server, PostgreSQL and the load generators.

  reliable  dmq protocol: P producers, W unanswered sends each, N messages to a reliable
            topic (stored in PostgreSQL before SEND_SUCCESS_ACK); TLS on the TLS port
  nsq       NSQ V2: P producers pipelining PUB (W unanswered each) to a fast topic; TLS by
            NSQ's in-band upgrade (IDENTIFY tls_v1)

The target (issue 16): TLS costs at most 25 % of plaintext throughput on the reliable path.
docs/benchmarks.md records results with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import ssl
import struct
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _dmq_load  # noqa: E402
from _common import free_port, machine_info, percentiles, run_worker, tree_cpu_seconds  # noqa: E402
from _pg import PrivatePostgres  # noqa: E402
from reliable import DmqServer, run_workers, split  # noqa: E402


# ----------------------------------------------------------------- the NSQ load generator
def nsq_producer_main(cfg: dict, index: int, ready_q: Any, start_evt: Any, result_q: Any) -> None:
    run_worker("nsq-producer", _nsq_producer, cfg, index, ready_q, start_evt, result_q)


def _nsq_frame_sizes(buf: bytearray) -> tuple[int, int, list[int]]:
    """(bytes used, OK count, error frame types) of the whole frames at the start of buf."""
    pos, oks, errors = 0, 0, []
    while len(buf) - pos >= 8:
        size, kind = struct.unpack_from(">ii", buf, pos)
        if len(buf) - pos < 4 + size:
            break
        if kind == 0 and buf[pos + 8 : pos + 4 + size] == b"OK":
            oks += 1
        elif kind == 1:
            errors.append(bytes(buf[pos + 8 : pos + 4 + size]))
        pos += 4 + size
    return pos, oks, errors


def _nsq_producer(cfg: dict, index: int, ready_q: Any, start_evt: Any, result: dict) -> None:
    sock = socket.create_connection((cfg["host"], cfg["port"]), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = json.dumps({"feature_negotiation": True, "tls_v1": bool(cfg.get("tls_ca"))}).encode()
    sock.sendall(b"  V2IDENTIFY\n" + struct.pack(">i", len(body)) + body)
    buf = bytearray()
    while True:  # the IDENTIFY answer
        buf += sock.recv(65536)
        if len(buf) >= 4 and len(buf) >= 4 + struct.unpack_from(">i", buf)[0]:
            break
    if cfg.get("tls_ca"):
        sock = ssl.create_default_context(cafile=cfg["tls_ca"]).wrap_socket(sock, server_hostname=cfg["host"])
        ok = b""
        while len(ok) < 10:
            ok += sock.recv(10 - len(ok))
    n, window = cfg["n"], cfg["window"]
    payload = b"x" * cfg["body_size"]
    command = f"PUB {cfg['topic']}\n".encode() + struct.pack(">i", len(payload)) + payload
    ready_q.put(("ready", index, None))
    if not start_evt.wait(120):
        raise RuntimeError("start signal never came")
    sock.settimeout(None)
    perf = time.perf_counter
    sent_at = array("d", bytes(8 * n))
    lat = array("d")
    sent = acked = 0
    errors: list[bytes] = []
    buf = bytearray()
    t_start = time.time()
    deadline = perf() + cfg["timeout"]
    while acked + len(errors) < n:
        if perf() > deadline:
            raise TimeoutError(f"only {acked} of {n} PUBs answered")
        k = min(n - sent, window - (sent - acked - len(errors)))
        if k > 0:
            now = perf()
            for seq in range(sent, sent + k):
                sent_at[seq] = now
            sock.sendall(command * k)
            sent += k
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            pass
        else:
            select.select([sock], [], [], 1.0)
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionError("closed by the server")
        now = perf()
        buf += data
        used, oks, errs = _nsq_frame_sizes(buf)
        for seq in range(acked + len(errors), acked + len(errors) + oks):
            lat.append(now - sent_at[seq])
        acked += oks
        errors += errs
        del buf[:used]
    result.update(sent=sent, acked=acked, failed=len(errors), first_error=errors[0].decode() if errors else None,
                  t_start=t_start, t_end=time.time(), lat=lat.tobytes())
    sock.close()


# ----------------------------------------------------------------- the runs
class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.workdir = workdir
        import trustme

        ca = trustme.CA()
        issued = ca.issue_cert("127.0.0.1")
        self.ca_file = workdir / "ca.pem"
        ca.cert_pem.write_to_path(str(self.ca_file))
        cert, key = workdir / "server.pem", workdir / "server.key"
        cert.write_bytes(b"".join(b.bytes() for b in issued.cert_chain_pems))
        issued.private_key_pem.write_to_path(str(key))
        self.tls_port = free_port()
        self.pg = PrivatePostgres()
        self.server: DmqServer | None = None
        self.server_args = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-address", f"127.0.0.1:{self.tls_port}",
                            "--admin-address", ""]

    def start(self) -> None:
        self.pg.start()
        self.server = DmqServer(self.pg.dsn, self.workdir, self.server_args, log_level="warn")
        self.server.start()
        from dmq_server.db.worker import connect
        import registry

        with connect(self.pg.dsn, autocommit=True) as conn:
            registry.create_topic(conn, "bench", msg_timeout_ms=60000)
            registry.add_channel(conn, "bench", "c1")
        time.sleep(2.5)  # the server re-reads the registry every 2 s (--registry-refresh)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.pg.stop()

    def probes(self) -> dict:
        pid = self.pg.postmaster_pid()
        return {"dmq-server": self.server.cpu, "PostgreSQL": lambda: tree_cpu_seconds(pid) if pid else 0.0}

    def round(self, scenario: str, tls: bool) -> dict:
        a = self.args
        worker = _dmq_load.producer_main if scenario == "reliable" else nsq_producer_main
        port = self.tls_port if tls and scenario == "reliable" else self.server.tcp_port
        topic = "bench" if scenario == "reliable" else "bench_nsq"
        cfgs = [
            (worker, {"host": "127.0.0.1", "port": port, "topic": topic, "producer": f"tls-{os.getpid()}-{i}-{time.time_ns()}",
                      "n": count, "window": a.window, "body_size": a.body_size, "rate": 0.0, "timeout": a.timeout,
                      "tls_ca": str(self.ca_file) if tls else None})
            for i, count in enumerate(split(a.messages, a.producers))
        ]
        run = run_workers(cfgs, self.probes(), result_timeout=a.timeout + 60)
        results = list(run["results"].values())
        errors = [r["error"] for r in results if r.get("error")]
        if errors:
            raise RuntimeError(f"{scenario} {'tls' if tls else 'plain'}: {errors[0]}")
        acked = sum(r["acked"] for r in results)
        elapsed = max(r["t_end"] for r in results) - run["t0"]
        lat = array("d")
        for r in results:
            lat.frombytes(r["lat"])
        client_cpu = sum(r.get("cpu_s", 0.0) for r in results)
        return {
            "acked": acked,
            "failed": sum(r["failed"] for r in results),
            "msgs_s": round(acked / elapsed, 1),
            "latency_ms": percentiles(lat),
            "us_per_msg": {
                "dmq-server": round(run["cpu"]["dmq-server"] / acked * 1e6, 1),
                "PostgreSQL": round(run["cpu"]["PostgreSQL"] / acked * 1e6, 1),
                "generators": round(client_cpu / acked * 1e6, 1),
            },
        }


def median_round(rounds: list[dict]) -> dict:
    by_rate = sorted(rounds, key=lambda r: r["msgs_s"])
    out = dict(by_rate[len(by_rate) // 2])
    out["all_msgs_s"] = [r["msgs_s"] for r in rounds]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller counts")
    parser.add_argument("--scenarios", default="reliable,nsq")
    parser.add_argument("--messages", type=int, default=None)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--body-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    defaults = {"reliable": 20_000 if args.quick else 100_000, "nsq": 50_000 if args.quick else 300_000}
    workdir = Path(tempfile.mkdtemp(prefix="dmq-bench-tls-"))
    workdir.chmod(0o755)
    bench = Bench(args, workdir)
    out: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "scenarios": {}}
    try:
        bench.start()
        for scenario in args.scenarios.split(","):
            args.messages_now = args.messages or defaults[scenario]
            rounds: dict[str, list[dict]] = {"plain": [], "tls": []}
            saved, args.messages = args.messages, max(1000, args.messages_now // 5)
            for mode in (False, True):  # warm-up, not counted (a fresh PostgreSQL, first connections)
                bench.round(scenario, mode)
            args.messages = args.messages_now
            for i in range(args.rounds):
                for mode in (("plain", "tls") if i % 2 == 0 else ("tls", "plain")):
                    r = bench.round(scenario, mode == "tls")
                    rounds[mode].append(r)
                    print(f"  {scenario:8} {mode:5} round {i + 1}: {r['msgs_s']:>10,.0f} msgs/s  "
                          f"p99 {r['latency_ms']['p99']} ms  server {r['us_per_msg']['dmq-server']} us/msg", flush=True)
            args.messages = saved
            summary = {mode: median_round(rs) for mode, rs in rounds.items()}
            plain, tls = summary["plain"]["msgs_s"], summary["tls"]["msgs_s"]
            summary["tls_cost_pct"] = round(100 * (1 - tls / plain), 1)
            out["scenarios"][scenario] = summary
        print()
        print(f"{'scenario':10} {'mode':6} {'msgs/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'server us/msg':>14} "
              f"{'PG us/msg':>10} {'clients us/msg':>15}")
        for scenario, summary in out["scenarios"].items():
            for mode in ("plain", "tls"):
                r = summary[mode]
                us = r["us_per_msg"]
                print(f"{scenario:10} {mode:6} {r['msgs_s']:>10,.0f} {r['latency_ms']['p50']:>8} {r['latency_ms']['p99']:>8} "
                      f"{us['dmq-server']:>14} {us['PostgreSQL']:>10} {us['generators']:>15}")
            print(f"{scenario:10} TLS costs {summary['tls_cost_pct']} % of plaintext throughput "
                  f"(rounds: plain {summary['plain']['all_msgs_s']}, tls {summary['tls']['all_msgs_s']})")
        reliable = out["scenarios"].get("reliable")
        if reliable is not None:
            ok = reliable["tls_cost_pct"] <= 25.0
            print(f"\ntarget: TLS costs <= 25 % on the reliable path: {'met' if ok else 'NOT met'} "
                  f"({reliable['tls_cost_pct']} %)")
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    finally:
        bench.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
