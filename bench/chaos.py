#!/usr/bin/env python3
"""Long runs of the chaos suite: every fault under mixed load, counted, with recovery times.

    python bench/chaos.py                              # every scenario, 20 s before, 15 s fault, 20 s after
    python bench/chaos.py --scenarios pg-primary-kill,node-kill --hold 30
    python bench/chaos.py --before 30 --hold 20 --after 30 --rate 200 --json out.json

One cluster for the run (ZooKeeper, a Patroni cluster of three in synchronous strict
mode, three dmq nodes, fault proxies on every link: tests/chaos/cluster.py), the
scenarios of tests/chaos/scenarios.py one after another, the cluster restored between
them. For each: sends attempted and acknowledged, per channel lost / duplicated /
unexpected / redelivered, the longest time a producer went unacknowledged (outage),
when service came back after the fault and after its heal, acknowledged sends per
second before, during and after, and CPU seconds of every process per message. The
exit status is 1 if any scenario lost, duplicated or made up a message.
docs/benchmarks.md records results with the command that produced them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from _common import machine_info, tree_cpu_seconds  # noqa: E402
from tests.chaos import scenarios  # noqa: E402
from tests.chaos.cluster import ChaosCluster, available  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(scenarios.SCENARIOS),
                        help="comma-separated, of: " + ", ".join(scenarios.SCENARIOS))
    parser.add_argument("--before", type=float, default=20.0, help="seconds of load before the fault")
    parser.add_argument("--hold", type=float, default=15.0, help="seconds the fault lasts")
    parser.add_argument("--after", type=float, default=20.0, help="seconds of load once service is back")
    parser.add_argument("--rate", type=float, default=120.0, help="sends per second per producer (3 producers)")
    parser.add_argument("--json", help="write the reports here")
    args = parser.parse_args()
    names = [n for n in args.scenarios.split(",") if n]
    unknown = [n for n in names if n not in scenarios.SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios: {unknown}")
    missing = available()
    if missing:
        print(f"needs {', '.join(missing)}: bash deploy/setup.sh --dev installs them", file=sys.stderr)
        return 2
    timing = scenarios.Timing(before=args.before, hold=args.hold, after=args.after, drain=120.0,
                              linger=5.0, rate=args.rate)
    print(machine_info(), flush=True)
    print(f"timing: {timing}", flush=True)
    cluster = ChaosCluster(flags=scenarios.NODE_FLAGS).start()
    reports = []
    try:
        for name in names:
            cpu_before = _cpu(cluster)
            report = scenarios.run(cluster, name, timing)
            cpu_after = _cpu(cluster)
            # processes alive at both ends (a killed one takes its CPU time with it)
            cpu = sum(cpu_after[pid] - cpu_before[pid] for pid in cpu_after.keys() & cpu_before.keys())
            report["cpu_s"] = round(cpu, 1)
            report["cpu_us_per_ack"] = round(cpu / max(1, report["acked"]) * 1e6)
            reports.append(report)
            print(scenarios.format_report(report), flush=True)
            if not report["ok"]:
                print(scenarios.diagnose(cluster, report), flush=True)
            report["restore_s"] = round(cluster.restore(), 1)
            print(f"  cpu {report['cpu_s']} s of dmq, PostgreSQL and ZooKeeper "
                  f"({report['cpu_us_per_ack']} us per acknowledged send); restored in {report['restore_s']} s",
                  flush=True)
    finally:
        cluster.close()
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=2))
    bad = [r["scenario"] for r in reports if not r["ok"]]
    print(f"{len(reports) - len(bad)} scenarios passed, {len(bad)} failed" + (f": {bad}" if bad else ""))
    return 1 if bad else 0


def _cpu(cluster: ChaosCluster) -> dict[int, float]:
    """CPU seconds so far of each dmq node, Patroni member, PostgreSQL (with its
    backends) and ZooKeeper, by pid."""
    pids = [n.proc.pid for n in cluster.nodes if n.proc is not None and n.proc.poll() is None]
    pids += [m.proc.pid for m in cluster.patroni.members if m.proc is not None and m.proc.poll() is None]
    pids += [pid for m in cluster.patroni.members if (pid := m.postmaster_pid())]
    if cluster.zk.proc is not None and cluster.zk.proc.poll() is None:
        pids.append(cluster.zk.proc.pid)
    return {pid: tree_cpu_seconds(pid) for pid in pids}


if __name__ == "__main__":
    sys.exit(main())
