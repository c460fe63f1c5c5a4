"""Readiness checks for deploy/cluster-local.sh: is *this* process serving yet?

A port that answers is not enough: another server may already hold it (a
dmq-server or nsqd from an earlier session on :4151 once made the script report a
node ready that had in fact failed to bind). So a node counts as ready only while
its own process is alive and its ``/info`` names its own node id; ZooKeeper only
while its process is alive and it answers ``ruok``. When a process exits or the
deadline passes, the check prints why and the tail of that process's log, and
exits 1.

    python deploy/cluster_ready.py free PORT...        # before starting: nothing listens
    python deploy/cluster_ready.py node NODE_ID HTTP_PORT PID LOG
    python deploy/cluster_ready.py zookeeper CLIENT_PORT PID LOG

Standard library only: it runs before anything is known to work.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Callable

TIMEOUT = 60.0  # seconds a process may take to serve
LOG_LINES = 30  # lines of its log shown when it does not


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie child counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's: not ours, but alive
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc: kill(0) is all we know
        return True


def ports_in_use(ports: list[int], host: str = "127.0.0.1") -> list[int]:
    """The ports something already accepts connections on (checked before starting, so
    a server left over from another run is named instead of being taken for ours)."""
    busy = []
    for port in ports:
        try:
            with socket.create_connection((host, port), timeout=1):
                busy.append(port)
        except OSError:
            pass
    return busy


def node_answers(http_port: int, node_id: str, host: str = "127.0.0.1") -> str:
    """'' when ``/info`` on the port names ``node_id``, else why not (a short reason)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{http_port}/info", timeout=1) as reply:
            body = json.loads(reply.read())
    except (OSError, ValueError) as exc:
        return f"no /info answer on :{http_port} ({exc})"
    if isinstance(body, dict) and isinstance(body.get("data"), dict):  # nsqd-style envelope
        body = body["data"]
    found = body.get("node_id") if isinstance(body, dict) else None
    if found != node_id:
        return f"another server answers on :{http_port} (node id {found!r}, expected {node_id!r})"
    return ""


def zookeeper_answers(client_port: int, host: str = "127.0.0.1") -> str:
    """'' when ZooKeeper on the port answers ``ruok`` with ``imok``, else why not."""
    try:
        with socket.create_connection((host, client_port), timeout=1) as sock:
            sock.sendall(b"ruok")
            answer = sock.recv(16)
    except OSError as exc:
        return f"no ZooKeeper answer on :{client_port} ({exc})"
    return "" if answer == b"imok" else f"unexpected answer to ruok on :{client_port}: {answer!r}"


def log_tail(path: Path, lines: int = LOG_LINES) -> str:
    try:
        with open(path, errors="replace") as log:
            return "".join(deque(log, maxlen=lines))
    except OSError as exc:
        return f"(cannot read {path}: {exc})\n"


def wait_ready(
    what: str,
    pid: int,
    check: Callable[[], str],
    log: Path,
    *,
    timeout: float = TIMEOUT,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Poll ``check`` while ``pid`` lives; '' once it passes, else the failure report
    (what failed, the last reason, the log's tail)."""
    deadline = clock() + timeout
    reason = "not checked yet"
    while True:
        if not alive(pid):
            return f"{what}: process {pid} exited; last lines of {log}:\n{log_tail(log)}"
        reason = check()
        if not reason:
            return ""
        if clock() >= deadline:
            return f"{what}: not ready after {timeout:.0f} s: {reason}; last lines of {log}:\n{log_tail(log)}"
        sleep(0.2)


def main(argv: list[str]) -> int:
    usage = (
        "usage: cluster_ready.py free PORT...\n"
        "       cluster_ready.py node NODE_ID HTTP_PORT PID LOG\n"
        "       cluster_ready.py zookeeper CLIENT_PORT PID LOG"
    )
    if len(argv) >= 2 and argv[0] == "free":
        busy = ports_in_use([int(p) for p in argv[1:]])
        if busy:
            print(
                "deploy/cluster-local.sh: already in use (another server, or a cluster left running?): "
                + ", ".join(f"127.0.0.1:{port}" for port in busy)
                + "; stop it, or choose other ports with ZK_PORT=... BASE_PORT=...",
                file=sys.stderr,
            )
            return 1
        return 0
    if len(argv) == 5 and argv[0] == "node":
        node_id, port, pid, log = argv[1], int(argv[2]), int(argv[3]), Path(argv[4])
        failure = wait_ready(node_id, pid, lambda: node_answers(port, node_id), log)
    elif len(argv) == 4 and argv[0] == "zookeeper":
        port, pid, log = int(argv[1]), int(argv[2]), Path(argv[3])
        failure = wait_ready(f"ZooKeeper on :{port}", pid, lambda: zookeeper_answers(port), log)
    else:
        print(usage, file=sys.stderr)
        return 2
    if failure:
        print(f"deploy/cluster-local.sh: {failure}", file=sys.stderr, end="" if failure.endswith("\n") else "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
