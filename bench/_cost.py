"""Run a cost bench's ``child`` in a fresh interpreter on a chosen source tree, and count
its instructions: the machinery ``channel_cost.py`` and ``message_cost.py`` share.

Time on a shared 2-core virtual machine drifts by a third from minute to minute, which
hides a change of a few per cent. Valgrind's cachegrind (Debian's ``valgrind``) counts the
instructions the interpreter runs instead; two runs of different length are subtracted,
so that start-up and imports cancel out. Repeated counts of one tree agree within 1 %
(0.8 % at most in session 18's runs), whatever else the machine does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_child(module: str, tree: str, messages: int, valgrind: str | None = None) -> dict | int:
    """``module.child(messages)`` with ``tree`` first on the path: its JSON result, or
    under ``valgrind`` the instructions the whole run took."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, str(HERE)]), PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-c", f"import {module}, json; print(json.dumps({module}.child({messages})))"]
    if valgrind:
        command = [valgrind, "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null", *command]
    done = subprocess.run(command, env=env, cwd="/", capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{tree}: the measurement failed:\n{done.stderr[-3000:]}")
    if valgrind:
        for line in done.stderr.splitlines():
            if "I   refs:" in line or "I refs:" in line:
                return int(line.split(":")[1].replace(",", ""))
        raise RuntimeError(f"no instruction count in valgrind's output:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def connect(factory, magic: bytes, port: int):
    """A connection of ``factory`` (a ``PortFactory``) from a client at ``port`` on a
    string transport, past its protocol's magic: (protocol, transport)."""
    from twisted.internet.address import IPv4Address
    from twisted.internet.testing import StringTransport

    protocol = factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", port))
    transport = StringTransport()
    protocol.makeConnection(transport)
    protocol.dataReceived(magic)
    return protocol, transport


def instructions_per_unit(module: str, tree: str, small: int, large: int, units_per_message: int = 1) -> float:
    """Instructions per unit of work between a run of ``small`` and one of ``large``
    messages (each message ``units_per_message`` units: copies, for the channel)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        sys.exit("--instructions needs valgrind (apt-get install valgrind, or bash deploy/setup.sh --bench)")
    extra = run_child(module, tree, large, valgrind) - run_child(module, tree, small, valgrind)  # type: ignore[operator]
    return extra / ((large - small) * units_per_message)


def main(module: str, doc: str, unit: str, halves: tuple[str, ...], small: int, step: int,
         units_per_message: int = 1) -> None:
    """The command line both benches share: CPU time of each half in alternated rounds,
    or (``--instructions``) instructions per ``unit`` between a run of ``small`` messages
    and one longer by ``--messages`` (at most 4000, rounded down to ``step``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", help="a source tree to measure (repeat to compare; default: this one)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=40_000, help="messages per run")
    parser.add_argument("--instructions", action="store_true", help="count instructions with valgrind instead")
    args = parser.parse_args()
    trees = [str(Path(t).resolve()) for t in (args.tree or [HERE.parent])]
    if args.instructions:
        large = small + max(step, min(args.messages, 4000) // step * step)
        for tree in trees:
            count = instructions_per_unit(module, tree, small, large, units_per_message)
            print(f"{tree}: {count:,.0f} instructions per {unit}")
        return
    results: dict[str, list[dict]] = {t: [] for t in trees}
    for _ in range(args.rounds):
        for tree in trees:  # alternated, so that a slower minute falls on every tree alike
            results[tree].append(run_child(module, tree, args.messages))  # type: ignore[arg-type]
    for tree, runs in results.items():
        for half in halves:
            values = [r[half] for r in runs]
            print(f"{tree}: {half.removesuffix('_ns')} CPU per {unit.split()[0]}: min {min(values):,.0f} ns, "
                  f"median {statistics.median(values):,.0f} ns  ({' '.join(f'{v:,.0f}' for v in values)})")
